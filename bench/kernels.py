"""Benchmark ppo_kernels against torch eager, torch.compile and installed peers (TRL, Liger-Kernel).

    python bench/kernels.py --device cuda              # GPU table (bf16, N = 1024/4096/16384, H = 4096, V = 151936)
    python bench/kernels.py --device cuda --no-compile # the same without the torch.compile rows (what gpu_suite.sh runs)
    python bench/kernels.py --device cpu               # CPU table (fp32, bf16, autocast; the fp32 rows alone: ~45 min)
    python bench/kernels.py --device cpu --medium      # CPU table at SmolLM2-135M's head (V = 49152, H = 576)
    python bench/kernels.py --device cpu --quick       # tiny CPU shapes, ~7 min: checks that every row runs
    python bench/kernels.py --smoke                    # the GPU runner's code on the CPU at tiny shapes, seconds
    python bench/kernels.py --only linear              # one op (and its -autocast rows): logits | linear | loss
    python bench/kernels.py --device cuda --only paged # paged decode attention alone (the GPU table's last section)

Physical units against ceilings measured in the same run, in the same process: GB/s against a large tensor
copy (bytes = one read of the logits for the forward, read + read + write for forward + backward) for the
logits op; TFLOP/s against a large matmul (bf16 8192^3 on CUDA) (2NHV per projection: 1 forward, 3 forward +
backward) for the fused-linear ops ("loss" forms its gradients in the forward, so its forward already holds the
whole cost). "vs eager" is forward + backward time and extra memory relative to the torch-eager row of the
same shape and dtype. "linear-autocast" and "loss-autocast" feed fp32 hidden states and weight under bf16
autocast, as the trainer does (fp32 master weights): the fused kernels should run their bf16 path there, at the
bf16 row's speed. On the CPU every op is measured in float32 and in bfloat16 (the bf16 rows' %ceil is against a
bf16 matmul measured in the same run; bf16 GEMMs run at 2-3x the fp32 rate on CPUs with AVX512-BF16 or AMX).
On CUDA (and --smoke) a last section times paged decode attention (ppo_kernels.decode_attention: one query per
sequence over a paged bf16 KV cache; forward only): time per call, and K + V bytes read per call / time against the
same copy bandwidth (B = 64 sequences of 1024 keys, Qwen3-0.6B's 16 query / 8 kv heads of 128, 16-token blocks).

CUDA (and --smoke): inputs are made on the device with a device generator; every implementation runs in one
process, one after another, with the allocator's peak statistics reset between them ("extra MiB" =
torch.cuda.max_memory_allocated beyond the inputs and the gradients returned); each is warmed up (Triton JIT,
cuBLAS heuristics, torch.compile), then timed over --repeats calls with CUDA events; the median is reported.
CPU (--device cpu): every measurement runs in a fresh subprocess on the same seeded inputs, so its peak resident
memory (VmHWM, reset through /proc/self/clear_refs once the inputs exist) is its own; rounds interleave the
implementations (a shared CPU's load drifts; interleaving spreads the drift over every row); the median over
rounds is reported, the ceilings are the best of one measurement per round.
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


def compiled(fn):
    """torch.compile(fn), built on the first call: --no-compile runs never import dynamo/inductor (seconds)."""
    cache = []

    def run(*args):
        if not cache:
            cache.append(torch.compile(fn))
        return cache[0](*args)
    return run


def logits_impls():
    """op 'logits': token_logprobs from [N, V] logits; each returns logprobs [N] (backward through them)."""
    import ppo_kernels
    from ppo_kernels import token_logprobs_reference
    impls = {
        "torch eager": lambda x, y: token_logprobs_reference(x, y),
        "torch.compile": compiled(lambda x, y: token_logprobs_reference(x, y)),
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
        "torch.compile": compiled(lambda h, w, y: linear_token_logprobs_reference(h, w, y)),
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


def ppo_loss_fn(old, adv, mask):
    """loss_fn(logp, entropy, rows) for linear_logprob_loss: ppo_core.algo's PPO clipped loss (token-mean over the
    batch's tokens, so that it splits over chunks of rows), as ppo_core.update.policy_objective builds it."""
    from ppo_core import algo
    num_tokens = mask.sum()

    def loss_fn(logp, entropy, rows):
        return algo.policy_loss(logp, old[rows], adv[rows], mask[rows],
                                agg=algo.Aggregation(num_tokens=num_tokens))
    return loss_fn


def loss_impls():
    """op 'loss': PPO clipped loss from hidden states (the policy update); returns the scalar loss."""
    import ppo_kernels
    impls = {}
    if hasattr(ppo_kernels, "linear_logprob_loss"):
        from ppo_kernels import linear_logprob_loss_reference
        impls["torch eager"] = (
            lambda h, w, y, old, adv, mask: linear_logprob_loss_reference(h, w, y, ppo_loss_fn(old, adv, mask))[0])
        impls["ppo_kernels"] = (
            lambda h, w, y, old, adv, mask: ppo_kernels.linear_logprob_loss(h, w, y, ppo_loss_fn(old, adv, mask))[0])
    liger_cls = _peer("liger_grpo")
    if liger_cls is not None:
        def liger(h, w, y, old, adv, mask, _loss=[]):
            if not _loss:  # one module per process; beta=0: no reference model, as in the other rows
                _loss.append(liger_cls(beta=0.0, epsilon_low=0.2, epsilon_high=0.2, loss_type="bnpo",
                                       use_ref_model=False))
            return _loss[0](h, w, y, mask, adv[:, 0], old_per_token_logps=old)[0]
        impls["liger LigerFusedLinearGRPOLoss"] = liger
    return impls


def linear_autocast_impls():
    """op 'linear-autocast': fp32 hidden and weight under bf16 autocast, as the trainer's fp32 master weights
    reach the LM head. Eager autocasts its matmul to bf16; the fused kernels must do the same (not run fp32)."""
    def under_autocast(fn):
        def run(h, w, y):
            with torch.autocast(h.device.type, dtype=torch.bfloat16):
                return fn(h, w, y)
        return run
    impls = linear_impls()
    return {name: under_autocast(impls[name]) for name in ("torch eager", "ppo_kernels")}


def loss_autocast_impls():
    """op 'loss-autocast': the policy update's loss from fp32 hidden and weight under bf16 autocast (as the
    trainer's fp32 master weights reach it): eager autocasts its matmul, the fused loss casts its operands."""
    impls = loss_impls()

    def under_autocast(fn):
        def run(h, w, *token_args):
            with torch.autocast(h.device.type, dtype=torch.bfloat16):
                return fn(h, w, *token_args)
        return run
    return {name: under_autocast(impls[name]) for name in ("torch eager", "ppo_kernels") if name in impls}


IMPLS = {"logits": logits_impls, "linear": linear_impls, "linear-autocast": linear_autocast_impls,
         "loss": loss_impls, "loss-autocast": loss_autocast_impls}


# -------------------------------------------------------------------------------------------- one measurement
def make_inputs(op, shape, dtype, device):
    """Seeded inputs made where they are used: on CUDA with a CUDA generator (a [16384, 151936] tensor made on
    the CPU and copied over takes seconds), on the CPU in float32 and then cast. -> (args, leaves to grad)."""
    on_device = device != "cpu"
    g = torch.Generator(device=device if on_device else "cpu").manual_seed(SEED)

    def randn(*size, scale=1.0, shift=0.0):
        if on_device:
            return torch.randn(*size, generator=g, device=device, dtype=dtype).mul_(scale).add_(shift)
        return (torch.randn(*size, generator=g) * scale + shift).to(dtype)

    def randint(high, *size):
        return torch.randint(0, high, size, generator=g, device=g.device)

    if op == "logits":
        N, V = shape
        logits = randn(N, V, scale=3.0).requires_grad_()
        return (logits, randint(V, N)), [logits]
    N, H, V = shape
    hidden = randn(N, H).requires_grad_()
    weight = randn(V, H, scale=3 / math.sqrt(H)).requires_grad_()
    labels = randint(V, N)
    if op in ("linear", "linear-autocast"):
        return (hidden, weight, labels), [hidden, weight]
    B, T = 2, N // 2  # loss: N = B * T tokens, [B, T] token arguments
    hidden = hidden.detach().view(B, T, H).requires_grad_()
    old = randn(B, T, scale=0.1, shift=-12.0).float()  # about log(1 / V): near the policy's logp
    adv = randn(B, 1).float().expand(B, T).contiguous()  # one advantage per sequence (GRPO)
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


def ceilings(device, small=False):
    """Copy bandwidth (GB/s, read + write) and matmul rate (TFLOP/s) measured here, in this run.
    small: tiny sizes (the --smoke run checks the code, not the machine)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    nbytes = (16 << 20) if small else (4 << 30) if device == "cuda" else (512 << 20)
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
    if device == "cuda" and not small:
        a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        flops, dtype = 2 * 8192**3, "bf16"
    elif small:
        a, b = torch.randn(256, 256, device=device), torch.randn(256, 256, device=device)
        flops, dtype = 2 * 256**3, "fp32"
    else:
        a, b = torch.randn(2048, 1024), torch.randn(1024, 4096)  # the torch path's tile shape
        flops, dtype = 2 * 2048 * 1024 * 4096, "fp32"
    mm_s = timed(lambda: a @ b, 10 if device == "cuda" else 5)
    result = {"copy_GBps": 2 * nbytes / copy_s / 1e9, "mm_TFLOPs": flops / mm_s / 1e12, "mm_dtype": dtype}
    if device == "cpu":  # the bf16 rows' ceiling: the same product in bf16 (oneDNN; fp32 accumulation inside)
        a, b = a.bfloat16(), b.bfloat16()
        result["mm_bf16_TFLOPs"] = flops / timed(lambda: a @ b, 10 if small else 5) / 1e12
    return result


def mm_ceiling(ceiling, op, dtype):
    """The matmul rate a row is measured against: the bf16 one (where measured) for bf16 rows and autocast ops."""
    bf16 = dtype == "bfloat16" or op.endswith("-autocast")
    return ceiling.get("mm_bf16_TFLOPs", ceiling["mm_TFLOPs"]) if bf16 else ceiling["mm_TFLOPs"]


def measure_in_process(fn, inputs, leaves, device, warmup, repeats):
    """Time fn(*inputs) and its backward in this process: `warmup` untimed calls, then `repeats` timed ones
    (CUDA events on CUDA, perf_counter elsewhere); peak memory beyond the inputs from the allocator's statistics,
    reset before the first call. -> {"fwd_s", "total_s": medians, "fwd_extra", "total_extra": bytes}."""
    cuda = device == "cuda"
    grad_bytes = sum(t.numel() * t.element_size() for t in leaves)
    memory = Memory(device)
    memory.reset()
    fwd_times, total_times, fwd_peak = [], [], None
    for i in range(warmup + repeats):
        for t in leaves:
            t.grad = None
        if cuda:
            start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            start.record()
        else:
            t0 = time.perf_counter()
        out = fn(*inputs)
        loss = out.sum() if out.dim() else out
        if cuda:
            mid.record()
        else:
            t1 = time.perf_counter()
        if fwd_peak is None:
            fwd_peak = memory.peak_extra()  # first forward: no gradients exist yet
        loss.backward()
        if cuda:
            end.record()
            torch.cuda.synchronize()
            fwd_s, total_s = start.elapsed_time(mid) / 1e3, start.elapsed_time(end) / 1e3
        else:
            fwd_s, total_s = t1 - t0, time.perf_counter() - t0
        del out, loss
        if i >= warmup:
            fwd_times.append(fwd_s)
            total_times.append(total_s)
    return {"fwd_s": statistics.median(fwd_times), "total_s": statistics.median(total_times),
            "fwd_extra": fwd_peak, "total_extra": max(0, memory.peak_extra() - grad_bytes),
            "threads": torch.get_num_threads(), "rounds": repeats}


def run_in_process(device, cases, impl_filter, warmup, repeats, small_ceilings):
    """The GPU runner (also the --smoke run on the CPU): ceilings, then every case's implementations one after
    another in this process. A failing row (out of memory, a compile error) is reported and the rest go on."""
    ceiling = ceilings(device, small=small_ceilings)
    print_header(ceiling, device, torch.get_num_threads())  # rows print as they finish: a time limit keeps them
    rows, eager = [], {}
    for op, shape, dtype in cases:
        impls = {name: fn for name, fn in IMPLS[op]().items() if impl_filter(name)}
        try:
            inputs, leaves = make_inputs(op, shape, getattr(torch, dtype), device)
        except Exception as e:  # e.g. out of memory for the inputs themselves
            for name in impls:
                rows.append((op, shape, dtype, name, {"error": f"inputs: {type(e).__name__}: {e}"[:160]}))
                print_row(rows[-1], ceiling, eager)
            continue
        for name, fn in impls.items():
            try:
                result = measure_in_process(fn, inputs, leaves, device, warmup, repeats)
            except Exception as e:
                result = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]}
            for t in leaves:
                t.grad = None
            if device == "cuda":
                torch.cuda.empty_cache()
            rows.append((op, shape, dtype, name, result))
            print(f"  {op} {shape} {dtype} {name}: {result}", file=sys.stderr, flush=True)
            print_row(rows[-1], ceiling, eager)
        del inputs, leaves
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows, ceiling


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


# -------------------------------------------------------------------------------------------- paged decode attention
# (batch, n_heads, n_kv_heads, head_dim, keys per sequence, block size): Qwen3-0.6B decoding 64 sequences at 1024 keys
PAGED_SHAPE = (64, 16, 8, 128, 1024, 16)
PAGED_SMOKE_SHAPE = (2, 4, 2, 32, 40, 16)
PAGED_CALLS = 20  # calls per timing: one call (~0.1 ms) is too short to time alone


def paged_attention_inputs(shape, dtype, device):
    """(q, k_cache, v_cache, block_tables, seq_lens): a pool holding exactly the batch's blocks, in shuffled order."""
    B, n_heads, n_kv_heads, head_dim, seq_len, block_size = shape
    g = torch.Generator(device=device).manual_seed(SEED)
    max_blocks = -(-seq_len // block_size)
    pool_shape = (B * max_blocks, block_size, n_kv_heads, head_dim)
    k_cache = torch.randn(pool_shape, generator=g, device=device).to(dtype)
    v_cache = torch.randn(pool_shape, generator=g, device=device).to(dtype)
    tables = torch.randperm(B * max_blocks, generator=g, device=device).view(B, max_blocks).to(torch.int32)
    q = torch.randn(B, n_heads, head_dim, generator=g, device=device).to(dtype)
    return q, k_cache, v_cache, tables, torch.full((B,), seq_len, dtype=torch.int32, device=device)


def paged_attention_table(device, ceiling, warmup, repeats, smoke=False):
    """Time ppo_kernels.decode_attention and the torch reference on one decoding step; print a table of physical
    units. Bytes = the K and V each call must read (every key of every sequence once, per kv head); the GB/s are
    against the copy bandwidth measured in this run. The median over `repeats` timings of PAGED_CALLS calls each,
    after `warmup` untimed calls (Triton JIT). Returns the names of the rows that failed."""
    from ppo_kernels import decode_attention, paged_decode_attention_reference
    shape = PAGED_SMOKE_SHAPE if smoke else PAGED_SHAPE
    B, n_heads, n_kv_heads, head_dim, seq_len, block_size = shape
    dtype = torch.bfloat16
    cuda = device == "cuda"
    inputs = paged_attention_inputs(shape, dtype, device)
    calls = 1 if smoke else PAGED_CALLS
    kv_bytes = 2 * B * seq_len * n_kv_heads * head_dim * dtype.itemsize  # [B, L, nkv, hd] keys + values
    print(f"\n## paged decode attention, {device}: B = {B}, {seq_len} keys, {n_heads} q / {n_kv_heads} kv heads of "
          f"{head_dim}, {block_size}-token blocks, bf16; K + V read per call: {kv_bytes / 2**20:.0f} MiB\n")
    print("| impl | us per call | K+V GB/s | % of copy |")
    print("|---|---|---|---|")
    failed = []
    for name, fn in (("ppo_kernels", decode_attention), ("torch reference", paged_decode_attention_reference)):
        try:
            for _ in range(warmup):
                fn(*inputs)
            times = []
            for _ in range(repeats):
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                else:
                    t0 = time.perf_counter()
                for _ in range(calls):
                    fn(*inputs)
                if cuda:
                    end.record()
                    torch.cuda.synchronize()
                    times.append(start.elapsed_time(end) / 1e3 / calls)
                else:
                    times.append((time.perf_counter() - t0) / calls)
            seconds = statistics.median(times)
            gbps = kv_bytes / seconds / 1e9
            print(f"| {name} | {seconds * 1e6:.1f} | {gbps:.0f} | {100 * gbps / ceiling['copy_GBps']:.0f}% |",
                  flush=True)
        except Exception as e:  # e.g. out of memory: the row says so, the run goes on
            print(f"| {name} | failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160] + " | | |")
            failed.append(name)
    return failed


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


def fmt_rate(tflops):
    return f"{tflops:.1f} TFLOP/s" if tflops >= 1 else f"{tflops * 1e3:.1f} GFLOP/s"


def print_header(ceiling, device, threads="?"):
    mm = f"{fmt_rate(ceiling['mm_TFLOPs'])} ({ceiling['mm_dtype']})"
    if "mm_bf16_TFLOPs" in ceiling:
        mm += f", {fmt_rate(ceiling['mm_bf16_TFLOPs'])} (bf16)"
    where = torch.cuda.get_device_name() if device == "cuda" else f"{threads} threads"
    print(f"\n## {device}: copy {ceiling['copy_GBps']:.1f} GB/s, matmul {mm}, {where}, torch {torch.__version__}\n")
    header = ["op", "shape", "dtype", "impl", "fwd ms", "fwd+bwd ms", "fwd rate", "fwd %ceil", "f+b rate",
              "f+b %ceil", "fwd extra MiB", "f+b extra MiB", "time vs eager", "mem vs eager"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header), flush=True)


def print_row(row, ceiling, eager):
    """One table row; eager: (op, shape, dtype) -> the torch-eager result of that shape (filled as rows come)."""
    op, shape, dtype, impl, result = row
    prefix = [op, "x".join(map(str, shape)), dtype, impl]
    if "error" in result:
        print("| " + " | ".join(prefix + [f"failed: {result['error']}"] + [""] * 9) + " |", flush=True)
        return
    if impl == "torch eager":
        eager[(op, shape, dtype)] = result
    byte_units, flop_units = work_units(op, shape)
    rates = []
    for units_index, seconds in ((0, result["fwd_s"]), (1, result["total_s"])):
        if byte_units is not None:
            gbps = byte_units[units_index] * getattr(torch, dtype).itemsize / seconds / 1e9
            rates += [f"{gbps:.1f} GB/s", f"{100 * gbps / ceiling['copy_GBps']:.0f}%"]
        else:
            tflops = flop_units[units_index] / seconds / 1e12
            rates += [fmt_rate(tflops), f"{100 * tflops / mm_ceiling(ceiling, op, dtype):.0f}%"]
    base = eager.get((op, shape, dtype))
    vs = ["", ""]
    if base:
        vs = [f"{result['total_s'] / base['total_s']:.2f}x",
              f"{result['total_extra'] / max(base['total_extra'], 1):.3f}x"]
    print("| " + " | ".join(prefix + [fmt_time(result["fwd_s"]), fmt_time(result["total_s"]), rates[0],
                                      rates[1], rates[2], rates[3], f"{result['fwd_extra'] / 2**20:.0f}",
                                      f"{result['total_extra'] / 2**20:.0f}"] + vs) + " |", flush=True)


def print_table(rows, ceiling, device):
    threads = next((r[-1]["threads"] for r in rows if "threads" in r[-1]), "?")
    print_header(ceiling, device, threads)
    eager = {}
    for row in rows:
        print_row(row, ceiling, eager)


def goals_summary(rows, ceiling):
    """The issue's goals on a GPU, read off the table at the largest N (16384 on CUDA): the logits op's forward
    at >= 85% of the copy bandwidth; the fused linear ops' forward + backward at >= 65% of the matmul rate with
    <= 1/20 of eager's extra memory."""
    results = {(op, shape, impl): r for op, shape, dtype, impl, r in rows if "error" not in r}
    n_goal = max((shape[0] for _, shape, _ in results), default=0)
    print(f"\ngoals (bf16, N = {n_goal}):")
    for (op, shape, impl), r in results.items():
        if impl != "ppo_kernels" or shape[0] != n_goal or op == "linear-autocast":
            continue
        byte_units, flop_units = work_units(op, shape)
        if op == "logits":
            share = byte_units[0] * 2 / r["fwd_s"] / 1e9 / ceiling["copy_GBps"]
            print(f"  token_logprobs forward: {100 * share:.0f}% of copy bandwidth (goal >= 85%): "
                  f"{'met' if share >= 0.85 else 'NOT met'}")
            continue
        share = flop_units[1] / r["total_s"] / 1e12 / ceiling["mm_TFLOPs"]
        eager = results.get((op, shape, "torch eager"))
        memory = r["total_extra"] / max(eager["total_extra"], 1) if eager else float("nan")
        met = share >= 0.65 and memory <= 1 / 20
        name = {"linear": "linear_token_logprobs", "loss": "linear_logprob_loss"}.get(op, op)
        print(f"  {name} forward + backward: {100 * share:.0f}% of the matmul rate (goal >= 65%), extra memory "
              f"{memory:.3f}x eager (goal <= 0.050x): {'met' if met else 'NOT met'}")


def configs(device, quick, smoke=False, medium=False):
    if smoke:  # the GPU runner's cases at toy size, bf16 as on a GPU (the Triton interpreter on the CPU)
        return [("logits", (64, 512), "bfloat16"), ("linear", (64, 64, 512), "bfloat16"),
                ("linear-autocast", (64, 64, 512), "float32"), ("loss", (64, 64, 512), "bfloat16")]
    if device == "cpu":
        # each op in float32, in bfloat16, and (the fused heads) fp32 under bf16 autocast, side by side
        if quick:
            logits, head = (64, 4096), (128, 64, 4096)
        elif medium:  # SmolLM2-135M's head: 1024 kept tokens, H = 576, V = 49152
            logits, head = (1024, 49152), (1024, 576, 49152)
        else:  # the CPU goal shapes
            logits, head = (1024, 151936), (2048, 1024, 151936)
        return [("logits", logits, "float32"), ("logits", logits, "bfloat16"),
                ("linear", head, "float32"), ("linear", head, "bfloat16"), ("linear-autocast", head, "float32"),
                ("loss", head, "float32"), ("loss", head, "bfloat16"), ("loss-autocast", head, "float32")]
    if quick:
        return [("logits", (1024, 151936), "bfloat16"), ("linear", (1024, 1024, 151936), "bfloat16"),
                ("linear-autocast", (1024, 1024, 151936), "float32"), ("loss", (1024, 1024, 151936), "bfloat16")]
    # N = kept tokens per micro-batch: 1024 and 4096 are PPO's usual sizes, where a forward parallel over rows
    # only fills few of the SMs; 16384 is the goal shape, measured first (rows print as they finish, so
    # a time limit cuts the least important ones). H = 4096, V = 151936 (Qwen3-8B's head).
    H, V = 4096, 151936
    return [("logits", (16384, V), "bfloat16"), ("linear", (16384, H, V), "bfloat16"),
            ("loss", (16384, H, V), "bfloat16"),
            ("logits", (4096, V), "bfloat16"), ("linear", (4096, H, V), "bfloat16"),
            ("linear-autocast", (4096, H, V), "float32"), ("loss", (4096, H, V), "bfloat16"),
            ("linear", (1024, H, V), "bfloat16"), ("loss", (1024, H, V), "bfloat16")]


def autocast_summary(rows):
    """The fused heads' forward + backward, ppo_kernels rows: bf16 inputs against fp32 ones (where both were
    measured: the CPU tables), and fp32 inputs under bf16 autocast against bf16 inputs."""
    times = {(op, shape, dtype): r["total_s"] for op, shape, dtype, impl, r in rows
             if impl == "ppo_kernels" and "error" not in r}
    names = {"logits": "token_logprobs", "linear": "linear_token_logprobs", "loss": "linear_logprob_loss"}
    print()
    for (op, shape, dtype), t in times.items():
        where = f"{names[op.removesuffix('-autocast')]} {'x'.join(map(str, shape))}"
        if dtype == "bfloat16" and (op, shape, "float32") in times:
            print(f"{where}: bf16 inputs take {t / times[(op, shape, 'float32')]:.2f}x the fp32-input time")
        base = (op.removesuffix("-autocast"), shape, "bfloat16")
        if op.endswith("-autocast") and base in times:
            ratio = t / times[base]
            verdict = ": the bf16 path" if ratio < 1.5 else ": NOT the bf16 path (fp32 kernels under autocast)"
            print(f"{where}: fp32 inputs under bf16 autocast take {ratio:.2f}x the bf16-input time{verdict}")


def mm_fp32_path(device):
    """How the bf16 backward's fp32-output matmuls run on this torch (ppo_kernels' probe, cached), or None."""
    try:
        from ppo_kernels.linear_logprobs import mm_fp32_path as probe
    except ImportError:  # a ppo_kernels that does not record it
        return None
    try:
        return probe(device, torch.bfloat16)
    except Exception as e:
        return f"probe failed: {type(e).__name__}: {e}"


def selected(op, only):
    """--only OP runs OP and OP-autocast (the same head on fp32 inputs under bf16 autocast)."""
    return not only or op in (only, f"{only}-autocast")


def run_cpu_subprocesses(args):
    """The CPU table: one fresh process per measurement (its own VmHWM), rounds interleaving the rows."""
    ceiling_runs, rows = [], []
    for op, shape, dtype in configs("cpu", args.quick, medium=args.medium):
        if not selected(op, args.only):
            continue
        impl_names = [n for n in IMPLS[op]() if not (args.no_compile and n == "torch.compile")]
        results = {impl: [] for impl in impl_names}
        # Rounds over the implementations, each timed once per round: a shared machine's load drifts over
        # minutes, and interleaving spreads that drift over every row instead of favouring one.
        for round_index in range(args.repeats):
            ceiling_runs.append(run_subprocess(["--ceilings", "cpu"], args.timeout))
            for impl in impl_names:
                compiled = impl == "torch.compile" or impl.startswith("liger LigerFused")
                spec = {"op": op, "impl": impl, "shape": shape, "dtype": dtype, "device": "cpu",
                        "warmup": 1 if compiled else 0, "repeats": 1}
                result = run_subprocess(["--worker", json.dumps(spec)], args.timeout)
                results[impl].append(result)
                print(f"  round {round_index} {op} {shape} {impl}: {result}", file=sys.stderr, flush=True)
        for impl in impl_names:
            rows.append((op, shape, dtype, impl, merge(results[impl])))
    ceiling = {"copy_GBps": max(c.get("copy_GBps", 0) for c in ceiling_runs),
               "mm_TFLOPs": max(c.get("mm_TFLOPs", 0) for c in ceiling_runs),
               "mm_bf16_TFLOPs": max(c.get("mm_bf16_TFLOPs", 0) for c in ceiling_runs),
               "mm_dtype": ceiling_runs[0].get("mm_dtype", "?")}
    return rows, ceiling


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small shapes: check that every row runs")
    parser.add_argument("--medium", action="store_true",
                        help="CPU: SmolLM2-135M's head (N = 1024, H = 576, V = 49152) instead of the goal shapes")
    parser.add_argument("--smoke", action="store_true",
                        help="the CUDA runner (one process, device-made inputs) at toy shapes on --device (cpu: "
                             "ppo_kernels on the Triton interpreter when TRITON_INTERPRET=1 and PPO_KERNELS_BACKEND=triton)")
    parser.add_argument("--only", choices=sorted(IMPLS) + ["paged"],
                        help="run one op (and its -autocast variant); paged: decode attention (CUDA, --smoke)")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile rows")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed calls per row (CUDA, --smoke) or rounds of one call each (CPU)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls before the timed ones (CUDA, --smoke)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds allowed per row (CPU subprocesses)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--ceilings", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    if args.ceilings:
        print(json.dumps(ceilings(args.ceilings)))
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/kernels.py: --device cuda but torch sees no CUDA device")
    paged_failed = []
    if args.device == "cpu" and not args.smoke:
        if args.only == "paged":
            sys.exit("bench/kernels.py: --only paged runs on CUDA (or with --smoke)")
        rows, ceiling = run_cpu_subprocesses(args)
        print_table(rows, ceiling, args.device)
    else:
        cases = [c for c in configs(args.device, args.quick, args.smoke) if selected(c[0], args.only)]
        no_compile = args.no_compile or args.smoke  # the smoke run checks code paths, not inductor on a CPU
        rows, ceiling = run_in_process(args.device, cases, lambda name: not (no_compile and name == "torch.compile"),
                                       args.warmup, args.repeats, small_ceilings=args.smoke)
        if args.only in (None, "paged"):
            paged_failed = paged_attention_table(args.device, ceiling, max(args.warmup, 1), args.repeats,
                                                 smoke=args.smoke)
    if args.only != "paged":  # --only paged: no table of the other ops to sum up
        autocast_summary(rows)
        if args.device == "cuda" or args.smoke:  # the Triton kernels' runs (the CPU tables run the torch paths)
            goals_summary(rows, ceiling)
            path = mm_fp32_path(args.device)
            if path:
                print(f"fp32-output matmul of the bf16 backward on {args.device}: {path}")
    if args.smoke and (any("error" in r[-1] for r in rows) or paged_failed):
        sys.exit("bench/kernels.py --smoke: a row failed (see the table)")


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
