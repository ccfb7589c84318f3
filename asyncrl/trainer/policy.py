"""PolicyTrainer: the train step of the run's algorithm, split into begin / micro-batches / finish / abort.

Gradient convention, the single place the code writes it down (docs/loss.md explains it):
    every micro-batch back-propagates the *unnormalized* sum  sum_t local_w * mask * loss_t,
    gradients are SUMMED over micro-batches (autograd accumulation) and over data- and
    context-parallel ranks, and ``finish_train_step`` divides them exactly once by the step-global
    normalizer D (N response tokens for token-mean, G sequences otherwise) before clipping.
No micro-batch ever divides by a local count, so any split, in any order, gives the same step.
With ``parallel`` (trainer/parallel.py) the counts behind D are summed over ranks in ``finish``,
and the wrapper's gradient averaging is undone there in the same multiplication as 1/D.

Exception safety: nothing persistent changes before ``optimizer.step()`` at the very end of
``finish_train_step`` (and a step whose loss or gradient is not finite never gets there). Until
then the only step state is gradients, the accumulators below and the RNG, all of which
``abort_train_step`` resets, so a failed step can simply be rerun.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from asyncrl.algorithms import Algorithm, build_algorithm
from asyncrl.config import RunConfig, TrainerConfig
from asyncrl.models import SampledDistribution, token_logprobs
from asyncrl.models.attention import use_autocast_attention
from asyncrl.models.factory import DTYPES
from asyncrl.models.logprobs import OutputHead, check_packing, chunk_tokens_for
from asyncrl.models.lora import adapter_dropout, adapter_seed, adapter_tensors, apply_lora, is_lora
from asyncrl.trainer import normalization
from asyncrl.trainer.context_parallel import enable_context_parallel_attention
from asyncrl.trainer.optim import build_optimizer, build_scheduler
from asyncrl.trainer.recompute import checkpoint_activations
from asyncrl.trainer.snapshot import StepSnapshot
from asyncrl.types import StepResult, TokenLossInputs, TrainBatch

if TYPE_CHECKING:
    from asyncrl.trainer.parallel import ParallelContext

# trainer.dtype values that are a compute dtype only: parameters and optimizer state stay float32.
_LOW_PRECISION = {"bfloat16": torch.bfloat16}


class StepInProgressError(RuntimeError):
    """begin_train_step was called while a step is open (or a step method without one)."""


# Step counters accumulate in one float64 vector (summed over micro-batches, later over ranks, in
# one collective): the loss sum, the counts behind D, the entropy's masked sum, then the masked sum
# of each metric the algorithm declares (``PolicyTrainer.counters``).
_COUNTS = ("loss_sum", "num_tokens", "num_sequences", "entropy_sum")


@dataclass
class _StepState:
    """Accumulators of the open step; sums only, so the order of micro-batches does not matter."""

    step: int
    rng_state: dict[str, Tensor]
    sums: Tensor
    low: Tensor  # the smallest value of each ranged metric (``PolicyTrainer.ranged``)
    high: Tensor  # and the largest
    num_microbatches: int = 0  # since the last update
    expected: tuple[int, int] | None = None  # (tokens, sequences) of the groups since the last update, if told
    updates: list[_Update] = field(default_factory=list)


@dataclass
class _Update:
    """One optimizer update of a step, on its own micro-batches."""

    loss: float
    grad_norm: float
    lr: float
    totals: Tensor  # the counters, summed over ranks
    extremes: tuple[Tensor, Tensor]  # (low, high) of the ranged metrics, over ranks
    num_microbatches: int
    skipped: bool  # non-finite: not applied
    empty: bool  # no response token: nothing to apply
    count_error: float = 0.0  # relative difference of the summed counts from the expected ones

    @property
    def taken(self) -> bool:
        return not (self.skipped or self.empty)


class PolicyTrainer:
    """Owns the policy, its optimizer and schedule, and the weight version V (optimizer steps taken)."""

    def __init__(
        self,
        model: nn.Module,
        trainer_cfg: TrainerConfig,
        algorithm: Algorithm,
        *,
        total_steps: int,
        reference_model: nn.Module | None = None,
        parallel: ParallelContext | None = None,
        distribution: SampledDistribution = SampledDistribution(),
    ) -> None:
        """``algorithm``: advantages and the per-token loss (asyncrl/algorithms); the trainer scores
        what its ``scoring`` asks for, aggregates its loss by ``trainer.aggregation`` and reduces the
        metrics it declares, whatever their names.

        ``parallel``: this rank's place among the trainer ranks; the policy is wrapped (FSDP2 or
        DDP) and both models get context-parallel attention. Every rank then makes the same calls.

        ``distribution``: the generator's temperature, top-k and top-p; every score (policy,
        proximal, reference, entropy) is under that distribution, so on-policy ratios are 1.
        With ``trainer.dtype`` bfloat16 the parameters and AdamW state are float32 masters (a
        lower-precision model is upcast) and only the forward and backward run in bfloat16: FSDP2
        casts the gathered parameters (MixedPrecisionPolicy), otherwise autocast does. Both models
        stay in eval mode: the loss forward scores with dropout off, like the proximal logprobs,
        so an on-policy ratio is exactly 1."""
        if algorithm.scoring.reference and reference_model is None:
            raise ValueError("algorithm: its loss scores against a reference, but no reference model was given")
        if distribution.temperature <= 0:
            raise ValueError(f"temperature: must be > 0, got {distribution.temperature}")
        self.distribution = distribution
        self.forward_dtype = _LOW_PRECISION.get(trainer_cfg.dtype)
        self.parallel = parallel
        self.model = model = self._prepare(
            model, reference_model, trainer_cfg.activation_checkpointing, trainer_cfg.packing
        )
        self.reference_model = reference_model
        self.cfg = trainer_cfg
        self.algorithm = algorithm
        self.counters = (*_COUNTS, *(f"{name}_sum" for name in algorithm.metrics))
        self.ranged = tuple(name for name, keys in algorithm.metrics.items() if keys.low or keys.high)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.params, trainer_cfg)
        self.scheduler = build_scheduler(self.optimizer, trainer_cfg, total_steps)
        self.version = 0
        self._step: _StepState | None = None
        self._step_start = StepSnapshot(self.device)  # taken before a step's first of several updates
        # called with (count error, evidence, step) before every update that was told its counts;
        # it raises to refuse the update (the integrity guard's loss_counts promise)
        self.count_check: Callable[[float, str, int], object] | None = None

    def _prepare(
        self, model: nn.Module, reference_model: nn.Module | None, recompute: bool, packing: bool
    ) -> nn.Module:
        """The policy as it trains: both models upcast to float32 masters and in eval mode, with the
        attention that keeps packed sequences apart if ``packing``, the policy's blocks recomputed in
        the backward if ``recompute``, both wrapped for the ranks, the reference frozen; decides
        whether autocast runs the forward (not where FSDP2 casts)."""
        for m in (model, reference_model):
            if m is not None:
                m.eval()  # the probe below draws no dropout randomness
                OutputHead(m).check(m)  # refuses, before any step, a head the chunked scoring cannot reproduce
                _upcast_low_precision(m)
        if packing:
            for m in (model, reference_model):
                if m is not None:
                    enable_context_parallel_attention(m)  # the one kernel that keeps packed sequences apart
            check_packing(model)
        if recompute:
            checkpoint_activations(model)
        self._autocast = self.forward_dtype is not None
        if self._autocast:
            for m in (model, reference_model):
                if m is not None:
                    use_autocast_attention(m)  # a no-op where FSDP2 casts the parameters instead
        if self.parallel is not None:
            model = self.parallel.parallelize(model, reference_model, mixed_precision=self.forward_dtype)
            self._autocast = self._autocast and not self.parallel.casts_parameters
        if reference_model is not None:
            reference_model.requires_grad_(False)
        return model

    @classmethod
    def from_config(
        cls,
        config: RunConfig,
        model: nn.Module,
        parallel: ParallelContext | None = None,
        algorithm: Algorithm | None = None,
    ) -> PolicyTrainer:
        """The trainer a run config describes; a KL penalty gets a frozen copy of ``model``.
        With ``lora.rank`` > 0, ``model`` becomes the frozen base of LoRA adapters (in place,
        models/lora.py), drawn from the run's ``seed`` and ``model.init_seed`` alone, so every
        runtime starts from the same adapters; the reference is that base.

        ``parallel``: this rank's context from ``trainer.parallel.start_rank(config.parallel, ...)``;
        ``algorithm``: the run's, built once per process (``RunParts``); None builds the config's."""
        if algorithm is None:
            algorithm = build_algorithm(config)
        reference = copy.deepcopy(model).requires_grad_(False) if algorithm.scoring.reference else None
        if config.lora.rank > 0:
            if reference is not None:
                reference.to(DTYPES[config.trainer.dtype])
            seed = adapter_seed(config.seed, config.model.init_seed)
            model = apply_lora(model, config.lora, DTYPES[config.trainer.dtype], seed=seed)
        return cls(
            model,
            config.trainer,
            algorithm,
            total_steps=config.step.max_steps,
            reference_model=reference,
            parallel=parallel,
            distribution=SampledDistribution(
                config.scoring_temperature, config.generation.top_k, config.generation.top_p
            ),
        )

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    @property
    def compute_dtype(self) -> torch.dtype:
        """Loss arithmetic runs in float64 for a float64 model, float32 otherwise."""
        return torch.float64 if self.params[0].dtype == torch.float64 else torch.float32

    @property
    def scores_in_any_precision(self) -> bool:
        """Whether ``compute_logprobs`` can run in another precision than the trainer's: not where
        FSDP2 casts the parameters."""
        return self.parallel is None or not self.parallel.casts_parameters

    def _forward(self, precision: torch.dtype | None = None) -> contextlib.AbstractContextManager:
        """Where a model forward runs: under autocast to ``forward_dtype`` when nothing else casts,
        or to ``precision`` (float32: no autocast) where given."""
        if precision is not None:
            if precision == torch.float32:
                return contextlib.nullcontext()
            return torch.autocast(self.device.type, dtype=precision)
        if not self._autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.forward_dtype)

    # ---- the split step -------------------------------------------------------------------

    def begin_train_step(self, step: int | None = None) -> None:
        """Open step ``step`` (defaults to, and must equal, the current version)."""
        if self._step is not None:
            raise StepInProgressError(f"begin_train_step: step {self._step.step} is still open")
        step = self.version if step is None else step
        if step != self.version:
            raise ValueError(f"begin_train_step: step {step} does not match trainer version {self.version}")
        self.optimizer.zero_grad(set_to_none=True)
        self._step = _StepState(
            step=step,
            rng_state=self._rng_state(),
            sums=torch.zeros(len(self.counters), dtype=torch.float64, device=self.device),
            low=torch.full((len(self.ranged),), float("inf"), dtype=torch.float64, device=self.device),
            high=torch.full((len(self.ranged),), float("-inf"), dtype=torch.float64, device=self.device),
        )

    def train_microbatch(self, batch: TrainBatch) -> dict[str, Tensor]:
        """Forward + backward of one micro-batch; gradients accumulate, nothing is stepped."""
        state = self._require_step("train_microbatch")
        batch = batch.to(self.device, self.compute_dtype)
        loss_sum, counters, (low, high) = self._microbatch_loss(batch)
        loss_sum.backward()
        state.sums += counters
        state.low = torch.minimum(state.low, low)
        state.high = torch.maximum(state.high, high)
        state.num_microbatches += 1
        return {"loss_sum": counters[0], "num_tokens": counters[1]}

    def expect_counts(self, tokens: int, sequences: int) -> None:
        """The response tokens and sequences the micro-batches trained next hold, over every rank,
        counted from their groups: the next update checks its summed counts against them."""
        state = self._require_step("expect_counts")
        before = state.expected or (0, 0)
        state.expected = (before[0] + tokens, before[1] + sequences)

    def finish_update(self) -> None:
        """One optimizer update on the micro-batches trained since the step began or since its last
        update, normalized by their own D; the step stays open for its next mini-batch (docs/loss.md,
        "Several updates per step"). The weights and optimizer state at step start are kept, off the
        training device (trainer/snapshot.py), until the step finishes, so ``abort_train_step``
        still restores them exactly."""
        state = self._require_step("finish_update")
        if not self._step_start.taken:
            self._step_start.save(self.params, self.optimizer)
        self._update(state)
        self.optimizer.zero_grad(set_to_none=True)

    def finish_train_step(self) -> StepResult:
        """The step's last update, then V += 1 and one step of the LR schedule.

        Each update normalizes once by its own D, clips and steps the optimizer. A non-finite loss
        or gradient norm skips that update (weights and optimizer untouched; the result says
        ``skipped``), and so does a mini-batch without a response token (every group filtered out):
        V still advances because the step's data is spent."""
        state = self._require_step("finish_train_step")
        self._update(state)
        if any(update.taken for update in state.updates):
            self.scheduler.step()
        self.version += 1
        self._step = None
        self._step_start.discard()
        return self._step_result(state.updates)

    def _update(self, state: _StepState) -> None:
        """Normalize the accumulated gradients once by D, clip, step; then reset the accumulators."""
        totals, extremes = self._step_totals(state)
        sums = dict(zip(self.counters, totals.tolist()))
        count_error = self._check_counts(state, sums)
        lr = self.optimizer.param_groups[0]["lr"]
        if sums["num_tokens"] == 0:
            self.optimizer.zero_grad(set_to_none=True)
            loss, grad_norm, skipped = float("nan"), float("nan"), False
        else:
            normalizer = self._step_normalizer(state, sums)
            grads = [p.grad for p in self.params if p.grad is not None]
            compensation = 1.0 if self.parallel is None else self.parallel.gradient_compensation
            torch._foreach_mul_(grads, compensation / normalizer)
            max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm is not None else float("inf")
            grad_norm = float(_full(torch.nn.utils.clip_grad_norm_(self.params, max_norm, foreach=True)))
            loss = sums["loss_sum"] / normalizer
            skipped = not (math.isfinite(grad_norm) and math.isfinite(sums["loss_sum"]))
            if skipped:
                self.optimizer.zero_grad(set_to_none=True)
            else:
                self.optimizer.step()
        state.updates.append(
            _Update(
                loss,
                grad_norm,
                lr,
                totals,
                extremes,
                state.num_microbatches,
                skipped,
                sums["num_tokens"] == 0,
                count_error,
            )
        )
        state.expected = None
        state.sums = torch.zeros_like(state.sums)
        state.low = torch.full_like(state.low, float("inf"))
        state.high = torch.full_like(state.high, float("-inf"))
        state.num_microbatches = 0

    def _check_counts(self, state: _StepState, sums: dict[str, float]) -> float:
        """The update's counts, summed over micro-batches and ranks (one collective, the step's
        own), against its groups': a loss counted twice or not at all shows here. 0 when untold."""
        if state.expected is None:
            return 0.0
        tokens, sequences = state.expected
        error = max(
            abs(sums["num_tokens"] - tokens) / max(tokens, 1),
            abs(sums["num_sequences"] - sequences) / max(sequences, 1),
        )
        if self.count_check is not None:
            evidence = (
                f"the loss summed {sums['num_tokens']:.0f} response tokens in {sums['num_sequences']:.0f} sequences "
                f"over its micro-batches and ranks, but the groups trained hold {tokens} in {sequences}"
            )
            self.count_check(error, evidence, state.step)
        return error

    def _step_result(self, updates: list[_Update]) -> StepResult:
        """The step's updates in one result: loss and gradient norm are means over the updates that
        had tokens, counts and metrics are (sum, count) over every update."""
        totals = updates[0].totals
        for update in updates[1:]:
            totals = totals + update.totals
        sums = dict(zip(self.counters, totals.tolist()))
        extremes = (
            torch.stack([update.extremes[0] for update in updates]).amin(0),
            torch.stack([update.extremes[1] for update in updates]).amax(0),
        )
        scored = [update for update in updates if not update.empty]
        return StepResult(
            version=self.version,
            loss=sum(u.loss for u in scored) / len(scored) if scored else float("nan"),
            grad_norm=sum(u.grad_norm for u in scored) / len(scored) if scored else float("nan"),
            lr=updates[0].lr,
            num_sequences=round(sums["num_sequences"]),
            num_tokens=round(sums["num_tokens"]),
            num_microbatches=sum(update.num_microbatches for update in updates),
            metrics=self._reduce_metrics(extremes, sums),
            skipped=any(update.skipped for update in updates),
            num_updates=sum(update.taken for update in updates),
            count_error=max(update.count_error for update in updates),
        )

    def abort_train_step(self) -> None:
        """Drop the open step (idempotent): gradients, accumulators and RNG go back to step start."""
        if self._step is not None:
            self._set_rng_state(self._step.rng_state)
            if self._step_start.taken:
                self._step_start.restore(self.params, self.optimizer)
        self._step_start.discard()
        self.optimizer.zero_grad(set_to_none=True)
        self._step = None

    def train_step(self, batch: TrainBatch) -> StepResult:
        """The monolithic reference: one micro-batch holding the whole step."""
        self.begin_train_step()
        try:
            self.train_microbatch(batch)
            return self.finish_train_step()
        except BaseException:
            self.abort_train_step()
            raise

    @property
    def step_open(self) -> bool:
        return self._step is not None

    # ---- loss -------------------------------------------------------------------------------

    def _microbatch_loss(self, batch: TrainBatch) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
        """(sum of local_w * mask * loss, this micro-batch's counters, (low, high) of the ranged
        metrics over its response tokens)."""
        inputs = self._loss_inputs(batch)
        loss, metrics = self.algorithm.token_loss(inputs)
        if metrics.keys() != self.algorithm.metrics.keys():
            raise ValueError(
                f"algorithm: its loss returned the metrics {sorted(metrics)}, but it declares {sorted(self.algorithm.metrics)}"
            )
        mask = inputs.response_mask
        loss_sum = (inputs.weights * loss).sum()
        entropy_sum = (inputs.entropy.detach() * mask).sum() if inputs.entropy is not None else mask.new_zeros(())
        counters = torch.stack(
            [
                loss_sum.detach(),
                inputs.num_tokens,
                inputs.num_sequences,
                entropy_sum,
                *((metrics[name] * mask).sum() for name in self.algorithm.metrics),
            ]
        ).double()
        ranged = [metrics[name].double() for name in self.ranged]
        low = [value.where(mask > 0, float("inf")).min() for value in ranged]
        high = [value.where(mask > 0, float("-inf")).max() for value in ranged]
        empty = counters.new_zeros(0)
        return loss_sum, counters, (torch.stack(low) if low else empty, torch.stack(high) if high else empty)

    def _loss_inputs(self, batch: TrainBatch) -> TokenLossInputs:
        """Score the micro-batch: whole rows here, this rank's shard under context parallelism."""
        scoring = {
            "with_entropy": self.scores_entropy,
            "entropy_grad": self.algorithm.scoring.entropy,
            "distribution": self.distribution,
            "chunk_tokens": chunk_tokens_for(self.cfg.logprob_chunk_tokens, self.device),
            "packed": self.cfg.packing,
        }
        weights = self._local_weights(batch)
        context = None if self.parallel is None else self.parallel.context
        with self._forward(), adapter_dropout(self.model):
            if context is not None:
                return context.loss_inputs(self.model, batch, weights, **scoring)
            logprobs, entropy = token_logprobs(self.model, batch.input_ids, batch.attention_mask, **scoring)
        mask = batch.response_mask
        return TokenLossInputs(
            logprobs=logprobs,
            entropy=entropy,
            old_logprobs=batch.prox_logprobs,
            behaviour_logprobs=batch.behaviour_logprobs,
            advantages=batch.advantages[:, None],
            ref_logprobs=batch.ref_logprobs,
            response_mask=mask,
            weights=weights,
            num_tokens=mask.sum(),
            num_sequences=(batch.response_lengths > 0).sum().to(mask.dtype),
        )

    def _local_weights(self, batch: TrainBatch) -> Tensor:
        """Per-token weights that depend only on each sequence (docs/loss.md); no local counts."""
        return normalization.local_token_weights(
            batch.response_mask, batch.response_lengths, self.cfg.aggregation, self.cfg.norm_constant
        )

    def _step_normalizer(self, state: _StepState, sums: dict[str, float]) -> float:
        """D, the one divisor of the step, from counts summed over every micro-batch."""
        return normalization.step_normalizer(self.cfg.aggregation, sums["num_tokens"], sums["num_sequences"])

    def _step_totals(self, state: _StepState) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """The step's counters and the ranged metrics' (low, high), over every rank when there are several."""
        if self.parallel is None:
            return state.sums, (state.low, state.high)
        return self.parallel.reduce_step(state.sums, state.low, state.high)

    @property
    def scores_entropy(self) -> bool:
        """Whether the policy's entropy is scored: the algorithm's loss uses it, or ``trainer.track_entropy``."""
        return self.algorithm.scoring.entropy or self.cfg.track_entropy

    def _reduce_metrics(self, extremes: tuple[Tensor, Tensor], sums: dict[str, float]) -> dict[str, float | None]:
        """Each declared metric's mean over the step's response tokens under its key, and the ranged
        ones' smallest and largest value (None without a token); the entropy's mean where scored."""
        tokens = max(sums["num_tokens"], 1.0)
        metrics: dict[str, float | None] = {}
        if self.scores_entropy:
            metrics["entropy"] = sums["entropy_sum"] / tokens
        for name, keys in self.algorithm.metrics.items():
            metrics[keys.mean] = sums[f"{name}_sum"] / tokens
        for index, name in enumerate(self.ranged):
            keys = self.algorithm.metrics[name]
            for key, value in ((keys.low, extremes[0][index]), (keys.high, extremes[1][index])):
                if key is not None:
                    metrics[key] = float(value) if sums["num_tokens"] else None
        return metrics

    def _require_step(self, method: str) -> _StepState:
        if self._step is None:
            raise StepInProgressError(f"{method}: no open step; call begin_train_step first")
        return self._step

    # ---- logprobs, weights, checkpoints ---------------------------------------------------

    @torch.no_grad()
    def compute_logprobs(
        self,
        batch: TrainBatch,
        *,
        reference: bool = False,
        micro_batch_size: int | None = None,
        precision: torch.dtype | None = None,
    ) -> Tensor:
        """Per-token logprobs of ``batch`` under the policy (proximal) or the frozen reference.

        Aligned with ``input_ids`` like every per-token tensor, and 0 on padding. ``precision``:
        the forward's compute dtype instead of the trainer's, where ``scores_in_any_precision``
        (the sampling probe measures what half precision's rounding moves).
        """
        model = self.reference_model if reference else self.model
        if model is None:
            raise ValueError("compute_logprobs: no reference model (the algorithm's scoring asks for none)")
        if precision is not None and not self.scores_in_any_precision:
            raise ValueError("compute_logprobs: FSDP2 casts the parameters; the forward has no other precision")
        size = micro_batch_size or self.cfg.micro_batch_size
        scoring = {
            "distribution": self.distribution,
            "chunk_tokens": chunk_tokens_for(self.cfg.logprob_chunk_tokens, self.device),
            "packed": self.cfg.packing,
        }
        width = batch.input_ids.shape[1]
        chunks = []
        context = None if self.parallel is None else self.parallel.context
        for part in batch.micro_batches(size):
            part = part.to(self.device, self.compute_dtype)
            with self._forward(precision):
                if context is not None:
                    logprobs = context.full_logprobs(model, part, **scoring)
                else:
                    logprobs, _ = token_logprobs(model, part.input_ids, part.attention_mask, **scoring)
            logprobs = logprobs * part.attention_mask
            chunks.append(torch.nn.functional.pad(logprobs, (0, width - logprobs.shape[1])))
        return torch.cat(chunks).cpu()

    def export_weights(self, *, copy: bool = True, device: str | None = "cpu") -> tuple[int, dict[str, Tensor]]:
        """(version, the policy weights as detached tensors on ``device``) for the generators, in
        the compute dtype (bfloat16 masters' copies when ``trainer.dtype`` is bfloat16).

        ``device=None`` leaves them where they are (a GPU-to-GPU broadcast sends them from there).
        ``copy=False`` returns views where the weights are already whole tensors of that dtype on
        ``device``: no new memory to allocate and fill, but they change with the next optimizer
        step, so the caller must be done with them by then. Sharded (FSDP) weights are gathered
        whole one tensor at a time, so every rank must call it; only the first rank keeps them,
        the others return an empty dict. A LoRA policy exports its adapter alone, under PEFT's names
        and in its own float32 (or float64) dtype (models/lora.py)."""
        keep = self.parallel is None or self.parallel.rank == 0
        state = self.model.state_dict()
        lora = is_lora(self.model)
        cast = None if lora else self.forward_dtype
        weights = {}
        for name, value in (adapter_tensors(self.model, state) if lora else state).items():
            whole = _full(value).detach()
            if keep:
                dtype = cast if cast is not None and whole.is_floating_point() else whole.dtype
                weights[name] = whole.to(device or whole.device, dtype=dtype, copy=copy)
        return self.version, weights

    def state_dict(self) -> dict:
        """Everything a resumed run needs to continue bit-identically."""
        if self._step is not None:
            raise StepInProgressError("state_dict: cannot checkpoint inside an open step")
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "version": self.version,
            "rng_state": self._rng_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.abort_train_step()
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = int(state["version"])
        self._set_rng_state(state["rng_state"])

    def _rng_state(self) -> dict[str, Tensor]:
        """The generators a step may draw from (dropout): the CPU one, and the trainer's GPU."""
        state = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def _set_rng_state(self, state: dict[str, Tensor]) -> None:
        torch.set_rng_state(state["cpu"])
        if "cuda" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], self.device)


def _upcast_low_precision(model: nn.Module) -> None:
    """float32 masters for a model whose parameters were loaded in a lower precision. A model with
    frozen parameters (a LoRA base) keeps them as they are: only what trains needs a master."""
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    if not any(p.is_floating_point() and p.dtype in (torch.bfloat16, torch.float16) for p in trainable):
        return
    if len(trainable) == len(params):
        model.float()
        return
    for p in trainable:
        p.data = p.data.float()


def _full(tensor: Tensor) -> Tensor:
    """The whole tensor behind a sharded or replicated DTensor (a collective); others as they are."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
