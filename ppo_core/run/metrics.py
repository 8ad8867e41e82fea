"""An iteration's record and a run's: iteration_metrics is the line metrics.jsonl gets each
iteration (every metric and what it means: docs/metrics.md), run_summary is summary.json."""
import os

from .. import algo
from ..config import PPOConfig, uses_critic
from ..models import distributed as dist


def iteration_metrics(rollout, ended, kl_coef, train_stats, filter_stats, opts, cfg: PPOConfig,
                      seconds):
    """This iteration's line of metrics.jsonl, over the global batch (every process's rows
    gathered); its step is opts.iteration (the Optimizers count iterations from 1). seconds: the
    time.perf_counter() readings at the rollout's start, the update's start and its end."""
    t_roll, t_train, t_end = seconds
    generate_s = filter_stats.pop("time/generate_s")
    mask = dist.all_gather_rows(rollout.response_mask)
    old_lp, ref_lp = (dist.all_gather_rows(rollout.old_logprobs),
                      dist.all_gather_rows(rollout.ref_logprobs))
    scores = dist.all_gather_rows(rollout.scores)
    advantages, returns = (dist.all_gather_rows(rollout.advantages),
                           dist.all_gather_rows(rollout.returns))
    kl_tok = algo.kl_estimate(old_lp, ref_lp, "k1")
    distill = {}
    # KL(pi_old || teacher), k1 per token: what distillation drives down
    if rollout.teacher_logprobs is not None:
        teacher_lp = dist.all_gather_rows(rollout.teacher_logprobs)
        distill["distill/reverse_kl"] = algo.masked_mean(algo.kl_estimate(old_lp, teacher_lp, "k1"),
                                                         mask).item()
    metrics = {
        "step": opts.iteration,
        "reward/mean": scores.mean().item(),
        "reward/std": scores.std().item() if len(scores) > 1 else 0.0,
        "kl/mean": algo.masked_mean(kl_tok, mask).item(),
        "kl/k3_mean": algo.masked_mean(algo.kl_estimate(old_lp, ref_lp, "k3"), mask).item(),
        "kl/seq_mean": (kl_tok * mask).sum(-1).mean().item(),
        "kl/coef": kl_coef,
        **distill,
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
        # reward, old/reference log-probs, values, advantages
        "time/score_s": t_train - t_roll - generate_s,
        "time/train_s": t_end - t_train,
        "tokens_per_s": mask.sum().item() / max(t_end - t_roll, 1e-9),
    }
    if uses_critic(cfg):
        metrics["value/explained_var"] = algo.explained_variance(
            dist.all_gather_rows(rollout.old_values), returns, mask)
    return metrics


def run_summary(ckpts, after, after_greedy, prompts) -> dict:
    """summary.json: the held-out reward before and after training, the final KL, the run's length
    and time."""
    cfg, state = ckpts.cfg, ckpts.state
    return {
        "eval/reward_before": state["eval_before"],
        "eval/reward_after": after,
        "eval/greedy_reward_before": state["eval_before_greedy"],
        "eval/greedy_reward_after": after_greedy,
        "eval/prompts": prompts,
        # k3 = E[r - 1 - log r] >= 0 per token, r = ref / pi: the sampled k1 mean can read below 0
        # on a short run
        "kl/final": state.get("last_kl_k3", 0.0),
        "iterations": cfg.iterations,
        "skipped_updates": ckpts.opts.skipped,
        "checkpoint": os.path.join(ckpts.run_dir.path, "checkpoints", f"step-{cfg.iterations}"),
        "time/total_s": ckpts.elapsed(),  # the whole run's, across resumes
    }
