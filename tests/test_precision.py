"""bf16-mixed on the CPU: how dtype='auto' resolves, what really runs in bf16, and how far from float64 it lands.

    python -m pytest -q tests/test_precision.py

bf16-mixed keeps fp32 master weights and runs every matmul under torch.autocast (bf16 operands, fp32
accumulation); on the CPU attention computes in fp32 (ppo_core.model.attention) and the KV cache is fp32. These
tests check that the projections really ran in bf16 in every pass of a real run (a setting that silently stays
fp32 is the easy mistake), that the packed decoding weights are bf16 and decode what autocast's F.linear decodes,
that the forward lands within bf16's rounding of float64, and the two precision records: config.json and the
log. The training loop in both precisions is in test_train.py, test_resume.py and test_distributed.py.
"""
import json
import os
import sys

import pytest
import torch

import ppo_core
from ppo_core import train
from ppo_core.config import build_config
from ppo_core.model import Backbone, KVCache, Linear, cpu_packed_linears

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_generate import CONFIGS, prompts, tiny  # noqa: E402

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
BF16_HALF_ULP = 2.0 ** -9  # bf16 keeps 8 significant bits: rounding moves a value by at most 2^-9 of it


def cpu_flags():
    """The CPU's feature flags as Linux reports them (an independent reading, not torch's)."""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="reads Linux's /proc/cpuinfo")
def test_auto_turns_on_bf16_autocast_exactly_on_cpus_with_amx_or_avx512_bf16():
    flags = cpu_flags()
    fast = torch.backends.mkldnn.is_available() and bool(flags & {"amx_bf16", "amx_tile", "avx512_bf16"})
    auto = train.resolve_precision(build_config(overrides={"device": "cpu"}))
    assert auto.device == "cpu" and auto.param_dtype == torch.float32
    assert auto.autocast_dtype == (torch.bfloat16 if fast else None), flags & {"amx_bf16", "amx_tile", "avx512_bf16"}
    assert ("AMX" in auto.why or "AVX512-BF16" in auto.why) == fast
    forced = train.resolve_precision(build_config(overrides={"device": "cpu", "dtype": "float32"}))
    assert forced.autocast_dtype is None and forced.describe()["matmuls"] == "float32"
    mixed = train.resolve_precision(build_config(overrides={"device": "cpu", "dtype": "bf16-mixed"}))
    assert mixed.autocast_dtype == torch.bfloat16 and mixed.describe() == {
        "device": "cpu", "weights": "float32", "matmuls": "bfloat16", "why": "dtype='bf16-mixed'"}
    with mixed.autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with forced.autocast():
        assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_bf16_mixed_forward_is_within_bf16_rounding_of_float64(name):
    """Logits under CPU bf16 autocast against the same model in float64. Each bf16 rounding moves a value by at most
    2^-9 of it; along the path to a logit a layer rounds about ten times (q/k/v, RoPE, attention output, o_proj,
    gate/up, silu, their product, down_proj) and the LM head once more, so with 4 layers the logits may drift by
    41 * 2^-9 of their scale at worst. The fp32 path must sit at fp32 rounding, and the bf16 one visibly above it (it
    really ran in bf16)."""
    model = tiny(name)
    ids, mask = prompts(P=9)
    real = mask.bool()
    with torch.no_grad():
        exact = tiny(name).double()(ids, mask)[real]
        fp32 = model(ids, mask)[real]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = model(ids, mask)[real]
    scale = exact.abs().max()
    assert mixed.dtype == torch.bfloat16
    fp32_err = ((fp32.double() - exact).abs().max() / scale).item()
    mixed_err = ((mixed.double() - exact).abs().max() / scale).item()
    assert fp32_err < 1e-5
    assert 1e-3 < mixed_err < (4 * 10 + 1) * BF16_HALF_ULP, mixed_err


def record_linear_dtypes():
    """A global forward hook: every ppo_core Linear's output dtype, by whether autograd was recording (the update) or
    not (decoding, scoring). -> (records {"no_grad": set, "grad": set}, the hook's handle)."""
    seen = {"no_grad": set(), "grad": set()}

    def hook(module, args, output):
        if isinstance(module, Linear):
            seen["grad" if torch.is_grad_enabled() else "no_grad"].add(output.dtype)

    return seen, torch.nn.modules.module.register_module_forward_hook(hook)


@pytest.mark.parametrize("dtype, expected", [("float32", torch.float32), ("bf16-mixed", torch.bfloat16)])
def test_every_projection_of_a_real_run_computes_in_the_configured_dtype(tmp_path, dtype, expected):
    """One iteration of the default job, in process: the output of every Linear of policy, reference and critic, in
    the evaluation, the rollout (decoding through the packed weights, the scoring forwards) and the update."""
    seen, handle = record_linear_dtypes()
    try:
        train.run(build_config(overrides={"dtype": dtype, "iterations": "1", "eval_size": "8", "rollout_batch_size": "32",
                                          "minibatch_size": "16", "micro_batch_size": "16", "out": str(tmp_path / "run"),
                                          "progress": "false"}))
    finally:
        handle.remove()
    assert seen == {"no_grad": {expected}, "grad": {expected}}
    with open(tmp_path / "run" / "config.json") as f:
        precision = json.load(f)["precision"]
    assert precision["device"] == "cpu" and precision["weights"] == "float32"
    assert precision["matmuls"] == str(expected).replace("torch.", "") and precision["why"] == f"dtype='{dtype}'"


@needs_onednn
@pytest.mark.parametrize("name", ["qwen3", "olmo3"])
def test_packed_decoding_weights_are_bf16_under_cpu_autocast_and_decode_as_f_linear(name):
    """Entered under CPU autocast, cpu_packed_linears packs bf16 copies; the packed matmuls and autocast's F.linear
    both multiply bf16 operands with fp32 accumulation in oneDNN, so prefill logits agree to the last bf16 bit
    but for accumulation order (one bf16 ulp of the largest logit, 2^-8 of it) and greedy decoding gives the same
    tokens; the KV cache that generate keeps on the CPU is fp32 (attention computes in fp32 there)."""
    model = tiny(name)
    ids, mask = prompts(P=9)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        plain = model(ids, mask)
        with cpu_packed_linears(model, ids.shape[0]):
            assert model.lm_head.packed_weight.dtype == torch.bfloat16
            assert model.model.layers[0].self_attn.packed_qkv[0].dtype == torch.bfloat16
            packed = model(ids, mask)
        tokens = ppo_core.generate(model, ids, 8, attention_mask=mask, greedy=True, stop_at_eos=False)
        unpacked = ppo_core.generate(model, ids, 8, attention_mask=mask, greedy=True, stop_at_eos=False,
                                     cpu_packed_weights=False)
    assert packed.dtype == plain.dtype == torch.bfloat16
    real = mask.bool()
    ulp = 2.0 ** -8 * plain[real].float().abs().max()
    assert (packed[real].float() - plain[real].float()).abs().max() <= ulp
    assert torch.equal(tokens, unpacked)

    caches = []
    init = KVCache.__init__

    def spy(self, *args, **kwargs):  # the real constructor; only the dtype it got is noted
        init(self, *args, **kwargs)
        caches.append(self.k.dtype)

    KVCache.__init__ = spy
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            ppo_core.generate(model, ids, 2, attention_mask=mask, greedy=True)
    finally:
        KVCache.__init__ = init
    assert caches == [torch.float32]


def count_scoring_forwards():
    """A global forward hook counting full-sequence backbone forwards made without autograd (the rollout's scoring
    passes: policy, reference, critic); decoding passes a KV cache and is not counted."""
    count = [0]

    def hook(module, args, output):
        if isinstance(module, Backbone) and not torch.is_grad_enabled() and (len(args) < 3 or args[2] is None):
            count[0] += 1

    return count, torch.nn.modules.module.register_module_forward_hook(hook)


@pytest.mark.parametrize("dtype, bound", [("float32", 1e-5), ("bf16-mixed", 0.05)])
def test_old_logprobs_from_rollout_skips_the_policy_forward_and_reports_the_ratio_deviation(tmp_path, dtype, bound):
    """With old_logprobs_from_rollout the rollout runs the reference and critic forwards only (2 per micro-batch
    instead of 3), the old log-probs being the decoding pass's. The first minibatch's ratio then deviates from 1 by
    the difference between decoding (KV cache, one token at a time, packed weights) and the training forward: fp32
    rounding in float32 (measured 4e-6); in bf16, the two paths' logits are rounded to bf16 from slightly different
    fp32 values: up to 2^-9 * 10 ~ 0.02 for the demo's logits of up to ~10, twice in a log-prob (the label's logit
    and the log-sum-exp), so |ratio - 1| < e^0.04 - 1 < 0.05 (measured 0.007). The mean entropy likewise."""
    base = {"dtype": dtype, "iterations": "2", "eval_size": "8", "rollout_batch_size": "32", "minibatch_size": "16",
            "micro_batch_size": "16", "progress": "false"}
    runs = {}
    for flag in ("false", "true"):
        count, handle = count_scoring_forwards()
        try:
            train.run(build_config(overrides={**base, "old_logprobs_from_rollout": flag, "out": str(tmp_path / flag)}))
        finally:
            handle.remove()
        with open(tmp_path / flag / "metrics.jsonl") as f:
            runs[flag] = (count[0], [json.loads(line) for line in f])
    (exact_count, exact), (decoded_count, decoded) = runs["false"], runs["true"]
    assert exact_count == 2 * 2 * 3 and decoded_count == 2 * 2 * 2  # iterations x micro-batches x forwards
    assert all(m["policy/first_ratio_max_dev"] == 0.0 for m in exact)  # recomputed: exactly 1 on the CPU
    devs = [m["policy/first_ratio_max_dev"] for m in decoded]
    assert all(d < bound for d in devs), devs
    assert decoded[0]["reward/mean"] == exact[0]["reward/mean"]  # the same samples: only the old log-probs differ
    assert decoded[0]["entropy/mean"] == pytest.approx(exact[0]["entropy/mean"], rel=0, abs=bound)


def test_a_run_resumed_where_auto_resolves_differently_says_so(tmp_path):
    """dtype='auto' is the same config on every machine, so a run started on a CPU with AVX512-BF16 continues on one
    without (or on a GPU): RunDir re-opens it, and the log says the continuation is not bit-exact."""
    from ppo_core.runlog import RunDir

    cfg = build_config(overrides={"out": str(tmp_path / "run")})
    here = {"device": "cpu", "weights": "float32", "matmuls": "bfloat16", "why": "dtype='auto': ... (AVX512-BF16)"}
    there = {**here, "matmuls": "float32", "why": "dtype='auto': this CPU has neither AMX nor AVX512-BF16"}
    assert RunDir.open(cfg, train.DEMO_CHECKPOINT, precision=here).precision_changed is None
    with open(tmp_path / "run" / "config.json") as f:
        assert json.load(f)["precision"] == here
    assert RunDir.open(cfg, train.DEMO_CHECKPOINT, precision=here).precision_changed is None
    line = RunDir.open(cfg, train.DEMO_CHECKPOINT, precision=there).precision_changed
    assert line.startswith("this run started with bfloat16 matmuls") and "continues with float32" in line
    assert "not a bit-exact continuation" in line
