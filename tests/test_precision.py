"""bf16-mixed on the CPU: how dtype='auto' resolves, what really runs in bf16, and how far from float64 it lands.

    python -m pytest -q tests/test_precision.py

bf16-mixed keeps fp32 master weights and runs every matmul under torch.autocast (bf16 operands, fp32
accumulation); on the CPU attention computes in fp32 (ppo_core.models.model.attention) and the KV cache is fp32. These
tests check that the projections really ran in bf16 in every pass of a real run (a setting that silently stays
fp32 is the easy mistake), that the packed decoding weights are bf16 and decode what autocast's F.linear decodes,
that the forward lands within bf16's rounding of float64, and the two precision records: config.json and the
log. The training loop in both precisions is in test_train.py, test_resume.py and test_distributed.py.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

import ppo_core
from ppo_core import train
from ppo_core.config import build_config
from ppo_core.models.precision import bf16_matmul_hardware, precision_line, resolve_precision
from ppo_core.models.model import Backbone, KVCache, Linear, can_pack_for_cpu, cpu_packed_linears, onednn_bf16_supported

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


# Environment settings that make torch and oneDNN on any x86 CPU behave as on an AVX2-only one (e.g. AMD Zen 3):
# ATen's vectorised kernels at AVX2, oneDNN capped at AVX2 (so it runs no bf16: packing bf16 weights raises there).
AS_ON_AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
RESOLVE_AUTO = ("import json; from ppo_core.models import precision; from ppo_core.config import build_config; "
                "p = precision.resolve_precision(build_config(overrides={'device': 'cpu'})); "
                "print(json.dumps({**p.describe(), 'line': precision.precision_line(p)}))")


def resolve_auto(env):
    """dtype='auto' resolved in a fresh Python under `env` (oneDNN reads its ISA cap once, at start-up)."""
    clean = {k: v for k, v in os.environ.items() if k not in AS_ON_AVX2}
    proc = subprocess.run([sys.executable, "-c", RESOLVE_AUTO], env={**clean, **env}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="reads Linux's /proc/cpuinfo")
def test_auto_turns_on_bf16_autocast_exactly_on_cpus_where_onednn_runs_amx_or_avx512_bf16():
    """Against Linux's own reading of the CPU: bf16 where the CPU has AMX or AVX512-BF16 and oneDNN can use it
    (AVX512-BW/VL/DQ or AVX-NE-CONVERT), float32 elsewhere; and float32 on every CPU once oneDNN and ATen are
    capped at AVX2, as on an AVX2-only CPU."""
    flags = cpu_flags()
    onednn_bf16 = {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags
    fast = torch.backends.mkldnn.is_available() and onednn_bf16 and bool(flags & {"amx_bf16", "amx_tile", "avx512_bf16"})
    auto = resolve_auto({})
    assert auto["device"] == "cpu" and auto["weights"] == "float32"
    assert auto["matmuls"] == ("bfloat16" if fast else "float32"), (auto, sorted(flags & {"avx512_bf16", "amx_bf16"}))
    # the line names the hardware it found, or says it found neither (a message that names both, in the negative)
    assert auto["why"].startswith("dtype='auto': bf16 matmuls are fast here (") == fast
    assert ("neither AMX nor AVX512-BF16" in auto["why"]) == (not fast)
    capped = resolve_auto(AS_ON_AVX2)
    assert capped["matmuls"] == "float32" and capped["line"].startswith("float32 throughout (dtype='auto': ")


@pytest.mark.parametrize("onednn, amx, avx512_bf16, expected", [
    (True, True, True, "AMX"), (True, False, True, "AVX512-BF16"), (True, False, False, ""),
    (False, True, True, ""), (False, False, True, "")])
def test_auto_follows_the_probes_on_every_cpu(monkeypatch, onednn, amx, avx512_bf16, expected):
    """Both branches of dtype='auto' on every machine, the probes' answers forced: bf16 only where oneDNN runs bf16
    and the CPU has AMX or AVX512-BF16; and each run's first lines name the kernels bf16-mixed runs on."""
    monkeypatch.setattr(ppo_core.models.precision, "onednn_bf16_supported", lambda: onednn)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    assert bf16_matmul_hardware("cpu") == expected
    auto = resolve_precision(build_config(overrides={"device": "cpu"}))
    assert auto.autocast_dtype == (torch.bfloat16 if expected else None) and auto.param_dtype == torch.float32
    assert (expected in auto.why) if expected else "neither AMX nor AVX512-BF16" in auto.why
    mixed = resolve_precision(build_config(overrides={"device": "cpu", "dtype": "bf16-mixed"}))
    kernels = "on oneDNN's bf16 kernels, packed weights" if onednn else "on torch's generic kernels, unpacked weights"
    assert mixed.autocast_dtype == torch.bfloat16 and kernels in precision_line(mixed)
    forced = resolve_precision(build_config(overrides={"device": "cpu", "dtype": "float32"}))
    assert forced.autocast_dtype is None and forced.describe()["matmuls"] == "float32"
    assert mixed.describe() == {"device": "cpu", "weights": "float32", "matmuls": "bfloat16", "why": "dtype='bf16-mixed'"}
    with mixed.autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with forced.autocast():
        assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("onednn", [True, False])
def test_decoding_packs_bf16_weights_only_where_onednn_runs_bf16(monkeypatch, onednn):
    """Under bf16 autocast the packed copies would be bf16, which oneDNN packs only on CPUs it runs bf16 on (elsewhere
    `_reorder_linear_weight` raises): generate then multiplies with autocast's F.linear, the same bf16 products.
    float32 weights without autocast pack on every CPU."""
    monkeypatch.setattr(ppo_core.models.model, "onednn_bf16_supported", lambda: onednn)
    model = tiny("qwen3")
    assert can_pack_for_cpu(model) == torch.backends.mkldnn.is_available()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert can_pack_for_cpu(model) == (onednn and torch.backends.mkldnn.is_available())


def test_the_default_job_runs_in_bf16_mixed_as_on_an_avx2_only_cpu(tmp_path):
    """The whole default job (shortened) in bf16-mixed with torch and oneDNN behaving as on an AVX2-only CPU, where
    packing bf16 weights raises (`mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or
    avx512bw, ...`): it runs on the generic kernels, says so in its first lines, and writes its summary."""
    clean = {k: v for k, v in os.environ.items() if k not in AS_ON_AVX2}
    proc = subprocess.run([sys.executable, "-m", "ppo_core.train", "--dtype=bf16-mixed", "--iterations=1", "--eval_size=8",
                           "--rollout_batch_size=16", "--minibatch_size=16", "--micro_batch_size=16",
                           f"--out={tmp_path / 'run'}"], env={**clean, **AS_ON_AVX2}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    first_lines = proc.stderr.splitlines()[:4]  # the log
    assert any(line.startswith("precision: float32 weights, bfloat16 autocast") and "torch's generic kernels" in line
               for line in first_lines), first_lines
    with open(tmp_path / "run" / "summary.json") as f:
        assert "eval/reward_after" in json.load(f)


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


@pytest.mark.skipif(not onednn_bf16_supported(), reason="oneDNN runs no bf16 on this CPU: it packs no bf16 weights "
                    "(test_decoding_packs_bf16_weights_only_where_onednn_runs_bf16 covers the choice)")
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
    from ppo_core.run.runlog import RunDir

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
