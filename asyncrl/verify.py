"""``asyncrl verify``: prove on this machine that a split train step equals the monolithic one.

For every loss aggregation mode it builds a random tiny model and a random ragged batch (uneven
prompt and response lengths, off-policy behaviour logprobs, a KL reference and an entropy bonus,
so every loss term and clipping branch is exercised), then runs

    reference: train_step(whole batch)
    candidate: begin_train_step, train_microbatch over K uneven micro-batches of shuffled rows
               in shuffled order, finish_train_step

from identical copies and compares loss, gradient norm, every gradient and every updated parameter
against DESIGN 5's tolerances. Parameters are compared where the gradient determines their update
(see ``_UNDETERMINED_BAND``). ``plant`` swaps in a deliberate normalization mistake
so a user can see the check fail.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from asyncrl.algorithms import grpo
from asyncrl.config import LossConfig, TrainerConfig
from asyncrl.models import build_tiny_model, token_logprobs
from asyncrl.trainer import PolicyTrainer
from asyncrl.types import TrainBatch

Plant = Literal["per-microbatch-mean"]
PLANTS: tuple[str, ...] = ("per-microbatch-mean",)
DTYPES = {"float64": torch.float64, "float32": torch.float32}
NUM_GROUPS, GROUP_SIZE = 4, 4
BATCH_ROWS = NUM_GROUPS * GROUP_SIZE  # the most micro-batches a check can use


@dataclass(frozen=True)
class Tolerance:
    """DESIGN 5: relative error on the loss; rtol plus atol relative to the tensor's max for tensors."""

    loss: float
    rtol: float
    atol_frac: float


TOLERANCES = {
    torch.float64: Tolerance(loss=1e-9, rtol=1e-9, atol_frac=0.0),
    torch.float32: Tolerance(loss=1e-5, rtol=1e-4, atol_frac=1e-5),
}


@dataclass
class Comparison:
    """Split-versus-monolithic errors for one aggregation mode."""

    mode: str
    loss: float
    loss_error: float
    grad_norm: float
    grad_norm_error: float
    worst_grad: tuple[str, float]
    worst_param: tuple[str, float]
    passed: bool

    @property
    def worst_error(self) -> tuple[float, str]:
        """(largest relative error of this mode, what it was measured on)."""
        return max(
            (self.loss_error, "loss"),
            (self.grad_norm_error, "grad norm"),
            (self.worst_grad[1], f"gradient of {self.worst_grad[0]}"),
            (self.worst_param[1], f"updated {self.worst_param[0]}"),
        )


class PerMicrobatchMeanTrainer(PolicyTrainer):
    """The planted mistake: each micro-batch is normalized by its own count, then averaged."""

    def _local_weights(self, batch: TrainBatch) -> Tensor:
        own = grpo.step_normalizer(self.loss_cfg.mode, batch.num_response_tokens, batch.num_sequences)
        return super()._local_weights(batch) / own

    def _step_normalizer(self, state, sums) -> float:
        return float(state.num_microbatches)


def random_batch(model: torch.nn.Module, *, num_groups: int, group_size: int, vocab_size: int, seed: int) -> TrainBatch:
    """A ragged GRPO batch whose logprobs sit near the model's, so ratios straddle the clip range."""
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
    input_ids = input_ids * attention_mask
    rewards = torch.randint(0, 3, (num_groups, group_size), generator=gen).double()
    advantages = grpo.group_advantages(rewards).reshape(-1)
    with torch.no_grad():
        logprobs, _ = token_logprobs(model, input_ids, attention_mask)

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


def uneven_split(batch: TrainBatch, parts: int, gen: torch.Generator) -> list[TrainBatch]:
    """Shuffle rows, cut into ``parts`` micro-batches of random uneven sizes, shuffle their order."""
    rows = len(batch)
    if not 1 <= parts <= rows:
        raise ValueError(f"--micro-batches: {parts} must be between 1 and the batch's {rows} rows")
    cuts = sorted(torch.randperm(rows - 1, generator=gen)[: parts - 1].add(1).tolist())
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, rows])]
    shuffled = batch.select(torch.randperm(rows, generator=gen))
    micro = shuffled.split(sizes)
    return [micro[i] for i in torch.randperm(parts, generator=gen).tolist()]


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


def verify_mode(
    mode: str,
    *,
    micro_batches: int,
    dtype: torch.dtype,
    plant: Plant | None = None,
    seed: int = 0,
    vocab_size: int = 48,
) -> Comparison:
    """Run reference and split steps for one aggregation mode and compare them."""
    torch.manual_seed(seed)
    model = build_tiny_model(vocab_size, seed=seed, dtype=dtype, hidden_size=64, num_layers=2, intermediate_size=128)
    batch = random_batch(model, num_groups=NUM_GROUPS, group_size=GROUP_SIZE, vocab_size=vocab_size, seed=seed)
    loss_cfg = LossConfig(
        mode=mode,
        norm_constant=16.0 if mode == "seq-mean-token-sum-norm" else None,
        kl_coef=0.05,
        entropy_coef=0.01,
    )
    trainer_cfg = TrainerConfig(lr=1e-3, max_grad_norm=1.0, dtype="float64" if dtype == torch.float64 else "float32")

    def make(cls: type[PolicyTrainer]) -> PolicyTrainer:
        policy = copy.deepcopy(model)
        reference = copy.deepcopy(model)
        return cls(policy, trainer_cfg, loss_cfg, importance_sampling="tis", total_steps=10, reference_model=reference)

    reference_trainer = make(PolicyTrainer)
    ref_result = reference_trainer.train_step(batch)

    candidate = make(PerMicrobatchMeanTrainer if plant == "per-microbatch-mean" else PolicyTrainer)
    candidate.begin_train_step()
    for micro in uneven_split(batch, micro_batches, torch.Generator().manual_seed(seed + 1)):
        candidate.train_microbatch(micro)
    result = candidate.finish_train_step()

    tol = TOLERANCES[dtype]
    worst_grad, worst_param, tensors_ok = ("", 0.0), ("", 0.0), True
    ref_params = dict(reference_trainer.model.named_parameters())
    largest_grad = max(p.grad.abs().max().item() for p in ref_params.values())
    for name, param in candidate.model.named_parameters():
        ref = ref_params[name]
        grad_err = _relative(ref.grad, param.grad)
        determined = ref.grad.abs() > _UNDETERMINED_BAND * (tol.rtol + tol.atol_frac) * largest_grad
        ref_updated, updated = ref.detach()[determined], param.detach()[determined]
        param_err = _relative(ref_updated, updated)
        tensors_ok &= _within(ref.grad, param.grad, tol) and _within(ref_updated, updated, tol)
        worst_grad = max(worst_grad, (name, grad_err), key=lambda x: x[1])
        worst_param = max(worst_param, (name, param_err), key=lambda x: x[1])

    loss_err = abs(result.loss - ref_result.loss) / max(abs(ref_result.loss), 1e-30)
    norm_err = abs(result.grad_norm - ref_result.grad_norm) / max(ref_result.grad_norm, 1e-30)
    return Comparison(
        mode=mode,
        loss=ref_result.loss,
        loss_error=loss_err,
        grad_norm=ref_result.grad_norm,
        grad_norm_error=norm_err,
        worst_grad=worst_grad,
        worst_param=worst_param,
        passed=tensors_ok and loss_err <= tol.loss and norm_err <= tol.rtol,
    )


def verify(
    modes: tuple[str, ...] = grpo.AGG_MODES,
    *,
    micro_batches: int = 4,
    dtype: str = "float64",
    plant: Plant | None = None,
    seed: int = 0,
) -> list[Comparison]:
    """Compare split and monolithic steps for each mode; see ``verify_mode``."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype: '{dtype}' is not one of {', '.join(DTYPES)}")
    if plant is not None and plant not in PLANTS:
        raise ValueError(f"--plant: '{plant}' is not one of {', '.join(PLANTS)}")
    for mode in modes:
        if mode not in grpo.AGG_MODES:
            raise ValueError(f"--mode: '{mode}' is not one of {', '.join(grpo.AGG_MODES)}")
    return [
        verify_mode(mode, micro_batches=micro_batches, dtype=DTYPES[dtype], plant=plant, seed=seed) for mode in modes
    ]
