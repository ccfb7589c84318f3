"""The run report: one PNG that says whether a run learned, how stale its data was, and where the
time went. Built from the run's jsonl files alone, so ``asyncrl plot DIR`` can redraw it any time.

Every key is optional: a panel whose metrics are missing says so instead of failing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from asyncrl.metrics import EVAL_FILE, METRICS_FILE, read_jsonl

REPORT_FILE = "report.png"
SUMMARY_FILE = "summary.json"
# Past this many steps a per-step curve is drawn faint with a moving average over it.
_SMOOTH_FROM_STEPS = 60
# The per-step curves: (grid cell, [(record key, legend label)], title, y-axis label).
_LINE_PANELS = (
    ((1, 2), [("time/tokens_per_s", "generated tokens/s")], "throughput", "tokens / s"),
    ((1, 3), [("time/step_s", "step"), ("time/sync_pause_s", "sync pause")], "wall time per step", "seconds"),
    ((2, 0), [("loss", "loss")], "policy loss", "loss"),
    ((2, 1), [("grad_norm", "grad norm")], "gradient norm (before clipping)", "L2 norm"),
    ((2, 2), [("entropy", "entropy")], "policy entropy", "nats / token"),
    ((2, 3), [("mismatch_kl", "generator vs trainer"), ("kl", "policy vs reference")], "KL divergence", "nats / token"),
)


def write_report(run_dir: str | Path) -> Path:
    """Draw ``run_dir/report.png`` from metrics.jsonl, eval.jsonl and summary.json; returns its path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    run_dir = Path(run_dir)
    steps, evals, summary = _load(run_dir)
    fig = Figure(figsize=(18, 12.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)  # render off-screen, without pyplot's global state or a display
    grid = fig.add_gridspec(3, 4, height_ratios=(1.25, 1, 1))
    _reward_panel(fig.add_subplot(grid[0, :3]), steps, evals)
    _lag_panel(fig.add_subplot(grid[0, 3]), steps)
    _time_panel(fig.add_subplot(grid[1, :2]), steps)
    for (row, column), keys, title, ylabel in _LINE_PANELS:
        _line_panel(fig.add_subplot(grid[row, column]), steps, keys, title, ylabel)
    fig.suptitle(_title(run_dir, steps, evals, summary), fontsize=15, fontweight="bold")
    path = run_dir / REPORT_FILE
    tmp = run_dir / f".{REPORT_FILE}.tmp-{os.getpid()}"
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _load(run_dir: Path) -> tuple[list[dict], list[dict], dict]:
    metrics_path = run_dir / METRICS_FILE
    if not metrics_path.is_file():
        raise FileNotFoundError(f"{metrics_path}: no such file; is {run_dir} a run directory?")
    steps = read_jsonl(metrics_path)
    if not steps:
        raise ValueError(f"{metrics_path}: no step records yet")
    evals = read_jsonl(run_dir / EVAL_FILE) if (run_dir / EVAL_FILE).is_file() else []
    summary_path = run_dir / SUMMARY_FILE
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    return steps, evals, summary


# ---- data ------------------------------------------------------------------------------------


def _series(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the records that hold a number under ``key``."""
    points = [(r["step"], r[key]) for r in records if _is_number(r.get(key)) and _is_number(r.get("step"))]
    return [step for step, _ in points], [value for _, value in points]


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _total(records: list[dict], key: str) -> float:
    return sum(r[key] for r in records if _is_number(r.get(key)))


def _moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values, the same length as ``values``."""
    averaged, running = [], 0.0
    for i, value in enumerate(values):
        running += value
        if i >= window:
            running -= values[i - window]
        averaged.append(running / min(i + 1, window))
    return averaged


def _window(values: list[float]) -> int:
    return max(len(values) // 20, 3)


def _lag_counts(steps: list[dict]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for record in steps:
        for lag, groups in (record.get("lag_histogram") or {}).items():
            counts[int(lag)] = counts.get(int(lag), 0) + groups
    return dict(sorted(counts.items()))


def _time_totals(steps: list[dict]) -> dict[str, float]:
    """Seconds over the run: busy and idle of generation and training, and the sync pauses.

    Generation busy time is summed over rollout workers, so its idle time is too: a step's
    worker-seconds are busy / (1 - idle fraction), of which the idle fraction was idle.
    """
    generation_idle = train_idle = 0.0
    for r in steps:
        step_s = r["time/step_s"] if _is_number(r.get("time/step_s")) else 0.0
        busy, idle = r.get("time/generation_s"), r.get("time/generation_idle_fraction")
        if _is_number(busy) and _is_number(idle):
            generation_idle += busy * idle / (1.0 - idle) if idle < 1.0 else step_s
        if _is_number(r.get("time/train_idle_fraction")):
            train_idle += r["time/train_idle_fraction"] * step_s
    return {
        "generation busy": _total(steps, "time/generation_s"),
        "generation idle": generation_idle,
        "train busy": _total(steps, "time/train_s"),
        "train idle": train_idle,
        "sync pause": _total(steps, "time/sync_pause_s"),
    }


# ---- panels ----------------------------------------------------------------------------------


def _no_data(ax, title: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_xticks([])
    ax.set_yticks([])


def _step_axis(ax, title: str, ylabel: str) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)


def _plot_steps(ax, xs: list[float], ys: list[float], label: str, color: str) -> None:
    """A per-step curve; long runs get a faint raw curve under a moving average."""
    if len(ys) < _SMOOTH_FROM_STEPS:
        ax.plot(xs, ys, color=color, label=label, marker=".")
        return
    window = _window(ys)
    ax.plot(xs, ys, color=color, alpha=0.25, linewidth=1)
    ax.plot(xs, _moving_average(ys, window), color=color, linewidth=2, label=f"{label} ({window}-step mean)")


def _reward_panel(ax, steps: list[dict], evals: list[dict]) -> None:
    title = "reward and accuracy"
    reward_x, reward = _series(steps, "reward_mean")
    accuracy_x, accuracy = _series(steps, "accuracy")
    eval_x, eval_accuracy = _series(evals, "accuracy")
    if not (reward or accuracy or eval_accuracy):
        return _no_data(ax, title)
    if reward:
        _plot_steps(ax, reward_x, reward, "train reward", "tab:blue")
        std_x, std = _series(steps, "reward_std")
        if std_x == reward_x:
            center, spread = reward, std
            if len(std) >= _SMOOTH_FROM_STEPS:
                center, spread = _moving_average(reward, _window(reward)), _moving_average(std, _window(std))
            low = [m - s for m, s in zip(center, spread)]
            high = [m + s for m, s in zip(center, spread)]
            ax.fill_between(reward_x, low, high, color="tab:blue", alpha=0.1, linewidth=0, label="train reward ± 1 std")
    if accuracy:
        _plot_steps(ax, accuracy_x, accuracy, "train accuracy", "tab:orange")
    if eval_accuracy:
        ax.plot(
            eval_x,
            eval_accuracy,
            color="tab:green",
            marker="o",
            markersize=7,
            linestyle="--",
            label="eval accuracy (held out)",
        )
        ax.annotate(
            f"{eval_accuracy[-1]:.3f}",
            (eval_x[-1], eval_accuracy[-1]),
            textcoords="offset points",
            xytext=(6, 6),
            color="tab:green",
            fontweight="bold",
        )
    _step_axis(ax, title, "reward / fraction correct")
    ax.legend(loc="best")


def _lag_panel(ax, steps: list[dict]) -> None:
    title = "staleness of trained groups"
    counts = _lag_counts(steps)
    if not counts:
        return _no_data(ax, title)
    bars = ax.bar(list(counts), list(counts.values()), color="tab:purple", width=0.7)
    ax.bar_label(bars, padding=2)
    ax.set_xticks(list(counts))
    ax.margins(y=0.15)
    total = sum(counts.values())
    mean = sum(lag * n for lag, n in counts.items()) / total
    evicted = max((r["evicted_groups"] for r in steps if _is_number(r.get("evicted_groups"))), default=0)
    ax.set_title(f"{title}\n{total} groups, mean lag {mean:.2f}, {evicted} evicted as too stale", fontsize="medium")
    ax.set_xlabel("lag (trainer version - generation version)")
    ax.set_ylabel("groups trained")
    ax.grid(axis="y", alpha=0.3)


_TIME_COLORS = {"generation": "tab:blue", "train": "tab:red", "sync": "tab:gray"}


def _time_panel(ax, steps: list[dict]) -> None:
    title = "where the time went (whole run)"
    totals = _time_totals(steps)
    if not any(totals.values()):
        return _no_data(ax, title)
    names = list(totals)[::-1]
    colors = [_TIME_COLORS[name.split()[0]] for name in names]
    bars = ax.barh(names, [totals[n] for n in names], color=colors, height=0.6)
    for bar, name in zip(bars, names):
        if name.endswith("idle"):
            bar.set_alpha(0.4)
    ax.bar_label(bars, labels=[f"{totals[n]:,.1f} s" for n in names], padding=4)
    ax.margins(x=0.15)
    ax.set_title(title)
    ax.set_xlabel("seconds (generation: summed over rollout workers)")
    ax.grid(axis="x", alpha=0.3)


def _line_panel(ax, steps: list[dict], keys: list[tuple[str, str]], title: str, ylabel: str) -> None:
    drawn = 0
    for (key, label), color in zip(keys, ("tab:blue", "tab:red")):
        xs, ys = _series(steps, key)
        if ys:
            _plot_steps(ax, xs, ys, label, color)
            drawn += 1
    if not drawn:
        return _no_data(ax, title)
    _step_axis(ax, title, ylabel)
    if len(keys) > 1 or len(steps) >= _SMOOTH_FROM_STEPS:
        ax.legend(loc="best", fontsize="small")


def _title(run_dir: Path, steps: list[dict], evals: list[dict], summary: dict) -> str:
    parts = [f"{run_dir.resolve().name}: {summary.get('steps', steps[-1].get('step', len(steps)))} steps"]
    first = summary.get("initial_eval_accuracy", evals[0].get("accuracy") if evals else None)
    last = summary.get("final_eval_accuracy", evals[-1].get("accuracy") if evals else None)
    if _is_number(first) and _is_number(last):
        parts.append(f"eval accuracy {first:.3f} → {last:.3f}")
    if _is_number(steps[-1].get("reward_mean")):
        parts.append(f"final train reward {steps[-1]['reward_mean']:.3f}")
    wall = summary.get("wall_seconds", steps[-1].get("time/wall_s"))
    if _is_number(wall):
        parts.append(_duration(wall))
    return "   ·   ".join(parts)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
