"""Resuming a cosine run with another ``step.max_steps`` trains on the schedule rebuilt for the new
length, and says so once, at the start, with the lr factor its next step gets."""

import pytest
from helpers import run


@pytest.mark.slow
def test_extending_a_cosine_run_warns_once_and_trains_at_the_rebuilt_lr(tmp_path, capsys):
    cosine = ("trainer.lr_schedule=cosine", "trainer.min_lr_ratio=0.1")
    run(tmp_path, "part", *cosine, "step.max_steps=2")
    assert "lr schedule" not in capsys.readouterr().err
    _, metrics, _ = run(tmp_path, "part", *cosine, "step.max_steps=4", resume=tmp_path / "part")
    warnings = [line for line in capsys.readouterr().err.splitlines() if "lr schedule" in line]
    assert warnings == [
        "warning: lr schedule rebuilt for 4 steps: lr factor at step 3 is 0.550 "
        "(was 0.100 in the 2-step schedule the checkpoint was trained on)"
    ]
    lr = {record["step"]: record["lr"] for record in metrics}
    assert lr[3] == pytest.approx(0.55 * 0.01) and lr[2] == pytest.approx(0.01 * (0.1 + 0.9 * 0.5 * (1 + 0)))
