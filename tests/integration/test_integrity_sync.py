"""Promises 1 and 2 in real runs of the small model (docs/integrity.md): a generator that
acknowledges a sync without loading it (``faults.sync_skips_load``), the whole model or a LoRA
adapter, locally and over Ray's object store and broadcast, and one that samples at another
temperature than the trainer scores at (``faults.generator_temperature``), in float32 and in
bfloat16, stop the run at the first sync with the one-line integrity stop and exit code 3, while
healthy bfloat16 runs pass every probe. The vLLM backend's are in test_vllm.py; the healthy runs
of every backend assert their ``integrity/`` metrics where they run.
"""

import re

import pytest
from helpers import SMALL

from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.errors import IntegrityStop
from asyncrl.metrics import read_jsonl

pytestmark = pytest.mark.slow
DIGITS = "rewards.functions=[reward_functions:digits]"  # rewards vary within groups: every step moves the weights


def stopped(capsys, run_dir, *overrides) -> str:
    """The one line of a run that must end with an integrity stop (exit code 3), without ``error: ``."""
    code = main(["train", "--output-dir", str(run_dir), *SMALL, DIGITS, *overrides])
    err = capsys.readouterr().err
    assert code == 3 and err.startswith("error: integrity: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err.removeprefix("error: ").rstrip("\n")


@pytest.mark.parametrize("lora", [False, True], ids=["weights", "lora-adapter"])
def test_a_generator_that_skips_its_load_stops_the_run_at_the_first_sync(capsys, tmp_path, lora):
    overrides = ["faults.sync_skips_load=true", *(["lora.rank=4", "trainer.device=cpu"] if lora else [])]
    line = stopped(capsys, tmp_path / "run", *overrides)
    assert line.startswith(
        "integrity: weights broken at step 1: generator 0 reports weight version 1 but serves weights with "
        "fingerprint float32:"
    ), line
    assert line.endswith(f"checkpoint saved to {tmp_path / 'run' / 'checkpoints' / 'step-000001'} "
                         f"(continue with: asyncrl train --resume {tmp_path / 'run'})")  # fmt: skip
    [step] = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert step["integrity/weights"] == 1 and step["sync_transport"] == "refused"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_generator_sampling_at_another_temperature_stops_the_run_at_the_first_sync(capsys, tmp_path, dtype):
    """In bfloat16 too: its bound is 10 times what bfloat16 moves the trainer's own scores (about
    4e-4 on the small model), or the float32 threshold where that is less."""
    line = stopped(capsys, tmp_path / "run", f"trainer.dtype={dtype}", "faults.generator_temperature=2.0")
    assert line.startswith("integrity: sampling broken at step 1: generator 0's logprobs of its 16 probe tokens "), line
    assert f"above the 0.01 allowed for weights in {dtype}" in line
    if dtype == "bfloat16":  # the noise the trainer measured, far under the threshold on the small model
        noise = float(re.search(r"10 times the (\S+) that bfloat16 moves the trainer's own scores", line).group(1))
        assert 0 < noise < 0.001
    [step] = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert step["integrity/sampling"] > 0.01 and step["integrity/weights"] == 0


def test_a_sampling_threshold_of_zero_allows_no_gap_in_half_precision_either(capsys, tmp_path):
    line = stopped(capsys, tmp_path / "run", "trainer.dtype=bfloat16", "integrity.sampling.threshold=0")
    assert line.startswith("integrity: sampling broken at step 1: generator 0's logprobs of its 16 probe tokens "), line
    assert "above the 0 allowed for weights in bfloat16; checkpoint saved to" in line


HEALTHY = {  # a sharper model (warm-started) rounds more in bfloat16: its gap nears the float32 threshold
    "bfloat16": ["trainer.dtype=bfloat16"],
    "bfloat16-warm-started": ["trainer.dtype=bfloat16", "warm_start.steps=60", "warm_start.lr=0.01"],
    "bfloat16-lora": ["trainer.dtype=bfloat16", "lora.rank=4", "trainer.device=cpu"],
}


@pytest.mark.parametrize("name", HEALTHY)
def test_healthy_half_precision_runs_pass_every_probe(tmp_path, name):
    from asyncrl.run import train

    overrides = [*SMALL, DIGITS, *HEALTHY[name], "integrity.sampling.every_syncs=1", f"logging.output_dir={tmp_path}"]
    train(load_config(None, overrides))
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert len(metrics) == 4 and all(0 < m["integrity/sampling"] < 0.01 for m in metrics), metrics


@pytest.mark.parametrize("transport", ["object_store", "broadcast"])
def test_a_ray_generator_that_skips_its_load_stops_the_run(ray_cluster, tmp_path, transport):
    from asyncrl.run import train

    overrides = ["runtime.name=ray", f"sync.transport={transport}", "generation.num_workers=2"]
    overrides += ["faults.sync_skips_load=true", f"logging.output_dir={tmp_path / 'run'}"]
    with pytest.raises(IntegrityStop) as stop:
        train(load_config(None, [*SMALL, DIGITS, *overrides]))
    assert (stop.value.promise, stop.value.step) == ("weights", 1)
    assert "(2 of 2 generators differ)" in stop.value.evidence
