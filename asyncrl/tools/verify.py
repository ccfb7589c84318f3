"""``asyncrl verify``: prove on this machine that a split or parallel train step equals the monolithic one.

For every loss aggregation mode it builds a random tiny model and a random ragged batch (uneven
prompt and response lengths, off-policy behaviour logprobs, a KL reference and an entropy bonus,
so every loss term and clipping branch is exercised), then runs

    reference: train_step(whole batch), in this process
    candidate: begin_train_step, train_microbatch over K uneven micro-batches of shuffled rows
               in shuffled order, finish_train_step
               -- in this process, or with ``dp``/``cp`` on dp·cp local ranks: each DP rank takes
               an uneven share of the rows and trains K micro-batches of it, and each CP rank one
               shard of every sequence (trainer/parallel.py, trainer/context_parallel.py)

from identical copies and compares loss, gradient norm, every gradient, every updated parameter and
every reported metric against docs/loss.md's tolerances. Parameters are compared where the gradient
determines their update (see ``_UNDETERMINED_BAND``). Every path scores under a tempered, top-k
and top-p truncated distribution (``DISTRIBUTION``), so shards and micro-batches are checked to
truncate exactly as whole rows do. ``plant`` swaps in a deliberate mistake so a user can see the
check fail.
"""

from __future__ import annotations

import contextlib
import copy
import io
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch import Tensor
from transformers import AttentionInterface

import asyncrl.models.logprobs as scoring
from asyncrl.algorithms import Algorithm, build_algorithm, grpo
from asyncrl.config import ParallelConfig, RunConfig, TrainerConfig
from asyncrl.models import SampledDistribution, build_tiny_model, token_logprobs
from asyncrl.models.lora import apply_lora
from asyncrl.plugins import resolve
from asyncrl.tools.plants import PLANTS, Plant
from asyncrl.trainer import PolicyTrainer, normalization
from asyncrl.trainer.context_parallel import ContextParallel, Shard, context_parallel_attention
from asyncrl.trainer.parallel import ParallelContext, init_parallel, launch
from asyncrl.trainer.worker import split_evenly
from asyncrl.types import StepResult, TrainBatch

UPDATE_PLANTS = ("whole-step-normalizer", "recompute-proximal")  # mistakes that need several updates
CP_PLANTS = (
    "shift-after-shard",
    "double-count-tokens",
    "cp-shard-mean",
    "cp-untruncated",
    "cp-causal-leak",
)  # mistakes that only exist across CP ranks
RANK_PLANTS = (*CP_PLANTS, "per-shard-mean", "average-without-compensation")  # need more than one rank
LORA_PLANTS = ("lora-base-trainable", "lora-double-scaling")  # mistakes of a LoRA policy: need --lora
PACKING_PLANTS = ("packed-leak",)  # mistakes of packed rows: need --packing
Options = tuple[tuple[str, Any], ...]  # an algorithm's options as sorted (key, value) pairs: hashable
DTYPES = {"float64": torch.float64, "float32": torch.float32}
WRAPS = ("fsdp", "ddp")
NUM_GROUPS, GROUP_SIZE = 4, 4
BATCH_ROWS = NUM_GROUPS * GROUP_SIZE  # the most micro-batches a check can use
MAX_RANKS = 4
# the sampling every check scores under: the truncation keeps about half of the 48 tokens
DISTRIBUTION = SampledDistribution(temperature=0.8, top_k=24, top_p=0.95)
LOGPROB_CHUNK_TOKENS = 7  # small and odd: chunk seams fall inside rows, at other tokens in each micro-batch


@dataclass(frozen=True)
class Tolerance:
    """docs/loss.md: relative error on the loss; rtol plus atol relative to the tensor's max for tensors."""

    loss: float
    rtol: float
    atol_frac: float


TOLERANCES = {
    torch.float64: Tolerance(loss=1e-9, rtol=1e-9, atol_frac=0.0),
    torch.float32: Tolerance(loss=1e-5, rtol=1e-4, atol_frac=1e-5),
}


@dataclass(frozen=True)
class Case:
    """One check of a multi-rank launch."""

    mode: str
    dtype: str = "float64"
    plant: str | None = None
    wrap: str = "fsdp"
    algorithm: str = "grpo"
    options: Options = ()  # a mapping is kept as its sorted (key, value) pairs
    lora: bool = False
    packing: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", tuple(sorted(dict(self.options).items())))


@dataclass
class Comparison:
    """Candidate-versus-monolithic errors for one aggregation mode."""

    mode: str
    loss: float
    loss_error: float
    grad_norm: float
    grad_norm_error: float
    worst_grad: tuple[str, float]
    worst_param: tuple[str, float]
    passed: bool
    worst_metric: tuple[str, float] = ("", 0.0)
    case: Case | None = field(default=None, compare=False)

    @property
    def worst_error(self) -> tuple[float, str]:
        """(largest relative error of this mode, what it was measured on)."""
        return max(
            (self.loss_error, "loss"),
            (self.grad_norm_error, "grad norm"),
            (self.worst_grad[1], f"gradient of {self.worst_grad[0]}"),
            (self.worst_param[1], f"updated {self.worst_param[0]}"),
            (self.worst_metric[1], f"metric {self.worst_metric[0]}"),
        )


@dataclass
class StepOutcome:
    """What a step produced, whole (unsharded) and on the CPU, so it can travel between processes."""

    loss: float
    grad_norm: float
    grads: dict[str, Tensor]
    params: dict[str, Tensor]
    metrics: dict[str, float]

    @classmethod
    def of(cls, trainer: PolicyTrainer, result: StepResult) -> StepOutcome:
        """Gathers sharded tensors, so every rank of a parallel trainer must call it. A frozen
        parameter (a LoRA base) has no gradient to record."""
        grads, params = {}, {}
        for name, param in trainer.model.named_parameters():
            if param.grad is not None:
                grads[name] = _whole(param.grad)
            params[name] = _whole(param.detach())
        return cls(result.loss, result.grad_norm, grads, params, dict(result.metrics))


def _whole(tensor: Tensor) -> Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).cpu().clone()


# ---- planted mistakes -------------------------------------------------------------------------


class PerMicrobatchMeanTrainer(PolicyTrainer):
    """The planted mistake: each micro-batch is normalized by its own count, then averaged."""

    def _local_weights(self, batch: TrainBatch) -> Tensor:
        own = normalization.step_normalizer(self.cfg.aggregation, batch.num_response_tokens, batch.num_sequences)
        return super()._local_weights(batch) / own

    def _step_normalizer(self, state, sums) -> float:
        return float(state.num_microbatches)


class WholeStepNormalizerTrainer(PolicyTrainer):
    """The planted mistake: every mini-batch's update divided by the whole step's D, not its own."""

    step_counts: tuple[int, int] = (0, 0)  # (response tokens, sequences) of the whole step

    def _step_normalizer(self, state, sums) -> float:
        return normalization.step_normalizer(self.cfg.aggregation, *self.step_counts)


class ObservationTrainedTrainer(PolicyTrainer):
    """The planted mistake: a multi-turn row's observation tokens trained like sampled ones (the
    holes in its response mask filled, from its first response token to its last)."""

    def _loss_inputs(self, batch: TrainBatch):
        return super()._loss_inputs(_holes_filled(batch))


class ChunkSeamTrainer(PolicyTrainer):
    """The planted mistake: the loss scores its chunks of tokens with targets shifted within each
    chunk, so a chunk's last token predicts padding instead of the next chunk's first token."""

    def _loss_inputs(self, batch: TrainBatch):
        with _shifted_within_chunks():
            return super()._loss_inputs(batch)


@contextlib.contextmanager
def _shifted_within_chunks() -> Iterator[None]:
    """``logprobs.chunk_inputs`` swapped for one whose targets come from the chunk's own tokens."""
    right = scoring.chunk_inputs

    def shifted_within(hidden: Tensor, targets: Tensor, start: int, stop: int) -> tuple[Tensor, Tensor]:
        return hidden[start:stop], F.pad(targets[start : stop - 1], (0, 1))

    scoring.chunk_inputs = shifted_within
    try:
        yield
    finally:
        scoring.chunk_inputs = right


def _holes_filled(batch: TrainBatch) -> TrainBatch:
    mask = batch.response_mask
    after_first = mask.cumsum(1) > 0
    up_to_last = mask.flip(1).cumsum(1).flip(1) > 0
    filled = (after_first & up_to_last).to(mask.dtype)
    return replace(batch, response_mask=filled, response_lengths=filled.sum(1).long())


class PerShardMeanTrainer(PolicyTrainer):
    """The planted mistake: each rank normalizes its shard by the shard's own count (tokens, or
    sequences with a token in the shard), and the wrapper's average over ranks is kept."""

    def _loss_inputs(self, batch: TrainBatch):
        inputs = super()._loss_inputs(batch)
        mask = inputs.response_mask
        tokens = mask.sum() if self.cfg.aggregation == "token-mean" else (mask.sum(-1) > 0).sum()
        inputs.weights = inputs.weights / tokens.clamp(min=1)
        return inputs

    def _step_normalizer(self, state, sums) -> float:
        return float(state.num_microbatches * self.parallel.world_size)


class _ShiftAfterShard(Shard):
    """The planted mistake: labels and loss tensors shifted within the shard, across its chunk seam."""

    def loss_side(self, x: Tensor) -> Tensor:
        local = self._pad(self._row(x))[:, self.columns]
        return F.pad(local[:, 1:], (0, 1))


class ShiftAfterShardCP(ContextParallel):
    """Context parallelism with the shift-after-shard mistake planted in its shards."""

    def shard(self, batch: TrainBatch, packed: bool = False) -> Shard:
        return _ShiftAfterShard(self, batch, packed)


class DoubleCountCP(ContextParallel):
    """The planted mistake: counts taken on the unsharded rows by every CP rank, then summed over CP."""

    def counts(self, batch: TrainBatch, response_mask: Tensor) -> tuple[Tensor, Tensor]:
        return batch.response_mask.sum(), (batch.response_lengths > 0).sum().to(response_mask.dtype)


class ShardMeanCP(ContextParallel):
    """The planted mistake: each CP shard takes its own mean for the sequence ratio (GSPO)."""

    def reduce_shard_sums(self, local: Tensor) -> Tensor:
        return local


class UntruncatedCP(ContextParallel):
    """The planted mistake: shards score the tempered distribution without its top-k / top-p truncation."""

    def logprobs(self, model, shard, *, distribution=SampledDistribution(), **scoring):
        return super().logprobs(model, shard, distribution=SampledDistribution(distribution.temperature), **scoring)


def _causal_leak(module, query, key, value, attention_mask, context_parallel_columns=None, **kwargs):
    """The planted mistake: context-parallel attention whose query blocks each see one key past
    the causal boundary (a query sees the token it predicts)."""
    queries, keys = context_parallel_columns
    leaked = (queries + 1).clamp(max=len(keys) - 1)  # the row's last column has no key after it
    return context_parallel_attention(
        module, query, key, value, attention_mask, context_parallel_columns=(leaked, keys), **kwargs
    )


CAUSAL_LEAK = "asyncrl_causal_leak"
AttentionInterface.register(CAUSAL_LEAK, _causal_leak)


def _packed_leak(module, query, key, value, attention_mask, packed_segments=None, **kwargs):
    """The planted mistake: a packed row attended as one sequence, each segment seeing the ones
    before it."""
    return context_parallel_attention(module, query, key, value, attention_mask, **kwargs)


PACKED_LEAK = "asyncrl_packed_leak"
AttentionInterface.register(PACKED_LEAK, _packed_leak)
PLANTED_ATTENTION = {"cp-causal-leak": CAUSAL_LEAK, "packed-leak": PACKED_LEAK}


class UncompensatedParallel(ParallelContext):
    """The planted mistake: the wrapper's gradient average over ranks is left in place."""

    gradient_compensation = 1.0


@dataclass(frozen=True)
class LoraSettings:
    """The adapters of ``--lora``: every projection, rank 4, B drawn at random so that every adapter
    matrix has a gradient at the first step."""

    rank: int = 4
    alpha: float = 8.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _planted_model(model: torch.nn.Module, plant: str | None) -> torch.nn.Module:
    """The candidate's copy of the policy with a LoRA mistake planted: the frozen base left
    trainable, or each adapter's alpha / rank scaling applied twice."""
    model = copy.deepcopy(model)
    if plant == "lora-base-trainable":
        model.requires_grad_(True)
    if plant == "lora-double-scaling":
        for module in model.modules():
            if isinstance(getattr(module, "scaling", None), dict):
                module.scaling = {name: 2 * value for name, value in module.scaling.items()}
    return model


def _planted(parallel: ParallelContext, plant: str | None) -> ParallelContext:
    """The trainer ranks' context with ``plant`` swapped into its CP shards or its gradient sum."""
    if plant == "shift-after-shard":
        return replace(parallel, context=ShiftAfterShardCP(parallel.context.group))
    if plant == "double-count-tokens":
        return replace(parallel, context=DoubleCountCP(parallel.context.group))
    if plant == "cp-shard-mean":
        return replace(parallel, context=ShardMeanCP(parallel.context.group))
    if plant == "cp-untruncated":
        return replace(parallel, context=UntruncatedCP(parallel.context.group))
    if plant == "average-without-compensation":
        return UncompensatedParallel(parallel.mesh, parallel.ranks_mesh, parallel.wrap, parallel.context)
    return parallel


# ---- the problem -----------------------------------------------------------------------------


def random_batch(
    model: torch.nn.Module,
    *,
    num_groups: int,
    group_size: int,
    vocab_size: int,
    seed: int,
    distribution: SampledDistribution = SampledDistribution(),
) -> TrainBatch:
    """A ragged GRPO batch whose logprobs sit near the model's (under ``distribution``), so ratios
    straddle the clip range. Every other row is a multi-turn episode: an observation the
    environment appended sits inside its response, masked out of the loss and of its length."""
    gen = torch.Generator().manual_seed(seed)
    rows = num_groups * group_size
    prompt_lengths = torch.randint(2, 9, (num_groups,), generator=gen).repeat_interleave(group_size)
    response_lengths = torch.randint(1, 13, (rows,), generator=gen)
    width = int((prompt_lengths + response_lengths).max())
    input_ids = torch.randint(1, vocab_size, (rows, width), generator=gen)
    positions = torch.arange(width)
    ends = (prompt_lengths + response_lengths)[:, None]
    attention_mask = (positions < ends).long()
    response_mask = ((positions >= prompt_lengths[:, None]) & (positions < ends)).double()
    response_mask[::2] *= _observations(prompt_lengths[::2], response_lengths[::2], width, gen)
    input_ids = input_ids * attention_mask
    rewards = torch.randint(0, 3, (num_groups, group_size), generator=gen).double()
    advantages = grpo.group_advantages(rewards).reshape(-1)
    with torch.no_grad():
        logprobs, _ = token_logprobs(model, input_ids, attention_mask, distribution=distribution)

    def near(scale: float) -> Tensor:
        return (logprobs + scale * torch.randn(logprobs.shape, generator=gen, dtype=logprobs.dtype)) * response_mask

    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        behaviour_logprobs=near(0.3),
        advantages=advantages,
        response_lengths=response_mask.sum(1).long(),
        prox_logprobs=near(0.15),
        ref_logprobs=near(0.3),
    )


def _observations(prompt_lengths: Tensor, response_lengths: Tensor, width: int, gen: torch.Generator) -> Tensor:
    """0 on an observation span strictly inside each response of 3 or more tokens, 1 elsewhere."""
    positions = torch.arange(width)
    starts = prompt_lengths + 1 + (torch.rand(len(prompt_lengths), generator=gen) * 3).long()
    stops = torch.minimum(
        starts + 1 + (torch.rand(len(prompt_lengths), generator=gen) * 4).long(), prompt_lengths + response_lengths - 1
    )
    return ((positions < starts[:, None]) | (positions >= stops[:, None])).double()


def _uneven_sizes(rows: int, parts: int, gen: torch.Generator, *, at_least: int = 1) -> list[int]:
    """``parts`` random sizes of at least ``at_least`` summing to ``rows``."""
    spare = rows - parts * at_least
    cuts = sorted(torch.randperm(spare + parts - 1, generator=gen)[: parts - 1].tolist())
    return [b - a - 1 + at_least for a, b in zip([-1, *cuts], [*cuts, spare + parts - 1])]


def uneven_split(batch: TrainBatch, parts: int, gen: torch.Generator) -> list[TrainBatch]:
    """Shuffle rows, cut into ``parts`` micro-batches of random uneven sizes, shuffle their order."""
    rows = len(batch)
    if not 1 <= parts <= rows:
        raise ValueError(f"--micro-batches: {parts} must be between 1 and the batch's {rows} rows")
    sizes = _uneven_sizes(rows, parts, gen)
    micro = batch.select(torch.randperm(rows, generator=gen)).split(sizes)
    return [micro[i] for i in torch.randperm(parts, generator=gen).tolist()]


def rank_micro_batches(batch: TrainBatch, *, dp: int, dp_rank: int, micro_batches: int, seed: int) -> list[TrainBatch]:
    """DP rank ``dp_rank``'s micro-batches: an uneven share of the shuffled rows, split unevenly."""
    rows = len(batch)
    if dp * micro_batches > rows:
        raise ValueError(f"--micro-batches: {dp} ranks x {micro_batches} exceed the batch's {rows} rows")
    gen = torch.Generator().manual_seed(seed + 1)
    sizes = _uneven_sizes(rows, dp, gen, at_least=micro_batches)
    shares = batch.select(torch.randperm(rows, generator=gen)).split(sizes)
    return uneven_split(shares[dp_rank], micro_batches, torch.Generator().manual_seed(seed + 2 + dp_rank))


def build_problem(
    mode: str,
    dtype: torch.dtype,
    seed: int,
    vocab_size: int = 48,
    updates: int = 1,
    algorithm: str = "grpo",
    options: Options = (),
    lora: bool = False,
) -> tuple[torch.nn.Module, TrainBatch, Algorithm, TrainerConfig]:
    """(model, batch, algorithm, trainer config) of one check; the same for every process. The
    algorithm is ``algorithm`` with ``options`` over the options its factory declares for this check
    (``verify_options``: grpo's turn on its KL and entropy terms and truncated importance weights).
    ``lora``: the model is a frozen base with LoRA adapters (``LoraSettings``) drawn from ``seed``.

    With several updates the learning rate is large enough that the later updates' ratios leave
    the clip range (about 10% of tokens clipped at 2 updates), so the clip branches are exercised."""
    model = build_tiny_model(vocab_size, seed=seed, dtype=dtype, hidden_size=64, num_layers=2, intermediate_size=128)
    if lora:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = apply_lora(model, LoraSettings(), dtype, random_b=True)
    batch = random_batch(
        model, num_groups=NUM_GROUPS, group_size=GROUP_SIZE, vocab_size=vocab_size, seed=seed, distribution=DISTRIBUTION
    )
    trainer_cfg = TrainerConfig(
        aggregation=mode,
        norm_constant=16.0 if mode == "seq-mean-token-sum-norm" else None,
        lr=1e-3 if updates == 1 else 1e-2,
        max_grad_norm=1.0,
        dtype="float64" if dtype == torch.float64 else "float32",
        logprob_chunk_tokens=LOGPROB_CHUNK_TOKENS,
    )
    return model, batch, checked_algorithm(algorithm, options), trainer_cfg


def checked_algorithm(name: str, options: Options = ()) -> Algorithm:
    """The algorithm ``name`` (as ``algorithm.name`` takes it) with ``options`` over its ``verify_options``;
    a bad name or option is one ValueError naming ``--algorithm`` or ``--option``."""
    try:
        factory = resolve("algorithm", name, "--algorithm")
        merged = {**getattr(factory, "verify_options", {}), **dict(options)}
        return build_algorithm(RunConfig(algorithm={"name": name, "options": merged}))
    except ValidationError as err:
        raise ValueError(f"--algorithm: {err.errors()[0]['msg'].removeprefix('Value error, ')}") from None
    except ValueError as err:
        raise ValueError(
            str(err).replace("algorithm.options.", "--option ").replace("algorithm.name", "--algorithm")
        ) from None


def _trainer(cls: type[PolicyTrainer], model, algorithm, trainer_cfg, parallel=None, batch=None) -> PolicyTrainer:
    trainer = cls(
        copy.deepcopy(model),
        trainer_cfg,
        algorithm,
        total_steps=10,
        reference_model=copy.deepcopy(model) if algorithm.scoring.reference else None,
        parallel=parallel,
        distribution=DISTRIBUTION,
    )
    if batch is not None:
        trainer.step_counts = (batch.num_response_tokens, batch.num_sequences)
    return trainer


def minibatches(batch: TrainBatch, updates: int) -> list[TrainBatch]:
    """The step's groups (GROUP_SIZE consecutive rows each) cut into ``updates`` consecutive runs."""
    groups = [list(range(g * GROUP_SIZE, (g + 1) * GROUP_SIZE)) for g in range(len(batch) // GROUP_SIZE)]
    return [batch.select([row for group in run for row in group]) for run in split_evenly(groups, updates)]


def _train(trainer: PolicyTrainer, updates: list[list[TrainBatch]], *, score: str | None = None) -> StepOutcome:
    """One step of ``len(updates)`` updates, each over its micro-batches. ``score``: where proximal
    logprobs come from: None, the batch's own; "start", this trainer at step start (every
    micro-batch scored before the first update, as the trainer worker does); "each", the planted
    mistake of scoring each mini-batch with the weights its update starts from."""
    trainer.begin_train_step()
    if score == "start":
        for micros in updates:
            for micro in micros:
                micro.prox_logprobs = trainer.compute_logprobs(micro)
    for index, micros in enumerate(updates):
        for micro in micros:
            if score == "each":
                micro.prox_logprobs = trainer.compute_logprobs(micro)
            trainer.train_microbatch(micro)
        if index < len(updates) - 1:
            trainer.finish_update()
    return StepOutcome.of(trainer, trainer.finish_train_step())


def _scoring(updates: int, plant: str | None) -> str | None:
    if updates == 1:
        return None
    return "each" if plant == "recompute-proximal" else "start"


# ---- comparison ------------------------------------------------------------------------------

# Adam's first update, lr * g / (|g| + eps), is sign(g) wherever |g| >> eps, so a coordinate whose
# gradient is zero to within the tolerance has an update decided by rounding noise. Parameters are compared where the reference gradient exceeds this
# many tolerance bands, (rtol + atol) times the largest gradient of the model.
_UNDETERMINED_BAND = 10.0


def _relative(a: Tensor, b: Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    scale = a.abs().max().item()
    diff = (a - b).abs().max().item()
    return diff / scale if scale > 0 else diff


def _within(a: Tensor, b: Tensor, tol: Tolerance) -> bool:
    if a.numel() == 0:
        return True
    atol = tol.atol_frac * a.abs().max().item()
    return bool(((a - b).abs() <= tol.rtol * a.abs() + atol).all())


def _scalar_error(reference: float, value: float) -> float:
    return abs(value - reference) / max(abs(reference), 1e-30) if value != reference else 0.0


def compare(
    mode: str,
    reference: StepOutcome,
    candidate: StepOutcome,
    dtype: torch.dtype,
    case: Case | None = None,
    updates: int = 1,
) -> Comparison:
    """Errors of ``candidate`` against ``reference`` and whether they are within docs/loss.md.

    After several updates the weights each later update starts from carry the rounding of the ones
    before, so an element of a gradient or parameter near zero has no meaningful relative error of
    its own: tensors then also get an absolute tolerance of rtol times the tensor's largest value."""
    tol = TOLERANCES[dtype]
    tensor_tol = tol if updates == 1 else replace(tol, atol_frac=max(tol.atol_frac, tol.rtol))
    worst_grad, worst_param, tensors_ok = ("", 0.0), ("", 0.0), True
    for name in reference.params.keys() - reference.grads.keys():  # frozen: must not move at all
        moved = _relative(reference.params[name], candidate.params[name])
        tensors_ok &= moved == 0.0
        worst_param = max(worst_param, (name, moved), key=lambda x: x[1])
    largest_grad = max(g.abs().max().item() for g in reference.grads.values())
    for name, ref_grad in reference.grads.items():
        grad = candidate.grads[name]
        determined = ref_grad.abs() > _UNDETERMINED_BAND * (tol.rtol + tol.atol_frac) * largest_grad
        ref_updated, updated = reference.params[name][determined], candidate.params[name][determined]
        tensors_ok &= _within(ref_grad, grad, tensor_tol) and _within(ref_updated, updated, tensor_tol)
        worst_grad = max(worst_grad, (name, _relative(ref_grad, grad)), key=lambda x: x[1])
        worst_param = max(worst_param, (name, _relative(ref_updated, updated)), key=lambda x: x[1])
    worst_metric = ("", 0.0)
    for name, value in reference.metrics.items():
        error = _scalar_error(value, candidate.metrics.get(name, float("nan")))
        worst_metric = max(worst_metric, (name, error), key=lambda x: x[1])
    loss_err = _scalar_error(reference.loss, candidate.loss)
    norm_err = _scalar_error(reference.grad_norm, candidate.grad_norm)
    return Comparison(
        mode=mode,
        loss=reference.loss,
        loss_error=loss_err,
        grad_norm=reference.grad_norm,
        grad_norm_error=norm_err,
        worst_grad=worst_grad,
        worst_param=worst_param,
        worst_metric=worst_metric,
        passed=tensors_ok and loss_err <= tol.loss and norm_err <= tol.rtol and worst_metric[1] <= tol.loss,
        case=case,
    )


def _reference(
    mode: str,
    dtype: torch.dtype,
    seed: int,
    vocab_size: int = 48,
    updates: int = 1,
    algorithm: str = "grpo",
    options: Options = (),
    lora: bool = False,
) -> StepOutcome:
    """The monolithic step: each update is one micro-batch holding its whole mini-batch; with
    several updates, proximal logprobs are the whole batch's, scored at once at step start."""
    model, batch, algo, trainer_cfg = build_problem(mode, dtype, seed, vocab_size, updates, algorithm, options, lora)
    trainer = _trainer(PolicyTrainer, model, algo, trainer_cfg)
    if updates > 1:
        batch.prox_logprobs = trainer.compute_logprobs(batch)
    return _train(trainer, [[part] for part in minibatches(batch, updates)])


def _candidate_class(plant: str | None) -> type[PolicyTrainer]:
    return {
        "per-microbatch-mean": PerMicrobatchMeanTrainer,
        "per-shard-mean": PerShardMeanTrainer,
        "whole-step-normalizer": WholeStepNormalizerTrainer,
        "observation-trained": ObservationTrainedTrainer,
        "chunk-seam": ChunkSeamTrainer,
    }.get(plant, PolicyTrainer)


# ---- single process ----------------------------------------------------------------------------


def verify_mode(
    mode: str,
    *,
    micro_batches: int,
    dtype: torch.dtype,
    plant: Plant | None = None,
    seed: int = 0,
    vocab_size: int = 48,
    updates: int = 1,
    algorithm: str = "grpo",
    options: Options = (),
    lora: bool = False,
    packing: bool = False,
) -> Comparison:
    """Run reference and split steps for one aggregation mode, in this process, and compare them;
    ``packing``: the split step packs each micro-batch's rows into one."""
    torch.manual_seed(seed)
    model, batch, algo, trainer_cfg = build_problem(mode, dtype, seed, vocab_size, updates, algorithm, options, lora)
    trainer_cfg = trainer_cfg.model_copy(update={"packing": packing})
    candidate = _trainer(_candidate_class(plant), _planted_model(model, plant), algo, trainer_cfg, batch=batch)
    _plant_attention(candidate, plant)
    split = [
        uneven_split(part, min(micro_batches, len(part)), torch.Generator().manual_seed(seed + 1 + k))
        for k, part in enumerate(minibatches(batch, updates))
    ]
    outcome = _train(candidate, split, score=_scoring(updates, plant))
    reference = _reference(mode, dtype, seed, vocab_size, updates, algorithm, options, lora)
    return compare(mode, reference, outcome, dtype, updates=updates)


def _plant_attention(trainer: PolicyTrainer, plant: str | None) -> None:
    """The policy's attention swapped for a planted leak."""
    if plant in PLANTED_ATTENTION:
        trainer.model.set_attn_implementation(PLANTED_ATTENTION[plant])


# ---- dp x cp ranks -----------------------------------------------------------------------------


def _rank_check(
    rank: int, world_size: int, cases: list[Case], dp: int, cp: int, micro_batches: int, seed: int, updates: int
) -> bytes:
    """One rank of ``verify_parallel``: train every case's step; rank 0 returns the outcomes."""
    parallel = init_parallel(ParallelConfig(dp=dp, cp=cp))
    outcomes = []
    for case in cases:
        torch.manual_seed(seed)
        model, batch, algorithm, trainer_cfg = build_problem(
            case.mode, DTYPES[case.dtype], seed, 48, updates, case.algorithm, case.options, case.lora
        )
        planted = _planted(replace(parallel, wrap=case.wrap), case.plant)
        model = _planted_model(model, case.plant)
        trainer_cfg = trainer_cfg.model_copy(update={"packing": case.packing})
        trainer = _trainer(_candidate_class(case.plant), model, algorithm, trainer_cfg, planted, batch=batch)
        _plant_attention(trainer, case.plant)
        split = [
            rank_micro_batches(
                part, dp=dp, dp_rank=parallel.dp_rank, micro_batches=min(micro_batches, len(part) // dp), seed=seed + k
            )
            for k, part in enumerate(minibatches(batch, updates))
        ]
        outcomes.append((case, _train(trainer, split, score=_scoring(updates, case.plant))))
    buffer = io.BytesIO()
    torch.save(outcomes if rank == 0 else None, buffer)
    return buffer.getvalue()


def verify_parallel(
    cases: list[Case], *, dp: int, cp: int, micro_batches: int, seed: int = 0, updates: int = 1
) -> list[Comparison]:
    """Check every case on dp·cp local ranks (one launch) against the monolithic step here."""
    for case in cases:
        check_layout(dp, cp, micro_batches, [case.plant], updates, case.options, case.lora, case.packing)
        _check_choices(case.mode, case.dtype, case.plant)
        if case.wrap not in WRAPS:
            raise ValueError(f"--wrap: '{case.wrap}' is not one of {', '.join(WRAPS)}")
    payload = launch(_rank_check, dp * cp, cases, dp, cp, micro_batches, seed, updates)[0]
    outcomes = torch.load(io.BytesIO(payload), weights_only=False)
    references = {}
    comparisons = []
    for case, outcome in outcomes:
        key = (case.mode, case.dtype, case.algorithm, case.options, case.lora)
        if key not in references:
            references[key] = _reference(
                case.mode, DTYPES[case.dtype], seed, 48, updates, case.algorithm, case.options, case.lora
            )
        comparisons.append(compare(case.mode, references[key], outcome, DTYPES[case.dtype], case, updates))
    return comparisons


# ---- entry point -------------------------------------------------------------------------------


def _check_choices(mode: str, dtype: str, plant: str | None) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"--dtype: '{dtype}' is not one of {', '.join(DTYPES)}")
    if plant is not None and plant not in PLANTS:
        raise ValueError(f"--plant: '{plant}' is not one of {', '.join(PLANTS)}")
    if mode not in normalization.AGG_MODES:
        raise ValueError(f"--mode: '{mode}' is not one of {', '.join(normalization.AGG_MODES)}")


def check_layout(
    dp: int,
    cp: int,
    micro_batches: int,
    plants: list[str | None],
    updates: int = 1,
    options: Options = (),
    lora: bool = False,
    packing: bool = False,
) -> None:
    """Reject a launch this check cannot run; the message starts with the option it is about.

    With several updates each mini-batch is split into at most ``micro_batches`` micro-batches
    (per DP rank), fewer when it has fewer rows."""
    if not 1 <= updates <= NUM_GROUPS:
        raise ValueError(f"--updates: {updates} must be between 1 and the batch's {NUM_GROUPS} groups")
    if dp > GROUP_SIZE * (NUM_GROUPS // updates):
        raise ValueError(f"--dp: {dp} ranks cannot share a mini-batch of {GROUP_SIZE * (NUM_GROUPS // updates)} rows")
    if dp < 1 or cp < 1:
        raise ValueError(f"--dp: dp {dp} and cp {cp} must be at least 1")
    if dp * cp > MAX_RANKS:
        raise ValueError(f"--dp: dp*cp = {dp * cp} local ranks; at most {MAX_RANKS} are launched")
    if micro_batches < 1 or dp * micro_batches > BATCH_ROWS:
        raise ValueError(
            f"--micro-batches: {dp} ranks x {micro_batches} must be between 1 and the batch's {BATCH_ROWS} rows"
        )
    for plant in plants:
        if plant in CP_PLANTS and cp == 1:
            raise ValueError(f"--plant: {plant} is a context-parallel mistake; it needs --cp 2 or more")
        if plant in RANK_PLANTS and dp * cp == 1:
            raise ValueError(f"--plant: {plant} is a multi-rank mistake; it needs --dp or --cp 2 or more")
        if plant in UPDATE_PLANTS and updates == 1:
            raise ValueError(f"--plant: {plant} is a mistake of several updates per step; it needs --updates 2 or more")
        if plant in LORA_PLANTS and not lora:
            raise ValueError(f"--plant: {plant} is a mistake of a LoRA policy; it needs --lora")
        if plant in PACKING_PLANTS and not packing:
            raise ValueError(f"--plant: {plant} is a mistake of packed rows; it needs --packing")
        if plant == "cp-shard-mean" and dict(options).get("ratio_level") != "sequence":
            raise ValueError(
                f"--plant: {plant} is a mistake of grpo's sequence ratio; it needs --option ratio_level=sequence"
            )


def verify(
    modes: tuple[str, ...] = normalization.AGG_MODES,
    *,
    micro_batches: int = 4,
    dtype: str = "float64",
    plant: Plant | None = None,
    seed: int = 0,
    dp: int = 1,
    cp: int = 1,
    wrap: str = "fsdp",
    updates: int = 1,
    algorithm: str = "grpo",
    options: Mapping[str, Any] | None = None,
    lora: bool = False,
    packing: bool = False,
) -> list[Comparison]:
    """Compare split (and, with dp·cp > 1, parallel) steps with the monolithic one for each mode;
    with ``updates`` K > 1 a step is K mini-batch updates against logprobs scored at its start;
    ``lora``: the policy is a frozen base with LoRA adapters (``LoraSettings``); ``packing``: the
    split step packs each micro-batch's rows into one row (the monolithic step never does);
    ``algorithm`` and ``options``: the algorithm trained, any registered one (``checked_algorithm``)."""
    for mode in modes:
        _check_choices(mode, dtype, plant)
    pairs: Options = tuple(sorted((options or {}).items()))
    checked_algorithm(algorithm, pairs)  # a bad name or option, said before any rank starts
    if dp * cp > 1:
        cases = [Case(mode, dtype, plant, wrap, algorithm, pairs, lora, packing) for mode in modes]
        return verify_parallel(cases, dp=dp, cp=cp, micro_batches=micro_batches, seed=seed, updates=updates)
    check_layout(dp, cp, micro_batches, [plant], updates, pairs, lora, packing)
    return [
        verify_mode(
            mode,
            micro_batches=micro_batches,
            dtype=DTYPES[dtype],
            plant=plant,
            seed=seed,
            updates=updates,
            algorithm=algorithm,
            options=pairs,
            lora=lora,
            packing=packing,
        )
        for mode in modes
    ]
