"""The data contract between modules: Rollout -> RolloutGroup -> TrainBatch -> TokenLossInputs,
and what workers report back (RolloutBatch, EvalResult, StepReport). Every type that crosses a
boundary lives here, so the control side names them without importing a worker module.

Token layout, shared by every tensor below: a row is ``prompt + response`` followed by right
padding. Per-token tensors are aligned with ``input_ids``: position t describes token t, so
``behaviour_logprobs[i, t]`` is log p(token t | tokens < t) under the generator and is 0 where
``response_mask`` is 0. Labels are shifted once, on the full sequence, inside the trainer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace

import torch
from torch import Tensor

from asyncrl.data.prompts import Prompt


@dataclass(frozen=True)
class RolloutJob:
    """One admitted prompt, controller -> rollout worker: its buffer slot and the sampler's stamps."""

    slot_id: int
    prompt: Prompt
    start_version: int
    target_step: int | None
    retries: int = 0


@dataclass
class Rollout:
    """One sampled completion, as the generator returns it (plain Python, not yet tensorized)."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    reward: float = 0.0
    versions: list[int] | None = None  # weight version that sampled each response token; None: one version
    loss_mask: list[int] | None = None  # 1: sampled, trained; 0: an observation the environment appended. None: all 1

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("Rollout.prompt_ids: a prompt needs at least one token")
        for name in ("logprobs", "versions", "loss_mask"):
            values = getattr(self, name)
            if values is not None and len(values) != len(self.response_ids):
                raise ValueError(f"Rollout.{name}: {len(values)} values for {len(self.response_ids)} response tokens")


@dataclass
class RolloutGroup:
    """The n samples of one prompt, tensorized by the producer before it commits to the buffer."""

    prompt_uid: str
    input_ids: Tensor  # [n, T] int64
    attention_mask: Tensor  # [n, T] int64, 1 on real tokens
    response_mask: Tensor  # [n, T] float32, 1 on response tokens
    behaviour_logprobs: Tensor  # [n, T] float32
    rewards: Tensor  # [n] float32
    finish_reasons: list[str]
    start_version: int
    end_version: int
    target_step: int | None = None
    correct: Tensor | None = None  # [n] float32, 1 where the sample's answer was judged correct
    reward_errors: int = 0  # reward calls that raised while scoring this group
    reward_timeouts: int = 0  # reward calls that ran past their timeout
    retries: int = 0  # failed generation attempts before this group was produced
    informative: bool | None = None  # the run's algorithm's judgement (Algorithm.informative); None: see below
    token_versions: Tensor | None = None  # [n, T] int64 version that sampled each trained token, -1 elsewhere
    episode_metrics: dict[str, float] = field(default_factory=dict)  # multi-turn episodes: sums over the samples
    samples: list[dict] = field(default_factory=list)  # transcripts of its first samples (asyncrl/samples.py)

    def __post_init__(self) -> None:
        n, t = self.input_ids.shape
        for name in ("attention_mask", "response_mask", "behaviour_logprobs", "token_versions"):
            if getattr(self, name) is not None and tuple(getattr(self, name).shape) != (n, t):
                raise ValueError(f"RolloutGroup.{name}: shape {tuple(getattr(self, name).shape)} != {(n, t)}")
        for name in ("rewards", "correct"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (n,):
                raise ValueError(f"RolloutGroup.{name}: shape {tuple(value.shape)} != {(n,)}")
        if len(self.finish_reasons) != n:
            raise ValueError(f"RolloutGroup.finish_reasons: {len(self.finish_reasons)} reasons for {n} samples")
        if self.end_version < self.start_version:
            raise ValueError("RolloutGroup.end_version: earlier than start_version")
        if self.informative is None:  # built by hand, or read from a checkpoint older than the flag
            self.informative = bool((self.rewards != self.rewards[:1]).any())  # GRPO's test: unequal rewards

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_tokens(self) -> int:
        """Response tokens over the group's samples (the bookkeeping needs no token tensors)."""
        return int(self.response_mask.sum())

    @property
    def row_response_tokens(self) -> list[int]:
        """Response tokens of each sample: what the loss counts for it (0: it adds no sequence)."""
        return self.response_mask.sum(1).round().long().tolist()

    @property
    def oldest_token_version(self) -> int:
        """The oldest weight version that sampled one of the group's trained tokens (its start
        version where tokens carry none): what the staleness bound holds the group to."""
        if self.token_versions is None:
            return self.start_version
        sampled = self.token_versions[self.token_versions >= 0]
        return int(sampled.min()) if sampled.numel() else self.start_version

    @property
    def sequence_lengths(self) -> list[int]:
        """Real tokens of each sample, prompt and response: what a token budget counts."""
        return self.attention_mask.sum(1).tolist()

    def state_dict(self) -> dict:
        """Tensors and plain Python only, so a checkpoint loads with ``torch.load(weights_only=True)``."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_state_dict(cls, state: dict) -> RolloutGroup:
        return cls(**state)

    @classmethod
    def from_rollouts(
        cls,
        prompt_uid: str,
        rollouts: Sequence[Rollout],
        *,
        pad_id: int,
        start_version: int,
        end_version: int | None = None,
        target_step: int | None = None,
    ) -> RolloutGroup:
        """Right-pad the samples of one prompt into ``[n, T]`` tensors; a rollout's ``loss_mask``
        becomes its row of ``response_mask`` (observation tokens: 0, out of the loss and its counts)."""
        if not rollouts:
            raise ValueError("RolloutGroup.from_rollouts: a group needs at least one rollout")
        width = max(len(r.prompt_ids) + len(r.response_ids) for r in rollouts)
        n = len(rollouts)
        input_ids = torch.full((n, width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((n, width), dtype=torch.long)
        response_mask = torch.zeros((n, width), dtype=torch.float32)
        logprobs = torch.zeros((n, width), dtype=torch.float32)
        versions = None if all(r.versions is None for r in rollouts) else torch.full((n, width), -1)
        for i, r in enumerate(rollouts):
            p, length = len(r.prompt_ids), len(r.prompt_ids) + len(r.response_ids)
            input_ids[i, :length] = torch.tensor(r.prompt_ids + r.response_ids, dtype=torch.long)
            attention_mask[i, :length] = 1
            mask = torch.ones(length - p) if r.loss_mask is None else torch.tensor(r.loss_mask, dtype=torch.float32)
            response_mask[i, p:length] = mask
            logprobs[i, p:length] = torch.tensor(r.logprobs, dtype=torch.float32) * mask
            if versions is not None:
                sampled = torch.tensor(r.versions or [start_version] * (length - p))
                versions[i, p:length] = sampled.where(mask > 0, -1)
        return cls(
            prompt_uid=prompt_uid,
            input_ids=input_ids,
            attention_mask=attention_mask,
            response_mask=response_mask,
            behaviour_logprobs=logprobs,
            rewards=torch.tensor([r.reward for r in rollouts], dtype=torch.float32),
            finish_reasons=[r.finish_reason for r in rollouts],
            start_version=start_version,
            end_version=start_version if end_version is None else end_version,
            target_step=target_step,
            token_versions=versions,
        )


def _pad_right(t: Tensor, width: int, value: float = 0) -> Tensor:
    if t.shape[1] == width:
        return t
    pad = torch.full((t.shape[0], width - t.shape[1]), value, dtype=t.dtype)
    return torch.cat([t, pad], dim=1)


@dataclass
class TrainBatch:
    """Sequences of one train step (or a slice of it), with everything the loss needs.

    ``response_lengths`` is counted on the full sequence when the batch is built and travels with
    every slice, so a micro-batch or a context-parallel shard never recounts it locally.
    Rows with ``response_lengths == 0`` are padding and carry zero loss weight.
    """

    input_ids: Tensor  # [B, T] int64
    attention_mask: Tensor  # [B, T] int64
    response_mask: Tensor  # [B, T] float
    behaviour_logprobs: Tensor  # [B, T] float
    advantages: Tensor  # [B] float
    response_lengths: Tensor  # [B] int64
    prox_logprobs: Tensor | None = None  # [B, T] trainer logprobs at step start (None: use detached)
    ref_logprobs: Tensor | None = None  # [B, T] frozen reference logprobs (for the KL term)
    versions: Tensor | None = None  # [B] int64 start_version of each row's group; zeros if not given

    def __post_init__(self) -> None:
        b, t = self.input_ids.shape
        if self.versions is None:
            self.versions = torch.zeros(b, dtype=torch.long)
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            expected = (b,) if f.name in ("advantages", "response_lengths", "versions") else (b, t)
            if tuple(value.shape) != expected:
                raise ValueError(f"TrainBatch.{f.name}: shape {tuple(value.shape)} != {expected}")

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_sequences(self) -> int:
        """Real (non-padding) sequences: G in the loss normalization contract."""
        return int((self.response_lengths > 0).sum())

    @property
    def num_response_tokens(self) -> int:
        """Response tokens in this slice: its share of N in the normalization contract."""
        return int(self.response_mask.sum())

    @classmethod
    def from_groups(cls, groups: Sequence[RolloutGroup], advantages: Sequence[Tensor]) -> TrainBatch:
        """Concatenate groups (right-padding to a common width) with their per-sample advantages."""
        if len(groups) != len(advantages):
            raise ValueError(f"TrainBatch.from_groups: {len(groups)} groups but {len(advantages)} advantage rows")
        width = max(g.input_ids.shape[1] for g in groups)

        def cat(name: str) -> Tensor:
            return torch.cat([_pad_right(getattr(g, name), width) for g in groups])

        response_mask = cat("response_mask")
        return cls(
            input_ids=cat("input_ids"),
            attention_mask=cat("attention_mask"),
            response_mask=response_mask,
            behaviour_logprobs=cat("behaviour_logprobs"),
            advantages=torch.cat([a.to(torch.float32).reshape(-1) for a in advantages]),
            response_lengths=response_mask.sum(dim=1).round().long(),
            versions=torch.cat([torch.full((g.size,), g.start_version, dtype=torch.long) for g in groups]),
        )

    @classmethod
    def concat(cls, batches: Sequence[TrainBatch]) -> TrainBatch:
        """Stack rows of several batches, right-padding to the widest."""
        if not batches:
            raise ValueError("TrainBatch.concat: no batches")
        width = max(b.input_ids.shape[1] for b in batches)
        values = {}
        for f in fields(cls):
            parts = [getattr(b, f.name) for b in batches]
            if any(p is None for p in parts):
                if not all(p is None for p in parts):
                    raise ValueError(f"TrainBatch.concat: {f.name} is set in some batches only")
                continue
            values[f.name] = torch.cat([p if p.dim() == 1 else _pad_right(p, width) for p in parts])
        return cls(**values)

    def map_tensors(self, fn) -> TrainBatch:
        """Apply ``fn(name, tensor)`` to every tensor field."""
        return replace(
            self,
            **{f.name: fn(f.name, getattr(self, f.name)) for f in fields(self) if getattr(self, f.name) is not None},
        )

    def select(self, index: Tensor | Sequence[int]) -> TrainBatch:
        """Rows by index, trimmed to the longest selected row."""
        index = torch.as_tensor(index, dtype=torch.long)
        return self.map_tensors(lambda _, t: t[index]).trim()

    def split(self, sizes: Sequence[int]) -> list[TrainBatch]:
        """Consecutive slices of the given row counts (uneven splits allowed)."""
        if sum(sizes) != len(self) or any(s <= 0 for s in sizes):
            raise ValueError(f"TrainBatch.split: sizes {list(sizes)} do not partition {len(self)} rows")
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [self.select(range(s, s + n)) for s, n in zip(starts, sizes)]

    def micro_batches(self, max_size: int) -> list[TrainBatch]:
        """Split into micro-batches of at most ``max_size`` rows."""
        if max_size <= 0:
            raise ValueError("TrainBatch.micro_batches: max_size must be positive")
        sizes = [min(max_size, len(self) - s) for s in range(0, len(self), max_size)]
        return self.split(sizes)

    def trim(self) -> TrainBatch:
        """Drop trailing columns that are padding in every row."""
        real_columns = self.attention_mask.any(dim=0).nonzero()
        width = int(real_columns.max()) + 1 if len(real_columns) else 0
        if width == self.input_ids.shape[1]:
            return self
        return self.map_tensors(lambda name, t: t if t.dim() == 1 else t[:, :width])

    def to(self, device: torch.device | str, float_dtype: torch.dtype | None = None) -> TrainBatch:
        """Move to ``device``; cast floating tensors to ``float_dtype`` when given."""

        def move(_: str, t: Tensor) -> Tensor:
            if float_dtype is not None and t.is_floating_point():
                return t.to(device=device, dtype=float_dtype)
            return t.to(device)

        return self.map_tensors(move)


def row_sum(values: Tensor) -> Tensor:
    """Each token's sequence sum, on one rank of unpacked rows: the whole row is here."""
    return values.sum(-1, keepdim=True).expand_as(values)


@dataclass
class TokenLossInputs:
    """The per-token tensors of one micro-batch (or one context-parallel shard of it), in one
    layout; the loss is elementwise, so the layout only orders sums. Counts are this piece's share."""

    logprobs: Tensor
    entropy: Tensor | None
    old_logprobs: Tensor | None  # None: the detached logprobs (on-policy)
    behaviour_logprobs: Tensor
    advantages: Tensor  # broadcastable to logprobs
    ref_logprobs: Tensor | None
    response_mask: Tensor
    weights: Tensor  # local_it * m_it
    num_tokens: Tensor
    num_sequences: Tensor
    sequence_sum: Callable[[Tensor], Tensor] = row_sum  # each token's sum over its whole sequence


# ---- what workers report back to the controller -----------------------------------------------


@dataclass
class RolloutBatch:
    """The groups of one generation call, in job order, and what it cost. ``failed``: the jobs
    (by slot) whose environment kept failing past the retries, with the error; they have no group."""

    groups: list[RolloutGroup]
    num_tokens: int
    seconds: float
    failed: dict[int, Exception] = field(default_factory=dict)


@dataclass(frozen=True)
class EvalResult:
    num_prompts: int
    accuracy: float
    reward_mean: float
    response_length_mean: float
    seconds: float
    samples: list[dict] = field(default_factory=list)  # transcripts of the first prompts (asyncrl/samples.py)
    episode_metrics: dict[str, float] = field(default_factory=dict)  # mean per episode; {} single-turn


@dataclass
class StepResult:
    """What one optimizer step reports; every mean is a global sum over a global count."""

    version: int
    loss: float
    grad_norm: float
    lr: float
    num_sequences: int
    num_tokens: int
    num_microbatches: int
    metrics: dict[str, float | None] = field(default_factory=dict)  # by record key: the entropy, the algorithm's
    skipped: bool = False  # non-finite loss or gradient: no update, but the step (and its data) is used up
    count_error: float = 0.0  # largest relative difference of an update's summed counts from its groups' (integrity)
    num_updates: int = 1  # optimizer updates applied (K mini-batches: up to K); skipped and empty ones are not


@dataclass
class StepData:
    """What a step was trained on, summed over its chunks (the controller turns it into metrics).

    Built from group metadata only (no token tensors), so every rank counts the whole step."""

    num_groups: int = 0
    num_filtered_groups: int = 0
    num_failed_groups: int = 0  # left out of the loss: a reward failed (integrity.failures)
    num_refill_groups: int = 0  # of num_groups, replacements for filtered groups (set by the controller)
    num_samples: int = 0
    num_scored_samples: int = 0  # of them, in groups that did not fail: what reward and accuracy average over
    num_zero_variance_groups: int = 0  # groups the algorithm judged uninformative, filtered or not
    num_turns: float = 0.0  # model turns: an episode's, or one per single-turn sample
    num_turns_cut: float = 0.0  # of them, cut by the generator at generation.max_new_tokens
    reward_sum: float = 0.0
    reward_sq_sum: float = 0.0
    num_correct: float = 0.0
    response_tokens: int = 0
    reward_errors: int = 0
    reward_timeouts: int = 0
    rollout_retries: int = 0
    lag_histogram: Counter = field(default_factory=Counter)
    episode_metrics: Counter = field(default_factory=Counter)  # multi-turn episodes: sums over the samples
    groups: list[dict] = field(default_factory=list)  # one record per group, for groups.jsonl
    samples: list[dict] = field(default_factory=list)  # the groups' sample transcripts, for samples.jsonl

    def add(self, group: RolloutGroup, version: int, advantages: Tensor | None = None, *, failed: bool = False) -> None:
        """Count ``group``, trained at ``version``; ``advantages``: its samples', None when it was
        filtered out or ``failed`` (a reward raised: left out of the loss, and out of the reward and
        accuracy means, where a 0 it never scored would pull them down)."""
        self.num_groups += 1
        self.num_samples += group.size
        self.num_zero_variance_groups += not group.informative
        if "turns" in group.episode_metrics:
            self.num_turns += group.episode_metrics["turns"]
            self.num_turns_cut += group.episode_metrics.get("turns_cut", 0.0)
        else:
            self.num_turns += group.size
            self.num_turns_cut += group.finish_reasons.count("length")
        if not failed:
            self.num_scored_samples += group.size
            self.reward_sum += float(group.rewards.double().sum())
            self.reward_sq_sum += float(group.rewards.double().square().sum())
            if group.correct is not None:
                self.num_correct += float(group.correct.sum())
        self.response_tokens += group.response_tokens
        self.reward_errors += group.reward_errors
        self.reward_timeouts += group.reward_timeouts
        self.rollout_retries += group.retries
        self.lag_histogram[version - group.start_version] += 1
        self.episode_metrics.update(group.episode_metrics)
        self.groups.append(
            {
                "step": version + 1,
                "prompt_uid": group.prompt_uid,
                "target_step": group.target_step,
                "start_version": group.start_version,
                "end_version": group.end_version,
                "trained_at": version,
                "lag": version - group.start_version,
                "reward_mean": float(group.rewards.mean()),
                "num_correct": float(group.correct.sum()) if group.correct is not None else None,
                "failed": failed,
            }
        )
        for sample in group.samples:
            advantage = None if advantages is None else float(advantages[sample["sample"]])
            self.samples.append(
                {"step": version + 1, "split": "train", **sample, "advantage": advantage, "failed": failed}
            )


@dataclass
class StepReport:
    result: StepResult
    data: StepData


@dataclass(frozen=True)
class ProbeGap:
    """The sampling probe scored: the absolute gap between the generator's and the trainer's
    logprob of each sampled token, its mean and max over the probe's ``tokens``; ``noise``, the
    mean gap between the trainer's own scores of them in bfloat16 and in float32 (None where it
    cannot score in both: FSDP2 casts its parameters)."""

    mean: float
    max: float
    tokens: int
    noise: float | None = None


@dataclass(frozen=True)
class SyncReport:
    """One weight sync (control/weight_sync.py): how long the gate stayed closed, how the weights
    moved, and what each generator serves after it."""

    version: int
    pause_s: float  # gate closed: no new rollouts admitted
    transfer_s: float  # export from the trainer + load into every generator
    bytes: int
    transport: str  # in_process, object_store or broadcast (runtime/ray.py); failed, interrupted: see failed()
    # What each generator serves after its load (None: cannot tell), and what the trainer exported,
    # by dtype (weights/fingerprint.py): the evidence the integrity guard's ``weights`` check reads.
    served: tuple[str | None, ...] = ()
    exported: Mapping[str, str] = field(default_factory=dict)

    def fingerprint_mismatches(self) -> list[int]:
        """The generators whose fingerprint is not the export's in the dtype they hold it in."""
        return [
            index
            for index, served in enumerate(self.served)
            if served is not None and self.exported.get(served.split(":", 1)[0]) != served  # "<dtype>:<hex>"
        ]

    @classmethod
    def failed(cls, held_version: int, seconds: float, transport: str = "failed") -> SyncReport:
        """A sync that stopped the run (it ``failed``, or a signal ``interrupted`` it): the step
        before it is still logged, with this in its place."""
        return cls(version=held_version, pause_s=seconds, transfer_s=seconds, bytes=0, transport=transport)
