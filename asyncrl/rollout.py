"""RolloutWorker: prompts -> generator -> rewards -> tensorized RolloutGroups.

The worker is a plain object; a runtime puts it behind a handle (a thread, or a Ray actor). One
``generate`` call is one deterministic generation batch: the caller composes it, the worker keeps
its order, and every sample's seed comes from (run seed, prompt uid, sample index) alone.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch
from torch import Tensor

from asyncrl.algorithms import Algorithm
from asyncrl.data import Prompt, encode_prompts
from asyncrl.generation import Generator, SampleRequest, SamplingParams, sample_seed
from asyncrl.rewards import RewardResult, RewardRunner
from asyncrl.types import EvalResult, Rollout, RolloutBatch, RolloutGroup, RolloutJob


class RolloutWorker:
    def __init__(
        self,
        generator: Generator,
        rewards: RewardRunner,
        tokenizer,
        *,
        run_seed: int,
        group_size: int,
        sampling: SamplingParams,
        inflight: bool = False,
        algorithm: Algorithm | None = None,
    ) -> None:
        """``algorithm``: the run's, which judges whether each group is informative as it is
        tensorized (None: ``RolloutGroup``'s own default, GRPO's test).

        ``inflight``: the generator takes weights while it generates (its responses then span
        versions), so a runtime may run ``load_weights`` beside ``generate`` (``unordered_methods``)."""
        self.generator = generator
        self.inflight = inflight
        self.unordered_methods = ("load_weights",) if inflight else ()
        self.rewards = rewards
        self.tokenizer = tokenizer
        self.run_seed = run_seed
        self.group_size = group_size
        self.sampling = sampling
        self.pad_id = tokenizer.pad_token_id
        self.algorithm = algorithm

    def load_weights(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        self.generator.load_weights(state_dict, version)

    def generate(self, jobs: Sequence[RolloutJob]) -> RolloutBatch:
        """Sample ``group_size`` completions per job, score them, tensorize one group per job."""
        start = time.perf_counter()
        version = self.generator.version
        stale = [
            job.slot_id
            for job in jobs
            if job.start_version > version or (job.start_version < version and not self.inflight)
        ]
        if stale:
            raise RuntimeError(
                f"RolloutWorker.generate: slots {stale} were admitted for another weight version than the "
                f"loaded {self.generator.version}; a weight sync overtook its generation batch"
            )
        n = self.group_size
        requests, answers = [], []
        for job in jobs:
            prompt_ids = self._encode(job.prompt)
            requests += [SampleRequest(prompt_ids, sample_seed(self.run_seed, job.prompt.uid, i)) for i in range(n)]
            answers += [job.prompt.answer] * n
        rollouts = self.generator.generate(requests, self.sampling)
        end_version = self.generator.version if not self.inflight else max(version, *_token_versions(rollouts))
        # One scoring call for the batch: a reward that hangs costs one timeout, not one per group.
        scores = self.rewards.score(
            [self._decode(r) for r in rollouts], answers, [len(r.response_ids) for r in rollouts]
        )
        groups = [
            self._group(job, rollouts[j * n : (j + 1) * n], scores, slice(j * n, (j + 1) * n), end_version)
            for j, job in enumerate(jobs)
        ]
        num_tokens = sum(len(r.response_ids) for r in rollouts)
        return RolloutBatch(groups=groups, num_tokens=num_tokens, seconds=time.perf_counter() - start)

    def close(self) -> None:
        """Release what the generator holds outside this process (a server it started)."""
        close = getattr(self.generator, "close", None)
        if close is not None:
            close()

    def evaluate(self, prompts: Sequence[Prompt]) -> EvalResult:
        """Greedy accuracy and mean reward of one completion per prompt."""
        start = time.perf_counter()
        requests = [SampleRequest(self._encode(p), sample_seed(self.run_seed, p.uid, 0)) for p in prompts]
        rollouts = self.generator.generate(requests, self.sampling.greedy())
        scores = self.rewards.score(
            [self._decode(r) for r in rollouts], [p.answer for p in prompts], [len(r.response_ids) for r in rollouts]
        )
        count = max(len(prompts), 1)
        return EvalResult(
            num_prompts=len(prompts),
            accuracy=sum(scores.correct) / count,
            reward_mean=sum(scores.rewards) / count,
            response_length_mean=sum(len(r.response_ids) for r in rollouts) / count,
            seconds=time.perf_counter() - start,
        )

    def _group(
        self, job: RolloutJob, samples: list[Rollout], scores: RewardResult, rows: slice, end_version: int
    ) -> RolloutGroup:
        for rollout, reward in zip(samples, scores.rewards[rows]):
            rollout.reward = reward
        group = RolloutGroup.from_rollouts(
            job.prompt.uid,
            samples,
            pad_id=self.pad_id,
            start_version=job.start_version,
            end_version=end_version,
            target_step=job.target_step,
        )
        return replace(
            group,
            informative=group.informative if self.algorithm is None else self.algorithm.informative(group.rewards),
            correct=torch.tensor(scores.correct[rows], dtype=torch.float32),
            reward_errors=sum(scores.item_errors[rows]),
            reward_timeouts=sum(scores.item_timeouts[rows]),
            retries=job.retries,
        )

    def _encode(self, prompt: Prompt) -> list[int]:
        ids = encode_prompts([prompt.text], self.tokenizer)[0]
        if not ids:
            raise ValueError(f"prompt {prompt.uid}: tokenizes to no tokens")
        return ids

    def _decode(self, rollout: Rollout) -> str:
        return self.tokenizer.decode(rollout.response_ids, skip_special_tokens=True)


def _token_versions(rollouts: Sequence[Rollout]) -> list[int]:
    return [v for r in rollouts if r.versions for v in r.versions]
