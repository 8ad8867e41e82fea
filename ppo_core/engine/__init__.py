"""Sampling responses: the rollout engine (rollout_engine.py: continuous batching over a paged KV cache),
its scheduler and block bookkeeping, the fixed-shape decode steps and their CUDA graphs, and the padded
reference sampler (generate.py).

    from ppo_core.engine import RolloutEngine, SamplingParams
"""
from .rollout_engine import EngineSettings, RolloutEngine, SamplingParams

__all__ = ["EngineSettings", "RolloutEngine", "SamplingParams"]
