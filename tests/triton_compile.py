"""Compile every ppo_kernels Triton kernel for sm_90a (H100/H200) and sm_80 (A100) without a GPU, at the launch
configurations the public wrappers really use, and report what ptxas says about each variant.

    python tests/triton_compile.py                 # prints the table (20-70 s on 2 cores, with their load)
    python tests/triton_compile.py --json out.json # and writes one record per compiled variant

How the launches are found: `JITFunction.run` (what `kernel[grid](...)` calls) is replaced by a recorder that
keeps the kernel, its arguments and its launch keywords and launches nothing; then the public wrappers
(`*_triton`, forward and backward) run on CPU tensors at small but realistic shapes, over every option that
selects a different constexpr. Their outputs are garbage (no kernel ran); only the launches matter.
Each distinct launch is then specialised exactly as `JITFunction.run` does on a GPU (Triton's own
`create_function_from_signature` binder and `_pack_args`: integers equal to 1 become constexprs, integers and
pointers divisible by 16 get `tt.divisibility` 16, integers >= 2^31 become i64) and compiled with
`triton.compile(ASTSource(...), target=GPUTarget("cuda", cap, 32))`, as `JITFunction._do_compile` does.
Pointer alignment comes from the CPU tensors: torch's CPU allocator aligns to 64 bytes, CUDA's to 256 or more,
so a pointer is 16-byte aligned on both exactly when its offset into its storage is.
`linear_logprobs.sm_count` and `paged_attention.sm_count` (the GPU's SM count, which picks the linear forward's
vocabulary splits and paged decode attention's KV splits) are set to the card's while recording; they are the only
device queries on the path. The small shapes give 32-bit integer arguments;
LARGE (N = 16384 tokens, Qwen3's V = 151936, H = 4096: N * V >= 2^31) gives token_logprobs' `stride_outer` as i64,
as a real batch does. Its logits, hidden states and weights are meta tensors (shapes, strides and a data_ptr of
storage offset x element size, no memory), so that launch is recorded from the wrappers as the others are.

Each variant records the MMA instructions of its PTX (`wgmma.mma_async... .f32.bf16.bf16`, `mma.sync...`) with
their operand types, and the input precision its tl.dot asked for (TTIR's `inputPrecision`, "ieee" when absent):
tests/test_kernels_compile.py requires bf16 MMAs of every bf16 launch and what the precision asks for of every
fp32 one. PROBES are launches altered to check that rule itself: a real bf16 launch with its operands cast to
fp32 before tl.dot (it compiles to tf32 MMAs, which the rule must reject) and an fp32 launch asking for tf32.
They are reported apart and not counted among the variants.

Triton's cache is pointed at a fresh temporary directory, so every variant is compiled (and ptxas run) anew;
TRITON_DUMP_PTXAS_LOG=1 makes Triton print the `ptxas -v` log of the very ptxas run that built the cubin.
Must run with TRITON_INTERPRET unset (tests/conftest.py sets it for the other tests): hence a script.
"""
import argparse
import contextlib
import io
import json
import multiprocessing
import os
import re
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

UNSUPPORTED_EXIT_CODE = 3  # this Triton's JIT internals differ: tests/test_kernels_compile.py skips
# Triton reads these when it compiles; set before it is imported.
os.environ.pop("TRITON_INTERPRET", None)
os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

try:  # the JIT's own binder (Triton >= 3.3); without it the specialisation cannot be reproduced faithfully
    from triton.runtime.jit import create_function_from_signature
    assert hasattr(JITFunction, "_pack_args")
except (ImportError, AssertionError):
    print(f"SKIP: triton {triton.__version__} lacks JITFunction's create_function_from_signature/_pack_args",
          file=sys.stderr)
    sys.exit(UNSUPPORTED_EXIT_CODE)

import ppo_kernels.linear_logprobs as linear_logprobs  # noqa: E402
import ppo_kernels.logprobs as logprobs  # noqa: E402
import ppo_kernels.loss as loss  # noqa: E402
import ppo_kernels.paged_attention as paged_attention  # noqa: E402

KERNEL_MODULES = (logprobs, linear_logprobs, loss, paged_attention)
# name: (compute capability, SMs of the card, largest shared memory one block may use (opt-in), in bytes)
ARCHS = {
    "sm_90a": (90, 132, 227 * 1024),  # H100 SXM / H200: 228 KB per SM, 227 KB per block
    "sm_80": (80, 108, 163 * 1024),  # A100: 164 KB per SM, 163 KB per block
}
# (name, tokens N, vocabulary V, hidden H, labels set to IGNORE_INDEX): V >= 4096 gives the BLOCK_V = 4096 launches
# of real vocabularies; "aligned" has N, V and the kept rows (N - ignored) multiples of 16 (Qwen3's V = 151936,
# Llama's 128256), "odd" has none (GPT-2's V = 50257). Any H that is a multiple of 16 specialises as a real one
# (4096) does; a small one keeps the CPU matmuls cheap.
SHAPES = (("aligned", 256, 4112, 64, 16), ("odd", 250, 4100, 64, 7))
# (name, tensors' dtype, autocast dtype or None)
DTYPES = (("fp32", torch.float32, None), ("bf16", torch.bfloat16, None), ("autocast", torch.float32, torch.bfloat16))
TEMPERATURE = 0.7
# linear_logprob_loss's entropy coefficient when the loss reads the entropy (the dz kernel's HAS_ENTROPY variant);
# the loss is the trainer's, ppo_core.algo.policy_loss (the kernels know no loss: any other launches the same)
ENTROPY_COEF = 0.01
# (name, tokens N, vocabulary V, hidden H): a real batch whose [N, V] logits pass 2^31 elements (int64 offsets),
# recorded on meta tensors. linear_logprob_loss is not among its calls: its [rows, V] buffers stay below
# loss.TRITON_LOSS_CHUNK_ELEMENTS (2^26) elements whatever N is, and it picks its rows from the labels' values
# (nonzero), which meta tensors do not have.
LARGE = ("large", 16384, 151936, 4096)
# Paged decode attention, fp32 and bf16 caches of 16-token blocks, 1024 keys per sequence: (name, n_heads,
# n_kv_heads, head_dim, window, batch sizes). The batch picks the KV splits (default_num_splits at the card's SM
# count): Qwen3-0.6B's heads at B = 16 split in 5 (sm_90a) / 4 (sm_80) (partials, then the merge kernel), at B = 256
# in 1 (the split kernel writes the output).
PAGED_SHAPES = (("qwen3-0.6b", 16, 8, 128, None, (16, 256)), ("gqa4-hd64-window", 32, 8, 64, 256, (16,)))
PAGED_BLOCK_SIZE, PAGED_KEYS = 16, 1024
# (what was altered, kernel, dtype of the recorded case, launch keywords replaced, what the rule must say).
# UPCAST is the kernels' own cast of both tl.dot operands to fp32 (the interpreter's branch): on a bf16 launch it
# is the edit that loses the bf16 tensor cores while still compiling to tensor-core instructions (tf32 ones).
PROBES = (
    ("bf16 operands cast to fp32 before tl.dot", "_linear_fwd_kernel", "bf16", {"UPCAST": True}, "reject"),
    ("fp32 operands, tl.dot asks for tf32", "_linear_fwd_kernel", "fp32", {"PRECISION": "tf32"}, "accept"),
)


# ----------------------------------------------------------------------------------------------------------------
# Recording the launches
# ----------------------------------------------------------------------------------------------------------------
def exercise_wrappers():
    """Call every public Triton wrapper, forward and backward, over the options that change a constexpr.

    Yields a case label ("<wrapper> <shape> <dtype>") before each group of calls; the recorder files the
    launches under it. dtype "autocast" is fp32 tensors under bf16 autocast, as the trainer runs the LM head.
    """
    from ppo_core import algo

    gen = torch.Generator().manual_seed(0)

    def randn(*shape, dtype, grad=False):
        return torch.randn(*shape, generator=gen).to(dtype).requires_grad_(grad)

    def labels_for(shape, V, n_ignored):
        labels = torch.randint(0, V, shape, generator=gen)
        ignored = torch.randperm(labels.numel(), generator=gen)[:n_ignored]
        labels.view(-1)[ignored] = logprobs.IGNORE_INDEX  # ignored rows, as prompts and padding give
        return labels

    def backward_through(lp, ent, use_logp, use_entropy):
        sum(t.sum() for t, used in ((lp, use_logp), (ent, use_entropy)) if used).backward()

    # which outputs the loss uses (which upstream gradients reach the backward): both, log-probs, entropy
    grad_kinds = ((True, True), (True, False), (False, True))
    for shape_name, N, V, H, n_ignored in SHAPES:
        B, T = 2, N // 2  # [B, T] token grids for the [B, T, ...] calls
        P = 3  # prompt length: the trainer's response hidden states are [B, P + T, H][:, P - 1 : -1]
        for dtype_name, dtype, autocast in DTYPES:
            case = f"{shape_name} {dtype_name}"
            amp = torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext()

            if not autocast:  # token_logprobs takes its inputs' dtype as it comes
                yield f"token_logprobs {case}"
                for use_logp, use_entropy in grad_kinds:
                    logits = randn(N, V, dtype=dtype, grad=True)  # [N, V]
                    lp, ent = logprobs.token_logprobs_triton(logits, labels_for((N,), V, n_ignored),
                                                             temperature=TEMPERATURE, return_entropy=True)
                    backward_through(lp, ent, use_logp, use_entropy)
                # [B, T, V] logits shifted by one token, as a causal LM's are used: rows of a 3-D strided view
                full = randn(B, T + 1, V, dtype=dtype, grad=True)
                lp, ent = logprobs.token_logprobs_triton(full[:, :-1], labels_for((B, T), V, n_ignored),
                                                         temperature=TEMPERATURE, return_entropy=True)
                backward_through(lp, ent, True, True)

            yield f"linear_token_logprobs {case}"
            for use_logp, use_entropy in grad_kinds:
                hidden, weight = randn(N, H, dtype=dtype, grad=True), randn(V, H, dtype=dtype, grad=True)
                with amp:
                    lp, ent = linear_logprobs.linear_token_logprobs_triton(
                        hidden, weight, labels_for((N,), V, n_ignored), temperature=TEMPERATURE, return_entropy=True)
                backward_through(lp, ent, use_logp, use_entropy)

            yield f"linear_logprob_loss {case}"
            for entropy_coef in (0.0, ENTROPY_COEF):  # the loss reads the log-probs; and the entropy too
                full = randn(B, P + T, H, dtype=dtype, grad=True)
                weight = randn(V, H, dtype=dtype, grad=True)
                mask = (torch.rand(B, T, generator=gen) > 0.2).float()
                old, adv = (randn(B, T, dtype=torch.float32) for _ in range(2))

                def loss_fn(logp, entropy, rows, mask=mask, old=old, adv=adv, entropy_coef=entropy_coef):
                    value, stats = algo.policy_loss(logp, old[rows], adv[rows], mask[rows], dual_clip=3.0,
                                                    agg=algo.Aggregation(num_tokens=mask.sum()))
                    if entropy_coef:
                        value = value - entropy_coef * algo.aggregate(entropy, mask[rows],
                                                                      algo.Aggregation(num_tokens=mask.sum()))
                    return value, stats
                with amp:
                    loss_value, *_ = loss.linear_logprob_loss_triton(
                        full[:, P - 1:-1], weight, labels_for((B, T), V, n_ignored), loss_fn,
                        temperature=TEMPERATURE, need_entropy=entropy_coef != 0)
                loss_value.backward()

    for shape_name, n_heads, n_kv_heads, head_dim, window, batches in PAGED_SHAPES:
        max_blocks = PAGED_KEYS // PAGED_BLOCK_SIZE
        for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            yield f"paged_decode_attention {shape_name} {dtype_name}"
            for B in batches:
                # a small pool that the sequences share (nothing runs): the strides are those of any pool's
                k_cache = torch.zeros(max_blocks, PAGED_BLOCK_SIZE, n_kv_heads, head_dim, dtype=dtype)
                tables = torch.randint(0, max_blocks, (B, max_blocks), generator=gen, dtype=torch.int32)
                paged_attention.paged_decode_attention(
                    randn(B, n_heads, head_dim, dtype=dtype), k_cache, torch.zeros_like(k_cache), tables,
                    torch.full((B,), PAGED_KEYS, dtype=torch.int32), window=window)

    # LARGE: one call of each logits wrapper, both gradients, every row kept (meta tensors cannot select rows)
    shape_name, N, V, H = LARGE
    labels = torch.randint(0, V, (N,), generator=gen)  # a real CPU tensor: _check_labels reads it
    for dtype_name, dtype, autocast in DTYPES:
        if autocast:  # autocast does not apply to meta tensors
            continue
        yield f"token_logprobs {shape_name} {dtype_name}"
        logits = torch.empty(N, V, dtype=dtype, device="meta", requires_grad=True)  # [N, V]: stride_outer = N * V
        backward_through(*logprobs.token_logprobs_triton(logits, labels, temperature=TEMPERATURE,
                                                         return_entropy=True), True, True)
        yield f"linear_token_logprobs {shape_name} {dtype_name}"
        hidden = torch.empty(N, H, dtype=dtype, device="meta", requires_grad=True)
        weight = torch.empty(V, H, dtype=dtype, device="meta", requires_grad=True)
        backward_through(*linear_logprobs.linear_token_logprobs_triton(
            hidden, weight, labels, temperature=TEMPERATURE, return_entropy=True), True, True)


def record_launches(sm_count):
    """[(kernel, args, kwargs, case)] of every `kernel[grid](...)` the wrappers make, none of them launched."""
    launches = []
    case = [None]

    def recorder(self, *args, grid, warmup, **kwargs):
        for arg in args:  # see the module docstring: pointer alignment carries over only from aligned storages
            assert not isinstance(arg, torch.Tensor) or arg.untyped_storage().data_ptr() % 16 == 0
        launches.append((self, args, kwargs, case[0]))
        return None

    real_run = JITFunction.run
    real_sm_counts = {module: module.sm_count for module in (linear_logprobs, paged_attention)
                      if hasattr(module, "sm_count")}
    JITFunction.run = recorder
    for module in real_sm_counts:
        module.sm_count = lambda device: sm_count
    try:
        for case[0] in exercise_wrappers():
            pass
    finally:
        JITFunction.run = real_run
        for module, real_sm_count in real_sm_counts.items():
            module.sm_count = real_sm_count
    return launches


# ----------------------------------------------------------------------------------------------------------------
# Specialising and compiling a launch as the JIT would
# ----------------------------------------------------------------------------------------------------------------
def specialise(kernel, args, kwargs, backend):
    """(signature, constexprs, attrs, options) exactly as JITFunction.run computes them for these arguments."""
    kwargs = dict(kwargs)
    # the option defaults JITFunction.run fills in before binding (those this Triton has)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    for name in ("instrumentation_mode", "fpsan_homomorphic_casts"):
        if hasattr(knobs.compilation, name):
            kwargs[name] = getattr(knobs.compilation, name)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    return signature, constexprs, attrs, options


def _kernel_sources(kernel, seen=None):
    """Source text of a JIT kernel and of every JIT function it calls."""
    seen = set() if seen is None else seen
    if kernel.fn in seen:
        return ""
    seen.add(kernel.fn)
    text = kernel.src
    for name in set(re.findall(r"\b([A-Za-z_]\w*)\s*\(", text)):
        callee = kernel.fn.__globals__.get(name)
        if isinstance(callee, JITFunction):
            text += _kernel_sources(callee, seen)
    return text


def uses_dot(kernel):
    return "tl.dot(" in _kernel_sources(kernel)


def _ptxas_numbers(log, name):
    """Registers, spill store/load bytes, stack bytes and static shared memory from a `ptxas -v` log."""
    start = log.find(f"Compiling entry function '{name}'")
    if start < 0:  # e.g. a cache hit: no ptxas ran
        raise RuntimeError(f"no ptxas -v log for {name} (TRITON_DUMP_PTXAS_LOG unsupported, or cached?): {log!r}")
    section = log[start:]
    spills = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", section)
    registers = re.search(r"Used (\d+) registers", section)
    smem = re.search(r"(\d+) bytes smem", section)
    return dict(registers=int(registers.group(1)), stack=int(spills.group(1)), spill_stores=int(spills.group(2)),
                spill_loads=int(spills.group(3)), static_shared=int(smem.group(1)) if smem else 0)


PTX_TYPES = ("f64", "f32", "tf32", "bf16", "f16", "e4m3", "e5m2", "s32", "s8", "u8")


def mma_instructions(ptx):
    """{opcode: (family, A type, B type)} of the PTX's tensor-core MMAs, e.g.
    'wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16': ('wgmma', 'bf16', 'bf16'),
    'mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32': ('mma.sync', 'tf32', 'tf32').

    Both forms list the types after the shape as D, A, B[, C].
    """
    found = {}
    for opcode in set(re.findall(r"\b(?:wgmma\.mma_async|mma\.sync)(?:\.\w+)+", ptx)):
        types = [part for part in opcode.split(".") if part in PTX_TYPES]
        found[opcode] = ("wgmma" if opcode.startswith("wgmma") else "mma.sync", types[1], types[2])
    return found


def dot_precisions(ttir):
    """The input precision each tt.dot of the TTIR asks for; the TTIR omits the default, "ieee"."""
    precisions = []
    for line in ttir.splitlines():
        if re.search(r"=\s*tt\.dot\s", line):
            asked = re.search(r"inputPrecision = (\w+)", line)
            precisions.append(asked.group(1) if asked else "ieee")
    return precisions


def compile_launch(kernel, signature, constexprs, attrs, options, target):
    """Compile one specialised launch; returns ptxas' numbers, shared memory and the tensor-core instructions."""
    log = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(log):  # TRITON_DUMP_PTXAS_LOG=1: Triton prints ptxas' log here
        compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                  options=options.__dict__)
    seconds = time.perf_counter() - start
    ptx = compiled.asm["ptx"]
    ptx_target = re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1).rstrip(",")
    mma = mma_instructions(ptx)
    result = dict(ptx_target=ptx_target, shared=compiled.metadata.shared, num_warps=compiled.metadata.num_warps,
                  num_stages=compiled.metadata.num_stages,
                  mma=sorted(mma), mma_kinds=sorted(set(mma.values())),  # e.g. [("wgmma", "bf16", "bf16")]
                  dot_precisions=sorted(set(dot_precisions(compiled.asm["ttir"]))),
                  tensor_core=" ".join(sorted({f"{family}.{a}" if a == b else f"{family}.{a}.{b}"
                                               for family, a, b in mma.values()})) or "-",
                  compile_s=round(seconds, 2))
    result.update(_ptxas_numbers(log.getvalue(), compiled.metadata.name))
    return result


def describe(kernel, constexprs):
    """The constexprs of a specialisation (integer arguments equal to 1 included), e.g. 'stride_hh=1 BLOCK_N=128'."""
    short = {True: "1", False: "0"}
    return " ".join(f"{kernel.arg_names[path[0]]}={short.get(value, value) if isinstance(value, bool) else value}"
                    for path, value in sorted(constexprs.items()))


def operand_dtype(signature):
    """Element type of the first floating-point pointer argument (the kernel's main operand)."""
    for arg_type in signature.values():
        if isinstance(arg_type, str) and arg_type[1:] in ("fp32", "bf16", "fp16", "fp64") and arg_type[0] == "*":
            return arg_type[1:]
    return "-"


def all_kernels():
    """Names of every launchable @triton.jit kernel of ppo_kernels: the JIT functions no other one calls."""
    functions = {name: value for module in KERNEL_MODULES for name, value in vars(module).items()
                 if isinstance(value, JITFunction) and value.fn.__module__ == module.__name__}
    called = set()
    for name, fn in functions.items():
        called.update(callee for callee in re.findall(r"\b([A-Za-z_]\w*)\s*\(", fn.src) if callee != name)
    return sorted(name for name in functions if name not in called)


_JOBS = []  # (kernel, signature, constexprs, attrs, options, target) per variant; forked workers read it


def _compile_job(index):
    try:
        return compile_launch(*_JOBS[index])
    except Exception as exc:  # report every failing variant, not just the first
        return dict(error=f"{type(exc).__name__}: {str(exc)[-2000:]}")


def _variant_key(kernel, signature, constexprs, attrs, options):
    return json.dumps([kernel.__name__, signature, sorted(map(str, constexprs.items())),
                       sorted(map(str, attrs.items())), sorted(map(str, options.__dict__.items()))])


def run_all(jobs=1, log=print):
    """Record, specialise and compile every distinct launch for every arch, and the PROBES.

    Returns (variants, probes): one dict per distinct launch and arch, one per probe and arch.
    """
    rows, probes = [], []
    for arch, (capability, sm_count, shared_limit) in ARCHS.items():
        target = GPUTarget("cuda", capability, 32)
        backend = make_backend(target)
        variants = {}  # specialisation key -> row
        launches = record_launches(sm_count)
        for kernel, args, kwargs, case in launches:
            signature, constexprs, attrs, options = specialise(kernel, args, kwargs, backend)
            key = _variant_key(kernel, signature, constexprs, attrs, options)
            dtype = case.split()[-1]
            if key not in variants:
                _JOBS.append((kernel, signature, constexprs, attrs, options, target))
                variants[key] = dict(
                    kernel=kernel.__name__, module=kernel.fn.__module__.split(".")[-1], arch=arch, cases=set(),
                    dtypes=set(), operands=operand_dtype(signature), spec=describe(kernel, constexprs),
                    uses_dot=uses_dot(kernel), shared_limit=shared_limit, job=len(_JOBS) - 1, error=None,
                    # pointer and integer arguments without the divisibility-16 hint; 64-bit integers
                    unaligned=[kernel.arg_names[path[0]] for path, attr in attrs.items()
                               if not attr and signature[kernel.arg_names[path[0]]] != "constexpr"],
                    int64=[name for name, arg_type in signature.items() if arg_type == "i64"])
            variants[key]["cases"].add(case)
            variants[key]["dtypes"].add(dtype)
        for row in variants.values():
            row["cases"], row["dtypes"] = sorted(row["cases"]), sorted(row["dtypes"])
            rows.append(row)
        for what, kernel_name, dtype, replaced, verdict in PROBES:  # the first launch of that kernel and dtype
            kernel, args, kwargs, case = next(launch for launch in launches if launch[0].__name__ == kernel_name
                                              and launch[3].split()[-1] == dtype)
            twin = variants[_variant_key(kernel, *specialise(kernel, args, kwargs, backend))]
            signature, constexprs, attrs, options = specialise(kernel, args, {**kwargs, **replaced}, backend)
            _JOBS.append((kernel, signature, constexprs, attrs, options, target))
            probes.append(dict(probe=what, expect=verdict, kernel=kernel_name, arch=arch, case=case,
                               operands=operand_dtype(signature), spec=describe(kernel, constexprs),
                               uses_dot=uses_dot(kernel), job=len(_JOBS) - 1, twin_job=twin["job"], error=None))
    # the matmul kernels first: they take ~1-2 s each, the others ~0.1-0.3 s
    records = sorted(rows + probes, key=lambda r: not r["uses_dot"])
    if jobs > 1:  # fork: the workers inherit _JOBS (kernels, tensors' specialisations) without pickling them
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            results = list(pool.map(_compile_job, [r["job"] for r in records]))
    else:
        results = [_compile_job(r["job"]) for r in records]
    for record, result in zip(records, results):
        record.update(result)
    for row in rows:
        log(f"FAILED {row['kernel']} {row['arch']}: {row['error'][:300]}" if row["error"] else
            f"compiled {row['kernel']} {row['arch']} {row['operands']} in {row['compile_s']} s")
    return rows, probes


def table(rows):
    head = ("kernel", "arch", "call dtype", "operand", "warps", "stages", "regs", "spill st/ld", "shared B",
            "tc instr", "specialisation")
    lines = []
    modules = [module.__name__.split(".")[-1] for module in KERNEL_MODULES]
    for r in sorted(rows, key=lambda r: (modules.index(r["module"]), r["kernel"], r["arch"], r["dtypes"], r["spec"])):
        if r["error"]:
            lines.append((r["kernel"], r["arch"], "+".join(r["dtypes"]), r["operands"], "", "", "", "", "",
                          "", "COMPILE ERROR"))
            continue
        lines.append((r["kernel"], r["arch"], "+".join(r["dtypes"]), r["operands"], str(r["num_warps"]),
                      str(r["num_stages"]), str(r["registers"]), f"{r['spill_stores']}/{r['spill_loads']}",
                      str(r["shared"] + r["static_shared"]), r["tensor_core"],
                      r["spec"] + (f" | not /16: {','.join(r['unaligned'])}" if r["unaligned"] else "")
                      + (f" | i64: {','.join(r['int64'])}" if r["int64"] else "")))
    widths = [max(len(str(x[i])) for x in (head, *lines)) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*x).rstrip() for x in (head, ["-" * w for w in widths], *lines))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="compiling processes")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="triton-cache-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache  # a fresh cache: every variant is compiled, ptxas run
        start = time.perf_counter()
        rows, probes = run_all(args.jobs, log=lambda line: print(line, file=sys.stderr))
        seconds = time.perf_counter() - start
    print(table(rows))
    for probe in probes:
        print(f"probe ({probe['probe']}; the rule must {probe['expect']} it): {probe['kernel']} {probe['arch']} "
              f"{probe['spec']}: " + (probe["error"] or f"MMA {', '.join(probe['mma']) or 'none'}; tl.dot asks "
                                      f"for {', '.join(probe['dot_precisions'])}"))
    compiled = [r for r in rows if not r["error"]]
    per_arch = ", ".join(f"{arch}: {sum(r['arch'] == arch for r in rows)}" for arch in ARCHS)
    summary = (f"{len(rows)} variants ({per_arch}), {len(rows) - len(compiled)} failed to compile, + {len(probes)} "
               f"probes, in {seconds:.0f} s, triton {triton.__version__}")
    if compiled:
        most = max(compiled, key=lambda r: r["registers"])
        summary += f"; most registers: {most['registers']} ({most['kernel']} {most['arch']} {most['operands']})"
    print(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, probes=probes, kernels=all_kernels(), triton=triton.__version__,
                           seconds=seconds, summary=summary), f)


if __name__ == "__main__":
    main()
