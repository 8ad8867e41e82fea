"""Batched sampling with a static KV cache: temperature, top-k, top-p, stop at EOS.

    tokens = generate(model, prompt_ids, 64, attention_mask=prompt_mask, temperature=1.0,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)   # [B, 64]

Prompts are left-padded (`attention_mask` 0 on the padding); positions count real tokens only, so a
prompt in a padded batch is decoded exactly as it would be alone. Positions after a row's EOS hold
the pad id.
"""
import torch

from .model import CausalLM, KVCache


def filter_logits(logits, top_k=0, top_p=1.0):
    """Mask to -inf everything outside the top-k tokens and outside the smallest set whose
    probability reaches top_p (the first token past the threshold is kept). logits: [B, V] float32."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the mass strictly before it already reaches top_p
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


@torch.no_grad()
def generate(
    model: CausalLM,
    prompt_ids,
    max_new_tokens,
    *,
    attention_mask=None,
    temperature=1.0,
    top_p=1.0,
    top_k=0,
    greedy=False,
    stop_at_eos=True,
    eos_token_id=None,
    pad_token_id=None,
    return_logprobs=False,
    generator=None,
):
    """Sample up to `max_new_tokens` after each prompt.

    prompt_ids: [B, P] int64, left-padded; attention_mask: [B, P] (1 = real token).
    Returns tokens [B, max_new_tokens] int64, or (tokens, logprobs [B, max_new_tokens] float32) where
    logprobs are log softmax(logits / temperature) of the chosen token before top-k/top-p filtering
    (0 after EOS). The PPO loop does not use them as old log-probs: it recomputes those with the
    training code path so that the first ratio is exactly 1.
    """
    B, P = prompt_ids.shape
    device = prompt_ids.device
    if attention_mask is None:
        attention_mask = torch.ones_like(prompt_ids, dtype=torch.bool)
    if eos_token_id is None:
        stop_at_eos = False
    pad = pad_token_id if pad_token_id is not None else (eos_token_id if eos_token_id is not None else 0)
    dtype = next(model.parameters()).dtype
    cache = KVCache(model.args, B, P + max_new_tokens, device, dtype)

    tokens = torch.full((B, max_new_tokens), pad, dtype=torch.long, device=device)
    logprobs = torch.zeros(B, max_new_tokens, dtype=torch.float32, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    hidden_in, mask_in = prompt_ids, attention_mask
    for t in range(max_new_tokens):
        logits = model(hidden_in, mask_in, cache=cache)[:, -1].float()  # [B, V]
        if greedy:
            next_tok = logits.argmax(-1)
        else:
            scaled = filter_logits(logits / temperature, top_k, top_p)
            probs = scaled.softmax(-1)
            next_tok = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        if return_logprobs:
            lp = torch.log_softmax(logits / (1.0 if greedy else temperature), -1)
            logprobs[:, t] = lp.gather(-1, next_tok[:, None]).squeeze(-1).masked_fill(done, 0.0)
        tokens[:, t] = next_tok.masked_fill(done, pad)
        if stop_at_eos:
            done = done | (next_tok == eos_token_id)
            if bool(done.all()):
                break
        hidden_in = next_tok[:, None]
        mask_in = torch.ones(B, 1, dtype=torch.bool, device=device)
    return (tokens, logprobs) if return_logprobs else tokens
