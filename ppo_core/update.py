"""The PPO update over one rollout: its advantages, then ppo_epochs of clipped minibatch updates.

    # fills rollout.rewards, .advantages, .returns [B, R]
    compute_advantages(rollout, cfg, kl_coef, ended)
    stats = ppo_update(policy, critic, rollout, Step(cfg, shuffle_gen, autocast), kl_coef,
                       opts.step)

  advantages: penalties on the raw scores, r_t = -beta * KL_t on every token (with kl_in_reward) +
              the score on the last one, then cfg.adv_estimator's advantages (GAE with the critic's
              values, or a critic-free baseline), computed on the global batch; the math is
              ppo_core.algo's. With a teacher (on-policy distillation)
              A_t = -distill_coef * (log pi_old - log pi_teacher), alone or added to those
  update:     ppo_update: shuffled minibatches of the global batch (stopped early past target_kl);
              minibatch_gradients runs each in micro-batches whose gradients add up to the
              minibatch's, summed across processes: padded ones of micro_batch_size rows (each
              process its own rows), or with micro_batch_tokens packed ones
              (ppo_core.data.packing: each minibatch's rows split across processes by token count,
              then packed to the budget)
  objectives: on one MicroBatch (a micro-batch's rows of the rollout, by name): policy_objective,
              cfg.policy_loss_kind's loss (algo.policy_loss_function: PPO's clipped surrogate,
              CISPO, GSPO), weighted per token by an off-policy correction when one is on, + the KL
              loss term, - the entropy bonus, on the fused kernel or the torch reference; the
              critic's clipped value loss (algo.value_loss)
  statistics: STEP_STATS, the one table of what each optimizer step reports and how it is averaged
  optimizers: Optimizers: AdamW for policy and critic, warm-up + cosine LR (lr_at), skip-on-NaN rule
The forward heads are the scoring pass's (ppo_core.heads), so the update's log-probs are computed as
the old ones were. The file reads in that order: the entry points first, then what they call, in the
order it runs. The notes behind it (measurements, the reasons at length): docs/update.md.
"""
import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch

import ppo_kernels

from . import algo
from .models import distributed as dist
from .config import PPOConfig
from .data.packing import Packed, balanced_split, pack_rows, token_budget_micro_batches
from .heads import micro_batches, response_head, response_labels, response_values
from .rollout import Rollout
from .run.start import Step


# ---------------------------------------------------------------------------- the entry points

def compute_advantages(rollout: Rollout, cfg: PPOConfig, kl_coef: float, ended_with_eos):
    """Scores -> per-token rewards (KL in the reward when cfg.kl_in_reward) -> advantages by
    cfg.adv_estimator; with a teacher (cfg.teacher) the distillation advantage replaces them, or is
    added to them with cfg.distill_with_reward (the rewards and returns stay the reward's: logged,
    and no critic reads them without distill_with_reward). ended_with_eos: [B] bool. Sets
    rollout.rewards, .advantages, .returns: [B, R], this process's rows.

    Computed on the GLOBAL batch (all processes' rows gathered), so batch statistics (reward and
    advantage whitening, a prompt's group of responses) are those of the whole batch; each process
    keeps its own rows. Penalties (missing EOS, overlong) apply to the raw scores, before whitening
    and clipping."""
    lo, hi = dist.rank() * len(rollout.prompts), (dist.rank() + 1) * len(rollout.prompts)
    mask = dist.all_gather_rows(rollout.response_mask)  # [B_global, R]
    old_logprobs, ref_logprobs = (dist.all_gather_rows(rollout.old_logprobs),
                                  dist.all_gather_rows(rollout.ref_logprobs))
    old_values, ended = (dist.all_gather_rows(rollout.old_values),
                         dist.all_gather_rows(ended_with_eos))
    scores, group = dist.all_gather_rows(rollout.scores), dist.all_gather_rows(rollout.group)
    if cfg.missing_eos_penalty:
        scores = torch.where(ended, scores, scores - cfg.missing_eos_penalty)
    if cfg.overlong_buffer:
        scores = scores + cfg.overlong_penalty * algo.overlong_penalty(
            mask.sum(-1), cfg.max_new_tokens, cfg.overlong_buffer)
    scores = algo.normalize_scores(scores, whiten=cfg.whiten_rewards, clip=cfg.reward_clip or None)
    kl = (algo.kl_estimate(old_logprobs, ref_logprobs, cfg.kl_reward_kind) if cfg.kl_in_reward
          else None)
    rewards = algo.per_token_rewards(scores, mask, kl=kl, kl_coef=kl_coef)  # [B, R]
    if cfg.adv_estimator == "gae":
        advantages, returns = algo.gae(rewards, old_values, mask, cfg.gamma, cfg.lam)
        if cfg.whiten_advantages:
            advantages = algo.masked_whiten(advantages, mask)
    else:
        # Monte Carlo return; a target for no critic
        returns = algo.discounted_returns(rewards, mask, cfg.gamma)
        if cfg.adv_estimator == "reinforce_pp":
            advantages = algo.masked_whiten(returns, mask)
        else:
            # each response's total reward (its score, minus its KL penalty with kl_in_reward)
            # against its group's
            advantages = algo.group_advantages(rewards.sum(-1), group, mask, cfg.adv_estimator)
    # on-policy distillation: the teacher's per-token signal, alone or beside the estimator's
    if cfg.teacher:
        teacher_logprobs = dist.all_gather_rows(rollout.teacher_logprobs)  # [B_global, R]
        # A_t = -distill_coef * (log pi_old(y_t) - log pi_teacher(y_t)),
        # the student's log-probs the rollout's old ones
        distill = algo.distillation_advantages(old_logprobs, teacher_logprobs, mask,
                                               cfg.distill_coef)
        advantages = advantages + distill if cfg.distill_with_reward else distill
    rollout.rewards, rollout.advantages, rollout.returns = (rewards[lo:hi], advantages[lo:hi],
                                                            returns[lo:hi])


# What each optimizer step reports, in the order its sums travel (minibatch_gradients,
# _read_step_stats), and how each is formed from the micro-batches. None: a loss, already normalised
# by the minibatch's global token and sequence counts (algo.aggregate), summed as it is. A key: that
# statistic of policy_objective's (policy/, off_policy/) or algo.value_loss's (value/) stats, a
# masked mean per micro-batch, summed times the micro-batch's token count and divided by the
# minibatch's: a mean over the minibatch's tokens. After these come the policy loss's own
# statistics, whatever its function reports (clipfrac, approx_kl, ratio_mean, ... as "policy/<key>",
# averaged the same way; a loss without a clip reports no clipfrac), but for the keys in
# LOSS_STATS_ELSEWHERE.
STEP_STATS = {
    "policy/loss": None,
    "value/loss": None,
    "policy/kl_loss": None,
    "policy/entropy": "entropy",
    "value/clipfrac": "clipfrac",
    "value/values_mean": "values_mean",
    "off_policy/behav_gap_mean": "behav_gap",
    "off_policy/corrected_frac": "corrected_frac",
}
MB_STATS = tuple(STEP_STATS)  # their names, in that order
# keys of the policy loss's stats reported otherwise: as maxima (ppo_update), or in STEP_STATS
LOSS_STATS_ELSEWHERE = ("ratio_max_dev", "behav_gap", "behav_gap_max", "corrected_frac", "entropy")


def fresh_first_minibatch(cfg: PPOConfig, n_rows, generator, train_policy=True):
    """The rows of the update's first minibatch (a CPU index tensor), where their old log-probs can
    be that minibatch's own forward, or None. Before the first optimizer step the policy is the one
    that scored the rollout, so the scoring pass need not run it over these rows: the update's
    forward gives log pi_old (ratio exactly 1) and the entropy, and writes both into the rollout for
    the metrics. Read from a copy of `generator`, which ppo_update then draws the same permutation
    from. None where the old log-probs are read before the update (the KL in the reward,
    distillation's advantages, an off-policy correction, a recording), come from the decoding pass,
    or live on other processes, and in a critic warm-up iteration (no policy forward)."""
    if (not train_policy or cfg.kl_in_reward or cfg.teacher or cfg.off_policy_correction != "none"
            or cfg.old_logprobs_from_rollout or cfg.save_rollouts or dist.world_size() > 1):
        return None
    copy = torch.Generator()
    copy.set_state(generator.get_state())
    return torch.randperm(n_rows, generator=copy)[: cfg.minibatch_size]


def ppo_update(policy, critic, rollout: Rollout, step: Step, kl_coef, step_fn, train_policy=True):
    """`ppo_epochs` passes of minibatch updates over one rollout; returns each statistic's mean.
    step: cfg, the generator that orders the minibatches, the autocast region.

    Minibatches are drawn from one permutation of the GLOBAL batch (the same on every process); each
    process runs the rows of the minibatch that it holds, in micro-batches, and the gradients are
    summed across processes (DDP / FSDP, on the last micro-batch) before `step_fn` steps the
    optimizers. `policy` and `critic` are what training forwards run through (a DDP wrapper, an FSDP
    or plain model); critic is None for the critic-free estimators. train_policy=False (critic
    warm-up) trains the critic alone. With cfg.target_kl, the iteration stops after the first step
    whose approx KL(old || new) exceeds it.

    Host reads of device values, in one place per optimizer step: `minibatch_gradients` only queues
    device work; then `_read_step_stats` copies the step's statistics to the host in one read, and
    `step_fn` (Optimizers.step) reads the gradient norms (are they finite?). Shuffling and row
    selection are host work on CPU tensors. tests/test_fake_cuda.py checks where reads are; why, and
    the one read in the model: docs/update.md#host-reads-one-place-per-optimizer-step."""
    cfg, generator = step.cfg, step.generator
    policy.train()
    if critic is not None:
        critic.train()
    b = rollout.input_ids.shape[0]
    world, lo = dist.world_size(), dist.rank() * b
    # packed: every process holds every row, and takes a token-balanced share of each minibatch
    if cfg.micro_batch_tokens:
        rollout = every_process_rows(rollout)
        lengths = rollout.host_mask.sum(-1).tolist()  # [b*world] real tokens per row
    stats: dict[str, list] = {}
    first_ratio_dev, ratio_max_dev, behav_gap_max, steps, stopped = None, 0.0, 0.0, 0, False
    for epoch in range(cfg.ppo_epochs):
        # [b*world] CPU, the same on every process
        order = torch.randperm(b * world, generator=generator)
        for start in range(0, b * world, cfg.minibatch_size):
            mb_global = order[start : start + cfg.minibatch_size]
            # Every process runs as many micro-batches as the busiest one (their gradient reductions
            # pair up); each process knows every process's rows from the shared permutation, so no
            # collective.
            if cfg.micro_batch_tokens:
                shares = balanced_split(mb_global.tolist(),
                                        [lengths[r] for r in mb_global.tolist()], world)
                plans = [token_budget_micro_batches(share, [lengths[r] for r in share],
                                                    cfg.micro_batch_tokens)
                         for share in shares]
                # rows of the every-process rollout
                chunks = [torch.tensor(rows) for rows in plans[dist.rank()]]
                n_micro = max(len(plan) for plan in plans)
            else:
                # this process's rows (CPU)
                mb = mb_global[(mb_global >= lo) & (mb_global < lo + b)] - lo
                # [world] CPU: how many of the minibatch's rows each process holds
                rows_per_process = (mb_global[None, :] // b == torch.arange(world)[:, None]).sum(-1)
                n_micro = -(-int(rows_per_process.max()) // cfg.micro_batch_size)  # ceil
                chunks = micro_batches(len(mb), cfg.micro_batch_size, mb)
            fresh = epoch == 0 and start == 0 and rollout.fresh_rows is not None
            if fresh and not torch.equal(mb_global, rollout.fresh_rows):
                raise RuntimeError(
                    "the update's first minibatch is not the one fresh_first_minibatch predicted")
            sums, counts, ratio_devs = minibatch_gradients(
                policy, critic, rollout, Minibatch(chunks, n_micro, fresh), step, kl_coef,
                train_policy)
            values, tokens, (first_dev, max_dev, gap_max) = _read_step_stats(
                sums, counts, ratio_devs)
            for name, value in values.items():
                _append(stats, name, value if name in STEP_STATS and STEP_STATS[name] is None
                        else value / tokens)
            if first_ratio_dev is None:
                first_ratio_dev = first_dev
            ratio_max_dev = max(ratio_max_dev, max_dev)
            behav_gap_max = max(behav_gap_max, gap_max)
            for name, norm in step_fn(train_policy).items():
                _append(stats, name, norm)
            steps += 1
            # Early stop (Spinning Up's PPO): the policy has moved as far from the sampling policy
            # as allowed
            if cfg.target_kl and train_policy and stats["policy/approx_kl"][-1] > cfg.target_kl:
                stopped = True
                break
        if stopped:
            break
    out = {k: float(np.mean(v)) for k, v in stats.items()}  # means over the optimizer steps
    for name in _unused_stats(cfg, critic is not None, train_policy):
        out.pop(name, None)
    out["train/steps"] = steps
    if train_policy:
        out["policy/ratio_max_dev"] = ratio_max_dev
        # the processes' first micro-batches: old log-probs come from the training code path, so
        # every process's first ratio is 1 up to the order of the log-sum-exp; how close, as
        # measured: docs/update.md#the-first-ratio-is-1-up-to-rounding
        out["policy/first_ratio_max_dev"] = first_ratio_dev
        # the largest |log pi_old - log mu| of any token the update saw
        if cfg.off_policy_correction != "none":
            out["off_policy/behav_gap_max"] = behav_gap_max
    return out


# ---------------------------------------------------------------------------- one minibatch

def every_process_rows(rollout: Rollout) -> Rollout:
    """The rollout with every process's rows, in rank order (one process: the rollout itself): what
    the packed update splits across processes by token count (ppo_update). Per-row tensors only;
    prompts, responses and scores stay each process's own."""
    if dist.world_size() == 1:
        return rollout
    tensors = {name: dist.all_gather_rows(getattr(rollout, name))
               for name in ("input_ids", "attention_mask", "response_mask", "old_logprobs",
                            "ref_logprobs", "old_values", "entropy", "advantages", "returns",
                            "behav_logprobs", "teacher_logprobs")
               if getattr(rollout, name) is not None}
    return dataclasses.replace(rollout, **tensors, host_mask=tensors["attention_mask"].cpu())


@dataclass
class Minibatch:
    """This process's share of one minibatch, as ppo_update plans it."""

    chunks: list  # its micro-batches: CPU index tensors of rollout rows
    n_micro: int  # the micro-batches every process runs (the busiest process's count)
    fresh: bool = False  # the update's first minibatch, its old log-probs not scored (None)


def minibatch_gradients(policy, critic, rollout: Rollout, minibatch: Minibatch, step: Step,
                        kl_coef, train_policy=True):
    """Forward and backward of policy and critic over this process's rows of one minibatch, in
    n_micro micro-batches: chunks, CPU index tensors of rows (a process with fewer than n_micro runs
    row 0 with no token in the loss: gradient 0), each padded to the rollout's width or, with
    cfg.micro_batch_tokens, packed (ppo_core.data.packing); gradients accumulate in .grad and are
    summed over processes on the last micro-batch. No critic (critic None), or no policy
    (train_policy False, the critic warm-up): that model's passes are skipped.

    Queues device work only, never a host read (see ppo_update). Returns (sums, counts, ratio_devs):
      sums        {name: 0-dim float64 device tensor} for MB_STATS and then the policy loss's own
                  statistics ("policy/<key>"), summed over the micro-batches and, after one
                  all-reduce, the processes (losses already normalised by the global counts;
                  per-token statistics times the token count)
      counts      [2] device tensor: the minibatch's global token and sequence counts
      ratio_devs  [3] device tensor: max |ratio - 1| of the processes' first micro-batches, and of
                  all of them; the largest behaviour gap |log pi_old - log mu|, 0 without an
                  off-policy correction"""
    chunks, n_micro, fresh = minibatch.chunks, minibatch.n_micro, minibatch.fresh
    cfg, autocast = step.cfg, step.autocast
    device = rollout.input_ids.device
    mask_mb = rollout.response_mask[torch.cat(chunks)] if chunks else rollout.response_mask[:0]
    # Global denominators for the whole minibatch, so the micro-batch losses of all processes
    # add up to the minibatch's loss (and their gradients to its gradient).
    counts = dist.all_reduce_sum(torch.stack([mask_mb.sum(),
                                              (mask_mb.sum(-1) > 0).sum().float()]))  # [2]
    agg = algo.Aggregation(cfg.loss_agg, num_tokens=counts[0], num_seqs=counts[1])
    sums = {}  # name -> float64 0-dim tensor, on the device of the losses added in
    zero = torch.zeros((), device=device)
    first_ratio_dev, max_ratio_dev, max_gap = None, zero, zero
    # One autocast region for the whole minibatch: its cast cache keeps one bf16 copy of each
    # trained weight for all the micro-batches; backward runs with autocast off (autocast_off).
    # Why: docs/update.md#one-autocast-region-per-minibatch
    with autocast():
        for i in range(n_micro):
            rows = chunks[i] if i < len(chunks) else torch.zeros(1, dtype=torch.long)
            batch = micro_batch(rollout, rows, packed=bool(cfg.micro_batch_tokens),
                                in_loss=i < len(chunks), fresh=fresh)
            last = i == n_micro - 1
            n = batch.response_mask.sum()
            pg_loss = kl_loss = vf_loss = zero
            pg_stats, vf_stats = {}, {}
            if train_policy:
                with dist.gradient_sync(policy, last):
                    loss, pg_loss, kl_loss, pg_stats = policy_objective(
                        policy, batch, cfg, kl_coef, agg)
                    with autocast_off(device):
                        loss.backward()
                # the old log-probs the scoring pass left to this forward (fresh_rows)
                if fresh and i < len(chunks):
                    rollout.old_logprobs[rows] = batch.old_logprobs * batch.response_mask
                    rollout.entropy[rows] = batch.entropy * batch.response_mask
                if first_ratio_dev is None:
                    first_ratio_dev = pg_stats["ratio_max_dev"].detach()
                max_ratio_dev = torch.maximum(max_ratio_dev, pg_stats["ratio_max_dev"].detach())
                if "behav_gap_max" in pg_stats:
                    max_gap = torch.maximum(max_gap, pg_stats["behav_gap_max"].detach())
            if critic is not None:
                with dist.gradient_sync(critic, last):
                    values = response_values(critic, batch.input_ids, batch.attention_mask,
                                             batch.prompt_len, batch.packed).float()
                    with autocast_off(device):
                        vf_loss, vf_stats = algo.value_loss(
                            values, batch.old_values, batch.returns, batch.response_mask,
                            clip=cfg.value_clip or None, agg=agg)
                        vf_loss.backward()
            losses = {"policy/loss": pg_loss, "value/loss": vf_loss.detach(),
                      "policy/kl_loss": kl_loss}
            terms = {name: losses[name] if key is None else
                     (vf_stats if name.startswith("value/") else pg_stats).get(key, zero) * n
                     for name, key in STEP_STATS.items()}
            # the loss's own statistics, in the order its function reports them (the same on every
            # process)
            terms.update({f"policy/{key}": value * n for key, value in pg_stats.items()
                          if key not in LOSS_STATS_ELSEWHERE})
            for name, value in terms.items():
                sums[name] = sums[name] + value.double() if name in sums else value.double()
    if first_ratio_dev is None:
        first_ratio_dev = zero
    names = list(sums)
    # one collective for all of them
    reduced = dist.all_reduce_sum(torch.stack([sums[name] for name in names]))
    return (dict(zip(names, reduced.unbind(0))), counts,
            dist.all_reduce_max(torch.stack([first_ratio_dev, max_ratio_dev,
                                             max_gap.to(max_ratio_dev.dtype)])))


def autocast_off(device):
    """Autocast switched off inside a region that stays open (its cast cache kept): for backward
    passes and the float32 work between a region's forwards."""
    return torch.autocast(device.type, enabled=False)


@dataclass
class MicroBatch:
    """One micro-batch's rows of the rollout: what policy_objective and the value loss read. b rows,
    prompts left-padded to prompt_len (P), responses right-padded to R."""

    input_ids: torch.Tensor  # [b, P+R] int64
    attention_mask: torch.Tensor  # [b, P+R] bool
    # [b, R] float32: 1 on the tokens the policy produced, the tokens in the loss
    response_mask: torch.Tensor
    prompt_len: int  # P
    # [b, R] float32: log pi_old, the rollout's; None: fresh (policy_objective)
    old_logprobs: torch.Tensor | None
    advantages: torch.Tensor  # [b, R] float32
    ref_logprobs: torch.Tensor  # [b, R] float32: the reference policy's
    # [b, R] float32: the sampler's, mu (cfg.off_policy_correction)
    behav_logprobs: torch.Tensor | None = None
    # [b, R] float32: the critic's at rollout time (the value loss's clip)
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None  # [b, R] float32: the value targets
    # these rows packed (cfg.micro_batch_tokens, ppo_core.data.packing)
    packed: Packed | None = None
    # [b, R] float32: set by policy_objective on a fresh micro-batch
    entropy: torch.Tensor | None = None


def micro_batch(rollout: Rollout, rows, packed=False, in_loss=True, fresh=False) -> MicroBatch:
    """The rollout's rows `rows` (a CPU index tensor) as a MicroBatch; packed: with their packed
    form. in_loss=False: a process's extra micro-batch (minibatch_gradients), all-zero
    response_mask, so no token is in the loss. fresh: rows of the update's first minibatch whose old
    log-probs were not scored (fresh_first_minibatch): old_logprobs None."""
    input_ids, response_mask = rollout.input_ids[rows], rollout.response_mask[rows]
    return MicroBatch(
        input_ids=input_ids, attention_mask=rollout.attention_mask[rows],
        response_mask=response_mask if in_loss else torch.zeros_like(response_mask),
        prompt_len=rollout.prompt_len,
        old_logprobs=None if fresh else rollout.old_logprobs[rows],
        advantages=rollout.advantages[rows],
        ref_logprobs=rollout.ref_logprobs[rows],
        behav_logprobs=None if rollout.behav_logprobs is None else rollout.behav_logprobs[rows],
        old_values=rollout.old_values[rows], returns=rollout.returns[rows],
        packed=pack_rows(input_ids, rollout.host_mask[rows],
                         rollout.prompt_len) if packed else None)


def policy_objective(policy, batch: MicroBatch, cfg: PPOConfig, kl_coef, agg):
    """The policy's minibatch loss on one micro-batch, `objective` below on the policy's log-probs.
    Returns (loss to backward, pg_loss, kl_loss, stats).

    fused (cfg.fused_kernels): ppo_kernels.linear_logprob_loss forms the log-probs (and entropies)
    from the hidden states and the LM head chunk by chunk, calls `objective` on each chunk's rows
    and turns its per-token gradient into the head's, never forming the [b*R, V] logits; without
    fused_kernels: full logits, log_softmax + gather, then `objective` on them. Either way the loss
    trained is the one ppo_core.algo computes: an edit there is what every path trains.
    batch.packed: these rows packed (ppo_core.data.packing); the heads see what they see padded.
    agg: an algo.Aggregation, cfg.loss_agg with the minibatch's global num_tokens and num_seqs; the
    policy loss gets it with the off-policy correction's weights when there is one. A fresh batch
    (old_logprobs None, the first minibatch before any step: fresh_first_minibatch): log pi_old is
    the forward's own log-probs, detached (ratio exactly 1), and batch.old_logprobs and
    batch.entropy are set to what the forward computed."""
    response_mask, old_logprobs, ref_logprobs = (batch.response_mask, batch.old_logprobs,
                                                 batch.ref_logprobs)
    fresh = old_logprobs is None
    advantages = batch.advantages
    labels = response_labels(batch.input_ids, response_mask, batch.prompt_len)
    off_weights, off_stats = None, {}
    # w_t from k_t = pi_old / mu (ppo_core.algo), [b, R] detached
    if batch.behav_logprobs is not None:
        off_weights, off_stats = algo.off_policy_weights(
            old_logprobs, batch.behav_logprobs, response_mask, correction=cfg.off_policy_correction,
            cap=cfg.off_policy_cap, band=(cfg.off_policy_band_low, cfg.off_policy_band_high),
            mask_level=cfg.off_policy_mask_level)
    # the one place a loss kind is chosen
    policy_loss_fn = algo.policy_loss_function(cfg.policy_loss_kind)
    settings = algo.loss_settings(cfg.policy_loss_kind, cfg)
    kl_in_loss = not cfg.kl_in_reward
    want_entropy = cfg.entropy_coef != 0.0

    def objective(logp, entropy, rows):
        """L = L^policy + beta KL - c_H H on the micro-batch's rows `rows`: logp, entropy [b, R]
        (entropy None unless entropy_coef or a fresh batch). Splits over rows as micro-batches do
        (global counts)."""
        mask = response_mask[rows]
        # a fresh batch: pi_old is the policy as it is
        old = logp.detach() if fresh else old_logprobs[rows]
        # L = aggregate(w_t L_t), with the off-policy correction's weights w_t when there are any
        weighted = (agg if off_weights is None else
                    dataclasses.replace(agg, weights=off_weights[rows]))
        loss, stats = policy_loss_fn(logp, old, advantages[rows], mask, agg=weighted, **settings)
        if kl_in_loss:
            # L += beta * aggregate(KL_t): the KL to the reference as a loss term
            # (cfg.kl_in_reward = False)
            kl_term = algo.aggregate(algo.kl_estimate(logp, ref_logprobs[rows], cfg.kl_loss_kind),
                                     mask, agg)
            loss = loss + kl_coef * kl_term
            stats["kl_loss"] = kl_term.detach()
        if want_entropy:
            # L = L^CLIP - c_H * H: the bonus keeps the policy from collapsing early
            loss = loss - cfg.entropy_coef * algo.aggregate(entropy, mask, agg)
            stats["entropy"] = algo.masked_mean(entropy.detach(), mask)
        return loss, stats

    # what one token's gradient reads: the fused head's tiles
    coupling = algo.loss_coupling(cfg.policy_loss_kind)

    def fused_head(hidden, weight):
        return ppo_kernels.linear_logprob_loss(hidden, weight, labels, objective,
                                               temperature=cfg.temperature,
                                               need_entropy=want_entropy or fresh,
                                               rows_separate=coupling != "batch",
                                               tokens_separate=coupling == "token")

    def reference_head(hidden, weight):
        return ppo_kernels.linear_logprob_loss_reference(hidden, weight, labels, objective,
                                                         temperature=cfg.temperature,
                                                         need_entropy=want_entropy or fresh)

    head = fused_head if cfg.fused_kernels else reference_head
    loss, stats, logp, entropy = response_head(policy, batch.input_ids, batch.attention_mask,
                                               batch.prompt_len, head, batch.packed)
    if fresh:
        batch.old_logprobs, batch.entropy = logp.detach().float(), entropy.detach().float()
    stats = dict(stats)
    # 0 on the loop's device where the loss has no KL term
    kl_loss = stats.pop("kl_loss", torch.zeros((), device=batch.input_ids.device))
    # the sampler's gap, and the share of tokens the correction truncated or dropped
    if off_weights is not None:
        stats["behav_gap"] = off_stats["behav_gap_mean"]
        stats["behav_gap_max"] = off_stats["behav_gap_max"]
        stats["corrected_frac"] = off_stats[CORRECTED_FRAC[cfg.off_policy_correction]]
    # reported: the surrogate (minus the entropy bonus when on) without the KL term, which is
    # reported apart
    pg_loss = loss.detach() - kl_coef * kl_loss if kl_in_loss else loss.detach()
    return loss, pg_loss, kl_loss.detach(), stats


# the share of tokens each off-policy correction truncates or drops, as ppo_core.algo's weight
# functions name it
CORRECTED_FRAC = {"tis": "truncated_frac", "decoupled": "filtered_frac", "icepop": "masked_frac"}


def _read_step_stats(sums, counts, ratio_devs):
    """The optimizer step's one read of statistics: sums, the token count and the maxima copied to
    the host together. -> ({name: value}, max(tokens, 1), (first ratio_max_dev, max ratio_max_dev,
    behaviour gap max)) as Python floats."""
    host = torch.cat([torch.stack(list(sums.values())), counts[:1].double(),
                      ratio_devs.double()]).tolist()
    return dict(zip(sums, host[: len(sums)])), max(host[len(sums)], 1.0), tuple(host[-3:])


def _append(stats, key, value):
    stats.setdefault(key, []).append(value)


def _unused_stats(cfg: PPOConfig, has_critic, train_policy):
    """The MB_STATS and norms that this configuration does not compute."""
    unused = []
    if not train_policy:
        unused += [n for n in MB_STATS + ("policy/grad_norm",) if n.startswith("policy/")]
    else:
        if cfg.kl_in_reward:
            unused.append("policy/kl_loss")
        if not cfg.entropy_coef:
            unused.append("policy/entropy")
    if not train_policy or cfg.off_policy_correction == "none":
        unused += ["off_policy/behav_gap_mean", "off_policy/corrected_frac"]
    if not has_critic:
        unused += [n for n in MB_STATS + ("value/grad_norm",) if n.startswith("value/")]
    return unused


# ---------------------------------------------------------------------------- the optimizer step

class NonFiniteUpdates(RuntimeError):
    """Too many consecutive updates had a non-finite loss or gradient."""


class Optimizers:
    """AdamW for policy and critic (None for the critic-free estimators), the LR schedules, and the
    skip-on-NaN rule, stepped together.

    Schedules run over optimizer steps: step k of iteration i is number i * steps_per_iter + k, so
    an iteration that stops early (target_kl) leaves the schedule on time. The critic's spans all
    iterations; the policy's starts after cfg.critic_warmup iterations (when it first steps) and
    spans the rest."""

    def __init__(self, policy, critic, cfg: PPOConfig, steps_per_iter, log):
        def adamw(model, lr):
            # fused: one kernel over all parameters, faster than the foreach default
            # (docs/update.md#adamw-with-fusedtrue); the same update, rounded in another order
            return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                                     betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                                     weight_decay=cfg.weight_decay, fused=True)

        self.cfg, self.steps_per_iter, self.log = cfg, steps_per_iter, log
        self.policy, self.critic = policy, critic
        self.policy_opt = adamw(policy, cfg.lr)
        self.critic_opt = adamw(critic, cfg.critic_lr) if critic is not None else None
        self.step_count = 0
        self.consecutive_skips = 0
        self.skipped = 0
        self.iteration = 0

    def start_iteration(self, it):
        """Iteration `it` (0-based) begins: its first optimizer step is it * steps_per_iter."""
        self.iteration = it + 1
        self.step_count = it * self.steps_per_iter

    def lr_scales(self, step):
        """(policy, critic) multipliers of the peak learning rates at optimizer step `step`."""
        cfg, warm = self.cfg, self.cfg.critic_warmup * self.steps_per_iter
        critic = lr_at(step, cfg.iterations * self.steps_per_iter, cfg)
        policy = lr_at(max(0, step - warm),
                       (cfg.iterations - cfg.critic_warmup) * self.steps_per_iter, cfg)
        return policy, critic

    def zero_grad(self):
        for m in (self.policy, self.critic):
            if m is not None:
                m.zero_grad(set_to_none=True)

    def step(self, train_policy=True):
        """Clip the (already summed over processes) gradients and step the optimizers (the critic's
        alone when not train_policy) — unless any gradient is not finite, in which case no weight is
        touched and the update is counted as skipped. Returns the gradient norms before clipping:
        {"policy/grad_norm", "value/grad_norm"}."""
        cfg = self.cfg
        policy_scale, critic_scale = self.lr_scales(self.step_count)
        stepped = ([("policy", self.policy, self.policy_opt, cfg.lr * policy_scale)] if train_policy
                   else [])
        if self.critic is not None:
            stepped.append(("value", self.critic, self.critic_opt, cfg.critic_lr * critic_scale))
        names, norms = [], []
        for name, model, _, _ in stepped:
            params = [p for p in model.parameters() if p.requires_grad and p.grad is not None]
            if params:
                norm = torch.nn.utils.clip_grad_norm_(
                    params, cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf"))
                names.append(f"{name}/grad_norm"), norms.append(dist.local_tensor(norm).float())
        # the step's one host read of the gradients
        host_norms = torch.stack(norms).tolist() if norms else []
        if all(math.isfinite(n) for n in host_norms):
            for _, _, opt, lr in stepped:
                for group in opt.param_groups:
                    group["lr"] = lr
                opt.step()
            self.consecutive_skips = 0
        else:
            self.skipped += 1
            self.consecutive_skips += 1
            self.log.info(
                f"iteration {self.iteration}: non-finite loss or gradient, update "
                f"{self.step_count} skipped")
            if self.consecutive_skips >= cfg.max_skipped_updates:
                raise NonFiniteUpdates(
                    f"stopping at iteration {self.iteration}: {self.consecutive_skips} consecutive "
                    f"updates had a non-finite loss or gradient "
                    f"(max_skipped_updates={cfg.max_skipped_updates})")
        self.zero_grad()
        self.step_count += 1
        return dict(zip(names, host_norms))


def lr_at(step, total_steps, cfg: PPOConfig):
    """The LR multiplier at optimizer step `step` (0-based) of total_steps: linear warm-up to the
    peak at step warmup_steps - 1, then cosine decay that reaches min_lr_ratio at the last step,
    total_steps - 1."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = (step + 1 - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, progress)))
