"""``asyncrl bench e2e``: wall time to a held-out accuracy, synchronous against asynchronous.

The default task and tiny model (or the run config of ``--config``) train with ``max_lag`` 0
(synchronous), 1 and 2, each over several seeds, for the same number of steps, so the same number
of samples. The target is on one held-out metric, ``--metric``: ``accuracy`` (exact answers) or
``reward_mean`` (the mean reward, which moves where exact answers stay rare, as in the tool task's
digit credit); every figure below is of that metric. The report gives:

- the wall time to a target held-out accuracy (mean, spread, median over seeds);
- the final accuracy at that sample budget, so that speed bought with accuracy shows;
- the accuracy each setting had reached after as many seconds of training as the fastest run took
  in all (``equal_time_s``): the comparison that still holds when no run reaches the target;
- the goal ratios: how long ``max_lag: 1`` takes to reach the synchronous run's final accuracy,
  as a fraction of the synchronous run's wall time, and with ``--against trl`` the same against
  TRL's final accuracy and TRL's wall time;
- per-seed ratios of time to the target, max_lag 1 over max_lag 0 and TRL over each asyncrl
  setting, paired by seed (every run starts from the same warm-started weights, ``warm_start.seed``),
  with their spread: a seed where either side misses the target has no ratio and shows as unreached.

Times count training only: evaluations are timed and subtracted on both sides. ``--against trl``
trains the same model from the same warm-started weights with TRL's GRPOTrainer on the same
prompts (asyncrl/bench/trl_baseline.py) and reports the ratio of median times to the target.

``--timing-seeds K`` adds short runs (``--timing-steps`` steps, evaluated only before the first
step and after the last) of every setting over K seeds, under a step profile
(asyncrl/bench/step_profile.py): each run's seconds per step, split into generation, rewards,
forward, backward, optimizer and weight sync, and the step-time ratio of TRL over each asyncrl
setting, paired by seed: where the time goes when a ratio is not what the goal asks.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

from asyncrl.bench.common import QUICK_RUN
from asyncrl.bench.step_profile import EVALUATION, StepProfile
from asyncrl.config import RunConfig, load_config
from asyncrl.metrics import read_jsonl
from asyncrl.run import train

LAGS = (0, 1, 2)
# ``--variants``: loss settings of docs/loss.md, each trained at max_lag 1 beside the rows above
VARIANTS = {
    "max_lag=1,num_minibatches=4": ["step.num_minibatches=4"],
    "max_lag=1,dynamic_sampling": ["step.filter_zero_variance=true", "step.max_refill_groups=4"],
}
GOAL_FRACTION_OF_SYNC = 0.6  # max_lag 1 reaches sync's final accuracy in this fraction of its time
GOAL_FRACTION_OF_TRL = 0.5  # max_lag 1 reaches TRL's final accuracy in this fraction of TRL's time
GOAL_SPEEDUP_OVER_TRL = 2.0


METRICS = ("accuracy", "reward_mean")  # eval.jsonl fields a target can be on


def settings(
    *,
    config: Path | None,
    metric: str,
    overrides: list[str],
    quick: bool,
    seeds: int,
    max_steps: int | None,
    eval_every: int | None,
    target: float,
    against: str | None,
    variants: bool,
    lags: tuple[int, ...],
    timing_seeds: int = 0,
    timing_steps: int = 4,
) -> dict[str, Any]:
    """What ``asyncrl bench e2e`` trains, as written into its result: ``--quick`` is a tiny model,
    a few steps and one seed; unset step counts take the full benchmark's."""
    return {
        "config": str(config) if config is not None else None,
        "metric": metric,
        "overrides": (QUICK_RUN if quick else []) + overrides,
        "seeds": list(range(1 if quick else seeds)),
        "max_steps": max_steps or (6 if quick else 400),
        "eval_every": eval_every or (3 if quick else 25),
        "target_accuracy": target,
        "against": against,
        "variants": VARIANTS if variants else {},
        "lags": list(lags),
        "timing_seeds": list(range(timing_seeds)),
        "timing_steps": timing_steps,
    }


def run_settings(settings: dict[str, Any], config_path: Path | None) -> dict[str, Any]:
    """``run`` over what ``settings`` describes, then ``run_timing`` if it has timing seeds."""
    result = run(
        overrides=settings["overrides"],
        seeds=tuple(settings["seeds"]),
        max_steps=settings["max_steps"],
        eval_every=settings["eval_every"],
        target=settings["target_accuracy"],
        against_trl=settings["against"] == "trl",
        variants=settings["variants"],
        lags=tuple(settings["lags"]),
        config_path=config_path,
        metric=settings["metric"],
    )
    if settings.get("timing_seeds"):
        result["step_profiles"] = run_timing(
            overrides=settings["overrides"],
            seeds=tuple(settings["timing_seeds"]),
            steps=settings["timing_steps"],
            against_trl=settings["against"] == "trl",
            lags=tuple(settings["lags"]),
            config_path=config_path,
        )
    return result


def bench_config(
    overrides: list[str], *, seed: int, max_lag: int, max_steps: int, eval_every: int, config_path: Path | None = None
) -> RunConfig:
    """``config_path``'s run config (default: the embedded one) with the overrides, then the bench's own."""
    return load_config(
        config_path,
        [
            *overrides,
            f"seed={seed}",
            f"sampler.max_lag={max_lag}",
            f"step.max_steps={max_steps}",
            f"logging.eval_every_steps={eval_every}",
            "checkpoint.every_steps=null",
            "logging.tensorboard=false",
            "logging.progress=false",
        ],
    )


def run_asyncrl(config: RunConfig, output_dir: Path) -> dict[str, Any]:
    """One run; its evals with wall time (total, and without evaluation time) and samples trained."""
    summary = train(config, output_dir=output_dir)
    steps = {record["step"]: record for record in read_jsonl(output_dir / "metrics.jsonl")}
    samples_per_step = config.step.prompts_per_step * config.step.generations_per_prompt
    evals, eval_seconds = [], 0.0
    for record in read_jsonl(output_dir / "eval.jsonl"):
        step = record["step"]
        eval_seconds += record["time/eval_s"]
        wall = (steps[step]["time/wall_s"] if step in steps else 0.0) + record["time/eval_s"]
        evals.append(
            {
                "step": step,
                "samples": step * samples_per_step,
                "wall_s": wall,
                "train_wall_s": wall - eval_seconds,
                **{metric: record[metric] for metric in METRICS},
            }
        )
    return {"evals": evals, "wall_s": summary["wall_seconds"]}


def time_to(evals: list[dict], level: float, metric: str = "accuracy") -> float | None:
    """Training seconds until the first evaluation with ``metric`` at or above ``level``; None if never."""
    return next((e["train_wall_s"] for e in evals if e[metric] >= level), None)


def value_at(evals: list[dict], train_wall_s: float, metric: str = "accuracy") -> float:
    """``metric`` at the last evaluation taken within ``train_wall_s`` seconds of training."""
    return [e for e in evals if e["train_wall_s"] <= train_wall_s][-1][metric]


def summarize(values: list[float | None]) -> dict[str, Any]:
    reached = [v for v in values if v is not None]
    return {
        "values": values,
        "reached": f"{len(reached)}/{len(values)}",
        "mean": statistics.fmean(reached) if reached else None,
        "median": statistics.median(reached) if len(reached) == len(values) and reached else None,
        "spread": (max(reached) - min(reached)) if reached else None,
    }


def run(
    *,
    overrides: list[str],
    seeds: tuple[int, ...],
    max_steps: int,
    eval_every: int,
    target: float,
    against_trl: bool,
    lags: tuple[int, ...] = LAGS,
    variants: dict[str, list[str]] | None = None,
    config_path: Path | None = None,
    metric: str = "accuracy",
) -> dict[str, Any]:
    """``variants``: name -> overrides, each trained at max_lag 1 over the same seeds; ``target``
    is a level of ``metric``."""
    settings = {f"max_lag={lag}": (lag, overrides) for lag in lags}
    settings.update({name: (1, overrides + extra) for name, extra in (variants or {}).items()})
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-e2e-") as tmp:
        for index, (name, (lag, setting)) in enumerate(settings.items()):
            runs[name] = [
                run_asyncrl(
                    bench_config(
                        setting,
                        seed=seed,
                        max_lag=lag,
                        max_steps=max_steps,
                        eval_every=eval_every,
                        config_path=config_path,
                    ),
                    Path(tmp) / f"setting{index}-seed{seed}",
                )
                for seed in seeds
            ]
        if against_trl:
            from asyncrl.bench.trl_baseline import run_trl

            runs["trl"] = [
                run_trl(
                    bench_config(
                        overrides,
                        seed=seed,
                        max_lag=0,
                        max_steps=max_steps,
                        eval_every=eval_every,
                        config_path=config_path,
                    ),
                    seed=seed,
                    max_steps=max_steps,
                    eval_every_steps=eval_every,
                    output_dir=Path(tmp) / f"trl-seed{seed}",
                )
                for seed in seeds
            ]
    return summarize_runs(runs, target, metric)


def summarize_runs(runs: dict[str, list[dict]], target: float, metric: str = "accuracy") -> dict[str, Any]:
    """The report of ``run``, from each setting's runs (one per seed) and their evaluations; every
    level (target, final value, value at equal time) is of ``metric``, and the keys name it."""
    results: dict[str, Any] = {"runs": {}, "metric": metric}
    equal_time = min(r["evals"][-1]["train_wall_s"] for seed_runs in runs.values() for r in seed_runs)
    for name, seed_runs in runs.items():
        final = [r["evals"][-1][metric] for r in seed_runs]
        results["runs"][name] = {
            "time_to_target_s": summarize([time_to(r["evals"], target, metric) for r in seed_runs]),
            f"final_{metric}": summarize(final),
            f"{metric}_at_equal_time": summarize([value_at(r["evals"], equal_time, metric) for r in seed_runs]),
            "train_wall_s": summarize([r["evals"][-1]["train_wall_s"] for r in seed_runs]),
            "samples": seed_runs[0]["evals"][-1]["samples"],
            "evals": [r["evals"] for r in seed_runs],
        }
        if "unmatched" in seed_runs[0]:
            results["runs"][name]["unmatched"] = seed_runs[0]["unmatched"]
        if "reward_errors" in seed_runs[0]:
            results["runs"][name]["reward_errors"] = [r["reward_errors"] for r in seed_runs]
    results["equal_time_s"] = equal_time
    for reference, label, goal in (("max_lag=0", "sync", GOAL_FRACTION_OF_SYNC), ("trl", "trl", GOAL_FRACTION_OF_TRL)):
        if reference in runs and "max_lag=1" in runs:
            results[f"max_lag_1_time_to_{label}_final_{metric}_over_{label}_time"] = _time_to_final(
                results["runs"][reference], runs["max_lag=1"], label, goal, metric
            )
    results["time_to_target_ratios"] = seed_ratios(runs, target, metric)
    if "trl" in results["runs"]:
        results["trl_time_to_target_over_asyncrl"] = {
            name: _ratio(results["runs"]["trl"], results["runs"][name]) for name in results["runs"] if name != "trl"
        }
    return results


def _time_to_final(reference: dict, lag1_runs: list[dict], label: str, goal: float, metric: str) -> dict[str, Any]:
    """How long max_lag 1 takes to reach ``reference``'s final ``metric`` (mean over seeds), as a
    fraction of the reference's training time: the goal ratios against sync and against TRL."""
    final = reference[f"final_{metric}"]["mean"]
    times = [time_to(r["evals"], final, metric) for r in lag1_runs]
    fraction = summarize([t / reference["train_wall_s"]["mean"] if t is not None else None for t in times])
    return {
        **fraction,
        f"{label}_final_{metric}": final,
        "goal": goal,
        "goal_met": fraction["median"] is not None and fraction["median"] <= goal,
    }


def seed_ratios(runs: dict[str, list[dict]], target: float, metric: str = "accuracy") -> dict[str, dict[str, Any]]:
    """Time to ``target`` of one setting over another's, seed by seed: max_lag 1 over max_lag 0,
    and TRL over every asyncrl setting, each summarized with its spread."""
    pairs = [("max_lag=1", "max_lag=0")] + [("trl", name) for name in runs if name != "trl" and "trl" in runs]
    ratios = {}
    for over, under in pairs:
        if over in runs and under in runs:
            times = zip(
                (time_to(r["evals"], target, metric) for r in runs[over]),
                (time_to(r["evals"], target, metric) for r in runs[under]),
            )
            ratios[f"{over} / {under}"] = summarize([a / b if a is not None and b else None for a, b in times])
    return ratios


def _ratio(trl: dict, ours: dict) -> dict[str, Any]:
    trl_median, our_median = trl["time_to_target_s"]["median"], ours["time_to_target_s"]["median"]
    ratio = trl_median / our_median if trl_median is not None and our_median else None
    return {
        "ratio": ratio,
        "goal": GOAL_SPEEDUP_OVER_TRL,
        "goal_met": ratio is not None and ratio >= GOAL_SPEEDUP_OVER_TRL,
    }


def profile_phases(*, trl: bool) -> dict[str, list[tuple[Any, str]]]:
    """The functions that do each phase of a step, on both sides: the rollouts' episodes and
    rewards, the trainer's forward passes (the loss's and any logprob scoring pass), PyTorch's
    backward and AdamW step, asyncrl's weight export and loads; the evaluations bracket the window."""
    import torch

    from asyncrl.rewards import RewardRunner
    from asyncrl.rollout import RolloutWorker
    from asyncrl.rollout.episode import MultiTurn, SingleTurn
    from asyncrl.trainer.policy import PolicyTrainer

    phases: dict[str, list[tuple[Any, str]]] = {
        EVALUATION: [(RolloutWorker, "evaluate")],
        "generation": [(SingleTurn, "run"), (MultiTurn, "run")],
        "rewards": [(RewardRunner, "score")],
        "forward": [(PolicyTrainer, "_microbatch_loss"), (PolicyTrainer, "compute_logprobs")],
        "backward": [(torch.autograd, "backward")],
        "optimizer": [(torch.optim.AdamW, "step")],
        "sync": [(PolicyTrainer, "export_weights"), (RolloutWorker, "load_weights")],
    }
    if trl:
        from trl import GRPOTrainer

        from asyncrl.bench.trl_baseline import Evaluator

        phases[EVALUATION].append((Evaluator, "evaluate"))
        phases["generation"].append((GRPOTrainer, "_generate"))
        phases["forward"].append((GRPOTrainer, "_get_per_token_logps_and_entropies"))
    return phases


def run_timing(
    *,
    overrides: list[str],
    seeds: tuple[int, ...],
    steps: int,
    against_trl: bool,
    lags: tuple[int, ...],
    config_path: Path | None,
) -> dict[str, Any]:
    """Short profiled runs of every setting over ``seeds``: the step profile of each run, each
    setting's seconds per step, and TRL's seconds per step over each asyncrl setting's by seed."""
    names = [f"max_lag={lag}" for lag in lags] + (["trl"] if against_trl else [])
    profiles: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-e2e-timing-") as tmp:
        for seed in seeds:
            for name in names:
                lag = 0 if name == "trl" else int(name.split("=")[1])
                config = bench_config(
                    overrides,
                    seed=seed,
                    max_lag=lag,
                    max_steps=steps,
                    eval_every=steps,
                    config_path=config_path,
                )
                output_dir = Path(tmp) / f"{name}-seed{seed}"
                with StepProfile(profile_phases(trl=name == "trl")) as profile:
                    if name == "trl":
                        from asyncrl.bench.trl_baseline import run_trl

                        run_trl(config, seed=seed, max_steps=steps, eval_every_steps=steps, output_dir=output_dir)
                    else:
                        run_asyncrl(config, output_dir)
                profiles[name].append(profile.window(steps))
    return summarize_timing(profiles)


def summarize_timing(profiles: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Each setting's profiles (one per seed), its seconds per step over the seeds, and the
    per-seed ratios of TRL's seconds per step over each asyncrl setting's."""
    result: dict[str, Any] = {
        name: {"step_s": summarize([p["step_s"] for p in runs]), "profiles": runs} for name, runs in profiles.items()
    }
    if "trl" in profiles:
        result["trl_step_s_over"] = {
            name: summarize([t["step_s"] / o["step_s"] for t, o in zip(profiles["trl"], runs)])
            for name, runs in profiles.items()
            if name != "trl"
        }
    return result
