"""Batched sampling with a KV cache: temperature, top-k, top-p, stop at EOS.

    tokens = generate(model, prompt_ids, 64, attention_mask=prompt_mask, temperature=1.0,
                      eos_token_id=tok.eos_token_ids, pad_token_id=tok.pad_token_id)  # [B, 64]

Prompts are left-padded (`attention_mask` 0 on the padding); positions count real tokens only, so a
prompt in a padded batch is decoded exactly as it would be alone. A row stops at the first token that is
any of the EOS ids (a chat model has several: generation_config.json's list, tokenizer.eos_token_ids);
positions after it hold the pad id. Works for every family of model.py: sliding-window layers keep a ring
of `window` slots (model.KVCache), NoPE layers skip RoPE.

The prompt is prefilled in one forward that computes logits at its last position only; then one token per
row per step, in one of two ways (the same tokens, tests/test_generate.py):

  static_cache=True (the default on a GPU): `model.decode_step`, the same kernels on tensors of the same
      shapes at every step, attending over every slot of the cache with a mask, the write slot and the
      positions held in device tensors, no host synchronisation. With cuda_graph=True the step is captured
      once as a CUDA graph (`CUDAGraphStep`) and replayed: one launch per token instead of one per kernel.
      (`torch.compile(model.decode_step, mode="reduce-overhead")` is the compiled alternative.)
  static_cache=False (the default on the CPU): `model(...)` with the cache, attending over the filled slots
      only, with no mask unless the prompt had padding: less attention work while the cache is mostly empty
      (on 2 CPU cores: as fast as the static step at 32 prompt + 64 new tokens, 7% faster at 32 + 512).

Precision: under an autocast region (the trainer's dtype='bf16-mixed', or 'auto' on a GPU or a CPU with AMX or
AVX512-BF16) the matmuls read bf16 copies of the weights (on CUDA autocast's cast cache holds one per parameter
for the region; on the CPU the packed copies below are bf16). On a GPU the KV cache is kept in the autocast
dtype (half the bytes per decoded token of fp32); under CPU autocast it is float32, the dtype attention computes
in there (model.attention: torch's bf16 CPU attention is the slower one); otherwise the parameters' dtype.

Speed on the CPU: float32 models multiply with oneDNN-packed weight copies for the duration of the call
(`cpu_packed_weights`, about 2x faster than MKL's sgemm at these batch sizes; packed in bf16 under CPU autocast).
bench/generate.py measures it.
"""
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ..models.model import CausalLM, KVCache, autocast_dtype, can_pack_for_cpu, cpu_packed_linears


def sample_from_probs(probs, uniforms):
    """Inverse-CDF sampling: the first token whose cumulative probability exceeds u * total.

    probs: [B, V] (need not be normalised); uniforms: [B] in [0, 1). One uniform per row and step,
    so a row's token depends only on its own noise: a batch split across processes samples the same
    tokens as the whole batch in one process (see `global_rows` in generate)."""
    # torch's use_deterministic_algorithms docstring lists a CUDA float cumsum as raising; torch 2.11's CUDA build
    # no longer does (it scans deterministically). bench/gpu_first_checks.py runs this under that mode on the GPU.
    cdf = probs.cumsum(-1)  # [B, V]
    threshold = uniforms[:, None].to(cdf.dtype) * cdf[:, -1:]  # [B, 1]
    return torch.searchsorted(cdf, threshold, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


def _int64(value):
    """A Python int as the int64 with the same low 64 bits (two's complement)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN, _MIX1, _MIX2 = _int64(0x9E3779B97F4A7C15), _int64(0xBF58476D1CE4E5B9), _int64(0x94D049BB133111EB)


def _splitmix64(z):
    """splitmix64's finaliser on an int64 tensor in wrapping 64-bit arithmetic (torch's int64 add and multiply wrap;
    a logical right shift is the arithmetic one with the sign bits masked off)."""
    z = z ^ ((z >> 30) & ((1 << 34) - 1))
    z = z * _MIX1
    z = z ^ ((z >> 27) & ((1 << 37) - 1))
    z = z * _MIX2
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def counter_uniforms(seed, rows, token_index):
    """[n] float64 in [0, 1): the sampling noise of rows `rows` [n] int64 at token `token_index` ([n] int64 or an
    int) under `seed`, a function of those three numbers only (a counter-based generator: splitmix64 applied three
    times, u = mix(mix(mix(seed + g) + row + g) + index + g) / 2^64 with 53 bits kept). So a row's tokens do not
    depend on which rows share a step, on preemption or on the number of processes (ppo_core.engine), and
    generate(noise_seed=...) draws the same noise for a comparison."""
    rows = torch.as_tensor(rows, dtype=torch.long)
    index = torch.as_tensor(token_index, dtype=torch.long, device=rows.device)
    z = _splitmix64(torch.full_like(rows, _int64(seed)) + _GOLDEN)
    z = _splitmix64(z + rows + _GOLDEN)
    z = _splitmix64(z + index + _GOLDEN)
    return ((z >> 11) & ((1 << 53) - 1)).double() * 2.0**-53


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


class CUDAGraphStep:
    """`model.decode_step` captured once as a CUDA graph on its cache, then replayed for every token.

        step = CUDAGraphStep(model, cache)        # after the prefill; the cache must stay the same object
        logits = step(next_tok[:, None])          # [B, 1, V], a fixed buffer: read it before the next call

    Decoding a small model on a GPU is bound by kernel launches, one per operation; a replay launches the whole
    step at once. This is possible because the step's shapes never change and it reads its slot and positions
    from device tensors that it advances in place (model.Backbone.decode_step). Capture follows
    torch.cuda.graphs: warm-up calls on a side stream first (cuBLAS handles, allocator); each warm-up writes the
    slot the first real step overwrites, and the counters it advances are put back afterwards.

    Inside an autocast region. torch.cuda.make_graphed_callables refuses autocast's cast cache because a graph
    would read cached casts that the cache frees when the region ends. Here the warm-up runs in the caller's region
    first, so every fp32 -> bf16 weight cast happens there and is cached (autocast caches the casts of leaves that
    require grad); the capture then finds each cast in the cache, records no cast kernel and reads the cached bf16
    weights directly. The cache lives until the outermost autocast region exits, after `generate` returns, so
    every replay of this step (it lives for one generate call) reads live memory, and the weights are cast once
    per call, not once per token (what cache_enabled=False would cost). Hence: build and replay a CUDAGraphStep
    inside one autocast region, never across its exit. A frozen weight (LoRA's base) is not cached: its cast is
    captured and re-run by every replay, correct but one more full weight read per token.

    The graph also reads the RoPE tables (model.Backbone._rope_tables) by address: `self.rope_tables` keeps the
    tensors alive, so a later forward that regrows a table cannot free memory that a replay still reads."""

    def __init__(self, model: CausalLM, cache: KVCache, warmup=3):
        if warmup < 1:
            raise ValueError("CUDAGraphStep: warmup must be at least 1 (it fills the autocast cast cache and "
                             "the RoPE tables before capture)")
        self.cache = cache
        self.input_ids = torch.zeros(cache.mask.shape[0], 1, dtype=torch.long, device=cache.mask.device)  # [B, 1]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                slot, n_real, mask, length = cache.slot.clone(), cache.n_real.clone(), cache.mask.clone(), cache.length
                model.decode_step(self.input_ids, cache)
                cache.slot.copy_(slot), cache.n_real.copy_(n_real), cache.mask.copy_(mask)
                cache.length = length
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):  # records the kernels; runs nothing
            self.logits = model.decode_step(self.input_ids, cache)  # [B, 1, V]
        cache.length -= 1  # the capture's host-side increment; replays advance it below
        self.rope_tables = dict(model.model._rope_tables)  # the tensors the graph reads, kept alive (G2)

    def __call__(self, input_ids):
        self.input_ids.copy_(input_ids)
        self.graph.replay()
        self.cache.length += 1
        return self.logits


@dataclass
class DecodeOptions:
    """How `generate` samples and decodes (it takes these by name; the defaults are these).

    temperature, top_p, top_k, greedy: the sampling (greedy: argmax). eos_token_id: an id, a list/tuple of ids, or
    None; stop_at_eos: a row stops at the first token that is any of them (never without one). pad_token_id: what
    fills a row after its EOS; None = the first EOS id (0 without one).
    return_logprobs: also log softmax(logits / temperature) of each chosen token before top-k/top-p filtering (0 after
    EOS); return_entropy (with return_logprobs): also the entropy of that distribution (0 after EOS).
    generator: the torch.Generator of the sampling noise.
    cpu_packed_weights: multiply with oneDNN-packed weight copies while generating (model.cpu_packed_linears):
    ~2x faster decoding on the CPU, same tokens, a second copy of the weights for the duration of the call.
    None = on for float32 models on the CPU.
    global_rows: (offset, global_batch) when these B prompts are rows offset..offset+B of a batch of
    global_batch split over processes: each step draws global_batch uniforms and uses this slice.
    static_cache: decode with the fixed-shape step `model.decode_step` (see the module docstring).
    None = on except on the CPU, where attending over the filled slots only is faster for long
    responses after short prompts.
    cuda_graph: capture that step as a CUDA graph (CUDAGraphStep); needs static_cache on a CUDA device.
    noise_seed: draw the sampling noise with `counter_uniforms(noise_seed, row, token index)` instead of `generator`
    (rows numbered from global_rows' offset): the noise of the rollout engine (ppo_core.engine), for comparisons."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    stop_at_eos: bool = True
    eos_token_id: object = None
    pad_token_id: int = None
    return_logprobs: bool = False
    return_entropy: bool = False
    generator: object = None
    cpu_packed_weights: bool = None
    global_rows: tuple = None
    static_cache: bool = None
    cuda_graph: bool = False
    noise_seed: int = None


@torch.no_grad()
def generate(model: CausalLM, prompt_ids, max_new_tokens, *, attention_mask=None, **options):
    """Sample up to `max_new_tokens` after each prompt.

    prompt_ids: [B, P] int64, left-padded; attention_mask: [B, P] (1 = real token); options: the fields of
    DecodeOptions, by name (an unknown one is a TypeError).
    Returns tokens [B, max_new_tokens] int64, or (tokens, logprobs [B, max_new_tokens] float32) with return_logprobs,
    (tokens, logprobs, entropy) with return_entropy too. The PPO loop does not use these log-probs as old log-probs:
    it recomputes those with the training code path so that the first ratio is exactly 1, unless the run sets
    old_logprobs_from_rollout.
    """
    o = DecodeOptions(**options)
    B, P = prompt_ids.shape
    device = prompt_ids.device
    if o.eos_token_id is None:
        stop_ids = []
    elif isinstance(o.eos_token_id, (list, tuple)):
        stop_ids = [int(i) for i in o.eos_token_id]
    else:
        stop_ids = [int(o.eos_token_id)]
    if not stop_ids:
        o.stop_at_eos = False
    pad = o.pad_token_id if o.pad_token_id is not None else (stop_ids[0] if stop_ids else 0)
    eos_ids = torch.tensor(stop_ids, dtype=torch.long, device=device)  # [E], made once for torch.isin below
    # under autocast, k, v come out of autocast's matmuls in its dtype: the cache keeps them so on a GPU; under CPU
    # autocast attention computes in float32 (model.attention), so the cache is float32 (no per-step upcast of it)
    if device.type == "cpu" and autocast_dtype("cpu"):
        cache_dtype = torch.float32
    else:
        cache_dtype = autocast_dtype(device.type) or next(model.parameters()).dtype
    cache = KVCache(model.args, B, P + max_new_tokens, device, cache_dtype)

    if o.cpu_packed_weights is None:
        o.cpu_packed_weights = can_pack_for_cpu(model)
    if o.static_cache is None:
        o.static_cache = device.type != "cpu"
    if o.cuda_graph and not (o.static_cache and device.type == "cuda"):
        raise ValueError("generate: cuda_graph=True needs static_cache=True and a CUDA device, "
                         f"got static_cache={o.static_cache} on {device}")
    # On a GPU, reading `done` on the host is a synchronisation: the static path looks only every 16 steps
    # (tokens past a row's EOS are overwritten with the pad id either way).
    eos_check_every = 16 if o.static_cache else 1

    tokens = torch.full((B, max_new_tokens), pad, dtype=torch.long, device=device)
    logprobs = torch.zeros(B, max_new_tokens, dtype=torch.float32, device=device)
    entropy = torch.zeros(B, max_new_tokens, dtype=torch.float32, device=device) if o.return_entropy else None
    done = torch.zeros(B, dtype=torch.bool, device=device)
    with cpu_packed_linears(model, B) if o.cpu_packed_weights else nullcontext():
        # Prefill: the whole prompt at once; only the last position needs logits.
        hidden = model(prompt_ids, attention_mask, cache=cache, return_hidden=True)[:, -1:]  # [B, 1, H]
        logits = model.lm_head(hidden)  # [B, 1, V]
        if o.cuda_graph:
            decode = CUDAGraphStep(model, cache)
        elif o.static_cache:
            decode = lambda ids: model.decode_step(ids, cache)  # noqa: E731
        else:  # one new token per row, always a real one (ignored after EOS): no mask needed
            decode = lambda ids: model(ids, None, cache=cache)  # noqa: E731
        for t in range(max_new_tokens):
            logits = logits[:, -1].float()  # [B, V]
            if o.greedy:
                next_tok = logits.argmax(-1)
            else:
                scaled = filter_logits(logits / o.temperature, o.top_k, o.top_p)
                probs = scaled.softmax(-1)
                if o.noise_seed is not None:
                    first_row = o.global_rows[0] if o.global_rows is not None else 0
                    uniforms = counter_uniforms(o.noise_seed, torch.arange(first_row, first_row + B, device=device), t)
                elif o.global_rows is None:
                    uniforms = torch.rand(B, generator=o.generator, device=device)
                else:  # these rows are rows offset.. of a global batch: draw its noise, keep our slice
                    offset, global_batch = o.global_rows
                    uniforms = torch.rand(global_batch, generator=o.generator, device=device)[offset : offset + B]
                next_tok = sample_from_probs(probs, uniforms)
            if o.return_logprobs:
                lp = torch.log_softmax(logits / (1.0 if o.greedy else o.temperature), -1)
                logprobs[:, t] = lp.gather(-1, next_tok[:, None]).squeeze(-1).masked_fill(done, 0.0)
                if o.return_entropy:
                    entropy[:, t] = -(lp.exp() * lp).sum(-1).masked_fill(done, 0.0)
            tokens[:, t] = next_tok.masked_fill(done, pad)
            if o.stop_at_eos:  # outside the decode step (and its CUDA graph): an eager isin against [E] ids
                done = done | torch.isin(next_tok, eos_ids)
                if (t + 1) % eos_check_every == 0 and bool(done.all()):
                    break
            if t + 1 < max_new_tokens:
                logits = decode(next_tok[:, None])  # [B, 1, V]
    if o.return_entropy and o.return_logprobs:
        return tokens, logprobs, entropy
    return (tokens, logprobs) if o.return_logprobs else tokens
