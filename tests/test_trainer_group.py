"""Trainer ranks behind one handle: TrainerGroup's fan-out, build_trainer_rank, and dp × cp ranks
running the real step sequence against the single-rank TrainerWorker (DESIGN 5, float32)."""

import asyncio

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.models.factory import build_model, build_tokenizer
from asyncrl.data import build_task
from asyncrl.runtime.local import LocalHandle
from asyncrl.trainer.group import TrainerGroup, TrainerRankError, build_trainer_rank
from asyncrl.warm_start import warm_start

# ---- TrainerGroup ---------------------------------------------------------------------------


class RecordingRank:
    """Answers with its rank; remembers the calls it got; fails where told."""

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
    methods = ["begin_step", "train_groups", "finish_step", "abort_step", "export_weights", "save_checkpoint", "load_checkpoint"]
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
        with pytest.raises(TrainerRankError, match=r"^trainer rank 1: train_groups failed: ValueError: planted failure") as info:
            await group.train_groups(["g"])
        assert info.value.rank == 1 and isinstance(info.value.__cause__, ValueError)
        await group.abort_step()

    run(drive)
    assert [m for m, _ in ranks[0].calls] == [m for m, _ in ranks[1].calls] == ["begin_step", "train_groups", "abort_step"]


def test_group_needs_a_rank():
    with pytest.raises(ValueError, match="at least one trainer rank"):
        TrainerGroup([])


# ---- build_trainer_rank on one rank -----------------------------------------------------------

SMALL = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "trainer.device=cpu",
    "trainer.lr=0.01",
    "grpo.prompts_per_step=5",
    "grpo.generations_per_prompt=4",
    "warm_start.steps=3",
    "warm_start.batch_size=8",
]


def small_config(tmp_path, *overrides):
    return load_config(None, [*SMALL, f"warm_start.cache_dir={tmp_path / 'warm'}", *overrides])


def test_a_single_rank_is_the_driver_s_warm_started_policy(tmp_path):
    config = small_config(tmp_path)
    tokenizer = build_tokenizer(config)
    model = build_model(config, tokenizer)
    warm_start(model, tokenizer, build_task(config.data, tokenizer).train, config.warm_start, seed=config.seed)
    worker = build_trainer_rank(config, 0, None)
    version, weights = worker.export_weights()
    assert version == 0 and worker.rank == 0 and worker.trainer.parallel is None
    expected = model.state_dict()
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[k], expected[k]) for k in expected)
