"""Several optimizer updates per step, end to end: the clip acts and its bounds matter."""

import pytest
from helpers import deterministic, run

# the default warm start and two groups per mini-batch: rewards vary, so every update has a gradient to clip
WARM = ["warm_start.steps=300", "step.prompts_per_step=8", "trainer.lr=0.003", "trainer.micro_batch_size=32"]


@pytest.mark.slow
def test_four_minibatch_updates_clip_and_the_clip_bound_changes_the_run(tmp_path):
    _, metrics, _ = run(tmp_path, "k4", "step.num_minibatches=4", "step.max_steps=4", *WARM)
    assert [m["num_updates"] for m in metrics] == [4, 4, 4, 4]
    assert sum(m["clip_fraction"] > 0 for m in metrics) >= 3
    # Both bounds: a token past 1 + clip_high is clipped under either upper bound, with the same
    # zero gradient, so tightening one bound alone can leave a run's updates unchanged.
    tight = ["algorithm.options.clip_high=0.01", "algorithm.options.clip_low=0.01"]
    _, tighter, _ = run(tmp_path, "k4-tight", "step.num_minibatches=4", "step.max_steps=4", *tight, *WARM)
    assert deterministic(tighter) != deterministic(metrics)
    assert any(a["clip_fraction"] != b["clip_fraction"] for a, b in zip(tighter, metrics))
