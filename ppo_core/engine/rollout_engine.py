"""The rollout engine: sampling from ppo-core's own model over a paged KV cache, with continuous batching.

    engine = RolloutEngine(policy)
    responses = engine.generate([[1, 5, 9], [1, 7]], 64, temperature=1.0, eos_token_id=tok.eos_token_ids, seed=3)
    # -> one list of new token ids per prompt, ending at (and including) its first EOS

The shape: generate adds the requests (a GenerateCall: one Sequence per prompt, each carrying the call's
SamplingParams; the KV pool; the scheduler), then runs RolloutEngine.step until every sequence is done. A step is
schedule (Scheduler.schedule picks what each sequence computes, StepBatch lays it out as one flat batch), run (the
model over it, or StaticDecode's fixed buffers) and postprocess (sample, append, end the sequences and turns that
are over).

What it does differently from `ppo_core.generate` (the plain padded reference, which it must agree with):
- The KV cache is a pool of fixed-size blocks (`block_size` positions of one sequence each, in every layer of a
  group), sized by a byte budget for the call and freed when it returns (the update gets the memory back, and a
  cache of the old weights could not serve the next rollout anyway). A sequence holds the blocks its tokens fill, no
  more: no row is padded to the longest prompt or response.
- Continuous batching (ppo_core.engine.scheduler): every step computes, in ONE forward over a flat batch of tokens, the next
  token of every running sequence and a chunk of each prompt being prefilled; a sequence that ends leaves at once and
  a waiting one takes its place. When blocks run out the newest sequence is preempted and recomputed later.
- Shared prefixes (ppo_core.engine.kv_blocks): the n samples of a GRPO group, and prompts that share a system prompt, are
  prefilled once; the other samples find the blocks by their content.
- Sampling noise is `counter_uniforms(seed, row, token index)`: a sequence's tokens do not depend on which
  sequences share its steps, on preemption, or on how the rows are split over processes (`rows`).

Layer groups. Layers that attend to a sliding window shorter than the call's longest sequence keep their keys in a
pool of their own, where a sequence holds only the blocks its next query can see; every other layer (full attention,
NoPE, q/k norms: whatever Attention computes) shares the main pool. For the sequences that compute one token in a
step, attention over the pool is ppo_kernels.paged_attention on CUDA (a Triton flash-decoding kernel that reads
the blocks in place); on the CPU, each sequence's visible keys gathered into one buffer and two batched matmuls,
a few sequences at a time once a step's keys and values pass GATHER_AT_ONCE_BYTES a layer (which would not stay in
the CPU's caches), with the blocks that a group of sequences shares (the samples of one prompt) gathered once and
attended by the group's queries together, merged by log-sum-exp (StepBatch.decode_plan). A prefill chunk runs fused
SDPA (ppo_core.models.model.attention) over its gathered keys.

Decode-only steps (every running sequence computes one token; no prefill chunk, no copy-on-write: most of a
rollout's steps) take ppo_core.engine.static_decode's path where `cuda_graphs` applies (CUDA, the Triton backend, a model
that is not FSDP-sharded): fixed-shape buffers, rows padded to a power-of-two bucket, one CUDA graph per bucket,
captured in the call and replayed. Elsewhere, and for every other step, the dynamic step below runs;
static_decode=True runs the static path without graphs anywhere (the CPU tests compare the two).

Precision as in ppo_core.generate: under autocast the matmuls compute in bf16; the cache is kept in the autocast
dtype on a GPU and in float32 under CPU autocast (where attention computes in float32); on the CPU float32 models
multiply with oneDNN-packed weights for the duration of the call.
"""
import math
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ppo_kernels import backend
from ppo_kernels.paged_attention import paged_decode_attention

from .generate import counter_uniforms, filter_logits, sample_from_probs
from ..models.model import CausalLM, attention, autocast_dtype, can_pack_for_cpu, cpu_packed_linears
from .scheduler import Scheduler, Sequence
from .static_decode import StaticDecode, graphs_unavailable, profiled

CPU_KV_CACHE_GB = 4.0
"""The CPU's default pool budget (GiB): an upper bound; a call allocates only what its sequences can use at once."""
GPU_FREE_MEMORY_FRACTION = 0.8
"""On a GPU the default budget is this fraction of the memory free when the call starts (the models are loaded)."""
SHARED_PREFIX_MIN_BYTES = 4 * 2**20
"""CPU decode steps attend to the prompt blocks a group of sequences shares once per group when that saves at least
this many bytes of keys and values gathered per layer (shared_prefix_groups). The extra pass and merge cost a fixed
few ops a layer: on an AVX2-only EPYC (Zen 2), 2 threads, SmolLM2-135M's heads (1.5 KB of keys and values a
position), saving 768 positions (4 groups x 3 x 64) was 1.74x slower, 1,792 positions level (1.00x, 0.98x), 3,584
positions 0.76x and 14,336 (workload C) 0.56x the time of gathering every sequence's keys (bench/results/decode-attention-cpu.md)."""
GATHER_AT_ONCE_BYTES = 16 * 2**20
GATHER_CHUNK_BYTES = 3 * 2**20
"""CPU decode steps gather the visible keys and values of all their sequences at once while those come to at most
GATHER_AT_ONCE_BYTES a layer, and beyond that as many sequences at a time as fit in GATHER_CHUNK_BYTES of keys (as
many of values), each chunk attended before the next is gathered: buffers that stay in the CPU's caches, not ones
the gather writes out to memory and the matmuls read back. Measured on an AVX2-only EPYC (Zen 2) with 16 MiB of L3,
2 threads, layer after layer (bench/decode_attention_cpu.py --layers 30, 64 sequences): chunks took 0.78x and 0.83x
the time of one gather at 320 and 640 positions at SmolLM2-135M's heads (31 and 63 MB of keys and values a layer),
0.72x at Qwen3-0.6B's (84 MB); at 160 positions (16 MB) the two were level from run to run, and workload C's own
keys (up to 13 MB) ran 1.02x slower in chunks (bench/results/decode-attention-cpu.md). Chunks of 1.5 and 6 MiB did worse than 3 (160
and 320 positions: 2.57 and 3.04, 5.10 and 5.82 against 2.48 and 4.69 ms a layer). A whole decode step of
SmolLM2-135M, 64 sequences at ~300 positions: 292.7 ms against 387.7 (bench/decode_steps.py --one-gather)."""


@dataclass(frozen=True)
class EngineSettings:
    """How a RolloutEngine sizes and runs its calls (RolloutEngine(model, **settings) takes these by name).

    kv_cache_gb: the byte budget of the pool (None: CPU_KV_CACHE_GB on the CPU, GPU_FREE_MEMORY_FRACTION of the free
    memory on a GPU); a call allocates at most what all its sequences could hold at once.
    block_size: positions per block (None: 16).
    max_num_seqs: sequences running at once at most; max_step_tokens: tokens computed in one step at most (prefill
    chunks; a decode token is never held back).
    cuda_graphs: on CUDA, replay each decode-only step as a CUDA graph, one per batch bucket, captured in the call
    (ppo_core.engine.static_decode); ignored on the CPU, and off for an FSDP-sharded model and PPO_KERNELS_BACKEND=torch
    (stats['cuda_graphs'] says which and why).
    static_decode: run decode-only steps on the fixed-shape buffers the graphs replay; None = exactly when graphs
    are used; True without graphs (the CPU, cuda_graphs=False) runs them eagerly: the path the graphs capture.
    shared_prefix_min_bytes: on the CPU, sequences sharing prompt blocks attend to them once per group when that
    saves at least this many bytes of gathered keys and values per layer (0: whenever blocks are shared).
    gather_at_once_bytes, gather_chunk_bytes: on the CPU, a decode step gathers the keys and values of all its
    sequences at once while they come to at most gather_at_once_bytes a layer, else the keys of as many sequences at
    a time as fit in gather_chunk_bytes (at least one; None: always at once), as many values with them."""
    kv_cache_gb: float = None
    block_size: int = None
    max_num_seqs: int = 256
    max_step_tokens: int = 4096
    cuda_graphs: bool = True
    static_decode: bool = None
    shared_prefix_min_bytes: int = SHARED_PREFIX_MIN_BYTES
    gather_at_once_bytes: int = GATHER_AT_ONCE_BYTES
    gather_chunk_bytes: int = GATHER_CHUNK_BYTES


@dataclass(frozen=True)
class SamplingParams:
    """How the sequences of a generate call sample (RolloutEngine.generate takes these by name); each Sequence
    carries its own (Sequence.params).

    temperature, top_p, top_k, greedy: as ppo_core.generate samples. eos_token_id: an id, a list of ids, or None
    (never stop early). seed: row r samples with counter_uniforms(seed, r, token index). return_logprobs: also the
    log softmax(logits / temperature) of each chosen token before top-k/top-p; return_entropy (with it): the entropy
    of that distribution. max_turn_tokens: a multi-turn episode's turn ends after this many sampled tokens (None:
    at an EOS only)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    eos_token_id: object = None
    seed: int = 0
    return_logprobs: bool = False
    return_entropy: bool = False
    max_turn_tokens: int = None

    @property
    def stop_ids(self) -> set:
        """The token ids that end a sequence (or a turn)."""
        ids = self.eos_token_id
        return set([] if ids is None else [int(i) for i in ids] if isinstance(ids, (list, tuple)) else [int(ids)])


@dataclass(frozen=True)
class PoolLayout:
    """The KV pool of one generate call: its layer groups (RolloutEngine.layer_groups: each group's window, the group
    of each layer and its index there), block_size, the blocks handed out per group (n_blocks; block n_blocks[g] is
    group g's spare, where padding rows write), the model's key-value heads, and the pool's device and dtype."""
    windows: list
    group_of: list
    index_in_group: list
    block_size: int
    n_blocks: list
    n_kv_heads: int = 0
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32


class RolloutEngine:
    """Generation for a CausalLM (a policy with or without LoRA, a reference, a judge) over a paged KV cache.

    RolloutEngine(model, **settings): the fields of EngineSettings, by name.
    generate(prompts, max_new_tokens, **sampling) = add the requests (GenerateCall), then `step` (schedule, run,
    postprocess) until every sequence is done."""

    def __init__(self, model: CausalLM, **settings):
        self.model = model
        self.settings = EngineSettings(**settings)
        self.block_size = self.settings.block_size or 16
        self.stats = {}

    # -- the pool -------------------------------------------------------------------------------------------------

    def layer_groups(self, longest: int):
        """-> (windows, group of each layer, its index in the group): one group per distinct window that is shorter
        than the longest sequence (a longer window never excludes a key: such a layer is a full one)."""
        windows = [w if w is not None and w < longest else None for w in self.model.args.sliding_windows]
        group_windows = sorted(set(windows), key=lambda w: (w is not None, w or 0))  # full attention first
        group_of = [group_windows.index(w) for w in windows]
        index_in_group = [group_of[:i].count(group_of[i]) for i in range(len(windows))]
        return group_windows, group_of, index_in_group

    def pool_sizes(self, lengths, windows, group_of, dtype, device):
        """Blocks per group: the budget split so that every group holds the same number of sequences of the
        longest length, capped at what all the call's sequences need at once."""
        a, bs = self.model.args, self.block_size
        per_block_layer = 2 * bs * a.num_key_value_heads * a.head_dim * torch.empty((), dtype=dtype).element_size()
        layers = [group_of.count(g) for g in range(len(windows))]
        chunk_blocks = -(-min(self.settings.max_step_tokens, max(lengths)) // bs) + 1

        def need(length, window):  # blocks one sequence holds at most in a group
            full = -(-length // bs)
            return full if window is None else min(full, -(-(window - 1) // bs) + chunk_blocks)

        one = [need(max(lengths), w) for w in windows]
        all_at_once = [sum(need(n, w) for n in lengths) for w in windows]
        budget = self.settings.kv_cache_gb
        if budget is None:
            budget = (GPU_FREE_MEMORY_FRACTION * torch.cuda.mem_get_info(device)[0] / 2**30 if device.type == "cuda"
                      else CPU_KV_CACHE_GB)
        sequences = budget * 2**30 / sum(o * n * per_block_layer for o, n in zip(one, layers))
        if sequences < 1:
            raise ValueError(f"RolloutEngine: kv_cache_gb={budget:.3g} cannot hold one sequence of {max(lengths)} "
                             f"tokens ({sum(o * n for o, n in zip(one, layers)) * per_block_layer / 2**30:.3g} GiB)")
        return [min(int(sequences * o), total) for o, total in zip(one, all_at_once)], per_block_layer, layers

    # -- generation -----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens, *, rows=None, on_turn_end=None, return_mask=False, **sampling):
        """Sample after each prompt (a list of token ids) up to max_new_tokens (an int, or one per prompt) new tokens.
        sampling: the fields of SamplingParams, by name (temperature, top_p, top_k, greedy, eos_token_id, seed,
        return_logprobs, return_entropy, max_turn_tokens).

        -> one list of new token ids per prompt, ending at its first EOS (included); with return_logprobs also the
        log softmax(logits / temperature) of each chosen token before top-k/top-p (as ppo_core.generate), and with
        return_entropy the entropy of that distribution: (tokens, logprobs[, entropy]), lists of lists.
        rows: row i samples with counter_uniforms(seed, rows[i], token index); rows defaults to 0..len(prompts)-1 (a
        process holding rows offset.. of a global batch passes their global numbers, and samples what one process
        would).

        Multi-turn episodes (ppo_core.agents.environments): on_turn_end(index, tokens after the prompt so far) is called when
        sequence `index` ends a turn (an EOS, or max_turn_tokens sampled in this turn) with room left in its
        max_new_tokens, and returns None (the episode is over: the sequence finishes), a list of token ids (an
        observation, appended now), or a concurrent.futures.Future of either (a tool still running: the sequence
        leaves the batch, keeping its cache, and the others go on decoding; it comes back when the future is done).
        Appended tokens count in max_new_tokens, get mask 0 (return_mask: one list of 1s and 0s per prompt after the
        tokens in the result), log-prob and entropy 0, and are prefilled on the sequence's own cache; an observation
        that leaves no room for one more sampled token ends the episode instead. Sampling noise counts every token
        after the prompt, the appended ones included.

        Afterwards `self.stats` holds the call's accounting: computed_tokens (positions run through the model),
        useful_tokens (tokens returned), steps, prefix_hit_tokens (prompt positions found in the pool, not
        computed), shared_prefix_steps (CPU steps whose decode attention read shared prompt blocks once per group of
        sequences holding them, StepBatch.decode_plan), preemptions, pool_bytes (allocated), peak_kv_bytes (blocks in
        use at the peak, in bytes) with kv_token_bytes_at_peak (the bytes of the tokens those blocks held) and sequences_at_peak, blocks (per group),
        cuda_graphs ("on", or "off: " and why), static_steps (decode-only steps run on the static buffers),
        graph_captures, graph_replays, graph_capture_s (seconds of warm-up and capture); with on_turn_end also turns,
        observation_tokens and busy_fraction (the share of the call's wall time spent in steps, not waiting on tools
        with nothing to decode)."""
        call = GenerateCall(self, prompts, max_new_tokens, rows, SamplingParams(**sampling), on_turn_end)
        with call.packed_weights():
            while not call.scheduler.done:
                if call.waiting_on_tools():
                    continue
                self.step(call)
        self.stats = call.accounting()
        return call.results(return_mask)

    def step(self, call):
        """One step of a call: schedule, run, postprocess."""
        step, batch = call.schedule()
        logits, n_tokens = call.run(step, batch)
        call.postprocess(step, batch, logits, n_tokens)


class GenerateCall:
    """One generate call's state: its requests (a Sequence per prompt, with the call's SamplingParams), the KV pool
    and its layout, the scheduler, the decode-only steps' buffers (StaticDecode), the episodes waiting on tools, and
    the accounting that becomes RolloutEngine.stats. Made by RolloutEngine.generate, which calls step() on it."""

    def __init__(self, engine, prompts, max_new_tokens, rows, params, on_turn_end):
        model, device = engine.model, next(engine.model.parameters()).device
        settings = engine.settings
        self.model, self.settings, self.params, self.on_turn_end = model, settings, params, on_turn_end
        n = len(prompts)
        budgets = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [int(max_new_tokens)] * n
        rows = list(range(n)) if rows is None else list(rows)
        if len(budgets) != n or len(rows) != n:
            raise ValueError(f"RolloutEngine.generate: {n} prompts, {len(budgets)} max_new_tokens, {len(rows)} rows")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("RolloutEngine.generate: an empty prompt (every prompt needs at least one token)")
        self.stop_ids = params.stop_ids
        if device.type == "cpu" and autocast_dtype("cpu"):
            cache_dtype = torch.float32  # CPU autocast attends in float32 (ppo_core.models.model.attention)
        else:
            cache_dtype = autocast_dtype(device.type) or next(model.parameters()).dtype

        lengths = [len(p) + m for p, m in zip(prompts, budgets)]
        windows, group_of, index_in_group = engine.layer_groups(max(lengths))
        n_blocks, self.per_block_layer, self.layers = engine.pool_sizes(lengths, windows, group_of, cache_dtype,
                                                                         device)
        a, bs = model.args, engine.block_size
        self.layout = PoolLayout(windows, group_of, index_in_group, bs, n_blocks, a.num_key_value_heads, device,
                                 cache_dtype)
        # per group: keys, values [L_g, blocks + 1, block_size, nkv, hs]; the last block is never handed out: the
        # padding rows of a step (StepBatch, StaticDecode) write there
        pools = [(torch.zeros(L, nb + 1, bs, a.num_key_value_heads, a.head_dim, dtype=cache_dtype, device=device),
                  torch.zeros(L, nb + 1, bs, a.num_key_value_heads, a.head_dim, dtype=cache_dtype, device=device))
                 for L, nb in zip(self.layers, n_blocks)]
        self.scheduler = Scheduler(n_blocks, bs, windows, settings.max_num_seqs, settings.max_step_tokens)
        self.sequences = [Sequence(i, rows[i], list(p), len(p), budgets[i], turn_start=len(p), params=params)
                          for i, p in enumerate(prompts)]
        for seq in self.sequences:  # add the requests
            if budgets[seq.index] > 0:
                self.scheduler.add(seq)
        self.stats = dict(computed_tokens=0, steps=0, shared_prefix_steps=0, peak_kv_bytes=0,
                          kv_token_bytes_at_peak=0, sequences_at_peak=0,
                          pool_bytes=sum(nb * L * self.per_block_layer for nb, L in zip(n_blocks, self.layers)))
        self.no_graphs = graphs_unavailable(model, device, settings.cuda_graphs)
        self.static = None  # the decode-only steps' buffers and graphs, for this call (the pool's lifetime)
        running_at_most = min(sum(1 for b in budgets if b > 0), settings.max_num_seqs)
        if (self.no_graphs is None if settings.static_decode is None else settings.static_decode) and running_at_most:
            self.static = StaticDecode(model, pools, self.layout, running_at_most, max(lengths),
                                       cuda_graphs=self.no_graphs is None)
        self.turns = dict(turns=0, observation_tokens=0, idle_s=0.0)
        self.pending = {}  # Future -> the parked sequence it answers
        self.started = time.perf_counter()
        self.scratch = Scratch()  # the gathered keys and values, reused by every layer and step of this call
        self.layer_pools = [LayerPool(pools[g][0][i], pools[g][1][i]) for g, i in zip(group_of, index_in_group)]
        self.n_prompts = n

    def packed_weights(self):
        """On the CPU, float32 models multiply with oneDNN-packed weights for the duration of the call."""
        packed = can_pack_for_cpu(self.model)
        rows = min(self.n_prompts, self.settings.max_num_seqs)
        return cpu_packed_linears(self.model, rows) if packed else nullcontext()

    # -- the three parts of a step ----------------------------------------------------------------------------------

    def schedule(self):
        """-> (the step's chunks (Scheduler.schedule), its StepBatch, or None when the static buffers run it)."""
        with profiled("engine.schedule"):
            step = self.scheduler.schedule()
            if not step.chunks:
                raise RuntimeError("RolloutEngine: a step with nothing to compute (the pool cannot hold one "
                                   "sequence's next chunk)")
            if self.static is not None and self.static.takes(step):
                return step, None
            settings = self.settings
            batch = StepBatch(step, self.layout, self.scratch,
                              min_shared=settings.shared_prefix_min_bytes // self.per_block_layer
                              * self.layout.block_size,
                              gather_bytes=(settings.gather_at_once_bytes, settings.gather_chunk_bytes))
            return step, batch

    def run(self, step, batch):
        """The model over the step -> (the logits [S, V] float32 of its S chunks that sample, positions computed)."""
        sampling = [c for c in step.chunks if c.samples]
        if batch is None:  # one token per chunk: row i of the logits is chunk i's
            logits = self.static.run(step)  # [n, V] float32
            if len(sampling) < len(step.chunks):  # (a one-token prefill chunk samples nothing)
                sampling_rows = [i for i, c in enumerate(step.chunks) if c.samples]
                logits = logits[torch.tensor(sampling_rows, device=self.layout.device)]  # [S, V]
            return logits, len(step.chunks)
        model = self.model
        attend = lambda i, q, k, v: batch.attend(self.layer_pools, i, q, k, v)  # noqa: E731
        hidden = model(batch.input_ids, paged=(batch.positions, attend, batch.n_positions),
                       return_hidden=True)  # [N + pad, H]
        last = batch.last_rows(sampling)  # [S]; padded to a row bucket for the matmul, cut after it
        last = torch.cat([last, last.new_zeros(row_bucket(len(last), self.layout.device) - len(last))])
        return model.lm_head(hidden[last])[: len(sampling)].float(), batch.n_tokens  # [S, V]

    def postprocess(self, step, batch, logits, n_tokens):
        """Sample each sampling chunk's next token, append it, and end the sequences (or turns) that are done."""
        params, sched = self.params, self.scheduler
        with profiled("engine.sampling"):
            seqs = [c.seq for c in step.chunks if c.samples]
            chosen, logprobs, entropy = sample(logits, seqs, params)
        sched.after_step(step)
        self.account(batch, n_tokens)
        for i, seq in enumerate(seqs):
            own = seq.params  # the sequence's settings (the call's: one SamplingParams for all)
            seq.tokens.append(chosen[i])
            seq.mask.append(1)
            if own.return_logprobs:
                seq.logprobs.append(logprobs[i])
                if own.return_entropy:
                    seq.entropy.append(entropy[i])
            if seq.generated >= seq.max_new:
                sched.finish(seq)
            elif self.on_turn_end is not None and (chosen[i] in self.stop_ids or (
                    own.max_turn_tokens is not None
                    and len(seq.tokens) - seq.turn_start >= own.max_turn_tokens)):
                self.end_turn(seq)
            elif chosen[i] in self.stop_ids:
                sched.finish(seq)

    def account(self, batch, n_tokens):
        stats, sched = self.stats, self.scheduler
        stats["computed_tokens"] += n_tokens
        stats["steps"] += 1
        stats["shared_prefix_steps"] += batch is not None and batch.shared_prefix_groups > 0
        used = sum(pool.n_used * L * self.per_block_layer for pool, L in zip(sched.pools, self.layers))
        if used > stats["peak_kv_bytes"]:
            stats["peak_kv_bytes"] = used
            stats["kv_token_bytes_at_peak"] = sum(sched.held_tokens(g) * L * self.per_block_layer
                                                  // self.layout.block_size for g, L in enumerate(self.layers))
            stats["sequences_at_peak"] = len(sched.running)

    # -- multi-turn episodes ----------------------------------------------------------------------------------------

    def waiting_on_tools(self) -> bool:
        """Resume the episodes whose tools have answered (waiting for one when nothing else can run) -> True when
        there is still nothing to schedule."""
        sched = self.scheduler
        self.collect_answers(block=not sched.running and not sched.waiting)
        return not sched.running and not sched.waiting

    def end_turn(self, seq):
        """seq ended a turn with room left: ask on_turn_end what follows."""
        self.turns["turns"] += 1
        answer = self.on_turn_end(seq.index, seq.tokens[seq.prompt_len :])
        if isinstance(answer, Future):
            self.scheduler.park(seq)
            self.pending[answer] = seq
        else:
            self.continue_episode(seq, answer, parked=False)

    def continue_episode(self, seq, observation, parked):
        sched = self.scheduler
        room = seq.max_new - seq.generated
        if observation is None or len(observation) >= room:  # over, or no room to answer the observation
            if parked:
                sched.parked.remove(seq)
                sched.running.append(seq)
            sched.finish(seq)
            return
        self.turns["observation_tokens"] += len(observation)
        if not parked:
            sched.park(seq)
        sched.resume(seq, list(observation))
        if seq.params.return_logprobs:
            seq.logprobs += [0.0] * len(observation)
            seq.entropy += [0.0] * len(observation) if seq.params.return_entropy else []

    def collect_answers(self, block):
        """Resume the parked sequences whose futures are done (block: wait for at least one first)."""
        if not self.pending:
            return
        if block:
            t0 = time.perf_counter()
            wait(list(self.pending), return_when=FIRST_COMPLETED)
            self.turns["idle_s"] += time.perf_counter() - t0
        for future in [f for f in self.pending if f.done()]:
            self.continue_episode(self.pending.pop(future), future.result(), parked=True)

    # -- the results ------------------------------------------------------------------------------------------------

    def accounting(self) -> dict:
        """The call's stats (RolloutEngine.generate's docstring lists them)."""
        stats, sched, static = dict(self.stats), self.scheduler, self.static
        stats.update(preemptions=sched.stats["preemptions"], prefix_hit_tokens=sched.stats["prefix_hit_tokens"],
                     useful_tokens=sum(s.generated for s in self.sequences), block_size=self.layout.block_size,
                     blocks=self.layout.n_blocks)
        stats.update(static.stats if static is not None else
                     dict(static_steps=0, graph_captures=0, graph_replays=0, graph_capture_s=0.0))
        if static is not None and static.cuda_graphs:
            stats["cuda_graphs"] = "on"
        else:
            stats["cuda_graphs"] = "off: " + (static is not None and static.failure or self.no_graphs or (
                "static_decode=False" if self.settings.static_decode is False else "nothing to decode"))
        if self.on_turn_end is not None:
            wall = time.perf_counter() - self.started
            stats.update(turns=self.turns["turns"], observation_tokens=self.turns["observation_tokens"],
                         busy_fraction=1.0 - self.turns["idle_s"] / wall if wall > 0 else 1.0)
        return stats

    def results(self, return_mask):
        """RolloutEngine.generate's return value."""
        sequences = self.sequences
        tokens = [s.tokens[s.prompt_len :] for s in sequences]
        out = (tokens,) + (([s.mask for s in sequences],) if return_mask else ())
        if self.params.return_logprobs:
            out += ([s.logprobs for s in sequences],)
            if self.params.return_entropy:
                out += ([s.entropy for s in sequences],)
        return out if len(out) > 1 else tokens


def sample(logits, seqs, params):
    """The next token of each sequence from logits [S, V] float32, as ppo_core.generate samples it, with the noise of
    (params.seed, its row, its token index). -> (tokens, logprobs or None, entropy or None), lists of S Python
    numbers."""
    temperature = params.temperature
    if params.greedy:
        chosen = logits.argmax(-1)
    else:
        scaled = logits if temperature == 1.0 else logits / temperature  # (x / 1 is x: one pass over [S, V] saved)
        probs = filter_logits(scaled, params.top_k, params.top_p).softmax(-1)
        uniforms = counter_uniforms(params.seed, torch.tensor([s.row for s in seqs], device=logits.device),
                                    torch.tensor([s.generated for s in seqs], device=logits.device))
        chosen = sample_from_probs(probs, uniforms)
    logprobs = entropy = None
    if params.return_logprobs:
        lp = torch.log_softmax(logits if params.greedy or temperature == 1.0 else logits / temperature, -1)  # [S, V]
        logprobs = lp.gather(-1, chosen[:, None]).squeeze(-1).tolist()
        if params.return_entropy:
            entropy = (-(lp.exp() * lp).sum(-1)).tolist()
    return chosen.tolist(), logprobs, entropy


def gathered_decode_attention(q, k, v, bias):
    """softmax(q k^T / sqrt(hs) + bias) v for q [B, nkv, g, hs] (a kv head's g query heads as rows), k, v
    [B, nkv, T, hs] gathered from the pool, bias [B, 1, 1, T] (0 or -inf), in the cache's dtype; the caller turns
    autocast off. The CPU's decode attention: at these shapes (a few query rows over a few hundred keys) two batched
    matmuls take 0.6x the time of SDPA's CPU flash kernel (measured at SmolLM2-135M's heads, 64 sequences, 160
    keys)."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(q.shape[-1] ** -0.5).add_(bias)  # [B, nkv, g, T]
    return torch.matmul(scores.softmax(-1), v)  # [B, nkv, g, hs]


def partial_attention(q, k, v, bias):
    """Attention over one part of the keys, unnormalised: q [.., g, hs], k, v [.., T, hs], bias [.., 1 | g, T] ->
    (exp(s - m) v, m, sum exp(s - m)) with s = q k^T / sqrt(hs) + bias and m its row maximum ([.., g, hs], [.., g, 1]
    x2); two parts of a row's keys merge as (o1 e^(m1 - m) + o2 e^(m2 - m)) / (l1 e^(m1 - m) + l2 e^(m2 - m)),
    m = max(m1, m2). Every row must see at least one key."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(q.shape[-1] ** -0.5).add_(bias)  # [.., g, T]
    top = scores.amax(-1, keepdim=True)
    weights = scores.sub_(top).exp_()
    return torch.matmul(weights, v), top, weights.sum(-1, keepdim=True)


def shared_prefix_groups(singles, g, bs, min_shared=0):
    """Groups of one-token sequences that share their first blocks in layer group g (the samples of one prompt, a
    common system prompt), to attend to those blocks once per group -> [(indices into singles, shared blocks k)].

    Sequences are grouped by their first block; a group's k is the number of leading blocks all its members hold,
    short of the block each writes its new token to (those are full and read-only). The groups are used when the
    positions they save gathering (k bs for every member but one) are at least min_shared in all; else [] (the
    extra pass and merge cost more than they save: SHARED_PREFIX_MIN_BYTES)."""
    by_first = {}
    for i, c in enumerate(singles):
        by_first.setdefault(c.seq.tables[g][0], []).append(i)
    groups, saved = [], 0
    for members in by_first.values():
        if len(members) < 2:
            continue
        tables = [singles[i].seq.tables[g] for i in members]
        limit = min(singles[i].start // bs for i in members)
        k = 0
        while k < limit and all(t[k] == tables[0][k] for t in tables):
            k += 1
        if k:
            groups.append((members, k))
            saved += (len(members) - 1) * k
    return groups if saved * bs >= max(min_shared, 1) else []


def row_bucket(n: int, device) -> int:
    """The row count a step's matmuls run with for n rows: on the CPU, n itself up to 16, then rounded up (to a
    multiple of 8 up to 128, of 32 up to 1024, of 128 beyond), because oneDNN keeps a primitive (about 0.6 MB) for
    every row count it has seen, which a continuous batch (any count from 1 to the step's budget) would otherwise
    grow by hundreds of MB; padding costs at most 1/8 more rows. Small counts stay exact: a heavy-tailed rollout
    ends with a long run of steps of a few sequences, and on an AVX2-only EPYC (Zen 2) a SmolLM2-135M step of 1 row
    padded to 8 took 110 ms against 64 ms unpadded (each row adds about 5 ms there; workload B of bench/rollout.py:
    74.4 -> 98.9 useful tokens/s). n itself elsewhere."""
    if device.type != "cpu":
        return n
    unit = 1 if n <= 16 else 8 if n <= 128 else 32 if n <= 1024 else 128
    return -(-n // unit) * unit


class LayerPool:
    """One layer's keys and values in the pool, [blocks + 1, block_size, nkv, hs] each, with the views a step
    reads them through, made once a call: by slot ([slots, nkv, hs]: where new keys are written) and by row
    ([slots x nkv, hs]: what the CPU's gathers index)."""

    def __init__(self, k, v):
        self.k, self.v = k, v
        nkv, hs = k.shape[2], k.shape[3]
        self.k_slots, self.v_slots = k.view(-1, nkv, hs), v.view(-1, nkv, hs)
        self.k_rows, self.v_rows = k.view(-1, hs), v.view(-1, hs)


class Scratch:
    """Buffers reused across the layers and steps of one generate call, for the keys and values gathered out of the
    pool. A fresh tensor of tens of MB is a fresh mmap on glibc (above its 32 MB threshold), and page-faulting it in
    cost more than the gather itself: at Qwen3-0.6B's shape (64 sequences x 160 positions, 8 kv heads of 128) one
    layer's key gather took 12.4 ms into a new tensor, 3.4 ms into a reused one (2 threads)."""

    def __init__(self):
        self.buffers = {}

    def take(self, name, shape, dtype, device) -> torch.Tensor:
        """An uninitialised tensor of `shape`, the front of buffer `name` (grown by a quarter when too small)."""
        n = math.prod(shape)
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != device:
            buf = self.buffers[name] = torch.empty(n + n // 4, dtype=dtype, device=device)
        return buf[:n].view(shape)


class StepBatch:
    """One step's flat batch, and the index tensors and masks its attention needs (dtype: the cache's), built once
    per step on the host, for all layers; the gathered keys and values go into `scratch`'s buffers."""

    def __init__(self, step, layout: PoolLayout, scratch=None, min_shared=0, gather_bytes=(None, None)):
        windows, group_of, index_in_group = layout.windows, layout.group_of, layout.index_in_group
        n_blocks, device = layout.n_blocks, layout.device
        self.scratch = scratch if scratch is not None else Scratch()
        # RolloutEngine's gather_at_once_bytes, gather_chunk_bytes: how much the CPU decode gathers at a time
        self.gather_at_once_bytes, self.gather_chunk_bytes = gather_bytes
        self.views = {}  # (scratch buffer name, layer group) -> its views this step (gather)
        self.autocast = autocast_dtype(device.type) is not None  # attention then runs with autocast off
        self.chunks, self.copies = step.chunks, step.copies
        self.windows, self.group_of, self.index_in_group = windows, group_of, index_in_group
        bs = layout.block_size
        ids, positions, self.starts = [], [], []
        for c in step.chunks:
            self.starts.append(len(ids))
            ids += c.seq.tokens[c.start : c.start + c.length]
            positions += range(c.start, c.start + c.length)
        self.n_positions = max(c.start + c.length for c in step.chunks)
        self.n_tokens = len(ids)  # N; then padding rows up to row_bucket(N), at position 0, written to the spare block
        n_pad = row_bucket(len(ids), device) - len(ids)
        self.input_ids = torch.tensor(ids + [0] * n_pad, dtype=torch.long, device=device)  # [N + pad]
        self.positions = torch.tensor(positions + [0] * n_pad, dtype=torch.long, device=device)  # [N + pad]
        self.n_single = sum(1 for c in step.chunks if c.length == 1)  # the first n_single chunks: one token each
        self.prefill_len = max((c.length for c in step.chunks[self.n_single :]), default=0)  # Tmax
        singles = step.chunks[: self.n_single]
        self.slots, self.tables, self.prefills = [], [], []
        for g in range(len(windows)):
            # where each new token's key goes: block * block_size + offset, in group g's pool
            slots = [c.seq.tables[g][p // bs] * bs + p % bs for c in step.chunks for p in range(c.start, c.start + c.length)]
            slots += [n_blocks[g] * bs] * n_pad  # the spare block
            self.slots.append(torch.tensor(slots, dtype=torch.long, device=device))  # [N + pad]
            width = max((len(c.seq.tables[g]) for c in singles), default=0)
            self.tables.append(torch.tensor([c.seq.tables[g] + [-1] * (width - len(c.seq.tables[g])) for c in singles],
                                            dtype=torch.int32, device=device).view(len(singles), width))  # [Bs, width]
            multi = list(zip(step.chunks[self.n_single :], self.starts[self.n_single :]))
            self.prefills.append(self.prefill_batch(multi, g, layout) if multi else None)
        self.seq_lens = torch.tensor([c.start + 1 for c in singles], dtype=torch.int32, device=device)  # [Bs]
        self.triton = backend(device) == "triton"
        self.shared_prefix_groups = 0  # groups of sequences whose shared prompt blocks a decode step attends to once
        if not self.triton and singles:  # the gathered path: what each single query sees, once for all layers
            self.single_plans = [self.decode_plan(singles, g, layout, min_shared) for g in range(len(windows))]
            self.shared_prefix_groups = max(p["prefix"][1].shape[0] if p["prefix"] else 0 for p in self.single_plans)

    @staticmethod
    def decode_plan(singles, g, layout: PoolLayout, min_shared=0):
        """How the one-token sequences of a step attend in layer group g on the CPU, built once for all its layers:
        -> {"rows": the pool rows of each sequence's keys from its first block on ([Bs nkv T] rows of the pool seen
        as [slots x nkv, hs]), "bias": [Bs, 1, 1, T] (0 where visible, -inf elsewhere), "prefix": None or the shared
        prompt blocks of groups of sequences, attended once per group when that saves gathering at least min_shared
        positions (shared_prefix_groups)}."""
        window, bs, nkv = layout.windows[g], layout.block_size, layout.n_kv_heads
        spare_slot, device, dtype = layout.n_blocks[g] * bs, layout.device, layout.dtype
        lens = [c.start + 1 for c in singles]  # each sequence's visible length (its new token included)
        prefix = shared_prefix_groups(singles, g, bs, min_shared) if window is None else []
        first = [0] * len(singles)  # the first block each sequence gathers itself
        for members, k in prefix:
            for i in members:
                first[i] = k
        if window is not None:  # a window: the blocks before the earliest one any query sees are skipped
            first = [max(0, min(n - window for n in lens)) // bs] * len(singles)
        tables = [c.seq.tables[g][f:] for c, f in zip(singles, first)]
        width = max(map(len, tables))
        table = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.long, device=device)
        positions = (torch.tensor(first, device=device)[:, None] * bs
                     + torch.arange(width * bs, device=device)[None])  # [Bs, T]
        lens_t = torch.tensor(lens, device=device)[:, None]  # [Bs, 1]
        visible = positions < lens_t
        if window is not None:
            visible = visible & (positions >= lens_t - window)
        # unused table entries (-1) point at block 0: finite values (the pool starts at zero), masked out
        slots = (table.clamp(min=0)[:, :, None] * bs + torch.arange(bs, device=device)).flatten(1)  # [Bs, T]
        # rows of the pool seen as [slots x nkv, hs], in the order [Bs, nkv, T]: one index_select then gives keys laid
        # out as the matmuls read them fastest (contiguous per sequence and head)
        rows = (slots[:, None, :] * nkv + torch.arange(nkv, device=device)[None, :, None]).flatten()
        # an additive float mask, made once: a bool one would be converted at every call (every layer)
        bias = torch.zeros(visible.shape, device=device, dtype=dtype).masked_fill_(~visible, float("-inf"))
        plan = dict(rows=rows, bias=bias[:, None, None, :], prefix=None)
        if prefix:
            n_max, K = max(len(m) for m, _ in prefix), max(k for _, k in prefix)
            B = len(singles)
            # the groups' shared blocks, padded to K blocks with the spare block (masked out)
            prefix_slots = torch.tensor([[singles[m[0]].seq.tables[g][j] * bs + o if j < k else spare_slot
                                          for j in range(K) for o in range(bs)] for m, k in prefix],
                                        dtype=torch.long, device=device)  # [Gc, K bs]
            prefix_rows = (prefix_slots[:, None, :] * nkv + torch.arange(nkv, device=device)[None, :, None]).flatten()
            prefix_visible = torch.tensor([[j < k * bs for j in range(K * bs)] for _, k in prefix], device=device)
            prefix_bias = torch.zeros(prefix_visible.shape, device=device, dtype=dtype)
            prefix_bias = prefix_bias.masked_fill_(~prefix_visible, float("-inf"))[:, None, None, :]  # [Gc, 1, 1, K bs]
            # the queries of group j in rows j n_max .. j n_max + n_max - 1 (index B: a zero query, padding)
            query_index = torch.tensor([m[i] if i < len(m) else B for m, _ in prefix for i in range(n_max)],
                                       dtype=torch.long, device=device)  # [Gc n_max]
            # where each sequence's share of its group's result is (row Gc n_max: "none", a sequence in no group)
            back = [len(prefix) * n_max] * B
            for j, (members, _) in enumerate(prefix):
                for i, member in enumerate(members):
                    back[member] = j * n_max + i
            plan["prefix"] = (prefix_rows, prefix_bias, query_index, torch.tensor(back, device=device), n_max)
        return plan

    @staticmethod
    def prefill_batch(multi, g, layout: PoolLayout):
        """The chunks of more than one token, as one batch for SDPA: (query rows [Bp Tmax] of the flat batch (0 on
        padding), which are real [Bp Tmax] bool, their flat rows [n real], key rows [Bp nkv Smax] of the pool seen
        as [slots x nkv, hs], a mask [Bp, 1, Tmax, Smax] or None for one chunk that is causal from position 0)."""
        window, bs, nkv = layout.windows[g], layout.block_size, layout.n_kv_heads
        spare_slot, device, dtype = layout.n_blocks[g] * bs, layout.device, layout.dtype
        first = [0 if window is None else max(0, c.start + 1 - window) // bs for c, _ in multi]  # first block seen
        keys = [[c.seq.tables[g][p // bs] * bs + p % bs for p in range(f * bs, c.start + c.length)]
                for (c, _), f in zip(multi, first)]  # [S_c] slots each
        T, S = max(c.length for c, _ in multi), max(map(len, keys))
        query_rows = [[start + i if i < c.length else 0 for i in range(T)] for c, start in multi]
        key_slots = torch.tensor([k + [spare_slot] * (S - len(k)) for k in keys], dtype=torch.long, device=device)
        key_rows = (key_slots[:, None, :] * nkv + torch.arange(nkv, device=device)[None, :, None]).flatten()
        real = torch.tensor([[i < c.length for i in range(T)] for c, _ in multi], device=device)  # [Bp, T]
        if all(c.start == 0 for c, _ in multi) and (window is None or window >= T):
            # every chunk starts its sequence: query i sees keys 0..i, which causal attention gives (a padding key
            # j >= T_c is seen only by padding queries i >= j, whose output is never read)
            mask = None
        else:
            q_pos = torch.tensor([c.start for c, _ in multi], device=device)[:, None] + torch.arange(T, device=device)
            k_pos = torch.tensor([f * bs for f in first], device=device)[:, None] + torch.arange(S, device=device)
            k_real = torch.arange(S, device=device)[None, :] < torch.tensor(list(map(len, keys)), device=device)[:, None]
            allowed = (k_pos[:, None, :] <= q_pos[:, :, None]) & k_real[:, None, :]  # [Bp, T, S]
            if window is not None:
                allowed = allowed & (k_pos[:, None, :] > q_pos[:, :, None] - window)
            allowed[:, :, 0] |= ~real  # a padding query sees one key: a finite softmax, never read
            mask = torch.zeros(allowed.shape, device=device, dtype=dtype).masked_fill_(~allowed, float("-inf"))[:, None]
        query_rows = torch.tensor(query_rows, dtype=torch.long, device=device).flatten()
        return query_rows, real.flatten(), query_rows[real.flatten()], key_rows, mask

    def last_rows(self, chunks) -> torch.Tensor:
        """Flat indices of the last token of each of `chunks` (whose logits give their next token)."""
        where = {id(c): s + c.length - 1 for c, s in zip(self.chunks, self.starts)}
        return torch.tensor([where[id(c)] for c in chunks], dtype=torch.long, device=self.input_ids.device)

    def attend(self, layer_pools, layer, q, k, v):
        """Layer `layer`'s attention for the flat batch: store k, v [N, nkv, hs] in its pool (layer_pools[layer]),
        then attend each sequence's queries q [N, nh, hs] over its cached keys. -> [N, nh, hs]."""
        g, pool = self.group_of[layer], layer_pools[layer]
        k_pool, v_pool = pool.k, pool.v  # [blocks, block_size, nkv, hs]
        nkv, hs = k_pool.shape[2], k_pool.shape[3]
        with profiled("engine.cache_write"):
            # (k and v differ from the pool's dtype under autocast; a same-dtype cast is still a dispatched op)
            k = k if k.dtype == k_pool.dtype else k.to(k_pool.dtype)
            v = v if v.dtype == v_pool.dtype else v.to(v_pool.dtype)
            pool.k_slots.index_copy_(0, self.slots[g], k)
            pool.v_slots.index_copy_(0, self.slots[g], v)
            for source, destination, n_slots in self.copies[g]:  # copy-on-write, after the source's own writes
                k_pool[destination, :n_slots] = k_pool[source, :n_slots]
                v_pool[destination, :n_slots] = v_pool[source, :n_slots]
        with profiled("engine.attention"):
            # attention runs in the cache's dtype (float32 under CPU autocast)
            q_cache = q if q.dtype == k_pool.dtype else q.to(k_pool.dtype)
            if self.n_single == len(q) and not self.triton:
                # decode only, no padding rows (most CPU steps): the gathered attention's output is the output
                return self.gathered_singles(g, q_cache, pool)
            out = torch.empty_like(q_cache)  # [N + pad, nh, hs]; Attention casts it back to q's dtype
            out[self.n_tokens :] = 0  # the padding rows' (never read)
            if self.n_single and self.triton:
                out[: self.n_single] = paged_decode_attention(q_cache[: self.n_single], k_pool, v_pool, self.tables[g],
                                                              self.seq_lens, self.windows[g])
            elif self.n_single:
                out[: self.n_single] = self.gathered_singles(g, q_cache[: self.n_single], pool)
            if self.prefills[g] is not None:  # every chunk of several tokens in one SDPA call
                query_rows, real, out_rows, key_rows, mask = self.prefills[g]
                nh = q.shape[1]
                queries = q_cache.index_select(0, query_rows).view(-1, self.prefill_len, nh, hs).transpose(1, 2)
                Bp = queries.shape[0]  # [Bp, nh, Tmax, hs]
                keys_k = self.gather(pool.k_rows, key_rows, "prefill_k", g, Bp, nkv, hs)  # [Bp, nkv, Smax, hs]
                keys_v = self.gather(pool.v_rows, key_rows, "prefill_v", g, Bp, nkv, hs)
                y = attention(queries, keys_k, keys_v, mask, is_causal=mask is None)  # [Bp, nh, Tmax, hs]
                out.index_copy_(0, out_rows, y.transpose(1, 2).reshape(-1, nh, hs)[real].to(out.dtype))
        return out

    def gathered_singles(self, g, q, pool):
        """The one-token sequences' attention on the CPU (decode_plan): gather each sequence's visible keys and values
        (from its first block that no group shares; a few sequences at a time when they would not stay in the CPU's
        caches: gathered_in_chunks), two batched matmuls; where groups of sequences share prompt
        blocks, those are gathered once per group and attended by the group's queries together, and the two parts
        merge by their log-sum-exp (as flash-decoding merges its splits). q [Bs, nh, hs] -> [Bs, nh, hs]."""
        (B, nh, hs), nkv = q.shape, pool.k.shape[2]
        plan, G = self.single_plans[g], nh // nkv
        queries = q.view(B, nkv, G, hs)  # [Bs, nkv, G, hs]: a kv head's query heads as rows
        T = len(plan["rows"]) // (B * nkv)
        key_bytes = nkv * T * hs * pool.k.element_size()  # one sequence's gathered keys (as many for its values)
        at_once = (self.gather_chunk_bytes is None or q.device.type != "cpu"  # (a GPU on the torch backend)
                   or 2 * B * key_bytes <= self.gather_at_once_bytes)
        chunk = B if at_once else max(1, self.gather_chunk_bytes // key_bytes)
        # each sequence's own keys (all of them, or those after its group's shared blocks): attended whole
        # (gathered_decode_attention), or unnormalised, to be merged with the shared part (partial_attention)
        attend_own = gathered_decode_attention if plan["prefix"] is None else partial_attention
        with torch.autocast(q.device.type, enabled=False) if self.autocast else nullcontext():
            if chunk < B:  # a few sequences at a time, in buffers that stay in the CPU's caches
                own = self.gathered_in_chunks(g, queries, pool, chunk, attend_own)
            else:
                keys_k = self.gather(pool.k_rows, plan["rows"], "k", g, B, nkv, hs)  # [Bs, nkv, T, hs]
                keys_v = self.gather(pool.v_rows, plan["rows"], "v", g, B, nkv, hs)
                own = attend_own(queries, keys_k, keys_v, plan["bias"])
            if plan["prefix"] is None:
                return own.view(B, nh, hs)
            rows, bias, query_index, back, n_max = plan["prefix"]
            Gc = bias.shape[0]
            own_out, own_max, own_sum = own  # [Bs, nkv, G, hs | 1]
            group_q = torch.cat([queries, queries.new_zeros(1, nkv, G, hs)]).index_select(0, query_index)
            group_q = group_q.view(Gc, n_max, nkv, G, hs).transpose(1, 2).reshape(Gc, nkv, n_max * G, hs)
            prefix_k = self.gather(pool.k_rows, rows, "prefix_k", g, Gc, nkv, hs)  # [Gc, nkv, K bs, hs]
            prefix_v = self.gather(pool.v_rows, rows, "prefix_v", g, Gc, nkv, hs)
            shared = partial_attention(group_q, prefix_k, prefix_v, bias)  # [Gc, nkv, n_max G, hs | 1]
            none = (0.0, float("-inf"), 0.0)  # a sequence in no group: nothing from the shared part
            shared_out, shared_max, shared_sum = (
                torch.cat([x.view(Gc, nkv, n_max, G, -1).transpose(1, 2).reshape(Gc * n_max, nkv, G, -1),
                           x.new_full((1, nkv, G, x.shape[-1]), fill)]).index_select(0, back)
                for x, fill in zip(shared, none))  # [Bs, nkv, G, hs | 1]
            m = torch.maximum(own_max, shared_max)
            a_own, a_shared = (own_max - m).exp_(), (shared_max - m).exp_()
            out = (own_out * a_own + shared_out * a_shared) / (own_sum * a_own + shared_sum * a_shared)
        return out.view(B, nh, hs)

    def gathered_in_chunks(self, g, queries, pool, chunk, attend):
        """attend(queries, keys, values, bias) for `chunk` sequences at a time (the rest last): each chunk's keys and
        values gathered into the front of two scratch buffers and attended before the next chunk overwrites them, so
        the buffers (gather_chunk_bytes each) stay in the CPU's caches; each sequence's matmuls are those of the whole
        batch. queries [Bs, nkv, G, hs] -> attend's result for all Bs sequences (a tensor, or a tuple of them). The
        caller turns autocast off (gathered_singles)."""
        plan, (B, nkv, G, hs) = self.single_plans[g], queries.shape
        rows, bias = plan["rows"], plan["bias"]
        per_sequence = len(rows) // B  # rows of one sequence: nkv T
        k_buf = self.scratch.take("chunk_k", (chunk * per_sequence, hs), pool.k_rows.dtype, pool.k_rows.device)
        v_buf = self.scratch.take("chunk_v", (chunk * per_sequence, hs), pool.v_rows.dtype, pool.v_rows.device)
        outs = None
        for first in range(0, B, chunk):
            n = min(chunk, B - first)
            part = rows[first * per_sequence : (first + n) * per_sequence]
            keys_k = torch.index_select(pool.k_rows, 0, part, out=k_buf[: n * per_sequence]).view(n, nkv, -1, hs)
            keys_v = torch.index_select(pool.v_rows, 0, part, out=v_buf[: n * per_sequence]).view(n, nkv, -1, hs)
            result = attend(queries[first : first + n], keys_k, keys_v, bias[first : first + n])
            parts = result if isinstance(result, tuple) else (result,)
            if outs is None:
                outs = [x.new_empty((B,) + x.shape[1:]) for x in parts]
            for out, x in zip(outs, parts):
                out[first : first + n] = x
        return tuple(outs) if isinstance(result, tuple) else outs[0]

    def gather(self, pool_rows, rows, name, g, B, nkv, hs):
        """The rows `rows` of a pool seen as [slots x nkv, hs] (LayerPool) into scratch buffer `name`, as
        [B, nkv, T, hs]. The buffer's views are made once a step for each layer group (every layer of a group
        gathers the same number of rows)."""
        views = self.views.get((name, g))
        if views is None:
            out = self.scratch.take(name, (len(rows), hs), pool_rows.dtype, pool_rows.device)
            views = self.views[name, g] = (out, out.view(B, nkv, -1, hs))
        torch.index_select(pool_rows, 0, rows, out=views[0])
        return views[1]
