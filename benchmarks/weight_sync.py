"""``asyncrl bench weight-sync``: how fast a full weight sync moves bytes, against memcpy.

A sync is the real path: ``WeightSync`` exports the trainer's weights once (``PolicyTrainer``)
and loads them into a generator (``HFGenerator``), through the runtime's handles. Its bandwidth
(bytes of the state dict / transfer seconds) is compared with torch's own memcpy bandwidth for the
same number of bytes, measured in the same run.
"""

from __future__ import annotations

import asyncio
import copy
import time

import torch

from asyncrl.config import LossConfig, TrainerConfig
from asyncrl.generation.hf import HFGenerator
from asyncrl.models import build_tiny_model
from asyncrl.runtime import LocalRuntime
from asyncrl.trainer.policy import PolicyTrainer
from asyncrl.weights import Changes, RolloutGate, WeightSync

VOCAB = 256
# name -> tiny model shape; the names are the approximate parameter counts.
MODELS = {
    "1M": dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512),
    "10M": dict(hidden_size=256, num_layers=10, num_heads=4, num_kv_heads=2, intermediate_size=1024),
    "100M": dict(hidden_size=768, num_layers=16, num_heads=12, num_kv_heads=4, intermediate_size=2048),
}
GOALS = {"local": 0.5, "ray": 0.25}  # fraction of memcpy bandwidth


def memcpy_bandwidth(num_bytes: int, repeats: int) -> float:
    """Bytes/s of ``dst.copy_(src)`` for one buffer of ``num_bytes`` (best of ``repeats``)."""
    src = torch.rand(num_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of the pages is not bandwidth
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return num_bytes / best


def sync_bandwidth(model: torch.nn.Module, repeats: int) -> tuple[int, float]:
    """(bytes per sync, best bytes/s) of ``WeightSync`` from a PolicyTrainer into an HFGenerator."""
    trainer = PolicyTrainer(model, TrainerConfig(), LossConfig(), importance_sampling="none", total_steps=1)
    generator = HFGenerator(copy.deepcopy(model), eos_token_id=1, pad_token_id=0, batch_size=1)
    runtime = LocalRuntime()
    try:
        trainer_handle = runtime.spawn(lambda: trainer, "trainer")
        generator_handle = runtime.spawn(lambda: generator, "generator")

        async def syncs():
            gate = RolloutGate(0, Changes(), wait_for_admissions=False)
            weight_sync = WeightSync(trainer_handle, [generator_handle], gate, mode="drain", timeout_s=600)
            return [await weight_sync.sync() for _ in range(repeats)]

        reports = asyncio.run(syncs())
    finally:
        runtime.shutdown()
    return reports[0].bytes, max(r.bytes / r.transfer_s for r in reports)


def run(*, models: tuple[str, ...], repeats: int, runtimes: tuple[str, ...]) -> list[dict]:
    torch.manual_seed(0)
    rows = []
    for name in models:
        model = build_tiny_model(VOCAB, seed=0, **MODELS[name])
        params = sum(p.numel() for p in model.parameters())
        for runtime_name in runtimes:
            if runtime_name != "local":
                raise ValueError(f"--runtime: '{runtime_name}' is not supported by this benchmark yet")
            num_bytes, bandwidth = sync_bandwidth(model, repeats)
            memcpy = memcpy_bandwidth(num_bytes, repeats)
            rows.append(
                {
                    "model": name,
                    "parameters": params,
                    "runtime": runtime_name,
                    "sync_bytes": num_bytes,
                    "sync_bytes_per_s": bandwidth,
                    "memcpy_bytes_per_s": memcpy,
                    "fraction_of_memcpy": bandwidth / memcpy,
                    "goal": GOALS[runtime_name],
                    "goal_met": bandwidth / memcpy >= GOALS[runtime_name],
                }
            )
    return rows
