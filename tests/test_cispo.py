"""CISPO (MiniMax-M1, arXiv:2506.13585), the worked example of a new loss kind, and the one place a kind is chosen.

    python -m pytest -q tests/test_cispo.py

    L_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) A_t log pi_theta(y_t),   r_t = pi_theta(y_t) / pi_old(y_t)

algo.cispo_policy_loss by hand and against a float64 Python loop (value and gradient, every aggregation, with and
without per-token weights); CISPO through the fused LM head (ppo_kernels.linear_logprob_loss, which takes the loss as a
function: the torch path in float64 to 1e-13, the Triton kernel under the interpreter in float32 no worse than the
reference's own rounding, as tests/test_kernels_loss.py holds every loss); the config accepting exactly the kinds
ppo_core.algo implements; the loss-path line naming what runs; and `ppo-train --policy_loss_kind=cispo` on the demo.
docs/adding-a-loss.md walks through these files.
"""
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import ppo_kernels
import ppo_kernels.loss as loss_module
from ppo_core import algo
from ppo_core.config import ConfigError, build_config
from ppo_core.models.precision import loss_paths
from ppo_core.train import DEMO_CHECKPOINT, main
from ppo_kernels.loss import linear_logprob_loss_reference, linear_logprob_loss_torch

from test_kernels_loss import (
    EPS32, IMPLS, TOL32, TOL64, assert_no_worse, f64, head_batch, inputs, max_err, objective, run,
    split_rows, truth_and_reference,
)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
F64 = torch.float64
AGG_MODES = algo.AGG_MODES


def t64(rows):
    return torch.tensor(rows, dtype=F64)


def batch(B=4, T=33):
    """(logp, old_logp, advantages, mask) [B, T] in float64: ratios within ~e^0.3 of 1, 3/4 of the tokens real,
    row 1 fully masked."""
    g = torch.Generator().manual_seed(B * T)
    logp = torch.randn(B, T, generator=g, dtype=F64) * 0.5 - 2.0
    old_logp = logp + torch.randn(B, T, generator=g, dtype=F64) * 0.3
    advantages = torch.randn(B, T, generator=g, dtype=F64)
    mask = (torch.rand(B, T, generator=g) > 0.25).to(F64)
    mask[1] = 0
    return logp, old_logp, advantages, mask


def loss_and_grad(fn, logp, *args, **kwargs):
    """fn(logp, *args, **kwargs) on a fresh leaf: (loss, dloss/dlogp, stats as floats)."""
    x = logp.detach().clone().requires_grad_()
    loss, stats = fn(x, *args, **kwargs)
    loss.backward()
    return loss.detach(), x.grad, {k: v.item() for k, v in stats.items()}


# ---------------------------------------------------------------- the loss, by hand
#
# four tokens, clip 0.2 (weight range [0.8, 1.2]); r = pi_theta / pi_old, token-mean over 4:
#   t0: pi_theta 0.6,  pi_old 0.4, A = +1: r = 1.5 -> weight 1.2: L = -1.2 log 0.6,        dL/dlogp = -1.2
#   t1: pi_theta 0.2,  pi_old 0.4, A = -1: r = 0.5 -> weight 0.8: L = +0.8 log 0.2,        dL/dlogp = +0.8
#   t2: pi_theta 0.3,  pi_old 0.3, A = +2: r = 1   -> weight 1:   L = -2 log 0.3,          dL/dlogp = -2
#   t3: pi_theta 0.55, pi_old 0.5, A = +1: r = 1.1 -> weight 1.1: L = -1.1 log 0.55,       dL/dlogp = -1.1
# PPO's clip gives t0 and t1 zero gradient; CISPO keeps it, bounded by the clipped weight.
HAND = dict(logp=[[0.6, 0.2, 0.3, 0.55]], old=[[0.4, 0.4, 0.3, 0.5]], advantages=[[1.0, -1.0, 2.0, 1.0]])


def test_cispo_hand_worked():
    logp = t64(HAND["logp"]).log().requires_grad_(True)
    loss, stats = algo.cispo_policy_loss(logp, t64(HAND["old"]).log(), t64(HAND["advantages"]), t64([[1, 1, 1, 1]]))
    loss.backward()
    expected = (-1.2 * math.log(0.6) + 0.8 * math.log(0.2) - 2 * math.log(0.3) - 1.1 * math.log(0.55)) / 4
    assert loss.item() == pytest.approx(expected, abs=1e-15)
    assert logp.grad[0].tolist() == pytest.approx([-0.3, 0.2, -0.5, -0.275], abs=1e-15)
    assert stats["clipfrac"].item() == 0.5  # t0 and t1: weight clipped, gradient kept
    assert stats["ratio_mean"].item() == pytest.approx((1.5 + 0.5 + 1 + 1.1) / 4, abs=1e-15)
    ppo_logp = logp.detach().clone().requires_grad_(True)
    algo.policy_loss(ppo_logp, t64(HAND["old"]).log(), t64(HAND["advantages"]), t64([[1, 1, 1, 1]]))[0].backward()
    assert ppo_logp.grad[0, :2].tolist() == [0.0, 0.0]  # what CISPO changes


def test_no_lower_bound_with_clip_low_at_least_one():
    # the paper's setting: no lower clip (clip_low >= 1 puts the bound at or below 0, and r > 0): t1 keeps r = 0.5
    logp = t64(HAND["logp"]).log().requires_grad_(True)
    loss, stats = algo.cispo_policy_loss(logp, t64(HAND["old"]).log(), t64(HAND["advantages"]), t64([[1, 1, 1, 1]]),
                                         clip_low=10.0, clip_high=0.2)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-0.3, 0.125, -0.5, -0.275], abs=1e-15)
    assert stats["clipfrac"].item() == 0.25


# ---------------------------------------------------------------- against a plain-Python loop

def python_cispo_loss(logp, old_logp, advantages, mask, clip_low, clip_high, agg, weights=None):
    """Token by token: each token's weight sg(clip(r)) a Python float (a constant), its loss a 0-dim float64 tensor of
    logp, so that autograd gives the reference gradient."""
    B, T = logp.shape
    row_sums, row_counts = [], []
    for b in range(B):
        real = [t for t in range(T) if mask[b, t].item() == 1]
        row_sum = 0.0
        for t in real:
            r = math.exp(logp[b, t].item() - old_logp[b, t].item())
            is_weight = min(max(r, 1 - clip_low), 1 + clip_high)
            w = 1.0 if weights is None else weights[b, t].item()
            row_sum = row_sum + w * (-is_weight * advantages[b, t].item() * logp[b, t])
        row_sums.append(row_sum)
        row_counts.append(len(real))
    n_tokens, n_seqs = sum(row_counts), sum(1 for n in row_counts if n > 0)
    if agg == "token-mean":
        return sum(row_sums) / n_tokens
    if agg == "seq-mean-token-mean":
        return sum(s / n for s, n in zip(row_sums, row_counts) if n > 0) / n_seqs
    if agg == "seq-mean-token-sum":
        return sum(row_sums) / n_seqs
    return sum(row_sums) / (n_seqs * T)  # seq-mean-token-sum-norm with the default norm_const T


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("clip_low, clip_high", [(0.2, 0.2), (0.1, 0.28), (10.0, 0.28)])
@pytest.mark.parametrize("weighted", [False, True])
def test_matches_a_python_loop_value_and_gradient(agg, clip_low, clip_high, weighted):
    g = torch.Generator().manual_seed(0)
    mask = t64([[1, 1, 0, 1, 1, 1], [1, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0], [0, 1, 1, 0, 1, 1]])
    old_logp = -torch.rand(4, 6, generator=g, dtype=F64) * 3
    logp = (old_logp + 0.4 * torch.randn(4, 6, generator=g, dtype=F64)).requires_grad_(True)
    advantages = torch.randn(4, 6, generator=g, dtype=F64)
    weights = torch.rand(4, 6, generator=g, dtype=F64) * 2 * mask if weighted else None
    loss, stats = algo.cispo_policy_loss(logp, old_logp, advantages, mask, clip_low, clip_high,
                                         agg=algo.Aggregation(agg, weights=weights))
    (grad,) = torch.autograd.grad(loss, logp)
    logp_ref = logp.detach().clone().requires_grad_(True)
    python_cispo_loss(logp_ref, old_logp, advantages, mask, clip_low, clip_high, agg, weights).backward()
    ref_loss = python_cispo_loss(logp.detach(), old_logp, advantages, mask, clip_low, clip_high, agg, weights)
    assert abs(loss.item() - float(ref_loss)) <= 1e-14 * max(1.0, abs(float(ref_loss)))
    assert (grad - logp_ref.grad).abs().max().item() <= 1e-14
    assert (grad[mask == 0] == 0).all()
    if clip_low < 1:  # the batch clips some tokens and not others, so the comparison is not vacuous
        assert 0 < stats["clipfrac"].item() < 1


@pytest.mark.parametrize("loss_fn", [algo.policy_loss, algo.cispo_policy_loss])
def test_unit_weights_are_the_unweighted_loss_bit_for_bit(loss_fn):
    # the one surrogate: weights=None and weights of 1 are the same ops, to the bit; and PPO's off-policy loss is
    # policy_loss with the correction's weights (policy_loss_off_policy computes them, then calls it)
    logp, old_logp, advantages, mask = batch(B=3, T=9)
    for agg in AGG_MODES:
        a, b = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
        loss_a, stats_a = loss_fn(a, old_logp, advantages, mask, agg=agg)
        loss_b, stats_b = loss_fn(b, old_logp, advantages, mask, agg=algo.Aggregation(agg, weights=torch.ones_like(mask)))
        loss_a.backward(), loss_b.backward()
        assert torch.equal(loss_a, loss_b) and torch.equal(a.grad, b.grad)
        assert stats_a.keys() == stats_b.keys() and all(torch.equal(stats_a[k], stats_b[k]) for k in stats_a)
    behav_logp = old_logp + 0.3 * torch.randn_like(old_logp)
    weights, _ = algo.off_policy_weights(old_logp, behav_logp, mask, "tis", cap=1.5)
    off_loss, _ = algo.policy_loss_off_policy(logp, old_logp, behav_logp, advantages, mask, "tis", cap=1.5)
    assert torch.equal(off_loss, algo.policy_loss(logp, old_logp, advantages, mask, agg=algo.Aggregation(weights=weights))[0])


def test_one_place_chooses_a_kind():
    # every kind the config accepts has a function; any other is refused, by algo and by the config
    for kind in algo.POLICY_LOSS_KINDS:
        assert callable(algo.policy_loss_function(kind))
        build_config({}, {"policy_loss_kind": kind, "adv_estimator": "grpo", "n_samples_per_prompt": "2"})
    assert algo.policy_loss_function("cispo") is algo.cispo_policy_loss
    # CISPO owns its settings (the config fields it reads, by name) and splits over rows (chunks of them, fused)
    cfg = build_config({}, {"policy_loss_kind": "cispo", "clip_low": "10", "clip_high": "0.28"})
    assert algo.loss_settings("cispo", cfg) == {"clip_low": 10.0, "clip_high": 0.28}
    assert not algo.loss_couples_rows("cispo")
    with pytest.raises(ValueError, match="kind must be one of"):
        algo.policy_loss_function("no_such_loss")
    kinds = ", ".join(algo.POLICY_LOSS_KINDS)
    with pytest.raises(ConfigError, match=f"config key 'policy_loss_kind' must be one of {kinds}, got 'no_such_loss'"):
        build_config({}, {"policy_loss_kind": "no_such_loss"})


def test_argument_errors():
    logp, old_logp, advantages, mask = batch()
    with pytest.raises(ValueError, match="dual_clip"):
        algo.cispo_policy_loss(logp, old_logp, advantages, mask, dual_clip=3.0)
    with pytest.raises(ValueError, match="dual_clip and weights"):
        algo.gspo_policy_loss(logp, old_logp, advantages, mask, agg=algo.Aggregation(weights=torch.ones_like(mask)))


# ---------------------------------------------------------------- the edges of the band

def test_edge_ratios():
    # ratios at the band's edges (closed: no clip counted), beyond them, and |logp - old| = 50 (the log-ratio clamp):
    # CISPO's gradient there is -A times the clip bound, finite and not zero (PPO's is zero)
    log_ratio = torch.cat([t64([1.0, 1.25, 0.75, 1.5, 0.5]).log(), t64([50.0, -50.0, 20.0, -20.0])])
    advantages = torch.stack([torch.full_like(log_ratio, a) for a in (0.0, 1.0, -1.0, -7.0)])  # [4, 9]
    old_logp = torch.full_like(advantages, -1.0)
    logp, mask = old_logp + log_ratio, torch.ones_like(advantages)
    kwargs = dict(clip_low=0.25, clip_high=0.25)
    loss, grad, stats = loss_and_grad(algo.cispo_policy_loss, logp, old_logp, advantages, mask, **kwargs)
    assert math.isfinite(loss.item()) and torch.isfinite(grad).all()
    # token-mean over 36: d loss / d logp = -A clip(r) / 36; at r = e^50, clip(r) = 1.25
    assert grad[1, 5].item() == pytest.approx(-1.25 / 36, abs=1e-15)
    assert grad[3, 6].item() == pytest.approx(7 * 0.75 / 36, abs=1e-15)
    assert stats["clipfrac"] == pytest.approx(6 / 9)  # 1.5, 0.5 and the four clamped ones; not 1.25, 0.75
    ppo_grad = loss_and_grad(algo.policy_loss, logp, old_logp, advantages, mask, **kwargs)[1]
    assert (ppo_grad[:, 5:7] == 0).all() and (grad[1:, 5:7] != 0).all()


# ---------------------------------------------------------------- CISPO through the fused LM head

CONFIGS = [
    dict(),
    dict(clip_low=0.1, clip_high=0.28),
    dict(clip_low=10.0, clip_high=0.28),  # no lower bound, the paper's setting
    dict(kl_coef=0.1, kl_kind="k1"),
    dict(kl_coef=0.05, kl_kind="k3", clip_high=0.3, entropy_coef=0.3),
]


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("config", range(len(CONFIGS)))
def test_fused_torch_path_matches_reference_float64(agg, config, monkeypatch, poisoned_empty):
    # every aggregation (the batch's global counts), in 3+ chunks of rows: the torch path in float64 against the float64
    # reference (full logits, autograd through algo.cispo_policy_loss), loss, stats, log-probs and gradients to TOL64
    hidden, weight, labels, tokens = inputs("torch", seed=10 + config, temperature=0.7)
    split_rows(monkeypatch, "torch", labels, weight.shape[0])
    loss_fn = objective("cispo", tokens, agg=agg, **CONFIGS[config])
    kwargs = dict(temperature=0.7, need_entropy="entropy_coef" in CONFIGS[config])
    truth = run(linear_logprob_loss_reference, hidden, weight, labels, loss_fn, **kwargs)
    got = run(linear_logprob_loss_torch, hidden, weight, labels, loss_fn, **kwargs)
    assert_no_worse(got, truth, truth, TOL64)
    assert "dual_clipfrac" not in got.stats and 0 < truth.stats["clipfrac"] < 1  # some weights clipped, not all


def test_gradcheck_float64(monkeypatch):
    # Finite differences see the weight move with logp, which the stop-gradient hides: gradcheck applies where the
    # weight is locally constant, every ratio outside the band (r = e or 1/e, the weight 1 + clip_high or
    # 1 - clip_low). There it checks algo.cispo_policy_loss's gradient with the KL term's, and then the fused head's
    # chain rule from CISPO's per-token gradient (and the entropy's) through T to hidden and weight, in 2 chunks.
    g = torch.Generator().manual_seed(0)
    logp, _, advantages, mask = batch(B=2, T=5)
    old_logp = logp + torch.where(torch.rand(logp.shape, generator=g) > 0.5, 1.0, -1.0).to(F64)
    ref_logp = logp + 0.2 * torch.randn(logp.shape, generator=g, dtype=F64)
    for kwargs in (dict(), dict(kl_coef=0.3, kl_kind="k3", agg="seq-mean-token-mean")):
        loss_fn = objective("cispo", (old_logp, advantages, mask, ref_logp), **kwargs)
        assert torch.autograd.gradcheck(lambda x: loss_fn(x, None, slice(None))[0], (logp.clone().requires_grad_(),))
    hidden, weight, labels, (_, advantages, mask, ref_logp) = head_batch(B=2, T=4, H=5, V=7, seed=9)
    logp = ppo_kernels.linear_token_logprobs_reference(hidden, weight, labels, temperature=0.7)
    old_logp = logp + torch.where(torch.rand(logp.shape, generator=g) > 0.5, 1.0, -1.0).to(F64)
    loss_fn = objective("cispo", (old_logp, advantages, mask, ref_logp), agg="seq-mean-token-mean", kl_coef=0.1,
                        entropy_coef=0.3)
    monkeypatch.setattr(loss_module, "TORCH_LOSS_TILE_ELEMENTS", 4 * 7)  # a chunk per row
    assert torch.autograd.gradcheck(
        lambda h, w: linear_logprob_loss_torch(h, w, labels, loss_fn, temperature=0.7, need_entropy=True)[0],
        (hidden.clone().requires_grad_(), weight.clone().requires_grad_()))


LINEAR_CONFIGS = [
    dict(temperature=0.7),
    dict(agg="seq-mean-token-mean", kl_coef=0.1, kl_kind="k3", clip_low=10.0, clip_high=0.28),
    dict(agg="seq-mean-token-sum-norm", entropy_coef=0.05, temperature=1.3, kl_coef=0.05, kl_kind="k2"),
]


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("config", range(len(LINEAR_CONFIGS)))
def test_fused_no_worse_than_the_reference_in_float32(impl, config, monkeypatch, poisoned_empty):
    # loss, stats, log-probs, dhidden and dweight of the fused paths in float32 (3+ chunks of rows) against the
    # reference in float64 (the truth): the kernel's error no larger than the float32 reference's own, + TOL32, as
    # tests/test_kernels_loss.py asks of every loss
    kwargs = dict(LINEAR_CONFIGS[config])
    temperature = kwargs.pop("temperature", 1.0)
    head = dict(temperature=temperature, need_entropy="entropy_coef" in kwargs)
    hidden, weight, labels, tokens = inputs(impl, seed=20 + config, dtype=torch.float32, temperature=temperature)
    split_rows(monkeypatch, impl, labels, weight.shape[0])
    make_loss = lambda toks: objective("cispo", toks, **kwargs)  # noqa: E731
    truth, reference = truth_and_reference(hidden, weight, labels, tokens, make_loss, **head)
    got = run(IMPLS[impl], hidden, weight, labels, make_loss(tokens), **head)
    assert_no_worse(got, reference, truth, TOL32, EPS32)
    assert "dual_clipfrac" not in got.stats
    # CISPO's gradient is not PPO's (the comparison above would not tell them apart otherwise)
    ppo = run(linear_logprob_loss_reference, f64(hidden), f64(weight), labels.cpu(),
              objective("ppo", tuple(map(f64, tokens)), **dict(kwargs, clip_low=0.2)), **head)
    assert max_err(ppo.dhidden, truth.dhidden) > 1e-2 * truth.dhidden.abs().max().item()


# ---------------------------------------------------------------- the config and the training loop

def test_config_refuses_dual_clip_with_cispo_and_allows_what_it_reads(capsys, tmp_path):
    assert main(["--policy_loss_kind=cispo", "--dual_clip=3", f"--out={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("ppo-train: error: config key 'dual_clip' has no effect with policy_loss_kind='cispo' (")
    assert not (tmp_path / "run").exists()
    build_config({}, {"policy_loss_kind": "cispo", "clip_low": "10", "clip_high": "0.28"})  # no lower bound
    with pytest.raises(ConfigError, match="config key 'clip_low' must be < 1"):
        build_config({}, {"clip_low": "10"})  # PPO's clip needs a positive lower bound
    off_policy = {"off_policy_correction": "tis", "old_logprobs_from_rollout": "false"}
    build_config({}, {"policy_loss_kind": "cispo", **off_policy})  # the weights multiply any token-level loss
    with pytest.raises(ConfigError, match="off_policy_correction"):
        build_config({}, {"policy_loss_kind": "gspo", "adv_estimator": "grpo", "n_samples_per_prompt": "2",
                          **off_policy})


def test_fused_and_plain_policy_objectives_agree_and_the_line_names_them(monkeypatch):
    """policy_objective with policy_loss_kind=cispo: the fused head (ppo_kernels.linear_logprob_loss, handed the
    objective update.py builds around algo.cispo_policy_loss, in chunks of rows) and the plain path (full logits, the
    same objective) give the same loss and gradients, with the KL loss term, the entropy bonus and an off-policy
    correction's weights; the loss-path line names each."""
    from ppo_core.models.model import load_model
    from ppo_core.heads import response_logprobs
    from ppo_core.rollout import sample_responses
    from ppo_core.run.start import Step
    from ppo_core.data.tasks import eval_prompts
    from ppo_core.models.tokenizer import load_tokenizer
    from ppo_core.update import MicroBatch, policy_objective

    calls = []  # (rows_separate, need_entropy) of each fused call
    real = ppo_kernels.linear_logprob_loss
    monkeypatch.setattr(ppo_kernels, "linear_logprob_loss",
                        lambda *a, **k: calls.append((k["rows_separate"], k["need_entropy"])) or real(*a, **k))
    tok, policy = load_tokenizer(DEMO_CHECKPOINT), load_model(DEMO_CHECKPOINT)
    gen = torch.Generator().manual_seed(0)
    sizes = {"rollout_batch_size": "6", "minibatch_size": "6", "micro_batch_size": "6"}
    cfg0 = build_config({}, sizes)
    out = sample_responses(policy, tok, eval_prompts(6, 0), Step(cfg0, gen))
    prompt_ids, prompt_mask, tokens, rm = out.prompt_ids, out.prompt_mask, out.tokens, out.response_mask
    ids, am, P = torch.cat([prompt_ids, tokens], 1), torch.cat([prompt_mask, rm.bool()], 1), prompt_ids.shape[1]
    logp = response_logprobs(policy, ids, am, rm, P, 1.0, False)[0].detach()
    old = logp - 0.3 * torch.rand(rm.shape, generator=gen) * rm  # ratios up to e^0.3: some weights clipped
    ref = old + 0.1 * torch.randn(old.shape, generator=gen) * rm
    behav = old + 0.3 * torch.randn(old.shape, generator=gen) * rm
    adv = torch.randn(old.shape, generator=gen) * rm
    agg = algo.Aggregation("seq-mean-token-mean", num_tokens=rm.sum(), num_seqs=torch.tensor(6.0))
    knobs = {"policy_loss_kind": "cispo", "clip_high": "0.1", "entropy_coef": "0.05", "kl_in_reward": "false",
             "off_policy_correction": "tis", "off_policy_cap": "1.2", "old_logprobs_from_rollout": "false", **sizes}
    results = {}
    for fused in ("true", "false"):
        cfg = build_config({}, {**knobs, "fused_kernels": fused})
        policy.zero_grad()
        batch = MicroBatch(input_ids=ids, attention_mask=am, response_mask=rm, prompt_len=P, old_logprobs=old,
                           advantages=adv, ref_logprobs=ref, behav_logprobs=behav)
        loss, pg_loss, kl_loss, stats = policy_objective(policy, batch, cfg, 0.2, agg)
        loss.backward()
        results[fused] = (loss.item(), pg_loss.item(), kl_loss.item(), stats["clipfrac"].item(),
                          stats["corrected_frac"].item(), {n: p.grad.clone() for n, p in policy.named_parameters()})
        line = loss_paths(cfg, "cpu")
        assert calls == [(True, True)]  # the fused call, chunks of rows, with the entropy (the plain path adds none)
        assert line.startswith("policy loss: algo.cispo_policy_loss, " if fused == "true" else
                               "the torch reference for every head: full logits, log_softmax + gather, "
                               "algo.cispo_policy_loss, ")
        assert ("on fused linear_logprob_loss (chunked torch; the loss's per-token gradient taken per tile of tokens"
                in line) == (fused == "true")
        assert "off_policy_correction='tis'" in line
    (*fused_scalars, fused_grads), (*plain_scalars, plain_grads) = results["true"], results["false"]
    assert 0 < plain_scalars[3] < 1 and 0 < plain_scalars[4] < 1  # some weights clipped, some tokens truncated
    assert fused_scalars == pytest.approx(plain_scalars, abs=1e-6)
    for name in plain_grads:
        assert torch.allclose(fused_grads[name], plain_grads[name], rtol=1e-4, atol=1e-6), name


def test_ppo_train_with_cispo_trains(tmp_path):
    """The smoke run a user would make: ppo-train on the demo with --policy_loss_kind=cispo (no lower clip, as the
    paper), two tiny iterations: finite losses, the loss-path line names CISPO's loss on the fused head, the weights
    move."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "ppo_core.train", "--policy_loss_kind=cispo", "--clip_low=10", "--clip_high=0.28",
         "--adv_estimator=grpo", "--iterations=2", "--eval_size=8", "--rollout_batch_size=4",
         "--n_samples_per_prompt=4", "--minibatch_size=8", "--micro_batch_size=8", "--ppo_epochs=1",
         "--max_new_tokens=8", "--progress=false", f"--out={out}"],
        capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("\nloss paths: policy loss: algo.cispo_policy_loss, on fused linear_logprob_loss (chunked torch; "
            in proc.stderr)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    assert all(math.isfinite(r["policy/loss"]) and 0 <= r["policy/clipfrac"] <= 1 for r in rows)
    assert "policy/dual_clipfrac" not in rows[0]
    start = load_file(os.path.join(DEMO_CHECKPOINT, "model.safetensors"))
    trained = load_file(str(out / "checkpoints" / "step-2" / "model.safetensors"))
    moved = max((trained[k].float() - start[k].float()).abs().max().item() for k in start)
    assert moved > 1e-4
