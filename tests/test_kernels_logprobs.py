"""Tests of ppo_kernels.token_logprobs: the Triton kernels and the chunked torch path against float64 truth.

    python -m pytest -q tests/test_kernels_logprobs.py

Each result is built three ways (as in Liger-Kernel's tests): the kernel, the plain torch reference in the
input dtype, and float64 torch on the upcast inputs. The rule: the kernel's error against float64 is no larger
than the reference's own error plus a small epsilon, and fp32 log-probs are within 1e-5 absolute.
Without a GPU the Triton kernels run under TRITON_INTERPRET=1 (slow), so they get the small shapes and the
chunked torch path gets the large ones. With a GPU the same Triton tests run compiled on CUDA tensors.
"""
import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before ppo_kernels imports triton

import pytest
import torch

import ppo_kernels
from ppo_kernels.logprobs import (
    _backend, token_logprobs_reference, token_logprobs_torch, token_logprobs_triton,
)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy inf/nan warnings in the interpreter
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
IMPLS = {"triton": token_logprobs_triton, "torch": token_logprobs_torch}
DEVICES = {"triton": TRITON_DEVICE, "torch": "cpu"}
EPS = 1e-5  # slack on top of the reference's own error (absolute, on log-probs, entropies and gradients)


def truth64(logits, labels, temperature):
    """float64 log-probs and entropy of the upcast logits: the ground truth."""
    logp_all = torch.log_softmax(logits.double() / temperature, dim=-1)  # [..., V]
    ignored = labels == -100
    logprobs = logp_all.gather(-1, labels.masked_fill(ignored, 0).unsqueeze(-1)).squeeze(-1).masked_fill(ignored, 0)
    probs = logp_all.exp()
    entropy = -(probs * logp_all.masked_fill(probs == 0, 0.0)).sum(-1).masked_fill(ignored, 0)
    return logprobs, entropy


def max_err(actual, expected):
    """max |actual - expected|, counting equal infinities as 0 and any NaN in actual as inf."""
    actual, expected = actual.double(), expected.double().to(actual.device)
    assert torch.isnan(actual).eq(torch.isnan(expected)).all(), "NaN where the truth has none (or the reverse)"
    diff = torch.where(actual == expected, 0.0, (actual - expected).abs())
    return diff.nan_to_num(0.0).max().item() if diff.numel() else 0.0


def assert_no_worse(name, kernel, reference, truth, eps=EPS):
    err_kernel, err_reference = max_err(kernel, truth), max_err(reference, truth)
    assert err_kernel <= err_reference + eps, (
        f"{name}: kernel err {err_kernel:.3g} > reference err {err_reference:.3g} + {eps:.3g}")


def make_inputs(N, V, dtype=torch.float32, scale=3.0, ignore_every=0, generator_seed=None):
    logits = torch.randn(N, V, dtype=torch.float32) * scale
    labels = torch.randint(0, V, (N,))
    if N >= 3:
        labels[0], labels[1] = 0, V - 1  # the first and last columns
    if ignore_every:
        labels[::ignore_every] = -100
    return logits.to(dtype), labels


# ---------------------------------------------------------------------------------------------------- forward
TRITON_SHAPES = [(1, 1), (3, 7), (3, 4095), (3, 4096), (3, 4097), (1, 32000), (1, 151936), (64, 7)]
TORCH_SHAPES = [(n, v) for n in (1, 3, 1023) for v in (1, 7, 4095, 4096, 4097, 32000)] + [(3, 151936)]
FORWARD_CASES = [("triton", n, v) for n, v in TRITON_SHAPES] + [("torch", n, v) for n, v in TORCH_SHAPES]


@pytest.mark.parametrize("impl,N,V", FORWARD_CASES)
def test_forward_fp32_matches_float64(impl, N, V, poisoned_empty):
    temperature = 0.7 if (N + V) % 2 else 1.0  # both temperatures across the shape list
    logits, labels = make_inputs(N, V, ignore_every=5 if N > 5 else 0)
    logits = logits.to(DEVICES[impl])
    labels = labels.to(DEVICES[impl])
    logprobs, entropy = IMPLS[impl](logits, labels, temperature=temperature, return_entropy=True)
    assert logprobs.dtype == entropy.dtype == torch.float32 and logprobs.shape == labels.shape
    ref_logprobs, ref_entropy = token_logprobs_reference(logits, labels, temperature=temperature, return_entropy=True)
    true_logprobs, true_entropy = truth64(logits, labels, temperature)
    assert max_err(logprobs, true_logprobs) <= 1e-5
    assert_no_worse("logprobs", logprobs, ref_logprobs, true_logprobs)
    assert_no_worse("entropy", entropy, ref_entropy, true_entropy)
    ignored = labels == -100
    assert (logprobs[ignored] == 0).all() and (entropy[ignored] == 0).all()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_low_precision(impl, dtype):
    logits, labels = make_inputs(5, 4097, dtype=dtype, ignore_every=4)
    logits, labels = logits.to(DEVICES[impl]), labels.to(DEVICES[impl])
    logprobs, entropy = IMPLS[impl](logits, labels, temperature=0.7, return_entropy=True)
    ref_logprobs, ref_entropy = token_logprobs_reference(logits, labels, temperature=0.7, return_entropy=True)
    true_logprobs, true_entropy = truth64(logits, labels, 0.7)
    assert logprobs.dtype == torch.float32
    assert_no_worse("logprobs", logprobs, ref_logprobs, true_logprobs)
    assert_no_worse("entropy", entropy, ref_entropy, true_entropy)


@pytest.mark.parametrize("impl", IMPLS)
def test_non_contiguous_rows(impl):
    device = DEVICES[impl]
    wide = torch.randn(4, 9, 300, device=device) * 2
    labels = torch.randint(0, 257, (4, 8), device=device)
    labels[0, 0] = -100
    cases = {
        "row stride 300 > V": (wide[0, :8, :257], labels[0]),
        "every other row, offset": (wide.reshape(36, 300)[::2, 5:262], labels.reshape(32)[:18]),
        "3-D shift logits[:, :-1]": (wide[:, :-1, :257], labels),  # rows not expressible as one stride
        "column stride 2 (copied)": (wide[:, :8, ::2][..., :150], labels.clamp(max=149)),
    }
    for name, (logits, lab) in cases.items():
        logprobs, entropy = IMPLS[impl](logits, lab, temperature=0.7, return_entropy=True)
        true_logprobs, true_entropy = truth64(logits, lab, 0.7)
        assert logprobs.shape == lab.shape, name
        assert max_err(logprobs, true_logprobs) <= 1e-5, name
        assert max_err(entropy, true_entropy) <= 1e-5, name


@pytest.mark.parametrize("impl", IMPLS)
def test_special_values(impl, poisoned_empty):
    device = DEVICES[impl]
    V = 4097
    logits = torch.randn(6, V) * 2
    logits[0, ::3] = float("-inf")  # masked-out vocabulary entries
    logits[1, 10] = float("-inf")  # label on a -inf logit: log-prob -inf
    logits[2, 17] = 200.0  # one token at probability -> 1 (entropy -> 0)
    logits[3] = 0.0  # uniform: entropy log V
    logits[4, : V - 1] = float("-inf")  # only the last token is possible
    labels = torch.tensor([1, 10, 17, 5, V - 1, -100])
    logits[5] = float("nan")  # an ignored row's logits never reach the outputs
    logits, labels = logits.to(device), labels.to(device)
    logprobs, entropy = IMPLS[impl](logits, labels, return_entropy=True)
    true_logprobs, true_entropy = truth64(logits[:5], labels[:5], 1.0)
    assert max_err(logprobs[:5], true_logprobs) <= 1e-5
    assert max_err(entropy[:5], true_entropy) <= 1e-5
    assert logprobs[1] == float("-inf") and logprobs[4] == 0 and entropy[4] == 0
    assert logprobs[5] == 0 and entropy[5] == 0
    assert abs(entropy[3].item() - torch.log(torch.tensor(float(V))).item()) < 1e-5


# ---------------------------------------------------------------------------------------------------- backward
GRAD_MODES = ["logprobs", "entropy", "both"]


def upstream(mode, logprobs, entropy, grad_logprobs, grad_entropy):
    if mode == "logprobs":
        return (logprobs * grad_logprobs).sum()
    if mode == "entropy":
        return (entropy * grad_entropy).sum()
    return (logprobs * grad_logprobs + entropy * grad_entropy).sum()


@pytest.mark.parametrize("impl,N,V", [("triton", 3, 7), ("triton", 5, 4097), ("triton", 1, 151936),
                                      ("torch", 3, 7), ("torch", 37, 4097), ("torch", 1023, 4096),
                                      ("torch", 3, 151936)])
@pytest.mark.parametrize("mode", GRAD_MODES)
def test_gradients_match_float64(impl, N, V, mode, poisoned_empty):
    device = DEVICES[impl]
    temperature = 0.7 if mode == "both" else 1.0
    logits, labels = make_inputs(N, V, ignore_every=4 if N > 4 else 0)
    logits[0, 3 % V] = float("-inf") if V > 1 else logits[0, 0]
    grad_logprobs, grad_entropy = torch.randn(N), torch.randn(N)
    logits, labels = logits.to(device), labels.to(device)
    grad_logprobs, grad_entropy = grad_logprobs.to(device), grad_entropy.to(device)

    def grad_of(fn, x):
        x = x.detach().clone().requires_grad_()
        if mode == "logprobs":  # the log-prob-only call (no entropy computed on the torch path)
            logprobs = fn(x, labels, temperature=temperature, return_entropy=False)
            (logprobs * grad_logprobs.to(logprobs.dtype)).sum().backward()
            return x.grad
        logprobs, entropy = fn(x, labels, temperature=temperature, return_entropy=True)
        upstream(mode, logprobs, entropy, grad_logprobs.to(logprobs.dtype), grad_entropy.to(logprobs.dtype)).backward()
        return x.grad

    def truth_fn(x, labels, temperature, return_entropy):
        logprobs, entropy = truth64(x, labels, temperature)
        return (logprobs, entropy) if return_entropy else logprobs

    kernel = grad_of(IMPLS[impl], logits)
    reference = grad_of(token_logprobs_reference, logits)
    truth = grad_of(truth_fn, logits.double())
    assert kernel.dtype == logits.dtype and kernel.shape == logits.shape
    assert_no_worse(f"dlogits ({mode})", kernel, reference, truth)
    assert (kernel[labels == -100] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16])
@pytest.mark.parametrize("impl", IMPLS)
def test_gradients_low_precision(impl, dtype):
    device = DEVICES[impl]
    logits, labels = make_inputs(5, 4097, dtype=dtype, ignore_every=3)
    logits, labels = logits.to(device), labels.to(device)
    grad_logprobs, grad_entropy = torch.randn(5, device=device), torch.randn(5, device=device)

    def grad_of(fn, x):
        x = x.detach().clone().requires_grad_()
        logprobs, entropy = fn(x, labels, temperature=0.7, return_entropy=True)
        (logprobs * grad_logprobs.to(logprobs.dtype) + entropy * grad_entropy.to(logprobs.dtype)).sum().backward()
        return x.grad

    kernel, reference = grad_of(IMPLS[impl], logits), grad_of(token_logprobs_reference, logits)
    truth = grad_of(lambda x, l, temperature, return_entropy: truth64(x, l, temperature), logits.double())
    assert kernel.dtype == dtype
    # the gradient is rounded to bf16 on the way out, as the reference's is
    assert_no_worse("dlogits bf16", kernel, reference, truth, eps=1e-3)


def test_gradcheck_float64_torch_path():
    logits = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 5, -100, 2])
    for temperature in (1.0, 0.7):
        def fn(x):
            logprobs, entropy = token_logprobs_torch(x, labels, temperature=temperature, return_entropy=True)
            return logprobs, entropy
        assert torch.autograd.gradcheck(fn, (logits,))


# ---------------------------------------------------------------------------------------------------- contract
@pytest.mark.parametrize("impl", IMPLS)
def test_bitwise_deterministic(impl):
    device = DEVICES[impl]
    logits, labels = make_inputs(7, 4097, ignore_every=3)
    logits, labels = logits.to(device), labels.to(device)
    grad_logprobs, grad_entropy = torch.randn(7, device=device), torch.randn(7, device=device)
    results = []
    for _ in range(2):
        x = logits.clone().requires_grad_()
        logprobs, entropy = IMPLS[impl](x, labels, temperature=0.7, return_entropy=True)
        (logprobs * grad_logprobs + entropy * grad_entropy).sum().backward()
        results.append((logprobs, entropy, x.grad))
    for first, second in zip(*results):
        assert torch.equal(first, second)


def test_torch_and_triton_agree():
    logits, labels = make_inputs(9, 4097, ignore_every=4)
    a = token_logprobs_torch(logits, labels, return_entropy=True)
    b = token_logprobs_triton(logits.to(TRITON_DEVICE), labels.to(TRITON_DEVICE), return_entropy=True)
    for x, y in zip(a, b):
        assert max_err(y.cpu(), x) <= 2e-6


def test_public_api_and_dispatch(monkeypatch):
    logits, labels = make_inputs(3, 11)
    out = ppo_kernels.token_logprobs(logits, labels)
    assert isinstance(out, torch.Tensor) and out.shape == (3,)
    logprobs, entropy = ppo_kernels.token_logprobs(logits.view(1, 3, 11), labels.view(1, 3), return_entropy=True)
    assert logprobs.shape == entropy.shape == (1, 3)
    monkeypatch.delenv("PPO_KERNELS_BACKEND", raising=False)
    assert _backend(torch.device("cpu")) == "torch"
    monkeypatch.setenv("PPO_KERNELS_BACKEND", "triton")
    assert _backend(torch.device("cpu")) == "triton"
    if INTERPRET:
        assert max_err(ppo_kernels.token_logprobs(logits, labels), out) <= 1e-6
    monkeypatch.setenv("PPO_KERNELS_BACKEND", "torch")
    assert _backend(torch.device("cuda")) == "torch"
    monkeypatch.setenv("PPO_KERNELS_BACKEND", "cuda")
    with pytest.raises(ValueError, match="PPO_KERNELS_BACKEND"):
        ppo_kernels.token_logprobs(logits, labels)
    monkeypatch.delenv("PPO_KERNELS_BACKEND")
    with pytest.raises(ValueError, match="labels shape"):
        ppo_kernels.token_logprobs(logits, labels[:2])


@pytest.mark.parametrize("impl", [*IMPLS, "reference", "public"])
@pytest.mark.parametrize("bad", [-1, 11, 16])
def test_label_outside_vocabulary_is_an_error(impl, bad):
    # without the check, Triton reads another row (or faults) and the torch paths raise an opaque index error
    fn = {**IMPLS, "reference": token_logprobs_reference, "public": ppo_kernels.token_logprobs}[impl]
    device = DEVICES.get(impl, "cpu")
    logits, labels = make_inputs(5, 11)
    labels[1], labels[3] = -100, bad
    logits, labels = logits.to(device), labels.to(device)
    with pytest.raises(ValueError, match=rf"label {bad} is outside \[0, V\) with V=11"):
        fn(logits, labels)
    labels[3] = 10  # -100 alone is fine
    logprobs = fn(logits, labels)
    assert logprobs[1] == 0 and max_err(logprobs, truth64(logits, labels, 1.0)[0]) <= 1e-5


def test_chunked_torch_path_is_memory_lean(monkeypatch):
    # the torch path never holds more than a couple of chunk-sized temporaries, whatever N
    import ppo_kernels.logprobs as module
    monkeypatch.setattr(module, "TORCH_CHUNK_ELEMENTS", 64 * 7)
    logits, labels = make_inputs(200, 7, ignore_every=9)
    x = logits.clone().requires_grad_()
    logprobs, entropy = token_logprobs_torch(x, labels, temperature=0.7, return_entropy=True)
    (logprobs.sum() + entropy.sum()).backward()
    true_logprobs, true_entropy = truth64(logits, labels, 0.7)
    assert max_err(logprobs, true_logprobs) <= 1e-5 and max_err(entropy, true_entropy) <= 1e-5


# ---------------------------------------------------------------------------------------------------- GPU tier
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs a GPU (compiled Triton)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_large_vocab(dtype):
    logits = (torch.randn(257, 151936, device="cuda") * 3).to(dtype)
    labels = torch.randint(0, 151936, (257,), device="cuda")
    labels[::7] = -100
    x = logits.clone().requires_grad_()
    logprobs, entropy = token_logprobs_triton(x, labels, temperature=0.7, return_entropy=True)
    (logprobs.sum() + entropy.sum()).backward()
    xr = logits.clone().requires_grad_()
    ref_logprobs, ref_entropy = token_logprobs_reference(xr, labels, temperature=0.7, return_entropy=True)
    (ref_logprobs.sum() + ref_entropy.sum()).backward()
    x64 = logits.double().requires_grad_()
    true_logprobs, true_entropy = truth64(x64, labels, 0.7)
    (true_logprobs.sum() + true_entropy.sum()).backward()
    assert_no_worse("logprobs", logprobs, ref_logprobs, true_logprobs)
    assert_no_worse("entropy", entropy, ref_entropy, true_entropy)
    assert_no_worse("dlogits", x.grad, xr.grad, x64.grad, eps=1e-6 if dtype == torch.float32 else 1e-3)
