"""Compile every ppo_kernels Triton kernel for an H100/H200 (sm_90) on a machine without a GPU.

    python -m pytest -q tests/test_kernels_compile.py       # ~20 s on 2 cores (then Triton's cache)
    PPO_KERNELS_COMPILE_CHECK=0 python -m pytest ...       # to skip it

The interpreter tier runs the kernels' Python, not the compiler, so an idiom the compiler rejects (a loop-carried
type change, a bad constexpr branch, too much shared memory) would first show up on a GPU. This check runs the
whole Triton pipeline to a cubin for sm_90 (Triton ships its ptxas). It needs TRITON_INTERPRET unset when the
kernels are defined, so it runs in a subprocess.
"""
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import os
    os.environ.pop("TRITON_INTERPRET", None)
    import torch, triton
    from triton.compiler import ASTSource
    from triton.backends.compiler import GPUTarget
    import ppo_kernels.linear_logprobs as linear
    import ppo_kernels.logprobs as logprobs
    import ppo_kernels.loss as loss

    target = GPUTarget("cuda", 90, 32)

    def build(kernel, signature, constexprs, options=None):
        triton.compile(ASTSource(kernel, signature, constexprs), target=target, options=options or {})

    for dt in ("fp32", "bf16"):
        rows = {"logits_ptr": f"*{dt}", "stride_outer": "i64", "stride_inner": "i64", "rows_per_outer": "i32",
                "labels_ptr": "*i64"}
        build(logprobs._token_logprobs_fwd_kernel, dict(rows, logprobs_ptr="*fp32", entropy_ptr="*fp32",
              lse_ptr="*fp32", V="i32", temperature="fp32"), {"BLOCK_V": 4096}, {"num_warps": 8})
        for g_logp, g_ent in ((True, True), (True, False), (False, True)):
            build(logprobs._token_logprobs_bwd_kernel, dict(rows, lse_ptr="*fp32", entropy_ptr="*fp32",
                  grad_logprobs_ptr="*fp32", grad_entropy_ptr="*fp32", dlogits_ptr=f"*{dt}", V="i32",
                  temperature="fp32"), {"HAS_GRAD_LOGPROBS": g_logp, "HAS_GRAD_ENTROPY": g_ent, "BLOCK_V": 4096},
                  {"num_warps": 8})
        opts = linear._triton_options(torch.float32 if dt == "fp32" else torch.bfloat16)
        launch = {"num_warps": opts.pop("num_warps"), "num_stages": opts.pop("num_stages")}
        operands = {"h_ptr": f"*{dt}", "stride_hn": "i64", "stride_hh": "i64", "w_ptr": f"*{dt}",
                    "stride_wv": "i64", "stride_wh": "i64", "labels_ptr": "*i64"}
        build(linear._linear_fwd_kernel, dict(operands, logprobs_ptr="*fp32", entropy_ptr="*fp32",
              lse_ptr="*fp32", N="i32", V="i32", H="i32", temperature="fp32"), opts, launch)
        build(linear._linear_dz_kernel, dict(operands, lse_ptr="*fp32", entropy_ptr="*fp32",
              grad_logprobs_ptr="*fp32", grad_entropy_ptr="*fp32", dz_ptr=f"*{dt}", stride_dn="i64", N="i32",
              V="i32", H="i32", v0="i32", temperature="fp32"),
              dict(opts, HAS_GRAD_LOGPROBS=True, HAS_GRAD_ENTROPY=True), launch)
    for dual, kl, kind in ((True, True, 3), (False, False, 1), (True, True, 1), (False, True, 2)):
        build(loss._policy_loss_kernel, {"logp_ptr": "*fp32", "old_ptr": "*fp32", "adv_ptr": "*fp32",
              "weight_ptr": "*fp32", "mask_ptr": "*fp32", "ref_ptr": "*fp32", "grad_ptr": "*fp32",
              "partials_ptr": "*fp32", "N": "i32", "clip_low": "fp32", "clip_high": "fp32", "dual_clip": "fp32",
              "kl_coef": "fp32"}, {"HAS_DUAL": dual, "HAS_KL": kl, "KL_KIND": kind, "BLOCK": 1024})
    print("compiled")
''')


@pytest.mark.skipif(os.environ.get("PPO_KERNELS_COMPILE_CHECK") == "0", reason="PPO_KERNELS_COMPILE_CHECK=0")
def test_kernels_compile_for_sm90():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]
