"""Trainer ranks behind one handle: TrainerGroup's fan-out, build_trainer_rank, and dp × cp ranks
running the real step sequence against the single-rank TrainerWorker (docs/loss.md, float64)."""

import asyncio
import io
import subprocess
import sys
import threading
from dataclasses import fields, replace

import pytest
import torch
import torch.distributed as dist
from helpers import make_groups

from asyncrl.config import load_config
from asyncrl.data import build_task
from asyncrl.errors import IntegrityStop
from asyncrl.faults import InjectedFault
from asyncrl.models.factory import build_model, build_tokenizer
from asyncrl.runtime.local import LocalHandle
from asyncrl.trainer import PolicyTrainer
from asyncrl.trainer.group import TrainerGroup, TrainerRankError
from asyncrl.trainer.parallel import launch
from asyncrl.trainer.worker import TrainerWorker
from asyncrl.types import RolloutGroup
from asyncrl.warm_start import warm_start
from asyncrl.workers import build_trainer_rank

# ---- TrainerGroup ---------------------------------------------------------------------------


class RecordingRank:
    """Answers with its rank; remembers the calls it got; fails where told."""

    unordered_methods = ()  # every call in order, as a trainer rank's

    def __init__(self, rank: int, fail: str | None = None) -> None:
        self.rank, self.fail, self.calls = rank, fail, []

    def __getattr__(self, method):
        def call(*args):
            self.calls.append((method, args))
            if method == self.fail:
                raise ValueError(f"planted failure in {method}")
            return (method, self.rank)

        return call


def run(coroutine_factory):
    async def main():
        return await coroutine_factory()

    return asyncio.run(main())


def test_group_sends_every_call_to_every_rank_in_order_and_answers_with_rank_0():
    ranks = [RecordingRank(r) for r in range(3)]

    async def drive():
        group = TrainerGroup([LocalHandle(r, f"trainer-{r.rank}") for r in ranks])
        results = [
            await group.begin_step(4),
            await group.train_groups(["g1", "g2"]),
            await group.finish_step(),
            await group.abort_step(),
            await group.export_weights(),
            await group.save_checkpoint("run", 5, {"v": 5}, 2),
            await group.load_checkpoint("ckpt", {"version": 5}),
        ]
        # submitted before awaiting: a later call queues behind an earlier one on every rank
        first, second = group.begin_step(6), group.abort_step()
        results += [await second, await first]
        return results

    results = run(drive)
    methods = [
        "begin_step",
        "train_groups",
        "finish_step",
        "abort_step",
        "export_weights",
        "save_checkpoint",
        "load_checkpoint",
    ]
    assert results == [(m, 0) for m in methods] + [("abort_step", 0), ("begin_step", 0)]
    for rank in ranks:
        assert rank.calls == [
            ("begin_step", (4,)),
            ("train_groups", (["g1", "g2"],)),
            ("finish_step", ()),
            ("abort_step", ()),
            ("export_weights", ()),
            ("save_checkpoint", ("run", 5, {"v": 5}, 2)),
            ("load_checkpoint", ("ckpt", {"version": 5})),
            ("begin_step", (6,)),
            ("abort_step", ()),
        ]


def test_a_failing_rank_is_named_and_its_error_kept():
    ranks = [RecordingRank(0), RecordingRank(1, fail="train_groups")]

    async def drive():
        group = TrainerGroup([LocalHandle(r, f"trainer-{r.rank}") for r in ranks])
        await group.begin_step(0)
        with pytest.raises(
            TrainerRankError, match=r"^trainer rank 1: train_groups failed: ValueError: planted failure"
        ) as info:
            await group.train_groups(["g"])
        assert info.value.rank == 1 and isinstance(info.value.__cause__, ValueError)
        await group.abort_step()

    run(drive)
    assert (
        [m for m, _ in ranks[0].calls] == [m for m, _ in ranks[1].calls] == ["begin_step", "train_groups", "abort_step"]
    )


def test_a_failing_rank_is_reported_while_another_still_waits_in_its_call():
    released = threading.Event()

    class Waiting(RecordingRank):
        def train_groups(self, groups):  # as a rank blocked in a collective the failed rank never joins
            released.wait(timeout=30)

    async def drive():
        group = TrainerGroup(
            [LocalHandle(Waiting(0), "trainer-0"), LocalHandle(RecordingRank(1, fail="train_groups"), "trainer-1")]
        )
        with pytest.raises(TrainerRankError, match="^trainer rank 1:"):
            await asyncio.wait_for(group.train_groups(["g"]), timeout=10)
        assert not released.is_set()
        released.set()

    run(drive)


def test_group_needs_a_rank():
    with pytest.raises(ValueError, match="at least one trainer rank"):
        TrainerGroup([])


# ---- build_trainer_rank on one rank -----------------------------------------------------------

SMALL = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "trainer.device=cpu",
    "trainer.lr=0.01",
    "step.prompts_per_step=5",
    "step.generations_per_prompt=4",
    "warm_start.steps=3",
    "warm_start.batch_size=8",
]


def small_config(tmp_path, *overrides):
    return load_config(None, [*SMALL, f"warm_start.cache_dir={tmp_path / 'warm'}", *overrides])


def test_a_single_rank_is_the_driver_s_warm_started_policy(tmp_path):
    config = small_config(tmp_path)
    tokenizer = build_tokenizer(config)
    model = build_model(config, tokenizer)
    warm_start(model, tokenizer, build_task(config.data, tokenizer).train, config.warm_start)
    worker = build_trainer_rank(config, 0, None)
    version, weights = worker.export_weights()
    assert version == 0 and worker.rank == 0 and worker.trainer.parallel is None
    expected = model.state_dict()
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[k], expected[k]) for k in expected)


def test_a_rank_gets_the_fault_section_s_wrapper(tmp_path):
    worker = build_trainer_rank(small_config(tmp_path, "faults.train_errors=[0]"), 0, None)
    worker.begin_step(0)
    with pytest.raises(InjectedFault, match="train step 0 failed"):
        worker.train_groups(make_groups(0))
    worker.abort_step()
    assert isinstance(worker.trainer, PolicyTrainer) and not worker.trainer.step_open


# ---- dp × cp ranks against the single-rank worker ---------------------------------------------

TENSORS = ("input_ids", "attention_mask", "response_mask", "behaviour_logprobs")
MICRO_BATCH = 6  # groups of 4: some lie in one micro-batch, some straddle two; steps end on a partial one
RANK_OVERRIDES = [
    "runtime.name=ray",
    f"trainer.micro_batch_size={MICRO_BATCH}",
    "step.filter_zero_variance=true",
    "algorithm.options.kl_coef=0.05",  # the reference logprobs run on every micro-batch too, padding included
    # float64, so that the ranks' other summation order stays far below the tolerance after three
    # AdamW steps, whatever the CPU: AdamW moves a coordinate by about lr * g / (|g| + eps), which in
    # float32 turns a rounding-level difference in a small gradient (a rare token's tied embedding
    # row, the key bias that softmax ignores) into a visible one
    "trainer.dtype=float64",
]
CHUNKS = {0: [5], 1: [1, 3, 1], 2: [2, 2, 1], 3: [4, 1]}  # groups per train_groups call, per step
FLOAT64 = {"loss": 1e-9, "rtol": 1e-9, "atol_frac": 1e-9}  # docs/loss.md, "What 'the same' means"


class HeldGroup:
    """A group as the object-store runtime hands it over: metadata, tensors only through fetch()."""

    def __init__(self, group: RolloutGroup) -> None:
        for f in fields(RolloutGroup):
            if f.name not in TENSORS:
                setattr(self, f.name, getattr(group, f.name))
        self.size, self.response_tokens = group.size, group.response_tokens
        self.sequence_lengths, self.row_response_tokens = group.sequence_lengths, group.row_response_tokens
        self.fetches = 0
        self._group = group

    def fetch(self) -> RolloutGroup:
        self.fetches += 1
        return self._group


def step_groups(step: int) -> list:
    """Step ``step``'s five groups of four: every other one held, two of step 2 stale, one of step 1
    with equal rewards (filtered). No reward failed: such a group is never trained (docs/integrity.md)."""
    groups = [replace(g, reward_errors=0) for g in make_groups(100 + step, count=5, version=step)]
    if step == 1:
        groups[2] = RolloutGroup(**{**groups[2].__dict__, "rewards": torch.ones(4), "informative": False})
    if step == 2:
        groups[:2] = [replace(g, reward_errors=0) for g in make_groups(200, count=2, version=1)]
    return [HeldGroup(g) if i % 2 else g for i, g in enumerate(groups)]


def run_step(worker, step: int) -> tuple:
    """(report, fetches of each held group by prompt uid) of one step, chunked as CHUNKS says."""
    groups = step_groups(step)
    worker.begin_step(step)
    start = 0
    for size in CHUNKS[step]:
        worker.train_groups(groups[start : start + size])
        start += size
    report = worker.finish_step()
    return report, {g.prompt_uid: g.fetches for g in groups if isinstance(g, HeldGroup)}


def expected_fetches(step: int, dp: int, dp_rank: int) -> dict[str, int]:
    """A held group is fetched once by the DP ranks whose micro-batches (m % dp) hold its rows."""
    fetches, row = {}, 0
    for group in step_groups(step):
        if len(set(group.rewards.tolist())) == 1:
            owners = set()  # filtered: never trained
        else:
            owners = {(r // MICRO_BATCH) % dp for r in range(row, row + group.size)}
            row += group.size
        if isinstance(group, HeldGroup):
            fetches[group.prompt_uid] = int(dp_rank in owners)
    return fetches


class TrainsEveryMicroBatch(TrainerWorker):
    """Planted: every DP rank trains every micro-batch of a round, not just its own."""

    def _round_batches(self, round_):
        return [self._micro_batch(micro_batch) for micro_batch in round_]


class DropsTheLastRound(TrainerWorker):
    """Planted: what is left at the end of a step (the partial micro-batch too) is never trained."""

    def finish_step(self):
        self._full, self._partial = [], []
        return super().finish_step()


def mismatches(got, want) -> list[str]:
    """What differs between two steps' reports beyond docs/loss.md's float64 tolerance."""
    problems = [] if got.data == want.data else ["step data"]
    a, b = got.result, want.result
    for name in ("version", "num_sequences", "num_tokens", "num_microbatches", "skipped"):
        if getattr(a, name) != getattr(b, name):
            problems.append(f"{name} {getattr(a, name)} != {getattr(b, name)}")
    if abs(a.loss - b.loss) > FLOAT64["loss"] * abs(b.loss):
        problems.append(f"loss {a.loss} != {b.loss}")
    if abs(a.grad_norm - b.grad_norm) > FLOAT64["rtol"] * b.grad_norm:
        problems.append(f"grad norm {a.grad_norm} != {b.grad_norm}")
    if a.metrics.keys() != b.metrics.keys():
        problems.append("metric names")
    for key, value in b.metrics.items():
        if abs(a.metrics.get(key, float("nan")) - value) > FLOAT64["rtol"] * abs(value) + FLOAT64["atol_frac"]:
            problems.append(f"metric {key}")
    return problems


def weight_mismatches(got: dict, want: dict) -> list[str]:
    """Weights beyond docs/loss.md's float64 tensor tolerance (rtol, atol relative to the tensor's max)."""
    if got.keys() != want.keys():
        return ["weight names"]
    return [
        name
        for name, value in want.items()
        if not torch.allclose(
            got[name], value, rtol=FLOAT64["rtol"], atol=FLOAT64["atol_frac"] * float(value.abs().max())
        )
    ]


def ranks_step_sequence(rank: int, world_size: int, overrides, rendezvous, resume_from, save_to, skewed=False) -> bytes:
    """On each rank: resume the single rank's checkpoint and train step 2 (when ``resume_from``),
    train steps 0-2 from scratch and checkpoint them (when ``save_to``), then one step of each
    planted twin. The fresh ranks meet through ``rendezvous`` when given, as a runtime's would.
    ``skewed``: ranks other than 0 build the fresh model from another seed (rank 0's weights win)."""
    config = load_config(None, overrides)
    fresh_config = load_config(None, [*overrides, "model.init_seed=7"]) if skewed and rank else config
    out = {}
    if rendezvous is not None:
        dist.destroy_process_group()
    if resume_from is not None:
        resumed = build_trainer_rank(config, rank, rendezvous, checkpoint_dir=resume_from)
        out["resumed_weights"] = resumed.export_weights()[1]
        out["resumed_step"] = run_step(resumed, 2)
    worker = build_trainer_rank(fresh_config, rank, None if resume_from is not None else rendezvous)
    out["dp_rank"] = worker.dp_rank
    out["steps"] = [run_step(worker, step) for step in range(3)]
    out["weights"] = worker.export_weights()
    if save_to is not None:
        out["checkpoint"] = worker.save_checkpoint(save_to, 3, {"note": "ranks"}, keep_last=1)
    unguarded = load_config(None, [*overrides, "integrity.enabled=false"])
    for plant in (TrainsEveryMicroBatch, DropsTheLastRound):
        twin = build_trainer_rank(unguarded, rank, None)
        twin.__class__ = plant
        out[plant.__name__] = run_step(twin, 0)[0]
        guarded = build_trainer_rank(config, rank, None)
        guarded.__class__ = plant
        try:  # the integrity guard's loss counts refuse the planted step before its update
            out[f"guarded {plant.__name__}"] = run_step(guarded, 0)[0]
        except IntegrityStop as stop:
            out[f"guarded {plant.__name__}"] = stop.promise
    buffer = io.BytesIO()
    torch.save(out, buffer)
    return buffer.getvalue()


def single_rank_reference(tmp_path, checkpoint_at: int | None = None):
    """The single-rank worker after steps 0-2, its reports, and (its checkpoint, its weights) at
    ``checkpoint_at``."""
    worker = build_trainer_rank(small_config(tmp_path, *RANK_OVERRIDES), 0, None)
    reports, checkpoint = [], (None, None)
    for step in range(3):
        if step == checkpoint_at:
            path = worker.save_checkpoint(str(tmp_path / "single"), step, {"note": "single"}, keep_last=1)
            checkpoint = (path, {k: v.clone() for k, v in worker.export_weights()[1].items()})
        reports.append(run_step(worker, step)[0])
    return worker, reports, checkpoint


def check_ranks_against_single_rank(payloads, reports, weights, dp: int) -> None:
    for rank, out in enumerate(payloads):
        for step, ((got, fetches), want) in enumerate(zip(out["steps"], reports)):
            assert mismatches(got, want) == [], (rank, step)
            assert fetches == expected_fetches(step, dp, out["dp_rank"]), (rank, step)
        version, got_weights = out["weights"]
        assert version == 3 and (got_weights == {}) == (rank != 0)
    assert weight_mismatches(payloads[0]["weights"][1], weights) == []
    # the negative twins fail the comparison that the ranks pass (with one DP rank, training every
    # micro-batch is no mistake)
    if dp > 1:
        assert any("num_tokens" in p for p in mismatches(payloads[0]["TrainsEveryMicroBatch"], reports[0]))
    dropped = mismatches(payloads[0]["DropsTheLastRound"], reports[0])
    assert any(p.startswith("loss") for p in dropped) and any(p.startswith("num_sequences") for p in dropped)
    # with the guard on, every rank refuses each planted step (docs/integrity.md, promise 5)
    for out in payloads:
        assert out["guarded DropsTheLastRound"] == "loss_counts"
        every_micro_batch = out["guarded TrainsEveryMicroBatch"]
        assert every_micro_batch == "loss_counts" if dp > 1 else every_micro_batch.result.version == 1  # no mistake


def rank_payloads(world_size: int, *args) -> list[dict]:
    return [torch.load(io.BytesIO(p), weights_only=False) for p in launch(ranks_step_sequence, world_size, *args)]


def check_checkpoint_loads_on_one_rank(tmp_path, payloads) -> TrainerWorker:
    """Rank 0 alone wrote the checkpoint; a single rank loads exactly the ranks' weights."""
    checkpoint = payloads[0]["checkpoint"]
    assert checkpoint is not None and all(out["checkpoint"] is None for out in payloads[1:])
    resumed = build_trainer_rank(small_config(tmp_path, *RANK_OVERRIDES), 0, None, checkpoint_dir=str(checkpoint))
    version, resumed_weights = resumed.export_weights()
    ranks_weights = payloads[0]["weights"][1]
    assert version == 3 and all(torch.equal(resumed_weights[k], ranks_weights[k]) for k in ranks_weights)
    return resumed


@pytest.mark.slow
def test_dp2_ranks_match_the_single_rank_worker_and_resume_across_layouts(tmp_path):
    single, reports, (single_checkpoint, checkpoint_weights) = single_rank_reference(tmp_path, checkpoint_at=2)
    overrides = [*SMALL, f"warm_start.cache_dir={tmp_path / 'warm'}", *RANK_OVERRIDES, "parallel.dp=2"]
    rendezvous = (tmp_path / "rendezvous").as_uri()
    payloads = rank_payloads(2, overrides, rendezvous, str(single_checkpoint), str(tmp_path / "ranks"), True)
    _, weights = single.export_weights()
    check_ranks_against_single_rank(payloads, reports, weights, dp=2)

    # dp=1 -> dp=2: the ranks load the single rank's step-2 checkpoint exactly and train step 2 like it
    assert all(torch.equal(payloads[0]["resumed_weights"][k], v) for k, v in checkpoint_weights.items())
    for out in payloads:
        assert mismatches(out["resumed_step"][0], reports[2]) == []
    # dp=2 -> dp=1: the single rank loads the ranks' step-3 checkpoint exactly and continues like the
    # uninterrupted single rank
    resumed = check_checkpoint_loads_on_one_rank(tmp_path, payloads)
    assert mismatches(run_step(resumed, 3)[0], run_step(single, 3)[0]) == []
    assert weight_mismatches(resumed.export_weights()[1], single.export_weights()[1]) == []


@pytest.mark.slow
@pytest.mark.parametrize("dp, cp", [(1, 2), (2, 2)])
def test_cp_and_dp_cp_ranks_match_the_single_rank_worker(tmp_path, dp, cp):
    single, reports, _ = single_rank_reference(tmp_path)
    overrides = [
        *SMALL,
        f"warm_start.cache_dir={tmp_path / 'warm'}",
        *RANK_OVERRIDES,
        f"parallel.dp={dp}",
        f"parallel.cp={cp}",
    ]
    payloads = rank_payloads(dp * cp, overrides, None, None, str(tmp_path / "ranks"))
    check_ranks_against_single_rank(payloads, reports, single.export_weights()[1], dp=dp)
    check_checkpoint_loads_on_one_rank(tmp_path, payloads)


@pytest.mark.slow
def test_workers_do_not_import_the_controller():
    """Workers share only asyncrl.errors with the controller, so a rank or an actor never loads it."""
    pytest.importorskip("ray")
    code = "import sys, asyncrl.trainer.group, asyncrl.runtime.ray; print('asyncrl.control.controller' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "False"
