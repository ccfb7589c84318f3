"""configs/tool-use.yaml learns: from the warm start (the call format from demonstrations, the copy
of the tool's result half learned), GRPO raises held-out accuracy on products of two 3-digit
numbers by at least 0.02 on each of three seeds (measured: 0.586 -> 0.617 / 0.664 / 0.680). The
whole 60 steps are needed: accuracy first dips, and a 40-step run of seed 0 went 0.586 -> 0.453
(10 steps) -> 0.602, under the margin.

The warm start is shared by the seeds (its cache is keyed by everything but the run seed), so the
module pays for it once. Where its 300 steps land swings with float rounding alone (docs/environments.md),
so a change to the scoring's arithmetic can move this test's starting point: retune
``warm_start.steps`` in the config, not the margin.
"""

from __future__ import annotations

import pytest
from helpers import ROOT

from asyncrl.config import load_config
from asyncrl.metrics import read_jsonl

pytestmark = pytest.mark.slow

SEEDS = (0, 1, 2)
MARGIN = 0.02


@pytest.fixture(scope="module")
def evaluations(tmp_path_factory):
    from asyncrl.run import train

    cache = tmp_path_factory.mktemp("warm_start")
    runs = {}
    for seed in SEEDS:
        out = tmp_path_factory.mktemp(f"seed{seed}")
        overrides = [
            f"seed={seed}",
            f"warm_start.cache_dir={cache}",
            f"logging.output_dir={out}",
            "logging.progress=false",
            "logging.tensorboard=false",
            "logging.eval_every_steps=null",
            "checkpoint.every_steps=null",
        ]
        summary = train(load_config(ROOT / "configs" / "tool-use.yaml", overrides))
        runs[seed] = read_jsonl(out / "eval.jsonl"), summary["warnings"]
    return runs


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("seed", SEEDS)
def test_held_out_accuracy_rises_from_the_warm_start(evaluations, seed):
    records, warnings = evaluations[seed]
    first, last = records[0], records[-1]
    assert first["step"] == 0 and last["step"] > 0
    assert last["accuracy"] >= first["accuracy"] + MARGIN, records
    assert warnings == []  # nothing in the run's health stands in its way
