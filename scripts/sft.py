"""Supervised fine-tuning of the tiny demo checkpoints in ppo_core/demo/: what scripts/make_demo_checkpoint.py,
make_arith_checkpoint.py, make_tool_checkpoint.py and make_judge_checkpoint.py share. Each script holds its task (the
tokenizer's characters, the demonstrator, its batches, how it measures the result); this file holds the model and
the training loop, so the four checkpoints are trained the same way:

    model = tiny_llama(vocab_size, pad_id, eos_id)          # matrices ~ N(0, 0.02^2) from torch's global generator
    loss, seconds = train(model, next_batch, steps, lr, log_every=100)

Not a library module: the scripts import it from their own folder (`python scripts/make_demo_checkpoint.py` puts
scripts/ first on sys.path).
"""
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ppo_core.models.model import CausalLM, ModelArgs  # noqa: E402

WARMUP_STEPS = 100
"""The learning rate rises linearly over this many steps, then follows a cosine to 0 at the last step."""


def character_tokenizer(characters: str, special_tokens: list[str], unk_token: str | None = None) -> Tokenizer:
    """A WordLevel tokenizer trained with the `tokenizers` library: the special tokens first, then one token a
    character of `characters`; decoding concatenates, no spaces. unk_token None: a character outside them is an
    error, not a token."""
    tok = Tokenizer(models.WordLevel(unk_token=unk_token))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token a character
    tok.decoder = decoders.Fuse()  # decode by concatenation, no spaces
    trainer = trainers.WordLevelTrainer(special_tokens=special_tokens, min_frequency=1)
    tok.train_from_iterator([characters] * 4, trainer=trainer)
    return tok


def tiny_llama(vocab_size: int, pad_token_id: int, eos_token_id: int, hidden_size: int = 64,
               intermediate_size: int = 176, layers: int = 4, max_positions: int = 64) -> CausalLM:
    """A small Llama-family model in float32 (tied embeddings, GQA: heads of 16, two key/value heads), every matrix
    drawn from N(0, 0.02^2) with torch's global generator (seed it first), the norms at 1. Its config.json is the
    Hugging Face Llama one below."""
    hf_config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": layers,
        "num_attention_heads": hidden_size // 16,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "pad_token_id": pad_token_id,
        "eos_token_id": eos_token_id,
        "bos_token_id": None,
        "torch_dtype": "float32",
    }
    model = CausalLM(ModelArgs.from_hf_config(hf_config))
    for p in model.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.02)
    return model


def right_pad(rows: list[list[int]], loss_masks: list[list[int]], pad_id: int):
    """Token rows and their loss masks (1 on the tokens to learn: the demonstrator's) -> (ids [B, T] right-padded
    with pad_id, attention mask [B, T], loss mask [B, T] float32), T the longest row."""
    T = max(len(r) for r in rows)
    ids = torch.tensor([r + [pad_id] * (T - len(r)) for r in rows])  # [B, T]
    loss_mask = torch.tensor([m + [0] * (T - len(m)) for m in loss_masks], dtype=torch.float32)  # [B, T]
    attn = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])  # [B, T]
    return ids, attn, loss_mask


def train(model: CausalLM, next_batch, steps: int, lr: float, log_every: int, after_step=None) -> tuple[float, float]:
    """Supervised fine-tuning: AdamW (weight decay 0.01, betas 0.9 / 0.98), the learning rate warmed up over
    WARMUP_STEPS then cosine to 0, gradients clipped at norm 1. next_batch() -> one step's padded batches, a list of
    right_pad's (ids, attn, loss_mask); the step's loss is the mean next-token NLL over every token a loss mask marks,
    in all of them together (as one padded batch would give; separate batches of similar length waste less padding).
    Prints the loss every log_every steps and at the last; after_step(step), if given, runs after each step (held-out
    evaluations), its time left out of the training time. -> (the last step's loss, seconds of training)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    model.train()
    t0 = time.perf_counter()
    outside_s = 0.0  # seconds spent in after_step
    for step in range(steps):
        step_lr = lr * min(1.0, (step + 1) / WARMUP_STEPS) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for g in opt.param_groups:
            g["lr"] = step_lr
        nll_sum, n_tokens = 0.0, 0.0
        for ids, attn, loss_mask in next_batch():
            logits = model(ids, attn)[:, :-1]  # [B, T-1, V]: predict token t+1 from position t
            nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
            nll_sum = nll_sum + (nll * loss_mask[:, 1:].reshape(-1)).sum()
            n_tokens += loss_mask[:, 1:].sum().item()
        loss = nll_sum / n_tokens
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % log_every == 0 or step == steps - 1:
            print(f"step {step:5d}  sft loss {loss.item():.4f}  lr {step_lr:.2e}  [{time.perf_counter() - t0:.0f}s]",
                  flush=True)
        if after_step is not None:
            t_after = time.perf_counter()
            after_step(step)
            outside_s += time.perf_counter() - t_after
    return loss.item(), time.perf_counter() - t0 - outside_s
