"""Four peer policy losses in ppo_core.algo: SAPO, GMPO, Clip-Cov and KL-Cov, by hand and against float64 loops.

    python -m pytest -q tests/test_losses_peers.py

  sapo      L_t = -sigmoid(tau_t (r_t - 1)) 4 / tau_t A_t,  tau_t = tau_pos if A_t > 0 else tau_neg  (arXiv:2511.20347)
  gmpo      l_i = -{prod_t |min(r_it A_i, clip(r_it, e^-eps_low, e^eps_high) A_i)|}^(1/|y_i|) sgn(A_i)
                                                                                        (arXiv:2507.20673)
  clip_cov  PPO's clipped surrogate, 0 on a few tokens drawn from a covariance band    (arXiv:2505.22617)
  kl_cov    -A_t r_t, plus beta |log r_t| on the tokens of largest covariance           (arXiv:2505.22617)

Each loss: a case worked by hand (numbers in the comments), its value and gradient against a plain-Python float64 loop
written from the paper's equation (every loss_agg, with and without per-token weights), its statistics and edge cases
(holes, fully masked rows, an empty batch); then the POLICY_LOSSES entries, the config fields and refusals, and the
fused LM head (ppo_kernels.linear_logprob_loss, chunks of rows) against the plain one for every kind.
Tolerances: the loop and torch compute the same float64 expressions in another order (math.exp against torch.exp, sums
of at most 35 terms); on these inputs they differ by 3.6e-15 at most (16 units of 2^-52, values and gradients below
10). TOL = 1e-14 absorbs that and no more (the fused head against full logits differs by 2.2e-16 at most). A wrong
formula fails a case below: 23 mutations of algo.py (a sign, a missing or one-sided clip, swapped taus, an inclusive
band, the global RNG, the wrong tokens ranked, ties to the later position, an uncoupled entry) each failed a test.
"""
import inspect
import math

import pytest
import torch

import ppo_kernels
import ppo_kernels.loss as kernel_loss
from ppo_core import algo
from ppo_core.config import ConfigError, PPOConfig, build_config

F64 = torch.float64
TOL = 1e-14
EPS64 = torch.finfo(F64).eps


def t64(rows):
    return torch.tensor(rows, dtype=F64)


def random_batch(seed, B=5, T=7, spread=0.5, token_advantages=False):
    """float64 [B, T] inputs: log-probs, old log-probs spread around them (ratios well outside PPO's band), advantages
    (one per row, or per token), a mask with a hole mid-row, a short row and a fully masked row."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=F64) * 3
    old_logp = logp + spread * torch.randn(B, T, generator=g, dtype=F64)
    if token_advantages:
        advantages = torch.randn(B, T, generator=g, dtype=F64) * 2
    else:
        advantages = (torch.randn(B, 1, generator=g, dtype=F64) * 2).expand(B, T).clone()
    mask = torch.ones(B, T, dtype=F64)
    mask[0, 3] = 0  # a hole
    mask[1, 4:] = 0  # a short row
    mask[2] = 0  # a fully masked row
    return logp, old_logp, advantages, mask


def run_head(head, hidden, weight, labels, objective, **kwargs):
    """A loss head (fused or reference) on copies of hidden and weight, forward and backward -> (loss, dhidden,
    dweight, stats)."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, stats, _, _ = head(h, w, labels, objective, **kwargs)
    loss.backward()
    return loss.detach(), h.grad, w.grad, stats


def agg_coefficients(mask, agg, num_tokens=None, num_seqs=None):
    """c_it with aggregate(loss, mask, agg) = sum_it c_it loss_it, from the definitions in algo.aggregate's doc."""
    rows = mask.tolist()
    n = [sum(row) for row in rows]
    tokens = sum(n) if num_tokens is None else num_tokens
    seqs = sum(1 for k in n if k > 0) if num_seqs is None else num_seqs
    T = len(rows[0])
    per_row = {"token-mean": lambda k: 1 / tokens, "seq-mean-token-mean": lambda k: 1 / (k * seqs),
               "seq-mean-token-sum": lambda k: 1 / seqs, "seq-mean-token-sum-norm": lambda k: 1 / (seqs * T)}[agg]
    return [[per_row(n[i]) if m else 0.0 for m in row] for i, row in enumerate(rows)]


def loss_and_grad(fn, logp, *args, **kwargs):
    logp = logp.detach().clone().requires_grad_(True)
    loss, stats = fn(logp, *args, **kwargs)
    loss.backward()
    return loss.item(), logp.grad, stats


def assert_close(loss, grad, ref_loss, ref_grad):
    assert abs(loss - ref_loss) <= TOL, (loss, ref_loss)
    assert (grad - t64(ref_grad)).abs().max().item() <= TOL


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def clip(x, low, high):
    return min(max(x, low), high)


# ---------------------------------------------------------------- SAPO

def sapo_loop(logp, old_logp, advantages, mask, tau_pos, tau_neg, agg, weights=None):
    """SAPO's loss and d loss / d logp, one token at a time from the paper's f_t(r) = sigmoid(tau (r - 1)) 4 / tau."""
    c = agg_coefficients(mask, agg)
    loss, grad = 0.0, [[0.0] * mask.shape[1] for _ in range(mask.shape[0])]
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[i, t]:
                continue
            A, w = advantages[i, t].item(), 1.0 if weights is None else weights[i, t].item()
            r = math.exp(logp[i, t].item() - old_logp[i, t].item())
            tau = tau_pos if A > 0 else tau_neg
            s = sigmoid(tau * (r - 1))
            loss += c[i][t] * w * -(s * 4 / tau) * A
            # d/d logp [-(4/tau) sigmoid(tau (r - 1)) A] = -A r 4 sigmoid (1 - sigmoid)
            grad[i][t] = c[i][t] * w * -A * r * 4 * s * (1 - s)
    return loss, grad


def test_sapo_hand_worked():
    # t0: A = +1, r = 1.5, tau_pos = 1: L = -4 sigmoid(0.5),       dL/dlogp = -1.5 * 4 sigmoid(0.5) sigmoid(-0.5)
    # t1: A = -2, r = 0.5, tau_neg = 2: L = +2 * 2 sigmoid(-1),    dL/dlogp = +2 * 0.5 * 4 sigmoid(-1) sigmoid(1)
    # t2: A = 0,  r = 1.5, tau_neg = 2 (A <= 0, as verl): L = 0, no gradient, gate weight 4 sigmoid(1) sigmoid(-1)
    # token-mean over 3 tokens. Swapping the taus gives t0 -4 sigmoid(1) / 2 ...: a different value.
    logp = t64([[math.log(0.6), math.log(0.2), math.log(0.6)]])
    old_logp = t64([[math.log(0.4), math.log(0.4), math.log(0.4)]])
    loss, grad, stats = loss_and_grad(algo.sapo_policy_loss, logp, old_logp, t64([[1.0, -2.0, 0.0]]), t64([[1, 1, 1]]),
                                      sapo_tau_pos=1.0, sapo_tau_neg=2.0)
    s0, s1, s2 = sigmoid(0.5), sigmoid(-1.0), sigmoid(1.0)
    assert loss == pytest.approx((-4 * s0 + 4 * s1) / 3, abs=1e-15)
    assert grad[0].tolist() == pytest.approx([-1.5 * 4 * s0 * (1 - s0) / 3, 2 * 0.5 * 4 * s1 * (1 - s1) / 3, 0.0],
                                             abs=1e-15)
    assert set(stats) == {"sapo_gate_weight", "approx_kl", "ratio_mean", "ratio_max_dev"}  # nothing clipped
    assert stats["sapo_gate_weight"].item() == pytest.approx(
        (4 * s0 * (1 - s0) + 4 * s1 * (1 - s1) + 4 * s2 * (1 - s2)) / 3, abs=1e-15)
    assert stats["ratio_max_dev"].item() == pytest.approx(0.5, abs=1e-15)


@pytest.mark.parametrize("agg", algo.AGG_MODES)
@pytest.mark.parametrize("taus", [(1.0, 1.05), (0.5, 3.0)])
def test_sapo_against_a_float64_loop(agg, taus):
    logp, old_logp, advantages, mask = random_batch(0, token_advantages=True)
    weights = torch.rand(mask.shape, generator=torch.Generator().manual_seed(1), dtype=F64) * 2
    for w in (None, weights):
        loss, grad, _ = loss_and_grad(algo.sapo_policy_loss, logp, old_logp, advantages, mask, *taus,
                                      agg=algo.Aggregation(agg, weights=w))
        assert_close(loss, grad, *sapo_loop(logp, old_logp, advantages, mask, *taus, agg, w))


def test_sapo_gradient_on_policy_is_the_policy_gradient():
    # at r = 1: d/d logp [-f(r) A] = -A f'(1) r = -A, the unclipped policy gradient (PPO's, where nothing is clipped)
    logp, _, advantages, mask = random_batch(2, token_advantages=True)
    advantages[0, :2] = 0.0  # A = 0: no gradient either way
    _, pg_grad, _ = loss_and_grad(algo.policy_loss, logp, logp, advantages, mask)
    assert pg_grad.abs().max() > 0.1
    for tau_neg in (1.0, 2.0, 0.5):  # a power of two: (4 / tau) * tau is exact, so is the gradient
        _, grad, stats = loss_and_grad(algo.sapo_policy_loss, logp, logp, advantages, mask, 1.0, tau_neg)
        assert torch.equal(grad, pg_grad)
        assert stats["sapo_gate_weight"].item() == 1.0 and stats["ratio_max_dev"].item() == 0.0
    # the paper's tau_neg = 1.05: the chain rule rounds 4 / tau, then (. * 4 / tau) and (. * tau): 1.5 ulp at most
    _, grad, _ = loss_and_grad(algo.sapo_policy_loss, logp, logp, advantages, mask, 1.0, 1.05)
    assert ((grad - pg_grad).abs() <= 1.5 * EPS64 * pg_grad.abs()).all()
    positive = advantages > 0
    assert torch.equal(grad[positive], pg_grad[positive])  # tau_pos = 1: exact
    # the value there is f(1) = 2 / tau per unit of advantage, not PPO's 1
    loss, _, _ = loss_and_grad(algo.sapo_policy_loss, logp, logp, advantages, mask, 1.0, 2.0)
    expected = sum(-(2.0 if a > 0 else 1.0) * a for a, m in zip(advantages.flatten().tolist(), mask.flatten()) if m)
    assert loss == pytest.approx(expected / mask.sum().item(), abs=TOL)


def test_sapo_far_off_policy_is_damped_not_cut():
    # PPO gives r = 3 (A > 0) no gradient; SAPO a smaller one, 4 sigmoid(2)(1 - sigmoid(2)) * r of the policy gradient
    logp, old_logp, mask = t64([[math.log(0.9)]]), t64([[math.log(0.3)]]), t64([[1]])
    _, grad, stats = loss_and_grad(algo.sapo_policy_loss, logp, old_logp, t64([[1.0]]), mask)
    r = math.exp(math.log(0.9) - math.log(0.3))  # 3 up to rounding, which the gate's slope would amplify
    s = sigmoid(r - 1)
    assert grad.item() == pytest.approx(-r * 4 * s * (1 - s), abs=1e-15)
    assert loss_and_grad(algo.policy_loss, logp, old_logp, t64([[1.0]]), mask)[1].item() == 0.0
    # a log-ratio past LOG_RATIO_CLAMP stays finite
    loss, grad, _ = loss_and_grad(algo.sapo_policy_loss, t64([[0.0]]), t64([[-90.0]]), t64([[-1.0]]), mask)
    assert math.isfinite(loss) and torch.isfinite(grad).all()


# ---------------------------------------------------------------- GMPO

def gmpo_loop(logp, old_logp, advantages, mask, eps_low, eps_high, num_seqs=None):
    """GMPO's loss and gradient from the paper's product form, row by row:
    l_i = -{prod_t |min(r A_i, clip(r, e^-eps_low, e^eps_high) A_i)|}^(1/n_i) sgn(A_i), L = 1/G sum_i l_i;
    d l_i / d logp_t = -A_i gbar_i / n_i on a token whose ratio the min keeps, 0 on one held at the bound."""
    lo, hi = math.exp(-eps_low), math.exp(eps_high)
    rows = [i for i in range(mask.shape[0]) if mask[i].sum() > 0]
    G = len(rows) if num_seqs is None else num_seqs
    loss, grad = 0.0, [[0.0] * mask.shape[1] for _ in range(mask.shape[0])]
    for i in rows:
        real = [t for t in range(mask.shape[1]) if mask[i, t]]
        A = sum(advantages[i, t].item() for t in real) / len(real)
        product, kept = 1.0, []
        for t in real:
            r = math.exp(logp[i, t].item() - old_logp[i, t].item())
            # min(r A, clip(r) A) for either sign of A: the smaller objective
            product *= abs(min(r * A, clip(r, lo, hi) * A))
            # held at the bound (the clipped term strictly smaller): r > e^eps_high for A > 0, r < e^-eps_low for A < 0
            kept.append(not (r > hi if A > 0 else r < lo))
        if A == 0:
            continue
        geometric = product ** (1 / len(real))  # |A| gbar
        loss += -geometric * math.copysign(1, A) / G
        gbar = geometric / abs(A)
        for t, keep in zip(real, kept):
            grad[i][t] = -A * gbar / len(real) / G if keep else 0.0
    return loss, grad


def test_gmpo_hand_worked():
    # eps 0.4 each.  row 0, A = +1, log r = [0.6, -0.6, 0.2]: the pessimistic side is the min, so 0.6 -> 0.4 (held,
    #   no gradient), -0.6 and 0.2 kept: mean (0.4 - 0.6 + 0.2) / 3 = 0, gbar = 1, l_0 = -1; grads -1/3 on t1, t2.
    # row 1, A = -1, log r = [0.6, -0.6]: the max, so -0.6 -> -0.4 (held), 0.6 kept: mean 0.1, l_1 = +e^0.1;
    #   grad +e^0.1 / 2 on t0.   L = (l_0 + l_1) / 2; held: 2 of 5 real tokens.
    old_logp = t64([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    logp = old_logp + t64([[0.6, -0.6, 0.2], [0.6, -0.6, 0.0]])
    mask = t64([[1, 1, 1], [1, 1, 0]])
    loss, grad, stats = loss_and_grad(algo.gmpo_policy_loss, logp, old_logp, t64([[1.0] * 3, [-1.0] * 3]), mask)
    e = math.exp(0.1)
    assert loss == pytest.approx((-1 + e) / 2, abs=1e-15)
    assert grad.flatten().tolist() == pytest.approx([0, -1 / 6, -1 / 6, e / 4, 0, 0], abs=1e-15)
    assert stats["clipfrac"].item() == pytest.approx(2 / 5, abs=1e-15)
    assert stats["gmpo_ratio_mean"].item() == pytest.approx((1 + e) / 2, abs=1e-15)
    assert stats["ratio_max_dev"].item() == pytest.approx(math.exp(0.6) - 1, abs=1e-15)  # token-level


@pytest.mark.parametrize("eps", [(0.4, 0.4), (0.1, 0.3)])
def test_gmpo_against_a_float64_loop(eps):
    logp, old_logp, advantages, mask = random_batch(3, spread=0.4)
    advantages[3] = 0.0  # a row with A = 0: no loss, no gradient
    loss, grad, stats = loss_and_grad(algo.gmpo_policy_loss, logp, old_logp, advantages, mask, *eps)
    assert_close(loss, grad, *gmpo_loop(logp, old_logp, advantages, mask, *eps))
    assert 0.1 < stats["clipfrac"].item() < 0.9  # both branches of the min are exercised
    # rows split like micro-batches with the GLOBAL number of sequences: the parts sum to the whole
    parts = [loss_and_grad(algo.gmpo_policy_loss, logp[rows], old_logp[rows], advantages[rows], mask[rows], *eps,
                           agg=algo.Aggregation(num_seqs=4))[:2] for rows in (slice(0, 2), slice(2, 5))]
    assert abs(sum(p[0] for p in parts) - loss) <= TOL
    assert torch.equal(torch.cat([p[1] for p in parts]), grad)


def test_gmpo_edge_cases():
    logp, old_logp, advantages, mask = random_batch(4)
    with pytest.raises(ValueError, match="weights"):
        algo.gmpo_policy_loss(logp, old_logp, advantages, mask, agg=algo.Aggregation(weights=torch.ones_like(mask)))
    with pytest.raises(ValueError, match="gmpo_clip_low"):
        algo.gmpo_policy_loss(logp, old_logp, advantages, mask, gmpo_clip_low=-0.1)
    loss, grad, stats = loss_and_grad(algo.gmpo_policy_loss, logp, old_logp, advantages, torch.zeros_like(mask))
    assert loss == 0.0 and not grad.any() and stats["ratio_max_dev"].item() == 0.0
    # a masked position may hold anything: it changes nothing
    old_logp_inf = old_logp.clone()
    old_logp_inf[mask == 0] = -float("inf")
    assert loss_and_grad(algo.gmpo_policy_loss, logp, old_logp_inf, advantages, mask)[0] == \
        loss_and_grad(algo.gmpo_policy_loss, logp, old_logp, advantages, mask)[0]


# ---------------------------------------------------------------- Clip-Cov and KL-Cov

def covariances(logp, advantages, mask):
    """Cov_t = (A_t - mean A)(log pi_t - mean log pi) over the real tokens: {(i, t): Cov_t}, row-major."""
    real = [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]
    mean_a = sum(advantages[i, t].item() for i, t in real) / len(real)
    mean_logp = sum(logp[i, t].item() for i, t in real) / len(real)
    return {(i, t): (advantages[i, t].item() - mean_a) * (logp[i, t].item() - mean_logp) for i, t in real}


def clip_cov_loop(logp, old_logp, advantages, mask, clip_low, clip_high, ratio, lb, ub, agg, weights=None):
    """Clip-Cov as the authors' code: the candidates lb < Cov < ub not clipped by PPO, n = max(int(ratio N), 1) of them
    drawn by randperm of a Generator seeded with CLIP_COV_SEED; their term is 0, the others keep PPO's surrogate."""
    c, cov = agg_coefficients(mask, agg), covariances(logp, advantages, mask)
    ppo = {}
    for i, t in cov:
        A, r = advantages[i, t].item(), math.exp(logp[i, t].item() - old_logp[i, t].item())
        unclipped, clipped = -A * r, -A * clip(r, 1 - clip_low, 1 + clip_high)
        ppo[i, t] = (max(unclipped, clipped), -A * r if unclipped >= clipped else 0.0, clipped > unclipped)
    candidates = [key for key, value in cov.items() if lb < value < ub and not ppo[key][2]]
    n = max(int(ratio * len(cov)), 1)
    order = torch.randperm(len(candidates), generator=torch.Generator().manual_seed(algo.CLIP_COV_SEED)).tolist()
    drawn = {candidates[k] for k in order[:n]}
    loss, grad = 0.0, [[0.0] * mask.shape[1] for _ in range(mask.shape[0])]
    for (i, t), (value, gradient, _) in ppo.items():
        if (i, t) in drawn:
            continue
        w = 1.0 if weights is None else weights[i, t].item()
        loss += c[i][t] * w * value
        grad[i][t] = c[i][t] * w * gradient
    return loss, grad, len(drawn) / len(cov)


def test_clip_cov_hand_worked():
    # one row, r = 1 everywhere (nothing PPO-clipped). A = [3, -1, -1, -1] (mean 0); log pi = [-0.5, -2.5, -1.5, -1.5]
    # (mean -1.5): Cov = [3 * 1, -1 * -1, 0, 0] = [3, 1, 0, 0]. The band 1 < Cov < 5 is strict: t0 only (t1 sits on
    # the bound). ratio 0.5: n = 2 >= 1 candidate, so t0 is drawn: L = (0 + 1 + 1 + 1) / 4 = 3/4 (PPO's: 0),
    # dL/dlogp = [0, 1/4, 1/4, 1/4].
    logp = t64([[-0.5, -2.5, -1.5, -1.5]])
    loss, grad, stats = loss_and_grad(algo.clip_cov_policy_loss, logp, logp, t64([[3.0, -1.0, -1.0, -1.0]]),
                                      t64([[1, 1, 1, 1]]), clip_cov_ratio=0.5)
    assert loss == 0.75 and grad[0].tolist() == [0.0, 0.25, 0.25, 0.25]
    assert stats["clipcov_frac"].item() == 0.25 and stats["clipfrac"].item() == 0.0
    assert set(stats) == {"clipfrac", "clipcov_frac", "approx_kl", "ratio_mean", "ratio_max_dev"}
    # a PPO-clipped token is no candidate: t0 with r = 1.5 > 1.2 and A > 0 is held by the clip (its covariance,
    # still 3 from the current log-probs, is in the band), so nothing is drawn and the loss is PPO's
    old_logp = logp - t64([[math.log(1.5), 0, 0, 0]])
    loss, grad, stats = loss_and_grad(algo.clip_cov_policy_loss, logp, old_logp, t64([[3.0, -1.0, -1.0, -1.0]]),
                                      t64([[1, 1, 1, 1]]), clip_cov_ratio=0.5)
    assert stats["clipcov_frac"].item() == 0.0 and stats["clipfrac"].item() == 0.25
    assert loss == pytest.approx((-3 * 1.2 + 3) / 4, abs=1e-15)


@pytest.mark.parametrize("agg", algo.AGG_MODES)
def test_clip_cov_against_a_float64_loop(agg):
    logp, old_logp, advantages, mask = random_batch(5, spread=0.2, token_advantages=True)
    weights = torch.rand(mask.shape, generator=torch.Generator().manual_seed(6), dtype=F64) * 2
    settings = dict(clip_low=0.2, clip_high=0.28, clip_cov_ratio=0.15, clip_cov_lb=0.3, clip_cov_ub=2.0)
    for w in (None, weights):
        loss, grad, stats = loss_and_grad(algo.clip_cov_policy_loss, logp, old_logp, advantages, mask,
                                          agg=algo.Aggregation(agg, weights=w), **settings)
        ref_loss, ref_grad, drawn_frac = clip_cov_loop(logp, old_logp, advantages, mask, *settings.values(), agg, w)
        assert_close(loss, grad, ref_loss, ref_grad)
        assert stats["clipcov_frac"].item() == pytest.approx(drawn_frac, abs=1e-15)
        n_real = int(mask.sum())
        assert drawn_frac == int(0.15 * n_real) / n_real > 0  # more candidates than n = int(0.15 N): n drawn


def test_clip_cov_draw_is_reproducible_and_leaves_the_global_rng_alone():
    logp, old_logp, advantages, mask = random_batch(5, spread=0.2, token_advantages=True)
    settings = dict(clip_cov_ratio=0.15, clip_cov_lb=0.3, clip_cov_ub=2.0)
    rng = torch.get_rng_state()
    first = loss_and_grad(algo.clip_cov_policy_loss, logp, old_logp, advantages, mask, **settings)
    assert torch.equal(torch.get_rng_state(), rng)
    torch.manual_seed(123)  # another global state: the same draw
    second = loss_and_grad(algo.clip_cov_policy_loss, logp, old_logp, advantages, mask, **settings)
    assert first[0] == second[0] and torch.equal(first[1], second[1])
    # the paper's ratio 2e-4 on a few tokens: at least one token is drawn
    _, _, stats = loss_and_grad(algo.clip_cov_policy_loss, logp, old_logp, advantages, mask, clip_cov_lb=0.3,
                                clip_cov_ub=2.0)
    assert stats["clipcov_frac"].item() == pytest.approx(1 / mask.sum().item(), abs=1e-15)


def test_clip_cov_edge_cases():
    logp, old_logp, advantages, mask = random_batch(7, spread=0.2, token_advantages=True)
    # no candidate in the band (the paper's 1 < Cov < 5 with these small covariances): exactly PPO's loss
    far = dict(clip_cov_lb=100.0, clip_cov_ub=200.0)
    loss, grad, stats = loss_and_grad(algo.clip_cov_policy_loss, logp, old_logp, advantages, mask, **far)
    ppo_loss, ppo_grad, ppo_stats = loss_and_grad(algo.policy_loss, logp, old_logp, advantages, mask)
    assert loss == ppo_loss and torch.equal(grad, ppo_grad) and stats["clipcov_frac"].item() == 0.0
    assert all(torch.equal(stats[k], ppo_stats[k]) for k in ppo_stats)
    loss, grad, stats = loss_and_grad(algo.clip_cov_policy_loss, logp, old_logp, advantages, torch.zeros_like(mask))
    assert loss == 0.0 and not grad.any() and stats["clipcov_frac"].item() == 0.0
    for bad in (dict(clip_cov_ratio=0.0), dict(clip_cov_lb=5.0, clip_cov_ub=1.0)):
        with pytest.raises(ValueError, match="clip_cov"):
            algo.clip_cov_policy_loss(logp, old_logp, advantages, mask, **bad)


def kl_cov_loop(logp, old_logp, advantages, mask, ratio, coef, agg, weights=None):
    """KL-Cov as the authors' code: the k = max(int(ratio N), 1) tokens of largest Cov (ties to the earlier position)
    get -A r + beta |log r|, the others -A r; no clip."""
    c, cov = agg_coefficients(mask, agg), covariances(logp, advantages, mask)
    ranked = sorted(cov, key=lambda key: (-cov[key], key))
    penalised = set(ranked[:max(int(ratio * len(cov)), 1)])
    loss, grad = 0.0, [[0.0] * mask.shape[1] for _ in range(mask.shape[0])]
    for i, t in cov:
        A, log_r = advantages[i, t].item(), logp[i, t].item() - old_logp[i, t].item()
        w = 1.0 if weights is None else weights[i, t].item()
        beta = coef if (i, t) in penalised else 0.0
        loss += c[i][t] * w * (-A * math.exp(log_r) + beta * abs(log_r))
        grad[i][t] = c[i][t] * w * (-A * math.exp(log_r) + beta * math.copysign(1, log_r))
    return loss, grad, len(penalised) / len(cov)


def test_kl_cov_hand_worked():
    # the covariances of test_clip_cov_hand_worked, [3, 1, 0, 0]; log r = [0.1, -0.3, 0.2, 0]; ratio 0.25: k = 1, t0.
    # L = [(-3 e^0.1 + 0.1), e^-0.3, e^0.2, 1] / 4;  dL/dlogp = [(-3 e^0.1 + 1), e^-0.3, e^0.2, 1] / 4.
    # t1 (A < 0, r = 0.74 < 0.8) is clipped by PPO (gradient 0); KL-Cov has no clip and keeps its gradient.
    logp, log_r = t64([[-0.5, -2.5, -1.5, -1.5]]), [0.1, -0.3, 0.2, 0.0]
    args = (logp - t64([log_r]), t64([[3.0, -1.0, -1.0, -1.0]]), t64([[1, 1, 1, 1]]))
    loss, grad, stats = loss_and_grad(algo.kl_cov_policy_loss, logp, *args, kl_cov_ratio=0.25)
    e = [math.exp(x) for x in log_r]
    assert loss == pytest.approx((-3 * e[0] + 0.1 + e[1] + e[2] + 1) / 4, abs=1e-15)
    assert grad[0].tolist() == pytest.approx([(-3 * e[0] + 1) / 4, e[1] / 4, e[2] / 4, 0.25], abs=1e-15)
    assert set(stats) == {"klcov_frac", "approx_kl", "ratio_mean", "ratio_max_dev"}  # nothing clipped
    assert stats["klcov_frac"].item() == 0.25
    assert loss_and_grad(algo.policy_loss, logp, *args)[1][0, 1].item() == 0.0  # what PPO's clip would do
    # kl_cov_coef = 0: the plain unclipped surrogate -A r
    loss, grad, _ = loss_and_grad(algo.kl_cov_policy_loss, logp, *args, kl_cov_ratio=0.25, kl_cov_coef=0.0)
    assert grad[0].tolist() == pytest.approx([-3 * e[0] / 4, e[1] / 4, e[2] / 4, 0.25], abs=1e-15)


@pytest.mark.parametrize("agg", algo.AGG_MODES)
def test_kl_cov_against_a_float64_loop(agg):
    logp, old_logp, advantages, mask = random_batch(8, token_advantages=True)
    weights = torch.rand(mask.shape, generator=torch.Generator().manual_seed(9), dtype=F64) * 2
    for ratio, coef in ((0.2, 1.0), (2e-3, 0.5)):
        for w in (None, weights):
            loss, grad, stats = loss_and_grad(algo.kl_cov_policy_loss, logp, old_logp, advantages, mask, ratio, coef,
                                              agg=algo.Aggregation(agg, weights=w))
            ref_loss, ref_grad, frac = kl_cov_loop(logp, old_logp, advantages, mask, ratio, coef, agg, w)
            assert_close(loss, grad, ref_loss, ref_grad)
            assert stats["klcov_frac"].item() == pytest.approx(frac, abs=1e-15)


def test_kl_cov_ties_and_edge_cases():
    # 7 real tokens, mean A = 3/7, mean log pi = -9/7: Cov = (4/7)(2/7) = 8/49 where A = 1, log pi = -1, and
    # (-10/7)(-5/7) = 50/49 on t3 of both rows, a tie. ratio 0.2: k = int(1.4) = 1, the earlier position (0, 3).
    logp = t64([[-1.0, -1.0, -1.0, -2.0], [-1.0, -1.0, -1.0, -2.0]])
    advantages = t64([[1.0, 1.0, 1.0, -1.0], [1.0, 1.0, 1.0, -1.0]])
    mask = t64([[0, 1, 1, 1], [1, 1, 1, 1]])
    _, grad, stats = loss_and_grad(algo.kl_cov_policy_loss, logp, logp - 0.1, advantages, mask, kl_cov_ratio=0.2)
    penalised = (grad - (-advantages * math.exp(0.1)) * mask / 7).abs() > 1e-12  # the penalty adds +1/7
    assert penalised.tolist() == [[False, False, False, True], [False] * 4]
    assert stats["klcov_frac"].item() == pytest.approx(1 / 7, abs=1e-15)
    loss, grad, stats = loss_and_grad(algo.kl_cov_policy_loss, logp, logp, advantages, torch.zeros_like(mask))
    assert loss == 0.0 and not grad.any() and stats["klcov_frac"].item() == 0.0
    with pytest.raises(ValueError, match="kl_cov_ratio"):
        algo.kl_cov_policy_loss(logp, logp, advantages, mask, kl_cov_ratio=1.5)
    with pytest.raises(ValueError, match="kl_cov_coef"):
        algo.kl_cov_policy_loss(logp, logp, advantages, mask, kl_cov_coef=-1.0)


# ---------------------------------------------------------------- their entries, the config, the fused head

NEW_KINDS = {"sapo": (algo.sapo_policy_loss, "token"), "gmpo": (algo.gmpo_policy_loss, "row"),
             "clip_cov": (algo.clip_cov_policy_loss, "batch"), "kl_cov": (algo.kl_cov_policy_loss, "batch")}
PAPER_DEFAULTS = {"sapo_tau_pos": 1.0, "sapo_tau_neg": 1.05, "gmpo_clip_low": 0.4, "gmpo_clip_high": 0.4,
                  "clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0, "kl_cov_ratio": 2e-3,
                  "kl_cov_coef": 1.0}


def test_entries_settings_and_paper_defaults():
    cfg = PPOConfig()
    for kind, (fn, coupling) in NEW_KINDS.items():
        assert algo.policy_loss_function(kind) is fn and algo.loss_coupling(kind) == coupling
        settings = algo.loss_settings(kind, cfg)
        # every setting is a keyword of the function, and the config's default is the function's
        defaults = {k: v.default for k, v in inspect.signature(fn).parameters.items()}
        assert all(defaults[k] == v for k, v in settings.items())
    assert {k: getattr(cfg, k) for k in PAPER_DEFAULTS} == PAPER_DEFAULTS


@pytest.mark.parametrize("kind", NEW_KINDS)
def test_every_loss_reports_ratio_max_dev_as_detached_scalars(kind):
    logp, old_logp, advantages, mask = random_batch(10)
    loss, stats = algo.policy_loss_function(kind)(logp.requires_grad_(), old_logp, advantages, mask,
                                                  **algo.loss_settings(kind, PPOConfig()))
    assert loss.dim() == 0 and loss.requires_grad and "ratio_max_dev" in stats
    assert all(v.dim() == 0 and not v.requires_grad and torch.isfinite(v) for v in stats.values())
    assert ("clipfrac" in stats) == (kind in ("gmpo", "clip_cov"))  # only the losses that clip report it


def test_config_accepts_the_kinds_and_refuses_what_they_do_not_read():
    for kind in NEW_KINDS:
        build_config({}, {"policy_loss_kind": kind})
        with pytest.raises(ConfigError, match=f"config key 'dual_clip' has no effect with policy_loss_kind='{kind}'"):
            build_config({}, {"policy_loss_kind": kind, "dual_clip": "3"})
    off_policy = {"off_policy_correction": "tis", "old_logprobs_from_rollout": "false"}
    for kind in ("sapo", "clip_cov", "kl_cov"):  # token losses take the off-policy weights
        build_config({}, {"policy_loss_kind": kind, **off_policy})
    with pytest.raises(ConfigError, match="off_policy_correction"):
        build_config({}, {"policy_loss_kind": "gmpo", **off_policy})
    with pytest.raises(ConfigError, match="config key 'loss_agg' has no effect with policy_loss_kind='gmpo'"):
        build_config({}, {"policy_loss_kind": "gmpo", "loss_agg": "seq-mean-token-mean"})
    for kind, key, value, what in (("sapo", "sapo_tau_neg", "0", "must be > 0"),
                                   ("gmpo", "gmpo_clip_high", "-1", "must be >= 0"),
                                   ("clip_cov", "clip_cov_ratio", "2", r"must be in \(0, 1\]"),
                                   ("kl_cov", "kl_cov_ratio", "0", r"must be in \(0, 1\]"),
                                   ("clip_cov", "clip_cov_lb", "5", r"must be < clip_cov_ub \(5.0\)"),
                                   ("kl_cov", "kl_cov_coef", "-0.1", "must be >= 0")):
        with pytest.raises(ConfigError, match=f"^config key '{key}' {what}, got"):
            build_config({}, {"policy_loss_kind": kind, key: value})


@pytest.mark.parametrize("kind", NEW_KINDS)
def test_the_fused_head_trains_the_same_loss(kind, monkeypatch):
    """ppo_kernels.linear_logprob_loss in chunks of rows (a tile of 2 rows of 7 tokens) against full logits, float64:
    loss and both gradients. The coupled kinds get every row in one chunk; cut into chunks they would differ."""
    B, T, H, V = 6, 7, 8, 11
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(B, T, H, generator=g, dtype=F64)
    weight = torch.randn(V, H, generator=g, dtype=F64)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, 5:] = labels[3, 2] = -100  # padding and a hole
    mask = (labels != -100).to(F64)
    old_logp = ppo_kernels.linear_token_logprobs_reference(hidden, weight, labels).detach() + 0.3 * torch.randn(
        B, T, generator=g, dtype=F64) * mask
    advantages = torch.randn(B, 1, generator=g, dtype=F64).expand(B, T) * 3
    settings = algo.loss_settings(kind, PPOConfig())
    if kind == "clip_cov":
        settings.update(clip_cov_ratio=0.2, clip_cov_lb=0.2, clip_cov_ub=5.0)  # draw a few of these 39 tokens
    if kind == "kl_cov":
        settings.update(kl_cov_ratio=0.1)

    def objective(logp, entropy, rows):
        return algo.policy_loss_function(kind)(logp, old_logp[rows], advantages[rows], mask[rows],
                                               agg=algo.Aggregation(num_tokens=mask.sum(),
                                                                    num_seqs=(mask.sum(-1) > 0).sum()),
                                               **settings)

    monkeypatch.setattr(kernel_loss, "TORCH_LOSS_TILE_ELEMENTS", 2 * T * V)
    monkeypatch.setenv("PPO_KERNELS_BACKEND", "torch")
    reference = run_head(ppo_kernels.linear_logprob_loss_reference, hidden, weight, labels, objective)
    coupling = algo.loss_coupling(kind)  # the tiles update.policy_objective asks the fused head for
    fused = run_head(ppo_kernels.linear_logprob_loss, hidden, weight, labels, objective,
                     rows_separate=coupling != "batch", tokens_separate=coupling == "token")
    for a, b in zip(fused[:3], reference[:3]):
        assert (a - b).abs().max().item() <= TOL
    assert all(abs(fused[3][k].item() - reference[3][k].item()) <= TOL for k in reference[3])
    if kind == "clip_cov":
        assert 0 < reference[3]["clipcov_frac"].item() < 0.5
    if algo.loss_couples_rows(kind):  # the batch statistic needs every row at once
        split = run_head(ppo_kernels.linear_logprob_loss, hidden, weight, labels, objective, rows_separate=True)
        assert (split[1] - reference[1]).abs().max().item() > 1e-6  # each chunk's gradient of its own statistic
