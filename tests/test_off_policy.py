"""Fast CPU tests of the off-policy corrections in ppo_core/algo.py (TIS, AReaL's decoupled PPO, IcePop masking)
against hand-worked numbers and a plain-Python loop.

    python -m pytest -q tests/test_off_policy.py

float64 unless a test says otherwise. Log-probs are built as logs of round probabilities, so a ratio such as
0.6 / 0.2 = 3 comes back from exp(log 0.6 - log 0.2) within a few ulps: hand-worked values are checked to 1e-15.
Where a ratio must sit exactly on a cap or a band edge, the edge is taken from the same torch.exp the code computes.
"""
import math

import pytest
import torch

from ppo_core.algo import (
    LOG_RATIO_CLAMP, decoupled_importance_weights, off_policy_mask, policy_loss, policy_loss_off_policy,
    truncated_importance_weights,
)

F64 = torch.float64
AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
# (correction, keyword arguments): every way of calling policy_loss_off_policy that the tests sweep
CORRECTIONS = [
    ("tis", {"cap": 1.5}),
    ("decoupled", {"cap": None}),
    ("decoupled", {"cap": 1.5}),
    ("icepop", {"band": (0.6, 1.6), "mask_level": "token"}),
    ("icepop", {"band": (0.8, 1.25), "mask_level": "sequence"}),
]
POLICY_LOSS_STATS = ("clipfrac", "approx_kl", "ratio_mean", "ratio_max_dev")


def t64(rows):
    return torch.tensor(rows, dtype=F64)


def close(actual, expected, tol=1e-15):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=F64), torch.as_tensor(expected, dtype=F64),
                               rtol=tol, atol=tol)


def log(probs):
    return t64(probs).log()


# ---------------------------------------------------------------- the weights and the mask, by hand
#
# k_t = pi_old / mu on a [3, 4] batch; row 2 is fully masked and holds garbage (mu = 0, so log mu = -inf)
#   row 0: pi_old 0.5 0.6 0.1 [0.3]   mu 0.5 0.2 0.2 [0.2]   k = 1  3  0.5 [1.5]
#   row 1: pi_old 0.8 [0.9] 0.3 0.7   mu 0.2 [0.1] 0.3 0.7   k = 4 [9]  1   1
# six real tokens; |log k| over them: 0, ln 3, ln 2, ln 4, 0, 0 (sum ln 24), max ln 4; k mean 10.5 / 6 = 1.75, max 4
PI_OLD = [[0.5, 0.6, 0.1, 0.3], [0.8, 0.9, 0.3, 0.7], [0.5, 0.5, 0.5, 0.5]]
MU = [[0.5, 0.2, 0.2, 0.2], [0.2, 0.1, 0.3, 0.7], [0.0, 0.0, 0.0, 0.0]]
MASK = [[1, 1, 1, 0], [1, 0, 1, 1], [0, 0, 0, 0]]


def check_behaviour_stats(stats):
    close(stats["behav_ratio_mean"], 1.75)
    close(stats["behav_ratio_max"], 4.0)
    close(stats["behav_gap_mean"], math.log(24) / 6)
    close(stats["behav_gap_max"], math.log(4))
    assert all(not v.requires_grad and v.dim() == 0 for v in stats.values())


def test_truncated_importance_weights_hand_worked():
    # C = 2: w = min(k, 2) -> row 0: 1 2 0.5 [0], row 1: 2 [0] 1 1; k = 3 and k = 4 are truncated: 2 of 6 tokens
    weights, stats = truncated_importance_weights(log(PI_OLD), log(MU), t64(MASK), cap=2.0)
    close(weights, [[1, 2, 0.5, 0], [2, 0, 1, 1], [0, 0, 0, 0]])
    close(stats["truncated_frac"], 2 / 6)
    check_behaviour_stats(stats)
    # C = 5 truncates nothing: w = k on the real tokens
    weights, stats = truncated_importance_weights(log(PI_OLD), log(MU), t64(MASK), cap=5.0)
    close(weights, [[1, 3, 0.5, 0], [4, 0, 1, 1], [0, 0, 0, 0]])
    assert stats["truncated_frac"].item() == 0


def test_decoupled_importance_weights_hand_worked():
    # no cap: w = k (AReaL's pi_prox / mu)
    weights, stats = decoupled_importance_weights(log(PI_OLD), log(MU), t64(MASK))
    close(weights, [[1, 3, 0.5, 0], [4, 0, 1, 1], [0, 0, 0, 0]])
    assert stats["filtered_frac"].item() == 0
    check_behaviour_stats(stats)
    # cap 2: the tokens with k = 3 and k = 4 are dropped, not truncated: 2 of 6
    weights, stats = decoupled_importance_weights(log(PI_OLD), log(MU), t64(MASK), cap=2.0)
    close(weights, [[1, 0, 0.5, 0], [0, 0, 1, 1], [0, 0, 0, 0]])
    close(stats["filtered_frac"], 2 / 6)
    # cap 3.5: only k = 4 goes
    weights, stats = decoupled_importance_weights(log(PI_OLD), log(MU), t64(MASK), cap=3.5)
    close(weights, [[1, 3, 0.5, 0], [0, 0, 1, 1], [0, 0, 0, 0]])
    close(stats["filtered_frac"], 1 / 6)


def test_off_policy_mask_token_hand_worked():
    # band [0.4, 1.5]: k = 3 (row 0) and k = 4 (row 1) fall above it; 0.5 and 1 are inside
    new_mask, stats = off_policy_mask(log(PI_OLD), log(MU), t64(MASK), 0.4, 1.5, level="token")
    assert new_mask.dtype == F64
    assert new_mask.tolist() == [[1, 0, 1, 0], [0, 0, 1, 1], [0, 0, 0, 0]]
    close(stats["masked_frac"], 2 / 6)
    assert stats["masked_seq_frac"].item() == 0  # both non-empty rows keep a token
    check_behaviour_stats(stats)


def test_off_policy_mask_sequence_hand_worked():
    # geometric means over real tokens: row 0 (1 * 3 * 0.5)^(1/3) = 1.5^(1/3) = 1.145, row 1 (4 * 1 * 1)^(1/3) = 1.587
    # band [0.4, 1.5]: row 0 stays whole (its k = 3 token too), row 1 goes whole: 3 of 6 tokens, 1 of 2 rows
    assert 1.5 ** (1 / 3) <= 1.5 < 4 ** (1 / 3)
    new_mask, stats = off_policy_mask(log(PI_OLD), log(MU), t64(MASK), 0.4, 1.5, level="sequence")
    assert new_mask.tolist() == [[1, 1, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    close(stats["masked_frac"], 3 / 6)
    close(stats["masked_seq_frac"], 1 / 2)
    check_behaviour_stats(stats)  # token-level k at either level
    # band [0.4, 2]: both rows stay
    new_mask, stats = off_policy_mask(log(PI_OLD), log(MU), t64(MASK), 0.4, 2.0, level="sequence")
    assert new_mask.tolist() == MASK
    assert stats["masked_frac"].item() == 0 and stats["masked_seq_frac"].item() == 0
    # a bool mask comes back as a bool mask
    new_mask, _ = off_policy_mask(log(PI_OLD), log(MU), t64(MASK) > 0, 0.4, 1.5, level="sequence")
    assert new_mask.dtype == torch.bool and new_mask.tolist() == [[1, 1, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]]


# ---------------------------------------------------------------- edges: a ratio exactly at the cap or the band

LN2 = math.log(2.0)
K_HIGH = torch.exp(t64(LN2)).item()  # the float64 that exp(ln 2) gives: what the code computes for k = 2
K_LOW = torch.exp(t64(-LN2)).item()  # and for k = 1/2


def below(x):
    return torch.nextafter(t64(x), t64(0.0)).item()


def above(x):
    return torch.nextafter(t64(x), t64(10.0)).item()


def test_cap_edges():
    # one real token with log k = ln 2: a cap exactly at k leaves it untruncated (TIS) and kept (AReaL keeps
    # k <= cap); a cap one ulp below truncates it to the cap (TIS) or drops it (decoupled)
    old_logp, behav_logp, mask = t64([[LN2, 0.0]]), t64([[0.0, 0.0]]), t64([[1, 0]])
    weights, stats = truncated_importance_weights(old_logp, behav_logp, mask, cap=K_HIGH)
    assert weights.tolist() == [[K_HIGH, 0.0]] and stats["truncated_frac"].item() == 0
    weights, stats = truncated_importance_weights(old_logp, behav_logp, mask, cap=below(K_HIGH))
    assert weights.tolist() == [[below(K_HIGH), 0.0]] and stats["truncated_frac"].item() == 1
    weights, stats = decoupled_importance_weights(old_logp, behav_logp, mask, cap=K_HIGH)
    assert weights.tolist() == [[K_HIGH, 0.0]] and stats["filtered_frac"].item() == 0
    weights, stats = decoupled_importance_weights(old_logp, behav_logp, mask, cap=below(K_HIGH))
    assert weights.tolist() == [[0.0, 0.0]] and stats["filtered_frac"].item() == 1
    # cap 1 is allowed: on-policy tokens (k exactly 1) keep weight 1 under both
    for weights_of in (truncated_importance_weights, decoupled_importance_weights):
        weights, _ = weights_of(t64([[0.0, LN2]]), t64([[0.0, 0.0]]), t64([[1, 1]]), cap=1.0)
        assert weights[0, 0].item() == 1.0


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_band_edges_are_closed(level):
    # row 0: two tokens of log k = ln 2, row 1: two of log k = -ln 2 (so each row's geometric mean is its tokens' k,
    # since (a + a) / 2 == a exactly). A band with its ends exactly at K_LOW and K_HIGH keeps everything; one ulp
    # inside on either end drops that end's row.
    old_logp, behav_logp, mask = t64([[LN2, LN2], [-LN2, -LN2]]), torch.zeros(2, 2, dtype=F64), torch.ones(2, 2)
    new_mask, stats = off_policy_mask(old_logp, behav_logp, mask.to(F64), K_LOW, K_HIGH, level)
    assert new_mask.tolist() == [[1, 1], [1, 1]] and stats["masked_frac"].item() == 0
    new_mask, stats = off_policy_mask(old_logp, behav_logp, mask.to(F64), K_LOW, below(K_HIGH), level)
    assert new_mask.tolist() == [[0, 0], [1, 1]] and stats["masked_frac"].item() == 0.5
    assert stats["masked_seq_frac"].item() == 0.5
    new_mask, stats = off_policy_mask(old_logp, behav_logp, mask.to(F64), above(K_LOW), K_HIGH, level)
    assert new_mask.tolist() == [[1, 1], [0, 0]]
    # the degenerate band [1, 1] keeps exactly the on-policy tokens
    new_mask, _ = off_policy_mask(t64([[0.0, LN2]]), t64([[0.0, 0.0]]), t64([[1, 1]]), 1.0, 1.0, "token")
    assert new_mask.tolist() == [[1, 0]]


def test_garbage_at_masked_positions_is_ignored():
    # inf and NaN log-probs where mask == 0 (e.g. padding the sampler never scored) change nothing
    old_logp, behav_logp, mask = log(PI_OLD), log(MU), t64(MASK)
    dirty_old, dirty_behav = old_logp.clone(), behav_logp.clone()
    dirty_old[0, 3], dirty_behav[0, 3] = -math.inf, -math.inf  # log k = NaN
    dirty_behav[1, 1] = math.nan
    dirty_old[2] = math.inf  # row 2 (fully masked): log k = +inf
    calls = [lambda o, b: truncated_importance_weights(o, b, mask, cap=2.0),
             lambda o, b: decoupled_importance_weights(o, b, mask, cap=2.0),
             lambda o, b: off_policy_mask(o, b, mask, 0.4, 1.5, "token"),
             lambda o, b: off_policy_mask(o, b, mask, 0.4, 1.5, "sequence")]
    for call in calls:
        clean, clean_stats = call(old_logp, behav_logp)
        dirty, dirty_stats = call(dirty_old, dirty_behav)
        assert torch.equal(clean, dirty)
        assert all(torch.equal(clean_stats[k], dirty_stats[k]) for k in clean_stats)


def test_huge_log_ratio_is_clamped():
    # log k = 50 is clamped to 20 before exp, as in policy_loss: the ratio stat is e^20, the gap stat the true 50
    old_logp, behav_logp, mask = t64([[0.0, 0.0]]), t64([[-50.0, 0.0]]), t64([[1, 1]])
    weights, stats = decoupled_importance_weights(old_logp, behav_logp, mask)
    close(weights, [[math.exp(LOG_RATIO_CLAMP), 1.0]])
    close(stats["behav_ratio_max"], math.exp(LOG_RATIO_CLAMP))
    assert stats["behav_gap_max"].item() == 50.0


# ---------------------------------------------------------------- the loss, by hand
#
# four tokens, clip 0.2 (ratio range [0.8, 1.2]); r = pi_theta / pi_old, k = pi_old / mu:
#   t0: pi_theta 0.6,  pi_old 0.4, mu 0.1,  A = +1: r = 1.5, clipped: L^CLIP = -1.2,  grad 0;       k = 4
#   t1: pi_theta 0.2,  pi_old 0.4, mu 0.8,  A = -1: r = 0.5, clipped: L^CLIP = 0.8,   grad 0;       k = 0.5
#   t2: pi_theta 0.3,  pi_old 0.3, mu 0.3,  A = +2: r = 1,   inside:  L^CLIP = -2,    dL/dlogp = -2;   k = 1
#   t3: pi_theta 0.55, pi_old 0.5, mu 0.25, A = +1: r = 1.1, inside:  L^CLIP = -1.1,  dL/dlogp = -1.1; k = 2
# token-mean over 4: loss = sum_t w_t L^CLIP_t / 4, d loss / d logp_t = w_t dL^CLIP_t/dlogp_t / 4
HAND_LOSS = {
    # tis, C = 3: w = 3, 0.5, 1, 2 -> (-3.6 + 0.4 - 2 - 2.2) / 4 = -7.4 / 4; grad t2 -2 / 4, t3 -2.2 / 4
    ("tis", 3.0, "token"): (-7.4 / 4, [0, 0, -0.5, -0.55], "truncated_frac", 1 / 4),
    # decoupled, no cap: w = k = 4, 0.5, 1, 2 -> (-4.8 + 0.4 - 2 - 2.2) / 4 = -8.6 / 4
    ("decoupled", None, "token"): (-8.6 / 4, [0, 0, -0.5, -0.55], "filtered_frac", 0.0),
    # decoupled, cap 3: t0 (k = 4) dropped -> (0 + 0.4 - 2 - 2.2) / 4 = -3.8 / 4; still divided by 4 tokens
    ("decoupled", 3.0, "token"): (-3.8 / 4, [0, 0, -0.5, -0.55], "filtered_frac", 1 / 4),
    # icepop, band [0.6, 5], token: t1 (k = 0.5) dropped, the others weighted by k -> (-4.8 + 0 - 2 - 2.2) / 4
    ("icepop", (0.6, 5.0), "token"): (-9.0 / 4, [0, 0, -0.5, -0.55], "masked_frac", 1 / 4),
    # icepop, sequence: the row's geometric mean (4 * 0.5 * 1 * 2)^(1/4) = sqrt 2 is inside [0.6, 5]: all kept
    ("icepop", (0.6, 5.0), "sequence"): (-8.6 / 4, [0, 0, -0.5, -0.55], "masked_frac", 0.0),
    # ... and outside [0.6, 1.2]: the whole row dropped, loss 0, gradient 0
    ("icepop", (0.6, 1.2), "sequence"): (0.0, [0, 0, 0, 0], "masked_seq_frac", 1.0),
}


@pytest.mark.parametrize("correction,setting,level", list(HAND_LOSS))
def test_policy_loss_off_policy_hand_worked(correction, setting, level):
    expected_loss, expected_grad, stat, expected_stat = HAND_LOSS[(correction, setting, level)]
    logp = log([[0.6, 0.2, 0.3, 0.55]]).requires_grad_(True)
    kwargs = {"cap": setting} if correction != "icepop" else {"band": setting, "mask_level": level}
    loss, stats = policy_loss_off_policy(logp, log([[0.4, 0.4, 0.3, 0.5]]), log([[0.1, 0.8, 0.3, 0.25]]),
                                         t64([[1.0, -1.0, 2.0, 1.0]]), t64([[1, 1, 1, 1]]), correction, **kwargs)
    loss.backward()
    close(loss, expected_loss)
    close(logp.grad, [expected_grad])
    close(stats[stat], expected_stat)
    close(stats["clipfrac"], 2 / 4)
    close(stats["ratio_mean"], (1.5 + 0.5 + 1 + 1.1) / 4)
    close(stats["behav_ratio_mean"], (4 + 0.5 + 1 + 2) / 4)
    close(stats["behav_gap_max"], math.log(4))
    assert all(not v.requires_grad and v.dim() == 0 for v in stats.values())


def test_dual_clip_applies_before_the_weight():
    # one token, r = e^5, A = -1, dual clip 3: L^CLIP = min(e^5, 3) = 3 (grad 0); TIS weight min(k = 4, 2) = 2 -> 6
    logp = t64([[5.0]]).requires_grad_(True)
    loss, stats = policy_loss_off_policy(logp, t64([[0.0]]), log([[0.25]]), t64([[-1.0]]), t64([[1]]),
                                         "tis", cap=2.0, dual_clip=3.0)
    loss.backward()
    close(loss, 6.0)
    assert logp.grad.item() == 0 and stats["dual_clipfrac"].item() == 1


# ---------------------------------------------------------------- the loss against a plain-Python loop

def python_off_policy_loss(logp, old_logp, behav_logp, advantages, mask, correction, cap=None, band=None,
                           mask_level="token", clip_low=0.2, clip_high=0.2, dual_clip=None, agg="token-mean"):
    """Token by token, in plain Python, with the weights as Python floats (constants) and each token's loss a 0-dim
    float64 tensor of logp, so that autograd gives the reference gradient."""
    B, T = logp.shape
    row_sums, row_counts = [], []
    for b in range(B):
        real = [t for t in range(T) if mask[b, t].item() == 1]
        log_k = {t: old_logp[b, t].item() - behav_logp[b, t].item() for t in real}
        if correction == "icepop" and mask_level == "sequence" and real:
            row_kept = band[0] <= math.exp(sum(log_k.values()) / len(real)) <= band[1]
        row_sum = 0.0
        for t in real:
            k = math.exp(log_k[t])
            if correction == "tis":
                w = min(k, cap)
            elif correction == "decoupled":
                w = 0.0 if cap is not None and k > cap else k
            else:
                kept = row_kept if mask_level == "sequence" else band[0] <= k <= band[1]
                w = k if kept else 0.0
            r = torch.exp(logp[b, t] - old_logp[b, t])
            a = advantages[b, t].item()
            # max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) = -A min(r, 1 + eps_high) for A >= 0,
            #                                                     |A| max(r, 1 - eps_low) for A < 0
            if a >= 0:
                token_loss = -a * torch.clamp(r, max=1 + clip_high)
            else:
                token_loss = -a * torch.clamp(r, min=1 - clip_low)
                if dual_clip is not None:
                    token_loss = torch.clamp(token_loss, max=dual_clip * -a)
            row_sum = row_sum + w * token_loss
        row_sums.append(row_sum)
        row_counts.append(len(real))
    n_tokens = sum(row_counts)
    n_seqs = sum(1 for n in row_counts if n > 0)
    if agg == "token-mean":
        return sum(row_sums) / n_tokens
    if agg == "seq-mean-token-mean":
        return sum(s / n for s, n in zip(row_sums, row_counts) if n > 0) / n_seqs
    if agg == "seq-mean-token-sum":
        return sum(row_sums) / n_seqs
    return sum(row_sums) / (n_seqs * T)  # seq-mean-token-sum-norm with the default norm_const T


def random_batch(seed, dtype=F64):
    """Random [3, 5] log-probs with holes in the mask: k = pi_old / mu spread over about e^-1 .. e^1."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1, 1, 0, 1, 1], [1, 0, 1, 1, 0], [0, 1, 1, 0, 1]], dtype=dtype)
    old_logp = -torch.rand(3, 5, generator=g, dtype=F64) * 3
    behav_logp = old_logp + 0.5 * torch.randn(3, 5, generator=g, dtype=F64)
    logp = old_logp + 0.3 * torch.randn(3, 5, generator=g, dtype=F64)
    advantages = torch.randn(3, 5, generator=g, dtype=F64)
    return [x.to(dtype) for x in (logp, old_logp, behav_logp, advantages)] + [mask]


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("correction,kwargs", CORRECTIONS)
@pytest.mark.parametrize("dual_clip", [None, 1.5])
def test_matches_a_python_loop_value_and_gradient(correction, kwargs, agg, dual_clip):
    logp, old_logp, behav_logp, advantages, mask = random_batch(0)
    logp.requires_grad_(True)
    loss, stats = policy_loss_off_policy(logp, old_logp, behav_logp, advantages, mask, correction, **kwargs,
                                         dual_clip=dual_clip, agg=agg)
    (grad,) = torch.autograd.grad(loss, logp)
    logp_ref = logp.detach().clone().requires_grad_(True)
    ref_loss = python_off_policy_loss(logp_ref, old_logp, behav_logp, advantages, mask, correction, **kwargs,
                                      dual_clip=dual_clip, agg=agg)
    ref_loss.backward()
    close(loss, ref_loss, tol=1e-14)
    close(grad, logp_ref.grad, tol=1e-14)
    # the batch exercises both branches of the clip and of the correction, so the comparison is not vacuous
    assert 0 < stats["clipfrac"].item() < 1
    correction_frac = {"tis": "truncated_frac", "decoupled": "filtered_frac", "icepop": "masked_frac"}[correction]
    if kwargs.get("cap", 1) is not None:
        assert 0 < stats[correction_frac].item() < 1
    if dual_clip is not None:
        assert stats["dual_clipfrac"].item() > 0


# ---------------------------------------------------------------- reduction to policy_loss and edge cases

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("correction,kwargs", CORRECTIONS)
def test_on_policy_reduces_to_policy_loss_bit_for_bit(correction, kwargs, dtype):
    # mu == pi_old: every k_t is exp(0) = 1 exactly, so w_t = 1 and L_t = 1 * L^CLIP_t is L^CLIP_t to the bit
    logp, old_logp, _, advantages, mask = random_batch(1, dtype)
    mask[1] = 0  # and a fully masked row
    for agg in AGG_MODES:
        for dual_clip in (None, 1.5):
            logp_a = logp.clone().requires_grad_(True)
            logp_b = logp.clone().requires_grad_(True)
            loss_a, stats_a = policy_loss_off_policy(logp_a, old_logp, old_logp.clone(), advantages, mask,
                                                     correction, **kwargs, dual_clip=dual_clip, agg=agg)
            loss_b, stats_b = policy_loss(logp_b, old_logp, advantages, mask, dual_clip=dual_clip, agg=agg)
            loss_a.backward()
            loss_b.backward()
            assert torch.equal(loss_a, loss_b)
            assert torch.equal(logp_a.grad, logp_b.grad)
            assert all(torch.equal(stats_a[k], stats_b[k]) for k in stats_b)
            assert stats_a["behav_ratio_max"].item() == 1 and stats_a["behav_gap_max"].item() == 0
            frac = [k for k in ("truncated_frac", "filtered_frac", "masked_frac") if k in stats_a]
            assert len(frac) == 1 and stats_a[frac[0]].item() == 0


@pytest.mark.parametrize("correction,kwargs", CORRECTIONS)
def test_fully_masked_rows_and_batch(correction, kwargs):
    logp, old_logp, behav_logp, advantages, mask = random_batch(2)
    # a fully masked row changes neither the loss nor the other rows' gradients, and gets none itself
    logp_all = logp.clone().requires_grad_(True)
    mask_holed = mask.clone()
    mask_holed[2] = 0
    loss, _ = policy_loss_off_policy(logp_all, old_logp, behav_logp, advantages, mask_holed, correction, **kwargs)
    loss.backward()
    logp_rows = logp[:2].clone().requires_grad_(True)
    loss_rows, _ = policy_loss_off_policy(logp_rows, old_logp[:2], behav_logp[:2], advantages[:2], mask[:2],
                                          correction, **kwargs)
    loss_rows.backward()
    assert torch.equal(loss, loss_rows)
    assert torch.equal(logp_all.grad[:2], logp_rows.grad) and torch.all(logp_all.grad[2] == 0)
    # a fully masked batch: loss 0, gradient 0, every stat 0, nothing NaN
    for agg in AGG_MODES:
        logp_none = logp.clone().requires_grad_(True)
        loss, stats = policy_loss_off_policy(logp_none, old_logp, behav_logp, advantages, torch.zeros_like(mask),
                                             correction, **kwargs, agg=agg)
        loss.backward()
        assert loss.item() == 0 and torch.all(logp_none.grad == 0)
        assert all(v.item() == 0 for v in stats.values())


def test_weights_are_detached():
    # gradient reaches logp only: none flows into behav_logp through w_t, and none into old_logp through w_t
    # (old_logp's only path is the ratio r_t, exactly as in policy_loss)
    logp, old_logp, behav_logp, advantages, mask = random_batch(3)
    for correction, kwargs in CORRECTIONS:
        old_a = old_logp.clone().requires_grad_(True)
        old_b = old_logp.clone().requires_grad_(True)
        behav = behav_logp.clone().requires_grad_(True)
        loss, _ = policy_loss_off_policy(logp, old_a, behav, advantages, mask, correction, **kwargs)
        loss.backward()
        assert behav.grad is None
        # the same loss with the weights computed beforehand as constants has the same old_logp gradient
        if correction == "tis":
            weights, _ = truncated_importance_weights(old_logp, behav_logp, mask, kwargs["cap"])
        elif correction == "decoupled":
            weights, _ = decoupled_importance_weights(old_logp, behav_logp, mask, kwargs["cap"])
        else:
            keep, _ = off_policy_mask(old_logp, behav_logp, mask, *kwargs["band"], kwargs["mask_level"])
            weights, _ = decoupled_importance_weights(old_logp, behav_logp, keep)
        assert not weights.requires_grad
        ratio = torch.exp(logp - old_b)
        clipped = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 0.8, 1.2))
        ((clipped * weights * mask).sum() / mask.sum()).backward()
        close(old_a.grad, old_b.grad, tol=1e-15)
    weights, _ = truncated_importance_weights(old_logp.requires_grad_(True), behav_logp, mask, cap=2.0)
    assert not weights.requires_grad


def test_bad_arguments_name_the_argument():
    logp, old_logp, behav_logp, advantages, mask = random_batch(4)
    with pytest.raises(ValueError, match="correction"):
        policy_loss_off_policy(logp, old_logp, behav_logp, advantages, mask, "vtrace")
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss_off_policy(logp, old_logp, behav_logp, advantages, mask, "tis", dual_clip=1.0)
    for cap in (None, 0.5):
        with pytest.raises(ValueError, match="cap"):
            policy_loss_off_policy(logp, old_logp, behav_logp, advantages, mask, "tis", cap=cap)
    with pytest.raises(ValueError, match="cap"):
        decoupled_importance_weights(old_logp, behav_logp, mask, cap=0.9)
    for low, high in ((1.1, 2.0), (0.5, 0.9)):
        with pytest.raises(ValueError, match="low <= 1 <= high"):
            off_policy_mask(old_logp, behav_logp, mask, low, high)
    with pytest.raises(ValueError, match="level"):
        off_policy_mask(old_logp, behav_logp, mask, 0.5, 2.0, level="batch")
