"""configs/multi-turn.yaml learns: from the warm start (the answer format, from solved one-turn
episodes), GRPO on whole feedback episodes raises held-out first-answer accuracy. CI runs seed 0 to
stay within its time budget; seeds 1 and 2, run the same way, are in the README. The seeds share
one warm start (its cache is keyed by everything but the run seed)."""

import pytest
from helpers import ROOT

from asyncrl.config import load_config
from asyncrl.metrics import read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]


@pytest.fixture(scope="module")
def warm_start_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("warm_start")


@pytest.mark.parametrize("seed", [0])
def test_held_out_accuracy_of_feedback_episodes_rises_from_the_warm_start(tmp_path, warm_start_cache, seed):
    from asyncrl.run import train

    config = load_config(
        ROOT / "configs" / "multi-turn.yaml",
        [
            f"seed={seed}",
            f"warm_start.cache_dir={warm_start_cache}",
            f"logging.output_dir={tmp_path}",
            "logging.eval_every_steps=null",  # the first and the last evaluation only
            "logging.progress=false",
            "logging.tensorboard=false",
            "checkpoint.every_steps=null",
        ],
    )
    summary = train(config)
    evaluations = read_jsonl(tmp_path / "eval.jsonl")
    assert [e["step"] for e in evaluations] == [0, 150]
    assert summary["final_eval_accuracy"] > summary["initial_eval_accuracy"], evaluations
