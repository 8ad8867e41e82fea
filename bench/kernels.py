"""Benchmark ppo_kernels against torch eager, torch.compile and installed peers (TRL, Liger-Kernel).

    python bench/kernels.py                # CPU table (float32; ~45 min on 2 busy cores); + CUDA table with a GPU
    python bench/kernels.py --quick        # tiny shapes, about a minute: checks that every row runs
    python bench/kernels.py --only linear  # one op: logits | linear | loss
    python bench/kernels.py --repeats 5    # rounds (default 3): every row is timed once per round

Every measurement runs in a fresh subprocess on the same seeded inputs, so its memory high-water mark is its own:
on CPU the peak resident memory (VmHWM, reset through /proc/self/clear_refs once the inputs exist), on CUDA
torch.cuda.max_memory_allocated; "extra MiB" is that peak beyond the inputs and the gradients returned.
Times: forward, and forward + backward, the median over rounds that interleave the implementations (a shared
CPU's load drifts; interleaving spreads the drift over every row), after a warm-up iteration where there is
something to warm up (torch.compile and Liger's compiled loss, and everything on CUDA); synchronised on CUDA.
The ceilings are the best of one measurement per round.
Throughput is in physical units against ceilings measured in the same run: GB/s against a large tensor copy
(bytes = one read of the logits for the forward, read + read + write for forward + backward) for the logits
op; TFLOP/s against a large matmul (2NHV per projection: 1 forward, 3 forward + backward) for the fused-linear
ops ("loss" forms its gradients in the forward, so its forward already holds the whole cost). "vs eager" is
forward + backward time and extra memory relative to the torch-eager row of the same shape.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from functools import partial

import torch

SEED = 0


# -------------------------------------------------------------------------------------------- implementations
def _peer(name):
    """Import a peer's function, or None when it is not installed (the row is then skipped)."""
    try:
        if name == "trl_selective_log_softmax":
            from trl.trainer.utils import selective_log_softmax
            return selective_log_softmax
        if name == "trl_chunked":
            from trl.kernels import ChunkedLogProbFunction
            return ChunkedLogProbFunction
        if name == "liger_chunked_logprob":
            from liger_kernel.chunked_loss.fused_linear_ppo import _ChunkedSelectiveLogProbFunction
            return _ChunkedSelectiveLogProbFunction
        if name == "liger_grpo":
            from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
            return LigerFusedLinearGRPOLoss
    except Exception:  # not installed, or installed without what it needs here
        return None
    raise KeyError(name)


def logits_impls():
    """op 'logits': token_logprobs from [N, V] logits; each returns logprobs [N] (backward through them)."""
    import ppo_kernels
    from ppo_kernels import token_logprobs_reference
    impls = {
        "torch eager": lambda x, y: token_logprobs_reference(x, y),
        "torch.compile": torch.compile(lambda x, y: token_logprobs_reference(x, y)),
        "ppo_kernels": lambda x, y: ppo_kernels.token_logprobs(x, y),
    }
    trl_fn = _peer("trl_selective_log_softmax")
    if trl_fn is not None:
        impls["trl selective_log_softmax"] = lambda x, y: trl_fn(x, y)
    return impls


def linear_impls():
    """op 'linear': log-probs of hidden @ weight.T without (or with, for eager) the [N, V] logits."""
    import ppo_kernels
    from ppo_kernels import linear_token_logprobs_reference
    impls = {
        "torch eager": lambda h, w, y: linear_token_logprobs_reference(h, w, y),
        "torch.compile": torch.compile(lambda h, w, y: linear_token_logprobs_reference(h, w, y)),
        "ppo_kernels": lambda h, w, y: ppo_kernels.linear_token_logprobs(h, w, y),
    }
    trl_cls = _peer("trl_chunked")
    if trl_cls is not None:
        # TRL's own chunk width (trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE); outputs=() is log-probs only
        impls["trl ChunkedLogProbFunction"] = (
            lambda h, w, y: trl_cls.apply(h, w, None, y, 1.0, 32768, None, 1.0, ())[0])
    liger_cls = _peer("liger_chunked_logprob")
    if liger_cls is not None:
        impls["liger chunked logprob (private)"] = lambda h, w, y: liger_cls.apply(h, w, y, None, 1.0, 4096)
    return impls


def loss_impls():
    """op 'loss': PPO clipped loss from hidden states (the policy update); returns the scalar loss."""
    import ppo_kernels
    impls = {}
    if hasattr(ppo_kernels, "linear_policy_loss"):
        from ppo_kernels.loss import linear_policy_loss_reference
        impls["torch eager"] = lambda h, w, y, old, adv, mask: linear_policy_loss_reference(h, w, y, old, adv, mask)[0]
        impls["ppo_kernels"] = (
            lambda h, w, y, old, adv, mask: ppo_kernels.linear_policy_loss(h, w, y, old, adv, mask)[0])
    liger_cls = _peer("liger_grpo")
    if liger_cls is not None:
        def liger(h, w, y, old, adv, mask, _loss=[]):
            if not _loss:  # one module per process; beta=0: no reference model, as in the other rows
                _loss.append(liger_cls(beta=0.0, epsilon_low=0.2, epsilon_high=0.2, loss_type="bnpo",
                                       use_ref_model=False))
            return _loss[0](h, w, y, mask, adv[:, 0], old_per_token_logps=old)[0]
        impls["liger LigerFusedLinearGRPOLoss"] = liger
    return impls


IMPLS = {"logits": logits_impls, "linear": linear_impls, "loss": loss_impls}


# -------------------------------------------------------------------------------------------- one measurement
def make_inputs(op, shape, dtype, device):
    g = torch.Generator().manual_seed(SEED)
    if op == "logits":
        N, V = shape
        logits = (torch.randn(N, V, generator=g) * 3).to(device, dtype).requires_grad_()
        labels = torch.randint(0, V, (N,), generator=g).to(device)
        return (logits, labels), [logits]
    N, H, V = shape
    hidden = torch.randn(N, H, generator=g).to(device, dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * (3 / math.sqrt(H))).to(device, dtype).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g).to(device)
    if op == "linear":
        return (hidden, weight, labels), [hidden, weight]
    B, T = 2, N // 2  # loss: N = B * T tokens, [B, T] token arguments
    hidden = hidden.detach().view(B, T, H).requires_grad_()
    old = (torch.randn(B, T, generator=g) * 0.1 - 12.0).to(device)  # about log(1 / V): near the policy's logp
    adv = torch.randn(B, 1, generator=g).expand(B, T).contiguous().to(device)  # one advantage per sequence (GRPO)
    mask = torch.ones(B, T, device=device)
    return (hidden, weight, labels.view(B, T), old, adv, mask), [hidden, weight]


class Memory:
    """Peak memory since reset(), in bytes: VmHWM on CPU (whole process), max_memory_allocated on CUDA."""

    def __init__(self, device):
        self.cuda = device == "cuda"

    def reset(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current resident set
            self.base = self._status("VmRSS")

    def peak_extra(self):
        if self.cuda:
            return torch.cuda.max_memory_allocated() - self.base
        return self._status("VmHWM") - self.base

    @staticmethod
    def _status(key):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024


def worker(spec):
    op, impl, shape, device = spec["op"], spec["impl"], tuple(spec["shape"]), spec["device"]
    dtype = getattr(torch, spec["dtype"])
    fn = IMPLS[op]()[impl]
    inputs, leaves = make_inputs(op, shape, dtype, device)
    grad_bytes = sum(t.numel() * t.element_size() for t in leaves)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    memory = Memory(device)
    memory.reset()
    fwd_times, total_times, fwd_peak = [], [], None
    for i in range(spec["warmup"] + spec["repeats"]):
        for t in leaves:
            t.grad = None
        sync()
        t0 = time.perf_counter()
        out = fn(*inputs)
        loss = out.sum() if out.dim() else out
        sync()
        t1 = time.perf_counter()
        if fwd_peak is None:
            fwd_peak = memory.peak_extra()  # first forward: no gradients exist yet
        loss.backward()
        sync()
        t2 = time.perf_counter()
        del out, loss
        if i >= spec["warmup"]:  # warm-up iterations: compilation (torch.compile, Liger)
            fwd_times.append(t1 - t0)
            total_times.append(t2 - t0)
    return {"fwd_s": fwd_times, "total_s": total_times,
            "fwd_extra": fwd_peak, "total_extra": max(0, memory.peak_extra() - grad_bytes),
            "threads": torch.get_num_threads()}


def ceilings(device):
    """Copy bandwidth (GB/s, read + write) and matmul rate (TFLOP/s) measured here, in this run."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    nbytes = (4 << 30) if device == "cuda" else (512 << 20)
    src = torch.empty(nbytes // 4, device=device).normal_()
    dst = torch.empty_like(src)
    def timed(f, repeats):
        f()
        sync()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            f()
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    copy_s = timed(partial(dst.copy_, src), 10)
    del src, dst
    if device == "cuda":
        a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        flops, dtype = 2 * 8192**3, "bf16"
    else:
        a, b = torch.randn(2048, 1024), torch.randn(1024, 4096)  # the torch path's tile shape
        flops, dtype = 2 * 2048 * 1024 * 4096, "fp32"
    mm_s = timed(lambda: a @ b, 5)
    return {"copy_GBps": 2 * nbytes / copy_s / 1e9, "mm_TFLOPs": flops / mm_s / 1e12, "mm_dtype": dtype}


def run_subprocess(args, timeout):
    cmd = [sys.executable, os.path.abspath(__file__)] + args
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": tail[:120]}


# -------------------------------------------------------------------------------------------- the table
def work_units(op, shape):
    """(bytes, flops) for forward and forward + backward: the physical floor of each op."""
    if op == "logits":
        N, V = shape
        return (N * V, 3 * N * V), None  # multiplied by the element size later
    N, H, V = shape
    return None, (2 * N * H * V, 6 * N * H * V)


def fmt_time(seconds):
    return f"{seconds * 1e3:.1f}" if seconds < 10 else f"{seconds * 1e3:.0f}"


def print_table(rows, ceiling, device):
    threads = next((r[-1]["threads"] for r in rows if "threads" in r[-1]), "?")
    print(f"\n## {device}: copy {ceiling['copy_GBps']:.1f} GB/s, matmul {ceiling['mm_TFLOPs'] * 1e3:.1f} "
          f"GFLOP/s ({ceiling['mm_dtype']}), {threads} threads\n")
    header = ["op", "shape", "dtype", "impl", "fwd ms", "fwd+bwd ms", "fwd rate", "fwd %ceil", "f+b rate",
              "f+b %ceil", "fwd extra MiB", "f+b extra MiB", "time vs eager", "mem vs eager"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    eager = {}
    for op, shape, dtype, impl, result in rows:
        if impl == "torch eager" and "error" not in result:
            eager[(op, shape, dtype)] = result
    for op, shape, dtype, impl, result in rows:
        prefix = [op, "x".join(map(str, shape)), dtype, impl]
        if "error" in result:
            print("| " + " | ".join(prefix + [f"failed: {result['error']}"] + [""] * 9) + " |")
            continue
        byte_units, flop_units = work_units(op, shape)
        rates = []
        for units_index, seconds in ((0, result["fwd_s"]), (1, result["total_s"])):
            if byte_units is not None:
                gbps = byte_units[units_index] * getattr(torch, dtype).itemsize / seconds / 1e9
                rates += [f"{gbps:.1f} GB/s", f"{100 * gbps / ceiling['copy_GBps']:.0f}%"]
            else:
                tflops = flop_units[units_index] / seconds / 1e12
                rates += [f"{tflops * 1e3:.1f} GFLOP/s" if tflops < 1 else f"{tflops:.1f} TFLOP/s",
                          f"{100 * tflops / ceiling['mm_TFLOPs']:.0f}%"]
        base = eager.get((op, shape, dtype))
        vs = ["", ""]
        if base:
            vs = [f"{result['total_s'] / base['total_s']:.2f}x",
                  f"{result['total_extra'] / max(base['total_extra'], 1):.3f}x"]
        print("| " + " | ".join(prefix + [fmt_time(result["fwd_s"]), fmt_time(result["total_s"]), rates[0],
                                          rates[1], rates[2], rates[3], f"{result['fwd_extra'] / 2**20:.0f}",
                                          f"{result['total_extra'] / 2**20:.0f}"] + vs) + " |", flush=True)


def configs(device, quick):
    if device == "cpu":
        if quick:
            return [("logits", (64, 4096), "float32"), ("linear", (128, 64, 4096), "float32"),
                    ("loss", (128, 64, 4096), "float32")]
        return [("logits", (1024, 151936), "float32"),  # the CPU goal shapes
                ("linear", (2048, 1024, 151936), "float32"),
                ("loss", (2048, 1024, 151936), "float32")]
    if quick:
        return [("logits", (1024, 151936), "bfloat16"), ("linear", (1024, 1024, 151936), "bfloat16")]
    return [("logits", (16384, 151936), "bfloat16"), ("linear", (16384, 4096, 151936), "bfloat16"),
            ("loss", (16384, 4096, 151936), "bfloat16")]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes: check that every row runs")
    parser.add_argument("--only", choices=sorted(IMPLS), help="run one op")
    parser.add_argument("--repeats", type=int, default=3, help="rounds: each row is timed once per round")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds allowed per row")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--ceilings", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    if args.ceilings:
        print(json.dumps(ceilings(args.ceilings)))
        return
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        ceiling_runs, rows = [], []
        for op, shape, dtype in configs(device, args.quick):
            if args.only and op != args.only:
                continue
            impl_names = list(IMPLS[op]().keys())  # only what is installed and defined
            results = {impl: [] for impl in impl_names}
            # Rounds over the implementations, each timed once per round: a shared machine's load drifts over
            # minutes, and interleaving spreads that drift over every row instead of favouring one.
            for round_index in range(args.repeats):
                ceiling_runs.append(run_subprocess(["--ceilings", device], args.timeout))
                for impl in impl_names:
                    compiled = impl == "torch.compile" or impl.startswith("liger LigerFused")
                    spec = {"op": op, "impl": impl, "shape": shape, "dtype": dtype, "device": device,
                            "warmup": 1 if (compiled or device == "cuda") else 0, "repeats": 1}
                    result = run_subprocess(["--worker", json.dumps(spec)], args.timeout)
                    results[impl].append(result)
                    print(f"  round {round_index} {op} {shape} {impl}: {result}", file=sys.stderr, flush=True)
            for impl in impl_names:
                rows.append((op, shape, dtype, impl, merge(results[impl])))
        ceiling = {"copy_GBps": max(c.get("copy_GBps", 0) for c in ceiling_runs),
                   "mm_TFLOPs": max(c.get("mm_TFLOPs", 0) for c in ceiling_runs),
                   "mm_dtype": ceiling_runs[0].get("mm_dtype", "?")}
        print_table(rows, ceiling, device)


def merge(runs):
    """Median time over the rounds; peak memory: the largest seen."""
    good = [r for r in runs if "error" not in r]
    if not good:
        return runs[0]
    return {"fwd_s": statistics.median(t for r in good for t in r["fwd_s"]),
            "total_s": statistics.median(t for r in good for t in r["total_s"]),
            "fwd_extra": max(r["fwd_extra"] for r in good), "total_extra": max(r["total_extra"] for r in good),
            "threads": good[0]["threads"], "rounds": len(good)}


if __name__ == "__main__":
    main()
