"""``asyncrl bench``: every --quick variant runs and reports the keys its page needs.

Timings are never asserted (the machines are shared and noisy); shapes, keys and the arithmetic
of the ratios are.
"""

import json

import pytest
import torch
from helpers import ROOT
from transformers import AutoModelForCausalLM

from asyncrl.bench import e2e, long_context, report
from asyncrl.bench.common import QUICK_RUN
from asyncrl.cli import main
from asyncrl.models import tiny_config

pytestmark = pytest.mark.slow


def bench(capsys, tmp_path, name, *args):
    output = tmp_path / f"{name.split()[0]}.json"
    code = main(["bench", *name.split(), "--quick", "--output", str(output), *args])
    printed = capsys.readouterr().out
    assert code == 0
    result = json.loads(output.read_text())
    assert json.loads(printed) == result
    for key in ("machine", "versions", "settings", "results", "commit", "date"):
        assert key in result
    assert result["versions"]["torch"] and result["machine"]["cores"]
    return result


def test_overlap_reports_ratios_against_the_ideal_and_the_synchronous_loop(capsys, tmp_path):
    rows = bench(capsys, tmp_path, "overlap")["results"]
    assert len(rows) == 3 * 3  # (g, t) shapes x max_lag 0, 1, 2
    for row in rows:
        assert row["step_time_over_ideal"] == pytest.approx(row["step_time_s"] / max(row["g_s"], row["t_s"]))
        assert row["sync_step_time_over_ideal"] == pytest.approx(row["sync_step_time_s"] / (row["g_s"] + row["t_s"]))
        assert row["speedup_over_sync"] == pytest.approx(row["sync_step_time_s"] / row["step_time_s"])
        assert row["step_time_over_ideal"] > 0.9  # no step beats the physical limit
        assert (row["goal_met"] is None) == (row["max_lag"] == 0)


def test_controller_reports_time_per_group_and_its_top_costs(capsys, tmp_path):
    result = bench(capsys, tmp_path, "controller")["results"]
    inline = result["inline"]
    assert inline["groups"] == 50 * 8
    assert 0 < inline["controller_s"] < inline["wall_s"]  # the workers' own time is subtracted
    assert inline["controller_us_per_group"] == pytest.approx(1e6 * inline["controller_s"] / inline["groups"])
    functions = [row["function"] for row in result["profile_top_by_own_time"]]
    assert functions and not any("fake_workers" in f or "trainer/worker" in f for f in functions)


def test_weight_sync_compares_with_memcpy(capsys, tmp_path):
    (row,) = bench(capsys, tmp_path, "weight-sync")["results"]
    assert row["model"] == "1M" and 0.9e6 < row["parameters"] < 1.2e6
    assert row["sync_bytes"] >= 4 * row["parameters"]  # float32, every tensor of the state dict
    assert row["fraction_of_memcpy"] == pytest.approx(row["sync_bytes_per_s"] / row["memcpy_bytes_per_s"])


def test_e2e_reports_time_to_target_and_final_accuracy(capsys, tmp_path):
    result = bench(capsys, tmp_path, "e2e", "--target", "0.0")["results"]
    assert set(result["runs"]) == {"max_lag=0", "max_lag=1", "max_lag=2"}
    for run in result["runs"].values():
        assert run["time_to_target_s"]["values"] == [0.0]  # accuracy >= 0 holds at the first eval
        assert [e["step"] for e in run["evals"][0]] == [0, 3, 6] and run["samples"] == 6 * 4 * 4
    assert "max_lag_1_time_to_sync_final_accuracy_over_sync_time" in result
    fastest = min(run["train_wall_s"]["mean"] for run in result["runs"].values())
    assert result["equal_time_s"] == pytest.approx(fastest)


def test_equal_time_accuracy_is_taken_where_the_fastest_run_ended():
    def runs(*finals):
        return [
            {
                "evals": [
                    {"train_wall_s": 0.0, "accuracy": 0.1, "samples": 0},
                    {"train_wall_s": t, "accuracy": a, "samples": 8},
                ]
            }
            for t, a in finals
        ]

    result = e2e.summarize_runs({"max_lag=0": runs((10.0, 0.5)), "max_lag=1": runs((6.0, 0.4))}, target=0.45)
    assert result["equal_time_s"] == 6.0
    assert result["runs"]["max_lag=0"]["accuracy_at_equal_time"]["values"] == [0.1]  # it had not evaluated again by 6 s
    assert result["runs"]["max_lag=1"]["accuracy_at_equal_time"]["values"] == [0.4]
    assert result["runs"]["max_lag=0"]["time_to_target_s"]["values"] == [10.0]


def saved_result(directory, name, settings, results) -> None:
    """A bench result file as ``asyncrl bench`` writes it, with placeholder provenance."""
    provenance = {"date": "d", "commit": "c", "machine": {"cpu": "x", "cores": 2, "cuda": None}, "versions": {}}
    (directory / f"{name}.json").write_text(json.dumps({"settings": settings, "results": results, **provenance}))


def test_time_to_target_ratios_pair_the_runs_of_each_seed_and_report_their_spread(tmp_path):
    def run(*points):
        return {"evals": [{"train_wall_s": t, "accuracy": a, "samples": 0} for t, a in [(0.0, 0.1), *points]]}

    runs = {
        "max_lag=0": [run((10.0, 0.5)), run((20.0, 0.5)), run((8.0, 0.5))],
        "max_lag=1": [run((5.0, 0.5)), run((15.0, 0.5)), run((8.0, 0.2))],
        "trl": [run((30.0, 0.5)), run((40.0, 0.5)), run((16.0, 0.5))],
    }
    ratios = e2e.summarize_runs(runs, target=0.45)["time_to_target_ratios"]
    assert set(ratios) == {"max_lag=1 / max_lag=0", "trl / max_lag=0", "trl / max_lag=1"}
    lag = ratios["max_lag=1 / max_lag=0"]
    assert lag["values"] == [0.5, 0.75, None] and lag["reached"] == "2/3" and lag["spread"] == pytest.approx(0.25)
    trl = ratios["trl / max_lag=0"]
    assert trl["values"] == [3.0, 2.0, 2.0] and trl["median"] == 2.0 and trl["spread"] == 1.0
    summary = e2e.summarize_runs(runs, 0.45)
    saved_result(tmp_path, "e2e", {"target_accuracy": 0.45}, summary)
    text = report.render(tmp_path)
    assert "| max_lag=1 | 5.0 | 15.0 | n/a |" in text and "| max_lag=1 / max_lag=0 | 2/3 | n/a | 0.62 | 0.25 |" in text
    saved_result(tmp_path, "e2e-trl-reasoning-gym", {"target_accuracy": 0.45}, summary)
    assert "### `asyncrl bench e2e --against trl data.task.name=reasoning_gym ...`" in report.render(tmp_path)
    saved_result(tmp_path, "e2e-trl-long-responses", {"target_accuracy": 0.45}, summary)
    assert "### `asyncrl bench e2e --against trl data.task.options.difficulty=3 ...`" in report.render(tmp_path)


def test_time_to_target_uses_training_time_and_the_first_eval_that_reaches_it():
    evals = [
        {"train_wall_s": 0.0, "accuracy": 0.1},
        {"train_wall_s": 2.0, "accuracy": 0.4},
        {"train_wall_s": 4.0, "accuracy": 0.3},
        {"train_wall_s": 6.0, "accuracy": 0.5},
    ]
    assert e2e.time_to(evals, 0.35) == 2.0 and e2e.time_to(evals, 0.45) == 6.0 and e2e.time_to(evals, 0.6) is None
    assert e2e.value_at(evals, 5.0) == 0.3 and e2e.value_at(evals, 6.0) == 0.5 and e2e.value_at(evals, 0.0) == 0.1
    summary = e2e.summarize([2.0, None, 4.0])
    assert summary["reached"] == "2/3" and summary["mean"] == 3.0 and summary["median"] is None


def test_results_land_in_the_working_directory_not_the_package(capsys, tmp_path, monkeypatch):
    from asyncrl.bench import common

    monkeypatch.chdir(tmp_path)
    common.write_result("probe", {"a": 1}, [1, 2])
    assert json.loads((tmp_path / "bench-results" / "probe.json").read_text())["results"] == [1, 2]
    assert json.loads(capsys.readouterr().out)["settings"] == {"a": 1}


def test_the_only_installed_top_level_package_is_asyncrl():
    """A top-level ``benchmarks`` (or any other) package would shadow the user's own."""
    import tomllib

    from setuptools import find_packages

    root = ROOT
    include = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {name.split(".")[0] for name in find_packages(str(root), include=include)} == {"asyncrl"}


def test_the_backends_table_gives_each_backends_rates_sync_and_step_time(tmp_path):
    rows = [
        {"backend": "hf", "short_tokens_per_s": 23653.5, "long_tokens_per_s": 14653.0, "sync_s_median": 0.0001}
        | {"step_s_mean": 0.345},
        {"backend": "vllm", "short_tokens_per_s": 4226.9, "long_tokens_per_s": 5717.5, "sync_s_median": 0.0544}
        | {"step_s_mean": 3.42},
    ]
    settings = {"requests": 128, "updates": 10, "train_steps": 30, "max_new_tokens": {"short": 16, "long": 256}}
    saved_result(tmp_path, "backends", settings, rows)
    text = report.render(tmp_path)
    assert "### `asyncrl bench backends`" in text and "tokens/s, up to 256 new" in text
    assert "| hf | 23,654 | 14,653 | 0.1 | 0.34 |" in text and "| vllm | 4,227 | 5,718 | 54.4 | 3.42 |" in text


def test_report_replaces_only_the_generated_section(capsys, tmp_path):
    bench(capsys, tmp_path, "overlap")
    page = tmp_path / "performance.md"
    page.write_text(f"# Performance\n\nprose before\n\n{report.BEGIN}\nold tables\n{report.END}\n\nprose after\n")
    assert main(["bench", "report", "--results-dir", str(tmp_path), "--write", str(page)]) == 0
    text = page.read_text()
    assert "old tables" not in text and "prose before" in text and "prose after" in text
    assert "### `asyncrl bench overlap`" in text and "| local | 0.05 | 0.05 | 1 |" in text
    page.write_text("no markers")
    capsys.readouterr()
    assert main(["bench", "report", "--results-dir", str(tmp_path), "--write", str(page)]) == 2
    assert "--write:" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["overlap", "weight-sync"])
def test_the_ray_runtime_is_measured_through_the_same_handles(capsys, tmp_path, ray_cluster, name):
    rows = bench(capsys, tmp_path, name, "--runtime", "ray")["results"]
    assert rows and {row["runtime"] for row in rows} == {"ray"}
    if name == "weight-sync":
        assert [row["transport"] for row in rows] == ["object_store", "broadcast"]
        assert all(row["goal"] == 0.25 and row["sync_bytes"] >= 4 * row["parameters"] for row in rows)


@pytest.mark.slow
def test_the_trl_baseline_scores_a_reasoning_gym_task_with_the_tasks_own_checker(tmp_path):
    """The checker needs each answer's entry, which a dataset column would flatten to its text."""
    pytest.importorskip("trl")
    pytest.importorskip("reasoning_gym")
    from asyncrl.bench.trl_baseline import run_trl

    task = [
        "data.task.name=reasoning_gym",
        "data.task.options.dataset=basic_arithmetic",
        "data.task.options.dataset_config={min_terms: 2, max_terms: 2, max_digits: 1}",
        "rewards.functions=[task]",
        "data.task.options.num_problems=200",
    ]
    config = e2e.bench_config([*QUICK_RUN, *task], seed=0, max_lag=0, max_steps=2, eval_every=2)
    result = run_trl(config, seed=0, max_steps=2, eval_every_steps=2, output_dir=tmp_path)
    assert result["reward_errors"] == 0 and len(result["evals"]) == 2


def test_e2e_against_trl_reports_trl_runs_and_the_time_ratio(capsys, tmp_path):
    pytest.importorskip("trl")
    args = ["--target", "0.0", "--against", "trl", "--lags", "1,0", "--timing-seeds", "2", "--timing-steps", "2"]
    saved = bench(capsys, tmp_path, "e2e", *args)
    result = saved["results"]
    assert set(result["runs"]) == {"max_lag=0", "max_lag=1", "trl"}
    trl = result["runs"]["trl"]
    (evals,) = trl["evals"]
    assert [e["step"] for e in evals] == [0, 3, 6] and trl["samples"] == 6 * 4 * 4
    assert trl["time_to_target_s"]["values"] == [0.0]  # the clock starts with the first evaluation
    assert 0.0 < evals[1]["train_wall_s"] < evals[2]["train_wall_s"] < evals[2]["wall_s"]  # evaluations left out
    ratios = result["trl_time_to_target_over_asyncrl"]
    assert set(ratios) == {"max_lag=0", "max_lag=1"}
    assert all(r["goal"] == e2e.GOAL_SPEEDUP_OVER_TRL for r in ratios.values())
    assert "sampling seeds" in trl["unmatched"]
    # the profiled runs: every phase is found at its seam on both sides (a renamed method reads 0)
    timing = result["step_profiles"]
    assert set(timing) == {"max_lag=0", "max_lag=1", "trl", "trl_step_s_over"}
    for name in ("max_lag=0", "max_lag=1", "trl"):
        profiles = timing[name]["profiles"]
        assert len(profiles) == 2 and all(p["steps"] == 2 for p in profiles)
        expected = {"generation", "rewards", "forward", "backward", "optimizer"} | (
            {"sync"} if name != "trl" else set()
        )
        for profile in profiles:
            assert expected <= {phase for phase, s in profile["phases_s"].items() if s > 0}, name
            assert 0 < profile["busy_s"] <= profile["step_s"] + 1e-9
    assert timing["max_lag=0"]["step_s"]["reached"] == "2/2"
    assert set(timing["trl_step_s_over"]) == {"max_lag=0", "max_lag=1"}
    saved_result(tmp_path, "e2e-trl", saved["settings"], result)
    assert "| profiled run | seeds | s / step (median) | generation s |" in report.render(tmp_path)


def test_step_profiles_pair_trl_with_each_setting_by_seed_and_render_by_phase(tmp_path):
    def profile(step_s, **phases):
        return {"steps": 4, "step_s": step_s, "phases_s": phases, "busy_s": 0.0, "untimed_s": 0.5, "overlap_s": 0.25}

    timing = e2e.summarize_timing(
        {
            "max_lag=1": [profile(2.0, generation=1.0), profile(4.0, generation=3.0)],
            "trl": [profile(3.0, generation=1.5, backward=1.0), profile(5.0, generation=2.5, backward=1.0)],
        }
    )
    ratio = timing["trl_step_s_over"]["max_lag=1"]
    assert ratio["values"] == [1.5, 1.25] and ratio["median"] == pytest.approx(1.375)
    assert timing["trl"]["step_s"]["median"] == 4.0 and len(timing["trl"]["profiles"]) == 2
    run = {"evals": [{"train_wall_s": t, "accuracy": a, "samples": 0} for t, a in [(0.0, 0.1), (10.0, 0.5)]]}
    summary = {**e2e.summarize_runs({"max_lag=1": [run], "trl": [run]}, 0.45), "step_profiles": timing}
    saved_result(tmp_path, "e2e-trl-smollm2-sums", {"target_accuracy": 0.45}, summary)
    text = report.render(tmp_path)
    assert "### `asyncrl bench e2e --against trl --config configs/smollm2-sums.yaml ...`" in text
    # means over the seeds; a phase a side never ran reads 0
    assert "| max_lag=1 | 2 | 3.00 | 2.00 | 0.00 | 0.00 | 0.00 | 0.00 | 0.00 | 0.50 | 0.25 |" in text
    assert "| trl | 2 | 4.00 | 2.00 | 0.00 | 0.00 | 1.00 | 0.00 | 0.00 | 0.50 | 0.25 |" in text
    assert "TRL s / step over asyncrl max_lag=1's, per seed: median 1.38x, spread 0.25 (2/2 seeds)." in text


def test_the_trl_baseline_trains_the_same_lora_adapters(tmp_path):
    """TRL wraps its policy in peft with the run's ``lora`` section, and the evaluations load the
    adapters alone into the generator's slot, as asyncrl's weight sync does."""
    pytest.importorskip("trl")
    from asyncrl.bench.trl_baseline import run_trl, trl_settings
    from asyncrl.config import load_config

    assert "lora initialization" in trl_settings(load_config(None, ["sampler.max_lag=0", "lora.rank=4"]))["unmatched"]
    assert "lora initialization" not in trl_settings(load_config(None, ["sampler.max_lag=0"]))["unmatched"]
    config = e2e.bench_config(
        [*QUICK_RUN, "lora.rank=4", "trainer.lr=0.01"], seed=0, max_lag=0, max_steps=2, eval_every=1
    )
    result = run_trl(config, seed=0, max_steps=2, eval_every_steps=1, output_dir=tmp_path)
    assert [e["step"] for e in result["evals"]] == [0, 1, 2] and result["reward_errors"] == 0


@pytest.mark.parametrize("lags", ["1,x", "-1"])
def test_bad_lags_fail_before_any_run(capsys, tmp_path, monkeypatch, lags):
    monkeypatch.setattr(e2e, "run_asyncrl", lambda *a, **k: pytest.fail("an asyncrl run started"))
    assert main(["bench", "e2e", "--quick", "--lags", lags, "--output", str(tmp_path / "x.json")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: Invalid value for --lags: ")


def test_e2e_against_trl_without_trl_fails_before_any_run(capsys, tmp_path, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else find_spec(name, *a))
    monkeypatch.setattr(e2e, "run_asyncrl", lambda *a, **k: pytest.fail("an asyncrl run started"))
    assert main(["bench", "e2e", "--quick", "--against", "trl", "--output", str(tmp_path / "x.json")]) == 2
    assert capsys.readouterr().err == 'error: --against trl: TRL is not installed; run pip install -e ".[bench]"\n'


def test_e2e_against_trl_async_is_refused_in_one_line_before_any_run(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(e2e, "run_asyncrl", lambda *a, **k: pytest.fail("an asyncrl run started"))
    output = tmp_path / "x.json"
    assert main(["bench", "e2e", "--quick", "--against", "trl-async", "--output", str(output)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: --against trl-async: TRL's AsyncGRPOTrainer needs CUDA GPUs (")
    assert line.endswith("so it is not a baseline; see docs/performance.md") and not output.exists()


def test_trl_settings_map_every_shared_setting():
    from asyncrl.bench.trl_baseline import trl_settings
    from asyncrl.config import load_config

    constant = ["sampler.max_lag=0", "trainer.lr_schedule=constant"]
    base = trl_settings(load_config(None, constant))
    kwargs = base["kwargs"]
    assert kwargs["per_device_train_batch_size"] == 16 * 8 and kwargs["num_generations"] == 8
    assert kwargs["gradient_accumulation_steps"] == kwargs["num_iterations"] == kwargs["steps_per_generation"] == 1
    assert kwargs["loss_type"] == "dapo" and kwargs["lr_scheduler_type"] == "constant_with_warmup"
    assert (kwargs["epsilon"], kwargs["epsilon_high"], kwargs["delta"], kwargs["beta"]) == (0.2, 0.28, 3.0, 0.0)
    assert kwargs["use_cpu"] and not kwargs["bf16"] and not kwargs["activation_checkpointing"]
    always = {"sampling seeds", "generation.batch_size", "trainer.micro_batch_size", "advantage epsilon"}
    assert set(base["unmatched"]) == always
    changes = [
        ("step.generations_per_prompt=4", "num_generations", 4),
        ("step.prompts_per_step=3", "per_device_train_batch_size", 3 * 8),
        ("generation.max_new_tokens=7", "max_completion_length", 7),
        ("generation.top_p=0.9", "top_p", 0.9),
        ("generation.top_k=5", "top_k", 5),
        ("trainer.lr=0.001", "learning_rate", 0.001),
        ("trainer.betas=[0.8, 0.9]", "adam_beta1", 0.8),
        ("trainer.betas=[0.8, 0.9]", "adam_beta2", 0.9),
        ("trainer.eps=1e-6", "adam_epsilon", 1e-6),
        ("trainer.weight_decay=0.1", "weight_decay", 0.1),
        ("trainer.max_grad_norm=0.5", "max_grad_norm", 0.5),
        ("trainer.max_grad_norm=null", "max_grad_norm", 0.0),
        ("trainer.lr_schedule=cosine", "lr_scheduler_type", "cosine_with_min_lr"),
        ("algorithm.options.clip_low=0.1", "epsilon", 0.1),
        ("algorithm.options.clip_high=0.3", "epsilon_high", 0.3),
        ("algorithm.options.dual_clip=5.0", "delta", 5.0),
        ("algorithm.options.dual_clip=null", "delta", None),
        ("trainer.aggregation=seq-mean-token-mean", "loss_type", "grpo"),
        ("trainer.aggregation=seq-mean-token-sum", "loss_type", "luspo"),
        ("algorithm.options.scale_by_std=false", "scale_rewards", "none"),
        # with what they cannot match, listed under "unmatched"
        ("generation.temperature=0.7", "temperature", 0.7),
        ("trainer.warmup_steps=10", "warmup_steps", 10),
        ("algorithm.options.kl_coef=0.01", "beta", 0.01),
        ("algorithm.options.entropy_coef=0.01", "entropy_coef", 0.01),
        ("trainer.aggregation=seq-mean-token-sum-norm", "loss_type", "dr_grpo"),
    ]
    for override, key, value in changes:
        changed = trl_settings(load_config(None, [*constant, "trainer.norm_constant=16", override]))["kwargs"]
        assert changed[key] == value != kwargs[key], override
    cosine = trl_settings(load_config(None, ["trainer.lr_schedule=cosine", "trainer.min_lr_ratio=0.1"]))["kwargs"]
    assert cosine["lr_scheduler_kwargs"] == {"min_lr_rate": 0.1}
    unmatched = [
        ("generation.temperature=0.7", "generation.temperature"),
        ("trainer.warmup_steps=10", "trainer.warmup_steps"),
        ("algorithm.options.kl_coef=0.01", "algorithm.options.kl_clamp"),
        ("algorithm.options.baseline=leave_one_out", "algorithm.options.baseline"),
        ("step.filter_zero_variance=true", "step.filter_zero_variance"),
        ("algorithm.options.importance_sampling=icepop", "algorithm.options.importance_sampling"),
        ("sampler.max_lag=1", "sampler.max_lag"),
        ("algorithm.options.dual_clip=1.2", "algorithm.options.dual_clip"),
        (
            "algorithm.options.entropy_coef=0.01 trainer.aggregation=seq-mean-token-mean",
            "algorithm.options.entropy_coef",
        ),
    ]
    for override, key in unmatched:
        assert key in trl_settings(load_config(None, ["sampler.max_lag=0", *override.split()]))["unmatched"], override
    norm = ["sampler.max_lag=0", "trainer.aggregation=seq-mean-token-sum-norm", "generation.max_new_tokens=16"]
    assert (
        "trainer.norm_constant" not in trl_settings(load_config(None, [*norm, "trainer.norm_constant=16"]))["unmatched"]
    )
    assert "trainer.norm_constant" in trl_settings(load_config(None, [*norm, "trainer.norm_constant=8"]))["unmatched"]


@pytest.mark.slow
def test_e2e_variants_add_minibatch_and_dynamic_sampling_rows():
    result = e2e.run(
        overrides=QUICK_RUN,
        seeds=(0,),
        max_steps=2,
        eval_every=2,
        target=0.0,
        against_trl=False,
        lags=(),
        variants=e2e.VARIANTS,
    )
    assert set(result["runs"]) == set(e2e.VARIANTS)
    assert all(run["samples"] == 2 * 4 * 4 for run in result["runs"].values())


def test_memory_of_several_updates_holds_no_second_copy_of_the_step_start(capsys, tmp_path):
    (row,) = bench(capsys, tmp_path, "memory")["results"]
    assert row["model"] == "16M" and row["updates"] == 4 and row["parameters"] > 16e6
    assert row["extra_bytes"] == row["peak_rss_bytes_k4"] - row["peak_rss_bytes_k1"]
    assert row["in_memory_snapshot_bytes"] == 12 * row["parameters"]
    # a copy of weights and moments in memory would make this about 1
    assert row["extra_over_in_memory_snapshot"] < 0.5


TOOL_USE = ROOT / "configs" / "tool-use.yaml"


def test_e2e_summaries_and_report_are_on_the_chosen_metric(tmp_path):
    def run(*points):
        return {
            "evals": [
                {"train_wall_s": t, "accuracy": a, "reward_mean": r, "samples": 0}
                for t, a, r in [(0.0, 0.0, 0.5), *points]
            ]
        }

    runs = {"max_lag=0": [run((10.0, 0.0, 0.55), (20.0, 0.1, 0.6))], "max_lag=1": [run((5.0, 0.0, 0.6))]}
    result = e2e.summarize_runs(runs, target=0.58, metric="reward_mean")
    assert result["runs"]["max_lag=0"]["time_to_target_s"]["values"] == [20.0]
    assert result["runs"]["max_lag=1"]["reward_mean_at_equal_time"]["values"] == [0.6]
    assert result["time_to_target_ratios"]["max_lag=1 / max_lag=0"]["values"] == [0.25]
    goal = result["max_lag_1_time_to_sync_final_reward_mean_over_sync_time"]
    assert goal["sync_final_reward_mean"] == 0.6 and goal["values"] == [0.25] and goal["goal_met"]
    saved_result(tmp_path, "e2e-tool-use", {"target_accuracy": 0.58, "metric": "reward_mean"}, result)
    text = report.render(tmp_path)
    assert "### `asyncrl bench e2e --config configs/tool-use.yaml ...`" in text
    assert "final reward (mean)" in text and "the synchronous run's final reward_mean (0.600) in 0.25" in text


def test_e2e_goal_against_trl_is_max_lag_1s_time_to_trls_final_accuracy_over_trls_time(tmp_path):
    def run(*points):
        return {"evals": [{"train_wall_s": t, "accuracy": a, "reward_mean": a, "samples": 0} for t, a in points]}

    runs = {
        "max_lag=1": [run((0.0, 0.2), (30.0, 0.5), (60.0, 0.7))],
        "trl": [run((0.0, 0.2), (50.0, 0.6), (100.0, 0.65))],
    }
    goal = e2e.summarize_runs(runs, target=0.5)["max_lag_1_time_to_trl_final_accuracy_over_trl_time"]
    # 0.5 at 30 s is short of TRL's final 0.65; 0.7 at 60 s reaches it: 60 / 100
    assert goal["trl_final_accuracy"] == 0.65 and goal["values"] == [0.6] and not goal["goal_met"]
    runs["max_lag=1"] = [run((0.0, 0.2), (40.0, 0.66))]
    goal = e2e.summarize_runs(runs, target=0.5)["max_lag_1_time_to_trl_final_accuracy_over_trl_time"]
    assert goal["values"] == [0.4] and goal["goal_met"]
    saved_result(tmp_path, "e2e-trl-smollm2-sums", {"target_accuracy": 0.5}, e2e.summarize_runs(runs, 0.5))
    assert "max_lag 1 reaches TRL's final accuracy (0.650) in 0.40 of TRL's time" in report.render(tmp_path)


def test_e2e_names_its_result_after_the_config(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(e2e, "run", lambda **kwargs: {"metric": kwargs["metric"]})
    assert main(["bench", "e2e", "--config", str(TOOL_USE), "--metric", "reward_mean"]) == 0
    assert json.loads((tmp_path / "bench-results" / "e2e-tool-use.json").read_text())["results"]["metric"] == (
        "reward_mean"
    )


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--config", "missing.yaml"], "error: --config: no such file 'missing.yaml'"),
        (["--metric", "loss"], "error: Invalid value for --metric: 'loss' is not one of accuracy, reward_mean"),
        (
            ["--against", "trl", "environment.name=feedback"],
            "error: --against trl: environment.name 'feedback' is not a tool environment; TRL's GRPOTrainer runs "
            "only tool-calling episodes",
        ),
    ],
)
def test_bad_e2e_inputs_fail_in_one_line_before_any_run(capsys, tmp_path, monkeypatch, args, error):
    monkeypatch.setattr(e2e, "run_asyncrl", lambda *a, **k: pytest.fail("an asyncrl run started"))
    assert main(["bench", "e2e", "--quick", *args, "--output", str(tmp_path / "x.json")]) == 2
    assert capsys.readouterr().err.splitlines() == [error]


@pytest.fixture
def tool_processes_closed():
    """Tools called on this thread start tool processes that live as long as it: stop them."""
    from asyncrl.environments.tool_env import close_toolboxes

    yield
    close_toolboxes()


def test_trl_runs_the_tool_environments_episodes(tool_processes_closed):
    """TRL sees asyncrl's prompt, reads its tool calls and calls the environment's own tool."""
    pytest.importorskip("trl")
    from transformers.utils import get_json_schema
    from trl.chat_template_utils import parse_response

    from asyncrl.bench import trl_environment
    from asyncrl.config import load_config
    from asyncrl.data import Prompt
    from asyncrl.models.tokenizer import build_char_tokenizer

    config = load_config(TOOL_USE, [])
    prompt = Prompt("products/2/7", "12*34=", "408")
    (messages,) = trl_environment.episode_prompts(config, [prompt])
    environment = trl_environment.trl_environment(config)()
    environment.reset(uid=prompt.uid, prompt=messages)
    tokenizer = build_char_tokenizer(chat=True)
    trl_environment.use_response_template(tokenizer)
    ours = tokenizer.apply_chat_template(
        messages, tools=environment.env.tools, add_generation_prompt=True, return_dict=False
    )
    theirs = tokenizer.apply_chat_template(
        messages, tools=[environment.calc], add_generation_prompt=True, return_dict=False
    )
    assert ours == theirs and get_json_schema(environment.calc)["function"]["parameters"]["required"] == ["expr"]
    call = tokenizer('<tool_call>{"name": "calc", "arguments": {"expr": "12*34"}}</tool_call><eos>')["input_ids"]
    (parsed,) = parse_response(tokenizer, call, prefix=theirs)["tool_calls"]
    assert environment.calc(**parsed["function"]["arguments"]) == "408" and environment.calc(expr="1/0").startswith(
        "error"
    )
    assert trl_environment.answer_text([*messages, {"role": "assistant", "content": "408"}]) == "408"


def test_e2e_on_a_run_config_with_trl_on_its_tool_environment_targets_the_chosen_metric(capsys, tmp_path):
    pytest.importorskip("trl")
    args = ["--config", str(TOOL_USE), "--against", "trl", "--lags", "0", "--metric", "reward_mean", "--target", "0.0"]
    result = bench(capsys, tmp_path, "e2e", *args)
    assert result["settings"]["config"] == str(TOOL_USE) and result["settings"]["metric"] == "reward_mean"
    runs = result["results"]["runs"]
    assert set(runs) == {"max_lag=0", "trl"} and result["results"]["metric"] == "reward_mean"
    for run in runs.values():
        (evals,) = run["evals"]
        assert run["final_reward_mean"]["values"] == [evals[-1]["reward_mean"]] and "final_accuracy" not in run
        assert [e["step"] for e in evals] == [0, 3, 6] and run["time_to_target_s"]["values"] == [0.0]
    assert runs["trl"]["reward_errors"] == [0] and "environment.max_turns" in runs["trl"]["unmatched"]
    assert set(result["results"]["trl_time_to_target_over_asyncrl"]) == {"max_lag=0"}


def test_lora_against_full_fine_tuning_reports_memory_step_sync_and_checkpoint(capsys, tmp_path):
    result = bench(capsys, tmp_path, "lora")
    full, lora = result["results"]["settings"]
    assert (full["setting"], lora["setting"]) == ("full", "lora r16") and result["settings"]["lora_rank"] == 16
    assert lora["parameters"] > full["parameters"] == full["trainable_parameters"] > lora["trainable_parameters"]
    assert lora["sync_bytes"] == 4 * lora["trainable_parameters"]  # float32, the adapter alone
    assert full["sync_bytes"] >= 4 * full["parameters"]  # every tensor (the tied embedding under both names)
    assert lora["checkpoint_bytes"] < full["checkpoint_bytes"] and lora["base_digest_s"] > 0
    for row in (full, lora):
        assert row["step_s"] == pytest.approx(row["generation_s"] + row["training_s"] + row["sync_s"])
        assert row["peak_rss_bytes_with_checkpoint"] >= row["peak_rss_bytes"] > 0
    goals = result["results"]["goals"]
    assert goals["sync_bytes_full_over_lora"]["value"] == full["sync_bytes"] / lora["sync_bytes"]
    assert "### `asyncrl bench lora`" in report.render(tmp_path)


def test_long_context_reports_each_ranks_step_peak_and_time(capsys, tmp_path):
    result = bench(capsys, tmp_path, "long-context")
    rows = result["results"]
    ranks = {
        (cp, layout): {r["rank"] for r in rows if (r["cp"], (r["padded"], r["packed"])) == (cp, layout)}
        for cp in (1, 2)
        for layout in long_context.LAYOUTS
    }
    assert ranks == {(cp, layout): set(range(cp)) for cp in (1, 2) for layout in long_context.LAYOUTS}
    for row in rows:
        assert (row["seq_len"], row["vocab_size"]) == (256, 4096) and sum(row["rows"]) == 256
        assert row["step_peak_bytes"] > 0 and row["step_seconds"] > 0
        assert row["rows"] == ([154, 102] if row["padded"] else [128, 128])
    assert result["stopped"] == []
    assert set(result["goals"]) == set(long_context.GOALS)  # on Qwen's vocabulary: not measured here
    assert all(goal["value"] is None and goal["met"] is None for goal in result["goals"].values())
    rendered = report.render(tmp_path)
    assert "### `asyncrl bench long-context`" in rendered
    assert {" equal ", " ragged ", " packed "} <= {cell for line in rendered.splitlines() for cell in line.split("|")}


def test_long_context_on_smollm2s_layout_measures_equal_rows_at_both_cp(capsys, tmp_path):
    result = bench(capsys, tmp_path, "long-context", "--shape", "smollm2")
    smollm2 = long_context.SHAPES["smollm2"].model
    assert result["settings"]["shape"] == "smollm2" and result["settings"]["vocab_sizes"] == [4096]
    assert result["settings"]["model"] == {**smollm2, "num_layers": long_context.QUICK_LAYERS}
    rows = result["results"]
    assert sorted((r["cp"], r["rank"]) for r in rows) == [(1, 0), (2, 0), (2, 1)]
    for row in rows:
        assert (row["seq_len"], row["rows"], row["padded"], row["packed"]) == (256, [128, 128], False, False)
        assert row["step_peak_bytes"] > 0 and row["base_rss_bytes"] > 0 and row["step_seconds"] > 0
    assert result["stopped"] == []
    assert all(goal["value"] is None for goal in result["goals"].values())  # on V = 49,152: not measured here
    (tmp_path / "long-context.json").rename(tmp_path / "long-context-smollm2.json")
    assert "### `asyncrl bench long-context --shape smollm2`" in report.render(tmp_path)


def test_the_smollm2_shape_is_smollm2_135ms_layout():
    shape = long_context.SHAPES["smollm2"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config(shape.vocab_size, **shape.model))
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.tie_word_embeddings
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # SmolLM2-135M's count


def test_an_unknown_long_context_shape_fails_in_one_line(capsys):
    assert main(["bench", "long-context", "--shape", "gpt2"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: Invalid value for --shape: 'gpt2' is not one of tiny, smollm2"
    ]


def test_long_context_goals_take_the_worst_rank_and_growth_stops_before_the_limits():
    def row(seq_len, cp, peak, seconds=1.0, rank=0, padded=False):
        setting = dict(seq_len=seq_len, cp=cp, padded=padded, packed=False, vocab_size=151_936, rank=rank)
        return {**setting, "step_peak_bytes": peak, "step_seconds": seconds}

    results = [row(8192, 1, 4e9), row(16384, 1, 8e9, 10.0), row(16384, 1, 7e9, padded=True)]
    results += [{**row(16384, 1, 1e9, padded=True), "packed": True}]  # the goal is the padded rows'
    results += [row(16384, 2, 4e9, 9.0), row(16384, 2, 4.4e9, 8.0, rank=1)]
    goals = long_context.goals(results, 151_936)
    assert goals["growth_8k_to_16k"] == {"value": 2.0, "goal": "<= 2.2", "met": True}
    assert goals["cp2_over_cp1_memory_at_largest_T"]["value"] == pytest.approx(0.55)
    assert goals["cp2_over_cp1_memory_at_largest_T"]["seq_len"] == 16384
    assert goals["cp2_over_cp1_time_per_token_at_largest_T"]["value"] == pytest.approx(0.9)
    assert goals["ragged_2x8k_step_peak_gb"] == {"value": 7.0, "goal": "< 8", "met": True}
    assert all(goal["value"] is None for goal in long_context.goals(results, 49_152).values())

    def ranks(peak, seconds, base=1e9):  # one length's two ranks
        return [{"step_peak_bytes": peak, "base_rss_bytes": base, "step_seconds": seconds}] * 2

    lens = [1024, 2048, 4096]
    assert long_context._stop_reason(lens, [], 0, 0.0) is None
    one = [ranks(1e9, 10.0)]  # T doubles next: 2e9 of base + 2 x 2e9 of growth, and 20 s, expected
    assert long_context._stop_reason(lens, one, 5.7 * 2**30, 20.0) is None
    assert long_context._stop_reason(lens, one, 5.5 * 2**30, 20.0) == "expected 5.6 GiB, over 5.5 GiB"
    grew = [ranks(1e9, 10.0), ranks(3e9, 30.0)]  # grew 3x: 2e9 + 3 x 6e9, and 90 s, expected next
    assert long_context._stop_reason(lens, grew, 19 * 2**30, 100.0) is None
    assert long_context._stop_reason(lens, grew, 18 * 2**30, 100.0) == "expected 18.6 GiB, over 18 GiB"
    assert long_context._stop_reason(lens, grew, 19 * 2**30, 80.0) == "expected 90 s, over 80 s"


def test_integrity_reports_the_step_time_ratio_of_runs_with_and_without_the_guard(capsys, tmp_path):
    result = bench(capsys, tmp_path, "integrity")
    results = result["results"]
    assert result["settings"]["pairs"] == 1 and result["settings"]["steps"] == 3
    [pair] = results["pairs"]
    assert pair["on_s"] > 0 and pair["off_s"] > 0 and pair["ratio"] == pytest.approx(pair["on_s"] / pair["off_s"])
    assert results["ratio"] == pytest.approx(pair["ratio"])
    assert results["overhead_percent"] == pytest.approx(100 * (results["ratio"] - 1))
    assert results["goal_met"] == (results["ratio"] < results["goal_ratio"] == 1.03)
    (tmp_path / "results").mkdir()
    (tmp_path / "integrity.json").rename(tmp_path / "results" / "integrity.json")
    text = report.render(tmp_path / "results")
    assert "### `asyncrl bench integrity`" in text and f"| median | {results['step_s_on']:.3f} |" in text
    assert f"Step time with the guard over without it: {results['overhead_percent']:+.1f} %" in text
    assert 0 < pair["guard_share"] == results["guard_share"] < 1  # the guarded run timed the guard's work


def test_roofline_reports_each_rate_as_a_fraction_of_the_matmul_rate(capsys, tmp_path):
    result = bench(capsys, tmp_path, "roofline")
    measured, settings = result["results"], result["settings"]
    rate = measured["matmul"]["flops_per_s"]
    assert rate == max(measured["matmul"]["model_flops_per_s"], measured["matmul"]["square_flops_per_s"]) > 0
    layers, hidden = settings["model"]["num_layers"], settings["model"]["hidden_size"]
    attention = 12 * layers * hidden * (settings["prompt_len"] + settings["response_len"])
    full, lora = measured["train"]["full"], measured["train"]["lora"]
    assert full["flops_per_token"] == 6 * full["parameters"] + attention
    adapter = lora["trainable_parameters"]
    assert lora["flops_per_token"] == 4 * (lora["parameters"] - adapter) + 6 * adapter + attention
    assert full["tokens"] == lora["tokens"] == settings["rows"] * (settings["prompt_len"] + settings["response_len"])
    phases = [full, lora, measured["hf"]["prefill"], measured["hf"]["decode"]]
    for row in phases:
        assert row["tokens_per_s"] > 0 and row["flops_per_s"] > 0
        assert row["over_matmul"] == pytest.approx(row["flops_per_s"] / rate)
    assert measured["hf"]["prefill"]["tokens_per_s"] == pytest.approx(
        settings["rows"] * settings["prompt_len"] / measured["hf"]["prefill"]["seconds"]
    )
    assert measured["vllm"] == {"skipped": "--quick starts no vLLM server"}
    goals = measured["goals"]
    assert set(goals) == {"train_full", "train_lora", "hf_prefill", "hf_decode"}
    assert goals["train_full"]["value"] == full["over_matmul"] and goals["train_full"]["goal"] == ">= 0.7"
    assert goals["hf_decode"]["value"] == measured["hf"]["decode"]["over_matmul"]
    assert goals["hf_decode"]["goal"] == ">= 0.5"
