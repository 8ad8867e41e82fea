"""ppo-train: one PPO run. `run` is the outline, top to bottom; the parts it calls follow it in
its order.

    ppo-train                         # the default job: the shipped demo checkpoint, CPU, ~30 s
    ppo-train --adv_estimator=grpo --n_samples_per_prompt=8     # GRPO on the same task, no critic
    ppo-train --config configs/default.toml --iterations=100 --out runs/mine

One iteration (Ouyang et al. 2022; Huang et al. 2024, "The N+ implementation details of RLHF with
PPO"):
  1. rollout:  sample n_samples_per_prompt responses per prompt from the policy (KV-cache
               decoding); with filter_groups, groups whose scores are all equal are replaced by
               fresh ones (DAPO)                                                ppo_core.rollout
               (with an environment: multi-turn episodes; with max_staleness=1, the rollout
               sampled one update earlier; with rollout_ranks, sampled by a rollout worker:
               stale_rollout, ppo_core.run.rollout_worker; with replay_rollouts, 1-2 read from a
               recorded run, save_rollouts records them: replayed_rollout, record_rollout,
               ppo_core.run.recording)
  2. score:    the reward function or model gives one scalar per response
                                                                         ppo_core.rewards.source
  3. forward:  old log-probs and entropy (policy), reference log-probs, the teacher's (on-policy
               distillation, if any), values (critic, if any), all with the training code path;
               the rows of the update's first minibatch get their old log-probs from its own
               forward instead (ratio exactly 1; not where the KL is in the reward or anything
               else reads them first: update.fresh_first_minibatch)             ppo_core.rollout
  4. rewards:  penalties on the raw score (missing EOS, overlong), optional whitening and
               clipping; then r_t = -beta * KL_t on every token, + the score on the last real
               token                                                ppo_core.update, ppo_core.algo
  5. advantages, by cfg.adv_estimator: GAE with the critic's values, whitened over the batch; or
               critic-free: the group-relative baselines of GRPO / Dr. GRPO / RLOO /
               REINFORCE++-baseline over each response's total reward, or REINFORCE++'s whitened
               discounted return; with a teacher, the per-token distillation advantage
               -distill_coef * (log pi_old - log pi_teacher) instead, or added
                                                                    ppo_core.update, ppo_core.algo
  6. update:   ppo_epochs over shuffled minibatches (stopped early past target_kl), gradient
               accumulation over micro-batches, the clipped surrogate (PPO's token ratio or GSPO's
               sequence ratio, + entropy bonus, + KL loss term) for the policy, the clipped value
               loss for the critic, AdamW, warm-up + cosine LR; the first critic_warmup
               iterations train the critic alone                                 ppo_core.update
Every per-token tensor is [B, R] over response tokens with `response_mask` 1 on tokens the policy
produced.

Here: `run`, the rollout sources beside the default one (stale, replayed, served to trainers),
the parts of the set-up that read the loop's own modules (encoded_lengths, check_prompts), and the
command line, `main`. Elsewhere in ppo_core/run/: the rest of the set-up, each part a named
function (start.py: check_paths, build_models, check_teacher, make_reward_sources, prompt_rows,
open_run_dir), an iteration's metrics and the summary (metrics.py), and `Checkpoints`
(checkpoints.py), which saves and resumes the run and stops it early with what the README
documents (a reward server down: a checkpoint and exit status 3; SIGTERM / SIGINT: 143).
"""
import dataclasses
import datetime
import os
import random
import sys
import time
import traceback

import numpy as np
import torch

from . import algo
from .run import plan
from .models import lora
from .models import distributed as dist
from .run import recording, rollout_worker, runlog, tracking
from .rewards.redact import forget_secrets, redact, remember_secrets
from .run.rollout_worker import RolloutClient
from .config import (ConfigError, PPOConfig, build_config, fit_batch_sizes, help_text, load_toml,
                     parse_cli, records_decode_logprobs, rollout_rows)
from .models.model import CheckpointError, load_model
from .models.precision import resolve_precision
from .data.prompts import PromptsError, columns_of, where_is
from .rewards.remote import API_KEY_ENV, PROXY_AUTH_ENV
from .rewards.source import make_reward_source
from .rewards.interface import RewardError
from .rollout import (EVAL_SEED_OFFSET, evaluate, iteration_rollout, needs_reference_responses,
                      prompt_token_ids, rollout_forward,
                      sampled_from_state, sampled_state, with_reference_responses)
from .models.tokenizer import UnknownTextError, load_tokenizer, native_stderr_held
from .update import (NonFiniteUpdates, Optimizers, compute_advantages, fresh_first_minibatch,
                     ppo_update)
from .run.checkpoints import (EXIT_DISK_FULL, EXIT_INTERRUPTED, EXIT_REWARD_SERVER_DOWN,
                              Checkpoints, RewardServerDown, StopRequested)
from .run.tracking import write_iteration_samples
from .run.metrics import iteration_metrics, run_summary
from .run.start import (build_models, build_teacher, check_batch, check_chat_template, check_paths,
                        check_process_count, check_roles, check_teacher, checkpoint_of,
                        fit_context, kl_controller, log_first_lines, log_rollout_lines,
                        make_reward_sources, open_run_dir, prompt_rows, spread_over_processes,
                        torch_threads, Models, Setup, Step)

DEMO_CHECKPOINT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo", "reverse-demo")
DEMO_CHECKPOINTS = {"reverse": DEMO_CHECKPOINT,
                    "arith": os.path.join(os.path.dirname(DEMO_CHECKPOINT), "arith-demo"),
                    "toolmul": os.path.join(os.path.dirname(DEMO_CHECKPOINT), "tool-demo")}


def run(cfg: PPOConfig, resume_from=None):
    """Train; returns the summary dict. Raises ConfigError / CheckpointError / RewardError on bad
    input. resume_from: a run directory to continue (its config is `cfg`); without it, a run
    directory that already holds a checkpoint of the same config is resumed too (what a retried
    container needs)."""
    # a config built in code, not by build_config: its default batch sizes made numbers
    cfg = fit_batch_sizes(cfg)
    torch.set_num_threads(torch_threads(cfg))
    check_paths(cfg)  # every path the config names, before anything is read
    policy_path = cfg.policy or DEMO_CHECKPOINTS[cfg.task]  # the task's shipped SFT checkpoint
    precision = resolve_precision(cfg)
    rank, world, device = dist.init(precision.device, roles=bool(cfg.rollout_ranks))
    check_roles(cfg)
    if dist.split_roles(cfg.rollout_ranks) == "rollout":  # a rollout worker: it samples
        return serve_rollouts(cfg, policy_path, device, precision)
    s = set_up(cfg, policy_path, precision, device, resume_from)
    m, log, run_dir, tracker = s.models, s.log, s.run_dir, s.tracker

    random.seed(cfg.seed), np.random.seed(cfg.seed), torch.manual_seed(cfg.seed)
    # the rollouts' sampling noise, the device, the autocast region
    step = Step(cfg, torch.Generator(device=device).manual_seed(cfg.seed), precision.autocast,
                device)
    shuffle_gen = torch.Generator().manual_seed(cfg.seed + 1)  # the minibatches' order
    train_step = dataclasses.replace(step, generator=shuffle_gen)  # the update's settings
    opts = Optimizers(m.policy, m.critic, cfg,
                      cfg.ppo_epochs * (rollout_rows(cfg) // cfg.minibatch_size), log)
    kl_ctl = kl_controller(cfg)
    evaluate_policy = held_out_evaluation(s, step)
    ckpts = Checkpoints(cfg, s, opts, {"sample": step.generator, "shuffle": shuffle_gen}, kl_ctl)
    workers = (RolloutClient(cfg, m.policy, s.stream, m.tokenizer.pad_token_id,
                             wire_autocast(precision)) if cfg.rollout_ranks else None)
    state = ckpts.state  # what the checkpoints hold beside models, optimizers, generators, ...
    start_iter = first_iteration(s, ckpts, evaluate_policy, precision, step)
    if workers is not None:
        workers.start(start_iter, state)

    # what a process ended by StopSignals' watchdog says: main()'s line
    def last_words(why, iteration):
        return f"ppo-train: {ckpts.abandoned_line(why, iteration)}"
    with runlog.StopSignals(cfg.stop_grace_s, last_words) as stop, ckpts.stopped_if_abandoned(stop):
        for it in log.iterations(cfg.iterations, start_iter):
            # from here to work_ends a second signal abandons the iteration (runlog.StopSignals)
            stop.work_starts(it + 1)
            # a reward server down: saved as of this iteration's start
            with ckpts.redone_if_server_down(it):
                opts.start_iteration(it)
                t_roll = time.perf_counter()
                # the update's first minibatch, whose old log-probs its own forward gives
                fresh = fresh_first_minibatch(cfg, rollout_rows(cfg), shuffle_gen,
                                              it >= cfg.critic_warmup)
                # 1-3: sample, score, forward
                rollout, ended, filter_stats = next_rollout(it, s, step, state, workers, fresh)
            # what 1-2 produced, for a later --replay_rollouts (ppo_core.run.recording)
            if cfg.save_rollouts:
                record_rollout(log, run_dir, it, rollout, filter_stats, first=it == start_iter)
            kl_coef = kl_ctl.value
            compute_advantages(rollout, cfg, kl_coef, ended)  # 4-5: rewards, advantages
            t_train = time.perf_counter()
            train_stats = ppo_update(m.policy_train, m.critic_train, rollout, train_step, kl_coef,
                                     opts.step, train_policy=it >= cfg.critic_warmup)  # 6
            # the new weights to the worker (and, one update stale, its next rollout)
            if workers is not None:
                train_stats.update(workers.after_update(it, state))
            metrics = iteration_metrics(rollout, ended, kl_coef, train_stats, filter_stats, opts,
                                        cfg, seconds=(t_roll, t_train, time.perf_counter()))
            if cfg.drop_overlong_prompts:
                metrics["prompts/dropped_overlong"] = s.overlong
            # k1: what the adaptive controller reads (Ziegler et al. 2019)
            state["last_kl"] = metrics["kl/mean"]
            state["last_kl_k3"] = metrics["kl/k3_mean"]  # k3 >= 0: what the summary reports
            kl_ctl.update(state["last_kl"], rollout_rows(cfg))
            if cfg.eval_every and (it + 1) % cfg.eval_every == 0 and it + 1 < cfg.iterations:
                # a reward server down keeps the update (saved), its samples and the metrics a
                # resume completes
                with ckpts.saved_if_server_down(it + 1, f" in the evaluation of iteration {it + 1}",
                                                pending=metrics, samples=(it, rollout.sampled)):
                    metrics["eval/reward"] = evaluate_policy()
            stop.work_ends()  # what follows is written whole, even under a second signal
            with stop.writing:  # a process ended by StopSignals' watchdog waits for these lines
                log.metrics(metrics)
                tracker.log(metrics, it + 1)
                write_iteration_samples(cfg, run_dir, tracker, m.tokenizer, it, rollout.sampled)
            if (it + 1 == cfg.iterations or stop.requested
                    or (cfg.save_every and (it + 1) % cfg.save_every == 0)):
                ckpts.save(it + 1)
            ckpts.stop_if_requested(stop, it + 1)

    with ckpts.stopped_if_server_down(
            f"during the final evaluation; the final checkpoint (iteration {cfg.iterations}) "
            f"is in {run_dir.path}; finish with: ppo-train --resume {run_dir.path}"):
        after, after_greedy = evaluate_policy(), evaluate_policy(greedy=True)
    summary = run_summary(ckpts, after, after_greedy, len(s.held_out))
    run_dir.write_summary(summary)
    log.close(), tracker.close()
    log.table(summary, cfg)
    if cfg.rollout_ranks:
        dist.job_barrier()  # the workers wait here for the trainers (serve_rollouts)
    return summary


def set_up(cfg: PPOConfig, policy_path, precision, device, resume_from) -> Setup:
    """Everything before the first iteration that can be wrong with the input, checked before the
    run directory is touched; then the models built and spread over the trainer processes, the
    prompts fitted to the context, the run directory opened. -> Setup."""
    world = dist.world_size()  # the trainers
    check_process_count(cfg, world)
    # without --out: runs/<policy>-<task>-<time> (RunDir.open)
    runlog.check_out_dir(resume_from or cfg.out or "runs")
    with checkpoint_of("policy"):
        # the prompts are checked against it before any model is built
        tokenizer = load_tokenizer(policy_path)
    check_chat_template(cfg, tokenizer, policy_path)
    check_teacher(cfg, policy_path, tokenizer)
    train_rows, held_out, stream = prompt_rows(cfg)
    prompt_lengths = encoded_lengths(cfg, tokenizer, held_out + train_rows)
    policy, critic, reference = build_models(cfg, policy_path, tokenizer, device,
                                             precision.param_dtype)
    teacher = build_teacher(cfg, device, precision.param_dtype)  # None without cfg.teacher
    # the only sources that read a checkpoint
    with checkpoint_of("judge" if cfg.judge else "reward_model"):
        reward_source, eval_source = make_reward_sources(cfg, device, precision.param_dtype)
    policy_train, critic_train = spread_over_processes(policy, critic, reference, teacher,
                                                       reward_source, cfg, device)
    train_rows, held_out, stream, overlong = fit_context(cfg, policy, train_rows, held_out, stream,
                                                         prompt_lengths)
    # the kept rows' longest prompt (where rows were dropped: the context less max_new_tokens)
    longest = min(max(prompt_lengths, default=1),
                  policy.args.max_position_embeddings - cfg.max_new_tokens)
    # the data and the memory can hold the batch
    check_batch(cfg, train_rows, longest, policy_path, world, device)
    check_prompts(cfg, train_rows, held_out, reward_source, eval_source)
    # a recording to train on (cfg.replay_rollouts), checked against this run: the checkpoint,
    # tokenizer, shape, steps
    replay = (recording.open_recording(cfg.replay_rollouts, cfg, policy_path) if cfg.replay_rollouts
              else None)
    run_dir, ckpt, log, tracker = open_run_dir(cfg, policy_path, resume_from, precision)
    if cfg.save_rollouts:
        recording.start_recording(run_dir.path, cfg, policy_path)
    models = Models(policy, reference, critic, teacher, tokenizer, reward_source, eval_source,
                    policy_train, critic_train)
    return Setup(models, policy_path, train_rows, held_out, stream, overlong, longest, replay,
                 run_dir, ckpt, log, tracker)


def held_out_evaluation(s: Setup, step: Step):
    """-> evaluate(greedy=False): the mean reward over the held-out rows, each evaluation with the
    same noise; a pairwise judge's reference responses for them sampled once, here."""
    cfg, m = step.cfg, s.models
    eval_seed = cfg.seed + EVAL_SEED_OFFSET  # every evaluation samples with the same noise
    if needs_reference_responses(cfg) and m.eval_source is m.reward_source:
        s.held_out = with_reference_responses(s.held_out, m.policy, m.reference, m.tokenizer, cfg,
                                              eval_seed + 1, step.autocast)

    def evaluate_policy(greedy=False):
        return evaluate(m.policy, m.tokenizer, s.held_out, m.eval_source, cfg, eval_seed,
                        greedy=greedy, autocast=step.autocast)
    return evaluate_policy


def first_iteration(s: Setup, ckpts, evaluate_policy, precision, step: Step) -> int:
    """Where the loop starts: a resumed run's checkpoint put back (and an iteration a reward server
    stopped in its evaluation finished), or a new run's first lines and its evaluation before
    training, into ckpts.state. -> the first iteration to run."""
    cfg, log, state = step.cfg, s.log, ckpts.state
    if s.ckpt is not None:
        start_iter = ckpts.resume(s.ckpt)
    else:
        start_iter = 0
        log_first_lines(s, step, dist.world_size(), precision)
        if s.overlong:
            log.info(
                f"prompts: {s.overlong} rows dropped (drop_overlong_prompts): longer than the "
                f"model's context leaves for max_new_tokens={cfg.max_new_tokens}")
        log_rollout_lines(log, cfg, s.run_dir, s.replay, s.longest)
        with ckpts.stopped_if_server_down(
                "during the evaluation before training; nothing saved yet; start again "
                f"with: ppo-train --resume {s.run_dir.path}"):
            state["eval_before"], state["eval_before_greedy"] = (evaluate_policy(),
                                                                 evaluate_policy(greedy=True))
        log.info(
            f"eval before training: reward {state['eval_before']:.4f} (T={cfg.temperature}), "
            f"{state['eval_before_greedy']:.4f} (greedy) [{time.perf_counter() - ckpts.t0:.1f}s]")
    # the run stopped in iteration start_iter's evaluation (server down): finish it
    if "pending_metrics" in state:
        ckpts.finish_pending_iteration(start_iter, evaluate_policy)
    return start_iter


def next_rollout(it, s: Setup, step: Step, state, workers, fresh):
    """Steps 1-3 of iteration it from the run's rollout source: a recorded run's (replay_rollouts),
    the rollout workers' (rollout_ranks), one sampled an update earlier (max_staleness=1), or
    sampled now (iteration_rollout). fresh: the update's first minibatch's rows, not scored here.
    -> (Rollout, ended [b], stats)."""
    if s.replay is not None:
        # 1-2 read from a recorded run, 3 as after sampling: see replayed_rollout
        return replayed_rollout(it, s.replay, s.models, step)
    if workers is not None:  # 1-3 on the rollout worker (ppo_core.run.rollout_worker)
        share, worker_stats = workers.rollout(it, state)
        sampled, group, filter_stats = sampled_from_state(share, step.device)
        filter_stats.update(worker_stats)
        return rollout_forward(s.models, sampled, group, step, fresh), sampled.ended, filter_stats
    if step.cfg.max_staleness:  # 1-3, one update stale: see stale_rollout
        return stale_rollout(it, state, s.stream, s.models, step)
    return iteration_rollout(it, s.stream, s.models, step, fresh_rows=fresh)  # 1-3


def serve_rollouts(cfg: PPOConfig, policy_path, device, precision):
    """A rollout worker's whole run (config rollout_ranks): the models and the stream it samples
    with, then ppo_core.run.rollout_worker.serve until the trainer's last iteration. It writes
    nothing: the trainer owns the run."""
    tokenizer = load_tokenizer(policy_path)
    train_rows, held_out, stream = prompt_rows(cfg)
    policy = load_model(policy_path, dtype=precision.param_dtype, device=device).eval()
    if cfg.drop_overlong_prompts:  # the trainers' stream drops the same rows (run)
        lengths = encoded_lengths(cfg, tokenizer, held_out + train_rows)
        _, _, stream, _ = fit_context(cfg, policy, train_rows, held_out, stream, lengths)
    if cfg.lora_rank:  # the trainers' adapters: their values arrive with the weights
        lora.add_lora(policy, cfg.lora_rank, cfg.lora_alpha or None)
    # what only a pairwise judge's reference samples read (with_reference_responses): the
    # reference checkpoint, or under LoRA without one the policy, adapters off
    reference = policy
    if needs_reference_responses(cfg) and (cfg.reference or not cfg.lora_rank):
        reference = load_model(cfg.reference or policy_path, dtype=precision.param_dtype,
                               device=device).eval()
    reward_source = make_reward_source(cfg, device, precision.param_dtype)
    # reseeded per iteration by iteration_rollout
    step = Step(cfg, torch.Generator(device=device).manual_seed(cfg.seed), precision.autocast,
                device)
    models = Models(policy, reference, tokenizer=tokenizer, reward_source=reward_source)
    def sample(it):  # the loop's rollout, steps 1-2, this worker's rows, for the wire
        sampled, group, stats = iteration_rollout(it, stream, models, step, sample_only=True)
        return sampled_state(sampled, group, stats, lists=False)

    rollout_worker.serve(cfg, policy, stream, sample, wire_autocast(precision))
    dist.job_barrier()  # until the trainers are done too (run)
    return {}


def wire_autocast(precision):
    """The autocast dtype the block weights may travel to the rollout workers in
    (rollout_worker.wire_dtypes): bf16-mixed's, where float32 master weights feed bf16 matmuls;
    None otherwise."""
    return precision.autocast_dtype if precision.param_dtype == torch.float32 else None


def stale_rollout(it, state, stream, models: Models, step: Step):
    """cfg.max_staleness = 1: iteration it trains on the rollout sampled (and scored) before the
    previous update, with the weights iteration it-1 started from (the first iteration samples its
    own), and samples iteration it+1's now, with its own starting weights, as a rollout worker one
    update behind would while it trains. The one sampled but not yet trained on waits in
    state["pending_rollout"] (ppo_core.rollout.sampled_state), which the checkpoint holds.
    -> what iteration_rollout returns; the old log-probs are recomputed with the current weights."""
    cfg, device = step.cfg, next(models.policy.parameters()).device
    args = (stream, models, step)
    pending = state.pop("pending_rollout", None)
    sampled, group, stats = (sampled_from_state(pending, device) if pending is not None
                             else iteration_rollout(it, *args, sample_only=True))
    staleness = it - pending.get("weights_version", it - 1) if pending is not None else 0
    if it + 1 < cfg.iterations:  # sampled with the weights iteration it starts from: version it
        state["pending_rollout"] = dict(
            sampled_state(*iteration_rollout(it + 1, *args, sample_only=True)), weights_version=it)
    return (rollout_forward(models, sampled, group, step), sampled.ended,
            dict(stats, **{"off_policy/staleness": staleness}))


def replayed_rollout(it, replay, models: Models, step: Step):
    """cfg.replay_rollouts: iteration it's rollout as the recorded run sampled and scored it
    (ppo_core.run.recording), then step 3 with this run's models and config, as after sampling
    (rollout_forward): old and reference log-probs, values. The recorded sampler's log-probs mu
    (its decoding pass's when it kept them, else its training path's old log-probs) stand in for
    the decoding pass's where this config reads them (off_policy_correction,
    old_logprobs_from_rollout). -> what iteration_rollout returns, the stats the recording's, with
    off_policy/behav_gap_mean and _max: |log pi_old - log mu| per token, this run's policy against
    the recorded sampler (0 for the recorded run's own config; with an off_policy_correction the
    update reports them). A recorded iteration that cannot be read is a ConfigError."""
    cfg, device, state = step.cfg, step.device, replay.read(it + 1)
    try:
        sampled, group, stats = sampled_from_state(state["sampled"], device)
        recorded = {name: state["sampler"][name].to(device)
                    for name in ("old_logprobs", "entropy")}  # [B, R]
    except (KeyError, TypeError, AttributeError) as e:  # a step-N.json edited by hand
        raise ConfigError(
            f"config key 'replay_rollouts': {replay.path}'s iteration {it + 1} is not a recorded "
            f"rollout ({type(e).__name__}: {e})") from None
    mu = (sampled.decode_logprobs if sampled.decode_logprobs is not None
          else recorded["old_logprobs"])
    if records_decode_logprobs(cfg) and sampled.decode_logprobs is None:
        sampled.decode_logprobs, sampled.decode_entropy = mu, recorded["entropy"]
    rollout = rollout_forward(models, sampled, group, step)
    stats = {**stats, "time/generate_s": 0.0}  # nothing decoded
    if cfg.off_policy_correction == "none":
        mask = rollout.response_mask
        gap = (rollout.old_logprobs - mu).abs() * mask  # [B, R] |log pi_old - log mu|
        stats["off_policy/behav_gap_mean"] = algo.masked_mean(gap, mask).item()
        stats["off_policy/behav_gap_max"] = gap.max().item()
    return rollout, sampled.ended, stats


def record_rollout(log, run_dir, it, rollout, stats, first=False):
    """cfg.save_rollouts: iteration it's rollout to RUN_DIR/rollouts/step-{it+1}
    (ppo_core.run.recording): what the sampler and the reward produced (sampled_state: prompt rows,
    token ids, masks, scores, reward components, the decoding pass's log-probs when kept), its
    statistics, and the sampler's log-probs and entropy on the training path (the rollout's old
    ones: the sampling policy's own, but with max_staleness=1 one update newer).
    first: the first this process writes, whose measured size the log says."""
    state = {"sampled": sampled_state(rollout.sampled, rollout.group, dict(stats), lists=False),
             "sampler": {"old_logprobs": rollout.old_logprobs, "entropy": rollout.entropy}}
    tensor_bytes, file_bytes = recording.write_rollout(run_dir.path, it + 1, state)
    if first:
        log.info(
            f"rollouts: iteration {it + 1} recorded in {recording.size_text(file_bytes)} "
            f"(measured: tensors {recording.size_text(tensor_bytes)}, the rest prompt rows, texts "
            "and JSON)")


# ---------------------------------------------------------------------------- set-up

def encoded_lengths(cfg: PPOConfig, tokenizer, rows) -> list[int]:
    """The token count of each row's prompt as the policy sees it (prompt_token_ids). A row the
    tokenizer cannot encode (a character its vocabulary lacks, and no unknown token) is a
    ConfigError naming its file, row and character."""
    lengths = []
    # a tokenizer that panics (a runaway regex) is one line, not the library's backtrace
    with native_stderr_held():
        for row in rows:
            try:
                lengths.append(len(prompt_token_ids(tokenizer, row, cfg)))
            except UnknownTextError as e:
                files = {"prompts_file": cfg.prompts_file,
                         "eval_prompts_file": cfg.eval_prompts_file}
                raise ConfigError(f"{where_is(row, files)}: {e}") from None
    return lengths


def check_prompts(cfg: PPOConfig, train_rows, held_out, reward_source, eval_source):
    """The prompts against what reads them: the columns each reward source needs are there (or will
    be sampled: a pairwise judge's reference responses) and no column would hide one of
    samples.jsonl's own. A ConfigError or RewardError names the first misfit."""
    columns = set(columns_of(train_rows + held_out)) | (
        {cfg.judge_reference_column} if needs_reference_responses(cfg) else set())
    # a column the reward needs is there (or will be sampled)
    reward_source.check_columns(sorted(columns))
    if eval_source is not reward_source:
        eval_source.check_columns(sorted(set(columns_of(held_out))))
    clash = [c for c in columns_of(train_rows)
             if c in ("step", "response", "reward") or c.startswith("reward/")]
    if cfg.log_samples_every and clash:
        raise ConfigError(
            f"config key 'log_samples_every': the prompts file's column '{clash[0]}' would hide "
            f"samples.jsonl's own '{clash[0]}'; rename that column")


# ---------------------------------------------------------------------------- the command line

USAGE = """usage: ppo-train [--config FILE.toml] [--KEY=VALUE ...]
       ppo-train --resume RUN_DIR

Runs PPO. With no arguments: the default job (the shipped demo checkpoint, the 'reverse' task,
CPU). Every field of ppo_core.config.PPOConfig is a --KEY (listed below; configs/default.toml has
them all). --resume continues a run from its latest checkpoint, with the config saved in
RUN_DIR/config.json.
Exit status: 0 done; 1 too many non-finite updates; 2 bad input (one line); 3 a reward server
(--reward_url) stayed unreachable: a checkpoint is saved, continue with --resume once it is back;
4 the disk is full: the last checkpoint and every whole metrics line are kept, continue with
--resume once there is space; 143 stopped by SIGTERM / SIGINT; 130 SIGINT in the start-up (one
line)."""


# what --resume may change: the progress bar, and where the reward server now is
RESUME_OVERRIDES = ("progress", "reward_url", "reward_timeout_s", "reward_retries")


def run_path(cfg, resume):
    """The run directory this command writes (or would have, for an error found before it was
    opened): --resume's, --out, else runlog.default_run_path as of now; None before the config is
    read."""
    if resume or cfg is None:
        return resume
    return cfg.out or runlog.default_run_path(cfg, cfg.policy or DEMO_CHECKPOINTS[cfg.task],
                                              datetime.datetime.now())


def say(line):
    """One line on stderr, its credentials redacted (ppo_core.rewards.redact): every line main()
    prints."""
    print(redact(line), file=sys.stderr)


def redacted_excepthook(kind, error, tb):
    """An unforeseen error's traceback, printed as Python would, with its credentials redacted."""
    sys.stderr.write(redact("".join(traceback.format_exception(kind, error, tb))))


def main(argv=None):
    """The ppo-train command line, argv (default sys.argv[1:]) as USAGE describes (-h: USAGE and
    the config keys). -> the exit status USAGE lists; any but 0 comes with one line on stderr (a
    reward server down: rank 0's), credentials redacted. An unforeseen error propagates, its
    traceback redacted (redacted_excepthook); a stop that abandoned an iteration ends the process
    here, os._exit(143)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + help_text())
        return 0
    # the URLs' credentials on the command line, and the reward server's keys, are never printed
    # or written
    forget_secrets()
    remember_secrets(argv)
    remember_secrets([os.environ.get(name, "") for name in (API_KEY_ENV, *PROXY_AUTH_ENV)],
                     whole=True)
    sys.excepthook = redacted_excepthook
    # what other libraries record of the command (W&B's metadata keeps sys.argv)
    sys.argv[:] = redact(sys.argv)
    cfg = resume = None
    try:
        own, overrides = parse_cli(argv)
        resume = own.get("resume")
        if resume:
            if "config" in own or set(overrides) - set(RESUME_OVERRIDES):
                raise ConfigError(
                    "--resume takes the run's own config from RUN_DIR/config.json; it cannot be "
                    "combined with --config or other keys (only "
                    f"--{', --'.join(RESUME_OVERRIDES)})")
            cfg = build_config(runlog.RunDir.saved_config(resume), overrides)
            # config.json keeps URLs without their credentials
            if any("***" in url for url in cfg.reward_url):
                raise ConfigError(
                    f"--resume: {resume}/config.json keeps reward_url without its credential "
                    f"({', '.join(cfg.reward_url)}); give the URL again: --resume {resume} "
                    "--reward_url URL")
        else:
            toml_values = load_toml(own["config"]) if "config" in own else {}
            remember_secrets(toml_values)
            cfg = build_config(toml_values, overrides, own.get("config", ""))
        run(cfg, resume_from=resume)
    except (ConfigError, CheckpointError, RewardError, PromptsError, tracking.TrackingError,
            runlog.RunDirError, plan.PlanError, FileNotFoundError) as e:
        # a reward function's traceback, or that of a user's file that did not import: DIR/error.log
        say(f"ppo-train: error: {runlog.log_error(e, run_path(cfg, resume))}")
        return 2
    except NonFiniteUpdates as e:
        say(f"ppo-train: error: {e}")
        return 1
    except StopRequested as e:
        say(f"ppo-train: {e}")
        if e.abandoned:
            # threads the abandoned work left running (a reward function's pool) would hold up the
            # interpreter's exit, which joins them: the process ends here
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(143)
        return 143
    except RewardServerDown as e:
        if dist.rank() == 0:  # every process stops at once; one line
            say(f"ppo-train: {e}")
        return EXIT_REWARD_SERVER_DOWN
    except KeyboardInterrupt:
        # SIGINT where runlog.StopSignals does not take it: the start-up, the final evaluation
        say(f"ppo-train: {runlog.interrupted_line(run_path(cfg, resume))}")
        return EXIT_INTERRUPTED
    except Exception as e:  # last: the clauses above are Exceptions too
        if not runlog.disk_full(e):
            raise
        say(f"ppo-train: error: {runlog.disk_full_line(e, run_path(cfg, resume))}")
        return EXIT_DISK_FULL
    finally:
        runlog.release_run_dir()
        dist.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
