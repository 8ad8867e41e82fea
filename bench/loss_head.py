"""The loss-agnostic fused head against the closed-form one it replaced, side by side in one run (issue 48, item 5).

    python bench/loss_head.py                      # SmolLM2-135M's head (H 576, V 49152) and a Qwen3-0.6B head
                                                   # (H 1024, V 151936), 2048 rows, bf16 operands and fp32
    python bench/loss_head.py --quick              # tiny shapes: checks that every row runs (seconds)
    python bench/loss_head.py --only qwen3-0.6b:float32 --rounds 5   # one row, more rounds

"before" is `linear_policy_loss` of commit 86f7a7c (its kernels/ files read with `git show` into a temporary
package: the PPO loss, KL term and entropy bonus written in closed form inside the kernel); "after" is today's
`ppo_kernels.linear_logprob_loss` with the same objective built from ppo_core.algo (PPO clip 0.2, k3 KL term at
0.01, entropy bonus at 0.01, token-mean), called per chunk of rows under autograd. Both take hidden [16, 128, H]
with 2048 rows in the loss, forward and backward. Every measurement runs in a fresh subprocess on the same seeded
inputs: its peak resident memory beyond the inputs (VmHWM after /proc/self/clear_refs once the inputs exist) is its
own; rounds interleave before and after (a shared CPU's load drifts); the median time over rounds is reported,
and the ratio of the median CPU times (process time, all threads: less sensitive than wall time to other jobs on a
shared machine). The CPU is named in the table's heading. "after" runs PPO in tiles of tokens (tokens_separate=True),
as ppo_core.update does for a token-level loss.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEFORE_COMMIT = "86f7a7c"
SHAPES = {"smollm2-135m": (576, 49152), "qwen3-0.6b": (1024, 151936)}
QUICK_SHAPES = {"tiny": (64, 1000)}
B, T = 16, 128  # 2048 rows
KL_COEF, ENTROPY_COEF = 0.01, 0.01


def old_package():
    """The kernels/ folder of BEFORE_COMMIT as an importable package `before_kernels`, in a temporary folder."""
    folder = tempfile.mkdtemp(prefix="loss-head-before-")
    os.makedirs(os.path.join(folder, "before_kernels"))
    for name in ("__init__.py", "logprobs.py", "linear_logprobs.py", "loss.py"):
        text = subprocess.run(["git", "-C", ROOT, "show", f"{BEFORE_COMMIT}:kernels/{name}"], check=True,
                              capture_output=True, text=True).stdout
        if name == "__init__.py":
            text = ""  # its dispatch re-exports are not needed
        with open(os.path.join(folder, "before_kernels", name), "w") as f:
            f.write(text)
    return folder


def peak_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))


def measure(which, H, V, dtype, repeats):
    """One subprocess's measurement: -> {"s": [seconds per call], "extra_mib": peak beyond the inputs}."""
    import torch

    torch.manual_seed(0)
    hidden = (torch.randn(B, T, H) * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(V, H) * 0.05).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (B, T))
    old = -torch.rand(B, T) * 3
    ref = old + 0.1 * torch.randn(B, T)
    adv = torch.randn(B, T)
    mask = torch.ones(B, T)
    n = mask.sum()
    if which == "before":
        from before_kernels.loss import linear_policy_loss

        def call():
            return linear_policy_loss(hidden, weight, labels, old, adv, mask, ref_logp=ref, kl_coef=KL_COEF,
                                      kl_kind="k3", entropy_coef=ENTROPY_COEF, num_tokens=n)[0]
    else:
        import ppo_kernels
        from ppo_core import algo

        def objective(logp, entropy, rows):
            m, agg = mask[rows], algo.Aggregation("token-mean", num_tokens=n)
            loss, stats = algo.policy_loss(logp, old[rows], adv[rows], m, 0.2, 0.2, agg=agg)
            loss = loss + KL_COEF * algo.aggregate(algo.kl_estimate(logp, ref[rows], "k3"), m, agg)
            return loss - ENTROPY_COEF * algo.aggregate(entropy, m, agg), stats

        def call():
            return ppo_kernels.linear_logprob_loss(hidden, weight, labels, objective, need_entropy=True,
                                                   tokens_separate=True)[0]  # as update.py runs PPO
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident size: the inputs exist
    base = peak_kib()
    times, cpu = [], []
    for _ in range(repeats + 1):  # the first call warms up
        hidden.grad = weight.grad = None
        start, start_cpu = time.perf_counter(), time.process_time()
        call().backward()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return {"s": times[1:], "cpu_s": cpu[1:], "extra_mib": (peak_kib() - base) / 1024}


def cpu_name():
    with open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown CPU")
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    bf16 = [f for f in ("avx512_bf16", "amx_bf16") if f in flags] or ["AVX2 only" if "avx2" in flags else "no AVX2"]
    return f"{model} ({', '.join(bf16)}), {os.cpu_count()} cores"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes: check that every row runs")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (subprocesses) per row")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per subprocess, after one warm-up")
    parser.add_argument("--only", default=None, help="one row, SHAPE:DTYPE (e.g. qwen3-0.6b:float32)")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # a subprocess's job, as JSON
    args = parser.parse_args()
    if args.measure:
        job = json.loads(args.measure)
        import torch
        torch.set_num_threads(job["threads"])
        print(json.dumps(measure(job["which"], job["H"], job["V"], getattr(torch, job["dtype"]), job["repeats"])))
        return
    import torch
    folder = old_package()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([folder, ROOT, os.environ.get("PYTHONPATH", "")])}
    threads = torch.get_num_threads()
    print(f"# linear policy loss, forward + backward, {B * T} rows; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"{cpu_name()}; torch {torch.__version__}, {threads} threads")
    print(f"{'shape':<14} {'dtype':<9} {'before s':>9} {'after s':>9} {'after/before':>12} {'cpu ratio':>10} "
          f"{'before MiB':>11} {'after MiB':>10}")
    for shape, (H, V) in (QUICK_SHAPES if args.quick else SHAPES).items():
        for dtype in ("bfloat16", "float32"):
            if args.only and args.only != f"{shape}:{dtype}":
                continue
            results = {"before": [], "after": []}
            for _ in range(args.rounds):
                for which in ("before", "after"):
                    job = dict(which=which, H=H, V=V, dtype=dtype, repeats=args.repeats, threads=threads)
                    out = subprocess.run([sys.executable, __file__, "--measure", json.dumps(job)], env=env,
                                         capture_output=True, text=True, check=True).stdout
                    results[which].append(json.loads(out.strip().splitlines()[-1]))
            t = {k: statistics.median(s for r in v for s in r["s"]) for k, v in results.items()}
            c = {k: statistics.median(s for r in v for s in r["cpu_s"]) for k, v in results.items()}
            mem = {k: max(r["extra_mib"] for r in v) for k, v in results.items()}
            print(f"{shape:<14} {dtype:<9} {t['before']:>9.3f} {t['after']:>9.3f} {t['after'] / t['before']:>12.3f} "
                  f"{c['after'] / c['before']:>10.3f} {mem['before']:>11.0f} {mem['after']:>10.0f}", flush=True)


if __name__ == "__main__":
    main()
