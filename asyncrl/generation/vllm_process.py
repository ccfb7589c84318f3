"""VLLMServer: one vLLM server process that asyncrl starts, health-checks, restarts and stops.

The server runs ``vllm_server.py`` (this directory) with the vLLM environment's interpreter, so
vLLM's own torch and transformers never enter this process. It gets its own process group, so
stopping it ends its engine and worker processes too, and it kills that group itself once the
process that started it is gone: a crashed or killed run leaves no server behind. A normal exit
stops it through ``atexit``. Its output goes to ``log_path``. It serves the model under a name
of its own, by which the start tells it from another run's server on the same port.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

SERVER_SCRIPT = Path(__file__).with_name("vllm_server.py")
WEIGHT_ENGINES = {"file": "asyncrl_file", "collective": "asyncrl_collective"}  # registered by vllm_server.py
PORT_ATTEMPTS = 5  # fresh ports tried when another process takes the one picked
ERROR_LINE = re.compile(r"(\(.+?\) ERROR .+?\] )?\w*(Error|Exception): ")  # an exception's message, logged or raw
ADDRESS_IN_USE = b"Address already in use"  # in the log of a server whose port was taken
STOP_TIMEOUT_S = 15  # how long a stop waits for the server to exit after SIGTERM, then after SIGKILL
WHOLE_PREFILL_MIN_BATCHED_TOKENS = 8192  # tokens per scheduler step on CPU, at least max_model_len


class ServerError(RuntimeError):
    """The vLLM server could not be started or stopped answering."""


def http_json(url: str, body: dict | None = None, *, timeout: float, method: str | None = None) -> dict:
    """One JSON call; an HTTP error status raises ServerError with the server's message. A plain-text
    answer (the adapter routes give one) comes back as ``{"message": text}``."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method or ("GET" if body is None else "POST"))
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw, content_type = response.read(), response.headers.get_content_type()
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")[:500]
        raise ServerError(f"{url}: HTTP {err.code}: {detail}") from None
    if content_type != "application/json":
        return {"message": raw.decode(errors="replace")}
    return json.loads(raw) if raw else {}


class VLLMServer:
    def __init__(
        self,
        *,
        python: Path,
        model_dir: Path,
        log_path: Path,
        max_model_len: int,
        startup_timeout_s: float,
        extra_args: list[str],
        dtype: str = "float32",
        kv_cache_bytes: int | None = None,
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = False,
        weight_transfer: str = "file",
        remove_on_exit: tuple[Path, ...] = (),
        cpu: bool = False,
        lora_rank: int = 0,
        lora_slots: int = 0,
    ) -> None:
        """``kv_cache_bytes``: the KV cache's size; None: what ``gpu_memory_utilization`` of the
        GPU leaves after weights and activations. ``weight_transfer``: file or collective
        (``WEIGHT_ENGINES``); ``remove_on_exit``: files the server removes if the process that
        started it dies first; ``cpu``: the server runs on vLLM's CPU build (always eager), where
        a seeded request whose prompt is split across scheduler steps kills the engine (a CPU
        ``torch.Generator`` cannot be rewound), so every prompt is prefilled in one step.
        ``lora_rank`` > 0: LoRA adapters of up to that rank (one vLLM accepts) are loaded and
        unloaded at run time by name, ``lora_slots`` of them held at once."""
        self.python = Path(python)
        self.weight_engine = WEIGHT_ENGINES[weight_transfer]
        self.remove_on_exit = remove_on_exit
        self.model_dir = Path(model_dir)
        self.log_path = Path(log_path)
        self.max_model_len = max_model_len
        self.dtype = dtype
        self.kv_cache_bytes = kv_cache_bytes
        self.gpu_memory_utilization = gpu_memory_utilization
        self.enforce_eager = enforce_eager or cpu
        self.startup_timeout_s = startup_timeout_s
        self.extra_args = list(extra_args)
        self.cpu = cpu
        self.lora_rank = lora_rank
        self.lora_slots = lora_slots
        self.served_name = f"policy-{uuid.uuid4().hex}"  # which server answers on our port: ours
        self.process: subprocess.Popen | None = None
        self.port: int | None = None
        atexit.register(self.stop)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            str(self.python), "-I", str(SERVER_SCRIPT),  # isolated: neither our sys.path nor PYTHON* variables
            "--model", str(self.model_dir), "--served-model-name", self.served_name,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", self.dtype, *(["--enforce-eager"] if self.enforce_eager else []),
            "--skip-tokenizer-init", "--enable-scale-out",
            "--max-model-len", str(self.max_model_len),
            *(["--kv-cache-memory-bytes", str(self.kv_cache_bytes)] if self.kv_cache_bytes is not None
              else ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]),
            "--logprobs-mode", "processed_logprobs",
            "--weight-transfer-config", json.dumps({"backend": self.weight_engine}),
            *(self.whole_prefill_args() if self.cpu else []),
            *(self.lora_args() if self.lora_rank else []),
            *self.extra_args,
        ]  # fmt: skip

    def lora_args(self) -> list[str]:
        """Adapters in every batch slot and in the engine's cache alike: a request never waits for
        one to be read back from disk."""
        slots = str(self.lora_slots)
        return ["--enable-lora", "--max-lora-rank", str(self.lora_rank), "--max-loras", slots, "--max-cpu-loras", slots]

    def whole_prefill_args(self) -> list[str]:
        """No chunked prefill, and a step budget that holds the longest sequence (vLLM requires it)."""
        budget = max(self.max_model_len, WHOLE_PREFILL_MIN_BATCHED_TOKENS)
        return ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(budget)]

    def start(self) -> None:
        """Start the process and return once it answers as this server; raises with the log's last line.

        The port is picked free, but another run may take it before the server binds it: then the
        server exits (address in use) or another server answers there (not with this server's
        ``served_name``), and the start is retried on a fresh port."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.startup_timeout_s
        for _ in range(PORT_ATTEMPTS):
            if self._launch(deadline):
                return
        raise ServerError(f"{PORT_ATTEMPTS} ports in a row were taken by other processes; see {self.log_path}")

    def _launch(self, deadline: float) -> bool:
        """One start on a fresh port: True once the server answers there, False if the port was taken."""
        self.port = _free_port()
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CONFIGURE_LOGGING="1")
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override the KV cache size set here
        if self.lora_rank:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # the /v1/load_lora_adapter and unload routes
        env["ASYNCRL_VLLM_REMOVE_ON_EXIT"] = os.pathsep.join(map(str, self.remove_on_exit))  # vllm_server.py
        with open(self.log_path, "ab") as log:
            log_start = log.tell()
            self.process = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        while (served := self.served_model()) != self.served_name:
            if served is not None:  # another server holds the port; ours cannot bind it
                self.stop()
                return False
            if self.process.poll() is not None:
                if ADDRESS_IN_USE in self.log_path.read_bytes()[log_start:]:
                    return False
                raise ServerError(
                    f"the vLLM server exited with code {self.process.returncode}: {self._failure(log_start)}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise ServerError(
                    f"the vLLM server did not start within {self.startup_timeout_s:g}s; see {self.log_path}"
                )
            time.sleep(0.5)
        return True

    def served_model(self) -> str | None:
        """The model name the server on our port serves (None: nothing answers there yet)."""
        try:
            return http_json(f"{self.url}/v1/models", timeout=5)["data"][0]["id"]
        except (OSError, ServerError, ValueError, KeyError, IndexError):
            return None

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
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _signal_group(process.pid, signal.SIGKILL)
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise ServerError(f"the vLLM server (pid {process.pid}) did not exit after SIGKILL") from None
        _signal_group(process.pid, signal.SIGKILL)  # an engine-core child that outlived its parent

    def _failure(self, log_start: int) -> str:
        """The first exception message the launch logged from ``log_start`` on (the root cause;
        the engine's own failure and shutdown noise follow it), else its last line."""
        output = self.log_path.read_bytes()[log_start:].decode(errors="replace")
        lines = [line.strip() for line in output.splitlines() if line.strip()]
        causes = [line[len(match.group(1) or "") :] for line in lines if (match := ERROR_LINE.match(line))]
        cause = (causes or lines[-1:] or ["no output"])[0]
        return f"{cause[:300]} (log: {self.log_path})"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
