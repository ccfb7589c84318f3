"""Episodes, token-in / token-out: how a prompt becomes one sampled completion.

``SingleTurn`` is the one-turn case, today's fast path: the prompt's text, one response.
``MultiTurn`` runs episodes against an environment. The tokens the trainer sees are exactly the
ones sampled, with their logprobs and weight versions; an environment's answer is appended as the
chat template's delta for the new messages (template(messages + new) minus template(messages),
checked to be a prefix), never by re-templating the transcript, and masked out of the loss.

Episodes run independently: every model turn that is ready goes into one generation call, and
each environment step runs on a thread of its own, so an episode waiting on its environment never
holds up the others. A turn's seed comes from the sample's seed and the turn's index alone, so with
a backend whose rows do not depend on their neighbours (HF) an episode samples the same tokens
however the turns of a batch happen to line up.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from asyncrl.data import Prompt, encode_prompts
from asyncrl.environments.base import Environment, Message
from asyncrl.generation import Generator, SampleRequest, SamplingParams
from asyncrl.generation.base import SEED_BITS
from asyncrl.models.hf import stop_token_ids
from asyncrl.plugins import resolve, validate_options
from asyncrl.types import Rollout

if TYPE_CHECKING:
    from asyncrl.config import RunConfig

OBSERVATION_VERSION = -1  # the "version" of a token the environment appended: no weights sampled it


@dataclass
class Completion:
    """One sample of a prompt: its rollout and what decides its reward."""

    rollout: Rollout
    text: str  # what the run's rewards score: the response, or the episode's last model turn
    reward: float | None = None  # the environment's own reward, when it gave one
    metrics: dict[str, float] = field(default_factory=dict)  # an episode's counts (docs/metrics.md)
    longest_turn: int | None = None  # the most tokens one model turn sampled; None: a single turn


class Episodes(Protocol):
    """How prompts become completions: ``seeds[i]`` alone decides the randomness of prompt i."""

    def run(self, prompts: Sequence[Prompt], seeds: Sequence[int], params: SamplingParams) -> list[Completion]: ...


class SingleTurn:
    """The one-turn case: the prompt's text (chat template already applied, if any), one response."""

    def __init__(self, generator: Generator, tokenizer) -> None:
        self.generator = generator
        self.tokenizer = tokenizer

    def run(self, prompts: Sequence[Prompt], seeds: Sequence[int], params: SamplingParams) -> list[Completion]:
        requests = [SampleRequest(_encode(self.tokenizer, p), seed) for p, seed in zip(prompts, seeds)]
        rollouts = self.generator.generate(requests, params)
        return [Completion(r, self.tokenizer.decode(r.response_ids, skip_special_tokens=True)) for r in rollouts]


def _encode(tokenizer, prompt: Prompt) -> list[int]:
    ids = encode_prompts([prompt.text], tokenizer)[0]
    if not ids:
        raise ValueError(f"prompt {prompt.uid}: tokenizes to no tokens")
    return ids


@dataclass(frozen=True)
class EpisodeLimits:
    """Per episode. ``max_tokens`` counts every response token, observations included."""

    max_turns: int
    max_tokens: int
    max_seconds: float | None = None  # wall time; None: none (a time limit makes a run depend on timing)


def turn_seed(seed: int, turn: int) -> int:
    """Turn 0 samples with the sample's own seed (a one-turn episode draws what a single turn does)."""
    if turn == 0:
        return seed
    digest = hashlib.sha256(f"{int(seed)}:{int(turn)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> (64 - SEED_BITS)


@dataclass
class _Episode:
    """One episode in flight: the token record so far and the transcript the environment sees."""

    prompt: Prompt
    seed: int
    env: Environment
    messages: list[Message]
    prompt_ids: list[int]
    started: float
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: int = 0
    longest_turn: int = 0  # tokens of the longest model turn as sampled, before the token budget cut it
    text: str = ""
    env_s: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    reward: float | None = None
    finish: str | None = None  # "stop": the environment ended it; "length": a limit did (truncated)

    def extend(self, ids: list[int], logprobs: list[float], versions: list[int], trained: int) -> None:
        self.response += ids
        self.logprobs += logprobs
        self.versions += versions
        self.mask += [trained] * len(ids)

    def completion(self) -> Completion:
        trained = sum(self.mask)
        metrics = {
            "turns": float(self.turns),
            "env_s": self.env_s,
            "trained_tokens": float(trained),
            "masked_tokens": float(len(self.mask) - trained),
            "truncated": float(self.finish == "length"),
            **self.metrics,
        }
        rollout = Rollout(
            prompt_ids=self.prompt_ids,
            response_ids=self.response,
            logprobs=self.logprobs,
            finish_reason=self.finish or "length",
            versions=self.versions,
            loss_mask=self.mask,
        )
        return Completion(rollout, self.text, self.reward, metrics, self.longest_turn)


class MultiTurn:
    """Episodes against ``make_env()`` instances, one per episode (see the module docstring)."""

    def __init__(
        self,
        generator: Generator,
        tokenizer,
        make_env: Callable[[], Environment],
        *,
        stop_token_ids: Sequence[int],
        limits: EpisodeLimits,
        env_threads: int = 32,
    ) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"tokenizer {_name(tokenizer)}: has no chat template, which multi-turn episodes need")
        self.generator = generator
        self.tokenizer = tokenizer
        self.make_env = make_env
        self.stop_token_ids = set(stop_token_ids)
        self.limits = limits
        self._pool = ThreadPoolExecutor(max_workers=env_threads, thread_name_prefix="environment")

    def run(self, prompts: Sequence[Prompt], seeds: Sequence[int], params: SamplingParams) -> list[Completion]:
        """Generate the turns that are ready in one call while the other episodes' environments
        answer. A backend that takes concurrent calls (``concurrent_calls``: vLLM) gets each batch
        on a thread, so turns that become ready meanwhile need not wait for it; the rest run here."""
        episodes = list(self._pool.map(self._open, prompts, seeds))
        order = {id(e): i for i, e in enumerate(episodes)}
        concurrent = getattr(self.generator, "concurrent_calls", False)
        ready, pending = list(episodes), set[Future]()
        while ready or pending:
            done, pending = wait(pending, timeout=0 if ready else None, return_when=FIRST_COMPLETED)
            for result in (f.result() for f in done):
                if isinstance(result, list):  # a generation call: its turns go to their environments
                    pending |= {self._pool.submit(self._step, e) for e in result if e.finish is None}
                elif result.finish is None:
                    ready.append(result)
            if ready:
                batch, ready = sorted(ready, key=lambda e: order[id(e)]), []
                if concurrent:
                    pending.add(self._pool.submit(self._generate, batch, params))
                else:
                    pending |= {
                        self._pool.submit(self._step, e) for e in self._generate(batch, params) if e.finish is None
                    }
        self._rescore(episodes, params)
        return [e.completion() for e in episodes]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _rescore(self, episodes: list[_Episode], params: SamplingParams) -> None:
        """Logprobs from one batch of the episodes in order, where the backend offers ``score``:
        the turn batches depended on when environments answered, and a row's float logits on its
        batch. Same tokens, same weights (an episode sampled by one version), so the same
        logprobs up to rounding, and a run is again a function of its config."""
        score = getattr(self.generator, "score", None)
        single = [e for e in episodes if len({v for v in e.versions if v != OBSERVATION_VERSION}) <= 1]
        if score is None or params.temperature == 0 or not single:
            return
        for episode, logprobs in zip(single, score([e.prompt_ids + e.response for e in single], params)):
            sampled = logprobs[len(episode.prompt_ids) :]
            episode.logprobs = [lp if trained else 0.0 for lp, trained in zip(sampled, episode.mask)]

    def _open(self, prompt: Prompt, seed: int) -> _Episode:
        started = time.perf_counter()
        env = self.make_env()
        messages = list(env.reset(prompt))
        ids = self._template(messages, env, generation_prompt=True)
        if not ids:
            raise ValueError(f"prompt {prompt.uid}: the environment's opening messages template to no tokens")
        return _Episode(prompt, seed, env, messages, ids, started, env_s=time.perf_counter() - started)

    def _generate(self, episodes: list[_Episode], params: SamplingParams) -> list[_Episode]:
        """One generation call for every ready turn; each keeps the tokens that fit its budget."""
        version = self.generator.version
        requests = [SampleRequest(e.prompt_ids + e.response, turn_seed(e.seed, e.turns)) for e in episodes]
        for episode, rollout in zip(episodes, self.generator.generate(requests, params)):
            room = self.limits.max_tokens - len(episode.response)
            ids = rollout.response_ids[:room]
            versions = rollout.versions or [version] * len(rollout.response_ids)
            episode.extend(ids, rollout.logprobs[:room], versions[:room], trained=1)
            episode.turns += 1
            episode.longest_turn = max(episode.longest_turn, len(rollout.response_ids))
            episode.text = self.tokenizer.decode(ids, skip_special_tokens=True)
            if rollout.finish_reason != "stop" or len(rollout.response_ids) > room:
                episode.finish = "length"
        return episodes

    def _step(self, episode: _Episode) -> _Episode:
        """The environment's answer to the last turn, appended as the template's delta (masked)."""
        env, limits = episode.env, self.limits
        assistant = env.parse(episode.text)
        start = time.perf_counter()
        turn = env.step(assistant)
        episode.env_s += time.perf_counter() - start
        for key, value in turn.metrics.items():
            episode.metrics[key] = episode.metrics.get(key, 0.0) + float(value)
        previous, episode.messages = episode.messages + [assistant], episode.messages + [assistant] + turn.messages
        if turn.done:
            episode.reward, episode.finish = turn.reward, "stop"
            return episode
        elapsed = time.perf_counter() - episode.started
        if episode.turns >= limits.max_turns or (limits.max_seconds is not None and elapsed > limits.max_seconds):
            episode.finish = "length"
            return episode
        delta = self._delta(previous, turn.messages, env)
        if len(episode.response) + len(delta) >= limits.max_tokens:
            episode.finish = "length"
            return episode
        episode.extend(delta, [0.0] * len(delta), [OBSERVATION_VERSION] * len(delta), trained=0)
        return episode

    def _delta(self, messages: list[Message], new: list[Message], env: Environment) -> list[int]:
        """The tokens ``new`` adds after the model's turn: what the template puts after the turn's
        end token, then template(messages + new) past template(messages)."""
        base = self._template(messages, env, generation_prompt=False)
        extended = self._template(messages + new, env, generation_prompt=True)
        if extended[: len(base)] != base:
            raise ValueError(
                f"tokenizer {_name(self.tokenizer)}: its chat template renders the transcript differently once "
                "messages are appended, so an observation cannot be appended as a delta"
            )
        ends = [i for i, token in enumerate(base) if token in self.stop_token_ids]
        after_turn = base[ends[-1] + 1 :] if ends else []
        return after_turn + extended[len(base) :]

    def _template(self, messages: list[Message], env: Environment, *, generation_prompt: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tools=env.tools or None, add_generation_prompt=generation_prompt, tokenize=False
        )
        return encode_prompts([text], self.tokenizer)[0]


def _name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__


def environment_class(config: RunConfig) -> tuple[type[Environment], dict[str, Any]] | None:
    """The class ``environment.name`` names and its checked options; None for single-turn runs."""
    spec = config.environment.name
    if spec is None:
        return None
    part = resolve("environment", spec, "environment.name")
    if not (isinstance(part, type) and issubclass(part, Environment)):
        raise ValueError(f"environment.name: '{spec}' is not a subclass of asyncrl.environments.Environment")
    return part, validate_options(part, spec, config.environment.options, "environment.options")


def build_episodes(config: RunConfig, generator: Generator, tokenizer) -> Episodes:
    """Multi-turn episodes when the config names an environment, else the one-turn case; a turn
    ends at the end tokens the generator stops on."""
    found = environment_class(config)
    if found is None:
        return SingleTurn(generator, tokenizer)
    cls, options = found
    env = config.environment
    return MultiTurn(
        generator,
        tokenizer,
        partial(cls, **options),
        stop_token_ids=stop_token_ids(tokenizer, config.model.path),
        limits=EpisodeLimits(env.max_turns, env.max_tokens, env.max_seconds),
        env_threads=env.threads,
    )
