"""The PPO training loop: rollout -> score -> rewards -> GAE -> ppo_epochs of clipped updates.

    ppo-train                                    # the default job: the shipped demo checkpoint, CPU, ~2 min
    ppo-train --config configs/default.toml --iterations=100 --out runs/mine
    python -m ppo_core.train --lr=5e-4

One iteration (Ouyang et al. 2022; Huang et al. 2024, "The N+ implementation details of RLHF with PPO"):
  1. rollout:  sample one response per prompt from the policy (KV-cache decoding)
  2. forward:  old log-probs and entropy (policy), reference log-probs, values (critic), all with the
               training code path, so the first minibatch's ratio is exactly 1 on the CPU (on a GPU, GEMM
               and attention kernels chosen by batch shape make it ~1e-3 off under bf16 autocast)
  3. score:    the reward function or model gives one scalar per response
  4. rewards:  r_t = -beta * KL_t on every token, + score on the last real token (ppo_core.algo)
  5. GAE:      advantages and returns; advantages whitened over the batch
  6. update:   ppo_epochs over shuffled minibatches, gradient accumulation over micro-batches, clipped
               surrogate for the policy, clipped value loss for the critic, AdamW, warm-up + cosine LR
Every per-token tensor is [B, R] over response tokens with `response_mask` 1 on tokens the policy produced.
"""
import contextlib
import math
import os
import random
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

import ppo_kernels

from . import algo, checkpoint, lora
from . import distributed as dist
from .config import ConfigError, PPOConfig, build_config, load_toml, parse_cli
from .generate import generate
from .model import CheckpointError, load_model, load_score_model
from .rewards import RewardError, load_prompts, make_reward_source
from .tasks import PromptStream, eval_prompts
from .runlog import ListPromptStream
from .tokenizer import load_tokenizer
from . import runlog

IGNORE_INDEX = -100  # label of a position that has no log-prob (padding, tool output)
DEMO_CHECKPOINT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo", "reverse-demo")


# ---------------------------------------------------------------------------- log-probs and values

def response_labels(input_ids, response_mask, prompt_len):
    """The response tokens as labels [B, R]: IGNORE_INDEX where response_mask is 0."""
    return input_ids[:, prompt_len:].masked_fill(response_mask == 0, IGNORE_INDEX)


def response_head(policy, input_ids, attention_mask, prompt_len, head):
    """Run `policy` and hand head(hidden [B, R, H], lm_head_weight [V, H]) the hidden states at the positions
    that predict the response tokens; returns what `head` returns. The head runs inside the model's forward
    (CausalLM's head_fn), so it sees the full LM-head weight under FSDP and goes through DDP's wrapper."""
    return policy(input_ids, attention_mask, head_fn=lambda hidden, weight: head(hidden[:, prompt_len - 1 : -1], weight))


def response_logprobs(policy, input_ids, attention_mask, response_mask, prompt_len, temperature, fused):
    """Log-probs and entropy of the response tokens under `policy`, at `temperature`.

    input_ids, attention_mask: [B, P+R]; response_mask: [B, R]. Returns logprobs, entropy: [B, R] float32
    (0 where response_mask is 0). `fused` picks ppo_kernels' LM-head-fused path, which never forms the
    [B*R, V] logits; the reference path is log_softmax + gather on full logits.
    """
    labels = response_labels(input_ids, response_mask, prompt_len)  # [B, R]

    def head(hidden, weight):
        B, R, H = hidden.shape
        if fused:
            logprobs, entropy = ppo_kernels.linear_token_logprobs(
                hidden.reshape(B * R, H), weight, labels.reshape(B * R), temperature=temperature, return_entropy=True)
            return logprobs.view(B, R), entropy.view(B, R)
        logits = torch.nn.functional.linear(hidden, weight)  # [B, R, V]
        return ppo_kernels.token_logprobs_reference(logits, labels, temperature=temperature, return_entropy=True)

    return response_head(policy, input_ids, attention_mask, prompt_len, head)


def reference_logprobs(policy, reference, *args):
    """response_logprobs under the reference. With LoRA and no separate reference checkpoint the reference
    IS the policy object: its base weights, computed with the adapters switched off."""
    if reference is policy:
        with lora.adapters_disabled(policy):
            return response_logprobs(policy, *args)
    return response_logprobs(reference, *args)


def response_values(critic, input_ids, attention_mask, prompt_len):
    """V(s_t) for each response token t: the critic read at the position that predicts it. -> [B, R]."""
    return critic(input_ids, attention_mask)[:, prompt_len - 1 : -1]


@dataclass
class Rollout:
    """One iteration's experience. B sequences, prompts left-padded to P, responses right-padded to R."""

    prompts: list
    responses: list
    input_ids: torch.Tensor  # [B, P+R] int64
    attention_mask: torch.Tensor  # [B, P+R] bool
    response_mask: torch.Tensor  # [B, R] float32
    prompt_len: int
    old_logprobs: torch.Tensor  # [B, R]
    ref_logprobs: torch.Tensor  # [B, R]
    old_values: torch.Tensor  # [B, R]
    entropy: torch.Tensor  # [B, R]
    scores: torch.Tensor  # [B]
    rewards: torch.Tensor = None  # [B, R]
    advantages: torch.Tensor = None  # [B, R]
    returns: torch.Tensor = None  # [B, R]


def render_prompt(tokenizer, prompt, cfg):
    """The text the policy sees: the prompt itself, or a user turn in the policy's chat template. One
    rendering for every stage: rollout, old/reference log-probs and values all read these token ids."""
    if cfg.chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False, enable_thinking=cfg.enable_thinking)
    return prompt


def encode_prompts(tokenizer, prompts, device, pad_to=0, cfg=None):
    """Left-pad the encoded (rendered) prompts to max(longest, pad_to). -> ids [B, P] int64, mask [B, P] bool.
    `prompts` may also be lists of token ids already encoded."""
    encoded = [p if isinstance(p, list) else tokenizer.encode(render_prompt(tokenizer, p, cfg) if cfg else p)
               for p in prompts]
    P = max(pad_to, max(len(e) for e in encoded))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (P - len(e)) + e for e in encoded], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (P - len(e)) + [1] * len(e) for e in encoded], dtype=torch.bool, device=device)
    return ids, mask


def sample_responses(policy, tokenizer, prompts, cfg, generator, greedy=False, pad_to=0, rows=None, encoded=None,
                     autocast=contextlib.nullcontext):
    """Generate one response per prompt. -> (prompt ids, prompt mask, response tokens [B, R],
    response_mask [B, R], decoded responses, ended_with_eos [B]).

    rows = (offset, global_batch): these prompts are rows offset.. of a batch of global_batch spread
    over processes; sampling noise is drawn for the global batch, so every row gets the same tokens
    whatever the number of processes. encoded: the prompts' token ids, when the caller has them already.
    autocast: the training passes' autocast; decoding under it reads bf16 copies of the weights (autocast's
    cast cache keeps one per call) and keeps a bf16 KV cache (generate picks the autocast dtype)."""
    device = next(policy.parameters()).device
    prompt_ids, prompt_mask = encode_prompts(tokenizer, encoded or prompts, device, pad_to, cfg)
    eos = tokenizer.eos_token_id
    with dist.gathered(policy), autocast():  # FSDP: full weights for the whole call, no collective per step
        tokens = generate(policy, prompt_ids, cfg.max_new_tokens, attention_mask=prompt_mask,
                          temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, greedy=greedy,
                          eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, generator=generator,
                          global_rows=rows, cuda_graph=cfg.cuda_graph and device.type == "cuda")
    # The response is every token up to and including the first EOS.
    is_eos = tokens == eos
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0  # [B, R] strictly after the first EOS
    response_mask = (~after_eos).float()
    ended_with_eos = is_eos.any(-1)
    texts = [tokenizer.decode(row[m.bool()].tolist()) for row, m in zip(tokens.cpu(), response_mask.cpu())]
    return prompt_ids, prompt_mask, tokens, response_mask, texts, ended_with_eos


@torch.no_grad()
def collect_rollout(policy, reference, critic, tokenizer, prompts, reward_source, cfg, generator, autocast,
                    pad_to, rows, encoded):
    policy.eval()
    prompt_ids, prompt_mask, tokens, response_mask, responses, ended = sample_responses(
        policy, tokenizer, prompts, cfg, generator, pad_to=pad_to, rows=rows, encoded=encoded, autocast=autocast)
    input_ids = torch.cat([prompt_ids, tokens], dim=1)  # [B, P+R]
    attention_mask = torch.cat([prompt_mask, response_mask.bool()], dim=1)
    P = prompt_ids.shape[1]
    old_logprobs, entropy, ref_logprobs, old_values = [], [], [], []
    for mb in micro_batches(len(prompts), cfg.micro_batch_size):
        args = (input_ids[mb], attention_mask[mb], response_mask[mb], P, cfg.temperature, cfg.fused_kernels)
        with autocast():
            lp, ent = response_logprobs(policy, *args)
            ref_lp, _ = reference_logprobs(policy, reference, *args)
            v = response_values(critic, input_ids[mb], attention_mask[mb], P)
        old_logprobs.append(lp), entropy.append(ent), ref_logprobs.append(ref_lp), old_values.append(v.float())
    with autocast():  # a reward model scores under the same autocast as the policy passes
        scores = reward_source(prompts, responses)  # [B] float32 (on the CPU for a reward function), validated
    return Rollout(prompts, responses, input_ids, attention_mask, response_mask, P,
                   torch.cat(old_logprobs), torch.cat(ref_logprobs), torch.cat(old_values) * response_mask,
                   torch.cat(entropy), scores.to(input_ids.device)), ended


def micro_batches(n, size, order=None):
    """Index tensors of consecutive chunks of `order` (default 0..n-1, on the CPU: indexing a CUDA tensor with a
    CPU index tensor is allowed and copies the index over)."""
    order = torch.arange(n) if order is None else order
    return [order[i : i + size] for i in range(0, n, size)]


# ---------------------------------------------------------------------------- advantages

def compute_advantages(rollout: Rollout, cfg: PPOConfig, kl_coef: float, ended_with_eos):
    """Scores -> per-token rewards (KL in the reward when cfg.kl_in_reward) -> GAE -> whitened advantages.

    Computed on the GLOBAL batch (all processes' rows gathered), so batch statistics — reward and
    advantage whitening — are those of the whole batch; each process keeps its own rows."""
    lo, hi = dist.rank() * len(rollout.prompts), (dist.rank() + 1) * len(rollout.prompts)
    mask = dist.all_gather_rows(rollout.response_mask)  # [B_global, R]
    old_logprobs, ref_logprobs = dist.all_gather_rows(rollout.old_logprobs), dist.all_gather_rows(rollout.ref_logprobs)
    old_values, ended = dist.all_gather_rows(rollout.old_values), dist.all_gather_rows(ended_with_eos)
    scores = algo.normalize_scores(dist.all_gather_rows(rollout.scores), whiten=cfg.whiten_rewards, clip=cfg.reward_clip or None)
    kl = algo.kl_estimate(old_logprobs, ref_logprobs, "k1") if cfg.kl_in_reward else None
    rewards = algo.per_token_rewards(scores, mask, kl=kl, kl_coef=kl_coef, ended_with_eos=ended,
                                     missing_eos_penalty=cfg.missing_eos_penalty or None)
    advantages, returns = algo.gae(rewards, old_values, mask, cfg.gamma, cfg.lam)
    if cfg.whiten_advantages:
        advantages = algo.masked_whiten(advantages, mask)
    rollout.rewards, rollout.advantages, rollout.returns = rewards[lo:hi], advantages[lo:hi], returns[lo:hi]


# ---------------------------------------------------------------------------- the update

def lr_at(step, total_steps, cfg: PPOConfig):
    """Linear warm-up for warmup_steps, then cosine decay to min_lr_ratio of the peak at the last step."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def policy_objective(policy, ids, am, rm, old_logp, advantages, ref_logp, P, cfg, kl_coef, agg):
    """The policy's minibatch loss on one micro-batch: the clipped surrogate (+ kl_coef * KL to the reference
    when the KL is a loss term, cfg.kl_in_reward = False). Returns (loss to backward, pg_loss, kl_loss, stats).

    fused: ppo_kernels.linear_policy_loss forms the log-probs, the loss and its gradients from the hidden
    states and the LM head tile by tile, never the [B*R, V] logits; otherwise full logits, log_softmax +
    gather and ppo_core.algo, the plain reference a researcher edits."""
    labels = response_labels(ids, rm, P)
    kl_in_loss = not cfg.kl_in_reward
    clip = dict(clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip or None)

    def fused_head(hidden, weight):
        return ppo_kernels.linear_policy_loss(
            hidden, weight, labels, old_logp, advantages, rm, temperature=cfg.temperature, **clip, **agg,
            ref_logp=ref_logp if kl_in_loss else None, kl_coef=kl_coef if kl_in_loss else 0.0, kl_kind=cfg.kl_loss_kind)

    def reference_head(hidden, weight):
        logits = torch.nn.functional.linear(hidden, weight)  # [B, R, V]
        return ppo_kernels.token_logprobs_reference(logits, labels, temperature=cfg.temperature)

    if cfg.fused_kernels:
        loss, stats = response_head(policy, ids, am, P, fused_head)
        logp = stats["logp"]  # detached; the KL term's value is reported separately below
    else:
        logp = response_head(policy, ids, am, P, reference_head)
        loss, stats = algo.policy_loss(logp, old_logp, advantages, rm, **clip, **agg)
    kl_loss = torch.zeros((), device=ids.device)  # on the loop's device: stacked with the losses below
    if kl_in_loss:
        kl_loss = algo.aggregate(algo.kl_estimate(logp, ref_logp, cfg.kl_loss_kind), rm, agg["agg"],
                                 num_tokens=agg["num_tokens"], num_seqs=agg["num_seqs"])
        if not cfg.fused_kernels:
            loss = loss + kl_coef * kl_loss
    pg_loss = loss.detach() - kl_coef * kl_loss.detach() if kl_in_loss else loss.detach()
    return loss, pg_loss, kl_loss.detach(), stats


def ppo_update(policy, critic, rollout: Rollout, cfg: PPOConfig, kl_coef, generator, autocast, step_fn):
    """`ppo_epochs` passes of minibatch updates over one rollout; returns the mean of each statistic.

    Minibatches are drawn from one permutation of the GLOBAL batch (the same on every process); each
    process runs the rows of the minibatch that it holds, in micro-batches, and the gradients are summed
    across processes (DDP / FSDP, on the last micro-batch) before `step_fn` steps the optimizers.
    `policy` and `critic` are what training forwards run through (a DDP wrapper, an FSDP or plain model).

    Host reads. On a GPU every read of a device value on the host (.item(), .tolist(), bool()) waits for all
    the work queued before it, so the loop makes them in one place per optimizer step: `minibatch_gradients`
    only queues device work; then `_read_step_stats` copies the step's statistics to the host in one read,
    and `step_fn` (Optimizers.step) reads whether the gradients are finite. Shuffling and row selection are
    host work on CPU tensors, no device read. (The model's forward reads whether the attention mask has
    padding: ppo_core.model.) tests/test_fake_cuda.py runs this on fake CUDA tensors and checks where reads are."""
    policy.train(), critic.train()
    b = rollout.input_ids.shape[0]
    world, lo = dist.world_size(), dist.rank() * b
    stats: dict[str, list] = {}
    first_ratio_dev = None
    for epoch in range(cfg.ppo_epochs):
        order = torch.randperm(b * world, generator=generator)  # [b*world] CPU, the same on every process
        for start in range(0, b * world, cfg.minibatch_size):
            mb_global = order[start : start + cfg.minibatch_size]
            mb = mb_global[(mb_global >= lo) & (mb_global < lo + b)] - lo  # this process's rows (CPU)
            # Every process runs as many micro-batches as the busiest one (their gradient reductions pair
            # up); each process knows every process's rows from the shared permutation, so no collective.
            rows_per_process = (mb_global[None, :] // b == torch.arange(world)[:, None]).sum(-1)  # [world] CPU
            n_micro = -(-int(rows_per_process.max()) // cfg.micro_batch_size)  # ceil
            sums, counts, first_ratio = minibatch_gradients(policy, critic, rollout, mb, n_micro, cfg, kl_coef, autocast)
            values, tokens, ratio_dev = _read_step_stats(sums, counts, first_ratio)
            for name, value, per_token in zip(MB_STATS, values, MB_STATS_PER_TOKEN):
                _append(stats, name, value / tokens if per_token else value)
            if first_ratio_dev is None:
                first_ratio_dev = ratio_dev
            step_fn()
    out = {k: float(np.mean(v)) for k, v in stats.items()}  # means over the optimizer steps
    if cfg.kl_in_reward:
        out.pop("policy/kl_loss")
    # rank 0's first micro-batch: old log-probs come from the training code path, so every process's first ratio
    # is exactly 1 on the CPU; on a GPU, kernels picked by batch shape (cuBLAS, SDPA) make it ~1e-3 off under bf16
    out["policy/first_ratio_max_dev"] = first_ratio_dev
    return out


def minibatch_gradients(policy, critic, rollout: Rollout, mb, n_micro, cfg: PPOConfig, kl_coef, autocast):
    """Forward and backward of policy and critic over this process's rows `mb` (a CPU index tensor) of one
    minibatch, in n_micro micro-batches (a process short of rows runs one of its rows with no token in the loss:
    gradient 0); gradients accumulate in .grad and are summed over processes on the last micro-batch.

    Queues device work only, never a host read (see ppo_update). Returns device tensors: sums [len(MB_STATS)]
    float64 over the micro-batches and, after the all-reduce, the processes (losses already normalised by the
    global counts; per-token statistics times the token count), counts [2] (the minibatch's global token and
    sequence counts) and first_ratio_dev [] (max |ratio - 1| of the first micro-batch)."""
    device, P = rollout.input_ids.device, rollout.prompt_len
    mask_mb = rollout.response_mask[mb]
    # Global denominators for the whole minibatch, so the micro-batch losses of all processes
    # add up to the minibatch's loss (and their gradients to its gradient).
    counts = dist.all_reduce_sum(torch.stack([mask_mb.sum(), (mask_mb.sum(-1) > 0).sum().float()]))  # [2]
    agg = dict(agg=cfg.loss_agg, num_tokens=counts[0], num_seqs=counts[1])
    chunks = micro_batches(len(mb), cfg.micro_batch_size, mb)
    sums = torch.zeros(len(MB_STATS), dtype=torch.float64, device=device)  # on the device of the losses added in
    first_ratio_dev = None
    for i in range(n_micro):
        rows = chunks[i] if i < len(chunks) else torch.zeros(1, dtype=torch.long)
        ids, am, rm = rollout.input_ids[rows], rollout.attention_mask[rows], rollout.response_mask[rows]
        if i >= len(chunks):
            rm = torch.zeros_like(rm)
        last = i == n_micro - 1
        with dist.gradient_sync(policy, last):
            with autocast():
                loss, pg_loss, kl_loss, pg_stats = policy_objective(
                    policy, ids, am, rm, rollout.old_logprobs[rows], rollout.advantages[rows],
                    rollout.ref_logprobs[rows], P, cfg, kl_coef, agg)
            loss.backward()
        with dist.gradient_sync(critic, last):
            with autocast():
                values = response_values(critic, ids, am, P).float()
            vf_loss, vf_stats = algo.value_loss(values, rollout.old_values[rows], rollout.returns[rows], rm,
                                                clip=cfg.value_clip or None, **agg)
            vf_loss.backward()
        if first_ratio_dev is None:
            first_ratio_dev = pg_stats["ratio_max_dev"].detach()
        n = rm.sum()
        sums += torch.stack([pg_loss, vf_loss.detach(), kl_loss, pg_stats["clipfrac"] * n,
                             pg_stats["approx_kl"] * n, vf_stats["clipfrac"] * n]).double()
    return dist.all_reduce_sum(sums), counts, first_ratio_dev


def _read_step_stats(sums, counts, first_ratio_dev):
    """The optimizer step's one read of statistics: sums, the token count and the first ratio's deviation
    copied to the host together. -> (MB_STATS values, max(tokens, 1), first_ratio_dev) as Python floats."""
    host = torch.cat([sums, counts[:1].double(), first_ratio_dev.double().view(1)]).tolist()
    return host[: len(MB_STATS)], max(host[-2], 1.0), host[-1]


MB_STATS = ("policy/loss", "value/loss", "policy/kl_loss", "policy/clipfrac", "policy/approx_kl", "value/clipfrac")
MB_STATS_PER_TOKEN = (False, False, False, True, True, True)


def _append(stats, key, value):
    stats.setdefault(key, []).append(value)


class NonFiniteUpdates(RuntimeError):
    """Too many consecutive updates had a non-finite loss or gradient."""


class Optimizers:
    """AdamW for policy and critic, the LR schedule, and the skip-on-NaN rule, stepped together."""

    def __init__(self, policy, critic, cfg: PPOConfig, total_steps, log):
        def adamw(model, lr):
            return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                                     betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, weight_decay=cfg.weight_decay)

        self.cfg, self.total_steps, self.log = cfg, total_steps, log
        self.models = (policy, critic)
        self.policy_opt, self.critic_opt = adamw(policy, cfg.lr), adamw(critic, cfg.critic_lr)
        self.step_count = 0
        self.consecutive_skips = 0
        self.skipped = 0
        self.iteration = 0

    def zero_grad(self):
        for m in self.models:
            m.zero_grad(set_to_none=True)

    def step(self):
        """Clip the (already summed over processes) gradients and step both optimizers — unless any gradient is not
        finite, in which case no weight is touched and the update is counted as skipped."""
        cfg = self.cfg
        scale = lr_at(self.step_count, self.total_steps, cfg)
        norms = []
        for model in self.models:
            params = [p for p in model.parameters() if p.requires_grad and p.grad is not None]
            if params:
                norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf"))
                norms.append(dist.local_tensor(norm).float())
        finite = not norms or bool(torch.isfinite(torch.stack(norms)).all())  # the step's one host read of the gradients
        if finite:
            for opt, lr in ((self.policy_opt, cfg.lr), (self.critic_opt, cfg.critic_lr)):
                for group in opt.param_groups:
                    group["lr"] = lr * scale
                opt.step()
            self.consecutive_skips = 0
        else:
            self.skipped += 1
            self.consecutive_skips += 1
            self.log.info(f"iteration {self.iteration}: non-finite loss or gradient, update {self.step_count} skipped")
            if self.consecutive_skips >= cfg.max_skipped_updates:
                raise NonFiniteUpdates(f"stopping at iteration {self.iteration}: {self.consecutive_skips} consecutive "
                                       f"updates had a non-finite loss or gradient (max_skipped_updates={cfg.max_skipped_updates})")
        self.zero_grad()
        self.step_count += 1


# ---------------------------------------------------------------------------- evaluation

@torch.no_grad()
def evaluate(policy, tokenizer, prompts, reward_source, cfg, seed, greedy=False, autocast=contextlib.nullcontext):
    """Mean reward over held-out prompts, sampling with the run's temperature (or greedily), under the
    rollouts' autocast.

    Each evaluation uses its own generator seeded from `seed`, so before and after see the same noise.
    Every process evaluates the same prompts (the held-out set is small)."""
    policy.eval()
    generator = torch.Generator(device=next(policy.parameters()).device).manual_seed(seed)
    scores = []
    for rows in micro_batches(len(prompts), 256):
        batch = [prompts[i] for i in rows.tolist()]
        *_, texts, _ = sample_responses(policy, tokenizer, batch, cfg, generator, greedy=greedy, autocast=autocast)
        with autocast():
            scores.append(reward_source(batch, texts))
    return float(torch.cat(scores).mean())


# ---------------------------------------------------------------------------- the run

def resolve_device_dtype(cfg):
    device = "cuda" if cfg.device == "auto" and torch.cuda.is_available() else ("cpu" if cfg.device == "auto" else cfg.device)
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("config key 'device' is 'cuda' but no CUDA device is available")
    param_dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    use_autocast = device == "cuda" and cfg.dtype == "auto"  # fp32 master weights, bf16 compute
    return device, param_dtype, use_autocast


def spread_over_processes(policy, critic, reference, reward_source, cfg, device):
    """With more than one process: FSDP2-shard (cfg.parallel='fsdp') or DDP-wrap the trainable models, and
    shard the frozen ones too with cfg.shard_frozen under FSDP. Returns the modules that training forwards
    run through: (policy, critic) themselves, or their DDP wrappers. One process: the models as they are.
    Every way computes in the precision of one process: the parameters' dtype, under the run's autocast."""
    if dist.world_size() == 1:
        return policy, critic
    if cfg.parallel == "ddp":
        return dist.replicate(policy, device), dist.replicate(critic, device)
    for model in (policy, critic):
        dist.shard(model, device, cpu_offload=cfg.cpu_offload)
    if cfg.shard_frozen:
        if reference is not policy:
            dist.shard(reference, device)
        if hasattr(reward_source, "model"):  # its score() reads the head outside forward: keep the root whole
            dist.shard(reward_source.model, device, root=False)
    return policy, critic


class StopRequested(Exception):
    """SIGTERM / SIGINT arrived; the run saved a checkpoint and stops."""


def run(cfg: PPOConfig, resume_from=None):
    """Train; returns the summary dict. Raises ConfigError / CheckpointError / RewardError on bad input.

    resume_from: a run directory to continue (its config is `cfg`). Without it, a run directory that
    already holds a checkpoint of the same config is resumed too (what a retried container needs)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    policy_path = cfg.policy or DEMO_CHECKPOINT
    device_kind, param_dtype, use_autocast = resolve_device_dtype(cfg)
    rank, world, device = dist.init(device_kind)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if use_autocast else contextlib.nullcontext
    if cfg.rollout_batch_size % world or cfg.minibatch_size % world:
        raise ConfigError(f"config keys 'rollout_batch_size' and 'minibatch_size' must be multiples of the number of processes ({world})")

    # Everything that can be wrong with the input is checked before the run directory is touched.
    tokenizer = load_tokenizer(policy_path)
    policy = load_model(policy_path, dtype=param_dtype, device=device)
    critic = load_score_model(cfg.critic or policy_path, dtype=param_dtype, device=device)
    if cfg.lora_rank:
        init = torch.Generator(device=device).manual_seed(cfg.seed + 2)  # the same adapters on every process
        for model in (policy, critic):
            lora.add_lora(model, cfg.lora_rank, cfg.lora_alpha or None, generator=init)
    if cfg.lora_rank and not cfg.reference:
        reference = policy  # the base weights: the policy with its adapters off (see reference_logprobs)
    else:
        reference = load_model(cfg.reference or policy_path, dtype=param_dtype, device=device).eval().requires_grad_(False)
    if tokenizer.vocab_size > policy.args.vocab_size:
        raise CheckpointError(f"tokenizer of {policy_path} has {tokenizer.vocab_size} tokens but the model's vocabulary is {policy.args.vocab_size}")
    policy.model.gradient_checkpointing = critic.model.gradient_checkpointing = cfg.gradient_checkpointing
    reward_source = make_reward_source(cfg, device, param_dtype)
    policy_train, critic_train = spread_over_processes(policy, critic, reference, reward_source, cfg, device)
    sharded = dist.is_sharded(policy)
    train_prompts = load_prompts(cfg.prompts_file) if cfg.prompts_file else []
    if cfg.eval_prompts_file:
        held_out = load_prompts(cfg.eval_prompts_file)[: cfg.eval_size]
    elif train_prompts:  # hold out the file's last eval_size prompts (at most half of it)
        n_eval = min(cfg.eval_size, len(train_prompts) // 2)
        if n_eval < 1:
            raise ConfigError(f"config key 'prompts_file': {cfg.prompts_file} needs at least 2 prompts to hold one out, "
                              f"or give eval_prompts_file")
        train_prompts, held_out = train_prompts[:-n_eval], train_prompts[-n_eval:]
    else:
        held_out = eval_prompts(cfg.eval_size, cfg.seed)
    stream = ListPromptStream(train_prompts, cfg.seed) if train_prompts else PromptStream(cfg.seed, held_out)
    context = policy.args.max_position_embeddings
    for p in held_out + train_prompts:
        n = len(tokenizer.encode(render_prompt(tokenizer, p, cfg)))
        if n + cfg.max_new_tokens > context:
            raise ConfigError(f"prompt {p[:40]!r} has {n} tokens; with max_new_tokens={cfg.max_new_tokens} it exceeds "
                              f"the model's context of {context} tokens")
    run_dir = runlog.RunDir.open(cfg, policy_path, resume_from)
    ckpt = run_dir.latest_checkpoint()
    # Metrics of iterations after the checkpoint belong to work a resume redoes.
    run_dir.truncate_metrics(0 if ckpt is None else checkpoint.checkpoint_step(ckpt))
    log = runlog.Logger(run_dir, progress=cfg.progress)

    random.seed(cfg.seed), np.random.seed(cfg.seed), torch.manual_seed(cfg.seed)
    sample_gen = torch.Generator(device=device).manual_seed(cfg.seed)
    shuffle_gen = torch.Generator().manual_seed(cfg.seed + 1)
    generators = {"sample": sample_gen, "shuffle": shuffle_gen}
    steps_per_iter = cfg.ppo_epochs * (cfg.rollout_batch_size // cfg.minibatch_size)
    opts = Optimizers(policy, critic, cfg, cfg.iterations * steps_per_iter, log)
    kl_ctl = (algo.AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon) if cfg.kl_target > 0
              else algo.FixedKLController(cfg.kl_coef))
    eval_seed = cfg.seed + 12345
    t0 = time.perf_counter()

    start_iter, state = 0, {}
    if ckpt is not None:
        state = checkpoint.load_training_state(ckpt, policy=policy, critic=critic, policy_opt=opts.policy_opt,
                                               critic_opt=opts.critic_opt, generators=generators, sharded=sharded)
        start_iter = state["step"]
        opts.step_count, opts.skipped = state["optimizer_step"], state["skipped_updates"]
        kl_ctl.load_state_dict(state["kl_controller"])
        stream.load_state_dict(state["prompt_stream"])
        log.info(f"resuming {run_dir.path} from {ckpt} (iteration {start_iter} of {cfg.iterations})")
    else:
        log.info(f"policy {policy_path} ({policy.num_parameters() / 1e6:.2f}M params), {world} process(es) on {device}, "
                 f"run dir {run_dir.path}")
        state["eval_before"] = evaluate(policy, tokenizer, held_out, reward_source, cfg, eval_seed, autocast=autocast)
        state["eval_before_greedy"] = evaluate(policy, tokenizer, held_out, reward_source, cfg, eval_seed, greedy=True, autocast=autocast)
        log.info(f"eval before training: reward {state['eval_before']:.4f} (T={cfg.temperature}), "
                 f"{state['eval_before_greedy']:.4f} (greedy) [{time.perf_counter() - t0:.1f}s]")
        state["last_kl"] = 0.0

    def save(step):
        return run_dir.save_checkpoint(step, sharded=sharded, policy=policy, critic=critic, tokenizer=tokenizer,
                                       policy_opt=opts.policy_opt, critic_opt=opts.critic_opt, generators=generators,
                                       state={"optimizer_step": opts.step_count, "skipped_updates": opts.skipped,
                                              "kl_controller": kl_ctl.state_dict(), "prompt_stream": stream.state_dict(),
                                              "eval_before": state["eval_before"], "eval_before_greedy": state["eval_before_greedy"],
                                              "last_kl": state["last_kl"]},
                                       keep=cfg.keep_checkpoints)

    b = cfg.rollout_batch_size // world
    with runlog.StopSignals() as stop:
        for it in log.iterations(cfg.iterations, start_iter):
            opts.iteration = it + 1
            t_roll = time.perf_counter()
            # Sampling noise is a function of (seed, iteration) alone, so processes that finish decoding
            # at different steps, and a resumed run, all draw the same noise for every row.
            sample_gen.manual_seed(cfg.seed * 1_000_003 + it)
            global_prompts = stream.next_batch(cfg.rollout_batch_size)
            prompts = global_prompts[rank * b : (rank + 1) * b]
            encoded = [tokenizer.encode(render_prompt(tokenizer, p, cfg)) for p in prompts]  # rendered once
            pad_to = dist.all_reduce_max_int(max(len(e) for e in encoded))  # the same prompt width on every process
            rollout, ended = collect_rollout(policy, reference, critic, tokenizer, prompts, reward_source, cfg,
                                             sample_gen, autocast, pad_to, (rank * b, cfg.rollout_batch_size), encoded)
            kl_coef = kl_ctl.value
            compute_advantages(rollout, cfg, kl_coef, ended)
            t_train = time.perf_counter()
            train_stats = ppo_update(policy_train, critic_train, rollout, cfg, kl_coef, shuffle_gen, autocast, opts.step)
            t_end = time.perf_counter()

            # Metrics over the global batch.
            mask = dist.all_gather_rows(rollout.response_mask)
            old_lp, ref_lp = dist.all_gather_rows(rollout.old_logprobs), dist.all_gather_rows(rollout.ref_logprobs)
            scores = dist.all_gather_rows(rollout.scores)
            kl_tok = algo.kl_estimate(old_lp, ref_lp, "k1")
            state["last_kl"] = algo.masked_mean(kl_tok, mask).item()
            kl_ctl.update(state["last_kl"], cfg.rollout_batch_size)
            metrics = {
                "step": it + 1,
                "reward/mean": scores.mean().item(),
                "reward/std": scores.std().item() if len(scores) > 1 else 0.0,
                "kl/mean": state["last_kl"],
                "kl/k3_mean": algo.masked_mean(algo.kl_estimate(old_lp, ref_lp, "k3"), mask).item(),
                "kl/seq_mean": (kl_tok * mask).sum(-1).mean().item(),
                "kl/coef": kl_coef,
                "entropy/mean": algo.masked_mean(dist.all_gather_rows(rollout.entropy), mask).item(),
                **train_stats,
                "train/skipped_updates": opts.skipped,
                "value/explained_var": algo.explained_variance(
                    dist.all_gather_rows(rollout.old_values), dist.all_gather_rows(rollout.returns), mask),
                "response/length_mean": mask.sum(-1).mean().item(),
                "response/eos_frac": dist.all_gather_rows(ended).float().mean().item(),
                "lr": cfg.lr * lr_at(max(0, opts.step_count - 1), opts.total_steps, cfg),
                "time/rollout_s": t_train - t_roll,
                "time/train_s": t_end - t_train,
                "tokens_per_s": mask.sum().item() / max(t_end - t_roll, 1e-9),
            }
            if cfg.eval_every and (it + 1) % cfg.eval_every == 0 and it + 1 < cfg.iterations:
                metrics["eval/reward"] = evaluate(policy, tokenizer, held_out, reward_source, cfg, eval_seed, autocast=autocast)
            log.metrics(metrics)
            last = it + 1 == cfg.iterations
            if last or stop.requested or (cfg.save_every and (it + 1) % cfg.save_every == 0):
                save(it + 1)
            if stop.requested and not last:
                log.close()
                raise StopRequested(f"received {stop.requested}; saved checkpoint at iteration {it + 1} of {cfg.iterations} "
                                    f"in {run_dir.path}; continue with: ppo-train --resume {run_dir.path}")

    after = evaluate(policy, tokenizer, held_out, reward_source, cfg, eval_seed, autocast=autocast)
    after_greedy = evaluate(policy, tokenizer, held_out, reward_source, cfg, eval_seed, greedy=True, autocast=autocast)
    summary = {
        "eval/reward_before": state["eval_before"],
        "eval/reward_after": after,
        "eval/greedy_reward_before": state["eval_before_greedy"],
        "eval/greedy_reward_after": after_greedy,
        "eval/prompts": len(held_out),
        "kl/final": state["last_kl"],
        "iterations": cfg.iterations,
        "skipped_updates": opts.skipped,
        "checkpoint": os.path.join(run_dir.path, "checkpoints", f"step-{cfg.iterations}"),
        "time/total_s": time.perf_counter() - t0,
    }
    run_dir.write_summary(summary)
    log.close()
    log.table(summary, cfg)
    return summary


USAGE = """usage: ppo-train [--config FILE.toml] [--KEY=VALUE ...]
       ppo-train --resume RUN_DIR

Runs PPO. With no arguments: the default job (the shipped demo checkpoint, the 'reverse' task, CPU).
Every field of ppo_core.config.PPOConfig is a --KEY; see configs/default.toml for all of them.
--resume continues a run from its latest checkpoint, with the config saved in RUN_DIR/config.json."""


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    try:
        own, overrides = parse_cli(argv)
        resume = own.get("resume")
        if resume:
            if "config" in own or set(overrides) - {"progress"}:
                raise ConfigError("--resume takes the run's own config from RUN_DIR/config.json; "
                                  "it cannot be combined with --config or other keys (only --progress)")
            cfg = build_config(runlog.RunDir.saved_config(resume), overrides)
        else:
            toml_values = load_toml(own["config"]) if "config" in own else {}
            cfg = build_config(toml_values, overrides, own.get("config", ""))
        run(cfg, resume_from=resume)
    except (ConfigError, CheckpointError, RewardError, runlog.RunDirError, FileNotFoundError) as e:
        print(f"ppo-train: error: {e}", file=sys.stderr)
        return 2
    except NonFiniteUpdates as e:
        print(f"ppo-train: error: {e}", file=sys.stderr)
        return 1
    except StopRequested as e:
        print(f"ppo-train: {e}", file=sys.stderr)
        return 143
    finally:
        dist.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
