"""TrainerWorker: chunk-invariant micro-batching, step data, checkpoints of the trainer side."""

import copy

import pytest
import torch
from helpers import TOKENIZER, make_groups

from asyncrl.algorithms import grpo
from asyncrl.algorithms.grpo import GRPO, GRPOOptions
from asyncrl.checkpoint import load_state, resolve_checkpoint
from asyncrl.config import StepConfig, TrainerConfig
from asyncrl.models import build_tiny_model
from asyncrl.trainer import PolicyTrainer
from asyncrl.trainer.worker import TrainerWorker
from asyncrl.types import RolloutGroup, TrainBatch


def make_worker(micro_batch_size=5, kl_coef=0.0, **grpo) -> TrainerWorker:
    model = build_tiny_model(
        len(TOKENIZER), seed=0, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64
    )
    trainer = PolicyTrainer(
        model,
        TrainerConfig(lr=1e-2, micro_batch_size=micro_batch_size),
        GRPO(GRPOOptions(kl_coef=kl_coef), "tis"),
        total_steps=10,
        reference_model=copy.deepcopy(model) if kl_coef else None,
    )
    return TrainerWorker(trainer, StepConfig(generations_per_prompt=4, **grpo), TOKENIZER)


def run_step(worker: TrainerWorker, groups, chunks):
    worker.begin_step(worker.version)
    start = 0
    for size in chunks:
        worker.train_groups(groups[start : start + size])
        start += size
    return worker.finish_step()


def test_chunking_does_not_change_the_step():
    groups = make_groups(0)
    whole, chunked = make_worker(), make_worker()
    a = run_step(whole, groups, [5])
    b = run_step(chunked, groups, [1, 3, 1])
    assert a.result.loss == b.result.loss and a.result.grad_norm == b.result.grad_norm
    assert a.result.num_microbatches == b.result.num_microbatches == 4  # 20 sequences / 5
    for p, q in zip(whole.trainer.model.parameters(), chunked.trainer.model.parameters()):
        assert torch.equal(p, q)


def test_a_different_order_is_a_different_step():
    """The negative twin: micro-batch composition matters, so the invariance above is not vacuous."""
    groups = make_groups(0)
    a = run_step(make_worker(), groups, [5])
    b = run_step(make_worker(), groups[::-1], [5])
    assert a.result.loss == pytest.approx(b.result.loss, rel=1e-5) and a.result.loss != b.result.loss


def test_step_data_counts_what_was_trained():
    worker = make_worker()
    groups = make_groups(1, version=0)
    worker.begin_step(0)
    worker.train_groups(groups)
    worker.finish_step()
    stale = make_groups(2, count=2, version=0)  # trained at version 1: lag 1
    report = run_step(worker, make_groups(3, count=3, version=1) + stale, [5])
    data = report.data
    assert data.num_groups == 5 and data.num_samples == 20
    assert dict(data.lag_histogram) == {0: 3, 1: 2}
    expected = torch.cat([g.rewards for g in make_groups(3, count=3, version=1) + stale])
    assert data.reward_sum == pytest.approx(float(expected.sum()))
    assert data.num_correct == pytest.approx(float(expected.sum()))
    assert data.reward_errors == 1 + 1  # groups 1 of each batch


def test_zero_variance_groups_are_filtered_but_counted():
    groups = make_groups(4)
    flat = RolloutGroup(**{**groups[0].__dict__, "rewards": torch.ones(4), "informative": False})
    report = run_step(make_worker(filter_zero_variance=True), [flat] + groups[1:], [5])
    assert report.data.num_filtered_groups == 1 and report.data.num_groups == 5
    assert report.result.num_sequences == 16


def test_kl_penalty_gets_reference_logprobs():
    report = run_step(make_worker(kl_coef=0.1), make_groups(5), [2, 3])
    assert "kl" in report.result.metrics


def test_abort_drops_the_partial_step():
    groups = make_groups(6)
    worker, reference = make_worker(), make_worker()
    worker.begin_step(0)
    worker.train_groups(groups[:3])
    worker.abort_step()
    a = run_step(worker, groups, [5])
    b = run_step(reference, groups, [5])
    assert a.result.loss == b.result.loss and a.data.num_groups == 5


def test_checkpoint_round_trip_continues_bit_identically(tmp_path):
    worker = make_worker()
    run_step(worker, make_groups(7), [5])
    path = worker.save_checkpoint(str(tmp_path), 1, {"note": "run state"}, keep_last=2)
    assert resolve_checkpoint(tmp_path) == path and (path / "model.safetensors").is_file()
    state = load_state(path)
    assert state["run"] == {"note": "run state"} and "model" not in state["trainer"]

    resumed = make_worker()
    resumed.load_checkpoint(path, state["trainer"])
    next_groups = make_groups(8, version=1)
    a = run_step(worker, next_groups, [5])
    b = run_step(resumed, next_groups, [5])
    assert a.result.loss == b.result.loss
    for p, q in zip(worker.trainer.model.parameters(), resumed.trainer.model.parameters()):
        assert torch.equal(p, q)


def test_a_step_whose_groups_are_all_filtered_takes_no_update_and_does_not_raise():
    worker = make_worker(filter_zero_variance=True)
    flat = [
        RolloutGroup(**{**g.__dict__, "rewards": torch.full((4,), float(i % 2)), "informative": False})
        for i, g in enumerate(make_groups(4))
    ]
    before = copy.deepcopy(worker.trainer.model.state_dict())
    report = run_step(worker, flat, [2, 3])
    assert report.result.num_updates == 0 and report.result.num_tokens == 0 and not report.result.skipped
    assert report.data.num_filtered_groups == 5 and worker.version == 1
    for name, tensor in worker.trainer.model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    assert run_step(worker, make_groups(5, version=1), [5]).result.num_updates == 1


def record_updates(worker: TrainerWorker) -> list[list[int]]:
    """The micro-batches each update of the worker's next step trains, numbered as first seen:
    the first pass numbers them in order, so an update of a later pass names its mini-batch."""
    updates, seen = [[]], {}
    train, finish_update = worker.trainer.train_microbatch, worker.trainer.finish_update

    def recording_train(batch):
        updates[-1].append(seen.setdefault(id(batch), len(seen)))
        return train(batch)

    def recording_finish_update():
        updates.append([])
        return finish_update()

    worker.trainer.train_microbatch, worker.trainer.finish_update = recording_train, recording_finish_update
    return updates


def minibatch_order(updates: list[list[int]], num_minibatches: int) -> list[int]:
    """The mini-batch of each update, by its place in the first pass."""
    return [updates[:num_minibatches].index(update) for update in updates]


@pytest.mark.parametrize("num_minibatches, num_epochs", [(3, 1), (2, 2)])
def test_minibatch_updates_equal_whole_minibatch_updates_against_step_start_logprobs(num_minibatches, num_epochs):
    groups = make_groups(3, count=6)
    worker = make_worker(micro_batch_size=5, num_minibatches=num_minibatches, num_epochs=num_epochs)
    updates = record_updates(worker)
    report = run_step(worker, groups, [2, 4])
    reference = make_worker(micro_batch_size=100).trainer
    reference.begin_train_step(0)
    parts = [groups[i : i + 6 // num_minibatches] for i in range(0, 6, 6 // num_minibatches)]
    batches = []
    for part in parts:
        batch = TrainBatch.from_groups(part, [grpo.group_advantages(g.rewards) for g in part])
        batch.prox_logprobs = reference.compute_logprobs(batch)  # every one before the first update
        batches.append(batch)
    updates = [batches[k] for k in minibatch_order(updates, num_minibatches)]
    for index, batch in enumerate(updates):
        reference.train_microbatch(batch)
        if index < len(updates) - 1:
            reference.finish_update()
    expected = reference.finish_train_step()
    assert report.result.num_updates == expected.num_updates == num_minibatches * num_epochs
    assert report.result.loss == pytest.approx(expected.loss, rel=1e-5)
    assert report.result.metrics["clip_fraction"] == expected.metrics["clip_fraction"] > 0  # the clip acts
    for name, tensor in worker.trainer.model.state_dict().items():
        torch.testing.assert_close(tensor, reference.model.state_dict()[name], rtol=1e-4, atol=1e-5)


def test_every_pass_after_the_first_takes_the_minibatches_in_a_seeded_order():
    def orders(seed: int) -> list[list[int]]:
        worker = make_worker(micro_batch_size=4, num_minibatches=4, num_epochs=3)
        worker.seed = seed
        steps = []
        for step in range(4):
            updates = record_updates(worker)
            run_step(worker, make_groups(step, count=4, version=step), [4])
            steps.append(minibatch_order(updates, 4))
        return steps

    first = orders(0)
    for order in first:
        assert order[:4] == [0, 1, 2, 3]  # the first pass in arrival order
        assert sorted(order[4:8]) == sorted(order[8:]) == [0, 1, 2, 3]
    assert any(order[4:] != [0, 1, 2, 3] * 2 for order in first)  # not one order reused
    assert len({tuple(order[4:8]) for order in first} | {tuple(order[8:]) for order in first}) > 1
    assert orders(0) == first and orders(1) != first  # a function of the run seed and the step


def test_aborting_after_an_update_restores_the_step_start_exactly():
    groups = make_groups(4, count=6)
    worker, clean = make_worker(num_minibatches=3), make_worker(num_minibatches=3)
    worker.begin_step(0)
    worker.train_groups(groups)
    original = worker.trainer.finish_train_step
    worker.trainer.finish_train_step = lambda: (_ for _ in ()).throw(RuntimeError("injected after two updates"))
    with pytest.raises(RuntimeError, match="injected"):
        worker.finish_step()
    worker.trainer.finish_train_step = original
    worker.abort_step()
    a, b = run_step(worker, groups, [6]), run_step(clean, groups, [6])
    assert a.result.loss == b.result.loss
    for name, tensor in worker.trainer.model.state_dict().items():
        assert torch.equal(tensor, clean.trainer.model.state_dict()[name]), name
    assert worker.trainer.optimizer.state_dict()["state"][0]["step"] == 3


def test_truncated_responses_can_be_left_out_of_the_loss():
    groups = make_groups(6)
    cut = [RolloutGroup(**{**g.__dict__, "finish_reasons": ["length", "stop", "stop", "length"]}) for g in groups]
    kept = run_step(make_worker(), cut, [5]).result
    masked = run_step(make_worker(mask_truncated=True), cut, [5]).result
    lengths = [int(g.response_mask[i].sum()) for g in groups for i in (0, 3)]
    assert kept.num_sequences == 20 and masked.num_sequences == 10
    assert masked.num_tokens == kept.num_tokens - sum(lengths) and masked.loss != kept.loss
