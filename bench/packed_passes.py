"""The training passes padded against packed (config micro_batch_tokens): one PPO iteration's scoring passes and update
on a fixed rollout, at the SmolLM2-135M shape with random weights, on the CPU.

    python bench/packed_passes.py                        # both workloads, padded and packed, 2 threads (~20 min)
    python bench/packed_passes.py --quick                # a 2-layer model and 16 rows: the same code in a minute
    python bench/packed_passes.py --only attention       # packed attention on the CPU: per-sequence SDPA vs one masked call

The rollout is built, not sampled (decoding is the rollout engine's business, bench/rollout.py): 64 prompts of 32 random
tokens, and random responses of
  heavy-tailed:  lengths lognormal with median 64 (sigma 1) clipped to [8, 512], max_new_tokens 512;
  equal:         every response 64 tokens, max_new_tokens 64.
The responses are right-padded to max_new_tokens, as the trainer's rollout holds them. Then, through the trainer's own
functions (ppo_core.rollout.rollout_forward, ppo_core.update.compute_advantages and ppo_update with ppo_core.update's
Optimizers; GAE with a critic, fused heads, fp32, one PPO epoch of two minibatches of 32):
  old logp, ref logp, values   the scoring passes (forward only), timed inside rollout_forward
  update                       the policy's and the critic's forward + backward over every row, and two AdamW steps
Padded runs micro-batches of --micro-batch rows ([rows, 32 + max_new_tokens] each); packed runs micro_batch_tokens =
--micro-batch * (32 + max_new_tokens), the same number of token slots, so a packed micro-batch never holds more
activations than a padded one. "computed / real" counts the token positions each pass runs the backbone on over the
real ones (prompt + response tokens); "peak RSS" is the process's peak resident memory over what it held after the
models were built (activations, gradients, AdamW state: each mode in a process of its own).

The attention table (--only attention, also printed first by default): one micro-batch's attention at the
SmolLM2-135M head shape (9 query heads, 3 KV heads, head size 64), forward + backward, packed as the model runs it
(ppo_core.models.model.packed_attention: one causal SDPA call per sequence) against one SDPA call over the whole pack with a
block-diagonal causal mask.
"""
import argparse
import json
import math
import os
import random
import resource
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
from ppo_core import rollout as rollout_module  # noqa: E402
from ppo_core.config import build_config  # noqa: E402
from ppo_core.models.model import CausalLM, ModelArgs, ScoreModel, attention, packed_attention, read_config  # noqa: E402
from ppo_core.rollout import Sampled, rollout_forward  # noqa: E402
from ppo_core.update import Optimizers, compute_advantages, ppo_update  # noqa: E402
from ppo_core.run.start import Models, Step  # noqa: E402

CONFIG = os.path.join(HERE, "..", "configs", "models", "SmolLM2-135M")
B, PROMPT = 64, 32


def lognormal_lengths(n, median, sigma, low, high, seed):
    rng = random.Random(seed)
    return [min(max(round(rng.lognormvariate(math.log(median), sigma)), low), high) for _ in range(n)]


def workload(name, quick):
    """-> (response lengths, max_new_tokens)."""
    n = 16 if quick else B
    if name == "heavy-tailed":
        return lognormal_lengths(n, 64, 1.0, 8, 512, 0), 512
    return [64] * n, 64


def random_models(quick):
    config = read_config(CONFIG)
    if quick:
        config = {**config, "num_hidden_layers": 2}
    args = ModelArgs.from_hf_config(config)
    models = []
    for seed, cls in ((0, CausalLM), (1, CausalLM), (2, ScoreModel)):
        torch.manual_seed(seed)
        model = cls(args)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) * 0.02)
        models.append(model)
    return models, args.vocab_size


def sampled(lengths, R, vocab_size):
    """The rollout's sampled part: prompts of PROMPT tokens, responses right-padded to R (no EOS in them)."""
    g = torch.Generator().manual_seed(0)
    n = len(lengths)
    prompt_ids = torch.randint(1, vocab_size, (n, PROMPT), generator=g)
    tokens = torch.randint(1, vocab_size, (n, R), generator=g)
    response_mask = (torch.arange(R)[None] < torch.tensor(lengths)[:, None]).float()
    tokens = tokens.masked_fill(response_mask == 0, 0)
    return Sampled([{"prompt": ""}] * n, [""] * n, [""] * n, prompt_ids, torch.ones(n, PROMPT, dtype=torch.bool),
                   tokens, response_mask, torch.zeros(n, dtype=torch.bool), torch.randn(n, generator=g), {})


def peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def one_run(name, mode, threads, micro_batch, quick):
    """One workload in one mode, in this process -> dict of seconds, token counts and memory."""
    torch.set_num_threads(threads)
    lengths, R = workload(name, quick)
    (policy, reference, critic), vocab_size = random_models(quick)
    batch = sampled(lengths, R, vocab_size)
    n = len(lengths)
    batching = ({"micro_batch_tokens": str(micro_batch * (PROMPT + R))} if mode == "packed"
                else {"micro_batch_size": str(micro_batch)})
    cfg = build_config({}, {**batching, "rollout_batch_size": str(n), "minibatch_size": str(n // 2),
                            "max_new_tokens": str(R), "ppo_epochs": "1", "dtype": "float32", "max_grad_norm": "0"})
    opts = Optimizers(policy, critic, cfg, steps_per_iter=2, log=None)
    rss_models = peak_rss_mb()

    seconds = {"old logp": 0.0, "ref logp": 0.0, "values": 0.0}
    plain = {k: getattr(rollout_module, k) for k in ("response_logprobs", "reference_logprobs", "response_values")}

    def timed(fn, key):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            seconds[key] += time.perf_counter() - t0
            return out
        return run

    # reference_logprobs calls response_logprobs: its time is taken out of "old logp" below
    rollout_module.response_logprobs = timed(plain["response_logprobs"], "old logp")
    rollout_module.reference_logprobs = timed(plain["reference_logprobs"], "ref logp")
    rollout_module.response_values = timed(plain["response_values"], "values")
    try:
        rollout = rollout_forward(Models(policy, reference, critic), batch, torch.arange(n), Step(cfg))
    finally:
        for k, fn in plain.items():
            setattr(rollout_module, k, fn)
    seconds["old logp"] -= seconds["ref logp"]
    compute_advantages(rollout, cfg, 0.05, batch.ended)
    t0 = time.perf_counter()
    ppo_update(policy, critic, rollout, Step(cfg, torch.Generator().manual_seed(0)), 0.05, opts.step)
    seconds["update"] = time.perf_counter() - t0
    real = sum(PROMPT + r for r in lengths)
    computed = real if mode == "packed" else n * (PROMPT + R)
    return {"workload": name, "mode": mode, "seconds": seconds, "computed_per_real": computed / real,
            "real_tokens": real, "peak_rss_mb": peak_rss_mb() - rss_models, "micro_batch": batching}


def in_subprocess(name, mode, args):
    cmd = [sys.executable, os.path.abspath(__file__), "--run", name, mode, "--threads", str(args.threads),
           "--micro-batch", str(args.micro_batch)] + (["--quick"] if args.quick else [])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def passes_table(args):
    shape = "SmolLM2-135M shape, 2 layers" if args.quick else "SmolLM2-135M shape"
    print(f"\n--passes: {shape}, random weights, float32, {args.threads} threads, torch {torch.__version__}, "
          f"{cpu_name()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| workload | mode | micro-batch | old logp s | ref logp s | values s | update s | total s | computed / real | "
          "peak RSS MB |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in ("heavy-tailed", "equal"):
        results = {}
        for mode in ("padded", "packed"):
            r = in_subprocess(name, mode, args)
            results[mode] = r
            s = r["seconds"]
            total = sum(s.values())
            size = next(f"{v} {'tokens' if 'tokens' in k else 'rows'}" for k, v in r["micro_batch"].items())
            print(f"| {name} | {mode} | {size} | {s['old logp']:.2f} | {s['ref logp']:.2f} | {s['values']:.2f} | "
                  f"{s['update']:.2f} | {total:.2f} | {r['computed_per_real']:.3f} | {r['peak_rss_mb']:.0f} |", flush=True)
        speedup = sum(results["padded"]["seconds"].values()) / sum(results["packed"]["seconds"].values())
        print(f"| {name} | packed / padded | | | | | | {speedup:.2f}x faster | | |", flush=True)


def attention_table(args):
    """Packed attention, forward + backward, on the CPU: per-sequence SDPA (what packed_attention runs) against one SDPA
    call over the pack with a block-diagonal causal mask."""
    torch.set_num_threads(args.threads)
    nh, nkv, hs = 9, 3, 64
    print(f"\n--attention: one packed micro-batch, {nh} query / {nkv} KV heads x {hs}, float32, forward + backward, "
          f"{args.threads} threads, median of 5, {cpu_name()}")
    print("| sequences (lengths) | tokens | per-sequence SDPA ms | one masked SDPA ms |")
    print("|---|---:|---:|---:|")
    for lengths in ([96] * 8, lognormal_lengths(16, 64, 1.0, 8, 512, 1), [544] * 2):
        N = sum(lengths)
        q = torch.randn(N, nh, hs, requires_grad=True)
        k, v = (torch.randn(N, nkv, hs, requires_grad=True) for _ in range(2))

        def per_sequence():
            packed_attention(q, k, v, lengths).sum().backward()

        seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        pos = torch.arange(N)
        mask = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])  # [N, N] block-diagonal causal

        def masked():
            y = attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask[None, None])
            y.sum().backward()

        times = {}
        for label, fn in (("seq", per_sequence), ("masked", masked)):
            fn()
            runs = []
            for _ in range(5):
                t0 = time.perf_counter()
                fn()
                runs.append(time.perf_counter() - t0)
            times[label] = sorted(runs)[2] * 1e3
        shown = lengths if len(lengths) <= 8 else f"{len(lengths)}: lognormal(64, 1) in [8, 512]"
        print(f"| {shown} | {N} | {times['seq']:.1f} | {times['masked']:.1f} |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=8, help="padded rows per micro-batch (packed: as many slots)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=("passes", "attention"))
    parser.add_argument("--run", nargs=2, metavar=("WORKLOAD", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        print(json.dumps(one_run(*args.run, args.threads, args.micro_batch, args.quick)))
        return
    if args.only in (None, "attention"):
        attention_table(args)
    if args.only in (None, "passes"):
        passes_table(args)


if __name__ == "__main__":
    main()
