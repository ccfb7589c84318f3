"""Trainer ranks: a dp × cp device mesh, FSDP2 or DDP over all of it, and the gradient-sum contract.

Every rank runs the same split-step calls. A data-parallel (DP) rank trains its own sequences; the
cp ranks of one DP group see the same sequences and each holds 2 of their 2·cp chunks
(context_parallel.py). Seen from the parameters, all W = dp·cp ranks are data-parallel, so the
wrapper (FSDP2 or DDP) spans the whole mesh.

Gradient convention (docs/loss.md): gradients are SUMMED over micro-batches, DP ranks and CP ranks.
Both wrappers average instead: FSDP2's reduce-scatter and DDP's all-reduce divide the sum by W.
That average is undone in exactly one place, ``ParallelContext.gradient_compensation`` (= W), which
``PolicyTrainer.finish_train_step`` folds into its single 1/D scaling. (With W a power of two the
division and the compensation are both exact.)

Normalizer counts: tokens and metric sums are counted on shards and summed over DP × CP; sequence
counts are counted on unsharded rows and contributed by CP rank 0 only, so the same single sum over
DP × CP is their sum over DP. Nothing is counted on unsharded data and summed over CP.

Every rank must make the same sequence of trainer calls (the same number of micro-batches per
step, the same ``compute_logprobs`` and ``export_weights`` calls): the wrappers run collectives
in every forward and backward.
"""

from __future__ import annotations

import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from asyncrl.config import ParallelConfig
from asyncrl.errors import ProcessGroupError
from asyncrl.trainer.context_parallel import ContextParallel, enable_context_parallel_attention
from asyncrl.trainer.recompute import transformer_blocks


def resolve_backend(cfg: ParallelConfig, device: torch.device | str) -> str:
    """``auto``: NCCL for CUDA ranks, gloo for CPU ranks."""
    if cfg.backend != "auto":
        return cfg.backend
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


@dataclass
class ParallelContext:
    """This rank's place in the dp × cp mesh, and the wrapper its policy gets."""

    mesh: DeviceMesh  # 2-D, dims ("dp", "cp")
    ranks_mesh: DeviceMesh  # the same ranks flattened: the group that sums gradients and step counters
    wrap: str  # "fsdp" | "ddp"
    context: ContextParallel | None  # None when cp is 1
    casts_parameters: bool = False  # set by parallelize: FSDP2 runs the forward in a lower precision

    @property
    def dp(self) -> int:
        return self.mesh.size(0)

    @property
    def cp(self) -> int:
        return self.mesh.size(1)

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp")

    @property
    def cp_rank(self) -> int:
        return self.mesh.get_local_rank("cp")

    @property
    def world_size(self) -> int:
        return self.dp * self.cp

    @property
    def rank(self) -> int:
        """This rank's place among all dp·cp ranks; rank 0 keeps what is gathered to one rank."""
        return dist.get_rank(self.ranks_mesh.get_group())

    @property
    def gradient_compensation(self) -> float:
        """The factor that turns the wrapper's gradient average over W ranks back into a sum."""
        return float(self.world_size)

    def parallelize(
        self, model: nn.Module, reference_model: nn.Module | None = None, *, mixed_precision: torch.dtype | None = None
    ) -> nn.Module:
        """Give both models context-parallel attention (cp > 1) and wrap them over all ranks.

        FSDP2 shards each transformer block (``transformer_blocks``) and then the rest, of the
        policy and of the frozen reference alike. With ``mixed_precision`` its MixedPrecisionPolicy
        gathers the float32 shards in that dtype for the forward and backward and reduces gradients
        in float32, so parameters and optimizer state stay float32 masters. DDP (composable
        ``replicate``) keeps a full copy of the policy on every rank, and of the reference, which
        has nothing for DDP to reduce. Both change the module in place, so names and state-dict
        keys stay those of the plain model.
        """
        if self.context is not None:
            for m in (model, reference_model):
                if m is not None:
                    enable_context_parallel_attention(m)
        if self.world_size == 1:
            return model
        if self.wrap == "ddp":
            from torch.distributed._composable.replicate import replicate

            return replicate(model, device_mesh=self.ranks_mesh)
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        precision = MixedPrecisionPolicy(
            param_dtype=mixed_precision, reduce_dtype=torch.float32 if mixed_precision else None
        )
        for m in (reference_model, model):
            if m is not None:
                for block in transformer_blocks(m):
                    fully_shard(block, mesh=self.ranks_mesh, mp_policy=precision)
                fully_shard(m, mesh=self.ranks_mesh, mp_policy=precision)
        self.casts_parameters = mixed_precision is not None
        return model

    def reduce_step(self, sums: Tensor, low: Tensor, high: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """Step counters summed, the ranged metrics' (low, high) reduced, over all ranks (two collectives)."""
        group = self.ranks_mesh.get_group()
        sums = sums.clone()
        dist.all_reduce(sums, group=group)
        extremes = torch.cat([-low, high])
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
        return sums, (-extremes[: len(low)], extremes[len(low) :])


def init_parallel(cfg: ParallelConfig, device: torch.device | str = "cpu") -> ParallelContext:
    """This rank's mesh; the default process group must already hold exactly dp·cp ranks."""
    ranks = dist.get_world_size()
    if ranks != cfg.world_size:
        raise ValueError(f"parallel.dp: dp*cp = {cfg.dp}*{cfg.cp} = {cfg.world_size} ranks, but {ranks} were started")
    mesh = init_device_mesh(torch.device(device).type, (cfg.dp, cfg.cp), mesh_dim_names=("dp", "cp"))
    context = ContextParallel(mesh.get_group("cp")) if cfg.cp > 1 else None
    return ParallelContext(mesh=mesh, ranks_mesh=mesh._flatten("dp_cp"), wrap=cfg.wrap, context=context)


def start_rank(
    cfg: ParallelConfig, *, rank: int, init_method: str, device: torch.device | str = "cpu", timeout_s: float = 600.0
) -> ParallelContext:
    """Join the trainer's process group as ``rank`` of dp·cp, then build the mesh.

    A group that cannot form (a rank unreachable at the address it gave) is a ``ProcessGroupError``
    in one line, naming the rendezvous and the collective's own first line."""
    backend = resolve_backend(cfg, device)
    try:
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=cfg.world_size, timeout=timedelta(seconds=timeout_s)
        )
        return init_parallel(cfg, device)
    except RuntimeError as err:  # torch's DistError and gloo's connect failures
        cause = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise ProcessGroupError(
            f"trainer rank {rank} could not form the trainer ranks' {backend} group at {init_method}: {cause}"
        ) from None


# ---- local ranks --------------------------------------------------------------------------------


def launch(fn: Callable[..., bytes], world_size: int, *args, timeout_s: float = 600.0) -> list[bytes]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh CPU processes joined in one gloo
    process group, and return what each returned, in rank order.

    Ranks meet through a file in a temporary directory, so there is no port to choose or collide
    on. Results travel as bytes (``torch.save`` into a buffer): tensors queued by a process that
    then exits do not survive the trip. A failing rank's traceback is raised here, and the other
    ranks, which would wait for it forever, are terminated.
    """
    spawn = mp.get_context("spawn")
    results = spawn.Queue()
    with tempfile.TemporaryDirectory(prefix="asyncrl-ranks-") as rendezvous:
        init_method = Path(rendezvous, "store").as_uri()
        ranks = [
            spawn.Process(
                target=_run_rank, args=(fn, rank, world_size, init_method, timeout_s, results, args), daemon=True
            )
            for rank in range(world_size)
        ]
        for process in ranks:
            process.start()
        try:
            payloads = _collect(ranks, results, time.monotonic() + timeout_s)
        finally:
            for process in ranks:
                process.join(timeout=10)
                if process.is_alive():
                    process.terminate()
                    process.join()
    return [payloads[rank] for rank in range(world_size)]


def _run_rank(fn, rank: int, world_size: int, init_method: str, timeout_s: float, results, args) -> None:
    """One local rank; its result (or traceback) is queued before it leaves the group, so a failing
    rank is reported before the ranks it leaves waiting fail too."""
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
        )
        results.put((rank, fn(rank, world_size, *args), None))
    except BaseException:
        results.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _collect(ranks: list, results, deadline: float) -> dict[int, bytes]:
    payloads: dict[int, bytes] = {}
    while len(payloads) < len(ranks):
        try:
            rank, payload, error = results.get(timeout=0.5)
        except queue.Empty:
            for rank, process in enumerate(ranks):
                if rank not in payloads and process.exitcode not in (None, 0):
                    raise RuntimeError(f"rank {rank} died with exit code {process.exitcode}") from None
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"ranks {sorted(set(range(len(ranks))) - set(payloads))} did not finish in time"
                ) from None
            continue
        if error is not None:
            raise RuntimeError(f"rank {rank} failed:\n{error}")
        payloads[rank] = payload
    return payloads
