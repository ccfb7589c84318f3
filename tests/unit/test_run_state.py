"""RunState, the controller's books: how a step is counted, the totals a step record repeats, and a
checkpoint's run state saved and restored (an older one without some totals included)."""

import torch
from helpers import make_groups

from asyncrl.control.run_state import RunState
from asyncrl.metrics import RunCounters
from asyncrl.types import StepResult


def result(*, skipped: bool = False, num_tokens: int = 5) -> StepResult:
    return StepResult(
        version=1, loss=0.0, grad_norm=0.0, lr=0.0, num_sequences=1, num_tokens=num_tokens, num_microbatches=1,
        skipped=skipped,
    )  # fmt: skip


def test_a_non_finite_step_extends_the_streak_and_a_finite_one_ends_it():
    state = RunState()
    for skipped in (True, True, False, True):
        state.count_step(result(skipped=skipped))
    assert (state.nonfinite_steps, state.nonfinite_streak) == (3, 1)
    state.count_step(result(num_tokens=0))
    assert (state.nonfinite_streak, state.empty_steps) == (0, 1)


def test_the_counters_are_the_totals_and_the_refills_given():
    state = RunState(num_evicted=1, skipped_prompts=2, step_retries=3, nonfinite_steps=4, empty_steps=5)
    assert state.counters(refill_groups_total=6) == RunCounters(
        refill_groups_total=6, evicted_groups=1, skipped_prompts=2, step_retries=3, nonfinite_steps=4, empty_steps=5
    )


def test_the_state_round_trips_through_a_weights_only_checkpoint(tmp_path):
    groups = make_groups(seed=3, count=2)
    state = RunState(1, 2, 3, 4, 5, 6, eval_due=True, step_groups=groups)
    torch.save(state.state_dict(), tmp_path / "state.pt")
    loaded = RunState()
    loaded.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert loaded.state_dict().keys() == state.state_dict().keys()
    assert (loaded.num_evicted, loaded.skipped_prompts, loaded.step_retries) == (1, 2, 3)
    assert (loaded.nonfinite_steps, loaded.nonfinite_streak, loaded.empty_steps, loaded.eval_due) == (4, 5, 6, True)
    assert [g.prompt_uid for g in loaded.step_groups] == [g.prompt_uid for g in groups]
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(loaded.step_groups, groups))


def test_an_older_state_without_the_later_totals_loads_them_as_zero():
    loaded = RunState(skipped_prompts=9, eval_due=True, step_groups=make_groups(seed=1, count=1))
    loaded.load_state_dict({"num_evicted": 2})
    assert loaded == RunState(num_evicted=2)
