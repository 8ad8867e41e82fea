"""Per-token log-probs (and entropy) straight from hidden states and the LM head, never forming [N, V] logits.

    z = hidden @ weight.T / temperature              # [N, V], only ever one tile at a time
    logprob_i = z_i[label_i] - logsumexp(z_i),   entropy_i = -sum_v p_iv log p_iv

The forward folds tiles of z into per-row online statistics (running max m, s = sum exp(z - m),
a = sum exp(z - m) (z - m), the label's logit) in fp32, whatever the input dtype. The backward recomputes each
tile from the saved logsumexp, turns it into dz, and accumulates

    dhidden += dz_tile @ weight_tile / temperature,   dweight_tile = dz_tile.T @ hidden / temperature

so its workspace is one tile (plus an [N, H] accumulator, fp64 for fp32 inputs: see _tile_shape; fp32 for
bf16 ones), never [N, V]. This costs one extra matmul (4 instead of 3 for forward + backward), the price of not
storing the logits; with upstream gradients unknown in the forward (two per row: log-prob and entropy) it
cannot be avoided. (linear_logprob_loss in loss.py, given the loss, takes its gradient in the forward and gets by
with 3.)

Three implementations with one signature, in this file:
  - `linear_token_logprobs_reference`: hidden @ weight.T then `token_logprobs_reference` (full logits).
  - Triton (`_linear_fwd_kernel` + `_linear_fwd_combine_kernel`, `_linear_dz_kernel`): the forward is one fused
    kernel (tl.dot tiles folded in registers, as in Cut Cross-Entropy, arXiv:2411.09009) over (row block,
    vocabulary split) programs, then a small merge; the backward writes dz for one block of V at a time into a
    bounded workspace and hands it to two cuBLAS matmuls (`_mm_fp32`; deterministic, unlike atomics).
  - the chunked torch path (`_fwd_torch`, `_bwd_torch`): the same tiling with torch.mm; what CPU tensors run.
    bf16 operands stay bf16 for its matmuls (`_torch_mm_dtype`: bf16 GEMMs run at 2-3x the fp32 rate on CPUs
    with AVX512-BF16 or AMX); their outputs come back rounded to bf16 (CPU GEMMs have no fp32 output for bf16
    operands), as eager bf16's logits and gradients do: |error| <= 2^-8 |z| per logit. The statistics are fp32.

The Triton forward is split over the vocabulary as well as the rows, so that a few thousand kept tokens still
fill a GPU: program (i, j) folds rows block i against vocabulary split j into partial statistics (m, s, a,
label_z), written to [SPLIT_V, N] fp32 buffers, and `_linear_fwd_combine_kernel` merges the splits in a fixed
order (0, 1, ..., SPLIT_V - 1; no atomics, so the result is deterministic):

    M = max_j m_j,   s = sum_j exp(m_j - M) s_j,   a = sum_j exp(m_j - M) (a_j + (m_j - M) s_j)

SPLIT_V is chosen from N and the GPU's SM count (`_split_plan`); SPLIT_V = 1 gives exactly the unsplit fold.

Rows whose label is -100 are dropped before any matmul (they give log-prob 0, entropy 0, zero gradient); any
other label outside [0, V) is a ValueError (one host sync per call).

Dtypes: under autocast (the trainer's fp32 master weights + bf16 autocast, on CUDA or the CPU), fp32 hidden and
weight are cast to the autocast dtype *before* the autograd Function, so the kernels take their bf16 path
(tensor cores; bf16 GEMMs on the CPU) and autograd carries the gradient back to the fp32 tensors (computed in
bf16's precision, as autocast's own matmuls give it); everything inside then runs with autocast disabled, at
the dtypes chosen here. A weight of another dtype than hidden is cast to hidden's; the last dims are made
contiguous. Log-probs and entropies are fp32 (fp64 for fp64 inputs on the torch path), gradients come back in
the operands' dtypes. tests/test_kernels_bf16.py checks the bf16 torch path against float64.
"""
import functools

import torch

from .logprobs import (
    IGNORE_INDEX, _autocast_off, _backend, _check_labels, _compute_dtype, _interpreting, token_logprobs_reference,
)

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# Elements in one logits tile on the torch path (fp32: 32 MiB; two such buffers are live, plus a bf16 one of 16 MiB
# for bf16 operands: the GEMMs' output and dz). At N = 2048 that is 4096 vocabulary columns: [2048, 1024] x
# [1024, 4096] products already run at the CPU's matmul rate.
TORCH_TILE_ELEMENTS = 1 << 23
# Elements in the backward's dz workspace on the Triton path (bf16: 128 MiB).
TRITON_TILE_ELEMENTS = 1 << 26
# The Triton forward's vocabulary splits: enough (row block, split) programs for FWD_PROGRAMS_PER_SM per SM,
# each split at least FWD_MIN_SPLIT_COLS wide (its partial statistics cost a few stores and a combine).
# FWD_SPLIT_V forces the split count (tests; None: chosen by _split_plan).
FWD_PROGRAMS_PER_SM = 2
FWD_MIN_SPLIT_COLS = 2048
FWD_SPLIT_V = None
INTERPRETER_SM_COUNT = 1  # the interpreter has no SMs: 1 still gives 2 splits when one row block is all of N


def linear_token_logprobs_reference(hidden, weight, labels, *, temperature=1.0, return_entropy=False):
    """token_logprobs_reference(hidden @ weight.T): materialises the [N, V] logits in the input dtype."""
    _check_labels(labels, weight.shape[0])
    logits = hidden @ weight.T  # [N, V]
    return token_logprobs_reference(logits, labels, temperature=temperature, return_entropy=return_entropy)


def _tile_shape(n_rows, n_cols, tile_elements, align=128, max_cols=8192):
    """(rows, cols) of a logits tile holding at most ~tile_elements: all rows if they fit, cols a multiple of 128.

    cols is capped so that each dz_tile @ weight_tile sums over at most max_cols terms before the fp64
    accumulation of dhidden (one fp32 product over all of V is ~30x less accurate: its terms cancel).
    """
    rows = max(1, min(n_rows, tile_elements // align))
    cols = max(align, min(max_cols, (tile_elements // rows) // align * align))
    return rows, min(cols, n_cols)


# ----------------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _logits_tile(h_ptr, stride_hn, stride_hh, w_ptr, stride_wv, stride_wh, rows, cols, N, V, H,
                     UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr):
        # [BLOCK_N, BLOCK_V] = hidden[rows] @ weight[cols].T, accumulated in fp32. The callers advance h_ptr and
        # w_ptr to their block (int64) and pass local rows / cols (int32) with N / V the valid counts from there.
        acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_H):
            ks = k0 + tl.arange(0, BLOCK_H)
            h = tl.load(h_ptr + rows[:, None] * stride_hn + ks[None, :] * stride_hh,
                        mask=(rows[:, None] < N) & (ks[None, :] < H), other=0.0)  # [BLOCK_N, BLOCK_H]
            w = tl.load(w_ptr + cols[None, :] * stride_wv + ks[:, None] * stride_wh,
                        mask=(cols[None, :] < V) & (ks[:, None] < H), other=0.0)  # [BLOCK_H, BLOCK_V]
            if UPCAST:  # the interpreter mishandles bf16 in tl.dot; on a GPU bf16 stays bf16 (fp32 accumulate)
                h = h.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(h, w, acc, input_precision=PRECISION)
        return acc

    @triton.jit
    def _linear_fwd_kernel(
        h_ptr, stride_hn, stride_hh,  # hidden [N, H]
        w_ptr, stride_wv, stride_wh,  # weight [V, H]
        labels_ptr,  # [N] int in [0, V) (ignored rows were dropped by the wrapper, others checked)
        part_m_ptr, part_s_ptr, part_a_ptr, part_label_ptr,  # [SPLIT_V, N] fp32 out: this split's statistics
        N, V, H, cols_per_split, temperature,
        UPCAST: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    ):
        # Program (i, j): rows block i against vocabulary columns [j * cols_per_split, (j + 1) * cols_per_split),
        # one [BLOCK_N, BLOCK_V] tile at a time. Offsets: the row block's and the split's base offsets are int64
        # (row0 * stride_hn, v_start * stride_wv: N * H and V * H may pass 2^31); offsets from those bases are
        # int32: rows * stride_hn < BLOCK_N * stride_hn, and cols * stride_wv < (cols_per_split + BLOCK_V) *
        # stride_wv, which _split_plan keeps below 2^31. (int32 there, rather than a 64-bit pointer carried
        # through the loop, kept the bf16 variant at 186 registers on sm_90a instead of 255: ptxas -v, triton 3.9,
        # BLOCK_H = 64.)
        row0 = tl.program_id(0).to(tl.int64) * BLOCK_N
        split = tl.program_id(1)
        rows = tl.arange(0, BLOCK_N)  # local to the row block
        n_rows = N - row0
        h_block = h_ptr + row0 * stride_hn
        v_start = split * cols_per_split  # int32: < V
        n_cols = tl.minimum(cols_per_split, V - v_start)  # this split's columns
        w_split = w_ptr + v_start.to(tl.int64) * stride_wv
        labels = tl.load(labels_ptr + row0 + rows, mask=rows < n_rows, other=-1).to(tl.int32) - v_start
        m = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)  # running max of z
        s = tl.zeros((BLOCK_N,), dtype=tl.float32)  # sum exp(z - m)
        a = tl.zeros((BLOCK_N,), dtype=tl.float32)  # sum exp(z - m) * (z - m)
        label_z = tl.zeros((BLOCK_N,), dtype=tl.float32)  # z[label] if the label is in this split, else 0
        for v0 in range(0, n_cols, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)  # local to the split
            # `/` compiles to div.full.f32 (<= 2 ulp), not the exact division of logprobs.py: z's fp32 dot
            # already rounds differently from torch's matmul, and the backward's recompute divides the same way.
            z = _logits_tile(h_block, stride_hn, stride_hh, w_split, stride_wv, stride_wh, rows, cols, n_rows,
                             n_cols, H, UPCAST, PRECISION, BLOCK_N, BLOCK_V, BLOCK_H) / temperature
            z = tl.where(cols[None, :] < n_cols, z, float("-inf"))
            label_z += tl.sum(tl.where(cols[None, :] == labels[:, None], z, 0.0), axis=1)
            m_new = tl.maximum(m, tl.max(z, axis=1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf
            rescale = tl.exp(m - m_ref)
            e = tl.exp(z - m_ref[:, None])
            a = rescale * (a + tl.where(s > 0, (m - m_ref) * s, 0.0))
            a += tl.sum(tl.where(e > 0, e * (z - m_ref[:, None]), 0.0), axis=1)
            s = rescale * s + tl.sum(e, axis=1)
            m = m_new
        out = split.to(tl.int64) * N + row0 + rows  # [SPLIT_V, N] row-major
        tl.store(part_m_ptr + out, m, mask=rows < n_rows)
        tl.store(part_s_ptr + out, s, mask=rows < n_rows)
        tl.store(part_a_ptr + out, a, mask=rows < n_rows)
        tl.store(part_label_ptr + out, label_z, mask=rows < n_rows)

    @triton.jit
    def _linear_fwd_combine_kernel(
        part_m_ptr, part_s_ptr, part_a_ptr, part_label_ptr,  # [SPLIT_V, N] fp32, from _linear_fwd_kernel
        logprobs_ptr, entropy_ptr, lse_ptr,  # [N] fp32 out
        N, SPLIT_V,
        BLOCK: tl.constexpr,
    ):
        # Merge the splits of each row in the fixed order 0..SPLIT_V-1 (deterministic). With SPLIT_V = 1 every
        # step below is exact (M = m, exp(0) = 1, + 0), so the result is the unsplit fold's, bit for bit.
        rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: split * N + row below
        mask = rows < N
        M = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
        offs = rows  # split j's entry for these rows: j * N + rows, advanced in int64
        for _ in range(0, SPLIT_V):
            M = tl.maximum(M, tl.load(part_m_ptr + offs, mask=mask, other=float("-inf")))
            offs += N
        M_ref = tl.where(M == float("-inf"), 0.0, M)  # no -inf - -inf
        s = tl.zeros((BLOCK,), dtype=tl.float32)
        a = tl.zeros((BLOCK,), dtype=tl.float32)
        label_z = tl.zeros((BLOCK,), dtype=tl.float32)
        offs = rows
        for _ in range(0, SPLIT_V):
            m_j = tl.load(part_m_ptr + offs, mask=mask, other=float("-inf"))
            s_j = tl.load(part_s_ptr + offs, mask=mask, other=0.0)
            a_j = tl.load(part_a_ptr + offs, mask=mask, other=0.0)
            rescale = tl.exp(m_j - M_ref)
            # a_j is relative to m_j: moving it to M shifts every (z - m_j) by (m_j - M)
            a += rescale * (a_j + tl.where(s_j > 0, (m_j - M_ref) * s_j, 0.0))
            s += rescale * s_j
            label_z += tl.load(part_label_ptr + offs, mask=mask, other=0.0)  # one split holds the label
            offs += N
        log_s = tl.log(s)
        # logprob = (z_label - M) - log s;  entropy = log s - a / s;  logsumexp = M + log s
        tl.store(logprobs_ptr + rows, (label_z - M) - log_s, mask=mask)
        tl.store(entropy_ptr + rows, log_s - a / s, mask=mask)
        tl.store(lse_ptr + rows, M + log_s, mask=mask)

    @triton.jit
    def _linear_dz_kernel(
        h_ptr, stride_hn, stride_hh,  # hidden rows of this tile [n, H]
        w_ptr, stride_wv, stride_wh,  # weight rows of this tile [vc, H]
        labels_ptr, lse_ptr, entropy_ptr, grad_logprobs_ptr, grad_entropy_ptr,  # [n]
        dz_ptr, stride_dn,  # [n, vc] out, the workspace
        N, V, H, v0, temperature,
        HAS_GRAD_LOGPROBS: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr,
        UPCAST: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    ):
        # Recompute one [BLOCK_N, BLOCK_V] tile of z and write dloss/dz for it. Offsets: the tile's base offsets
        # are int64 pointer advances (row0 * stride_hn, col0 * stride_wv, row0 * stride_dn); inside the tile
        # they are int32 (rows, cols local, < BLOCK).
        row0 = tl.program_id(0).to(tl.int64) * BLOCK_N
        col0 = tl.program_id(1) * BLOCK_V  # int32: < V
        rows = tl.arange(0, BLOCK_N)
        cols = tl.arange(0, BLOCK_V)
        n_rows = N - row0
        z = _logits_tile(h_ptr + row0 * stride_hn, stride_hn, stride_hh, w_ptr + col0.to(tl.int64) * stride_wv,
                         stride_wv, stride_wh, rows, cols, n_rows, V - col0, H,
                         UPCAST, PRECISION, BLOCK_N, BLOCK_V, BLOCK_H) / temperature
        row_mask = rows < n_rows
        logp = z - tl.load(lse_ptr + row0 + rows, mask=row_mask, other=0.0)[:, None]
        p = tl.exp(logp)
        dz = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
        if HAS_GRAD_LOGPROBS:
            # d logp_label / dz_v = 1[v = label] - p_v
            g = tl.load(grad_logprobs_ptr + row0 + rows, mask=row_mask, other=0.0)[:, None]
            labels = tl.load(labels_ptr + row0 + rows, mask=row_mask, other=-1).to(tl.int32)
            dz += g * (tl.where(cols[None, :] == (labels - v0 - col0)[:, None], 1.0, 0.0) - p)
        if HAS_GRAD_ENTROPY:
            # d H / dz_v = -p_v (log p_v + H)
            g = tl.load(grad_entropy_ptr + row0 + rows, mask=row_mask, other=0.0)[:, None]
            ent = tl.load(entropy_ptr + row0 + rows, mask=row_mask, other=0.0)[:, None]
            dz -= g * tl.where(p > 0, p * (logp + ent), 0.0)
        tl.store(dz_ptr + row0 * stride_dn + col0 + rows[:, None] * stride_dn + cols[None, :],
                 dz.to(dz_ptr.dtype.element_ty), mask=row_mask[:, None] & (cols[None, :] < V - col0))


def _autocast_operands(hidden, weight):
    """hidden and weight at the dtype the head computes in, cast before the autograd Function so that autograd
    carries each gradient back to the caller's tensor in its own dtype.

    Under autocast an fp32 operand is cast to the autocast dtype, as autocast casts a matmul's (fp32 master
    weights would otherwise select the exact-fp32 kernels, on CUDA cores); then a weight of another dtype than
    hidden is cast to hidden's (tl.dot takes one dtype); the last dims are made contiguous (the kernels' fast
    variant assumes unit inner strides).
    """
    device_type = hidden.device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        autocast_dtype = torch.get_autocast_dtype(device_type)
        hidden = hidden.to(autocast_dtype) if hidden.dtype == torch.float32 else hidden
        weight = weight.to(autocast_dtype) if weight.dtype == torch.float32 else weight
    if weight.dtype != hidden.dtype:
        weight = weight.to(hidden.dtype)
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    return hidden, weight


def _triton_options(dtype):
    interpreting = _interpreting()
    fp32 = dtype in (torch.float32, torch.float64)
    if interpreting:  # numpy runs each op over the whole block: few, wide blocks are what make it fast
        return dict(UPCAST=True, PRECISION="ieee", BLOCK_N=16, BLOCK_V=512, BLOCK_H=32)
    return dict(
        UPCAST=fp32,
        # fp32 inputs get true fp32 products (tf32 would miss the 1e-5 log-prob tolerance)
        PRECISION="ieee" if fp32 else "tf32",
        # BLOCK_H, the step along H, sizes the operand tiles each pipeline stage holds beside the [BLOCK_N, BLOCK_V]
        # fp32 tile. At 64 (bf16) / 32 (fp32) ptxas put the bf16 forward on sm_80 and the bf16 dz on sm_90a at its
        # 255-register cap under triton 3.6, the fp32 forward on sm_80 under 3.9; at 32 / 16 every variant stays
        # within tests/test_kernels_compile.py's margin on both. The tile, hence the grid and the splits, is as before.
        BLOCK_N=64 if fp32 else 128, BLOCK_V=128, BLOCK_H=16 if fp32 else 32,
        num_warps=8, num_stages=2 if fp32 else 3,
    )


# ----------------------------------------------------------------------------------------------------------------
# out (+)= a @ b in fp32 for the Triton backward's two cuBLAS matmuls
# ----------------------------------------------------------------------------------------------------------------
# The ways to compute an fp32 product of bf16/fp16 operands, best first. torch's fp32-output GEMMs (the
# `out_dtype=` overloads, torch >= 2.8, CUDA) accumulate and write fp32 without rounding the product to bf16;
# which of them a given torch build accepts is found by trying (`_probe_mm_fp32`). "rounded" (Liger's legacy
# path) always works, at the cost of one bf16 rounding of each product. "upcast" (fp32 copies of the operands,
# an fp32 GEMM) is exact and what fp32 operands, and every device but CUDA, use.
MM_FP32_KINDS = ("addmm_out_dtype", "mm_out_dtype_into", "mm_out_dtype", "rounded")
_MM_FP32_PATHS = {}  # (device, dtype) -> the kind chosen, filled on first use; see mm_fp32_path


def mm_fp32_impl(kind, a, b, out, accumulate):
    """out (+)= a @ b computed the way `kind` names (see MM_FP32_KINDS); out is fp32 [M, N], a [M, K], b [K, N]."""
    beta = 1.0 if accumulate else 0.0  # beta = 0: `out` is not read, so its old contents (even NaN) do not matter
    if kind == "addmm_out_dtype":
        return torch.addmm(out, a, b, beta=beta, out_dtype=torch.float32, out=out)
    if kind == "upcast":
        return torch.addmm(out, a.to(out.dtype), b.to(out.dtype), beta=beta, out=out)
    if kind == "mm_out_dtype_into" and not accumulate:  # written in place: no [M, N] temporary
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    if kind in ("mm_out_dtype", "mm_out_dtype_into"):
        # (some torch builds reject addmm's fp32 `self` with bf16 operands but take mm with out_dtype)
        product = torch.mm(a, b, out_dtype=torch.float32)  # [M, N] fp32
    elif kind == "rounded":
        product = torch.mm(a, b).float()  # [M, N], rounded to a's dtype first
    else:
        raise ValueError(f"unknown _mm_fp32 kind {kind!r}")
    return out.add_(product) if accumulate else out.copy_(product)


def _probe_mm_fp32(device, dtype, kinds=MM_FP32_KINDS):
    """The first of `kinds` that runs on (device, dtype) and gives a 16x16 product to within its rounding.

    Each kind gets two tries: beta = 0 into a NaN-filled out (must not read it), and accumulate onto ones.
    """
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(16, 16, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(16, 16, generator=gen).to(device=device, dtype=dtype)
    exact = a.double() @ b.double()  # [16, 16]; the products of bf16/fp16 values are exact in fp32
    bound = 2.0 ** -7 * (a.double().abs() @ b.double().abs()) + 1e-6  # loose: one bf16/fp16 rounding passes
    for kind in kinds:
        try:
            fresh = mm_fp32_impl(kind, a, b, torch.full((16, 16), float("nan"), device=device), False)
            summed = mm_fp32_impl(kind, a, b, torch.ones(16, 16, device=device), True)
        except (RuntimeError, TypeError, NotImplementedError):  # an overload this torch build lacks
            continue
        if ((fresh.double() - exact).abs() <= bound).all() and ((summed.double() - 1 - exact).abs() <= bound).all():
            return kind
    raise RuntimeError(f"no fp32-output matmul works for {dtype} on {device} (tried {kinds})")


def mm_fp32_path(device, dtype):
    """How _mm_fp32 computes for operands of `dtype` on `device` ("upcast" or one of MM_FP32_KINDS).

    bf16/fp16 operands on CUDA are probed once per (device, dtype) and the answer cached; bench scripts print it.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if dtype not in (torch.float16, torch.bfloat16) or device.type != "cuda":
        return "upcast"
    key = (str(device), dtype)
    if key not in _MM_FP32_PATHS:
        _MM_FP32_PATHS[key] = _probe_mm_fp32(device, dtype)
    return _MM_FP32_PATHS[key]


def _mm_fp32(a, b, out, accumulate=False):
    """out (+)= a @ b into an fp32 `out`, without first rounding the product to the inputs' dtype where torch
    allows it (see MM_FP32_KINDS; the path taken is `mm_fp32_path(a.device, a.dtype)`)."""
    with _autocast_off(a.device.type):
        return mm_fp32_impl(mm_fp32_path(a.device, a.dtype), a, b, out, accumulate)


# ----------------------------------------------------------------------------------------------------------------
# Triton forward and backward
# ----------------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def sm_count(device):
    """The number of SMs the forward's vocabulary splits are planned for (a fixed stand-in off CUDA and under the
    interpreter); public for the GPU script's first checks, which print it."""
    if _interpreting() or device.type != "cuda":
        return INTERPRETER_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count


def _split_plan(n_rows, V, weight_row_stride, block_n, block_v, sm_count, split_v=None):
    """(SPLIT_V, columns per split) of the Triton forward's grid (cdiv(n_rows, block_n), SPLIT_V).

    Enough splits for FWD_PROGRAMS_PER_SM programs per SM, none narrower than FWD_MIN_SPLIT_COLS (unless V is),
    unless `split_v` forces a count; and always enough that a split's int32 weight offsets, (columns per split +
    block_v) * weight_row_stride, stay below 2^31 (see _linear_fwd_kernel). Columns per split are a multiple of
    block_v (no ragged tile inside V), so the count used may differ from the one asked for: it is
    cdiv(V, columns per split), and no split is empty.
    """
    row_blocks = -(-n_rows // block_n)
    if split_v is None:
        wanted = -(-FWD_PROGRAMS_PER_SM * sm_count // row_blocks)
        split_v = min(wanted, max(1, V // FWD_MIN_SPLIT_COLS))
    max_cols = ((2**31 - 1) // max(weight_row_stride, 1) - block_v) // block_v * block_v
    split_v = max(1, -(-V // max_cols), min(int(split_v), -(-V // block_v)))
    cols_per_split = -(-(-(-V // split_v)) // block_v) * block_v
    return -(-V // cols_per_split), cols_per_split


def _fwd_triton(hidden, weight, labels, temperature, split_v=None):
    # hidden [N, H], weight [V, H], labels [N] all in [0, V). Returns logprobs, entropy, lse: [N] fp32.
    # split_v forces the number of vocabulary splits (else FWD_SPLIT_V, else _split_plan's choice).
    N, H = hidden.shape
    V = weight.shape[0]
    logprobs = torch.empty(N, device=hidden.device, dtype=torch.float32)
    entropy = torch.empty_like(logprobs)
    lse = torch.empty_like(logprobs)
    if N == 0:
        return logprobs, entropy, lse
    opts = _triton_options(hidden.dtype)
    split_v, cols_per_split = _split_plan(N, V, weight.stride(0), opts["BLOCK_N"], opts["BLOCK_V"],
                                          sm_count(hidden.device), split_v if split_v is not None else FWD_SPLIT_V)
    partials = torch.empty((4, split_v, N), device=hidden.device, dtype=torch.float32)  # m, s, a, label_z
    _linear_fwd_kernel[(triton.cdiv(N, opts["BLOCK_N"]), split_v)](
        hidden, hidden.stride(0), hidden.stride(1), weight, weight.stride(0), weight.stride(1),
        labels, partials[0], partials[1], partials[2], partials[3], N, V, H, cols_per_split, temperature, **opts,
    )
    block = 1024 if _interpreting() else 256
    _linear_fwd_combine_kernel[(triton.cdiv(N, block),)](
        partials[0], partials[1], partials[2], partials[3], logprobs, entropy, lse, N, split_v,
        BLOCK=block, num_warps=4,
    )
    return logprobs, entropy, lse


def _bwd_triton(hidden, weight, labels, temperature, lse, entropy, grad_logprobs, grad_entropy, need_dh, need_dw):
    # hidden [N, H], weight [V, H] one dtype; labels, lse, entropy, grad_* [N]. Returns dhidden [N, H] fp32, dweight.
    # Autocast off: it would recast dh's fp32 matmul below to bf16 (the fp64 accumulation then sums bf16 products).
    with _autocast_off(hidden.device.type):
        return _bwd_triton_tiles(hidden, weight, labels, temperature, lse, entropy, grad_logprobs, grad_entropy,
                                 need_dh, need_dw)


def _bwd_triton_tiles(hidden, weight, labels, temperature, lse, entropy, grad_logprobs, grad_entropy, need_dh,
                      need_dw):
    N, H = hidden.shape
    V = weight.shape[0]
    opts = _triton_options(hidden.dtype)
    # fp32 inputs: accumulate dhidden over the V tiles in fp64 (see _bwd_torch); bf16/fp16: fp32 is plenty
    dh_dtype = torch.float64 if hidden.dtype in (torch.float32, torch.float64) else torch.float32
    dh = torch.zeros((N, H), device=hidden.device, dtype=dh_dtype) if need_dh else None
    if N == 0:  # every row ignored
        return dh, torch.zeros_like(weight) if need_dw else None
    dw = torch.empty((V, H), device=weight.device, dtype=weight.dtype) if need_dw else None
    rows_per_tile, cols_per_tile = _tile_shape(N, V, TRITON_TILE_ELEMENTS)
    # dz in the input dtype feeds the two matmuls at full speed on a GPU; the interpreter truncates fp32 -> bf16
    # stores instead of rounding them, so there it stays fp32.
    low_precision = hidden.dtype in (torch.bfloat16, torch.float16)
    dz_dtype = hidden.dtype if low_precision and not _interpreting() else torch.float32
    workspace = torch.empty(rows_per_tile * cols_per_tile, device=hidden.device, dtype=dz_dtype)
    multi_row = rows_per_tile < N
    dw_slab = torch.empty((cols_per_tile, H), device=weight.device, dtype=torch.float32) if need_dw else None
    for v0 in range(0, V, cols_per_tile):
        v1 = min(v0 + cols_per_tile, V)
        w_tile = weight[v0:v1]  # [vc, H]
        for r0 in range(0, N, rows_per_tile):
            r1 = min(r0 + rows_per_tile, N)
            dz = workspace[: (r1 - r0) * (v1 - v0)].view(r1 - r0, v1 - v0)  # [n, vc]
            h_tile = hidden[r0:r1]
            grid = (triton.cdiv(r1 - r0, opts["BLOCK_N"]), triton.cdiv(v1 - v0, opts["BLOCK_V"]))
            _linear_dz_kernel[grid](
                h_tile, h_tile.stride(0), h_tile.stride(1), w_tile, w_tile.stride(0), w_tile.stride(1),
                labels[r0:r1], lse[r0:r1], entropy[r0:r1],
                grad_logprobs[r0:r1] if grad_logprobs is not None else lse,
                grad_entropy[r0:r1] if grad_entropy is not None else lse,
                dz, dz.stride(0), r1 - r0, v1 - v0, H, v0, temperature,
                HAS_GRAD_LOGPROBS=grad_logprobs is not None, HAS_GRAD_ENTROPY=grad_entropy is not None, **opts,
            )
            if need_dh:
                if dh.dtype == torch.float64:
                    dh[r0:r1] += torch.mm(dz.float(), w_tile.float())  # [n, H]
                else:
                    _mm_fp32(dz, w_tile.to(dz.dtype), out=dh[r0:r1], accumulate=True)  # [n, H]
            if need_dw:
                _mm_fp32(dz.T, h_tile.to(dz.dtype), out=dw_slab[: v1 - v0], accumulate=multi_row and r0 > 0)
        if need_dw:
            dw[v0:v1] = dw_slab[: v1 - v0] / temperature
    return ((dh / temperature).float() if need_dh else None), dw


# ----------------------------------------------------------------------------------------------------------------
# Chunked torch path
# ----------------------------------------------------------------------------------------------------------------
def _fold_tile(z, stats, rows, e_buf, local_labels, in_tile, need_entropy=True):
    """Fold one tile z [n, vc] into the running (m, s, a, label_z) of its rows. Overwrites z and e_buf."""
    m, s, a, label_z = (t[rows] for t in stats)
    label_z = torch.where(in_tile, z.gather(1, local_labels.clamp(0, z.shape[1] - 1).unsqueeze(1)).squeeze(1),
                          label_z)
    m_new = torch.maximum(m, z.amax(1))
    m_ref = m_new.masked_fill(m_new == float("-inf"), 0.0)  # no -inf - -inf
    rescale = torch.exp(m - m_ref)
    z.sub_(m_ref.unsqueeze(1))  # z - m
    e = torch.exp(z, out=e_buf)  # exp(z - m)
    s_tile = e.sum(1)
    if need_entropy:
        a_tile = e.mul_(z).sum(1)  # tiles of hidden @ weight.T are finite: no 0 * -inf here
        # move the old sums from reference m to m_ref, then add this tile
        a = rescale * (a + torch.where(s > 0, (m - m_ref) * s, 0.0)) + a_tile
    s = rescale * s + s_tile
    for t, new in zip(stats, (m_new, s, a, label_z)):
        t[rows] = new


def _torch_mm_dtype(dtype):
    """The dtype the torch path's matmuls run in for operands of `dtype`; its statistics are _compute_dtype's.

    bf16 stays bf16: a bf16 GEMM (oneDNN; fp32 accumulation inside, each output rounded to bf16) runs at 2-3x
    the fp32 rate on CPUs with AVX512-BF16 or AMX, and is what eager bf16 / autocast runs. fp16 is upcast (CPUs
    have no fast fp16 GEMM, and fp16 dz would underflow); fp32 and fp64 run as they are.
    """
    return torch.bfloat16 if dtype == torch.bfloat16 else _compute_dtype(dtype)


def _tile_logits(h_rows, w_tile, temperature, z_out, mm_out):
    """z = h_rows @ w_tile.T / temperature for one tile, into z_out [n, vc] at the statistics dtype.

    mm_out None (operands at the statistics dtype): h_rows comes already divided by the temperature (one pass
    over [n, H] rather than [n, vc]) and the product goes straight to z_out. mm_out [n, vc] bf16 (bf16 operands):
    the bf16 GEMM writes there, each logit rounded to bf16 (|error| <= 2^-8 |z|, the rounding eager bf16 and
    autocast give their logits too), then z_out = that / T in fp32 (dividing hidden first would round hidden / T
    to bf16 as well; torch.div(bf16, T, out=fp32) would round the quotient to bf16 before widening it).
    """
    if mm_out is None:
        return torch.mm(h_rows, w_tile.T, out=z_out)
    z_out.copy_(torch.mm(h_rows, w_tile.T, out=mm_out))
    return z_out.div_(temperature) if temperature != 1.0 else z_out


def _add_widened(total, part, scratch):
    """total += part for an fp32 total and a bf16 part [rows, cols], widened block by block into scratch.

    scratch: a free fp32 buffer (flat, any size >= one row). A plain mixed-dtype add_ first widens part into a
    fresh fp32 temporary as large as part (for a [V, H] gradient, page faults costing several times the add);
    blocks as large as the scratch keep the number of ops (each a thread-pool synchronisation) small.
    """
    rows = max(1, min(total.shape[0], scratch.numel() // max(1, total[0].numel())))
    for r0 in range(0, total.shape[0], rows):
        n = min(rows, total.shape[0] - r0)
        total[r0:r0 + n].add_(scratch[: part[r0:r0 + n].numel()].view(part[r0:r0 + n].shape).copy_(part[r0:r0 + n]))


def _fwd_torch(hidden, weight, labels, temperature, need_entropy=True):
    N, H = hidden.shape
    V = weight.shape[0]
    acc = _compute_dtype(hidden.dtype)  # the statistics' dtype: fp32 (fp64 for fp64 inputs)
    mm_dtype = _torch_mm_dtype(hidden.dtype)
    h = hidden.to(mm_dtype)
    if temperature != 1.0 and mm_dtype == acc:
        h = h / temperature  # [N, H]: dividing the small operand saves a pass over every tile
    m = torch.full((N,), float("-inf"), device=hidden.device, dtype=acc)
    s, a, label_z = (torch.zeros((N,), device=hidden.device, dtype=acc) for _ in range(3))
    rows_per_tile, cols_per_tile = _tile_shape(N, V, TORCH_TILE_ELEMENTS)
    z_buf = torch.empty(rows_per_tile * cols_per_tile, device=hidden.device, dtype=acc)
    e_buf = torch.empty_like(z_buf)
    # bf16 operands: the GEMM's bf16 output tile, widened into z_buf for the statistics
    mm_buf = None if mm_dtype == acc else torch.empty_like(z_buf, dtype=mm_dtype)
    for v0 in range(0, V, cols_per_tile):
        v1 = min(v0 + cols_per_tile, V)
        w_tile = weight[v0:v1].to(mm_dtype)  # [vc, H]
        for r0 in range(0, N, rows_per_tile):
            r1 = min(r0 + rows_per_tile, N)
            n, vc = r1 - r0, v1 - v0
            z = _tile_logits(h[r0:r1], w_tile, temperature, z_buf[: n * vc].view(n, vc),
                             None if mm_buf is None else mm_buf[: n * vc].view(n, vc))  # [n, vc] z for this tile
            local = labels[r0:r1] - v0
            _fold_tile(z, (m, s, a, label_z), slice(r0, r1), e_buf[: n * vc].view(n, vc), local,
                       (local >= 0) & (local < vc), need_entropy)
    log_s = torch.log(s)
    # logprob = (z_label - m) - log s;  entropy = log s - a / s;  logsumexp = m + log s
    return (label_z - m) - log_s, (log_s - a / s) if need_entropy else None, m + log_s


def _bwd_torch(hidden, weight, labels, temperature, lse, entropy, grad_logprobs, grad_entropy, need_dh, need_dw):
    """dhidden [N, H] (at the statistics dtype) and dweight [V, H] (weight's dtype) for the kept rows.

    fp32 / fp64 operands: the tile matmuls run at that dtype, dhidden accumulates in fp64 (see below).
    bf16 operands: dz / T (1/T folded into the per-row upstream gradients) rounded to bf16 feeds two bf16
    GEMMs, whose outputs are rounded to bf16; they are summed in fp32 (dhidden over the V tiles, dweight over
    the row tiles). This is eager bf16's rounding (autograd rounds d logits to bf16 for the matmul backward);
    with one tile of each it is the same computation.
    """
    N, H = hidden.shape
    V = weight.shape[0]
    acc = _compute_dtype(hidden.dtype)
    mm_dtype = _torch_mm_dtype(hidden.dtype)
    low_precision = mm_dtype != acc
    h = hidden.to(mm_dtype)
    if temperature != 1.0 and not low_precision:
        h = h / temperature  # z = h @ W.T with h = hidden / T, so dW = dz.T @ h and dhidden = dz @ W / T
    g_logp = grad_logprobs.to(acc) if grad_logprobs is not None else None
    g_ent = grad_entropy.to(acc) if grad_entropy is not None else None
    if temperature != 1.0 and low_precision:
        # dz is linear in (g_logp, g_ent): scaled here, it is dloss/d(hidden @ W.T) = dloss/dz / T, and the GEMMs
        # give dW = dz.T @ hidden, dhidden = dz @ W with no rounded result left to divide
        g_logp = g_logp / temperature if g_logp is not None else None
        g_ent = g_ent / temperature if g_ent is not None else None
    rows_per_tile, cols_per_tile = _tile_shape(N, V, TORCH_TILE_ELEMENTS)
    z_buf = torch.empty(rows_per_tile * cols_per_tile, device=hidden.device, dtype=acc)
    dz_buf = torch.empty_like(z_buf)
    # bf16: the GEMM's output tile for z, then the bf16 copy of dz / T that feeds the two gradient GEMMs
    mm_buf = torch.empty_like(z_buf, dtype=mm_dtype) if low_precision else None
    # dhidden sums dz @ W over every V tile, with heavy cancellation (each row of dz sums to ~0): accumulating
    # the fp32 tiles in fp64 keeps that sum as accurate as one tile's product (one fp32 product over V: ~30x
    # worse). bf16 products are rounded to bf16 (2^-8) before they are summed: fp32 is plenty there.
    dh = torch.zeros((N, H), device=hidden.device, dtype=acc if low_precision else torch.float64) if need_dh else None
    if N == 0:  # every row ignored
        return dh, torch.zeros_like(weight) if need_dw else None
    dh_tile = torch.empty((rows_per_tile, H), device=hidden.device, dtype=mm_dtype) if need_dh else None
    dw = torch.empty((V, H), device=weight.device, dtype=weight.dtype) if need_dw else None
    # With one row tile each dW row block is written once, straight into dw when the dtypes agree; otherwise the
    # row tiles' products are summed in a slab at the statistics dtype.
    direct_dw = rows_per_tile >= N and weight.dtype == mm_dtype
    dw_slab = None if (direct_dw or not need_dw) else torch.empty((cols_per_tile, H), device=weight.device, dtype=acc)
    dw_tile = torch.empty((cols_per_tile, H), device=weight.device, dtype=mm_dtype) if (
        need_dw and low_precision and not direct_dw) else None  # a bf16 product before it joins the slab
    for v0 in range(0, V, cols_per_tile):
        v1 = min(v0 + cols_per_tile, V)
        w_tile = weight[v0:v1].to(mm_dtype)  # [vc, H]
        for r0 in range(0, N, rows_per_tile):
            r1 = min(r0 + rows_per_tile, N)
            n, vc = r1 - r0, v1 - v0
            mm_out = mm_buf[: n * vc].view(n, vc) if low_precision else None
            logp = _tile_logits(h[r0:r1], w_tile, temperature, z_buf[: n * vc].view(n, vc), mm_out)  # [n, vc] z
            logp.sub_(lse[r0:r1].unsqueeze(1))  # log p
            dz = torch.exp(logp, out=dz_buf[: n * vc].view(n, vc))  # p, turned into dloss/dz in place
            if g_ent is not None:
                # dz = -p * (g_logp + g_ent * (log p + H))   [+ g_logp at the label, below]
                logp.add_(entropy[r0:r1].unsqueeze(1)).mul_(g_ent[r0:r1].unsqueeze(1))
                if g_logp is not None:
                    logp.add_(g_logp[r0:r1].unsqueeze(1))
                dz.mul_(logp).neg_()
            else:
                dz.mul_(-g_logp[r0:r1].unsqueeze(1))  # dz = -g_logp * p
            if g_logp is not None:
                # d logp_label / dz_v = 1[v = label] - p_v
                local = labels[r0:r1] - v0
                hit = ((local >= 0) & (local < vc)).nonzero().squeeze(1)
                dz.index_put_((hit, local[hit]), g_logp[r0:r1][hit], accumulate=True)
            if low_precision:
                dz = mm_out.copy_(dz)  # [n, vc] bf16: the gradient GEMMs' operand
            if need_dh:
                dh[r0:r1] += torch.mm(dz, w_tile, out=dh_tile[:n])  # [n, H]
            if need_dw and direct_dw:
                torch.mm(dz.T, h[r0:r1], out=dw[v0:v1])  # [vc, H]
            elif need_dw and low_precision:  # each row tile's bf16 product, summed in the fp32 slab
                product = torch.mm(dz.T, h[r0:r1], out=dw_tile[:vc])  # [vc, H]
                if r0 == 0:
                    dw_slab[:vc].copy_(product)
                else:
                    _add_widened(dw_slab[:vc], product, scratch=dz_buf)  # dz_buf is free: dz is in mm_out
            elif need_dw and r0 == 0:
                torch.mm(dz.T, h[r0:r1], out=dw_slab[:vc])  # [vc, H]
            elif need_dw:
                dw_slab[:vc].addmm_(dz.T, h[r0:r1])
        if need_dw and not direct_dw:
            dw[v0:v1] = dw_slab[: v1 - v0]
    if need_dh and temperature != 1.0 and not low_precision:
        dh.div_(temperature)
    return (dh.to(acc) if need_dh else None), dw


# ----------------------------------------------------------------------------------------------------------------
# Autograd wrapper and dispatch
# ----------------------------------------------------------------------------------------------------------------
class _LinearTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, backend, need_entropy):
        # hidden [N, H], weight [V, H], labels [N]. Returns logprobs [N], entropy [N].
        ctx.set_materialize_grads(False)
        N = hidden.shape[0]
        acc = _compute_dtype(hidden.dtype) if backend == "torch" else torch.float32
        valid = labels != IGNORE_INDEX
        # Ignored rows (prompt, padding) are dropped before any matmul; their outputs are 0.
        keep = valid.nonzero().squeeze(1)  # [Nv]
        all_valid = keep.numel() == N
        h_kept = hidden if all_valid else hidden.index_select(0, keep)
        labels_kept = labels if all_valid else labels.index_select(0, keep)
        if backend == "triton":  # the entropy is free in the fused kernel
            logp_kept, ent_kept, lse_kept = _fwd_triton(h_kept, weight, labels_kept, temperature)
        else:
            logp_kept, ent_kept, lse_kept = _fwd_torch(h_kept, weight, labels_kept, temperature, need_entropy)
            if ent_kept is None:
                ent_kept = torch.zeros_like(logp_kept)  # never returned, so never differentiated
        if all_valid:
            logprobs, entropy = logp_kept.to(acc), ent_kept.to(acc)
        else:
            logprobs = torch.zeros(N, device=hidden.device, dtype=acc).index_copy_(0, keep, logp_kept.to(acc))
            entropy = torch.zeros(N, device=hidden.device, dtype=acc).index_copy_(0, keep, ent_kept.to(acc))
        ctx.save_for_backward(hidden, weight, labels_kept, keep, lse_kept, ent_kept)
        ctx.temperature, ctx.backend, ctx.all_valid, ctx.need_entropy = temperature, backend, all_valid, need_entropy
        ctx.device_type = hidden.device.type
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        # backward() may run under autocast (the forward's state does not carry over): every op at its own dtype
        with _autocast_off(ctx.device_type):
            return _LinearTokenLogprobs._backward(ctx, grad_logprobs, grad_entropy)

    @staticmethod
    def _backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, labels_kept, keep, lse_kept, ent_kept = ctx.saved_tensors
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not ctx.need_entropy:
            grad_entropy = None  # the entropy was not returned to the caller
        if (grad_logprobs is None and grad_entropy is None) or not (need_dh or need_dw):
            return None, None, None, None, None, None
        h_kept = hidden if ctx.all_valid else hidden.index_select(0, keep)
        gdtype = lse_kept.dtype
        g_logp = grad_logprobs.to(gdtype).index_select(0, keep).contiguous() if grad_logprobs is not None else None
        g_ent = grad_entropy.to(gdtype).index_select(0, keep).contiguous() if grad_entropy is not None else None
        bwd = _bwd_triton if ctx.backend == "triton" else _bwd_torch
        dh_kept, dw = bwd(h_kept, weight, labels_kept, ctx.temperature, lse_kept, ent_kept, g_logp, g_ent,
                          need_dh, need_dw)
        dhidden = None
        if need_dh:
            if ctx.all_valid:
                dhidden = dh_kept.to(hidden.dtype)
            else:
                dhidden = torch.zeros(hidden.shape, device=hidden.device, dtype=hidden.dtype)
                dhidden.index_copy_(0, keep, dh_kept.to(hidden.dtype))
        return dhidden, dw, None, None, None, None


def _linear_token_logprobs(hidden, weight, labels, temperature, return_entropy, backend):
    if hidden.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ValueError(f"hidden [..., H] {tuple(hidden.shape)} and weight [V, H] {tuple(weight.shape)} disagree")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} must be hidden shape without H {tuple(hidden.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    _check_labels(labels, weight.shape[0])
    hidden, weight = _autocast_operands(hidden, weight)  # [..., H], [V, H]: one dtype, unit inner strides
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    flat_labels = labels.reshape(-1).contiguous()  # [N]
    with _autocast_off(hidden.device.type):  # the Function's ops run at the dtypes chosen above
        logprobs, entropy = _LinearTokenLogprobs.apply(flat_hidden, weight, flat_labels, float(temperature),
                                                       backend, return_entropy)
    if not return_entropy:
        return logprobs.view(labels.shape)
    return logprobs.view(labels.shape), entropy.view(labels.shape)


def linear_token_logprobs_triton(hidden, weight, labels, *, temperature=1.0, return_entropy=False):
    """`linear_token_logprobs` on the Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1)."""
    return _linear_token_logprobs(hidden, weight, labels, temperature, return_entropy, "triton")


def linear_token_logprobs_torch(hidden, weight, labels, *, temperature=1.0, return_entropy=False):
    """`linear_token_logprobs` on the chunked torch path (any device; what CPU tensors run)."""
    return _linear_token_logprobs(hidden, weight, labels, temperature, return_entropy, "torch")


def linear_token_logprobs(hidden, weight, labels, *, temperature=1.0, return_entropy=False):
    """log p(label) under softmax(hidden @ weight.T / temperature) (+ entropy), without the [N, V] logits.

    hidden: [N, H] (or [..., H]) any float dtype; weight: [V, H] the LM head; labels: [N] (or [...]) int,
    IGNORE_INDEX (-100) rows give 0 and no gradient, any other label outside [0, V) raises ValueError.
    Returns logprobs [N] float32, or (logprobs, entropy) with return_entropy=True; differentiable w.r.t. hidden
    and weight. Under autocast, fp32 hidden / weight compute at the autocast dtype (gradients still reach them
    in fp32); a weight of another dtype than hidden is cast to hidden's. CUDA tensors run Triton, others the
    chunked torch path; PPO_KERNELS_BACKEND=triton|torch forces one.
    """
    return _linear_token_logprobs(hidden, weight, labels, temperature, return_entropy, _backend(hidden.device))
