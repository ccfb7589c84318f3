"""Run metrics: the jsonl files every run writes, optional TensorBoard and W&B sinks, live progress.

``metrics.jsonl`` (one record per optimizer step), ``eval.jsonl`` (one per evaluation),
``groups.jsonl`` (one per trained prompt group) and ``samples.jsonl`` (a few transcripts per step
and evaluation, asyncrl/samples.py) are the source of truth; the report, the summary and
resumption read them back. Keys whose values depend on wall-clock timing start with
``TIMING_PREFIX``, so a determinism test can compare two runs with ``strip_timing``. The record
schema is documented in docs/metrics.md.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.text import Text

from asyncrl.config import LoggingConfig
from asyncrl.samples import SAMPLES_FILE, as_text

if TYPE_CHECKING:
    from asyncrl.types import StepReport, StepResult, SyncReport

TIMING_PREFIX = "time/"
METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.jsonl"
GROUPS_FILE = "groups.jsonl"
TENSORBOARD_DIR = "tensorboard"
RECORD_FILES = (METRICS_FILE, EVAL_FILE, GROUPS_FILE, SAMPLES_FILE)
SAMPLE_COLUMNS = ("step", "split", "prompt_uid", "sample", "transcript", "reward", "advantage", "finish_reason")


# ---- files -----------------------------------------------------------------------------------


def read_jsonl(path: str | Path) -> list[dict]:
    """All records of a jsonl file. A last line cut short by a crash mid-write is dropped; a
    broken line anywhere else is real corruption and raises."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: byte {err.start} is not UTF-8; the file is damaged") from None
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines):
                break
            raise ValueError(f"{path}: line {number} is not valid JSON ({err.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("step", 0), int):
            raise ValueError(f"{path}: line {number} is not a record (a JSON object with an integer step)")
        records.append(record)
    return records


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """Write JSON so a reader sees the old file or the new one, never half of one."""
    _replace_atomic(Path(path), json.dumps(obj, indent=2) + "\n")


def _replace_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep the records up to ``last_step``: what a resumed run continues from."""
    if not path.exists():
        return
    kept = [record for record in read_jsonl(path) if record.get("step", 0) <= last_step]
    _replace_atomic(path, "".join(json.dumps(record) + "\n" for record in kept))


@dataclass
class StepClock:
    """Busy and idle seconds of the loops since the last step record."""

    generation_s: float = 0.0
    generated_tokens: int = 0
    train_s: float = 0.0
    train_wait_s: float = 0.0

    def lap(self) -> StepClock:
        """What was counted since the last lap; the clock starts again from zero."""
        lap = replace(self)
        self.generation_s = self.train_s = self.train_wait_s = 0.0
        self.generated_tokens = 0
        return lap


@dataclass(frozen=True)
class RunCounters:
    """The controller's totals over the run that every step record repeats."""

    refill_groups_total: int
    evicted_groups: int
    skipped_prompts: int
    step_retries: int
    nonfinite_steps: int
    empty_steps: int


def step_record(
    report: StepReport,
    sync: SyncReport,
    counters: RunCounters,
    clock: StepClock,
    step_s: float,
    wall_s: float,
    rollout_workers: int,
) -> dict:
    """One line of metrics.jsonl (docs/metrics.md), from what the step, the sync and the controller
    counted; a pure function so that the controller only keeps the books."""
    result, data = report.result, report.data
    samples = max(data.num_samples, 1)
    record = {
        **_sample_keys(report, counters, samples),
        **_update_keys(result),
        **_fault_keys(report, counters),
        "sync_bytes": sync.bytes,
        "sync_version": sync.version,
        "sync_transport": sync.transport,
    }
    record.update(episode_keys({key: total / samples for key, total in data.episode_metrics.items()}))
    record.update(_timing_keys(clock, sync, step_s, wall_s, rollout_workers))
    return record


def episode_keys(means: dict[str, float]) -> dict[str, float]:
    """Per-episode means as record keys: ``episode/<key>``, a duration (``*_s``) under ``time/``."""
    return {f"{TIMING_PREFIX if key.endswith('_s') else ''}episode/{key}": means[key] for key in sorted(means)}


def _sample_keys(report: StepReport, counters: RunCounters, samples: int) -> dict:
    """What the step's samples scored and how its groups were filtered and refilled."""
    data = report.data
    scored = data.num_scored_samples  # failed groups' samples scored nothing: they are counted in failed_groups
    reward_mean = data.reward_sum / scored if scored else None
    return {
        "step": report.result.version,
        "reward_mean": reward_mean,
        "reward_std": max(data.reward_sq_sum / scored - reward_mean**2, 0.0) ** 0.5 if scored else None,
        "accuracy": data.num_correct / scored if scored else None,
        "response_length_mean": data.response_tokens / samples,
        "num_groups": data.num_groups,
        "num_filtered_groups": data.num_filtered_groups,
        "num_informative_groups": data.num_groups - data.num_filtered_groups - data.num_failed_groups,
        "zero_variance_groups": data.num_zero_variance_groups,
        "turns_cut_fraction": data.num_turns_cut / max(data.num_turns, 1),
        "refill_groups": data.num_refill_groups,
        "refill_groups_total": counters.refill_groups_total,
    }


def _update_keys(result: StepResult) -> dict:
    """What the trainer's update saw: its size, loss and gradient, and the metrics the trainer reduced:
    the entropy and every one the algorithm declares (GRPO's: clipping, off-policy weights, KL)."""
    return {
        "num_sequences": result.num_sequences,
        "num_tokens": result.num_tokens,
        "num_microbatches": result.num_microbatches,
        "loss": _finite_or_none(result.loss),
        "grad_norm": _finite_or_none(result.grad_norm),
        "lr": result.lr,
        **result.metrics,
    }


def _fault_keys(report: StepReport, counters: RunCounters) -> dict:
    """Staleness, and the step's faults beside the run's totals of each."""
    result, data = report.result, report.data
    lags = data.lag_histogram
    return {
        "lag_histogram": {str(lag): lags[lag] for lag in sorted(lags)},
        "lag_mean": sum(lag * count for lag, count in lags.items()) / max(sum(lags.values()), 1),
        "reward_errors": data.reward_errors,
        "reward_timeouts": data.reward_timeouts,
        "failed_groups": data.num_failed_groups,
        "rollout_retries": data.rollout_retries,
        "evicted_groups": counters.evicted_groups,
        "skipped_prompts": counters.skipped_prompts,
        "step_retries": counters.step_retries,
        "skipped": result.skipped,
        "nonfinite_steps": counters.nonfinite_steps,
        "num_updates": result.num_updates,
        "empty_steps": counters.empty_steps,
    }


def _timing_keys(clock: StepClock, sync: SyncReport, step_s: float, wall_s: float, rollout_workers: int) -> dict:
    """Wall-clock keys (``time/``): how long the step took and how busy each side was."""
    return {
        "time/step_s": step_s,
        "time/wall_s": wall_s,
        "time/tokens_per_s": clock.generated_tokens / step_s if step_s > 0 else 0.0,
        "time/generation_s": clock.generation_s,
        "time/generation_idle_fraction": _idle(clock.generation_s, step_s * rollout_workers),
        "time/train_s": clock.train_s,
        "time/train_idle_fraction": _idle(clock.train_s, step_s),
        "time/sync_pause_s": sync.pause_s,
        "time/sync_transfer_s": sync.transfer_s,
    }


def _finite_or_none(value: float) -> float | None:
    """Non-finite numbers are not JSON: a skipped step logs its loss and gradient norm as null."""
    return value if math.isfinite(value) else None


def _idle(busy_s: float, total_s: float) -> float:
    return min(max(1.0 - busy_s / total_s, 0.0), 1.0) if total_s > 0 else 0.0


def strip_timing(record: dict) -> dict:
    """The record without wall-clock dependent keys: equal for two identical runs."""
    return {key: value for key, value in record.items() if not key.startswith(TIMING_PREFIX)}


def scalars(record: dict, prefix: str = "") -> dict[str, float]:
    """The numeric values of a record as flat scalar tags; ``step`` is the x axis, not a scalar.

    A dict value (``lag_histogram``) becomes one tag per entry, ``lag_histogram/<lag>``.
    """
    flat: dict[str, float] = {}
    for key, value in record.items():
        if key == "step":
            continue
        entries = value.items() if isinstance(value, dict) else [(None, value)]
        for sub, number in entries:
            if isinstance(number, (int, float)) and not isinstance(number, bool):
                flat[prefix + key + (f"/{sub}" if sub is not None else "")] = float(number)
    return flat


# ---- sinks -----------------------------------------------------------------------------------


class MetricsWriter:
    """Appends step and eval records to the run's jsonl files and mirrors them to TensorBoard / W&B."""

    def __init__(
        self,
        run_dir: Path,
        cfg: LoggingConfig,
        *,
        run_config: dict | None = None,
        resume_step: int | None = None,
    ):
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            for name in RECORD_FILES:
                _truncate_jsonl(run_dir / name, resume_step)
        self._files = {name: open(run_dir / name, "a") for name in RECORD_FILES}
        self._tensorboard = _TensorBoard(run_dir / TENSORBOARD_DIR, resume_step) if cfg.tensorboard else None
        self._wandb = _start_wandb(run_dir, run_config) if cfg.wandb else None
        self._closed = False

    def log_step(self, record: dict) -> None:
        self._log(METRICS_FILE, record, prefix="")

    def log_eval(self, record: dict) -> None:
        self._log(EVAL_FILE, record, prefix="eval/")

    def log_groups(self, records: list[dict]) -> None:
        """One line per trained group (its versions and lag): the staleness audit trail."""
        f = self._files[GROUPS_FILE]
        f.writelines(json.dumps(record) + "\n" for record in records)
        f.flush()

    def log_samples(self, records: list[dict]) -> None:
        """Sample transcripts of one step or evaluation (asyncrl/samples.py): a line each, and
        per split a text on TensorBoard and a table on W&B at the records' step."""
        f = self._files[SAMPLES_FILE]
        f.writelines(json.dumps(record) + "\n" for record in records)
        f.flush()
        for split in dict.fromkeys(record["split"] for record in records):
            chosen = [record for record in records if record["split"] == split]
            step = chosen[0]["step"]
            if self._tensorboard is not None:
                text = "\n\n".join(f"```\n{as_text(record)}\n```" for record in chosen)
                self._tensorboard.write_text(step, f"samples/{split}", text)
            if self._wandb is not None:
                import wandb

                rows = [
                    [record.get(c) if c != "transcript" else as_text(record) for c in SAMPLE_COLUMNS]
                    for record in chosen
                ]
                self._wandb.log({f"samples/{split}": wandb.Table(columns=list(SAMPLE_COLUMNS), data=rows)}, step=step)

    def _log(self, name: str, record: dict, prefix: str) -> None:
        f = self._files[name]
        f.write(json.dumps(record) + "\n")
        f.flush()
        values = scalars(record, prefix)
        if self._tensorboard is not None:
            self._tensorboard.write(record["step"], values)
        if self._wandb is not None:
            self._wandb.log(values, step=record["step"])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for f in self._files.values():
            f.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _TensorBoard:
    """Scalar event files, written with tensorboard's own writer (no torch import needed)."""

    def __init__(self, logdir: Path, resume_step: int | None):
        from tensorboard.compat.proto import event_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event_pb2 = event_pb2
        self._writer = EventFileWriter(str(logdir))
        if resume_step is not None:
            # TensorBoard drops events at or after a START session log's step from earlier files,
            # so the steps a crashed run logged past its checkpoint are not shown twice.
            start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
            self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=resume_step + 1, session_log=start))

    def write(self, step: int, values: dict[str, float]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=tag, simple_value=value) for tag, value in values.items()])
        self._writer.add_event(self._event_pb2.Event(wall_time=time.time(), step=step, summary=summary))
        self._writer.flush()

    def write_text(self, step: int, tag: str, text: str) -> None:
        """A text summary (TensorBoard's Text tab renders it as markdown)."""
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
        from tensorboard.compat.proto.types_pb2 import DT_STRING

        metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
        shape = TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)])
        tensor = TensorProto(dtype=DT_STRING, string_val=[text.encode()], tensor_shape=shape)
        summary = Summary(value=[Summary.Value(tag=tag, metadata=metadata, tensor=tensor)])
        self._writer.add_event(self._event_pb2.Event(wall_time=time.time(), step=step, summary=summary))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _start_wandb(output_dir: Path, run_config: dict | None) -> Any:
    """A W&B run, or None with one warning line when wandb is not installed: it is optional."""
    try:
        import wandb
    except ImportError:
        print("warning: logging.wandb is true but wandb is not installed; W&B logging is off", file=sys.stderr)
        return None
    return wandb.init(project="asyncrl", name=output_dir.name, dir=str(output_dir), config=run_config or {})


# ---- live progress ---------------------------------------------------------------------------

# (label, record key, format) of the numbers shown per step, in this order.
_STEP_FIELDS = (
    ("reward", "reward_mean", "{:.3f}"),
    ("acc", "accuracy", "{:.3f}"),
    ("eval acc", "eval/accuracy", "{:.3f}"),
    ("loss", "loss", "{:.4f}"),
    ("lag", "lag_mean", "{:.2f}"),
    ("tok/s", "time/tokens_per_s", "{:,.0f}"),
)
_EVAL_FIELDS = (
    ("accuracy", "accuracy", "{:.3f}"),
    ("reward", "reward_mean", "{:.3f}"),
    ("prompts", "num_prompts", "{}"),
    ("seconds", "time/eval_s", "{:.1f}"),
)
# A plain-mode status of the same kind as the previous one (equal but for its numbers) is printed
# at most this often, so a log is not flooded by e.g. one warm start line per supervised step.
_STATUS_INTERVAL_S = 10.0


class ProgressDisplay:
    """What a user watches during a run: a live bar on a terminal, one line per step in a log.

    Used as a context manager around the run. ``enabled=False`` prints nothing.
    """

    def __init__(self, total_steps: int, *, enabled: bool, console: Console | None = None):
        self.total_steps = total_steps
        self.enabled = enabled
        self.console = console if console is not None else Console()
        self.live_mode = enabled and self.console.is_terminal
        self._latest: dict = {}
        self._latest_eval: dict = {}
        self._status = ""
        self._last_status: tuple[str, float] | None = None
        self._progress = Progress(
            TextColumn("[bold]GRPO"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("steps"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self.console,
            speed_estimate_period=600.0,
        )
        self._task = self._progress.add_task("steps", total=total_steps)
        self._live: Live | None = None

    def __enter__(self) -> ProgressDisplay:
        if self.live_mode:
            self._live = Live(self._renderable(), console=self.console, refresh_per_second=4)
            self._live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.update(self._renderable(), refresh=True)
            self._live.stop()
            self._live = None

    def update(self, record: dict) -> None:
        """Show a step record; until the next status the run is training."""
        self._latest, self._status = record, "training"
        if "step" in record:
            self._progress.update(self._task, completed=record["step"])
        if self.live_mode:
            self._refresh()
        elif self.enabled:
            self._print(f"step {record.get('step', '?')}/{self.total_steps}  {self._numbers()}{_wall(record)}")

    def update_eval(self, record: dict) -> None:
        """Show an evaluation record."""
        self._latest_eval, self._status = record, "training"
        if self.live_mode:
            self._refresh()
        elif self.enabled:
            parts = [f"eval step {record.get('step', '?')}"]
            parts += [f"{label} {_number(record, key, fmt)}" for label, key, fmt in _EVAL_FIELDS if key in record]
            self._print("  ".join(parts))

    def status(self, text: str) -> None:
        """Say what the run is doing between steps (warm start, evaluating, checkpointing)."""
        self._status = text
        if self.live_mode:
            self._refresh()
        elif self.enabled and self._status_is_news(text):
            self._print(text)

    def warn(self, text: str) -> None:
        """A warning the user must see, whatever the display: above a live bar, in a log, or on
        stderr when the display is off."""
        if self.enabled:
            self.console.print(f"warning: {text}", highlight=False, markup=False, soft_wrap=True)
        else:
            print(f"warning: {text}", file=sys.stderr, flush=True)

    def _status_is_news(self, text: str) -> bool:
        kind, now = re.sub(r"[\d.,]+", "#", text), time.monotonic()
        if (
            self._last_status is not None
            and self._last_status[0] == kind
            and now - self._last_status[1] < _STATUS_INTERVAL_S
        ):
            return False
        self._last_status = (kind, now)
        return True

    def _numbers(self) -> str:
        latest = {**self._latest, **{f"eval/{key}": value for key, value in self._latest_eval.items()}}
        return "  ".join(f"{label} {_number(latest, key, fmt)}" for label, key, fmt in _STEP_FIELDS if key in latest)

    def _renderable(self) -> Group:
        return Group(self._progress, Text(self._numbers()), Text(self._status, style="dim"))

    def _refresh(self) -> None:
        if self._live is not None:
            self._live.update(self._renderable())

    def _print(self, line: str) -> None:
        self.console.print(line, highlight=False, markup=False, soft_wrap=True)


def _number(record: dict, key: str, fmt: str) -> str:
    value = record[key]
    return fmt.format(value) if isinstance(value, (int, float)) else "-"


def _wall(record: dict) -> str:
    wall = record.get("time/wall_s")
    return f"  wall {wall:.0f} s" if isinstance(wall, (int, float)) else ""
