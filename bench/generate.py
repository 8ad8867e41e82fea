"""Decode throughput of `ppo_core.generate` against `transformers`' `generate` on the same checkpoint.

    python bench/generate.py                       # SmolLM2-135M shape, batch 8, 32 prompt + 64 new, 2 threads
    python bench/generate.py --batch 4 --new 32 --repeats 5 --threads 2 --config ../shared/model-configs/SmolLM2-360M

A random-weight checkpoint with the architecture of `--config` is written to a temporary directory by
`transformers` and loaded by both libraries (float32, CPU). Both decode greedily for exactly `--new` tokens
(EOS ignored) from the same random prompts; the script checks the tokens are identical, then reports the
median wall time of `--repeats` timed calls after a short warm-up call each (the calls of the implementations
interleaved), as new tokens per second (batch * new / time, prefill included) and milliseconds per new token
step. ppo_core runs three times: with its default CPU fast path (oneDNN-packed weights, see model.cpu_packed_linears),
with plain F.linear, the same matmul transformers uses, and with packed weights and the static-cache decode step
(`static_cache=True`, every step attends over all prompt + new slots with a mask: the default on a GPU).
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import ppo_core  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def timed(fns: dict, new, repeats):
    """name -> (tokens, median seconds) of fn(new). Each fn is warmed up with a short call (allocator, thread
    pool, kernel choice); the timed calls of all fns are interleaved so that a change in the load of a shared
    machine hits every implementation alike."""
    for fn in fns.values():
        fn(4)
    outputs, times = {}, {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            outputs[name] = fn(new)
            times[name].append(time.perf_counter() - t0)
    return {name: (outputs[name], statistics.median(times[name])) for name in fns}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(HERE, "..", "..", "shared", "model-configs", "SmolLM2-135M"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hf-static", action="store_true", help="also time transformers with cache_implementation='static'")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoConfig, AutoModelForCausalLM  # the reference only; ppo_core never imports it

    config = AutoConfig.from_pretrained(args.config)
    config.dtype = "float32"
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with tempfile.TemporaryDirectory() as ckpt:
        hf.save_pretrained(ckpt)
        ours = ppo_core.load_model(ckpt).eval()
    hf.generation_config.eos_token_id = None  # decode exactly --new tokens in both
    hf.generation_config.pad_token_id = 0

    prompts = torch.randint(0, config.vocab_size, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompts)

    def run_ours(new, **kw):
        return ppo_core.generate(ours, prompts, new, attention_mask=mask, greedy=True, stop_at_eos=False, **kw)

    def run_hf(new, **kw):
        with torch.no_grad():
            out = hf.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, **kw)
        return out[:, args.prompt:]

    fns = {"transformers generate (dynamic cache)": run_hf}
    if args.hf_static:
        fns["transformers generate (static cache)"] = lambda new: run_hf(new, cache_implementation="static")
    fns["ppo_core generate, plain F.linear"] = lambda new: run_ours(new, cpu_packed_weights=False)
    fns["ppo_core generate (packed CPU weights)"] = run_ours
    fns["ppo_core generate (packed, static cache)"] = lambda new: run_ours(new, static_cache=True)
    results = timed(fns, args.new, args.repeats)
    hf_tokens, t_hf = results["transformers generate (dynamic cache)"]
    rows = [(name, t, bool(torch.equal(tokens, hf_tokens))) for name, (tokens, t) in results.items()]

    n_params = ppo_core.count_parameters(args.config)
    print(f"model {os.path.basename(os.path.normpath(args.config))} ({n_params / 1e6:.1f}M params, random weights, float32), "
          f"batch {args.batch}, prompt {args.prompt}, new {args.new}, greedy, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, median of {args.repeats} after warm-up, load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs")
    print(f"| {'implementation':<40} | {'time (s)':>8} | {'new tok/s':>9} | {'ms/step':>7} | {'vs transformers':>15} | {'same tokens':>11} |")
    print(f"|{'-' * 42}|{'-' * 10}:|{'-' * 10}:|{'-' * 8}:|{'-' * 16}:|{'-' * 12}:|")
    for name, t, same in rows:
        print(f"| {name:<40} | {t:8.3f} | {args.batch * args.new / t:9.1f} | {1000 * t / args.new:7.1f} | "
              f"{t_hf / t:14.2f}x | {'yes' if same else 'NO':>11} |")
    for name, (tokens, _) in results.items():
        if not torch.equal(tokens, hf_tokens):
            print(f"WARNING: {name}: greedy tokens differ from transformers in "
                  f"{(tokens != hf_tokens).any(-1).sum().item()}/{args.batch} rows")
            sys.exit(1)


if __name__ == "__main__":
    main()
