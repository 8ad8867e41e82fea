"""ppo-core: PPO for language models, small enough to read in an afternoon.

    import ppo_core
    model = ppo_core.load_model("checkpoints/reverse-demo")
    tok = ppo_core.load_tokenizer("checkpoints/reverse-demo")
    responses = ppo_core.RolloutEngine(model).generate([[1, 5, 9], [1, 7]], 16,
                                                       eos_token_id=tok.eos_token_ids)
    # the padded reference
    tokens = ppo_core.generate(model, prompt_ids, 16, eos_token_id=tok.eos_token_id)
    # rm.score(ids, mask) -> [B]
    rm = ppo_core.load_reward_model("path/to/Skywork-Reward-V2-Qwen3-0.6B")
"""
from .engine import RolloutEngine
from .engine.generate import generate
from .models.model import (
    CausalLM, CheckpointError, KVCache, ModelArgs, ScoreModel, count_parameters, load_model,
    load_reward_model, load_score_model,
)
from .models.tokenizer import load_tokenizer

__all__ = ["CausalLM", "CheckpointError", "KVCache", "ModelArgs", "RolloutEngine", "ScoreModel",
           "count_parameters", "generate", "load_model", "load_reward_model", "load_score_model",
           "load_tokenizer"]
