"""VLLMGenerator: the Generator protocol over a vLLM server (docs/generation.md).

Sampling goes through the server's token-in/token-out route (``/inference/v1/generate``): one
HTTP request per sample, all sent at once so the server batches them, each with its own seed,
so a sample's tokens depend on its seed alone, as with the transformers backend. The server
returns the logprob of every sampled token under the distribution it sampled from (it runs with
``logprobs_mode=processed_logprobs``), and the spans of output tokens each weight version
produced, from which every response token gets the version that sampled it.

Weights go through vLLM's weight-transfer API: pause (requests in flight are kept), start /
update / finish with the new ``weight_version``, prefix-cache reset (cached blocks hold keys and
values of the old weights; running requests are recomputed under the new ones, their sampled
tokens and logprobs kept), resume. The server then reports the version, which is checked. The
update either names a safetensors file the state dict was written to (in /dev/shm when there is
one), or, for a collective transfer, describes the flat buffers this process then broadcasts to
the server's worker over a process group of the two (``runtime/broadcast.py``: gloo or NCCL).

A server asyncrl started and that died is restarted and re-synced (from the last weights file,
or this process's copy of the last broadcast) before the next call, up to ``max_restarts``
times; the failed call itself raises, and the rollout loop retries it.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import urllib.parse
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor
from transformers import PreTrainedModel

from asyncrl.config import RunConfig
from asyncrl.generation.base import SampleRequest, SamplingParams, check_vocabulary
from asyncrl.generation.vllm_env import checked_python
from asyncrl.generation.vllm_process import ServerError, VLLMServer, http_json
from asyncrl.runtime.broadcast import BroadcastMember, Rendezvous
from asyncrl.types import Rollout

SHM = Path("/dev/shm")
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)  # what vLLM's CPU attention implements


def build_vllm_generator(config: RunConfig, model: PreTrainedModel, stop_token_ids: Sequence[int]) -> VLLMGenerator:
    """A generator on ``vllm.url``, or on a server started from ``model``'s weights.

    The model is saved (float32) to a temporary directory the server loads at start; the server's
    log goes to ``<run dir>/vllm/``. A server that does not start (an incompatible environment) is
    a ValueError naming ``vllm.python`` and the log's last line.
    """
    cfg = config.vllm
    collective = collective_backend(cfg.weight_transfer, config.trainer.device)
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    vocab_size = model.get_input_embeddings().num_embeddings
    options = dict(request_timeout_s=cfg.request_timeout_s, max_restarts=cfg.max_restarts, collective=collective)
    if cfg.url is not None:
        return VLLMGenerator(
            shapes=shapes, stop_token_ids=stop_token_ids, vocab_size=vocab_size, url=cfg.url, **options
        )
    gpu = torch.cuda.is_available()
    head_size = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    if not gpu and head_size not in CPU_HEAD_SIZES:
        raise ValueError(
            f"model.num_heads: head size {head_size} (hidden_size / num_heads) is not one vLLM's CPU attention "
            f"supports {list(CPU_HEAD_SIZES)}; change model.hidden_size or model.num_heads"
        )
    python = checked_python(cfg.python, "gpu" if gpu else "cpu")
    model_dir = Path(tempfile.mkdtemp(prefix="asyncrl-vllm-model-"))
    model.to(torch.float32).save_pretrained(model_dir)
    run_dir = Path(config.logging.output_dir) if config.logging.output_dir else model_dir
    weights_path = new_weights_path()
    server = VLLMServer(
        python=python,
        model_dir=model_dir,
        log_path=run_dir / "vllm" / f"server-{os.getpid()}-{uuid.uuid4().hex[:6]}.log",
        max_model_len=model.config.max_position_embeddings,
        kv_cache_mib=cfg.kv_cache_mib,
        startup_timeout_s=cfg.startup_timeout_s,
        extra_args=cfg.extra_args,
        weight_transfer="file" if collective is None else "collective",
        remove_on_exit=(model_dir, weights_path),
        cpu=not gpu,
    )
    try:
        generator = VLLMGenerator(
            shapes=shapes,
            stop_token_ids=stop_token_ids,
            vocab_size=vocab_size,
            server=server,
            weights_path=weights_path,
            **options,
        )
    except ServerError as err:
        shutil.rmtree(model_dir, ignore_errors=True)
        raise ValueError(f"vllm.python: {python} could not serve the model: {err}") from None
    generator.model_dir = model_dir
    return generator


def collective_backend(weight_transfer: str, trainer_device: str) -> str | None:
    """The group backend of a collective transfer (NCCL where this process sees a GPU, else gloo),
    or None for a file; ``auto`` is collective from a CUDA trainer only: gloo is no faster than a
    file in /dev/shm."""
    gpu = torch.cuda.is_available()
    if weight_transfer == "file" or (weight_transfer == "auto" and not (gpu and trainer_device != "cpu")):
        return None
    return "nccl" if gpu else "gloo"


class VLLMGenerator:
    """Drives one server: ``server`` (started here) or the one at ``url`` (someone else's).

    ``collective``: the group backend ("gloo", "nccl") of a collective weight transfer, whose
    server runs the asyncrl_collective engine; None: weights go through a file.
    A response ends with one of ``stop_token_ids`` (kept, finish reason "stop") or at
    ``max_new_tokens`` ("length"); with no stop ids, only at ``max_new_tokens``.
    """

    def __init__(
        self,
        *,
        shapes: Mapping[str, tuple[int, ...]],
        stop_token_ids: Sequence[int],
        vocab_size: int,
        server: VLLMServer | None = None,
        url: str | None = None,
        request_timeout_s: float = 600.0,
        max_restarts: int = 3,
        max_concurrency: int = 256,
        weights_path: Path | None = None,
        collective: str | None = None,
    ) -> None:
        if (server is None) == (url is None):
            raise ValueError("VLLMGenerator: give exactly one of server (to start) and url (to use)")
        self.shapes = {name: tuple(shape) for name, shape in shapes.items()}
        self.stop_token_ids = list(stop_token_ids)
        self.vocab_size = vocab_size
        self.server = server
        self.url = url.rstrip("/") if url is not None else None
        self.timeout = request_timeout_s
        self.max_restarts = max_restarts
        self.restarts = 0
        self.version = 0
        self.model_dir: Path | None = None  # the server's initial checkpoint, removed by close()
        self.weights_path = weights_path or new_weights_path()
        self.collective = collective
        self.member: BroadcastMember | None = None  # this process's end of the group with the server
        self.joined = False  # whether the server's worker is in ``member``'s group
        self.sent_version: int | None = None  # of the weights last sent: what a restarted server gets
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="vllm-request")
        self._lock = threading.Lock()  # one weight update at a time; a restart waits for it
        if server is not None:
            server.start()
            self.url = server.url
        self._connect()

    def generate(self, requests: Sequence[SampleRequest], params: SamplingParams) -> list[Rollout]:
        """One Rollout per request, in request order; every response token carries its version."""
        check_vocabulary(requests, self.vocab_size)
        self._revive()
        version = self.version
        futures = [self._pool.submit(self._sample, request, params, version) for request in requests]
        return [future.result() for future in futures]

    def load_weights(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        """Strict names and shapes (checked before anything is sent), then one update on the server."""
        missing = sorted(self.shapes.keys() - state_dict.keys())
        unexpected = sorted(state_dict.keys() - self.shapes.keys())
        if missing or unexpected:
            raise ValueError(
                f"VLLMGenerator.load_weights: version {version} does not match the model: "
                f"missing tensors {missing}, unexpected tensors {unexpected}"
            )
        for name, tensor in state_dict.items():
            if tuple(tensor.shape) != self.shapes[name]:
                raise ValueError(
                    f"VLLMGenerator.load_weights: tensor {name} of version {version} has shape "
                    f"{tuple(tensor.shape)}, the model's has {self.shapes[name]}"
                )
        with self._lock:
            self._revive_locked()
            if self.collective is None:
                _write_weights(state_dict, self.weights_path)
            elif not self.joined:
                self._connect()
            self.sent_version = version
            try:
                self._update(version, state_dict)
            except ServerError:
                if self.server is None or self.server.alive():
                    raise  # the server refused the update; it did not die
                self._restart_locked()  # it died during the update: a new one gets this version
                self._update(version, None if self.collective is None else state_dict)

    def close(self) -> None:
        """Stop the server this generator started and remove its weights file; safe to call twice."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.member is not None:
            self.member.group.abort()
        if self.server is not None:
            self.server.stop()
        self.weights_path.unlink(missing_ok=True)
        if self.model_dir is not None:
            shutil.rmtree(self.model_dir, ignore_errors=True)

    def _sample(self, request: SampleRequest, params: SamplingParams, version: int) -> Rollout:
        sampling = {
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,
            "seed": request.seed,
            "logprobs": 0,
            "stop_token_ids": self.stop_token_ids,
            "detokenize": False,
        }
        body = {"token_ids": list(request.prompt_ids), "sampling_params": sampling, "model": None}
        choice = self._call("/inference/v1/generate", body)["choices"][0]
        tokens = choice["token_ids"]
        logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
        return Rollout(
            prompt_ids=list(request.prompt_ids),
            response_ids=tokens,
            logprobs=logprobs,
            finish_reason="stop" if tokens and tokens[-1] in self.stop_token_ids else "length",
            versions=_token_versions(choice.get("weight_versions"), len(tokens), version),
        )

    def _connect(self) -> None:
        """Initialize the server's weight-transfer engine; for a collective transfer, in a new group
        with this process as rank 0 (it hosts the store; the server's call returns once its worker
        joined)."""
        if self.collective is None:
            self._call("/init_weight_transfer_engine", {"init_info": {}})
            return
        if self.member is not None:
            self.member.group.abort()
        host = _local_address(self.url)
        with socket.socket() as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
        member = self._pool.submit(BroadcastMember, Rendezvous(host, port, 2, self.collective, self.timeout), 0)
        init_info = {"host": host, "port": port, "backend": self.collective, "timeout_s": self.timeout}
        self._call("/init_weight_transfer_engine", {"init_info": init_info})
        self.member, self.joined = member.result(), True

    def _update(self, version: int, weights: Mapping[str, Tensor] | None) -> None:
        """Load ``version`` into the server: ``weights`` through the group, or the weights file."""
        self._call("/pause?mode=keep", {})
        try:
            self._call("/start_weight_update", {})
            self._transfer(version, weights)
            self._call("/finish_weight_update", {"weight_version": str(version)})
            if not self._call("/reset_prefix_cache?reset_running_requests=true", {}).get("success"):
                raise ServerError(f"{self.url}: the prefix cache could not be reset after loading version {version}")
        finally:
            self._call("/resume", {})
        reported = self._call("/weight_info")["weight_version"]
        if reported != str(version):
            raise ServerError(f"{self.url}: reports weight version {reported!r} after loading version {version}")
        self.version = version

    def _transfer(self, version: int, weights: Mapping[str, Tensor] | None) -> None:
        if self.collective is None:
            self._call("/update_weights", {"update_info": {"path": str(self.weights_path)}})
            return
        layout = self.member.send(_distinct(weights), version)
        try:
            self._call("/update_weights", {"update_info": layout.meta()})
        except ServerError:
            self.member.group.abort()  # the broadcast would wait for the worker until the timeout
            self.joined = False
            raise
        self.member.drain()

    def _revive(self) -> None:
        with self._lock:
            self._revive_locked()

    def _revive_locked(self) -> None:
        """Restart a started server that died and load the last weights sent into it (counted)."""
        if self.server is None or self.server.alive():
            return
        held = None if self.collective is None or self.sent_version is None else self.member.held(self.sent_version)
        self._restart_locked()
        if self.sent_version is not None:
            self._update(self.sent_version, held)

    def _restart_locked(self) -> None:
        """A new server process in place of the dead one, with its weight-transfer engine (counted)."""
        if self.restarts >= self.max_restarts:
            raise ServerError(
                f"the vLLM server died and vllm.max_restarts={self.max_restarts} restarts are used up; "
                f"see {self.server.log_path}"
            )
        self.restarts += 1
        self.server.stop()
        self.server.start()
        self.url = self.server.url
        self._connect()

    def _call(self, route: str, body: dict | None = None) -> dict:
        try:
            return http_json(f"{self.url}{route}", body, timeout=self.timeout)
        except OSError as err:
            raise ServerError(f"{self.url}{route}: {err}") from None


def new_weights_path() -> Path:
    """Where a generator writes the weights it sends: /dev/shm (memory) when there is one."""
    return (SHM if SHM.is_dir() else Path(tempfile.gettempdir())) / f"asyncrl-{uuid.uuid4().hex}.safetensors"


def _local_address(url: str) -> str:
    """This host's address on the route to the server at ``url``: where its worker finds the group's store."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((urllib.parse.urlsplit(url).hostname, 80))
        return probe.getsockname()[0]


def _distinct(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The state dict without tensors tied to an earlier one (a tied head): the server loads each once."""
    tensors, seen = {}, set()
    for name, tensor in state_dict.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            tensors[name] = tensor.detach()
    return tensors


def _write_weights(state_dict: Mapping[str, Tensor], path: Path) -> None:
    """float32 safetensors of the distinct tensors, written aside and renamed."""
    tensors = {
        name: tensor.to(device="cpu", dtype=torch.float32).contiguous()
        for name, tensor in _distinct(state_dict).items()
    }
    partial = path.with_suffix(".partial")
    save_file(tensors, str(partial))
    partial.replace(path)


def _token_versions(spans: list[dict] | None, length: int, fallback: int) -> list[int]:
    """The version of each response token from the server's ``[start, end)`` spans."""
    if not spans:
        return [fallback] * length
    versions = [fallback] * length
    for span in spans:
        label = span["version"]
        value = int(label) if label.isdigit() else fallback
        for position in range(span["start"], min(span["end"], length)):
            versions[position] = value
    return versions
