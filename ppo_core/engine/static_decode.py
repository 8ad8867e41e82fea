"""The rollout engine's decode-only steps on fixed-shape buffers, and their CUDA graphs (one per batch bucket).

    static = StaticDecode(model, pools, layout, max_rows=64, max_len=1024, cuda_graphs=True)  # a PoolLayout
    if static.takes(step):             # every chunk one token, no copy-on-write, at most the buffers' rows
        logits = static.run(step)      # [n chunks, V] float32, row i = chunk i's next-token logits

Most steps of a rollout (ppo_core.engine) compute one token for every running sequence and nothing else. Such a
step differs from the next in values only (token ids, positions, where the keys go, block tables, lengths), not in
shapes, once
  - its rows are padded to a bucket: 1, 2, 4, ..., the first power of two >= the call's most running sequences
    (`decode_bucket`). A padding row is token 0 at position 0; it writes its key and value to the pool's spare block
    (the last block of each group's pool, never handed out) and sees that one key (length 1); its logits are never
    read. Few buckets, so few graphs per call, for at most 2x the rows: a decode step's matmuls read every weight
    once whatever the rows, up to a hundred or so;
  - its block tables are padded to one width for the call, W = ceil(longest sequence / block_size), the most blocks
    any of its sequences can hold (the kernel reads a row's entries below ceil(length / block_size) only: the
    others may hold anything, -1 or a block number from an earlier step);
  - RoPE's table covers the call's longest sequence from the first such step on (it is never regrown in the call).
Each step copies its values into preallocated buffers (two host-to-device copies), then the forward and the LM head
run over the buffers' first `bucket` rows and write the logits into a fixed buffer [rows, V] float32.

What runs where:
  - CUDA with the Triton backend, cuda_graphs=True (RolloutEngine's default there): the first step of each bucket
    in a generate call runs the step GRAPH_WARMUP times eagerly on a side stream (Triton's JIT, cuBLAS's handles,
    autocast's cast cache, the RoPE table: nothing is created during capture), captures it as a CUDA graph into a
    memory pool that the call's graphs share, then replays it; later steps of the bucket copy their values and
    replay. The paged decode kernel's launch (grid (B, n_kv_heads, num_splits), num_splits =
    default_num_splits(B, n_kv_heads, W, sm_count); window, scale) is a function of the bucket, W, the layer group
    and the GPU only, so one captured launch serves every step of the bucket.
  - Everywhere else (the CPU, cuda_graphs=False, PPO_KERNELS_BACKEND=torch): the same buffers and shapes, run eagerly,
    the attention on the kernel's torch reference (PPO_KERNELS_BACKEND=triton: the kernel, in Triton's interpreter
    off the GPU). The CPU tests compare this with the engine's dynamic step; the GPU tier compares the graphs with
    it.
  - No graphs (`graphs_unavailable` says why; the engine runs its dynamic steps): an FSDP-sharded model (FSDP's
    forward hooks synchronise its own streams with the current one, which a capture would have to join) and the
    torch backend on CUDA (the reference reads the lengths on the host).

Lifetime: one generate call, as the KV pool's. The graphs read the pool, the buffers and the weights by address, and
under autocast the bf16 copies of the weights that autocast caches for its region (generate.CUDAGraphStep explains
the cast cache); the pool is freed when the call returns (the update gets the memory back) and the caller's autocast
region may end then. So the buffers, graphs and their memory pool are made in the call and dropped with it: at
most one capture per bucket per call. Capture happens in the call's own contexts (no_grad, the caller's autocast
region, FSDP's gathered weights where they apply, LoRA adapters as they are set), as the eager step runs.
"""
import time
import warnings
from contextlib import nullcontext

import torch
from torch.profiler import record_function

from ppo_kernels import backend
from ppo_kernels.paged_attention import paged_decode_attention, paged_decode_attention_reference

from ..models.distributed import is_sharded

GRAPH_WARMUP = 2
"""Eager runs of a bucket's step on a side stream before its capture: nothing may be created lazily during a capture
(torch.cuda.graphs); the first run creates it, the second runs on what the first created, as torch's examples do."""


def profiled(name):
    """record_function(name) while a profiler runs (bench/rollout.py --profile breaks a step down by these ranges),
    else nothing: the range itself costs about 12 us, twice per layer, when nothing records it (the engine's steps
    use it too)."""
    return record_function(name) if torch.autograd._profiler_enabled() else nullcontext()


def decode_bucket(n: int) -> int:
    """The rows a decode-only step of n sequences runs with: the first power of two >= n."""
    return 1 << (n - 1).bit_length()


def decode_only(step) -> bool:
    """Whether a step (ppo_core.engine.scheduler.Step) takes the static path: every chunk is one token and no block is
    copied (copy-on-write runs before attention, in the dynamic step only)."""
    return all(c.length == 1 for c in step.chunks) and not any(step.copies)


def graphs_unavailable(model, device, cuda_graphs: bool):
    """Why a generate call on `device` cannot replay its decode steps as CUDA graphs, or None if it can."""
    if not cuda_graphs:
        return "cuda_graphs=False"
    if device.type != "cuda":
        return f"not on CUDA ({device.type})"
    if backend(device) != "triton":
        return "PPO_KERNELS_BACKEND=torch (the reference attention reads the lengths on the host)"
    if is_sharded(model):
        return "an FSDP-sharded model (its hooks synchronise other streams)"
    return None


class StaticDecode:
    """The buffers of one generate call's decode-only steps, the step over them, and (cuda_graphs) its graphs.

    pools: per layer group (keys, values) [L_g, blocks + 1, block_size, nkv, hs] (the engine's; the last block is the
    spare); layout: the call's ppo_core.engine.rollout_engine.PoolLayout (its layer groups, block_size, n_blocks: per
    group the blocks handed out, the spare block's number; its device); max_rows: the most sequences a step usually holds (a step of more, which resumed
    multi-turn episodes can make, runs dynamically); max_len: the longest sequence of the call. `stats`:
    static_steps (steps run here), graph_captures, graph_replays, graph_capture_s (warm-up and capture, seconds)."""

    def __init__(self, model, pools, layout, max_rows, max_len, cuda_graphs):
        self.model, self.pools, self.device = model, pools, layout.device
        self.windows, self.group_of, self.index_in_group = layout.windows, layout.group_of, layout.index_in_group
        self.block_size, self.spare, self.max_len = layout.block_size, list(layout.n_blocks), max_len
        windows, block_size, device = layout.windows, layout.block_size, layout.device
        self.width = -(-max_len // block_size)  # W
        self.rows = rows = decode_bucket(max_rows)  # R
        groups = len(windows)  # G
        # rows of one step: token ids, positions, lengths (position + 1), then each group's slot (block * block_size
        # + offset) where the token's key and value go
        self.step_rows = torch.zeros(3 + groups, rows, dtype=torch.long, device=device)  # [3 + G, R]
        self.tables = torch.full((groups, rows, self.width), -1, dtype=torch.int32, device=device)  # [G, R, W]
        self.logits = torch.zeros(rows, model.args.vocab_size, dtype=torch.float32, device=device)  # [R, V]
        self.attention = paged_decode_attention if backend(device) == "triton" else paged_decode_attention_reference
        self.cuda_graphs = cuda_graphs
        self.failure = None  # why a capture failed (the call then runs its steps here eagerly)
        self.graphs = {}  # bucket -> torch.cuda.CUDAGraph
        self.graph_pool = torch.cuda.graph_pool_handle() if cuda_graphs else None
        self.rope_tables = []  # the RoPE tables the graphs read, kept alive with them
        self.stats = dict(static_steps=0, graph_captures=0, graph_replays=0, graph_capture_s=0.0)

    def takes(self, step) -> bool:
        """Whether the step runs here: decode-only, and no more sequences than the buffers' rows."""
        return decode_only(step) and len(step.chunks) <= self.rows

    def load(self, step) -> int:
        """Copy the step's values into the buffers' first rows -> the bucket B (rows n..B-1: padding)."""
        chunks, bs = step.chunks, self.block_size
        n = len(chunks)
        B = decode_bucket(n)
        pad = B - n
        ids = [c.seq.tokens[c.start] for c in chunks] + [0] * pad
        positions = [c.start for c in chunks] + [0] * pad
        lengths = [c.start + 1 for c in chunks] + [1] * pad
        slots = [[c.seq.tables[g][c.start // bs] * bs + c.start % bs for c in chunks] + [spare * bs] * pad
                 for g, spare in enumerate(self.spare)]
        self.step_rows[:, :B].copy_(torch.tensor([ids, positions, lengths, *slots], dtype=torch.long))  # [3 + G, B]
        # only the first w columns are written: the kernel never reads a row's entries past its length
        w = max(len(table) for c in chunks for table in c.seq.tables)
        if w > self.width:
            raise RuntimeError(f"StaticDecode: a block table of {w} blocks, wider than the call's {self.width}")
        tables = [[c.seq.tables[g] + [-1] * (w - len(c.seq.tables[g])) for c in chunks]
                  + [[spare] + [-1] * (w - 1)] * pad for g, spare in enumerate(self.spare)]  # a padding row sees the spare
        self.tables[:, :B, :w].copy_(torch.tensor(tables, dtype=torch.int32))  # [G, B, w]
        return B

    def forward(self, B):
        """The step over the buffers' first B rows: keys and values into the pools, logits into self.logits[:B].
        Fixed shapes for a given B, no host synchronisation on the Triton backend: what a CUDA graph captures."""
        ids, positions = self.step_rows[0, :B], self.step_rows[1, :B]  # [B] each
        lengths = self.step_rows[2, :B].to(torch.int32)  # [B], once for every layer

        def attend(layer, q, k, v):  # q [B, nh, hs], k, v [B, nkv, hs] -> [B, nh, hs] (Attention.forward)
            g, i = self.group_of[layer], self.index_in_group[layer]
            k_pool, v_pool = self.pools[g][0][i], self.pools[g][1][i]  # [blocks + 1, block_size, nkv, hs]
            nkv, hs = k_pool.shape[2], k_pool.shape[3]
            with profiled("engine.cache_write"):
                k_pool.view(-1, nkv, hs).index_copy_(0, self.step_rows[3 + g, :B], k.to(k_pool.dtype))
                v_pool.view(-1, nkv, hs).index_copy_(0, self.step_rows[3 + g, :B], v.to(v_pool.dtype))
            with profiled("engine.attention"):  # in the cache's dtype, as the dynamic step attends
                return self.attention(q.to(k_pool.dtype), k_pool, v_pool, self.tables[g, :B], lengths, self.windows[g])

        hidden = self.model(ids, paged=(positions, attend, self.max_len), return_hidden=True)  # [B, H]
        self.logits[:B].copy_(self.model.lm_head(hidden))  # [B, V], to float32

    def run(self, step) -> torch.Tensor:
        """The step's logits [n chunks, V] float32 (a view of self.logits: read it before the next step)."""
        B = self.load(step)
        self.stats["static_steps"] += 1
        if self.cuda_graphs and B not in self.graphs:
            self.capture(B)
        if self.cuda_graphs:
            self.graphs[B].replay()
            self.stats["graph_replays"] += 1
        else:
            self.forward(B)
        return self.logits[: len(step.chunks)]

    def capture(self, B):
        """Warm bucket B's step up on a side stream, then capture it (torch.cuda.graphs' recipe). The warm-up runs
        compute this step (the replay that follows writes the same slots again). Should the capture fail (a forward
        that synchronises with the host, say), the call's steps run eagerly on the buffers from then on."""
        t0 = time.perf_counter()
        try:
            with torch.cuda.device(self.device):  # the streams below on the model's GPU, whichever is current
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())  # the buffers' copies first
                with torch.cuda.stream(side):
                    for _ in range(GRAPH_WARMUP):
                        self.forward(B)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                # thread_local: a thread of the caller's (a tool of a multi-turn episode) may use CUDA meanwhile
                with torch.cuda.graph(graph, pool=self.graph_pool, capture_error_mode="thread_local"):
                    self.forward(B)
        except RuntimeError as e:
            warnings.warn(f"RolloutEngine: capturing a decode step as a CUDA graph failed ({str(e).splitlines()[0]}); "
                          "this call's decode steps run eagerly")
            self.cuda_graphs = False
            self.failure = f"capture failed: {str(e).splitlines()[0]}"
            return
        self.graphs[B] = graph
        self.rope_tables.append(dict(self.model.model._rope_tables))  # what the graph reads, kept alive
        self.stats["graph_captures"] += 1
        self.stats["graph_capture_s"] += time.perf_counter() - t0
