"""Milliseconds per decode step by batch size: RolloutEngine.generate against ppo_core.generate (the padded
reference) on one random-weight checkpoint, CPU, float32. The tail of a heavy-tailed rollout (workload B of
bench/rollout.py) is a long run of steps of a few sequences, so this is where per-step overhead shows.

    python bench/decode_steps.py                                   # SmolLM2-135M shape, 2 threads
    python bench/decode_steps.py --model Qwen3-0.6B --threads 1 --batches 1 4 16

Each row: prompts of 32 random tokens; a call of --long new tokens minus a call of --short new tokens, over the
difference in steps (prefill and per-call set-up cancel), the median of --repeats such pairs after a warm-up. The
checkpoint is bench/rollout.py's (written once into its cache directory).
"""
import argparse
import importlib.util
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
import ppo_core  # noqa: E402
from ppo_core.engine import RolloutEngine  # noqa: E402

# bench/rollout.py's checkpoint(), loaded by path (bench/ stays off sys.path: see bench/rollout.py)
_spec = importlib.util.spec_from_file_location("bench_rollout", os.path.join(HERE, "rollout.py"))
_rollout = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_rollout)
checkpoint = _rollout.checkpoint


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M", help="an architecture in configs/models")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64])
    ap.add_argument("--short", type=int, default=8)
    ap.add_argument("--long", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    cache_home = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    ap.add_argument("--cache-dir", default=os.path.join(cache_home, "ppo_core", "bench-rollout"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = ppo_core.load_model(checkpoint(args.model, False, args.cache_dir)).eval()
    V = model.args.vocab_size
    engine = RolloutEngine(model)
    g = torch.Generator().manual_seed(0)

    def engine_call(b, n):
        prompts = torch.randint(1, V, (b, 32), generator=g).tolist()
        t0 = time.perf_counter()
        engine.generate(prompts, n, seed=0)
        return time.perf_counter() - t0

    def generate_call(b, n):
        ids = torch.randint(1, V, (b, 32), generator=g)
        t0 = time.perf_counter()
        ppo_core.generate(model, ids, n, stop_at_eos=False, generator=torch.Generator().manual_seed(0))
        return time.perf_counter() - t0

    def per_step(call, b):
        call(b, args.short)  # warm-up
        steps = args.long - args.short
        return 1e3 * statistics.median((call(b, args.long) - call(b, args.short)) / steps for _ in range(args.repeats))

    print(f"decode step, {args.model} (random weights), 32-token prompts, float32, {args.threads} threads, "
          f"torch {torch.__version__}")
    print("| batch | engine ms/step | generate() ms/step | engine / generate |")
    print("|---:|---:|---:|---:|")
    with torch.no_grad():
        for b in args.batches:
            e, p = per_step(engine_call, b), per_step(generate_call, b)
            print(f"| {b} | {e:.1f} | {p:.1f} | {e / p:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
