"""The PPO math for language models: advantages, KL estimators, masked statistics, losses,
rewards and KL controllers.

Pure functions, tensors in and tensors out; the training loop lives elsewhere. Every tensor is
`[B, T]` over response tokens, with a float `mask` of 0/1 (1 = a token the policy produced). The
mask may have holes (e.g. tool-output tokens mid-response): those positions are skipped, and rows
may be fully masked. Masked positions of every `[B, T]` output hold 0.
"""
from dataclasses import dataclass, field, replace

import torch


# ---------------------------------------------------------------- masked statistics

def masked_mean(x, mask, dim=None):
    """Mean of x over positions where mask == 1 (TRL / OpenRLHF). An empty mask gives 0, not NaN.

    x, mask: [B, T]. dim: None (all elements, 0-dim result) or a dim to reduce.
    """
    total = (x * mask).sum() if dim is None else (x * mask).sum(dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    # counts are integers, so clamp(min=1) only changes the empty case, where total is 0
    return total / count.clamp(min=1)


def masked_var(x, mask, unbiased=True):
    """Variance of x over mask == 1, with Bessel's correction n / (n - 1) when unbiased (TRL).

    Returns a 0-dim tensor; n <= 1 gives 0 (TRL raises instead; 0 keeps this free of host syncs).
    """
    mean = masked_mean(x, mask)
    # Var = E[(x - E[x])^2]
    variance = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        variance = variance * n / (n - 1).clamp(min=1)
    return variance


def masked_whiten(x, mask, shift_mean=True):
    """(x - mean) / sqrt(var + 1e-8) over mask == 1, var unbiased; the mean is added back if not
    shift_mean.

    The 1e-8 inside the rsqrt (as in TRL) keeps a constant batch finite. Returns [B, T], 0 where
    masked.
    """
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


# ---------------------------------------------------------------- advantages and KL

@torch.no_grad()
def gae(rewards, values, mask, gamma, lam):
    """Generalised Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438), backwards over T.

    rewards, values, mask: [B, T] (float32 in, float32 out; float64 works too).
    Masked positions are transparent: their reward and value are ignored and the running "next
    value" and advantage pass through them unchanged, so the last real token before a hole
    bootstraps from the first real token after it. After a row's last real token the next value is
    0 (the episode ends).
    Returns (advantages, returns), both [B, T] and 0 at masked positions; returns = advantages +
    values. No whitening here. Runs under no_grad: advantages are constants of the PPO objective.
    """
    B, T = rewards.shape
    real = mask > 0  # [B, T] bool
    # [B] V_{t+1}, 0 = terminal
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)
    next_adv = torch.zeros(B, dtype=values.dtype, device=values.device)  # [B] A_{t+1}
    advantages = torch.zeros_like(values)  # [B, T]
    for t in reversed(range(T)):
        # delta_t = r_t + gamma * V_{t+1} - V_t
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        # A_t = delta_t + gamma * lam * A_{t+1}
        adv_t = delta + gamma * lam * next_adv
        next_adv = torch.where(real[:, t], adv_t, next_adv)
        next_value = torch.where(real[:, t], values[:, t], next_value)
        advantages[:, t] = torch.where(real[:, t], adv_t, 0.0)
    returns = torch.where(real, advantages + values, 0.0)
    return advantages, returns


@torch.no_grad()
def discounted_returns(token_rewards, mask, gamma):
    """G_t = r_t + gamma * G_{t+1}, backwards over T: the return REINFORCE++ uses as its advantage
    (whitened over the batch by the caller).

    token_rewards, mask: [B, T]. Masked positions are transparent, as in `gae`: their reward is
    ignored and the running return passes through them unchanged. Returns [B, T], 0 where masked.
    """
    real = mask > 0  # [B, T] bool
    next_return = torch.zeros(token_rewards.shape[0], dtype=token_rewards.dtype,
                              device=token_rewards.device)  # [B]
    returns = torch.zeros_like(token_rewards)  # [B, T]
    for t in reversed(range(token_rewards.shape[1])):
        g_t = token_rewards[:, t] + gamma * next_return
        next_return = torch.where(real[:, t], g_t, next_return)
        returns[:, t] = torch.where(real[:, t], g_t, 0.0)
    return returns


GROUP_KINDS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")


@torch.no_grad()
def group_advantages(scores, group, mask, kind, eps=1e-6):
    """Critic-free advantages from the scores of n responses to the same prompt, broadcast over each
    response.

    scores: [B] float; group: [B] int64, rows with equal ids are the responses to one prompt;
    mask: [B, T]. kind:
      grpo                   A_i = (s_i - mean_g) / (std_g + eps), std unbiased
                             (Shao et al. 2024, DeepSeekMath)
      dr_grpo                A_i = s_i - mean_g  (Liu et al. 2025, Dr. GRPO)
      rloo                   A_i = s_i - mean_{g without i} = n/(n-1) (s_i - mean_g)
                             (Ahmadian et al. 2024)
      reinforce_pp_baseline  A_i = s_i - mean_g, then whitened over the batch mask
                             (Hu 2025, REINFORCE++)
    A group of one has mean 0 and std 1 (no baseline from a single sample). Returns [B, T], 0 where
    masked. The group sums are a [G, B] one-hot matmul (a fixed summation order, unlike index_add_'s
    atomics on a GPU).
    """
    if kind not in GROUP_KINDS:
        raise ValueError(f"group_advantages: kind must be one of {GROUP_KINDS}, got {kind!r}")
    ids, member = torch.unique(group, return_inverse=True)  # member [B]: each row's group index
    one_hot = (member[None, :]
               == torch.arange(len(ids), device=group.device)[:, None]).to(scores.dtype)  # [G, B]
    n = one_hot.sum(1)  # [G] responses per group
    mean = torch.where(n > 1, (one_hot @ scores) / n, 0.0)  # [G]
    centred = scores - mean[member]  # [B] s_i - mean_g
    # unbiased std: sqrt(sum (s - mean)^2 / (n - 1))
    std = torch.where(n > 1, ((one_hot @ centred**2) / (n - 1).clamp(min=1)).sqrt(), 1.0)  # [G]
    if kind == "grpo":
        advantage = centred / (std[member] + eps)
    elif kind == "rloo":
        advantage = torch.where(n[member] > 1, n[member] / (n[member] - 1).clamp(min=1) * centred,
                                scores)
    else:  # dr_grpo, reinforce_pp_baseline
        advantage = centred
    advantages = advantage[:, None] * mask  # [B, T]
    if kind == "reinforce_pp_baseline":
        advantages = masked_whiten(advantages, mask)
    return advantages


@torch.no_grad()
def varied_groups(scores, group):
    """DAPO's dynamic-sampling filter (Yu et al. 2025, arXiv:2503.14476, the constraint
    0 < |{o_i correct}| < G of its objective): which rows to keep.

    scores: [B] float; group: [B] int64, rows with equal ids are the responses to one prompt.
    Returns [B] bool: True for rows whose group's scores are not all equal (exactly:
    max_g != min_g). DAPO keeps groups with 0 < accuracy < 1; for any score, a group of equal scores
    gets zero group-relative advantage, so it carries no learning signal. A group of one is never
    varied (max == min), for the same reason.
    """
    ids, member = torch.unique(group, return_inverse=True)  # member [B]: each row's group index
    # every group has at least one row, so include_self=False fills every slot; max and min are
    # exact in any order
    group_max = scores.new_zeros(len(ids)).scatter_reduce(0, member, scores, "amax",
                                                          include_self=False)  # [G]
    group_min = scores.new_zeros(len(ids)).scatter_reduce(0, member, scores, "amin",
                                                          include_self=False)  # [G]
    # keep group g iff max_g > min_g  (for 0/1 accuracy: 0 < mean_g < 1)
    return (group_max > group_min)[member]


LOG_RATIO_CLAMP = 20.0
"""|log-ratio| bound before exp in `kl_estimate`'s k3, `policy_loss`, `cispo_policy_loss` and
`gspo_policy_loss` (exp(20) ~ 4.9e8 is finite in float32, whose exp overflows past ~88). The clamp
has zero gradient beyond the bound."""
K3_CLAMP = 10.0
"""Bound on each token's k3 estimate, as verl's "low_var_kl" (core_algos.kl_penalty). k3 >= 0, so
only the upper bound acts: where log ref - log pi > 2.61 or < -11.0 (k3 = 10 there); the clamped
tokens get zero gradient."""


def kl_estimate(logp, ref_logp, kind):
    """Per-token KL(pi || ref) estimate from tokens sampled from pi (Schulman, "Approximating KL").

    logp, ref_logp: [B, T] log-probs of the sampled tokens. kind: "k1" | "k2" | "k3". Returns
    [B, T]. As a value on samples from pi, k1 and (unclamped) k3 are unbiased estimates of
    KL(pi || ref), k2 a biased one. As a loss term on-policy their expected gradients differ: k1's
    is zero, k2's is that of the reverse KL(pi || ref), k3's that of the forward KL(ref || pi)
    (the derivation: docs/algorithm.md#kl_estimate-as-a-loss-term).
    k3 is clamped as verl's "low_var_kl": the log-ratio to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]
    before exp (finite in float32, and no 0 * inf = NaN in the backward), the estimate to
    [-K3_CLAMP, K3_CLAMP]; zero gradient where either clamp is active.
    """
    if kind == "k1":
        # k1 = log pi - log ref  (unbiased, high variance, can be negative)
        return logp - ref_logp
    if kind == "k2":
        # k2 = 1/2 (log pi - log ref)^2
        return 0.5 * (logp - ref_logp) ** 2
    if kind == "k3":
        # [B, T] log(ref / pi)
        log_ratio = torch.clamp(ref_logp - logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        # k3 = exp(log ref - log pi) - (log ref - log pi) - 1  (unbiased, >= 0)
        k3 = torch.exp(log_ratio) - log_ratio - 1
        return torch.clamp(k3, -K3_CLAMP, K3_CLAMP)
    raise ValueError(f"kl_estimate: kind must be one of 'k1', 'k2', 'k3', got {kind!r}")


@torch.no_grad()
def distillation_advantages(logp, teacher_logp, mask, coef=1.0):
    """On-policy distillation's per-token advantage: the student samples, the teacher scores each
    sampled token, and the token's advantage is the negative per-token reverse-KL estimate (Agarwal
    et al. 2024, GKD, arXiv:2306.13649, with the student's own samples and the reverse KL; K. Lu /
    Thinking Machines Lab 2025, "On-Policy Distillation", which uses it with discount 0: a token is
    credited with its own log-ratio only).

    logp: [B, T] log pi_student(y_t) of the sampled tokens (the rollout's old log-probs);
    teacher_logp: [B, T] log pi_teacher(y_t) of the same tokens; mask: [B, T]. Returns [B, T] in
    logp's dtype, 0 where masked. Its expected policy gradient is -coef * grad KL(pi || teacher) at
    each position (docs/algorithm.md#distillation_advantages-the-policy-gradient).
    """
    real = mask > 0  # [B, T]
    # A_t = -coef * (log pi_student(y_t) - log pi_teacher(y_t)), minus k1 of KL(student || teacher)
    return torch.where(real, -coef * (logp - teacher_logp), 0.0)


# ---------------------------------------------------------------- loss aggregation

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class Aggregation:
    """How a loss's [B, T] per-token terms become the one number trained (`aggregate`): what
    travels together from the update to every loss.

    mode: one of AGG_MODES (the config's loss_agg). num_tokens / num_seqs: the counts to divide by,
    None = this call's own (real tokens / non-empty rows); the update passes the minibatch's GLOBAL
    counts (over micro-batches and ranks) so that the micro-batch losses add up to the minibatch's.
    norm_const: seq-mean-token-sum-norm's constant, None = the padded length mask.shape[-1].
    weights: None, or [B, T] detached per-token weights w_t >= 0 that multiply each token's term
    before the sum, L = aggregate(w_t L_t) (an off-policy correction's, `off_policy_weights`);
    weighted tokens still count in the denominators, and w_t = 1 everywhere gives the unweighted
    loss bit for bit. A loss function takes one `agg`: an Aggregation, or a mode name alone."""
    mode: str = "token-mean"
    num_tokens: object = None
    num_seqs: object = None
    norm_const: object = None
    weights: object = None


def as_aggregation(agg):
    """`agg` as an Aggregation: a mode name (a str) becomes Aggregation(mode) with this call's own
    counts."""
    return agg if isinstance(agg, Aggregation) else Aggregation(agg)


def aggregate(loss_mat, mask, agg):
    """Reduce a [B, T] per-token loss to a scalar; agg: an Aggregation (or its mode alone).
    With weights w, loss_it below is w_it loss_it.

    token-mean:              sum(loss * mask) / num_tokens
    seq-mean-token-mean:     sum_i [sum_t loss_it * mask_it / n_i] / num_seqs
    seq-mean-token-sum:      sum_i [sum_t loss_it * mask_it] / num_seqs
    seq-mean-token-sum-norm: sum_i [sum_t loss_it * mask_it] / (num_seqs * norm_const)
                             (Dr. GRPO, arXiv:2503.20783: the seq-mean of token sums over a
                             constant, by default the padded response length mask.shape[-1])
    n_i is the real-token count of row i. Fully masked rows are left out of the sums and of
    num_seqs. num_tokens / num_seqs default to the local counts (real tokens / non-empty rows); pass
    GLOBAL counts (over accumulation microbatches and ranks) so that the per-microbatch losses sum
    to the full-batch loss. (DDP averages gradients over ranks, so multiply by the world size
    there.) An empty batch gives 0 with zero gradients.
    """
    agg = as_aggregation(agg)
    mode, num_tokens, num_seqs, norm_const = agg.mode, agg.num_tokens, agg.num_seqs, agg.norm_const
    if mode not in AGG_MODES:
        raise ValueError(f"aggregate: mode must be one of {AGG_MODES}, got {mode!r}")
    if agg.weights is not None:
        # L_t = w_t L_t, w_t detached: a constant of the objective, like A_t
        loss_mat = loss_mat * agg.weights
    token_sum = (loss_mat * mask).sum(-1)  # [B]
    if mode == "token-mean":
        if num_tokens is None:
            num_tokens = mask.sum()
        return token_sum.sum() / _count(num_tokens, token_sum)
    tokens_per_seq = mask.sum(-1)  # [B]
    seq_mask = (tokens_per_seq > 0).to(token_sum.dtype)  # [B] 1 = row has a real token
    if num_seqs is None:
        num_seqs = seq_mask.sum()
    if mode == "seq-mean-token-mean":
        seq_losses = token_sum / tokens_per_seq.clamp(min=1)  # [B]
        return (seq_losses * seq_mask).sum() / _count(num_seqs, token_sum)
    seq_mean = token_sum.sum() / _count(num_seqs, token_sum)  # empty rows add 0 to the sum
    if mode == "seq-mean-token-sum":
        return seq_mean
    return seq_mean / (mask.shape[-1] if norm_const is None else norm_const)


def _count(count, like):
    """A token or sequence count as a tensor, at least 1 (an empty batch then gives 0 / 1 = 0)."""
    return torch.as_tensor(count, dtype=like.dtype, device=like.device).clamp(min=1)


# ---------------------------------------------------------------- losses

def policy_loss_function(kind):
    """The loss of policy_loss_kind `kind` (a key of POLICY_LOSSES): the one place a kind is chosen.
    Every path trains it: ppo_core.update.policy_objective calls it on the log-probs of the fused
    head (ppo_kernels' linear_logprob_loss) or of full logits alike.

    Each is called as fn(logp, old_logp, advantages, mask, agg=Aggregation(...), **settings), with
    settings = loss_settings(kind, cfg), and returns (loss: 0-dim, stats: dict of
    detached 0-dim tensors). A new loss: its function below and its entry in POLICY_LOSSES
    (docs/adding-a-loss.md).
    """
    if kind not in POLICY_LOSSES:
        raise ValueError(
            f"policy_loss_function: kind must be one of {POLICY_LOSS_KINDS}, got {kind!r}")
    # looked up in this module by its name at each call, so that a function replaced at run time (a
    # notebook's `algo.policy_loss = my_loss`, a test's monkeypatch) is the one trained, as an edit
    # of its text would be
    return globals()[POLICY_LOSSES[kind][0].__name__]


def loss_settings(kind, cfg):
    """The settings policy_loss_kind `kind` takes, read by name from cfg (the PPOConfig fields its
    POLICY_LOSSES entry names): a dict of keyword arguments for its function."""
    return {name: getattr(cfg, name) for name in POLICY_LOSSES[kind][1]}


def loss_coupling(kind):
    """What the gradient of loss `kind` at one token depends on besides that token's log-prob:
    "token" nothing (a token-level loss: L = sum_t w_t l(logp_t), the weights w_t from the mask
    alone), "row" the other log-probs of its row (a sequence ratio: GSPO, GMPO), "batch" every row's
    (a batch statistic chooses its tokens: Clip-Cov, KL-Cov). The fused head
    (ppo_kernels.linear_logprob_loss) then hands the loss any tile of tokens, whole rows, or a whole
    micro-batch at once. A loss declared "token" that is not would train on wrong gradients: its
    test against the reference head in its own test file catches that."""
    return POLICY_LOSSES[kind][2]


def loss_couples_rows(kind):
    """True when loss `kind`'s gradient at a token depends on other rows' log-probs (loss_coupling
    "batch")."""
    return loss_coupling(kind) == "batch"


def policy_loss(logp, old_logp, advantages, mask, clip_low=0.2, clip_high=0.2, dual_clip=None,
                agg="token-mean"):
    """PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347), optional dual clip, optional
    per-token weights.

    logp: [B, T] log-probs under the current policy (with grad); old_logp: [B, T] at sampling time;
    advantages: [B, T]; mask: [B, T]. clip_low / clip_high: ratio clipped to
    [1 - clip_low, 1 + clip_high].
    dual_clip: None or 0 (none), or c > 1 capping the loss of A < 0 tokens at c * |A| (Ye et al.
    2020, arXiv:1912.09729).
    agg: an `Aggregation` (the mode, the global counts, and per-token weights w_t, L_t =
    w_t L^CLIP_t: an off-policy correction's; `policy_loss_off_policy` is this with them), or a
    mode name alone.
    Returns (loss: 0-dim, stats: dict of detached 0-dim tensors, masked token means over local
    tokens):
      clipfrac       fraction of real tokens where the clipped branch is strictly larger
                     (pg_loss2 > pg_loss1)
      dual_clipfrac  (only with dual_clip) fraction of real tokens where the dual cap is strictly
                     active
      approx_kl      k3 estimate of KL(old || new): (r - 1) - log r, r = pi_new / pi_old
      ratio_mean     mean ratio; ratio_max_dev: max |ratio - 1| over real tokens (0 if none)
    """
    dual_clip = dual_clip or None  # 0 (the config's "off") and None alike
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(
            f"policy_loss: dual_clip must be > 1, or 0 / None for none, got {dual_clip}")
    # the clamp keeps exp finite when the policies have drifted far apart (zero gradient there)
    log_ratio = torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B, T]
    ratio = torch.exp(log_ratio)
    # L^CLIP = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), a loss to minimise
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg_losses = torch.maximum(pg_loss1, pg_loss2)
    stats = {"clipfrac": masked_mean((pg_loss2 > pg_loss1).to(ratio.dtype), mask)}
    if dual_clip is not None:
        # for A < 0: L = min(L^CLIP, -A c) = min(L^CLIP, c |A|)
        pg_loss3 = -advantages * dual_clip
        negative = advantages < 0
        stats["dual_clipfrac"] = masked_mean((negative & (pg_losses > pg_loss3)).to(ratio.dtype),
                                             mask)
        pg_losses = torch.where(negative, torch.minimum(pg_losses, pg_loss3), pg_losses)
    # L = aggregate(w_t L^CLIP_t): agg's weights (an off-policy correction's, detached) times each
    # token's term
    loss = aggregate(pg_losses, mask, agg)
    stats.update(_ratio_stats(ratio, log_ratio, mask))
    return loss, {k: v.detach() for k, v in stats.items()}


def cispo_policy_loss(logp, old_logp, advantages, mask, clip_low=0.2, clip_high=0.2, dual_clip=None,
                      agg="token-mean"):
    """CISPO: REINFORCE with a clipped, stop-gradient importance weight (MiniMax-M1, MiniMax 2025,
    arXiv:2506.13585):

      L_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A_t log pi_theta(y_t)

    Where PPO's clip zeroes the gradient of a token outside the trust region, CISPO clips the weight
    and keeps every token's gradient, bounded by the clipped weight:
    d L_t / d logp_t = -clip(r_t, 1 - eps_low, 1 + eps_high) A_t (why:
    docs/algorithm.md#cispo_policy_loss).
    clip_low / clip_high: the weight clipped to [1 - clip_low, 1 + clip_high], the same config keys
    as PPO's clip. clip_low >= 1 sets no lower bound, as the paper does (r_t > 0, so a bound
    1 - clip_low <= 0 never binds); the config's default 0.2 keeps PPO's symmetric band.
    dual_clip: must be None (the weight is already bounded; the config refuses dual_clip with
    CISPO).
    agg and the returned stats as in `policy_loss`; clipfrac here is the
    fraction of real tokens whose weight was clipped (r_t strictly outside the band): their gradient
    is not zeroed, only bounded.
    """
    if dual_clip is not None:
        raise ValueError(
            f"cispo_policy_loss: dual_clip does not apply (the weight is clipped already), "
            f"got {dual_clip}")
    # [B, T], as in policy_loss
    log_ratio = torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    is_weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high).detach()  # [B, T] sg(clip(r_t))
    # L_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A_t log pi_theta(y_t)
    pg_losses = -advantages * is_weight * logp
    clipped = (ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)
    stats = {"clipfrac": masked_mean(clipped.to(ratio.dtype), mask)}
    # L = aggregate(w_t L_t): agg's weights (an off-policy correction's) times each token's term
    loss = aggregate(pg_losses, mask, agg)
    stats.update(_ratio_stats(ratio, log_ratio, mask))
    return loss, {k: v.detach() for k, v in stats.items()}


@torch.no_grad()
def _ratio_stats(ratio, log_ratio, mask):
    """How far the policy moved from pi_old over real tokens, for the token-level losses: 0-dim
    tensors."""
    # KL(old || new) ~ E_old[(r - 1) - log r]  (k3, >= 0 per token)
    return {"approx_kl": masked_mean((ratio - 1) - log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
            "ratio_max_dev": torch.where(mask > 0, (ratio - 1).abs(), 0.0).max()}


def gspo_policy_loss(logp, old_logp, advantages, mask, clip_low=3e-4, clip_high=4e-4,
                     agg="token-mean", dual_clip=None):
    """GSPO: the clipped surrogate on a sequence-level ratio (Zheng et al. 2025, "Group Sequence
    Policy Optimization", arXiv:2507.18071, eq. 5), as a loss to minimise.

    logp: [B, T] log-probs under the current policy (with grad); old_logp: [B, T] at sampling time;
    advantages: [B, T], one value per response (A_i is taken as the row's masked mean);
    mask: [B, T].
    clip_low / clip_high: s_i clipped to [1 - clip_low, 1 + clip_high]; the defaults are the paper's
    3e-4 / 4e-4 (a sequence ratio is a per-token geometric mean, so its range is far narrower than
    PPO's token ratio).
    agg: an `Aggregation` (or a mode name); only its num_seqs is read, the count to divide by
    (None: the local number of non-empty rows; the update passes the GLOBAL count, as for
    `aggregate`). GSPO always reduces as a mean over sequences (the paper's 1/G sum_i), whatever the
    mode. dual_clip and agg.weights must be None: a sequence's one ratio has no token losses to cap
    or weight (the config refuses both with GSPO).
    The gradient is the paper's: d l_i / d logp_t = -A_i s_i / |y_i| on each real token of an
    unclipped row, 0 on a clipped one (its GSPO-token form, s_it = sg[s_i] pi(y_t) / sg[pi(y_t)]
    averaged over each row's tokens, has the same value and gradient when A is constant over the
    row).
    Fully masked rows are left out. Returns (loss: 0-dim, stats: dict of detached 0-dim tensors,
    over local rows):
      clipfrac       fraction of non-empty rows where the clipped branch is strictly larger
      approx_kl      token-level k3 estimate of KL(old || new), (r - 1) - log r, masked mean as in
                     `policy_loss`
      ratio_mean     mean of s_i over non-empty rows; ratio_max_dev: max |s_i - 1| over them (0 if
                     none)
    """
    num_seqs = as_aggregation(agg).num_seqs
    if dual_clip is not None or as_aggregation(agg).weights is not None:
        raise ValueError(
            "gspo_policy_loss: dual_clip and weights do not apply to a sequence-level ratio")
    tokens_per_seq = mask.sum(-1)  # [B] |y_i|
    seq_mask = (tokens_per_seq > 0).to(logp.dtype)  # [B] 1 = row has a real token
    token_log_ratio = logp - old_logp  # [B, T]
    # log s_i = 1/|y_i| sum_t log(pi(y_it) / pi_old(y_it)), clamped as in policy_loss (zero gradient
    # beyond the bound)
    seq_log_ratio = torch.clamp(masked_mean(token_log_ratio, mask, dim=-1), -LOG_RATIO_CLAMP,
                                LOG_RATIO_CLAMP)  # [B]
    seq_ratio = torch.exp(seq_log_ratio)  # [B] s_i
    seq_advantages = masked_mean(advantages, mask, dim=-1)  # [B] A_i
    # l_i = max(-A_i s_i, -A_i clip(s_i, 1 - eps_low, 1 + eps_high)), a loss to minimise
    pg_loss1 = -seq_advantages * seq_ratio
    pg_loss2 = -seq_advantages * torch.clamp(seq_ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg_losses = torch.maximum(pg_loss1, pg_loss2)  # [B]
    if num_seqs is None:
        num_seqs = seq_mask.sum()
    # L^GSPO = 1/G sum_i l_i  over the non-empty rows
    loss = (pg_losses * seq_mask).sum() / _count(num_seqs, pg_losses)
    with torch.no_grad():
        local_seqs = seq_mask.sum().clamp(min=1)
        token_log_ratio = torch.clamp(token_log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        stats = {
            "clipfrac": ((pg_loss2 > pg_loss1).to(logp.dtype) * seq_mask).sum() / local_seqs,
            # KL(old || new) ~ E_old[(r - 1) - log r] per token  (k3, >= 0 per token)
            "approx_kl": masked_mean(torch.exp(token_log_ratio) - 1 - token_log_ratio, mask),
            "ratio_mean": (seq_ratio * seq_mask).sum() / local_seqs,
            "ratio_max_dev": torch.where(seq_mask > 0, (seq_ratio - 1).abs(), 0.0).max(),
        }
    return loss, {k: v.detach() for k, v in stats.items()}


def sapo_policy_loss(logp, old_logp, advantages, mask, sapo_tau_pos=1.0, sapo_tau_neg=1.05,
                     agg="token-mean"):
    """SAPO: a smooth, temperature-controlled gate in place of PPO's hard clip (Qwen team 2025,
    "Soft Adaptive Policy Optimization", arXiv:2511.20347), as a loss to minimise:

      L_t = -f_t(r_t) A_t,   f_t(r) = sigmoid(tau_t (r - 1)) 4 / tau_t,
      tau_t = tau_pos if A_t > 0 else tau_neg

    At r_t = 1 the gradient is the unclipped policy gradient -A_t grad log pi; elsewhere it is that
    times the gate weight 4 sigmoid(x_t)(1 - sigmoid(x_t)) in (0, 1], x_t = tau_t (r_t - 1), which
    decays smoothly instead of dropping to 0 at a clip boundary. A larger tau_neg damps
    negative-advantage tokens faster. (The derivation, the paper's reasons and the peers' forms:
    docs/algorithm.md#sapo_policy_loss.)

    logp, old_logp, advantages, mask: [B, T] as in `policy_loss`. sapo_tau_pos, sapo_tau_neg: tau
    for A > 0 and A <= 0, both > 0. agg: as in `policy_loss` (an `Aggregation` with its weights);
    the paper averages per sequence (seq-mean-token-mean), here loss_agg chooses, as for every
    token-level loss. The log-ratio is clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]
    before exp, as in `policy_loss`.
    Returns (loss: 0-dim, stats: dict of detached 0-dim tensors, masked token means over local
    tokens): approx_kl, ratio_mean, ratio_max_dev as in `policy_loss` (no clipfrac: nothing is
    clipped), and
      sapo_gate_weight  mean gate weight: the gradient's scale against the unclipped policy
                        gradient's (1 on-policy)
    """
    if sapo_tau_pos <= 0 or sapo_tau_neg <= 0:
        raise ValueError(
            f"sapo_policy_loss: sapo_tau_pos and sapo_tau_neg must be > 0, got {sapo_tau_pos}, "
            f"{sapo_tau_neg}")
    # [B, T], as in policy_loss
    log_ratio = torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    # tau_t = tau_pos if A_t > 0 else tau_neg
    tau = torch.where(advantages > 0, torch.full_like(ratio, sapo_tau_pos),
                      torch.full_like(ratio, sapo_tau_neg))
    gate_input = tau * (ratio - 1)  # [B, T] x_t = tau_t (r_t - 1)
    # f_t(r_t) = sigmoid(tau_t (r_t - 1)) * 4 / tau_t
    gate = torch.sigmoid(gate_input) * (4 / tau)
    # L_t = -f_t(r_t) A_t
    pg_losses = -gate * advantages
    # L = aggregate(w_t L_t): agg's weights (an off-policy correction's) times each token's term
    loss = aggregate(pg_losses, mask, agg)
    with torch.no_grad():
        sigmoid = torch.sigmoid(gate_input)
        # gate weight = d f_t / d r at r_t = 4 sigmoid(x_t) (1 - sigmoid(x_t))
        stats = {"sapo_gate_weight": masked_mean(4 * sigmoid * (1 - sigmoid), mask)}
    stats.update(_ratio_stats(ratio, log_ratio, mask))
    return loss, {k: v.detach() for k, v in stats.items()}


def gmpo_policy_loss(logp, old_logp, advantages, mask, gmpo_clip_low=0.4, gmpo_clip_high=0.4,
                     agg="token-mean"):
    """GMPO: the geometric mean of the token ratios of a response, each clipped in log space (Zhao
    et al. 2025, "Geometric-Mean Policy Optimization", arXiv:2507.20673), as a loss to minimise. Per
    non-empty row i, with A_i its advantage and |y_i| its real tokens:

      l_i = -A_i exp(1/|y_i| sum_t c_it),
      c_it = min(log r_it, clip(log r_it, -eps_low, eps_high))   if A_i >= 0
             max(log r_it, clip(log r_it, -eps_low, eps_high))   if A_i < 0
      L = 1/G sum_i l_i

    Each token takes the pessimistic side of its clip: a token past the bound on the side that would
    help the objective is held at the bound and gets no gradient. (The paper's form of the same
    loss, the sources of the sign rule, and why the clip is wider than PPO's:
    docs/algorithm.md#gmpo_policy_loss.)

    logp, old_logp: [B, T]; advantages: [B, T], one value per response (A_i is the row's masked
    mean; the paper's advantages are group-relative, as adv_estimator=grpo gives); mask: [B, T].
    gmpo_clip_low, gmpo_clip_high: eps_low, eps_high >= 0, the log-ratio's clip range (the paper's
    0.4 each). The row's mean log-ratio is clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] before
    exp (zero gradient beyond it). agg: as in `gspo_policy_loss` (only num_seqs read); GMPO always
    averages over sequences, whatever the mode. agg.weights must be None: a response's one ratio
    has no token losses to weight (the config refuses an off-policy correction with GMPO).
    Fully masked rows are left out. Returns (loss: 0-dim, stats: dict of detached 0-dim tensors):
      clipfrac          fraction of real tokens held at their clip bound (c_it != log r_it: zero
                        gradient)
      approx_kl, ratio_mean, ratio_max_dev: token-level, as in `policy_loss` (the clip is per token)
      gmpo_ratio_mean   mean over non-empty rows of exp(1/|y_i| sum_t c_it), the clipped
                        geometric-mean ratio
    """
    num_seqs = as_aggregation(agg).num_seqs
    if as_aggregation(agg).weights is not None:
        raise ValueError(
            "gmpo_policy_loss: weights do not apply to a sequence's geometric-mean ratio")
    if gmpo_clip_low < 0 or gmpo_clip_high < 0:
        raise ValueError(
            f"gmpo_policy_loss: gmpo_clip_low and gmpo_clip_high must be >= 0, got "
            f"{gmpo_clip_low}, {gmpo_clip_high}")
    real = mask > 0  # [B, T] bool
    seq_mask = real.any(-1).to(logp.dtype)  # [B] 1 = row has a real token
    token_log_ratio = torch.where(real, logp - old_logp, 0.0)  # [B, T] log r_it, 0 where masked
    seq_advantages = masked_mean(advantages, mask, dim=-1)  # [B] A_i
    clipped_log_ratio = torch.clamp(token_log_ratio, -gmpo_clip_low, gmpo_clip_high)  # [B, T]
    # c_it = min(log r, clip(log r)) for A_i >= 0, max(log r, clip(log r)) for A_i < 0: the
    # pessimistic side
    positive = (seq_advantages >= 0)[:, None]  # [B, 1]
    # [B, T] c_it
    pessimistic_log_ratio = torch.where(positive, torch.minimum(token_log_ratio, clipped_log_ratio),
                                        torch.maximum(token_log_ratio, clipped_log_ratio))
    # log gbar_i = 1/|y_i| sum_t c_it, clamped as in policy_loss
    seq_log_ratio = torch.clamp(masked_mean(pessimistic_log_ratio, mask, dim=-1), -LOG_RATIO_CLAMP,
                                LOG_RATIO_CLAMP)
    seq_ratio = torch.exp(seq_log_ratio)  # [B] gbar_i, the clipped geometric-mean ratio
    # l_i = -A_i gbar_i
    pg_losses = -seq_advantages * seq_ratio  # [B]
    if num_seqs is None:
        num_seqs = seq_mask.sum()
    # L^GMPO = 1/G sum_i l_i  over the non-empty rows
    loss = (pg_losses * seq_mask).sum() / _count(num_seqs, pg_losses)
    with torch.no_grad():
        held = real & torch.where(positive, token_log_ratio > gmpo_clip_high,
                                  token_log_ratio < -gmpo_clip_low)
        log_ratio = torch.clamp(token_log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        stats = {"clipfrac": masked_mean(held.to(logp.dtype), mask),
                 "gmpo_ratio_mean": (seq_ratio * seq_mask).sum() / seq_mask.sum().clamp(min=1),
                 **_ratio_stats(torch.exp(log_ratio), log_ratio, mask)}
    return loss, {k: v.detach() for k, v in stats.items()}


CLIP_COV_SEED = 0
"""Seed of the torch.Generator that clip_cov_policy_loss creates in each call to draw its tokens:
the draw is a fixed function of its inputs (a resumed run is bit-identical, on any device), and the
global RNG is not consumed."""


@torch.no_grad()
def _centred_covariance(logp, advantages, mask):
    """Cov_t = (A_t - mean A)(log pi_t - mean log pi), the means over the real tokens of the batch:
    each token's term of the covariance that drives the entropy change (Cui et al. 2025,
    arXiv:2505.22617). [B, T], detached."""
    # Cov_t = (A_t - 1/N sum_s A_s) (log pi_theta(y_t) - 1/N sum_s log pi_theta(y_s))
    return (advantages - masked_mean(advantages, mask)) * (logp - masked_mean(logp, mask))


def clip_cov_policy_loss(logp, old_logp, advantages, mask, clip_low=0.2, clip_high=0.2,
                         clip_cov_ratio=2e-4, clip_cov_lb=1.0, clip_cov_ub=5.0, agg="token-mean"):
    """Clip-Cov: PPO's clipped surrogate with a few high-covariance tokens taken out of the gradient
    (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
    Models", arXiv:2505.22617).

    Entropy falls where a token's log-prob and its advantage move together: tokens with a large
    centred covariance Cov_t (see `_centred_covariance`, over this call's real tokens) drive the
    collapse. Clip-Cov draws, uniformly at random, n = max(floor(clip_cov_ratio N), 1) of the
    candidate tokens, N the real tokens,

      I_clip ~ Uniform({t : clip_cov_lb < Cov_t < clip_cov_ub, t not clipped by PPO}, n)
      L_t = 0 for t in I_clip,   max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high)) otherwise

    (all candidates when there are fewer than n). As in the authors' code: the bounds are strict,
    tokens PPO's clip already holds are not candidates, a drawn token's term is 0 in value and
    gradient, and the other tokens keep PPO's clipped surrogate with clip_low / clip_high (the
    paper's equation, the authors' code and verl's port compared:
    docs/algorithm.md#clip_cov_policy_loss). The draw: a torch.Generator seeded with CLIP_COV_SEED
    in each call permutes the candidates (row-major order) and takes the first n; it is
    reproducible (a resumed run is bit-identical) and consumes no global random state. Two calls
    with equally many candidates draw the same positions of their candidate lists.

    The selection reads every row of the call (a batch statistic), so its POLICY_LOSSES entry
    couples rows: the fused head hands it a whole micro-batch, and N and the means are the
    micro-batch's. clip_cov_ratio in (0, 1]; clip_cov_lb < clip_cov_ub (the paper's 2e-4, 1, 5).
    agg as in `policy_loss` (dual_clip is not taken). One host read per call (N and the
    candidates).
    Returns (loss: 0-dim, stats: dict of detached 0-dim tensors, masked token means over local
    tokens):
      clipfrac       fraction of real tokens where PPO's clipped branch is strictly larger, as in
                     `policy_loss`
      clipcov_frac   fraction of real tokens drawn into I_clip
      approx_kl, ratio_mean, ratio_max_dev as in `policy_loss`
    """
    if not 0 < clip_cov_ratio <= 1:
        raise ValueError(
            f"clip_cov_policy_loss: clip_cov_ratio must be in (0, 1], got {clip_cov_ratio}")
    if not clip_cov_lb < clip_cov_ub:
        raise ValueError(
            f"clip_cov_policy_loss: need clip_cov_lb < clip_cov_ub, got "
            f"{clip_cov_lb}, {clip_cov_ub}")
    real = mask > 0  # [B, T] bool
    # [B, T], as in policy_loss
    log_ratio = torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    # L^CLIP = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), as in policy_loss
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped = pg_loss2 > pg_loss1  # [B, T] held by PPO's clip
    with torch.no_grad():
        covariance = _centred_covariance(logp.detach(), advantages, mask)  # [B, T] Cov_t
        # [B, T] real, not held by PPO's clip, lb < Cov_t < ub
        candidates = real & ~clipped & (covariance > clip_cov_lb) & (covariance < clip_cov_ub)
        # n = max(floor(r N), 1), as the authors' code
        n_clip = max(int(clip_cov_ratio * int(real.sum())), 1)
        candidate_idx = candidates.flatten().nonzero().squeeze(1)  # [C] flat positions, row-major
        generator = torch.Generator().manual_seed(CLIP_COV_SEED)
        drawn = torch.randperm(len(candidate_idx),
                               generator=generator)[:n_clip].to(candidate_idx.device)
        in_clip = torch.zeros_like(candidates).flatten().index_fill(
            0, candidate_idx[drawn], True).view_as(real)
    # L_t = 0 on I_clip (no value, no gradient), L^CLIP_t elsewhere
    pg_losses = torch.where(in_clip, 0.0, torch.maximum(pg_loss1, pg_loss2))
    # L = aggregate(w_t L_t): agg's weights (an off-policy correction's) times each token's term
    loss = aggregate(pg_losses, mask, agg)
    stats = {"clipfrac": masked_mean(clipped.to(ratio.dtype), mask),
             "clipcov_frac": masked_mean(in_clip.to(ratio.dtype), mask),
             **_ratio_stats(ratio, log_ratio, mask)}
    return loss, {k: v.detach() for k, v in stats.items()}


def kl_cov_policy_loss(logp, old_logp, advantages, mask, kl_cov_ratio=2e-3, kl_cov_coef=1.0,
                       agg="token-mean"):
    """KL-Cov: the unclipped surrogate with a KL penalty on the highest-covariance tokens (Cui et
    al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models",
    arXiv:2505.22617), as a loss:

      I_KL = the k = max(floor(kl_cov_ratio N), 1) real tokens of largest Cov_t
             (see `_centred_covariance`)
      L_t = -A_t r_t + beta |log r_t|   for t in I_KL,     -A_t r_t   otherwise

    N the real tokens of the call, beta = kl_cov_coef. No PPO clip anywhere: the penalty restrains
    exactly the tokens whose updates drive entropy down. As in the authors' code, |log r_t|
    estimates the KL, the ranking is over all real tokens, and at least one token is penalised. Ties
    in Cov_t are broken by position (a stable sort, row-major), so the choice is deterministic. The
    log-ratio is clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] before exp, as in `policy_loss`.
    (The sources, the paper's settings against verl's: docs/algorithm.md#kl_cov_policy_loss.)

    The ranking reads every row of the call, so its POLICY_LOSSES entry couples rows (a whole
    micro-batch at once; N and the means are the micro-batch's). kl_cov_ratio in (0, 1];
    kl_cov_coef >= 0 (the defaults are the paper's 7B setting). agg as in `policy_loss` (dual_clip
    is not taken). One host read per call (N).
    Returns (loss: 0-dim, stats: dict of detached 0-dim tensors, masked token means over local
    tokens): approx_kl, ratio_mean, ratio_max_dev as in `policy_loss` (no clipfrac: nothing is
    clipped), and
      klcov_frac  fraction of real tokens in I_KL
    """
    if not 0 < kl_cov_ratio <= 1:
        raise ValueError(
            f"kl_cov_policy_loss: kl_cov_ratio must be in (0, 1], got {kl_cov_ratio}")
    if kl_cov_coef < 0:
        raise ValueError(f"kl_cov_policy_loss: kl_cov_coef must be >= 0, got {kl_cov_coef}")
    real = mask > 0  # [B, T] bool
    # [B, T], as in policy_loss
    log_ratio = torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    with torch.no_grad():
        covariance = _centred_covariance(logp.detach(), advantages, mask)  # [B, T] Cov_t
        real_idx = real.flatten().nonzero().squeeze(1)  # [N] flat positions, row-major
        # k = max(floor(k N), 1)
        n_kl = max(int(kl_cov_ratio * len(real_idx)), 1) if len(real_idx) else 0
        # the k largest Cov_t, ties to the earlier position
        ranked = torch.sort(covariance.flatten()[real_idx], descending=True,
                            stable=True).indices[:n_kl]
        in_kl = torch.zeros_like(real).flatten().index_fill(0, real_idx[ranked], True).view_as(real)
    # L_t = -A_t r_t + beta |log r_t| 1[t in I_KL]
    pg_losses = -advantages * ratio + torch.where(in_kl, kl_cov_coef * log_ratio.abs(), 0.0)
    # L = aggregate(w_t L_t): agg's weights (an off-policy correction's) times each token's term
    loss = aggregate(pg_losses, mask, agg)
    stats = {"klcov_frac": masked_mean(in_kl.to(ratio.dtype), mask),
             **_ratio_stats(ratio, log_ratio, mask)}
    return loss, {k: v.detach() for k, v in stats.items()}


def kl_penalty_policy_loss(logp, old_logp, advantages, mask, kl_penalty_beta=1.0,
                           agg="token-mean"):
    """PPO's KL-penalised surrogate, the alternative to clipping in the PPO paper (Schulman et al.
    2017, "Proximal Policy Optimization Algorithms", arXiv:1707.06347, eq. 8, with a fixed
    coefficient), as a loss to minimise:

      L_t = -r_t A_t + beta KL_t,   KL_t = r_t - 1 - log r_t

    KL_t estimates KL[pi_old(.|s_t), pi_theta(.|s_t)] from the sampled token alone (y_t ~ pi_old):
    the "k3" estimator of KL(pi_old || pi_theta) (Schulman 2020, "Approximating KL Divergence"),
    unbiased and >= 0, 0 at r_t = 1, so on policy the gradient is the unclipped policy gradient
    -A_t grad log pi. beta = kl_penalty_beta, fixed (the paper's settings and its adaptive beta,
    which is not here: docs/algorithm.md#kl_penalty_policy_loss). No clip: the penalty alone keeps
    the ratio near 1. The log-ratio is clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] before exp,
    as in `policy_loss`.

    logp, old_logp, advantages, mask: [B, T] as in `policy_loss`. kl_penalty_beta >= 0. agg: as in
    `policy_loss` (an `Aggregation` with its weights, or a mode name).
    Returns (loss: 0-dim, stats: dict of detached 0-dim tensors, masked token means over local
    tokens): approx_kl, ratio_mean, ratio_max_dev as in `policy_loss` (no clipfrac: nothing is
    clipped), and
      kl_penalty  mean KL_t, the penalised estimate (before beta)
    """
    if kl_penalty_beta < 0:
        raise ValueError(
            f"kl_penalty_policy_loss: kl_penalty_beta must be >= 0, got {kl_penalty_beta}")
    # [B, T], as in policy_loss
    log_ratio = torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    # KL_t = r_t - 1 - log r_t
    kl = ratio - 1 - log_ratio
    # L_t = -r_t A_t + beta KL_t
    pg_losses = -ratio * advantages + kl_penalty_beta * kl
    # L = aggregate(w_t L_t): agg's weights (an off-policy correction's) times each token's term
    loss = aggregate(pg_losses, mask, agg)
    stats = {"kl_penalty": masked_mean(kl, mask), **_ratio_stats(ratio, log_ratio, mask)}
    return loss, {k: v.detach() for k, v in stats.items()}


POLICY_LOSSES = {
    # kind: (its function, the config fields it takes (handed to it by name), what a token's
    #        gradient depends on besides its own log-prob: "token" nothing, "row" its row's,
    #        "batch" every row's; see loss_coupling)
    "ppo": (policy_loss, ("clip_low", "clip_high", "dual_clip"), "token"),
    "cispo": (cispo_policy_loss, ("clip_low", "clip_high"), "token"),
    "gspo": (gspo_policy_loss, ("clip_low", "clip_high"), "row"),
    "sapo": (sapo_policy_loss, ("sapo_tau_pos", "sapo_tau_neg"), "token"),
    "gmpo": (gmpo_policy_loss, ("gmpo_clip_low", "gmpo_clip_high"), "row"),
    "clip_cov": (clip_cov_policy_loss, ("clip_low", "clip_high", "clip_cov_ratio", "clip_cov_lb",
                                        "clip_cov_ub"), "batch"),
    "kl_cov": (kl_cov_policy_loss, ("kl_cov_ratio", "kl_cov_coef"), "batch"),
    "kl_penalty": (kl_penalty_policy_loss, ("kl_penalty_beta",), "token"),
}
"""Every policy loss by its policy_loss_kind. ppo_core.config refuses any other kind, and refuses a
setting of one loss (a field some entry names) set away from its default while another loss, which
does not name it, is chosen."""
POLICY_LOSS_KINDS = tuple(POLICY_LOSSES)


def value_loss(values, old_values, returns, mask, clip=0.2, agg="token-mean"):
    """Clipped value loss (as in OpenAI baselines ppo2 / TRL).

    values: [B, T] current predictions (with grad); old_values: [B, T] at sampling time; returns:
    [B, T] targets; mask: [B, T]. clip: max move of values away from old_values, None = plain
    squared error. agg: an `Aggregation` (or a mode name), as for the policy losses.
    Returns (loss: 0-dim, stats): clipfrac (fraction of real tokens where the clipped branch is
    strictly larger), values_mean (masked mean of values); both detached 0-dim tensors.
    """
    vf_losses1 = (values - returns) ** 2
    if clip is None:
        vf_losses = vf_losses1
        clipfrac = torch.zeros((), dtype=values.dtype, device=values.device)
    else:
        # V_clip = V_old + clip(V - V_old, -eps, eps)
        v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        vf_losses2 = (v_clipped - returns) ** 2
        vf_losses = torch.maximum(vf_losses1, vf_losses2)
        # Count a token only where the clamp is active: inside the clip range
        # V_clip = V_old + (V - V_old) is V up to one rounding, and `vf_losses2 > vf_losses1` alone
        # would count a rounding-dependent share of unclipped tokens (verl and TRL count those too).
        clipped = ((values - old_values).abs() > clip) & (vf_losses2 > vf_losses1)
        clipfrac = masked_mean(clipped.to(values.dtype), mask)
    # L^V = 1/2 max((V - R)^2, (V_clip - R)^2)
    loss_mat = 0.5 * vf_losses
    loss = aggregate(loss_mat, mask, agg)
    stats = {"clipfrac": clipfrac.detach(), "values_mean": masked_mean(values, mask).detach()}
    return loss, stats


def explained_variance(values, returns, mask):
    """1 - Var[returns - values] / Var[returns] over mask == 1, as a Python float (for logging).

    1 = perfect value function, 0 = no better than a constant, < 0 = worse. Returns 0.0 (not NaN)
    when Var[returns] == 0 or there are fewer than 2 real tokens.
    """
    with torch.no_grad():
        var_returns = masked_var(returns, mask).item()
        if var_returns == 0.0:
            return 0.0
        return 1.0 - masked_var(returns - values, mask).item() / var_returns


# ---------------------------------------------------------------- off-policy corrections
#
# Rollouts sampled by stale weights (a rollout worker one update behind) or by another engine's
# numerics come from a behaviour policy mu that is not the policy the update starts from. Three
# log-probs per response token y_t, [B, T]:
#   behav_logp  log mu(y_t), recorded by the sampler
#   old_logp    log pi_old(y_t), recomputed by the trainer with the weights the update starts
#               from: the proximal policy
#   logp        log pi_theta(y_t), the policy being optimised (with grad)
# The PPO ratio stays pi_theta / pi_old, so the trust region is centred on pi_old; the correction
# is a detached per-token weight built from k_t = pi_old(y_t) / mu(y_t). With mu == pi_old every
# k_t is exactly 1.

OFF_POLICY_CORRECTIONS = ("tis", "decoupled", "icepop")
MASK_LEVELS = ("token", "sequence")


def _behaviour_gap_stats(old_logp, behav_logp, ratio, mask):
    """The behaviour/old mismatch over real tokens, as 0-dim tensors: mean and max of
    k_t = pi_old / mu (ratio, [B, T]) and of |log pi_old - log mu|; a max is 0 when there is no
    real token. Masked positions may hold inf or NaN."""
    real = mask > 0  # [B, T] bool
    gap = torch.where(real, (old_logp - behav_logp).abs(), 0.0)  # [B, T] |log pi_old - log mu|
    ratio = torch.where(real, ratio, 0.0)  # [B, T]
    return {"behav_ratio_mean": masked_mean(ratio, mask), "behav_ratio_max": ratio.max(),
            "behav_gap_mean": masked_mean(gap, mask), "behav_gap_max": gap.max()}


@torch.no_grad()
def truncated_importance_weights(old_logp, behav_logp, mask, cap):
    """Truncated importance sampling (TIS) weights w_t = min(pi_old(y_t) / mu(y_t), C), detached.

    Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training" (TIS:
    the PPO loss of each token times min(pi_trainer_old / pi_sampler, C)); the same truncation as
    IMPALA's V-trace weights rho_t = min(rho_bar, pi / mu) (Espeholt et al. 2018,
    arXiv:1802.01561). Truncation bounds the weight's variance at the price of a bias on tokens
    that mu under-samples by more than a factor C.

    old_logp: [B, T] log pi_old (recomputed by the trainer); behav_logp: [B, T] log mu (recorded by
    the sampler); mask: [B, T]. cap: C >= 1 (a cap below 1 would down-weight on-policy tokens).
    The log-ratio is clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] before exp, as in
    `policy_loss`.
    Returns (weights [B, T], 0 on masked tokens; stats: dict of 0-dim tensors over real tokens):
      truncated_frac    fraction of real tokens with k_t > C strictly (at k_t == C the min changes
                        nothing)
      behav_ratio_mean  mean of k_t = pi_old / mu;  behav_ratio_max: its max (0 if there is no
                        real token)
      behav_gap_mean    mean of |log pi_old - log mu|;  behav_gap_max: its max (0 if there is no
                        real token)
    """
    if cap is None or cap < 1:
        raise ValueError(f"truncated_importance_weights: cap must be a number >= 1, got {cap}")
    real = mask > 0  # [B, T] bool
    # [B, T] log k_t
    log_ratio = torch.clamp(old_logp - behav_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)  # [B, T] k_t = pi_old / mu
    # w_t = min(pi_old(y_t) / mu(y_t), C)
    weights = torch.where(real, torch.clamp(ratio, max=cap), 0.0)
    stats = {"truncated_frac": masked_mean((real & (ratio > cap)).to(ratio.dtype), mask),
             **_behaviour_gap_stats(old_logp, behav_logp, ratio, mask)}
    return weights, stats


@torch.no_grad()
def decoupled_importance_weights(old_logp, behav_logp, mask, cap=None):
    """The behaviour importance weight of AReaL's decoupled PPO objective,
    w_t = pi_prox(y_t) / mu(y_t), detached, with pi_old as the proximal policy pi_prox (Fu et al.
    2025, arXiv:2505.24298; see `policy_loss_off_policy`).

    old_logp: [B, T] log pi_old = log pi_prox; behav_logp: [B, T] log mu; mask: [B, T].
    cap: None (no bound, the paper's objective) or C >= 1: tokens whose weight exceeds C are dropped
    (w_t = 0), as AReaL's `behav_imp_weight_cap` does in its `ppo_actor_loss_fn` (its later names
    for this: docs/algorithm.md#decoupled_importance_weights); TIS truncates them to C instead.
    Returns (weights [B, T], 0 on masked and dropped tokens; stats):
      filtered_frac  fraction of real tokens dropped by the cap, k_t > C strictly (0 without a cap)
      and the behav_* stats of `truncated_importance_weights`.
    """
    if cap is not None and cap < 1:
        raise ValueError(f"decoupled_importance_weights: cap must be None or >= 1, got {cap}")
    real = mask > 0  # [B, T] bool
    # [B, T] log k_t
    log_ratio = torch.clamp(old_logp - behav_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)  # [B, T] k_t = pi_prox / mu
    # keep_t = 1[k_t <= C]  (every token without a cap)
    dropped = real & (ratio > cap) if cap is not None else torch.zeros_like(real)
    # w_t = pi_prox(y_t) / mu(y_t) on kept tokens, 0 on dropped ones
    weights = torch.where(real & ~dropped, ratio, 0.0)
    stats = {"filtered_frac": masked_mean(dropped.to(ratio.dtype), mask),
             **_behaviour_gap_stats(old_logp, behav_logp, ratio, mask)}
    return weights, stats


@torch.no_grad()
def off_policy_mask(old_logp, behav_logp, mask, low, high, level="token"):
    """IcePop-style masking: drop the tokens (or whole sequences) where pi_old and mu disagree
    beyond a band, rather than clip their weight (IcePop: Ling Team 2025, "Every Step Evolves:
    Scaling Reinforcement Learning for Trillion-Scale Thinking Model" (Ring-1T), arXiv:2510.18855;
    its M(k; alpha, beta) = k for k in [alpha, beta], 0 outside, on
    k = pi_train(y_t; theta_old) / pi_infer(y_t; theta_old); the paper's band is [0.5, 5]).

      token:     keep_t = 1[low <= k_t <= high],   k_t = pi_old(y_t) / mu(y_t)
      sequence:  keep_t = 1[low <= kbar_i <= high] on every token of row i,
                 kbar_i = exp(1/|y_i| sum_t log k_t), the row's geometric-mean ratio (the whole
                 sequence in or out)

    old_logp, behav_logp, mask: [B, T]. low <= 1 <= high, so that on-policy tokens (k = 1) are
    always kept; the band is closed (a ratio exactly at low or high is kept); a symmetric band
    [1/k, k] is low=1/k, high=k.
    Log-ratios are clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] (per token, or the row's mean)
    before exp.
    Returns (new_mask [B, T] in mask's dtype: mask with the dropped tokens set to 0; stats, 0-dim
    tensors):
      masked_frac      fraction of real tokens dropped
      masked_seq_frac  fraction of non-empty rows left with no real token
      and the behav_* stats of `truncated_importance_weights` (token-level k_t at either level).
    To weight the kept tokens by k_t as IcePop does, use
    `policy_loss_off_policy(..., correction="icepop")`.
    """
    if not low <= 1 <= high:
        raise ValueError(f"off_policy_mask: need low <= 1 <= high, got low={low}, high={high}")
    if level not in MASK_LEVELS:
        raise ValueError(f"off_policy_mask: level must be one of {MASK_LEVELS}, got {level!r}")
    real = mask > 0  # [B, T] bool
    token_log_ratio = torch.where(real, old_logp - behav_logp, 0.0)  # [B, T] log k_t, 0 if masked
    ratio = torch.exp(torch.clamp(token_log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # [B, T] k_t
    if level == "token":
        # keep_t = 1[low <= k_t <= high]
        keep = (ratio >= low) & (ratio <= high)  # [B, T]
    else:
        # log kbar_i = 1/|y_i| sum_t log k_t
        seq_log_ratio = torch.clamp(masked_mean(token_log_ratio, mask, dim=-1), -LOG_RATIO_CLAMP,
                                    LOG_RATIO_CLAMP)
        seq_ratio = torch.exp(seq_log_ratio)  # [B] kbar_i
        # keep_t = 1[low <= kbar_i <= high] for every t of row i
        keep = ((seq_ratio >= low) & (seq_ratio <= high))[:, None].expand_as(real)  # [B, T]
    kept = real & keep  # [B, T]
    non_empty = real.any(-1)  # [B]
    emptied = non_empty & ~kept.any(-1)  # [B] rows that had real tokens and lost them all
    stats = {"masked_frac": masked_mean((real & ~keep).to(ratio.dtype), mask),
             "masked_seq_frac": emptied.sum().to(ratio.dtype) / non_empty.sum().clamp(min=1),
             **_behaviour_gap_stats(old_logp, behav_logp, ratio, mask)}
    return kept.to(mask.dtype), stats


def off_policy_weights(old_logp, behav_logp, mask, correction="tis", cap=2.0, band=(0.5, 5.0),
                       mask_level="token"):
    """The detached per-token weights w_t [B, T] of `correction` (see policy_loss_off_policy) and
    its stats."""
    if correction not in OFF_POLICY_CORRECTIONS:
        raise ValueError(
            f"off_policy_weights: correction must be one of {OFF_POLICY_CORRECTIONS}, "
            f"got {correction!r}")
    if correction == "tis":
        return truncated_importance_weights(old_logp, behav_logp, mask, cap)
    if correction == "decoupled":
        return decoupled_importance_weights(old_logp, behav_logp, mask, cap)
    # icepop
    keep, stats = off_policy_mask(old_logp, behav_logp, mask, band[0], band[1], mask_level)
    # M(k_t; low, high) = k_t on the kept tokens, 0 on the dropped ones
    weights, _ = decoupled_importance_weights(old_logp, behav_logp, keep)
    return weights, stats


def policy_loss_off_policy(logp, old_logp, behav_logp, advantages, mask, correction="tis", cap=2.0,
                           band=(0.5, 5.0), mask_level="token", clip_low=0.2, clip_high=0.2,
                           dual_clip=None, agg="token-mean"):
    """The PPO clipped surrogate on tokens sampled by a behaviour policy mu != pi_old, each token's
    loss times a detached off-policy weight w_t built from k_t = pi_old(y_t) / mu(y_t):
    `off_policy_weights`, then `policy_loss` with them as agg's weights (the training loop does the
    same for any token-level policy_loss_kind):

      L_t = w_t max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high)),
      r_t = pi_theta(y_t) / pi_old(y_t)

    correction (chosen by a plain `if`; the weights come from the functions above):
      "tis"        w_t = min(k_t, C)
                   TIS, Yao et al. 2025 (`truncated_importance_weights`)
      "decoupled"  w_t = k_t; with a cap C, 0 where k_t > C
                   AReaL, Fu et al. 2025 (`decoupled_importance_weights`)
      "icepop"     w_t = k_t inside the band, 0 outside
                   IcePop, Ring-1T 2025 (`off_policy_mask`, at mask_level); at
                   mask_level="sequence" the row decides in or out, and a kept token's weight is
                   still its own k_t
    With pi_old as AReaL's proximal policy, TIS and the decoupled objective share this surrogate and
    differ only at the cap: TIS truncates a large weight to C, AReaL drops the token. The trust
    region is always around pi_old, never mu. (AReaL's objective and its sequence-level variant:
    docs/algorithm.md#policy_loss_off_policy.)

    logp: [B, T] log pi_theta (with grad); old_logp: [B, T] log pi_old; behav_logp: [B, T] log mu;
    advantages, mask: [B, T]. cap: C for "tis" (>= 1) and "decoupled" (None or >= 1); band:
    (low, high) and mask_level ("token" | "sequence") for "icepop" (see `off_policy_mask`; the
    default band is the Ring-1T paper's [0.5, 5]).
    clip_low, clip_high, dual_clip: as in `policy_loss`; agg: an `Aggregation` or a mode name, its
    weights replaced by the correction's.
    Dropped tokens (w_t = 0) still count in the denominators of `aggregate`: they add a zero loss,
    as in AReaL's loss. With behav_logp == old_logp every k_t is exactly 1, and the loss, its
    gradient and policy_loss's stats equal `policy_loss`'s bit for bit, for every correction.
    Returns (loss: 0-dim, stats: dict of detached 0-dim tensors): policy_loss's stats (clipfrac,
    approx_kl, ratio_mean, ratio_max_dev, and dual_clipfrac with dual_clip) and the correction's
    (truncated_frac, filtered_frac or masked_frac / masked_seq_frac, with behav_ratio_mean,
    behav_ratio_max, behav_gap_mean, behav_gap_max).
    """
    if correction not in OFF_POLICY_CORRECTIONS:
        raise ValueError(
            f"policy_loss_off_policy: correction must be one of {OFF_POLICY_CORRECTIONS}, "
            f"got {correction!r}")
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(
            f"policy_loss_off_policy: dual_clip must be > 1 or None, got {dual_clip}")
    weights, correction_stats = off_policy_weights(old_logp, behav_logp, mask, correction, cap,
                                                   band, mask_level)
    # L_t = w_t L^CLIP_t: policy_loss's one clipped surrogate, each token's loss times its detached
    # weight
    loss, stats = policy_loss(logp, old_logp, advantages, mask, clip_low, clip_high, dual_clip,
                              replace(as_aggregation(agg), weights=weights))
    stats.update({k: v.detach() for k, v in correction_stats.items()})
    return loss, stats


# ---------------------------------------------------------------- rewards

def per_token_rewards(scores, mask, *, kl=None, kl_coef=0.0, ended_with_eos=None,
                      missing_eos_penalty=None):
    """Per-token rewards for GAE: a KL penalty on every real token, the sequence score on the last
    one.

    scores: [B] float, one scalar per response (e.g. a reward model). mask: [B, T].
    kl: [B, T] per-token KL estimate (the caller computes it, usually kl_estimate(..., "k1")), or
    None. ended_with_eos: [B] bool; with missing_eos_penalty not None, rows without EOS get
    score - penalty.
    Returns rewards [B, T] in scores' dtype: r_t = -kl_coef * kl_t on real tokens, plus the score
    at the last index where mask == 1 (holes do not matter); padding and fully masked rows get
    nothing.
    """
    B, T = mask.shape
    real = mask > 0  # [B, T]
    rewards = torch.zeros((B, T), dtype=scores.dtype, device=scores.device)  # [B, T]
    if kl is not None:
        # r_t = -beta * KL_t  (the KL-in-reward formulation, Ziegler et al. 2019)
        rewards = -kl_coef * kl.to(scores.dtype) * mask
    if missing_eos_penalty is not None:
        if ended_with_eos is None:
            raise ValueError("per_token_rewards: missing_eos_penalty needs ended_with_eos")
        scores = torch.where(ended_with_eos, scores, scores - missing_eos_penalty)
    positions = torch.arange(T, device=mask.device).expand(B, T)  # [B, T]
    last = torch.where(real, positions, 0).amax(-1, keepdim=True)  # [B, 1] last real index
    score = torch.where(real.any(-1), scores, 0.0).unsqueeze(-1)  # [B, 1], 0 for fully masked rows
    return rewards.scatter_add(-1, last, score)


def overlong_penalty(lengths, max_len, cache_len):
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13), added to the task
    score.

    lengths: [B] int or float, response lengths in real tokens. max_len: L_max, the generation
    limit; cache_len: L_cache, the interval before L_max over which the penalty ramps from 0 down to
    -1 (1 <= cache_len <= max_len). Returns [B] float (lengths' dtype if floating, else the default
    float dtype):
      R(L) = 0                                  if L <= L_max - L_cache
             ((L_max - L_cache) - L) / L_cache  if L_max - L_cache < L <= L_max
             -1                                 if L > L_max
    """
    if not 1 <= cache_len <= max_len:
        raise ValueError(
            f"overlong_penalty: cache_len must be in [1, max_len={max_len}], got {cache_len}")
    if not lengths.is_floating_point():
        lengths = lengths.to(torch.get_default_dtype())
    expected_len = max_len - cache_len  # L_max - L_cache, the longest length with no penalty
    ramp = (expected_len - lengths) / cache_len  # [B]
    return torch.where(lengths <= expected_len, 0.0, torch.where(lengths <= max_len, ramp, -1.0))


def normalize_scores(scores, *, whiten=False, clip=None):
    """Optionally whiten scores [B] over the batch, (s - mean) / (std + 1e-8) with unbiased std,
    then clamp to [-clip, clip]. A batch of one whitens to 0. Returns scores [B]."""
    if whiten:
        ones = torch.ones_like(scores)
        scores = (scores - scores.mean()) / (masked_var(scores, ones).sqrt() + 1e-8)
    if clip is not None:
        scores = torch.clamp(scores, -clip, clip)
    return scores


# ---------------------------------------------------------------- KL coefficient controllers

@dataclass
class FixedKLController:
    """A constant KL coefficient beta."""
    kl_coef: float
    """beta, the weight of the KL penalty."""
    value: float = field(init=False)

    def __post_init__(self):
        self.value = float(self.kl_coef)

    def update(self, current_kl, n_steps):
        pass

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = float(state["value"])


@dataclass
class AdaptiveKLController:
    """A beta that steers the measured KL towards a target (Ziegler et al. 2019, arXiv:1909.08593,
    2.2)."""
    init_kl_coef: float
    """beta at the start of training."""
    target: float
    """KL the controller aims for (nats per sequence or per token, as the caller measures
    current_kl)."""
    horizon: float
    """Number of samples over which a 20% error moves beta by 20%."""
    value: float = field(init=False)

    def __post_init__(self):
        if self.target <= 0:
            raise ValueError(f"AdaptiveKLController: target must be > 0, got {self.target}")
        if self.horizon <= 0:
            raise ValueError(f"AdaptiveKLController: horizon must be > 0, got {self.horizon}")
        self.value = float(self.init_kl_coef)

    def update(self, current_kl, n_steps):
        """current_kl: float or 0-dim tensor, the measured KL; n_steps: samples since the last
        update."""
        # e_t = clip(KL / KL_target - 1, -0.2, 0.2)
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        # beta <- beta * (1 + e_t * n_steps / horizon)
        mult = 1.0 + proportional_error * n_steps / self.horizon
        self.value *= mult

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = float(state["value"])
