"""A reward model checkpoint as a reward source (config `reward_model`).

RewardModelReward: each prompt + response is rendered (with the reward model's own chat template when `chat_template`
is on, with the run's `enable_thinking`), tokenized with the reward model's tokenizer, right-padded, and scored at its
last real token by a *ForSequenceClassification checkpoint, as transformers computes it. No metrics.
"""
import torch

from .model import load_reward_model
from .rewards import RewardError, clip_text
from .tokenizer import load_tokenizer


class RewardModelReward:
    """Scores from a *ForSequenceClassification checkpoint, as transformers computes them. It reads no columns."""

    def __init__(self, path, cfg, device, dtype, batch_size=16):
        self.model = load_reward_model(path, dtype=dtype, device=device).eval().requires_grad_(False)
        self.tokenizer = load_tokenizer(path)
        self.cfg, self.device, self.batch_size = cfg, device, batch_size

    def render(self, prompt, response):
        if self.cfg.chat_template:
            chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            return self.tokenizer.apply_chat_template(chat, tokenize=False, enable_thinking=self.cfg.enable_thinking)
        return prompt + response

    def check_columns(self, names):
        """Nothing to check: the reward model scores prompt + response only."""

    @torch.no_grad()
    def __call__(self, prompts, responses, columns=None):
        """-> (scores [B] float32 on the CPU, {}); `columns` is ignored."""
        encoded = [self.tokenizer.encode(self.render(p, r)) for p, r in zip(prompts, responses)]
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        scores = []
        for i in range(0, len(encoded), self.batch_size):
            chunk = encoded[i : i + self.batch_size]
            T = max(len(e) for e in chunk)
            ids = torch.tensor([e + [pad] * (T - len(e)) for e in chunk], device=self.device)  # [b, T] right-padded
            mask = torch.tensor([[1] * len(e) + [0] * (T - len(e)) for e in chunk], device=self.device)
            scores.append(self.model.score(ids, mask).float().cpu())  # [b]
        scores = torch.cat(scores)
        if not torch.isfinite(scores).all():
            i = int((~torch.isfinite(scores)).nonzero()[0])
            raise RewardError(f"reward model gave {scores[i].item()} for sample {i} (prompt {clip_text(prompts[i])})")
        return scores, {}
