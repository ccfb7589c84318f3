"""VLLMServer: one vLLM server process that asyncrl starts, health-checks, restarts and stops.

The server runs ``vllm_server.py`` (this directory) with the vLLM environment's interpreter, so
vLLM's own torch and transformers never enter this process. It gets its own process group, so
stopping it ends its engine and worker processes too, and it kills that group itself once the
process that started it is gone: a crashed or killed run leaves no server behind. A normal exit
stops it through ``atexit``. Its output goes to ``log_path``.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

SERVER_SCRIPT = Path(__file__).with_name("vllm_server.py")
WEIGHT_ENGINES = {"file": "asyncrl_file", "collective": "asyncrl_collective"}  # registered by vllm_server.py
SERVED_NAME = "policy"
WHOLE_PREFILL_MIN_BATCHED_TOKENS = 8192  # tokens per scheduler step on CPU, at least max_model_len


class ServerError(RuntimeError):
    """The vLLM server could not be started or stopped answering."""


def http_json(url: str, body: dict | None = None, *, timeout: float, method: str | None = None) -> dict:
    """One JSON call; an HTTP error status raises ServerError with the server's message."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method or ("GET" if body is None else "POST"))
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")[:500]
        raise ServerError(f"{url}: HTTP {err.code}: {detail}") from None
    return json.loads(raw) if raw else {}


class VLLMServer:
    def __init__(
        self,
        *,
        python: Path,
        model_dir: Path,
        log_path: Path,
        max_model_len: int,
        kv_cache_mib: int,
        startup_timeout_s: float,
        extra_args: list[str],
        weight_transfer: str = "file",
        remove_on_exit: tuple[Path, ...] = (),
        cpu: bool = False,
    ) -> None:
        """``weight_transfer``: file or collective (``WEIGHT_ENGINES``); ``remove_on_exit``: files
        the server removes if the process that started it dies first; ``cpu``: the server runs on
        vLLM's CPU build, where a seeded request whose prompt is split across scheduler steps
        kills the engine (a CPU ``torch.Generator`` cannot be rewound), so every prompt is
        prefilled in one step."""
        self.python = Path(python)
        self.weight_engine = WEIGHT_ENGINES[weight_transfer]
        self.remove_on_exit = remove_on_exit
        self.model_dir = Path(model_dir)
        self.log_path = Path(log_path)
        self.max_model_len = max_model_len
        self.kv_cache_mib = kv_cache_mib
        self.startup_timeout_s = startup_timeout_s
        self.extra_args = list(extra_args)
        self.cpu = cpu
        self.process: subprocess.Popen | None = None
        self.port: int | None = None
        atexit.register(self.stop)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            str(self.python), "-I", str(SERVER_SCRIPT),  # isolated: neither our sys.path nor PYTHON* variables
            "--model", str(self.model_dir), "--served-model-name", SERVED_NAME,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--enforce-eager", "--skip-tokenizer-init", "--enable-scale-out",
            "--max-model-len", str(self.max_model_len),
            "--kv-cache-memory-bytes", str(self.kv_cache_mib * 2**20),
            "--logprobs-mode", "processed_logprobs",
            "--weight-transfer-config", json.dumps({"backend": self.weight_engine}),
            *(self.whole_prefill_args() if self.cpu else []),
            *self.extra_args,
        ]  # fmt: skip

    def whole_prefill_args(self) -> list[str]:
        """No chunked prefill, and a step budget that holds the longest sequence (vLLM requires it)."""
        budget = max(self.max_model_len, WHOLE_PREFILL_MIN_BATCHED_TOKENS)
        return ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(budget)]

    def start(self) -> None:
        """Start the process and return once it answers /health; raises with the log's last line."""
        self.port = _free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CONFIGURE_LOGGING="1")
        env["ASYNCRL_VLLM_REMOVE_ON_EXIT"] = os.pathsep.join(map(str, self.remove_on_exit))  # vllm_server.py
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        deadline = time.monotonic() + self.startup_timeout_s
        while not self.healthy():
            if self.process.poll() is not None:
                raise ServerError(
                    f"the vLLM server exited with code {self.process.returncode}: {self._last_log_line()}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise ServerError(
                    f"the vLLM server did not answer /health within {self.startup_timeout_s:g}s; see {self.log_path}"
                )
            time.sleep(0.5)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                return response.status == 200
        except OSError:
            return False

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None and self.healthy()

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after 15 s; safe to call twice."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        _signal_group(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            _signal_group(process.pid, signal.SIGKILL)
            process.wait()
        _signal_group(process.pid, signal.SIGKILL)  # an engine-core child that outlived its parent

    def _last_log_line(self) -> str:
        lines = [line for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        return f"{lines[-1].strip()[-300:] if lines else 'no output'} (log: {self.log_path})"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
