"""Reward sources and prompt files.

A reward source is `source(prompts, responses) -> scores [B] float32`. It wraps either
  - a Python callable `fn(prompts: list[str], responses: list[str]) -> list[float]`
    (config `reward_fn = "module:function"`, or the built-in task's reward), or
  - a reward model checkpoint (config `reward_model`): each prompt + response is rendered (with the
    reward model's own chat template when `chat_template` is on, with the run's `enable_thinking`),
    tokenized with the reward model's tokenizer, right-padded, and scored at its last real token.
Whatever the callable returns is checked: one finite number per response. A callable that raises is
reported with the sample it failed on.
"""
import importlib
import importlib.util
import json
import math
import os

import torch

from .tasks import reverse_rewards

TASK_REWARDS = {"reverse": reverse_rewards}


class RewardError(RuntimeError):
    """The reward function failed or returned something that is not one finite score per response."""


def import_callable(spec: str):
    """'package.module:function' -> the function (the module may also be a path to a .py file)."""
    module_name, _, attr = spec.partition(":")
    try:
        if module_name.endswith(".py"):
            loader_spec = importlib.util.spec_from_file_location(os.path.basename(module_name)[:-3], module_name)
            if loader_spec is None or not os.path.isfile(module_name):
                raise ModuleNotFoundError(f"no file {module_name}")
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
        fn = getattr(module, attr)
    except (ImportError, AttributeError) as e:
        raise RewardError(f"cannot load reward_fn '{spec}': {e}") from None
    if not callable(fn):
        raise RewardError(f"reward_fn '{spec}' is not callable")
    return fn


class CallableReward:
    """Calls fn(prompts, responses) and checks its answer."""

    def __init__(self, fn, name):
        self.fn, self.name = fn, name

    def __call__(self, prompts, responses):
        try:
            scores = self.fn(list(prompts), list(responses))
        except Exception as e:
            raise RewardError(f"reward function {self.name} raised {type(e).__name__}: {e} "
                              f"{self._locate(prompts, responses)}") from None
        try:
            scores = [float(s) for s in scores]
        except (TypeError, ValueError):
            raise RewardError(f"reward function {self.name} must return a list of numbers, got {type(scores).__name__}") from None
        if len(scores) != len(responses):
            raise RewardError(f"reward function {self.name} returned {len(scores)} scores for {len(responses)} responses")
        for i, s in enumerate(scores):
            if not math.isfinite(s):
                raise RewardError(f"reward function {self.name} returned {s} for sample {i} "
                                  f"(prompt {prompts[i]!r}, response {responses[i]!r})")
        return torch.tensor(scores, dtype=torch.float32)

    def _locate(self, prompts, responses):
        """Find the first sample on which the function raises by itself, to name it in the error."""
        for i, (p, r) in enumerate(zip(prompts, responses)):
            try:
                self.fn([p], [r])
            except Exception:
                return f"on sample {i} (prompt {p!r}, response {r!r})"
        return f"on a batch of {len(prompts)} samples"


class RewardModelReward:
    """Scores from a *ForSequenceClassification checkpoint, as transformers computes them."""

    def __init__(self, path, cfg, device, dtype, batch_size=16):
        from .model import load_reward_model
        from .tokenizer import load_tokenizer

        self.model = load_reward_model(path, dtype=dtype, device=device).eval().requires_grad_(False)
        self.tokenizer = load_tokenizer(path)
        self.cfg, self.device, self.batch_size = cfg, device, batch_size

    def render(self, prompt, response):
        if self.cfg.chat_template:
            chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            return self.tokenizer.apply_chat_template(chat, tokenize=False, enable_thinking=self.cfg.enable_thinking)
        return prompt + response

    @torch.no_grad()
    def __call__(self, prompts, responses):
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
            raise RewardError(f"reward model gave {scores[i].item()} for sample {i} (prompt {prompts[i]!r})")
        return scores


def make_reward_source(cfg, device="cpu", dtype=None):
    if cfg.reward_model:
        return RewardModelReward(cfg.reward_model, cfg, device, dtype)
    if cfg.reward_fn:
        return CallableReward(import_callable(cfg.reward_fn), cfg.reward_fn)
    return CallableReward(TASK_REWARDS[cfg.task], f"of task '{cfg.task}'")


def load_prompts(path) -> list[str]:
    """Prompts from a text file (one per line) or a JSONL file (a "prompt" field per line)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"prompts file not found: {path}")
    prompts = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if path.endswith(".jsonl"):
                try:
                    prompts.append(json.loads(line)["prompt"])
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise RewardError(f"{path}:{n}: expected a JSON object with a \"prompt\" field") from None
            else:
                prompts.append(line)
    if not prompts:
        raise RewardError(f"prompts file {path} holds no prompts")
    return prompts
