"""Batched sampling with a static KV cache: temperature, top-k, top-p, stop at EOS.

    tokens = generate(model, prompt_ids, 64, attention_mask=prompt_mask, temperature=1.0,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)   # [B, 64]

Prompts are left-padded (`attention_mask` 0 on the padding); positions count real tokens only, so a
prompt in a padded batch is decoded exactly as it would be alone. Positions after a row's EOS hold
the pad id. Works for every family of model.py: sliding-window layers mask the cache slots outside their
window, NoPE layers skip RoPE.

Speed on the CPU: the prompt is prefilled in one forward that computes logits at its last position only;
each step then feeds one token per row with no mask (unless the prompt had padding) into the static cache;
and float32 models multiply with oneDNN-packed weight copies for the duration of the call
(`cpu_packed_weights`, about 2x faster than MKL's sgemm at these batch sizes). bench/generate.py measures it.
"""
from contextlib import nullcontext

import torch

from .model import CausalLM, KVCache, can_pack_for_cpu, cpu_packed_linears


def sample_from_probs(probs, uniforms):
    """Inverse-CDF sampling: the first token whose cumulative probability exceeds u * total.

    probs: [B, V] (need not be normalised); uniforms: [B] in [0, 1). One uniform per row and step,
    so a row's token depends only on its own noise: a batch split across processes samples the same
    tokens as the whole batch in one process (see `global_rows` in generate)."""
    cdf = probs.cumsum(-1)  # [B, V]
    threshold = uniforms[:, None].to(cdf.dtype) * cdf[:, -1:]  # [B, 1]
    return torch.searchsorted(cdf, threshold, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


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
    cpu_packed_weights=None,
    global_rows=None,
):
    """Sample up to `max_new_tokens` after each prompt.

    prompt_ids: [B, P] int64, left-padded; attention_mask: [B, P] (1 = real token).
    Returns tokens [B, max_new_tokens] int64, or (tokens, logprobs [B, max_new_tokens] float32) where
    logprobs are log softmax(logits / temperature) of the chosen token before top-k/top-p filtering
    (0 after EOS). The PPO loop does not use them as old log-probs: it recomputes those with the
    training code path so that the first ratio is exactly 1.

    cpu_packed_weights: multiply with oneDNN-packed weight copies while generating (model.cpu_packed_linears):
    ~2x faster decoding on the CPU, same tokens, a second copy of the weights for the duration of the call.
    None (default) = on for float32 models on the CPU.
    global_rows: (offset, global_batch) when these B prompts are rows offset..offset+B of a batch of
    global_batch split over processes: each step draws global_batch uniforms and uses this slice.
    """
    B, P = prompt_ids.shape
    device = prompt_ids.device
    if eos_token_id is None:
        stop_at_eos = False
    pad = pad_token_id if pad_token_id is not None else (eos_token_id if eos_token_id is not None else 0)
    dtype = next(model.parameters()).dtype
    cache = KVCache(model.args, B, P + max_new_tokens, device, dtype)

    if cpu_packed_weights is None:
        cpu_packed_weights = can_pack_for_cpu(model)

    tokens = torch.full((B, max_new_tokens), pad, dtype=torch.long, device=device)
    logprobs = torch.zeros(B, max_new_tokens, dtype=torch.float32, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    with cpu_packed_linears(model, B) if cpu_packed_weights else nullcontext():
        # Prefill: the whole prompt at once; only the last position needs logits.
        hidden = model(prompt_ids, attention_mask, cache=cache, return_hidden=True)[:, -1]  # [B, H]
        for t in range(max_new_tokens):
            logits = model.lm_head(hidden).float()  # [B, V]
            if greedy:
                next_tok = logits.argmax(-1)
            else:
                scaled = filter_logits(logits / temperature, top_k, top_p)
                probs = scaled.softmax(-1)
                if global_rows is None:
                    uniforms = torch.rand(B, generator=generator, device=device)
                else:  # these rows are rows offset.. of a global batch: draw its noise, keep our slice
                    offset, global_batch = global_rows
                    uniforms = torch.rand(global_batch, generator=generator, device=device)[offset : offset + B]
                next_tok = sample_from_probs(probs, uniforms)
            if return_logprobs:
                lp = torch.log_softmax(logits / (1.0 if greedy else temperature), -1)
                logprobs[:, t] = lp.gather(-1, next_tok[:, None]).squeeze(-1).masked_fill(done, 0.0)
            tokens[:, t] = next_tok.masked_fill(done, pad)
            if stop_at_eos:
                done = done | (next_tok == eos_token_id)
                if bool(done.all()):
                    break
            if t + 1 < max_new_tokens:
                # Decode: one new token per row, always a real one (ignored after EOS): no mask needed.
                hidden = model(next_tok[:, None], None, cache=cache, return_hidden=True)[:, -1]  # [B, H]
    return (tokens, logprobs) if return_logprobs else tokens
