"""Run health: what makes learning impossible or unlikely, said once each, naming the setting.

A run can go on for hours learning nothing while every number it logs is in plain sight: each
turn cut at ``generation.max_new_tokens`` before its tool call closed, every group scored alike
so every advantage is 0. ``RunHealth`` reads the step records (metrics.jsonl) as they are written
and, once a condition has held at each of the last ``logging.health_window`` steps, gives a warning
that says what it saw and which setting to change. Each warning is given once per run; the
controller prints it and ``summary.json`` lists them (the summary replays metrics.jsonl through
the same checks, so a resumed run reports the whole run). The checks are ``CHECKS``, each a
function of the window of records; docs/metrics.md lists them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

from asyncrl.config import RunConfig

MOST = 0.5  # "most": more than this share
EVICTED_IN_STEP = "evicted_in_step"  # derived by RunHealth: the step's own evictions (evicted_groups is cumulative)
COLLAPSED_IS_WEIGHT = 0.5  # a mean importance weight below this: most of the gradient is gone


@dataclass(frozen=True)
class HealthWarning:
    warning: str  # which check (a key of CHECKS)
    step: int  # the step at which it was given
    message: str


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / max(len(values), 1)


def _turns_cut(config: RunConfig, window: Sequence[dict]) -> str | None:
    if not all(r.get("turns_cut_fraction", 0.0) > MOST for r in window):
        return None
    share = _mean(r["turns_cut_fraction"] for r in window)
    limit = config.generation.max_new_tokens
    return (
        f"{share:.0%} of the model's turns were cut at generation.max_new_tokens={limit} before they ended "
        f"(turns_cut_fraction): raise generation.max_new_tokens"
    )


def _episodes_cut(config: RunConfig, window: Sequence[dict]) -> str | None:
    """Episodes cut off mid-turn or out of time; one that used up ``max_turns`` is whole (and the
    turn budget may be what the task is about), so it does not count."""
    shares = [r.get("episode/cut", 0.0) + r.get("episode/timed_out", 0.0) for r in window]
    if not all(share > MOST for share in shares):
        return None
    env = config.environment
    timed_out = sum(r.get("episode/timed_out", 0.0) for r in window) > sum(r.get("episode/cut", 0.0) for r in window)
    fix = (
        f"raise environment.max_seconds={env.max_seconds}"
        if timed_out
        else f"raise environment.max_tokens={env.max_tokens} (or generation.max_new_tokens="
        f"{config.generation.max_new_tokens}, if turns are cut)"
    )
    return (
        f"{_mean(shares):.0%} of episodes were cut off before the environment ended them "
        f"(episode/cut, episode/timed_out): {fix}"
    )


def _zero_variance(config: RunConfig, window: Sequence[dict]) -> str | None:
    if not all(r.get("num_groups", 0) > 0 and r.get("zero_variance_groups") == r["num_groups"] for r in window):
        return None
    accuracy = _mean(r.get("accuracy") or 0.0 for r in window)  # None: every group failed
    task = config.data.task
    settings = f"data.task.options of {task.name}" + (f", now {task.options}" if task.options else "")
    if accuracy == 0.0:
        fix = f"the task is too hard for the model: make it easier ({settings}) or raise warm_start.steps"
    elif accuracy == 1.0:
        fix = f"the task is too easy: make it harder ({settings})"
    else:
        fix = "give partial credit (rewards.functions) or raise step.generations_per_prompt"
    return (
        f"every group of the last {len(window)} steps scored all its samples alike (zero_variance_groups), so every "
        f"advantage is 0 and nothing is learned: {fix}"
    )


def _tool_failures(config: RunConfig, window: Sequence[dict]) -> str | None:
    shares, kinds = [], {}
    for r in window:  # each step's failed calls by kind (a call past the limit ends its episode: not one)
        failed = {
            key.removeprefix("episode/tool_errors_"): value
            for key, value in r.items()
            if key.startswith("episode/tool_errors_") and key != "episode/tool_errors_limit"
        }
        attempted = r.get("episode/tool_calls", 0.0) + failed.get("parse", 0.0)
        shares.append(sum(failed.values()) / attempted if attempted > 0 else 0.0)
        for kind, value in failed.items():
            kinds[kind] = kinds.get(kind, 0.0) + value
    if not all(share > MOST for share in shares):
        return None
    worst = max(kinds, key=kinds.get)
    fixes = {
        "parse": "the parser cannot read the model's calls: check environment.options.parser, raise warm_start.steps "
        "(the call format), or generation.max_new_tokens if calls are cut",
        "timeout": "the tools run past their limit: raise environment.options.tool_timeout_s",
    }
    fix = fixes.get(worst, "the model calls the tools wrongly or they fail: raise warm_start.steps, or fix the tools")
    return f"{_mean(shares):.0%} of tool calls were unreadable or failed, most often '{worst}': {fix}"


def _reward_failures(config: RunConfig, window: Sequence[dict]) -> str | None:
    calls_per_group = config.step.generations_per_prompt * max(len(config.rewards.functions), 1)
    shares = [
        (r.get("reward_errors", 0) + r.get("reward_timeouts", 0)) / max(r.get("num_groups", 0) * calls_per_group, 1)
        for r in window
    ]
    if not all(share > MOST for share in shares):
        return None
    if sum(r.get("reward_timeouts", 0) for r in window) > sum(r.get("reward_errors", 0) for r in window):
        fix = f"they run past rewards.timeout_s={config.rewards.timeout_s}: raise it"
    else:
        fix = "they raise (each scores 0): fix the functions of rewards.functions"
    return f"{_mean(shares):.0%} of reward calls failed (reward_errors, reward_timeouts): {fix}"


def _lag_pinned(config: RunConfig, window: Sequence[dict]) -> str | None:
    bound = config.sampler.max_lag
    evicted = sum(r[EVICTED_IN_STEP] for r in window)
    if evicted <= 0 or not all(r.get("lag_mean", 0.0) >= bound for r in window):
        return None
    return (
        f"trained groups sit at the staleness bound (lag_mean {bound}) and {evicted} groups were evicted as too "
        f"stale over the last {len(window)} steps: generation falls behind training; raise "
        f"sampler.max_lag={bound} or generation.num_workers={config.generation.num_workers}"
    )


def _weights_collapsed(config: RunConfig, window: Sequence[dict]) -> str | None:
    weights = [r["is_weight_mean"] for r in window if isinstance(r.get("is_weight_mean"), (int, float))]
    if len(weights) < len(window) or max(weights) >= COLLAPSED_IS_WEIGHT:
        return None
    kl = _mean(r.get("mismatch_kl") or 0.0 for r in window)
    return (
        f"the importance weights collapsed (is_weight_mean {_mean(weights):.2f}, mismatch_kl {kl:.3f}): the "
        f"generator's policy is far from the trainer's, so most tokens barely count; lower "
        f"sampler.max_lag={config.sampler.max_lag}, or make generation match training "
        f"(generation.backend.name, trainer.dtype)"
    )


CHECKS: dict[str, Callable[[RunConfig, Sequence[dict]], str | None]] = {
    "turns_cut": _turns_cut,
    "episodes_cut": _episodes_cut,
    "zero_variance": _zero_variance,
    "tool_failures": _tool_failures,
    "reward_failures": _reward_failures,
    "lag_pinned": _lag_pinned,
    "importance_weights_collapsed": _weights_collapsed,
}


class RunHealth:
    """The checks over a sliding window of step records; each warning given once."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.window: deque[dict] = deque(maxlen=config.logging.health_window)
        self.given: list[HealthWarning] = []
        self.evicted = 0  # evicted_groups up to the last record read: a run starts with none

    def observe(self, record: dict) -> list[HealthWarning]:
        """Read one step record; the warnings it newly gives (each at most once per run)."""
        evicted, self.evicted = self.evicted, record.get("evicted_groups", 0)
        self.window.append({**record, EVICTED_IN_STEP: self.evicted - evicted})
        if len(self.window) < self.window.maxlen:
            return []
        given = {warning.warning for warning in self.given}
        new = []
        for name, check in CHECKS.items():
            message = None if name in given else check(self.config, list(self.window))
            if message is not None:
                new.append(HealthWarning(name, record["step"], message))
        self.given += new
        return new

    def replay(self, records: Iterable[dict]) -> list[HealthWarning]:
        """Read records already written (a resumed run's), giving their warnings silently."""
        for record in records:
            self.observe(record)
        return self.given


def run_warnings(config: RunConfig, records: Iterable[dict]) -> list[dict]:
    """The warnings a run's step records give, as summary.json lists them."""
    return [asdict(warning) for warning in RunHealth(config).replay(records)]
