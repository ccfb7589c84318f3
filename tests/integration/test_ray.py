"""The Ray runtime on one shared local cluster: parity with the local runtime, the object-store data
plane, generator and trainer-rank deaths, and no Ray process left behind.

Each run uses the small model of test_train.py; most of a run's seconds are actor start-up.
"""

import math
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import fields
from functools import partial

import pytest
import torch
from helpers import SMALL, dashboard_command_lines, ray_server_processes, wait_for_exit, wait_until_gone
from test_integrity import EPISODES

from asyncrl.config import ConfigError, load_config
from asyncrl.errors import IntegrityStop
from asyncrl.metrics import read_jsonl, strip_timing
from asyncrl.run import train
from asyncrl.runtime.ray import TrainerRankDiedError
from asyncrl.types import RolloutGroup, RolloutJob

RAY = "runtime.name=ray"
DIGITS = "rewards.functions=[reward_functions:digits]"  # varies within groups even untrained: real gradients


def run(tmp_path, name, *overrides, resume=None):
    config = load_config(None, [*SMALL, f"logging.output_dir={tmp_path / name}", *overrides])
    summary = train(config, resume=resume)
    return summary, read_jsonl(tmp_path / name / "metrics.jsonl"), read_jsonl(tmp_path / name / "groups.jsonl")


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """``run`` on the local runtime, once per set of overrides in this module: the reference runs."""
    done = {}

    def run_once(*overrides):
        if overrides not in done:
            done[overrides] = run(tmp_path_factory.mktemp("local"), "run", *overrides)
        return done[overrides]

    return run_once


def deterministic(records, *drop):
    """The records without timing, nor how weights moved (local: in process; Ray: not)."""
    return [{k: v for k, v in strip_timing(r).items() if k not in {"sync_transport", *drop}} for r in records]


def kill_until_dead(actor, *, restart: bool = True) -> None:
    """Kill an actor and return once its process is gone: ``ray.kill`` returns before the kill
    lands, so a call made at once may still run on the old process and succeed."""
    import os

    import ray

    pid = ray.get(actor.__ray_call__.remote(lambda _: os.getpid()))
    ray.kill(actor, no_restart=not restart)

    def running() -> set[int]:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return set()
        return {pid}

    assert not wait_for_exit(running, timeout_s=30.0), f"the actor's process {pid} outlived ray.kill"


# ---- without a cluster ------------------------------------------------------------------------


def test_asyncrl_and_the_local_runtime_do_not_import_ray():
    code = "import sys, asyncrl, asyncrl.config, asyncrl.run, asyncrl.runtime; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_ray_only_settings_are_one_line_errors_on_the_local_runtime():
    with pytest.raises(ConfigError, match=r"^runtime.address: set, but runtime.name is local"):
        load_config(None, ["runtime.address=auto"])
    with pytest.raises(ConfigError, match=r"^runtime.controller_actor: needs runtime.name ray"):
        load_config(None, ["runtime.controller_actor=true"])
    with pytest.raises(ConfigError, match=r"^generation.num_workers: 2 rollout workers need runtime.name ray"):
        load_config(None, ["generation.num_workers=2"])
    assert load_config(None, [RAY, "generation.num_workers=2"]).generation.num_workers == 2


def test_the_weight_transport_broadcasts_between_gpus_by_default_and_only_on_ray():
    with pytest.raises(ConfigError, match=r"^sync.transport: broadcast needs runtime.name ray \(the local runtime"):
        load_config(None, ["sync.transport=broadcast"])
    assert load_config(None, []).weight_transport == "in_process"
    assert load_config(None, [RAY]).weight_transport == "object_store"
    gpus = [RAY, "runtime.trainer_gpus=1", "runtime.generator_gpus=1"]
    assert (load_config(None, gpus).weight_transport, load_config(None, gpus).broadcast_backend) == (
        "broadcast",
        "nccl",
    )
    assert load_config(None, [*gpus, "trainer.device=cpu"]).weight_transport == "object_store"
    assert load_config(None, [*gpus, "runtime.generator_gpus=0"]).broadcast_backend == "gloo"
    shared = load_config(None, [*gpus, "runtime.generator_gpus=0.5"])  # NCCL refuses two members on one GPU
    assert (shared.weight_transport, shared.broadcast_backend) == ("object_store", "gloo")
    chosen = load_config(None, [RAY, "sync.transport=broadcast"])
    assert (chosen.weight_transport, chosen.broadcast_backend) == ("broadcast", "gloo")
    assert load_config(None, [*gpus, "sync.transport=object_store"]).weight_transport == "object_store"


def test_a_remote_group_has_every_attribute_of_a_group_but_its_token_tensors():
    from asyncrl.runtime.payloads import RemoteGroup

    n, t = 3, 5
    group = RolloutGroup(
        prompt_uid="p7",
        input_ids=torch.ones(n, t, dtype=torch.long),
        attention_mask=torch.ones(n, t, dtype=torch.long),
        response_mask=torch.tensor([[0.0, 0, 1, 1, 0]] * n),
        behaviour_logprobs=torch.zeros(n, t),
        rewards=torch.tensor([1.0, 0.0, 1.0]),
        finish_reasons=["stop"] * n,
        start_version=2,
        end_version=3,
        target_step=4,
        correct=torch.tensor([1.0, 0.0, 1.0]),
        reward_errors=1,
        reward_timeouts=2,
        retries=1,
    )
    remote = RemoteGroup.describe(group)
    token_tensors = {"input_ids", "attention_mask", "response_mask", "behaviour_logprobs", "token_versions"}
    for name in {f.name for f in fields(RolloutGroup)} - token_tensors | {
        "size",
        "response_tokens",
        "sequence_lengths",
        "oldest_token_version",
        "row_response_tokens",
    }:
        assert getattr(remote, name) is getattr(group, name) or getattr(remote, name) == getattr(group, name), name
    assert not token_tensors & set(vars(remote))
    assert (remote.size, remote.response_tokens, remote.oldest_token_version) == (3, 6, 2) and remote.ref is None


# ---- on the session cluster --------------------------------------------------------------------


def unbuildable():
    raise ValueError("data.task.options.path: no such file 'missing.jsonl'")


@pytest.mark.slow
def test_group_payloads_are_owned_by_the_caller_and_outlive_their_generator(ray_cluster, tmp_path):
    """Also: actors start together, and ``ready`` raises a factory's error as itself."""
    import ray

    from asyncrl.data.prompts import Prompt
    from asyncrl.runtime.payloads import RemoteGroup
    from asyncrl.runtime.ray import RayRuntime
    from asyncrl.workers import build_rollout_worker

    config = load_config(None, [*SMALL, RAY])
    runtime = RayRuntime(config.runtime)
    [handle] = runtime.spawn_generators(lambda: build_rollout_worker(config), 1)
    [broken] = runtime.spawn_trainer_ranks(lambda rank, init_method: unbuildable, 1)
    with pytest.raises(ValueError, match=r"^data.task.options.path: no such file 'missing.jsonl'$"):
        runtime.ready()
    runtime.ready()  # nothing left to wait for
    jobs = [RolloutJob(slot, Prompt(f"u{slot}", f"{slot}+1=", str(slot + 1)), 0, 0) for slot in range(2)]

    async def generate():
        return await handle.generate(jobs)

    import asyncio

    batch = asyncio.run(generate())
    kill_until_dead(handle.actor, restart=False)
    runtime.shutdown()
    assert ray.is_initialized()  # the session's cluster is not the runtime's to shut down
    assert [type(g) for g in batch.groups] == [RemoteGroup, RemoteGroup]
    fetched = [g.fetch() for g in batch.groups]  # after the actor that made them is gone
    assert [g.prompt_uid for g in fetched] == ["u0", "u1"] and fetched[0].input_ids.shape[0] == 4
    assert torch.equal(fetched[1].rewards, batch.groups[1].rewards)
    assert batch.groups[0].response_tokens == fetched[0].response_tokens


class LoadWaiter:
    """``wait_for_load`` returns whether ``load_weights`` ran before its wait ended: only a load
    that runs beside it can end the wait early."""

    def __init__(self, unordered: bool) -> None:
        self.unordered_methods = ("load_weights",) if unordered else ()
        self.loaded = threading.Event()

    def wait_for_load(self, timeout_s: float) -> bool:
        return self.loaded.wait(timeout_s)

    def load_weights(self, weights, version: int) -> None:
        self.loaded.set()


@pytest.mark.slow
def test_a_workers_unordered_methods_run_beside_its_calls_on_rollout_and_trainer_actors(ray_cluster):
    """A weight load submitted after a call that waits for it: on an actor whose worker lists
    ``load_weights`` as unordered it runs during that call (a rollout worker's in-flight load, a
    trainer rank's ``abandon``); otherwise after it."""
    import asyncio

    import ray

    from asyncrl.runtime.payloads import WeightsRef
    from asyncrl.runtime.ray import RayRuntime

    runtime = RayRuntime(load_config(None, [*SMALL, RAY]).runtime)

    async def load_during_wait(handle, timeout_s):
        waited = handle.wait_for_load(timeout_s)
        await handle.load_weights(WeightsRef(ray.put({}), 0), 1)
        return await waited

    try:
        [inflight] = runtime.spawn_generators(partial(LoadWaiter, True), 1)
        [ordered] = runtime.spawn_generators(partial(LoadWaiter, False), 1)
        [rank] = runtime.spawn_trainer_ranks(lambda rank, init: partial(LoadWaiter, True), 1)
        [ordered_rank] = runtime.spawn_trainer_ranks(lambda rank, init: partial(LoadWaiter, False), 1)
        runtime.ready()
        unordered = (inflight.unordered, ordered.unordered, rank.unordered, ordered_rank.unordered)
        assert unordered == (("load_weights",), (), ("load_weights",), ())
        assert asyncio.run(load_during_wait(inflight, 60.0))
        assert not asyncio.run(load_during_wait(ordered, 1.0))
        assert asyncio.run(load_during_wait(rank, 60.0))
        assert not asyncio.run(load_during_wait(ordered_rank, 1.0))
    finally:
        runtime.shutdown()


@pytest.mark.slow
def test_an_in_order_run_on_two_generator_actors_matches_the_local_runtime(ray_cluster, tmp_path, local_run):
    local, local_metrics, local_groups = local_run(DIGITS)
    remote, metrics, groups = run(tmp_path, "ray", DIGITS, RAY, "generation.num_workers=2")
    assert deterministic(metrics) == deterministic(local_metrics) and len(metrics) == 4
    assert groups == local_groups
    assert all(m["grad_norm"] > 0 for m in metrics) and metrics[-1]["sync_bytes"] > 0
    assert [m["sync_transport"] for m in metrics] == ["object_store"] * 4
    assert remote["final_eval_reward_mean"] == local["final_eval_reward_mean"]


@pytest.mark.slow
def test_an_in_order_episode_run_warm_starts_the_ranks_on_the_environments_demonstrations(ray_cluster, tmp_path):
    """The ranks must find the driver's warm start (demonstrations included) in the cache, not
    train one of their own: a fresh cache, so a rank that computes another key trains another."""
    episodes = (
        "environment.name=feedback",
        "environment.max_turns=3",
        "environment.max_tokens=40",
        "warm_start.steps=60",
        "warm_start.lr=0.01",
        "step.max_steps=3",
        f"warm_start.cache_dir={tmp_path / 'cache'}",
    )
    _, local, local_groups = run(tmp_path, "local", *episodes)
    _, remote, groups = run(tmp_path, "ray", *episodes, RAY)
    assert deterministic(remote) == deterministic(local) and groups == local_groups
    assert len(list((tmp_path / "cache").iterdir())) == 1
    assert max(m["episode/turns"] for m in remote) > 1


@pytest.mark.slow
def test_the_controller_runs_in_an_actor_and_broadcasts_weights_to_two_generators(ray_cluster, tmp_path, local_run):
    """The broadcast channel travels into the controller actor with the handles it serves."""
    _, local_metrics, local_groups = local_run(DIGITS)
    broadcast = ("runtime.controller_actor=true", "generation.num_workers=2", "sync.transport=broadcast")
    summary, metrics, groups = run(tmp_path, "actor", DIGITS, RAY, *broadcast)
    assert deterministic(metrics) == deterministic(local_metrics) and groups == local_groups
    assert [m["sync_transport"] for m in metrics] == ["broadcast"] * 4
    assert summary["steps"] == 4 and (tmp_path / "actor" / "eval.jsonl").is_file()


@pytest.mark.slow
def test_a_generator_that_dies_mid_run_is_restarted_with_the_latest_weights(ray_cluster, tmp_path, local_run):
    marker = ray_cluster
    marker.write_text("")
    _, _, local_groups = local_run("step.max_steps=5")
    summary, _, groups = run(
        tmp_path,
        "ray",
        RAY,
        "step.max_steps=5",
        "rewards.functions=[reward_functions:exit_once]",
        "rewards.processes=1",
    )
    assert not marker.exists() and marker.with_name(f"{marker.name}.used").exists()  # it did die
    assert summary["steps"] == 5 and summary["rollout_retries"] >= 1
    assert [(g["step"], g["prompt_uid"]) for g in groups] == [(g["step"], g["prompt_uid"]) for g in local_groups]
    # The batch was retried after the next sync, so on the weights after it: the restarted actor
    # had loaded them (a generator on other weights refuses the batch, and the retries run out).
    retried = [g for g, local in zip(groups, local_groups) if g != local]
    assert retried and all(g["start_version"] == g["end_version"] >= 1 for g in retried)


@pytest.mark.slow
def test_a_generator_that_misses_a_broadcast_loads_rank0s_copy_and_the_broadcast_stops(ray_cluster):
    """A generator that dies in a batch after a broadcast fails that batch, which stops the broadcast; once
    restarted it loads the broadcast version from rank 0's copy. A generator killed before a
    broadcast fails to join it, and loads rank 0's copy in that same sync. Either way it then
    generates the same groups as before it died, and later syncs use the object store."""
    import asyncio

    import ray

    from asyncrl.data.prompts import Prompt
    from asyncrl.runtime.ray import RayRuntime, WorkerDiedError
    from asyncrl.workers import build_rollout_worker, build_trainer_rank

    marker = ray_cluster
    kill_in_reward = ("rewards.functions=[reward_functions:exit_when_marked]", "rewards.processes=1")
    config = load_config(None, [*SMALL, RAY, "sync.transport=broadcast", *kill_in_reward])
    jobs = [RolloutJob(slot, Prompt(f"u{slot}", f"{slot}+1=", str(slot + 1)), 0, 0) for slot in range(2)]
    runtime = RayRuntime(config.runtime)

    async def sync(generator):
        version, weights = await rank0.export_weights()
        await generator.load_weights(weights, version)
        return weights.transport

    async def generate(generator):
        return [group.fetch() for group in (await generator.generate(jobs)).groups]

    def same(groups, other):
        return all(
            torch.equal(a.input_ids, b.input_ids) and torch.equal(a.behaviour_logprobs, b.behaviour_logprobs)
            for a, b in zip(groups, other)
        )

    try:
        [rank0] = runtime.spawn_trainer_ranks(lambda rank, init: partial(build_trainer_rank, config, rank, init), 1)
        [generator] = runtime.spawn_generators(partial(build_rollout_worker, config), 1)
        runtime.ready()
        runtime.connect_broadcast(rank0, [generator], "gloo", 60.0)
        assert asyncio.run(sync(generator)) == "broadcast"
        before = asyncio.run(generate(generator))
        marker.write_text("")  # the batch's first reward call kills the actor
        with pytest.raises(WorkerDiedError):
            asyncio.run(generate(generator))
        assert not marker.exists()
        assert generator.broadcast.stopped == "rollout worker 0 died"
        assert same(asyncio.run(generate(generator)), before)  # on version 0, from rank 0's copy
        assert asyncio.run(sync(generator)) == "object_store"

        runtime.connect_broadcast(rank0, [generator], "gloo", 60.0)  # a new group, as at the start of a run
        assert asyncio.run(sync(generator)) == "broadcast"
        kill_until_dead(generator.actor)
        ray.get(generator.actor.alive.remote())  # restarted
        assert asyncio.run(sync(generator)) == "broadcast"  # rank 0 broadcast; the generator missed it
        # Ray may report the restart to the join itself, or the restarted actor refuses it.
        assert re.match(
            r"rollout worker 0 (died|missed weight version 0: .*not in the weight broadcast group)",
            generator.broadcast.stopped,
        )
        assert same(asyncio.run(generate(generator)), before)
        assert asyncio.run(sync(generator)) == "object_store"
    finally:
        runtime.shutdown()


@pytest.mark.slow
def test_a_dead_trainer_rank_stops_the_run_and_its_last_checkpoint_resumes(ray_cluster, tmp_path):
    every_step = "checkpoint.every_steps=1"
    with pytest.raises(TrainerRankDiedError, match=r"^trainer rank 0 died: ") as stopped:
        run(tmp_path, "ray", RAY, every_step, "faults.kill_in_checkpoint=2")
    assert "\n" not in str(stopped.value)
    checkpoints = tmp_path / "ray" / "checkpoints"
    assert (checkpoints / "latest").read_text() == "step-000001"
    summary, resumed, _ = run(tmp_path, "ray", RAY, every_step, resume=tmp_path / "ray")
    _, full, _ = run(tmp_path, "local", every_step)
    assert summary["steps"] == 4
    assert deterministic(resumed) == deterministic(full)


def close(a, b) -> bool:
    """Equal ints and strings; floats within docs/loss.md's float32 tolerance (rtol 1e-4)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6)
    return a == b


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["parallel.dp=2", "parallel.cp=2"])
def test_trainer_ranks_match_the_single_rank_run(ray_cluster, tmp_path, local_run, layout):
    """dp=2 also broadcasts weights from rank 0, beside the ranks' own process group."""
    synchronous = (DIGITS, "sampler.max_lag=0", "step.max_steps=3")
    _, single, _ = local_run(*synchronous)
    transport = "sync.transport=broadcast" if layout == "parallel.dp=2" else "sync.transport=object_store"
    _, ranks, _ = run(tmp_path, "ranks", RAY, layout, transport, *synchronous)
    _, other_lr, _ = local_run(*synchronous, "trainer.lr=0.0101")
    assert len(ranks) == 3 and {m["sync_transport"] for m in ranks} == {transport.split("=")[1]}
    assert all(close(a, b) for a, b in zip(deterministic(ranks), deterministic(single)))
    assert not all(close(a, b) for a, b in zip(deterministic(other_lr), deterministic(single)))  # it can fail


@pytest.mark.slow
def test_an_integrity_stop_of_the_trainer_ranks_counts_both_ranks_and_stops_the_run(ray_cluster, tmp_path):
    """The loss counts are checked on sums over the DP ranks (docs/integrity.md, promise 5): each of
    two ranks trains its first micro-batch (6 of the step's 16 sequences) twice, so the sums hold
    28 sequences; the stop crosses from the rank actors as itself, before the step's update."""
    with pytest.raises(IntegrityStop) as stopped:
        run(tmp_path, "ranks", RAY, "parallel.dp=2", "faults.duplicate_microbatch=true")
    assert (stopped.value.promise, stopped.value.step) == ("loss_counts", 1)
    assert re.search(
        r"response tokens in 28 sequences over .* but the groups trained hold \d+ in 16$", str(stopped.value)
    )
    assert stopped.value.checkpoint.name == "step-000000"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overrides", "promise", "latest_step"),
    [
        (("sampler.max_lag=0", "faults.stale_tokens=1"), "staleness", 2),
        (("faults.rewards_raise=true",), "failures", 1),
        ((*EPISODES, "faults.template_rewrites_transcript=true"), "transcripts", 3),
    ],
    ids=["staleness", "failures", "transcripts"],
)
def test_a_broken_promise_about_the_groups_stops_a_ray_run_as_a_local_one(
    ray_cluster, tmp_path, overrides, promise, latest_step
):
    """Promises 3, 4 and 6 are checked by the controller on what a group carries (docs/integrity.md):
    from Ray's rollout actors that is a RemoteGroup's metadata, and each fault stops the run there too."""
    with pytest.raises(IntegrityStop) as stopped:
        run(tmp_path, promise, RAY, *overrides)
    assert stopped.value.promise == promise and stopped.value.step <= latest_step
    assert stopped.value.checkpoint.name == f"step-{stopped.value.step - 1:06d}"  # the last step trained


@pytest.mark.slow
def test_an_interrupted_cli_run_on_ray_leaves_no_ray_process_behind(tmp_path):
    """The CLI starts its own cluster; Ctrl-C checkpoints, stops, and the cluster goes with it."""
    before = ray_server_processes()
    run_dir = tmp_path / "cli"
    command = [
        sys.executable,
        "-m",
        "asyncrl",
        "train",
        "--output-dir",
        str(run_dir),
        *SMALL,
        RAY,
        "step.max_steps=500",
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        metrics = run_dir / "metrics.jsonl"
        while (
            not (metrics.is_file() and read_jsonl(metrics)) and process.poll() is None and time.monotonic() < deadline
        ):
            time.sleep(0.2)
        assert ray_server_processes() - before, "the CLI run started no cluster of its own"
        for argv in dashboard_command_lines():  # the dashboard: no web frontend, loopback only
            assert "--host=127.0.0.1" in argv and "--disable-frontend" in argv, argv
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 128 + signal.SIGINT, err[-2000:]
    assert "interrupted by SIGINT" in err and (run_dir / "checkpoints" / "latest").is_file()
    assert not wait_until_gone(ray_server_processes() - before)
