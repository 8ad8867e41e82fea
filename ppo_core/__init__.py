"""ppo-core: PPO for language models, small enough to read in an afternoon.

    import ppo_core
    model = ppo_core.load_model("checkpoints/reverse-demo")
    tok = ppo_core.load_tokenizer("checkpoints/reverse-demo")
    tokens = ppo_core.generate(model, prompt_ids, 16, eos_token_id=tok.eos_token_id)
"""
from .generate import generate
from .model import CausalLM, ModelArgs, ScoreModel, load_model, load_score_model
from .tokenizer import load_tokenizer

__all__ = ["CausalLM", "ModelArgs", "ScoreModel", "generate", "load_model", "load_score_model", "load_tokenizer"]
