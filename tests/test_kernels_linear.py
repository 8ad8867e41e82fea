"""Tests of ppo_kernels.linear_token_logprobs (log-probs from hidden states and the LM head, no [N, V] logits).

    python -m pytest -q tests/test_kernels_linear.py

Three ways, as in tests/test_kernels_logprobs.py: the kernel, the plain reference in the input dtype
(hidden @ weight.T, then log_softmax), and float64 torch on the upcast inputs. The kernel's error against
float64 must not exceed the reference's plus a small epsilon; fp32 log-probs are within 1e-5 absolute.
The Triton kernels run under TRITON_INTERPRET=1 without a GPU, so they get small shapes; the chunked torch
path gets the large ones, and small tile budgets to exercise every tiling branch.
"""
import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before ppo_kernels imports triton

import pytest
import torch

import ppo_kernels
import ppo_kernels.linear_logprobs as linear_module
from ppo_kernels.linear_logprobs import (
    linear_token_logprobs_reference, linear_token_logprobs_torch, linear_token_logprobs_triton,
)
from test_kernels_logprobs import truth64 as logits_truth64  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy inf/nan warnings in the interpreter
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
IMPLS = {"triton": linear_token_logprobs_triton, "torch": linear_token_logprobs_torch}
DEVICES = {"triton": TRITON_DEVICE, "torch": "cpu"}
EPS = 1e-5


def truth64(hidden, weight, labels, temperature):
    """float64 log-probs and entropy of the float64 logits hidden @ weight.T: the ground truth."""
    return logits_truth64(hidden.double() @ weight.double().T, labels, temperature)  # [N, V] logits


def max_err(actual, expected):
    actual, expected = actual.double(), expected.double().to(actual.device)
    assert not torch.isnan(actual).any(), "NaN in the kernel's result"
    return (actual - expected).abs().max().item() if actual.numel() else 0.0


def assert_no_worse(name, kernel, reference, truth, eps=EPS):
    err_kernel, err_reference = max_err(kernel, truth), max_err(reference, truth)
    assert err_kernel <= err_reference + eps, (
        f"{name}: kernel err {err_kernel:.3g} > reference err {err_reference:.3g} + {eps:.3g}")


def make_inputs(N, H, V, dtype=torch.float32, ignore_every=0, scale=3.0):
    hidden = torch.randn(N, H)
    weight = torch.randn(V, H) * (scale / H**0.5)  # logits ~ N(0, scale^2)
    labels = torch.randint(0, V, (N,))
    if N >= 3:
        labels[0], labels[1] = 0, V - 1
    if ignore_every:
        labels[::ignore_every] = -100
    return hidden.to(dtype), weight.to(dtype), labels


def run(fn, hidden, weight, labels, temperature, mode, grad_logprobs, grad_entropy, need_weight_grad=True):
    """Forward, then backward of sum(g * output) for the chosen outputs. Returns (logprobs, entropy, dh, dw)."""
    hidden = hidden.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_(need_weight_grad)
    if mode == "logprobs-only":  # the call without entropy (the torch path then skips its sums)
        logprobs = fn(hidden, weight, labels, temperature=temperature, return_entropy=False)
        (logprobs * grad_logprobs.to(logprobs.dtype)).sum().backward()
        return logprobs.detach(), torch.zeros_like(logprobs), hidden.grad, weight.grad
    logprobs, entropy = fn(hidden, weight, labels, temperature=temperature, return_entropy=True)
    loss = 0
    if mode in ("logprobs", "both"):
        loss = loss + (logprobs * grad_logprobs.to(logprobs.dtype)).sum()
    if mode in ("entropy", "both"):
        loss = loss + (entropy * grad_entropy.to(entropy.dtype)).sum()
    loss.backward()
    return logprobs.detach(), entropy.detach(), hidden.grad, weight.grad


def truth_fn(hidden, weight, labels, temperature, return_entropy):
    logprobs, entropy = truth64(hidden, weight, labels, temperature)
    return (logprobs, entropy) if return_entropy else logprobs


def check_all(impl, N, H, V, dtype=torch.float32, temperature=1.0, mode="both", ignore_every=0,
              eps=EPS, need_weight_grad=True):
    device = DEVICES[impl]
    hidden, weight, labels = make_inputs(N, H, V, dtype=dtype, ignore_every=ignore_every)
    hidden, weight, labels = hidden.to(device), weight.to(device), labels.to(device)
    g_logp, g_ent = torch.randn(N, device=device), torch.randn(N, device=device)
    args = (labels, temperature, mode, g_logp, g_ent, need_weight_grad)
    kernel = run(IMPLS[impl], hidden, weight, *args)
    reference = run(linear_token_logprobs_reference, hidden, weight, *args)
    truth = run(truth_fn, hidden.double(), weight.double(), *args)
    assert kernel[0].dtype == torch.float32 and kernel[0].shape == labels.shape
    assert kernel[2].dtype == dtype and kernel[2].shape == hidden.shape
    if dtype == torch.float32:
        assert max_err(kernel[0], truth[0]) <= 1e-5
    for name, k, r, t in zip(("logprobs", "entropy", "dhidden", "dweight"), kernel, reference, truth):
        if name == "dweight" and not need_weight_grad:
            assert k is None
            continue
        # gradients: the slack scales with their magnitude (dweight sums over N rows)
        slack = eps if name in ("logprobs", "entropy") else eps * max(1.0, t.abs().max().item())
        assert_no_worse(f"{name} ({mode}, {dtype}, T={temperature})", k, r, t, eps=slack)
    ignored = labels == -100
    assert (kernel[0][ignored] == 0).all() and (kernel[1][ignored] == 0).all() and (kernel[2][ignored] == 0).all()


# ------------------------------------------------------------------------------------------ forward + backward
TRITON_CASES = [(1, 16, 1), (3, 16, 7), (37, 64, 4097), (1, 32, 32000), (130, 32, 257)]
TORCH_CASES = [(1, 16, 1), (3, 16, 7), (37, 64, 4095), (37, 64, 4096), (1023, 64, 4097), (257, 32, 32000),
               (3, 32, 151936)]


@pytest.mark.parametrize("impl,N,H,V", [("triton", *c) for c in TRITON_CASES] + [("torch", *c) for c in TORCH_CASES])
def test_fp32_matches_float64(impl, N, H, V, poisoned_empty):
    check_all(impl, N, H, V, temperature=0.7 if V % 2 else 1.0, ignore_every=5 if N > 5 else 0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", ["logprobs-only", "logprobs", "entropy", "both"])
def test_gradient_modes(impl, mode):
    check_all(impl, 37, 32, 1000, mode=mode, temperature=0.7, ignore_every=4)


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16(impl):
    # fp32 accumulation beats the reference, whose logits are rounded to bf16 by the matmul
    check_all(impl, 37, 64, 1000, dtype=torch.bfloat16, temperature=0.7, ignore_every=4)


@pytest.mark.parametrize("impl", IMPLS)
def test_only_hidden_needs_grad(impl):
    check_all(impl, 9, 16, 300, need_weight_grad=False)


@pytest.mark.parametrize("impl", IMPLS)
def test_every_tiling_branch(impl, monkeypatch, poisoned_empty):
    # tiny tile budgets: several row tiles (dW accumulated over them) and several V tiles, a ragged last tile
    monkeypatch.setattr(linear_module, "TORCH_TILE_ELEMENTS", 128 * 200)
    monkeypatch.setattr(linear_module, "TRITON_TILE_ELEMENTS", 128 * 200)
    check_all(impl, 450 if impl == "torch" else 150, 32, 1000, temperature=0.7, ignore_every=7)


def test_all_rows_ignored():
    hidden, weight, labels = make_inputs(5, 16, 50)
    labels[:] = -100
    for impl in IMPLS:
        h = hidden.clone().to(DEVICES[impl]).requires_grad_()
        w = weight.clone().to(DEVICES[impl]).requires_grad_()
        logprobs, entropy = IMPLS[impl](h, w, labels.to(DEVICES[impl]), return_entropy=True)
        (logprobs.sum() + entropy.sum()).backward()
        assert (logprobs == 0).all() and (entropy == 0).all()
        assert (h.grad == 0).all() and (w.grad == 0).all()


def test_gradcheck_float64_torch_path():
    hidden = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 6, -100, 3, 1])
    for temperature in (1.0, 0.7):
        def fn(h, w):
            return linear_token_logprobs_torch(h, w, labels, temperature=temperature, return_entropy=True)
        assert torch.autograd.gradcheck(fn, (hidden, weight))


@pytest.mark.parametrize("impl", IMPLS)
def test_bitwise_deterministic(impl):
    device = DEVICES[impl]
    hidden, weight, labels = make_inputs(37, 32, 1000, ignore_every=4)
    hidden, weight, labels = hidden.to(device), weight.to(device), labels.to(device)
    g = torch.randn(37, device=device)
    first = run(IMPLS[impl], hidden, weight, labels, 0.7, "both", g, g)
    second = run(IMPLS[impl], hidden, weight, labels, 0.7, "both", g, g)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_public_api_leading_dims():
    hidden, weight, labels = make_inputs(6, 16, 50)
    logprobs, entropy = ppo_kernels.linear_token_logprobs(hidden.view(2, 3, 16), weight, labels.view(2, 3),
                                                          return_entropy=True)
    assert logprobs.shape == entropy.shape == (2, 3)
    expected = linear_token_logprobs_reference(hidden, weight, labels)
    assert max_err(logprobs.reshape(6), expected) <= 1e-5
    with pytest.raises(ValueError, match="labels shape"):
        ppo_kernels.linear_token_logprobs(hidden, weight, labels[:3])


# ---------------------------------------------------------------------------------------------------- GPU tier
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs a GPU (compiled Triton, bf16 tl.dot)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_qwen_sized(dtype):
    check_all("triton", 1024, 1024, 151936, dtype=dtype, temperature=0.7, ignore_every=7)
