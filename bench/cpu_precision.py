"""Which ops bf16 speeds up on this CPU, and which it slows down: the measurements behind bf16-mixed on the CPU.

    python bench/cpu_precision.py             # one thread (the trainer's default), about a minute
    python bench/cpu_precision.py --threads 2

dtype='auto' turns on bf16 autocast on CPUs with AMX or AVX512-BF16 (ppo_core.models.precision.resolve_precision). Autocast
would also run attention (torch's CPU flash kernel) in bf16; ppo_core.models.model.attention computes it in fp32 on the
CPU instead, and generate keeps a float32 KV cache there, because of the rows below: on the CPU this project was
measured on, bf16 attention is the slower one while bf16 matmuls are the faster one. Each row times an op in fp32
and in bf16 at two shapes: the demo model's (hidden 64, 4 heads of 16) and SmolLM2-135M's (hidden 576, 9 heads of
64, 3 KV heads) with 16 sequences of 96 tokens (the bench/e2e.py iteration) or one decoding step. Median of
--repeats calls after a warm-up; "bf16 / fp32" < 1 means bf16 is faster.
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = {  # name: (hidden, intermediate, heads, kv heads, head dim)
    "demo": (64, 176, 4, 2, 16),
    "SmolLM2-135M": (576, 1536, 9, 3, 64),
}


def timed(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cases(shape, batch, seq):
    """(op name, fn(dtype) -> a zero-argument callable) for one model shape."""
    H, I, nh, nkv, hs = SHAPES[shape]
    g = torch.Generator().manual_seed(0)

    def randn(*size, dtype, grad=False):
        return torch.randn(*size, generator=g).to(dtype).requires_grad_(grad)

    def linear_fwd_bwd(dtype):
        x, w = randn(batch * seq, H, dtype=dtype, grad=True), randn(I, H, dtype=dtype, grad=True)
        return lambda: F.linear(x, w).sum().backward()

    def linear_decode_packed(dtype):
        x = randn(batch, H, dtype=dtype)
        w = torch.ops.mkldnn._reorder_linear_weight(randn(I, H, dtype=dtype), batch)
        return lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    def attention_fwd_bwd(dtype):
        q = randn(batch, nh, seq, hs, dtype=dtype, grad=True)
        k, v = randn(batch, nkv, seq, hs, dtype=dtype, grad=True), randn(batch, nkv, seq, hs, dtype=dtype, grad=True)
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nh > nkv).sum().backward()

    def attention_decode(dtype):  # one query per row over a cache of seq keys (model.attention's "query heads as rows")
        q = randn(batch, nkv, nh // nkv, hs, dtype=dtype)
        k, v = randn(batch, nkv, seq, hs, dtype=dtype), randn(batch, nkv, seq, hs, dtype=dtype)
        return lambda: F.scaled_dot_product_attention(q, k, v)

    return [("linear fwd+bwd [B*T, H] x [I, H]", linear_fwd_bwd),
            ("packed linear, one decode step", linear_decode_packed),
            ("attention fwd+bwd, causal", attention_fwd_bwd),
            ("attention, one decode step", attention_decode)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=96)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from ppo_core.models.precision import bf16_matmul_hardware
    print(f"torch {torch.__version__}, {args.threads} thread(s), bf16 matmul hardware: "
          f"{bf16_matmul_hardware('cpu') or 'none'}; batch {args.batch}, {args.seq} tokens")
    print(f"{'shape':14} {'op':36} {'fp32 ms':>9} {'bf16 ms':>9} {'bf16 / fp32':>12}")
    for shape in SHAPES:
        for name, make in cases(shape, args.batch, args.seq):
            fp32 = timed(make(torch.float32), args.repeats)
            bf16 = timed(make(torch.bfloat16), args.repeats)
            print(f"{shape:14} {name:36} {fp32 * 1e3:9.3f} {bf16 * 1e3:9.3f} {bf16 / fp32:12.2f}", flush=True)


if __name__ == "__main__":
    main()
