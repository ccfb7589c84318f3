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
the server's worker over a process group of the two (``weights/broadcast.py``: gloo or NCCL).

A LoRA run (``lora.rank`` > 0) sends the base once, at the server's start, and each sync loads
the adapter alone as a new named adapter (``ServedAdapters``); every request names the adapter of
the version it is sampled with, so its tokens all carry that version.

A server asyncrl started and that died is restarted and re-synced (from the last weights file,
or this process's copy of the last broadcast) before the next call, up to ``max_restarts``
times; the failed call itself raises, and the rollout loop retries it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import tempfile
import threading
import time
import urllib.parse
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from peft import LoraConfig
from safetensors.torch import load_file, save_file
from torch import Tensor
from transformers import PreTrainedModel

from asyncrl.checkpoint import ADAPTER_WEIGHTS_FILE
from asyncrl.config import RunConfig
from asyncrl.generation.base import GeneratorBase, SampleRequest, SamplingParams, check_vocabulary
from asyncrl.generation.vllm_env import checked_python
from asyncrl.generation.vllm_options import VLLMOptions
from asyncrl.generation.vllm_process import ServerError, VLLMServer, http_json
from asyncrl.models.lora import adapter_tensors, apply_lora, peft_config
from asyncrl.types import Rollout
from asyncrl.weights.broadcast import BroadcastMember, Rendezvous
from asyncrl.weights.fingerprint import Sample, fingerprint

if TYPE_CHECKING:
    from asyncrl.data.files import Budget

SHM = Path("/dev/shm")
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)  # what vLLM's CPU attention implements
KV_BLOCK_TOKENS = 256  # vLLM allocates a sequence's cache in blocks (16 to 256 tokens): sized in the largest
CPU_KV_CACHE_CAP = 4 * 2**30  # an auto-sized CPU cache holds a step's sequences up to this, one at least
SERVER_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SERVED_REQUEST_PREFIX = "generate-tokens-"  # vLLM's id of a generate request is this + its request_id
TEMP_PREFIX = "asyncrl-vllm-"  # what a generator leaves for its server is named asyncrl-vllm-<pid>-...
NO_ADAPTER = "float32:none, the base alone"  # the fingerprint of a LoRA server that lists no adapter


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the --max-lora-rank values vLLM 0.32 accepts


def max_lora_rank(rank: int) -> int:
    """The smallest maximum rank a vLLM server accepts that holds adapters of ``rank``."""
    if rank > LORA_RANKS[-1]:
        raise ValueError(f"lora.rank: {rank} is above {LORA_RANKS[-1]}, the largest adapter rank vLLM serves")
    return next(allowed for allowed in LORA_RANKS if allowed >= rank)


def build_vllm_generator(
    config: RunConfig,
    model: PreTrainedModel,
    tokenizer,
    stop_token_ids: Sequence[int],
    cfg: VLLMOptions,
    *,
    run_dir: Path | None = None,
    request_bound: tuple[int, Budget],
) -> VLLMGenerator:
    """A generator on the options' ``url``, or on a server started from ``model``'s weights;
    ``cfg`` is ``generation.backend.options`` as ``VLLMOptions`` checked it.

    The model is saved (in the server's dtype) to a temporary directory the server loads at
    start; the server's log goes to ``<run_dir>/vllm/`` (beside the saved model outside a run).
    Its context holds the run's longest request, ``request_bound`` (the longest first request and
    what a request may add to it, as ``asyncrl.rollout.context.request_bound`` gives them; the
    composition root computes it and ``build_generator`` hands it over: ``served_context``), and
    its KV cache at least one such sequence (``server_kv_cache``). A server that does not start (an incompatible
    environment) is a ValueError naming the ``python`` option and the log's last line.
    """
    lora = config.lora.rank > 0
    if lora:
        max_lora_rank(config.lora.rank)  # before a server starts
    options = dict(
        shapes={name: tuple(tensor.shape) for name, tensor in model.state_dict().items()},
        stop_token_ids=stop_token_ids,
        vocab_size=model.get_input_embeddings().num_embeddings,
        request_timeout_s=cfg.request_timeout_s,
        max_restarts=cfg.max_restarts,
        collective=None if lora else collective_backend(cfg.weight_transfer, config.trainer.device),
    )
    if cfg.url is not None:
        return VLLMGenerator(url=cfg.url, adapters=_adapters(config, model, run_dir), **options)
    server, weights_path, python = _started_server(config, cfg, model, request_bound, run_dir, options["collective"])
    adapters = _adapters(config, model, run_dir)
    try:
        generator = VLLMGenerator(server=server, weights_path=weights_path, adapters=adapters, **options)
    except ServerError as err:
        shutil.rmtree(server.model_dir, ignore_errors=True)
        if adapters is not None:
            shutil.rmtree(adapters.directory, ignore_errors=True)
        raise ValueError(f"generation.backend.options.python: {python} could not serve the model: {err}") from None
    generator.model_dir = server.model_dir
    return generator


build_vllm_generator.Options = VLLMOptions  # generation.backend.options
build_vllm_generator.writes_to_run_dir = True  # the server's log, and the adapters it loads
build_vllm_generator.takes_lora_adapters = True
build_vllm_generator.takes_request_bound = True  # the run's longest request sizes a started server's context


def _adapters(config: RunConfig, model: PreTrainedModel, run_dir: Path | None) -> ServedAdapters | None:
    """With ``lora.rank`` > 0, the adapters' names and shapes (``model`` is wrapped in place: its
    base is saved for the server first) and where their versions are written: ``<run_dir>/vllm/``,
    else a temporary directory."""
    if config.lora.rank == 0:
        return None
    settings = peft_config(config.lora)
    shapes = {name: tuple(t.shape) for name, t in adapter_tensors(apply_lora(model, config.lora, model.dtype)).items()}
    parent = run_dir / "vllm" if run_dir is not None else None
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-adapters-", dir=parent))
    return ServedAdapters(shapes, settings, directory, slots=config.sampler.max_lag + 2)


def _started_server(
    config: RunConfig,
    cfg: VLLMOptions,
    model: PreTrainedModel,
    request_bound: tuple[int, Budget],
    run_dir: Path | None,
    collective: str | None,
) -> tuple[VLLMServer, Path, str]:
    """The server for ``model``, the file its weight updates are written to, and the interpreter
    it runs in: dtype, context and KV cache chosen for this machine, the model saved where the
    server loads it from."""
    gpu = torch.cuda.is_available()
    head_size = _head_size(model.config)
    if not gpu and head_size not in CPU_HEAD_SIZES:
        raise ValueError(
            f"model.num_heads: head size {head_size} (hidden_size / num_heads) is not one vLLM's CPU attention "
            f"supports {list(CPU_HEAD_SIZES)}; change model.hidden_size or model.num_heads"
        )
    dtype = server_dtype(cfg.dtype, config.trainer.dtype, gpu)
    max_model_len = served_context(request_bound, cfg, model.config.max_position_embeddings)
    kv_cache_bytes = server_kv_cache(config, cfg, model.config, dtype, max_model_len, gpu)
    python = checked_python(cfg.python, "gpu" if gpu else "cpu")
    remove_dead_runs_files()
    model_dir = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-model-"))
    model.to(SERVER_DTYPES[dtype]).save_pretrained(model_dir)
    weights_path = new_weights_path()
    server = VLLMServer(
        python=python,
        model_dir=model_dir,
        log_path=(run_dir or model_dir) / "vllm" / f"server-{os.getpid()}-{uuid.uuid4().hex[:6]}.log",
        max_model_len=max_model_len,
        startup_timeout_s=cfg.startup_timeout_s,
        extra_args=cfg.extra_args,
        dtype=dtype,
        kv_cache_bytes=kv_cache_bytes,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        enforce_eager=cfg.enforce_eager,
        weight_transfer="file" if collective is None else "collective",
        remove_on_exit=(model_dir, weights_path, _partial(weights_path)),
        cpu=not gpu,
        lora_rank=max_lora_rank(config.lora.rank) if config.lora.rank else 0,
        lora_slots=config.sampler.max_lag + 2,
    )
    return server, weights_path, python


def server_dtype(setting: str, trainer_dtype: str, gpu: bool) -> str:
    """the ``dtype`` option; auto: bfloat16 on a GPU, else the trainer's dtype (vLLM has no float64)."""
    if setting != "auto":
        return setting
    if gpu:
        return "bfloat16"
    return "float32" if trainer_dtype == "float64" else trainer_dtype


def served_context(request_bound: tuple[int, Budget], cfg: VLLMOptions, max_positions: int) -> int:
    """The ``max_model_len`` option, else the run's longest request: the task's longest prompt, or with an
    environment its longest templated opening plus the whole episode, then a turn's
    ``generation.max_new_tokens``. ``request_bound`` is that opening's length and the rest's
    ``Budget``, as ``asyncrl.rollout.context.request_bound`` returns them (the composition root
    computes it; this module builds no task and resolves no environment). A server sized to the
    model's whole context would need its KV cache for one such sequence."""
    opening, room = request_bound
    needed = opening + room.tokens
    length = cfg.max_model_len or needed
    if length > max_positions:
        raise ValueError(
            f"generation.backend.options.max_model_len: {length} tokens exceed the model's {max_positions} positions"
        )
    if length < needed:
        raise ValueError(
            f"generation.backend.options.max_model_len: {length} tokens do not hold the task's longest {room.opening} ({opening} tokens) "
            f"and {room.terms}; raise it to {needed} or leave it null"
        )
    return length


def server_kv_cache(
    config: RunConfig, cfg: VLLMOptions, model_config, dtype: str, max_model_len: int, gpu: bool
) -> int | None:
    """KV cache bytes of a started server: the ``kv_cache_mib`` option, at least one sequence of
    ``max_model_len``; unset, a step's sequences on CPU (at most ``CPU_KV_CACHE_CAP``, one at
    least), and on a GPU None: vLLM fills ``gpu_memory_utilization``."""
    per_token = kv_bytes_per_token(model_config, SERVER_DTYPES[dtype].itemsize)
    sequence = -(-max_model_len // KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS * per_token
    mib = cfg.kv_cache_mib
    if mib is None:
        if gpu:
            return None
        step = config.step.prompts_per_step * config.step.generations_per_prompt
        return max(sequence, min(step * sequence, CPU_KV_CACHE_CAP))
    if mib * 2**20 < sequence:
        raise ValueError(
            f"generation.backend.options.kv_cache_mib: {mib} MiB do not hold one sequence of generation.backend.options.max_model_len {max_model_len} tokens "
            f"({-(-sequence // 2**20)} MiB in {dtype}); raise it, or lower generation.backend.options.max_model_len or "
            "generation.max_new_tokens"
        )
    return mib * 2**20


def kv_bytes_per_token(model_config, itemsize: int) -> int:
    """Keys and values of one token over every layer."""
    kv_heads = getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads
    return 2 * model_config.num_hidden_layers * kv_heads * _head_size(model_config) * itemsize


def _head_size(model_config) -> int:
    return getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads


def collective_backend(weight_transfer: str, trainer_device: str) -> str | None:
    """The group backend of a collective transfer (NCCL where this process sees a GPU, else gloo),
    or None for a file; ``auto`` is collective from a CUDA trainer only: gloo is no faster than a
    file in /dev/shm."""
    gpu = torch.cuda.is_available()
    if weight_transfer == "file" or (weight_transfer == "auto" and not (gpu and trainer_device != "cpu")):
        return None
    return "nccl" if gpu else "gloo"


class ServedAdapters:
    """A LoRA run's adapters on its server, one per recent weight version (docs/lora.md).

    Each version is written in PEFT's format (``adapter_config.json``, ``adapter_model.safetensors``)
    to a directory of its own and loaded under its own name, ``v<version>-<this client's tag>`` (two
    runs may share a server), before any request names it; a request keeps its adapter to its last
    token, however many syncs come meanwhile. The newest ``slots`` stay loaded (sampler.max_lag + 2:
    every version a request still in bounds samples with, and the one being loaded); older ones are
    unloaded and their files removed. The base goes to the server once, at its start. Version 0's adapter is zero (B starts
    at zero), so until the first sync requests name none and run on the base."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], settings: LoraConfig, directory: Path, slots: int):
        self.shapes = dict(shapes)
        self.settings = settings
        self.directory = directory
        self.slots = slots
        self.loaded: dict[int, Path] = {}  # version -> its directory, oldest first
        self.tag = uuid.uuid4().hex[:8]

    def name(self, version: int) -> str | None:
        """What a request sampled with ``version`` names as its model; None: the base."""
        return f"v{version}-{self.tag}" if version in self.loaded else None

    def write(self, adapter: Mapping[str, Tensor], version: int) -> Path:
        """The adapter's directory, written aside and renamed into place (float32, as ``_write_weights``)."""
        target = self.directory / f"v{version}"
        partial = _partial(target)
        shutil.rmtree(partial, ignore_errors=True)
        self.settings.save_pretrained(partial)
        tensors = {name: tensor.to(device="cpu", dtype=torch.float32).contiguous() for name, tensor in adapter.items()}
        save_file(tensors, str(partial / ADAPTER_WEIGHTS_FILE))
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
        return target

    def past_bound(self) -> list[int]:
        """The loaded versions beyond the newest ``slots``, oldest first."""
        return list(self.loaded)[: max(0, len(self.loaded) - self.slots)]


class VLLMGenerator(GeneratorBase):
    """Drives one server: ``server`` (started here) or the one at ``url`` (someone else's).

    ``collective``: the group backend ("gloo", "nccl") of a collective weight transfer, whose
    server runs the asyncrl_collective engine; None: weights go through a file.
    ``adapters``: a LoRA run's; a sync then loads a new adapter by name (``ServedAdapters``) and
    ``shapes`` are the adapter's, not the model's.
    A response ends with one of ``stop_token_ids`` (kept, finish reason "stop") or at
    ``max_new_tokens`` ("length"); with no stop ids, only at ``max_new_tokens``.
    """

    loads_while_generating = True  # the server swaps weights between decoding steps of running requests
    concurrent_calls = True  # generate may run on several threads at once: the server takes every request

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
        adapters: ServedAdapters | None = None,
    ) -> None:
        if (server is None) == (url is None):
            raise ValueError("VLLMGenerator: give exactly one of server (to start) and url (to use)")
        self.adapters = adapters
        shapes = adapters.shapes if adapters is not None else shapes
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
        self.aliases: dict[str, str] = {}  # tied tensors the server is not sent -> the name it gets them under
        self.max_concurrency = max_concurrency
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="vllm-request")
        self._counting = threading.Lock()
        self._open_calls = 0  # submitted to the pool and not yet returned: what a new batch queues behind
        self._lock = threading.Lock()  # one weight update at a time; a restart waits for it
        atexit.register(self._remove_files)
        if server is not None:
            server.start()
            self.url = server.url
        self._connect()

    def generate(self, requests: Sequence[SampleRequest], params: SamplingParams) -> list[Rollout]:
        """One Rollout per request, in request order; every response token carries its version.
        A call that fails, or a batch past its deadline (``_limit_s``), raises once the batch's
        other calls are ended (``_abort``)."""
        check_vocabulary(requests, self.vocab_size)
        self._revive()
        version = self.version
        adapter = self.adapters.name(version) if self.adapters is not None else None
        batch = uuid.uuid4().hex
        request_ids = [f"{batch}-{index}" for index in range(len(requests))]
        limit_s = self._limit_s(len(requests))
        deadline = time.monotonic() + limit_s
        futures = [
            self._pool.submit(self._sample, request, params, version, request_id, adapter)
            for request, request_id in zip(requests, request_ids)
        ]
        for future in futures:
            future.add_done_callback(self._returned)
        try:
            wait(futures, timeout=max(0.0, deadline - time.monotonic()), return_when=FIRST_EXCEPTION)
            failed = next((f.exception() for f in futures if f.done() and f.exception() is not None), None)
            if failed is not None:
                raise failed
            if not all(future.done() for future in futures):
                raise ServerError(
                    f"{self.url}: a batch of {len(requests)} requests did not return within its deadline, "
                    f"{limit_s:g}s ({limit_s / self.timeout:g} x generation.backend.options.request_timeout_s)"
                )
            return [future.result() for future in futures]
        except BaseException:
            self._abort(request_ids, futures)
            raise

    def _limit_s(self, calls: int) -> float:
        """How long a batch of ``calls`` may take. Each call is bounded by the request timeout and
        the pool runs ``max_concurrency`` at once, so a request timeout for each wave of the calls
        queued ahead of the batch and in it, and one more for the slack of connecting."""
        with self._counting:
            self._open_calls += calls
            waves = -(-self._open_calls // self.max_concurrency) + 1
        return waves * self.timeout

    def _returned(self, future: Future) -> None:
        with self._counting:
            self._open_calls -= 1

    def _abort(self, request_ids: list[str], futures: list[Future]) -> None:
        """End the batch's other requests before its failure is raised, so a retry of the batch
        never runs beside them: those not sent are cancelled, the server aborts those it runs
        (their calls then return), and this waits for every call, for a request timeout at most."""
        running = [rid for rid, future in zip(request_ids, futures) if not future.cancel() and not future.done()]
        if running:
            try:
                self._call("/abort_requests", {"request_ids": [f"{SERVED_REQUEST_PREFIX}{rid}" for rid in running]})
            except ServerError:
                pass  # a server that does not answer runs nothing to abort; its calls fail on their own
        if wait(futures, timeout=self.timeout).not_done:
            raise ServerError(
                f"{self.url}: {len(running)} aborted requests of a failed batch still ran "
                f"generation.backend.options.request_timeout_s {self.timeout:g}s later"
            )

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
            if self.adapters is not None:
                self._load_adapter(state_dict, version)
                return
            self.aliases = _aliases(state_dict)
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

    def fingerprint(self) -> str:
        """The server's own sample of the weights its worker loaded last (``vllm_server.py``: the
        last update's, else its initial checkpoint's), with the tied names it was not sent.

        A LoRA run's: the newest adapter the server lists, read back from the files it loaded it
        from; ``NO_ADAPTER`` while it lists none (it serves the base alone, which no sync exports)."""
        if self.adapters is not None:
            return self._adapter_fingerprint()
        served = self._call("/collective_rpc", {"method": "asyncrl_served_weights"})["results"][0]
        return Sample.from_json(served["sample"]).with_aliases(self.aliases).digest(served["dtype"])

    def _adapter_fingerprint(self) -> str:
        listed = {model["id"] for model in self._call("/v1/models")["data"]}
        served = [version for version in self.adapters.loaded if self.adapters.name(version) in listed]
        if not served:
            return NO_ADAPTER
        return fingerprint(load_file(str(self.adapters.loaded[max(served)] / ADAPTER_WEIGHTS_FILE)))

    def _load_adapter(self, adapter: Mapping[str, Tensor], version: int) -> None:
        """Write and load ``version``'s adapter, make it the one new requests name, then unload those
        past the bound. A server that died on the way is restarted with every adapter still held."""
        self.adapters.loaded[version] = self.adapters.write(adapter, version)
        try:
            self._serve_adapter(version)
        except ServerError:
            if self.server is None or self.server.alive():
                shutil.rmtree(self.adapters.loaded.pop(version), ignore_errors=True)
                raise
            self._restart_locked()
            self._serve_adapters()
        self.version = version
        for old in self.adapters.past_bound():
            self._call("/v1/unload_lora_adapter", {"lora_name": self.adapters.name(old)})
            shutil.rmtree(self.adapters.loaded.pop(old), ignore_errors=True)

    def _serve_adapter(self, version: int) -> None:
        path = self.adapters.loaded[version]
        self._call("/v1/load_lora_adapter", {"lora_name": self.adapters.name(version), "lora_path": str(path)})

    def _serve_adapters(self) -> None:
        """Every adapter held, into a restarted server."""
        for version in self.adapters.loaded:
            self._serve_adapter(version)

    def close(self) -> None:
        """Stop the server this generator started and remove its weights file; safe to call twice."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.member is not None:
            self.member.group.abort()
        if self.server is not None:
            self.server.stop()
        self._remove_files()

    def _remove_files(self) -> None:
        """The weights file (and a half-written one) and the initial checkpoint; also at exit."""
        self.weights_path.unlink(missing_ok=True)
        _partial(self.weights_path).unlink(missing_ok=True)
        if self.model_dir is not None:
            shutil.rmtree(self.model_dir, ignore_errors=True)
        if self.adapters is not None:
            shutil.rmtree(self.adapters.directory, ignore_errors=True)

    def _sample(
        self, request: SampleRequest, params: SamplingParams, version: int, request_id: str, adapter: str | None
    ) -> Rollout:
        """One sample; ``adapter``: the LoRA adapter it runs with, whose version is every token's."""
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
        body = {
            "token_ids": list(request.prompt_ids),
            "sampling_params": sampling,
            "model": adapter,
            "request_id": request_id,
        }
        choice = self._call("/inference/v1/generate", body)["choices"][0]
        tokens = choice["token_ids"]
        logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
        return Rollout(
            prompt_ids=list(request.prompt_ids),
            response_ids=tokens,
            logprobs=logprobs,
            finish_reason="stop" if tokens and tokens[-1] in self.stop_token_ids else "length",
            versions=_token_versions(None if self.adapters else choice.get("weight_versions"), len(tokens), version),
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
        try:  # the store gives up after the timeout itself; this bounds the wait should it not
            self.member, self.joined = member.result(timeout=2 * self.timeout), True
        except TimeoutError:
            raise ServerError(
                f"{self.url}: the server's worker did not join the weight-transfer group within "
                f"2 x generation.backend.options.request_timeout_s {self.timeout:g}s"
            ) from None

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
        if self.adapters is not None:
            self._restart_locked()
            self._serve_adapters()
            return
        held = None if self.collective is None or self.sent_version is None else self.member.held(self.sent_version)
        self._restart_locked()
        if self.sent_version is not None:
            self._update(self.sent_version, held)

    def _restart_locked(self) -> None:
        """A new server process in place of the dead one, with its weight-transfer engine (counted)."""
        if self.restarts >= self.max_restarts:
            raise ServerError(
                f"the vLLM server died and generation.backend.options.max_restarts={self.max_restarts} restarts are used up; "
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
    """Where a generator writes the weights it sends: /dev/shm (memory) when there is one, named
    with this process's id so a later run can tell a dead run's leftover."""
    return _weights_dir() / f"{TEMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex}.safetensors"


def remove_dead_runs_files() -> None:
    """Remove what runs killed before their cleanup left for their servers (a weights file, whole
    or half-written, and the initial checkpoint): the files of processes that are gone."""
    for directory in {_weights_dir(), Path(tempfile.gettempdir())}:
        for path in directory.glob(f"{TEMP_PREFIX}*-*"):
            owner = path.name[len(TEMP_PREFIX) :].split("-", 1)[0]
            if owner.isdigit() and not _process_exists(int(owner)):
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def _weights_dir() -> Path:
    return SHM if SHM.is_dir() else Path(tempfile.gettempdir())


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def _local_address(url: str) -> str:
    """This host's address on the route to the server at ``url``: where its worker finds the group's store."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((urllib.parse.urlsplit(url).hostname, 80))
        return probe.getsockname()[0]


def _distinct(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The state dict without tensors tied to an earlier one (a tied head): the server loads each once."""
    tensors, seen = {}, set()
    for name, tensor in state_dict.items():
        key = _storage_key(tensor)
        if key not in seen:
            seen.add(key)
            tensors[name] = tensor.detach()
    return tensors


def _aliases(state_dict: Mapping[str, Tensor]) -> dict[str, str]:
    """The names ``_distinct`` leaves out, each mapped to the name its tensor is sent under."""
    kept = _distinct(state_dict)
    by_key = {_storage_key(tensor): name for name, tensor in kept.items()}
    return {name: by_key[_storage_key(tensor)] for name, tensor in state_dict.items() if name not in kept}


def _storage_key(tensor: Tensor) -> tuple:
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))


def _write_weights(state_dict: Mapping[str, Tensor], path: Path) -> None:
    """float32 safetensors of the distinct tensors, written aside and renamed."""
    tensors = {
        name: tensor.to(device="cpu", dtype=torch.float32).contiguous()
        for name, tensor in _distinct(state_dict).items()
    }
    partial = _partial(path)
    try:
        save_file(tensors, str(partial))
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    partial.replace(path)


def _partial(path: Path) -> Path:
    """Where ``path`` is written before it is renamed into place: a reader never sees half a file."""
    return path.with_name(path.name + ".partial")


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
