"""TrainerWorker: the trainer side of the controller's protocol.

The controller streams a step to it in chunks of groups. The worker turns each chunk into
advantages and sequences, packs sequences into micro-batches of ``trainer.micro_batch_size`` in
the order received (a partial micro-batch waits for the next chunk), and runs the split step. So
micro-batch composition depends only on the order of the groups, never on how the step happened
to be chunked: the same groups in the same order give a bit-identical step.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from torch import Tensor

from asyncrl.algorithms import grpo
from asyncrl.checkpoint import load_weights, save_checkpoint
from asyncrl.config import GRPOConfig
from asyncrl.trainer.policy import PolicyTrainer, StepResult
from asyncrl.types import RolloutGroup, TrainBatch


@dataclass
class StepData:
    """What a step was trained on, summed over its chunks (the controller turns it into metrics)."""

    num_groups: int = 0
    num_filtered_groups: int = 0
    num_samples: int = 0
    reward_sum: float = 0.0
    reward_sq_sum: float = 0.0
    num_correct: float = 0.0
    response_tokens: int = 0
    reward_errors: int = 0
    reward_timeouts: int = 0
    rollout_retries: int = 0
    lag_histogram: Counter = field(default_factory=Counter)
    groups: list[dict] = field(default_factory=list)  # one record per group, for groups.jsonl

    def add(self, group: RolloutGroup, version: int) -> None:
        self.num_groups += 1
        self.num_samples += group.size
        self.reward_sum += float(group.rewards.double().sum())
        self.reward_sq_sum += float(group.rewards.double().square().sum())
        if group.correct is not None:
            self.num_correct += float(group.correct.sum())
        self.response_tokens += group.response_tokens
        self.reward_errors += group.reward_errors
        self.reward_timeouts += group.reward_timeouts
        self.rollout_retries += group.retries
        self.lag_histogram[version - group.start_version] += 1
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
            }
        )


@dataclass
class StepReport:
    result: StepResult
    data: StepData


class TrainerWorker:
    def __init__(self, trainer: PolicyTrainer, grpo_cfg: GRPOConfig, tokenizer) -> None:
        self.trainer = trainer
        self.tokenizer = tokenizer
        self.grpo = grpo_cfg
        self.micro_batch_size = trainer.cfg.micro_batch_size
        self._pending: TrainBatch | None = None
        self._data = StepData()

    @property
    def version(self) -> int:
        return self.trainer.version

    def begin_step(self, step: int) -> None:
        self.trainer.begin_train_step(step)
        self._pending = None
        self._data = StepData()

    def train_groups(self, groups: Sequence[RolloutGroup]) -> int:
        """Add a chunk of the step; trains every full micro-batch. Returns sequences trained so far."""
        kept, advantages = [], []
        for group in groups:
            self._data.add(group, self.trainer.version)
            if self.grpo.filter_zero_variance and bool(grpo.zero_variance_groups(group.rewards)):
                self._data.num_filtered_groups += 1
                continue
            kept.append(group)
            advantages.append(
                grpo.group_advantages(group.rewards, baseline=self.grpo.baseline, scale_by_std=self.grpo.scale_by_std)
            )
        if kept:
            chunk = TrainBatch.from_groups(kept, advantages)
            self._pending = chunk if self._pending is None else TrainBatch.concat([self._pending, chunk])
        while self._pending is not None and len(self._pending) >= self.micro_batch_size:
            rows = len(self._pending)
            head, tail = (
                self._pending.split([self.micro_batch_size, rows - self.micro_batch_size])
                if rows > self.micro_batch_size
                else (self._pending, None)
            )
            self._train(head)
            self._pending = tail
        return self._data.num_samples

    def finish_step(self) -> StepReport:
        """Train the last partial micro-batch, then normalize, clip and step (V += 1)."""
        if self._pending is not None:
            self._train(self._pending)
            self._pending = None
        return StepReport(result=self.trainer.finish_train_step(), data=self._data)

    def abort_step(self) -> None:
        self.trainer.abort_train_step()
        self._pending = None
        self._data = StepData()

    def export_weights(self) -> tuple[int, dict[str, Tensor]]:
        return self.trainer.export_weights()

    def save_checkpoint(self, run_dir: str, step: int, run_state: dict, keep_last: int) -> Path:
        """The policy as an HF model, the tokenizer, and the trainer state next to ``run_state``."""
        trainer_state = self.trainer.state_dict()
        trainer_state.pop("model")  # saved as model.safetensors
        return save_checkpoint(
            run_dir,
            step,
            write_model=lambda directory: self.trainer.model.save_pretrained(directory, safe_serialization=True),
            tokenizer=self.tokenizer,
            state={"trainer": trainer_state, "run": run_state},
            keep_last=keep_last,
        )

    def load_checkpoint(self, checkpoint_dir: str | Path, trainer_state: dict) -> None:
        load_weights(self.trainer.model, Path(checkpoint_dir))
        self.trainer.load_state_dict({**trainer_state, "model": self.trainer.model.state_dict()})

    def _train(self, batch: TrainBatch) -> None:
        if self.trainer.reference_model is not None:
            batch.ref_logprobs = self.trainer.compute_logprobs(batch, reference=True)
        self.trainer.train_microbatch(batch)
