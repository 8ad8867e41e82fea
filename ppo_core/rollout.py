"""A rollout's experience: prompts encoded, responses sampled and scored, and the training code
path's forward over them (old, reference and teacher log-probs, entropy, values). The loop
(ppo_core.train) takes one Rollout an iteration.

    models = Models(policy, reference, critic, tokenizer=tokenizer, reward_source=reward_source)
    rollout, ended, stats = iteration_rollout(it, stream, models, Step(cfg, generator, autocast))
    rollout.old_logprobs, rollout.ref_logprobs  # [B, R] float32, 0 after each response
    rollout.old_values                          # [B, R] float32, 0 after each response
    rollout.teacher_logprobs                    # [B, R] with cfg.teacher, else None
    rollout.scores, rollout.group               # [B]: the reward, the prompt's index

  iteration: iteration_rollout: rollout_batch_size prompts x n_samples_per_prompt, this process's
             rows of the global batch; with filter_groups, DAPO's group filter over batches
             gathered from every process (gather_sampled, select_sampled)
  forward:   rollout_forward runs ppo_core.heads' response_logprobs (fused LM-head kernel or the
             torch reference), reference_logprobs, the teacher's response_logprobs (cfg.teacher)
             and response_values over a Sampled batch in micro-batches -> Rollout (padded ones of
             micro_batch_size rows, or packed ones of micro_batch_tokens tokens:
             ppo_core.data.packing); the update (ppo_core.update) runs the same heads, so the
             first minibatch's ratio is 1 up to the order of a log-sum-exp
  evaluate:  the mean reward over held-out prompts; evaluate_rows: each row's reward and response
             (ppo-eval)
  prompts:   prompt_token_ids, render_prompt, encode_prompts: the token ids the policy sees,
             left-padded; with_reference_responses for a pairwise judge
  sampling:  sample_and_score: sample_responses (the rollout engine, ppo_core.engine, or the padded
             ppo_core.engine.generate), scored by the reward source -> Sampled; play_episodes for
             multi-turn episodes (cfg.environment, ppo_core.agents.environments), scored by their
             environments
  state:     sampled_state / sampled_from_state carry a Sampled through a checkpoint or to a
             trainer (ppo_core.run.rollout_worker); ppo_core.run.tracking.sample_rows is what
             samples.jsonl shows
The file reads in that order: the entry points first, then what they call, in the order it runs.
B sequences, prompts left-padded to P, responses right-padded to R; `response_mask` [B, R] is 1 on
the tokens the policy produced. The reasons behind the sampling noise, decoding's precision and
the scoring passes' micro-batches: docs/rollout.md.
"""
from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field

import torch

from . import algo
from .models import lora
from .models import distributed as dist
from .config import records_decode_logprobs, rollout_rows
from .engine import RolloutEngine
from .agents.environments import make_environment, render, reset_messages, run_episodes
from .engine.generate import generate
from .heads import micro_batches, reference_logprobs, response_logprobs, response_values
from .data.packing import pack_rows, token_budget_micro_batches
from .data.prompts import columns_of, prompt_text
from .run.start import Models, Step

# ---------------------------------------------------------------------------- the entry points

def iteration_rollout(it, stream, models: Models, step: Step, sample_only=False, fresh_rows=None):
    """Iteration `it`'s experience: rollout_batch_size prompts, each sampled n_samples_per_prompt
    times (a group of consecutive rows), scored; this process's rows of the global batch. With
    cfg.filter_groups, groups whose scores are all equal are replaced by groups of further prompt
    batches (DAPO's dynamic sampling).
    -> (Rollout, ended [b], stats {"filter/...": float, reward components' means,
    "time/generate_s"}).
    sample_only (cfg.max_staleness, rollout workers): the rollout sampled and scored, not
    forwarded -> (Sampled, group [b], stats), which rollout_forward takes later (ppo_core.train).
    fresh_rows: see rollout_forward. The seeds: docs/rollout.md#the-sampling-noise."""
    cfg, generator, tokenizer = step.cfg, step.generator, models.tokenizer
    rank, world, n = dist.rank(), dist.world_size(), cfg.n_samples_per_prompt
    rows_total = rollout_rows(cfg)
    b = rows_total // world
    local = slice(rank * b, (rank + 1) * b)
    kept, stats, batches = [], {}, cfg.filter_groups_max_batches if cfg.filter_groups else 1
    generate_s = 0.0
    for batch in range(batches):
        # Sampling noise is a function of (seed, iteration, batch) alone, so processes that finish
        # decoding at different steps, and a resumed run, all draw the same noise for every row.
        generator.manual_seed(cfg.seed * 1_000_003 + it + batch * 1_000_000_007)
        prompt_batch = [p if isinstance(p, dict) else {"prompt": p}
                        for p in stream.next_batch(cfg.rollout_batch_size)]
        # one reference response per prompt, shared by its n rows
        if needs_reference_responses(cfg):
            prompt_batch = with_reference_responses(
                prompt_batch, models.policy, models.reference, tokenizer, cfg,
                cfg.seed * 1_000_003 + it + batch * 1_000_000_007 + 1, step.autocast)
        # [rows_total] a prompt's n rows in a row
        global_prompts = [row for row in prompt_batch for _ in range(n)]
        prompts = global_prompts[local]
        encoded = [prompt_token_ids(tokenizer, p, cfg) for p in prompts]  # rendered once
        # the same prompt width on every process
        pad_to = dist.all_reduce_max_int(max(len(e) for e in encoded))
        sampled = sample_and_score(models, step, prompts, pad_to, (rank * b, rows_total), encoded)
        generate_s += sampled.generate_s
        if not cfg.filter_groups:
            # [b] the prompt's index in the global batch
            group = torch.arange(rows_total)[local] // n
            stats.update(reward_means(sampled.reward_metrics), **{"time/generate_s": generate_s})
            if sample_only:
                return sampled, group, stats
            return rollout_forward(models, sampled, group, step, fresh_rows), sampled.ended, stats
        everything = gather_sampled(sampled, global_prompts, tokenizer, cfg)
        varied = algo.varied_groups(everything.scores,
                                    torch.arange(rows_total, device=everything.scores.device) // n)
        kept.append((everything, varied))
        n_varied = sum(int(v.sum()) for _, v in kept) // n
        stats = {"filter/batches": batch + 1,
                 "filter/kept_groups_frac": n_varied / (cfg.rollout_batch_size * (batch + 1))}
        if n_varied >= cfg.rollout_batch_size:
            break
    # The first rollout_batch_size varied groups, in sampling order; a batch still short after
    # filter_groups_max_batches is topped up with dropped groups (whose group-relative advantages
    # are 0).
    rows = [(i, j) for i, (_, v) in enumerate(kept) for j in v.nonzero().squeeze(1).tolist()]
    rows += [(i, j) for i, (_, v) in enumerate(kept) for j in (~v).nonzero().squeeze(1).tolist()]
    rows = rows[:rows_total][local]
    sampled = select_sampled([e for e, _ in kept], rows, tokenizer)
    group = torch.arange(rows_total)[local] // n
    stats.update(reward_means(sampled.reward_metrics), **{"time/generate_s": generate_s})
    if sample_only:
        return sampled, group, stats
    return rollout_forward(models, sampled, group, step, fresh_rows), sampled.ended, stats


@torch.no_grad()
def rollout_forward(models: Models, sampled: Sampled, group, step: Step,
                    fresh_rows=None) -> Rollout:
    """The training code path over sampled responses -> Rollout: old and reference log-probs,
    entropy and values (zeros without a critic), and with a teacher (on-policy distillation,
    cfg.teacher) its log-probs of the sampled tokens, computed as the reference's; in
    micro-batches (cfg.micro_batch_size rows, or packed ones of cfg.micro_batch_tokens tokens).
    group: [B] int64, each row's prompt id in the global batch. With cfg.old_logprobs_from_rollout
    the old log-probs and entropy are the decoding pass's: no policy forward. fresh_rows
    (update.fresh_first_minibatch): rows the policy is not run over here; the update's first
    minibatch fills their old log-probs and entropy. Reads the models' policy, reference, critic
    and teacher."""
    policy, reference, critic, teacher = (models.policy, models.reference, models.critic,
                                          models.teacher)
    cfg, autocast = step.cfg, step.autocast
    policy.eval()
    input_ids = torch.cat([sampled.prompt_ids, sampled.tokens], dim=1)  # [B, P+R]
    # [B, R] bool: the response's tokens, observations too
    attended = sampled.response_mask.bool() if sampled.attended is None else sampled.attended
    attention_mask = torch.cat([sampled.prompt_mask, attended], dim=1)
    host_mask = attention_mask.cpu()  # [B, P+R]: packing is planned on the host
    response_mask, P = sampled.response_mask, sampled.prompt_ids.shape[1]
    B, R = response_mask.shape
    old_logprobs, entropy, ref_logprobs, old_values = (torch.zeros(B, R, device=input_ids.device)
                                                       for _ in range(4))  # [B, R]
    # [B, R] with a teacher, else None
    teacher_logprobs = torch.zeros(B, R, device=input_ids.device) if teacher is not None else None
    scored = torch.ones(B, dtype=torch.bool)  # the rows whose old log-probs are computed here
    if fresh_rows is not None:
        scored[fresh_rows] = False

    def args_of(mb):
        packed = pack_rows(input_ids[mb], host_mask[mb], P) if cfg.micro_batch_tokens else None
        return (input_ids[mb], attention_mask[mb], response_mask[mb], P, cfg.temperature,
                cfg.fused_kernels), packed

    # One region for every micro-batch: its cast cache holds one bf16 copy of the policy's weights.
    with autocast():
        if cfg.old_logprobs_from_rollout:
            old_logprobs, entropy = (sampled.decode_logprobs * response_mask,
                                     sampled.decode_entropy * response_mask)
        elif scored.any():
            rows = scored.nonzero().squeeze(1)  # [b'] CPU
            chunks, n_real = scoring_micro_batches(host_mask[rows], cfg)
            for i, mb in enumerate(chunks):
                args, packed = args_of(rows[mb])
                lp, ent = response_logprobs(policy, *args, packed=packed)
                if i < n_real:  # (else a forward run only to match another process's count)
                    old_logprobs[rows[mb]], entropy[rows[mb]] = lp.float(), ent.float()
        chunks, n_real = scoring_micro_batches(host_mask, cfg)
        for i, mb in enumerate(chunks):
            args, packed = args_of(mb)
            ref_lp, _ = reference_logprobs(policy, reference, *args, packed=packed)
            teacher_lp = (response_logprobs(teacher, *args, packed=packed)[0]
                          if teacher is not None else None)
            v = (response_values(critic, input_ids[mb], attention_mask[mb], P, packed)
                 if critic is not None else None)
            if i >= n_real:  # a forward run only to match another process's count
                continue
            ref_logprobs[mb] = ref_lp.float()
            if teacher_lp is not None:
                teacher_logprobs[mb] = teacher_lp.float()
            if v is not None:
                old_values[mb] = v.float()
    behav_logprobs = None
    # the behaviour policy: what the sampler computed for its own tokens
    if cfg.off_policy_correction != "none":
        behav_logprobs = sampled.decode_logprobs * response_mask
    return Rollout(sampled.prompts, sampled.responses, input_ids, attention_mask, response_mask, P,
                   old_logprobs, ref_logprobs, old_values * response_mask, entropy, sampled.scores,
                   group.to(input_ids.device), sampled=sampled, host_mask=host_mask,
                   behav_logprobs=behav_logprobs, teacher_logprobs=teacher_logprobs,
                   fresh_rows=fresh_rows)


@dataclass
class Rollout:
    """One iteration's experience. B sequences, prompts left-padded to P, responses right-padded
    to R."""

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
    # [B] int64: the prompt's index in the global batch; a prompt's n responses share it
    group: torch.Tensor
    rewards: torch.Tensor = None  # [B, R]
    advantages: torch.Tensor = None  # [B, R]
    returns: torch.Tensor = None  # [B, R]
    # what was sampled and scored: the rows, texts and reward components (for samples.jsonl)
    sampled: "Sampled" = None
    # [B, P+R] bool on the CPU: attention_mask, read by the packed passes (ppo_core.data.packing)
    host_mask: torch.Tensor = None
    # [B, R]: the sampler's own log-probs (cfg.off_policy_correction), 0 off the loss
    behav_logprobs: torch.Tensor = None
    # [B, R]: log pi_teacher of the sampled tokens (cfg.teacher), 0 off the loss
    teacher_logprobs: torch.Tensor = None
    # CPU int64: rows whose old log-probs the update's first minibatch computes
    fresh_rows: torch.Tensor = None


@torch.no_grad()
def evaluate(policy, tokenizer, prompts, reward_source, cfg, seed, greedy=False,
             autocast=contextlib.nullcontext):
    """Mean reward over held-out prompt rows, sampling with the run's temperature (or greedily),
    under the rollouts' autocast: the mean of evaluate_rows' scores.

    Each evaluation uses its own generator seeded from `seed`
    (docs/rollout.md#the-sampling-noise). Every process evaluates the same prompts (the held-out
    set is small)."""
    scores, _ = evaluate_rows(policy, tokenizer, prompts, reward_source, cfg, seed, greedy,
                              autocast)
    return float(scores.mean())


# an evaluation's noise seed is the run's seed + this (+ j for ppo-eval's j-th sample)
EVAL_SEED_OFFSET = 12345


@torch.no_grad()
def evaluate_rows(policy, tokenizer, prompts, reward_source, cfg, seed, greedy=False,
                  autocast=contextlib.nullcontext):
    """One response per held-out prompt row and its reward -> (scores [N] float32 on the reward's
    device, the N responses' texts).
    What ppo-train's evaluations (evaluate) and ppo-eval (ppo_core.evaluate) both read. The noise
    is a function of (seed, the row's index within its batch of 256, token index) on the rollout
    engine."""
    policy.eval()
    generator = torch.Generator(device=next(policy.parameters()).device).manual_seed(seed)
    scores, responses = [], []
    for rows in micro_batches(len(prompts), 256):
        batch = [prompts[i] for i in rows.tolist()]  # rows (ppo_core.data.prompts)
        if cfg.environment:  # the episodes' rewards
            batch = [r if isinstance(r, dict) else {"prompt": r} for r in batch]
            played = play_episodes(policy, tokenizer, batch, Step(cfg, generator, autocast), 0,
                                   None, greedy)
            scores.append(played.scores)
            responses += played.responses
            continue
        texts = sample_responses(policy, tokenizer, batch, Step(cfg, generator, autocast),
                                 greedy=greedy).texts
        with autocast():
            scores.append(reward_source([prompt_text(r) for r in batch], texts,
                                        columns_of(batch))[0])
        responses += texts
    return torch.cat(scores), responses


# ---------------------------------------------------------------------------- prompts

def needs_reference_responses(cfg) -> bool:
    """A pairwise judge, in this process (cfg.judge) or on a reward server (cfg.reward_url with
    judge_mode pairwise), compares each response with a reference response: from the prompt column
    cfg.judge_reference_column, else sampled from the frozen reference policy
    (with_reference_responses) and sent along as that column."""
    return cfg.judge_mode == "pairwise" and bool(cfg.judge or cfg.reward_url)


@torch.no_grad()
def with_reference_responses(rows, policy, reference, tokenizer, cfg, seed, autocast) -> list:
    """Copies of the prompt rows (dicts) whose cfg.judge_reference_column is missing, given one
    response sampled from the frozen reference policy (LoRA without a reference checkpoint: the
    policy with its adapters off) at the run's temperature, with a generator seeded by `seed`
    alone, so the same on every process and on resuming (docs/rollout.md#the-sampling-noise).
    Rows that have the column are kept as they are."""
    column = cfg.judge_reference_column
    missing = [i for i, row in enumerate(rows) if row.get(column) is None]
    if not missing:
        return rows
    model = policy if reference is policy else reference
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with lora.adapters_disabled(policy) if reference is policy else contextlib.nullcontext():
        texts = sample_responses(model, tokenizer, [rows[i] for i in missing],
                                 Step(cfg, generator, autocast)).texts
    out = list(rows)
    for i, text in zip(missing, texts):
        # a copy: a prompt file's row is drawn again in later passes
        out[i] = {**rows[i], column: text}
    return out


def prompt_token_ids(tokenizer, prompt, cfg):
    """The prompt's token ids as the policy sees them. prompt: a string or a row
    (ppo_core.data.prompts): a chat row's "messages" and, with cfg.chat_template, a plain prompt as
    a user turn, are rendered with the chat template (which writes any BOS itself); a plain prompt
    otherwise gets what the tokenizer's post-processor adds (a BOS for Llama-family checkpoints),
    as transformers' tokenizer(text) does."""
    # an episode's first messages, as its environment gives them (any row)
    if cfg is not None and cfg.environment:
        build, tools = make_environment(cfg.environment, cfg.tools, cfg.max_turns,
                                        cfg.max_tool_calls_per_turn)
        row = prompt if isinstance(prompt, dict) else {"prompt": prompt}
        messages = reset_messages(build(), row, cfg.environment)
        return tokenizer.encode(render(tokenizer, messages, tools, **episode_template_kwargs(cfg)))
    if isinstance(prompt, dict) and "messages" in prompt:
        return tokenizer.encode(tokenizer.apply_chat_template(
            prompt["messages"], add_generation_prompt=True, tokenize=False,
            enable_thinking=cfg.enable_thinking))
    prompt = prompt["prompt"] if isinstance(prompt, dict) else prompt
    if cfg is not None and cfg.chat_template:
        return tokenizer.encode(render_prompt(tokenizer, prompt, cfg))
    ids, plain = tokenizer.encode_prompt(prompt), tokenizer.encode(prompt)
    if ids[-1:] != plain[-1:] and ids[-1:] and ids[-1] in tokenizer.eos_token_ids:
        # a post-processor that also appends EOS ("<s> $A </s>") would end the text the policy
        # continues
        ids = ids[:-1]
    return ids


def render_prompt(tokenizer, prompt, cfg):
    """The text the policy sees: the prompt itself, or a user turn in the policy's chat template.
    One rendering for every stage: rollout, old/reference log-probs and values all read these
    token ids."""
    if cfg.chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                             add_generation_prompt=True, tokenize=False,
                                             enable_thinking=cfg.enable_thinking)
    return prompt


def episode_template_kwargs(cfg) -> dict:
    """The chat template's switches for episodes: Qwen3's enable_thinking (templates without it
    ignore it)."""
    return {"enable_thinking": cfg.enable_thinking}


def encode_prompts(tokenizer, prompts, device, pad_to=0, cfg=None):
    """Left-pad the encoded (rendered) prompts to max(longest, pad_to). -> ids [B, P] int64, mask
    [B, P] bool. `prompts` may also be lists of token ids already encoded."""
    encoded = [p if isinstance(p, list) else prompt_token_ids(tokenizer, p, cfg) for p in prompts]
    P = max(pad_to, max(len(e) for e in encoded))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (P - len(e)) + e for e in encoded], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (P - len(e)) + [1] * len(e) for e in encoded], dtype=torch.bool,
                        device=device)
    return ids, mask


# ---------------------------------------------------------------------------- sampling and scoring

@torch.no_grad()
def sample_and_score(models: Models, step: Step, prompt_rows, pad_to, rows, encoded):
    """One response per row of `prompt_rows`, and its score from the reward source (under the
    policy passes' autocast) -> Sampled. The reward sees the raw prompt text (not the chat
    rendering) and the rows' extra columns. Reads the models' policy, tokenizer and
    reward_source."""
    policy, tokenizer, reward_source = models.policy, models.tokenizer, models.reward_source
    cfg, autocast = step.cfg, step.autocast
    policy.eval()
    if cfg.environment:
        return play_episodes(policy, tokenizer, prompt_rows, step, pad_to, rows)
    t0 = time.perf_counter()
    out = sample_responses(policy, tokenizer, encoded or prompt_rows, step, pad_to=pad_to,
                           rows=rows, decode_logprobs=records_decode_logprobs(cfg))
    # sample_responses ends with a host read of the tokens: nothing in flight
    generate_s = time.perf_counter() - t0
    texts = [prompt_text(r) for r in prompt_rows]
    with autocast():  # a reward model scores under the same autocast as the policy passes
        # [B] float32 (on the CPU for a reward function), validated; and each component's
        # per-sample values
        scores, reward_metrics = reward_source(texts, out.texts, columns_of(prompt_rows))
    device = out.tokens.device
    numbers = {k: v.float().to(device) for k, v in reward_metrics.items()
               if isinstance(v, torch.Tensor)}
    words = {k: list(v) for k, v in reward_metrics.items()
             if not isinstance(v, torch.Tensor)}  # lists of B str
    return Sampled(prompt_rows, texts, out.texts, out.prompt_ids, out.prompt_mask, out.tokens,
                   out.response_mask, out.ended, scores.to(device), numbers, words, generate_s,
                   out.decode_logprobs, out.decode_entropy)


@dataclass
class Sampled:
    """Responses sampled and scored, before any log-prob: B rows, prompts left-padded to P,
    responses right-padded."""

    rows: list  # the prompt rows (ppo_core.data.prompts): "prompt" or "messages", and extra columns
    prompts: list  # the raw prompt texts the reward function saw
    responses: list
    prompt_ids: torch.Tensor  # [B, P] int64
    prompt_mask: torch.Tensor  # [B, P] bool
    tokens: torch.Tensor  # [B, R] int64
    response_mask: torch.Tensor  # [B, R] float32
    ended: torch.Tensor  # [B] bool, the response ends with an EOS
    scores: torch.Tensor  # [B] float32
    reward_metrics: dict  # name -> [B] float32: each reward function's score and its own metrics
    # name -> B str: a judge's rationales (samples.jsonl)
    reward_texts: dict = field(default_factory=dict)
    # seconds spent decoding them (the rest of the rollout: reward and scoring forwards)
    generate_s: float = 0.0
    # [B, R] float32, the decoding pass's (cfg.old_logprobs_from_rollout)
    decode_logprobs: torch.Tensor | None = None
    decode_entropy: torch.Tensor | None = None  # [B, R] float32, likewise
    # [B, R] bool: the response's real tokens, the policy's and observations' (multi-turn
    # episodes, where response_mask is 0 on observations); None: response_mask's tokens
    attended: torch.Tensor | None = None


@dataclass
class Responses:
    """What sample_responses returns: B prompts left-padded to P, one response each right-padded
    to R."""

    prompt_ids: torch.Tensor  # [B, P] int64
    prompt_mask: torch.Tensor  # [B, P] bool
    tokens: torch.Tensor  # [B, R] int64
    response_mask: torch.Tensor  # [B, R] float32: 1 up to and including the first EOS
    texts: list  # B decoded responses
    ended: torch.Tensor  # [B] bool, the response ends with an EOS
    # [B, R] float32, the decoding pass's (decode_logprobs=True)
    decode_logprobs: torch.Tensor | None = None
    decode_entropy: torch.Tensor | None = None  # [B, R] float32, likewise


def sample_responses(policy, tokenizer, prompts, step: Step, greedy=False, pad_to=0, rows=None,
                     decode_logprobs=False) -> Responses:
    """Generate one response per prompt (a row, or its token ids when the caller has them
    already) -> Responses; with decode_logprobs also the decoding pass's log-probs and entropy of
    the sampled tokens (0 after the response). Reads step.cfg, step.generator and step.autocast
    (the training passes' autocast, which decoding runs under:
    docs/rollout.md#decoding-under-the-training-autocast).

    rows = (offset, global_batch): these prompts are rows offset.. of a batch of global_batch
    spread over processes; every row gets the same tokens whatever the number of processes
    (docs/rollout.md#the-sampling-noise)."""
    cfg, generator, autocast = step.cfg, step.generator, step.autocast
    device = next(policy.parameters()).device
    encoded = [p if isinstance(p, list) else prompt_token_ids(tokenizer, p, cfg) for p in prompts]
    prompt_ids, prompt_mask = encode_prompts(tokenizer, encoded, device, pad_to, cfg)
    # every stop token: the tokenizer's EOS and generation_config.json's
    eos = tokenizer.eos_token_ids
    # FSDP: full weights for the whole call, no collective per step
    with dist.gathered(policy), autocast():
        if cfg.rollout_engine == "paged":
            out = engine_responses(policy, tokenizer, encoded, step, greedy, rows, decode_logprobs)
        else:
            out = generate(policy, prompt_ids, cfg.max_new_tokens, attention_mask=prompt_mask,
                           temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                           greedy=greedy, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
                           generator=generator, global_rows=rows,
                           cuda_graph=cfg.cuda_graph and device.type == "cuda",
                           return_logprobs=decode_logprobs, return_entropy=decode_logprobs)
    tokens = out[0] if decode_logprobs else out
    # The response is every token up to and including the first EOS.
    is_eos = torch.isin(tokens, torch.tensor(eos, device=tokens.device))
    # [B, R] strictly after the first EOS
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    response_mask = (~after_eos).float()
    ended_with_eos = is_eos.any(-1)
    texts = [tokenizer.decode(row[m.bool()].tolist())
             for row, m in zip(tokens.cpu(), response_mask.cpu())]
    return Responses(prompt_ids, prompt_mask, tokens, response_mask, texts, ended_with_eos,
                     *((out[1], out[2]) if decode_logprobs else ()))


def engine_responses(policy, tokenizer, encoded, step: Step, greedy, rows, decode_logprobs):
    """sample_responses' decoding on the rollout engine (cfg.rollout_engine='paged'), returned as
    ppo_core.engine.generate returns it: tokens [B, max_new_tokens] (pad after a response), with
    decode_logprobs also (log-probs, entropy) [B, max_new_tokens] float32 (0 after it). The noise
    seed is the generator's initial seed (None: torch's default generator's), and the engine's
    noise a function of (seed, global row, token index) alone
    (docs/rollout.md#the-sampling-noise). rows = (offset, global batch) numbers these rows in the
    global batch. Stops at every one of the tokenizer's EOS tokens, pads with its pad token."""
    cfg, generator = step.cfg, step.generator
    eos, pad_token_id = tokenizer.eos_token_ids, tokenizer.pad_token_id
    device = next(policy.parameters()).device
    engine = RolloutEngine(policy, kv_cache_gb=cfg.rollout_kv_cache_gb or None,
                           cuda_graphs=cfg.cuda_graph)
    first = rows[0] if rows is not None else 0
    out = engine.generate(
        encoded, cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
        top_k=cfg.top_k, greedy=greedy, eos_token_id=eos,
        seed=generator.initial_seed() if generator is not None else torch.initial_seed(),
        rows=range(first, first + len(encoded)), return_logprobs=decode_logprobs,
        return_entropy=decode_logprobs)
    responses = out[0] if decode_logprobs else out
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    R = cfg.max_new_tokens
    tokens = torch.tensor([r + [pad] * (R - len(r)) for r in responses], dtype=torch.long,
                          device=device)  # [B, R]
    if not decode_logprobs:
        return tokens
    logprobs, entropy = ([row + [0.0] * (R - len(row)) for row in values] for values in out[1:])
    return (tokens, torch.tensor(logprobs, dtype=torch.float32, device=device),
            torch.tensor(entropy, dtype=torch.float32, device=device))


@torch.no_grad()
def play_episodes(policy, tokenizer, prompt_rows, step: Step, pad_to, rows,
                  greedy=False) -> Sampled:
    """sample_and_score for multi-turn episodes (cfg.environment, ppo_core.agents.environments):
    one episode per row, played on the rollout engine, scored by its environment's rewards.
    tokens [B, R]: everything after the prompt (the policy's turns and the observations),
    response_mask 1 on the policy's tokens only, `attended` on all of them.
    Metrics per row: env/turns, env/observation_tokens, env/observations_truncated
    (max_observation_chars), env/observation_chars_replaced (characters of observations the
    tokenizer cannot encode, ppo_core.agents.environments.encodable_observation) and, where the
    environment counts them (ToolEnvironment), env/tool_calls, env/malformed_calls,
    env/tool_errors, env/tool_s (seconds its tools ran: the sandbox's for Python); samples.jsonl
    gets each conversation turn by turn."""
    cfg, generator, autocast = step.cfg, step.generator, step.autocast
    build, tools = make_environment(cfg.environment, cfg.tools, cfg.max_turns,
                                    cfg.max_tool_calls_per_turn)
    device = next(policy.parameters()).device
    t0 = time.perf_counter()
    envs = [build() for _ in prompt_rows]
    first = rows[0] if rows is not None else 0
    seed = generator.initial_seed() if generator is not None else torch.initial_seed()
    with dist.gathered(policy), autocast():
        engine = RolloutEngine(policy, kv_cache_gb=cfg.rollout_kv_cache_gb or None,
                               cuda_graphs=cfg.cuda_graph)
        episodes = run_episodes(
            engine, tokenizer, envs, prompt_rows, max_new_tokens=cfg.max_new_tokens,
            max_turn_tokens=cfg.max_turn_tokens or None, tools=tools,
            template_kwargs=episode_template_kwargs(cfg), name=cfg.environment,
            max_observation_chars=cfg.max_observation_chars, temperature=cfg.temperature,
            top_p=cfg.top_p, top_k=cfg.top_k, greedy=greedy, seed=seed,
            rows=range(first, first + len(prompt_rows)),
            return_logprobs=records_decode_logprobs(cfg),
            return_entropy=records_decode_logprobs(cfg))
    generate_s = time.perf_counter() - t0
    prompt_ids, prompt_mask = encode_prompts(tokenizer, [e.prompt_ids for e in episodes], device,
                                             pad_to, cfg)
    R = cfg.max_new_tokens
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def rows_of(values, fill):  # [B, R] right-padded
        return [list(v) + [fill] * (R - len(v)) for v in values]
    tokens = torch.tensor(rows_of([e.tokens for e in episodes], pad), dtype=torch.long,
                          device=device)
    response_mask = torch.tensor(rows_of([e.mask for e in episodes], 0), dtype=torch.float32,
                                 device=device)
    attended = torch.tensor(rows_of([[1] * len(e.tokens) for e in episodes], 0), dtype=torch.bool,
                            device=device)
    scores = torch.tensor([e.reward for e in episodes], dtype=torch.float32, device=device)
    metrics = {"env/turns": [e.turns for e in episodes],
               "env/observation_tokens": [e.observation_tokens for e in episodes],
               "env/observation_chars_replaced": [e.observation_chars_replaced for e in episodes],
               "env/observations_truncated": [e.observations_truncated for e in episodes]}
    for key in ("tool_calls", "malformed_calls", "tool_errors", "calls_not_run", "tool_s"):
        if all(hasattr(env, "counts") for env in envs):
            metrics[f"env/{key}"] = [env.counts.get(key, 0) for env in envs]
    metrics = {k: torch.tensor(v, dtype=torch.float32, device=device) for k, v in metrics.items()}
    texts = {"conversation": [json.dumps(e.messages, ensure_ascii=False)
                              for e in episodes]}  # turn by turn
    responses = [tokenizer.decode(e.tokens, skip_special_tokens=False) for e in episodes]
    decoded = [None, None]
    if records_decode_logprobs(cfg):
        decoded = [torch.tensor(rows_of([e.logprobs for e in episodes], 0.0), device=device),
                   torch.tensor(rows_of([e.entropy for e in episodes], 0.0), device=device)]
    # ended: the policy's last token is a stop token; an episode the budget cut short is done but
    # did not end
    eos = set(tokenizer.eos_token_ids)
    ended = torch.tensor([bool(e.tokens) and e.tokens[-1] in eos for e in episodes], device=device)
    return Sampled(prompt_rows, [prompt_text(r) for r in prompt_rows], responses, prompt_ids,
                   prompt_mask, tokens, response_mask, ended, scores, metrics, texts, generate_s,
                   *decoded, attended=attended)


def reward_means(reward_metrics) -> dict:
    """Each reward component's mean over the global batch, for metrics.jsonl."""
    return {name: dist.all_gather_rows(values).mean().item()
            for name, values in sorted(reward_metrics.items())}


# ---------------------------------------------------------------------------- DAPO's group filter

def gather_sampled(sampled: Sampled, global_prompts, tokenizer, cfg) -> Sampled:
    """Every process's rows of `sampled`, in rank order (responses padded to max_new_tokens
    first)."""
    pad = cfg.max_new_tokens - sampled.tokens.shape[1]
    tokens = torch.nn.functional.pad(sampled.tokens, (0, pad), value=tokenizer.pad_token_id)
    response_mask = torch.nn.functional.pad(sampled.response_mask, (0, pad))
    parts = [dist.all_gather_rows(t) for t in (sampled.prompt_ids, sampled.prompt_mask, tokens,
                                               response_mask, sampled.ended, sampled.scores)]
    responses = [tokenizer.decode(row[m.bool()].tolist())
                 for row, m in zip(parts[2].cpu(), parts[3].cpu())]
    metrics = {k: dist.all_gather_rows(v) for k, v in sampled.reward_metrics.items()}
    # a judge's rationales travel only within one process (texts are not gathered): kept in a
    # 1-process run
    words = sampled.reward_texts if dist.world_size() == 1 else {}
    decoded = [None, None]
    if sampled.decode_logprobs is not None:  # cfg.old_logprobs_from_rollout
        decoded = [dist.all_gather_rows(torch.nn.functional.pad(t, (0, pad)))
                   for t in (sampled.decode_logprobs, sampled.decode_entropy)]
    return Sampled(global_prompts, [prompt_text(r) for r in global_prompts], responses, *parts,
                   metrics, words, sampled.generate_s, *decoded)


def select_sampled(batches: list, rows: list, tokenizer) -> Sampled:
    """Rows (batch index, row index) of several Sampled batches as one; prompts left-padded to the
    widest."""
    P = max(s.prompt_ids.shape[1] for s in batches)
    def left_pad(t, value):  # [B, p] -> [B, P]
        return torch.nn.functional.pad(t, (P - t.shape[1], 0), value=value)
    picked = [(batches[i], j) for i, j in rows]
    return Sampled([s.rows[j] for s, j in picked], [s.prompts[j] for s, j in picked],
                   [s.responses[j] for s, j in picked],
                   torch.stack([left_pad(s.prompt_ids, tokenizer.pad_token_id)[j]
                                for s, j in picked]),
                   torch.stack([left_pad(s.prompt_mask, False)[j] for s, j in picked]),
                   torch.stack([s.tokens[j] for s, j in picked]),
                   torch.stack([s.response_mask[j] for s, j in picked]),
                   torch.stack([s.ended[j] for s, j in picked]),
                   torch.stack([s.scores[j] for s, j in picked]),
                   {k: torch.stack([s.reward_metrics[k][j] for s, j in picked])
                    for k in batches[0].reward_metrics},
                   {k: [s.reward_texts[k][j] for s, j in picked] for k in batches[0].reward_texts},
                   sum(s.generate_s for s in batches),
                   *([torch.stack([getattr(s, name)[j] for s, j in picked])
                      for name in ("decode_logprobs", "decode_entropy")]
                     if batches[0].decode_logprobs is not None else [None, None]))


# ------------------------------------------------------------ the scoring passes' micro-batches

def scoring_micro_batches(host_mask, cfg):
    """The scoring passes' micro-batches -> (CPU index tensors of rows, how many of them are
    real): cfg.micro_batch_size rows each, or with cfg.micro_batch_tokens rows packed to at most
    that many real tokens (ppo_core.data.packing). Every process runs as many forwards as the
    busiest one: a process short of them runs row 0 again and keeps nothing
    (docs/rollout.md#the-scoring-passes-micro-batches)."""
    B = host_mask.shape[0]
    if not cfg.micro_batch_tokens:
        chunks = micro_batches(B, cfg.micro_batch_size)
        return chunks, len(chunks)
    lengths = host_mask.sum(-1).tolist()
    bins = [torch.tensor(b)
            for b in token_budget_micro_batches(list(range(B)), lengths, cfg.micro_batch_tokens)]
    extra = dist.all_reduce_max_int(len(bins)) - len(bins)
    return bins + [torch.zeros(1, dtype=torch.long)] * extra, len(bins)


# ------------------------------------------------------------ checkpoints, workers, samples.jsonl

_SAMPLED_TENSORS = ("prompt_ids", "prompt_mask", "tokens", "response_mask", "ended", "scores",
                    "decode_logprobs", "decode_entropy", "attended")


def sampled_state(sampled: Sampled, group, stats, lists=True) -> dict:
    """A sampled rollout not yet trained on (cfg.max_staleness) as plain JSON for the checkpoint:
    tensors as nested lists with their dtype (float32 values round-trip exactly through Python
    floats), texts and rows as they are. lists=False: the tensors' values stay CPU tensors (the
    messages of ppo_core.run.rollout_worker; ppo_core.run.checkpoint.state_lists turns it into
    the JSON one)."""
    def tensor(t):
        return None if t is None else {"dtype": str(t.dtype).removeprefix("torch."),
                                       "values": t.tolist() if lists else t.detach().cpu()}
    return {"rows": sampled.rows, "prompts": sampled.prompts, "responses": sampled.responses,
            "tensors": {name: tensor(getattr(sampled, name)) for name in _SAMPLED_TENSORS},
            "reward_metrics": {k: tensor(v) for k, v in sampled.reward_metrics.items()},
            "reward_texts": sampled.reward_texts, "generate_s": sampled.generate_s,
            "group": tensor(group), "stats": stats}


def sampled_from_state(state: dict, device):
    """sampled_state's inverse (either form) -> (Sampled, group, stats)."""
    def tensor(t):
        if t is None:
            return None
        if isinstance(t["values"], torch.Tensor):
            return t["values"].to(device)
        return torch.tensor(t["values"], dtype=getattr(torch, t["dtype"]), device=device)
    tensors = {name: tensor(t) for name, t in state["tensors"].items()}
    sampled = Sampled(state["rows"], state["prompts"], state["responses"],
                      reward_metrics={k: tensor(v) for k, v in state["reward_metrics"].items()},
                      reward_texts=state["reward_texts"], generate_s=state["generate_s"], **tensors)
    return sampled, tensor(state["group"]).cpu(), state["stats"]


# ---------------------------------------------------------------------------- for tests

def collect_rollout(models: Models, step: Step, prompts, pad_to, rows, encoded, group):
    """Sample and score one response per row (a prompt row or a plain prompt string), then run the
    training code path over them. -> (Rollout, ended [B])."""
    prompts = [p if isinstance(p, dict) else {"prompt": p} for p in prompts]
    sampled = sample_and_score(models, step, prompts, pad_to, rows, encoded)
    return rollout_forward(models, sampled, group, step), sampled.ended
