"""A resume rebuilds the lr schedule for its own ``step.max_steps``; when that moves the lr of the
step it continues with (cosine decay over another length), the run says so in one warning."""

import pytest
import torch

from asyncrl.config import TrainerConfig, dump_config, load_config
from asyncrl.trainer.optim import build_optimizer, build_scheduler, resumed_schedule_warning


def state(version, *overrides, last_epoch=None):
    """A checkpoint's state as the resume reads it: the run's version and config, the scheduler's position."""
    scheduler = {"last_epoch": version if last_epoch is None else last_epoch}
    return {
        "run": {"version": version, "config": dump_config(load_config(None, list(overrides)))},
        "trainer": {"scheduler": scheduler},
    }


def warning(saved, *overrides):
    return resumed_schedule_warning(load_config(None, list(overrides)), saved)


def test_extending_a_finished_cosine_run_says_the_lr_rises_from_the_floor():
    assert warning(state(400), "step.max_steps=1200") == (
        "lr schedule rebuilt for 1200 steps: lr factor at step 401 is 0.775 "
        "(was 0.100 in the 400-step schedule the checkpoint was trained on)"
    )


def test_shortening_a_run_midway_says_the_lr_falls():
    assert warning(state(100), "step.max_steps=200") == (
        "lr schedule rebuilt for 200 steps: lr factor at step 101 is 0.550 "
        "(was 0.868 in the 400-step schedule the checkpoint was trained on)"
    )


@pytest.mark.parametrize(
    ("saved", "overrides"),
    [
        (None, ["step.max_steps=1200"]),  # a fresh run
        (state(200), []),  # the same length
        (state(400, "trainer.lr_schedule=constant"), ["step.max_steps=1200", "trainer.lr_schedule=constant"]),
        (state(3, "trainer.warmup_steps=10"), ["step.max_steps=1200", "trainer.warmup_steps=10"]),  # still warming up
        ({"run": {"version": 400, "config": "step: [unclosed"}, "trainer": {}}, ["step.max_steps=1200"]),
        ({"run": {"version": 400}, "trainer": {}}, ["step.max_steps=1200"]),  # a state saved without its config
    ],
)
def test_no_warning_where_the_next_steps_lr_stays(saved, overrides):
    assert warning(saved, *overrides) is None


def test_the_factor_is_the_schedulers_own_position_when_steps_were_skipped():
    """A skipped (non-finite) step advances the version but not the schedule."""
    assert "lr factor at step 401 is 0.775 (was 0.100" in warning(state(400, last_epoch=400), "step.max_steps=1200")
    assert "lr factor at step 401 is 0.776 (was 0.100" in warning(state(400, last_epoch=399), "step.max_steps=1200")


def test_a_loaded_schedule_sets_the_lr_of_its_own_length_for_the_next_step():
    """The saved optimizer holds the lr the saved schedule set; the loaded schedule replaces it."""
    params, cfg = [torch.nn.Parameter(torch.zeros(2))], TrainerConfig(lr=0.01)
    optimizer = build_optimizer(params, cfg)
    schedule = build_scheduler(optimizer, cfg, total_steps=2)
    for _ in range(2):
        optimizer.step()
        schedule.step()
    saved = optimizer.state_dict(), schedule.state_dict()

    def next_lr(total_steps: int) -> float:
        resumed = build_optimizer(params, cfg)
        resumed_schedule = build_scheduler(resumed, cfg, total_steps)
        resumed.load_state_dict(saved[0])
        resumed_schedule.load_state_dict(saved[1])
        assert resumed_schedule.get_last_lr() == [resumed.param_groups[0]["lr"]]
        return resumed.param_groups[0]["lr"]

    assert next_lr(2) == optimizer.param_groups[0]["lr"] == pytest.approx(0.001)  # the same run: bit for bit
    assert next_lr(4) == pytest.approx(0.0055)
