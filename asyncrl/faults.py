"""Injected faults (the ``faults`` config section): how the tests prove a run survives each one.

The wrappers sit between a runtime and the worker it hosts, so a fault takes the same path as a
real one: an exception out of a handle call, a call that never returns in time, a NaN gradient,
a process killed halfway through a checkpoint. With the section at its defaults nothing is
wrapped. docs/reliability.md maps every fault class to its behaviour and test.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from asyncrl.config import FaultsConfig
from asyncrl.rewards import RewardResult
from asyncrl.types import RolloutGroup


class InjectedFault(RuntimeError):
    """An error raised on purpose by the ``faults`` section."""


def inject_rollout_faults(worker: Any, faults: FaultsConfig) -> Any:
    """``worker`` itself, or a wrapper that applies the section's generation and sync faults."""
    if (
        faults.generate_errors
        or faults.failing_prompts
        or faults.hang_generate_calls
        or faults.slow_sync_s
        or faults.load_errors
        or faults.eval_errors
        or faults.sync_skips_load
        or faults.generator_temperature is not None
        or faults.stale_tokens
        or faults.rewards_raise
        or faults.template_rewrites_transcript
    ):
        return FaultyRolloutWorker(worker, faults)
    return worker


def inject_trainer_faults(worker: Any, faults: FaultsConfig) -> Any:
    """``worker`` itself, or a wrapper that applies the section's train-step and checkpoint faults."""
    if (
        faults.train_errors
        or faults.nonfinite_steps
        or faults.kill_in_checkpoint is not None
        or faults.duplicate_microbatch
        or faults.slow_module_s
    ):
        return FaultyTrainerWorker(worker, faults)
    return worker


class _Wrapper:
    def __init__(self, worker: Any, faults: FaultsConfig) -> None:
        self.worker = worker
        self.faults = faults

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)


class FaultyRolloutWorker(_Wrapper):
    """Counts generation and evaluation calls; raises, hangs or slows a weight load where the section
    says; acknowledges a load without making it; samples at another temperature than the trainer scores at;
    ages the token versions of the groups it returns, fails every reward call, rewrites multi-turn transcripts."""

    def __init__(self, worker: Any, faults: FaultsConfig) -> None:
        super().__init__(worker, faults)
        if faults.rewards_raise:
            worker.rewards = _RaisingRewards(worker.rewards)
        if faults.template_rewrites_transcript:
            worker.episodes.tokenizer = _RewritingTemplate(worker.episodes.tokenizer)
        self.calls = 0
        self.eval_calls = 0
        self.load_calls = 0
        if faults.generator_temperature is not None:
            worker.sampling = replace(worker.sampling, temperature=faults.generator_temperature)

    def generate(self, jobs: Sequence[Any]) -> Any:
        call, self.calls = self.calls, self.calls + 1
        if call in self.faults.hang_generate_calls:
            time.sleep(self.faults.hang_s)
        if call in self.faults.generate_errors:
            raise InjectedFault(f"generation call {call} failed (faults.generate_errors)")
        failing = [job.prompt.uid for job in jobs if _base_uid(job.prompt.uid) in self.faults.failing_prompts]
        if failing:
            raise InjectedFault(f"prompt {failing[0]} cannot be generated (faults.failing_prompts)")
        result = self.worker.generate(jobs)
        if self.faults.stale_tokens:
            result.groups = [_aged(group, self.faults.stale_tokens) for group in result.groups]
        return result

    def evaluate(self, prompts: Sequence[Any]) -> Any:
        call, self.eval_calls = self.eval_calls, self.eval_calls + 1
        if call in self.faults.eval_errors:
            raise InjectedFault(f"evaluation call {call} failed (faults.eval_errors)")
        return self.worker.evaluate(prompts)

    def load_weights(self, weights: Any, version: int) -> Any:
        call, self.load_calls = self.load_calls, self.load_calls + 1
        if call >= self.faults.slow_sync_from:
            time.sleep(self.faults.slow_sync_s)
        if call in self.faults.load_errors:
            raise InjectedFault(f"weight load {call} failed (faults.load_errors)")
        if self.faults.sync_skips_load:  # the generator claims the version and keeps serving the old weights
            self.worker.generator.version = version
            return self.worker.served_fingerprint()
        return self.worker.load_weights(weights, version)


class FaultyTrainerWorker(_Wrapper):
    """Fails a step's first attempt, poisons its gradients, dies inside a checkpoint write,
    trains a micro-batch twice, or makes every micro-batch slow."""

    def __init__(self, worker: Any, faults: FaultsConfig) -> None:
        super().__init__(worker, faults)
        if faults.duplicate_microbatch:
            worker.trainer = _TrainsFirstMicrobatchTwice(worker.trainer)
        if faults.slow_module_s:
            _slow_down(worker.trainer.model, faults.slow_module_s)
        self.step: int | None = None
        self.failed_steps: set[int] = set()

    def begin_step(self, step: int) -> None:
        self.step = step
        self.worker.begin_step(step)

    def train_groups(self, groups: Sequence[Any]) -> int:
        trained = self.worker.train_groups(groups)
        if self.step in self.faults.train_errors and self.step not in self.failed_steps:
            self.failed_steps.add(self.step)
            raise InjectedFault(f"train step {self.step} failed mid-step (faults.train_errors)")
        return trained

    def finish_step(self) -> Any:
        if self.step in self.faults.nonfinite_steps:
            for param in self.worker.trainer.params:
                if param.grad is not None:
                    param.grad.fill_(float("nan"))
        return self.worker.finish_step()

    def save_checkpoint(self, run_dir: str, step: int, *args: Any, **kwargs: Any) -> Any:
        if step != self.faults.kill_in_checkpoint:
            return self.worker.save_checkpoint(run_dir, step, *args, **kwargs)
        # The tokenizer is written after the weights and before the state and the rename: die there.
        self.worker.tokenizer = _KilledAfterSaving(self.worker.tokenizer)
        return self.worker.save_checkpoint(run_dir, step, *args, **kwargs)


def _slow_down(model: torch.nn.Module, seconds: float) -> None:
    """Each module holding parameters of its own sleeps before a forward that records gradients
    (a train micro-batch; scoring and a generator's copy of the model run without)."""

    def sleep(module: torch.nn.Module, args: tuple) -> None:
        if torch.is_grad_enabled():
            time.sleep(seconds)

    for module in model.modules():
        if any(True for _ in module.parameters(recurse=False)):
            module.register_forward_pre_hook(sleep)


class _TrainsFirstMicrobatchTwice:
    """A policy trainer that trains each step's first micro-batch with a response twice."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.doubled_at: int | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.trainer, name)

    def train_microbatch(self, batch: Any) -> Any:
        result = self.trainer.train_microbatch(batch)
        if batch.num_sequences and self.doubled_at != self.trainer.version:
            self.doubled_at = self.trainer.version
            self.trainer.train_microbatch(batch)
        return result


class _KilledAfterSaving:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def save_pretrained(self, directory: Any) -> None:
        self.tokenizer.save_pretrained(directory)
        os.kill(os.getpid(), signal.SIGKILL)


class _RaisingRewards:
    """A reward runner whose every call fails: each completion scores 0 with one error, as the
    runner reports a reward function that raised."""

    def __init__(self, rewards: Any) -> None:
        self.rewards = rewards

    def __getattr__(self, name: str) -> Any:
        return getattr(self.rewards, name)

    def score(self, completions: Sequence[str], *args: Any) -> RewardResult:
        scored = self.rewards.score(completions, *args)
        zeros = [0.0] * len(completions)
        return replace(
            scored,
            rewards=zeros,
            correct=[False] * len(completions),
            per_function={name: zeros for name in scored.per_function},
            item_errors=[errors + 1 for errors in scored.item_errors],
        )


class _RewritingTemplate:
    """A tokenizer whose chat template, once an assistant message is in the transcript, renders the
    first message one character short: what follows the model's turn no longer extends the
    transcript the model saw."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.tokenizer(*args, **kwargs)

    def apply_chat_template(self, messages: list[dict], *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("add_generation_prompt") and any(m["role"] == "assistant" for m in messages):
            first = messages[0]
            messages = [{**first, "content": first["content"][1:]}, *messages[1:]]
        return self.tokenizer.apply_chat_template(messages, *args, **kwargs)


def _aged(group: RolloutGroup, versions: int) -> RolloutGroup:
    """The group with every trained token's weight version ``versions`` older, never below 0."""
    sampled = group.token_versions
    if sampled is None:
        sampled = torch.full_like(group.input_ids, group.start_version).where(group.response_mask > 0, -1)
    return replace(group, token_versions=(sampled - versions).clamp(min=0).where(sampled >= 0, -1))


def _base_uid(uid: str) -> str:
    """A prompt's uid without the epoch suffix the loader appends (``<uid>/<epoch>``)."""
    return uid.rsplit("/", 1)[0]
