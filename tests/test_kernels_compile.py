"""Every ppo_kernels Triton kernel, compiled for an H100/H200 (sm_90a) and an A100 (sm_80) on a machine without a GPU,
at the launch configurations the public wrappers really use (tests/triton_compile.py records them).

    python -m pytest -q -s tests/test_kernels_compile.py    # ~1-2 min on 2 cores; -s prints the table
    PPO_KERNELS_COMPILE_CHECK=0 python -m pytest ...        # to skip it

The interpreter tier runs the kernels' Python, not the compiler, so what only the compiler sees would first show
up on a GPU: an idiom it rejects, register spills, more shared memory than the card has, or a matmul on CUDA
cores instead of tensor cores. For each compiled variant this asserts that it compiles, that `ptxas -v` (the one
Triton ships, the very run that built the cubin) reports no spill stores or loads, that shared memory fits one
block of the card (227 KB on H100/H200, 163 KB on A100) and that the bf16 variants of the kernels with tl.dot
contain tensor-core instructions (wgmma on sm_90a, mma.sync on sm_80). Nothing is cached across runs.
"""
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
TENSOR_CORE_INSTRUCTION = {"sm_90a": "wgmma", "sm_80": "mma.sync"}

pytestmark = pytest.mark.skipif(os.environ.get("PPO_KERNELS_COMPILE_CHECK") == "0",
                                reason="PPO_KERNELS_COMPILE_CHECK=0")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """The records of tests/triton_compile.py: one per (kernel, arch, specialisation), plus the kernel list."""
    pytest.importorskip("triton")
    out = tmp_path_factory.mktemp("compile") / "variants.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the kernels must be real JIT functions
    proc = subprocess.run([sys.executable, os.path.join(HERE, "triton_compile.py"), "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=os.path.dirname(HERE))
    if proc.returncode == 3 and "SKIP:" in proc.stderr:  # this Triton's JIT internals are not the ones used
        pytest.skip(proc.stderr[proc.stderr.index("SKIP:"):].strip())
    assert proc.returncode == 0, proc.stderr[-5000:]
    print("\n" + proc.stdout)  # the table (shown with -s)
    return json.loads(out.read_text())


def _name(row):
    return f"{row['kernel']} {row['arch']} {'+'.join(row['dtypes'])} [{row['spec']}]"


def test_every_kernel_is_launched_and_compiles(compiled):
    rows = compiled["rows"]
    failed = [f"{_name(r)}: {r['error']}" for r in rows if r["error"]]
    assert not failed, "\n".join(failed)
    for arch in TENSOR_CORE_INSTRUCTION:
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
    # and the block fits the register file: threads * registers <= 64K
    too_many = [_name(r) for r in compiled["rows"]
                if not r["error"] and 32 * r["num_warps"] * r["registers"] > 65536]
    assert not too_many, too_many


def test_shared_memory_fits_the_card(compiled):
    too_big = [f"{_name(r)}: {r['shared'] + r['static_shared']} B > {r['shared_limit']} B" for r in compiled["rows"]
               if not r["error"] and r["shared"] + r["static_shared"] > r["shared_limit"]]
    assert not too_big, "\n".join(too_big)


def test_bf16_matmuls_use_tensor_cores(compiled):
    matmuls = [r for r in compiled["rows"] if not r["error"] and r["uses_dot"] and r["operands"] == "bf16"]
    assert matmuls
    missing = [f"{_name(r)}: {r['tensor_core']}" for r in matmuls
               if TENSOR_CORE_INSTRUCTION[r["arch"]] not in r["tensor_core"].split()]
    assert not missing, "\n".join(missing)


def test_autocast_gives_the_matmul_kernels_bf16_operands(compiled):
    # fp32 hidden states and master weights under bf16 autocast (the trainer's LM head) must reach tl.dot as bf16
    matmuls = [r for r in compiled["rows"] if r["uses_dot"] and "autocast" in r["dtypes"]]
    assert matmuls
    assert all(r["operands"] == "bf16" for r in matmuls), [_name(r) for r in matmuls if r["operands"] != "bf16"]
