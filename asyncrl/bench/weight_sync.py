"""``asyncrl bench weight-sync``: how fast a full weight sync moves bytes, against memcpy.

A sync is the real path: ``WeightSync`` exports the trainer's weights once (``TrainerWorker``
over a ``PolicyTrainer``) and loads them into a generator (``HFGenerator``), through the
runtime's handles; on Ray once per weight transport (the object store, and the broadcast group
over gloo). Its bandwidth (bytes of the state dict / transfer seconds) is compared with torch's
own memcpy bandwidth for the same number of bytes, measured in the same run.
"""

from __future__ import annotations

import asyncio
import functools
import time

import torch

from asyncrl.algorithms.grpo import GRPO
from asyncrl.bench.common import runtime_session, spawn_pair
from asyncrl.config import StepConfig, TrainerConfig
from asyncrl.control.changes import Changes
from asyncrl.control.gate import RolloutGate
from asyncrl.control.weight_sync import WeightSync
from asyncrl.generation.hf import HFGenerator
from asyncrl.models import build_tiny_model
from asyncrl.trainer.policy import PolicyTrainer
from asyncrl.trainer.worker import TrainerWorker

VOCAB = 256
# name -> tiny model shape; the names are the approximate parameter counts.
MODELS = {
    "1M": dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512),
    "10M": dict(hidden_size=256, num_layers=10, num_heads=4, num_kv_heads=2, intermediate_size=1024),
    "100M": dict(hidden_size=768, num_layers=16, num_heads=12, num_kv_heads=4, intermediate_size=2048),
}
GOALS = {"local": 0.5, "ray": 0.25}  # fraction of memcpy bandwidth
TRANSPORTS = {"local": ("in_process",), "ray": ("object_store", "broadcast")}


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


def build_trainer(model_name: str) -> TrainerWorker:
    """The trainer side a run syncs from: a TrainerWorker over a PolicyTrainer."""
    model = build_tiny_model(VOCAB, seed=0, **MODELS[model_name])
    trainer = PolicyTrainer(model, TrainerConfig(), GRPO(), total_steps=1)
    return TrainerWorker(trainer, StepConfig(), tokenizer=None)


def build_generator(model_name: str) -> HFGenerator:
    model = build_tiny_model(VOCAB, seed=1, **MODELS[model_name])
    return HFGenerator(model, stop_token_ids=[1], pad_token_id=0, batch_size=1)


def sync_bandwidth(model_name: str, runtime_name: str, transport: str, repeats: int) -> tuple[int, float]:
    """(bytes per sync, best bytes/s) of ``WeightSync`` from a TrainerWorker into an HFGenerator,
    each behind a handle of runtime ``runtime_name`` (built inside the actors on Ray)."""
    runtime, trainer, generator = spawn_pair(
        runtime_name, functools.partial(build_trainer, model_name), functools.partial(build_generator, model_name)
    )
    try:
        if transport == "broadcast":
            runtime.connect_broadcast(trainer, [generator], "gloo", timeout_s=600)

        async def syncs():
            gate = RolloutGate(0, Changes(), wait_for_admissions=False)
            weight_sync = WeightSync(trainer, [generator], gate, mode="drain", timeout_s=600)
            return [await weight_sync.sync() for _ in range(repeats)]

        reports = asyncio.run(syncs())
    finally:
        runtime.shutdown()
    if {r.transport for r in reports} != {transport}:
        raise RuntimeError(f"weight-sync: the syncs went {sorted({r.transport for r in reports})}, not {transport}")
    return reports[0].bytes, max(r.bytes / r.transfer_s for r in reports)


def run(*, models: tuple[str, ...], repeats: int, runtimes: tuple[str, ...]) -> list[dict]:
    with runtime_session(runtimes):
        return [
            _row(name, runtime_name, transport, repeats)
            for name in models
            for runtime_name in runtimes
            for transport in TRANSPORTS[runtime_name]
        ]


def _row(name: str, runtime_name: str, transport: str, repeats: int) -> dict:
    params = sum(p.numel() for p in build_tiny_model(VOCAB, seed=0, **MODELS[name]).parameters())
    num_bytes, bandwidth = sync_bandwidth(name, runtime_name, transport, repeats)
    memcpy = memcpy_bandwidth(num_bytes, repeats)
    return {
        "model": name,
        "parameters": params,
        "runtime": runtime_name,
        "transport": transport,
        "sync_bytes": num_bytes,
        "sync_bytes_per_s": bandwidth,
        "memcpy_bytes_per_s": memcpy,
        "fraction_of_memcpy": bandwidth / memcpy,
        "goal": GOALS[runtime_name],
        "goal_met": bandwidth / memcpy >= GOALS[runtime_name],
    }
