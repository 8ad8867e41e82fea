"""Every ppo_kernels Triton kernel, compiled for an H100/H200 (sm_90a) and an A100 (sm_80) on a machine without a GPU,
at the launch configurations the public wrappers really use (tests/triton_compile.py records them).

    python -m pytest -q -s tests/test_kernels_compile.py    # ~1 min on 2 cores; -s prints the table
    PPO_KERNELS_COMPILE_CHECK=0 python -m pytest ...        # to skip it

The interpreter tier runs the kernels' Python, not the compiler, so what only the compiler sees would first show
up on a GPU: an idiom it rejects, register spills, more shared memory than the card has, or a matmul on the wrong
units. For each compiled variant this asserts that it compiles, that `ptxas -v` (the one Triton ships, the very
run that built the cubin) reports no spill stores or loads and registers at least REGISTER_MARGIN below ptxas'
cap, that shared memory fits one block of the card (227 KB on H100/H200, 163 KB on A100), and that each kernel
with tl.dot has the MMA instructions its launch calls for (`tensor_core_problem`): bf16 ones (`wgmma ... .bf16.bf16`
on sm_90a, `mma.sync ... .bf16.bf16` on sm_80) for bf16 operands, none for fp32 operands whose tl.dot asks for
"ieee". The variants include a batch whose [N, V] logits pass 2^31 elements (64-bit offsets); probes (altered
launches, tests/triton_compile.py PROBES) check the tensor-core rule itself. Nothing is cached across runs. The
run's summary line (the variant count, the most registers) is printed to the terminal; bench/results/kernels-compile.md quotes it.
"""
import contextlib
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
# the MMA instructions a matmul kernel must use on each arch (mma.sync also exists on sm_90a, at a lower rate)
TENSOR_CORE_FAMILY = {"sm_90a": "wgmma", "sm_80": "mma.sync"}
# the MMA operand type each tl.dot input precision gives fp32 operands; "ieee" is exact fp32 products on the FMA units
PRECISION_MMA_TYPE = {"ieee": None, "tf32": "tf32", "tf32x3": "tf32", "bf16x3": "bf16", "bf16x6": "bf16"}
# ptxas gives a thread at most 255 registers (fewer when the block's threads would overflow the 64K register file)
# and spills beyond that. A variant must stay this many below: at the cap, ptxas has already been squeezing, and
# the next live value added to the kernel spills. 15 (limit 240 at <= 8 warps, 6%) is a choice, not a derivation:
# it flags the variants the audit found at 250-255 while leaving today's kernels room. It cannot absorb a Triton
# upgrade (one bf16 _linear_dz_kernel variant on sm_90a: 202 registers under triton 3.9, 107 under 3.6): run this
# under each Triton the GPUs will use.
REGISTER_MARGIN = 15

pytestmark = pytest.mark.skipif(os.environ.get("PPO_KERNELS_COMPILE_CHECK") == "0",
                                reason="PPO_KERNELS_COMPILE_CHECK=0")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, request):
    """The records of tests/triton_compile.py: one per (kernel, arch, specialisation), the probes, the kernel list."""
    pytest.importorskip("triton")
    out = tmp_path_factory.mktemp("compile") / "variants.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the kernels must be real JIT functions
    proc = subprocess.run([sys.executable, os.path.join(HERE, "triton_compile.py"), "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=os.path.dirname(HERE))
    if proc.returncode == 3 and "SKIP:" in proc.stderr:  # this Triton's JIT internals are not the ones used
        pytest.skip(proc.stderr[proc.stderr.index("SKIP:"):].strip())
    assert proc.returncode == 0, proc.stderr[-5000:]
    print("\n" + proc.stdout)  # the table (shown with -s)
    records = json.loads(out.read_text())
    # the summary line (the variant count documents quote), shown with or without -s
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print(f"\ntests/triton_compile.py: {records['summary']}")
    return records


def _name(row):
    return f"{row['kernel']} {row['arch']} {'+'.join(row['dtypes'])} [{row['spec']}]"


def register_limit(num_warps):
    """The most registers per thread a variant may use: ptxas' cap for its block size, less REGISTER_MARGIN."""
    return min(255, 65536 // (32 * num_warps)) - REGISTER_MARGIN


def tensor_core_problem(record):
    """None if a tl.dot kernel's MMA instructions are those its launch calls for, else what is wrong.

    bf16 operands: bf16 MMAs (A and B) of the arch's family, and no other MMA: a tf32 one means the operands were
    widened to fp32 before tl.dot (half the bf16 rate, and not the precision the caller chose). fp32 operands: what
    tl.dot's input precision asks for: "ieee" no MMA at all, "tf32" tf32 MMAs of the arch's family.
    """
    if record["operands"] == "bf16":
        wanted = "bf16"
    elif record["operands"] == "fp32":
        asked = {PRECISION_MMA_TYPE.get(precision, "?") for precision in record["dot_precisions"]}
        if len(asked) != 1 or "?" in asked:  # one precision per kernel, a known one
            return f"tl.dot input precisions {record['dot_precisions']}, not one of {set(PRECISION_MMA_TYPE)}"
        wanted = asked.pop()
    else:
        return f"no rule for {record['operands']} operands"
    expected = {(TENSOR_CORE_FAMILY[record["arch"]], wanted, wanted)} if wanted else set()
    if {tuple(kind) for kind in record["mma_kinds"]} != expected:
        return (f"{record['operands']} operands, tl.dot asks for {'/'.join(record['dot_precisions'])}: wants "
                f"{' '.join('.'.join(kind) for kind in expected) or 'no MMA'}, the PTX has "
                f"{', '.join(record['mma']) or 'no MMA'}")
    return None


def test_every_kernel_is_launched_and_compiles(compiled):
    rows = compiled["rows"]
    failed = [f"{_name(r)}: {r['error']}" for r in rows if r["error"]]
    assert not failed, "\n".join(failed)
    for arch in TENSOR_CORE_FAMILY:
        launched = {r["kernel"] for r in rows if r["arch"] == arch}
        # a kernel no wrapper call reached would not be checked at all
        assert launched == set(compiled["kernels"]), (arch, set(compiled["kernels"]) ^ launched)
        for kernel in {r["kernel"] for r in rows if r["uses_dot"]}:
            operands = {r["operands"] for r in rows if r["arch"] == arch and r["kernel"] == kernel}
            assert {"fp32", "bf16"} <= operands, (kernel, arch, operands)
    assert all(r["ptx_target"] == r["arch"] for r in rows), {(r["kernel"], r["ptx_target"]) for r in rows}


def test_no_register_spills(compiled):
    spilling = [f"{_name(r)}: {r['registers']} registers, {r['spill_stores']} B spill stores, "
                f"{r['spill_loads']} B spill loads" for r in compiled["rows"]
                if not r["error"] and (r["spill_stores"] or r["spill_loads"])]
    assert not spilling, "\n".join(spilling)


def test_registers_leave_a_margin_below_the_cap(compiled):
    rows = [r for r in compiled["rows"] if not r["error"]]
    near_cap = [f"{_name(r)}: {r['registers']} registers > {register_limit(r['num_warps'])} ({r['num_warps']} warps)"
                for r in rows if r["registers"] > register_limit(r["num_warps"])]
    assert not near_cap, "\n".join(near_cap)


def test_shared_memory_fits_the_card(compiled):
    too_big = [f"{_name(r)}: {r['shared'] + r['static_shared']} B > {r['shared_limit']} B" for r in compiled["rows"]
               if not r["error"] and r["shared"] + r["static_shared"] > r["shared_limit"]]
    assert not too_big, "\n".join(too_big)


def test_matmuls_use_the_tensor_cores_their_launch_calls_for(compiled):
    matmuls = [r for r in compiled["rows"] if not r["error"] and r["uses_dot"]]
    for arch in TENSOR_CORE_FAMILY:
        assert {"bf16", "fp32"} <= {r["operands"] for r in matmuls if r["arch"] == arch}, arch
    wrong = [f"{_name(r)}: {tensor_core_problem(r)}" for r in matmuls if tensor_core_problem(r)]
    assert not wrong, "\n".join(wrong)


def test_fp32_matmuls_ask_for_exact_products(compiled):
    # linear_logprobs._triton_options: fp32 inputs get "ieee" products (tf32 misses the 1e-5 log-prob tolerance).
    # The interpreter tests run "ieee" whatever the GPU options say, so a switch to tf32 would show only here.
    fp32 = [r for r in compiled["rows"] if not r["error"] and r["uses_dot"] and r["operands"] == "fp32"]
    assert fp32 and all(r["dot_precisions"] == ["ieee"] for r in fp32), \
        [f"{_name(r)}: {r['dot_precisions']}" for r in fp32 if r["dot_precisions"] != ["ieee"]]


def test_tensor_core_rule_rejects_tf32_in_a_bf16_kernel(compiled):
    # The probes (tests/triton_compile.py PROBES): a real bf16 launch of _linear_fwd_kernel with both tl.dot
    # operands cast to fp32 (UPCAST=1), which compiles to tf32 MMAs of the right family (a search for
    # "wgmma" / "mma.sync" alone accepts it), must be rejected, its unmodified launch accepted; an fp32 launch
    # asking for tf32 must be accepted (tf32 MMAs), as its "ieee" launch is (no MMA).
    jobs = {r["job"]: r for r in compiled["rows"]}
    probes = compiled["probes"]
    assert {(p["expect"], p["arch"]) for p in probes} == {(e, a) for e in ("reject", "accept")
                                                          for a in TENSOR_CORE_FAMILY}
    for probe in probes:
        assert not probe["error"], f"{probe['probe']} {probe['arch']}: {probe['error']}"
        twin = jobs[probe["twin_job"]]
        assert tensor_core_problem(twin) is None, (_name(twin), tensor_core_problem(twin))
        assert (TENSOR_CORE_FAMILY[probe["arch"]], "tf32", "tf32") in {tuple(kind) for kind in probe["mma_kinds"]}, \
            (probe["probe"], probe["arch"], probe["mma"])
        verdict = "reject" if tensor_core_problem(probe) else "accept"
        assert verdict == probe["expect"], (probe["probe"], probe["arch"], probe["mma"], tensor_core_problem(probe))


def test_autocast_gives_the_matmul_kernels_bf16_operands(compiled):
    # fp32 hidden states and master weights under bf16 autocast (the trainer's LM head) must reach tl.dot as bf16
    matmuls = [r for r in compiled["rows"] if r["uses_dot"] and "autocast" in r["dtypes"]]
    assert matmuls
    assert all(r["operands"] == "bf16" for r in matmuls), [_name(r) for r in matmuls if r["operands"] != "bf16"]


def test_large_vocabulary_batch_compiles_with_64_bit_offsets(compiled):
    # N * V >= 2^31 logits (16384 tokens x 151936): token_logprobs' row offsets are i64 arguments there. The
    # spill, register and shared-memory tests above cover these variants as every other.
    for arch in TENSOR_CORE_FAMILY:
        for dtype in ("bf16", "fp32"):
            large = [r for r in compiled["rows"] if r["arch"] == arch and f"token_logprobs large {dtype}" in r["cases"]]
            assert {r["kernel"] for r in large} == {"_token_logprobs_fwd_kernel", "_token_logprobs_bwd_kernel"}
            assert all("stride_outer" in r["int64"] and not r["error"] for r in large), [_name(r) for r in large]
        linear = [r for r in compiled["rows"] if r["arch"] == arch and "linear_token_logprobs large bf16" in r["cases"]]
        assert {"_linear_fwd_kernel", "_linear_dz_kernel"} <= {r["kernel"] for r in linear}
