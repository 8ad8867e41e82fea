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
Steps 1-3 are ppo_core.rollout's, 4-6 ppo_core.update's; this file sets the run up and loops.
"""
import dataclasses
import os
import random
import sys
import time

import numpy as np
import torch

from . import algo, checkpoint, lora
from . import distributed as dist
from .config import ConfigError, PPOConfig, build_config, help_text, to_dict, load_toml, parse_cli, rollout_rows, uses_critic
from .model import CheckpointError, load_model, load_score_model
from .precision import loss_paths, precision_line, resolve_precision
from .prompts import PromptsError, RowStream, columns_of, load_rows, prompt_text, split_held_out, where_is
from .remote_reward import RewardUnavailable
from .reward_source import make_reward_source
from .rewards import RewardError
from .rollout import (evaluate, iteration_rollout, needs_reference_responses, prompt_token_ids, sample_rows,
                      with_reference_responses)
from .tasks import PromptStream, eval_prompts
from .tokenizer import UnknownTextError, load_tokenizer
from .update import NonFiniteUpdates, Optimizers, compute_advantages, ppo_update
from . import runlog, tracking

DEMO_CHECKPOINT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo", "reverse-demo")
DEMO_CHECKPOINTS = {"reverse": DEMO_CHECKPOINT, "arith": os.path.join(os.path.dirname(DEMO_CHECKPOINT), "arith-demo")}


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
