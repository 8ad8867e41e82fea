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


# ------------------------------------------------------------------------------- the vocabulary-split forward
def test_split_plan_fills_the_gpu():
    # hand-worked: (SPLIT_V, columns per split) for 132 SMs, BLOCK_N = BLOCK_V = 128, FWD_PROGRAMS_PER_SM = 2
    plan = linear_module._split_plan
    # N = 1024: 8 row blocks, cdiv(264, 8) = 33 splits of cdiv(cdiv(151936, 33), 128) * 128 = 4608 columns
    assert plan(1024, 151936, 1024, 128, 128, 132) == (33, 4608)
    # N = 16384: 128 row blocks already fill the GPU once: cdiv(264, 128) = 3 splits
    assert plan(16384, 151936, 4096, 128, 128, 132) == (3, 50688)
    # N = 128: 264 splits wanted, capped at 151936 // 2048 = 74; 2176 columns each -> cdiv(151936, 2176) = 70
    assert plan(128, 151936, 4096, 128, 128, 132) == (70, 2176)
    # one split would need int32 offsets up to 256000 * 16384 > 2^31: two, each (128000 + 128) * 16384 < 2^31
    assert plan(65536, 256000, 16384, 128, 128, 132) == (2, 128000)
    assert plan(65536, 128256, 16384, 128, 128, 132) == (1, 128256)  # (128256 + 128) * 16384 < 2^31
    # forced counts: columns per split are whole 512-blocks, so 7 asked -> cdiv(5000, 1024) = 5 used
    assert [plan(37, 5000, 32, 16, 512, 1, s) for s in (1, 2, 4, 7, 10)] == [
        (1, 5120), (2, 2560), (4, 1536), (5, 1024), (10, 512)]


def test_split_v_forward_matches_float64():
    # V = 5000 is no multiple of the 512-column tiles or of any split; labels sit on either side of split edges
    hidden, weight, labels = make_inputs(37, 32, 5000)
    labels[:8] = torch.tensor([0, 4999, 511, 512, 1535, 1536, 2559, 2560])
    hidden, weight, labels = hidden.to(TRITON_DEVICE), weight.to(TRITON_DEVICE), labels.to(TRITON_DEVICE)
    true_logprobs, true_entropy = truth64(hidden, weight, labels, 0.7)
    true_lse = torch.logsumexp(hidden.double() @ weight.double().T / 0.7, dim=1)
    results = {}
    for split_v in (1, 2, 4, 10):
        results[split_v] = linear_module._fwd_triton(hidden, weight, labels, 0.7, split_v=split_v)
        for name, got, truth in zip(("logprobs", "entropy", "lse"), results[split_v], (true_logprobs, true_entropy,
                                                                                       true_lse)):
            assert max_err(got, truth) <= 1e-5, f"{name}, SPLIT_V={split_v}"
    for split_v in (2, 4, 10):  # the merge only reorders fp32 sums: within 4 ulp of the unsplit fold
        for got, unsplit in zip(results[split_v], results[1]):
            assert ((got - unsplit).abs() <= 2.0**-21 * unsplit.abs().clamp(min=1)).all(), f"SPLIT_V={split_v}"


def test_split_v_forward_and_backward(monkeypatch):
    monkeypatch.setattr(linear_module, "FWD_SPLIT_V", 3)  # 3 splits of 512 columns over V = 1100
    check_all("triton", 37, 32, 1100, temperature=0.7, ignore_every=4)


# ------------------------------------------------------------------------------------------- bad labels (W3)
@pytest.mark.parametrize("impl", [*IMPLS, "reference", "public"])
@pytest.mark.parametrize("bad", [-1, 50, 55])
def test_label_outside_vocabulary_is_an_error(impl, bad):
    fn = {**IMPLS, "reference": linear_token_logprobs_reference, "public": ppo_kernels.linear_token_logprobs}[impl]
    device = DEVICES.get(impl, "cpu")
    hidden, weight, labels = make_inputs(6, 16, 50)
    labels[2], labels[4] = -100, bad
    hidden, weight, labels = hidden.to(device), weight.to(device), labels.to(device)
    with pytest.raises(ValueError, match=rf"label {bad} is outside \[0, V\) with V=50"):
        fn(hidden, weight, labels)
    labels[4] = 49  # -100 alone is fine
    logprobs = fn(hidden, weight, labels)
    assert logprobs[2] == 0 and max_err(logprobs, truth64(hidden, weight, labels, 1.0)[0]) <= 1e-5


# ------------------------------------------------------------------------------ fp32 products for the backward
def test_mm_fp32_kinds_round_as_documented():
    # bf16 operands: each product a_ik b_kj is exact in fp32, so an fp32-output GEMM of K terms is within
    # K * 2^-24 * (|a| @ |b|) of the float64 result; "rounded" adds one bf16 rounding (2^-8 relative) of the product
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(16, 40, generator=gen).bfloat16()
    b = torch.randn(40, 24, generator=gen).bfloat16()
    start = torch.randn(16, 24, generator=gen)
    exact = a.double() @ b.double()  # [16, 24]
    accumulation = 40 * 2.0**-24 * (a.double().abs() @ b.double().abs())
    working = []
    for kind in (*linear_module.MM_FP32_KINDS, "upcast"):
        try:
            fresh = linear_module.mm_fp32_impl(kind, a, b, torch.full((16, 24), float("nan")), False)
            summed = linear_module.mm_fp32_impl(kind, a, b, start.clone(), True)
        except (RuntimeError, TypeError, NotImplementedError):
            continue  # an overload this torch build does not have on the CPU (addmm/mm out_dtype: CUDA only)
        working.append(kind)
        rounding = 2.0**-8 * exact.abs() if kind == "rounded" else 0.0
        assert fresh.dtype == torch.float32 and not fresh.isnan().any(), kind  # beta = 0 never reads out
        assert ((fresh.double() - exact).abs() <= accumulation + rounding).all(), kind
        total = start.double() + exact  # one more fp32 rounding for the sum
        assert ((summed.double() - total).abs() <= accumulation + rounding + 2.0**-24 * total.abs()).all(), kind
    assert "rounded" in working and "upcast" in working
    # the probe picks the first kind in MM_FP32_KINDS that works here
    first = next(k for k in linear_module.MM_FP32_KINDS if k in working)
    assert linear_module._probe_mm_fp32(torch.device("cpu"), torch.bfloat16) == first
    assert linear_module.mm_fp32_path("cpu", torch.bfloat16) == "upcast"  # not CUDA: exact fp32 copies
    assert linear_module.mm_fp32_path("cpu", torch.float32) == "upcast"


# ----------------------------------------------------------------------------------- autocast and dtypes (S1)
@pytest.mark.parametrize("impl", IMPLS)
def test_autocast_computes_in_the_autocast_dtype(impl):
    # the trainer's setting: fp32 leaves (master weights) under bf16 autocast. The head must compute as if
    # called with bf16 hidden and weight, and hand fp32 gradients back to the fp32 leaves.
    device = DEVICES[impl]
    hidden, weight, labels = make_inputs(21, 32, 700, ignore_every=5)
    hidden, weight, labels = hidden.to(device), weight.to(device), labels.to(device)
    g_logp, g_ent = torch.randn(21, device=device), torch.randn(21, device=device)

    def run_with(autocast, cast):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            logprobs, entropy = IMPLS[impl](h.to(cast), w.to(cast), labels, temperature=0.7, return_entropy=True)
        (logprobs * g_logp + entropy * g_ent).sum().backward()
        return logprobs, entropy, h.grad, w.grad

    under_autocast = run_with(True, torch.float32)
    explicit_bf16 = run_with(False, torch.bfloat16)
    plain_fp32 = run_with(False, torch.float32)
    assert under_autocast[2].dtype == under_autocast[3].dtype == torch.float32
    for got, want in zip(under_autocast, explicit_bf16):
        assert torch.equal(got, want)
    assert not torch.equal(under_autocast[0], plain_fp32[0])  # it did compute in bf16


@pytest.mark.parametrize("impl", IMPLS)
def test_mixed_dtypes_and_strided_operands(impl):
    # a bf16 weight with fp32 hidden computes as weight.float(); hidden / weight whose last dim is strided
    # (transposed storage) give what their contiguous copies give
    device = DEVICES[impl]
    hidden, weight, labels = make_inputs(13, 32, 300)
    hidden, weight, labels = hidden.to(device), weight.to(device), labels.to(device)
    weight16 = weight.bfloat16()
    mixed = IMPLS[impl](hidden, weight16, labels, return_entropy=True)
    for got, want in zip(mixed, IMPLS[impl](hidden, weight16.float(), labels, return_entropy=True)):
        assert torch.equal(got, want)
    strided = IMPLS[impl](hidden.T.contiguous().T, weight.T.contiguous().T, labels, return_entropy=True)
    for got, want in zip(strided, IMPLS[impl](hidden, weight, labels, return_entropy=True)):
        assert torch.equal(got, want)
