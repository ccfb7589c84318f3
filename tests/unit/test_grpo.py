"""GRPO loss terms against values worked out by hand, and the loss normalization contract."""

import math

import pytest
import torch

from asyncrl.algorithms.grpo import (
    GRPOOptions,
    clipped_surrogate,
    group_advantages,
    importance_weights,
    kl_k3,
    sequence_ratio,
    token_loss,
    zero_variance_groups,
)
from asyncrl.trainer.normalization import AGG_MODES, local_token_weights, step_normalizer

SQRT3 = math.sqrt(3.0)


def f64(values):
    return torch.as_tensor(values, dtype=torch.float64)


def assert_close(actual, expected, tol=1e-12):
    torch.testing.assert_close(actual, f64(expected).to(actual.dtype), rtol=tol, atol=tol)


# ---- advantages ------------------------------------------------------------------------------


def test_mean_baseline_scaled_by_unbiased_std():
    # [1, 0, 0, 1]: mean 0.5, deviations +-0.5, unbiased var 4 * 0.25 / 3 = 1/3, std 1/sqrt(3)
    # -> A = +-0.5 * sqrt(3) = +-sqrt(3)/2
    rewards = f64([1.0, 0.0, 0.0, 1.0])
    assert_close(group_advantages(rewards, eps=0.0), [SQRT3 / 2, -SQRT3 / 2, -SQRT3 / 2, SQRT3 / 2])
    # eps enters the denominator: 0.5 / (1/sqrt(3) + 0.5) = sqrt(3) / (2 + sqrt(3)) = 2 sqrt(3) - 3
    a = 2 * SQRT3 - 3
    assert_close(group_advantages(rewards, eps=0.5), [a, -a, -a, a])


def test_leave_one_out_baseline():
    # [1, 0, 0, 1]: b for a 1 is (2 - 1)/3 = 1/3 -> r - b = 2/3; b for a 0 is 2/3 -> r - b = -2/3
    rewards = f64([1.0, 0.0, 0.0, 1.0])
    assert_close(
        group_advantages(rewards, baseline="leave_one_out", scale_by_std=False), [2 / 3, -2 / 3, -2 / 3, 2 / 3]
    )
    # divided by std 1/sqrt(3): 2 sqrt(3) / 3
    a = 2 * SQRT3 / 3
    assert_close(group_advantages(rewards, baseline="leave_one_out", eps=0.0), [a, -a, -a, a])


def test_no_std_scaling_is_plain_difference_to_the_mean():
    # Dr. GRPO: [3, 1, 2, 2] - mean 2
    assert_close(group_advantages(f64([3.0, 1.0, 2.0, 2.0]), scale_by_std=False), [1.0, -1.0, 0.0, 0.0])


def test_batch_of_groups_is_normalized_per_row():
    # row 0: as above, +-sqrt(3)/2
    # row 1: all 0.1, zero variance -> 0
    # row 2: [4, 0, 2, 2]: mean 2, deviations [2, -2, 0, 0], var 8/3, A = 2 / sqrt(8/3) = sqrt(3/2)
    rewards = f64([[1.0, 0.0, 0.0, 1.0], [0.1, 0.1, 0.1, 0.1], [4.0, 0.0, 2.0, 2.0]])
    h, s = SQRT3 / 2, math.sqrt(1.5)
    expected = [[h, -h, -h, h], [0.0, 0.0, 0.0, 0.0], [s, -s, 0.0, 0.0]]
    assert_close(group_advantages(rewards, eps=0.0), expected)
    assert zero_variance_groups(rewards).tolist() == [False, True, False]


@pytest.mark.parametrize("baseline", ["mean", "leave_one_out"])
@pytest.mark.parametrize("scale_by_std", [True, False])
def test_zero_variance_groups_get_exactly_zero(baseline, scale_by_std):
    # 0.1 is not representable: the mean of three 0.1s is off by one ulp, which /(0 + eps) would blow up
    rewards = f64([[0.1, 0.1, 0.1], [1.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    advantages = group_advantages(rewards, baseline=baseline, scale_by_std=scale_by_std)
    assert advantages[:2].eq(0).all()
    assert advantages[2].ne(0).all()


def test_group_of_one_and_its_leave_one_out_error():
    assert group_advantages(f64([[5.0], [2.0]])).eq(0).all()
    with pytest.raises(ValueError, match="baseline"):
        group_advantages(f64([[5.0], [2.0]]), baseline="leave_one_out")
    with pytest.raises(ValueError, match="baseline"):
        group_advantages(f64([1.0, 0.0]), baseline="median")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_advantages_keep_dtype_and_shape(dtype):
    for shape in [(4,), (3, 4)]:
        out = group_advantages(torch.rand(shape, dtype=dtype))
        assert out.dtype == dtype and out.shape == shape


# ---- clipped surrogate -----------------------------------------------------------------------

# clip range [0.8, 1.28]. Per token (A, r) and the loss max(-A r, -A clamp(r)):
#   A= 2, r=0.9: inside            -> -1.8                      not clipped
#   A= 2, r=1.5: above             -> max(-3.0, -2.56) = -2.56  clipped
#   A= 2, r=0.5: below             -> max(-1.0, -1.6)  = -1.0   not clipped (grad pushes r up)
#   A=-1, r=1.5: above             -> max( 1.5,  1.28) =  1.5   not clipped (dual cap 3 inactive)
#   A=-1, r=0.5: below             -> max( 0.5,  0.8)  =  0.8   clipped
#   A=-1, r=4.0: above, dual clip  -> min(max(4.0, 1.28), 3) = 3.0  dual-clipped (4.0 without)
ADVANTAGES = [2.0, 2.0, 2.0, -1.0, -1.0, -1.0]
RATIOS = [0.9, 1.5, 0.5, 1.5, 0.5, 4.0]


def surrogate(dual_clip, logprobs=None):
    logprobs = f64(RATIOS).log() if logprobs is None else logprobs
    return clipped_surrogate(
        logprobs,
        torch.zeros(6, dtype=torch.float64),
        f64(ADVANTAGES),
        clip_low=0.2,
        clip_high=0.28,
        dual_clip=dual_clip,
    )


def test_clipped_surrogate_values_and_clip_indicator():
    loss, clipped = surrogate(dual_clip=3.0)
    assert_close(loss, [-1.8, -2.56, -1.0, 1.5, 0.8, 3.0])
    assert clipped.tolist() == [0.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    assert clipped.dtype == torch.float64


def test_without_dual_clip_negative_advantage_is_unbounded():
    loss, clipped = surrogate(dual_clip=None)
    assert_close(loss, [-1.8, -2.56, -1.0, 1.5, 0.8, 4.0])
    assert clipped.tolist() == [0.0, 1.0, 0.0, 0.0, 1.0, 0.0]


def test_dual_clip_must_exceed_one():
    with pytest.raises(ValueError, match="dual_clip"):
        surrogate(dual_clip=1.0)


def test_gradient_is_zero_exactly_where_clipped():
    # unclipped d(-A r)/d lp = -A r: [-1.8, ., -1.0, 1.5, ., .]; clipped tokens get 0
    logprobs = f64(RATIOS).log().requires_grad_()
    loss, clipped = surrogate(dual_clip=3.0, logprobs=logprobs)
    loss.sum().backward()
    assert_close(logprobs.grad, [-1.8, 0.0, -1.0, 1.5, 0.0, 0.0])
    assert logprobs.grad[clipped == 1].eq(0).all()


def test_advantage_column_broadcasts_over_tokens():
    # A = [[2], [-1]] against ratios 1.5 on every token: row 0 clipped at 1.28, row 1 unclipped
    logprobs = torch.full((2, 3), math.log(1.5), dtype=torch.float64)
    loss, clipped = clipped_surrogate(
        logprobs, torch.zeros(2, 3, dtype=torch.float64), f64([[2.0], [-1.0]]), clip_low=0.2, clip_high=0.28
    )
    assert_close(loss, [[-2.56] * 3, [1.5] * 3])
    assert clipped.tolist() == [[1.0] * 3, [0.0] * 3]


# ---- importance weights ----------------------------------------------------------------------

# lp_gen = 0 and lp_old = log w, so the raw weights are w = [0.25, 1, 1.5, 3]
RAW_WEIGHTS = [0.25, 1.0, 1.5, 3.0]


def weights(mode, **kwargs):
    old = f64(RAW_WEIGHTS).log().requires_grad_()
    behaviour = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    return importance_weights(old, behaviour, mode=mode, **kwargs)


def test_importance_weight_modes():
    assert weights("none").tolist() == [1.0, 1.0, 1.0, 1.0]
    assert_close(weights("tis", cap=2.0), [0.25, 1.0, 1.5, 2.0])
    assert_close(weights("icepop", low=0.5, high=2.0), [0.0, 1.0, 1.5, 0.0])
    # both icepop bounds are inclusive (w = exp(0) = 1 is exact)
    assert weights("icepop", low=1.0, high=2.0)[1] == 1.0
    assert weights("icepop", low=0.5, high=1.0)[1] == 1.0


@pytest.mark.parametrize("mode", ["none", "tis", "icepop"])
def test_importance_weights_carry_no_gradient(mode):
    w = weights(mode)
    assert not w.requires_grad and w.grad_fn is None


def test_importance_weight_parameters_are_validated():
    with pytest.raises(ValueError, match="cap"):
        weights("tis", cap=0.0)
    with pytest.raises(ValueError, match="low"):
        weights("icepop", low=-0.1)
    with pytest.raises(ValueError, match="high"):
        weights("icepop", low=2.0, high=1.0)
    with pytest.raises(ValueError, match="mode"):
        weights("clip")


# ---- KL --------------------------------------------------------------------------------------


def test_k3_values_and_gradient():
    # d = lp_ref - lp:  0 -> 0;  1 -> e - 2;  -1 -> 1/e;  2 -> e^2 - 3
    logprobs = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    kl = kl_k3(logprobs, f64([0.0, 1.0, -1.0, 2.0]))
    assert_close(kl, [0.0, math.e - 2, 1 / math.e, math.e**2 - 3])
    # d k3 / d lp = -(e^d - 1)
    kl.sum().backward()
    assert_close(logprobs.grad, [0.0, 1 - math.e, 1 - 1 / math.e, 1 - math.e**2])


def test_k3_clamps():
    zeros = torch.zeros(3, dtype=torch.float64)
    # log-ratio clamp 20: d = 25 -> 20: e^20 - 21;  d = -30 -> -20: e^-20 + 19
    kl = kl_k3(zeros, f64([25.0, -30.0, 1.0]), kl_clamp=1e12)
    assert_close(kl, [485165195.4097903 - 21, 19.000000002061153, math.e - 2])
    # value clamp 10: d = 3 gives e^3 - 4 = 16.09 -> 10;  d = 2 gives 4.389 (kept)
    assert_close(kl_k3(zeros, f64([3.0, 2.0, 25.0])), [10.0, math.e**2 - 3, 10.0])


def test_mismatch_kl_estimates_kl_of_generator_from_trainer():
    """Tokens sampled from a known generator distribution: the mean of mismatch_kl is the exact
    KL(gen || train); the other orientation of the log-ratio (the planted twin) is far from it."""
    gen = torch.softmax(f64([1.5, 0.5, 0.0, -0.5, -1.0, -2.0]), dim=0)
    train = torch.softmax(f64([0.5, 1.0, 0.0, 0.0, -1.5, -1.0]), dim=0)
    exact = float((gen * (gen.log() - train.log())).sum())
    tokens = torch.multinomial(gen, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    lp_gen, lp_train = gen.log()[tokens][None], train.log()[tokens][None]
    _, metrics = token_loss(lp_train, lp_train, lp_gen, f64([[1.0]]), cfg=GRPOOptions(), is_mode="tis")
    assert float(metrics["mismatch_kl"].mean()) == pytest.approx(exact, rel=0.03)
    twin = float(kl_k3(lp_train, lp_gen).mean())
    assert twin != pytest.approx(exact, rel=0.03)


# ---- token_loss ------------------------------------------------------------------------------


def test_token_loss_composition_and_metrics():
    # one token: r = 0.9, A = 2 -> surrogate -1.8 (inside the clip range)
    # w_is = exp(lp_old - lp_gen) = 1.5 (below the tis cap 2)
    # d = lp_ref - lp = 1 -> k3 = e - 2;  entropy 2
    # l = 1.5 * -1.8 + 0.1 * (e - 2) - 0.01 * 2
    # mismatch_kl = exp(lp_old - lp_gen) - 1 - (lp_old - lp_gen) = 1.5 - 1 - log 1.5
    logprobs = f64([[math.log(0.9)]]).requires_grad_()
    old = f64([[0.0]])
    behaviour = f64([[-math.log(1.5)]])
    ref = logprobs.detach() + 1
    entropy = f64([[2.0]]).requires_grad_()
    cfg = GRPOOptions(kl_coef=0.1, entropy_coef=0.01)
    loss, metrics = token_loss(
        logprobs, old, behaviour, f64([[2.0]]), cfg=cfg, is_mode="tis", ref_logprobs=ref, entropy=entropy
    )
    assert_close(loss, [[-2.7 + 0.1 * (math.e - 2) - 0.02]])
    assert_close(metrics["clip"], [[0.0]])
    assert_close(metrics["is_weight"], [[1.5]])
    assert_close(metrics["ratio"], [[0.9]])
    assert_close(metrics["kl"], [[math.e - 2]])
    assert "entropy" not in metrics  # the trainer's to report
    assert_close(metrics["mismatch_kl"], [[0.5 - math.log(1.5)]])
    assert all(m.grad_fn is None for m in metrics.values())
    # d l / d lp = w_is * (-A r) + kl_coef * (1 - e^d) = 1.5 * -1.8 + 0.1 * (1 - e)
    loss.sum().backward()
    assert_close(logprobs.grad, [[-2.7 + 0.1 * (1 - math.e)]])
    assert_close(entropy.grad, [[-0.01]])


def test_token_loss_optional_terms():
    lp = f64([[-1.0, -2.0]])
    advantages = f64([[1.0]])
    bare, metrics = token_loss(lp, lp, lp, advantages, cfg=GRPOOptions(), is_mode="tis")
    # r = 1, w = 1: l = -A
    assert_close(bare, [[-1.0, -1.0]])
    assert set(metrics) == {"clip", "is_weight", "ratio", "mismatch_kl"}
    # ref and entropy given with zero coefficients: not added to the loss; the KL is reported
    loss, metrics = token_loss(
        lp, lp, lp, advantages, cfg=GRPOOptions(), is_mode="tis", ref_logprobs=lp + 1, entropy=lp.exp()
    )
    assert torch.equal(loss, bare)
    assert set(metrics) == {"clip", "is_weight", "ratio", "mismatch_kl", "kl"}


def test_token_loss_requires_inputs_for_its_terms():
    lp = f64([[-1.0]])
    with pytest.raises(ValueError, match="ref_logprobs"):
        token_loss(lp, lp, lp, lp, cfg=GRPOOptions(kl_coef=0.1), is_mode="tis")
    with pytest.raises(ValueError, match="entropy"):
        token_loss(lp, lp, lp, lp, cfg=GRPOOptions(entropy_coef=0.1), is_mode="tis")


def test_sequence_ratio_is_the_geometric_mean_of_response_token_ratios_clipped_per_sequence():
    # row 0: token ratios 1.1 and 1.2 (the third token is outside the response) -> s = sqrt(1.32),
    # inside [0.8, 1.28]: l = -A s on both tokens, d/d lp_0t of their sum = -A s * 2 * (1/2) = -s.
    # row 1: every ratio 1.5 -> s = 1.5 > 1.28, A > 0: clipped, l = -1.28, no gradient.
    mask = f64([[1, 1, 0], [1, 1, 1]])
    logprobs = f64([[math.log(1.1), math.log(1.2), 5.0], [math.log(1.5)] * 3]).requires_grad_()
    old = torch.zeros_like(logprobs)
    s0 = math.sqrt(1.32)
    assert_close(sequence_ratio(logprobs, old, mask), [[s0] * 3, [1.5] * 3])
    cfg = GRPOOptions(dual_clip=None, ratio_level="sequence")
    loss, metrics = token_loss(logprobs, old, old, f64([[1.0], [1.0]]), cfg=cfg, is_mode="none", response_mask=mask)
    assert_close(loss * mask, [[-s0, -s0, 0.0], [-1.28] * 3])
    assert_close(metrics["clip"], [[0.0] * 3, [1.0] * 3])
    assert_close(metrics["ratio"], [[s0] * 3, [1.5] * 3])
    (loss * mask).sum().backward()
    assert_close(logprobs.grad, [[-s0, -s0, 0.0], [0.0] * 3])
    with pytest.raises(ValueError, match="response_mask"):
        token_loss(logprobs, old, old, f64([[1.0], [1.0]]), cfg=cfg, is_mode="none")


def test_sequence_ratio_sums_rows_with_the_given_sequence_sum():
    # two halves of one row, each summed "across shards" by a sum that also adds the other half
    lp, mask = f64([[0.2, 0.4]]), f64([[1.0, 1.0]])
    other = {"lr": f64([0.6]), "mask": f64([2.0])}  # the other shard: log ratios 0.2 and 0.4, 2 tokens

    def shard_sum(values):
        total = values.sum(-1, keepdim=True) + (other["mask"] if values is mask else other["lr"])
        return total.expand_as(values)

    assert_close(sequence_ratio(lp, torch.zeros_like(lp), mask, shard_sum), [[math.exp(1.2 / 4)] * 2])


# ---- aggregation weights ---------------------------------------------------------------------

# row 0: n = 3;  row 1: n = 0 (padding);  row 2: n = 4 of which this shard holds 2;  row 3: n = 1
MASK = f64([[0, 1, 1, 1, 0], [0, 0, 0, 0, 0], [0, 0, 1, 1, 0], [1, 0, 0, 0, 0]])
LENGTHS = torch.tensor([3, 0, 4, 1])


def test_local_weights_for_every_mode():
    assert torch.equal(local_token_weights(MASK, LENGTHS, "token-mean"), MASK)
    assert torch.equal(local_token_weights(MASK, LENGTHS, "seq-mean-token-sum"), MASK)
    t = 1 / 3
    expected = [[0, t, t, t, 0], [0, 0, 0, 0, 0], [0, 0, 0.25, 0.25, 0], [1, 0, 0, 0, 0]]
    assert_close(local_token_weights(MASK, LENGTHS, "seq-mean-token-mean"), expected)
    assert_close(local_token_weights(MASK, LENGTHS, "seq-mean-token-sum-norm", norm_constant=4.0), MASK / 4)


def test_local_weights_keep_mask_dtype():
    for mode in AGG_MODES:
        out = local_token_weights(MASK.float(), LENGTHS, mode, norm_constant=2.0)
        assert out.dtype == torch.float32 and out.shape == MASK.shape


def test_local_weights_errors():
    for bad in (None, 0.0, -1.0):
        with pytest.raises(ValueError, match="norm_constant"):
            local_token_weights(MASK, LENGTHS, "seq-mean-token-sum-norm", norm_constant=bad)
    with pytest.raises(ValueError, match="mode"):
        local_token_weights(MASK, LENGTHS, "sum")


def test_step_normalizer():
    assert step_normalizer("token-mean", 7, 3) == 7.0
    for mode in AGG_MODES[1:]:
        assert step_normalizer(mode, 7, 3) == 3.0
    with pytest.raises(ValueError, match="empty step"):
        step_normalizer("token-mean", 0, 3)
    with pytest.raises(ValueError, match="empty step"):
        step_normalizer("seq-mean-token-mean", 7, 0)
    with pytest.raises(ValueError, match="mode"):
        step_normalizer("mean", 7, 3)


# ---- the normalization contract: any split of the step gives the same loss -------------------

NORM_CONSTANT = 16.0


def ragged_step(seed=0, rows=7, width=12):
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, 4, (rows,), generator=gen)
    lengths = torch.randint(1, width - 3, (rows,), generator=gen)
    lengths[3] = 0  # a padding row
    positions = torch.arange(width)
    mask = ((positions >= prompt[:, None]) & (positions < (prompt + lengths)[:, None])).double()
    loss = torch.randn(rows, width, generator=gen, dtype=torch.float64)
    return mask, lengths, loss


def reference_loss(mode, mask, lengths, loss):
    """Each mode from its name, on whole sequences."""
    rows = [loss[i][mask[i] > 0] for i in range(len(lengths)) if lengths[i] > 0]
    if mode == "token-mean":
        return torch.cat(rows).mean()
    if mode == "seq-mean-token-mean":
        return torch.stack([r.mean() for r in rows]).mean()
    if mode == "seq-mean-token-sum":
        return torch.stack([r.sum() for r in rows]).mean()
    return torch.stack([r.sum() for r in rows]).mean() / NORM_CONSTANT


def pieces(mask, lengths, loss, row_parts, column_shards):
    """Row slices (micro-batches), each cut into column shards that keep the full n_i."""
    cuts = torch.linspace(0, mask.shape[1], column_shards + 1).long().tolist()
    for rows in row_parts:
        for start, stop in zip(cuts, cuts[1:]):
            yield mask[rows, start:stop], lengths[rows], loss[rows, start:stop], start == 0


PARTITIONS = [
    [[0, 1, 2, 3, 4, 5, 6]],
    [[0], [1], [2], [3], [4], [5], [6]],
    [[5, 1], [3], [6, 0, 4, 2]],
]


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("column_shards", [1, 3])
@pytest.mark.parametrize("row_parts", PARTITIONS)
def test_split_step_equals_whole_step(mode, row_parts, column_shards):
    mask, lengths, loss = ragged_step()
    expected = reference_loss(mode, mask, lengths, loss)
    total, tokens, sequences = 0.0, 0.0, 0.0
    for m, n, terms, first_shard in pieces(mask, lengths, loss, [torch.tensor(r) for r in row_parts], column_shards):
        total = total + (local_token_weights(m, n, mode, NORM_CONSTANT) * terms).sum()
        tokens += float(m.sum())
        sequences += float((n > 0).sum()) if first_shard else 0.0  # a sequence counts once, not per shard
    got = total / step_normalizer(mode, tokens, sequences)
    assert abs(got - expected) <= 1e-12 * abs(expected)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_normalizing_each_piece_by_its_own_count_is_detected(mode):
    # the planted mistake: every micro-batch divides by its own count, the step averages them
    mask, lengths, loss = ragged_step()
    expected = reference_loss(mode, mask, lengths, loss)
    row_parts = [torch.tensor(r) for r in PARTITIONS[2]]
    own = [
        (local_token_weights(m, n, mode, NORM_CONSTANT) * terms).sum()
        / step_normalizer(mode, float(m.sum()), float((n > 0).sum()))
        for m, n, terms, _ in pieces(mask, lengths, loss, row_parts, column_shards=1)
        if m.sum() > 0
    ]
    got = torch.stack(own).mean()
    assert abs(got - expected) > 1e-3 * abs(expected)


def test_module_exports_the_four_modes_in_order():
    assert AGG_MODES == ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
