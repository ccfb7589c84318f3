"""``asyncrl bench gpu``: does the trainer work on this CUDA GPU, and how fast, in one command.

On one GPU it builds a model of Qwen2.5-0.5B's shape with random weights (nothing is downloaded)
and measures, through the code a run uses:

- ``train``: split GRPO steps (``PolicyTrainer``: micro-batches, then one optimizer step) in
  bfloat16 over float32 masters: tokens/s, and MFU against the GPU's peak dense bf16 FLOP/s;
  ``train_packed`` the same with ``trainer.packing`` (each micro-batch's rows in one row);
- ``weights``: the export a weight sync makes (``PolicyTrainer.export_weights``), to the GPU and to
  host memory, and ``HFGenerator.load_weights`` of it into a bfloat16 generator, in GB/s;
- ``fsdp2``: the same steps with the policy sharded by FSDP2 over a one-rank process group;
- ``long_context``: one step of two rows holding T tokens in all, T doubling to 128k, with
  activation checkpointing: equal rows, ragged rows (60 % / 40 % of T) right-padded, and the same
  packed; the step's peak GPU memory above the built trainer, and its time. This is
  ``asyncrl bench long-context``'s cp = 1 measurement at the real model's width, on the GPU's
  attention kernels (one GPU: cp = 2 needs two);
- ``vllm``: the vLLM backend's generation and weight load, where its GPU environment exists.

Model FLOPs per trained token follow PaLM's count: 6 N (forward and backward through N
parameters, the tied embedding counted once, as the output projection) + 12 L H T for attention
scores over a context of T. Peaks are looked up by device name in ``PEAK_TFLOPS`` or given with
``--peak-tflops``. Only torch and transformers calls the trainer itself makes are used, so it runs
on a GPU image's own builds of both.
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from asyncrl.bench.flops import train_flops_per_token

# Dense bfloat16 tensor-core peaks in TFLOP/s, by a substring of torch.cuda.get_device_name();
# the longest matching name wins, so "H100 PCIe" is not read as an SXM "H100".
PEAK_TFLOPS = {
    "B200": 2250.0,
    "H200": 989.4,
    "H100": 989.4,
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H800": 989.4,
    "A100": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
}


@dataclass(frozen=True)
class Workload:
    """A model shape (``tiny_config`` keywords) and the GRPO steps trained on it."""

    vocab_size: int
    model: dict[str, int]
    rows: int  # sequences per step
    prompt_len: int
    response_len: int
    micro_batch_size: int
    steps: int  # timed steps, after one warm-up step
    repeats: int  # timed weight exports and loads (the best counts)
    long_context_lens: tuple[int, ...] = ()  # T of the long-context steps (two rows' tokens in all)

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len


QWEN25_05B = Workload(
    vocab_size=151936,
    model=dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864),
    rows=32,
    prompt_len=256,
    response_len=768,
    micro_batch_size=8,
    steps=5,
    repeats=3,
    long_context_lens=tuple(8192 * 2**k for k in range(5)),  # 8k .. 128k
)
LONG_CONTEXT_RAGGED = (0.6, 0.4)  # the ragged rows' shares of T, as in ``asyncrl bench long-context``


def peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a device, by its name; None when the table does not know it."""
    matches = [name for name in PEAK_TFLOPS if name.lower() in device_name.lower()]
    return PEAK_TFLOPS[max(matches, key=len)] if matches else None


def flops_per_token(parameters: int, workload: Workload) -> float:
    """Training FLOPs per token (forward and backward), PaLM's count."""
    m = workload.model
    return train_flops_per_token(parameters, m["num_layers"], m["hidden_size"], workload.seq_len)


def run(workload: Workload = QWEN25_05B, *, device: str = "cuda", peak: float | None = None) -> dict[str, Any]:
    """Every measurement on ``device``; ``peak`` (TFLOP/s) overrides the table."""
    device_name = torch.cuda.get_device_name(device) if device == "cuda" else "cpu"
    peak = peak if peak is not None else peak_tflops(device_name)
    trainer = _trainer(_model(workload, device), workload, device)
    parameters = sum(p.numel() for p in trainer.params)
    result: dict[str, Any] = {
        "device": device_name,
        "peak_bf16_tflops": peak,
        "parameters": parameters,
        "flops_per_token": flops_per_token(parameters, workload),
        "train": _train(trainer, workload, peak),
        "weights": _weights(trainer, workload, device),
    }
    del trainer
    _empty_cache(device)
    result["train_packed"] = _train(_trainer(_model(workload, device), workload, device, packing=True), workload, peak)
    _empty_cache(device)
    result["fsdp2"] = _fsdp2(workload, device, peak)
    result["long_context"] = _long_context(workload, device)
    result["vllm"] = _vllm(workload, device)
    return result


def _model(workload: Workload, device: str, dtype: torch.dtype = torch.float32, positions: int | None = None):
    """The workload's model, with room for ``positions`` (default: the workload's rows)."""
    from asyncrl.models import build_tiny_model

    with torch.device(device):  # initialized where it runs: a 0.5B model on the host is slow to move
        return build_tiny_model(
            workload.vocab_size,
            seed=0,
            dtype=dtype,
            max_position_embeddings=positions or workload.seq_len,
            **workload.model,
        )


def _trainer(model, workload: Workload, device: str, parallel=None, packing: bool = False):
    from asyncrl.algorithms.grpo import GRPO
    from asyncrl.config import TrainerConfig
    from asyncrl.trainer.policy import PolicyTrainer

    config = TrainerConfig(dtype="bfloat16", micro_batch_size=workload.micro_batch_size, device=device, packing=packing)
    return PolicyTrainer(model, config, GRPO(), total_steps=workload.steps + 1, parallel=parallel)


def _batch(workload: Workload, seed: int):
    """Full-length rows (every position a real token), so tokens/s counts no padding."""
    from asyncrl.types import TrainBatch

    gen = torch.Generator().manual_seed(seed)
    rows, width = workload.rows, workload.seq_len
    response = torch.zeros(rows, width)
    response[:, workload.prompt_len :] = 1.0
    uniform = -math.log(workload.vocab_size)  # a random model's logprob of any token
    return TrainBatch(
        input_ids=torch.randint(0, workload.vocab_size, (rows, width), generator=gen),
        attention_mask=torch.ones(rows, width, dtype=torch.long),
        response_mask=response,
        behaviour_logprobs=uniform * response,
        advantages=torch.randn(rows, generator=gen),
        response_lengths=response.sum(1).long(),
        prox_logprobs=uniform * response,
    )


def _train(trainer, workload: Workload, peak: float | None) -> dict[str, Any]:
    """Mean tokens/s of ``workload.steps`` split steps, after one untimed warm-up step."""
    seconds = []
    for step in range(workload.steps + 1):
        batch = _batch(workload, seed=step)
        start = _now(trainer.device)
        trainer.begin_train_step()
        for micro in batch.micro_batches(workload.micro_batch_size):
            trainer.train_microbatch(micro)
        result = trainer.finish_train_step()
        seconds.append(_now(trainer.device) - start)
        if not math.isfinite(result.loss):
            raise RuntimeError(f"bench gpu: step {step} has a non-finite loss {result.loss}")
    step_s = sum(seconds[1:]) / workload.steps
    tokens_per_s = workload.rows * workload.seq_len / step_s
    achieved = tokens_per_s * flops_per_token(sum(p.numel() for p in trainer.params), workload)
    return {
        "steps": workload.steps,
        "tokens_per_step": workload.rows * workload.seq_len,
        "micro_batches_per_step": math.ceil(workload.rows / workload.micro_batch_size),
        "step_s": step_s,
        "tokens_per_s": tokens_per_s,
        "model_tflops": achieved / 1e12,
        "mfu": achieved / (peak * 1e12) if peak else None,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if trainer.device.type == "cuda" else None,
    }


def _long_rows(seq_len: int, ragged: bool) -> list[int]:
    if not ragged:
        return [seq_len // 2, seq_len - seq_len // 2]
    first = round(seq_len * LONG_CONTEXT_RAGGED[0])
    return [first, seq_len - first]


def _long_batch(lengths: list[int], workload: Workload, seed: int):
    """Rows of ``lengths`` tokens right-padded to the longest: a prompt, then a response."""
    from asyncrl.types import TrainBatch

    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    columns = torch.arange(width)
    ends = torch.tensor(lengths)[:, None]
    attention_mask = (columns < ends).long()
    response = ((columns >= min(workload.prompt_len, min(lengths) - 1)) & (columns < ends)).float()
    uniform = -math.log(workload.vocab_size)
    return TrainBatch(
        input_ids=torch.randint(1, workload.vocab_size, (len(lengths), width), generator=gen) * attention_mask,
        attention_mask=attention_mask,
        response_mask=response,
        behaviour_logprobs=uniform * response,
        advantages=torch.tensor([1.0, -1.0]),
        response_lengths=response.sum(1).long(),
        prox_logprobs=uniform * response,
    )


def _long_context(workload: Workload, device: str) -> dict[str, Any]:
    """Per layout, one step at each T until one does not fit: its peak memory above the built
    trainer (after a short step, so AdamW's moments exist) and its seconds; the peak's growth per
    doubling of T, which stays near 2 when memory is linear in T."""
    from asyncrl.algorithms.grpo import GRPO
    from asyncrl.config import TrainerConfig
    from asyncrl.trainer.policy import PolicyTrainer

    lens = workload.long_context_lens
    if not lens:
        return {"skipped": "the workload names no long-context lengths"}
    longest_row = max(max(_long_rows(t, ragged=True)) for t in lens)
    rows, stopped = [], []
    for layout, (ragged, packing) in {"equal": (False, False), "ragged": (True, False), "packed": (True, True)}.items():
        model = _model(workload, device, positions=longest_row)
        config = TrainerConfig(
            dtype="bfloat16", micro_batch_size=2, device=device, packing=packing, activation_checkpointing=True
        )
        trainer = PolicyTrainer(model, config, GRPO(), total_steps=2)
        trainer.train_step(_long_batch([16, 16], workload, seed=0))
        peaks = []
        for seq_len in lens:
            lengths = _long_rows(seq_len, ragged)
            batch = _long_batch(lengths, workload, seed=seq_len)
            _empty_cache(device)
            before = _memory(device, peak=False)
            _reset_peak(device)
            start = _now(trainer.device)
            try:
                trainer.begin_train_step()
                trainer.train_microbatch(batch)
                trainer.finish_train_step()
            except torch.OutOfMemoryError as err:
                trainer.abort_train_step()
                stopped.append({"layout": layout, "seq_len": seq_len, "reason": str(err).splitlines()[0]})
                break
            seconds = _now(trainer.device) - start
            peak = _memory(device, peak=True) - before
            growth = peak / peaks[-1] if peaks and peaks[-1] else None
            peaks.append(peak)
            rows.append({"layout": layout, "seq_len": seq_len, "rows": lengths, "step_peak_bytes": peak,
                         "step_seconds": seconds, "tokens_per_s": seq_len / seconds, "growth": growth})  # fmt: skip
        del trainer, model
        _empty_cache(device)
    return {"activation_checkpointing": True, "rows": rows, "stopped": stopped}


def _memory(device: str, *, peak: bool) -> int:
    """Bytes the device's allocator holds now (or at its high-water mark); 0 off the GPU, where
    ``asyncrl bench long-context`` measures resident memory instead."""
    if device != "cuda":
        return 0
    return torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()


def _reset_peak(device: str) -> None:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _weights(trainer, workload: Workload, device: str) -> dict[str, Any]:
    """Best-of-``repeats`` GB/s of the export (to the GPU, to host memory) and of the generator's load."""
    from asyncrl.generation.hf import HFGenerator

    generator = HFGenerator(_model(workload, device, torch.bfloat16), stop_token_ids=[0], pad_token_id=0, batch_size=1)
    row: dict[str, Any] = {}
    for target in dict.fromkeys((device, "cpu")):  # once on a CPU-only machine
        exports, loads = [], []
        for version in range(1, workload.repeats + 1):
            start = _now(trainer.device)
            _, weights = trainer.export_weights(copy=True, device=target)
            exports.append(_now(trainer.device) - start)
            start = _now(trainer.device)
            generator.load_weights(weights, version)
            loads.append(_now(trainer.device) - start)
        num_bytes = sum(t.numel() * t.element_size() for t in weights.values())
        row[f"export_to_{target}_gb_per_s"] = num_bytes / min(exports) / 1e9
        row[f"load_from_{target}_gb_per_s"] = num_bytes / min(loads) / 1e9
        row["bytes"] = num_bytes
    return row


def _fsdp2(workload: Workload, device: str, peak: float | None) -> dict[str, Any]:
    """The train steps with the policy sharded by FSDP2 over a one-rank group (NCCL on a GPU),
    and a whole-weights export gathered from the shards."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from asyncrl.config import ParallelConfig
    from asyncrl.trainer.parallel import start_rank
    from asyncrl.trainer.recompute import transformer_blocks

    with tempfile.TemporaryDirectory() as rendezvous:
        context = start_rank(ParallelConfig(), rank=0, init_method=f"file://{Path(rendezvous) / 'init'}", device=device)
        try:
            # parallelize() leaves a single rank unwrapped; shard the way it does for several.
            model = _model(workload, device)
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for block in transformer_blocks(model):
                fully_shard(block, mesh=context.ranks_mesh, mp_policy=policy)
            fully_shard(model, mesh=context.ranks_mesh, mp_policy=policy)
            context.casts_parameters = True
            trainer = _trainer(model, workload, device, parallel=context)
            row = _train(trainer, workload, peak)
            row["sharded"] = all(hasattr(p, "full_tensor") for p in trainer.params)  # DTensors: FSDP2 holds them
            start = _now(trainer.device)
            _, weights = trainer.export_weights(copy=True, device=device)
            seconds = _now(trainer.device) - start
            row["export_gb_per_s"] = sum(t.numel() * t.element_size() for t in weights.values()) / seconds / 1e9
            row["backend"] = dist.get_backend()
            return row
        finally:
            dist.destroy_process_group()
            _empty_cache(device)


def _vllm(workload: Workload, device: str) -> dict[str, Any]:
    """Generation tokens/s and weight-load GB/s of the vLLM backend on this GPU; skipped, with the
    reason, without a GPU or without the environment ``asyncrl vllm-env --device gpu`` makes."""
    from asyncrl.generation.vllm_env import VLLMEnvError, checked_python

    if device != "cuda":
        return {"skipped": "the vLLM GPU backend needs a CUDA device"}
    try:
        checked_python(None, "gpu")
    except VLLMEnvError as err:
        return {"skipped": str(err)}
    from asyncrl.config import load_config
    from asyncrl.data import build_task
    from asyncrl.environments.base import environment_class
    from asyncrl.generation import SampleRequest, SamplingParams
    from asyncrl.generation.vllm import build_vllm_generator
    from asyncrl.generation.vllm_options import VLLMOptions
    from asyncrl.models.factory import build_tokenizer
    from asyncrl.workers import generator_request_bound

    config = load_config(
        None,
        ["generation.backend.name=vllm", "trainer.dtype=bfloat16", "trainer.device=cuda",
         f"generation.backend.options.max_model_len={workload.seq_len}"],
    )  # fmt: skip
    model = _model(workload, device)
    weights = {name: t.to(torch.bfloat16) for name, t in model.state_dict().items()}
    tokenizer = build_tokenizer(config)
    bound = generator_request_bound(config, build_task(config.data, tokenizer), environment_class(config), tokenizer)
    options = VLLMOptions.model_validate(config.generation.backend.options)
    generator = build_vllm_generator(config, model, tokenizer, [], options, request_bound=bound)
    try:
        gen = torch.Generator().manual_seed(0)
        requests = [
            SampleRequest(torch.randint(0, workload.vocab_size, (workload.prompt_len,), generator=gen).tolist(), seed)
            for seed in range(workload.rows)
        ]
        start = time.perf_counter()
        rollouts = generator.generate(requests, SamplingParams(workload.response_len))
        generate_s = time.perf_counter() - start
        start = time.perf_counter()
        generator.load_weights(weights, 1)
        load_s = time.perf_counter() - start
    finally:
        generator.close()
    num_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    return {
        "generate_tokens_per_s": sum(len(r.response_ids) for r in rollouts) / generate_s,
        "load_gb_per_s": num_bytes / load_s / 1e9,
    }


def _now(device: torch.device) -> float:
    """Wall time once the device's queued work has finished."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _empty_cache(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()


def settings(workload: Workload) -> dict[str, Any]:
    return {**asdict(workload), "dtype": "bfloat16", "model_shape": "Qwen2.5-0.5B (random weights)"}
