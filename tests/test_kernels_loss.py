"""Tests of ppo_kernels.policy_loss and linear_policy_loss against ppo_core.algo.policy_loss (the reference).

    python -m pytest -q tests/test_kernels_loss.py

The reference is autograd through ppo_core.algo.policy_loss (+ algo.kl_estimate for the KL term); the fused
paths form the gradient in closed form, so gradients are compared with autograd, in float64 on the torch
path (to 1e-12) and in float32 on the Triton kernel (interpreter without a GPU). k3's clamps (verl's low_var_kl)
are checked against the formula written out in the test; linear_policy_loss's entropy bonus against autograd
through token_logprobs_reference(return_entropy=True).
"""
import math
import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before ppo_kernels imports triton

import pytest
import torch

pytest.importorskip("ppo_core.algo")
import ppo_kernels
import ppo_kernels.loss as loss_module
from ppo_kernels.loss import (
    linear_policy_loss_reference, linear_policy_loss_torch, linear_policy_loss_triton, policy_loss_reference,
    policy_loss_torch, policy_loss_triton,
)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def batch(B=4, T=33, dtype=torch.float64, spread=0.3, device="cpu"):
    logp = torch.randn(B, T, dtype=dtype) * 0.5 - 2.0
    old_logp = logp + torch.randn(B, T, dtype=dtype) * spread
    advantages = torch.randn(B, T, dtype=dtype)
    mask = (torch.rand(B, T) > 0.25).to(dtype)
    mask[1] = 0  # a fully masked row
    ref_logp = logp + torch.randn(B, T, dtype=dtype) * 0.2
    return [t.to(device) for t in (logp, old_logp, advantages, mask, ref_logp)]


def loss_and_grad(fn, logp, *args, **kwargs):
    x = logp.detach().clone().requires_grad_()
    loss, stats = fn(x, *args, **kwargs)
    loss.backward()
    return loss.detach(), x.grad, {k: v.item() for k, v in stats.items()}


def assert_same(a, b, tol):
    (loss_a, grad_a, stats_a), (loss_b, grad_b, stats_b) = a, b
    assert abs(loss_a.item() - loss_b.item()) <= tol * max(1.0, abs(loss_b.item())), (loss_a, loss_b)
    assert (grad_a.double().cpu() - grad_b.double().cpu()).abs().max().item() <= tol, "gradient"
    assert set(stats_a) == set(stats_b)
    for key in stats_b:
        assert abs(stats_a[key] - stats_b[key]) <= tol * max(1.0, abs(stats_b[key])), key


# ---------------------------------------------------------------------------------------------------- policy_loss
CONFIGS = [
    dict(),
    dict(clip_low=0.1, clip_high=0.28),
    dict(dual_clip=3.0),
    dict(kl_coef=0.1, kl_kind="k1"),
    dict(kl_coef=0.1, kl_kind="k2", dual_clip=2.0),
    dict(kl_coef=0.05, kl_kind="k3", clip_high=0.3),
]


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("config", range(len(CONFIGS)))
def test_torch_path_matches_reference_float64(agg, config):
    logp, old_logp, advantages, mask, ref_logp = batch()
    kwargs = dict(CONFIGS[config], agg=agg)
    if "kl_coef" in kwargs:
        kwargs["ref_logp"] = ref_logp
    expected = loss_and_grad(policy_loss_reference, logp, old_logp, advantages, mask, **kwargs)
    assert_same(loss_and_grad(policy_loss_torch, logp, old_logp, advantages, mask, **kwargs), expected, 1e-12)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("config", range(len(CONFIGS)))
def test_triton_matches_reference(agg, config, poisoned_empty):
    logp, old_logp, advantages, mask, ref_logp = batch(B=3, T=1500, dtype=torch.float32, device=TRITON_DEVICE)
    kwargs = dict(CONFIGS[config], agg=agg)
    if "kl_coef" in kwargs:
        kwargs["ref_logp"] = ref_logp
    expected = loss_and_grad(policy_loss_reference, logp.double(), old_logp.double(), advantages.double(),
                             mask.double(), **{k: (v.double() if torch.is_tensor(v) else v) for k, v in kwargs.items()})
    assert_same(loss_and_grad(policy_loss_triton, logp, old_logp, advantages, mask, **kwargs), expected, 2e-6)


def test_num_tokens_num_seqs_norm_const():
    logp, old_logp, advantages, mask, _ = batch()
    for agg, extra in [("token-mean", dict(num_tokens=1000)), ("seq-mean-token-mean", dict(num_seqs=17)),
                       ("seq-mean-token-sum", dict(num_seqs=5)), ("seq-mean-token-sum-norm", dict(norm_const=64))]:
        expected = loss_and_grad(policy_loss_reference, logp, old_logp, advantages, mask, agg=agg, **extra)
        got = loss_and_grad(policy_loss_torch, logp, old_logp, advantages, mask, agg=agg, **extra)
        assert_same(got, expected, 1e-12)


def test_edge_ratios_and_advantages():
    # ratio exactly 1, exactly at 1 +- clip (ties between the branches), beyond them, |logp - old| = 50 (the clamp),
    # advantages 0 / positive / negative, and dual clip on and off
    ratios = torch.tensor([1.0, 1.25, 0.75, 1.5, 0.5], dtype=torch.float64)
    log_ratio = torch.cat([ratios.log(), torch.tensor([50.0, -50.0, 20.0, -20.0], dtype=torch.float64)])
    clip_high = ratios[1].item() - 1.0  # exactly representable boundaries: 1 + clip_high == r
    clip_low = 1.0 - ratios[2].item()
    rows = []
    for a in (0.0, 1.0, -1.0, -7.0):
        rows.append(torch.full_like(log_ratio, a))
    advantages = torch.stack(rows)  # [4, 9]
    old_logp = torch.zeros_like(advantages)  # so that logp - old_logp is log_ratio exactly
    logp = old_logp + log_ratio
    mask = torch.ones_like(advantages)
    # dual_clip equal to one token's ratio: with A = -1 that token ties the dual cap exactly
    for dual_clip in (None, 3.0, torch.exp(log_ratio[3]).item()):
        kwargs = dict(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)
        expected = loss_and_grad(policy_loss_reference, logp, old_logp, advantages, mask, **kwargs)
        assert_same(loss_and_grad(policy_loss_torch, logp, old_logp, advantages, mask, **kwargs), expected, 1e-12)
        got = loss_and_grad(policy_loss_triton, logp.float().to(TRITON_DEVICE), old_logp.float().to(TRITON_DEVICE),
                            advantages.float().to(TRITON_DEVICE), mask.float().to(TRITON_DEVICE), **kwargs)
        assert torch.isfinite(got[1]).all() and math.isfinite(got[0].item())
        assert (got[1][:, 5:7] == 0).all()  # |log ratio| = 50: the clamp passes no gradient


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("fn", [policy_loss_torch, policy_loss_triton])
def test_k3_clamped_as_verl(fn, agg):
    # verl's core_algos.kl_penalty("low_var_kl"): x = clamp(ref - logp, -20, 20), k3 = clamp(e^x - x - 1, -10, 10),
    # written out here in float64 with autograd (clamp passes gradient on its closed interval). Gaps ref - logp:
    # 25 and -25 hit both clamps, 12.5 (k3 = e^12.5 - 13.5), 3 (16.1) and -12 (11.0) only k3's, 20 and -20 sit on the
    # log-ratio clamp's edge (inside it) with k3 clamped; 2, -5, -10 (k3 = 9.00005), 0.25, -0.5 hit neither.
    # Dyadic values: logp, ref and their difference are exact in float32 as in float64.
    gaps = torch.tensor([25.0, -25.0, 12.5, 3.0, -12.0, 20.0, -20.0, 2.0, -5.0, -10.0, 0.25, -0.5], dtype=torch.float64)
    clamped = torch.tensor([1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0], dtype=torch.bool)
    logp = -torch.arange(1, 25, dtype=torch.float64).view(2, 12) / 8  # [2, 12]
    ref_logp = logp + gaps
    old_logp = logp + torch.randn(2, 12, dtype=torch.float64) * 0.3
    advantages = torch.randn(2, 12, dtype=torch.float64)
    mask = torch.ones(2, 12, dtype=torch.float64)
    mask[1, :2] = 0
    kl_coef = 0.1
    from ppo_core import algo

    def verl_loss(x, *args, **kwargs):
        loss, stats = policy_loss_reference(x, *args, **kwargs)  # without its KL term
        log_ratio = torch.clamp(ref_logp - x, min=-20.0, max=20.0)
        k3 = torch.clamp(torch.exp(log_ratio) - log_ratio - 1, min=-10.0, max=10.0)
        stats["kl"] = algo.masked_mean(k3, mask).detach()
        return loss + kl_coef * algo.aggregate(k3, mask, agg), stats

    expected = loss_and_grad(verl_loss, logp, old_logp, advantages, mask, agg=agg)
    assert expected[2]["kl"] > 5.0  # the clamped tokens dominate the mean
    torch_path = fn is policy_loss_torch
    device, dtype, tol = ("cpu", torch.float64, 1e-12) if torch_path else (TRITON_DEVICE, torch.float32, 2e-6)
    got = loss_and_grad(fn, *(t.to(device, dtype) for t in (logp, old_logp, advantages, mask)), agg=agg,
                        ref_logp=ref_logp.to(device, dtype), kl_coef=kl_coef, kl_kind="k3")
    assert_same(got, expected, tol)
    # where a clamp binds, the token's gradient is its PPO term's alone
    pg_only = loss_and_grad(policy_loss_reference, logp, old_logp, advantages, mask, agg=agg)[1]
    kl_grad = got[1].double().cpu() - pg_only  # [2, 12] the KL term's share of the gradient
    assert kl_grad[:, clamped].abs().max().item() <= tol
    assert (kl_grad[:, ~clamped][mask[:, ~clamped] != 0].abs() > 100 * tol).all()


@pytest.mark.parametrize("fn", [policy_loss_torch, policy_loss_triton])
def test_fully_masked_batch_is_zero_not_nan(fn):
    device = "cpu" if fn is policy_loss_torch else TRITON_DEVICE
    logp, old_logp, advantages, mask, ref_logp = batch(dtype=torch.float32, device=device)
    for agg in AGG_MODES:
        loss, grad, stats = loss_and_grad(fn, logp, old_logp, advantages, torch.zeros_like(mask), agg=agg,
                                          dual_clip=3.0, kl_coef=0.1, ref_logp=ref_logp)
        assert loss.item() == 0.0 and (grad == 0).all()
        assert all(v == 0.0 for v in stats.values()), stats


@pytest.mark.parametrize("fn", [policy_loss_torch, policy_loss_triton])
def test_kl_coef_zero_never_reads_ref(fn):
    device = "cpu" if fn is policy_loss_torch else TRITON_DEVICE
    logp, old_logp, advantages, mask, _ = batch(dtype=torch.float32, device=device)
    poisoned_ref = torch.full_like(logp, float("nan"))
    without = loss_and_grad(fn, logp, old_logp, advantages, mask)
    with_nan_ref = loss_and_grad(fn, logp, old_logp, advantages, mask, ref_logp=poisoned_ref, kl_coef=0.0)
    assert torch.equal(without[0], with_nan_ref[0]) and torch.equal(without[1], with_nan_ref[1])
    assert "kl" not in with_nan_ref[2]


def test_gradcheck_float64():
    logp, old_logp, advantages, mask, ref_logp = batch(B=2, T=5)
    for kwargs in (dict(dual_clip=3.0), dict(kl_coef=0.3, kl_kind="k3", ref_logp=ref_logp, agg="seq-mean-token-mean")):
        assert torch.autograd.gradcheck(
            lambda x: policy_loss_torch(x, old_logp, advantages, mask, **kwargs)[0], (logp.clone().requires_grad_(),))


@pytest.mark.parametrize("fn", [policy_loss_torch, policy_loss_triton])
def test_bitwise_deterministic(fn):
    device = "cpu" if fn is policy_loss_torch else TRITON_DEVICE
    args = batch(B=3, T=2000, dtype=torch.float32, device=device)
    a = loss_and_grad(fn, *args[:4], dual_clip=3.0, kl_coef=0.1, ref_logp=args[4])
    b = loss_and_grad(fn, *args[:4], dual_clip=3.0, kl_coef=0.1, ref_logp=args[4])
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2]


def test_argument_errors():
    logp, old_logp, advantages, mask, _ = batch()
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_kernels.policy_loss(logp, old_logp, advantages, mask, dual_clip=1.0)
    with pytest.raises(ValueError, match="agg"):
        ppo_kernels.policy_loss(logp, old_logp, advantages, mask, agg="sum")
    with pytest.raises(ValueError, match="ref_logp"):
        ppo_kernels.policy_loss(logp, old_logp, advantages, mask, kl_coef=0.1)


# ------------------------------------------------------------------------------------------ linear_policy_loss
def linear_batch(B, T, H, V, dtype=torch.float32, device="cpu"):
    hidden = torch.randn(B, T, H, dtype=dtype)
    weight = torch.randn(V, H, dtype=dtype) * (3 / H**0.5)
    labels = torch.randint(0, V, (B, T))
    mask = (torch.rand(B, T) > 0.2).to(dtype)
    labels[0, :3], mask[0, :3] = -100, 0  # prompt / padding positions
    if B > 2:
        mask[2] = 0  # a fully masked row
    with torch.no_grad():
        logp = ppo_kernels.linear_token_logprobs_reference(hidden, weight, labels).to(dtype)
    old_logp = logp + torch.randn(B, T, dtype=dtype) * 0.3
    ref_logp = logp + torch.randn(B, T, dtype=dtype) * 0.2
    advantages = torch.randn(B, T, dtype=dtype)
    return [t.to(device) for t in (hidden, weight, labels, old_logp, advantages, mask, ref_logp)]


def linear_loss_and_grads(fn, hidden, weight, *args, **kwargs):
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    loss, stats = fn(h, w, *args, **kwargs)
    loss.backward()
    scalars = {k: v.item() for k, v in stats.items() if k not in ("logp_mean", "logp")}
    return loss.detach(), h.grad, w.grad, scalars, stats.get("logp")


def f64(t):
    """t in float64 if it is a floating tensor, else t as it is."""
    return t.double() if torch.is_tensor(t) and t.is_floating_point() else t


def truth_and_reference(hidden, weight, args, kwargs):
    """linear_loss_and_grads of the naive reference in float64 (the truth) and in the inputs' dtype."""
    truth = linear_loss_and_grads(linear_policy_loss_reference, f64(hidden), f64(weight), *map(f64, args),
                                  **{k: f64(v) for k, v in kwargs.items()})
    return truth, linear_loss_and_grads(linear_policy_loss_reference, hidden, weight, *args, **kwargs)


LINEAR_CONFIGS = [
    dict(temperature=0.7),
    dict(dual_clip=3.0, agg="seq-mean-token-mean", kl_coef=0.1, kl_kind="k3"),
    dict(agg="seq-mean-token-sum-norm", kl_coef=0.05, kl_kind="k2", clip_high=0.28),
]


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("config", range(len(LINEAR_CONFIGS)))
def test_linear_policy_loss_matches_reference(impl, config, monkeypatch, poisoned_empty):
    if impl == "torch":
        monkeypatch.setattr(loss_module, "TORCH_LOSS_TILE_ELEMENTS", 13 * 1000)  # several row tiles
    fn = linear_policy_loss_torch if impl == "torch" else linear_policy_loss_triton
    device = "cpu" if impl == "torch" else TRITON_DEVICE
    hidden, weight, labels, old_logp, advantages, mask, ref_logp = linear_batch(3, 40, 32, 1000, device=device)
    kwargs = dict(LINEAR_CONFIGS[config])
    if "kl_coef" in kwargs:
        kwargs["ref_logp"] = ref_logp
    args = (labels, old_logp, advantages, mask)
    truth, reference = truth_and_reference(hidden, weight, args, kwargs)
    got = linear_loss_and_grads(fn, hidden, weight, *args, **kwargs)
    for name, k, r, t in zip(("loss", "dhidden", "dweight"), got[:3], reference[:3], truth[:3]):
        err_kernel = (k.double().cpu() - t.cpu()).abs().max().item()
        err_reference = (r.double().cpu() - t.cpu()).abs().max().item()
        assert err_kernel <= err_reference + 1e-6 * max(1.0, t.abs().max().item()), (name, err_kernel, err_reference)
    for key in truth[3]:
        assert abs(got[3][key] - truth[3][key]) <= 1e-5, key
    assert (got[1][labels == -100] == 0).all() and (got[1][mask == 0] == 0).all()
    # the per-token log-probs it hands back (the loop reports the KL term from them): those of the
    # float64 reference on the tokens in the loss, 0 elsewhere
    in_loss = (mask > 0) & (labels != -100)
    truth_logp = ppo_kernels.linear_token_logprobs_reference(f64(hidden), f64(weight), labels, temperature=kwargs.get("temperature", 1.0))
    assert got[4].shape == mask.shape and (got[4][~in_loss] == 0).all()
    assert (got[4].double().cpu() - truth_logp.cpu())[in_loss.cpu()].abs().max().item() <= 1e-5


# The entropy bonus: every aggregation mode once, both coefficients, temperatures != 1, a KL term, dual clip.
ENTROPY_CONFIGS = [
    dict(entropy_coef=0.01, temperature=0.7, agg="token-mean"),
    dict(entropy_coef=0.3, temperature=1.3, agg="seq-mean-token-mean", kl_coef=0.1, kl_kind="k3"),
    dict(entropy_coef=0.3, temperature=0.7, agg="seq-mean-token-sum", dual_clip=3.0),
    dict(entropy_coef=0.05, temperature=1.3, agg="seq-mean-token-sum-norm", clip_high=0.28),
]


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("config", range(len(ENTROPY_CONFIGS)))
def test_linear_policy_loss_entropy_bonus(impl, config, monkeypatch, poisoned_empty):
    # loss - entropy_coef * aggregate(H) and its gradients to hidden and weight, against the naive reference's
    # autograd in float64 (entropy from token_logprobs_reference(return_entropy=True)): no worse than the reference
    # in float32, as test_linear_policy_loss_matches_reference requires without the entropy term.
    if impl == "torch":
        monkeypatch.setattr(loss_module, "TORCH_LOSS_TILE_ELEMENTS", 13 * 1000)  # several row tiles
    fn = linear_policy_loss_torch if impl == "torch" else linear_policy_loss_triton
    device = "cpu" if impl == "torch" else TRITON_DEVICE
    torch.manual_seed(config)  # the same batch whatever ran before (the check below needs the term to be visible)
    hidden, weight, labels, old_logp, advantages, mask, ref_logp = linear_batch(3, 40, 32, 1000, device=device)
    kwargs = dict(ENTROPY_CONFIGS[config])
    if "kl_coef" in kwargs:
        kwargs["ref_logp"] = ref_logp
    args = (labels, old_logp, advantages, mask)
    truth, reference = truth_and_reference(hidden, weight, args, kwargs)
    without = linear_loss_and_grads(linear_policy_loss_reference, f64(hidden), f64(weight), *map(f64, args),
                                    **{k: f64(v) for k, v in dict(kwargs, entropy_coef=0.0).items()})
    got = linear_loss_and_grads(fn, hidden, weight, *args, **kwargs)
    for name, k, r, t, t0 in zip(("loss", "dhidden", "dweight"), got[:3], reference[:3], truth[:3], without[:3]):
        tol = 1e-6 * max(1.0, t.abs().max().item())
        assert (t - t0).abs().max().item() > 100 * tol, name  # the entropy term is well above the tolerance
        err_kernel = (k.double().cpu() - t.cpu()).abs().max().item()
        err_reference = (r.double().cpu() - t.cpu()).abs().max().item()
        assert err_kernel <= err_reference + tol, (name, err_kernel, err_reference)
    assert "entropy" in truth[3] and "entropy" not in without[3]
    assert set(got[3]) == set(truth[3])
    for key in truth[3]:  # relative: a ratio near 30 (ratio_max_dev) carries a log-prob's rounding times 30
        assert abs(got[3][key] - truth[3][key]) <= 1e-5 * max(1.0, abs(truth[3][key])), key
    assert (got[1][labels == -100] == 0).all() and (got[1][mask == 0] == 0).all()


def test_linear_policy_loss_entropy_gradcheck_float64():
    # the closed-form dz (log-prob and entropy terms, through the temperature) against finite differences
    hidden, weight, labels, old_logp, advantages, mask, ref_logp = linear_batch(2, 4, 5, 7, dtype=torch.float64)
    kwargs = dict(temperature=0.7, entropy_coef=0.3, kl_coef=0.1, ref_logp=ref_logp, agg="seq-mean-token-mean")
    assert torch.autograd.gradcheck(
        lambda h, w: linear_policy_loss_torch(h, w, labels, old_logp, advantages, mask, **kwargs)[0],
        (hidden.clone().requires_grad_(), weight.clone().requires_grad_()))


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_linear_policy_loss_fully_masked(impl):
    fn = linear_policy_loss_torch if impl == "torch" else linear_policy_loss_triton
    device = "cpu" if impl == "torch" else TRITON_DEVICE
    hidden, weight, labels, old_logp, advantages, mask, ref_logp = linear_batch(2, 10, 16, 100, device=device)
    for entropy_coef in (0.0, 0.3):
        loss, dh, dw, stats, _ = linear_loss_and_grads(fn, hidden, weight, labels, old_logp, advantages,
                                                    torch.zeros_like(mask), kl_coef=0.1, ref_logp=ref_logp,
                                                    entropy_coef=entropy_coef)
        assert loss.item() == 0.0 and (dh == 0).all() and (dw == 0).all()
        assert stats.get("entropy", 0.0) == 0.0 and ("entropy" in stats) == (entropy_coef != 0)


def test_linear_policy_loss_flat_tokens_and_frozen_head():
    hidden, weight, labels, old_logp, advantages, mask, _ = linear_batch(2, 20, 16, 300)
    flat = lambda t: t.reshape(-1, *t.shape[2:])
    loss_2d, dh_2d, dw_2d, *_ = linear_loss_and_grads(linear_policy_loss_torch, hidden, weight, labels, old_logp,
                                                     advantages, mask)
    loss_1d, dh_1d, dw_1d, *_ = linear_loss_and_grads(linear_policy_loss_torch, flat(hidden), weight, flat(labels),
                                                     flat(old_logp), flat(advantages), flat(mask))
    assert torch.allclose(loss_1d, loss_2d, atol=1e-6) and torch.allclose(dh_1d, flat(dh_2d), atol=1e-7)
    h = hidden.clone().requires_grad_()
    loss, _ = ppo_kernels.linear_policy_loss(h, weight, labels, old_logp, advantages, mask)  # weight without grad
    loss.backward()
    assert torch.allclose(h.grad, dh_2d, atol=1e-7)


# Every aggregation mode, every KL kind, dual clip, temperatures != 1, the entropy bonus, ignored (-100) and fully
# masked rows.
CHUNKED_CONFIGS = [
    dict(agg="token-mean", temperature=0.7, kl_coef=0.1, kl_kind="k1"),
    dict(agg="seq-mean-token-mean", dual_clip=3.0, kl_coef=0.1, kl_kind="k3"),
    dict(agg="seq-mean-token-sum", kl_coef=0.05, kl_kind="k2", temperature=1.3, clip_low=0.1, clip_high=0.28),
    dict(agg="seq-mean-token-sum-norm", dual_clip=2.0, temperature=0.7),
    dict(agg="seq-mean-token-mean", temperature=1.3, entropy_coef=0.3, kl_coef=0.1, kl_kind="k3", dual_clip=3.0),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", range(len(CHUNKED_CONFIGS)))
def test_linear_policy_loss_triton_row_chunks(config, dtype, monkeypatch, poisoned_empty):
    # The Triton path in chunks of rows (logits, log-probs, dz, then dh and dW += per chunk): forced to >= 3 chunks,
    # the last one shorter, against the float64 truth and the torch path.
    V = 1000
    hidden, weight, labels, old_logp, advantages, mask, ref_logp = linear_batch(3, 40, 32, V, device=TRITON_DEVICE)
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    kept = int(((mask != 0) & (labels != -100)).sum())
    rows_per_chunk = next(r for r in range(kept // 4, 0, -1) if kept % r)
    assert kept // rows_per_chunk >= 3 and kept % rows_per_chunk != 0  # >= 3 full chunks and a ragged one
    monkeypatch.setattr(loss_module, "TRITON_LOSS_CHUNK_ELEMENTS", rows_per_chunk * V)
    kwargs = dict(CHUNKED_CONFIGS[config])
    if "kl_coef" in kwargs:
        kwargs["ref_logp"] = ref_logp
    args = (labels, old_logp, advantages, mask)
    truth, reference = truth_and_reference(hidden, weight, args, kwargs)
    chunk_rows, fwd = [], loss_module._logprobs._fwd_triton  # the rows of each chunk's log-prob kernel launch
    monkeypatch.setattr(loss_module._logprobs, "_fwd_triton", lambda z, *a: chunk_rows.append(len(z)) or fwd(z, *a))
    got = linear_loss_and_grads(linear_policy_loss_triton, hidden, weight, *args, **kwargs)
    assert chunk_rows == [rows_per_chunk] * (kept // rows_per_chunk) + [kept % rows_per_chunk]
    torch_path = linear_loss_and_grads(linear_policy_loss_torch, hidden.cpu(), weight.cpu(),
                                       *(t.cpu() for t in args), **{k: (v.cpu() if torch.is_tensor(v) else v)
                                                                    for k, v in kwargs.items()})
    for name, k, r, t, c in zip(("loss", "dhidden", "dweight"), got[:3], reference[:3], truth[:3], torch_path[:3]):
        k, r, t, c = (x.double().cpu() for x in (k, r, t, c))
        scale = max(1.0, t.abs().max().item())
        err_kernel, err_reference = (k - t).abs().max().item(), (r - t).abs().max().item()
        assert err_kernel <= err_reference + 1e-6 * scale, (name, err_kernel, err_reference)
        if dtype == torch.float32:
            # the two paths round differently (h / T before the matmul against z / T after it); a log-prob
            # difference of 1e-5 (the log-prob tolerance below) moves the loss and its gradients by as much, relatively
            assert (k - c).abs().max().item() <= 1e-5 * scale, (name, (k - c).abs().max().item())
        elif INTERPRET:
            # bf16 operands, fp32 logits and dz under the interpreter: dhidden / dweight are the truth rounded to
            # bf16 (half an ulp: 2^-8 relative, bf16's unit roundoff) up to the fp32 path's own error
            assert ((k - t).abs() <= 2**-8 * t.abs() + 1e-6 * scale).all(), name
    for key in truth[3]:
        assert abs(got[3][key] - truth[3][key]) <= 1e-5 * max(1.0, abs(truth[3][key])), key
    in_loss = (mask > 0) & (labels != -100)
    truth_logp = ppo_kernels.linear_token_logprobs_reference(f64(hidden), f64(weight), labels,
                                                             temperature=kwargs.get("temperature", 1.0))
    assert (got[4][~in_loss] == 0).all() and (got[1][~in_loss] == 0).all()
    assert (got[4].double() - truth_logp)[in_loss].abs().max().item() <= 1e-5
    if dtype == torch.float32:  # bf16: the torch path's bf16 GEMM rounds the logits to bf16 (2^-8 |z|: held to that
        # against float64 in tests/test_kernels_bf16.py); the Triton path's fp32-output GEMM does not
        assert (got[4].cpu() - torch_path[4]).abs().max().item() <= 1e-5
    if config == 0 and dtype == torch.float32:
        again = linear_loss_and_grads(linear_policy_loss_triton, hidden, weight, *args, **kwargs)
        assert all(torch.equal(a, b) for a, b in zip(got[:3], again[:3]))  # bitwise deterministic
        h = hidden.clone().requires_grad_()  # frozen head: dhidden alone, the same
        loss, _ = linear_policy_loss_triton(h, weight, *args, **kwargs)
        loss.backward()
        assert torch.equal(h.grad, got[1])


@pytest.mark.parametrize("impl", ["torch", "triton", "dispatch"])
def test_linear_policy_loss_autocast_and_mixed_dtypes(impl, monkeypatch):
    # Under autocast, fp32 hidden / weight are cast to the autocast dtype: the result is that of an explicit bf16
    # cast, and the gradients reach the fp32 tensors in fp32, straight from the fp32 accumulators: rounded to bf16
    # they are the explicit call's gradients (which autograd rounded to bf16 on the way back through the cast).
    # A weight of another dtype than hidden is cast to hidden's; a weight whose last dim is not contiguous is made so.
    fn = {"torch": linear_policy_loss_torch, "triton": linear_policy_loss_triton,
          "dispatch": ppo_kernels.linear_policy_loss}[impl]
    device = TRITON_DEVICE if impl == "triton" else "cpu"
    hidden, weight, labels, old_logp, advantages, mask, ref_logp = linear_batch(2, 24, 32, 300, device=device)
    args = (labels, old_logp, advantages, mask)
    kwargs = dict(temperature=0.7, kl_coef=0.1, ref_logp=ref_logp, dual_clip=3.0)

    def run(cast_hidden, cast_weight, autocast=False, weight_leaf=weight):
        h, w = hidden.clone().requires_grad_(), weight_leaf.clone().requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            loss, stats = fn(cast_hidden(h), cast_weight(w), *args, **kwargs)
        loss.backward()
        return loss, stats, h.grad, w.grad

    # several row tiles: the torch path's bf16 GEMMs round each tile's dW product to bf16, their sum is fp32
    monkeypatch.setattr(loss_module, "TORCH_LOSS_TILE_ELEMENTS", 10 * 300)
    keep, bf16 = (lambda t: t), (lambda t: t.to(torch.bfloat16))
    explicit = run(bf16, bf16)
    for got in (run(keep, keep, autocast=True),  # fp32 master weights under autocast
                run(bf16, keep),  # bf16 hidden, fp32 weight
                run(bf16, lambda w: w.T.contiguous().T, weight_leaf=weight.T.contiguous().T)):  # last dim strided
        assert torch.equal(got[0], explicit[0]) and torch.equal(got[1]["logp"], explicit[1]["logp"])
        assert got[2].dtype == torch.float32 and got[3].dtype == torch.float32
        assert torch.equal(got[2].to(torch.bfloat16).float(), explicit[2])
        assert torch.equal(got[3].to(torch.bfloat16).float(), explicit[3])
    assert not torch.equal(got[3], explicit[3])  # fp32 weight: its gradient was not rounded to bf16


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_linear_policy_loss_label_outside_vocabulary(impl):
    fn = linear_policy_loss_torch if impl == "torch" else linear_policy_loss_triton
    device = "cpu" if impl == "torch" else TRITON_DEVICE
    hidden, weight, labels, old_logp, advantages, mask, _ = linear_batch(2, 10, 16, 100, device=device)
    for bad in (100, -1):
        labels[1, 4] = bad
        with pytest.raises(ValueError, match=f"label {bad} is outside"):
            fn(hidden, weight, labels, old_logp, advantages, mask)
