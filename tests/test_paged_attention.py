"""Tests of ppo_kernels.paged_attention: decode attention over a paged KV cache, the Triton kernels and the torch
reference against a float64 ground truth built another way.

    python -m pytest -q tests/test_paged_attention.py

The truth (`truth64`) walks each sequence's visible positions one by one in Python, looks each key and value up
through the block table, and does a plain float64 softmax: no gather, no mask, no batching, so it shares none of the
reference's or the kernel's indexing. The caches are poisoned: every slot that no sequence may see (unused blocks,
the unwritten tail of a sequence's last block, the slots of its first visible block that lie before its window) is
NaN, so a read of one shows up in the result. Table entries past a sequence's end, and those of blocks wholly before
its window, are -1; tables are shuffled (no sequence's blocks are contiguous or in order).

Tolerances, with t the float64 truth:
  fp32 caches (largest error over the elements): the reference within FP32_TOL of t; the kernel no further from t
    than the reference + KERNEL_EPS (both fp32; they differ only in the order of their sums).
  bf16 caches (each element): the result is an fp32 value x rounded to bf16 (round to nearest: |rd(x) - x| <= U_BF16 |x|), so
    |out - t| <= U_BF16 |x32| + |x32 - t| + (1 + U_BF16) KERNEL_EPS, where x32 is the reference computed on the same
    bf16 values upcast to fp32 (for the reference itself KERNEL_EPS drops out). Nothing is widened beyond that.
Without a GPU the kernels run under TRITON_INTERPRET=1 (which widens bf16 operands to fp32 before tl.dot). Compiled
(with a GPU: these tests on CUDA tensors, and the GPU tier's larger shapes), the probabilities are also rounded to the
cache's dtype before the P.V product, which may add U * sum_p P_p |v_p| (`p_rounding_bound`) to the fp32 value.
"""
import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before ppo_kernels imports triton

import pytest
import torch

import ppo_kernels
from ppo_kernels.paged_attention import (
    decode_attention, default_num_splits, paged_decode_attention, paged_decode_attention_reference,
)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy inf/nan warnings in the interpreter
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
FP32_TOL = 1e-5  # |reference - truth| for fp32 caches; outputs are softmax averages of N(0, 1) values
KERNEL_EPS = 1e-6  # how much further from the truth than the reference an fp32 kernel result may be
U_BF16 = 2.0**-8  # bf16's unit roundoff (8 significant bits, round to nearest)


# ------------------------------------------------------------------------------------------------ the cases
def make_case(n_heads, n_kv_heads, head_dim, block_size, seq_lens, window, dtype, seed=0, device="cpu"):
    """(q, k_cache, v_cache, block_tables, seq_lens) with shuffled tables and NaN in every slot no query may see.

    Each sequence gets blocks for its visible span only: blocks wholly before its window get no block (entry -1),
    as do the columns past its end (one spare column at the end of every table, always -1).
    """
    gen = torch.Generator().manual_seed(seed)
    B = len(seq_lens)
    max_blocks = max(-(-L // block_size) for L in seq_lens) + 1
    lows = [max(0, L - window) if window is not None else 0 for L in seq_lens]
    needed = [-(-L // block_size) - lo // block_size for L, lo in zip(seq_lens, lows)]
    n_blocks = sum(needed) + 3  # three blocks nobody owns
    pool = torch.randperm(n_blocks, generator=gen)  # shuffled: block i of a sequence lands anywhere
    k_cache = torch.full((n_blocks, block_size, n_kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    block_tables = torch.full((B, max_blocks), -1, dtype=torch.int32)
    used = 0
    for b, (L, lo) in enumerate(zip(seq_lens, lows)):
        for col in range(lo // block_size, -(-L // block_size)):
            block_tables[b, col] = pool[used]
            used += 1
        for p in range(lo, L):  # only the visible positions are written
            block, slot = block_tables[b, p // block_size], p % block_size
            k_cache[block, slot] = torch.randn(n_kv_heads, head_dim, generator=gen)
            v_cache[block, slot] = torch.randn(n_kv_heads, head_dim, generator=gen)
    q = 2 * torch.randn(B, n_heads, head_dim, generator=gen)  # x2: sharper softmaxes than N(0, 1) scores give
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return [t.to(device) for t in (q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), block_tables, lens)]


def truth64(q, k_cache, v_cache, block_tables, seq_lens, window=None, scale=None):
    """float64 attention, one sequence, position and head at a time (q cast to the cache's dtype first, as the
    functions under test do)."""
    B, n_heads, head_dim = q.shape
    block_size, n_kv_heads = k_cache.shape[1], k_cache.shape[2]
    g = n_heads // n_kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    q = q.to(k_cache.dtype).double().cpu()
    k_cache, v_cache, block_tables = k_cache.double().cpu(), v_cache.double().cpu(), block_tables.cpu()
    out = torch.empty(B, n_heads, head_dim, dtype=torch.float64)
    for b in range(B):
        L = int(seq_lens[b])
        lo = max(0, L - window) if window is not None else 0
        slots = [(int(block_tables[b, p // block_size]), p % block_size) for p in range(lo, L)]
        keys = torch.stack([k_cache[block, slot] for block, slot in slots])  # [n, n_kv_heads, head_dim]
        values = torch.stack([v_cache[block, slot] for block, slot in slots])
        for h in range(n_heads):
            scores = keys[:, h // g] @ q[b, h] * scale  # [n]
            weights = torch.exp(scores - scores.max())
            out[b, h] = (weights / weights.sum()) @ values[:, h // g]
    return out


# (name, n_heads, n_kv_heads, head_dim, block_size, seq_lens, window, scale, dtype): GQA g = 1, 2, 3, 4; lengths 1,
# exactly a block, a block + 1, several blocks; windows smaller than a block and straddling blocks.
CASES = [
    ("g1 hd14 bs4", 3, 3, 14, 4, [1, 4, 5, 23], None, None, torch.float32),
    ("g2 hd24 bs16", 4, 2, 24, 16, [16, 17, 1, 70], None, 0.3, torch.float32),
    ("g3 hd24 bs4 window 3 < block", 6, 2, 24, 4, [9, 2, 30, 3], 3, None, torch.float32),
    ("g4 hd64 bs16 window 20 straddles", 4, 1, 64, 16, [40, 16, 5, 33], 20, None, torch.float32),
    ("g2 hd14 bs4 window 6 bf16", 6, 3, 14, 4, [7, 1, 26], 6, None, torch.bfloat16),
    ("g4 hd64 bs16 bf16", 8, 2, 64, 16, [1, 33, 64], None, None, torch.bfloat16),
]
IDS = [case[0] for case in CASES]


def bf16_bound(x32, truth, eps, p_rounding=0.0):
    """The largest |out - truth| a bf16 result may have: an fp32 value within eps + p_rounding of x32 (fp32 attention
    on the same bf16 values) rounded to bf16 (module docstring)."""
    x32 = x32.double().cpu()
    return U_BF16 * x32.abs() + (x32 - truth).abs() + (1 + U_BF16) * (eps + p_rounding)


def p_rounding_bound(inputs, window, scale, unit):
    """U * sum_p P_p |v_p| (float64): what rounding the probabilities to the cache's dtype before the P.V product
    (the compiled kernels' bf16 / fp16 path, not the interpreter's) may add to each output element."""
    q, k_cache, v_cache, tables, lens = inputs
    weighted_abs = paged_decode_attention_reference(q.to(k_cache.dtype).double(), k_cache.double(),
                                                    v_cache.double().abs(), tables, lens, window=window, scale=scale)
    return unit * weighted_abs.cpu()


def check_against_truth(name, out, reference, truth, x32, p_rounding=0.0):
    """out (kernel) and reference against the float64 truth, by the rules of the module docstring."""
    out, reference = out.double().cpu(), reference.double().cpu()
    assert not out.isnan().any(), f"{name}: NaN (a poisoned slot was read)"
    if x32 is None:  # fp32
        err_ref, err_out = (reference - truth).abs().max().item(), (out - truth).abs().max().item()
        assert err_ref <= FP32_TOL, f"{name}: reference err {err_ref:.3g}"
        assert err_out <= err_ref + KERNEL_EPS, f"{name}: kernel err {err_out:.3g} > reference err {err_ref:.3g} + eps"
    else:
        assert ((reference - truth).abs() <= bf16_bound(x32, truth, 0.0)).all(), f"{name}: reference"
        excess = (out - truth).abs() - bf16_bound(x32, truth, KERNEL_EPS, p_rounding)
        assert (excess <= 0).all(), f"{name}: kernel beyond the bf16 rounding bound by {excess.max().item():.3g}"


def upcast_reference(q, k_cache, v_cache, *rest, **kwargs):
    """The reference on the bf16 values upcast to fp32: the fp32 result a bf16 output is the rounding of."""
    return paged_decode_attention_reference(q.to(k_cache.dtype).float(), k_cache.float(), v_cache.float(), *rest,
                                            **kwargs)


# ------------------------------------------------------------------------------------------------ the reference
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_reference_matches_float64(case):
    name, n_heads, n_kv, head_dim, block_size, seq_lens, window, scale, dtype = case
    q, k_cache, v_cache, tables, lens = make_case(n_heads, n_kv, head_dim, block_size, seq_lens, window, dtype)
    reference = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, window=window, scale=scale)
    assert reference.shape == q.shape and reference.dtype == dtype
    truth = truth64(q, k_cache, v_cache, tables, lens, window=window, scale=scale)
    x32 = None if dtype == torch.float32 else upcast_reference(q, k_cache, v_cache, tables, lens, window=window,
                                                              scale=scale)
    check_against_truth(f"reference {name}", reference, reference, truth, x32)
    # float64 in, float64 out: the reference's math is the truth's (up to summation order)
    exact = paged_decode_attention_reference(q.double(), k_cache.double(), v_cache.double(), tables, lens,
                                             window=window, scale=scale)
    assert exact.dtype == torch.float64 and (exact - truth).abs().max().item() < 1e-12


def test_reference_q_in_another_dtype_than_the_cache():
    # fp32 queries over a bf16 cache (an fp32 model with a bf16 cache): attention runs in the cache's dtype, the
    # result comes back in q's
    q, k_cache, v_cache, tables, lens = make_case(4, 2, 24, 4, [5, 9], None, torch.bfloat16)
    q32 = q.float() + 1e-3 * torch.randn(q.shape)  # not representable in bf16
    out = paged_decode_attention_reference(q32, k_cache, v_cache, tables, lens)
    assert out.dtype == torch.float32
    assert torch.equal(out, upcast_reference(q32, k_cache, v_cache, tables, lens))


# ------------------------------------------------------------------------------------------------ the kernels
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_kernel_matches_float64_and_reference(case):
    name, n_heads, n_kv, head_dim, block_size, seq_lens, window, scale, dtype = case
    inputs = make_case(n_heads, n_kv, head_dim, block_size, seq_lens, window, dtype, device=TRITON_DEVICE)
    q, k_cache, v_cache, tables, lens = inputs
    reference = paged_decode_attention_reference(*inputs, window=window, scale=scale)
    truth = truth64(*inputs, window=window, scale=scale)
    x32 = None if dtype == torch.float32 else upcast_reference(*inputs, window=window, scale=scale)
    compiled_bf16 = dtype == torch.bfloat16 and not INTERPRET
    p_rounding = p_rounding_bound(inputs, window, scale, U_BF16) if compiled_bf16 else 0.0
    # 1 split; 2; more splits than any sequence has blocks (some splits get none)
    for num_splits in (1, 2, tables.shape[1] + 2):
        out = paged_decode_attention(*inputs, window=window, scale=scale, num_splits=num_splits)
        assert out.shape == q.shape and out.dtype == dtype
        check_against_truth(f"kernel {name} num_splits={num_splits}", out, reference, truth, x32, p_rounding)
        if num_splits == 2:  # bit-for-bit deterministic
            again = paged_decode_attention(*inputs, window=window, scale=scale, num_splits=num_splits)
            assert torch.equal(out, again)


def test_kernel_q_in_another_dtype_and_head_dim_80():
    # fp32 queries over a bf16 cache, and a head_dim (80) that is no power of two: padded to 128 with masked lanes
    inputs = make_case(4, 1, 80, 16, [1, 17, 40], 24, torch.bfloat16, seed=1, device=TRITON_DEVICE)
    q32 = inputs[0].float() + 1e-3 * torch.randn(inputs[0].shape, device=TRITON_DEVICE)
    inputs[0] = q32
    out = paged_decode_attention(*inputs, window=24, num_splits=2)
    assert out.dtype == torch.float32
    reference = paged_decode_attention_reference(*inputs, window=24)
    truth = truth64(*inputs, window=24)
    check_against_truth("kernel fp32 q over bf16 cache", out, reference, truth, None)


def test_default_num_splits():
    # a pure function of (B, n_kv_heads, max_blocks, SM count)
    assert default_num_splits(64, 8, 64, 132) == 2  # Qwen3-0.6B, B = 64, 1024 keys (16-token blocks), H200
    assert default_num_splits(4, 8, 64, 132) == 16  # few sequences: split their length
    assert default_num_splits(1, 1, 4096, 132) == 64  # at most MAX_SPLITS
    assert default_num_splits(2, 1, 3, 132) == 1  # no split shorter than MIN_BLOCKS_PER_SPLIT blocks
    assert default_num_splits(256, 8, 64, 132) == 1  # enough sequences already


def test_dispatch_and_errors(monkeypatch):
    inputs = make_case(4, 2, 24, 4, [3, 8], 5, torch.float32)
    monkeypatch.delenv("PPO_KERNELS_BACKEND", raising=False)
    # CPU tensors run the reference
    assert torch.equal(ppo_kernels.decode_attention(*inputs, window=5),
                       paged_decode_attention_reference(*inputs, window=5))
    assert ppo_kernels.paged_decode_attention is paged_decode_attention
    if INTERPRET:
        monkeypatch.setenv("PPO_KERNELS_BACKEND", "triton")
        out = decode_attention(*inputs, window=5)
        assert (out - paged_decode_attention_reference(*inputs, window=5)).abs().max() <= 1e-6
        monkeypatch.delenv("PPO_KERNELS_BACKEND")
    q, k_cache, v_cache, tables, lens = inputs
    with pytest.raises(ValueError, match="not a multiple"):
        paged_decode_attention_reference(q[:, :3], k_cache, v_cache, tables, lens)
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention_reference(q, k_cache, v_cache, tables[:1], lens)
    with pytest.raises(ValueError, match="window"):
        paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, window=0)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention_reference(q[..., :8], k_cache, v_cache, tables, lens)


# ------------------------------------------------------------------------------------------------ GPU tier
def gpu_case(n_heads, n_kv_heads, head_dim, block_size, seq_lens, window, dtype, seed=0):
    """A large case made on the GPU: a shuffled pool with NaN in every block no table uses."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    B = len(seq_lens)
    max_blocks = -(-max(seq_lens) // block_size)
    n_blocks = B * max_blocks + 7
    k_cache = torch.randn(n_blocks, block_size, n_kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
    v_cache = torch.randn(n_blocks, block_size, n_kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
    order = torch.randperm(n_blocks, device="cuda", generator=gen)
    block_tables = order[: B * max_blocks].view(B, max_blocks).to(torch.int32)
    lens = torch.tensor(seq_lens, device="cuda", dtype=torch.int32)
    cols = torch.arange(max_blocks, device="cuda")
    lo = (lens - window).clamp(min=0) if window is not None else torch.zeros_like(lens)
    unused = (cols[None, :] * block_size >= lens[:, None]) | ((cols[None, :] + 1) * block_size <= lo[:, None])
    k_cache[order[B * max_blocks:]] = float("nan")  # blocks nobody owns, and those the tables drop below
    v_cache[order[B * max_blocks:]] = float("nan")
    k_cache[block_tables.long()[unused]] = float("nan")
    v_cache[block_tables.long()[unused]] = float("nan")
    block_tables[unused] = -1
    q = 2 * torch.randn(B, n_heads, head_dim, device="cuda", generator=gen)
    return [q.to(dtype), k_cache, v_cache, block_tables, lens]


GPU_CASES = [  # (n_heads, n_kv_heads, head_dim, block_size, window, dtype)
    (16, 8, 128, 16, None, torch.bfloat16),  # Qwen3-0.6B
    (32, 8, 64, 16, 300, torch.bfloat16),  # g = 4 with a window
    (28, 4, 128, 32, None, torch.bfloat16),  # Qwen2.5-7B: g = 7
    (16, 8, 128, 16, 300, torch.float32),
    (12, 2, 80, 16, None, torch.float16),  # head_dim 80, g = 6
]


@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs a GPU (compiled Triton)")
@pytest.mark.parametrize("n_heads,n_kv_heads,head_dim,block_size,window,dtype", GPU_CASES)
def test_gpu_large(n_heads, n_kv_heads, head_dim, block_size, window, dtype):
    lengths = torch.randint(1, 1500, (27,), generator=torch.Generator().manual_seed(head_dim + n_heads))
    seq_lens = [1, block_size, block_size + 1, 1000, 2049] + lengths.tolist()
    inputs = gpu_case(n_heads, n_kv_heads, head_dim, block_size, seq_lens, window, dtype)
    q, k_cache, v_cache, tables, lens = inputs
    truth = paged_decode_attention_reference(q.to(dtype).double(), k_cache.double(), v_cache.double(), tables, lens,
                                             window=window)
    reference = paged_decode_attention_reference(*inputs, window=window)
    x32 = upcast_reference(*inputs, window=window)
    unit = {torch.bfloat16: U_BF16, torch.float16: 2.0**-11, torch.float32: 0.0}[dtype]  # unit roundoff
    p_rounding = p_rounding_bound(inputs, window, None, unit).cuda()
    for num_splits in (None, 1, 3, 200):
        out = paged_decode_attention(*inputs, window=window, num_splits=num_splits)
        assert not out.isnan().any()
        assert torch.equal(out, paged_decode_attention(*inputs, window=window, num_splits=num_splits))
        err = (out.double() - truth).abs()  # [B, n_heads, head_dim] on the GPU
        if dtype == torch.float32:
            err_ref = (reference.double() - truth).abs().max().item()
            assert err_ref <= FP32_TOL and err.max().item() <= err_ref + KERNEL_EPS, (num_splits, err.max().item())
        else:
            bound = unit * x32.double().abs() + (x32.double() - truth).abs() + (1 + unit) * (KERNEL_EPS + p_rounding)
            assert (err <= bound).all(), (num_splits, (err - bound).max().item())
