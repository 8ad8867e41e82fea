"""A reward model checkpoint as a reward source (config `reward_model`).

RewardModelReward: each prompt + response is rendered (with the reward model's own chat template when `chat_template`
is on, with the run's `enable_thinking`), tokenized with the reward model's tokenizer, and scored at its last real token
by a *ForSequenceClassification checkpoint, as transformers computes it: right-padded in batches of `batch_size`, or,
with cfg.micro_batch_tokens > 0, packed without padding into micro-batches of at most that many tokens
(ppo_core.data.packing). No metrics.
"""
import torch

from ..models import distributed as dist
from ..models.model import load_reward_model
from ..data.packing import token_budget_micro_batches
from .interface import RewardError, clip_text
from ..models.tokenizer import load_tokenizer


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
        if self.cfg.micro_batch_tokens > 0:
            scores = self.score_packed(encoded, pad)
        else:
            scores = self.score_padded(encoded, pad)
        if not torch.isfinite(scores).all():
            i = int((~torch.isfinite(scores)).nonzero()[0])
            raise RewardError(f"reward model gave {scores[i].item()} for sample {i} (prompt {clip_text(prompts[i])})")
        return scores, {}

    def score_padded(self, encoded, pad):
        """encoded: B lists of token ids -> scores [B] float32 on the CPU, right-padded batches of `batch_size`."""
        scores = []
        for i in range(0, len(encoded), self.batch_size):
            chunk = encoded[i : i + self.batch_size]
            T = max(len(e) for e in chunk)
            ids = torch.tensor([e + [pad] * (T - len(e)) for e in chunk], device=self.device)  # [b, T] right-padded
            mask = torch.tensor([[1] * len(e) + [0] * (T - len(e)) for e in chunk], device=self.device)
            scores.append(self.model.score(ids, mask).float().cpu())  # [b]
        return torch.cat(scores)

    def score_packed(self, encoded, pad):
        """encoded: B lists of token ids -> scores [B] float32 on the CPU, in packed micro-batches of at most
        cfg.micro_batch_tokens tokens (a longer sequence alone), no padding at all."""
        # An empty encoding is scored as the pad token alone: what the padded batch gives a row with no real token.
        encoded = [e or [pad] for e in encoded]
        lengths = [len(e) for e in encoded]
        micro_batches = token_budget_micro_batches(list(range(len(encoded))), lengths, self.cfg.micro_batch_tokens)
        # Sharded over processes (parallel='fsdp' with shard_frozen: ppo_core.run.start.spread_over_processes), a forward
        # all-gathers each block's weights, so every process runs as many forwards though their texts, and so their
        # micro-batch counts, differ: the most of any process, agreed before the first forward (collectives must come
        # in the same order everywhere), the missing ones as forwards of one token.
        n_forwards = len(micro_batches)
        if dist.is_sharded(self.model):
            n_forwards = dist.all_reduce_max_int(n_forwards)
        scores = torch.empty(len(encoded))  # [B] float32, filled in the original order
        for rows in micro_batches:
            ids = torch.tensor([t for i in rows for t in encoded[i]], device=self.device)  # [N] the rows' tokens
            positions = torch.tensor([p for i in rows for p in range(lengths[i])], device=self.device)  # [N]
            scores[rows] = self.model.score_packed(ids, positions, [lengths[i] for i in rows]).float().cpu()
        for _ in range(n_forwards - len(micro_batches)):
            one = torch.tensor([pad], device=self.device)  # [1]
            self.model.score_packed(one, torch.zeros_like(one), [1])
        return scores
