"""Milliseconds per decode step by batch size: RolloutEngine.generate against ppo_core.generate (the padded
reference) on one random-weight checkpoint, CPU, float32. The tail of a heavy-tailed rollout (workload B of
bench/rollout.py) is a long run of steps of a few sequences, so this is where per-step overhead shows.

    python bench/decode_steps.py                                   # SmolLM2-135M shape, 2 threads
    python bench/decode_steps.py --model Qwen3-0.6B --threads 1 --batches 1 4 16

Each row: prompts of --prompt-len random tokens (default 32); a call of --long new tokens minus a call of --short new
tokens, over the difference in steps (prefill and per-call set-up cancel), the median of --repeats such pairs after a
warm-up. The checkpoint is bench/rollout.py's (written once into its cache directory).

    python bench/decode_steps.py --batches 16 64 --prompt-len 288 --one-gather   # long contexts

--one-gather adds the engine with gather_chunk_bytes=None: each decode step's keys and values gathered all at once,
as before the engine gathered them a few sequences at a time (ppo_core.engine.GATHER_CHUNK_BYTES).
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
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--one-gather", action="store_true", help="also the engine gathering each step's keys at once")
    cache_home = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    ap.add_argument("--cache-dir", default=os.path.join(cache_home, "ppo_core", "bench-rollout"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = ppo_core.load_model(checkpoint(args.model, False, args.cache_dir)).eval()
    V = model.args.vocab_size
    engines = {"engine": RolloutEngine(model), "one gather": RolloutEngine(model, gather_chunk_bytes=None)}
    g = torch.Generator().manual_seed(0)
    P = args.prompt_len

    def engine_call(b, n, name="engine"):
        prompts = torch.randint(1, V, (b, P), generator=g).tolist()
        t0 = time.perf_counter()
        engines[name].generate(prompts, n, seed=0)
        return time.perf_counter() - t0

    def one_gather_call(b, n):
        return engine_call(b, n, "one gather")

    def generate_call(b, n):
        ids = torch.randint(1, V, (b, P), generator=g)
        t0 = time.perf_counter()
        ppo_core.generate(model, ids, n, stop_at_eos=False, generator=torch.Generator().manual_seed(0))
        return time.perf_counter() - t0

    def per_step(call, b):
        call(b, args.short)  # warm-up
        steps = args.long - args.short
        return 1e3 * statistics.median((call(b, args.long) - call(b, args.short)) / steps for _ in range(args.repeats))

    print(f"decode step, {args.model} (random weights), {P}-token prompts, new tokens {args.short + 1}..{args.long}, "
          f"float32, {args.threads} threads, torch {torch.__version__}")
    one = args.one_gather
    print("| batch | engine ms/step |" + (" engine, one gather a step |" if one else "")
          + " generate() ms/step | engine / generate |" + (" engine / one gather |" if one else ""))
    print("|---:|---:|---:|---:|" + ("---:|---:|" if one else ""))
    with torch.no_grad():
        for b in args.batches:
            e = per_step(engine_call, b)
            o = per_step(one_gather_call, b) if one else None
            p = per_step(generate_call, b)
            print(f"| {b} | {e:.1f} |" + (f" {o:.1f} |" if one else "") + f" {p:.1f} | {e / p:.2f}x |"
                  + (f" {e / o:.2f}x |" if one else ""), flush=True)


if __name__ == "__main__":
    main()
