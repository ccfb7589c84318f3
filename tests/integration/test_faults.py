"""Every fault class, injected through the ``faults`` section: the run finishes, or stops with a
one-line error and a checkpoint that resumes. docs/reliability.md points at each test here.

Runs use the small model of test_train.py; the signal and kill tests run the CLI in a subprocess.
"""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from helpers import SMALL, TESTS, deterministic, run

from asyncrl.checkpoint import load_state, resolve_checkpoint
from asyncrl.cli import main
from asyncrl.control.controller import SingleController
from asyncrl.control.weight_sync import WeightSync
from asyncrl.errors import (
    EvaluationFailedError,
    NonFiniteStepsError,
    RunInterrupted,
    StallError,
    SyncTimeoutError,
    TrainStepError,
    WeightLoadFailedError,
)
from asyncrl.faults import FaultyRolloutWorker
from asyncrl.metrics import read_jsonl, strip_timing

pytestmark = pytest.mark.slow
COUNTERS = ("step_retries", "skipped", "nonfinite_steps", "skipped_prompts", "rollout_retries", "loss", "grad_norm")


def without(records, keys=COUNTERS):
    return [{k: v for k, v in strip_timing(r).items() if k not in keys} for r in records]


def cli(capsys, tmp_path, name, *overrides, resume=None):
    args = ["train", "--output-dir", str(tmp_path / name), *SMALL, *overrides]
    if resume is not None:
        args = ["train", "--resume", str(resume), *overrides]
    code = main(args)
    return code, capsys.readouterr().err.strip()


def test_failed_generation_batches_are_retried_and_counted(tmp_path):
    _, clean, clean_groups = run(tmp_path, "clean", "sampler.max_lag=0")
    summary, faulty, faulty_groups = run(tmp_path, "faulty", "sampler.max_lag=0", "faults.generate_errors=[0, 3]")
    assert summary["rollout_retries"] == 2 * 2  # two failed batches of two groups, each retried once
    assert without(faulty, ("rollout_retries",)) == without(clean, ("rollout_retries",))
    assert [g["prompt_uid"] for g in faulty_groups] == [g["prompt_uid"] for g in clean_groups]


def test_a_failed_train_step_is_aborted_and_rerun_exactly(tmp_path):
    _, clean, clean_groups = run(tmp_path, "clean", "sampler.max_lag=0")
    summary, faulty, faulty_groups = run(
        tmp_path, "faulty", "sampler.max_lag=0", "faults.train_errors=[1]", "trainer.max_step_retries=1"
    )
    assert [m["step_retries"] for m in faulty] == [0, 1, 1, 1]
    assert without(faulty, ("step_retries",)) == without(clean, ("step_retries",))
    assert faulty_groups == clean_groups
    assert summary["steps"] == 4


def test_a_train_step_that_keeps_failing_stops_with_a_checkpoint_that_resumes_exactly(tmp_path):
    _, clean, clean_groups = run(tmp_path, "clean", "sampler.max_lag=0", "step.min_groups_per_chunk=2")
    with pytest.raises(TrainStepError, match=r"train step 2 failed 1 times \(trainer.max_step_retries=0\)") as err:
        run(tmp_path, "part", "sampler.max_lag=0", "step.min_groups_per_chunk=2", "faults.train_errors=[2]")
    assert err.value.checkpoint == tmp_path / "part" / "checkpoints" / "step-000002"
    state = load_state(err.value.checkpoint)["run"]
    taken, ready = len(state["step_groups"]), len(state["buffer"]["ready"])
    # the aborted step's chunks (how many were ready at its first chunk is timing), the rest still ready
    assert state["version"] == 2 and taken >= 2 and taken + ready == 4
    summary, resumed, resumed_groups = run(
        tmp_path, "part", "sampler.max_lag=0", "step.min_groups_per_chunk=2", resume=tmp_path / "part"
    )
    assert summary["steps"] == 4
    assert without(resumed) == without(clean)
    assert resumed_groups == clean_groups


def test_a_non_finite_step_is_skipped_and_counted(tmp_path):
    _, clean, _ = run(tmp_path, "clean", "sampler.max_lag=0", "step.max_steps=2")
    summary, metrics, groups = run(
        tmp_path, "nan", "sampler.max_lag=0", "step.max_steps=3", "faults.nonfinite_steps=[1]"
    )
    assert [m["skipped"] for m in metrics] == [False, True, False]
    assert [m["nonfinite_steps"] for m in metrics] == [0, 1, 1]
    assert metrics[1]["grad_norm"] is None  # NaN is not JSON
    assert without(metrics[:1]) == without(clean[:1])
    assert summary["steps"] == 3 and len(groups) == 3 * 4  # the skipped step's groups are used up, not retrained


def test_consecutive_non_finite_steps_stop_the_run_with_a_checkpoint(tmp_path):
    overrides = ("faults.nonfinite_steps=[1, 2]", "trainer.max_nonfinite_steps=1")
    with pytest.raises(NonFiniteStepsError, match=r"2 consecutive steps .* \(trainer.max_nonfinite_steps=1\)") as err:
        run(tmp_path, "nan", *overrides)
    assert err.value.checkpoint is not None and load_state(err.value.checkpoint)["run"]["version"] == 3
    metrics = read_jsonl(tmp_path / "nan" / "metrics.jsonl")
    assert [m["skipped"] for m in metrics] == [False, True, True]


def first_prompt(tmp_path) -> str:
    """The task uid (epoch suffix dropped) of the first prompt a small run trains."""
    _, _, groups = run(tmp_path, "probe", "step.max_steps=1")
    return groups[0]["prompt_uid"].rsplit("/", 1)[0]


def test_a_prompt_that_always_fails_is_skipped_and_replaced(tmp_path):
    uid = first_prompt(tmp_path)
    summary, metrics, groups = run(tmp_path, "skip", f"faults.failing_prompts=['{uid}']")  # skip: the default
    assert summary["steps"] == 4 and [m["num_groups"] for m in metrics] == [4] * 4
    assert metrics[-1]["skipped_prompts"] == 1
    assert uid not in {g["prompt_uid"].rsplit("/", 1)[0] for g in groups}


def test_a_prompt_that_always_fails_stops_the_run_with_a_resumable_checkpoint(tmp_path, capsys):
    uid = first_prompt(tmp_path)
    code, err = cli(capsys, tmp_path, "stop", f"faults.failing_prompts=['{uid}']", "runtime.on_rollout_failure=stop")
    assert code == 1 and "\n" not in err and "Traceback" not in err
    assert err.startswith(f"error: prompt {uid}/0: generation failed 3 times (runtime.max_rollout_retries=2)")
    checkpoint = tmp_path / "stop" / "checkpoints" / "step-000000"
    assert f"checkpoint saved to {checkpoint} (continue with: asyncrl train --resume {tmp_path / 'stop'})" in err
    pending = load_state(checkpoint)["run"]["pending"]
    assert uid + "/0" in [job["prompt"]["uid"] for job in pending]  # nothing committed or admitted is lost
    code, err = cli(capsys, tmp_path, "stop", "faults.failing_prompts=[]", resume=tmp_path / "stop")
    assert code == 0, err
    assert len(read_jsonl(tmp_path / "stop" / "metrics.jsonl")) == 4


def test_a_pending_prompt_missing_from_the_resumed_split_is_a_one_line_error():
    """A resumed run takes each pending prompt back from its train split by uid; a split that lacks
    it (or holds other text under that uid) means the data settings changed since the checkpoint."""
    from asyncrl.config import ConfigError
    from asyncrl.control.rollout_loop import _job_from_state
    from asyncrl.data import Prompt

    saved = {
        "prompt": {"uid": "t/3/0", "text": "1+2=", "answer": "3"},
        "start_version": 0,
        "target_step": 0,
        "retries": 0,
    }
    assert _job_from_state(saved, {"t/3": Prompt("t/3", "1+2=", "3")}).prompt.uid == "t/3/0"
    for split in ({}, {"t/3": Prompt("t/3", "2+2=", "4")}):
        with pytest.raises(ConfigError, match=r"^--resume: the checkpoint's pending prompt t/3/0 is not in this run's"):
            _job_from_state(saved, split)


def test_a_weight_sync_past_its_timeout_checkpoints_the_step_it_follows(tmp_path, capsys):
    # the first load is on time, with room for a loaded machine: it is bounded by the same timeout
    slow = ("faults.slow_sync_s=4", "faults.slow_sync_from=1", "sync.timeout_s=1.5")
    with pytest.raises(SyncTimeoutError, match=r"sync.timeout_s=1.5s while loading weights version 1") as err:
        run(tmp_path, "slow", *slow)
    assert err.value.checkpoint == tmp_path / "slow" / "checkpoints" / "step-000001"
    state = load_state(err.value.checkpoint)
    assert state["run"]["version"] == state["trainer"]["version"] == 1
    code, err = cli(capsys, tmp_path, "slow-cli", *slow)
    assert code == 1 and "\n" not in err and "checkpoint saved to" in err


def test_a_step_whose_sync_fails_is_counted_in_the_run_totals(tmp_path, capsys):
    """Step 2 is non-finite and its sync fails: the stop checkpoint counts it, so the resumed run's
    totals are the straight run's."""
    _, straight, _ = run(tmp_path, "straight", "step.max_steps=3", "faults.nonfinite_steps=[1]")
    code, err = cli(
        capsys, tmp_path, "broken", "step.max_steps=3", "faults.nonfinite_steps=[1]", "faults.load_errors=[2]"
    )
    assert code == 1 and "loading weights version 2" in err, err
    broken = read_jsonl(tmp_path / "broken" / "metrics.jsonl")
    assert broken[-1]["step"] == 2 and broken[-1]["nonfinite_steps"] == 1
    code, err = cli(capsys, tmp_path, "resumed", "faults.load_errors=[]", resume=tmp_path / "broken")
    assert code == 0, err
    resumed = read_jsonl(tmp_path / "broken" / "metrics.jsonl")
    assert [m["nonfinite_steps"] for m in resumed] == [m["nonfinite_steps"] for m in straight] == [0, 1, 1]


def test_the_first_weight_load_is_bounded_by_the_sync_timeout(tmp_path, capsys):
    """The generators' first load (warm-started or resumed weights) stops the run like any sync's."""
    start = time.monotonic()
    code, err = cli(capsys, tmp_path, "first", "faults.slow_sync_s=30", "sync.timeout_s=0.5", "runtime.watchdog_s=5")
    assert time.monotonic() - start < 25
    assert code == 1 and "\n" not in err, err
    assert "sync.timeout_s=0.5s while loading weights version 0 into the generators" in err
    assert "checkpoint saved to" not in err and not (tmp_path / "first" / "checkpoints").exists()
    code, err = cli(capsys, tmp_path, "broken-first", "faults.load_errors=[0]")
    assert code == 1 and "\n" not in err and "loading weights version 0 into the generators failed" in err


def test_a_weight_load_that_fails_checkpoints_the_step_it_follows_and_resumes(tmp_path, capsys):
    message = r"^loading weights version 1 into the generators failed: InjectedFault: weight load 1 failed"
    with pytest.raises(WeightLoadFailedError, match=message) as err:
        run(tmp_path, "broken", "faults.load_errors=[1]")  # load 0 is the run's initial one
    assert err.value.checkpoint == tmp_path / "broken" / "checkpoints" / "step-000001"
    code, err = cli(capsys, tmp_path, "broken-cli", "faults.load_errors=[1]")
    assert code == 1 and "\n" not in err and "checkpoint saved to" in err
    code, err = cli(capsys, tmp_path, "resumed", "faults.load_errors=[]", resume=tmp_path / "broken")
    assert code == 0, err
    assert len(read_jsonl(tmp_path / "broken" / "metrics.jsonl")) == 4


@pytest.mark.parametrize("limit", [None, 2])
def test_generation_longer_than_the_sync_timeout_does_not_fail_the_sync(tmp_path, monkeypatch, limit):
    """max_lag 1: step 1's first batch (call 2) runs while step 0's sync waits. That batch goes on
    for three sync timeouts once the sync has begun, so the sync outlasts its timeout waiting for it.
    With at most 2 groups in flight, call 3 waits for call 2 to finish, and so does closing the gate."""
    timeout_s, events, sync_began = 0.5, [], threading.Event()
    original_sync, original_generate = WeightSync.sync, FaultyRolloutWorker.generate

    async def sync(self):
        events.append("sync begins")
        sync_began.set()
        report = await original_sync(self)
        events.append("sync ends")
        return report

    def generate(self, jobs):
        if self.calls == 2:
            assert sync_began.wait(120), "no weight sync began while call 2 ran"
            time.sleep(3 * timeout_s)
            events.append("call 2 ends")
        return original_generate(self, jobs)

    monkeypatch.setattr(WeightSync, "sync", sync)
    monkeypatch.setattr(FaultyRolloutWorker, "generate", generate)
    summary, _, _ = run(
        tmp_path,
        "long",
        "faults.hang_generate_calls=[1000]",  # any fault wraps the worker
        f"sync.timeout_s={timeout_s}",
        f"runtime.max_inflight_groups={'null' if limit is None else limit}",
    )
    assert summary["steps"] == 4 and events[:3] == ["sync begins", "call 2 ends", "sync ends"]


def test_the_watchdog_stops_a_stalled_run_naming_what_each_loop_waits_on(tmp_path):
    """Without the watchdog the hang would end and the run finish: no StallError."""
    with pytest.raises(StallError) as err:
        run(tmp_path, "stall", "faults.hang_generate_calls=[1]", "faults.hang_s=4", "runtime.watchdog_s=1")
    message = str(err.value)
    assert "no progress for" in message and "(runtime.watchdog_s=1)" in message
    assert "rollout loop waits on" in message and "train loop waits on groups for step 0" in message
    assert err.value.checkpoint is None and not (tmp_path / "stall" / "checkpoints").exists()


def test_the_watchdog_also_watches_the_first_evaluation(tmp_path, monkeypatch):
    original = FaultyRolloutWorker.evaluate

    def slow_first_evaluation(self, prompts):
        if self.eval_calls == 0:
            time.sleep(4)
        return original(self, prompts)

    monkeypatch.setattr(FaultyRolloutWorker, "evaluate", slow_first_evaluation)
    with pytest.raises(StallError, match="train loop waits on the evaluation at step 0"):
        run(tmp_path, "stall", "faults.hang_generate_calls=[1000]", "runtime.watchdog_s=1")


def start_cli(tmp_path, name, *overrides):
    args = [sys.executable, "-m", "asyncrl.cli", "train", "--output-dir", str(tmp_path / name), *SMALL, *overrides]
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_checkpoints_the_run_and_exits_128_plus_signal(tmp_path, signum):
    process = start_cli(tmp_path, "run", "step.max_steps=100000", "checkpoint.every_steps=null")
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and len(read_jsonl(metrics)) >= 2):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.2)
    process.send_signal(signum)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signum, err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"error: interrupted by {signal.Signals(signum).name} at step ")
    step = int(line.split(" at step ")[1].split(";")[0])
    checkpoint = resolve_checkpoint(tmp_path / "run")
    assert checkpoint.name == f"step-{step:06d}" and load_state(checkpoint)["run"]["version"] == step
    assert len(read_jsonl(metrics)) == step


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_signal_in_a_minute_long_step_checkpoints_within_seconds_and_the_resumed_run_is_identical(tmp_path):
    """``faults.slow_module_s=1`` makes each train micro-batch take about 21 s (the small model has 21
    modules with parameters), so a step of 3 micro-batches takes over a minute, as on a real model.
    SIGTERM arrives inside the first step: the trainer abandons the micro-batch at its next module
    and aborts the step, so the checkpoint is on disk within 10 s and the process exits within 60
    s; resumed without the fault, the run writes what an uninterrupted one does."""
    process = start_cli(tmp_path, "run", "faults.slow_module_s=1", "checkpoint.every_steps=null")
    evals = tmp_path / "run" / "eval.jsonl"
    deadline = time.monotonic() + 120
    while not (evals.exists() and read_jsonl(evals)):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.2)
    time.sleep(5)  # the first step's first micro-batch is 21 s long
    process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    manifest = tmp_path / "run" / "checkpoints" / "step-000000" / "manifest.json"
    while not manifest.exists() and time.monotonic() < signalled + 60:
        time.sleep(0.05)
    checkpointed = time.monotonic() - signalled
    _, err = process.communicate(timeout=120)
    exited = time.monotonic() - signalled
    assert process.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1].startswith("error: interrupted by SIGTERM at step 0")
    assert checkpointed < 10 and exited < 60, (checkpointed, exited)
    assert load_state(manifest.parent)["run"]["step_groups"], "the aborted step's groups were not kept"
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not read_jsonl(tmp_path / "run" / "metrics.jsonl")
    _, clean, clean_groups = run(tmp_path, "clean")
    summary, resumed, resumed_groups = run(tmp_path, "run", "faults.slow_module_s=0", resume=tmp_path / "run")
    assert summary["steps"] == 4
    assert deterministic(resumed) == deterministic(clean) and resumed_groups == clean_groups


WAITS_ON_WORKERS = {  # the train loop waits behind a rollout worker's call: the method entered, the call that hangs
    "weight sync": (WeightSync, "sync", "generate", 2, []),
    "checkpoint": (SingleController, "checkpoint", "generate", 4, ["checkpoint.every_steps=1"]),
    "evaluation": (SingleController, "evaluate", "evaluate", 1, ["logging.eval_every_steps=1"]),
}


@pytest.mark.parametrize("where", WAITS_ON_WORKERS)
def test_a_signal_while_the_run_waits_on_a_rollout_worker_checkpoints_before_the_call_ends(
    tmp_path, monkeypatch, where
):
    """SIGTERM arrives while the train loop waits behind a generation batch or an evaluation that
    does not end until a checkpoint appears: the stop checkpoint must not wait for it."""
    owner, waiting_method, worker_method, hung_call, overrides = WAITS_ON_WORKERS[where]
    entered, outcome = threading.Event(), {}
    original_wait, original_call = getattr(owner, waiting_method), getattr(FaultyRolloutWorker, worker_method)

    async def waits(self, *args, **kwargs):
        if not isinstance(self, SingleController) or self.version >= 1:  # not the first evaluation
            entered.set()
        return await original_wait(self, *args, **kwargs)

    def hangs(self, jobs):
        calls = self.calls if worker_method == "generate" else self.eval_calls
        if calls == hung_call:
            assert entered.wait(120), f"the run never reached the {where}"
            signal.raise_signal(signal.SIGTERM)
            deadline = time.monotonic() + 120
            while not list((tmp_path / "run" / "checkpoints").glob("step-*/manifest.json")):
                if time.monotonic() > deadline:
                    outcome["checkpoint"] = "never written while this call ran"
                    break
                time.sleep(0.05)
            outcome.setdefault("checkpoint", "written while this call ran")
        return original_call(self, jobs)

    monkeypatch.setattr(owner, waiting_method, waits)
    monkeypatch.setattr(FaultyRolloutWorker, worker_method, hangs)
    with pytest.raises(RunInterrupted) as err:
        run(tmp_path, "run", "faults.hang_generate_calls=[1000]", *overrides)  # any fault wraps the worker
    assert outcome["checkpoint"] == "written while this call ran"
    assert err.value.exit_code == 128 + signal.SIGTERM and err.value.checkpoint is not None
    state = load_state(err.value.checkpoint)["run"]
    assert state["version"] == 1 and state["eval_due"] == (where == "evaluation")
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1]
    assert metrics[0]["sync_transport"] == ("interrupted" if where == "weight sync" else "in_process")
    monkeypatch.undo()
    summary, _, _ = run(tmp_path, "run", resume=tmp_path / "run")
    assert summary["steps"] == 4


def test_a_kill_during_a_checkpoint_write_leaves_the_previous_one_intact(tmp_path, capsys):
    process = start_cli(tmp_path, "run", "step.max_steps=3", "checkpoint.every_steps=1", "faults.kill_in_checkpoint=2")
    _, err = process.communicate(timeout=300)
    assert process.returncode == -signal.SIGKILL, err
    root = tmp_path / "run" / "checkpoints"
    assert (root / "latest").read_text() == "step-000001"
    assert [p.name for p in root.glob(".tmp-step-000002-*")]  # the half-written one
    state = load_state(resolve_checkpoint(tmp_path / "run"))
    assert state["run"]["version"] == 1
    code, err = cli(capsys, tmp_path, "run", "faults.kill_in_checkpoint=null", resume=tmp_path / "run")
    assert code == 0, err
    assert not list(root.glob(".tmp-*")) and (root / "latest").read_text() == "step-000003"
    assert [m["step"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]


def test_injected_nan_gradients_reach_every_parameter():
    """The nonfinite fault must poison the real gradients, or the skip tests above prove nothing."""
    from asyncrl.config import FaultsConfig
    from asyncrl.faults import inject_trainer_faults

    class Worker:
        def __init__(self):
            self.trainer = type("T", (), {"params": [torch.nn.Parameter(torch.ones(2))]})()
            self.trainer.params[0].grad = torch.zeros(2)

        def begin_step(self, step):
            pass

        def finish_step(self):
            return self.trainer.params[0].grad.clone()

    worker = inject_trainer_faults(Worker(), FaultsConfig(nonfinite_steps=[3]))
    worker.begin_step(2)
    assert torch.equal(worker.finish_step(), torch.zeros(2))
    worker.begin_step(3)
    assert worker.finish_step().isnan().all()
    assert inject_trainer_faults(worker.worker, FaultsConfig()) is worker.worker


def test_a_failed_evaluation_is_retried_and_one_that_keeps_failing_stops_with_a_checkpoint_that_resumes_exactly(
    tmp_path,
):
    _, clean, clean_groups = run(tmp_path, "clean", "sampler.max_lag=0")
    clean_evals = read_jsonl(tmp_path / "clean" / "eval.jsonl")
    _, retried, _ = run(tmp_path, "retried", "sampler.max_lag=0", "faults.eval_errors=[1]")
    assert without(retried) == without(clean)
    assert [strip_timing(e) for e in read_jsonl(tmp_path / "retried" / "eval.jsonl")] == [
        strip_timing(e) for e in clean_evals
    ]
    # evaluation call 1 is step 2's: it fails on every attempt (runtime.max_rollout_retries=2)
    with pytest.raises(EvaluationFailedError, match=r"evaluation at step 2 failed 3 times") as err:
        run(tmp_path, "part", "sampler.max_lag=0", "faults.eval_errors=[1, 2, 3]")
    assert err.value.checkpoint == tmp_path / "part" / "checkpoints" / "step-000002"
    assert load_state(err.value.checkpoint)["run"]["eval_due"]
    assert [e["step"] for e in read_jsonl(tmp_path / "part" / "eval.jsonl")] == [0]
    summary, resumed, resumed_groups = run(tmp_path, "part", "sampler.max_lag=0", resume=tmp_path / "part")
    assert summary["steps"] == 4
    assert without(resumed) == without(clean)
    assert resumed_groups == clean_groups
    assert [strip_timing(e) for e in read_jsonl(tmp_path / "part" / "eval.jsonl")] == [
        strip_timing(e) for e in clean_evals
    ]
