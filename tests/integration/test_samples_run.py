"""A run writes its sample transcripts and says what makes learning unlikely: the small run (4 new
tokens, no warm start: every response is cut and every group scores 0) writes a few samples per
step and per evaluation, ``asyncrl samples`` prints its last step, and its warnings about the cut
turns and the groups without reward variance are given once, in the log and in summary.json. The
default config's start gives none."""

import json
import re

import pytest
from helpers import ROOT, run

from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.metrics import read_jsonl

pytestmark = pytest.mark.slow


def documented_record_keys() -> set[str]:
    """The backticked names in the first column of docs/samples.md's table of the record."""
    text = (ROOT / "docs" / "samples.md").read_text()
    section = re.search(r"^## The record\n(.*?)(?=^### )", text, re.M | re.S).group(1)
    return {name for cell in re.findall(r"^\| ([^|\n]+) \|", section, re.M) for name in re.findall(r"`([^`]+)`", cell)}


def test_a_run_writes_its_samples_prints_them_and_warns_once_about_what_stops_it_learning(tmp_path, capsys):
    summary, metrics, _ = run(tmp_path, "run", "logging.health_window=2", "logging.eval_samples=3")
    samples = read_jsonl(tmp_path / "run" / "samples.jsonl")
    train = [s for s in samples if s["split"] == "train"]
    evals = [s for s in samples if s["split"] == "eval"]
    assert [s["step"] for s in train] == [step for step in (1, 2, 3, 4) for _ in range(4)]
    assert [s["step"] for s in evals] == [0, 0, 0, 2, 2, 2, 4, 4, 4]
    assert {key for sample in samples for key in sample} == documented_record_keys()
    first_step = train[:4]
    assert len({s["prompt_uid"] for s in first_step}) == 4 and {s["sample"] for s in first_step} == {0}
    for sample in train:
        [turn] = sample["messages"]
        assert sample["advantage"] is not None and sample["versions"] == [max(sample["step"] - 2, 0)]
        assert turn["finish_reason"] == sample["finish_reason"] and turn["tokens"] == sample["tokens"]["sampled"]
        assert set(sample["reward_parts"]) == {"exact_match"}
    assert any(sample["finish_reason"] == "length" for sample in train)
    assert all(m["turns_cut_fraction"] > 0.5 for m in metrics)

    warnings = {w["warning"]: w for w in summary["warnings"]}
    assert set(warnings) == {"turns_cut", "zero_variance"} and warnings["turns_cut"]["step"] == 2
    assert "generation.max_new_tokens=4" in warnings["turns_cut"]["message"]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["warnings"] == summary["warnings"]
    log = capsys.readouterr().err
    assert log.count("warning: step 2: ") == 2 and log.count("generation.max_new_tokens=4") == 1

    assert main(["samples", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert out.count("step 4 train") == 4 and out.count("step 4 eval") == 3
    assert "CUT at generation.max_new_tokens" in out


def test_the_default_config_gives_no_warning(tmp_path):
    """Its first 20 steps, two health windows: the warm-started policy's groups vary and its answers fit."""
    from asyncrl.run import train

    overrides = [
        "step.max_steps=20",
        f"logging.output_dir={tmp_path / 'run'}",
        f"warm_start.cache_dir={tmp_path / 'warm_start'}",
        "logging.eval_every_steps=null",
        "logging.progress=false",
        "logging.tensorboard=false",
        "checkpoint.every_steps=null",
    ]
    summary = train(load_config(ROOT / "configs" / "default.yaml", overrides))
    assert summary["steps"] == 20 and summary["warnings"] == []
