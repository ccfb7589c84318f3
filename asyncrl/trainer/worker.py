"""TrainerWorker: the trainer side of the controller's protocol, on one rank or on several.

The controller streams a step to it in chunks of groups. The worker turns each chunk into
advantages and packs the sequences into micro-batches of ``trainer.micro_batch_size`` in the
order received (a partial micro-batch waits for the next chunk), then runs the split step. With
``trainer.micro_batch_tokens`` a micro-batch also closes before its real tokens would pass that
budget (a longer sequence trains alone), so long and short sequences cost a micro-batch alike. So
micro-batch composition depends only on the order of the groups, never on how the step happened
to be chunked: the same groups in the same order give a bit-identical step.

With ``step.num_minibatches`` K or ``num_epochs`` E above 1 the worker collects the step instead,
and ``finish_step`` cuts its groups into K mini-batches of consecutive groups, packs each the same
way, scores every micro-batch once with the weights at step start (the proximal logprobs every
update's ratio is taken against), then trains the mini-batches E times over, one optimizer update
each (docs/loss.md, "When the clip acts"). The first pass takes the mini-batches in the order
their groups arrived; every later pass in its own order, drawn from the run seed, the step and the
pass, so every rank, a rerun and a resumed run draw the same.

On several trainer ranks (trainer/parallel.py) every rank receives every group, in the same order,
and packs the same micro-batches; global micro-batch m is trained by DP rank m % dp (its cp ranks
each take their shard of it). Ranks train in rounds of dp micro-batches: a round runs once all of
its micro-batches are full, and the step's last round takes whatever is left. A rank that has no
micro-batch in a round trains a padding micro-batch of zero weight instead, so every rank makes the
same forward and backward calls, which FSDP and the context-parallel attention run collectives in.
Packing and the step's bookkeeping (StepData) read only a group's metadata, and a group's tensors
are fetched (``RemoteGroup.fetch()``, a group held in an object store) only by the ranks whose
micro-batches hold its sequences, so rank 0 reports the whole step while fetching only its share.

A stop does not wait for the step in flight on a single rank: ``abandon`` (an unordered
method, run beside the queued calls) makes the running forward or backward raise at its next
module (models/abandon.py), so the ``abort_step`` queued behind it runs within seconds whatever a
micro-batch costs. Several ranks are not abandoned that way, since one rank leaving a collective
its peers are in would hang them: they finish the call in flight first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from asyncrl.checkpoint import read_weights, save_checkpoint
from asyncrl.config import IntegrityConfig, StepConfig
from asyncrl.generation.base import sample_seed
from asyncrl.integrity import IntegrityGuard
from asyncrl.models.abandon import AbandonSwitch
from asyncrl.models.lora import check_base, is_lora, read_adapter, save_adapter
from asyncrl.trainer.policy import PolicyTrainer
from asyncrl.types import ProbeGap, RolloutGroup, StepData, StepReport, TrainBatch
from asyncrl.weights.fingerprint import HELD_DTYPES, Sample, sample

# Whole tensors, gathered from every rank onto rank 0's CPU (the other ranks get empty dicts).
_FULL_ON_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)
# Whole tensors in, each rank keeping its own shard of them.
_FULL_INTO_SHARDS = StateDictOptions(full_state_dict=True, strict=False)


@dataclass
class _Rows:
    """Consecutive sequences [start, stop) of one group, inside one micro-batch."""

    group: Any  # a RolloutGroup, or a RemoteGroup whose tensors come from fetch()
    advantages: Tensor  # the whole group's
    start: int
    stop: int


MicroBatch = list[_Rows]


class TrainerWorker:
    def __init__(
        self,
        trainer: PolicyTrainer,
        step_cfg: StepConfig,
        tokenizer,
        *,
        rank: int = 0,
        seed: int = 0,
        integrity: IntegrityConfig | None = None,
    ) -> None:
        """``rank``: this trainer rank's place among all of them; rank 0 writes checkpoints and
        returns the exported weights. Its DP rank and the DP size come from ``trainer.parallel``.
        ``seed``: the run seed, which orders the mini-batches of every pass after the first.
        ``integrity``: the run's integrity section; with the guard on, a group whose reward failed
        is never trained, every update checks that its loss counted its groups' tokens and
        sequences once, and each export is fingerprinted (docs/integrity.md)."""
        self.trainer = trainer
        self.guarded = integrity is not None and integrity.enabled
        self.fingerprints = self.guarded  # a sample of each export, for the weight sync's check
        if self.guarded:
            guard = IntegrityGuard(integrity)
            trainer.count_check = partial(_check_loss_counts, guard)
        self.tokenizer = tokenizer
        self.step_cfg = step_cfg
        self.rank = rank
        self.seed = seed
        self.dp = 1 if trainer.parallel is None else trainer.parallel.dp
        self.dp_rank = 0 if trainer.parallel is None else trainer.parallel.dp_rank
        self.micro_batch_size = trainer.cfg.micro_batch_size
        self.micro_batch_tokens = trainer.cfg.micro_batch_tokens
        # K mini-batches or E passes: the step is collected first, then trained update by update
        self.collect = step_cfg.num_minibatches * step_cfg.num_epochs > 1
        self.exported: Sample | None = None  # a sample of the last weights exported (rank 0)
        self._switch: AbandonSwitch | None = None
        if trainer.parallel is None or trainer.parallel.dp * trainer.parallel.cp == 1:
            self._switch = AbandonSwitch("the train step")
            self._switch.attach(trainer.model)
        self.unordered_methods = ("abandon",)
        self._reset_step()

    def _reset_step(self) -> None:
        self._data = StepData()
        self._full: list[MicroBatch] = []  # full micro-batches waiting for their round
        self._partial: MicroBatch = []
        self._partial_rows = 0
        self._partial_tokens = 0
        self._num_microbatches = 0  # of the whole step, trained on some rank
        self._fetched: dict[int, RolloutGroup] = {}  # id(remote group) -> its tensors, while needed
        self._collected: list[tuple[Any, Tensor]] = []  # (group, advantages) of a collected step

    @property
    def version(self) -> int:
        return self.trainer.version

    def begin_step(self, step: int) -> None:
        if self._switch is not None:
            self._switch.clear()
        self.trainer.begin_train_step(step)
        self._reset_step()

    def _watched(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if self._switch is None else self._switch.watching()

    def train_groups(self, groups: Sequence[RolloutGroup]) -> int:
        """Add a chunk of the step; trains every full round. Returns sequences received so far."""
        with self._watched():
            return self._train_groups(groups)

    def _train_groups(self, groups: Sequence[RolloutGroup]) -> int:
        for group in groups:
            failed = self.guarded and bool(group.reward_errors)  # a failure is never trained as a number
            filtered = not failed and self.step_cfg.filter_zero_variance and not group.informative
            advantages = None if failed or filtered else self.trainer.algorithm.advantages(group.rewards)
            self._data.add(group, self.trainer.version, advantages, failed=failed)
            if failed:
                self._data.num_failed_groups += 1
                continue
            if filtered:
                self._data.num_filtered_groups += 1
                continue
            if self.collect:
                self._collected.append((group, advantages))
            else:
                self._pack(group, advantages)
        while len(self._full) >= self.dp:
            self._train_round(self._full[: self.dp])
            del self._full[: self.dp]
        return self._data.num_samples

    def finish_step(self) -> StepReport:
        """Train the last round (what is left, the partial micro-batch included), then normalize,
        clip and step (V += 1). The result counts the micro-batches of the whole step."""
        with self._watched():
            if self.collect:
                self._train_minibatches()
            else:
                last_round = self._full + ([self._partial] if self._partial else [])
                if last_round:
                    self._train_round(last_round)
        result = self.trainer.finish_train_step()
        report = StepReport(result=replace(result, num_microbatches=self._num_microbatches), data=self._data)
        self._reset_step()
        return report

    def abort_step(self) -> None:
        self.trainer.abort_train_step()
        self._reset_step()
        if self._switch is not None:
            self._switch.clear()

    def abandon(self) -> None:
        """Make the call in flight on this single rank drop its step at its next module; the
        ``abort_step`` that follows puts the step back (several ranks: nothing, see above)."""
        if self._switch is not None:
            self._switch.set()

    def export_weights(self, device: str | None = "cpu") -> tuple[int, dict[str, Tensor]]:
        """(version, whole weights on ``device``, None: where they are) on rank 0; other ranks
        take part in the gathers and return none.

        Weights already on ``device`` are views, valid until the next step: the weight sync loads
        them into every generator (or serializes or copies them) before the trainer steps again."""
        version, weights = self.trainer.export_weights(copy=False, device=device)
        if self.rank != 0:
            return version, {}
        self.exported = sample(weights) if self.fingerprints else None
        return version, weights

    def exported_fingerprints(self, dtypes: Sequence[str]) -> dict[str, str]:
        """The fingerprint of the last weights exported (weights/fingerprint.py) in each of
        ``dtypes``, those the generators hold them in: the weight sync compares each generator's
        with its dtype's."""
        if self.exported is None:
            return {}
        return {dtype: self.exported.digest(dtype) for dtype in dtypes if dtype in HELD_DTYPES}

    @torch.no_grad()
    def probe_gap(self, group: RolloutGroup) -> ProbeGap:
        """How far the generator's logprobs of the probe's sampled tokens are from this policy's,
        scored as every step scores (``generation``'s temperature, top-k and top-p). Every rank
        scores the whole probe: sharded and context-parallel forwards need them all. Its
        ``noise`` is what bfloat16's rounding alone moves this policy's own scores of the same
        tokens: the bound a half-precision generator is held to is a multiple of it."""
        batch = TrainBatch.from_groups([group], [torch.zeros(group.size)])
        scored = self.trainer.compute_logprobs(batch).to(torch.float64)
        mask = batch.response_mask.to(torch.float64)
        gaps = (scored - batch.behaviour_logprobs.to(torch.float64)).abs() * mask
        tokens = int(mask.sum())
        noise = None
        if self.trainer.scores_in_any_precision:
            half, full = (self.trainer.compute_logprobs(batch, precision=p) for p in (torch.bfloat16, torch.float32))
            noise = float(((half.double() - full.double()).abs() * mask).sum()) / max(tokens, 1)
        return ProbeGap(mean=float(gaps.sum()) / max(tokens, 1), max=float(gaps.max()), tokens=tokens, noise=noise)

    def save_checkpoint(self, run_dir: str, step: int, run_state: dict, keep_last: int) -> Path | None:
        """The whole policy as an HF model (a LoRA policy: its adapter in PEFT's format), the
        tokenizer, and the trainer state next to ``run_state``.

        Every rank takes part in gathering whole weights and optimizer state; rank 0 writes them
        and returns the checkpoint directory, the others return None. The optimizer state is keyed
        by parameter name, so any dp × cp layout can load it."""
        model = self.trainer.model
        weights = get_model_state_dict(model, options=_FULL_ON_RANK0)
        optimizer = get_optimizer_state_dict(model, self.trainer.optimizer, options=_FULL_ON_RANK0)
        if self.rank != 0:
            return None
        trainer_state = {**self.trainer.state_dict(), "optimizer": optimizer}
        trainer_state.pop("model")  # saved as model.safetensors, or a LoRA policy's adapter alone
        if is_lora(model):
            write_model = partial(save_adapter, model, state=weights)
        else:
            write_model = partial(model.save_pretrained, state_dict=weights, safe_serialization=True)
        return save_checkpoint(
            run_dir,
            step,
            write_model=write_model,
            tokenizer=self.tokenizer,
            state={"trainer": trainer_state, "run": run_state},
            keep_last=keep_last,
        )

    def load_checkpoint(self, checkpoint_dir: str | Path, trainer_state: dict) -> None:
        """Load a checkpoint written by any layout; every rank calls it and keeps its own shards."""
        checkpoint_dir = Path(checkpoint_dir)
        model, optimizer = self.trainer.model, self.trainer.optimizer
        if is_lora(model):  # the adapter alone, over the base this run built: checked to be the saved one
            base = get_model_state_dict(model, options=_FULL_ON_RANK0)
            if self.rank == 0:
                check_base(base, checkpoint_dir)
            weights = read_adapter(model, checkpoint_dir)
        else:
            weights = read_weights(model, checkpoint_dir)
            _check_weight_names(model, weights.keys(), checkpoint_dir)
        set_model_state_dict(model, weights, options=_FULL_INTO_SHARDS)
        set_optimizer_state_dict(model, optimizer, trainer_state["optimizer"], options=_FULL_INTO_SHARDS)
        # the rest of the trainer state (schedule, version, RNG); weights and moments are in place
        self.trainer.load_state_dict(
            {**trainer_state, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
        )

    # ---- several updates per step ----------------------------------------------------------------

    def _train_minibatches(self) -> None:
        """K mini-batches of consecutive groups, E passes, one update each (the last is left to
        ``finish_train_step``). Every micro-batch is scored first, with the weights at step start:
        those proximal logprobs are what every update's ratio is taken against."""
        rounds = [self._rounds_of(part) for part in split_evenly(self._collected, self.step_cfg.num_minibatches)]
        batches = [[self._scored(self._round_batches(round_)) for round_ in minibatch] for minibatch in rounds]
        self._fetched.clear()
        updates = [
            (rounds[k], batches[k])
            for epoch in range(self.step_cfg.num_epochs)
            for k in self._pass_order(epoch, len(rounds))
        ]
        for index, (minibatch_rounds, minibatch_batches) in enumerate(updates):
            for round_, round_batches in zip(minibatch_rounds, minibatch_batches):
                self._num_microbatches += len(round_)
                self._expect_counts(rows for micro_batch in round_ for rows in micro_batch)
                for batch in round_batches:
                    self.trainer.train_microbatch(batch)
            if index < len(updates) - 1:
                self.trainer.finish_update()

    def _pass_order(self, epoch: int, count: int) -> list[int]:
        """The order pass ``epoch`` takes the ``count`` mini-batches in: as they arrived in the first
        pass, then a permutation seeded by the run seed, the step and the pass."""
        if epoch == 0:
            return list(range(count))
        seed = sample_seed(self.seed, f"minibatch-order:{self.trainer.version}", epoch)
        return torch.randperm(count, generator=torch.Generator().manual_seed(seed)).tolist()

    def _rounds_of(self, items: list[tuple[Any, Tensor]]) -> list[list[MicroBatch]]:
        """The rounds of dp micro-batches that ``items`` pack into, packed as a streamed step would be."""
        for group, advantages in items:
            self._pack(group, advantages)
        packed = self._full + ([self._partial] if self._partial else [])
        self._full, self._partial, self._partial_rows, self._partial_tokens = [], [], 0, 0
        return [packed[start : start + self.dp] for start in range(0, len(packed), self.dp)]

    def _scored(self, batches: list[TrainBatch]) -> list[TrainBatch]:
        """Proximal (and reference) logprobs of this rank's batches, once, before any update."""
        for batch in batches:
            batch.prox_logprobs = self.trainer.compute_logprobs(batch)
            if self.trainer.reference_model is not None:
                batch.ref_logprobs = self.trainer.compute_logprobs(batch, reference=True)
        return batches

    # ---- packing and rounds -------------------------------------------------------------------

    def _pack(self, group: RolloutGroup, advantages: Tensor) -> None:
        """Append the group's sequences to the micro-batches, in order: a micro-batch is full at
        ``micro_batch_size`` sequences, and closes before a sequence that would take its real tokens
        past ``micro_batch_tokens``. A streamed step's update must count every row packed here
        (a collected step's updates are told theirs as they train them)."""
        if not self.collect:
            self._expect_counts([_Rows(group, advantages, 0, group.size)])
        lengths = group.sequence_lengths if self.micro_batch_tokens is not None else [0] * group.size
        for index, tokens in enumerate(lengths):
            if self._partial and self._over_budget(tokens):
                self._close_partial()
            last = self._partial[-1] if self._partial else None
            if last is not None and last.group is group and last.stop == index:
                last.stop += 1
            else:
                self._partial.append(_Rows(group, advantages, index, index + 1))
            self._partial_rows += 1
            self._partial_tokens += tokens
            if self._partial_rows == self.micro_batch_size:
                self._close_partial()

    def _over_budget(self, tokens: int) -> bool:
        return self.micro_batch_tokens is not None and self._partial_tokens + tokens > self.micro_batch_tokens

    def _close_partial(self) -> None:
        self._full.append(self._partial)
        self._partial, self._partial_rows, self._partial_tokens = [], 0, 0

    def _train_round(self, round_: list[MicroBatch]) -> None:
        """Consecutive global micro-batches, the j-th for DP rank j; every rank trains its batches."""
        self._num_microbatches += len(round_)
        for batch in self._round_batches(round_):
            self._train(batch)
        for micro_batch in round_:  # a group's tensors are not needed after its last rows
            for rows in micro_batch:
                if rows.stop == rows.group.size:
                    self._fetched.pop(id(rows.group), None)

    def _expect_counts(self, rows: Iterable[_Rows]) -> None:
        """With the guard on, tell the trainer what its next update's loss must count for ``rows``:
        their response tokens and sequences on every rank, from their groups' metadata alone (a
        truncated row, masked, counts nothing)."""
        if not self.guarded:
            return
        tokens = sequences = 0
        for part in rows:
            for index in range(part.start, part.stop):
                masked = self.step_cfg.mask_truncated and part.group.finish_reasons[index] == "length"
                count = 0 if masked else part.group.row_response_tokens[index]
                tokens, sequences = tokens + count, sequences + (count > 0)
        self.trainer.expect_counts(tokens, sequences)

    def _round_batches(self, round_: list[MicroBatch]) -> list[TrainBatch]:
        """This rank's micro-batch of the round, or a padding one when the round has none for it."""
        if self.dp_rank < len(round_):
            return [self._micro_batch(round_[self.dp_rank])]
        return [self._padding_batch()]

    def _micro_batch(self, micro_batch: MicroBatch) -> TrainBatch:
        groups = [self._fetch(rows.group) for rows in micro_batch]
        batch = TrainBatch.from_groups(groups, [rows.advantages for rows in micro_batch])
        index, offset, truncated = [], 0, []
        for group, rows in zip(groups, micro_batch):
            index.extend(range(offset + rows.start, offset + rows.stop))
            truncated.extend(reason == "length" for reason in group.finish_reasons[rows.start : rows.stop])
            offset += group.size
        batch = batch.select(index)
        if self.step_cfg.mask_truncated and any(truncated):
            # out of the loss and out of its counts: a row with n_i = 0 is padding (docs/loss.md)
            keep = ~torch.tensor(truncated)
            batch = replace(
                batch, response_mask=batch.response_mask * keep[:, None], response_lengths=batch.response_lengths * keep
            )
        return batch

    def _fetch(self, group: Any) -> RolloutGroup:
        """The group with its tensors: itself, or a held group's, fetched once."""
        if isinstance(group, RolloutGroup):
            return group
        if id(group) not in self._fetched:
            self._fetched[id(group)] = group.fetch()
        return self._fetched[id(group)]

    def _padding_batch(self) -> TrainBatch:
        """One sequence that attends to real tokens (so every activation is finite) but has no
        response: zero loss weight, zero gradient, and nothing added to the step's counts."""
        ones, zeros = torch.ones((1, 2)), torch.zeros((1, 2))
        return TrainBatch(
            input_ids=torch.zeros((1, 2), dtype=torch.long),
            attention_mask=ones.long(),
            response_mask=zeros,
            behaviour_logprobs=zeros,
            advantages=torch.zeros(1),
            response_lengths=torch.zeros(1, dtype=torch.long),
        )

    def _train(self, batch: TrainBatch) -> None:
        if self.trainer.reference_model is not None:
            batch.ref_logprobs = self.trainer.compute_logprobs(batch, reference=True)
        self.trainer.train_microbatch(batch)


def _check_loss_counts(guard: IntegrityGuard, error: float, evidence: str, version: int) -> None:
    """Promise 5, on every rank alike (the sums are global): stop (or warn) before the update of
    the step that trains from ``version``, step version + 1 as metrics.jsonl numbers it."""
    guard.check("loss_counts", error, step=version + 1, evidence=evidence)


def split_evenly(items: list, parts: int) -> list[list]:
    """``items`` cut into at most ``parts`` consecutive non-empty runs, sizes differing by at most one."""
    parts = min(parts, len(items))
    size, extra = divmod(len(items), max(parts, 1))
    runs, start = [], 0
    for index in range(parts):
        stop = start + size + (index < extra)
        runs.append(items[start:stop])
        start = stop
    return runs


def _check_weight_names(model: nn.Module, names, checkpoint_dir: Path) -> None:
    """The checkpoint holds exactly the model's weights; a tied weight may be stored once."""
    names = set(names)
    expected = set(model.state_dict())
    aliases: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), set()).add(name)
    covered = names | {name for tied in aliases.values() if tied & names for name in tied}
    missing, unexpected = sorted(expected - covered), sorted(names - expected)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {checkpoint_dir}: weights do not match the model "
            f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
