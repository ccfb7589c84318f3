"""dp × cp trainer ranks on local gloo processes: parity with the single-process step (docs/loss.md),
every planted mistake failing, the real trainer over two steps, the collectives' gradients, and the
``parallel`` config section.

One launch per (dp, cp, micro-batches) layout checks every mode, dtype and plant it needs: starting
a rank costs seconds of imports.
"""

import copy
import io

import pytest
import torch
import torch.distributed as dist

from asyncrl.algorithms.grpo import GRPO, GRPOOptions
from asyncrl.cli import main
from asyncrl.config import ConfigError, ParallelConfig, load_config
from asyncrl.tools.verify import (
    LORA_PLANTS,
    PACKING_PLANTS,
    PLANTS,
    UPDATE_PLANTS,
    Case,
    build_problem,
    random_batch,
    rank_micro_batches,
    verify_parallel,
)
from asyncrl.trainer import PolicyTrainer
from asyncrl.trainer.context_parallel import gather_sequence, head_tail_columns
from asyncrl.trainer.normalization import AGG_MODES
from asyncrl.trainer.parallel import init_parallel, launch

FLOAT64 = 1e-9


def assert_float64_parity(results):
    for r in results:
        assert r.passed, r
        assert r.loss_error <= FLOAT64 and r.worst_grad[1] <= FLOAT64 and r.worst_error[0] <= FLOAT64, r


@pytest.mark.slow
def test_cp2_matches_in_every_mode_in_float64_float32_and_under_ddp():
    cases = (
        [Case(mode) for mode in AGG_MODES]
        + [Case(mode, dtype="float32") for mode in AGG_MODES]
        + [Case(mode, wrap="ddp") for mode in AGG_MODES]
    )
    results = verify_parallel(cases, dp=1, cp=2, micro_batches=1)
    assert [r.case for r in results] == cases
    assert_float64_parity([r for r in results if r.case.dtype == "float64"])
    for r in results:
        assert r.passed and r.loss_error <= 1e-5, r  # float32: docs/loss.md's tolerances, checked inside ``passed``


@pytest.mark.slow
def test_dp2_cp2_matches_in_every_mode_and_every_planted_mistake_fails():
    # the cp-shard-mean plant is in test_verify.py, the LoRA plants in test_lora_verify.py, packing's in test_packing.py
    plants = [p for p in PLANTS if p not in (*UPDATE_PLANTS, *LORA_PLANTS, *PACKING_PLANTS, "cp-shard-mean")]
    cases = [Case(mode) for mode in AGG_MODES] + [Case(mode, plant=plant) for plant in plants for mode in AGG_MODES]
    results = verify_parallel(cases, dp=2, cp=2, micro_batches=2)
    assert_float64_parity([r for r in results if r.case.plant is None])
    planted = [r for r in results if r.case.plant is not None]
    assert {r.case.plant for r in planted} == set(plants)
    for r in planted:
        assert not r.passed, (r.case, r.worst_error)
        assert r.worst_error[0] > 1e-3, (r.case, r.worst_error)


@pytest.mark.slow
def test_dp2_cp2_two_updates_match_in_every_mode_and_their_planted_mistakes_fail():
    cases = [Case(mode) for mode in AGG_MODES] + [
        Case(mode, plant=plant) for plant in UPDATE_PLANTS for mode in AGG_MODES
    ]
    results = verify_parallel(cases, dp=2, cp=2, micro_batches=2, updates=2)
    assert_float64_parity([r for r in results if r.case.plant is None])
    for r in results:
        if r.case.plant is not None:
            assert not r.passed and r.worst_error[0] > 1e-3, (r.case, r.worst_error)


@pytest.mark.slow
def test_cp4_with_two_micro_batches_matches_in_every_mode():
    assert_float64_parity(verify_parallel([Case(mode) for mode in AGG_MODES], dp=1, cp=4, micro_batches=2))


# ---- the real trainer, two optimizer steps ------------------------------------------------------

LAYOUTS = {"dp2": ParallelConfig(dp=2), "cp2": ParallelConfig(cp=2)}
STEPS = 2


def two_step_trainer(parallel=None):
    model, _, algorithm, trainer_cfg = build_problem("seq-mean-token-mean", torch.float64, 0)
    trainer = PolicyTrainer(
        model,
        trainer_cfg,
        algorithm,
        total_steps=10,
        reference_model=copy.deepcopy(model),
        parallel=parallel,
    )
    batches = [random_batch(model, num_groups=4, group_size=4, vocab_size=48, seed=step) for step in range(STEPS)]
    return trainer, batches


def train_on_ranks(parallel) -> dict:
    """The split-step API, unchanged, on every rank: each DP rank trains its share in two micro-batches."""
    trainer, batches = two_step_trainer(parallel)
    results = []
    for step, batch in enumerate(batches):
        micro = rank_micro_batches(batch, dp=parallel.dp, dp_rank=parallel.dp_rank, micro_batches=2, seed=step)
        trainer.begin_train_step()
        for part in micro:
            trainer.train_microbatch(part)
        results.append(trainer.finish_train_step())
    return {
        "results": results,
        "logprobs": trainer.compute_logprobs(batches[0], micro_batch_size=5),
        "ref_logprobs": trainer.compute_logprobs(batches[0], reference=True),
        "weights": trainer.export_weights(),
    }


def collective_gradients(cp) -> dict:
    """Gradients through gather_sequence and sequence_sum on this rank's columns of fixed rows."""
    gen = torch.Generator().manual_seed(7)
    rows, mask = torch.randn(3, 8, generator=gen, dtype=torch.float64), (torch.rand(3, 8, generator=gen) > 0.3).double()
    weights = torch.randn(cp.size, 3, 8, generator=gen, dtype=torch.float64)
    columns = head_tail_columns(8, cp.size, cp.rank)
    local = rows[:, columns].clone().requires_grad_()
    (gather_sequence(local, cp.group, dim=1) * weights[cp.rank]).sum().backward()
    gather_grad, local.grad = local.grad, None
    sequence_level_is_loss(cp.sequence_sum, local, mask[:, columns]).backward()
    return {"columns": columns, "gather": gather_grad, "sequence": local.grad}


def sequence_level_is_loss(sequence_sum, logratio, mask):
    """A per-sequence importance weight (geometric mean of token ratios), masked outside [0.8, 1.25]."""
    weight = torch.exp(sequence_sum(logratio * mask) / sequence_sum(mask))
    keep = ((weight > 0.8) & (weight < 1.25)).double()
    return (keep * weight * logratio * mask).sum()


def ranks_two_steps(rank: int, world_size: int) -> bytes:
    out = {name: train_on_ranks(init_parallel(cfg)) for name, cfg in LAYOUTS.items()}
    out["collectives"] = collective_gradients(init_parallel(ParallelConfig(cp=2)).context)
    buffer = io.BytesIO()
    torch.save(out, buffer)
    return buffer.getvalue()


def relative(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.slow
def test_real_trainer_on_dp2_and_cp2_ranks_matches_the_single_process_trainer_for_two_steps():
    payloads = [torch.load(io.BytesIO(p), weights_only=False) for p in launch(ranks_two_steps, 2)]
    single, batches = two_step_trainer()
    expected = [single.train_step(batch) for batch in batches]
    expected_lp = single.compute_logprobs(batches[0])
    expected_ref = single.compute_logprobs(batches[0], reference=True)
    _, expected_weights = single.export_weights()
    for name in LAYOUTS:
        for rank, rank_out in enumerate(payloads):
            got = rank_out[name]
            for result, want in zip(got["results"], expected):
                assert (result.version, result.num_tokens, result.num_sequences) == (
                    want.version,
                    want.num_tokens,
                    want.num_sequences,
                )
                assert abs(result.loss - want.loss) <= FLOAT64 * abs(want.loss), name
                assert abs(result.grad_norm - want.grad_norm) <= FLOAT64 * want.grad_norm, name
                assert result.metrics.keys() == want.metrics.keys()
                for key, value in want.metrics.items():
                    assert abs(result.metrics[key] - value) <= FLOAT64 * max(abs(value), 1e-12), (name, key)
            assert (
                relative(got["logprobs"], expected_lp) <= FLOAT64
                and relative(got["ref_logprobs"], expected_ref) <= FLOAT64
            )
            version, weights = got["weights"]
            assert version == STEPS and weights.keys() == (expected_weights.keys() if rank == 0 else set())
            for key, value in weights.items():
                assert relative(value, expected_weights[key]) <= FLOAT64, (name, key)

    # the collectives' backward: all-reduce then slice, and a per-sequence sum whose gradient is summed too
    gen = torch.Generator().manual_seed(7)
    rows, mask = torch.randn(3, 8, generator=gen, dtype=torch.float64), (torch.rand(3, 8, generator=gen) > 0.3).double()
    weights = torch.randn(2, 3, 8, generator=gen, dtype=torch.float64)
    order = torch.cat([p["collectives"]["columns"] for p in payloads])
    full = rows.clone().requires_grad_()
    sequence_level_is_loss(lambda x: x.sum(-1, keepdim=True).expand_as(x), full, mask).backward()
    for rank_out in payloads:
        got = rank_out["collectives"]
        gathered_grad = weights.sum(0)[:, torch.argsort(order)]  # both ranks' losses use every column
        assert torch.allclose(got["gather"], gathered_grad[:, got["columns"]], rtol=1e-12, atol=0)
        assert torch.allclose(got["sequence"], full.grad[:, got["columns"]], rtol=1e-12, atol=1e-15)


# ---- the launcher -------------------------------------------------------------------------------


def fail_on_rank_one(rank: int, world_size: int) -> bytes:
    if rank == 1:
        raise ValueError("planted failure")
    dist.barrier()  # rank 1 never arrives
    return b""


@pytest.mark.slow
def test_a_failing_rank_is_reported_with_its_traceback_and_the_others_are_stopped():
    with pytest.raises(RuntimeError, match=r"rank 1 failed:(.|\n)*ValueError: planted failure"):
        launch(fail_on_rank_one, 2, timeout_s=120)


# ---- command line and config --------------------------------------------------------------------


@pytest.mark.slow
def test_cli_verify_on_ranks_passes_and_a_planted_mistake_exits_nonzero(capsys):
    assert main(["verify", "--cp", "2", "--micro-batches", "2", "--mode", "token-mean"]) == 0
    out = capsys.readouterr().out
    assert "dp 1 x cp 2 ranks" in out and out.strip().endswith("PASS")
    assert (
        main(["verify", "--dp", "2", "--cp", "2", "--mode", "seq-mean-token-sum", "--plant", "double-count-tokens"])
        == 1
    )
    out = capsys.readouterr().out
    assert "planted: double-count-tokens" in out and out.strip().endswith("FAIL")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dp", "4", "--cp", "2"], "--dp: dp*cp = 8 local ranks; at most 4"),
        (["--plant", "shift-after-shard"], "--plant: shift-after-shard is a context-parallel mistake"),
        (["--dp", "2", "--plant", "double-count-tokens"], "--plant: double-count-tokens is a context-parallel mistake"),
        (["--plant", "per-shard-mean"], "--plant: per-shard-mean is a multi-rank mistake"),
        (["--dp", "2", "--micro-batches", "9"], "--micro-batches: 2 ranks x 9"),
    ],
)
def test_cli_rejects_layouts_it_cannot_check_in_one_line(capsys, argv, message):
    assert main(["verify", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"error: Invalid value for {message}"), err


def test_parallel_config_defaults_to_one_rank_and_checks_its_neighbours():
    config = load_config()
    assert (config.parallel.dp, config.parallel.cp, config.parallel.wrap, config.parallel.backend) == (
        1,
        1,
        "fsdp",
        "auto",
    )
    assert load_config(None, ["runtime.name=ray", "parallel.dp=2", "parallel.cp=2"]).parallel.world_size == 4
    for overrides, message in [
        (["parallel.dp=2"], "parallel.dp: dp*cp = 2 trainer ranks need runtime.name ray"),
        (["parallel.backend=nccl", "trainer.device=cpu"], "parallel.backend: nccl needs GPU trainer ranks"),
        (["parallel.backend=gloo", "trainer.device=cuda"], "parallel.backend: gloo runs CPU trainer ranks"),
        (
            ["runtime.name=ray", "step.prompts_per_step=2", "step.generations_per_prompt=4", "parallel.dp=9"],
            "parallel.dp: 9 data-parallel ranks but only 8 sequences per step",
        ),
        (["parallel.cp=0"], "parallel.cp:"),
        (["parallel.wrap=zero"], "parallel.wrap:"),
    ]:
        with pytest.raises(ConfigError) as info:
            load_config(None, overrides)
        assert str(info.value).startswith(message), str(info.value)


def test_init_parallel_rejects_a_mesh_that_does_not_match_the_started_ranks(tmp_path):
    dist.init_process_group("gloo", init_method=(tmp_path / "store").as_uri(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=r"parallel.dp: dp\*cp = 1\*2 = 2 ranks, but 1 were started"):
            init_parallel(ParallelConfig(cp=2))
        parallel = init_parallel(ParallelConfig())
        assert (parallel.dp, parallel.cp, parallel.world_size, parallel.context) == (1, 1, 1, None)
        assert parallel.gradient_compensation == 1.0
    finally:
        dist.destroy_process_group()


def _abort_after_updates_on_fsdp_ranks(rank: int, world_size: int) -> bytes:
    """Two FSDP ranks: steps of three updates, the faulty trainer aborting each once after two."""
    from helpers import updates_of

    model, batch, _, trainer_cfg = build_problem("token-mean", torch.float64, 0, updates=3)
    algorithm = GRPO(GRPOOptions(entropy_coef=0.01), "tis")
    parallel = init_parallel(ParallelConfig(dp=2))
    clean, faulty = (
        PolicyTrainer(copy.deepcopy(model), trainer_cfg, algorithm, total_steps=5, parallel=parallel) for _ in range(2)
    )
    share = batch.select([(4 * rank + row) % len(batch) for row in range(12)])
    for _ in range(2):
        updates_of(clean, share)
        updates_of(faulty, share, fail_after=2)
        updates_of(faulty, share)
    same = [torch.equal(a.to_local(), b.to_local()) for a, b in zip(clean.params, faulty.params)]
    moments = [
        torch.equal(
            clean.optimizer.state[a]["exp_avg_sq"].to_local(), faulty.optimizer.state[b]["exp_avg_sq"].to_local()
        )
        for a, b in zip(clean.params, faulty.params)
    ]
    buffer = io.BytesIO()
    torch.save((all(same), all(moments)), buffer)
    return buffer.getvalue()


@pytest.mark.slow
def test_aborting_after_updates_on_fsdp_ranks_restores_each_rank_s_shards_exactly():
    for payload in launch(_abort_after_updates_on_fsdp_ranks, 2):
        assert torch.load(io.BytesIO(payload)) == (True, True)
