"""Decode attention over a paged KV cache: one new query token per sequence, its keys gathered through a block table.

    out[b, h] = sum_p softmax_p(scale * q[b, h] . k[b, p]) v[b, p],   p in [max(0, L_b - window), L_b)

where L_b = seq_lens[b] keys are visible (the query is position L_b - 1, its own key and value already written) and
k[b, p] = k_cache[block_tables[b, p // block_size], p % block_size, h // g] (g = n_heads / n_kv_heads: GQA).

The layout (the rollout engine's; fixed):
    k_cache, v_cache  [n_blocks, block_size, n_kv_heads, head_dim]   one layer's pool, last dim contiguous
    q                 [B, n_heads, head_dim]                          one query per sequence
    block_tables      [B, max_blocks] int32                           entry i: the pool block of positions
                                                                      i*block_size .. (i+1)*block_size - 1
    seq_lens          [B] int32 >= 1
Table entries past a sequence's end, and (with a window) those of blocks lying wholly before the window, may be -1:
they are never read. `window` follows transformers' sliding-window convention: a query sees itself and the
window - 1 keys before it. Attention runs in the cache's dtype, as ppo_core.models.model.KVCache's does: q is cast to the
cache's dtype first (a no-op when they match), the products and the softmax are fp32 (fp64 for fp64 inputs on the
torch path), and the result comes back in q's dtype.

In this file:
  - `paged_decode_attention_reference`: plain PyTorch, any device. The keys of every sequence are gathered at once
    through the table, -1 clamped to 0 (one [B, T, n_kv_heads, head_dim] copy, T spanning the table columns some
    sequence sees), positions outside each sequence's [lo, L) are masked, then a softmax. The engine's CPU path.
  - the Triton kernels (flash-decoding, Dao et al. 2023, https://crfm.stanford.edu/2023/10/12/flashdecoding.html):
    `_paged_decode_split_kernel` runs one program per (sequence, kv head, split); split s owns a contiguous range of
    the sequence's visible blocks, folds them one [BLOCK_N keys, head_dim] tile at a time into an online softmax in
    fp32 (running max m, sum l, weighted sum acc), and writes (m, l, acc) to fp32 partial buffers;
    `_paged_decode_combine_kernel` merges each (sequence, head)'s splits in the fixed order 0, 1, ..., num_splits-1
    (no atomics: the result is bit-for-bit deterministic for a given num_splits):
        M = max_s m_s,   out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s
    With one split the split kernel writes the output itself (acc / l, what the merge would give, bit for bit).
  - `decode_attention`: the dispatcher; CUDA tensors run the kernels, others the reference
    (PPO_KERNELS_BACKEND=triton|torch forces one, as for every ppo_kernels op).

GQA tiles: the g query heads that share a kv head are one [G_PAD, head_dim] tile (G_PAD = max(16, next_pow2(g)),
padded rows masked) matched against each key tile with tl.dot, so the keys are read once per kv head, not once per
query head, and the products run on tensor cores. The tile is used transposed, keys on the MMA's M side:
    scores^T [BLOCK_N, G_PAD] = K [BLOCK_N, D] @ q^T [D, G_PAD];   acc^T [D, G_PAD] += V^T [D, BLOCK_N] @ p^T
because Hopper's wgmma needs M to be a multiple of 64, which G_PAD = 16 is not (the "swap AB" of small-M GEMMs);
BLOCK_N = 64 keys and head_dim 64 / 128 are. bf16 / fp16 operands enter tl.dot as they are (p is rounded to v's
dtype for the second product, as in flash attention); fp32 operands get exact fp32 products ("ieee"). Under the
Triton interpreter (TRITON_INTERPRET=1), which mishandles bf16 in tl.dot, every operand is widened to fp32 (UPCAST).
head_dim need not be a power of two (80, 96, ...): it is padded to D_PAD with masked (zero) lanes.

Splits: `default_num_splits(B, n_kv_heads, max_blocks, sm_count)` is a pure function of those four numbers (sm_count
is the GPU's SM count, CPU_SM_COUNT off the GPU and under the interpreter), so a sequence's result depends only on
them and on its own inputs. Each split covers cdiv(visible blocks, num_splits) blocks (rounded up to whole key
tiles), counted from the first visible block of that sequence, so the work is spread over the splits whatever the
sequence's length; splits left without blocks write an empty partial (m = -inf, l = 0), which the merge weighs 0.
"""
import functools

import torch

from .logprobs import _autocast_off, _backend, _interpreting

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton on this platform: only the reference exists
    triton = None

# default_num_splits: enough (sequence, kv head, split) programs for PROGRAMS_PER_SM per SM, but no split shorter
# than MIN_BLOCKS_PER_SPLIT blocks (its partials cost (head_dim + 2) fp32 per head and a merge), at most MAX_SPLITS.
PROGRAMS_PER_SM = 4
MIN_BLOCKS_PER_SPLIT = 4
MAX_SPLITS = 64
CPU_SM_COUNT = 1  # the "SM count" off the GPU and under the interpreter: one split unless B * n_kv_heads < 4
# Key tile of the split kernel: BLOCK_N keys per step. bf16 / fp16: 64 (wgmma's M is a multiple of 64). fp32: 32
# (exact fp32 products run on the FMA units, operands in registers: at 64 keys and head_dim 128 ptxas spills). The
# interpreter's is smaller, so that the tests' short sequences still take several steps. tests/test_kernels_compile.py
# checks the GPU choices (registers, spills, shared memory, MMA instructions) on sm_90a and sm_80.
BLOCK_N_GPU = 64
BLOCK_N_GPU_FP32 = 32
BLOCK_N_INTERPRETER = 16
NO_WINDOW = 2**31 - 1  # the kernels' `window` when there is none: every position is at most that far back


def _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, window):
    """ValueError naming the argument whose shape does not fit the layout in the module docstring."""
    if q.dim() != 3:
        raise ValueError(f"q must be [B, n_heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [n_blocks, block_size, n_kv_heads, head_dim], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache must have one dtype, got {k_cache.dtype} and {v_cache.dtype}")
    B, n_heads, head_dim = q.shape
    n_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"q's head_dim {head_dim} != the cache's {k_cache.shape[3]}")
    if n_heads % n_kv_heads:
        raise ValueError(f"q's n_heads {n_heads} is not a multiple of the cache's n_kv_heads {n_kv_heads}")
    if block_tables.dim() != 2 or block_tables.shape[0] != B:
        raise ValueError(f"block_tables must be [B={B}, max_blocks], got shape {tuple(block_tables.shape)}")
    if seq_lens.shape != (B,):
        raise ValueError(f"seq_lens must be [B={B}], got shape {tuple(seq_lens.shape)}")
    if window is not None and window < 1:
        raise ValueError(f"window must be None or >= 1, got {window}")


def paged_decode_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, window=None, scale=None):
    """Attention of each sequence's one query over its keys in the paged cache, in plain PyTorch (any device).

    q: [B, n_heads, head_dim]; k_cache, v_cache: [n_blocks, block_size, n_kv_heads, head_dim]; block_tables:
    [B, max_blocks] int (-1 where unused); seq_lens: [B] int >= 1; window: None or int >= 1; scale: float
    (default head_dim ** -0.5). Returns [B, n_heads, head_dim] in q's dtype, computed in fp32 (fp64 if the cache
    is fp64) from q cast to the cache's dtype. One host sync (the longest visible span).
    """
    _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, window)
    B, n_heads, head_dim = q.shape
    block_size, n_kv_heads = k_cache.shape[1], k_cache.shape[2]
    g = n_heads // n_kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    if B == 0:
        return q.new_empty(q.shape)
    compute = torch.promote_types(k_cache.dtype, torch.float32)
    seq_lens = seq_lens.long()
    # first visible position of each sequence: lo = max(0, L - window)
    lo = (seq_lens - window).clamp(min=0) if window is not None else torch.zeros_like(seq_lens)
    # Gather only the table columns some sequence needs: [first_col, last_col) (one host sync)
    first_col = int((lo // block_size).min())
    last_col = int((seq_lens.max() + block_size - 1) // block_size)
    with _autocast_off(q.device.type):  # the matmuls below at the dtype chosen here, not autocast's
        tables = block_tables[:, first_col:last_col].long().clamp(min=0)  # [B, C]; -1 -> block 0, masked below
        T = tables.shape[1] * block_size
        positions = first_col * block_size + torch.arange(T, device=q.device)  # [T]
        visible = (positions >= lo[:, None]) & (positions < seq_lens[:, None])  # [B, T]
        keys = k_cache[tables].reshape(B, T, n_kv_heads, head_dim).to(compute)  # [B, T, nkv, hd], a copy
        values = v_cache[tables].reshape(B, T, n_kv_heads, head_dim).to(compute)  # [B, T, nkv, hd], a copy
        # Invisible slots (a clamped -1, a block's unwritten tail) may hold anything, NaN included. Their scores are
        # replaced by -inf below; their values are zeroed, since probability 0 times a NaN value is still NaN.
        values.masked_fill_(~visible[:, :, None, None], 0)
        # query heads j*g .. (j+1)*g - 1 share kv head j
        queries = q.to(k_cache.dtype).to(compute).reshape(B, n_kv_heads, g, head_dim)  # [B, nkv, g, hd]
        scores = (queries @ keys.permute(0, 2, 3, 1)) * scale  # [B, nkv, g, T]
        scores.masked_fill_(~visible[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # every row has its own key: no all -inf row
        out = probs @ values.transpose(1, 2)  # [B, nkv, g, hd]
    return out.reshape(B, n_heads, head_dim).to(q.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _paged_decode_split_kernel(
        k_cache_ptr, stride_kb, stride_kp, stride_kh,  # [n_blocks, BLOCK_SIZE, n_kv_heads, HEAD_DIM], unit last stride
        v_cache_ptr, stride_vb, stride_vp, stride_vh,  # the same layout
        q_ptr, stride_qb, stride_qh,  # [B, n_heads, HEAD_DIM] in the cache's dtype, unit last stride
        block_tables_ptr, stride_tb,  # [B, max_blocks] int32
        seq_lens_ptr,  # [B] int32
        out_ptr, stride_ob, stride_oh,  # [B, n_heads, HEAD_DIM]: written when num_splits == 1
        part_m_ptr, part_l_ptr, part_acc_ptr,  # [B, n_heads, num_splits] (acc: x HEAD_DIM) fp32: when > 1
        group, window, scale, num_splits,
        BLOCK_SIZE: tl.constexpr, PAGES_PER_TILE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
        G_PAD: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    ):
        # Program (b, j, s): kv head j of sequence b (its query heads j*group .. (j+1)*group - 1) over split s.
        # Offsets: a block's base (block * stride_kb) and the sequence's rows are int64 (a layer's pool may pass
        # 2^31 elements); positions, dims and heads are int32.
        b = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        n_heads = tl.num_programs(1) * group
        rows = tl.arange(0, G_PAD)  # query head kv_head * group + rows
        dims = tl.arange(0, D_PAD)
        heads = kv_head * group + rows
        row_ok = rows < group
        dim_ok = dims < HEAD_DIM

        # q^T [D_PAD, G_PAD] (q in the cache's dtype: the wrapper casts it); padded rows and dims are 0
        q_t = tl.load(q_ptr + b * stride_qb + heads[None, :] * stride_qh + dims[:, None],
                      mask=row_ok[None, :] & dim_ok[:, None], other=0.0)
        if UPCAST:  # the interpreter mishandles bf16 in tl.dot; on a GPU bf16 stays bf16 (fp32 accumulate)
            q_t = q_t.to(tl.float32)

        # This split's positions: visible ones are [lo, seq_len); the split owns blocks_per_split whole blocks of
        # them, counted from the first visible block (blocks wholly before the window are never loaded).
        seq_len = tl.load(seq_lens_ptr + b)
        lo = tl.maximum(seq_len - window, 0)
        first_block = lo // BLOCK_SIZE
        n_blocks = tl.cdiv(seq_len, BLOCK_SIZE) - first_block
        blocks_per_split = tl.cdiv(tl.cdiv(n_blocks, num_splits), PAGES_PER_TILE) * PAGES_PER_TILE
        split_block = first_block + split * blocks_per_split
        start = tl.maximum(split_block * BLOCK_SIZE, lo)
        stop = tl.minimum((split_block + blocks_per_split) * BLOCK_SIZE, seq_len)

        # Online softmax over the tiles, per query head (columns): running max m, sum l = sum_p exp(s_p - m),
        # acc^T = sum_p exp(s_p - m) v_p. Every tile holds a visible key (p0 < stop), so m is finite after the
        # first tile and exp(m_old - m) = exp(-inf) = 0 there: no -inf - -inf.
        m = tl.full((G_PAD,), float("-inf"), dtype=tl.float32)
        l = tl.zeros((G_PAD,), dtype=tl.float32)
        acc_t = tl.zeros((D_PAD, G_PAD), dtype=tl.float32)
        table_row = block_tables_ptr + b * stride_tb
        for p0 in range(start, stop, BLOCK_N):
            positions = p0 + tl.arange(0, BLOCK_N)
            valid = positions < stop
            block = tl.load(table_row + positions // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)  # [BLOCK_N]
            slot = positions % BLOCK_SIZE
            if D_PAD == HEAD_DIM:  # no mask along the contiguous dim: the loads stay vectorised
                kv_mask = valid[:, None]
            else:
                kv_mask = valid[:, None] & dim_ok[None, :]
            k = tl.load(k_cache_ptr + block[:, None] * stride_kb + (slot * stride_kp + kv_head * stride_kh)[:, None]
                        + dims[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, D_PAD]
            v = tl.load(v_cache_ptr + block[:, None] * stride_vb + (slot * stride_vp + kv_head * stride_vh)[:, None]
                        + dims[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, D_PAD]
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            scores_t = tl.dot(k, q_t, input_precision=PRECISION) * scale  # [BLOCK_N, G_PAD] = scale * K q^T
            scores_t = tl.where(valid[:, None], scores_t, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores_t, axis=0))  # [G_PAD]
            alpha = tl.exp(m - m_new)  # rescales what was summed relative to the old max
            p_t = tl.exp(scores_t - m_new[None, :])  # [BLOCK_N, G_PAD]
            l = l * alpha + tl.sum(p_t, axis=0)
            # acc^T = alpha acc^T + V^T p^T; p rounded to v's dtype (bf16 on a GPU) to enter the tensor cores
            acc_t = tl.dot(tl.trans(v), p_t.to(v.dtype), acc_t * alpha[None, :], input_precision=PRECISION)
            m = m_new

        if num_splits == 1:  # the whole sequence was this program's: out = acc / l, what the merge would give
            tl.store(out_ptr + b * stride_ob + heads[None, :] * stride_oh + dims[:, None],
                     (acc_t / l[None, :]).to(out_ptr.dtype.element_ty), mask=row_ok[None, :] & dim_ok[:, None])
        else:
            part = (b * n_heads + heads) * num_splits + split  # [G_PAD] int64, row-major [B, n_heads, num_splits]
            tl.store(part_m_ptr + part, m, mask=row_ok)
            tl.store(part_l_ptr + part, l, mask=row_ok)
            tl.store(part_acc_ptr + part[None, :] * HEAD_DIM + dims[:, None], acc_t,
                     mask=row_ok[None, :] & dim_ok[:, None])

    @triton.jit
    def _paged_decode_combine_kernel(
        part_m_ptr, part_l_ptr, part_acc_ptr,  # [B, n_heads, num_splits] (acc: x HEAD_DIM) fp32
        out_ptr, stride_ob, stride_oh,  # [B, n_heads, HEAD_DIM]
        n_heads, num_splits,
        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    ):
        # Program r: query head r % n_heads of sequence r // n_heads. The splits are merged in the order
        # 0, 1, ..., num_splits - 1 (deterministic):  M = max_s m_s,  out = sum_s w_s acc_s / sum_s w_s l_s,
        # w_s = exp(m_s - M). Split 0 always holds keys (the first visible block), so M is finite; an empty split
        # (m = -inf) weighs 0. With one split this is acc / l exactly (w = exp(0) = 1).
        row = tl.program_id(0).to(tl.int64)  # b * n_heads + head
        dims = tl.arange(0, D_PAD)
        dim_ok = dims < HEAD_DIM
        first = row * num_splits
        M = tl.load(part_m_ptr + first)
        for s in range(1, num_splits):
            M = tl.maximum(M, tl.load(part_m_ptr + first + s))
        l = 0.0
        acc = tl.zeros((D_PAD,), dtype=tl.float32)
        for s in range(0, num_splits):
            w = tl.exp(tl.load(part_m_ptr + first + s) - M)
            l += w * tl.load(part_l_ptr + first + s)
            acc += w * tl.load(part_acc_ptr + (first + s) * HEAD_DIM + dims, mask=dim_ok, other=0.0)
        b, head = row // n_heads, row % n_heads
        tl.store(out_ptr + b * stride_ob + head * stride_oh + dims, (acc / l).to(out_ptr.dtype.element_ty),
                 mask=dim_ok)


@functools.lru_cache(maxsize=None)
def sm_count(device):
    """The SM count default_num_splits plans for: the GPU's, or CPU_SM_COUNT off CUDA and under the interpreter."""
    if _interpreting() or device.type != "cuda":
        return CPU_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_num_splits(batch, n_kv_heads, max_blocks, sm_count):
    """Splits of the KV length: enough (sequence, kv head, split) programs to give each of the sm_count SMs
    PROGRAMS_PER_SM, with at least MIN_BLOCKS_PER_SPLIT table columns (of max_blocks) per split and at most MAX_SPLITS.

    A pure function of its four arguments: the same batch shape on the same card always splits the same way.
    E.g. Qwen3-0.6B (8 kv heads) on an H200 (132 SMs), 1024-token tables of 16-token blocks (max_blocks = 64):
    B = 64 gives cdiv(528, 512) = 2 splits; B = 4 wants 17, capped at 64 / MIN_BLOCKS_PER_SPLIT = 16.
    """
    wanted = -(-PROGRAMS_PER_SM * sm_count // max(batch * n_kv_heads, 1))
    return max(1, min(wanted, -(-max_blocks // MIN_BLOCKS_PER_SPLIT), MAX_SPLITS))


def _launch_options(dtype, block_size):
    """Constexprs and launch keywords of the split kernel for a cache of this dtype and block size."""
    interpreting = _interpreting()
    fp32 = dtype == torch.float32
    if interpreting:
        block_n, num_warps = BLOCK_N_INTERPRETER, 4
    elif fp32:  # exact fp32 products run on the FMA units with their operands in registers: a smaller tile, 8 warps
        block_n, num_warps = BLOCK_N_GPU_FP32, 8
    else:
        block_n, num_warps = BLOCK_N_GPU, 4
    return dict(
        BLOCK_N=block_n,
        # a split's blocks are rounded up to whole tiles when blocks are smaller than a tile (block_size 16: 4)
        PAGES_PER_TILE=max(1, block_n // block_size),
        UPCAST=interpreting or fp32,
        PRECISION="ieee",  # fp32 operands: exact fp32 products; bf16 / fp16 operands: their own MMA, whatever this says
        num_warps=num_warps,
        num_stages=1 if interpreting else 2,  # 2: the next tile's loads in flight during this tile's math
    )


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, window=None, scale=None, num_splits=None):
    """`paged_decode_attention_reference` on the Triton kernels (CUDA, or CPU tensors under TRITON_INTERPRET=1).

    Same arguments and result; block_tables and seq_lens are taken as int32. num_splits: how many programs share
    each sequence's KV length (default `default_num_splits(B, n_kv_heads, max_blocks, sm_count(device))`); for a
    given num_splits the result is bit-for-bit deterministic. No host sync: two kernel launches (one with 1 split).
    """
    if triton is None:
        raise RuntimeError("paged_decode_attention needs Triton; use paged_decode_attention_reference")
    _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, window)
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need a contiguous last dim (head_dim)")
    if k_cache.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"the Triton kernel takes fp32 / bf16 / fp16 caches, got {k_cache.dtype}")
    B, n_heads, head_dim = q.shape
    block_size, n_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = n_heads // n_kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    if num_splits is None:
        num_splits = default_num_splits(B, n_kv_heads, block_tables.shape[1], sm_count(q.device))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    out_dtype = q.dtype
    q = q.to(k_cache.dtype)  # attention runs in the cache's dtype; torch rounds (the interpreter's cast truncates)
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_tables = block_tables.to(torch.int32)
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    # The interpreter truncates (not rounds) fp32 -> bf16 / fp16 stores: there, store fp32 and let torch round.
    store_dtype = torch.float32 if _interpreting() and out_dtype in (torch.bfloat16, torch.float16) else out_dtype
    out = torch.empty((B, n_heads, head_dim), device=q.device, dtype=store_dtype)
    if B == 0:
        return out.to(out_dtype)
    d_pad = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs every dim >= 16
    opts = _launch_options(k_cache.dtype, block_size)
    if num_splits > 1:
        part_m = torch.empty((B, n_heads, num_splits), device=q.device, dtype=torch.float32)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((B, n_heads, num_splits, head_dim), device=q.device, dtype=torch.float32)
    else:  # not read: the split kernel writes `out` itself
        part_m = part_l = part_acc = out
    _paged_decode_split_kernel[(B, n_kv_heads, num_splits)](
        k_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache, v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        q, q.stride(0), q.stride(1), block_tables, block_tables.stride(0), seq_lens,
        out, out.stride(0), out.stride(1), part_m, part_l, part_acc,
        group, NO_WINDOW if window is None else min(int(window), NO_WINDOW), float(scale), num_splits,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, D_PAD=d_pad, G_PAD=max(16, triton.next_power_of_2(group)),
        **opts,
    )
    if num_splits > 1:
        _paged_decode_combine_kernel[(B * n_heads,)](
            part_m, part_l, part_acc, out, out.stride(0), out.stride(1), n_heads, num_splits,
            HEAD_DIM=head_dim, D_PAD=d_pad, num_warps=1 if d_pad <= 64 else 2,
        )
    return out.to(out_dtype)


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, window=None, scale=None):
    """Paged decode attention (see the module docstring for the layout): the Triton kernels for CUDA tensors,
    `paged_decode_attention_reference` for others; PPO_KERNELS_BACKEND=triton|torch forces one.
    Returns [B, n_heads, head_dim] in q's dtype."""
    if _backend(q.device) == "triton":
        return paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, window=window, scale=scale)
    return paged_decode_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, window=window, scale=scale)
