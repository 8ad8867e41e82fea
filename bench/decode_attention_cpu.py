"""One layer's decode attention on the CPU over a paged KV pool, four ways, at one shape (default: Qwen3-0.6B's heads,
64 sequences x 160 positions, blocks of 16 in a shuffled pool), in ms per layer:

    python bench/decode_attention_cpu.py                      # 2 threads
    python bench/decode_attention_cpu.py --threads 1 --seqs 64 --positions 160 --kv-heads 8 --group 2 --head-dim 128

  padded            the keys already contiguous per sequence (a padded cache, as ppo_core.generate holds it): two
                    batched matmuls, the floor for the others
  gather, new       index_select of every visible key and value row into a fresh tensor, then the two matmuls
                    (the engine's CPU decode before engine.Scratch)
  gather, reused    the same into buffers allocated once (the engine's CPU decode now: engine.Scratch)
  blocks in place   no gather: the pool in a head-major layout [blocks, kv heads, block, head_dim], each block's
                    scores against its sequence's queries (the queries gathered to the blocks), a softmax per block,
                    then the blocks of each sequence merged in table order (a segmented softmax, as flash-decoding
                    merges its splits); not in the engine

Every way is checked against a float64 reference first. The rows are medians of --repeats calls after one warm-up.
"""
import argparse
import statistics
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
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    S, L, nkv, G, hs, bs = args.seqs, args.positions, args.kv_heads, args.group, args.head_dim, args.block_size
    width = -(-L // bs)  # blocks per sequence
    T = width * bs
    n_blocks = S * width + 50  # a few blocks free
    k_pool, v_pool = torch.randn(n_blocks, bs, nkv, hs), torch.randn(n_blocks, bs, nkv, hs)  # the engine's layout
    tables = torch.randperm(n_blocks)[: S * width].view(S, width)  # [S, width] shuffled, as a long-running pool is
    q = torch.randn(S, nkv, G, hs)
    visible = torch.arange(T)[None, :] < L  # [1, T]
    bias = torch.zeros(S, 1, 1, T).masked_fill_(~visible[:, None, None, :], float("-inf"))
    scale = hs ** -0.5

    slots = (tables[:, :, None] * bs + torch.arange(bs)).flatten(1)  # [S, T]
    rows = (slots[:, None, :] * nkv + torch.arange(nkv)[None, :, None]).flatten()  # [S nkv T] rows of [slots nkv, hs]
    k_ref = k_pool.view(-1, hs)[rows].view(S, nkv, T, hs).double()
    v_ref = v_pool.view(-1, hs)[rows].view(S, nkv, T, hs).double()
    reference = torch.softmax((q.double() @ k_ref.transpose(-1, -2)) * scale + bias.double(), -1) @ v_ref

    def two_matmuls(keys, values):
        scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(scale).add_(bias)  # [S, nkv, G, T]
        return torch.matmul(scores.softmax(-1), values)  # [S, nkv, G, hs]

    k_padded, v_padded = k_ref.float().contiguous(), v_ref.float().contiguous()

    def padded():
        return two_matmuls(k_padded, v_padded)

    def gather_new():
        keys = k_pool.view(-1, hs).index_select(0, rows).view(S, nkv, T, hs)
        values = v_pool.view(-1, hs).index_select(0, rows).view(S, nkv, T, hs)
        return two_matmuls(keys, values)

    k_buf, v_buf = torch.empty(len(rows), hs), torch.empty(len(rows), hs)

    def gather_reused():
        torch.index_select(k_pool.view(-1, hs), 0, rows, out=k_buf)
        torch.index_select(v_pool.view(-1, hs), 0, rows, out=v_buf)
        return two_matmuls(k_buf.view(S, nkv, T, hs), v_buf.view(S, nkv, T, hs))

    # blocks in place: a head-major copy of the pool (the layout this way would need), blocks 0..used-1 computed
    k_heads, v_heads = k_pool.transpose(1, 2).contiguous(), v_pool.transpose(1, 2).contiguous()  # [blocks, nkv, bs, hs]
    used = int(tables.max()) + 1
    owner = torch.full((used,), S, dtype=torch.long)  # the sequence reading each block; S = none (a zero query)
    owner[tables.flatten()] = torch.arange(S).repeat_interleave(width)
    block_bias = torch.zeros(used, 1, 1, bs)
    block_bias[owner == S] = float("-inf")
    tail = L - (width - 1) * bs  # positions in each sequence's last block
    block_bias[tables[:, -1], :, :, tail:] = float("-inf")
    q_padded = torch.cat([q, q.new_zeros(1, nkv, G, hs)])  # [S + 1, nkv, G, hs]
    pairs = tables.flatten()  # each sequence's blocks in table order

    def blocks_in_place():
        queries = q_padded.index_select(0, owner)  # [used, nkv, G, hs]
        scores = torch.matmul(queries, k_heads[:used].transpose(-1, -2)).mul_(scale).add_(block_bias)  # [.., G, bs]
        m = scores.amax(-1, keepdim=True).clamp_(min=-1e30)  # [used, nkv, G, 1]
        p = (scores - m).exp_()
        l = p.sum(-1, keepdim=True)
        o = torch.matmul(p, v_heads[:used])  # [used, nkv, G, hs]
        m_s = m.index_select(0, pairs).view(S, width, nkv, G, 1)
        l_s = l.index_select(0, pairs).view(S, width, nkv, G, 1)
        o_s = o.index_select(0, pairs).view(S, width, nkv, G, hs)
        w = (m_s - m_s.amax(1, keepdim=True)).exp_()
        return (o_s * w).sum(1) / (l_s * w).sum(1)

    ways = [("padded", padded), ("gather, new", gather_new), ("gather, reused", gather_reused),
            ("blocks in place", blocks_in_place)]
    for name, fn in ways:
        err = (fn().double() - reference).abs().max().item()
        assert err < 1e-4, (name, err)
    kv_mb = 2 * S * L * nkv * hs * 4 / 1e6
    print(f"decode attention, one layer: {S} sequences x {L} positions, {nkv} kv heads x {G} queries of {hs}, "
          f"blocks of {bs} ({kv_mb:.1f} MB of keys and values visible), float32, {args.threads} threads, "
          f"torch {torch.__version__}")
    print("| way | ms / layer | vs padded |")
    print("|---|---:|---:|")
    floor = None
    for name, fn in ways:
        ms = timed(fn, args.repeats)
        floor = floor or ms
        print(f"| {name} | {ms:.2f} | {ms / floor:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
