"""The PPO paper's KL-penalised surrogate (policy_loss_kind='kl_penalty'), added by docs/adding-a-loss.md alone:

  L_t = -r_t A_t + beta (r_t - 1 - log r_t)          (Schulman et al. 2017, arXiv:1707.06347, eq. 8, fixed beta)

by hand, against a float64 loop for every loss_agg with and without per-token weights, its statistics, the config, and
the fused LM head against full logits. TOL as in tests/test_losses_peers.py: the loop and torch compute the same
float64 expressions in another order.

    python -m pytest -q tests/test_loss_kl_penalty.py
"""
import math

import pytest
import torch

import ppo_kernels
import ppo_kernels.loss as kernel_loss
from ppo_core import algo
from ppo_core.config import ConfigError, PPOConfig, build_config
from test_losses_peers import agg_coefficients, random_batch, run_head  # the same inputs, weights and head run

F64 = torch.float64
TOL = 1e-14


def t64(rows):
    return torch.tensor(rows, dtype=F64)


def kl_penalty_loop(logp, old_logp, advantages, mask, beta, agg, weights=None):
    """The loss and d loss / d logp one token at a time: d/dlogp [-r A + beta (r - 1 - log r)] = -r A + beta (r - 1)."""
    c = agg_coefficients(mask, agg)
    loss, grad = 0.0, [[0.0] * mask.shape[1] for _ in range(mask.shape[0])]
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[i, t]:
                A, w = advantages[i, t].item(), 1.0 if weights is None else weights[i, t].item()
                log_r = logp[i, t].item() - old_logp[i, t].item()
                r = math.exp(log_r)
                loss += c[i][t] * w * (-r * A + beta * (r - 1 - log_r))
                grad[i][t] = c[i][t] * w * (-r * A + beta * (r - 1))
    return loss, grad


def loss_and_grad(logp, *args, **kwargs):
    logp = logp.detach().clone().requires_grad_(True)
    loss, stats = algo.kl_penalty_policy_loss(logp, *args, **kwargs)
    loss.backward()
    return loss.item(), logp.grad, stats


def test_hand_worked():
    # t0: A = +1, r = 2,   beta = 0.5: L = -2 + 0.5 (1 - ln 2),  dL/dlogp = -2 + 0.5 * 1 = -1.5
    # t1: A = -1, r = 0.5, beta = 0.5: L = 0.5 + 0.5 (-0.5 + ln 2), dL/dlogp = 0.5 + 0.5 * -0.5 = 0.25
    # token-mean over 2 tokens; KL_t = 1 - ln 2 and ln 2 - 0.5
    logp = t64([[math.log(0.8), math.log(0.2)]])
    old_logp = t64([[math.log(0.4), math.log(0.4)]])
    loss, grad, stats = loss_and_grad(logp, old_logp, t64([[1.0, -1.0]]), t64([[1, 1]]), kl_penalty_beta=0.5)
    ln2 = math.log(2)
    assert loss == pytest.approx((-2 + 0.5 * (1 - ln2) + 0.5 + 0.5 * (ln2 - 0.5)) / 2, abs=1e-15)
    assert grad[0].tolist() == pytest.approx([-1.5 / 2, 0.25 / 2], abs=1e-15)
    assert set(stats) == {"kl_penalty", "approx_kl", "ratio_mean", "ratio_max_dev"}  # nothing clipped
    assert stats["kl_penalty"].item() == pytest.approx((1 - ln2 + ln2 - 0.5) / 2, abs=1e-15)
    assert stats["ratio_max_dev"].item() == pytest.approx(1.0, abs=1e-15)


def test_on_policy_the_gradient_is_the_policy_gradient():
    # at r = 1 the penalty and its gradient vanish: dL/dlogp = -A / N, for any beta
    logp, _, advantages, mask = random_batch(3, token_advantages=True)
    for beta in (0.0, 10.0):
        _, grad, stats = loss_and_grad(logp, logp, advantages, mask, kl_penalty_beta=beta)
        assert (grad + advantages * mask / mask.sum()).abs().max().item() <= TOL
        assert stats["kl_penalty"].item() == 0.0


@pytest.mark.parametrize("agg", algo.AGG_MODES)
@pytest.mark.parametrize("beta", [0.0, 0.3, 3.0])
def test_against_a_float64_loop(agg, beta):
    logp, old_logp, advantages, mask = random_batch(0, token_advantages=True)
    weights = torch.rand(mask.shape, generator=torch.Generator().manual_seed(1), dtype=F64) * 2
    for w in (None, weights):
        loss, grad, _ = loss_and_grad(logp, old_logp, advantages, mask, beta, agg=algo.Aggregation(agg, weights=w))
        ref_loss, ref_grad = kl_penalty_loop(logp, old_logp, advantages, mask, beta, agg, w)
        assert abs(loss - ref_loss) <= TOL, (loss, ref_loss)
        assert (grad - t64(ref_grad)).abs().max().item() <= TOL


def test_the_entry_the_config_and_its_refusals():
    assert algo.policy_loss_function("kl_penalty") is algo.kl_penalty_policy_loss
    assert algo.loss_coupling("kl_penalty") == "token"
    assert algo.loss_settings("kl_penalty", PPOConfig()) == {"kl_penalty_beta": 1.0}
    cfg = build_config({}, {"policy_loss_kind": "kl_penalty", "kl_penalty_beta": "0.3"})
    assert algo.loss_settings("kl_penalty", cfg) == {"kl_penalty_beta": 0.3}
    with pytest.raises(ConfigError, match="^config key 'kl_penalty_beta' has no effect with policy_loss_kind='ppo'"):
        build_config({}, {"kl_penalty_beta": "0.3"})
    with pytest.raises(ConfigError, match="^config key 'kl_penalty_beta' must be >= 0, got"):
        build_config({}, {"policy_loss_kind": "kl_penalty", "kl_penalty_beta": "-1"})
    with pytest.raises(ConfigError, match="config key 'clip_high' has no effect with policy_loss_kind='kl_penalty'"):
        build_config({}, {"policy_loss_kind": "kl_penalty", "clip_high": "0.28"})
    build_config({}, {"policy_loss_kind": "kl_penalty", "off_policy_correction": "tis",
                      "old_logprobs_from_rollout": "false"})  # a token-level loss takes the off-policy weights


def test_the_fused_head_trains_the_same_loss(monkeypatch):
    """ppo_kernels.linear_logprob_loss in tiles of tokens against full logits, float64: loss and both gradients."""
    B, T, H, V = 6, 7, 8, 11
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(B, T, H, generator=g, dtype=F64)
    weight = torch.randn(V, H, generator=g, dtype=F64)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, 5:] = labels[3, 2] = -100
    mask = (labels != -100).to(F64)
    old_logp = ppo_kernels.linear_token_logprobs_reference(hidden, weight, labels).detach() + 0.3 * torch.randn(
        B, T, generator=g, dtype=F64) * mask
    advantages = torch.randn(B, 1, generator=g, dtype=F64).expand(B, T) * 3

    def objective(logp, entropy, rows):
        return algo.kl_penalty_policy_loss(logp, old_logp[rows], advantages[rows], mask[rows], kl_penalty_beta=0.5,
                                           agg=algo.Aggregation(num_tokens=mask.sum(),
                                                                num_seqs=(mask.sum(-1) > 0).sum()))

    monkeypatch.setattr(kernel_loss, "TORCH_LOSS_TILE_ELEMENTS", 2 * T * V)
    monkeypatch.setenv("PPO_KERNELS_BACKEND", "torch")
    reference = run_head(ppo_kernels.linear_logprob_loss_reference, hidden, weight, labels, objective)
    fused = run_head(ppo_kernels.linear_logprob_loss, hidden, weight, labels, objective, rows_separate=True,
                     tokens_separate=True)
    for a, b in zip(fused[:3], reference[:3]):
        assert (a - b).abs().max().item() <= TOL
    assert all(abs(fused[3][k].item() - reference[3][k].item()) <= TOL for k in reference[3])
