"""The run's reward source, chosen from its config: the one place that knows every kind of source.

    source = make_reward_source(cfg, device, dtype)
    scores, metrics = source(prompts, responses, columns)      # the interface: ppo_core.rewards

It stands above the sources (ppo_core.rewards.functions, reward_model, judges, remote_reward), which know nothing of
one another; ppo-train (ppo_core.train) and ppo-serve-reward (ppo_core.rewards.server) build theirs here.
"""
from .judges import JudgeReward
from .remote import RemoteReward
from .functions import TASK_REWARDS, WeightedReward, import_callable, metric_names
from .reward_model import RewardModelReward
from .interface import CallableReward


def make_reward_source(cfg, device="cpu", dtype=None, key="reward_fn"):
    """The run's reward source: the reward model (cfg.reward_model), else the reward functions (cfg.reward_fn, a list)
    weighted by cfg.reward_weights (empty = 1.0 each), else the built-in task's reward, as a WeightedReward of one;
    with cfg.reward_url, the reward servers at those URLs (ppo_core.rewards.remote); with cfg.judge, a generative judge
    (ppo_core.rewards.judges); with cfg.environment, none: the episodes score themselves (ppo_core.agents.environments).
    key: the config key the functions came from, for a message (eval_reward_fn for the evaluations' source)."""
    if cfg.environment:
        return EpisodeRewards()
    if cfg.reward_url:
        return RemoteReward(cfg.reward_url, cfg.reward_timeout_s, cfg.reward_retries)
    if cfg.judge:
        return JudgeReward(cfg.judge, cfg.judge_mode, template=cfg.judge_template or None,
                           max_new_tokens=cfg.judge_max_new_tokens, unparsed_score=cfg.judge_unparsed_score,
                           reference_column=cfg.judge_reference_column, enable_thinking=cfg.judge_enable_thinking,
                           greedy=cfg.judge_temperature == 0, temperature=cfg.judge_temperature or 1.0,
                           batch_size=cfg.judge_batch_size, device=device, dtype=dtype, seed=cfg.seed,
                           score_range=cfg.judge_score_range or None, engine=cfg.rollout_engine)
    if cfg.reward_model:
        return RewardModelReward(cfg.reward_model, cfg, device, dtype)
    if isinstance(cfg.reward_fn, str):
        raise TypeError("cfg.reward_fn must be a list of 'module:function' specs (config.build_config makes one)")
    if cfg.reward_fn:
        functions = [CallableReward(import_callable(spec, key), spec) for spec in cfg.reward_fn]
        return WeightedReward(functions, list(cfg.reward_weights) or [1.0] * len(functions), metric_names(cfg.reward_fn))
    return WeightedReward([CallableReward(TASK_REWARDS[cfg.task], f"of task '{cfg.task}'")], [1.0], [cfg.task])


class EpisodeRewards:
    """The run's reward source when an environment scores its episodes (cfg.environment): nothing to check, nothing
    to call (ppo_core.rollout.play_episodes takes the episodes' rewards)."""

    def check_columns(self, names):
        """The environment reads the columns itself."""

    def __call__(self, prompts, responses, columns=None):
        raise RuntimeError("episodes are scored by their environment (ppo_core.rollout.play_episodes)")
