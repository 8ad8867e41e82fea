"""Fast CPU tests of ppo_core/algo.py against hand-worked numbers and plain-Python references.

    python -m pytest -q tests/test_algo.py

float64 throughout unless a test is about float32, so tolerances are a few float64 ulps (1e-12 or tighter).
"""
import json
import math

import numpy as np
import pytest
import torch

from ppo_core.algo import (
    K3_CLAMP, LOG_RATIO_CLAMP, AdaptiveKLController, Aggregation, FixedKLController, aggregate, discounted_returns,
    explained_variance, gae, group_advantages, gspo_policy_loss, kl_estimate, masked_mean, masked_var, masked_whiten,
    normalize_scores, overlong_penalty, per_token_rewards, policy_loss, value_loss, varied_groups,
)

F64 = torch.float64
AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def t64(rows):
    return torch.tensor(rows, dtype=F64)


def close(actual, expected, tol=1e-12):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=F64), torch.as_tensor(expected, dtype=F64),
                               rtol=tol, atol=tol)


def ragged_mask(B, T, generator):
    """Random 0/1 mask [B, T]: ragged lengths, holes in the middle, row 1 fully masked."""
    mask = torch.zeros(B, T, dtype=F64)
    for b in range(B):
        length = int(torch.randint(1, T + 1, (1,), generator=generator))
        mask[b, :length] = 1.0
        holes = torch.rand(T, generator=generator) < 0.25
        mask[b, holes] = 0.0
    mask[1] = 0.0
    return mask


# ---------------------------------------------------------------- gae

def reference_gae(rewards, values, mask, gamma, lam):
    """Plain-Python GAE: per row, walk backwards over the real tokens only."""
    advantages, returns = [], []
    for r, v, m in zip(rewards.tolist(), values.tolist(), mask.tolist()):
        adv = [0.0] * len(r)
        next_value, next_adv = 0.0, 0.0
        for t in reversed([t for t in range(len(r)) if m[t] == 1.0]):
            delta = r[t] + gamma * next_value - v[t]
            adv[t] = delta + gamma * lam * next_adv
            next_value, next_adv = v[t], adv[t]
        advantages.append(adv)
        returns.append([adv[t] + v[t] if m[t] == 1.0 else 0.0 for t in range(len(r))])
    return t64(advantages), t64(returns)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.5, 1.0)])
def test_gae_matches_python_loop(gamma, lam):
    g = torch.Generator().manual_seed(0)
    B, T = 7, 11
    mask = ragged_mask(B, T, g)
    rewards, values = torch.randn(B, T, generator=g, dtype=F64), torch.randn(B, T, generator=g, dtype=F64)
    adv, ret = gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = reference_gae(rewards, values, mask, gamma, lam)
    close(adv, ref_adv)
    close(ret, ref_ret)
    assert torch.all(adv[mask == 0] == 0) and torch.all(ret[mask == 0] == 0)
    # float32 in, float32 out, equal to the float64 truth up to float32 rounding over T steps
    adv32, ret32 = gae(rewards.float(), values.float(), mask.float(), gamma, lam)
    assert adv32.dtype == torch.float32 and ret32.dtype == torch.float32
    close(adv32, ref_adv, tol=1e-5)
    close(ret32, ref_ret, tol=1e-5)


def test_gae_hole_is_transparent_hand_worked():
    # position 1 is a hole: its reward 100 and value 9 must be ignored.
    # t=2: delta = 1 + 0 - 0.25 = 0.75, A2 = 0.75
    # t=0: delta = 0 + 0.5 * 0.25 - 0.5 = -0.375, A0 = -0.375 + 0.25 * 0.75 = -0.1875
    rewards, values, mask = t64([[0.0, 100.0, 1.0, 7.0]]), t64([[0.5, 9.0, 0.25, 3.0]]), t64([[1, 0, 1, 0]])
    values.requires_grad_(True)
    adv, ret = gae(rewards, values, mask, gamma=0.5, lam=0.5)
    close(adv, [[-0.1875, 0.0, 0.75, 0.0]], tol=0)
    close(ret, [[0.3125, 0.0, 1.0, 0.0]], tol=0)
    assert not adv.requires_grad and not ret.requires_grad


# ---------------------------------------------------------------- kl

def test_kl_estimators_hand_worked():
    logp, ref = t64([-1.0, -2.0, -3.0]), t64([-2.0, -1.0, -3.0])
    # d = logp - ref = [1, -1, 0]
    close(kl_estimate(logp, ref, "k1"), [1.0, -1.0, 0.0], tol=0)
    close(kl_estimate(logp, ref, "k2"), [0.5, 0.5, 0.0], tol=0)
    # k3 = e^-d + d - 1: e^-1 + 0 = 0.36787944117144233; e^1 - 2 = 0.7182818284590451; 0
    close(kl_estimate(logp, ref, "k3"), [0.36787944117144233, 0.7182818284590451, 0.0], tol=1e-15)
    with pytest.raises(ValueError, match="k3"):
        kl_estimate(logp, ref, "k4")


def test_k3_clamps_hand_worked_with_zero_gradient_where_clamped():
    assert (LOG_RATIO_CLAMP, K3_CLAMP) == (20.0, 10.0)
    # gap d = ref - logp, k3 = e^d - d - 1, d k3 / d logp = 1 - e^d where neither clamp is active
    #   d = 2.5: e^2.5 - 3.5 = 8.682493960703473 (inside), grad 1 - e^2.5 = -11.182493960703473
    #   d = 3:   e^3 - 4 = 16.0855... -> 10 (k3 clamp), grad 0
    #   d = 25:  d -> 20 (log-ratio clamp), e^20 - 21 = 4.85e8 -> 10, grad 0
    #   d = -5:  e^-5 + 4 = 4.006737946999086 (inside), grad 1 - e^-5 = 0.9932620530009145
    #   d = -12: e^-12 + 11 = 11.000006... -> 10, grad 0
    #   d = -25: d -> -20, e^-20 + 19 -> 10, grad 0
    logp = torch.zeros(6, dtype=F64, requires_grad=True)
    ref = t64([2.5, 3.0, 25.0, -5.0, -12.0, -25.0])
    k3 = kl_estimate(logp, ref, "k3")
    close(k3, [8.682493960703473, 10.0, 10.0, 4.006737946999086, 10.0, 10.0], tol=1e-15)
    k3.sum().backward()
    close(logp.grad, [-11.182493960703473, 0.0, 0.0, 0.9932620530009145, 0.0, 0.0], tol=1e-15)
    assert torch.all(logp.grad[[1, 2, 4, 5]] == 0)


@pytest.mark.parametrize("dtype,gap", [(torch.float32, 100.0), (torch.float64, 1000.0)])
def test_k3_log_ratio_clamp_keeps_value_and_gradient_finite(dtype, gap):
    # without the log-ratio clamp exp(gap) is inf, and the k3 clamp's zero gradient times inf would be NaN
    assert torch.isinf(torch.exp(torch.tensor(gap, dtype=dtype)))
    logp = torch.zeros(2, dtype=dtype, requires_grad=True)
    k3 = kl_estimate(logp, torch.tensor([gap, -gap], dtype=dtype), "k3")
    assert k3.tolist() == [10.0, 10.0]
    k3.sum().backward()
    assert logp.grad.tolist() == [0.0, 0.0]


# ---------------------------------------------------------------- masked statistics

def test_masked_stats_match_python():
    g = torch.Generator().manual_seed(1)
    mask = ragged_mask(5, 9, g)
    x = torch.randn(5, 9, generator=g, dtype=F64) * 3 + 2
    real = [xi for xi, mi in zip(x.flatten().tolist(), mask.flatten().tolist()) if mi == 1.0]
    n = len(real)
    mean = sum(real) / n
    var = sum((xi - mean) ** 2 for xi in real) / (n - 1)
    close(masked_mean(x, mask), mean)
    close(masked_var(x, mask), var)
    close(masked_var(x, mask, unbiased=False), var * (n - 1) / n)
    expected = [[(xi - mean) / math.sqrt(var + 1e-8) if mi == 1.0 else 0.0 for xi, mi in zip(xr, mr)]
                for xr, mr in zip(x.tolist(), mask.tolist())]
    close(masked_whiten(x, mask), expected)
    expected_shifted = [[e + mean if mi == 1.0 else 0.0 for e, mi in zip(er, mr)]
                        for er, mr in zip(expected, mask.tolist())]
    close(masked_whiten(x, mask, shift_mean=False), expected_shifted)
    row_means = [sum(xi for xi, mi in zip(xr, mr) if mi) / max(sum(mr), 1)  # empty row 1 -> 0
                 for xr, mr in zip(x.tolist(), mask.tolist())]
    close(masked_mean(x, mask, dim=-1), row_means)


def test_masked_stats_empty_and_single():
    x = t64([[1.0, 2.0, 3.0]])
    empty, single = t64([[0, 0, 0]]), t64([[0, 1, 0]])
    assert masked_mean(x, empty).item() == 0.0 and masked_var(x, empty).item() == 0.0
    assert masked_var(x, single).item() == 0.0
    close(masked_whiten(x, single), [[0.0, 0.0, 0.0]], tol=0)


# ---------------------------------------------------------------- aggregate

# real tokens: row 0 -> 1, 2, 4 (sum 7, n 3); row 1 -> none; row 2 -> 9 (sum 9, n 1)
AGG_LOSS = [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 10.0, 11.0, 12.0]]
AGG_MASK = [[1, 1, 0, 1], [0, 0, 0, 0], [1, 0, 0, 0]]


@pytest.mark.parametrize("mode,kwargs,expected", [
    ("token-mean", {}, 16 / 4),
    ("seq-mean-token-mean", {}, (7 / 3 + 9) / 2),
    ("seq-mean-token-sum", {}, 16 / 2),
    ("seq-mean-token-sum-norm", {}, 16 / 2 / 4),  # default norm_const = T = 4
    ("seq-mean-token-sum-norm", {"norm_const": 8}, 16 / 2 / 8),
    ("token-mean", {"num_tokens": 8}, 16 / 8),
    ("seq-mean-token-mean", {"num_seqs": 4}, (7 / 3 + 9) / 4),
    ("seq-mean-token-sum", {"num_seqs": 4}, 16 / 4),
    ("seq-mean-token-sum-norm", {"num_seqs": 4, "norm_const": 2}, 16 / 4 / 2),
])
def test_aggregate_hand_worked(mode, kwargs, expected):
    loss = t64(AGG_LOSS).requires_grad_(True)
    out = aggregate(loss, t64(AGG_MASK), Aggregation(mode, **kwargs))
    close(out, expected, tol=1e-15)
    out.backward()
    assert torch.all(loss.grad[t64(AGG_MASK) == 0] == 0)


def test_aggregate_weights_multiply_each_token_and_keep_the_denominators():
    # AGG_LOSS rows [1, 2, ., 4] (n 3), empty, [9] (n 1); weights [2, 0, ., 1] and [0.5]:
    # token-mean (2 + 0 + 4 + 4.5) / 4; seq-mean-token-mean ((2 + 0 + 4) / 3 + 4.5) / 2
    weights = t64([[2, 0, 7, 1], [3, 3, 3, 3], [0.5, 7, 7, 7]])
    loss = t64(AGG_LOSS).requires_grad_(True)
    out = aggregate(loss, t64(AGG_MASK), Aggregation("token-mean", weights=weights))
    close(out, (2 + 0 + 4 + 4.5) / 4, tol=1e-15)
    out.backward()
    close(loss.grad, weights * t64(AGG_MASK) / 4, tol=0)
    close(aggregate(t64(AGG_LOSS), t64(AGG_MASK), Aggregation("seq-mean-token-mean", weights=weights)),
          ((2 + 0 + 4) / 3 + 4.5) / 2, tol=1e-15)
    # a mode name alone is Aggregation(mode); weights of 1 are the unweighted loss, bit for bit
    for mode in AGG_MODES:
        plain = aggregate(t64(AGG_LOSS), t64(AGG_MASK), mode)
        assert torch.equal(plain, aggregate(t64(AGG_LOSS), t64(AGG_MASK), Aggregation(mode)))
        ones = Aggregation(mode, weights=torch.ones(3, 4, dtype=F64))
        assert torch.equal(plain, aggregate(t64(AGG_LOSS), t64(AGG_MASK), ones))


def test_aggregate_token_mean_gradient():
    loss = t64(AGG_LOSS).requires_grad_(True)
    aggregate(loss, t64(AGG_MASK), "token-mean").backward()
    close(loss.grad, t64(AGG_MASK) / 4, tol=0)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_fully_masked_batch_is_zero(mode):
    loss = t64(AGG_LOSS).requires_grad_(True)
    out = aggregate(loss, torch.zeros(3, 4, dtype=F64), mode)
    assert out.item() == 0.0
    out.backward()
    assert torch.all(loss.grad == 0)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_microbatches_with_global_counts_sum_to_full_batch(mode):
    g = torch.Generator().manual_seed(2)
    mask = ragged_mask(6, 8, g)
    loss = torch.randn(6, 8, generator=g, dtype=F64)
    num_tokens, num_seqs = mask.sum(), (mask.sum(-1) > 0).sum()
    full = aggregate(loss, mask, mode)
    parts = sum(aggregate(loss[i:i + 3], mask[i:i + 3], Aggregation(mode, num_tokens=num_tokens, num_seqs=num_seqs))
                for i in (0, 3))
    close(parts, full)


def test_aggregate_unknown_mode():
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
        aggregate(t64(AGG_LOSS), t64(AGG_MASK), "sum")


# ---------------------------------------------------------------- policy loss

def run_policy_loss(log_ratio, advantages, mask, **kwargs):
    """policy_loss with old_logp = 0 and logp = log_ratio; returns (loss, stats, d loss / d logp)."""
    logp = t64(log_ratio).requires_grad_(True)
    loss, stats = policy_loss(logp, torch.zeros_like(logp), t64(advantages), t64(mask), **kwargs)
    loss.backward()
    return loss, stats, logp.grad


def test_policy_loss_ratio_one():
    g = torch.Generator().manual_seed(3)
    mask = ragged_mask(4, 6, g)
    adv = torch.randn(4, 6, generator=g, dtype=F64) * mask
    logp = torch.randn(4, 6, generator=g, dtype=F64).requires_grad_(True)
    loss, stats = policy_loss(logp, logp.detach().clone(), adv, mask)
    loss.backward()
    n = mask.sum().item()
    close(loss, -adv.sum().item() / n)
    # d/dlogp (-A e^{logp - old}) = -A at ratio 1
    close(logp.grad, -adv * mask / n)
    assert stats["clipfrac"].item() == 0 and stats["approx_kl"].item() == 0
    assert stats["ratio_mean"].item() == 1 and stats["ratio_max_dev"].item() == 0


def test_policy_loss_at_clip_boundaries_is_not_clipped():
    # ratios exactly 1.25 and 0.75 (exp(log(1.25)) == 1.25 in float64) with clip 0.25: both branches equal
    assert math.exp(math.log(1.25)) == 1.25 and math.exp(math.log(0.75)) == 0.75
    loss, stats, _ = run_policy_loss([[math.log(1.25), math.log(0.75)]], [[1.0, -2.0]], [[1, 1]],
                                     clip_low=0.25, clip_high=0.25)
    close(loss, (-1.25 + 2 * 0.75) / 2, tol=1e-15)
    assert stats["clipfrac"].item() == 0


def test_policy_loss_both_signs_beyond_clip():
    # tokens: (r=2, A=+1) clipped -> -1.2, grad 0;  (r=2, A=-1) unclipped -> 2, grad -A r = 2
    #         (r=.5, A=+1) unclipped -> -0.5, grad -0.5;  (r=.5, A=-1) clipped -> 0.8, grad 0
    #         (r=1, A=0) -> 0;  a masked token with log ratio 50 and A=3, which must be ignored
    log2 = math.log(2.0)
    loss, stats, grad = run_policy_loss([[log2, log2, -log2], [-log2, 0.0, 50.0]],
                                        [[1.0, -1.0, 1.0], [-1.0, 0.0, 3.0]], [[1, 1, 1], [1, 1, 0]])
    close(loss, (-1.2 + 2 - 0.5 + 0.8 + 0) / 5, tol=1e-15)
    close(grad, [[0.0, 2 / 5, -0.5 / 5], [0.0, 0.0, 0.0]], tol=1e-15)
    close(stats["clipfrac"], 2 / 5, tol=1e-15)
    close(stats["ratio_mean"], (2 + 2 + 0.5 + 0.5 + 1) / 5, tol=1e-15)
    close(stats["ratio_max_dev"], 1.0, tol=0)
    # k3: (r - 1 - log r) = 1 - ln 2 for r = 2 and ln 2 - 0.5 for r = 0.5, so the four sum to exactly 1
    close(stats["approx_kl"], 1.0 / 5, tol=1e-15)
    assert all(not v.requires_grad and v.dim() == 0 for v in stats.values())


def test_policy_loss_asymmetric_clip():
    # clip_low 0.2, clip_high 0.28 (DAPO): ratio range [0.8, 1.28]
    # (1.25, +1) inside -> -1.25, grad -1.25;  (1.5, +1) clipped at 1.28 -> -1.28, grad 0
    # (0.75, -1) clipped at 0.8 -> 0.8, grad 0;  (0.85, -1) inside -> 0.85, grad 0.85
    loss, stats, grad = run_policy_loss([[math.log(1.25), math.log(1.5), math.log(0.75), math.log(0.85)]],
                                        [[1.0, 1.0, -1.0, -1.0]], [[1, 1, 1, 1]],
                                        clip_low=0.2, clip_high=0.28)
    close(loss, (-1.25 - 1.28 + 0.8 + 0.85) / 4, tol=1e-15)
    close(grad, [[-1.25 / 4, 0.0, 0.0, 0.85 / 4]], tol=1e-15)
    close(stats["clipfrac"], 0.5, tol=0)


def test_policy_loss_dual_clip():
    # dual_clip 3: (r=e^5, A=-1) -> min(e^5, 3) = 3, grad 0;  (r=2, A=-1) -> 2, grad 2
    #              (r=e^5, A=+1) -> ordinary clip -1.2, grad 0
    loss, stats, grad = run_policy_loss([[5.0, math.log(2.0), 5.0]], [[-1.0, -1.0, 1.0]], [[1, 1, 1]],
                                        dual_clip=3.0)
    close(loss, (3 + 2 - 1.2) / 3, tol=1e-15)
    close(grad, [[0.0, 2 / 3, 0.0]], tol=1e-15)
    close(stats["dual_clipfrac"], 1 / 3, tol=1e-15)
    close(stats["clipfrac"], 1 / 3, tol=1e-15)
    _, stats_plain, _ = run_policy_loss([[0.0]], [[1.0]], [[1]])
    assert "dual_clipfrac" not in stats_plain
    for bad in (1.0, 0.5):
        with pytest.raises(ValueError, match="dual_clip"):
            run_policy_loss([[0.0]], [[1.0]], [[1]], dual_clip=bad)


def test_policy_loss_huge_log_ratio_is_clamped():
    # |logp - old| = 50 is clamped to 20: (e^20, +1) -> -1.2; (e^20, -1) -> e^20; (e^-20, +1) -> -e^-20;
    # (e^-20, -1) -> 0.8. The clamp has zero gradient beyond +-20, the clip zero gradient on the others.
    loss, stats, grad = run_policy_loss([[50.0, 50.0, -50.0, -50.0]], [[1.0, -1.0, 1.0, -1.0]],
                                        [[1, 1, 1, 1]])
    close(loss, (-1.2 + math.exp(20) - math.exp(-20) + 0.8) / 4, tol=1e-15)
    assert torch.all(grad == 0)
    assert all(torch.isfinite(v) for v in stats.values())
    close(stats["ratio_max_dev"], math.exp(20) - 1, tol=1e-15)


def test_policy_loss_fully_masked_rows_and_batch():
    log_ratio, adv = [[0.1, -0.2, 0.3], [5.0, 5.0, 5.0]], [[1.0, -1.0, 2.0], [4.0, 4.0, 4.0]]
    loss, _, grad = run_policy_loss(log_ratio, adv, [[1, 1, 1], [0, 0, 0]])
    loss_row0, _, grad_row0 = run_policy_loss(log_ratio[:1], adv[:1], [[1, 1, 1]])
    close(loss, loss_row0, tol=0)
    close(grad[:1], grad_row0, tol=0)
    assert torch.all(grad[1] == 0)
    for mode in AGG_MODES:
        loss, stats, grad = run_policy_loss(log_ratio, adv, [[0, 0, 0], [0, 0, 0]], agg=mode)
        assert loss.item() == 0 and torch.all(grad == 0)
        assert all(v.item() == 0 for v in stats.values())


def test_policy_loss_passes_aggregation_through():
    # ratio 1: per-token loss = -A; rows: [-1, -2] (n 2) and [-4] (n 1)
    args = ([[0.0, 0.0], [0.0, 0.0]], [[1.0, 2.0], [4.0, 9.0]], [[1, 1], [1, 0]])
    close(run_policy_loss(*args, agg="seq-mean-token-mean")[0], (-1.5 - 4) / 2, tol=0)
    close(run_policy_loss(*args, agg=Aggregation("seq-mean-token-sum", num_seqs=4))[0], (-3 - 4) / 4, tol=0)


# ---------------------------------------------------------------- GSPO

def run_gspo(log_ratio, advantages, mask, **kwargs):
    """gspo_policy_loss with old_logp = 0 and logp = log_ratio; returns (loss, stats, d loss / d logp)."""
    logp = t64(log_ratio).requires_grad_(True)
    loss, stats = gspo_policy_loss(logp, torch.zeros_like(logp), t64(advantages), t64(mask), **kwargs)
    loss.backward()
    return loss, stats, logp.grad


def test_gspo_hand_worked():
    # default clip range [1 - 3e-4, 1 + 4e-4] = [0.9997, 1.0004]; 4 non-empty rows, so G = 4
    # row 0: log-ratios 0.1, -0.1 (7 masked): s = e^0 = 1; A = mean(0.5, 1.5) = 1 -> l = -1 (inside the range),
    #        grad -A s / |y| = -0.5 per real token
    # row 1: log-ratios ln 2, ln 2 (a hole with 9): s = 2; A = -1 -> max(2, 1.0004) = 2 (unclipped), grad 1 per token
    # row 2: log-ratio ln 0.5: s = 0.5; A = -1 -> max(0.5, 0.9997) = 0.9997 (clipped), grad 0
    # row 3: log-ratio ln 2: s = 2; A = +1 -> max(-2, -1.0004) = -1.0004 (clipped), grad 0
    # row 4: fully masked (log-ratio 50, A 3): left out
    ln2 = math.log(2.0)
    loss, stats, grad = run_gspo(
        [[0.1, -0.1, 7.0], [ln2, 9.0, ln2], [-ln2, 0.0, 0.0], [0.0, ln2, 0.0], [50.0, 50.0, 50.0]],
        [[0.5, 1.5, 5.0], [-1.0, 4.0, -1.0], [-1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [3.0, 3.0, 3.0]],
        [[1, 1, 0], [1, 0, 1], [1, 0, 0], [0, 1, 0], [0, 0, 0]])
    close(loss, (-1 + 2 + 0.9997 - 1.0004) / 4, tol=1e-15)
    close(grad, [[-0.5 / 4, -0.5 / 4, 0], [1 / 4, 0, 1 / 4], [0, 0, 0], [0, 0, 0], [0, 0, 0]], tol=1e-15)
    close(stats["clipfrac"], 2 / 4, tol=0)
    close(stats["ratio_mean"], (1 + 2 + 0.5 + 2) / 4, tol=1e-15)
    close(stats["ratio_max_dev"], 1.0, tol=1e-15)
    # token k3 (r - 1) - log r over the 6 real tokens: e^0.1 - 1.1, e^-0.1 - 0.9, 3 x (1 - ln 2), ln 2 - 0.5
    close(stats["approx_kl"], (math.exp(0.1) + math.exp(-0.1) - 2 + 2.5 - 2 * ln2) / 6, tol=1e-15)
    assert all(not v.requires_grad and v.dim() == 0 for v in stats.values())


def python_gspo(logp, old_logp, advantages, mask, clip_low, clip_high):
    """A plain Python loop over sequences on 0-dim float64 tensors, so autograd gives its gradient too."""
    total, n_seqs, n_clipped, ratio_sum = 0.0, 0, 0, 0.0
    for b in range(logp.shape[0]):
        real = [t for t in range(logp.shape[1]) if mask[b, t] == 1]
        if not real:
            continue
        s = torch.exp(sum(logp[b, t] - old_logp[b, t] for t in real) / len(real))
        a = sum(advantages[b, t].item() for t in real) / len(real)
        unclipped = -a * s
        clipped = -a * min(max(s, 1 - clip_low), 1 + clip_high)  # a constant, no gradient, when s is clipped
        if clipped > unclipped:
            total, n_clipped = total + clipped, n_clipped + 1
        else:
            total = total + unclipped
        n_seqs += 1
        ratio_sum += s.item()
    return total / n_seqs, n_clipped / n_seqs, ratio_sum / n_seqs


@pytest.mark.parametrize("clip_low,clip_high,scale", [(3e-4, 4e-4, 1e-3), (0.2, 0.28, 0.5)])
def test_gspo_matches_a_python_loop_value_and_gradient(clip_low, clip_high, scale):
    g = torch.Generator().manual_seed(13)
    B, T = 12, 7
    mask = ragged_mask(B, T, g)
    old_logp = -torch.rand(B, T, generator=g, dtype=F64) * 3
    logp = (old_logp + scale * torch.randn(B, T, generator=g, dtype=F64)).requires_grad_(True)
    advantages = torch.randn(B, T, generator=g, dtype=F64)  # not constant over a row: A_i is the row's mean
    loss, stats = gspo_policy_loss(logp, old_logp, advantages, mask, clip_low, clip_high)
    (grad,) = torch.autograd.grad(loss, logp)
    logp_ref = logp.detach().clone().requires_grad_(True)
    ref_loss, ref_clipfrac, ref_ratio_mean = python_gspo(logp_ref, old_logp, advantages, mask, clip_low, clip_high)
    ref_loss.backward()
    assert 0 < ref_clipfrac < 1  # both branches are exercised
    close(loss, ref_loss, tol=1e-14)
    close(grad, logp_ref.grad, tol=1e-14)
    close(stats["clipfrac"], ref_clipfrac, tol=0)
    close(stats["ratio_mean"], ref_ratio_mean, tol=1e-14)


def test_gspo_equals_its_token_form_with_a_per_row_token_mean():
    # GSPO-token (arXiv:2507.18071): s_it = sg[s_i] pi(y_t) / sg[pi(y_t)], with A constant over each row, averaged
    # over each row's tokens then over rows, has the same value and gradient as the sequence-level loss
    g = torch.Generator().manual_seed(14)
    B, T = 8, 6
    mask = ragged_mask(B, T, g)
    old_logp = -torch.rand(B, T, generator=g, dtype=F64) * 3
    logp = (old_logp + 0.3 * torch.randn(B, T, generator=g, dtype=F64)).requires_grad_(True)
    advantages = torch.randn(B, 1, generator=g, dtype=F64) * mask
    loss, _ = gspo_policy_loss(logp, old_logp, advantages, mask, 0.1, 0.1)
    (grad,) = torch.autograd.grad(loss, logp)
    seq_log_ratio = masked_mean(logp - old_logp, mask, dim=-1).detach()[:, None]  # [B, 1] sg[log s_i]
    s_token = torch.exp(seq_log_ratio + logp - logp.detach())  # [B, T], value s_i
    token_losses = torch.maximum(-advantages * s_token, -advantages * torch.clamp(s_token, 0.9, 1.1))
    token_loss = aggregate(token_losses, mask, "seq-mean-token-mean")
    (token_grad,) = torch.autograd.grad(token_loss, logp)
    close(loss, token_loss, tol=1e-14)
    close(grad, token_grad, tol=1e-14)


def test_gspo_microbatches_with_global_num_seqs_sum_to_full_batch():
    g = torch.Generator().manual_seed(15)
    mask = ragged_mask(6, 5, g)
    log_ratio = 0.3 * torch.randn(6, 5, generator=g, dtype=F64)
    advantages = torch.randn(6, 1, generator=g, dtype=F64) * mask
    zeros = torch.zeros_like(log_ratio)
    full, _ = gspo_policy_loss(log_ratio, zeros, advantages, mask, 0.1, 0.1)
    num_seqs = (mask.sum(-1) > 0).sum()
    parts = sum(gspo_policy_loss(log_ratio[i:i + 3], zeros[i:i + 3], advantages[i:i + 3], mask[i:i + 3], 0.1, 0.1,
                                 agg=Aggregation(num_seqs=num_seqs))[0] for i in (0, 3))
    close(parts, full, tol=1e-15)


def test_gspo_huge_mean_log_ratio_is_clamped():
    # mean log-ratio (40 + 60) / 2 = 50 -> 20: s = e^20, A = -1: unclipped branch e^20, zero gradient (the clamp)
    for dtype in (F64, torch.float32):
        logp = torch.tensor([[40.0, 60.0]], dtype=dtype, requires_grad=True)
        loss, stats = gspo_policy_loss(logp, torch.zeros_like(logp), -torch.ones_like(logp), torch.ones_like(logp))
        loss.backward()
        close(loss, math.exp(20), tol=1e-15 if dtype == F64 else 1e-7)
        assert torch.all(logp.grad == 0)
        assert all(torch.isfinite(v) for v in stats.values())


def test_gspo_fully_masked_batch():
    loss, stats, grad = run_gspo([[0.1, 5.0], [-0.2, 0.3]], [[1.0, 1.0], [-2.0, -2.0]], [[0, 0], [0, 0]])
    assert loss.item() == 0 and torch.all(grad == 0)
    assert all(v.item() == 0 for v in stats.values())


# ---------------------------------------------------------------- critic-free estimators

# group 7: rows 0, 1, 3 with scores 1, 0, 0.5: mean 0.5, unbiased std sqrt((0.25 + 0.25 + 0) / 2) = 0.5;
# group 3: row 2 alone: mean 0, std 1 (no baseline from one sample).
GROUP_SCORES, GROUP_IDS = [1.0, 0.0, 1.0, 0.5], [7, 7, 3, 7]


@pytest.mark.parametrize("kind,expected", [
    ("grpo", [0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6), 1.0 / (1 + 1e-6), 0.0]),
    ("dr_grpo", [0.5, -0.5, 1.0, 0.0]),
    # leave-one-out: row 0: 1 - (0 + 0.5) / 2; row 1: 0 - (1 + 0.5) / 2; row 3: 0.5 - (1 + 0) / 2; alone: s
    ("rloo", [0.75, -0.75, 1.0, 0.0]),
])
def test_group_advantages_hand_worked(kind, expected):
    mask = t64([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1]])
    got = group_advantages(t64(GROUP_SCORES), torch.tensor(GROUP_IDS), mask, kind)
    close(got, t64(expected)[:, None] * mask, tol=1e-15)


def test_reinforce_pp_baseline_whitens_the_centred_scores_over_tokens():
    mask = t64([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1]])
    centred = t64([0.5, -0.5, 1.0, 0.0])[:, None] * mask  # dr_grpo's advantages, per token
    tokens = [v for row, m in zip(centred.tolist(), mask.tolist()) for v, k in zip(row, m) if k]
    mean = sum(tokens) / len(tokens)
    std = math.sqrt(sum((v - mean) ** 2 for v in tokens) / (len(tokens) - 1) + 1e-8)
    expected = ((centred - mean) / std) * mask
    got = group_advantages(t64(GROUP_SCORES), torch.tensor(GROUP_IDS), mask, "reinforce_pp_baseline")
    close(got, expected, tol=1e-14)


def python_group_advantages(scores, group, kind, eps):
    """A plain Python loop over rows: the per-row advantage before broadcasting (no whitening)."""
    out = []
    for i, s in enumerate(scores):
        members = [scores[j] for j in range(len(scores)) if group[j] == group[i]]
        n = len(members)
        mean = sum(members) / n if n > 1 else 0.0
        std = math.sqrt(sum((m - mean) ** 2 for m in members) / (n - 1)) if n > 1 else 1.0
        if kind == "grpo":
            out.append((s - mean) / (std + eps))
        elif kind == "rloo":
            out.append(s - (sum(members) - s) / (n - 1) if n > 1 else s)
        else:
            out.append(s - mean)
    return out


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "rloo"])
def test_group_advantages_match_a_python_loop(kind):
    g = torch.Generator().manual_seed(11)
    B, T = 13, 6
    scores = torch.randn(B, generator=g, dtype=F64)
    group = torch.randint(0, 5, (B,), generator=g) * 3  # ids need not be 0..G-1; some groups of one, some empty
    mask = ragged_mask(B, T, g)
    expected = t64(python_group_advantages(scores.tolist(), group.tolist(), kind, 1e-6))[:, None] * mask
    close(group_advantages(scores, group, mask, kind), expected, tol=1e-13)


def test_group_advantages_rejects_an_unknown_kind():
    with pytest.raises(ValueError, match="kind must be one of"):
        group_advantages(t64([1.0]), torch.tensor([0]), t64([[1.0]]), "ppo")


def test_discounted_returns_hand_worked_and_holes_transparent():
    # row 0: rewards 1, _, 2 with a hole in the middle, gamma 0.5: G_2 = 2, G_0 = 1 + 0.5 * 2 = 2
    # row 1: rewards 0, 0, 3: G = 0.75, 1.5, 3
    rewards, mask = t64([[1.0, 9.0, 2.0], [0.0, 0.0, 3.0]]), t64([[1, 0, 1], [1, 1, 1]])
    close(discounted_returns(rewards, mask, 0.5), t64([[2.0, 0.0, 2.0], [0.75, 1.5, 3.0]]), tol=0)


def test_discounted_returns_match_a_python_loop():
    g = torch.Generator().manual_seed(12)
    rewards = torch.randn(6, 9, generator=g, dtype=F64)
    mask = ragged_mask(6, 9, g)
    expected = torch.zeros_like(rewards)
    for b in range(6):
        running = 0.0
        for t in reversed(range(9)):
            if mask[b, t]:
                running = rewards[b, t].item() + 0.9 * running
                expected[b, t] = running
    close(discounted_returns(rewards, mask, 0.9), expected, tol=1e-13)


# ---------------------------------------------------------------- DAPO dynamic sampling and overlong penalty

def test_varied_groups_hand_worked():
    # group 7: scores 1, 0 -> varied; group 2: 1, 1 -> not; group 5: 0.5, 0.5, 0.5 -> not; group 9 alone -> not;
    # group 4: 0, 0, 1 (interleaved) -> varied
    scores = t64([1.0, 1.0, 0.5, 0.0, 0.0, 1.0, 0.5, 3.0, 0.5, 0.0, 1.0])
    group = torch.tensor([7, 2, 5, 7, 4, 2, 5, 9, 5, 4, 4])
    got = varied_groups(scores, group)
    assert got.dtype == torch.bool
    assert got.tolist() == [True, False, False, True, True, False, False, False, False, True, True]


def test_varied_groups_match_a_python_loop():
    g = torch.Generator().manual_seed(16)
    for _ in range(5):
        B = 17
        scores = torch.randint(0, 2, (B,), generator=g).to(F64)  # 0/1 accuracy: many all-equal groups
        group = torch.randint(0, 6, (B,), generator=g) * 5  # some groups of one, some ids unused
        expected = [len({scores[j].item() for j in range(B) if group[j] == group[i]}) > 1 for i in range(B)]
        assert varied_groups(scores, group).tolist() == expected


@pytest.mark.parametrize("lengths,expected", [
    # max_len 10, cache_len 4: no penalty up to 6, then (6 - L) / 4 down to -1 at L = 10, then -1
    ([0, 5, 6, 7, 8, 9, 10, 11, 100], [0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0]),
    ([6.5, 10.5], [-0.125, -1.0]),
])
def test_overlong_penalty_hand_worked(lengths, expected):
    got = overlong_penalty(torch.tensor(lengths), 10, 4)
    assert got.dtype == torch.get_default_dtype() and got.tolist() == expected
    got64 = overlong_penalty(torch.tensor(lengths, dtype=F64), 10, 4)
    assert got64.dtype == F64 and got64.tolist() == expected


def test_overlong_penalty_cache_len_bounds():
    # cache_len == max_len: the ramp starts at 0: L = 0 -> 0, L = 5 -> -0.5, L = 10 -> -1
    assert overlong_penalty(torch.tensor([0, 5, 10, 11]), 10, 10).tolist() == [0.0, -0.5, -1.0, -1.0]
    # cache_len 1: L = max_len is the only ramp point, -1
    assert overlong_penalty(torch.tensor([9, 10, 11]), 10, 1).tolist() == [0.0, -1.0, -1.0]
    for bad in (0, 11):
        with pytest.raises(ValueError, match="cache_len"):
            overlong_penalty(torch.tensor([3]), 10, bad)


# ---------------------------------------------------------------- value loss

# token 0: v-old = 0.5 -> clipped to 0.2, V_clip 0.7: max(1, 1.69) = 1.69 (clipped branch), grad 0
# token 1: v-old = -0.5 -> V_clip 2.3: max(4, 5.29) = 5.29 (clipped branch), grad 0
# token 2: v = old: both 0.25, grad 1/2 * 2 (v - R) = -0.5
# token 3: v-old = -1 -> V_clip 0.8: max(4, 1.44) = 4 (unclipped), grad v - R = -2
# token 4: masked, garbage
VALUES, OLD_VALUES = [[1.0, 2.0, 0.5, 0.0, 100.0]], [[0.5, 2.5, 0.5, 1.0, 0.0]]
RETURNS, VALUE_MASK = [[2.0, 0.0, 1.0, 2.0, -100.0]], [[1, 1, 1, 1, 0]]


@pytest.mark.parametrize("clip,expected_loss,expected_grad,expected_clipfrac", [
    (0.2, 0.5 * (1.69 + 5.29 + 0.25 + 4) / 4, [[0.0, 0.0, -0.5 / 4, -2 / 4, 0.0]], 0.5),
    (None, 0.5 * (1 + 4 + 0.25 + 4) / 4, [[-1 / 4, 2 / 4, -0.5 / 4, -2 / 4, 0.0]], 0.0),
    (2.0, 0.5 * (1 + 4 + 0.25 + 4) / 4, [[-1 / 4, 2 / 4, -0.5 / 4, -2 / 4, 0.0]], 0.0),
])
def test_value_loss_hand_worked(clip, expected_loss, expected_grad, expected_clipfrac):
    values = t64(VALUES).requires_grad_(True)
    loss, stats = value_loss(values, t64(OLD_VALUES), t64(RETURNS), t64(VALUE_MASK), clip=clip)
    loss.backward()
    close(loss, expected_loss, tol=1e-15)
    close(values.grad, expected_grad, tol=1e-15)
    close(stats["clipfrac"], expected_clipfrac, tol=0)
    close(stats["values_mean"], (1 + 2 + 0.5 + 0) / 4, tol=0)


def test_value_clipfrac_ignores_rounding_inside_the_clip_range():
    # Inside the clip range V_clip = V_old + (V - V_old) differs from V by one rounding in about a third of
    # float32 tokens (here: all chosen so), which makes (V_clip - R)^2 > (V - R)^2 for some: no clamp was active,
    # so clipfrac is 0 and the loss is the unclipped one.
    values, old = torch.tensor([[0.009838319383561611]]), torch.tensor([[0.10353358089923859]])  # float32
    v_clipped = old + torch.clamp(values - old, -0.2, 0.2)
    assert v_clipped.item() != values.item()  # the rounding this test is about
    returns = torch.tensor([[0.0]])  # V_clip > V > 0 here: (V_clip - 0)^2 > (V - 0)^2
    assert ((v_clipped - returns) ** 2 > (values - returns) ** 2).item()  # the old count would say "clipped"
    loss, stats = value_loss(values, old, returns, torch.ones(1, 1), clip=0.2)
    assert stats["clipfrac"].item() == 0.0


# ---------------------------------------------------------------- explained variance

def test_explained_variance_matches_numpy():
    g = torch.Generator().manual_seed(4)
    mask = ragged_mask(5, 7, g)
    returns = torch.randn(5, 7, generator=g, dtype=F64)
    values = returns + 0.5 * torch.randn(5, 7, generator=g, dtype=F64)
    real = mask.numpy() == 1
    r, v = returns.numpy()[real], values.numpy()[real]
    expected = 1 - np.var(r - v, ddof=1) / np.var(r, ddof=1)
    ev = explained_variance(values, returns, mask)
    assert isinstance(ev, float)
    assert ev == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert explained_variance(returns, returns, mask) == 1.0
    assert explained_variance(values, torch.ones_like(returns), mask) == 0.0
    assert explained_variance(values, returns, torch.zeros_like(mask)) == 0.0


# ---------------------------------------------------------------- rewards

def test_per_token_rewards_score_on_last_real_token():
    mask = t64([[1, 1, 0, 0, 1, 0],   # holes at 2, 3; padding at 5 -> last real token 4
                [0, 0, 0, 0, 0, 0],   # fully masked: no score
                [1, 1, 1, 1, 1, 1]])  # last real token 5
    scores = t64([1.0, 2.0, 3.0])
    kl = t64([[1, 2, 3, 4, 5, 6], [1, 1, 1, 1, 1, 1], [2, 2, 2, 2, 2, 2]])
    close(per_token_rewards(scores, mask), [[0, 0, 0, 0, 1, 0], [0] * 6, [0, 0, 0, 0, 0, 3]], tol=0)
    # -0.5 * kl on real tokens; row 2 lacks EOS: 3 - 0.5 = 2.5; row 1 also lacks EOS but has no tokens
    ended_with_eos = torch.tensor([True, False, False])
    rewards = per_token_rewards(scores, mask, kl=kl, kl_coef=0.5, ended_with_eos=ended_with_eos,
                                missing_eos_penalty=0.5)
    close(rewards, [[-0.5, -1.0, 0, 0, -2.5 + 1, 0], [0] * 6, [-1, -1, -1, -1, -1, -1 + 2.5]], tol=0)
    with pytest.raises(ValueError, match="ended_with_eos"):
        per_token_rewards(scores, mask, missing_eos_penalty=1.0)


def test_normalize_scores():
    scores = t64([1.0, 2.0, 3.0, 4.0])
    # mean 2.5; unbiased var (2.25 + 0.25 + 0.25 + 2.25) / 3 = 5 / 3
    std = math.sqrt(5 / 3)
    whitened = [(s - 2.5) / (std + 1e-8) for s in (1.0, 2.0, 3.0, 4.0)]
    close(normalize_scores(scores, whiten=True), whitened)
    close(normalize_scores(scores, whiten=True, clip=1.0), [max(min(w, 1.0), -1.0) for w in whitened])
    close(normalize_scores(scores, clip=2.5), [1.0, 2.0, 2.5, 2.5], tol=0)
    close(normalize_scores(t64([7.0]), whiten=True), [0.0], tol=0)


# ---------------------------------------------------------------- KL controllers

def test_adaptive_kl_controller_hand_worked():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
    # kl 12: error clip(12/6 - 1) = 0.2, mult 1 + 0.2 * 256 / 10000 = 1.00512
    ctl.update(12.0, 256)
    assert ctl.value == pytest.approx(0.100512, rel=1e-15)
    # kl 6.6: error 0.1, mult 1.00256
    ctl.update(torch.tensor(6.6, dtype=F64), 256)  # a 0-dim tensor is accepted
    assert ctl.value == pytest.approx(0.10076931072, rel=1e-14)
    ctl = AdaptiveKLController(0.1, 6.0, 10000)
    for kl, mult_value in [(12.0, 0.100512), (6.6, 0.10076931072), (3.0, 0.1002533718491136),
                           (5.7, 0.100125047533146734592)]:  # 3: error -0.5 clipped to -0.2; 5.7: error -0.05
        ctl.update(kl, 256)
        assert ctl.value == pytest.approx(mult_value, rel=1e-14)
    restored = AdaptiveKLController(0.1, 6.0, 10000)
    restored.load_state_dict(json.loads(json.dumps(ctl.state_dict())))
    assert restored.value == ctl.value
    ctl.update(7.0, 64)
    restored.update(7.0, 64)
    assert restored.value == ctl.value
    with pytest.raises(ValueError, match="target"):
        AdaptiveKLController(0.1, 0.0, 10000)


def test_fixed_kl_controller():
    ctl = FixedKLController(0.05)
    ctl.update(100.0, 256)
    assert ctl.value == 0.05
    restored = FixedKLController(0.0)
    restored.load_state_dict(json.loads(json.dumps(ctl.state_dict())))
    assert restored.value == 0.05
