"""``asyncrl bench memory``: the trainer's peak memory with K mini-batch updates per step against one.

A step of K > 1 updates keeps the weights and optimizer state it started from until it finishes,
for the abort path (``trainer/snapshot.py``). Each K runs in a fresh process, since peak resident
memory is a per-process high-water mark: build a Qwen2-layout model from a config (no download),
take one plain step (so AdamW's moments exist, as in any step after a run's first), then one step
of K updates, and read the process's peak RSS. Both processes do the same work up to that step,
so the difference is what K > 1 adds. On the CPU the step-start copy goes to a temporary file;
a copy in memory would add 12 bytes a parameter (float32 weight and two moments).
"""

from __future__ import annotations

import multiprocessing as mp
import resource
import sys
from concurrent.futures import ProcessPoolExecutor

import torch

from asyncrl.algorithms.grpo import GRPO
from asyncrl.config import TrainerConfig
from asyncrl.models import build_tiny_model
from asyncrl.tools.verify import random_batch
from asyncrl.trainer.policy import PolicyTrainer

VOCAB = 32768
# name -> model shape; the names are the approximate parameter counts.
MODELS = {
    "16M": dict(hidden_size=256, num_layers=8, num_heads=4, num_kv_heads=2, intermediate_size=1024),
    "100M": dict(hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4, intermediate_size=2048),
}
SNAPSHOT_BYTES_PER_PARAMETER = 12  # float32 weight, Adam's first and second moments
NUM_GROUPS, GROUP_SIZE = 4, 2


def peak_rss_bytes(model_name: str, updates: int) -> tuple[int, int]:
    """(parameters, the process's peak RSS in bytes) after a plain step and a step of ``updates``."""
    torch.manual_seed(0)
    model = build_tiny_model(VOCAB, seed=0, **MODELS[model_name])
    trainer = PolicyTrainer(model, TrainerConfig(lr=1e-5), GRPO(), total_steps=2)
    batch = random_batch(model, num_groups=NUM_GROUPS, group_size=GROUP_SIZE, vocab_size=VOCAB, seed=0)
    trainer.train_step(batch)
    parts = batch.split([len(batch) // updates + (k < len(batch) % updates) for k in range(updates)])
    trainer.begin_train_step()
    for index, part in enumerate(parts):
        trainer.train_microbatch(part)
        if index < len(parts) - 1:
            trainer.finish_update()
    trainer.finish_train_step()
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return sum(p.numel() for p in model.parameters()), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _in_fresh_process(model_name: str, updates: int) -> tuple[int, int]:
    with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(peak_rss_bytes, model_name, updates).result()


def run(*, models: tuple[str, ...], updates: int) -> list[dict]:
    rows = []
    for name in models:
        parameters, one = _in_fresh_process(name, 1)
        _, several = _in_fresh_process(name, updates)
        snapshot_bytes = SNAPSHOT_BYTES_PER_PARAMETER * parameters
        rows.append(
            {
                "model": name,
                "parameters": parameters,
                "updates": updates,
                "peak_rss_bytes_k1": one,
                f"peak_rss_bytes_k{updates}": several,
                "extra_bytes": several - one,
                "in_memory_snapshot_bytes": snapshot_bytes,
                "extra_over_in_memory_snapshot": (several - one) / snapshot_bytes,
            }
        )
    return rows
