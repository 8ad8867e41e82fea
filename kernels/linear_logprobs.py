"""Per-token log-probs (and entropy) straight from hidden states and the LM head, never forming [N, V] logits.

    z = hidden @ weight.T / temperature              # [N, V], only ever one tile at a time
    logprob_i = z_i[label_i] - logsumexp(z_i),   entropy_i = -sum_v p_iv log p_iv

The forward folds tiles of z into per-row online statistics (running max m, s = sum exp(z - m),
a = sum exp(z - m) (z - m), the label's logit) in fp32, whatever the input dtype. The backward recomputes each
tile from the saved logsumexp, turns it into dz, and accumulates

    dhidden += dz_tile @ weight_tile / temperature,   dweight_tile = dz_tile.T @ hidden / temperature

so its workspace is one tile (plus an [N, H] accumulator, fp64 for fp32 inputs: see _tile_shape), never
[N, V]. This costs one extra matmul (4 instead of 3 for forward + backward), the price of not storing the
logits; with upstream gradients unknown in the forward (two per row: log-prob and entropy) it cannot be
avoided. (linear_policy_loss in loss.py knows its gradient in the forward and gets by with 3.)

Three implementations with one signature, in this file:
  - `linear_token_logprobs_reference`: hidden @ weight.T then `token_logprobs_reference` (full logits).
  - Triton (`_linear_fwd_kernel`, `_linear_dz_kernel`): the forward is one fused kernel (tl.dot tiles folded in
    registers, as in Cut Cross-Entropy, arXiv:2411.09009); the backward writes dz for one block of V at a time
    into a bounded workspace and hands it to two cuBLAS matmuls (deterministic, unlike atomics).
  - the chunked torch path (`_fwd_torch`, `_bwd_torch`): the same tiling with torch.mm; what CPU tensors run.

Rows whose label is -100 are dropped before any matmul (they give log-prob 0, entropy 0, zero gradient).
"""
import torch

from .logprobs import IGNORE_INDEX, _backend, _compute_dtype, _interpreting, token_logprobs_reference

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# Elements in one logits tile on the torch path (fp32: 32 MiB; two such buffers are live). At N = 2048 that
# is 4096 vocabulary columns: [2048, 1024] x [1024, 4096] products already run at the CPU's matmul rate.
TORCH_TILE_ELEMENTS = 1 << 23
# Elements in the backward's dz workspace on the Triton path (bf16: 128 MiB).
TRITON_TILE_ELEMENTS = 1 << 26


def linear_token_logprobs_reference(hidden, weight, labels, *, temperature=1.0, return_entropy=False):
    """token_logprobs_reference(hidden @ weight.T): materialises the [N, V] logits in the input dtype."""
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
        # [BLOCK_N, BLOCK_V] = hidden[rows] @ weight[cols].T, accumulated in fp32
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
        labels_ptr,  # [N] int, all valid (ignored rows were dropped by the wrapper)
        logprobs_ptr, entropy_ptr, lse_ptr,  # [N] fp32 out
        N, V, H, temperature,
        UPCAST: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    ):
        # One program per block of rows; it walks the whole vocabulary, one [BLOCK_N, BLOCK_V] tile at a time.
        rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        labels = tl.load(labels_ptr + rows, mask=rows < N, other=0).to(tl.int64)
        m = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)  # running max of z
        s = tl.zeros((BLOCK_N,), dtype=tl.float32)  # sum exp(z - m)
        a = tl.zeros((BLOCK_N,), dtype=tl.float32)  # sum exp(z - m) * (z - m)
        label_z = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            z = _logits_tile(h_ptr, stride_hn, stride_hh, w_ptr, stride_wv, stride_wh, rows, cols, N, V, H,
                             UPCAST, PRECISION, BLOCK_N, BLOCK_V, BLOCK_H) / temperature
            z = tl.where(cols[None, :] < V, z, float("-inf"))
            label_z += tl.sum(tl.where(cols[None, :] == labels[:, None], z, 0.0), axis=1)
            m_new = tl.maximum(m, tl.max(z, axis=1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf
            rescale = tl.exp(m - m_ref)
            e = tl.exp(z - m_ref[:, None])
            a = rescale * (a + tl.where(s > 0, (m - m_ref) * s, 0.0))
            a += tl.sum(tl.where(e > 0, e * (z - m_ref[:, None]), 0.0), axis=1)
            s = rescale * s + tl.sum(e, axis=1)
            m = m_new
        log_s = tl.log(s)
        tl.store(logprobs_ptr + rows, (label_z - m) - log_s, mask=rows < N)
        tl.store(entropy_ptr + rows, log_s - a / s, mask=rows < N)
        tl.store(lse_ptr + rows, m + log_s, mask=rows < N)

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
        # Recompute one [BLOCK_N, BLOCK_V] tile of z and write dloss/dz for it.
        rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.program_id(1).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
        z = _logits_tile(h_ptr, stride_hn, stride_hh, w_ptr, stride_wv, stride_wh, rows, cols, N, V, H,
                         UPCAST, PRECISION, BLOCK_N, BLOCK_V, BLOCK_H) / temperature
        row_mask = rows < N
        logp = z - tl.load(lse_ptr + rows, mask=row_mask, other=0.0)[:, None]
        p = tl.exp(logp)
        dz = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
        if HAS_GRAD_LOGPROBS:
            # d logp_label / dz_v = 1[v = label] - p_v
            g = tl.load(grad_logprobs_ptr + rows, mask=row_mask, other=0.0)[:, None]
            labels = tl.load(labels_ptr + rows, mask=row_mask, other=-1).to(tl.int64)
            dz += g * (tl.where(cols[None, :] + v0 == labels[:, None], 1.0, 0.0) - p)
        if HAS_GRAD_ENTROPY:
            # d H / dz_v = -p_v (log p_v + H)
            g = tl.load(grad_entropy_ptr + rows, mask=row_mask, other=0.0)[:, None]
            ent = tl.load(entropy_ptr + rows, mask=row_mask, other=0.0)[:, None]
            dz -= g * tl.where(p > 0, p * (logp + ent), 0.0)
        tl.store(dz_ptr + rows[:, None] * stride_dn + cols[None, :], dz.to(dz_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & (cols[None, :] < V))


def _triton_options(dtype):
    interpreting = _interpreting()
    fp32 = dtype in (torch.float32, torch.float64)
    if interpreting:  # numpy runs each op over the whole block: few, wide blocks are what make it fast
        return dict(UPCAST=True, PRECISION="ieee", BLOCK_N=16, BLOCK_V=512, BLOCK_H=32)
    return dict(
        UPCAST=fp32,
        # fp32 inputs get true fp32 products (tf32 would miss the 1e-5 log-prob tolerance)
        PRECISION="ieee" if fp32 else "tf32",
        BLOCK_N=64 if fp32 else 128, BLOCK_V=128, BLOCK_H=32 if fp32 else 64,
        num_warps=8, num_stages=2 if fp32 else 3,
    )


def _mm_fp32(a, b, out, accumulate=False):
    """out (+)= a @ b into an fp32 `out`, without first rounding the product to the inputs' dtype."""
    beta = 1.0 if accumulate else 0.0  # beta = 0: `out` is not read, so its old contents (even NaN) do not matter
    if a.dtype in (torch.float16, torch.bfloat16) and a.is_cuda:
        return torch.addmm(out, a, b, beta=beta, out_dtype=torch.float32, out=out)
    return torch.addmm(out, a.to(out.dtype), b.to(out.dtype), beta=beta, out=out)


def _fwd_triton(hidden, weight, labels, temperature):
    N, H = hidden.shape
    V = weight.shape[0]
    logprobs = torch.empty(N, device=hidden.device, dtype=torch.float32)
    entropy = torch.empty_like(logprobs)
    lse = torch.empty_like(logprobs)
    if N == 0:
        return logprobs, entropy, lse
    opts = _triton_options(hidden.dtype)
    _linear_fwd_kernel[(triton.cdiv(N, opts["BLOCK_N"]),)](
        hidden, hidden.stride(0), hidden.stride(1), weight, weight.stride(0), weight.stride(1),
        labels, logprobs, entropy, lse, N, V, H, temperature, **opts,
    )
    return logprobs, entropy, lse


def _bwd_triton(hidden, weight, labels, temperature, lse, entropy, grad_logprobs, grad_entropy, need_dh, need_dw):
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


def _fwd_torch(hidden, weight, labels, temperature, need_entropy=True):
    N, H = hidden.shape
    V = weight.shape[0]
    acc = _compute_dtype(hidden.dtype)
    h = hidden.to(acc)
    if temperature != 1.0:
        h = h / temperature  # [N, H]: dividing the small operand saves a pass over every tile
    m = torch.full((N,), float("-inf"), device=hidden.device, dtype=acc)
    s, a, label_z = (torch.zeros((N,), device=hidden.device, dtype=acc) for _ in range(3))
    rows_per_tile, cols_per_tile = _tile_shape(N, V, TORCH_TILE_ELEMENTS)
    z_buf = torch.empty(rows_per_tile * cols_per_tile, device=hidden.device, dtype=acc)
    e_buf = torch.empty_like(z_buf)
    for v0 in range(0, V, cols_per_tile):
        v1 = min(v0 + cols_per_tile, V)
        w_tile = weight[v0:v1].to(acc)  # [vc, H]
        for r0 in range(0, N, rows_per_tile):
            r1 = min(r0 + rows_per_tile, N)
            n, vc = r1 - r0, v1 - v0
            z = torch.mm(h[r0:r1], w_tile.T, out=z_buf[: n * vc].view(n, vc))  # [n, vc] = z for this tile
            local = labels[r0:r1] - v0
            _fold_tile(z, (m, s, a, label_z), slice(r0, r1), e_buf[: n * vc].view(n, vc), local,
                       (local >= 0) & (local < vc), need_entropy)
    log_s = torch.log(s)
    # logprob = (z_label - m) - log s;  entropy = log s - a / s;  logsumexp = m + log s
    return (label_z - m) - log_s, (log_s - a / s) if need_entropy else None, m + log_s


def _bwd_torch(hidden, weight, labels, temperature, lse, entropy, grad_logprobs, grad_entropy, need_dh, need_dw):
    N, H = hidden.shape
    V = weight.shape[0]
    acc = _compute_dtype(hidden.dtype)
    h = hidden.to(acc)
    if temperature != 1.0:
        h = h / temperature  # z = h @ W.T with h = hidden / T, so dW = dz.T @ h and dhidden = dz @ W / T
    g_logp = grad_logprobs.to(acc) if grad_logprobs is not None else None
    g_ent = grad_entropy.to(acc) if grad_entropy is not None else None
    rows_per_tile, cols_per_tile = _tile_shape(N, V, TORCH_TILE_ELEMENTS)
    z_buf = torch.empty(rows_per_tile * cols_per_tile, device=hidden.device, dtype=acc)
    dz_buf = torch.empty_like(z_buf)
    # dhidden sums dz @ W over every V tile, with heavy cancellation (each row of dz sums to ~0): accumulating
    # the tiles in fp64 keeps that sum as accurate as one tile's product (one fp32 product over V: ~30x worse).
    dh = torch.zeros((N, H), device=hidden.device, dtype=torch.float64) if need_dh else None
    if N == 0:  # every row ignored
        return dh, torch.zeros_like(weight) if need_dw else None
    dh_tile = torch.empty((rows_per_tile, H), device=hidden.device, dtype=acc) if need_dh else None
    dw = torch.empty((V, H), device=weight.device, dtype=weight.dtype) if need_dw else None
    # With one row tile each dW row block is written once, straight into dw when the dtypes agree.
    direct_dw = rows_per_tile >= N and weight.dtype == acc
    dw_slab = None if (direct_dw or not need_dw) else torch.empty((cols_per_tile, H), device=weight.device, dtype=acc)
    for v0 in range(0, V, cols_per_tile):
        v1 = min(v0 + cols_per_tile, V)
        w_tile = weight[v0:v1].to(acc)  # [vc, H]
        for r0 in range(0, N, rows_per_tile):
            r1 = min(r0 + rows_per_tile, N)
            n, vc = r1 - r0, v1 - v0
            logp = torch.mm(h[r0:r1], w_tile.T, out=z_buf[: n * vc].view(n, vc))  # [n, vc] = z
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
            if need_dh:
                dh[r0:r1] += torch.mm(dz, w_tile, out=dh_tile[:n])  # [n, H]
            if need_dw:
                target = dw[v0:v1] if direct_dw else dw_slab[:vc]
                if r0 == 0:
                    torch.mm(dz.T, h[r0:r1], out=target)  # [vc, H]
                else:
                    target.addmm_(dz.T, h[r0:r1])
        if need_dw and not direct_dw:
            dw[v0:v1] = dw_slab[: v1 - v0]
    if need_dh and temperature != 1.0:
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
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
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
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1).contiguous()
    logprobs, entropy = _LinearTokenLogprobs.apply(flat_hidden, weight, flat_labels, float(temperature), backend,
                                                   return_entropy)
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
    IGNORE_INDEX (-100) rows give 0 and no gradient. Returns logprobs [N] float32, or (logprobs, entropy)
    with return_entropy=True; differentiable w.r.t. hidden and weight. CUDA tensors run Triton, others the
    chunked torch path; PPO_KERNELS_BACKEND=triton|torch forces one.
    """
    return _linear_token_logprobs(hidden, weight, labels, temperature, return_entropy, _backend(hidden.device))
