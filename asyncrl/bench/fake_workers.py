"""Workers that take a fixed time and return well-formed results.

They stand in for the generator and the trainer where a benchmark measures the controller,
the samplers, the buffer, the runtime and the weight sync, and not the model: a generation batch
of k groups sleeps ``k * generate_s_per_group``, a train chunk of k groups ``k * train_s_per_group``.
Sleeping releases the GIL, so on the local runtime the loops overlap the way real torch work does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from asyncrl.data import Prompt
from asyncrl.types import EvalResult, RolloutBatch, RolloutGroup, StepData, StepReport, StepResult

SEQUENCE_LENGTH = 8
STEP_METRICS = {"clip_fraction": 0.0, "is_weight_mean": 1.0, "mismatch_kl": 0.0}


class DelayRolloutWorker:
    def __init__(self, generate_s_per_group: float, group_size: int) -> None:
        self.generate_s_per_group = generate_s_per_group
        self.group_size = group_size
        self.version = 0
        self.ids = torch.ones(group_size, SEQUENCE_LENGTH, dtype=torch.long)
        self.response_mask = torch.zeros(group_size, SEQUENCE_LENGTH)
        self.response_mask[:, SEQUENCE_LENGTH // 2 :] = 1.0
        self.rewards = torch.arange(group_size, dtype=torch.float32) % 2

    def load_weights(self, weights: Any, version: int) -> None:
        self.version = version

    def generate(self, jobs: Sequence[Any]) -> RolloutBatch:
        start = time.perf_counter()
        if self.generate_s_per_group:
            time.sleep(self.generate_s_per_group * len(jobs))
        groups = [self._group(job) for job in jobs]
        tokens = len(jobs) * int(self.response_mask.sum())
        return RolloutBatch(groups=groups, num_tokens=tokens, seconds=time.perf_counter() - start)

    def evaluate(self, prompts: Sequence[Prompt]) -> EvalResult:
        return EvalResult(
            num_prompts=len(prompts), accuracy=0.0, reward_mean=0.0, response_length_mean=0.0, seconds=0.0
        )

    def _group(self, job: Any) -> RolloutGroup:
        return RolloutGroup(
            prompt_uid=job.prompt.uid,
            input_ids=self.ids,
            attention_mask=self.ids,
            response_mask=self.response_mask,
            behaviour_logprobs=self.response_mask,
            rewards=self.rewards,
            finish_reasons=["length"] * self.group_size,
            start_version=job.start_version,
            end_version=self.version,
            target_step=job.target_step,
            correct=self.rewards,
            retries=job.retries,
        )


class DelayTrainerWorker:
    def __init__(self, train_s_per_group: float, weights: dict[str, torch.Tensor] | None = None) -> None:
        self.train_s_per_group = train_s_per_group
        self.weights = weights if weights is not None else {"w": torch.zeros(1)}
        self.version = 0
        self.data = StepData()

    def begin_step(self, step: int) -> None:
        self.data = StepData()

    def train_groups(self, groups: Sequence[Any]) -> int:
        if self.train_s_per_group:
            time.sleep(self.train_s_per_group * len(groups))
        for group in groups:
            self.data.add(group, self.version)
        return self.data.num_samples

    def finish_step(self) -> StepReport:
        self.version += 1
        result = StepResult(
            version=self.version,
            loss=0.0,
            grad_norm=0.0,
            lr=0.0,
            num_sequences=self.data.num_samples,
            num_tokens=self.data.response_tokens,
            num_microbatches=1,
            metrics=dict(STEP_METRICS),
        )
        return StepReport(result=result, data=self.data)

    def abort_step(self) -> None:
        self.data = StepData()

    def abandon(self) -> None:
        """Nothing to abandon early: a delay runs to its end (a stop waits at most for it)."""

    def export_weights(self) -> tuple[int, dict[str, torch.Tensor]]:
        return self.version, self.weights

    def save_checkpoint(self, run_dir: str, step: int, run_state: dict, keep_last: int) -> Path:
        return Path(run_dir) / f"step-{step:06d}"


class NullMetrics:
    """A metrics sink that keeps the step records in memory (for step times) and writes nothing."""

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def log_step(self, record: dict) -> None:
        self.steps.append(record)

    def log_eval(self, record: dict) -> None:
        pass

    def log_groups(self, records: list[dict]) -> None:
        pass

    def log_samples(self, records: list[dict]) -> None:
        pass


class NullProgress:
    def status(self, text: str) -> None:
        pass

    def warn(self, text: str) -> None:
        pass

    def update(self, record: dict) -> None:
        pass

    def update_eval(self, record: dict) -> None:
        pass
