"""Any loss of the per-token log-probs, fused with the LM-head projection: linear_logprob_loss.

    logp_t, H_t  from  z_t = h_t W^T / T          (log-softmax at the label; entropy of softmax(z_t))
    loss, stats = loss_fn(logp, H, rows)          (ppo_core.algo's math, in plain torch, under autograd)

This file holds no loss formula, clip, KL estimator or coefficient: `loss_fn` brings the objective (ppo_core.update
builds it from ppo_core.algo), and the kernel does only the [N, V] work: the logits, the log-softmax and entropy, and
the chain rule from a per-token gradient (dloss/dlogp_t, dloss/dH_t) to the logits and on to hidden and weight:

    dloss/dz_tv = g_t (1[v = label_t] - p_tv) / T  -  g^H_t p_tv (log p_tv + H_t) / T
    dhidden = dz W,   dweight = dz^T h

To need no [N, V] logits and no fourth matmul (a backward that recomputes them), the per-token gradient is taken while
a chunk's logits are on hand: the rows of the batch (sequences) are cut into chunks of whole rows; for each chunk the
logits of its kept tokens are formed, its log-probs and entropies computed, `loss_fn` called on those rows alone
(torch.autograd.grad gives g and g^H), dz formed, and dhidden / dweight accumulated. The loss is the sum of the
chunks' losses. That is exact for every loss that splits over rows the way a micro-batch does: a loss evaluated on a
subset of the rows with the minibatch's global counts (ppo_core.algo.aggregate's num_tokens, num_seqs) gives that
subset's share, which is the contract ppo_core.update's micro-batches already rely on. A loss that couples the rows of
a batch (rows_separate=False: a statistic over all tokens selects or weights them) gets one chunk holding every row.
A loss whose tokens separate (tokens_separate=True: a token's gradient depends on its own log-prob alone, as every
token-level loss's does) is cut finer: into balanced tiles of tokens, across row boundaries, as the budget allows
(rows of whole sequences would leave small remainders, and each chunk costs a [V, H] dweight product). A tile's
call gets the rows its tokens lie in, with placeholder log-probs (0) on those rows' other tokens; only the tile's
tokens' gradients are kept, and the loss's value and statistics come from one more call on every row at the end.
When a chunk would not fit (one row's tokens, or a coupled batch, beyond MAX_CHUNK_FACTOR times the budget),
the call falls back to linear_logprobs' autograd Function and `loss_fn` on the whole batch: the same result, at the
cost of a recomputation of the logits in the backward.

In this file:
  - `linear_logprob_loss_reference`: full logits, token_logprobs_reference, loss_fn: the plain PyTorch the others are
    tested against.
  - `_linear_loss_grads_torch` (CPU; any device) and `_linear_loss_grads_triton` (3 cuBLAS GEMMs with two Triton row
    kernels between them: linear log-probs' forward (logprobs._fwd_triton) and `_loss_dz_kernel`): one pass over the
    chunks, as described above.
  - `linear_logprob_loss`: the dispatch, on hidden's device.
Dtypes as in linear_logprobs: under autocast fp32 hidden / weight are cast to the autocast dtype first (gradients come
back to the caller's fp32 tensors unrounded); bf16 operands give bf16 GEMMs on the torch path (outputs rounded to
bf16, as eager bf16's are); log-probs, entropies, the loss and the per-token gradients are fp32 (fp64 for fp64
inputs on the torch path). tests/test_kernels_loss.py and tests/test_kernels_bf16.py check them.
"""
import torch

from . import linear_logprobs as _linear
from . import logprobs as _logprobs
from .logprobs import IGNORE_INDEX, _backend, _compute_dtype, _interpreting

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# Elements in the [rows, V] logits buffer of the torch path (fp32: 128 MiB; a second one with the entropy, and bf16
# operands add a bf16 one of half that, for the GEMMs' output and dz). Rows are grouped into chunks up to this size.
TORCH_LOSS_TILE_ELEMENTS = 1 << 25
DH_BLOCK = 8192  # vocabulary columns per fp32 product in dhidden's fp64 accumulation
# Elements in the [rows, V] fp32 logits chunk of the Triton path (256 MiB, plus a bf16 dz chunk of half that on a
# GPU). At V = 151936 that is 441 rows per chunk.
TRITON_LOSS_CHUNK_ELEMENTS = 1 << 26
# A chunk may hold up to this many times the budget (one long row, or a batch whose rows are coupled) before the
# call falls back to linear_token_logprobs' recomputing backward.
MAX_CHUNK_FACTOR = 4


def linear_logprob_loss_reference(hidden, weight, labels, loss_fn, *, temperature=1.0, need_entropy=False,
                                  rows_separate=True):
    """The naive path: full [.., V] logits, token_logprobs_reference (log-softmax + gather, and the entropy), then
    loss_fn(logp, entropy, slice(None)). -> (loss, stats, logp, entropy): as linear_logprob_loss."""
    out = _linear.linear_token_logprobs_reference(hidden, weight, labels, temperature=temperature,
                                                  return_entropy=need_entropy)
    logp, entropy = out if need_entropy else (out, None)
    loss, stats = loss_fn(logp, entropy, slice(None))
    return loss, stats, logp.detach(), None if entropy is None else entropy.detach()


# ----------------------------------------------------------------------------------------------------------------
# The Triton row kernel: dz from the per-token gradient
# ----------------------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _loss_dz_kernel(
        logits_ptr,  # [n, V] fp32 contiguous: z = hidden @ weight.T, before the temperature
        labels_ptr, lse_ptr, grad_ptr,  # [n]: label (all valid), logsumexp(z / T), dloss / dlogp
        entropy_ptr, entropy_grad_ptr,  # [n]: H of softmax(z / T), dloss / dH (read only if HAS_ENTROPY)
        dz_ptr,  # [n, V] contiguous out, dloss / dz (may be logits_ptr itself: each element is read, then written)
        V, temperature,
        HAS_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr,
    ):
        # One program per (row, block of V):  dloss/dz_v = g (1[v = label] - p_v) / T,  p_v = exp(z_v / T - lse)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
        inb = cols < V
        z = tl.load(logits_ptr + row * V + cols, mask=inb, other=0.0) / temperature  # as the reference rounds
        logp = z - tl.load(lse_ptr + row)
        p = tl.exp(logp)
        label = tl.load(labels_ptr + row).to(tl.int64)
        g = tl.load(grad_ptr + row)
        dz = g * (tl.where(cols == label, 1.0, 0.0) - p)
        if HAS_ENTROPY:
            # + dloss/dH dH/dz_v,  dH/dz_v = -p_v (log p_v + H); p_v = 0 contributes 0 (also where log p_v = -inf)
            g_entropy = tl.load(entropy_grad_ptr + row)
            dz -= g_entropy * tl.where(p > 0, p * (logp + tl.load(entropy_ptr + row)), 0.0)
        dz = dz / temperature  # dz/dlogits = 1 / T
        tl.store(dz_ptr + row * V + cols, dz.to(dz_ptr.dtype.element_ty), mask=inb)



# ----------------------------------------------------------------------------------------------------------------
# One pass over the chunks: logits, log-probs (and entropies), the loss's per-token gradient, dz, dhidden, dweight
# ----------------------------------------------------------------------------------------------------------------
def _linear_loss_grads_torch(h_kept, weight, labels_kept, temperature, bounds, chunk_grad_fn, need_entropy,
                             need_dh=True, need_dw=True):
    """The pass on the torch backend, one chunk of kept rows at a time with its full-V logits.

    bounds: [(r0, r1), ...] the chunks, consecutive ranges of the kept rows. chunk_grad_fn(i, logp_rows, entropy_rows)
    -> (dloss/dlogp [n], dloss/dH [n] or None) for chunk i; entropy_rows is None unless need_entropy.
    Returns logp [Nk], dhidden [Nk, H], dweight [V, H] and entropy [Nk] (None unless need_entropy), all in the
    compute dtype (fp32; fp64 for fp64 inputs).

    The matmuls run at linear_logprobs._torch_mm_dtype: bf16 operands give bf16 GEMMs, whose outputs are rounded
    to bf16 (the logits, widened to fp32 for the statistics; dhidden, one GEMM over V per chunk; dweight, one
    per chunk, summed over them in fp32), and dz / T (1/T folded into g) is rounded to bf16 to feed them, as
    eager bf16's autograd rounds d logits. Everything else (max, sum-exp, log-probs, entropy, g) is fp32.
    """
    Nk, H = h_kept.shape
    V = weight.shape[0]
    acc = _compute_dtype(h_kept.dtype)
    mm_dtype = _linear._torch_mm_dtype(h_kept.dtype)
    low_precision = mm_dtype != acc  # bf16 GEMMs, fp32 statistics
    h = h_kept.to(mm_dtype)
    if temperature != 1.0 and not low_precision:
        h = h / temperature  # z = h @ W.T with h = hidden / T: dW = dz.T @ h, dhidden = dz @ W / T
    w = weight.to(mm_dtype)
    logp = torch.empty(Nk, device=h.device, dtype=acc)
    entropy = torch.empty(Nk, device=h.device, dtype=acc) if need_entropy else None
    dh = torch.empty((Nk, H), device=h.device, dtype=acc) if need_dh else None
    # fp32 products accumulate with addmm_ (onto zeros); bf16 ones are copied in (first chunk) or added
    # (zeros also when no row is kept: a process whose micro-batch has no token in the loss returns dW = 0)
    dw = (torch.empty if low_precision and Nk > 0 else torch.zeros)((V, H), device=h.device, dtype=acc) if need_dw else None
    rows_max = max([r1 - r0 for r0, r1 in bounds] + [1])
    buf = torch.empty(rows_max * V, device=h.device, dtype=acc)
    # the entropy needs z - m and exp(z - m) at once: a second buffer
    e_buf = torch.empty_like(buf) if need_entropy else None
    # bf16: the logits GEMM's output (widened into buf), then dz / T in bf16 for the gradient GEMMs; dW's bf16
    # product of each chunk before it joins the fp32 sum
    mm_buf = torch.empty_like(buf, dtype=mm_dtype) if low_precision else None
    dw_tile = torch.empty((V, H), device=h.device, dtype=mm_dtype) if need_dw and low_precision else None
    first = True
    for i, (r0, r1) in enumerate(bounds):
        n, rows = r1 - r0, slice(r0, r1)
        mm_out = mm_buf[: n * V].view(n, V) if low_precision else None
        z = _linear._tile_logits(h[rows], w, temperature, buf[: n * V].view(n, V), mm_out)  # [n, V]
        m = z.amax(1)
        label_z = z.gather(1, labels_kept[rows].unsqueeze(1)).squeeze(1)
        z_m = z.sub_(m.unsqueeze(1))  # [n, V] z - m, in place
        if need_entropy:
            e = torch.exp(z_m, out=e_buf[: n * V].view(n, V))  # [n, V] exp(z - m)
        else:
            e = z_m.exp_()  # exp(z - m), in place: z - m is not needed again
        s = e.sum(1)
        log_s = torch.log(s)
        logp[rows] = (label_z - m) - log_s
        if need_entropy:
            # H = -sum_v p_v log p_v = log s - sum_v e_v (z_v - m) / s   (as logprobs._fwd_torch); a batched dot
            # product leaves no [n, V] temporary
            entropy[rows] = log_s - torch.bmm(e.unsqueeze(1), z_m.unsqueeze(2)).view(n) / s
        g, g_entropy = chunk_grad_fn(i, logp[rows], entropy[rows] if need_entropy else None)  # [n] each
        if not (need_dh or need_dw):
            continue
        g = g.to(acc)
        if low_precision and temperature != 1.0:
            g = g / temperature  # dz / T below: dloss/d(h W^T), what the bf16 GEMMs take
        if g_entropy is None:
            # dloss/dz = g (onehot(label) - p),  p = e / s
            dz = e.mul_((-g / s).unsqueeze(1))
        else:
            g_entropy = g_entropy.to(acc)
            if low_precision and temperature != 1.0:
                g_entropy = g_entropy / temperature
            # dloss/dz = g (onehot(label) - p) + g_H dH/dz,  dH/dz_v = -p_v (log p_v + H),  log p_v = z_v - m - log s
            #          = p (-g - g_H (log p + H)) + g onehot(label),   p = e / s
            dz = z_m.sub_((log_s - entropy[rows]).unsqueeze(1)).mul_(-g_entropy.unsqueeze(1))
            dz = dz.sub_(g.unsqueeze(1)).mul_(e).div_(s.unsqueeze(1))
        dz[torch.arange(n, device=h.device), labels_kept[rows]] += g
        if low_precision:
            dz = mm_out.copy_(dz)  # [n, V] bf16
        if need_dh and low_precision:
            dh[rows] = torch.mm(dz, w)  # [n, H]: one bf16 GEMM (fp32 inside, rounded once), as eager bf16's
        elif need_dh:
            # dz @ W over blocks of V, summed in fp64: the terms cancel (see linear_logprobs._tile_shape)
            dh_rows = torch.zeros((n, H), device=h.device, dtype=torch.float64)
            for v0 in range(0, V, DH_BLOCK):
                dh_rows += torch.mm(dz[:, v0:v0 + DH_BLOCK], w[v0:v0 + DH_BLOCK])
            dh[rows] = dh_rows
        if need_dw and low_precision:
            product = torch.mm(dz.T, h[rows], out=dw_tile)  # [V, H] bf16
            if first:
                dw.copy_(product)
            else:  # summed over the chunks in fp32 (buf is free: dz is in mm_out)
                _linear._add_widened(dw, product, scratch=buf)
        elif need_dw:
            dw.addmm_(dz.T, h[rows])  # [V, H]
        first = False
    if need_dh and temperature != 1.0 and not low_precision:
        dh.div_(temperature)
    return logp, dh, dw, entropy


def _linear_loss_grads_triton(h_kept, weight, labels_kept, temperature, bounds, chunk_grad_fn, need_entropy,
                              need_dh=True, need_dw=True):
    """The same pass on the Triton backend, one chunk at a time: 3 cuBLAS matmuls, 2 Triton row kernels.

        z     = h @ W.T                     [n, V] fp32 (bf16/fp16 operands: fp32 accumulate and output)
        logp, H, lse from z / T             _logprobs._fwd_triton (divides z by T as the reference does)
        g, g_H                              chunk_grad_fn: the loss's dloss/dlogp and dloss/dH
        dz    = g (onehot(label) - p) / T   _loss_dz_kernel, in the operands' dtype (over z itself when fp32)
              - g_H p (log p + H) / T         + the entropy term, when the loss reads H
        dh    = dz @ W,   dW += dz.T @ h    fp32 accumulators; dW's over the chunks, in their order

    Arguments and returns as _linear_loss_grads_torch's, all fp32. No atomics: the result does not depend on
    scheduling. (The forward kernel computes the entropy in any case; it is handed to the loss only with need_entropy.)
    """
    Nk, H = h_kept.shape
    V = weight.shape[0]
    device = h_kept.device
    low_precision = h_kept.dtype in (torch.bfloat16, torch.float16)
    h = h_kept if low_precision else h_kept.float()  # fp64 inputs run in fp32, as the other Triton kernels do
    w = weight if low_precision else weight.float()
    logp = torch.empty(Nk, device=device, dtype=torch.float32)
    entropy = torch.empty(Nk, device=device, dtype=torch.float32) if need_entropy else None
    dh = torch.empty((Nk, H), device=device, dtype=torch.float32) if need_dh else None
    dw = torch.zeros((V, H), device=device, dtype=torch.float32) if need_dw else None
    if Nk == 0:  # nothing in the loss: the loss is still called, on no kept row, for its (zero) value
        for i in range(len(bounds)):
            chunk_grad_fn(i, logp, entropy)
        return logp, dh, dw, entropy
    rows_max = max(r1 - r0 for r0, r1 in bounds)
    z_buf = torch.empty(rows_max * V, device=device, dtype=torch.float32)
    # dz in the operands' dtype feeds the two matmuls at full speed; the interpreter truncates fp32 -> bf16 stores
    # instead of rounding them, so there it stays fp32. fp32 dz overwrites z in place (each element is read first).
    dz_dtype = h.dtype if low_precision and not _interpreting() else torch.float32
    dz_buf = z_buf if dz_dtype == torch.float32 else torch.empty(rows_max * V, device=device, dtype=dz_dtype)
    w_dz = w.to(dz_dtype)  # a no-op except under the interpreter with bf16/fp16 operands
    block_v = min(4096, triton.next_power_of_2(V))
    first = True
    for i, (r0, r1) in enumerate(bounds):
        n, rows = r1 - r0, slice(r0, r1)
        if n == 0:
            chunk_grad_fn(i, logp[rows], entropy[rows] if need_entropy else None)
            continue
        z = z_buf[: n * V].view(n, V)
        if low_precision:
            _linear._mm_fp32(h[rows], w.T, out=z)  # [n, V], products never rounded to bf16
        else:
            torch.mm(h[rows], w.T, out=z)  # [n, V]
        labels_rows = labels_kept[rows]
        logp_rows, entropy_rows, lse = _logprobs._fwd_triton(z, labels_rows, temperature)  # [n] each
        logp[rows] = logp_rows
        if need_entropy:
            entropy[rows] = entropy_rows
        g, g_entropy = chunk_grad_fn(i, logp_rows, entropy_rows if need_entropy else None)
        if not (need_dh or need_dw):
            continue
        g = g.float().contiguous()  # [n] dloss/dlogp
        has_entropy = g_entropy is not None
        g_entropy = g_entropy.float().contiguous() if has_entropy else lse
        dz = dz_buf[: n * V].view(n, V)
        _loss_dz_kernel[(n, triton.cdiv(V, block_v))](
            z, labels_rows, lse, g, entropy_rows, g_entropy, dz, V, float(temperature),
            HAS_ENTROPY=has_entropy, BLOCK_V=block_v, num_warps=8 if block_v >= 2048 else 4)
        if need_dh:
            if low_precision:
                _linear._mm_fp32(dz, w_dz, out=dh[rows])  # [n, H]
            else:
                # dz @ W over blocks of V, accumulated in fp64: the terms cancel (as in _linear_loss_grads_torch)
                dh_rows = torch.zeros((n, H), device=device, dtype=torch.float64)
                for v0 in range(0, V, DH_BLOCK):
                    dh_rows += torch.mm(dz[:, v0:v0 + DH_BLOCK], w[v0:v0 + DH_BLOCK])
                dh[rows] = dh_rows
        if need_dw:
            _linear._mm_fp32(dz.T, h[rows].to(dz_dtype), out=dw, accumulate=not first)  # [V, H]
        first = False
    return logp, dh, dw, entropy


# ----------------------------------------------------------------------------------------------------------------
# linear_logprob_loss: chunks of rows, the loss per chunk, gradients formed in the forward
# ----------------------------------------------------------------------------------------------------------------
class _ScaledGrad(torch.autograd.Function):
    """loss (a scalar whose gradients were formed in the forward) -> backward scales them by dloss."""

    @staticmethod
    def forward(ctx, loss, *inputs_and_grads):
        n = len(inputs_and_grads) // 2
        ctx.save_for_backward(*inputs_and_grads[n:])
        ctx.n = n
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss):
        grads = ctx.saved_tensors
        # the usual grad_loss is exactly 1: hand the buffers over instead of copying a [V, H] gradient
        one = grad_loss.numel() == 1 and bool(grad_loss == 1)
        scaled = [g if g is None or one else g * grad_loss.to(g.dtype) for g in grads]
        return (None, *scaled, *([None] * ctx.n))


def row_chunks(kept_per_row, budget, rows_separate=True):
    """Consecutive rows grouped into chunks of at most `budget` kept tokens (a row with more is a chunk of its own),
    closed once it holds the even share ceil(total / ceil(total / budget)), so that rows of equal length make chunks of
    equal size rather than full ones and a small remainder (each chunk costs a whole [V, H] dweight product).
    rows_separate=False: one chunk of every row. -> [(first row, end row), ...], at least one chunk."""
    B, total = len(kept_per_row), sum(kept_per_row)
    if not rows_separate or B == 0:
        return [(0, B)]
    target = max(1, -(-total // max(1, -(-total // budget))))  # the even share, <= budget
    chunks, start, tokens = [], 0, 0
    for row, n in enumerate(kept_per_row):
        if row > start and n > 0 and (tokens + n > budget or tokens >= target):  # empty rows ride along
            chunks.append((start, row))
            start, tokens = row, 0
        tokens += n
    chunks.append((start, B))
    return chunks


def token_tiles(kept_per_row, budget, T):
    """Balanced tiles of kept tokens for a loss whose tokens separate: ceil(total / budget) tiles of nearly equal size,
    row boundaries ignored. -> (bounds [(first kept token, end), ...], rows [(first row, end row) each tile spans]),
    at least one tile (an empty one spanning every row when no token is kept)."""
    total, B = sum(kept_per_row), len(kept_per_row)
    if total == 0:
        return [(0, 0)], [(0, B)]
    n_tiles = -(-total // budget)
    size = -(-total // n_tiles)
    row_of = [row for row, n in enumerate(kept_per_row) for _ in range(n)]  # the row of each kept token, in order
    bounds = [(r0, min(r0 + size, total)) for r0 in range(0, total, size)]
    return bounds, [(row_of[r0], row_of[r1 - 1] + 1) for r0, r1 in bounds]


def _linear_logprob_loss(hidden, weight, labels, loss_fn, temperature, need_entropy, rows_separate, tokens_separate,
                         backend):
    if labels.dim() != 2 or hidden.dim() != 3 or hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden [B, T, H] {tuple(hidden.shape)} and labels [B, T] {tuple(labels.shape)} disagree")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"hidden [..., H] {tuple(hidden.shape)} and weight [V, H] {tuple(weight.shape)} disagree")
    _logprobs._check_labels(labels, weight.shape[0])  # a label outside [0, V) would read another row of logits
    B, T, H = hidden.shape
    V = weight.shape[0]
    in_loss = labels != IGNORE_INDEX  # [B, T]: the tokens whose logits are formed
    kept_per_row = in_loss.sum(-1).tolist()  # one host read per call
    elements = TRITON_LOSS_CHUNK_ELEMENTS if backend == "triton" else TORCH_LOSS_TILE_ELEMENTS
    budget = max(1, elements // max(V, 1))
    tokens_separate = tokens_separate and rows_separate
    chunks = row_chunks(kept_per_row, budget, rows_separate)
    if not tokens_separate and max(sum(kept_per_row[s0:s1]) for s0, s1 in chunks) > MAX_CHUNK_FACTOR * budget:
        # a chunk too large to hold its logits: log-probs with their own (recomputing) backward, the loss on them
        out = _linear._linear_token_logprobs(hidden, weight, labels, temperature, need_entropy, backend)
        logp, entropy = out if need_entropy else (out, None)
        loss, stats = loss_fn(logp, entropy, slice(None))
        return loss, {k: v.detach() for k, v in stats.items()}, logp.detach(), None if entropy is None else entropy.detach()
    # The caller's tensors get their gradients directly, in their own dtypes: with fp32 master weights under
    # autocast, dweight leaves the fp32 accumulator as it is (no bf16 rounding, no second [V, H] copy).
    hidden_in, weight_in = hidden, weight
    hidden, weight = _linear._autocast_operands(hidden, weight)  # what the kernels compute with
    with _logprobs._autocast_off(hidden.device.type), torch.no_grad():
        acc = _compute_dtype(hidden.dtype) if backend == "torch" else torch.float32
        kept = in_loss.reshape(-1).nonzero().squeeze(1)  # [Nk] positions in the flat [B*T], row-major
        h_kept = hidden.reshape(-1, H).index_select(0, kept)
        labels_kept = labels.reshape(-1).index_select(0, kept)
        if tokens_separate:  # tiles of tokens, each handed to the loss with the rows it spans (see below)
            bounds, chunks = token_tiles(kept_per_row, budget, T)
        else:
            ends = [0]
            for n in kept_per_row:
                ends.append(ends[-1] + n)
            bounds = [(ends[s0], ends[s1]) for s0, s1 in chunks]  # each chunk's range of kept rows
        losses, chunk_stats = [], []

        def chunk_grad(i, logp_rows, entropy_rows):  # the loss on chunk i's rows, and its per-token gradient
            (s0, s1), (r0, r1) = chunks[i], bounds[i]
            positions = kept[r0:r1] - s0 * T  # the kept tokens' positions in the chunk's flat [s1 - s0, T]
            inputs = [torch.zeros((s1 - s0) * T, device=hidden.device, dtype=acc).index_copy_(
                0, positions, rows.to(acc)).view(s1 - s0, T).requires_grad_()
                for rows in ([logp_rows] if entropy_rows is None else [logp_rows, entropy_rows])]
            with torch.enable_grad():
                loss, stats = loss_fn(inputs[0], inputs[1] if len(inputs) > 1 else None, slice(s0, s1))
                grads = (torch.autograd.grad(loss, inputs, allow_unused=True) if loss.requires_grad
                         else [None] * len(inputs))
            losses.append(loss.detach())
            chunk_stats.append(stats)
            g = [None if d is None else d.reshape(-1).index_select(0, positions) for d in grads]
            return (torch.zeros_like(logp_rows) if g[0] is None else g[0]), (g[1] if len(g) > 1 else None)

        need_dh, need_dw = hidden_in.requires_grad, weight_in.requires_grad
        grads = _linear_loss_grads_triton if backend == "triton" else _linear_loss_grads_torch
        logp_kept, dh_kept, dw, entropy_kept = grads(h_kept, weight, labels_kept, float(temperature), bounds,
                                                     chunk_grad, need_entropy, need_dh, need_dw)
        logp = torch.zeros(B * T, device=hidden.device, dtype=acc).index_copy_(0, kept, logp_kept.to(acc)).view(B, T)
        entropy = None
        if need_entropy:
            entropy = torch.zeros(B * T, device=hidden.device, dtype=acc).index_copy_(
                0, kept, entropy_kept.to(acc)).view(B, T)
        if chunks != [(0, B)]:
            # the value and statistics of the whole batch: the loss evaluated again on every row (cheap: elementwise
            # over [B, T]), since a chunk's masked means are not the batch's, and a tile's loss saw placeholders.
            # (One chunk of every row saw the batch as it is: 0 on the tokens outside the loss, as here.)
            loss, stats = loss_fn(logp, entropy, slice(None))
        else:
            loss, stats = losses[0], chunk_stats[0]
        dhidden = dweight = None
        if need_dh:
            dhidden = torch.zeros((B * T, H), device=hidden.device, dtype=hidden_in.dtype)
            dhidden = dhidden.index_copy_(0, kept, dh_kept.to(hidden_in.dtype)).view(B, T, H)
        if need_dw:
            dweight = dw.to(weight_in.dtype)  # no copy when the caller's weight is fp32
    loss = _ScaledGrad.apply(loss.to(acc), hidden_in, weight_in, dhidden, dweight)
    return loss, {k: v.detach() for k, v in stats.items()}, logp, entropy


def linear_logprob_loss_triton(hidden, weight, labels, loss_fn, *, temperature=1.0, need_entropy=False,
                               rows_separate=True, tokens_separate=False):
    """`linear_logprob_loss` on the Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1)."""
    return _linear_logprob_loss(hidden, weight, labels, loss_fn, temperature, need_entropy, rows_separate,
                                tokens_separate, "triton")


def linear_logprob_loss_torch(hidden, weight, labels, loss_fn, *, temperature=1.0, need_entropy=False,
                              rows_separate=True, tokens_separate=False):
    """`linear_logprob_loss` on the chunked torch path (what CPU tensors run)."""
    return _linear_logprob_loss(hidden, weight, labels, loss_fn, temperature, need_entropy, rows_separate,
                                tokens_separate, "torch")


def linear_logprob_loss(hidden, weight, labels, loss_fn, *, temperature=1.0, need_entropy=False, rows_separate=True,
                        tokens_separate=False):
    """loss_fn(linear_token_logprobs(hidden, weight, labels, temperature)) without the [B*T, V] logits.

    hidden: [B, T, H]; weight: [V, H] the LM head; labels: [B, T] int, IGNORE_INDEX (-100) on tokens outside the
    loss (their log-prob and entropy are 0 and pass no gradient).
    loss_fn(logp, entropy, rows) -> (loss 0-dim, stats dict of 0-dim tensors): the loss of the batch's rows `rows`
    (a slice of B), given their log-probs logp [b, T] (and entropies [b, T] with need_entropy, else None) as tensors
    that require grad. It must split over rows as a micro-batch does (the loss of a set of rows, with the batch's
    global counts, is that set's share), unless rows_separate=False, which hands it every row at once.
    tokens_separate=True (a loss whose gradient at a token reads that token's log-prob alone, and its row's mask):
    tiles of tokens across rows instead, the loss called on the rows a tile spans with placeholders (0) on their
    other tokens, then once more on every row for its value and statistics.
    Returns (loss, stats, logp [B, T], entropy [B, T] or None): the loss with gradients to hidden and weight (formed
    in the forward: the backward only scales them), the stats loss_fn reported (on the whole batch), and the
    log-probs and entropies, detached. Under autocast, fp32 hidden and weight are cast to the autocast dtype first
    (their gradients come back in fp32); a weight of another dtype than hidden is cast to hidden's.
    """
    return _linear_logprob_loss(hidden, weight, labels, loss_fn, temperature, need_entropy, rows_separate,
                                tokens_separate, _backend(hidden.device))
