"""``asyncrl bench lora``: LoRA adapters against full fine-tuning, same model and batch, on the CPU.

Each setting runs in a fresh process, since peak resident memory is a per-process high-water
mark: build a model of Qwen2.5-0.5B's shape with random weights (no download; float32), a
generator (``build_hf_generator``) over what the local runtime gives it (``generator_copy``: its
own copy for full fine-tuning; for LoRA the trainer's frozen base, shared, and one adapter slot of
its own) and the trainer (``PolicyTrainer.from_config``: LoRA wraps it, or not). Then a few GRPO
steps of the same parts a run's step has: generation of the batch's responses, a split train step
on full-length rows, and the weight sync a run makes (the trainer's export, loaded into the
generator). The last step counts; the first pays for
first touches and AdamW's moments. At the end one checkpoint (``TrainerWorker.save_checkpoint``,
the run's writer) gives its size on disk, and, for LoRA, the time the base's SHA-256 in
``lora_base.json`` takes.
"""

from __future__ import annotations

import multiprocessing as mp
import resource
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from asyncrl.bench.gpu import QWEN25_05B, Workload, _batch, _model
from asyncrl.config.lora import LoraConfig

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK = 16
# Same shape as bench gpu's; a short batch, so that both settings run in minutes on two cores.
FULL = replace(QWEN25_05B, rows=8, prompt_len=32, response_len=32, micro_batch_size=8, steps=2, repeats=1)
SMALL_MODEL = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
QUICK = replace(FULL, vocab_size=1024, model=SMALL_MODEL, rows=4, prompt_len=8, response_len=8, micro_batch_size=4)
GOALS = {"peak_rss_full_over_lora": 2.0, "sync_bytes_full_over_lora": 100.0, "step_s_lora_over_full": 1.0}


def measure(workload: Workload, rank: int) -> dict[str, Any]:
    """One setting (``rank`` 0: full fine-tuning) in this process: its step, sync, checkpoint and peak RSS."""
    from asyncrl.weights.size import state_dict_bytes

    tokenizer, trainer, generator = _setting(workload, rank)
    steps, weights = _timed_steps(workload, trainer, generator)
    step_peak = _peak_rss_bytes()
    checkpoint_bytes, checkpoint_s, base_digest_s = _checkpoint_costs(trainer, tokenizer, rank)
    last = steps[-1]
    return {
        "setting": f"lora r{rank}" if rank else "full",
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
        "trainable_parameters": sum(p.numel() for p in trainer.params),
        "peak_rss_bytes": step_peak,
        "peak_rss_bytes_with_checkpoint": _peak_rss_bytes(),
        "step_s": sum(last.values()),
        **last,
        "sync_bytes": state_dict_bytes(weights),
        "checkpoint_bytes": checkpoint_bytes,
        "checkpoint_s": checkpoint_s,
        "base_digest_s": base_digest_s,
    }


def _setting(workload: Workload, rank: int) -> tuple[Any, Any, Any]:
    """The tokenizer, trainer and in-process generator of one setting, as a run builds them."""
    from asyncrl.config import load_config
    from asyncrl.generation.hf import build_hf_generator
    from asyncrl.models import build_tokenizer
    from asyncrl.models.factory import DTYPES
    from asyncrl.models.lora import generator_copy
    from asyncrl.trainer.policy import PolicyTrainer

    config = load_config(
        None,
        [
            f"lora.rank={rank}",
            f"lora.target_modules=[{','.join(TARGETS)}]",
            "trainer.dtype=float32",
            "trainer.device=cpu",
            f"trainer.micro_batch_size={workload.micro_batch_size}",
            f"generation.batch_size={workload.rows}",
        ],
    )
    tokenizer = build_tokenizer(config)  # the checkpoint saves one; the model's vocabulary is the workload's
    model = _model(workload, "cpu")
    generator = build_hf_generator(
        config, generator_copy(model, rank, DTYPES[config.trainer.dtype]), tokenizer, stop_token_ids=[0]
    )
    return tokenizer, PolicyTrainer.from_config(config, model), generator


def _timed_steps(workload: Workload, trainer: Any, generator: Any) -> tuple[list[dict[str, float]], Any]:
    """Each step's generation, training and sync seconds, and the weights the last sync moved."""
    from asyncrl.generation import SampleRequest, SamplingParams

    steps = []
    for step in range(workload.steps):
        batch = _batch(workload, seed=step)
        requests = [SampleRequest(row[: workload.prompt_len].tolist(), seed=i) for i, row in enumerate(batch.input_ids)]
        start = time.perf_counter()
        generator.generate(requests, SamplingParams(max_new_tokens=workload.response_len))
        generated = time.perf_counter()
        trainer.begin_train_step()
        for micro in batch.micro_batches(workload.micro_batch_size):
            trainer.train_microbatch(micro)
        trainer.finish_train_step()
        trained = time.perf_counter()
        version, weights = trainer.export_weights(copy=False)
        generator.load_weights(weights, version)
        synced = time.perf_counter()
        steps.append({"generation_s": generated - start, "training_s": trained - generated, "sync_s": synced - trained})
    return steps, weights


def _checkpoint_costs(trainer: Any, tokenizer: Any, rank: int) -> tuple[int, float, float | None]:
    """A checkpoint's bytes and seconds, and (LoRA) the seconds of the frozen base's digest."""
    from asyncrl.config import StepConfig
    from asyncrl.models.lora import base_sha256
    from asyncrl.trainer.worker import TrainerWorker

    with tempfile.TemporaryDirectory() as run_dir:
        start = time.perf_counter()
        saved = TrainerWorker(trainer, StepConfig(), tokenizer).save_checkpoint(run_dir, 1, {}, keep_last=1)
        checkpoint_s = time.perf_counter() - start
        checkpoint_bytes = sum(f.stat().st_size for f in Path(saved).rglob("*") if f.is_file())
    base_digest_s = None
    if rank:
        start = time.perf_counter()
        base_sha256(trainer.model.state_dict())
        base_digest_s = time.perf_counter() - start
    return checkpoint_bytes, checkpoint_s, base_digest_s


def _peak_rss_bytes() -> int:
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _in_fresh_process(workload: Workload, rank: int) -> dict[str, Any]:
    with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(measure, workload, rank).result()


def run(workload: Workload) -> dict[str, Any]:
    """Full fine-tuning, then LoRA (one after the other: never both in memory), and their ratios."""
    full = _in_fresh_process(workload, 0)
    lora = _in_fresh_process(workload, RANK)
    ratios = {
        "peak_rss_full_over_lora": full["peak_rss_bytes"] / lora["peak_rss_bytes"],
        "sync_bytes_full_over_lora": full["sync_bytes"] / lora["sync_bytes"],
        "step_s_lora_over_full": lora["step_s"] / full["step_s"],
    }
    goals = {
        name: {
            "value": value,
            "goal": f"<= {GOALS[name]:g}" if name.endswith("over_full") else f">= {GOALS[name]:g}",
            "met": value <= GOALS[name] if name.endswith("over_full") else value >= GOALS[name],
        }
        for name, value in ratios.items()
    }
    return {"settings": [full, lora], "goals": goals}


def settings(workload: Workload) -> dict[str, Any]:
    return {
        **{k: v for k, v in asdict(workload).items() if k != "repeats"},
        "dtype": "float32",
        "device": "cpu",
        "lora_rank": RANK,
        "lora_alpha": LoraConfig().alpha,
        "target_modules": list(TARGETS),
    }
