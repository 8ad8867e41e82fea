"""The token-level policy losses in one pass, and fused with the LM-head projection (linear_policy_loss).

    r = exp(clamp(logp - old_logp, -20, 20))
    loss_kind "ppo":
    L_t = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))            (Schulman et al. 2017)
    L_t = min(L_t, dual_clip * |A|)  for A < 0, with dual_clip           (Ye et al. 2020)
    loss_kind "cispo":
    L_t = -sg(clip(r, 1 - clip_low, 1 + clip_high)) A logp,  dL_t/dlogp = -clip(r) A   (MiniMax-M1 2025)
    L_t += kl_coef * KL_t(logp, ref_logp),  KL one of k1 / k2 / k3        (Schulman, "Approximating KL")
        k1 = logp - ref,   k2 = 1/2 (logp - ref)^2,
        k3 = clamp(exp(x) - x - 1, -10, 10),  x = clamp(ref - logp, -20, 20)   (verl's "low_var_kl")
    loss = aggregate(L, mask, agg)  =  sum_t w_t L_t
    loss -= entropy_coef * aggregate(H, mask, agg)                       (entropy bonus, Schulman et al. 2017
        H_t = -sum_v p_tv log p_tv,  p_t = softmax(h_t W^T / T)             eq. 9; linear_policy_loss only)

Clamps: r's log-ratio at +-LOG_RATIO_CLAMP (20) keeps exp finite; k3's log-ratio x at +-LOG_RATIO_CLAMP and k3 itself
at +-K3_CLAMP (10, only the upper bound can bind: k3 >= 0) bound the KL term of a token whose log-prob has drifted far
from the reference's, as verl's core_algos.kl_penalty does. Where a clamp is strictly active the term passes no
gradient.

A loss kind fuses here when each token's loss and its gradient are functions of (logp, old_logp, A) alone: both
paths compute them in one elementwise branch on loss_kind (LOSS_KINDS; `ppo_core.algo.policy_loss_function` has
each kind's reference). GSPO, whose ratio spans a sequence, is not one.

Every aggregation mode of `ppo_core.algo.aggregate` is linear in L, so it is a weighted sum with per-token
weights w that depend on the mask alone (`_token_weights`). The loss is a scalar, so dloss/dlogp_t = w_t dL_t/dlogp_t
is known in the forward: both paths compute it there, with the same tie rules as torch autograd
(max/min split a tie's gradient in half; clamp passes gradient on its closed interval), and the backward only
scales it by the incoming scalar gradient. Gradients flow to logp (and, in linear_policy_loss, to hidden and
weight); old_logp, advantages and ref_logp are treated as constants. The entropy term is not elementwise in logp:
linear_policy_loss adds its gradient per logit, dloss/dz_tv += -entropy_coef w_t dH_t/dz_tv with
dH_t/dz_tv = -p_tv (log p_tv + H_t) (z_t = h_t W^T / T), to the log-prob term's while the logits are on hand.

In this file:
  - `policy_loss_reference`: `ppo_core.algo.policy_loss` (or `algo.cispo_policy_loss`) plus the KL term through
    `algo.kl_estimate` and `algo.aggregate`: the plain PyTorch the others are tested against.
  - `_policy_loss_kernel` (Triton): one pass over the tokens: loss, gradient and the stats' partial sums.
  - `_loss_terms_torch`: the same closed form in torch (CPU, and inside linear_policy_loss).
  - `linear_policy_loss`: log-probs (and entropies) from hidden states and the LM head, then the loss, in one
    pass over blocks of rows: each block gets its full-vocabulary logits, its log-probs, its loss gradient and
    then its contribution to dhidden and dweight while the logits are on hand. 3 matmuls, as the naive path, with
    one [rows, V] fp32 logits buffer instead of [N, V] (two on the torch path with the entropy term). On the torch
    path (`_linear_loss_grads_torch`) these are torch.mm; on the Triton path (`_linear_loss_grads_triton`) they are
    cuBLAS GEMMs with fp32 accumulation, and two Triton row kernels in between turn the logits into log-probs and
    entropies (logprobs.py's forward kernel) and into dloss/dz (`_loss_dz_kernel`, the entropy term under its
    constexpr HAS_ENTROPY; written in the operands' dtype so the two gradient GEMMs run at full rate). dweight
    is summed over the chunks of rows in an fp32 [V, H] accumulator, in a fixed order.
    Temperature: the torch path scales h by 1/T before its matmul (fp32 / fp64 operands), the Triton path
    and the torch path on bf16 operands divide the fp32 logits by T, as the reference does. Under autocast,
    fp32 hidden / weight are cast to the autocast dtype (`linear_logprobs._autocast_operands`), so the kernels
    see bf16; the gradients, formed in fp32 accumulators, go to the caller's fp32 tensors without being rounded
    to bf16 on the way. On the torch path bf16 operands give bf16 GEMMs (the CPU's fast path), whose outputs
    (logits, and each tile's gradient products before their fp32 sum) are rounded to bf16, as eager bf16's are;
    the statistics, the loss and its per-token gradient stay fp32 (tests/test_kernels_bf16.py).
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

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
LOSS_KINDS = ("ppo", "cispo")  # the token-level losses fused here (loss_kind), of ppo_core.algo.POLICY_LOSS_KINDS
KL_KINDS = ("k1", "k2", "k3")
LOG_RATIO_CLAMP = 20.0  # |log r| and |x| of k3 are clamped here (exp(20) ~ 4.9e8: finite in fp32)
K3_CLAMP = 10.0  # k3 is clamped to [-K3_CLAMP, K3_CLAMP] (verl's low_var_kl); k3 >= 0, so only the top binds
# Elements in the [rows, V] logits buffer of linear_policy_loss's torch path (fp32: 128 MiB; bf16 operands add a
# bf16 one, 64 MiB, for the GEMMs' output and dz).
TORCH_LOSS_TILE_ELEMENTS = 1 << 25
DH_BLOCK = 8192  # vocabulary columns per fp32 product in dhidden's fp64 accumulation
# Elements in the [rows, V] fp32 logits chunk of linear_policy_loss's Triton path (256 MiB, plus a bf16 dz chunk
# of half that on a GPU). At V = 151936 that is 441 rows per chunk.
TRITON_LOSS_CHUNK_ELEMENTS = 1 << 26


def policy_loss_reference(logp, old_logp, advantages, mask, clip_low=0.2, clip_high=0.2, dual_clip=None,
                          agg="token-mean", num_tokens=None, num_seqs=None, norm_const=None, *,
                          ref_logp=None, kl_coef=0.0, kl_kind="k3", loss_kind="ppo"):
    """loss_kind's ppo_core.algo function (algo.policy_loss, algo.cispo_policy_loss), plus
    kl_coef * aggregate(kl_estimate(logp, ref_logp, kl_kind)) when kl_coef != 0."""
    from ppo_core import algo

    if loss_kind not in LOSS_KINDS:
        raise ValueError(f"loss_kind must be one of {LOSS_KINDS}, got {loss_kind!r}")
    loss, stats = algo.policy_loss_function(loss_kind)(logp, old_logp, advantages, mask, clip_low, clip_high,
                                                       dual_clip, agg, num_tokens, num_seqs, norm_const)
    if kl_coef != 0.0:
        kl = algo.kl_estimate(logp, ref_logp, kl_kind)
        loss = loss + kl_coef * algo.aggregate(kl, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs,
                                               norm_const=norm_const)
        stats["kl"] = algo.masked_mean(kl, mask).detach()
    return loss, stats


def linear_policy_loss_reference(hidden, weight, labels, old_logp, advantages, mask, *, temperature=1.0,
                                 clip_low=0.2, clip_high=0.2, dual_clip=None, agg="token-mean", ref_logp=None,
                                 kl_coef=0.0, kl_kind="k3", entropy_coef=0.0, num_tokens=None, num_seqs=None,
                                 norm_const=None, loss_kind="ppo"):
    """The naive path: full logits, log-softmax + gather (and the entropy), then policy_loss_reference.

    With entropy_coef != 0 the loss subtracts entropy_coef * aggregate(H, mask, agg), H [like mask] the entropy of
    softmax(hidden @ weight.T / temperature) per token (0 where the label is IGNORE_INDEX), and the stats add
    "entropy" (its masked mean).
    """
    from ppo_core import algo

    if entropy_coef == 0.0:  # the entropy costs [N, V] temporaries: only when it is in the loss
        logp = _linear.linear_token_logprobs_reference(hidden, weight, labels, temperature=temperature)
    else:
        logp, entropy = _linear.linear_token_logprobs_reference(hidden, weight, labels, temperature=temperature,
                                                                return_entropy=True)
    loss, stats = policy_loss_reference(logp, old_logp, advantages, mask, clip_low, clip_high, dual_clip, agg,
                                        num_tokens, num_seqs, norm_const, ref_logp=ref_logp, kl_coef=kl_coef,
                                        kl_kind=kl_kind, loss_kind=loss_kind)
    if entropy_coef != 0.0:
        # loss -= entropy_coef * aggregate(H, mask, agg)   (entropy bonus, Schulman et al. 2017, eq. 9)
        loss = loss - entropy_coef * algo.aggregate(entropy, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs,
                                                    norm_const=norm_const)
        stats["entropy"] = algo.masked_mean(entropy, mask).detach()
    return loss, stats


# ----------------------------------------------------------------------------------------------------------------
# Aggregation as per-token weights
# ----------------------------------------------------------------------------------------------------------------
def _count(count, like):
    return torch.as_tensor(count, dtype=like.dtype, device=like.device).clamp(min=1)


def _token_weights(mask, agg, num_tokens, num_seqs, norm_const, dtype):
    """w [*mask.shape] with aggregate(L, mask, agg) == sum(w * L): the reductions of ppo_core.algo.aggregate."""
    if agg not in AGG_MODES:
        raise ValueError(f"agg must be one of {AGG_MODES}, got {agg!r}")
    mask = mask.to(dtype)
    if agg == "token-mean":
        # sum(L * mask) / num_tokens
        return mask / _count(mask.sum() if num_tokens is None else num_tokens, mask)
    tokens_per_seq = mask.sum(-1, keepdim=True)  # [B, 1]
    seqs = _count((tokens_per_seq > 0).sum() if num_seqs is None else num_seqs, mask)
    if agg == "seq-mean-token-mean":
        # sum_i [sum_t L_it mask_it / n_i] / num_seqs  (empty rows: mask 0, so weight 0)
        return mask / (tokens_per_seq.clamp(min=1) * seqs)
    if agg == "seq-mean-token-sum":
        return mask / seqs
    # Dr. GRPO: seq-mean of token sums over a constant (default: the padded length)
    return mask / (seqs * (mask.shape[-1] if norm_const is None else norm_const))


def _check_args(clip_low, clip_high, dual_clip, kl_coef, kl_kind, ref_logp, loss_kind):
    if loss_kind not in LOSS_KINDS:
        raise ValueError(f"loss_kind must be one of {LOSS_KINDS}, got {loss_kind!r}")
    if loss_kind == "cispo" and dual_clip is not None:
        raise ValueError(f"dual_clip does not apply to loss_kind 'cispo' (its weight is clipped already), "
                         f"got {dual_clip}")
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1 or None, got {dual_clip}")
    if kl_kind not in KL_KINDS:
        raise ValueError(f"kl_kind must be one of {KL_KINDS}, got {kl_kind!r}")
    if kl_coef != 0.0 and ref_logp is None:
        raise ValueError("kl_coef != 0 needs ref_logp")


# ----------------------------------------------------------------------------------------------------------------
# Triton kernel: loss, gradient and stats in one pass over the tokens
# ----------------------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _policy_loss_kernel(
        logp_ptr, old_ptr, adv_ptr, weight_ptr, mask_ptr, ref_ptr,  # [N] fp32 each (ref read only if HAS_KL)
        grad_ptr,  # [N] fp32 out: dloss / dlogp
        partials_ptr,  # [n_blocks, 8] fp32 out: loss, clip, dual, approx_kl, ratio, max |r - 1|, kl, (unused)
        N, clip_low, clip_high, dual_clip, kl_coef,
        LOSS_KIND: tl.constexpr, HAS_DUAL: tl.constexpr, HAS_KL: tl.constexpr, KL_KIND: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        block = tl.program_id(0)
        offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inb = offs < N
        logp = tl.load(logp_ptr + offs, mask=inb, other=0.0)
        old = tl.load(old_ptr + offs, mask=inb, other=0.0)
        adv = tl.load(adv_ptr + offs, mask=inb, other=0.0)
        w = tl.load(weight_ptr + offs, mask=inb, other=0.0)
        m = tl.load(mask_ptr + offs, mask=inb, other=0.0)
        real = m != 0

        raw = logp - old
        log_ratio = tl.minimum(tl.maximum(raw, -20.0), 20.0)
        in_clamp = tl.where((raw >= -20.0) & (raw <= 20.0), 1.0, 0.0)  # clamp's gradient (closed interval)
        ratio = tl.exp(log_ratio)
        dual = tl.zeros((BLOCK,), dtype=tl.float32)
        if LOSS_KIND == 2:  # cispo
            # L = -sg(clip(r, 1 - eps_low, 1 + eps_high)) A logp:  dL/dlogp = -A clip(r), no gradient through r
            dpg = -adv * tl.minimum(tl.maximum(ratio, 1.0 - clip_low), 1.0 + clip_high)
            pg = dpg * logp
            clipped = tl.where(real & ((ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)), m, 0.0)
        else:  # ppo
            # L^CLIP = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))
            pg1 = -adv * ratio
            pg2 = -adv * tl.minimum(tl.maximum(ratio, 1.0 - clip_low), 1.0 + clip_high)
            in_clip = tl.where((ratio >= 1.0 - clip_low) & (ratio <= 1.0 + clip_high), 1.0, 0.0)
            d1 = pg1 * in_clamp  # d(-A r)/dlogp = -A r
            d2 = pg1 * in_clip * in_clamp
            pg = tl.maximum(pg1, pg2)
            dpg = tl.where(pg1 > pg2, d1, tl.where(pg1 == pg2, 0.5 * (d1 + d2), d2))  # torch.maximum's tie rule
            clipped = tl.where(real & (pg2 > pg1), m, 0.0)
            if HAS_DUAL:
                # for A < 0: L = min(L^CLIP, -A c)
                pg3 = -adv * dual_clip
                negative = adv < 0
                dual = tl.where(real & negative & (pg > pg3), m, 0.0)
                dpg = tl.where(negative, tl.where(pg < pg3, dpg, tl.where(pg == pg3, 0.5 * dpg, 0.0)), dpg)
                pg = tl.where(negative, tl.minimum(pg, pg3), pg)
        loss_t = pg
        dloss_t = dpg
        kl = tl.zeros((BLOCK,), dtype=tl.float32)
        if HAS_KL:
            ref = tl.load(ref_ptr + offs, mask=inb, other=0.0)
            if KL_KIND == 1:  # k1 = logp - ref
                kl = logp - ref
                dkl = tl.full((BLOCK,), 1.0, dtype=tl.float32)
            elif KL_KIND == 2:  # k2 = 1/2 (logp - ref)^2
                kl = 0.5 * (logp - ref) * (logp - ref)
                dkl = logp - ref
            else:  # k3 = clamp(exp(x) - x - 1, -10, 10),  x = clamp(ref - logp, -20, 20)  (K3_CLAMP, LOG_RATIO_CLAMP)
                raw_x = ref - logp
                x = tl.minimum(tl.maximum(raw_x, -20.0), 20.0)
                e = tl.exp(x)
                k3 = e - x - 1.0
                kl = tl.minimum(tl.maximum(k3, -10.0), 10.0)
                # dk3/dlogp = 1 - e, 0 where either clamp is strictly active (clamp's closed interval, as autograd's)
                in_clamps = (raw_x >= -20.0) & (raw_x <= 20.0) & (k3 >= -10.0) & (k3 <= 10.0)
                dkl = tl.where(in_clamps, 1.0 - e, 0.0)
            loss_t += kl_coef * kl
            dloss_t += kl_coef * dkl
        tl.store(grad_ptr + offs, tl.where(w != 0, w * dloss_t, 0.0), mask=inb)
        row = partials_ptr + block * 8
        tl.store(row + 0, tl.sum(tl.where(w != 0, w * loss_t, 0.0), axis=0))
        tl.store(row + 1, tl.sum(clipped, axis=0))
        tl.store(row + 2, tl.sum(dual, axis=0))
        # approx KL(old || new), k3: (r - 1) - log r
        tl.store(row + 3, tl.sum(tl.where(real, m * ((ratio - 1.0) - log_ratio), 0.0), axis=0))
        tl.store(row + 4, tl.sum(tl.where(real, m * ratio, 0.0), axis=0))
        tl.store(row + 5, tl.max(tl.where(real & inb, tl.abs(ratio - 1.0), 0.0), axis=0))
        tl.store(row + 6, tl.sum(tl.where(real, m * kl, 0.0), axis=0))
        tl.store(row + 7, 0.0)

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


def _loss_terms_triton(logp, old, adv, w, mask, ref, clip_low, clip_high, dual_clip, kl_coef, kl_kind, loss_kind):
    # flat [N] fp32 inputs. Returns (loss, dloss/dlogp [N], stats sums [7]: as the kernel's partials).
    N = logp.numel()
    block = 1024
    n_blocks = max(1, triton.cdiv(N, block))
    grad = torch.empty_like(logp)
    partials = torch.empty((n_blocks, 8), device=logp.device, dtype=torch.float32)
    has_kl = kl_coef != 0.0
    _policy_loss_kernel[(n_blocks,)](
        logp, old, adv, w, mask, ref if has_kl else logp, grad, partials,
        N, float(clip_low), float(clip_high), float(dual_clip or 0.0), float(kl_coef),
        LOSS_KIND=LOSS_KINDS.index(loss_kind) + 1, HAS_DUAL=dual_clip is not None, HAS_KL=has_kl,
        KL_KIND=KL_KINDS.index(kl_kind) + 1, BLOCK=block,
    )
    sums = partials[:, :7].sum(0)  # fixed order: deterministic
    sums[5] = partials[:, 5].max()
    return sums[0], grad, sums[1:]


def _loss_terms_torch(logp, old, adv, w, mask, ref, clip_low, clip_high, dual_clip, kl_coef, kl_kind, loss_kind):
    """The kernel's math in torch, on any shape. Returns (loss, dloss/dlogp, stats sums [6])."""
    real = mask != 0
    raw = logp - old
    log_ratio = raw.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    dual = zero
    if loss_kind == "cispo":
        # L = -sg(clip(r, 1 - eps_low, 1 + eps_high)) A logp:  dL/dlogp = -A clip(r), no gradient through r
        dpg = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
        pg = dpg * logp
        clipped = torch.where(real & ((ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)), mask, zero).sum()
    else:  # ppo
        in_clamp = ((raw >= -LOG_RATIO_CLAMP) & (raw <= LOG_RATIO_CLAMP)).to(logp.dtype)
        # L^CLIP = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))
        pg1 = -adv * ratio
        pg2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
        in_clip = ((ratio >= 1.0 - clip_low) & (ratio <= 1.0 + clip_high)).to(logp.dtype)
        d1 = pg1 * in_clamp  # d(-A r)/dlogp = -A r
        d2 = d1 * in_clip
        pg = torch.maximum(pg1, pg2)
        dpg = torch.where(pg1 > pg2, d1, torch.where(pg1 == pg2, 0.5 * (d1 + d2), d2))  # torch.maximum's tie rule
        clipped = torch.where(real & (pg2 > pg1), mask, zero).sum()
        if dual_clip is not None:
            # for A < 0: L = min(L^CLIP, -A c)
            pg3 = -adv * dual_clip
            negative = adv < 0
            dual = torch.where(real & negative & (pg > pg3), mask, zero).sum()
            dpg = torch.where(negative, torch.where(pg < pg3, dpg, torch.where(pg == pg3, 0.5 * dpg, zero)), dpg)
            pg = torch.where(negative, torch.minimum(pg, pg3), pg)
    loss_t, dloss_t, kl = pg, dpg, zero
    if kl_coef != 0.0:
        if kl_kind == "k1":  # k1 = logp - ref
            kl, dkl = logp - ref, torch.ones_like(logp)
        elif kl_kind == "k2":  # k2 = 1/2 (logp - ref)^2
            kl, dkl = 0.5 * (logp - ref) ** 2, logp - ref
        else:  # k3 = clamp(exp(x) - x - 1, -K3_CLAMP, K3_CLAMP),  x = clamp(ref - logp, -20, 20)  (verl's low_var_kl)
            raw_x = ref - logp
            x = raw_x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
            e = torch.exp(x)
            k3 = e - x - 1.0
            kl = k3.clamp(-K3_CLAMP, K3_CLAMP)
            # dk3/dlogp = 1 - e, 0 where either clamp is strictly active (clamp's closed interval, as autograd's)
            in_clamps = ((raw_x >= -LOG_RATIO_CLAMP) & (raw_x <= LOG_RATIO_CLAMP)
                         & (k3 >= -K3_CLAMP) & (k3 <= K3_CLAMP))
            dkl = torch.where(in_clamps, 1.0 - e, zero)
        loss_t = loss_t + kl_coef * kl
        dloss_t = dloss_t + kl_coef * dkl
    nonzero_w = w != 0
    loss = torch.where(nonzero_w, w * loss_t, zero).sum()
    grad = torch.where(nonzero_w, w * dloss_t, zero)
    sums = torch.stack([
        clipped, dual,
        torch.where(real, mask * ((ratio - 1.0) - log_ratio), zero).sum(),  # approx KL(old || new), k3
        torch.where(real, mask * ratio, zero).sum(),
        torch.where(real, (ratio - 1.0).abs(), zero).max() if ratio.numel() else zero,
        torch.where(real, mask * kl, zero).sum(),
    ])
    return loss, grad, sums


def _stats(sums, mask, dual_clip, kl_coef):
    """The stats dict of ppo_core.algo.policy_loss (+ 'kl'), from the sums: masked means over mask."""
    count = mask.sum().clamp(min=1)
    stats = {"clipfrac": sums[0] / count}
    if dual_clip is not None:
        stats["dual_clipfrac"] = sums[1] / count
    stats["approx_kl"] = sums[2] / count
    stats["ratio_mean"] = sums[3] / count
    stats["ratio_max_dev"] = sums[4]
    if kl_coef != 0.0:
        stats["kl"] = sums[5] / count
    return {k: v.detach() for k, v in stats.items()}


# ----------------------------------------------------------------------------------------------------------------
# policy_loss: autograd wrapper and dispatch
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


def _policy_loss(logp, old_logp, advantages, mask, clip_low, clip_high, dual_clip, agg, num_tokens, num_seqs,
                 norm_const, ref_logp, kl_coef, kl_kind, loss_kind, backend):
    _check_args(clip_low, clip_high, dual_clip, kl_coef, kl_kind, ref_logp, loss_kind)
    acc = _compute_dtype(logp.dtype) if backend == "torch" else torch.float32
    with torch.no_grad():  # the gradient is formed here, in closed form
        weights = _token_weights(mask, agg, num_tokens, num_seqs, norm_const, acc)
        flat = [t.reshape(-1).to(acc).contiguous() for t in (logp, old_logp, advantages, weights, mask)]
        ref = ref_logp.reshape(-1).to(acc).contiguous() if kl_coef != 0.0 else None  # not read when kl_coef == 0
        terms = _loss_terms_triton if backend == "triton" else _loss_terms_torch
        loss, grad, sums = terms(*flat, ref, clip_low, clip_high, dual_clip, kl_coef, kl_kind, loss_kind)
        stats = _stats(sums, mask.to(acc), dual_clip, kl_coef)
        grad = grad.view(logp.shape).to(logp.dtype)
    return _ScaledGrad.apply(loss.to(logp.dtype), logp, grad), stats


def policy_loss_triton(logp, old_logp, advantages, mask, clip_low=0.2, clip_high=0.2, dual_clip=None,
                       agg="token-mean", num_tokens=None, num_seqs=None, norm_const=None, *, ref_logp=None,
                       kl_coef=0.0, kl_kind="k3", loss_kind="ppo"):
    """`policy_loss` on the Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1)."""
    return _policy_loss(logp, old_logp, advantages, mask, clip_low, clip_high, dual_clip, agg, num_tokens,
                        num_seqs, norm_const, ref_logp, kl_coef, kl_kind, loss_kind, "triton")


def policy_loss_torch(logp, old_logp, advantages, mask, clip_low=0.2, clip_high=0.2, dual_clip=None,
                      agg="token-mean", num_tokens=None, num_seqs=None, norm_const=None, *, ref_logp=None,
                      kl_coef=0.0, kl_kind="k3", loss_kind="ppo"):
    """`policy_loss` on the closed-form torch path (any device)."""
    return _policy_loss(logp, old_logp, advantages, mask, clip_low, clip_high, dual_clip, agg, num_tokens,
                        num_seqs, norm_const, ref_logp, kl_coef, kl_kind, loss_kind, "torch")


def policy_loss(logp, old_logp, advantages, mask, clip_low=0.2, clip_high=0.2, dual_clip=None,
                agg="token-mean", num_tokens=None, num_seqs=None, norm_const=None, *, ref_logp=None,
                kl_coef=0.0, kl_kind="k3", loss_kind="ppo"):
    """ppo_core.algo.policy_loss (same arguments, loss and stats), fused, plus an optional KL-to-reference term;
    with loss_kind="cispo", ppo_core.algo.cispo_policy_loss instead (LOSS_KINDS: the kinds fused here).

    logp: [B, T] current log-probs (with grad); old_logp, advantages, mask: [B, T]; ref_logp: [B, T] or None,
    read only when kl_coef != 0; kl_kind: "k1" | "k2" | "k3" (k3 clamped as verl's low_var_kl, see the module
    docstring). The loss adds kl_coef * aggregate(KL) and the stats add "kl" (masked mean of the estimate) when
    kl_coef != 0. Returns (loss 0-dim, stats dict of detached 0-dim).
    Gradient flows to logp only.
    """
    return _policy_loss(logp, old_logp, advantages, mask, clip_low, clip_high, dual_clip, agg, num_tokens,
                        num_seqs, norm_const, ref_logp, kl_coef, kl_kind, loss_kind, _backend(logp.device))


# ----------------------------------------------------------------------------------------------------------------
# linear_policy_loss: the loss fused into the LM-head projection
# ----------------------------------------------------------------------------------------------------------------
def _linear_loss_grads_torch(h_kept, weight, labels_kept, temperature, token_grad_fn, need_dh=True, need_dw=True,
                             entropy_grad=None):
    """One pass over blocks of rows with their full-V logits: log-probs, then dloss/dz and its matmuls.

    token_grad_fn(rows, logp_rows) -> dloss/dlogp for those rows (the loss is elementwise in logp).
    entropy_grad: [Nk] dloss/dH per row (the entropy bonus's -entropy_coef * w_t), or None: no entropy term.
    Returns logp [Nk], dhidden [Nk, H], dweight [V, H] and entropy [Nk] (None without entropy_grad), all in the
    compute dtype (fp32; fp64 for fp64 inputs).

    The matmuls run at linear_logprobs._torch_mm_dtype: bf16 operands give bf16 GEMMs, whose outputs are rounded
    to bf16 (the logits, widened to fp32 for the statistics; dhidden, one GEMM over V per row tile; dweight, one
    per row tile, summed over them in fp32), and dz / T (1/T folded into g) is rounded to bf16 to feed them, as
    eager bf16's autograd rounds d logits. Everything else (max, sum-exp, log-probs, entropy, the loss, g) is fp32.
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
    entropy = torch.empty(Nk, device=h.device, dtype=acc) if entropy_grad is not None else None
    dh = torch.empty((Nk, H), device=h.device, dtype=acc) if need_dh else None
    # fp32 products accumulate with addmm_ (onto zeros); bf16 ones are copied in (first row tile) or added
    # (zeros also when no row is kept: a process whose micro-batch has no token in the loss returns dW = 0)
    dw = (torch.empty if low_precision and Nk > 0 else torch.zeros)((V, H), device=h.device, dtype=acc) if need_dw else None
    # rows per tile: at most TORCH_LOSS_TILE_ELEMENTS // V, balanced (1024 rows in tiles of <= 341 are 4 x 256, not
    # 3 x 341 + 1: a 1-row tile costs a whole dW accumulation)
    n_tiles = -(-Nk // max(1, TORCH_LOSS_TILE_ELEMENTS // max(V, 1)))
    rows_per_tile = max(1, -(-Nk // max(1, n_tiles)))
    buf = torch.empty(rows_per_tile * V, device=h.device, dtype=acc)
    # the entropy term needs z - m and exp(z - m) at once: a second buffer
    e_buf = torch.empty_like(buf) if entropy_grad is not None else None
    # bf16: the logits GEMM's output (widened into buf), then dz / T in bf16 for the gradient GEMMs; dW's bf16
    # product of each row tile before it joins the fp32 sum
    mm_buf = torch.empty_like(buf, dtype=mm_dtype) if low_precision else None
    dw_tile = torch.empty((V, H), device=h.device, dtype=mm_dtype) if need_dw and low_precision else None
    for r0 in range(0, Nk, rows_per_tile):
        r1 = min(r0 + rows_per_tile, Nk)
        n, rows = r1 - r0, slice(r0, r1)
        mm_out = mm_buf[: n * V].view(n, V) if low_precision else None
        # [n, V] z, the only [*, V] buffer without entropy
        z = _linear._tile_logits(h[rows], w, temperature, buf[: n * V].view(n, V), mm_out)
        m = z.amax(1)
        label_z = z.gather(1, labels_kept[rows].unsqueeze(1)).squeeze(1)
        if entropy_grad is None:
            e = z.sub_(m.unsqueeze(1)).exp_()  # exp(z - m), in place
            s = e.sum(1)
            logp[rows] = (label_z - m) - torch.log(s)
            g = token_grad_fn(rows, logp[rows])  # [n] dloss/dlogp
            if low_precision and temperature != 1.0:
                g = g / temperature  # dz / T below: dloss/d(h W^T), what the bf16 GEMMs take
            # dloss/dz = g (onehot(label) - p),  p = e / s
            dz = e.mul_((-g / s).unsqueeze(1))
        else:
            z_m = z.sub_(m.unsqueeze(1))  # [n, V] z - m, in place
            e = torch.exp(z_m, out=e_buf[: n * V].view(n, V))  # [n, V] exp(z - m)
            s = e.sum(1)
            log_s = torch.log(s)
            logp[rows] = (label_z - m) - log_s
            # H = -sum_v p_v log p_v = log s - sum_v e_v (z_v - m) / s   (as logprobs._fwd_torch); a batched dot
            # product leaves no [n, V] temporary
            entropy[rows] = log_s - torch.bmm(e.unsqueeze(1), z_m.unsqueeze(2)).view(n) / s
            g = token_grad_fn(rows, logp[rows])  # [n] dloss/dlogp
            g_entropy = entropy_grad[rows].to(acc)  # [n] dloss/dH
            if low_precision and temperature != 1.0:
                g, g_entropy = g / temperature, g_entropy / temperature  # dz / T below, as above
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
            if r0 == 0:
                dw.copy_(product)
            else:  # summed over the row tiles in fp32 (buf is free: dz is in mm_out)
                _linear._add_widened(dw, product, scratch=buf)
        elif need_dw:
            dw.addmm_(dz.T, h[rows])  # [V, H]
    if need_dh and temperature != 1.0 and not low_precision:
        dh.div_(temperature)
    return logp, dh, dw, entropy


def _linear_loss_grads_triton(h_kept, weight, labels_kept, temperature, token_grad_fn, need_dh=True, need_dw=True,
                              entropy_grad=None):
    """The same pass on the Triton backend, one chunk of rows at a time: 3 cuBLAS matmuls, 2 Triton row kernels.

        z     = h @ W.T                     [n, V] fp32 (bf16/fp16 operands: fp32 accumulate and output)
        logp, H, lse from z / T             _logprobs._fwd_triton (divides z by T as the reference does)
        g     = dloss/dlogp                 token_grad_fn
        dz    = g (onehot(label) - p) / T   _loss_dz_kernel, in the operands' dtype (over z itself when fp32)
              - g_H p (log p + H) / T         + the entropy term, g_H = entropy_grad, when it is given
        dh    = dz @ W,   dW += dz.T @ h    fp32 accumulators; dW's over the chunks, in their order

    token_grad_fn(rows, logp_rows) -> dloss/dlogp for those rows. entropy_grad: [Nk] dloss/dH per row, or None.
    Returns logp [Nk], dhidden [Nk, H], dweight [V, H] and entropy [Nk] (None without entropy_grad), all fp32.
    No atomics: the result does not depend on scheduling.
    """
    Nk, H = h_kept.shape
    V = weight.shape[0]
    device = h_kept.device
    low_precision = h_kept.dtype in (torch.bfloat16, torch.float16)
    h = h_kept if low_precision else h_kept.float()  # fp64 inputs run in fp32, as the other Triton kernels do
    w = weight if low_precision else weight.float()
    logp = torch.empty(Nk, device=device, dtype=torch.float32)
    has_entropy = entropy_grad is not None
    entropy = torch.empty(Nk, device=device, dtype=torch.float32) if has_entropy else None
    dh = torch.empty((Nk, H), device=device, dtype=torch.float32) if need_dh else None
    if Nk == 0:  # nothing in the loss
        return logp, dh, torch.zeros((V, H), device=device, dtype=torch.float32) if need_dw else None, entropy
    entropy_grad = entropy_grad.float().contiguous() if has_entropy else None
    dw = torch.empty((V, H), device=device, dtype=torch.float32) if need_dw else None  # written by the first chunk
    rows_per_chunk = max(1, min(Nk, TRITON_LOSS_CHUNK_ELEMENTS // max(V, 1)))
    z_buf = torch.empty(rows_per_chunk * V, device=device, dtype=torch.float32)
    # dz in the operands' dtype feeds the two matmuls at full speed; the interpreter truncates fp32 -> bf16 stores
    # instead of rounding them, so there it stays fp32. fp32 dz overwrites z in place (each element is read first).
    dz_dtype = h.dtype if low_precision and not _interpreting() else torch.float32
    dz_buf = z_buf if dz_dtype == torch.float32 else torch.empty(rows_per_chunk * V, device=device, dtype=dz_dtype)
    w_dz = w.to(dz_dtype)  # a no-op except under the interpreter with bf16/fp16 operands
    block_v = min(4096, triton.next_power_of_2(V))
    for r0 in range(0, Nk, rows_per_chunk):
        r1 = min(r0 + rows_per_chunk, Nk)
        n, rows = r1 - r0, slice(r0, r1)
        z = z_buf[: n * V].view(n, V)
        if low_precision:
            _linear._mm_fp32(h[rows], w.T, out=z)  # [n, V], products never rounded to bf16
        else:
            torch.mm(h[rows], w.T, out=z)  # [n, V]
        labels_rows = labels_kept[rows]
        logp_rows, entropy_rows, lse = _logprobs._fwd_triton(z, labels_rows, temperature)  # [n] each
        logp[rows] = logp_rows
        if has_entropy:
            entropy[rows] = entropy_rows
        if not (need_dh or need_dw):
            continue
        g = token_grad_fn(rows, logp_rows).float().contiguous()  # [n] dloss/dlogp
        dz = dz_buf[: n * V].view(n, V)
        _loss_dz_kernel[(n, triton.cdiv(V, block_v))](
            z, labels_rows, lse, g, entropy_rows if has_entropy else lse,
            entropy_grad[rows] if has_entropy else lse, dz, V, float(temperature),
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
            _linear._mm_fp32(dz.T, h[rows].to(dz_dtype), out=dw, accumulate=r0 > 0)  # [V, H]
    return logp, dh, dw, entropy


def _linear_policy_loss(hidden, weight, labels, old_logp, advantages, mask, temperature, clip_low, clip_high,
                        dual_clip, agg, ref_logp, kl_coef, kl_kind, entropy_coef, num_tokens, num_seqs, norm_const,
                        loss_kind, backend):
    _check_args(clip_low, clip_high, dual_clip, kl_coef, kl_kind, ref_logp, loss_kind)
    if hidden.shape[:-1] != mask.shape or labels.shape != mask.shape:
        raise ValueError(f"hidden [..., H] {tuple(hidden.shape)}, labels {tuple(labels.shape)} and mask "
                         f"{tuple(mask.shape)} must share their leading shape")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"hidden [..., H] {tuple(hidden.shape)} and weight [V, H] {tuple(weight.shape)} disagree")
    _logprobs._check_labels(labels, weight.shape[0])  # a label outside [0, V) would read another row of logits
    # The caller's tensors get their gradients directly, in their own dtypes: with fp32 master weights under
    # autocast, dweight leaves the fp32 accumulator as it is (no bf16 rounding, no second [V, H] copy).
    hidden_in, weight_in = hidden, weight
    hidden, weight = _linear._autocast_operands(hidden, weight)  # what the kernels compute with
    # every gradient is formed here; autograd only sees _ScaledGrad
    with _logprobs._autocast_off(hidden.device.type), torch.no_grad():
        acc = _compute_dtype(hidden.dtype) if backend == "torch" else torch.float32
        H = hidden.shape[-1]
        flat_hidden, flat_labels = hidden.reshape(-1, H), labels.reshape(-1)
        weights = _token_weights(mask, agg, num_tokens, num_seqs, norm_const, acc).reshape(-1)
        old, adv, flat_mask = (t.reshape(-1).to(acc) for t in (old_logp, advantages, mask))
        ref = ref_logp.reshape(-1).to(acc) if kl_coef != 0.0 else None  # never read when kl_coef == 0
        params = (clip_low, clip_high, dual_clip, kl_coef, kl_kind, loss_kind)
        terms = _loss_terms_triton if backend == "triton" else _loss_terms_torch

        # Only rows that enter the loss get projected: masked-out and label -100 rows have weight 0 or a
        # constant log-prob of 0 (as in the reference's token_logprobs), so they need no logits.
        kept = ((weights != 0) & (flat_labels != IGNORE_INDEX)).nonzero().squeeze(1)  # [Nk]
        h_kept, labels_kept = flat_hidden.index_select(0, kept), flat_labels.index_select(0, kept)

        def token_grad(rows, logp_rows):  # dloss/dlogp for kept rows `rows`: the loss is elementwise in logp
            idx = kept[rows]
            sub = (logp_rows, old[idx], adv[idx], weights[idx], flat_mask[idx], ref[idx] if ref is not None else None)
            return terms(*(t.contiguous() if t is not None else None for t in sub), *params)[1]

        # entropy bonus, - entropy_coef * sum_t w_t H_t:  dloss/dH_t = -entropy_coef * w_t   [Nk]
        entropy_grad = -entropy_coef * weights.index_select(0, kept) if entropy_coef != 0.0 else None

        need_dh, need_dw = hidden_in.requires_grad, weight_in.requires_grad
        grads = _linear_loss_grads_triton if backend == "triton" else _linear_loss_grads_torch
        logp_kept, dh_kept, dw, entropy_kept = grads(h_kept, weight, labels_kept, float(temperature), token_grad,
                                                     need_dh, need_dw, entropy_grad)
        logp = torch.zeros(flat_labels.numel(), device=hidden.device, dtype=acc)
        logp.index_copy_(0, kept, logp_kept.to(acc))  # [N]; 0 where not kept
        loss, _, sums = terms(logp, old.contiguous(), adv.contiguous(), weights.contiguous(), flat_mask.contiguous(),
                              ref.contiguous() if ref is not None else None, *params)
        stats = _stats(sums, flat_mask, dual_clip, kl_coef)
        if entropy_coef != 0.0:
            entropy = torch.zeros(flat_labels.numel(), device=hidden.device, dtype=acc)
            entropy.index_copy_(0, kept, entropy_kept.to(acc))  # [N]; 0 where not kept (label -100 or weight 0)
            # loss -= entropy_coef * aggregate(H) = entropy_coef * sum_t w_t H_t
            loss = loss - entropy_coef * (weights * entropy).sum()
            stats["entropy"] = ((entropy * flat_mask).sum() / flat_mask.sum().clamp(min=1)).detach()
        stats["logp_mean"] = ((logp * flat_mask).sum() / flat_mask.sum().clamp(min=1)).detach()
        stats["logp"] = logp.view(mask.shape).detach()  # per token, 0 where not in the loss
        dhidden = dweight = None
        if need_dh:
            dhidden = torch.zeros(flat_hidden.shape, device=hidden.device, dtype=hidden_in.dtype)
            dhidden = dhidden.index_copy_(0, kept, dh_kept.to(hidden_in.dtype)).view(hidden.shape)
        if need_dw:
            dweight = dw.to(weight_in.dtype)  # no copy when the caller's weight is fp32
    loss = _ScaledGrad.apply(loss.to(acc), hidden_in, weight_in, dhidden, dweight)
    return loss, stats


def linear_policy_loss_triton(hidden, weight, labels, old_logp, advantages, mask, **kwargs):
    """`linear_policy_loss` on the Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1)."""
    return _linear_policy_loss_kw(hidden, weight, labels, old_logp, advantages, mask, "triton", **kwargs)


def linear_policy_loss_torch(hidden, weight, labels, old_logp, advantages, mask, **kwargs):
    """`linear_policy_loss` on the one-pass torch path (what CPU tensors run)."""
    return _linear_policy_loss_kw(hidden, weight, labels, old_logp, advantages, mask, "torch", **kwargs)


def _linear_policy_loss_kw(hidden, weight, labels, old_logp, advantages, mask, backend, *, temperature=1.0,
                           clip_low=0.2, clip_high=0.2, dual_clip=None, agg="token-mean", ref_logp=None,
                           kl_coef=0.0, kl_kind="k3", entropy_coef=0.0, num_tokens=None, num_seqs=None,
                           norm_const=None, loss_kind="ppo"):
    return _linear_policy_loss(hidden, weight, labels, old_logp, advantages, mask, temperature, clip_low,
                               clip_high, dual_clip, agg, ref_logp, kl_coef, kl_kind, entropy_coef, num_tokens,
                               num_seqs, norm_const, loss_kind, backend)


def linear_policy_loss(hidden, weight, labels, old_logp, advantages, mask, *, temperature=1.0, clip_low=0.2,
                       clip_high=0.2, dual_clip=None, agg="token-mean", ref_logp=None, kl_coef=0.0, kl_kind="k3",
                       entropy_coef=0.0, num_tokens=None, num_seqs=None, norm_const=None, loss_kind="ppo"):
    """policy_loss(linear_token_logprobs(hidden, weight, labels, temperature), ...) without the [N, V] logits.

    loss_kind: "ppo" (ppo_core.algo.policy_loss) or "cispo" (algo.cispo_policy_loss), LOSS_KINDS.

    hidden: [N, H] or [B, T, H]; weight: [V, H]; labels, old_logp, advantages, mask (and ref_logp): [N] or
    [B, T], the same leading shape as hidden ([N] counts as one sequence for the seq-mean modes).
    entropy_coef: the entropy bonus, loss -= entropy_coef * aggregate(H, mask, agg) with H [like mask] the entropy
    of softmax(hidden @ weight.T / temperature) per token (0 where the label is IGNORE_INDEX); its gradient flows
    to hidden and weight. 0 (the default) leaves the entropy out (no cost).
    Other arguments as in `policy_loss`; num_tokens / num_seqs / norm_const as in ppo_core.algo.aggregate.
    Returns (loss 0-dim, stats): policy_loss's stats plus "logp_mean" (masked mean log-prob) and "logp" (the
    log-probs, detached, shaped like mask; 0 on tokens outside the loss), and "entropy" (masked mean of H) when
    entropy_coef != 0.
    Gradients flow to hidden and weight; they are formed in the forward, which therefore costs what forward
    and backward of the naive path cost, and the backward only scales them. Under autocast, fp32 hidden and
    weight are cast to the autocast dtype first (their gradients come back in fp32); a weight of another dtype
    than hidden is cast to hidden's.
    """
    return _linear_policy_loss(hidden, weight, labels, old_logp, advantages, mask, temperature, clip_low,
                               clip_high, dual_clip, agg, ref_logp, kl_coef, kl_kind, entropy_coef, num_tokens,
                               num_seqs, norm_const, loss_kind, _backend(hidden.device))
