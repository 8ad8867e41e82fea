"""The training loop: rollout -> score -> rewards -> advantages -> ppo_epochs of clipped updates.

    ppo-train                                    # the default job: the shipped demo checkpoint, CPU, ~30 s
    ppo-train --adv_estimator=grpo --n_samples_per_prompt=8       # GRPO on the same task, no critic
    ppo-train --config configs/default.toml --iterations=100 --out runs/mine

One iteration (Ouyang et al. 2022; Huang et al. 2024, "The N+ implementation details of RLHF with PPO"):
  1. rollout:  sample n_samples_per_prompt responses per prompt from the policy (KV-cache decoding); with
               filter_groups, groups whose scores are all equal are replaced by fresh ones (DAPO)
  2. score:    the reward function or model gives one scalar per response
  3. forward:  old log-probs and entropy (policy), reference log-probs, values (critic, if any), all with the
               training code path, so the first minibatch's ratio is 1 up to the order of a log-sum-exp (measured
               as policy/first_ratio_max_dev: 0.0 for the CPU demo, ~1e-6 at large vocabularies, ~1e-3 on a GPU
               under bf16 autocast, where GEMM and attention kernels are chosen by batch shape)
  4. rewards:  penalties on the raw score (missing EOS, overlong), optional whitening and clipping; then
               r_t = -beta * KL_t on every token, + the score on the last real token (ppo_core.algo)
  5. advantages, by cfg.adv_estimator (ppo_core.algo): GAE with the critic's values, whitened over the batch;
               or critic-free: the group-relative baselines of GRPO / Dr. GRPO / RLOO / REINFORCE++-baseline
               over each response's total reward, or REINFORCE++'s whitened discounted return
  6. update:   ppo_epochs over shuffled minibatches (stopped early past target_kl), gradient accumulation over
               micro-batches, the clipped surrogate (PPO's token ratio or GSPO's sequence ratio, + entropy bonus,
               + KL loss term) for the policy, the clipped value loss for the critic, AdamW, warm-up + cosine LR;
               the first critic_warmup iterations train the critic alone
Every per-token tensor is [B, R] over response tokens with `response_mask` 1 on tokens the policy produced.
"""
import contextlib
import dataclasses
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

import ppo_kernels

from . import algo, checkpoint, lora
from . import distributed as dist
from .config import ConfigError, PPOConfig, build_config, help_text, to_dict, load_toml, parse_cli, rollout_rows, uses_critic
from .generate import generate
from .model import CheckpointError, load_model, load_score_model
from .precision import loss_paths, precision_line, resolve_precision
from .prompts import PromptsError, RowStream, columns_of, load_rows, prompt_text, split_held_out, where_is
from .remote_reward import RewardUnavailable
from .reward_source import make_reward_source
from .rewards import RewardError
from .tasks import PromptStream, eval_prompts
from .tokenizer import UnknownTextError, load_tokenizer
from . import runlog, tracking

IGNORE_INDEX = -100  # label of a position that has no log-prob (padding, tool output)
DEMO_CHECKPOINT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo", "reverse-demo")
DEMO_CHECKPOINTS = {"reverse": DEMO_CHECKPOINT, "arith": os.path.join(os.path.dirname(DEMO_CHECKPOINT), "arith-demo")}


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
    group: torch.Tensor  # [B] int64: the prompt's index in the global batch; a prompt's n responses share it
    rewards: torch.Tensor = None  # [B, R]
    advantages: torch.Tensor = None  # [B, R]
    returns: torch.Tensor = None  # [B, R]
    sampled: "Sampled" = None  # what was sampled and scored: the rows, texts and reward components (for samples.jsonl)


def render_prompt(tokenizer, prompt, cfg):
    """The text the policy sees: the prompt itself, or a user turn in the policy's chat template. One
    rendering for every stage: rollout, old/reference log-probs and values all read these token ids."""
    if cfg.chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False, enable_thinking=cfg.enable_thinking)
    return prompt


def prompt_token_ids(tokenizer, prompt, cfg):
    """The prompt's token ids as the policy sees them. prompt: a string or a row (ppo_core.prompts): a chat row's
    "messages" and, with cfg.chat_template, a plain prompt as a user turn, are rendered with the chat template (which
    writes any BOS itself); a plain prompt otherwise gets what the tokenizer's post-processor adds (a BOS for
    Llama-family checkpoints), as transformers' tokenizer(text) does."""
    if isinstance(prompt, dict) and "messages" in prompt:
        return tokenizer.encode(tokenizer.apply_chat_template(prompt["messages"], add_generation_prompt=True, tokenize=False,
                                                              enable_thinking=cfg.enable_thinking))
    prompt = prompt["prompt"] if isinstance(prompt, dict) else prompt
    if cfg is not None and cfg.chat_template:
        return tokenizer.encode(render_prompt(tokenizer, prompt, cfg))
    ids, plain = tokenizer.encode_prompt(prompt), tokenizer.encode(prompt)
    if ids[-1:] != plain[-1:] and ids[-1:] and ids[-1] in tokenizer.eos_token_ids:
        ids = ids[:-1]  # a post-processor that also appends EOS ("<s> $A </s>") would end the text the policy continues
    return ids


def encode_prompts(tokenizer, prompts, device, pad_to=0, cfg=None):
    """Left-pad the encoded (rendered) prompts to max(longest, pad_to). -> ids [B, P] int64, mask [B, P] bool.
    `prompts` may also be lists of token ids already encoded."""
    encoded = [p if isinstance(p, list) else prompt_token_ids(tokenizer, p, cfg) for p in prompts]
    P = max(pad_to, max(len(e) for e in encoded))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (P - len(e)) + e for e in encoded], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (P - len(e)) + [1] * len(e) for e in encoded], dtype=torch.bool, device=device)
    return ids, mask


def sample_responses(policy, tokenizer, prompts, cfg, generator, greedy=False, pad_to=0, rows=None, encoded=None,
                     autocast=contextlib.nullcontext, decode_logprobs=False):
    """Generate one response per prompt. -> (prompt ids, prompt mask, response tokens [B, R],
    response_mask [B, R], decoded responses, ended_with_eos [B]), and with decode_logprobs a seventh item: the
    decoding pass's (log-probs, entropy) [B, R] float32 of the sampled tokens (0 after the response).

    rows = (offset, global_batch): these prompts are rows offset.. of a batch of global_batch spread
    over processes; sampling noise is drawn for the global batch, so every row gets the same tokens
    whatever the number of processes. encoded: the prompts' token ids, when the caller has them already.
    autocast: the training passes' autocast; decoding under it reads bf16 copies of the weights (autocast's cast
    cache on a GPU, oneDNN-packed bf16 copies on the CPU) and keeps its KV cache in the dtype attention computes in
    (bf16 on a GPU, fp32 on the CPU: ppo_core.generate)."""
    device = next(policy.parameters()).device
    prompt_ids, prompt_mask = encode_prompts(tokenizer, encoded or prompts, device, pad_to, cfg)
    eos = tokenizer.eos_token_ids  # every stop token: the tokenizer's EOS and generation_config.json's
    with dist.gathered(policy), autocast():  # FSDP: full weights for the whole call, no collective per step
        out = generate(policy, prompt_ids, cfg.max_new_tokens, attention_mask=prompt_mask,
                       temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, greedy=greedy,
                       eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, generator=generator,
                       global_rows=rows, cuda_graph=cfg.cuda_graph and device.type == "cuda",
                       return_logprobs=decode_logprobs, return_entropy=decode_logprobs)
    tokens = out[0] if decode_logprobs else out
    # The response is every token up to and including the first EOS.
    is_eos = torch.isin(tokens, torch.tensor(eos, device=tokens.device))
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0  # [B, R] strictly after the first EOS
    response_mask = (~after_eos).float()
    ended_with_eos = is_eos.any(-1)
    texts = [tokenizer.decode(row[m.bool()].tolist()) for row, m in zip(tokens.cpu(), response_mask.cpu())]
    if decode_logprobs:
        return prompt_ids, prompt_mask, tokens, response_mask, texts, ended_with_eos, (out[1], out[2])
    return prompt_ids, prompt_mask, tokens, response_mask, texts, ended_with_eos


@dataclass
class Sampled:
    """Responses sampled and scored, before any log-prob: B rows, prompts left-padded to P, responses right-padded."""

    rows: list  # the prompt rows (ppo_core.prompts): "prompt" or "messages", and extra columns
    prompts: list  # the raw prompt texts the reward function saw
    responses: list
    prompt_ids: torch.Tensor  # [B, P] int64
    prompt_mask: torch.Tensor  # [B, P] bool
    tokens: torch.Tensor  # [B, R] int64
    response_mask: torch.Tensor  # [B, R] float32
    ended: torch.Tensor  # [B] bool, the response ends with an EOS
    scores: torch.Tensor  # [B] float32
    reward_metrics: dict  # name -> [B] float32: each reward function's score and its own metrics
    reward_texts: dict = field(default_factory=dict)  # name -> B str: a judge's rationales (samples.jsonl)
    generate_s: float = 0.0  # seconds spent decoding them (the rest of the rollout: reward and scoring forwards)
    decode_logprobs: torch.Tensor | None = None  # [B, R] float32, the decoding pass's (cfg.old_logprobs_from_rollout)
    decode_entropy: torch.Tensor | None = None  # [B, R] float32, likewise


@torch.no_grad()
def sample_and_score(policy, tokenizer, prompt_rows, reward_source, cfg, generator, autocast, pad_to, rows, encoded):
    """One response per row of `prompt_rows`, and its score from the reward source (under the policy passes'
    autocast). The reward sees the raw prompt text (not the chat rendering) and the rows' extra columns."""
    policy.eval()
    t0 = time.perf_counter()
    prompt_ids, prompt_mask, tokens, response_mask, responses, ended, *decoded = sample_responses(
        policy, tokenizer, prompt_rows, cfg, generator, pad_to=pad_to, rows=rows, encoded=encoded, autocast=autocast,
        decode_logprobs=cfg.old_logprobs_from_rollout)
    decode_logprobs, decode_entropy = decoded[0] if decoded else (None, None)
    generate_s = time.perf_counter() - t0  # sample_responses ends with a host read of the tokens: nothing in flight
    texts = [prompt_text(r) for r in prompt_rows]
    with autocast():  # a reward model scores under the same autocast as the policy passes
        # [B] float32 (on the CPU for a reward function), validated; and each component's per-sample values
        scores, reward_metrics = reward_source(texts, responses, columns_of(prompt_rows))
    device = tokens.device
    numbers = {k: v.float().to(device) for k, v in reward_metrics.items() if isinstance(v, torch.Tensor)}
    words = {k: list(v) for k, v in reward_metrics.items() if not isinstance(v, torch.Tensor)}  # lists of B str
    return Sampled(prompt_rows, texts, responses, prompt_ids, prompt_mask, tokens, response_mask, ended, scores.to(device),
                   numbers, words, generate_s, decode_logprobs, decode_entropy)


@torch.no_grad()
def rollout_forward(policy, reference, critic, sampled: Sampled, group, cfg, autocast) -> Rollout:
    """The training code path over sampled responses: old and reference log-probs, entropy and values (zeros
    without a critic), in micro-batches. group: [B] int64, each row's prompt id in the global batch.
    With cfg.old_logprobs_from_rollout the old log-probs and entropy are the decoding pass's: no policy forward."""
    policy.eval()
    input_ids = torch.cat([sampled.prompt_ids, sampled.tokens], dim=1)  # [B, P+R]
    attention_mask = torch.cat([sampled.prompt_mask, sampled.response_mask.bool()], dim=1)
    response_mask, P = sampled.response_mask, sampled.prompt_ids.shape[1]
    old_logprobs, entropy, ref_logprobs, old_values = [], [], [], []
    for mb in micro_batches(len(sampled.prompts), cfg.micro_batch_size):
        args = (input_ids[mb], attention_mask[mb], response_mask[mb], P, cfg.temperature, cfg.fused_kernels)
        with autocast():
            if cfg.old_logprobs_from_rollout:
                lp, ent = sampled.decode_logprobs[mb] * response_mask[mb], sampled.decode_entropy[mb] * response_mask[mb]
            else:
                lp, ent = response_logprobs(policy, *args)
            ref_lp, _ = reference_logprobs(policy, reference, *args)
            v = response_values(critic, input_ids[mb], attention_mask[mb], P) if critic is not None else torch.zeros_like(lp)
        old_logprobs.append(lp), entropy.append(ent), ref_logprobs.append(ref_lp), old_values.append(v.float())
    return Rollout(sampled.prompts, sampled.responses, input_ids, attention_mask, response_mask, P,
                   torch.cat(old_logprobs), torch.cat(ref_logprobs), torch.cat(old_values) * response_mask,
                   torch.cat(entropy), sampled.scores, group.to(input_ids.device), sampled=sampled)


def sample_rows(sampled: Sampled) -> list:
    """What samples.jsonl and the trackers' table show of each row: prompt, response, reward (the score), each reward
    component, and the row's extra columns."""
    components = {k: v.tolist() for k, v in sampled.reward_metrics.items()}
    components.update(sampled.reward_texts)
    scores = sampled.scores.tolist()
    return [{"prompt": text, "response": response, "reward": scores[i], **{k: v[i] for k, v in components.items()},
             **{k: v for k, v in row.items() if k not in ("prompt", "messages")}}
            for i, (row, text, response) in enumerate(zip(sampled.rows, sampled.prompts, sampled.responses))]


def collect_rollout(policy, reference, critic, tokenizer, prompts, reward_source, cfg, generator, autocast,
                    pad_to, rows, encoded, group):
    """Sample and score one response per row (a prompt row or a plain prompt string), then run the training code path
    over them. -> (Rollout, ended [B])."""
    prompts = [p if isinstance(p, dict) else {"prompt": p} for p in prompts]
    sampled = sample_and_score(policy, tokenizer, prompts, reward_source, cfg, generator, autocast, pad_to, rows, encoded)
    return rollout_forward(policy, reference, critic, sampled, group, cfg, autocast), sampled.ended


def needs_reference_responses(cfg) -> bool:
    """A pairwise judge, in this process (cfg.judge) or on a reward server (cfg.reward_url with judge_mode pairwise),
    compares each response with a reference response: from the prompt column cfg.judge_reference_column, else
    sampled from the frozen reference policy (with_reference_responses) and sent along as that column."""
    return cfg.judge_mode == "pairwise" and bool(cfg.judge or cfg.reward_url)


@torch.no_grad()
def with_reference_responses(rows, policy, reference, tokenizer, cfg, seed, autocast) -> list:
    """Copies of the prompt rows (dicts) whose cfg.judge_reference_column is missing, given one response sampled from
    the frozen reference policy (LoRA without a reference checkpoint: the policy with its adapters off) at the run's
    temperature, with a generator seeded by `seed` alone: every process samples the same (global) rows alike, and a
    resumed run samples them again identically. Rows that have the column are kept as they are."""
    column = cfg.judge_reference_column
    missing = [i for i, row in enumerate(rows) if row.get(column) is None]
    if not missing:
        return rows
    model = policy if reference is policy else reference
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with lora.adapters_disabled(policy) if reference is policy else contextlib.nullcontext():
        *_, texts, _ = sample_responses(model, tokenizer, [rows[i] for i in missing], cfg, generator, autocast=autocast)
    out = list(rows)
    for i, text in zip(missing, texts):
        out[i] = {**rows[i], column: text}  # a copy: a prompt file's row is drawn again in later passes
    return out


def iteration_rollout(it, stream, policy, reference, critic, tokenizer, reward_source, cfg, generator, autocast):
    """Iteration `it`'s experience: rollout_batch_size prompts, each sampled n_samples_per_prompt times (a group of
    consecutive rows), scored; this process's rows of the global batch. With cfg.filter_groups, groups whose
    scores are all equal are replaced by groups of further prompt batches (DAPO's dynamic sampling).
    -> (Rollout, ended [b], stats {"filter/...": float, reward components' means, "time/generate_s"})."""
    rank, world, n = dist.rank(), dist.world_size(), cfg.n_samples_per_prompt
    rows_total = rollout_rows(cfg)
    b = rows_total // world
    local = slice(rank * b, (rank + 1) * b)
    kept, stats, batches = [], {}, cfg.filter_groups_max_batches if cfg.filter_groups else 1
    generate_s = 0.0
    for batch in range(batches):
        # Sampling noise is a function of (seed, iteration, batch) alone, so processes that finish decoding
        # at different steps, and a resumed run, all draw the same noise for every row.
        generator.manual_seed(cfg.seed * 1_000_003 + it + batch * 1_000_000_007)
        prompt_batch = [p if isinstance(p, dict) else {"prompt": p} for p in stream.next_batch(cfg.rollout_batch_size)]
        if needs_reference_responses(cfg):  # one reference response per prompt, shared by its n rows
            prompt_batch = with_reference_responses(prompt_batch, policy, reference, tokenizer, cfg,
                                                    cfg.seed * 1_000_003 + it + batch * 1_000_000_007 + 1, autocast)
        global_prompts = [row for row in prompt_batch for _ in range(n)]  # [rows_total] a prompt's n rows in a row
        prompts = global_prompts[local]
        encoded = [prompt_token_ids(tokenizer, p, cfg) for p in prompts]  # rendered once
        pad_to = dist.all_reduce_max_int(max(len(e) for e in encoded))  # the same prompt width on every process
        sampled = sample_and_score(policy, tokenizer, prompts, reward_source, cfg, generator, autocast, pad_to,
                                   (rank * b, rows_total), encoded)
        generate_s += sampled.generate_s
        if not cfg.filter_groups:
            group = torch.arange(rows_total)[local] // n  # [b] the prompt's index in the global batch
            stats.update(reward_means(sampled.reward_metrics), **{"time/generate_s": generate_s})
            return rollout_forward(policy, reference, critic, sampled, group, cfg, autocast), sampled.ended, stats
        everything = gather_sampled(sampled, global_prompts, tokenizer, cfg)
        varied = algo.varied_groups(everything.scores, torch.arange(rows_total, device=everything.scores.device) // n)
        kept.append((everything, varied))
        n_varied = sum(int(v.sum()) for _, v in kept) // n
        stats = {"filter/batches": batch + 1, "filter/kept_groups_frac": n_varied / (cfg.rollout_batch_size * (batch + 1))}
        if n_varied >= cfg.rollout_batch_size:
            break
    # The first rollout_batch_size varied groups, in sampling order; a batch still short after
    # filter_groups_max_batches is topped up with dropped groups (whose group-relative advantages are 0).
    rows = [(i, j) for i, (_, v) in enumerate(kept) for j in v.nonzero().squeeze(1).tolist()]
    rows += [(i, j) for i, (_, v) in enumerate(kept) for j in (~v).nonzero().squeeze(1).tolist()]
    rows = rows[:rows_total][local]
    sampled = select_sampled([e for e, _ in kept], rows, tokenizer)
    group = torch.arange(rows_total)[local] // n
    stats.update(reward_means(sampled.reward_metrics), **{"time/generate_s": generate_s})
    return rollout_forward(policy, reference, critic, sampled, group, cfg, autocast), sampled.ended, stats


def reward_means(reward_metrics) -> dict:
    """Each reward component's mean over the global batch, for metrics.jsonl."""
    return {name: dist.all_gather_rows(values).mean().item() for name, values in sorted(reward_metrics.items())}


def gather_sampled(sampled: Sampled, global_prompts, tokenizer, cfg) -> Sampled:
    """Every process's rows of `sampled`, in rank order (responses padded to max_new_tokens first)."""
    pad = cfg.max_new_tokens - sampled.tokens.shape[1]
    tokens = torch.nn.functional.pad(sampled.tokens, (0, pad), value=tokenizer.pad_token_id)
    response_mask = torch.nn.functional.pad(sampled.response_mask, (0, pad))
    parts = [dist.all_gather_rows(t) for t in (sampled.prompt_ids, sampled.prompt_mask, tokens, response_mask,
                                               sampled.ended, sampled.scores)]
    responses = [tokenizer.decode(row[m.bool()].tolist()) for row, m in zip(parts[2].cpu(), parts[3].cpu())]
    metrics = {k: dist.all_gather_rows(v) for k, v in sampled.reward_metrics.items()}
    # a judge's rationales travel only within one process (texts are not gathered): kept in a 1-process run
    words = sampled.reward_texts if dist.world_size() == 1 else {}
    decoded = [None, None]
    if sampled.decode_logprobs is not None:  # cfg.old_logprobs_from_rollout
        decoded = [dist.all_gather_rows(torch.nn.functional.pad(t, (0, pad)))
                   for t in (sampled.decode_logprobs, sampled.decode_entropy)]
    return Sampled(global_prompts, [prompt_text(r) for r in global_prompts], responses, *parts, metrics, words,
                   sampled.generate_s, *decoded)


def select_sampled(batches: list, rows: list, tokenizer) -> Sampled:
    """Rows (batch index, row index) of several Sampled batches as one; prompts left-padded to the widest."""
    P = max(s.prompt_ids.shape[1] for s in batches)
    def left_pad(t, value):  # [B, p] -> [B, P]
        return torch.nn.functional.pad(t, (P - t.shape[1], 0), value=value)
    picked = [(batches[i], j) for i, j in rows]
    return Sampled([s.rows[j] for s, j in picked], [s.prompts[j] for s, j in picked], [s.responses[j] for s, j in picked],
                   torch.stack([left_pad(s.prompt_ids, tokenizer.pad_token_id)[j] for s, j in picked]),
                   torch.stack([left_pad(s.prompt_mask, False)[j] for s, j in picked]),
                   torch.stack([s.tokens[j] for s, j in picked]), torch.stack([s.response_mask[j] for s, j in picked]),
                   torch.stack([s.ended[j] for s, j in picked]), torch.stack([s.scores[j] for s, j in picked]),
                   {k: torch.stack([s.reward_metrics[k][j] for s, j in picked]) for k in batches[0].reward_metrics},
                   {k: [s.reward_texts[k][j] for s, j in picked] for k in batches[0].reward_texts},
                   sum(s.generate_s for s in batches),
                   *([torch.stack([getattr(s, name)[j] for s, j in picked]) for name in ("decode_logprobs", "decode_entropy")]
                     if batches[0].decode_logprobs is not None else [None, None]))


def micro_batches(n, size, order=None):
    """Index tensors of consecutive chunks of `order` (default 0..n-1, on the CPU: indexing a CUDA tensor with a
    CPU index tensor is allowed and copies the index over)."""
    order = torch.arange(n) if order is None else order
    return [order[i : i + size] for i in range(0, n, size)]


# ---------------------------------------------------------------------------- advantages

def compute_advantages(rollout: Rollout, cfg: PPOConfig, kl_coef: float, ended_with_eos):
    """Scores -> per-token rewards (KL in the reward when cfg.kl_in_reward) -> advantages by cfg.adv_estimator.

    Computed on the GLOBAL batch (all processes' rows gathered), so batch statistics (reward and advantage
    whitening, a prompt's group of responses) are those of the whole batch; each process keeps its own rows.
    Penalties (missing EOS, overlong) apply to the raw scores, before whitening and clipping."""
    lo, hi = dist.rank() * len(rollout.prompts), (dist.rank() + 1) * len(rollout.prompts)
    mask = dist.all_gather_rows(rollout.response_mask)  # [B_global, R]
    old_logprobs, ref_logprobs = dist.all_gather_rows(rollout.old_logprobs), dist.all_gather_rows(rollout.ref_logprobs)
    old_values, ended = dist.all_gather_rows(rollout.old_values), dist.all_gather_rows(ended_with_eos)
    scores, group = dist.all_gather_rows(rollout.scores), dist.all_gather_rows(rollout.group)
    if cfg.missing_eos_penalty:
        scores = torch.where(ended, scores, scores - cfg.missing_eos_penalty)
    if cfg.overlong_buffer:
        scores = scores + cfg.overlong_penalty * algo.overlong_penalty(mask.sum(-1), cfg.max_new_tokens, cfg.overlong_buffer)
    scores = algo.normalize_scores(scores, whiten=cfg.whiten_rewards, clip=cfg.reward_clip or None)
    kl = algo.kl_estimate(old_logprobs, ref_logprobs, cfg.kl_reward_kind) if cfg.kl_in_reward else None
    rewards = algo.per_token_rewards(scores, mask, kl=kl, kl_coef=kl_coef)  # [B, R]
    if cfg.adv_estimator == "gae":
        advantages, returns = algo.gae(rewards, old_values, mask, cfg.gamma, cfg.lam)
        if cfg.whiten_advantages:
            advantages = algo.masked_whiten(advantages, mask)
    else:
        returns = algo.discounted_returns(rewards, mask, cfg.gamma)  # Monte Carlo return; a target for no critic
        if cfg.adv_estimator == "reinforce_pp":
            advantages = algo.masked_whiten(returns, mask)
        else:
            # each response's total reward (its score, minus its KL penalty with kl_in_reward) against its group's
            advantages = algo.group_advantages(rewards.sum(-1), group, mask, cfg.adv_estimator)
    rollout.rewards, rollout.advantages, rollout.returns = rewards[lo:hi], advantages[lo:hi], returns[lo:hi]


# ---------------------------------------------------------------------------- the update

def lr_at(step, total_steps, cfg: PPOConfig):
    """The LR multiplier at optimizer step `step` (0-based) of total_steps: linear warm-up to the peak at step
    warmup_steps - 1, then cosine decay that reaches min_lr_ratio at the last step, total_steps - 1."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = (step + 1 - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def policy_objective(policy, ids, am, rm, old_logp, advantages, ref_logp, P, cfg, kl_coef, agg):
    """The policy's minibatch loss on one micro-batch: the clipped surrogate (cfg.policy_loss_kind: PPO's token ratio
    or GSPO's sequence ratio), + kl_coef * KL to the reference when the KL is a loss term (cfg.kl_in_reward = False),
    - entropy_coef * entropy. Returns (loss to backward, pg_loss, kl_loss, stats).

    fused: ppo_kernels.linear_policy_loss forms the log-probs, the loss and its gradients from the hidden
    states and the LM head tile by tile, never the [B*R, V] logits (GSPO, whose ratio spans a whole sequence, runs
    on ppo_kernels.linear_token_logprobs' fused log-probs and entropy, with their own backward); otherwise full
    logits, log_softmax + gather and ppo_core.algo, the plain reference a researcher edits."""
    labels = response_labels(ids, rm, P)
    kl_in_loss = not cfg.kl_in_reward
    clip = dict(clip_low=cfg.clip_low, clip_high=cfg.clip_high)
    want_entropy = cfg.entropy_coef != 0.0

    def fused_head(hidden, weight):
        return ppo_kernels.linear_policy_loss(
            hidden, weight, labels, old_logp, advantages, rm, temperature=cfg.temperature, **clip,
            dual_clip=cfg.dual_clip or None, **agg, ref_logp=ref_logp if kl_in_loss else None,
            kl_coef=kl_coef if kl_in_loss else 0.0, kl_kind=cfg.kl_loss_kind, entropy_coef=cfg.entropy_coef)

    def logprob_head(hidden, weight):  # -> (log-probs [B, R], entropy [B, R] or None), with gradient
        if cfg.fused_kernels:
            B, R, H = hidden.shape
            out = ppo_kernels.linear_token_logprobs(hidden.reshape(B * R, H), weight, labels.reshape(B * R),
                                                    temperature=cfg.temperature, return_entropy=want_entropy)
            return (out[0].view(B, R), out[1].view(B, R)) if want_entropy else (out.view(B, R), None)
        logits = torch.nn.functional.linear(hidden, weight)  # [B, R, V]
        out = ppo_kernels.token_logprobs_reference(logits, labels, temperature=cfg.temperature, return_entropy=want_entropy)
        return out if want_entropy else (out, None)

    if cfg.fused_kernels and cfg.policy_loss_kind == "ppo":
        loss, stats = response_head(policy, ids, am, P, fused_head)  # the KL and entropy terms are inside
        logp = stats["logp"]  # detached; the KL term's value is reported separately below
    else:
        logp, entropy = response_head(policy, ids, am, P, logprob_head)
        if cfg.policy_loss_kind == "gspo":
            loss, stats = algo.gspo_policy_loss(logp, old_logp, advantages, rm, **clip, num_seqs=agg["num_seqs"])
        else:
            loss, stats = algo.policy_loss(logp, old_logp, advantages, rm, **clip, dual_clip=cfg.dual_clip or None, **agg)
        if want_entropy:
            # L = L^CLIP - c_H * H: the bonus keeps the policy from collapsing early
            loss = loss - cfg.entropy_coef * algo.aggregate(entropy, rm, agg["agg"], num_tokens=agg["num_tokens"],
                                                            num_seqs=agg["num_seqs"])
            stats["entropy"] = algo.masked_mean(entropy.detach(), rm)
    kl_loss = torch.zeros((), device=ids.device)  # on the loop's device: stacked with the losses below
    if kl_in_loss:
        kl_loss = algo.aggregate(algo.kl_estimate(logp.detach(), ref_logp, cfg.kl_loss_kind), rm, agg["agg"],
                                 num_tokens=agg["num_tokens"], num_seqs=agg["num_seqs"])
        if not (cfg.fused_kernels and cfg.policy_loss_kind == "ppo"):
            loss = loss + kl_coef * algo.aggregate(algo.kl_estimate(logp, ref_logp, cfg.kl_loss_kind), rm, agg["agg"],
                                                   num_tokens=agg["num_tokens"], num_seqs=agg["num_seqs"])
    # reported: the surrogate (minus the entropy bonus when on) without the KL term, which is reported apart
    pg_loss = loss.detach() - kl_coef * kl_loss if kl_in_loss else loss.detach()
    return loss, pg_loss, kl_loss.detach(), stats


def ppo_update(policy, critic, rollout: Rollout, cfg: PPOConfig, kl_coef, generator, autocast, step_fn, train_policy=True):
    """`ppo_epochs` passes of minibatch updates over one rollout; returns the mean of each statistic.

    Minibatches are drawn from one permutation of the GLOBAL batch (the same on every process); each
    process runs the rows of the minibatch that it holds, in micro-batches, and the gradients are summed
    across processes (DDP / FSDP, on the last micro-batch) before `step_fn` steps the optimizers.
    `policy` and `critic` are what training forwards run through (a DDP wrapper, an FSDP or plain model);
    critic is None for the critic-free estimators. train_policy=False (critic warm-up) trains the critic alone.
    With cfg.target_kl, the iteration stops after the first step whose approx KL(old || new) exceeds it.

    Host reads. On a GPU every read of a device value on the host (.item(), .tolist(), bool()) waits for all
    the work queued before it, so the loop makes them in one place per optimizer step: `minibatch_gradients`
    only queues device work; then `_read_step_stats` copies the step's statistics to the host in one read,
    and `step_fn` (Optimizers.step) reads the gradient norms (are they finite?). Shuffling and row selection are
    host work on CPU tensors, no device read. (The model's forward reads whether the attention mask has
    padding: ppo_core.model.) tests/test_fake_cuda.py runs this on fake CUDA tensors and checks where reads are."""
    policy.train()
    if critic is not None:
        critic.train()
    b = rollout.input_ids.shape[0]
    world, lo = dist.world_size(), dist.rank() * b
    stats: dict[str, list] = {}
    first_ratio_dev, ratio_max_dev, steps, stopped = None, 0.0, 0, False
    for epoch in range(cfg.ppo_epochs):
        order = torch.randperm(b * world, generator=generator)  # [b*world] CPU, the same on every process
        for start in range(0, b * world, cfg.minibatch_size):
            mb_global = order[start : start + cfg.minibatch_size]
            mb = mb_global[(mb_global >= lo) & (mb_global < lo + b)] - lo  # this process's rows (CPU)
            # Every process runs as many micro-batches as the busiest one (their gradient reductions pair
            # up); each process knows every process's rows from the shared permutation, so no collective.
            rows_per_process = (mb_global[None, :] // b == torch.arange(world)[:, None]).sum(-1)  # [world] CPU
            n_micro = -(-int(rows_per_process.max()) // cfg.micro_batch_size)  # ceil
            sums, counts, ratio_devs = minibatch_gradients(policy, critic, rollout, mb, n_micro, cfg, kl_coef, autocast,
                                                           train_policy)
            values, tokens, (first_dev, max_dev) = _read_step_stats(sums, counts, ratio_devs)
            for name, value, per_token in zip(MB_STATS, values, MB_STATS_PER_TOKEN):
                _append(stats, name, value / tokens if per_token else value)
            if first_ratio_dev is None:
                first_ratio_dev = first_dev
            ratio_max_dev = max(ratio_max_dev, max_dev)
            for name, norm in step_fn(train_policy).items():
                _append(stats, name, norm)
            steps += 1
            # Early stop (Spinning Up's PPO): the policy has moved as far from the sampling policy as allowed
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
        # the processes' first micro-batches: old log-probs come from the training code path, so every process's first ratio
        # is 1 up to the order of the log-sum-exp (bit-exact for the CPU demo: ~1e-6 at large vocabularies); on a GPU,
        # kernels picked by batch shape (cuBLAS, SDPA) make it ~1e-3 off under bf16 autocast
        out["policy/first_ratio_max_dev"] = first_ratio_dev
    return out


def _unused_stats(cfg: PPOConfig, has_critic, train_policy):
    """The MB_STATS and norms that this configuration does not compute."""
    unused = []
    if not train_policy:
        unused += [n for n in MB_STATS + ("policy/grad_norm",) if n.startswith("policy/")]
    else:
        if cfg.kl_in_reward:
            unused.append("policy/kl_loss")
        if not cfg.dual_clip or cfg.policy_loss_kind == "gspo":
            unused.append("policy/dual_clipfrac")
        if not cfg.entropy_coef:
            unused.append("policy/entropy")
    if not has_critic:
        unused += [n for n in MB_STATS + ("value/grad_norm",) if n.startswith("value/")]
    return unused


def minibatch_gradients(policy, critic, rollout: Rollout, mb, n_micro, cfg: PPOConfig, kl_coef, autocast, train_policy=True):
    """Forward and backward of policy and critic over this process's rows `mb` (a CPU index tensor) of one
    minibatch, in n_micro micro-batches (a process short of rows runs one of its rows with no token in the loss:
    gradient 0); gradients accumulate in .grad and are summed over processes on the last micro-batch. No critic
    (critic None), or no policy (train_policy False, the critic warm-up): that model's passes are skipped.

    Queues device work only, never a host read (see ppo_update). Returns device tensors: sums [len(MB_STATS)]
    float64 over the micro-batches and, after the all-reduce, the processes (losses already normalised by the
    global counts; per-token statistics times the token count), counts [2] (the minibatch's global token and
    sequence counts) and ratio_devs [2] (max |ratio - 1| of the processes' first micro-batches, and of all of them)."""
    device, P = rollout.input_ids.device, rollout.prompt_len
    mask_mb = rollout.response_mask[mb]
    # Global denominators for the whole minibatch, so the micro-batch losses of all processes
    # add up to the minibatch's loss (and their gradients to its gradient).
    counts = dist.all_reduce_sum(torch.stack([mask_mb.sum(), (mask_mb.sum(-1) > 0).sum().float()]))  # [2]
    agg = dict(agg=cfg.loss_agg, num_tokens=counts[0], num_seqs=counts[1])
    chunks = micro_batches(len(mb), cfg.micro_batch_size, mb)
    sums = torch.zeros(len(MB_STATS), dtype=torch.float64, device=device)  # on the device of the losses added in
    zero = torch.zeros((), device=device)
    first_ratio_dev, max_ratio_dev = None, zero
    for i in range(n_micro):
        rows = chunks[i] if i < len(chunks) else torch.zeros(1, dtype=torch.long)
        ids, am, rm = rollout.input_ids[rows], rollout.attention_mask[rows], rollout.response_mask[rows]
        if i >= len(chunks):
            rm = torch.zeros_like(rm)
        last = i == n_micro - 1
        n = rm.sum()
        pg_loss = kl_loss = vf_loss = zero
        pg_stats, vf_stats = {}, {}
        if train_policy:
            with dist.gradient_sync(policy, last):
                with autocast():
                    loss, pg_loss, kl_loss, pg_stats = policy_objective(
                        policy, ids, am, rm, rollout.old_logprobs[rows], rollout.advantages[rows],
                        rollout.ref_logprobs[rows], P, cfg, kl_coef, agg)
                loss.backward()
            if first_ratio_dev is None:
                first_ratio_dev = pg_stats["ratio_max_dev"].detach()
            max_ratio_dev = torch.maximum(max_ratio_dev, pg_stats["ratio_max_dev"].detach())
        if critic is not None:
            with dist.gradient_sync(critic, last):
                with autocast():
                    values = response_values(critic, ids, am, P).float()
                vf_loss, vf_stats = algo.value_loss(values, rollout.old_values[rows], rollout.returns[rows], rm,
                                                    clip=cfg.value_clip or None, **agg)
                vf_loss.backward()
        sums += torch.stack([pg_loss, vf_loss.detach(), kl_loss] + [
            (vf_stats if name.startswith("value/") else pg_stats).get(_STAT_KEYS[name], zero) * n for name in MB_STATS[3:]
        ]).double()
    if first_ratio_dev is None:
        first_ratio_dev = zero
    return dist.all_reduce_sum(sums), counts, dist.all_reduce_max(torch.stack([first_ratio_dev, max_ratio_dev]))


def _read_step_stats(sums, counts, ratio_devs):
    """The optimizer step's one read of statistics: sums, the token count and the ratio deviations copied to the
    host together. -> (MB_STATS values, max(tokens, 1), (first ratio_max_dev, max ratio_max_dev)) as Python floats."""
    host = torch.cat([sums, counts[:1].double(), ratio_devs.double()]).tolist()
    return host[: len(MB_STATS)], max(host[len(MB_STATS)], 1.0), tuple(host[-2:])


# the statistics summed over micro-batches and processes; the last ones are masked means times the token count
MB_STATS = ("policy/loss", "value/loss", "policy/kl_loss", "policy/clipfrac", "policy/dual_clipfrac",
            "policy/approx_kl", "policy/ratio_mean", "policy/entropy", "value/clipfrac", "value/values_mean")
MB_STATS_PER_TOKEN = (False, False, False, True, True, True, True, True, True, True)
# their keys in policy_loss's / value_loss's stats
_STAT_KEYS = {"policy/clipfrac": "clipfrac", "policy/dual_clipfrac": "dual_clipfrac", "policy/approx_kl": "approx_kl",
              "policy/ratio_mean": "ratio_mean", "policy/entropy": "entropy", "value/clipfrac": "clipfrac",
              "value/values_mean": "values_mean"}


def _append(stats, key, value):
    stats.setdefault(key, []).append(value)


class NonFiniteUpdates(RuntimeError):
    """Too many consecutive updates had a non-finite loss or gradient."""


class Optimizers:
    """AdamW for policy and critic (None for the critic-free estimators), the LR schedules, and the skip-on-NaN rule,
    stepped together.

    Schedules run over optimizer steps: step k of iteration i is number i * steps_per_iter + k, so an iteration that
    stops early (target_kl) leaves the schedule on time. The critic's spans all iterations; the policy's starts after
    cfg.critic_warmup iterations (when it first steps) and spans the rest."""

    def __init__(self, policy, critic, cfg: PPOConfig, steps_per_iter, log):
        def adamw(model, lr):
            # fused: one kernel over all parameters (on this project's CPU, one thread, 135M parameters: 0.15 s a
            # step against the foreach default's 0.70 s); the same update, rounded in another order
            return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                                     betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
                                     fused=True)

        self.cfg, self.steps_per_iter, self.log = cfg, steps_per_iter, log
        self.policy, self.critic = policy, critic
        self.policy_opt = adamw(policy, cfg.lr)
        self.critic_opt = adamw(critic, cfg.critic_lr) if critic is not None else None
        self.step_count = 0
        self.consecutive_skips = 0
        self.skipped = 0
        self.iteration = 0

    def start_iteration(self, it):
        """Iteration `it` (0-based) begins: its first optimizer step is number it * steps_per_iter."""
        self.iteration = it + 1
        self.step_count = it * self.steps_per_iter

    def lr_scales(self, step):
        """(policy, critic) multipliers of the peak learning rates at optimizer step `step`."""
        cfg, warm = self.cfg, self.cfg.critic_warmup * self.steps_per_iter
        critic = lr_at(step, cfg.iterations * self.steps_per_iter, cfg)
        policy = lr_at(max(0, step - warm), (cfg.iterations - cfg.critic_warmup) * self.steps_per_iter, cfg)
        return policy, critic

    def zero_grad(self):
        for m in (self.policy, self.critic):
            if m is not None:
                m.zero_grad(set_to_none=True)

    def step(self, train_policy=True):
        """Clip the (already summed over processes) gradients and step the optimizers (the critic's alone when not
        train_policy) — unless any gradient is not finite, in which case no weight is touched and the update is
        counted as skipped. Returns the gradient norms before clipping: {"policy/grad_norm", "value/grad_norm"}."""
        cfg = self.cfg
        policy_scale, critic_scale = self.lr_scales(self.step_count)
        stepped = [("policy", self.policy, self.policy_opt, cfg.lr * policy_scale)] if train_policy else []
        if self.critic is not None:
            stepped.append(("value", self.critic, self.critic_opt, cfg.critic_lr * critic_scale))
        names, norms = [], []
        for name, model, _, _ in stepped:
            params = [p for p in model.parameters() if p.requires_grad and p.grad is not None]
            if params:
                norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf"))
                names.append(f"{name}/grad_norm"), norms.append(dist.local_tensor(norm).float())
        host_norms = torch.stack(norms).tolist() if norms else []  # the step's one host read of the gradients
        if all(math.isfinite(n) for n in host_norms):
            for _, _, opt, lr in stepped:
                for group in opt.param_groups:
                    group["lr"] = lr
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
        return dict(zip(names, host_norms))


# ---------------------------------------------------------------------------- evaluation

@torch.no_grad()
def evaluate(policy, tokenizer, prompts, reward_source, cfg, seed, greedy=False, autocast=contextlib.nullcontext):
    """Mean reward over held-out prompt rows, sampling with the run's temperature (or greedily), under the
    rollouts' autocast.

    Each evaluation uses its own generator seeded from `seed`, so before and after see the same noise.
    Every process evaluates the same prompts (the held-out set is small)."""
    policy.eval()
    generator = torch.Generator(device=next(policy.parameters()).device).manual_seed(seed)
    scores = []
    for rows in micro_batches(len(prompts), 256):
        batch = [prompts[i] for i in rows.tolist()]  # rows (ppo_core.prompts)
        *_, texts, _ = sample_responses(policy, tokenizer, batch, cfg, generator, greedy=greedy, autocast=autocast)
        with autocast():
            scores.append(reward_source([prompt_text(r) for r in batch], texts, columns_of(batch))[0])
    return float(torch.cat(scores).mean())


# ---------------------------------------------------------------------------- the run

def prompt_rows(cfg: PPOConfig):
    """(training rows, held-out rows, the training stream). Rows are dicts with a "prompt" or chat "messages" and any
    extra columns (ppo_core.prompts). From prompts_file (its last eval_size rows held out, at most half, unless
    eval_prompts_file is given), or the built-in task's seeded prompt stream and held-out set."""
    if not cfg.prompts_file:
        held_out = [{"prompt": p} for p in eval_prompts(cfg.eval_size, cfg.seed, cfg.task)]
        return [], held_out, PromptStream(cfg.seed, [r["prompt"] for r in held_out], cfg.task)
    try:
        train_rows = load_rows(cfg.prompts_file)
        if cfg.eval_prompts_file:
            held_out = load_rows(cfg.eval_prompts_file)[: cfg.eval_size]
        else:  # hold out the file's last eval_size prompts (at most half of it)
            train_rows, held_out = split_held_out(train_rows, cfg.eval_size)
    except PromptsError as e:
        raise ConfigError(f"config key 'prompts_file': {e}") from None
    return train_rows, held_out, RowStream(train_rows, cfg.seed)


def build_models(cfg: PPOConfig, policy_path, device, param_dtype):
    """Tokenizer, policy, critic (None for the critic-free estimators: nothing built, trained or saved) and the
    frozen reference: the policy itself when LoRA adapters switched off give the reference weights."""
    tokenizer = load_tokenizer(policy_path)
    policy = load_model(policy_path, dtype=param_dtype, device=device)
    critic = load_score_model(cfg.critic or policy_path, dtype=param_dtype, device=device) if uses_critic(cfg) else None
    trainable = [m for m in (policy, critic) if m is not None]
    if cfg.lora_rank:
        init = torch.Generator(device=device).manual_seed(cfg.seed + 2)  # the same adapters on every process
        for model in trainable:
            lora.add_lora(model, cfg.lora_rank, cfg.lora_alpha or None, generator=init)
    if cfg.lora_rank and not cfg.reference:
        reference = policy  # the base weights: the policy with its adapters off (see reference_logprobs)
    else:
        reference = load_model(cfg.reference or policy_path, dtype=param_dtype, device=device).eval().requires_grad_(False)
    if tokenizer.vocab_size > policy.args.vocab_size:
        raise CheckpointError(f"tokenizer of {policy_path} has {tokenizer.vocab_size} tokens but the model's vocabulary is {policy.args.vocab_size}")
    for model in trainable:
        model.model.gradient_checkpointing = cfg.gradient_checkpointing
    return tokenizer, policy, critic, reference


def spread_over_processes(policy, critic, reference, reward_source, cfg, device):
    """With more than one process: FSDP2-shard (cfg.parallel='fsdp') or DDP-wrap the trainable models, and
    shard the frozen ones too with cfg.shard_frozen under FSDP. Returns the modules that training forwards
    run through: (policy, critic) themselves, or their DDP wrappers. One process: the models as they are.
    Every way computes in the precision of one process: the parameters' dtype, under the run's autocast."""
    if dist.world_size() == 1:
        return policy, critic
    if cfg.parallel == "ddp":
        return dist.replicate(policy, device), dist.replicate(critic, device) if critic is not None else None
    for model in (policy, critic):
        if model is not None:
            dist.shard(model, device, cpu_offload=cfg.cpu_offload)
    if cfg.shard_frozen:
        if reference is not policy:
            dist.shard(reference, device)
        if hasattr(reward_source, "model"):  # its score() reads the head outside forward: keep the root whole
            dist.shard(reward_source.model, device, root=False)
    return policy, critic


class StopRequested(Exception):
    """SIGTERM / SIGINT arrived; the run saved a checkpoint and stops."""


class RewardServerDown(Exception):
    """A reward server stayed unreachable (ppo_core.remote_reward.RewardUnavailable); the run saved what it could and
    stops with exit status 3, to be continued with --resume once the server is back."""


EXIT_REWARD_SERVER_DOWN = 3  # not 2 (bad input): nothing is wrong with the run, it can continue


def resume_point(stream, generators, opts):
    """What a rollout advances and a checkpoint saves, as of now (the end of the previous iteration): the prompt
    stream's position, every RNG state and the optimizer step count. -> a function that puts them back, so that a
    checkpoint saved after a rollout the reward server failed resumes by redoing that iteration exactly. (Weights,
    optimizer moments and the KL controller change only after the rollout.)"""
    stream_state, step_count, iteration = stream.state_dict(), opts.step_count, opts.iteration
    generator_states = {name: g.get_state() for name, g in generators.items()}
    cpu_rng, cuda_rng = torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    python_rng, numpy_rng = random.getstate(), np.random.get_state()

    def restore():
        stream.load_state_dict(stream_state)
        for name, g in generators.items():
            g.set_state(generator_states[name])
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        random.setstate(python_rng), np.random.set_state(numpy_rng)
        opts.step_count, opts.iteration = step_count, iteration

    return restore


def run(cfg: PPOConfig, resume_from=None):
    """Train; returns the summary dict. Raises ConfigError / CheckpointError / RewardError on bad input.

    resume_from: a run directory to continue (its config is `cfg`). Without it, a run directory that
    already holds a checkpoint of the same config is resumed too (what a retried container needs)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    policy_path = cfg.policy or DEMO_CHECKPOINTS[cfg.task]  # the task's shipped SFT checkpoint
    precision = resolve_precision(cfg)
    param_dtype, autocast = precision.param_dtype, precision.autocast
    rank, world, device = dist.init(precision.device)
    if rollout_rows(cfg) % world or cfg.minibatch_size % world:
        raise ConfigError(f"config keys 'rollout_batch_size' (times n_samples_per_prompt) and 'minibatch_size' must be "
                          f"multiples of the number of processes ({world})")

    # Everything that can be wrong with the input is checked before the run directory is touched.
    runlog.check_out_dir(resume_from or cfg.out or "runs")  # without --out: runs/<policy>-<task>-<time> (RunDir.open)
    tokenizer, policy, critic, reference = build_models(cfg, policy_path, device, param_dtype)
    if cfg.chat_template:
        try:
            tokenizer.get_chat_template()
        except ValueError as e:  # none at all, or several and no default
            raise ConfigError(f"config key 'chat_template': the policy {policy_path} cannot render a chat: {e}; "
                              f"add chat_template.jinja, or drop --chat_template") from None
    reward_source = make_reward_source(cfg, device, param_dtype)
    eval_source = reward_source  # what scores the held-out evaluations: the training reward, or eval_reward_fn
    if cfg.eval_reward_fn:
        eval_source = make_reward_source(dataclasses.replace(cfg, reward_fn=[cfg.eval_reward_fn], reward_weights=[],
                                                             reward_model="", reward_url=[], judge=""))
    policy_train, critic_train = spread_over_processes(policy, critic, reference, reward_source, cfg, device)
    sharded = dist.is_sharded(policy)
    train_rows, held_out, stream = prompt_rows(cfg)
    columns = set(columns_of(train_rows + held_out)) | ({cfg.judge_reference_column} if needs_reference_responses(cfg) else set())
    reward_source.check_columns(sorted(columns))  # a column the reward needs is there (or will be sampled)
    if eval_source is not reward_source:
        eval_source.check_columns(sorted(set(columns_of(held_out))))
    clash = [c for c in columns_of(train_rows) if c in ("step", "response", "reward") or c.startswith("reward/")]
    if cfg.log_samples_every and clash:
        raise ConfigError(f"config key 'log_samples_every': the prompts file's column '{clash[0]}' would hide "
                          f"samples.jsonl's own '{clash[0]}'; rename that column")
    context = policy.args.max_position_embeddings
    for row in held_out + train_rows:
        try:
            n = len(prompt_token_ids(tokenizer, row, cfg))
        except UnknownTextError as e:  # a character the vocabulary lacks, and no unknown token: name its file and row
            files = {"prompts_file": cfg.prompts_file, "eval_prompts_file": cfg.eval_prompts_file}
            raise ConfigError(f"{where_is(row, files)}: {e}") from None
        if n + cfg.max_new_tokens > context:
            raise ConfigError(f"prompt {prompt_text(row)[:40]!r} has {n} tokens; with max_new_tokens={cfg.max_new_tokens} "
                              f"it exceeds the model's context of {context} tokens")
    run_dir = runlog.RunDir.open(cfg, policy_path, resume_from, precision.describe())
    ckpt = run_dir.latest_checkpoint()
    # Metrics of iterations after the checkpoint belong to work a resume redoes.
    done = 0 if ckpt is None else checkpoint.checkpoint_step(ckpt)
    run_dir.truncate_metrics(done)
    tracking.truncate_samples(run_dir.path, done)
    log = runlog.Logger(run_dir, progress=cfg.progress)
    if run_dir.replaced:  # a run that stopped before its first checkpoint, started again with another config
        log.info(run_dir.replaced)
    if run_dir.precision_changed:
        log.info(run_dir.precision_changed)
    tracker = tracking.Tracker(cfg.report_to, run_dir.path, {**to_dict(cfg), "policy": policy_path, "out": run_dir.path},
                               os.path.basename(os.path.normpath(run_dir.path)), resume_step=done)

    random.seed(cfg.seed), np.random.seed(cfg.seed), torch.manual_seed(cfg.seed)
    sample_gen = torch.Generator(device=device).manual_seed(cfg.seed)
    shuffle_gen = torch.Generator().manual_seed(cfg.seed + 1)
    generators = {"sample": sample_gen, "shuffle": shuffle_gen}
    steps_per_iter = cfg.ppo_epochs * (rollout_rows(cfg) // cfg.minibatch_size)
    opts = Optimizers(policy, critic, cfg, steps_per_iter, log)
    kl_ctl = (algo.AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon) if cfg.kl_target > 0
              else algo.FixedKLController(cfg.kl_coef))
    eval_seed = cfg.seed + 12345
    if needs_reference_responses(cfg) and eval_source is reward_source:  # the held-out rows' references, sampled once
        held_out = with_reference_responses(held_out, policy, reference, tokenizer, cfg, eval_seed + 1, autocast)
    t0 = time.perf_counter()

    start_iter, state = 0, {}

    def elapsed():  # seconds of this run so far: the segments before a resume, and this one
        return state.get("elapsed_s", 0.0) + time.perf_counter() - t0
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
        log.info(f"precision: {precision_line(precision)}")
        log.info(f"loss paths: {loss_paths(cfg, device)}")
        if cfg.prompts_file:  # the split of a prompts file is not obvious: a small file holds out half of itself
            where = f"from {cfg.eval_prompts_file}" if cfg.eval_prompts_file else "(the file's last rows, at most half)"
            log.info(f"prompts: {len(train_rows)} training rows from {cfg.prompts_file}, {len(held_out)} held out {where}")
        try:
            state["eval_before"] = evaluate(policy, tokenizer, held_out, eval_source, cfg, eval_seed, autocast=autocast)
            state["eval_before_greedy"] = evaluate(policy, tokenizer, held_out, eval_source, cfg, eval_seed, greedy=True, autocast=autocast)
        except RewardUnavailable as e:
            log.close(), tracker.close()  # no iteration done, nothing to save: the run directory starts over
            raise RewardServerDown(f"{e} during the evaluation before training; nothing saved yet; start again "
                                   f"with: ppo-train --resume {run_dir.path}") from None
        log.info(f"eval before training: reward {state['eval_before']:.4f} (T={cfg.temperature}), "
                 f"{state['eval_before_greedy']:.4f} (greedy) [{time.perf_counter() - t0:.1f}s]")
        state["last_kl"] = 0.0

    def save(step):
        return run_dir.save_checkpoint(step, sharded=sharded, policy=policy, critic=critic, tokenizer=tokenizer,
                                       policy_opt=opts.policy_opt, critic_opt=opts.critic_opt, generators=generators,
                                       state={"optimizer_step": opts.step_count, "skipped_updates": opts.skipped,
                                              "kl_controller": kl_ctl.state_dict(), "prompt_stream": stream.state_dict(),
                                              "eval_before": state["eval_before"], "eval_before_greedy": state["eval_before_greedy"],
                                              "last_kl": state["last_kl"], "elapsed_s": elapsed(),
                                              **({"pending_metrics": state["pending_metrics"]} if "pending_metrics" in state else {})},
                                       keep=cfg.keep_checkpoints)

    def write_samples(it, sampled):
        if cfg.log_samples_every and (it + 1) % cfg.log_samples_every == 0:
            samples = sample_rows(sampled)
            tracking.write_samples(run_dir.path, samples, it + 1)
            tracker.log_samples(samples, it + 1)

    def server_down(e, step, where=""):
        """Save a checkpoint at `step`, and the exception that stops the run: the reward server failed `where`."""
        save(step)
        log.close(), tracker.close()
        return RewardServerDown(f"{e}{where}; saved checkpoint at iteration {step} of {cfg.iterations} in {run_dir.path}; "
                                f"continue with: ppo-train --resume {run_dir.path}")

    if "pending_metrics" in state:  # the run stopped in iteration start_iter's evaluation (server down): finish it
        metrics = state.pop("pending_metrics")
        try:
            metrics["eval/reward"] = evaluate(policy, tokenizer, held_out, eval_source, cfg, eval_seed, autocast=autocast)
        except RewardUnavailable as e:
            state["pending_metrics"] = metrics
            raise server_down(e, start_iter, f" in the evaluation of iteration {start_iter}") from None
        log.metrics(metrics)  # its samples were written before the stop
        tracker.log(metrics, start_iter)
        save(start_iter)  # the checkpoint without the pending metrics: a later resume from it must not log them twice

    with runlog.StopSignals() as stop:
        for it in log.iterations(cfg.iterations, start_iter):
            back_to_iteration_start = resume_point(stream, generators, opts)
            opts.start_iteration(it)
            t_roll = time.perf_counter()
            try:
                rollout, ended, filter_stats = iteration_rollout(it, stream, policy, reference, critic, tokenizer,
                                                                 reward_source, cfg, sample_gen, autocast)
            except RewardUnavailable as e:  # a resume redoes this iteration from its start
                back_to_iteration_start()
                raise server_down(e, it) from None
            generate_s = filter_stats.pop("time/generate_s")
            kl_coef = kl_ctl.value
            compute_advantages(rollout, cfg, kl_coef, ended)
            t_train = time.perf_counter()
            train_stats = ppo_update(policy_train, critic_train, rollout, cfg, kl_coef, shuffle_gen, autocast, opts.step,
                                     train_policy=it >= cfg.critic_warmup)
            t_end = time.perf_counter()

            # Metrics over the global batch.
            mask = dist.all_gather_rows(rollout.response_mask)
            old_lp, ref_lp = dist.all_gather_rows(rollout.old_logprobs), dist.all_gather_rows(rollout.ref_logprobs)
            scores = dist.all_gather_rows(rollout.scores)
            advantages, returns = dist.all_gather_rows(rollout.advantages), dist.all_gather_rows(rollout.returns)
            kl_tok = algo.kl_estimate(old_lp, ref_lp, "k1")
            state["last_kl"] = algo.masked_mean(kl_tok, mask).item()
            kl_ctl.update(state["last_kl"], rollout_rows(cfg))
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
                **filter_stats,
                "train/skipped_updates": opts.skipped,
                "advantages/mean": algo.masked_mean(advantages, mask).item(),
                "advantages/std": algo.masked_var(advantages, mask).sqrt().item(),
                "returns/mean": algo.masked_mean(returns, mask).item(),
                "returns/std": algo.masked_var(returns, mask).sqrt().item(),
                "response/length_mean": mask.sum(-1).mean().item(),
                "response/eos_frac": dist.all_gather_rows(ended).float().mean().item(),
                "lr": cfg.lr * opts.lr_scales(max(0, opts.step_count - 1))[0],
                "time/rollout_s": t_train - t_roll,
                "time/generate_s": generate_s,  # the rollout's decoding; the rest of it is time/score_s
                "time/score_s": t_train - t_roll - generate_s,  # reward, old/reference log-probs, values, advantages
                "time/train_s": t_end - t_train,
                "tokens_per_s": mask.sum().item() / max(t_end - t_roll, 1e-9),
            }
            if critic is not None:
                metrics["value/explained_var"] = algo.explained_variance(dist.all_gather_rows(rollout.old_values), returns, mask)
            if cfg.eval_every and (it + 1) % cfg.eval_every == 0 and it + 1 < cfg.iterations:
                try:
                    metrics["eval/reward"] = evaluate(policy, tokenizer, held_out, eval_source, cfg, eval_seed, autocast=autocast)
                except RewardUnavailable as e:  # the update is done: save it, and the metrics a resume completes
                    write_samples(it, rollout.sampled)
                    state["pending_metrics"] = metrics
                    raise server_down(e, it + 1, f" in the evaluation of iteration {it + 1}") from None
            log.metrics(metrics)
            tracker.log(metrics, it + 1)
            write_samples(it, rollout.sampled)
            last = it + 1 == cfg.iterations
            if last or stop.requested or (cfg.save_every and (it + 1) % cfg.save_every == 0):
                save(it + 1)
            if stop.requested and not last:
                log.close(), tracker.close()
                raise StopRequested(f"received {stop.requested}; saved checkpoint at iteration {it + 1} of {cfg.iterations} "
                                    f"in {run_dir.path}; continue with: ppo-train --resume {run_dir.path}")

    try:
        after = evaluate(policy, tokenizer, held_out, eval_source, cfg, eval_seed, autocast=autocast)
        after_greedy = evaluate(policy, tokenizer, held_out, eval_source, cfg, eval_seed, greedy=True, autocast=autocast)
    except RewardUnavailable as e:  # the final checkpoint is saved: a resume runs no iteration, only this evaluation
        log.close(), tracker.close()
        raise RewardServerDown(f"{e} during the final evaluation; the final checkpoint (iteration {cfg.iterations}) is "
                               f"in {run_dir.path}; finish with: ppo-train --resume {run_dir.path}") from None
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
        "time/total_s": elapsed(),  # the whole run's, across resumes
    }
    run_dir.write_summary(summary)
    log.close(), tracker.close()
    log.table(summary, cfg)
    return summary


USAGE = """usage: ppo-train [--config FILE.toml] [--KEY=VALUE ...]
       ppo-train --resume RUN_DIR

Runs PPO. With no arguments: the default job (the shipped demo checkpoint, the 'reverse' task, CPU).
Every field of ppo_core.config.PPOConfig is a --KEY (listed below; configs/default.toml has them all).
--resume continues a run from its latest checkpoint, with the config saved in RUN_DIR/config.json.
Exit status: 0 done; 1 too many non-finite updates; 2 bad input (one line); 3 a reward server (--reward_url) stayed
unreachable: a checkpoint is saved, continue with --resume once it is back; 143 stopped by SIGTERM / SIGINT."""


# what --resume may change: the progress bar, and where the reward server now is
RESUME_OVERRIDES = ("progress", "reward_url", "reward_timeout_s", "reward_retries")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + help_text())
        return 0
    try:
        own, overrides = parse_cli(argv)
        resume = own.get("resume")
        if resume:
            if "config" in own or set(overrides) - set(RESUME_OVERRIDES):
                raise ConfigError("--resume takes the run's own config from RUN_DIR/config.json; it cannot be combined "
                                  f"with --config or other keys (only --{', --'.join(RESUME_OVERRIDES)})")
            cfg = build_config(runlog.RunDir.saved_config(resume), overrides)
        else:
            toml_values = load_toml(own["config"]) if "config" in own else {}
            cfg = build_config(toml_values, overrides, own.get("config", ""))
        run(cfg, resume_from=resume)
    except (ConfigError, CheckpointError, RewardError, PromptsError, tracking.TrackingError, runlog.RunDirError,
            FileNotFoundError) as e:
        print(f"ppo-train: error: {runlog.log_error(e)}", file=sys.stderr)  # a reward function's traceback: DIR/error.log
        return 2
    except NonFiniteUpdates as e:
        print(f"ppo-train: error: {e}", file=sys.stderr)
        return 1
    except StopRequested as e:
        print(f"ppo-train: {e}", file=sys.stderr)
        return 143
    except RewardServerDown as e:
        if dist.rank() == 0:  # every process stops at once; one line
            print(f"ppo-train: {e}", file=sys.stderr)
        return EXIT_REWARD_SERVER_DOWN
    finally:
        dist.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
