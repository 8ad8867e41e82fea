"""Decode attention on the CPU over a paged KV pool, five ways, at one shape (default: Qwen3-0.6B's heads,
64 sequences x 160 positions, blocks of 16 in a shuffled pool), in ms per layer:

    python bench/decode_attention_cpu.py                      # 2 threads, one layer
    python bench/decode_attention_cpu.py --threads 1 --seqs 64 --positions 160 --kv-heads 8 --group 2 --head-dim 128
    python bench/decode_attention_cpu.py --layers 30 --kv-heads 3 --group 3 --head-dim 64   # SmolLM2-135M's step

--layers N: N layers, each with a pool of its own, attended one after another as a decode step does (ms per
layer): with one layer the same pool is read every call and what fits stays in the CPU's caches; with a model's
layers (SmolLM2-135M: 30) the pools come from memory, as in the engine.

  padded            the keys already contiguous per sequence (a padded cache, as ppo_core.generate holds it): two
                    batched matmuls, the floor for the others
  gather, new       index_select of every visible key and value row into a fresh tensor, then the two matmuls
                    (the engine's CPU decode before engine.Scratch)
  gather, reused    the same into buffers allocated once (engine.Scratch: the engine's CPU decode while a step's keys
                    and values come to at most GATHER_AT_ONCE_BYTES a layer)
  gather, chunks    the same a few sequences at a time, into buffers of at most --chunk-bytes (default: the engine's
                    GATHER_CHUNK_BYTES), each chunk attended before the next is gathered (the engine's CPU decode
                    beyond GATHER_AT_ONCE_BYTES: StepBatch.gathered_in_chunks)
  blocks in place   no gather: the pool in a head-major layout [blocks, kv heads, block, head_dim], each block's
                    scores against its sequence's queries (the queries gathered to the blocks), a softmax per block,
                    then the blocks of each sequence merged in table order (a segmented softmax, as flash-decoding
                    merges its splits); not in the engine

Every way is checked against a float64 reference first. The rows are medians of --repeats calls after one warm-up.

    python bench/decode_attention_cpu.py --shared      # GRPO groups: workload C's shape at SmolLM2-135M's heads

--shared: --groups groups of --group-size sequences, each group sharing its first --prefix positions (whole blocks)
and every sequence --positions more of its own, two ways:
  gathered          every sequence's keys gathered (the shared ones once per sequence), two batched matmuls
  shared once       the engine's way (ppo_core.engine.rollout_engine.partial_attention): the shared blocks gathered once per group
                    and attended by the group's queries as rows of one matmul, each sequence's own keys as above,
                    the two parts merged by log-sum-exp
"""
import argparse
import os
import statistics
import sys
import time

import torch


def timed(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--positions", type=int, default=160)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--group", type=int, default=2, help="query heads per kv head")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--layers", type=int, default=1, help="layers attended one after another, each its own pool")
    ap.add_argument("--chunk-bytes", type=int, default=None,
                    help="'gather, chunks': bytes of keys gathered at a time (default: ppo_core.engine's)")
    ap.add_argument("--shared", action="store_true", help="groups sharing a prompt's blocks (see the docstring)")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prefix", type=int, default=256, help="--shared: positions each group shares")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.chunk_bytes is None:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
        from ppo_core.engine.rollout_engine import GATHER_CHUNK_BYTES

        args.chunk_bytes = GATHER_CHUNK_BYTES
    if args.shared:
        return shared_prefix(args)
    S, L, nkv, G, hs, bs = args.seqs, args.positions, args.kv_heads, args.group, args.head_dim, args.block_size
    N = args.layers
    width = -(-L // bs)  # blocks per sequence
    T = width * bs
    n_blocks = S * width + 50  # a few blocks free
    # one pool per layer, in the engine's layout [blocks, block_size, nkv, hs]
    k_pools = [torch.randn(n_blocks, bs, nkv, hs) for _ in range(N)]
    v_pools = [torch.randn(n_blocks, bs, nkv, hs) for _ in range(N)]
    tables = torch.randperm(n_blocks)[: S * width].view(S, width)  # [S, width] shuffled, as a long-running pool is
    q = torch.randn(S, nkv, G, hs)
    visible = torch.arange(T)[None, :] < L  # [1, T]
    bias = torch.zeros(S, 1, 1, T).masked_fill_(~visible[:, None, None, :], float("-inf"))
    scale = hs ** -0.5

    slots = (tables[:, :, None] * bs + torch.arange(bs)).flatten(1)  # [S, T]
    rows = (slots[:, None, :] * nkv + torch.arange(nkv)[None, :, None]).flatten()  # [S nkv T] rows of [slots nkv, hs]
    k_ref = k_pools[0].view(-1, hs)[rows].view(S, nkv, T, hs).double()  # every way is checked on layer 0
    v_ref = v_pools[0].view(-1, hs)[rows].view(S, nkv, T, hs).double()
    reference = torch.softmax((q.double() @ k_ref.transpose(-1, -2)) * scale + bias.double(), -1) @ v_ref

    def two_matmuls(keys, values, q=q, bias=bias):
        scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(scale).add_(bias)  # [S, nkv, G, T]
        return torch.matmul(scores.softmax(-1), values)  # [S, nkv, G, hs]

    k_padded = [k.view(-1, hs)[rows].view(S, nkv, T, hs) for k in k_pools]
    v_padded = [v.view(-1, hs)[rows].view(S, nkv, T, hs) for v in v_pools]

    def padded(i):
        return two_matmuls(k_padded[i], v_padded[i])

    def gather_new(i):
        keys = k_pools[i].view(-1, hs).index_select(0, rows).view(S, nkv, T, hs)
        values = v_pools[i].view(-1, hs).index_select(0, rows).view(S, nkv, T, hs)
        return two_matmuls(keys, values)

    k_buf, v_buf = torch.empty(len(rows), hs), torch.empty(len(rows), hs)

    def gather_reused(i):
        torch.index_select(k_pools[i].view(-1, hs), 0, rows, out=k_buf)
        torch.index_select(v_pools[i].view(-1, hs), 0, rows, out=v_buf)
        return two_matmuls(k_buf.view(S, nkv, T, hs), v_buf.view(S, nkv, T, hs))

    per_sequence = nkv * T  # pool rows each sequence gathers
    chunk = min(S, max(1, args.chunk_bytes // (per_sequence * hs * 4)))  # sequences per gather, as the engine chooses

    def gather_chunks(i):
        out = torch.empty_like(q)
        for first in range(0, S, chunk):
            n = min(chunk, S - first)
            part = rows[first * per_sequence : (first + n) * per_sequence]
            keys = torch.index_select(k_pools[i].view(-1, hs), 0, part, out=k_buf[: n * per_sequence])
            values = torch.index_select(v_pools[i].view(-1, hs), 0, part, out=v_buf[: n * per_sequence])
            out[first : first + n] = two_matmuls(keys.view(n, nkv, T, hs), values.view(n, nkv, T, hs),
                                                 q[first : first + n], bias[first : first + n])
        return out

    # blocks in place: a head-major copy of the pool (the layout this way would need), blocks 0..used-1 computed
    k_heads = [k.transpose(1, 2).contiguous() for k in k_pools]  # [blocks, nkv, bs, hs]
    v_heads = [v.transpose(1, 2).contiguous() for v in v_pools]
    used = int(tables.max()) + 1
    owner = torch.full((used,), S, dtype=torch.long)  # the sequence reading each block; S = none (a zero query)
    owner[tables.flatten()] = torch.arange(S).repeat_interleave(width)
    block_bias = torch.zeros(used, 1, 1, bs)
    block_bias[owner == S] = float("-inf")
    tail = L - (width - 1) * bs  # positions in each sequence's last block
    block_bias[tables[:, -1], :, :, tail:] = float("-inf")
    q_padded = torch.cat([q, q.new_zeros(1, nkv, G, hs)])  # [S + 1, nkv, G, hs]
    pairs = tables.flatten()  # each sequence's blocks in table order

    def blocks_in_place(i):
        queries = q_padded.index_select(0, owner)  # [used, nkv, G, hs]
        scores = torch.matmul(queries, k_heads[i][:used].transpose(-1, -2)).mul_(scale).add_(block_bias)  # [.., G, bs]
        m = scores.amax(-1, keepdim=True).clamp_(min=-1e30)  # [used, nkv, G, 1]
        p = (scores - m).exp_()
        l = p.sum(-1, keepdim=True)
        o = torch.matmul(p, v_heads[i][:used])  # [used, nkv, G, hs]
        m_s = m.index_select(0, pairs).view(S, width, nkv, G, 1)
        l_s = l.index_select(0, pairs).view(S, width, nkv, G, 1)
        o_s = o.index_select(0, pairs).view(S, width, nkv, G, hs)
        w = (m_s - m_s.amax(1, keepdim=True)).exp_()
        return (o_s * w).sum(1) / (l_s * w).sum(1)

    ways = [("padded", padded), ("gather, new", gather_new), ("gather, reused", gather_reused),
            (f"gather, chunks of {chunk}", gather_chunks), ("blocks in place", blocks_in_place)]
    kv_mb = 2 * S * L * nkv * hs * 4 / 1e6
    per_layer = [(name, (lambda way: lambda: [way(i) for i in range(N)])(way), (lambda way: lambda: way(0))(way))
                 for name, way in ways]
    check_and_time(per_layer, reference, args.repeats,
                   f"decode attention, {N} layer(s) one after another, ms per layer: {S} sequences x {L} positions, "
                   f"{nkv} kv heads x {G} queries of {hs}, blocks of {bs} ({kv_mb:.1f} MB of keys and values visible "
                   f"a layer), chunks of at most {args.chunk_bytes / 2**20:.2f} MiB of keys, float32, {args.threads} "
                   f"threads, torch {torch.__version__}", per=N)


def check_and_time(ways, reference, repeats, title, per=1):
    """Check every (name, fn[, check]) of `ways` against the float64 reference (check(), or fn()), then print the
    table of their times (fn's, / per), each against the first way's."""
    for name, fn, *check in ways:
        err = ((check[0] if check else fn)().double() - reference).abs().max().item()
        assert err < 1e-4, (name, err)
    print(title)
    print(f"| way | ms / layer | vs {ways[0][0]} |")
    print("|---|---:|---:|")
    floor = None
    for name, fn, *_ in ways:
        ms = timed(fn, repeats) / per
        floor = floor or ms
        print(f"| {name} | {ms:.2f} | {ms / floor:.2f}x |", flush=True)


def shared_prefix(args):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from ppo_core.engine.rollout_engine import partial_attention

    n_groups, n, P, own = args.groups, args.group_size, args.prefix, args.positions
    nkv, G, hs, bs = args.kv_heads, args.group, args.head_dim, args.block_size
    assert P % bs == 0, "--prefix must be whole blocks"
    S, pw, ow = n_groups * n, P // bs, -(-own // bs)
    n_blocks = n_groups * pw + S * ow + 10
    k_pool, v_pool = torch.randn(n_blocks, bs, nkv, hs), torch.randn(n_blocks, bs, nkv, hs)
    perm = torch.randperm(n_blocks)
    shared = perm[: n_groups * pw].view(n_groups, pw)  # [groups, pw]
    owned = perm[n_groups * pw : n_groups * pw + S * ow].view(S, ow)  # [S, ow]
    tables = torch.cat([shared.repeat_interleave(n, 0), owned], 1)  # [S, pw + ow], a group's rows adjacent
    q = torch.randn(S, nkv, G, hs)

    def rows_of(table):  # rows of the pool seen as [slots x nkv, hs], in the order [rows, nkv, positions]
        slots = (table[:, :, None] * bs + torch.arange(bs)).flatten(1)
        return (slots[:, None, :] * nkv + torch.arange(nkv)[None, :, None]).flatten()

    def bias_of(visible):  # [rows, T] bool -> [rows, 1, 1, T]
        return torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))[:, None, None, :]

    T, To = tables.shape[1] * bs, ow * bs
    rows_all, rows_shared, rows_own = rows_of(tables), rows_of(shared), rows_of(owned)
    bias_all = bias_of((torch.arange(T) < P + own)[None].expand(S, T))
    bias_own = bias_of((torch.arange(To) < own)[None].expand(S, To))
    bias_shared = torch.zeros(n_groups, 1, 1, P)
    buffers = {name: torch.empty(len(r), hs) for name, r in
               [("k", rows_all), ("v", rows_all), ("sk", rows_shared), ("sv", rows_shared), ("ok", rows_own),
                ("ov", rows_own)]}

    def gather(pool, rows, name, shape):
        return torch.index_select(pool.view(-1, hs), 0, rows, out=buffers[name]).view(shape)

    def gathered():
        k = gather(k_pool, rows_all, "k", (S, nkv, T, hs))
        v = gather(v_pool, rows_all, "v", (S, nkv, T, hs))
        scores = torch.matmul(q, k.transpose(-1, -2)).mul_(hs ** -0.5).add_(bias_all)
        return torch.matmul(scores.softmax(-1), v)

    def shared_once():
        k = gather(k_pool, rows_own, "ok", (S, nkv, To, hs))
        v = gather(v_pool, rows_own, "ov", (S, nkv, To, hs))
        o2, m2, l2 = partial_attention(q, k, v, bias_own)
        qg = q.view(n_groups, n, nkv, G, hs).transpose(1, 2).reshape(n_groups, nkv, n * G, hs)
        k = gather(k_pool, rows_shared, "sk", (n_groups, nkv, P, hs))
        v = gather(v_pool, rows_shared, "sv", (n_groups, nkv, P, hs))
        o1, m1, l1 = (x.view(n_groups, nkv, n, G, -1).transpose(1, 2).reshape(S, nkv, G, -1)
                      for x in partial_attention(qg, k, v, bias_shared))
        m = torch.maximum(m1, m2)
        a1, a2 = (m1 - m).exp_(), (m2 - m).exp_()
        return (o1 * a1 + o2 * a2) / (l1 * a1 + l2 * a2)

    k_ref = k_pool.view(-1, hs)[rows_all].view(S, nkv, T, hs).double()
    v_ref = v_pool.view(-1, hs)[rows_all].view(S, nkv, T, hs).double()
    reference = torch.softmax((q.double() @ k_ref.transpose(-1, -2)) * hs ** -0.5 + bias_all.double(), -1) @ v_ref
    check_and_time([("gathered", gathered), ("shared once", shared_once)], reference, args.repeats,
                   f"decode attention, one layer: {n_groups} groups x {n} sequences, {P} shared positions + {own} own, "
                   f"{nkv} kv heads x {G} queries of {hs}, blocks of {bs}, float32, {args.threads} threads, "
                   f"torch {torch.__version__}")


if __name__ == "__main__":
    main()
