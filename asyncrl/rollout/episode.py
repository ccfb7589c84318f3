"""Episodes, token-in / token-out: how a prompt becomes one sampled completion.

``SingleTurn`` is the one-turn case, today's fast path: the prompt's text, one response.
``MultiTurn`` runs episodes against an environment. The tokens the trainer sees are exactly the
ones sampled, with their logprobs and weight versions; an environment's answer is appended as the
chat template's delta for the new messages (template(messages + new) minus template(messages),
checked to be a prefix), never by re-templating the transcript, and masked out of the loss. A
template that rewrites the transcript instead of extending it ends the episode there, before the
observation (finish reason ``transcript``, counted in ``transcript_breaks``): a transcript only
grows, and the integrity guard decides what the run does about it (docs/integrity.md).

Episodes run independently: every model turn that is ready goes into one generation call, and
each environment step runs on a thread of its own, so an episode waiting on its environment never
holds up the others. A turn's seed comes from the sample's seed and the turn's index alone, so with
a backend whose rows do not depend on their neighbours (HF) an episode samples the same tokens
however the turns of a batch happen to line up.

An environment is code the run does not control. A call into it that runs past the episode's
``max_seconds`` is abandoned (its daemon thread left to finish, or not) and the episode truncated;
an environment that raises costs only its own episode, which is rerun from the start with the same
seeds (so, on a backend whose rows do not depend on their neighbours, it samples what it would have
sampled), up to ``max_retries`` times; past that its place in the batch holds the error.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from asyncrl.data import Prompt, encode_prompts
from asyncrl.environments.base import Environment, EnvironmentPart, Message
from asyncrl.errors import RunStopped
from asyncrl.generation import Generator, SampleRequest, SamplingParams
from asyncrl.generation.base import SEED_BITS
from asyncrl.models.hf import stop_token_ids
from asyncrl.threads import DaemonPool
from asyncrl.types import Rollout

if TYPE_CHECKING:
    from asyncrl.config import RunConfig
    from asyncrl.environments.base import Turn

OBSERVATION_VERSION = -1  # the "version" of a token the environment appended: no weights sampled it


class EpisodeError(RuntimeError):
    """The environment raised (or its ``reset`` overran ``max_seconds``) on every attempt of an
    episode: the episode has no rollout, and the prompt fails as a generation would."""


@dataclass
class Completion:
    """One sample of a prompt: its rollout and what decides its reward."""

    rollout: Rollout
    text: str  # what the run's rewards score: the response, or the episode's last model turn
    reward: float | None = None  # the environment's own reward, when it gave one
    metrics: dict[str, float] = field(default_factory=dict)  # an episode's counts (docs/metrics.md)
    longest_turn: int | None = None  # the most tokens one model turn sampled; None: a single turn
    retries: int = 0  # attempts of the episode that its environment failed before this one
    transcript: list[Message] | None = None  # an episode's messages, turns annotated (transcript()); None: one turn


class Episodes(Protocol):
    """How prompts become completions: ``seeds[i]`` alone decides the randomness of prompt i. An
    episode whose environment failed on every attempt is its ``EpisodeError`` instead."""

    def run(
        self, prompts: Sequence[Prompt], seeds: Sequence[int], params: SamplingParams
    ) -> list[Completion | EpisodeError]: ...


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


FINISH_REASONS = {  # why an episode ended: its rollout's finish reason
    "stop": "the environment ended it (done)",
    "length": "a turn was cut: at generation.max_new_tokens, or at the episode's max_tokens",
    "max_turns": "the environment had not ended it after max_turns model turns",
    "time_limit": "max_seconds of wall time (an environment call past it is abandoned)",
    "transcript": "the chat template rewrote the transcript instead of extending it: ended before the observation",
}


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

    index: int  # its place among the episodes of the call
    prompt: Prompt
    seed: int
    retries: int = 0  # earlier attempts that the environment failed
    started: float = field(default_factory=time.perf_counter)
    env: Environment | None = None  # None until ``reset`` returned
    messages: list[Message] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: int = 0
    longest_turn: int = 0  # tokens of the longest model turn as sampled, before the token budget cut it
    turn_log: list[dict[str, Any]] = field(default_factory=list)  # each model turn: text, tokens, how it ended
    text: str = ""
    env_s: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    reward: float | None = None
    finish: str | None = None  # FINISH_REASONS
    error: EpisodeError | None = None  # the environment failed its last attempt too
    call_started: float = 0.0  # when its running environment call was made

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
            "truncated": float(self.finish != "stop"),
            "cut": float(self.finish == "length"),
            "timed_out": float(self.finish == "time_limit"),
            "turns_cut": float(sum(turn["finish_reason"] == "length" for turn in self.turn_log)),
            "transcript_breaks": float(self.finish == "transcript"),
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
        transcript = annotated_transcript(self.messages, self.turn_log)
        return Completion(rollout, self.text, self.reward, metrics, self.longest_turn, self.retries, transcript)

    def deadline(self, limits: EpisodeLimits) -> float:
        return float("inf") if limits.max_seconds is None else self.started + limits.max_seconds


@dataclass
class _Opened:
    """What ``reset`` gave, made on an environment thread and applied by the loop."""

    env: Environment
    messages: list[Message]
    prompt_ids: list[int]
    seconds: float


@dataclass
class _Answered:
    """The environment's answer to a turn and its template delta (None when the episode ends, or
    when the template rewrote the transcript: ``rewritten``)."""

    assistant: Message
    turn: Turn
    delta: list[int] | None
    seconds: float
    rewritten: bool = False


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
        max_retries: int = 0,
    ) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"tokenizer {_name(tokenizer)}: has no chat template, which multi-turn episodes need")
        self.generator = generator
        self.tokenizer = tokenizer
        self.make_env = make_env
        self.stop_token_ids = set(stop_token_ids)
        self.limits = limits
        self.max_retries = max_retries  # reruns of an episode whose environment failed
        self._pool = DaemonPool(env_threads, "environment")

    def run(
        self, prompts: Sequence[Prompt], seeds: Sequence[int], params: SamplingParams
    ) -> list[Completion | EpisodeError]:
        """Generate the turns that are ready in one call while the other episodes' environments
        answer. A backend that takes concurrent calls (``concurrent_calls``: vLLM) gets each batch
        on a thread, so turns that become ready meanwhile need not wait for it; the rest run here.
        No environment call is waited on past its episode's deadline."""
        episodes = [_Episode(i, prompt, seed) for i, (prompt, seed) in enumerate(zip(prompts, seeds))]
        calls: dict[Future, _Episode | None] = {}  # running calls: an episode's environment, or None: generation
        for episode in episodes:
            calls[self._pool.submit(self._open, episode)] = episode
        opening = set(calls)  # the first turns wait for every reset, so that one call generates them all
        concurrent = self.generator.concurrent_calls
        ready: list[_Episode] = []
        while ready or calls:
            start = bool(ready) and opening.isdisjoint(calls)
            done, _ = wait(calls, timeout=0 if start else self._until_deadline(calls), return_when=FIRST_COMPLETED)
            for future in done:
                ready += self._collect(future, calls.pop(future), episodes, calls)
            self._time_out(episodes, calls)
            if ready and opening.isdisjoint(calls):
                batch, ready = sorted(ready, key=lambda e: e.index), []
                if concurrent:
                    calls[self._pool.submit(self._generate, batch, params)] = None
                else:
                    self._answer_all(self._generate(batch, params), calls)
        self._rescore([e for e in episodes if e.error is None], params)
        return [e.error or e.completion() for e in episodes]

    def close(self) -> None:
        self._pool.shutdown()

    def _collect(
        self, future: Future, episode: _Episode | None, episodes: list[_Episode], calls: dict[Future, _Episode | None]
    ) -> list[_Episode]:
        """A finished call: a generation call's turns go to their environments; an environment's
        answer is applied, and its episode is ready for the next turn unless that ended it."""
        if episode is None:
            self._answer_all(future.result(), calls)
            return []
        if isinstance(future.exception(), EpisodeError):
            self._failed(episode, future.exception(), episodes, calls)
            return []
        result = future.result()  # anything else raised is not the environment's doing: it propagates
        if isinstance(result, _Opened):
            episode.env, episode.messages, episode.prompt_ids = result.env, result.messages, result.prompt_ids
            episode.env_s += result.seconds
        else:
            self._answered(episode, result)
        return [episode] if episode.finish is None else []

    def _answer_all(self, episodes: list[_Episode], calls: dict[Future, _Episode | None]) -> None:
        for episode in episodes:
            if episode.finish is None:
                episode.call_started = time.perf_counter()
                calls[self._pool.submit(self._answer, episode)] = episode

    def _failed(
        self, episode: _Episode, error: EpisodeError, episodes: list[_Episode], calls: dict[Future, _Episode | None]
    ) -> None:
        """Rerun the episode from the start on a fresh environment, same seed, while retries last."""
        if episode.retries >= self.max_retries:
            episode.error = error
            return
        rerun = _Episode(episode.index, episode.prompt, episode.seed, retries=episode.retries + 1)
        episodes[episode.index] = rerun
        calls[self._pool.submit(self._open, rerun)] = rerun

    def _until_deadline(self, calls: dict[Future, _Episode | None]) -> float | None:
        """Seconds until the first deadline of an episode waiting on its environment; None: none."""
        first = min((e.deadline(self.limits) for e in calls.values() if e is not None), default=float("inf"))
        return None if first == float("inf") else max(0.0, first - time.perf_counter())

    def _time_out(self, episodes: list[_Episode], calls: dict[Future, _Episode | None]) -> None:
        """Abandon the environment calls past their episode's deadline: a step's episode ends there
        (``time_limit``); a reset that never gave the opening messages fails the attempt."""
        now = time.perf_counter()
        for future, episode in list(calls.items()):
            if episode is None or episode.deadline(self.limits) > now:
                continue
            self._pool.abandon(future)
            del calls[future]
            if episode.env is None:
                late = EpisodeError(
                    f"the environment's reset ran past environment.max_seconds={self.limits.max_seconds}"
                )
                self._failed(episode, late, episodes, calls)
            else:
                episode.env_s += now - episode.call_started
                episode.finish = "time_limit"

    def _rescore(self, episodes: list[_Episode], params: SamplingParams) -> None:
        """Logprobs from one batch of the episodes in order, where the backend offers ``score``:
        the turn batches depended on when environments answered, and a row's float logits on its
        batch. Same tokens, same weights (an episode sampled by one version), so the same
        logprobs up to rounding, and a run is again a function of its config."""
        single = [e for e in episodes if len({v for v in e.versions if v != OBSERVATION_VERSION}) <= 1]
        if params.temperature == 0 or not single:
            return
        scores = self.generator.score([e.prompt_ids + e.response for e in single], params)
        for episode, logprobs in zip(single, scores or []):
            sampled = logprobs[len(episode.prompt_ids) :]
            episode.logprobs = [lp if trained else 0.0 for lp, trained in zip(sampled, episode.mask)]

    def _open(self, episode: _Episode) -> _Opened:
        """On an environment thread: a fresh environment's opening messages, templated."""
        start = time.perf_counter()
        env = _environment("construction", self.make_env)
        messages = list(_environment("reset", env.reset, episode.prompt))
        ids = self._template(messages, env, generation_prompt=True)
        if not ids:
            raise ValueError(f"prompt {episode.prompt.uid}: the environment's opening messages template to no tokens")
        return _Opened(env, messages, ids, time.perf_counter() - start)

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
            cut = "max_tokens" if len(rollout.response_ids) > room else None
            finish = "length" if rollout.finish_reason != "stop" else cut or "stop"
            episode.turn_log.append({"content": episode.text, "tokens": len(ids), "finish_reason": finish})
            if finish != "stop":
                episode.finish = "length"
        return episodes

    def _answer(self, episode: _Episode) -> _Answered:
        """On an environment thread: the environment's answer to the last turn and, when the
        episode goes on, its template delta. The episode itself is changed only by the loop, so a
        call abandoned past the deadline that returns later changes nothing."""
        env = episode.env
        start = time.perf_counter()
        assistant = _environment("parse", env.parse, episode.text)
        turn = _environment("step", env.step, assistant)
        seconds = time.perf_counter() - start
        going_on = not turn.done and episode.turns < self.limits.max_turns
        delta = self._delta(episode.messages + [assistant], turn.messages, env) if going_on else None
        return _Answered(assistant, turn, delta, seconds, rewritten=going_on and delta is None)

    def _answered(self, episode: _Episode, answer: _Answered) -> None:
        """The answer applied: the episode ends (done, or a limit), or its observation is appended
        as the template's delta (masked)."""
        limits, turn = self.limits, answer.turn
        episode.env_s += answer.seconds
        for key, value in turn.metrics.items():
            episode.metrics[key] = episode.metrics.get(key, 0.0) + float(value)
        episode.messages = episode.messages + [answer.assistant] + turn.messages
        if turn.done:
            episode.reward, episode.finish = turn.reward, "stop"
        elif answer.rewritten:
            episode.finish = "transcript"
        elif answer.delta is None:
            episode.finish = "max_turns"
        elif time.perf_counter() > episode.deadline(limits):
            episode.finish = "time_limit"
        elif len(episode.response) + len(answer.delta) >= limits.max_tokens:
            episode.finish = "length"
        else:
            delta = answer.delta
            episode.extend(delta, [0.0] * len(delta), [OBSERVATION_VERSION] * len(delta), trained=0)

    def _delta(self, messages: list[Message], new: list[Message], env: Environment) -> list[int] | None:
        """The tokens ``new`` adds after the model's turn: what the template puts after the turn's
        end token, then template(messages + new) past template(messages). None when the template
        renders the transcript differently once messages are appended: no delta extends it."""
        base = self._template(messages, env, generation_prompt=False)
        extended = self._template(messages + new, env, generation_prompt=True)
        if extended[: len(base)] != base:
            return None
        ends = [i for i, token in enumerate(base) if token in self.stop_token_ids]
        after_turn = base[ends[-1] + 1 :] if ends else []
        return after_turn + extended[len(base) :]

    def _template(self, messages: list[Message], env: Environment, *, generation_prompt: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tools=env.tools or None, add_generation_prompt=generation_prompt, tokenize=False
        )
        return encode_prompts([text], self.tokenizer)[0]


TURN_FINISHES = {  # how one model turn ended: the ``finish_reason`` of its transcript message
    "stop": "the model ended it (an end token)",
    "length": "the generator cut it at generation.max_new_tokens",
    "max_tokens": "it did not fit the episode's environment.max_tokens and was cut there",
}


def annotated_transcript(messages: list[Message], turns: list[dict[str, Any]]) -> list[Message]:
    """The episode's messages, each model turn's carrying its sampled ``tokens``, its
    ``finish_reason`` (TURN_FINISHES) and, where the environment parsed it into something else
    (tool calls), the ``text`` it sampled; a last turn that ended the episode before the
    environment read it (cut, or out of time) is added as that text."""
    transcript, turn = [], 0
    for message in messages:
        if message.get("role") == "assistant" and turn < len(turns):
            sampled = turns[turn]
            message = {**message, "tokens": sampled["tokens"], "finish_reason": sampled["finish_reason"]}
            if sampled["content"] != message.get("content"):
                message["text"] = sampled["content"]
            turn += 1
        transcript.append(message)
    transcript += [{"role": "assistant", **unread} for unread in turns[turn:]]
    return transcript


def _environment(what: str, call: Callable[..., Any], *args: Any) -> Any:
    """A call into environment code: whatever it raises fails the episode's attempt, not the batch;
    a ``RunStopped`` (a tool process that cannot start: the environment's fault) stops the run."""
    try:
        return call(*args)
    except RunStopped:
        raise
    except Exception as err:
        raise EpisodeError(f"{type(err).__name__} in the environment's {what}: {err}") from err


def _name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__


def build_episodes(config: RunConfig, environment: EnvironmentPart | None, generator: Generator, tokenizer) -> Episodes:
    """Multi-turn episodes against ``environment`` (``RunParts.environment``), else the one-turn
    case; a turn ends at the end tokens the generator stops on."""
    if environment is None:
        return SingleTurn(generator, tokenizer)
    env = config.environment
    return MultiTurn(
        generator,
        tokenizer,
        environment.build,
        stop_token_ids=stop_token_ids(tokenizer, config.model.path),
        limits=EpisodeLimits(env.max_turns, env.max_tokens, env.max_seconds),
        env_threads=env.threads,
        max_retries=config.runtime.max_rollout_retries,
    )
