"""The models: the causal LM, score and reward-model heads and checkpoint loading (model.py), the
tokenizer and chat templates, LoRA."""
