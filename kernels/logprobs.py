"""Per-token log-probs (and entropy) from logits: log_softmax + gather, without the [N, V] float32 bill.

    logprob_i = z_i[label_i] - logsumexp(z_i),      z_i = logits_i / temperature
    entropy_i = -sum_v p_iv log p_iv,                p_i = softmax(z_i)

Three implementations with one signature, in this file:
  - `token_logprobs_reference`: plain PyTorch (full [N, V] fp32 temporaries); the ground truth the others are
    tested against.
  - the Triton kernels (`_token_logprobs_fwd_kernel`, `_token_logprobs_bwd_kernel`): the forward reads each
    row once, folding tiles of V into an online max / sum-exp / logit-weighted sum in fp32; the backward
    recomputes the probabilities from the saved logsumexp and writes the logits gradient (one more read + write).
  - the chunked torch path (`_fwd_torch`, `_bwd_torch`): the same math over blocks of rows, so no temporary is
    larger than a bounded chunk; this is what CPU tensors run.

`token_logprobs` dispatches: CUDA tensors -> Triton, anything else -> chunked torch;
`PPO_KERNELS_BACKEND=triton|torch` forces one (Triton on CPU tensors needs `TRITON_INTERPRET=1` set before
import; that is how the tests run the kernels without a GPU).

Rows whose label is IGNORE_INDEX (-100) give log-prob 0, entropy 0 and a zero gradient; any other label outside
[0, V) is a ValueError (one host sync per call, `_check_labels`), on every backend.
Autocast: the logits keep the dtype they arrive in, and everything inside runs with autocast disabled, so the
internal ops run at the dtypes chosen here (fp32 statistics), not at the autocast dtype.
Offsets: a row's base offset is formed in int64 (`row` is int64), so N * V >= 2^31 is safe; inner column
offsets stay int32 (< V). Division by the temperature is IEEE round-to-nearest (`_div_exact`), as in torch.
Results are float32 (float64 for float64 logits on the torch path, so `gradcheck` can check the math).
"""
import contextlib
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton on this platform: only the torch paths exist
    triton = None

IGNORE_INDEX = -100
# Elements per chunk buffer on the chunked torch path (fp32: 32 MiB; at most two buffers). Smaller chunks
# would sit in cache, but each op then costs a thread-pool synchronisation, which dominates on a busy CPU.
TORCH_CHUNK_ELEMENTS = 1 << 23
# Below this a logit contributes exactly 0 to sum-exp in fp32 and fp64 (exp(-1e4) underflows); clamping there
# keeps 0 * (-inf) out of the entropy sums without changing any result.
LOGP_FLOOR = -1e4


def _check_labels(labels, V):
    """ValueError naming the first label outside [0, V) that is not IGNORE_INDEX. One host sync.

    Without it a Triton kernel would read another row (or fault) for such a label, and the fused linear
    kernels would silently return -logsumexp.
    """
    bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= V))
    if bool(bad.any()):
        raise ValueError(f"label {labels[bad][0].item()} is outside [0, V) with V={V} (vocabulary size); "
                         f"only IGNORE_INDEX ({IGNORE_INDEX}) may lie outside")


def token_logprobs_reference(logits, labels, *, temperature=1.0, return_entropy=False):
    """log p(label) under softmax(logits / temperature), in float32 (float64 for float64 logits).

    logits: [..., V] any float dtype; labels: [...] int64, IGNORE_INDEX (-100) rows give 0, any other label
    outside [0, V) raises ValueError.
    Returns logprobs [...] float32 (float64), or (logprobs, entropy) with return_entropy=True.
    """
    _check_labels(labels, logits.shape[-1])
    # float32 at least (bf16 logits are upcast); float64 stays float64, so float64 inputs give float64 truth
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    logp_all = torch.log_softmax(logits, dim=-1)  # [..., V]
    ignored = labels == IGNORE_INDEX
    safe_labels = labels.masked_fill(ignored, 0)
    logprobs = logp_all.gather(-1, safe_labels.unsqueeze(-1)).squeeze(-1)
    logprobs = logprobs.masked_fill(ignored, 0.0)
    if not return_entropy:
        return logprobs
    probs = logp_all.exp()
    # H = -sum_v p_v log p_v; 0 * -inf is taken as 0 for tokens with zero probability
    entropy = -(probs * logp_all.masked_fill(probs == 0, 0.0)).sum(-1)
    entropy = entropy.masked_fill(ignored, 0.0)
    return logprobs, entropy


# ----------------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------------
if triton is not None:

    if hasattr(tl.math, "div_rn"):  # Triton >= 3.0; `/` compiles to div.full.f32 (<= 2 ulp) on NVIDIA GPUs
        @triton.jit
        def _div_exact(x, y):
            # x / y rounded to nearest, as torch divides: the kernels then round exactly as the reference does
            return tl.math.div_rn(x, y)
    else:
        @triton.jit
        def _div_exact(x, y):
            return x / y

    @triton.jit
    def _token_logprobs_fwd_kernel(
        logits_ptr,  # [N, V] as rows (row // rows_per_outer) * stride_outer + (row % rows_per_outer) * stride_inner
        stride_outer,
        stride_inner,
        rows_per_outer,
        labels_ptr,  # [N] int
        logprobs_ptr,  # [N] fp32 out
        entropy_ptr,  # [N] fp32 out
        lse_ptr,  # [N] fp32 out, logsumexp(z) saved for the backward
        V,
        temperature,
        BLOCK_V: tl.constexpr,
    ):
        # One program per row; one pass over the row's logits. int64: row, the row's base offset (row * stride
        # reaches 2^31 once N * V does); int32: cols (< V).
        row = tl.program_id(0).to(tl.int64)
        row_ptr = logits_ptr + (row // rows_per_outer) * stride_outer + (row % rows_per_outer) * stride_inner
        label = tl.load(labels_ptr + row).to(tl.int64)
        valid = label != -100
        # Ignored rows mask off every load: the loop runs but reads no memory.
        n_cols = tl.where(valid, V, 0)

        # Online statistics relative to the running max m:  s = sum_v exp(z_v - m),
        # a = sum_v exp(z_v - m) * (z_v - m);  then logsumexp = m + log s and entropy = log s - a / s.
        # Keeping a relative to m (not sum e*z) avoids cancelling two large numbers when logits are large.
        m = float("-inf")
        s = 0.0
        a = 0.0
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            z = tl.load(row_ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
            z = _div_exact(z, temperature)
            m_new = tl.maximum(m, tl.max(z, axis=0))
            # While every logit seen is -inf, shift by 0 instead of -inf so that no -inf - -inf appears.
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            rescale = tl.exp(m - m_ref)
            e = tl.exp(z - m_ref)
            # moving the reference from m to m_ref shifts every (z - m) by (m - m_ref)
            a = rescale * (a + tl.where(s > 0, (m - m_ref) * s, 0.0))
            a += tl.sum(tl.where(e > 0, e * (z - m_ref), 0.0), axis=0)
            s = rescale * s + tl.sum(e, axis=0)
            m = m_new

        log_s = tl.log(s)
        lse = m + log_s
        entropy = log_s - a / s
        label_logit = _div_exact(tl.load(row_ptr + tl.where(valid, label, 0), mask=valid, other=0.0).to(tl.float32),
                                 temperature)
        # (z - m) - log s rounds less than z - (m + log s): z - m is exact when z is near the max
        tl.store(logprobs_ptr + row, tl.where(valid, (label_logit - m) - log_s, 0.0))
        tl.store(entropy_ptr + row, tl.where(valid, entropy, 0.0))
        tl.store(lse_ptr + row, tl.where(valid, lse, 0.0))

    @triton.jit
    def _token_logprobs_bwd_kernel(
        logits_ptr,
        stride_outer,
        stride_inner,
        rows_per_outer,
        labels_ptr,
        lse_ptr,
        entropy_ptr,
        grad_logprobs_ptr,  # [N] fp32, read only if HAS_GRAD_LOGPROBS
        grad_entropy_ptr,  # [N] fp32, read only if HAS_GRAD_ENTROPY
        dlogits_ptr,  # [N, V] contiguous, logits dtype, out
        V,
        temperature,
        HAS_GRAD_LOGPROBS: tl.constexpr,
        HAS_GRAD_ENTROPY: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        # One program per (row, block of V): read the logits block once, write its gradient once.
        # int64: row and the row offsets (row * stride, row * V); int32: cols (< V + BLOCK_V).
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        col_mask = cols < V
        row_ptr = logits_ptr + (row // rows_per_outer) * stride_outer + (row % rows_per_outer) * stride_inner
        label = tl.load(labels_ptr + row).to(tl.int64)
        valid = label != -100
        # ignored rows read nothing
        z = tl.load(row_ptr + cols, mask=cols < tl.where(valid, V, 0), other=0.0).to(tl.float32)
        z = _div_exact(z, temperature)
        logp = z - tl.load(lse_ptr + row)
        p = tl.exp(logp)
        dz = tl.zeros((BLOCK_V,), dtype=tl.float32)
        if HAS_GRAD_LOGPROBS:
            # d logp_label / dz_v = 1[v = label] - p_v
            g = tl.load(grad_logprobs_ptr + row)
            dz += g * (tl.where(cols == label, 1.0, 0.0) - p)
        if HAS_GRAD_ENTROPY:
            # d H / dz_v = -p_v (log p_v + H); p_v = 0 contributes 0 (also where log p_v = -inf)
            g = tl.load(grad_entropy_ptr + row)
            dz -= g * tl.where(p > 0, p * (logp + tl.load(entropy_ptr + row)), 0.0)
        # dz/dlogits = 1 / temperature
        dlogits = tl.where(valid, _div_exact(dz, temperature), 0.0)
        tl.store(dlogits_ptr + row * V + cols, dlogits.to(dlogits_ptr.dtype.element_ty), mask=col_mask)


def _as_3d(logits):
    """View [..., V] logits as [B, T, V] without copying where the strides allow it.

    Row r of the flattened [N, V] is x[r // T, r % T]; this covers 2-D tensors with any row stride and 3-D
    slices such as logits[:, :-1] (the usual shift by one token), neither of which `view(-1, V)` can express.
    """
    V = logits.shape[-1]
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    try:
        return logits.view(1, -1, V)
    except RuntimeError:
        pass
    if logits.dim() == 3:
        return logits
    return logits.reshape(1, -1, V)  # >3 dims with non-collapsible strides: the one case that copies


def _row_chunks(logits3d, rows_per_chunk):
    """Yield (flat_row_slice, [n, V] view) over the rows of [B, T, V] logits, n <= rows_per_chunk."""
    B, T, _ = logits3d.shape
    for b in range(B):
        for t0 in range(0, T, rows_per_chunk):
            t1 = min(t0 + rows_per_chunk, T)
            yield slice(b * T + t0, b * T + t1), logits3d[b, t0:t1]


def _interpreting():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _fwd_triton(logits, labels, temperature):
    # logits [..., V]; labels [N] flat. Returns logprobs, entropy, lse: [N] fp32.
    rows = _as_3d(logits)  # [B, T, V]
    N, V = labels.numel(), logits.shape[-1]
    logprobs = torch.empty(N, device=logits.device, dtype=torch.float32)
    entropy = torch.empty_like(logprobs)
    lse = torch.empty_like(logprobs)
    if N == 0:
        return logprobs, entropy, lse
    block_v = min(4096, triton.next_power_of_2(V))
    _token_logprobs_fwd_kernel[(N,)](
        rows, rows.stride(0), rows.stride(1), max(rows.shape[1], 1), labels, logprobs, entropy, lse, V, temperature,
        BLOCK_V=block_v, num_warps=8 if block_v >= 2048 else 4,
    )
    return logprobs, entropy, lse


def _bwd_triton(logits, labels, temperature, lse, entropy, grad_logprobs, grad_entropy):
    rows = _as_3d(logits)  # [B, T, V]
    N, V = labels.numel(), logits.shape[-1]
    # The interpreter truncates (not rounds) fp32 -> bf16/fp16 stores: there, store fp32 and let torch round.
    store_dtype = torch.float32 if _interpreting() and logits.dtype in (torch.bfloat16, torch.float16) else logits.dtype
    dlogits = torch.empty(logits.shape, device=logits.device, dtype=store_dtype)  # [..., V] contiguous
    if N == 0:
        return dlogits.to(logits.dtype)
    block_v = min(4096, triton.next_power_of_2(V))
    _token_logprobs_bwd_kernel[(N, triton.cdiv(V, block_v))](
        rows, rows.stride(0), rows.stride(1), max(rows.shape[1], 1), labels, lse, entropy,
        grad_logprobs if grad_logprobs is not None else lse,
        grad_entropy if grad_entropy is not None else lse,
        dlogits, V, temperature,
        HAS_GRAD_LOGPROBS=grad_logprobs is not None, HAS_GRAD_ENTROPY=grad_entropy is not None,
        BLOCK_V=block_v, num_warps=8 if block_v >= 2048 else 4,
    )
    return dlogits.to(logits.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Chunked torch path: the kernels' math on blocks of rows
# ----------------------------------------------------------------------------------------------------------------
def _compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _fwd_torch(logits, labels, temperature, need_entropy=True):
    # logits [..., V]; labels [N] flat. Returns logprobs, entropy (None unless need_entropy), lse: [N].
    rows3d = _as_3d(logits)  # [B, T, V]
    N, V = labels.numel(), logits.shape[-1]
    acc = _compute_dtype(logits.dtype)
    logprobs = torch.empty(N, device=logits.device, dtype=acc)
    entropy = torch.empty_like(logprobs) if need_entropy else None
    lse = torch.empty_like(logprobs)
    rows_per_chunk = max(1, TORCH_CHUNK_ELEMENTS // max(V, 1))
    # Two chunk buffers reused for every chunk: small enough to stay in cache between the passes below.
    z_buf = torch.empty(min(N, rows_per_chunk) * V, device=logits.device, dtype=acc)
    e_buf = torch.empty_like(z_buf) if need_entropy else None
    for rows, chunk in _row_chunks(rows3d, rows_per_chunk):
        n = chunk.shape[0]
        chunk_labels = labels[rows]
        ignored = chunk_labels == IGNORE_INDEX
        z = z_buf[: n * V].view(n, V)  # [n, V]
        if chunk.dtype != acc:
            chunk = z.copy_(chunk)  # bf16 / fp16 logits widened into the buffer: no [n, V] temporary
        if temperature != 1.0:
            # divide (not multiply by 1/T) to round exactly as the reference does
            chunk = torch.div(chunk, temperature, out=z)
        m = chunk.amax(-1, keepdim=True)  # [n, 1]
        m = m.masked_fill(m == float("-inf"), 0.0)  # all -inf row: shift by 0, not -inf
        label_z = chunk.gather(-1, chunk_labels.masked_fill(ignored, 0).unsqueeze(-1)).squeeze(-1) - m.squeeze(-1)
        torch.sub(chunk, m, out=z)  # z - m
        if need_entropy:
            e = torch.exp(z, out=e_buf[: n * V].view(n, V))  # exp(z - m)
            s = e.sum(-1)
            # a = sum e * (z - m); the clamp keeps 0 * (-inf) out (exp below the floor is 0 anyway)
            a = e.mul_(z.clamp_(min=LOGP_FLOOR)).sum(-1)
        else:
            s = z.exp_().sum(-1)
        log_s = torch.log(s)
        # logsumexp = m + log s;  logprob = (z_label - m) - log s;  entropy = log s - a / s
        lse[rows] = (m.squeeze(-1) + log_s).masked_fill(ignored, 0.0)
        logprobs[rows] = (label_z - log_s).masked_fill(ignored, 0.0)
        if need_entropy:
            entropy[rows] = (log_s - a / s).masked_fill(ignored, 0.0)
    return logprobs, entropy, lse


def _bwd_torch(logits, labels, temperature, lse, entropy, grad_logprobs, grad_entropy):
    rows3d = _as_3d(logits)  # [B, T, V]
    N, V = labels.numel(), logits.shape[-1]
    acc = _compute_dtype(logits.dtype)
    dlogits = torch.empty((N, V), device=logits.device, dtype=logits.dtype)
    valid = labels != IGNORE_INDEX
    # Fold 1/temperature and the ignore mask into the per-row upstream gradients.
    g_logp = torch.where(valid, grad_logprobs.to(acc), 0.0) / temperature if grad_logprobs is not None else None
    g_ent = torch.where(valid, grad_entropy.to(acc), 0.0) / temperature if grad_entropy is not None else None
    rows_per_chunk = max(1, TORCH_CHUNK_ELEMENTS // max(V, 1))
    in_place = dlogits.dtype == acc  # work straight in dlogits' rows; else in a buffer, then cast
    z_buf = None if in_place else torch.empty(min(N, rows_per_chunk) * V, device=logits.device, dtype=acc)
    p_buf = torch.empty(min(N, rows_per_chunk) * V, device=logits.device, dtype=acc) if g_ent is not None else None
    for rows, chunk in _row_chunks(rows3d, rows_per_chunk):
        n = chunk.shape[0]
        logp = dlogits[rows] if in_place else z_buf[: n * V].view(n, V)  # [n, V]
        if chunk.dtype != acc:
            chunk = logp.copy_(chunk)  # bf16 / fp16 logits widened into the buffer: no [n, V] temporary
        if temperature != 1.0:
            chunk = torch.div(chunk, temperature, out=logp)
        torch.sub(chunk, lse[rows].to(acc).unsqueeze(-1), out=logp)  # log p
        if g_ent is not None:
            p = torch.exp(logp, out=p_buf[: n * V].view(n, V))
            # dz = -p * (g_logp + g_ent * (log p + H))   [+ g_logp at the label, below]
            logp.clamp_(min=LOGP_FLOOR).add_(entropy[rows].to(acc).unsqueeze(-1)).mul_(g_ent[rows].unsqueeze(-1))
            if g_logp is not None:
                logp.add_(g_logp[rows].unsqueeze(-1))
            dz = logp.mul_(p).neg_()
        else:
            dz = logp.exp_().mul_(-g_logp[rows].unsqueeze(-1))  # dz = -g_logp * p
        if g_logp is not None:
            # d logp_label / dz_v = 1[v = label] - p_v
            safe_labels = labels[rows].masked_fill(~valid[rows], 0).unsqueeze(-1)
            dz.scatter_add_(-1, safe_labels, g_logp[rows].unsqueeze(-1))
        dz.masked_fill_(~valid[rows].unsqueeze(-1), 0.0)  # ignored rows: 0 even where their logits are not finite
        if not in_place:
            dlogits[rows] = dz
    return dlogits


# ----------------------------------------------------------------------------------------------------------------
# Autograd wrapper and dispatch
# ----------------------------------------------------------------------------------------------------------------
def _backend(device):
    forced = os.environ.get("PPO_KERNELS_BACKEND", "").strip().lower()
    if forced in ("triton", "torch"):
        if forced == "triton" and triton is None:
            raise RuntimeError("PPO_KERNELS_BACKEND=triton but Triton is not installed")
        return forced
    if forced:
        raise ValueError(f"PPO_KERNELS_BACKEND must be 'triton' or 'torch', got {forced!r}")
    return "triton" if device.type == "cuda" and triton is not None else "torch"


def _autocast_off(device_type):
    """Autocast disabled on device_type (a no-op context where autocast does not exist for it)."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, temperature, backend, need_entropy):
        # logits [..., V]; labels [N] flat int. Returns logprobs [N], entropy [N] ([0] if not need_entropy).
        ctx.set_materialize_grads(False)  # entropy is often for logging only: skip its zero gradient
        if backend == "triton":  # the entropy is free in the kernel's one pass
            logprobs, entropy, lse = _fwd_triton(logits, labels, temperature)
        else:
            logprobs, entropy, lse = _fwd_torch(logits, labels, temperature, need_entropy)
            if entropy is None:
                entropy = logprobs.new_zeros(0)
        ctx.save_for_backward(logits, labels, lse, entropy)
        ctx.temperature, ctx.backend = temperature, backend
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, labels, lse, entropy = ctx.saved_tensors
        if grad_entropy is not None and entropy.numel() == 0:
            grad_entropy = None  # the entropy was not returned to the caller
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, None, None
        grad_logprobs = grad_logprobs.float().contiguous() if grad_logprobs is not None else None
        grad_entropy = grad_entropy.float().contiguous() if grad_entropy is not None else None
        # backward() may be called under autocast (the forward's autocast state does not carry over): disable it
        with _autocast_off(logits.device.type):
            if ctx.backend == "triton":
                dlogits = _bwd_triton(logits, labels, ctx.temperature, lse, entropy, grad_logprobs, grad_entropy)
            else:
                dlogits = _bwd_torch(logits, labels, ctx.temperature, lse, entropy, grad_logprobs, grad_entropy)
        return dlogits.view(logits.shape), None, None, None, None


def _token_logprobs(logits, labels, temperature, return_entropy, backend):
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} must be logits shape without V {tuple(logits.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    _check_labels(labels, logits.shape[-1])
    flat_labels = labels.reshape(-1)
    if not flat_labels.is_contiguous():
        flat_labels = flat_labels.contiguous()
    with _autocast_off(logits.device.type):  # internal ops at the dtypes chosen here
        logprobs, entropy = _TokenLogprobs.apply(logits, flat_labels, float(temperature), backend, return_entropy)
    if not return_entropy:
        return logprobs.view(labels.shape)
    return logprobs.view(labels.shape), entropy.view(labels.shape)


def token_logprobs_triton(logits, labels, *, temperature=1.0, return_entropy=False):
    """`token_logprobs` on the Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1)."""
    return _token_logprobs(logits, labels, temperature, return_entropy, "triton")


def token_logprobs_torch(logits, labels, *, temperature=1.0, return_entropy=False):
    """`token_logprobs` on the chunked torch path (any device; what CPU tensors run)."""
    return _token_logprobs(logits, labels, temperature, return_entropy, "torch")


def token_logprobs(logits, labels, *, temperature=1.0, return_entropy=False):
    """log p(label) under softmax(logits / temperature), and optionally the entropy of that softmax.

    logits: [..., V] any float dtype, any row stride (last dim contiguous, else it is copied).
    labels: [...] int; IGNORE_INDEX (-100) rows give log-prob 0, entropy 0 and no gradient; any other label
    outside [0, V) raises ValueError.
    Returns logprobs [...] float32, or (logprobs, entropy) with return_entropy=True; both differentiable
    w.r.t. logits. CUDA tensors run the Triton kernels, others the chunked torch path;
    PPO_KERNELS_BACKEND=triton|torch forces one.
    """
    return _token_logprobs(logits, labels, temperature, return_entropy, _backend(logits.device))
