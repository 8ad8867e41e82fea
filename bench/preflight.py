"""Before any GPU step: is everything importable, and does a Triton kernel launch? (bench/gpu_suite.sh step 1)

    python bench/preflight.py

Prints the version of each package the suite uses (or what is missing), the device, and launches one trivial
Triton kernel: its first launch builds Triton's C launcher stub with the system compiler and Python.h, a
failure of its own that would otherwise surface inside the first kernel test. Under Triton's interpreter
(TRITON_INTERPRET=1, the CPU smoke run) a second kernel loops over a bound passed at run time: triton 3.6's
interpreter turns such a bound into a Python int with int() of a 1-element numpy array, which NumPy 2.4 rejects
("only 0-dimensional arrays can be converted to Python scalars"); that pair is reported as
"triton interpreter INCOMPATIBLE with numpy ..." (gpu_suite.sh then does not run its interpreter steps), with
the fix: numpy<2.4 for that triton. Exit status: 2 if ppo_core or ppo_kernels cannot be imported (nothing after
this can run), 1 if something else needed is missing or a kernel fails, 0 otherwise. transformers is optional
(reference rows and parity tests only).
"""
import importlib
import os
import sys
import time

REQUIRED = ["torch", "triton", "numpy", "safetensors", "tokenizers", "jinja2", "pytest"]
OPTIONAL = ["transformers", "liger_kernel", "trl"]


def version_of(name):
    module = importlib.import_module(name)
    return getattr(module, "__version__", "?"), getattr(module, "__file__", "?")


def main():
    status = 0
    print(f"  {'python':<13} {sys.version.split()[0]} ({sys.executable})")
    for name in REQUIRED + OPTIONAL:
        try:
            version, _ = version_of(name)
            print(f"  {name:<13} {version}")
        except Exception as e:
            kind = "optional, " if name in OPTIONAL else ""
            print(f"  {name:<13} MISSING ({kind}{type(e).__name__}: {e})")
            if name in REQUIRED:
                status = 1
    for name in ("ppo_core", "ppo_kernels"):
        try:
            _, path = version_of(name)
            print(f"  {name:<13} {os.path.dirname(path)}")
        except Exception as e:
            print(f"  {name:<13} CANNOT BE IMPORTED: {type(e).__name__}: {e}")
            print("preflight: ppo_core / ppo_kernels are not importable; nothing after this step can run")
            return 2

    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        print(f"  device        {props.name}, sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB, "
              f"{props.multi_processor_count} SMs, CUDA {torch.version.cuda}, "
              f"CUBLAS_WORKSPACE_CONFIG={os.environ.get('CUBLAS_WORKSPACE_CONFIG', '(unset)')}")
        device = "cuda"
    else:
        print(f"  device        CPU only (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')})")
        device = "cpu"
    try:
        import triton
        import triton.language as tl

        @triton.jit
        def add_one(x_ptr, n, BLOCK: tl.constexpr):
            offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            mask = offsets < n
            tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + 1.0, mask=mask)

        x = torch.arange(1000, dtype=torch.float32, device=device)
        t0 = time.perf_counter()
        add_one[(triton.cdiv(1000, 256),)](x, 1000, BLOCK=256)
        ok = torch.equal(x.cpu(), torch.arange(1000, dtype=torch.float32) + 1)
        print(f"  triton kernel {'ran' if ok else 'gave WRONG values'} on {device} "
              f"(first launch, compile included: {time.perf_counter() - t0:.1f} s)")
        status = status or (0 if ok else 1)
    except Exception as e:
        print(f"  triton kernel FAILED: {type(e).__name__}: {str(e)[:300]}")
        status = status or 1
    if os.environ.get("TRITON_INTERPRET") == "1":
        status = interpreter_check() or status
    from ppo_kernels import linear_logprobs
    if device == "cuda" and hasattr(linear_logprobs, "mm_fp32_path"):  # probed once, on a 16x16 matmul
        try:
            print(f"  fp32-output matmul of the bf16 backward: {linear_logprobs.mm_fp32_path(device, torch.bfloat16)}")
        except Exception as e:
            print(f"  fp32-output matmul probe FAILED: {type(e).__name__}: {str(e)[:300]}")
            status = status or 1
    return status


def interpreter_check():
    """Under the interpreter, run a kernel whose loop bound is an argument (its __index__); returns 0 or 1."""
    import numpy as np
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def total(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n, BLOCK):  # n: a run-time bound
            offsets = start + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offsets, mask=offsets < n, other=0.0)
        tl.store(out_ptr, tl.sum(acc, 0))

    x, out = torch.ones(1000), torch.zeros(1)
    try:
        total[(1,)](x, out, 1000, BLOCK=256)
    except Exception as e:  # triton wraps the TypeError in its InterpreterError
        if "0-dimensional" not in str(e):
            print(f"  triton interpreter FAILED on a loop over a run-time bound: {type(e).__name__}: {str(e)[:300]}")
            return 1
        if os.environ.get("STEP_NOTE"):  # the results row of bench/gpu_suite.sh
            with open(os.environ["STEP_NOTE"], "w") as f:
                f.write(f"triton {triton.__version__}'s interpreter INCOMPATIBLE with numpy {np.__version__}\n")
        print(f"  triton interpreter INCOMPATIBLE with numpy {np.__version__}: triton {triton.__version__}'s "
              f"interpreter does int() of a 1-element array, which numpy >= 2.4 rejects ({str(e)[:120]}). "
              f"Kernels cannot run under this interpreter: pip install 'numpy<2.4' (or a triton that squeezes first)")
        return 1
    ok = out.item() == 1000
    print(f"  triton interpreter {'ran' if ok else 'gave a WRONG sum for'} a loop over a run-time bound "
          f"(triton {triton.__version__}, numpy {np.__version__})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
