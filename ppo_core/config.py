"""The run configuration: one flat dataclass, every field documented, loaded from TOML and the
command line.

    ppo-train --config configs/default.toml --lr=5e-4 --ppo_epochs 2

Precedence: defaults < the TOML file < command-line overrides. A list field (reward_fn,
reward_weights) is a TOML list or comma-separated text (`--reward_fn=a.py:f,b.py:g`). Paths are
made absolute, `~` expanded, as the config is built (absolute_paths), so a run's config.json and
`--resume` work from any directory. minibatch_size and micro_batch_size left at 0 become the sizes
that fit the rollout (fit_batch_sizes). `help_text()` lists every field for `ppo-train --help`.

A key that does not exist, a value of the wrong type or an impossible value is a `ConfigError`
whose message names the key (an unknown key also names the fields it may mean, by another
library's name for them or by spelling: `learning_rate` -> `lr`). Every problem found is in the one
error, "N config problems: ...; ...", which the command line prints as one line on stderr before
exiting with status 2.
"""
import ast
import dataclasses
import difflib
import math
import os
import re
import textwrap
import typing
import urllib.parse
from dataclasses import dataclass, field, fields

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from .algo import POLICY_LOSS_KINDS, POLICY_LOSSES


class ConfigError(ValueError):
    """A configuration the run cannot start with; the message is meant to be shown as is."""


@dataclass
class PPOConfig:
    # ------------------------------------------------------------------ models and data
    policy: str = ""
    """Policy checkpoint directory (HF layout). Empty = the shipped demo checkpoint for the
    'reverse' task."""
    reference: str = ""
    """Frozen reference checkpoint for the KL penalty. Empty = the policy's initial weights."""
    teacher: str = ""
    """On-policy distillation: a frozen teacher checkpoint (HF layout, the policy's tokenizer and
    vocabulary size) scores each sampled token; the token's advantage is the negative reverse-KL
    estimate (ppo_core.algo's distillation_advantages; Agarwal et al. 2024, GKD). Empty = off."""
    distill_coef: float = 1.0
    """Weight of the distillation advantage -distill_coef * (log pi(y_t) - log pi_teacher(y_t)) of
    each token."""
    distill_with_reward: bool = False
    """With a teacher: false = the distillation advantage alone (no critic; the task reward is still
    computed and logged, and scores the evaluations, but trains nothing); true = added to
    adv_estimator's advantages."""
    critic: str = ""
    """Critic checkpoint (a *ForSequenceClassification or *ForCausalLM dir). Empty = the policy's
    backbone with a new zero scalar head."""
    task: str = "reverse"
    """Built-in task supplying prompts and reward when no prompts_file / reward_fn is given, and the
    demo policy when no policy is: 'reverse' (reverse a word, partial credit), 'arith' (multi-digit
    addition and subtraction, the answer as '#### N', exact match) or 'toolmul' (multiply two
    3-digit numbers with the calculator tool: played as episodes, environment='tools' unless set,
    the answer scored by exact match)."""
    reward_fn: list[str] = field(default_factory=list)
    """Python reward functions, each 'module:function' or 'path/file.py:function' (a TOML list, or
    comma-separated on the command line); empty = the task's reward. Each is called fn(prompts,
    responses, <column>=...) with the raw prompt texts, the responses and the extra prompt columns
    its signature names, and returns one number per response or {"rewards": [...],
    "<metric>": [...]} (ppo_core.rewards). Several add up, weighted by reward_weights."""
    reward_weights: list[float] = field(default_factory=list)
    """Weight of each reward function, in reward_fn's order (a TOML list, or comma-separated);
    empty = 1.0 each. The score is sum_k w_k * r_k; a function of weight 0 is only logged."""
    reward_model: str = ""
    """Reward-model checkpoint (*ForSequenceClassification, e.g. Skywork-Reward-V2) scoring
    prompt + response at its last token. Empty = reward_fn or the task's reward."""
    reward_url: list[str] = field(default_factory=list)
    """Reward servers to score with instead (a TOML list, or comma-separated): 'http://host:port' of
    a ppo-serve-reward or any server of OpenRLHF's remote reward protocol; a batch is split across
    them (ppo_core.rewards.remote). A server still down after the retries makes ppo-train save a
    checkpoint and stop with exit status 3. Empty = in-process."""
    reward_timeout_s: float = 60.0
    """Seconds one request to a reward server may take, connecting to the answer's last byte, before
    a retry."""
    reward_retries: int = 3
    """Further tries of a reward request that got no answer, each after a doubling wait (1 s, 2 s,
    4 s, ...)."""
    judge: str = ""
    """Generative judge checkpoint (a *ForCausalLM that writes a rationale, then a verdict: CE-RM,
    GRAM, RM-R1, or ppo_core/demo/judge-demo) as the reward (ppo_core.rewards.judges).
    Empty = no judge."""
    judge_mode: str = "pointwise"
    """'pointwise' (the judge scores each response) or 'pairwise' (it compares the response with a
    reference response, in both orders; the reward is its mean preference for the policy's
    response). With reward_url, 'pairwise' says the server's judge is pairwise: the trainer sends
    the reference responses (judge_reference_column) along."""
    judge_template: str = ""
    """Jinja file of the judge's prompt, or a shipped name ('pointwise', 'pairwise'). Empty = the
    judge checkpoint's own <mode>.jinja when it has one, else the shipped template of judge_mode."""
    judge_reference_column: str = "reference"
    """Prompt column holding a pairwise judge's reference response; a prompt file without that
    column gets one response per row sampled from the frozen reference policy."""
    judge_max_new_tokens: int = 1024
    """Longest judgement in tokens; a rationale cut there has no verdict."""
    judge_unparsed_score: float = 0.0
    """Reward of a judgement without a verdict (pairwise: of that order), counted in the metric
    judge/unparsed."""
    judge_score_range: list[float] = field(default_factory=list)
    """[lo, hi] of a pointwise judge's scale, mapped onto [0, 1] (e.g. 1,10); empty = the parsed
    score as it is."""
    judge_temperature: float = 0.0
    """Judge decoding temperature; 0 = greedy (the default: the same response gets the same
    judgement)."""
    judge_enable_thinking: bool = False
    """The reasoning switch of the judge's own chat template (not the run's enable_thinking)."""
    judge_batch_size: int = 32
    """Judge prompts decoded per generate call."""
    chat_template: bool = False
    """Render each prompt as a user turn with the policy's chat template (+ generation prompt); the
    reward model renders the same conversation with its own."""
    enable_thinking: bool = True
    """Reasoning switch passed to every chat-template rendering (Qwen3's enable_thinking); fixed
    once, so rollout, reference, critic and reward model see one rendering."""
    prompts_file: str = ""
    """Training prompt rows: .jsonl / .json (objects with a "prompt" string or a chat "messages"
    list), .parquet, or text with one prompt per line; every other column reaches the reward
    functions (ppo_core.data.prompts). Empty = the task's prompt stream."""
    eval_prompts_file: str = ""
    """Held-out prompts for evaluation, same format. Empty = the task's held-out set, or the last
    eval_size prompts of prompts_file (at most half)."""
    drop_overlong_prompts: bool = False
    """A prompt row with no room left in the policy's context for max_new_tokens: false = refused,
    naming its file and line; true = dropped, the count in the run's first lines and in metrics
    (prompts/dropped_overlong)."""

    # ------------------------------------------------------------------ rollout
    iterations: int = 60
    """Number of PPO iterations (rollout, then ppo_epochs of updates)."""
    rollout_batch_size: int = 64
    """Prompts sampled per iteration, summed over all processes; each is sampled
    n_samples_per_prompt times, so a rollout holds rollout_batch_size * n_samples_per_prompt
    sequences (minibatch_size and micro_batch_size count sequences)."""
    n_samples_per_prompt: int = 1
    """Responses sampled per prompt: a group, the unit of the critic-free estimators' baselines
    (GRPO uses 8-64)."""
    max_new_tokens: int = 12
    """Longest response; a response that has not produced EOS by then is cut. With an environment:
    an episode's budget of tokens after its prompt, the policy's turns and the observations
    together."""
    environment: str = ""
    """Multi-turn episodes (ppo_core.agents.environments) instead of one response per prompt:
    'tools' for the shipped ToolEnvironment (the policy calls `tools` until it answers; the answer
    scored against the row's 'answer' column), or 'file.py:Class' / 'module:Class' for your own
    class with reset(row) and step(text) (one instance per episode, built with no arguments). The
    episodes' rewards are the scores: no reward_fn, reward_model, judge or reward_url with it. Needs
    rollout_engine='paged' and a chat template in the policy's tokenizer."""
    tools: str = "calculator,python"
    """With environment='tools': the tools offered, comma-separated: 'calculator', 'python' (code
    run in the sandbox, ppo_core.rewards.sandbox)."""
    max_tool_calls_per_turn: int = 8
    """With environment='tools': the tool calls run in one turn at most; the rest are not run,
    answered with one line saying so and counted (env/calls_not_run). Bounds what one turn can cost
    (a Python call runs up to its timeout)."""
    max_turns: int = 4
    """With an environment: the policy's turns per episode at most (a class's own max_turns
    attribute wins)."""
    max_turn_tokens: int = 0
    """With an environment: the tokens one turn may sample at most (0 = up to what is left of
    max_new_tokens)."""
    max_observation_chars: int = 65536
    """With an environment: each observation message's content is cut to its first
    max_observation_chars characters before the chat template renders it and the tokenizer reads it
    (counted: env/observations_truncated); an observation longer than what is left of max_new_tokens
    ends the episode anyway, and a tool echoing 10^7 characters took 11 GB to tokenize.
    0 = no cap."""
    temperature: float = 1.0
    """Sampling temperature; log-probs for the ratio and KL are taken at the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1.0 = off)."""
    top_k: int = 0
    """Sample only among the k most likely tokens (0 = off)."""
    allow_filtered_sampling: bool = False
    """Train with top_p < 1 or top_k > 0 anyway. Refused by default: old, new and reference
    log-probs and the KL are those of the unfiltered tempered softmax, not of the truncated
    distribution the tokens were sampled from."""
    filter_groups: bool = False
    """DAPO's dynamic sampling (Yu et al. 2025): drop groups whose scores are all equal
    (no group-relative signal) and sample more prompts until rollout_batch_size groups are kept, at
    most filter_groups_max_batches batches; a batch still short then trains on the groups it has.
    Needs n_samples_per_prompt > 1."""
    filter_groups_max_batches: int = 4
    """The most prompt batches sampled per iteration with filter_groups (the first one included)."""

    # ------------------------------------------------------------------ PPO update
    adv_estimator: str = "gae"
    """Advantage estimator (ppo_core.algo): 'gae' (PPO with a critic), or critic-free: 'grpo'
    (group-normalised score), 'dr_grpo' (group-centred score), 'rloo' (leave-one-out baseline),
    'reinforce_pp' (discounted return whitened over the batch), 'reinforce_pp_baseline'
    (group-centred, then batch-whitened). Critic-free runs build, train and save no critic. The
    group estimators use each response's summed reward (score minus its KL penalty when
    kl_in_reward)."""
    policy_loss_kind: str = "ppo"
    """'ppo' (the token-level clipped surrogate), 'cispo' (CISPO, MiniMax-M1 2025: REINFORCE with a
    clipped stop-gradient importance weight, so clipped tokens keep a bounded gradient;
    clip_low >= 1 drops its lower bound, as the paper does), 'gspo' (GSPO's sequence-level ratio,
    Zheng et al. 2025: the length-normalised sequence likelihood ratio clipped per sequence; use
    clip_low/clip_high around 3e-4/4e-4), 'sapo' (SAPO, Qwen 2025: a smooth sigmoid gate in place of
    the clip; sapo_tau_pos/sapo_tau_neg), 'gmpo' (GMPO, Zhao et al. 2025: the geometric mean of each
    response's token ratios, clipped per token in log space; gmpo_clip_low/gmpo_clip_high),
    'clip_cov' or 'kl_cov' (Cui et al. 2025: PPO's clip with a few high-covariance tokens' gradients
    dropped, clip_cov_*; or the unclipped surrogate with a |log r| penalty on the highest-covariance
    tokens, kl_cov_*), 'kl_penalty' (the PPO paper's KL-penalised surrogate, no clip:
    -r A + kl_penalty_beta (r - 1 - log r)). ppo_core.algo.POLICY_LOSSES maps each kind to its
    function and the fields it reads; every kind trains on the fused head (fused_kernels)."""
    ppo_epochs: int = 4
    """Passes over each rollout batch."""
    minibatch_size: int = 0
    """Sequences per optimizer step (0 = the largest divisor of the rollout's rows up to 32: all of
    a rollout of 32 or fewer; config.json holds the number chosen);
    rollout_batch_size * n_samples_per_prompt must be a multiple of it."""
    micro_batch_size: int = 0
    """Sequences per forward/backward (0 = the largest divisor of minibatch_size up to 32;
    config.json holds the number chosen); gradients accumulate over
    minibatch_size / micro_batch_size of them. Read only with micro_batch_tokens = 0."""
    micro_batch_tokens: int = 0
    """> 0: every pass over the experience (old and reference log-probs, values, a reward model's
    scores, the update) runs on packed micro-batches of at most this many real tokens
    (prompt + response, no padding; ppo_core.data.packing), and each minibatch's sequences are split
    across processes by token count; a longer sequence gets a micro-batch of its own. The update is
    the padded one up to the order of floating-point sums. It sets the activation memory: choose the
    most tokens one forward/backward fits (ppo-plan). 0 = padded micro-batches of
    micro_batch_size."""
    lr: float = 5e-4
    """Peak AdamW learning rate of the policy."""
    critic_lr: float = 2e-3
    """Peak AdamW learning rate of the critic."""
    lora_rank: int = 0
    """LoRA (Hu et al. 2021) on q/k/v/o and gate/up/down of policy and critic: only the rank-r
    adapters (and the critic's head) train; the reference is the policy with its adapters off
    (no second copy). 0 = full fine-tuning."""
    lora_alpha: float = 0.0
    """LoRA scale alpha: the update is (alpha / lora_rank) * B A. 0 = lora_rank (scale 1)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay, both models."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 10
    """Optimizer steps of linear LR warm-up from 0."""
    min_lr_ratio: float = 0.1
    """Cosine decay reaches min_lr_ratio * lr at the last optimizer step."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm of each model to this (0 = no clipping)."""
    clip_low: float = 0.2
    """Policy ratio lower clip: ratio >= 1 - clip_low (with cispo, the clip of its importance
    weight; >= 1 = none)."""
    clip_high: float = 0.2
    """Policy ratio upper clip: ratio <= 1 + clip_high (raise it for 'clip-higher')."""
    dual_clip: float = 0.0
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens at c*|A|
    (0 = off)."""
    sapo_tau_pos: float = 1.0
    """sapo: temperature of the soft gate on tokens with A > 0 (the SAPO paper's 1.0)."""
    sapo_tau_neg: float = 1.05
    """sapo: temperature of the soft gate on tokens with A <= 0; larger decays faster (the SAPO
    paper's 1.05)."""
    gmpo_clip_low: float = 0.4
    """gmpo: each token's log-ratio is clipped below at -gmpo_clip_low in the geometric mean (the
    GMPO paper's 0.4)."""
    gmpo_clip_high: float = 0.4
    """gmpo: each token's log-ratio is clipped above at gmpo_clip_high in the geometric mean (the
    GMPO paper's 0.4)."""
    clip_cov_ratio: float = 2e-4
    """clip_cov: share of real tokens (at least 1) drawn from the covariance band, gradient dropped
    (paper: 2e-4)."""
    clip_cov_lb: float = 1.0
    """clip_cov: a token is a candidate when clip_cov_lb < its centred covariance < clip_cov_ub
    (paper: 1)."""
    clip_cov_ub: float = 5.0
    """clip_cov: the covariance band's upper bound, exclusive (the Clip-Cov paper's 5)."""
    kl_cov_ratio: float = 2e-3
    """kl_cov: share of real tokens (at least 1), largest covariance first, given the |log r|
    penalty (paper: 2e-3)."""
    kl_cov_coef: float = 1.0
    """kl_cov: coefficient of the |log r| penalty on those tokens (the KL-Cov paper's 1; verl's
    default 0.1)."""
    kl_penalty_beta: float = 1.0
    """kl_penalty: beta of the per-token KL(pi_old || pi) estimate r - 1 - log r (the PPO paper's
    betas: 0.3-10)."""
    value_clip: float = 0.2
    """Critic predictions move at most this far from the rollout's values per update
    (0 = no clipping)."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss subtracts entropy_coef * the aggregated entropy of the tempered
    policy (0 = off)."""
    target_kl: float = 0.0
    """Early stop: an iteration's remaining minibatches and epochs are skipped once a step's approx
    KL(old || new) exceeds this (CleanRL / Spinning Up; 0 = off). Its schedule steps are skipped
    too, so the LR schedule stays on time."""
    critic_warmup: int = 0
    """Iterations at the start that train only the critic (the policy is not updated); gae only."""
    loss_agg: str = "token-mean"
    """How per-token losses are reduced: token-mean, seq-mean-token-mean, seq-mean-token-sum,
    seq-mean-token-sum-norm."""
    gamma: float = 1.0
    """Discount factor of GAE."""
    lam: float = 0.95
    """GAE lambda."""
    whiten_advantages: bool = True
    """Whiten GAE advantages over the rollout batch (masked mean/variance). The critic-free
    estimators normalise as their papers do and ignore it."""

    # ------------------------------------------------------------------ reward and KL
    kl_coef: float = 0.05
    """KL penalty coefficient beta (the initial one when kl_target > 0)."""
    kl_target: float = 0.0
    """Adaptive KL control (Ziegler et al.): per-token KL to steer towards; 0 = fixed kl_coef."""
    kl_horizon: float = 10000.0
    """Adaptive KL horizon, in samples."""
    kl_in_reward: bool = True
    """True: the kl_reward_kind KL estimate folded into the per-token reward; false: kl_loss_kind KL
    added to the policy loss."""
    kl_reward_kind: str = "k1"
    """KL estimator in the reward when kl_in_reward: k1 (log pi - log ref, TRL's default), k2 or k3
    (clamped as verl)."""
    kl_loss_kind: str = "k3"
    """KL estimator in the loss when kl_in_reward is False. On-policy, their gradients differ: k1's
    is zero in expectation (E_pi[grad log pi] = 0), k3's is the gradient of the forward
    KL(ref || pi) (GRPO, verl's default), k2's is the gradient of the reverse KL(pi || ref)."""
    whiten_rewards: bool = False
    """Whiten the sequence scores over the rollout batch before they enter the rewards."""
    reward_clip: float = 0.0
    """Clamp (possibly whitened) scores to [-reward_clip, reward_clip] (0 = off)."""
    missing_eos_penalty: float = 0.0
    """Subtracted from the raw score of a response that ends without EOS, before whitening and
    clipping (0 = off)."""
    overlong_buffer: int = 0
    """DAPO's overlong soft penalty (Yu et al. 2025, eq. 13) over the last overlong_buffer tokens of
    max_new_tokens: a response of length L > max_new_tokens - overlong_buffer gets
    overlong_penalty * (max_new_tokens - overlong_buffer - L) / overlong_buffer added to its raw
    score (0 = off)."""
    overlong_penalty: float = 1.0
    """Scale of the overlong soft penalty (its value at L = max_new_tokens)."""

    # ------------------------------------------------------------------ evaluation, logging, saving
    eval_size: int = 256
    """Held-out prompts evaluated before and after training (and every eval_every iterations)."""
    eval_every: int = 0
    """Evaluate every this many iterations as well (0 = only before and after)."""
    eval_reward_fn: str = ""
    """A reward function 'module:function' (or 'file.py:function') that scores the held-out
    evaluations instead of the training reward: a ground-truth check while training on a judge or a
    reward model (the reverse task's: ppo_core.data.tasks:reverse_rewards). Empty = the training
    reward."""
    report_to: str = ""
    """Experiment trackers besides metrics.jsonl, comma-separated: 'tensorboard'
    (RUN_DIR/tensorboard) and/or 'wandb' (project ppo-core; WANDB_MODE=offline keeps the run in
    RUN_DIR/wandb); each needs its extra, pip install -e '.[tensorboard]' / '.[wandb]'.
    Empty = metrics.jsonl only."""
    log_samples_every: int = 0
    """Every this many iterations, write the rollout's completions (prompt, response, reward, each
    reward component, the row's extra columns; rank 0's rows) to RUN_DIR/samples.jsonl and the
    trackers' sample table (0 = off)."""
    save_every: int = 20
    """Write a full training checkpoint (policy, critic, optimizers, RNGs) every this many
    iterations (0 = only at the end)."""
    keep_checkpoints: int = 2
    """Keep the newest this many checkpoints (the final one is always kept)."""
    save_rollouts: bool = False
    """Record every iteration's rollout in RUN_DIR/rollouts (ppo_core.run.recording: the prompt
    rows, token ids, masks, scores and reward components, the sampler's log-probs;
    safetensors + JSON), for replay_rollouts. The log's first lines give its size per iteration. One
    process (docs/replay.md)."""
    replay_rollouts: str = ""
    """A run directory recorded with save_rollouts: train on its rollouts, iteration for iteration,
    instead of sampling. Old and reference log-probs, values and advantages are recomputed with this
    run's policy and config; the same config reproduces the recorded run's weights bit for bit,
    another loss or estimator trains on the same data (off-policy after the first iteration: metrics
    off_policy/behav_gap_*). Refused unless it was recorded from the same checkpoint, tokenizer,
    rollout_batch_size, n_samples_per_prompt and max_new_tokens and holds `iterations` iterations.
    Empty = sample. One process (docs/replay.md)."""
    max_skipped_updates: int = 3
    """Stop the run after this many consecutive updates with a non-finite loss or gradient (each is
    skipped)."""
    stop_grace_s: float = 20.0
    """After a SIGTERM / SIGINT, seconds the iteration in flight may take to finish and save; past
    them (or at a second signal) it is abandoned, the last checkpoint kept: exit 143, the process
    gone within 2 s more whatever it was doing (0 = wait for it). 20 s ends inside Slurm's and
    Kubernetes' 30 s pre-emption grace."""
    out: str = ""
    """Run directory. Empty = runs/<policy directory>-<task, or custom with your own
    prompts_file/reward_fn/reward_model>-<date>-<time>."""
    seed: int = 0
    """Seed of every random stream: prompts, sampling, minibatch order, head initialisation."""

    # ------------------------------------------------------------------ execution
    device: str = "auto"
    """'auto' (CUDA when available, else CPU), 'cpu' or 'cuda'."""
    dtype: str = "auto"
    """Precision. 'bf16-mixed': fp32 master weights, the matmuls under bf16 autocast (decoding reads
    bf16 weight copies), log-softmax, losses, GAE and the optimizer in fp32; attention and the KV
    cache in bf16 on a GPU, in fp32 on the CPU (where torch's bf16 attention is the slower:
    bench/cpu_precision.py). 'float32': everything fp32. 'auto': bf16-mixed where bf16 matmuls are
    fast (CUDA; CPUs with AMX or AVX512-BF16, detected and written to the run's config.json and
    log), else float32. 'bfloat16': the parameters themselves in bf16 (no fp32 master copy; for
    memory-bound experiments only)."""
    old_logprobs_from_rollout: bool = False
    """Take the old log-probs (and the entropy metric) from the decoding pass instead of a separate
    forward of the policy over the sampled responses: one forward fewer per iteration, but the
    decode step's rounding (KV cache, one token at a time, packed or bf16 weights) differs from the
    training forward's, so the first minibatch's ratio is no longer exactly 1 (reported as
    policy/first_ratio_max_dev). False = recompute them exactly."""
    rollout_ranks: int = 0
    """Under torchrun: how many processes are rollout workers (ppo_core.run.rollout_worker: the last
    ones), sampling and scoring while the others train (DDP or FSDP among themselves); 0 = every
    process does both in turn. The workers split a rollout's rows as data-parallel processes do
    (LoRA: the adapters travel with the weights; a pairwise judge: each worker holds the frozen
    reference too). With max_staleness=1 the roles overlap."""
    max_staleness: int = 0
    """0: each iteration trains on a rollout its own starting weights sampled (the synchronous
    loop). 1: one-step off-policy, as rollout workers one update behind sample: iteration i trains
    on the rollout sampled with the weights iteration i-1 started from, and samples iteration i+1's
    with its own before updating (the first trains on its own). In one process the two take turns
    (rollout workers overlap them: rollout_ranks); the checkpoint holds the rollout sampled but not
    yet trained on, so a resume is exact. Pair with off_policy_correction. One process, or rollout
    workers beside any number of trainers."""
    off_policy_correction: str = "none"
    """Correct the update for the sampler not being the policy the update starts from (its numerics:
    decoding runs other kernels, bf16 weights, a KV cache; and stale weights, with rollout workers):
    the rollout records its own log-probs (the behaviour policy mu) and each token's loss (ppo,
    cispo) is weighted by a function of k = pi_old / mu (ppo_core.algo's off-policy corrections;
    metrics off_policy/*): 'tis' (min(k, off_policy_cap), Yao et al. 2025), 'decoupled' (k, a token
    above off_policy_cap dropped: AReaL), 'icepop' (k inside [off_policy_band_low,
    off_policy_band_high], else dropped, at off_policy_mask_level), 'none'. The ratio stays
    pi_theta / pi_old."""
    off_policy_cap: float = 2.0
    """With off_policy_correction 'tis' or 'decoupled': C, the largest weight (>= 1)."""
    off_policy_band_low: float = 0.5
    """With off_policy_correction='icepop': tokens with k = pi_old / mu below this are
    dropped (<= 1)."""
    off_policy_band_high: float = 5.0
    """With off_policy_correction='icepop': tokens with k above this are dropped (>= 1)."""
    off_policy_mask_level: str = "token"
    """With off_policy_correction='icepop': 'token' drops tokens, 'sequence' drops a whole response
    whose geometric-mean k lies outside the band."""
    fused_kernels: bool = True
    """Use ppo_kernels' fused paths: LM head + log-probs for the old/reference log-probs, LM
    head + clipped loss for the update. False = the plain torch reference (full logits,
    log_softmax + gather, ppo_core.algo)."""
    rollout_engine: str = "paged"
    """How rollouts, evaluation, reference-policy samples and judges decode. 'paged':
    ppo_core.engine (a paged KV cache sized by rollout_kv_cache_gb, continuous batching, prompts
    shared by a group prefilled once; a row's sampling noise a function of (seed, iteration, row,
    token index) only). 'padded': ppo_core.generate, one left-padded batch decoded until its longest
    row ends (the reference the engine is tested against)."""
    rollout_kv_cache_gb: float = 0.0
    """The paged engine's KV-cache budget in GiB; 0 = the default: 4 on the CPU, 80% of the GPU
    memory free when a rollout starts. A call allocates only what its sequences can hold at once and
    frees it when it returns."""
    cuda_graph: bool = True
    """Decode through CUDA graphs on CUDA devices (one launch per token): rollout_engine='padded'
    captures its static decode step; 'paged' replays its decode-only steps, one graph per batch
    bucket (ppo_core.engine.static_decode; not for an FSDP-sharded policy). Ignored on the CPU."""
    parallel: str = "ddp"
    """With more than one process (torchrun): 'ddp' replicates policy and critic
    (DistributedDataParallel); 'fsdp' shards them with FSDP2 (fully_shard per decoder block, sharded
    checkpoints for resume)."""
    shard_frozen: bool = True
    """With parallel='fsdp': shard the frozen reference and reward models too (False = a full copy
    per process)."""
    cpu_offload: bool = False
    """With parallel='fsdp': keep sharded parameters, gradients and optimizer state in CPU memory
    (CUDA only)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    threads: int = 1
    """torch CPU threads (0 = one per core this process may use, os.sched_getaffinity). A run's
    numbers do not depend on it (the default job's metrics.jsonl and weights are bit-identical with
    1 and 2). One is fastest for the tiny demo model: with two, the default job took 3x as long on a
    2-core machine with other work on it."""
    progress: bool = True
    """Show a progress bar on stderr (only when stderr is a terminal)."""


FIELDS = {f.name: f for f in fields(PPOConfig)}
PATH_FIELDS = ("policy", "reference", "teacher", "critic", "reward_model", "judge", "prompts_file",
               "eval_prompts_file", "replay_rollouts", "out")
DTYPES = ("auto", "float32", "bf16-mixed", "bfloat16")
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
ADV_ESTIMATORS = ("gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
# a baseline from the other responses to the prompt
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")


def records_decode_logprobs(cfg) -> bool:
    """Whether sampling keeps its own log-probs: the old log-probs taken from decoding, or the
    behaviour policy of an off-policy correction."""
    return cfg.old_logprobs_from_rollout or cfg.off_policy_correction != "none"


def uses_critic(cfg) -> bool:
    """Whether the run has a critic: only GAE reads a value function, and distillation alone
    reads none."""
    return cfg.adv_estimator == "gae" and not distills_only(cfg)


def distills_only(cfg) -> bool:
    """Whether the advantages are the distillation term alone (compute_advantages): a teacher
    without distill_with_reward."""
    return bool(cfg.teacher) and not cfg.distill_with_reward


def rollout_rows(cfg) -> int:
    """Sequences per iteration, over all processes: prompts times responses per prompt."""
    return cfg.rollout_batch_size * cfg.n_samples_per_prompt


# sequences: what minibatch_size and micro_batch_size left at 0 grow to at most
LARGEST_DEFAULT_BATCH = 32


def largest_divisor_up_to(n: int, limit: int) -> int:
    """The largest d <= limit that divides n (n >= 1): a default batch size that always fits."""
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def fit_batch_sizes(cfg: PPOConfig) -> PPOConfig:
    """cfg with minibatch_size and micro_batch_size left at 0 (their defaults) set to sizes that
    fit this rollout: the minibatch the largest divisor of the rollout's rows up to 32, the
    micro-batch the largest divisor of the minibatch up to 32 (left 0 with micro_batch_tokens > 0:
    nothing reads it). A size the user set is kept, for validate to refuse when it does not fit.
    cfg is returned unchanged while the rows are not yet >= 1."""
    rows = rollout_rows(cfg)
    if rows < 1:
        return cfg
    minibatch = cfg.minibatch_size or largest_divisor_up_to(rows, LARGEST_DEFAULT_BATCH)
    micro = cfg.micro_batch_size
    if not micro and not cfg.micro_batch_tokens and minibatch >= 1:
        micro = largest_divisor_up_to(minibatch, LARGEST_DEFAULT_BATCH)
    return dataclasses.replace(cfg, minibatch_size=minibatch, micro_batch_size=micro)


# What other libraries (TRL, verl, OpenRLHF, Hugging Face Trainer, CleanRL) call a field here, for
# the unknown-key hint: their name -> the field(s) it means; a name for two things names both.
ALIASES = {
    "learning_rate": ("lr",), "actor_learning_rate": ("lr",), "actor_lr": ("lr",),
    "critic_learning_rate": ("critic_lr",), "value_learning_rate": ("critic_lr",),
    "vf_lr": ("critic_lr",),
    "num_ppo_epochs": ("ppo_epochs",), "num_train_epochs": ("ppo_epochs",),
    "max_epochs": ("ppo_epochs",),
    "num_iterations": ("ppo_epochs",), "update_epochs": ("ppo_epochs",),
    "per_device_train_batch_size": ("micro_batch_size", "minibatch_size"),
    "micro_train_batch_size": ("micro_batch_size",),
    "ppo_micro_batch_size": ("micro_batch_size",),
    "ppo_micro_batch_size_per_gpu": ("micro_batch_size",),
    "gradient_accumulation_steps": ("minibatch_size", "micro_batch_size"),
    "mini_batch_size": ("minibatch_size",),
    "ppo_mini_batch_size": ("minibatch_size",), "num_mini_batches": ("minibatch_size",),
    "num_minibatches": ("minibatch_size",), "batch_size": ("rollout_batch_size",),
    "train_batch_size": ("rollout_batch_size", "minibatch_size"),
    "micro_rollout_batch_size": ("rollout_batch_size",),
    "num_generations": ("n_samples_per_prompt",), "num_samples": ("n_samples_per_prompt",),
    "n": ("n_samples_per_prompt",),
    "group_size": ("n_samples_per_prompt",), "num_return_sequences": ("n_samples_per_prompt",),
    "beta": ("kl_coef",), "init_kl_coef": ("kl_coef",), "init_kl_coeff": ("kl_coef",),
    "kl_coeff": ("kl_coef",),
    "kl_beta": ("kl_coef",), "kl_ctl": ("kl_coef",), "kl_penalty_coef": ("kl_coef",),
    "kl_loss_coef": ("kl_coef",),
    "use_kl_loss": ("kl_in_reward",), "use_kl_in_reward": ("kl_in_reward",),
    "kl_penalty": ("kl_reward_kind",),
    "kl_estimator": ("kl_reward_kind", "kl_loss_kind"), "kl_loss_type": ("kl_loss_kind",),
    "adap_kl_ctrl": ("kl_target",), "horizon": ("kl_horizon",),
    "max_completion_length": ("max_new_tokens",), "response_length": ("max_new_tokens",),
    "max_response_length": ("max_new_tokens",), "generate_max_len": ("max_new_tokens",),
    "max_tokens": ("max_new_tokens",),
    "cliprange": ("clip_low", "clip_high"), "clip_ratio": ("clip_low", "clip_high"),
    "eps_clip": ("clip_low", "clip_high"), "epsilon": ("clip_low", "clip_high"),
    "clip_coef": ("clip_low", "clip_high"),
    "clip_range": ("clip_low", "clip_high"),
    "clip_ratio_low": ("clip_low",), "epsilon_low": ("clip_low",),
    "clip_ratio_high": ("clip_high",),
    "epsilon_high": ("clip_high",), "clip_ratio_c": ("dual_clip",), "dual_clip_c": ("dual_clip",),
    "cliprange_value": ("value_clip",), "value_clip_range": ("value_clip",),
    "clip_vloss": ("value_clip",),
    "entropy_coeff": ("entropy_coef",), "ent_coef": ("entropy_coef",),
    "entropy_loss_coef": ("entropy_coef",),
    "gae_lambda": ("lam",), "lambd": ("lam",), "lmbda": ("lam",), "grad_clip": ("max_grad_norm",),
    "adam_epsilon": ("adam_eps",), "lr_warmup_steps": ("warmup_steps",),
    "num_warmup_steps": ("warmup_steps",),
    "loss_type": ("loss_agg", "policy_loss_kind"), "loss_agg_mode": ("loss_agg",),
    "advantage_estimator": ("adv_estimator",), "norm_adv": ("whiten_advantages",),
    "max_steps": ("iterations",), "total_episodes": ("iterations",),
    "num_episodes": ("iterations",),
    "total_training_steps": ("iterations",), "total_timesteps": ("iterations",),
    "output_dir": ("out",), "save_path": ("out",), "save_steps": ("save_every",),
    "eval_steps": ("eval_every",),
    "model_name_or_path": ("policy",), "sft_model_path": ("policy",), "pretrain": ("policy",),
    "model": ("policy",),
    "ref_model": ("reference",), "ref_pretrain": ("reference",), "critic_pretrain": ("critic",),
    "value_model_path": ("critic",), "reward_model_path": ("reward_model",),
    "reward_pretrain": ("reward_model",),
    "reward_funcs": ("reward_fn",), "remote_rm_url": ("reward_url",),
    "train_file": ("prompts_file",),
    "train_files": ("prompts_file",), "prompt_data": ("prompts_file",),
    "dataset_name": ("prompts_file",),
    "val_files": ("eval_prompts_file",), "eval_dataset": ("eval_prompts_file",),
    "bf16": ("dtype",), "torch_dtype": ("dtype",), "lora_r": ("lora_rank",),
    "overlong_buffer_len": ("overlong_buffer",), "overlong_penalty_factor": ("overlong_penalty",),
    "dynamic_sampling": ("filter_groups",), "max_num_gen_batches": ("filter_groups_max_batches",),
}


def _unknown_key(key, where) -> str:
    """The error line for a key that is no field, naming at most three fields it may mean: first by
    meaning, the fields another library's name for them is (ALIASES; a misspelt one too:
    'clip_ration' -> clip_low, clip_high), then by spelling (difflib). Where a meaning is found,
    only near-identical spellings (ratio >= 0.9) are added: 'clip_ration' is neither 'iterations'
    nor 'clip_cov_ratio'."""
    meant = ALIASES.get(key) or tuple(
        name for alias in difflib.get_close_matches(key, ALIASES, n=1, cutoff=0.8)
        for name in ALIASES[alias])
    spelt = difflib.get_close_matches(key, FIELDS, n=3, cutoff=0.9 if meant else 0.6)
    close = list(dict.fromkeys([*meant, *spelt]))[:3]
    hint = f" (did you mean {' or '.join(repr(name) for name in close)}?)" if close else ""
    return f"unknown config key '{key}'{where}{hint}"


def url_host_port(url: str) -> bool:
    """Whether a parser reads the URL's host and port where they are: after its last @ (a # / ? in
    a password would end the host part before it), a port that is a number in 0-65535."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # raises ValueError when it is not a number in range
    except ValueError:
        return False
    return bool(parts.hostname) and url.count("@") == parts.netloc.count("@")


def _one_error(problems: list[str]) -> ConfigError:
    """Every problem found in one ConfigError, so that one run shows all there is to fix: one
    problem as it is; several as "N config problems: first; second; ...", still one line."""
    if len(problems) == 1:
        return ConfigError(problems[0])
    return ConfigError(f"{len(problems)} config problems: " + "; ".join(problems))


def _coerce(key, value, from_text):
    """Convert `value` to the field's type: command-line text is parsed, TOML values checked.

    A list field takes a TOML list, or text whose comma-separated items are parsed one by one (the
    command line's form, accepted from TOML too: `reward_fn = "my_rewards.py:score"`); empty text
    is the empty list.
    """
    kind = FIELDS[key].type
    if typing.get_origin(kind) is list:
        item_kind = typing.get_args(kind)[0]
        if isinstance(value, str):
            items = [item.strip() for item in value.split(",")] if value.strip() else []
            if any(item == "" for item in items):
                raise ConfigError(f"config key '{key}' has an empty item in {value!r} (items are "
                                  f"separated by commas)")
            try:
                return [_coerce_one(key, item, item_kind, True) for item in items]
            except ConfigError:
                raise ConfigError(
                    f"config key '{key}' expects a comma-separated list of {item_kind.__name__}, "
                    f"got {value!r}") from None
        if not isinstance(value, list):
            raise ConfigError(f"config key '{key}' expects a list of {item_kind.__name__}, got "
                              f"{type(value).__name__} {value!r}")
        return [_coerce_one(key, item, item_kind, False) for item in value]
    return _coerce_one(key, value, kind, from_text)


def _coerce_one(key, value, kind, from_text):
    """One value of type `kind` (int, float, bool or str) from command-line text or a TOML value."""
    kind = {"int": int, "float": float, "bool": bool, "str": str}.get(kind, kind)
    if from_text:
        try:
            if kind is bool:
                lowered = value.lower()
                if lowered not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                return lowered in ("true", "1", "yes")
            return kind(value)
        except ValueError:
            raise ConfigError(
                f"config key '{key}' expects {kind.__name__}, got {value!r}") from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(
            f"config key '{key}' expects {kind.__name__}, got {type(value).__name__} {value!r}")
    return value


def load_toml(path) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None


def build_config(toml_values: dict | None = None, overrides: dict | None = None,
                 toml_path="") -> PPOConfig:
    """Defaults < TOML values < command-line overrides (strings), then validated, paths made
    absolute: every unknown key, impossible value and conflict in one ConfigError (a value of the
    wrong type stops before the checks of values, which would check the default in its place)."""
    values, problems, unreadable = {}, [], False
    for key, value in (toml_values or {}).items():
        if isinstance(value, dict):
            problems.append(f"config file {toml_path}: tables are not used, key '{key}' must be a "
                            "plain value (the config is flat)")
        elif key not in FIELDS:
            problems.append(_unknown_key(key, f" in {toml_path}" if toml_path else ""))
        else:
            try:
                values[key] = _coerce(key, value, from_text=False)
            except ConfigError as e:
                problems.append(str(e))
                unreadable = True
    for key, value in (overrides or {}).items():
        if key not in FIELDS:
            problems.append(_unknown_key(key, ""))
            continue
        try:
            values[key] = _coerce(key, value, from_text=True)
        except ConfigError as e:
            problems.append(str(e))
            unreadable = True
    if unreadable:
        raise _one_error(problems)
    if values.get("task") == "toolmul" and not values.get("environment"):
        # the task is played with the calculator (ppo_core.data.tasks)
        values["environment"] = "tools"
    cfg = fit_batch_sizes(PPOConfig(**values))
    problems += _problems(cfg)  # on the values as given, which the messages quote
    if problems:
        raise _one_error(problems)
    resolved = absolute_paths(values)
    return dataclasses.replace(cfg, **{key: value for key, value in resolved.items()
                                       if value != values[key]})


def absolute_paths(values: dict) -> dict:
    """Config values (a dict of some fields) with every path made absolute against the working
    directory now, `~` expanded (`--policy=~/models/x`: the shell expands ~ only at the start of a
    word): PATH_FIELDS (`out` only expanded: a resume names its run directory itself), a
    judge_template that is a file rather than a shipped name, and the file part of a
    'path/file.py:function' spec (reward_fn, eval_reward_fn, environment; a dotted module name is
    left as it is, imported from sys.path). So a run directory's config.json names the same files
    from any directory (`--resume`)."""
    out = dict(values)
    for key in PATH_FIELDS:
        if out.get(key):
            out[key] = (os.path.expanduser(out[key]) if key == "out"
                        else os.path.abspath(os.path.expanduser(out[key])))
    template = out.get("judge_template")
    if template and (os.sep in template or template.endswith(".jinja") or os.path.isfile(template)):
        out["judge_template"] = os.path.abspath(os.path.expanduser(template))
    if "reward_fn" in out:
        out["reward_fn"] = [_absolute_spec(spec) for spec in out["reward_fn"]]
    for key in ("eval_reward_fn", "environment"):
        if out.get(key):
            out[key] = _absolute_spec(out[key])
    return out


def _absolute_spec(spec):
    """'~/r.py:score' -> '/home/me/r.py:score', 'r.py:score' -> '/cwd/r.py:score'; a dotted module
    name ('pkg.mod:score') and a name with no module ('tools') are left as they are."""
    module, colon, function = spec.rpartition(":")
    if not colon or not (module.endswith(".py") or os.sep in module or module.startswith("~")):
        return spec
    return os.path.abspath(os.path.expanduser(module)) + colon + function


def validate(cfg: PPOConfig):
    """Reject impossible values and conflicts, naming the field: all found, in one ConfigError."""
    problems = _problems(cfg)
    if problems:
        raise _one_error(problems)


def _problems(cfg: PPOConfig) -> list[str]:
    """validate's problems, one line each (a check that divides by a field first checks that
    field's range, so that a bad value is one problem, not a crash)."""
    problems = []

    def need(ok, key, what):
        if not ok:
            problems.append(f"config key '{key}' {what}, got {getattr(cfg, key)!r}")

    for key in ("iterations", "rollout_batch_size", "n_samples_per_prompt",
                "filter_groups_max_batches", "keep_checkpoints", "max_skipped_updates",
                "max_new_tokens", "ppo_epochs", "eval_size"):
        need(getattr(cfg, key) >= 1, key, "must be >= 1")
    # 0 is their default, which fit_batch_sizes makes a size (left 0 only where the rows are not
    # known yet, or for a micro_batch_size nothing reads)
    need(cfg.minibatch_size >= 0, "minibatch_size",
         "must be >= 1 (or 0: the largest divisor of the rollout up to 32)")
    need(cfg.micro_batch_size >= 0, "micro_batch_size",
         "must be >= 1 (or 0: the largest divisor of minibatch_size up to 32)")
    for key in ("lr", "critic_lr", "temperature", "kl_horizon"):
        need(getattr(cfg, key) > 0, key, "must be > 0")
    for key in ("weight_decay", "adam_eps", "warmup_steps", "max_grad_norm", "clip_low",
                "clip_high", "value_clip", "kl_coef", "kl_target", "reward_clip",
                "missing_eos_penalty", "entropy_coef", "target_kl", "critic_warmup",
                "overlong_buffer", "overlong_penalty", "eval_every", "log_samples_every",
                "save_every", "top_k", "threads"):
        need(getattr(cfg, key) >= 0, key, "must be >= 0")
    need(cfg.stop_grace_s >= 0, "stop_grace_s",
         "must be >= 0 (0 = wait for the iteration in flight)")
    # cispo: clip_low >= 1 lifts the weight's floor
    need(cfg.clip_low < 1 or cfg.policy_loss_kind == "cispo", "clip_low",
         "must be < 1 (the ratio's lower bound 1 - clip_low must stay positive)")
    need(0 < cfg.top_p <= 1, "top_p", "must be in (0, 1]")
    need(0 <= cfg.adam_beta1 < 1, "adam_beta1", "must be in [0, 1)")
    need(0 <= cfg.adam_beta2 < 1, "adam_beta2", "must be in [0, 1)")
    need(0 <= cfg.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")
    need(0 <= cfg.gamma <= 1, "gamma", "must be in [0, 1]")
    need(0 <= cfg.lam <= 1, "lam", "must be in [0, 1]")
    need(cfg.dual_clip == 0 or cfg.dual_clip > 1, "dual_clip", "must be 0 (off) or > 1")
    for key in ("sapo_tau_pos", "sapo_tau_neg"):
        need(getattr(cfg, key) > 0, key, "must be > 0")
    for key in ("gmpo_clip_low", "gmpo_clip_high", "kl_cov_coef", "kl_penalty_beta"):
        need(getattr(cfg, key) >= 0, key, "must be >= 0")
    for key in ("clip_cov_ratio", "kl_cov_ratio"):
        need(0 < getattr(cfg, key) <= 1, key, "must be in (0, 1]")
    need(cfg.clip_cov_lb < cfg.clip_cov_ub, "clip_cov_lb",
         f"must be < clip_cov_ub ({cfg.clip_cov_ub})")
    need(cfg.loss_agg in AGG_MODES, "loss_agg", f"must be one of {', '.join(AGG_MODES)}")
    need(cfg.kl_loss_kind in ("k1", "k2", "k3"), "kl_loss_kind", "must be one of k1, k2, k3")
    need(all(n.strip() in ("tensorboard", "wandb") for n in cfg.report_to.split(",") if n.strip()),
         "report_to", "must be a comma-separated list of tensorboard, wandb")
    need(cfg.kl_reward_kind in ("k1", "k2", "k3"), "kl_reward_kind", "must be one of k1, k2, k3")
    need(cfg.adv_estimator in ADV_ESTIMATORS, "adv_estimator",
         f"must be one of {', '.join(ADV_ESTIMATORS)}")
    need(cfg.policy_loss_kind in POLICY_LOSS_KINDS, "policy_loss_kind",
         f"must be one of {', '.join(POLICY_LOSS_KINDS)}")
    need(cfg.adv_estimator not in GROUP_ESTIMATORS or cfg.n_samples_per_prompt > 1,
         "n_samples_per_prompt",
         f"must be > 1 for adv_estimator={cfg.adv_estimator!r} (its baseline comes from the other "
         "responses to the prompt)")
    need(not cfg.filter_groups or cfg.n_samples_per_prompt > 1, "filter_groups",
         "needs n_samples_per_prompt > 1")
    need(cfg.critic_warmup == 0 or uses_critic(cfg), "critic_warmup",
         "needs a critic: distillation alone trains none (distill_with_reward=true keeps "
         "adv_estimator's)"
         if distills_only(cfg)
         else f"needs a critic (adv_estimator='gae'), not {cfg.adv_estimator!r}")
    need(math.isfinite(cfg.distill_coef) and cfg.distill_coef > 0, "distill_coef",
         "must be a finite number > 0")
    need(cfg.critic_warmup < cfg.iterations, "critic_warmup",
         f"must be < iterations ({cfg.iterations})")
    need(cfg.overlong_buffer <= cfg.max_new_tokens, "overlong_buffer",
         f"must be <= max_new_tokens ({cfg.max_new_tokens})")
    need(cfg.allow_filtered_sampling or (cfg.top_p == 1.0 and cfg.top_k == 0),
         "top_p" if cfg.top_p != 1.0 else "top_k",
         "filters the sampling distribution, but log-probs, ratio and KL are of the unfiltered "
         "one; set allow_filtered_sampling=true to train so anyway")
    need(cfg.device in ("auto", "cpu", "cuda"), "device", "must be auto, cpu or cuda")
    need(cfg.dtype in DTYPES, "dtype", f"must be one of {', '.join(DTYPES)}")
    need(cfg.parallel in ("ddp", "fsdp"), "parallel", "must be ddp or fsdp")
    need(cfg.rollout_engine in ("paged", "padded"), "rollout_engine", "must be paged or padded")
    need(cfg.off_policy_correction in ("none", "tis", "decoupled", "icepop"),
         "off_policy_correction", "must be none, tis, decoupled or icepop")
    if cfg.off_policy_correction != "none":
        need(not cfg.old_logprobs_from_rollout, "off_policy_correction",
             "compares the sampler's log-probs with the "
             "recomputed old ones: it needs old_logprobs_from_rollout = false")
        sequence_ratio = ("gspo", "gmpo")
        need(cfg.policy_loss_kind not in sequence_ratio, "off_policy_correction",
             "weights a token-level loss ("
             f"{', '.join(k for k in POLICY_LOSS_KINDS if k not in sequence_ratio)}), "
             "not GSPO's or GMPO's sequence ratio")
    need(cfg.off_policy_cap >= 1, "off_policy_cap", "must be >= 1")
    need(cfg.max_staleness in (0, 1), "max_staleness", "must be 0 or 1")
    need(cfg.rollout_ranks >= 0, "rollout_ranks", "must be >= 0")
    # the rollouts are read, not sampled: nothing here samples, nothing to record again
    if cfg.replay_rollouts:
        need(not cfg.save_rollouts, "save_rollouts",
             "does not combine with replay_rollouts (its rollouts are recorded "
             "already)")
        need(not cfg.max_staleness, "max_staleness",
             "does not combine with replay_rollouts (nothing is sampled, so "
             "nothing is stale)")
    for key in ("save_rollouts", "replay_rollouts"):
        need(not (getattr(cfg, key) and cfg.rollout_ranks), key,
             "runs in one process, without rollout workers "
             "(rollout_ranks; docs/replay.md)")
    need(0 < cfg.off_policy_band_low <= 1 <= cfg.off_policy_band_high, "off_policy_band_low",
         "and off_policy_band_high must satisfy 0 < low <= 1 <= high")
    need(cfg.off_policy_mask_level in ("token", "sequence"), "off_policy_mask_level",
         "must be token or sequence")
    if cfg.environment:
        need(cfg.rollout_engine == "paged", "environment",
             "needs rollout_engine='paged' (episodes continue on the engine's cache)")
        need(cfg.environment == "tools" or ":" in cfg.environment, "environment",
             f"must be 'tools' or 'file.py:Class' / 'module:Class', got {cfg.environment!r}")
        need(not (cfg.reward_fn or cfg.reward_model or cfg.judge or cfg.reward_url), "environment",
             "scores episodes with the environment's rewards: drop reward_fn, reward_model, judge "
             "and reward_url")
        need(not cfg.filter_groups, "environment", "does not combine with filter_groups yet")
        need(cfg.max_turns >= 1, "max_turns", "must be >= 1")
        need(cfg.max_tool_calls_per_turn >= 1, "max_tool_calls_per_turn", "must be >= 1")
        need(cfg.max_turn_tokens >= 0, "max_turn_tokens",
             "must be >= 0 (0 = no limit but max_new_tokens)")
        need(cfg.max_observation_chars >= 0, "max_observation_chars", "must be >= 0 (0 = no cap)")
    need(cfg.rollout_kv_cache_gb >= 0, "rollout_kv_cache_gb",
         "must be >= 0 (0 = the default budget)")
    need(cfg.lora_rank >= 0, "lora_rank", "must be >= 0")
    need(cfg.lora_alpha >= 0, "lora_alpha", "must be >= 0")
    need(cfg.lora_rank > 0 or cfg.lora_alpha == 0, "lora_alpha", "needs lora_rank > 0")
    need(not cfg.cpu_offload or cfg.parallel == "fsdp", "cpu_offload", "needs parallel='fsdp'")
    need(cfg.task in ("reverse", "arith", "toolmul"), "task",
         "must be 'reverse', 'arith' or 'toolmul' (the built-in tasks)")
    rows = rollout_rows(cfg)
    need(cfg.minibatch_size <= rows, "minibatch_size",
         f"must be <= rollout_batch_size * n_samples_per_prompt ({rows})")
    # a multiple is checked only where the sizes are in range: one cause, one line
    need(not 1 <= cfg.minibatch_size <= rows or rows % cfg.minibatch_size == 0,
         "rollout_batch_size",
         f"times n_samples_per_prompt ({rows}) must be a multiple of minibatch_size "
         f"({cfg.minibatch_size})")
    need(cfg.micro_batch_tokens >= 0, "micro_batch_tokens",
         "must be >= 0 (0 = padded micro-batches of micro_batch_size)")
    if not cfg.micro_batch_tokens:
        need(cfg.micro_batch_size <= cfg.minibatch_size, "micro_batch_size",
             f"must be <= minibatch_size ({cfg.minibatch_size})")
        need(not 1 <= cfg.micro_batch_size <= cfg.minibatch_size
             or cfg.minibatch_size % cfg.micro_batch_size == 0, "minibatch_size",
             f"must be a multiple of micro_batch_size ({cfg.micro_batch_size})")
    need(cfg.kl_target == 0 or cfg.kl_coef > 0, "kl_coef",
         "must be > 0 when kl_target > 0 (the adaptive controller scales it multiplicatively)")
    need(not (cfg.reward_fn and cfg.reward_model), "reward_model",
         "conflicts with reward_fn: give one reward source")
    need(not (cfg.reward_url and (cfg.reward_fn or cfg.reward_model)), "reward_url",
         "conflicts with reward_fn and reward_model: give one reward source (the server has "
         "its own)")
    need(not (cfg.judge and (cfg.reward_fn or cfg.reward_model or cfg.reward_url)), "judge",
         "conflicts with reward_fn, reward_model and reward_url: give one reward source (a server "
         "builds its own judge)")
    need(cfg.judge_mode in ("pointwise", "pairwise"), "judge_mode", "must be pointwise or pairwise")
    for key in ("judge_max_new_tokens", "judge_batch_size"):
        need(getattr(cfg, key) >= 1, key, "must be >= 1")
    need(cfg.judge_temperature >= 0, "judge_temperature", "must be >= 0 (0 = greedy)")
    need(not cfg.judge_score_range or (len(cfg.judge_score_range) == 2
                                       and cfg.judge_score_range[0] < cfg.judge_score_range[1]),
         "judge_score_range", "must be empty or two numbers lo,hi with lo < hi")
    # the value is printed redacted (ppo_core.rewards.redact), never as given
    for url in cfg.reward_url:
        http = url.lower().startswith(("http://", "https://"))
        need(http, "reward_url", f"must hold http:// or https:// URLs, not {url!r}")
        need(not http or url_host_port(url), "reward_url",
             "holds a URL whose host or port cannot be read: a # / ? "
             "in its user:password@ ends the host part early, an @ after it reads as one; "
             "percent-encode them "
             "(%23 %2F %3F %40)")
    need(cfg.reward_timeout_s > 0, "reward_timeout_s", "must be > 0")
    need(cfg.reward_retries >= 0, "reward_retries", "must be >= 0")
    need(cfg.eval_reward_fn == "" or ":" in cfg.eval_reward_fn, "eval_reward_fn",
         "must be 'module:function'")
    for spec in cfg.reward_fn:
        need(":" in spec, "reward_fn",
             f"must name each function as 'module:function' (or 'file.py:function'), not {spec!r}")
    need(len(set(cfg.reward_fn)) == len(cfg.reward_fn), "reward_fn",
         "names a function twice (add the weights up instead)")
    need(not cfg.reward_weights or cfg.reward_fn, "reward_weights",
         "needs reward_fn (one weight per reward function)")
    need(not cfg.reward_weights or len(cfg.reward_weights) == len(cfg.reward_fn), "reward_weights",
         f"must hold one weight per reward_fn ({len(cfg.reward_fn)})")
    need(all(math.isfinite(w) for w in cfg.reward_weights), "reward_weights", "must be finite")
    return problems + _unread_settings(cfg)


def refuse_unread_settings(cfg: PPOConfig):
    """Keys that only some estimators, loss kinds or modes read, set away from their default where
    nothing reads them: refused, naming both keys, rather than silently ignored (a run that differs
    from what its config says)."""
    problems = _unread_settings(cfg)
    if problems:
        raise _one_error(problems)


def _unread_settings(cfg: PPOConfig) -> list[str]:
    """refuse_unread_settings' problems, one line each."""
    default, problems = PPOConfig(), []

    def unread(key, other, why):
        if getattr(cfg, key) != getattr(default, key):
            problems.append(
                f"config key '{key}' has no effect with {other}={getattr(cfg, other)!r} ({why}), "
                f"got {getattr(cfg, key)!r}")

    # a loss's own settings (the fields its algo.POLICY_LOSSES entry names), another loss chosen
    if cfg.policy_loss_kind in POLICY_LOSSES:
        reads = set(POLICY_LOSSES[cfg.policy_loss_kind][1])
        for key in dict.fromkeys(name for _, names, _ in POLICY_LOSSES.values() for name in names):
            if key not in reads:
                readers = ", ".join(kind for kind, (_, names, _) in POLICY_LOSSES.items()
                                    if key in names)
                unread(key, "policy_loss_kind", f"only policy_loss_kind {readers} reads it")
    if cfg.policy_loss_kind == "gspo":
        if cfg.kl_in_reward and not cfg.entropy_coef:
            unread("loss_agg", "policy_loss_kind",
                   "GSPO averages over sequences; loss_agg reduces only a KL loss "
                   "term (kl_in_reward=false) and the entropy bonus (entropy_coef)")
    if cfg.policy_loss_kind == "gmpo":
        if cfg.kl_in_reward and not cfg.entropy_coef:
            unread("loss_agg", "policy_loss_kind",
                   "GMPO averages over sequences; loss_agg reduces only a KL loss "
                   "term (kl_in_reward=false) and the entropy bonus (entropy_coef)")
    if not cfg.teacher:
        for key in ("distill_coef", "distill_with_reward"):
            unread(key, "teacher", "no teacher, no distillation")
    # the advantages are the teacher's alone: nothing of the reward's or the estimator's is read
    if distills_only(cfg):
        for key in ("adv_estimator", "critic", "critic_lr", "value_clip", "lam",
                    "whiten_advantages", "whiten_rewards", "reward_clip", "missing_eos_penalty",
                    "overlong_buffer"):
            unread(key, "distill_with_reward",
                   "distillation alone trains on the teacher's per-token advantages; "
                   "distill_with_reward=true adds the reward's")
        # the reference's KL penalty lives in the rewards (kl_in_reward=false: a loss term, kept)
        if cfg.kl_in_reward:
            for key in ("kl_coef", "kl_target", "kl_reward_kind"):
                unread(key, "distill_with_reward",
                       "distillation alone reads no reward, so no KL penalty in it; "
                       "kl_in_reward=false keeps the KL to the reference as a loss term")
    elif not uses_critic(cfg):
        for key in ("critic", "critic_lr", "value_clip", "lam", "whiten_advantages"):
            unread(key, "adv_estimator",
                   "a critic-free estimator: no critic, no GAE, its own normalisation")
    if cfg.kl_in_reward:
        unread("kl_loss_kind", "kl_in_reward",
               "the KL is in the reward: kl_reward_kind picks its estimator")
    else:
        unread("kl_reward_kind", "kl_in_reward",
               "the KL is a loss term: kl_loss_kind picks its estimator")
    if not cfg.kl_target:
        unread("kl_horizon", "kl_target",
               "the KL coefficient is fixed; the horizon paces the adaptive controller")
    if not cfg.overlong_buffer:
        unread("overlong_penalty", "overlong_buffer", "no overlong penalty without a buffer")
    if not cfg.filter_groups:
        unread("filter_groups_max_batches", "filter_groups", "no group filter")
    if not cfg.prompts_file:
        unread("eval_prompts_file", "prompts_file", "the task's own held-out prompts are evaluated")
    if cfg.micro_batch_tokens:
        unread("micro_batch_size", "micro_batch_tokens", "packed micro-batches are sized in tokens")
    if cfg.off_policy_correction not in ("tis", "decoupled"):
        unread("off_policy_cap", "off_policy_correction", "only tis and decoupled cap the weight")
    if cfg.off_policy_correction != "icepop":
        for key in ("off_policy_band_low", "off_policy_band_high", "off_policy_mask_level"):
            unread(key, "off_policy_correction", "only icepop masks by a band")
    if not cfg.environment:
        for key in ("max_turns", "max_turn_tokens", "max_observation_chars"):
            unread(key, "environment", "one response per prompt, no turns")
    if cfg.environment != "tools":
        unread("tools", "environment", "only the shipped ToolEnvironment offers them")
        unread("max_tool_calls_per_turn", "environment",
               "only the shipped ToolEnvironment runs tool calls")
    if not cfg.chat_template and not cfg.environment:
        unread("enable_thinking", "chat_template",
               "only a chat template reads it (or an environment's episodes)")
    if cfg.parallel == "ddp":
        unread("shard_frozen", "parallel", "only FSDP shards")
    if not cfg.reward_url:
        for key in ("reward_timeout_s", "reward_retries"):
            unread(key, "reward_url", "they apply to a reward server")
    if not cfg.judge:
        for key in ("judge_template", "judge_max_new_tokens", "judge_unparsed_score",
                    "judge_score_range", "judge_temperature", "judge_enable_thinking",
                    "judge_batch_size"):
            unread(key, "judge", "no judge in this process")
        if not cfg.reward_url:  # a pairwise judge on a reward server reads these two as well
            for key in ("judge_mode", "judge_reference_column"):
                unread(key, "judge", "no judge in this process or on a reward server")
    return problems


def parse_cli(argv: list[str]) -> tuple[dict, dict]:
    """Split argv into the driver's own flags (--config, --resume) and config overrides.

    Accepts `--key=value` and `--key value`; `--flag` alone sets a bool field to true. A key that is
    no field is passed on in the overrides, for build_config to list with every other problem; the
    malformed arguments are listed in one ConfigError here.
    """
    own, overrides, problems = {}, {}, []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--") or arg == "--":
            problems.append(f"unexpected argument {arg!r} (options look like --key=value)")
            continue
        key, eq, value = arg[2:].partition("=")
        key = key.replace("-", "_")
        known = key in FIELDS or key in ("config", "resume")
        if not eq:
            is_bool = key in FIELDS and FIELDS[key].type in (bool, "bool")
            nxt = argv[i] if i < len(argv) else None
            if nxt is not None and not nxt.startswith("--"):
                value = nxt
                i += 1
            elif is_bool:
                value = "true"
            elif known:
                problems.append(f"option --{key} needs a value")
                continue
        if key in ("config", "resume"):
            own[key] = value
        else:
            overrides[key] = value
    if problems:
        raise _one_error(problems)
    return own, overrides


def to_dict(cfg: PPOConfig) -> dict:
    return dataclasses.asdict(cfg)


# ------------------------------------------------------------------------------------------- --help

SECTION_COMMENT = re.compile(r"^\s*# -{3,}\s*(.+?)\s*$")  # `    # ------------ models and data`


def field_docs() -> dict:
    """{field name: (section, docstring)} for every field of PPOConfig, read from this file's
    source: the docstring under each field, and the `# ------ <section>` comment above it (comments
    are not in the AST, so lines are scanned)."""
    with open(__file__) as f:
        source = f.read()
    lines = source.splitlines()
    cls = next(n for n in ast.parse(source).body
               if isinstance(n, ast.ClassDef) and n.name == "PPOConfig")
    docs = {}
    for node, nxt in zip(cls.body, cls.body[1:] + [None]):
        if not isinstance(node, ast.AnnAssign):
            continue
        section = ""
        for line in lines[cls.lineno : node.lineno - 1]:  # the class body above this field
            match = SECTION_COMMENT.match(line)
            if match:
                section = match.group(1)
        is_doc = (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                  and isinstance(nxt.value.value, str))
        docs[node.target.id] = (section, nxt.value.value if is_doc else "")
    return docs


def first_sentence(text: str) -> str:
    """The text, whitespace collapsed, up to its first full stop outside parentheses ('e.g.' and
    'et al.' sit in parentheses in the field docstrings)."""
    text = " ".join(text.split())
    depth = 0
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if ch == "." and depth == 0 and (i + 1 == len(text) or text[i + 1] == " "):
            return text[: i + 1]
    return text


def _type_name(kind) -> str:
    if typing.get_origin(kind) is list:
        return f"comma-separated list of {typing.get_args(kind)[0].__name__}"
    return kind.__name__


def show_default(value) -> str:
    """A default as one would type it after --key= (a list comma-separated), for --help and
    docs/configuration.md."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(str(v) for v in value) or '""'
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def help_text() -> str:
    """Every option for `ppo-train --help`, grouped by the sections of PPOConfig in their order:

        models and data:
          --policy (str, default "")
              Policy checkpoint directory (HF layout).
    """
    defaults = PPOConfig()
    out, section = [], None
    for name, (field_section, doc) in field_docs().items():
        if field_section != section:
            section = field_section
            out.append(f"\n{section}:" if out else f"{section}:")
        out.append(f"  --{name} ({_type_name(FIELDS[name].type)}, default "
                   f"{show_default(getattr(defaults, name))})")
        out.extend(textwrap.wrap(first_sentence(doc), width=110, initial_indent=" " * 6,
                                 subsequent_indent=" " * 6, break_on_hyphens=False))
    return "\n".join(out)
