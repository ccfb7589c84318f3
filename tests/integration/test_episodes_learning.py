"""configs/multi-turn.yaml learns: from the warm start (the answer format, from solved one-turn
episodes), GRPO on whole feedback episodes raises held-out first-answer accuracy, on each of three
seeds. Each seed trains the config's first 60 steps (CI's time budget; the README has the whole
150-step runs). The seeds share one warm start (its cache is keyed by everything but the run seed)."""

import pytest
from helpers import ROOT

from asyncrl.config import load_config
from asyncrl.metrics import read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]


@pytest.fixture(scope="module")
def warm_start_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("warm_start")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_held_out_accuracy_of_feedback_episodes_rises_from_the_warm_start(tmp_path, warm_start_cache, seed):
    from asyncrl.run import train

    config = load_config(
        ROOT / "configs" / "multi-turn.yaml",
        [
            f"seed={seed}",
            f"warm_start.cache_dir={warm_start_cache}",
            f"logging.output_dir={tmp_path}",
            "grpo.max_steps=60",
            "logging.eval_every_steps=null",  # the first and the last evaluation only
            "logging.progress=false",
            "logging.tensorboard=false",
            "checkpoint.every_steps=null",
        ],
    )
    summary = train(config)
    evaluations = read_jsonl(tmp_path / "eval.jsonl")
    assert [e["step"] for e in evaluations] == [0, 60]
    assert summary["final_eval_accuracy"] > summary["initial_eval_accuracy"], evaluations
