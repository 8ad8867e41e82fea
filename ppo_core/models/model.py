"""The decoder: one readable transformer for the open families PPO is run on, loaded from and saved to the
Hugging Face layout with exact parity.

    model = load_model("checkpoints/reverse-demo")           # config.json + (sharded) safetensors
    logits = model(input_ids, attention_mask)                 # [B, T, V]
    logits = model(flat_ids, packed=(positions, seq_lens))    # [N, V]: sequences packed without padding
    rm = load_reward_model("Skywork-Reward-V2-Qwen3-8B")      # *ForSequenceClassification
    rewards = rm.score(input_ids, attention_mask)             # [B], the score at the last real token
    model.save_pretrained("out/")                             # loads unchanged in `transformers`
    count_parameters("configs/models/Qwen3-0.6B")    # 596049920, from config.json on the meta device

Families (the `architectures` entry of config.json) and what sets them apart, all as fields of `ModelArgs`:

    Llama / SmolLM2  LlamaForCausalLM     the base: pre-norm RMSNorm, SwiGLU, RoPE (also Llama-3.1 "llama3" scaling)
    Qwen2 / 2.5      Qwen2ForCausalLM     + bias on the q, k, v projections, none on o (`qkv_bias`); optional
                                          sliding-window layers from `max_window_layers` on (`use_sliding_window`)
    Qwen3            Qwen3ForCausalLM     + RMSNorm over each head of q and k (`qk_norm="head"`)
    SmolLM3          SmolLM3ForCausalLM   + no RoPE in every 4th layer (`use_rope[i]` from `no_rope_layers`)
    OLMo (1)         OlmoForCausalLM      LayerNorm without weight or bias (`norm="layernorm"`), `clip_qkv`
    OLMo 2           Olmo2ForCausalLM     norms after attention/MLP (`norm_after`), RMSNorm over all of q and k
                                          (`qk_norm="projection"`)
    OLMo 3           Olmo3ForCausalLM     OLMo 2 + sliding-window layers (`sliding_windows[i]` from `layer_types`)
    reward models    *ForSequenceClassification of each (Skywork-Reward-V2: Llama, Qwen3; RM-R1 and the
                                          R1-distilled judges: Qwen2): a scalar `score` head

Module names mirror the Hugging Face ones (`model.layers.0.self_attn.q_proj.weight`, `lm_head.weight`), so a
checkpoint's tensors map onto parameters by name. One exception: the reward head is `score_head` here (saved and
loaded as HF's `score.weight`) because `ScoreModel.score(...)` is the reward-model reading.

Shapes: B batch, T sequence (new tokens), S keys (cached + new), H hidden, nh query heads, nkv key/value heads,
hs head size, V vocab, L layers.
"""
import functools
import inspect
import itertools
import json
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

# architecture -> family; a family is a set of ModelArgs fields, filled in by ModelArgs.from_hf_config
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "SmolLM3ForCausalLM": "smollm3",
    "OlmoForCausalLM": "olmo",
    "Olmo2ForCausalLM": "olmo2",
    "Olmo3ForCausalLM": "olmo3",
    # reward models and critics: the backbone plus a one-label `score` head
    "LlamaForSequenceClassification": "llama",
    "Qwen2ForSequenceClassification": "qwen2",
    "Qwen3ForSequenceClassification": "qwen3",
    "SmolLM3ForSequenceClassification": "smollm3",
    "OlmoForSequenceClassification": "olmo",
    "Olmo2ForSequenceClassification": "olmo2",
    "Olmo3ForSequenceClassification": "olmo3",
}
ARCHITECTURES_LM = tuple(a for a in ARCHITECTURES if a.endswith("ForCausalLM"))
ARCHITECTURES_SCORE = tuple(a for a in ARCHITECTURES if a.endswith("ForSequenceClassification"))

# Defaults of the transformers config classes, for fields a config.json may leave out
# (checked against `transformers` in tests/test_model_parity.py).
FAMILY_DEFAULTS = {
    "llama": dict(rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "qwen2": dict(rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "qwen3": dict(rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "smollm3": dict(rope_theta=2000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "olmo": dict(rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "olmo2": dict(rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "olmo3": dict(rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded (missing file, missing tensor, bad or unsupported config)."""


@dataclass
class ModelArgs:
    """The architecture, read from a Hugging Face `config.json` (field names as there where they exist)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm (OLMo 1's LayerNorm uses a fixed 1e-5, as in transformers)."""
    rope_theta: float = 10000.0
    """RoPE base of the default rope; the full per-layer-type parameters are in `rope_parameters`."""
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """Bias on the q, k, v and o projections (Llama's `attention_bias`)."""
    qkv_bias: bool = False
    """Bias on the q, k, v projections only, none on o (Qwen2, always: its config has no switch for it)."""
    mlp_bias: bool = False
    family: str = "llama"
    """One of FAMILY_DEFAULTS; only used to explain errors and in repr, never branched on in forward."""
    norm: str = "rmsnorm"
    """"rmsnorm" (weighted RMSNorm) or "layernorm" (OLMo 1: LayerNorm with no weight and no bias)."""
    norm_after: bool = False
    """OLMo 2/3: x + norm(attn(x)) and x + norm(mlp(x)) instead of the pre-norm x + attn(norm(x))."""
    qk_norm: str | None = None
    """None, "head" (Qwen3: RMSNorm over each head of q and k) or "projection" (OLMo 2/3: over all of q and k)."""
    clip_qkv: float | None = None
    """OLMo 1: clamp q, k, v projections to [-clip_qkv, clip_qkv]."""
    float32_rope_and_norm_weight: bool = False
    """OLMo: apply RoPE in float32 and multiply the RMSNorm weight before casting back (as transformers does
    for OLMo); the others cast cos/sin and the normalised x to the model dtype first. Same values in float32."""
    layer_types: list = field(default_factory=list)
    """Per layer, "full_attention" or "sliding_attention"; selects the layer's RoPE parameters."""
    sliding_windows: list = field(default_factory=list)
    """Per layer, the attention window (a query sees itself and the window-1 keys before it) or None."""
    use_rope: list = field(default_factory=list)
    """Per layer, whether RoPE is applied (SmolLM3 has NoPE layers)."""
    rope_parameters: dict = field(default_factory=dict)
    """layer type -> {"rope_type", "rope_theta", ...} as transformers standardises them."""
    pad_token_id: int | None = None
    hf_config: dict = field(default_factory=dict, repr=False)
    """The config.json as it came, written back unchanged by `save_pretrained`."""

    def __post_init__(self):
        L = self.num_hidden_layers
        self.layer_types = list(self.layer_types) or ["full_attention"] * L
        self.sliding_windows = list(self.sliding_windows) or [None] * L
        self.use_rope = list(self.use_rope) or [True] * L
        if not self.rope_parameters:
            self.rope_parameters = {t: {"rope_type": "default", "rope_theta": self.rope_theta} for t in set(self.layer_types)}
        for name in ("layer_types", "sliding_windows", "use_rope"):
            if len(getattr(self, name)) != L:
                raise CheckpointError(f"config: {name} has {len(getattr(self, name))} entries, num_hidden_layers is {L}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(f"config: num_attention_heads={self.num_attention_heads} is not a multiple of "
                                  f"num_key_value_heads={self.num_key_value_heads}")

    @classmethod
    def from_hf_config(cls, cfg: dict, source="config.json") -> "ModelArgs":
        """`cfg` (a config.json as a dict; `source` names it in errors), checked by check_hf_config first."""
        check_hf_config(cfg, source)
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in ARCHITECTURES:
            raise CheckpointError(f"unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
        family = ARCHITECTURES[arch]
        defaults = FAMILY_DEFAULTS[family]
        if cfg.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"config: hidden_act={cfg['hidden_act']!r} is not supported (only 'silu')")
        L, n_heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]

        # Which layers attend to a sliding window, and which use RoPE, as each transformers config class derives them.
        layer_types = cfg.get("layer_types")
        use_rope = [True] * L
        if family in ("qwen2", "qwen3"):  # layers max_window_layers.. slide when use_sliding_window is set
            window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window", False) else None
            layer_types = layer_types or ["sliding_attention" if window is not None and i >= cfg.get("max_window_layers", 28)
                                          else "full_attention" for i in range(L)]
        elif family == "smollm3":
            window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
            # no_rope_layers[i] == 1 means layer i DOES use RoPE (transformers: `self.use_rope = no_rope_layers[i]`)
            interval = cfg.get("no_rope_layer_interval", 4)
            no_rope_layers = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(L)]
            use_rope = [bool(r) for r in no_rope_layers]
            layer_types = layer_types or ["sliding_attention" if window is not None and not use_rope[i]
                                          else "full_attention" for i in range(L)]
        elif family == "olmo3":
            window = cfg.get("sliding_window", 4096)
            layer_types = layer_types or ["sliding_attention" if (i + 1) % 4 != 0 else "full_attention" for i in range(L)]
        else:  # Llama, OLMo 1/2: every layer attends to everything before it
            window, layer_types = None, ["full_attention"] * L
        sliding_windows = [window if t == "sliding_attention" else None for t in layer_types]

        rope_parameters = _standardize_rope(cfg, family, layer_types, defaults["rope_theta"])
        olmo = family in ("olmo", "olmo2", "olmo3")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=L,
            num_attention_heads=n_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            rms_norm_eps=cfg.get("rms_norm_eps") or defaults["rms_norm_eps"],
            rope_theta=rope_parameters[layer_types[0]]["rope_theta"],
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", defaults["tie_word_embeddings"]),
            # Qwen2 builds q/k/v with bias and o without, whatever the config says
            attention_bias=bool(cfg.get("attention_bias", False)) and family != "qwen2",
            qkv_bias=family == "qwen2",
            # Qwen3 and OLMo build their MLPs without bias whatever the config says
            mlp_bias=bool(cfg.get("mlp_bias", False)) and family in ("llama", "smollm3"),
            family=family,
            norm="layernorm" if family == "olmo" else "rmsnorm",
            norm_after=family in ("olmo2", "olmo3"),
            qk_norm={"qwen3": "head", "olmo2": "projection", "olmo3": "projection"}.get(family),
            clip_qkv=cfg.get("clip_qkv") if family == "olmo" else None,
            float32_rope_and_norm_weight=olmo,
            layer_types=layer_types,
            sliding_windows=sliding_windows,
            use_rope=use_rope,
            rope_parameters=rope_parameters,
            pad_token_id=cfg.get("pad_token_id"),
            hf_config=dict(cfg),
        )


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# config.json's integers that size what is built, as (smallest, largest): a value outside, or not an integer, is
# refused before anything is allocated (the largest well above any released model, far below exhausting memory).
CONFIG_INT_RANGES = {
    "vocab_size": (1, 2 ** 22), "hidden_size": (1, 65536 * 4), "intermediate_size": (1, 2 ** 20),
    "num_hidden_layers": (1, 1024), "num_attention_heads": (1, 4096), "num_key_value_heads": (1, 4096),
    "head_dim": (1, 4096), "max_position_embeddings": (1, 2 ** 26), "sliding_window": (1, 2 ** 26),
    "max_window_layers": (0, 2 ** 20), "no_rope_layer_interval": (1, 1024),
}
CONFIG_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# the other keys from_hf_config reads, by the JSON type they must have when present and not null
_CONFIG_TYPES = {"rms_norm_eps": "number", "rope_theta": "number", "clip_qkv": "number", "pad_token_id": "integer",
                 "tie_word_embeddings": "boolean", "attention_bias": "boolean", "mlp_bias": "boolean",
                 "use_sliding_window": "boolean", "hidden_act": "string", "architectures": "array",
                 "layer_types": "array", "no_rope_layers": "array", "rope_scaling": "object", "rope_parameters": "object",
                 "num_labels": "integer", "id2label": "object"}
_JSON_TYPE_CHECKS = {"number": lambda v: _is_int(v) or isinstance(v, float), "integer": _is_int,
                     "boolean": lambda v: isinstance(v, bool), "string": lambda v: isinstance(v, str),
                     "array": lambda v: isinstance(v, list), "object": lambda v: isinstance(v, dict)}
_ROPE_NUMBERS = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                 "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "partial_rotary_factor")
# the ones a RoPE divides by, raises to a power or takes the log of: 0 or less gives NaN or garbage positions
_ROPE_POSITIVE = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                  "beta_fast", "beta_slow", "partial_rotary_factor")


def check_hf_config(cfg, source="config.json"):
    """Refuse a config.json (as a dict; `source` names it) whose keys from_hf_config reads have the wrong JSON type
    or an out-of-range size (CONFIG_INT_RANGES), or whose head counts do not divide: one CheckpointError naming
    the file and the key, before anything is built."""
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{source}: expected a JSON object, got {type(cfg).__name__}")
    arches = cfg.get("architectures")
    if arches is not None and not (isinstance(arches, list) and all(isinstance(a, str) for a in arches)):
        raise CheckpointError(f"{source}: key 'architectures' must be a list of strings, got {arches!r}")
    _architecture(cfg)  # a model of another family is named as such before its keys are checked
    for key in CONFIG_REQUIRED:
        if cfg.get(key) is None:
            raise CheckpointError(f"{source}: missing key '{key}'")
    for key, (low, high) in CONFIG_INT_RANGES.items():
        value = cfg.get(key)
        if value is not None and not (_is_int(value) and low <= value <= high):
            raise CheckpointError(f"{source}: key '{key}' must be an integer in [{low}, {high}], got {value!r}")
    for key, kind in _CONFIG_TYPES.items():
        if cfg.get(key) is not None and not _JSON_TYPE_CHECKS[kind](cfg[key]):
            raise CheckpointError(f"{source}: key '{key}' must be a JSON {kind}, got {cfg[key]!r}")
    for key in ("rms_norm_eps", "rope_theta", "clip_qkv"):  # JSON's Infinity and NaN read as floats: refused too
        if cfg.get(key) is not None and not 0 < cfg[key] < math.inf:
            raise CheckpointError(f"{source}: key '{key}' must be a positive finite number, got {cfg[key]!r}")
    L, heads, kv_heads = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg.get("num_key_value_heads")
    if kv_heads is not None and heads % kv_heads:
        raise CheckpointError(f"{source}: key 'num_key_value_heads' ({kv_heads}) must divide "
                              f"num_attention_heads ({heads})")
    if cfg.get("head_dim") is None and cfg["hidden_size"] % heads:
        raise CheckpointError(f"{source}: key 'hidden_size' ({cfg['hidden_size']}) must be a multiple of "
                              f"num_attention_heads ({heads}) when there is no head_dim")
    for key, allowed in (("layer_types", ("full_attention", "sliding_attention")), ("no_rope_layers", (0, 1))):
        values = cfg.get(key)
        if values is not None and (len(values) != L or any(v not in allowed or type(v) is float for v in values)):
            raise CheckpointError(f"{source}: key '{key}' must list one of {allowed} for each of the {L} layers")
    for key in ("rope_scaling", "rope_parameters"):  # flat, or nested by layer type
        params = cfg.get(key) or {}
        for p in [params, *(v for v in params.values() if isinstance(v, dict))]:
            for name in _ROPE_NUMBERS:
                if p.get(name) is None:
                    continue
                if not _JSON_TYPE_CHECKS["number"](p[name]):
                    raise CheckpointError(f"{source}: key '{key}': '{name}' must be a number, got {p[name]!r}")
                if not (0 < p[name] if name in _ROPE_POSITIVE else -math.inf < p[name]) or not p[name] < math.inf:
                    what = "a positive finite number" if name in _ROPE_POSITIVE else "a finite number"
                    raise CheckpointError(f"{source}: key '{key}': '{name}' must be {what}, got {p[name]!r}")


def _standardize_rope(cfg, family, layer_types, default_theta) -> dict:
    """layer type -> RoPE parameters, read from either config format as transformers 5 does: the new
    `rope_parameters` (flat, or nested by layer type) or the older `rope_theta` + `rope_scaling`."""
    theta = cfg.get("rope_theta", default_theta)
    scaling = cfg.get("rope_scaling")
    if family == "olmo3":
        # Olmo3Config: a legacy `rope_scaling` applies to the full-attention layers only
        nested = {k: dict(v) for k, v in (cfg.get("rope_parameters") or {}).items() if isinstance(v, dict)}
        nested.setdefault("full_attention", {"rope_type": "default"})
        nested.setdefault("sliding_attention", {"rope_type": "default"})
        if scaling:
            nested["full_attention"].update(scaling)
    else:
        params = dict(scaling or cfg.get("rope_parameters") or {})
        if any(k in ("full_attention", "sliding_attention") for k in params):
            nested = {k: dict(v) for k, v in params.items() if isinstance(v, dict)}
        else:
            nested = {t: dict(params) for t in set(layer_types)}
    out = {}
    for layer_type in set(layer_types):
        p = nested.get(layer_type)
        if p is None:
            raise CheckpointError(f"config: no RoPE parameters for layer type {layer_type!r}")
        p.setdefault("rope_type", p.get("type", "default"))
        p.setdefault("rope_theta", theta)
        if p["rope_type"] in ("llama3", "yarn"):
            p.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings", 2048))
        if p["rope_type"] not in ("default", "linear", "llama3", "yarn"):
            raise CheckpointError(f"config: rope_type {p['rope_type']!r} is not supported "
                                  "(supported: default, linear, llama3, yarn)")
        if p.get("partial_rotary_factor", 1.0) != 1.0:
            raise CheckpointError("config: partial_rotary_factor != 1 is not supported")
        out[layer_type] = p
    return out


def rope_inv_freq(p: dict, head_dim: int, max_position_embeddings: int, nested: bool = False):
    """RoPE inverse frequencies [hs/2] float32 and the cos/sin scale, for one parameter set, exactly as
    transformers' `ROPE_INIT_FUNCTIONS` compute them (default, linear, llama3, yarn)."""
    base, kind = p["rope_theta"], p["rope_type"]
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if kind == "linear":
        return inv_freq / p["factor"], 1.0
    if kind == "llama3":  # Llama 3.1: low frequencies divided by `factor`, a smooth ramp in between
        factor, lo, hi, old_len = p["factor"], p["low_freq_factor"], p["high_freq_factor"], p["original_max_position_embeddings"]
        low_freq_wavelen, high_freq_wavelen = old_len / lo, old_len / hi
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, inv_freq_llama), 1.0
    if kind == "yarn":  # https://arxiv.org/abs/2309.00071, transformers' _compute_yarn_parameters
        old_len = p["original_max_position_embeddings"]
        factor = p.get("factor") or max_position_embeddings / old_len

        def get_mscale(scale, mscale=1.0):
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

        attention_factor = p.get("attention_factor")
        if attention_factor is None:
            if p.get("mscale") and p.get("mscale_all_dim"):
                attention_factor = float(get_mscale(factor, p["mscale"]) / get_mscale(factor, p["mscale_all_dim"]))
            else:
                attention_factor = get_mscale(factor)
        beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

        def correction_dim(num_rotations):
            return (head_dim * math.log(old_len / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        # transformers reads `truncate` from the top-level rope dict: always the default for nested (OLMo 3) configs
        if nested or p.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = base ** (torch.arange(0, head_dim, 2).float() / head_dim)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
        extrapolation_factor = 1 - ramp
        return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor, attention_factor
    return inv_freq, 1.0


def packed_linear(x, packed_weight, bias=None):
    """x @ W.T + b with W in oneDNN's packed layout (from torch.ops.mkldnn._reorder_linear_weight), computed in the
    packed weight's dtype (bf16 copies packed under CPU autocast: x is cast as autocast would cast it)."""
    if x.dtype != packed_weight.dtype:  # (a cast to the same dtype is still a dispatched op: skipped)
        x = x.to(packed_weight.dtype)
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


class Linear(nn.Linear):
    """nn.Linear with an optional fast path for CPU inference: while `packed_weight` holds a oneDNN-packed copy
    of the weight (see `cpu_packed_linears`) and autograd is off, the matmul runs on it. Same values as
    F.linear (to float32 rounding), 1.5-4x faster than MKL's sgemm at decoding batch sizes."""

    packed_weight = None

    def forward(self, x):
        if self.packed_weight is not None and not torch.is_grad_enabled():
            return packed_linear(x, self.packed_weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def onednn_bf16_supported() -> bool:
    """Whether oneDNN's bf16 kernels run on this CPU: they need AVX512-BW/VL/DQ or AVX-NE-CONVERT (torch's
    mkldnn_bf16_device_check, which also honours ONEDNN_MAX_CPU_ISA). Where they do not (e.g. AVX2-only CPUs),
    packing bf16 weights raises, and bf16 matmuls run on torch's generic kernels, slower than float32."""
    return torch.backends.mkldnn.is_available() and getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)()


def can_pack_for_cpu(model) -> bool:
    """The oneDNN fast path applies: float32 weights on the CPU, a torch built with oneDNN, no LoRA adapters
    (ppo_core.models.lora: the packed q/k/v and gate/up matmuls would bypass them), and, under bf16 autocast (where the
    packed copies are bf16), a CPU on which oneDNN runs bf16 (`onednn_bf16_supported`): elsewhere autocast's
    F.linear computes the same bf16 products on torch's generic kernels. (No fp16 packing: nothing here uses it.)"""
    weight = next(model.parameters())
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and (autocast_dtype("cpu") is None or (autocast_dtype("cpu") == torch.bfloat16 and onednn_bf16_supported()))
            and not any(hasattr(m, "lora_A") for m in model.modules()))


@contextmanager
def cpu_packed_linears(model, batch_size):
    """Inside this block, the matmuls of `model` run on oneDNN-packed copies of its weights (packed for
    `batch_size` rows; any row count works), with q/k/v and gate/up each fused into one matmul (fewer, larger
    calls: less thread synchronisation per token). Costs a second copy of the weights while inside, and the
    packing (~0.5 s per GB); the copies are dropped on exit, so weights updated by training are never stale.
    Entered inside a CPU autocast region, the copies are in the autocast dtype (bf16: half the bytes, oneDNN's
    bf16 kernels), so the packed matmuls compute as autocast's F.linear would."""
    dtype = autocast_dtype("cpu") or next(model.parameters()).dtype

    def pack(*linears):
        weight = torch.cat([m.weight.detach() for m in linears]) if len(linears) > 1 else linears[0].weight.detach()
        bias = None if linears[0].bias is None else torch.cat([m.bias.detach() for m in linears]).to(dtype)
        return torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype), batch_size), bias

    fused = set()
    try:
        for m in model.modules():
            if isinstance(m, Attention):
                m.packed_qkv = pack(m.q_proj, m.k_proj, m.v_proj)
                fused.update((m.q_proj, m.k_proj, m.v_proj))
            elif isinstance(m, MLP):
                m.packed_gate_up = pack(m.gate_proj, m.up_proj)
                fused.update((m.gate_proj, m.up_proj))
        for m in model.modules():
            if isinstance(m, Linear) and m not in fused:
                m.packed_weight = pack(m)[0]
        yield model
    finally:
        for m in model.modules():
            if isinstance(m, Attention):
                m.packed_qkv = None
            elif isinstance(m, MLP):
                m.packed_gate_up = None
            elif isinstance(m, Linear):
                m.packed_weight = None


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), normalised in float32 as transformers does."""

    def __init__(self, dim, eps, weight_in_float32=False):
        super().__init__()
        self.eps = eps
        self.weight_in_float32 = weight_in_float32
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        if (x.dtype == self.weight.dtype == torch.float32 and x.device.type == "cpu"
                and not torch.is_grad_enabled()):
            # the same ops in the same order (bitwise equal results), dispatched as one call: decoding runs this
            # twice a layer at a few rows, where Python's share of six small ops is most of the cost
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_in_float32:  # OLMo 2/3: (weight * x).to(dtype)
            return (self.weight * x).to(dtype)
        return self.weight * x.to(dtype)  # Llama, Qwen3, SmolLM3


class LayerNorm(nn.Module):
    """OLMo 1: LayerNorm with no learnable weight or bias, in float32, eps 1e-5."""

    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return F.layer_norm(x.float(), (self.dim,), None, None, eps=1e-5).to(x.dtype)


def make_norm(args: ModelArgs, dim):
    if args.norm == "layernorm":
        return LayerNorm(dim)
    return RMSNorm(dim, args.rms_norm_eps, weight_in_float32=args.float32_rope_and_norm_weight)


def apply_rope(x, cos, sin):
    """x: [B, nh, T, hs] (or [B, T, nh, hs]); cos, sin: [B, 1, T, hs] (or [B, T, 1, hs]) with sin's first half
    negated (Backbone.rope_table). x*cos + rotate_half(x)*sin, rotate_half(x) = cat(-x2, x1), back in x's dtype:
    rotate_half(x)*sin = cat(x2, x1) * cat(-sin1, sin2) exactly (a sign moves between factors), and cat(x2, x1) is
    x rolled by half: 4 ops instead of 6."""
    y = x * cos + x.roll(x.shape[-1] // 2, -1) * sin
    return y if y.dtype == x.dtype else y.to(x.dtype)


class KVCache:
    """Keys/values of every layer, preallocated for `max_len` time slots (prompt + new tokens, padding included).

    Full-attention layers keep every slot: k, v [L_full, B, nkv, max_len, hs]. Sliding-window layers keep only
    a ring of R = min(window, max_len) slots, time slot t in ring slot t % R: k_ring, v_ring [L_ring, B, nkv, R, hs]
    (a query at t sees t-window+1..t, so the window's last R keys are all it needs). A window at least as long
    as the cache never excludes a key; such a layer is cached as a full one. `layer_k[i]`, `layer_v[i]` are
    views of layer i's buffer, [B, nkv, max_len or R, hs].

    mask [B, max_len] bool: time slot t holds a real (non-pad) token; unfilled slots are False.
    n_real [B] int64: real tokens seen so far, which is the RoPE position of the next one.
    length (int) and slot ([] int64): slots filled so far, on the host (read by `Backbone.forward`, which
    slices by it) and on the device (read by `Backbone.decode_step`, whose shapes must not depend on it).
    dtype: that of the keys and values, whatever the model's (e.g. bf16 under float32 weights): new keys and
    values are cast on the way in, and attention over the cache runs in this dtype.
    """

    def __init__(self, args: ModelArgs, batch_size, max_len, device, dtype):
        B, nkv, hs = batch_size, args.num_key_value_heads, args.head_dim
        self.max_len = max_len
        self.windows = [w if w is not None and w < max_len else None for w in args.sliding_windows]
        ring_windows = set(self.windows) - {None}
        if len(ring_windows) > 1:
            raise ValueError(f"KVCache: the sliding layers have different windows {sorted(ring_windows)}; "
                             "one ring size per cache is supported")
        self.ring_size = min(ring_windows) if ring_windows else 0  # R
        n_ring = sum(w is not None for w in self.windows)
        n_full = args.num_hidden_layers - n_ring
        self.k = torch.zeros((n_full, B, nkv, max_len, hs), device=device, dtype=dtype)
        self.v = torch.zeros((n_full, B, nkv, max_len, hs), device=device, dtype=dtype)
        self.k_ring = torch.zeros((n_ring, B, nkv, self.ring_size, hs), device=device, dtype=dtype)
        self.v_ring = torch.zeros((n_ring, B, nkv, self.ring_size, hs), device=device, dtype=dtype)
        full, ring = iter(range(n_full)), iter(range(n_ring))
        self.layer_k, self.layer_v = [], []
        for window in self.windows:
            if window is None:
                i = next(full)
                self.layer_k.append(self.k[i]), self.layer_v.append(self.v[i])
            else:
                i = next(ring)
                self.layer_k.append(self.k_ring[i]), self.layer_v.append(self.v_ring[i])
        self.mask = torch.zeros(B, max_len, device=device, dtype=torch.bool)
        self.n_real = torch.zeros(B, device=device, dtype=torch.long)
        self.slot = torch.zeros((), device=device, dtype=torch.long)
        self.length = 0
        self.has_padding = False  # set once a pad slot is written; until then `forward` decodes without a mask


def ring_times(newest, ring_size, device):
    """[R] int64: the time slot held by each ring slot j when the newest time written is `newest` (an int or a
    [] tensor): the latest t <= newest with t % R == j; negative for a slot not yet written."""
    j = torch.arange(ring_size, device=device)
    return newest - (newest - j) % ring_size


def causal_window_mask(q_times, k_times, real, window):
    """[B|1, 1, T, S] bool (True = may attend) for queries at time slots q_times [T] and keys at k_times [S]
    (negative = an empty slot); real [B, S] bool marks keys that are real tokens (None: all are).

    Causal, never an empty slot or a pad, and with a window a query at t sees only t-window+1..t (transformers'
    `sliding_window_overlay`: kv_idx > q_idx - window). A pad query sees only itself, so that softmax stays finite
    (its output is never read)."""
    q, k = q_times[:, None], k_times[None, :]  # [T, 1], [1, S]
    allowed = (k <= q) & (k >= 0)
    if window is not None:
        allowed = allowed & (k > q - window)
    allowed = allowed[None]  # [1, T, S]
    if real is not None:
        allowed = allowed & real[:, None, :]  # [B, T, S]
    return (allowed | (k == q)[None])[:, None]


_attention_paths = None  # a list while inside `record_attention_paths`


HALF = (torch.bfloat16, torch.float16)


def attention(q, k, v, attn_mask=None, is_causal=False):
    """softmax(q k^T / sqrt(hs), masked) v for q [B, nh, T, hs] and k, v [B, nkv, S, hs], where kv head j serves
    the query heads j*nh/nkv .. (j+1)*nh/nkv - 1 (GQA); attn_mask [B|1, 1, T, S] bool (True = may attend) or
    None; is_causal only without a mask. -> [B, nh, T, hs].

    Shaped so that CUDA can run a fused SDPA kernel (flash, cuDNN or memory-efficient; recent torch may prefer
    cuDNN over flash on Hopper for the same call), never the math fallback,
    which upcasts to float32 and materialises the [B, nh, T, S] scores (and keeps them for the backward). Flash
    takes no mask and 16-bit inputs only (torch's sdp_utils.cpp: check_for_attn_mask, check_dtypes_flash_attention);
    the memory-efficient kernel of torch 2.11 takes a mask and float32 but not GQA
    (check_batch_size_and_num_heads_dense<supports_gqa=false>). So the paths, as `record_attention_paths` names them:
      "causal", "no mask"     as given, with enable_gqa: flash with native GQA (training and scoring forwards,
                              whose padding Backbone.forward moves after the real tokens)
      "query heads as rows"   one query per row (decoding) with GQA: the nh/nkv query heads of kv head j become
                              its query rows, q [B, nkv, nh/nkv, hs]: MHA shapes without copying K/V; a mask
                              [B, 1, 1, S] broadcasts over the rows (memory-efficient)
      "MHA shapes"            k, v repeated to nh heads (a copy): a mask with T > 1 (a left-padded prefill,
                              sliding-window layers shorter than the sequence, rows with holes in their padding),
                              or float32 on CUDA without a mask (memory-efficient)

    Under CPU autocast (bf16-mixed) attention computes in float32, autocast off, whatever the dtype of q, k, v (the
    result comes back in q's dtype): torch's CPU flash kernel in bf16 ran 1.5-4.8x slower than in fp32 on this
    project's AVX512-BF16 CPU (forward + backward at the demo's and SmolLM2-135M's head shapes:
    bench/cpu_precision.py), so bf16-mixed on the CPU keeps bf16 for the projections and fp32 for attention (and a
    float32 KVCache: ppo_core.generate). A model whose parameters are bf16 (dtype='bfloat16', no autocast) attends
    in bf16, as transformers does."""
    if q.device.type == "cpu" and autocast_dtype("cpu"):
        up = torch.float32 if q.dtype in HALF else q.dtype  # float64 stays float64
        with torch.autocast("cpu", enabled=False):
            return attention(q.to(up), k.to(up), v.to(up), attn_mask, is_causal).to(q.dtype)
    B, nh, T, hs = q.shape
    group = nh // k.shape[1]
    float32_cuda = q.is_cuda and _sdpa_dtype(q) == torch.float32
    if T == 1 and group > 1 and not is_causal:
        path = "query heads as rows"
        rows = q.reshape(B, k.shape[1], group, hs)  # [B, nkv, nh/nkv, hs]
        y = F.scaled_dot_product_attention(rows, k, v, attn_mask=attn_mask).reshape(B, nh, 1, hs)
    elif attn_mask is None and not (group > 1 and float32_cuda):
        path = "causal" if is_causal else "no mask"
        y = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=group > 1)
    else:
        path = "MHA shapes"
        if group > 1:
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [B, nh, S, hs]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)
    if _attention_paths is not None:
        _attention_paths.append(path)
    return y


def packed_attention(q, k, v, seq_lens, window=None, cu_seqlens=None):
    """Causal attention within each of several sequences packed one after another, never across them.

    q [N, nh, hs], k, v [N, nkv, hs] (GQA as in `attention`); seq_lens: the sequences' lengths, host ints summing to
    N; window: a query at place t of its sequence sees only t-window+1..t (None: all of 0..t); cu_seqlens: [S+1]
    int32 on q's device, the running sum of seq_lens from 0 (made here when not given). -> [N, nh, hs].

    The reference, which runs everywhere: the sequences of one length as the batch of one causal `attention` call (no
    mask, so a fused SDPA kernel, which computes each (sequence, head) alone: the same bits as one call per sequence,
    tests/test_packing.py), a sequence longer than the window in a call of its own with a window mask. On the CPU
    this measured faster than one call over the pack with a block-diagonal mask, which computes and stores all N^2
    scores (bench/ppo_step.py --attention), and than one call per sequence (a rollout's packs have few distinct
    lengths: bench/results/smollm2-addition.md). CUDA with 16-bit q: torch's variable-length flash attention, one
    kernel for the whole pack (`varlen_flash_attention`), where the torch build has it."""
    if q.is_cuda and _sdpa_dtype(q) in HALF and _varlen_attn() is not None:
        if cu_seqlens is None:
            cu_seqlens = torch.tensor([0] + list(itertools.accumulate(seq_lens)), dtype=torch.int32, device=q.device)
        return varlen_flash_attention(q, k, v, cu_seqlens, max(seq_lens), window)
    if len(seq_lens) == 1 and (window is None or seq_lens[0] <= window):  # one sequence: no gather
        return attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), is_causal=True)[0].transpose(0, 1)
    starts = list(itertools.accumulate([0] + list(seq_lens[:-1])))
    calls = {}  # (length, windowed) -> the first rows of its sequences
    for start, length in zip(starts, seq_lens):
        calls.setdefault((length, window is not None and length > window), []).append(start)
    # one gather puts each call's rows together, split hands each call its rows: in the backward one cat and one
    # index_add, where a gather per call would add a zero tensor of the whole pack per call
    order = torch.cat([(torch.tensor(firsts)[:, None] + torch.arange(length)).reshape(-1)
                       for (length, _), firsts in calls.items()]).to(q.device)  # [N]
    sizes = [len(firsts) * length for (length, _), firsts in calls.items()]
    q_calls, k_calls, v_calls = (t.index_select(0, order).split(sizes) for t in (q, k, v))  # [G*L, nh|nkv, hs]
    outputs = []
    for i, ((length, windowed), firsts) in enumerate(calls.items()):
        q_g, k_g, v_g = (t[i].unflatten(0, (len(firsts), length)).transpose(1, 2)
                         for t in (q_calls, k_calls, v_calls))  # [G, nh|nkv, L, hs]
        if windowed:
            t = torch.arange(length, device=q.device)
            y = attention(q_g, k_g, v_g, causal_window_mask(t, t, None, window))
        else:
            y = attention(q_g, k_g, v_g, is_causal=True)
        outputs.append(y.transpose(1, 2).flatten(0, 1))  # [G*L, nh, hs]
    return torch.cat(outputs).index_select(0, order.argsort())  # back in the pack's order


@functools.cache
def _varlen_attn():
    """torch.nn.attention.varlen.varlen_attn and the names of its keyword arguments, or None where this torch has
    none (its signature changed between releases: is_causal in 2.10; window_size, then enable_gqa, later)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def varlen_flash_attention(q, k, v, cu_seqlens, max_len, window=None):
    """packed_attention on CUDA: torch's variable-length flash attention over the whole pack (16-bit q, k, v;
    under autocast they are cast to its dtype). Untested here without a GPU; tests/test_packing.py's GPU tier compares
    it with the per-sequence reference."""
    varlen_attn, params = _varlen_attn()
    dtype = _sdpa_dtype(q)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    kwargs = {}
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = k.shape[1] != q.shape[1]
    elif k.shape[1] != q.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [N, nh, hs]
    if "window_size" in params:
        # flash's window: keys i - left .. i + right; ours: i - window + 1 .. i
        kwargs["window_size"] = (window - 1 if window is not None else -1, 0)
    else:
        if window is not None and window < max_len:
            raise NotImplementedError("this torch's varlen_attn has no sliding window: use torch >= 2.11")
        kwargs["is_causal"] = True
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, **kwargs)


def _sdpa_dtype(q):
    """The dtype SDPA computes in: the autocast dtype inside an autocast region of q's device (SDPA is one of its
    lower-precision ops on CUDA and on the CPU), else q's."""
    return autocast_dtype(q.device.type) or q.dtype


def autocast_dtype(device_type):
    """The autocast dtype while an autocast region of `device_type` ("cuda", "cpu") is active, else None."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


@contextmanager
def record_attention_paths():
    """Inside this block, every `attention` call appends its path ("causal", "no mask", "query heads as rows",
    "MHA shapes"; see `attention`) to the list it yields. Each is shaped for a fused CUDA kernel; which one
    actually ran shows by running the pass under torch.nn.attention.sdpa_kernel with the math backend left out."""
    global _attention_paths
    outer, _attention_paths = _attention_paths, []
    try:
        yield _attention_paths
    finally:
        _attention_paths = outer


def padding_layout(key_mask):
    """(padded, one_run) for key_mask [B, T] bool (True = real token), read in one host sync: whether any slot
    is a pad, and whether every row's real tokens form one run: [pads, real tokens, pads] (or no real token)."""
    after_pad = torch.cat([torch.zeros_like(key_mask[:, :1]), key_mask[:, :-1]], 1).logical_not()  # [B, T]
    run_starts = (key_mask & after_pad).sum(-1)  # [B]
    all_real, holes = torch.stack([key_mask.all(), (run_starts > 1).any()]).tolist()
    return not all_real, not holes


def roll_indices(key_mask):
    """(index, inverse) [B, T] int64 for rows of one run of real tokens: index[b] rolls row b left by its leading
    pads (x.gather(1, index) puts the real tokens first, every pad after them); inverse[b] rolls it back."""
    T = key_mask.shape[1]
    shift = key_mask.long().argmax(-1, keepdim=True)  # [B, 1] leading pads (the first True; 0 for no real token)
    t = torch.arange(T, device=key_mask.device)[None]  # [1, T]
    return (t + shift) % T, (t - shift) % T


class PermuteRows(torch.autograd.Function):
    """y[b, t] = x[b, index[b, t]] for x [B, T, ...] and a per-row permutation index [B, T] whose inverse is
    `inverse`: the backward is then a gather too (autograd's backward of gather is a scatter-add, atomic on CUDA)."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x.gather(1, index.view(*index.shape, *[1] * (x.dim() - 2)).expand_as(x))

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.gather(1, inverse.view(*inverse.shape, *[1] * (grad.dim() - 2)).expand_as(grad)), None, None


class Attention(nn.Module):
    packed_qkv = None  # (packed [q; k; v] weight, bias) inside cpu_packed_linears

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.qk_norm, self.clip_qkv = args.qk_norm, args.clip_qkv
        H, hs = args.hidden_size, args.head_dim
        qkv_bias = args.attention_bias or args.qkv_bias
        self.q_proj = Linear(H, self.n_heads * hs, bias=qkv_bias)
        self.k_proj = Linear(H, self.n_kv * hs, bias=qkv_bias)
        self.v_proj = Linear(H, self.n_kv * hs, bias=qkv_bias)
        self.o_proj = Linear(self.n_heads * hs, H, bias=args.attention_bias)
        if args.qk_norm == "head":  # Qwen3: one RMSNorm over hs, shared by all heads
            self.q_norm = RMSNorm(hs, args.rms_norm_eps)
            self.k_norm = RMSNorm(hs, args.rms_norm_eps)
        elif args.qk_norm == "projection":  # OLMo 2/3: over the whole projection, before splitting heads
            self.q_norm = RMSNorm(self.n_heads * hs, args.rms_norm_eps, weight_in_float32=True)
            self.k_norm = RMSNorm(self.n_kv * hs, args.rms_norm_eps, weight_in_float32=True)

    def forward(self, x, rope, attn_mask, cache: KVCache | None, static=False, attend=None):
        """x [B, T, H]; rope: (cos, sin) [B, 1, T, hs] or None (NoPE layer); attn_mask: [B, 1, T, S] bool
        (True = may attend), or None for plain causal attention; static: the fixed-shape decode step
        (see cache_keys_values). attend: the rollout engine's paged attention (Backbone.forward_paged): with it,
        x is one flat batch [1, N, H] of several sequences' tokens and attend(layer index, q [N, nh, hs],
        k, v [N, nkv, hs]) stores k, v and returns the attention output [N, nh, hs]. Returns [B, T, H]."""
        B, T, _ = x.shape
        if self.packed_qkv is not None and not torch.is_grad_enabled():  # CPU fast path: one matmul
            q, k, v = packed_linear(x, *self.packed_qkv).split(
                [self.n_heads * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim], -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [B, T, nh*hs], [B, T, nkv*hs] x2
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        if self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, self.n_heads, self.head_dim)
        k = k.view(B, T, self.n_kv, self.head_dim)
        v = v.view(B, T, self.n_kv, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if attend is not None:  # B = 1: a flat batch of several sequences; rope: [1, N, 1, hs] (token-major)
            if rope is not None:
                q, k = apply_rope(q, *rope), apply_rope(k, *rope)
            y = attend(self.layer_idx, q[0], k[0], v[0])  # [N, nh, hs]
            y = y if y.dtype == q.dtype else y.to(q.dtype)
            return self.o_proj(y.reshape(B, T, self.n_heads * self.head_dim))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, nh|nkv, T, hs]
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        is_causal = attn_mask is None and cache is None
        dtype = q.dtype
        if cache is not None:
            start = 0 if static else cache.length
            k, v = self.cache_keys_values(cache, k, v, static)  # [B, nkv, S, hs], in the cache's dtype
            q = q.to(k.dtype)  # a cache in another dtype than the model's (e.g. bf16): attention runs in it
            # without a mask, T new queries see all cached keys: causal among themselves only if T > 1
            is_causal = attn_mask is None and T > 1 and start == 0
            if attn_mask is None and T > 1 and start > 0:
                attn_mask = _causal_mask(start, T, start + T, x.device)[None, None]
        y = attention(q, k, v, attn_mask, is_causal).to(dtype)  # [B, nh, T, hs]
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        return self.o_proj(y)

    def cache_keys_values(self, cache: KVCache, k, v, static):
        """Store this layer's new keys and values k, v [B, nkv, T, hs] in the cache -> the keys and values to
        attend over [B, nkv, S, hs], in the order Backbone's masks assume.

        static (Backbone.decode_step): T = 1 at time slot `cache.slot`, a device tensor: written in place
        (index_copy_), then all max_len (full layer) or R (ring) slots are attended over: the same shapes
        at every step. Otherwise at time slots cache.length.. (host int): a full layer attends over slots
        0..length+T-1; a ring layer over its R slots followed by the T new keys (only the new ones for the
        first call), and keeps the last min(T, R) of them."""
        k_buf, v_buf = cache.layer_k[self.layer_idx], cache.layer_v[self.layer_idx]  # [B, nkv, max_len | R, hs]
        k, v = k.to(k_buf.dtype), v.to(v_buf.dtype)  # the cache keeps its own dtype (index_copy_ demands equal ones)
        ring = cache.windows[self.layer_idx] is not None
        R = k_buf.shape[2]
        if static:
            # [1]; in a ring, the slot written held time slot - R, which no query from now on sees
            index = (cache.slot % R if ring else cache.slot).view(1)
            k_buf.index_copy_(2, index, k)
            v_buf.index_copy_(2, index, v)
            return k_buf, v_buf
        start, T = cache.length, k.shape[2]
        if not ring:
            k_buf[:, :, start : start + T] = k
            v_buf[:, :, start : start + T] = v
            return k_buf[:, :, : start + T], v_buf[:, :, : start + T]
        keys, values = (k, v) if start == 0 else (torch.cat([k_buf, k], 2), torch.cat([v_buf, v], 2))
        n = min(T, R)
        index = torch.arange(start + T - n, start + T, device=k.device) % R  # [n]: time t goes to ring slot t % R
        k_buf.index_copy_(2, index, k[:, :, T - n :])
        v_buf.index_copy_(2, index, v[:, :, T - n :])
        return keys, values


def _causal_mask(start, T, S, device):
    """[T, S] bool: query at slot start+i sees key slots <= start+i."""
    return torch.arange(S, device=device)[None, :] <= torch.arange(start, start + T, device=device)[:, None]


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    packed_gate_up = None  # (packed [gate; up] weight, bias) inside cpu_packed_linears

    def __init__(self, args: ModelArgs):
        super().__init__()
        H, I, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = Linear(H, I, bias=bias)
        self.up_proj = Linear(H, I, bias=bias)
        self.down_proj = Linear(I, H, bias=bias)

    def forward(self, x):
        if self.packed_gate_up is not None and not torch.is_grad_enabled():  # CPU fast path: one matmul
            gate, up = packed_linear(x, *self.packed_gate_up).chunk(2, -1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)  # [B, T, I] x2
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.norm_after = args.norm_after
        self.self_attn = Attention(args, layer_idx)
        self.mlp = MLP(args)
        if args.norm_after:  # OLMo 2/3 (HF names: the norm applied to the attention / MLP output)
            self.post_attention_layernorm = make_norm(args, args.hidden_size)
            self.post_feedforward_layernorm = make_norm(args, args.hidden_size)
        else:  # the norm applied to the attention / MLP input
            self.input_layernorm = make_norm(args, args.hidden_size)
            self.post_attention_layernorm = make_norm(args, args.hidden_size)

    def forward(self, x, rope, attn_mask, cache, static=False, attend=None):
        if self.norm_after:
            x = x + self.post_attention_layernorm(self.self_attn(x, rope, attn_mask, cache, static, attend))
            return x + self.post_feedforward_layernorm(self.mlp(x))
        x = x + self.self_attn(self.input_layernorm(x), rope, attn_mask, cache, static, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Embeddings, blocks, final norm: input ids [B, T] -> hidden states [B, T, H]."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        # nn.Embedding's own N(0, 1) init, skipped on the meta device (load_model builds there, then loads): there
        # normal_ runs a Python reference that imports torch._dynamo, 1.6-1.9 s of every process's start-up
        weight = torch.empty(args.vocab_size, args.hidden_size)
        if weight.device.type != "meta":
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.num_hidden_layers))
        self.norm = make_norm(args, args.hidden_size)
        self.gradient_checkpointing = False
        self._rope_tables = {}  # (layer type, device) -> (cos, sin) [N, hs] float32, grown on demand

    def rope_table(self, layer_type, n_positions, device):
        """cos, sin [N >= n_positions, hs] float32 for positions 0..N-1 of a layer type's RoPE, sin with its first
        half negated (the sign of rotate_half, see apply_rope)."""
        key = (layer_type, str(device))
        table = self._rope_tables.get(key)
        if table is None or table[0].shape[0] < n_positions:
            n = max(n_positions, 2 * table[0].shape[0] if table is not None else 256)
            a = self.args
            inv_freq, scale = rope_inv_freq(a.rope_parameters[layer_type], a.head_dim, a.max_position_embeddings,
                                            nested=a.family == "olmo3")
            freqs = torch.arange(n, device=device).float()[:, None] * inv_freq.to(device)[None, :]  # [N, hs/2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [N, hs]
            table = (emb.cos() * scale, torch.cat((-freqs.sin(), freqs.sin()), dim=-1) * scale)
            self._rope_tables[key] = table
        return table

    def ropes(self, positions, n_positions, dtype):
        """layer type -> (cos, sin) [B|1, 1, T, hs] at positions [B|1, T] (< n_positions), for layers with RoPE."""
        out = {}
        for layer_type in set(t for t, r in zip(self.args.layer_types, self.args.use_rope) if r):
            cos, sin = self.rope_table(layer_type, n_positions, positions.device)
            cos, sin = cos[positions][:, None], sin[positions][:, None]  # [B, 1, T, hs] float32
            if not self.args.float32_rope_and_norm_weight:
                cos, sin = cos.to(dtype), sin.to(dtype)
            out[layer_type] = (cos, sin)
        return out

    @staticmethod
    def token_major(ropes):
        """The tables of `ropes` as [1, N, 1, hs], for a flat batch's q, k [1, N, nh, hs] (Attention's `attend` path:
        its heads are never moved in front of its tokens)."""
        return {kind: (cos.transpose(1, 2), sin.transpose(1, 2)) for kind, (cos, sin) in ropes.items()}

    def forward(self, input_ids, attention_mask=None, cache: KVCache | None = None):
        """input_ids [B, T]; attention_mask [B, T] (1 = real token, None = all real); with a cache, the T
        tokens are appended after the `cache.length` slots already filled. -> hidden [B, T, H].

        Without a cache, a padded batch whose rows each read [pads, real tokens, pads] (left-padded prompts and
        right-padded responses: every PPO training and scoring pass) runs with each row rolled left by its
        leading pads, so that every pad follows the real tokens: plain causal attention, no mask, is then exact
        for every real token, and SDPA can take a fused kernel (see `attention`). The hidden states come back
        in the input's order; at pad slots they are finite and meaningless. Rows with holes keep a mask."""
        B, T = input_ids.shape
        device = input_ids.device
        start = 0 if cache is None else cache.length
        S = start + T
        windows = self.args.sliding_windows if cache is None else cache.windows
        roll = None  # (index, inverse) [B, T]: row b is computed as input_ids[b, index[b]]
        # Positions count real tokens only, so a left-padded prompt gets the same positions as alone.
        if attention_mask is None:
            padded, key_mask = False, None
            new_positions = torch.arange(T, device=device)[None]  # [1, T]
        else:
            key_mask = attention_mask.bool()  # [B, S=T]
            if cache is None:
                padded, one_run = padding_layout(key_mask)  # the forward's one host sync
                if padded and one_run:
                    roll = roll_indices(key_mask)
                    input_ids, key_mask = input_ids.gather(1, roll[0]), key_mask.gather(1, roll[0])
            else:
                padded = not bool(key_mask.all())
            new_positions = key_mask.long().cumsum(-1) - 1  # [B, T]
        if cache is None:
            positions = new_positions.clamp(min=0)
        else:
            if S > cache.max_len:
                raise ValueError(f"KVCache of {cache.max_len} slots cannot take {T} more after {start}")
            if attention_mask is None:
                cache.mask[:, start:S] = True
                n_new = T
            else:
                cache.mask[:, start:S] = key_mask
                n_new = key_mask.sum(-1)
            positions = (cache.n_real[:, None] + new_positions).clamp(min=0)  # [B, T]
            cache.n_real += n_new
            cache.has_padding = cache.has_padding or padded
            padded = cache.has_padding
            key_mask = cache.mask[:, :S]  # [B, S]

        # One boolean mask [B|1, 1, T, S] per distinct window (None = plain causal). Rolled rows need no
        # padding mask: causal order alone keeps the trailing pads from every real query.
        pad_mask = padded and roll is None
        q_times = torch.arange(start, S, device=device)  # [T]
        masks = {}
        for window in set(windows):
            if cache is not None and window is not None and start > 0:  # keys: the ring's R slots, then the new ones
                k_times = torch.cat([ring_times(start - 1, cache.ring_size, device), q_times])  # [R + T]
                real = cache.mask.gather(1, k_times.clamp(min=0).expand(B, -1))  # [B, R + T]
                masks[window] = causal_window_mask(q_times, k_times, real, window)
            elif not pad_mask and (window is None or window >= S):
                masks[window] = None
            else:  # keys: time slots 0..S-1
                real = key_mask if pad_mask else None
                masks[window] = causal_window_mask(q_times, torch.arange(S, device=device), real, window)

        x = self.embed_tokens(input_ids)  # [B, T, H]
        ropes = self.ropes(positions, S, x.dtype)
        for i, layer in enumerate(self.layers):
            rope = ropes.get(self.args.layer_types[i]) if self.args.use_rope[i] else None
            attn_mask = masks[windows[i]]
            if self.gradient_checkpointing and self.training and cache is None:
                x = torch.utils.checkpoint.checkpoint(layer, x, rope, attn_mask, None, use_reentrant=False)
            else:
                x = layer(x, rope, attn_mask, cache)
        if cache is not None:
            cache.length = S
            cache.slot.fill_(S)
        hidden = self.norm(x)
        if roll is not None:
            hidden = PermuteRows.apply(hidden, roll[1], roll[0])  # back to the input's order
        return hidden

    def decode_step(self, input_ids, cache: KVCache):
        """One new real token per row, input_ids [B, 1], at time slot `cache.slot` -> hidden [B, 1, H].

        The static-cache step: every full-attention layer attends over all max_len slots and every sliding
        layer over its R ring slots, masked by which slots hold real tokens; the slot and the RoPE positions
        (`cache.n_real`) are device tensors, written in place. So every call runs the same kernels on tensors of
        the same shapes and never reads a tensor on the host: what a CUDA graph can capture once and replay
        (generate.CUDAGraphStep). Gives the tokens of `forward` with the cache (tests/test_generate.py)."""
        device = input_ids.device
        slot = cache.slot  # [] int64, the time slot of the new token
        cache.mask.index_fill_(1, slot.view(1), True)
        masks = {}
        for window in set(cache.windows):
            if window is None:  # every slot; the unfilled ones are False in cache.mask
                k_times = torch.arange(cache.max_len, device=device)  # [max_len]
                masks[window] = causal_window_mask(slot.view(1), k_times, cache.mask, None)  # [B, 1, 1, max_len]
            else:
                k_times = ring_times(slot, cache.ring_size, device)  # [R]
                real = cache.mask.gather(1, k_times.clamp(min=0).expand(cache.mask.shape[0], -1))  # [B, R]
                masks[window] = causal_window_mask(slot.view(1), k_times, real, window)  # [B, 1, 1, R]

        x = self.embed_tokens(input_ids)  # [B, 1, H]
        ropes = self.ropes(cache.n_real[:, None], cache.max_len, x.dtype)  # a table for every slot: never regrown
        for i, layer in enumerate(self.layers):
            rope = ropes.get(self.args.layer_types[i]) if self.args.use_rope[i] else None
            x = layer(x, rope, masks[cache.windows[i]], cache, static=True)
        cache.n_real += 1
        cache.slot += 1
        cache.length += 1  # the host copy, for a later `forward`; never read here (a CUDA graph replay skips it)
        return self.norm(x)


    def forward_paged(self, input_ids, positions, attend, n_positions):
        """The rollout engine's step (ppo_core.engine): input_ids [N], the new tokens of several sequences one after
        the other, at positions [N] (each its place in its own sequence, all < n_positions, which the host knows);
        attend(layer index, q, k, v) runs attention against each sequence's cached keys (Attention.forward).
        -> hidden [N, H]."""
        x = self.embed_tokens(input_ids[None])  # [1, N, H]
        ropes = self.token_major(self.ropes(positions[None], n_positions, x.dtype))
        for i, layer in enumerate(self.layers):
            rope = ropes.get(self.args.layer_types[i]) if self.args.use_rope[i] else None
            x = layer(x, rope, None, None, attend=attend)
        return self.norm(x)[0]

    def forward_packed(self, input_ids, positions, seq_lens):
        """A packed batch, the training passes' forward without padding (ppo_core.data.packing): input_ids [N], the real
        tokens of several sequences one after another; positions [N], each token's place in its own sequence (0 at
        its first token); seq_lens, their lengths (host ints). Attention stays within each sequence
        (packed_attention; sliding-window layers see their window). -> hidden [N, H]: row n equals what
        `forward` gives that token in its sequence alone."""
        cu_seqlens = None
        if input_ids.is_cuda:  # once for every layer of the pass (varlen flash attention reads it)
            cu_seqlens = torch.tensor([0] + list(itertools.accumulate(seq_lens)), dtype=torch.int32,
                                      device=input_ids.device)
        windows = self.args.sliding_windows

        def attend(layer_idx, q, k, v):  # q [N, nh, hs], k, v [N, nkv, hs] -> [N, nh, hs]
            return packed_attention(q, k, v, seq_lens, windows[layer_idx], cu_seqlens)

        x = self.embed_tokens(input_ids[None])  # [1, N, H]
        ropes = self.token_major(self.ropes(positions[None], max(seq_lens), x.dtype))
        for i, layer in enumerate(self.layers):
            rope = ropes.get(self.args.layer_types[i]) if self.args.use_rope[i] else None
            if self.gradient_checkpointing and self.training:
                x = torch.utils.checkpoint.checkpoint(layer, x, rope, None, None, False, attend, use_reentrant=False)
            else:
                x = layer(x, rope, None, None, attend=attend)
        return self.norm(x)[0]


class PretrainedMixin:
    """Saving to the Hugging Face layout; shared by both heads."""

    hf_names = {}  # parameter name here -> tensor name in the checkpoint, where they differ

    def save_pretrained(self, out_dir, max_shard_size=None, state_dict=None):
        """Write config.json (as it came) + model.safetensors (or shards of at most `max_shard_size` bytes
        with model.safetensors.index.json), each file atomically. Tensors are written straight from the
        parameters' memory: no second copy of the model. `state_dict` (names as in this module) replaces
        the module's own, e.g. the full tensors gathered from a sharded model."""
        os.makedirs(out_dir, exist_ok=True)
        state = {self.hf_names.get(k, k): v.detach() for k, v in (state_dict or self.state_dict()).items()}
        if self.args.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        shards, current, size = [], {}, 0
        for name, tensor in state.items():
            nbytes = tensor.numel() * tensor.element_size()
            if max_shard_size and current and size + nbytes > max_shard_size:
                shards.append(current)
                current, size = {}, 0
            current[name] = tensor
            size += nbytes
        shards.append(current)
        if len(shards) == 1:
            _atomic_write(os.path.join(out_dir, "model.safetensors"), lambda p: write_safetensors(p, shards[0]))
            names = []
        else:
            names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
            weight_map = {}
            for name, shard in zip(names, shards):
                _atomic_write(os.path.join(out_dir, name), lambda p, s=shard: write_safetensors(p, s))
                weight_map.update({k: name for k in shard})
            total = sum(t.numel() * t.element_size() for t in state.values())
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            _atomic_write(os.path.join(out_dir, "model.safetensors.index.json"), lambda p: _write_json(p, index))
        # remove weight files of an earlier save with another layout, so the directory is not ambiguous
        written = set(names) | {"model.safetensors.index.json"} if names else {"model.safetensors"}
        for f in os.listdir(out_dir):
            is_weights = f in ("model.safetensors", "model.safetensors.index.json") or (
                f.startswith("model-") and f.endswith(".safetensors"))
            if is_weights and f not in written:
                os.remove(os.path.join(out_dir, f))
        config = dict(self.args.hf_config)
        _atomic_write(os.path.join(out_dir, "config.json"), lambda p: _write_json(p, config))

    def num_parameters(self):
        return sum(p.numel() for p in self.parameters())


class CausalLM(nn.Module, PretrainedMixin):
    """Policy / reference: hidden states -> next-token logits."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Backbone(args)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, attention_mask=None, cache=None, return_hidden=False, head_fn=None, paged=None,
                packed=None):
        """input_ids [B, T] -> logits [B, T, V] (or the final hidden states [B, T, H]).

        head_fn(hidden [B, T, H], lm_head_weight [V, H]) -> anything: replaces the LM head, e.g. with a fused
        log-prob or loss kernel that never forms the logits. It runs inside forward, where FSDP has the
        head's weight gathered (outside, a sharded model holds only its shard).
        paged: (positions, attend, n_positions): the rollout engine's flat batch, input_ids [N] -> [N, H] or [N, V]
        (Backbone.forward_paged); through this forward, so that FSDP's hooks see the root module first.
        packed: (positions, seq_lens): a packed batch, input_ids [N] (Backbone.forward_packed); the head (head_fn or
        the LM head) then gets hidden [N, H]."""
        if packed is not None:
            hidden = self.model.forward_packed(input_ids, *packed)
            if head_fn is not None:
                return head_fn(hidden, self.lm_head.weight)
            return hidden if return_hidden else self.lm_head(hidden)
        if paged is not None:
            hidden = self.model.forward_paged(input_ids, *paged)
            return hidden if return_hidden else self.lm_head(hidden)
        hidden = self.model(input_ids, attention_mask, cache)
        if head_fn is not None:
            return head_fn(hidden, self.lm_head.weight)
        return hidden if return_hidden else self.lm_head(hidden)

    def decode_step(self, input_ids, cache: KVCache):
        """input_ids [B, 1] -> logits [B, 1, V]: the fixed-shape static-cache step (Backbone.decode_step)."""
        return self.lm_head(self.model.decode_step(input_ids, cache))


class ScoreModel(nn.Module, PretrainedMixin):
    """Critic / reward model: a scalar per position from the same backbone.

    `forward` gives the value at every position (the critic); `score` the value at each row's last real
    token (the reward model). The head is `score_head` here and `score.weight` in the checkpoint."""

    hf_names = {"score_head.weight": "score.weight"}

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Backbone(args)
        self.score_head = Linear(args.hidden_size, 1, bias=False)

    def forward(self, input_ids, attention_mask=None, packed=None):
        """input_ids [B, T] -> values [B, T] (float32); packed (positions, seq_lens): input_ids [N] -> [N]
        (Backbone.forward_packed)."""
        if packed is not None:
            return self.score_head(self.model.forward_packed(input_ids, *packed)).squeeze(-1).float()
        return self.score_head(self.model(input_ids, attention_mask)).squeeze(-1).float()

    def score_packed(self, input_ids, positions, seq_lens):
        """`score` on a packed batch (Backbone.forward_packed): the score at each sequence's last token -> [S]
        float32; equals `score` with last_token="mask" on the same sequences padded."""
        hidden = self.model.forward_packed(input_ids, positions, seq_lens)  # [N, H]
        last = torch.tensor(list(itertools.accumulate(seq_lens)), device=input_ids.device) - 1  # [S]
        return self.score_head(hidden[last]).squeeze(-1).float()

    def score(self, input_ids, attention_mask=None, *, last_token="mask"):
        """The reward-model reading: the score at the last real token of each row -> [B] float32.

        last_token="mask" (default): the last position where attention_mask is 1 (any padding side).
        last_token="pad_token_id": as transformers' *ForSequenceClassification: the rightmost token that is
        not `pad_token_id` (position 0 if there is none; the last position if the config has no pad id,
        where transformers refuses batches > 1). The two agree unless a real token equals the pad id,
        e.g. a final EOS when pad == eos: transformers then scores the token before it.

        Positions count real tokens only, so on right-padded input this equals transformers; on left-padded
        input it equals transformers on the unpadded sequence (transformers without `position_ids` shifts
        the positions of a left-padded row by its pad count)."""
        B, T = input_ids.shape
        hidden = self.model(input_ids, attention_mask)  # [B, T, H]
        idx = torch.arange(T, device=input_ids.device)
        if last_token == "pad_token_id":
            pad = self.args.pad_token_id
            if pad is None:
                if B != 1:
                    raise ValueError("score(last_token='pad_token_id'): the config has no pad_token_id; "
                                     "transformers cannot score batches > 1 without one")
                last = torch.full((B,), T - 1, device=input_ids.device)
            else:
                last = (idx * (input_ids != pad)).argmax(-1)  # [B]
        elif last_token == "mask":
            mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
            last = (idx * mask.long()).argmax(-1)  # [B], index of the last real token
        else:
            raise ValueError(f"score: last_token must be 'mask' or 'pad_token_id', got {last_token!r}")
        last_hidden = hidden[torch.arange(B, device=input_ids.device), last]  # [B, H]
        return self.score_head(last_hidden).squeeze(-1).float()

    def sequence_score(self, input_ids, attention_mask):
        """Alias of `score` (the name the loop used first)."""
        return self.score(input_ids, attention_mask)


# ---------------------------------------------------------------------------------------------------------------
# safetensors, read and written by hand: 8 bytes header length (little endian), a JSON header
# {name: {"dtype", "shape", "data_offsets": [begin, end]}}, then the raw little-endian tensor bytes.
# Reading with plain file reads straight into each parameter keeps peak memory at the model's size (a memory
# map would add every touched page of the file to the process's RSS), and casts each tensor on its way in.
# The header is checked as the safetensors library checks it before a byte of data is trusted (every entry's
# bytes exactly its tensor's size, the entries tiling the data section with no gap or overlap, to the file's
# last byte), and every read is checked for its length: a crafted or damaged file is a CheckpointError naming
# it, never a parameter left as uninitialised memory or filled from another tensor's bytes.

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
SAFETENSORS_MAX_HEADER = 100_000_000
"""Bytes: a longer header is refused unread (the safetensors library's own limit)."""


def read_safetensors_header(f, file=None):
    """-> ({name: {"dtype", "shape", "data_offsets"}}, byte offset of the data) of a safetensors file open for
    reading at its start, checked before anything is trusted (see above). Raises CheckpointError naming `file`."""
    file = file or getattr(f, "name", "safetensors file")

    def bad(what):
        return CheckpointError(f"cannot read {file} (not a valid safetensors file): {what}")

    size = os.fstat(f.fileno()).st_size
    prefix = f.read(8)
    if len(prefix) != 8:
        raise bad(f"{len(prefix)} bytes long, shorter than the 8-byte header length")
    n = int.from_bytes(prefix, "little")
    if n > SAFETENSORS_MAX_HEADER or n > size - 8:
        raise bad(f"header length {n} bytes, but the file has {size - 8} after it (at most {SAFETENSORS_MAX_HEADER})")
    raw = f.read(n)
    if len(raw) != n:
        raise bad(f"header of {n} bytes, the file ended after {len(raw)}")
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise bad(f"header is not JSON ({str(e) or type(e).__name__})") from None
    if not isinstance(header, dict):
        raise bad(f"header is a JSON {type(header).__name__}, not an object")
    if not isinstance(header.pop("__metadata__", {}), dict):
        raise bad("__metadata__ is not an object")
    for name, info in header.items():
        if not isinstance(info, dict):
            raise bad(f"tensor {name}: its entry is not an object")
        dtype, shape, offsets = _ST_DTYPES.get(info.get("dtype")), info.get("shape"), info.get("data_offsets")
        if dtype is None:
            raise bad(f"tensor {name}: unsupported dtype {info.get('dtype')!r}")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise bad(f"tensor {name}: shape must be a list of non-negative integers, got {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
            raise bad(f"tensor {name}: data_offsets must be [begin, end], got {offsets!r}")
        nbytes = math.prod(shape) * dtype.itemsize
        if offsets[1] - offsets[0] != nbytes:
            raise bad(f"tensor {name}: data_offsets {offsets} span {offsets[1] - offsets[0]} bytes, its shape "
                      f"{shape} of {info['dtype']} takes {nbytes}")
    end = 0  # the tensors must tile the data section: each begins where the one before it ends
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"]):
        begin = info["data_offsets"][0]
        if begin != end:
            raise bad(f"tensor {name} begins at byte {begin} of the data, " +
                      ("overlapping the tensor before it" if begin < end else f"leaving a gap after byte {end}"))
        end = info["data_offsets"][1]
    if 8 + n + end != size:
        raise bad(f"its tensors take {end} bytes after the header, the file has {size - 8 - n}"
                  + (" (truncated)" if 8 + n + end > size else ""))
    return header, 8 + n


def _read_into(f, tensor, file, name):
    """Fill contiguous CPU `tensor` from f's current position; a short read (a file that changed since its header
    was checked) is a CheckpointError, never bytes left as they were."""
    view = memoryview(_bytes_of(tensor))
    done = 0
    while done < len(view):
        got = f.readinto(view[done:])
        if not got:
            raise CheckpointError(f"{file}: tensor {name}: the file ended after {done} of its {len(view)} bytes")
        done += got


def read_safetensors(path) -> dict:
    """Every tensor of a safetensors file (what `safetensors.torch.load_file` returns, on the CPU), through the
    checks of read_safetensors_header. Raises CheckpointError naming the file."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            header, data_start = read_safetensors_header(f, path)
            tensors = {}
            for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"]):
                tensors[name] = torch.empty(info["shape"], dtype=_ST_DTYPES[info["dtype"]])
                f.seek(data_start + info["data_offsets"][0])
                _read_into(f, tensors[name], path, name)
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None
    return tensors


def _bytes_of(tensor):
    """A writable numpy uint8 view of a contiguous CPU tensor's memory."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


def write_safetensors(path, tensors: dict, metadata=None):
    header = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for t in tensors.values():
            t = t.detach().to("cpu").contiguous()  # no copy for a contiguous CPU tensor
            f.write(memoryview(_bytes_of(t)))


def _write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def _atomic_write(path, write):
    """Write to path.tmp, fsync, rename: a reader never sees half a file."""
    tmp = path + ".tmp"
    write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def checkpoint_dir(path) -> str:
    """`path` with `~` expanded, checked to be a directory (every loader starts here, so a mistyped path says
    so rather than naming the first file it lacks) whose files are its own (check_links). Raises CheckpointError."""
    path = os.path.expanduser(os.fspath(path))
    if not os.path.isdir(path):
        raise CheckpointError(f"not a directory: {path!r}" if os.path.exists(path) else f"no such directory: {path!r}")
    check_links(path)
    return path


def link_root(path) -> str:
    """The folder a checkpoint's symbolic links may point into: the checkpoint itself (resolved), or, for a snapshot
    of the Hugging Face cache (models--ORG--NAME/snapshots/REV, whose files are links to ../../blobs/SHA), the
    model's whole cache folder models--ORG--NAME."""
    real = os.path.realpath(path)
    parts = real.split(os.sep)
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots" and parts[i - 1].startswith("models--"):
            return os.sep.join(parts[:i])
    return real


def check_links(path):
    """CheckpointError (one line naming the file) when an entry of checkpoint directory `path` is a symbolic link that
    resolves outside link_root(path): a loader would read it, and every save copy it, as the checkpoint's own (a
    chat_template.jinja linked to a key file lands in each saved tokenizer_config.json). Dot-directories (.git,
    .cache), which no loader reads, are not searched."""
    root = link_root(path)
    for folder, dirs, files in os.walk(path):  # links to directories are checked, not followed
        dirs[:] = [d for d in dirs if not d.startswith(".") or os.path.islink(os.path.join(folder, d))]
        for name in dirs + files:
            entry = os.path.join(folder, name)
            target = os.path.realpath(entry)
            if os.path.islink(entry) and os.path.commonpath([target, root]) != root:
                raise CheckpointError(f"{entry} is a symbolic link to {target}, outside the checkpoint directory "
                                      f"{root}: refused (copy the file into the checkpoint instead)")


def read_json_object(file) -> dict:
    """A JSON file that must hold an object, as a dict. Unreadable, not JSON (or nested past Python's recursion
    limit), or another kind of JSON value: a CheckpointError naming the file."""
    try:
        with open(file, encoding="utf-8") as f:
            value = json.load(f)
    except OSError as e:
        raise CheckpointError(f"cannot read {file}: {e.strerror or e}") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{file}: not valid JSON ({str(e) or type(e).__name__})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(value).__name__}")
    return value


def read_config(path) -> dict:
    """config.json of a checkpoint directory as a dict, checked by check_hf_config."""
    path = checkpoint_dir(path)
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"no config.json in checkpoint directory {path!r}")
    cfg = read_json_object(cfg_path)
    check_hf_config(cfg, cfg_path)
    return cfg


def _safetensors_files(path) -> list[str]:
    """The weight files of a checkpoint directory: model.safetensors, or the shards its index names (plain file
    names in the directory: an index cannot send the loader elsewhere)."""
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: 'weight_map' must be an object of tensor name -> file name")
        names = sorted(set(weight_map.values()))
        for name in names:
            if name != os.path.basename(name) or name in ("", ".", "..") or not name.endswith(".safetensors"):
                raise CheckpointError(f"{index}: shard {name!r} is not a .safetensors file name in the checkpoint")
        return [os.path.join(path, name) for name in names]
    if os.path.isfile(single):
        return [single]
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {path!r}")


def _load_weights(module: nn.Module, path, device, dtype, skip=()):
    """Fill `module` (built on the meta device) from safetensors, one tensor at a time: each is read straight
    into its parameter when dtypes match on the CPU, else through one staging tensor of its own size. Every
    header is read and checked, and every parameter matched to a tensor of its shape, before the module is
    allocated: a config.json describing a bigger model than the files hold costs no memory."""
    def by_file_name():  # the module's tensors by their names in the checkpoint
        params = dict(module.named_parameters(remove_duplicate=False), **dict(module.named_buffers()))
        return {module.hf_names.get(k, k): v for k, v in params.items() if k not in skip}

    params = by_file_name()  # on the meta device: shapes only
    where = {}  # name -> (file, header entry, byte offset of the file's data)
    for file in _safetensors_files(path):
        if not os.path.isfile(file):
            raise CheckpointError(f"missing checkpoint shard {file!r}")
        try:
            with open(file, "rb") as f:
                header, data_start = read_safetensors_header(f, file)
        except OSError as e:
            raise CheckpointError(f"cannot read {file}: {e.strerror or e}") from None
        for name, info in header.items():
            if name not in params:
                continue  # e.g. a ForCausalLM's lm_head when loading a critic
            if name in where:
                raise CheckpointError(f"{file}: tensor {name} is also in {where[name][0]}")
            if tuple(info["shape"]) != tuple(params[name].shape):
                raise CheckpointError(f"{file}: tensor {name} has shape {tuple(info['shape'])}, model expects "
                                      f"{tuple(params[name].shape)}")
            where[name] = (file, info, data_start)
    tied = {"lm_head.weight"} if module.args.tie_word_embeddings else set()
    missing = sorted(set(params) - set(where) - tied)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise CheckpointError(f"checkpoint {path!r} is missing {len(missing)} tensor(s): {shown}")

    module.to(dtype)  # on the meta device: no data, only the dtype of every tensor
    module.to_empty(device=device)
    params = by_file_name()
    for file in dict.fromkeys(file for file, _, _ in where.values()):
        tensors = sorted(((info["data_offsets"][0], name, info, data_start)
                          for name, (in_file, info, data_start) in where.items() if in_file == file))
        with open(file, "rb") as f:
            for begin, name, info, data_start in tensors:  # in file order: one forward pass over the file
                target, file_dtype = params[name], _ST_DTYPES[info["dtype"]]
                f.seek(data_start + begin)
                with torch.no_grad():
                    if target.device.type == "cpu" and file_dtype == target.dtype and target.is_contiguous():
                        _read_into(f, target.data, file, name)
                    else:
                        staging = torch.empty(info["shape"], dtype=file_dtype)
                        _read_into(f, staging, file, name)
                        target.copy_(staging)
                        del staging


def _architecture(cfg) -> str:
    arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    return arch


def _build(cls, path, dtype, device, args=None):
    args = args or ModelArgs.from_hf_config(read_config(path))
    device = torch.device(device or "cpu")
    with torch.device("meta"):
        model = cls(args)
    _load_weights(model, path, device, dtype or torch.float32)
    if args.tie_word_embeddings and isinstance(model, CausalLM):
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def load_model(path, dtype=None, device=None) -> CausalLM:
    """Load a `*ForCausalLM` checkpoint directory (config.json + safetensors) as a CausalLM."""
    path = checkpoint_dir(path)
    arch = _architecture(read_config(path))
    if arch not in ARCHITECTURES_LM:
        raise CheckpointError(f"{path!r} is a {arch}, not a causal LM; load it with load_reward_model")
    return _build(CausalLM, path, dtype, device)


def _score_args(cfg) -> ModelArgs:
    num_labels = cfg.get("num_labels") or len(cfg.get("id2label") or {0: None})
    if num_labels != 1:
        raise CheckpointError(f"config: a reward model must have one label, this one has num_labels={num_labels}")
    return ModelArgs.from_hf_config(cfg)


def load_reward_model(path, dtype=None, device=None) -> ScoreModel:
    """Load a `*ForSequenceClassification` checkpoint with one label (e.g. Skywork-Reward-V2's
    `LlamaForSequenceClassification` / `Qwen3ForSequenceClassification`) as a ScoreModel; `model.score(input_ids, attention_mask)` -> [B] is the reward (see ScoreModel.score)."""
    path = checkpoint_dir(path)
    cfg = read_config(path)
    arch = _architecture(cfg)
    if arch not in ARCHITECTURES_SCORE:
        raise CheckpointError(f"{path!r} is a {arch}; a reward model is one of {', '.join(ARCHITECTURES_SCORE)}")
    return _build(ScoreModel, path, dtype, device, args=_score_args(cfg))


def load_score_model(path, dtype=None, device=None, *, init_head="zeros") -> ScoreModel:
    """A ScoreModel from a directory: a reward model / critic checkpoint (with `score.weight`), or a
    causal-LM checkpoint whose backbone initialises a fresh critic (head set per `init_head`:
    "zeros" or "normal", std 1/sqrt(H+1))."""
    path = checkpoint_dir(path)
    cfg = read_config(path)
    arch = _architecture(cfg)
    if arch in ARCHITECTURES_SCORE:
        return load_reward_model(path, dtype, device)
    # Critic initialised from a policy checkpoint: same backbone, new scalar head.
    args = ModelArgs.from_hf_config(cfg)
    args.hf_config = {**cfg, "architectures": [arch.replace("ForCausalLM", "ForSequenceClassification")], "num_labels": 1}
    args.hf_config.pop("id2label", None)
    args.hf_config.pop("label2id", None)
    with torch.device("meta"):
        model = ScoreModel(args)
    _load_weights(model, path, torch.device(device or "cpu"), dtype or torch.float32, skip={"score_head.weight"})
    with torch.no_grad():
        if init_head == "zeros":
            model.score_head.weight.zero_()
        elif init_head == "normal":
            model.score_head.weight.normal_(0.0, 1.0 / math.sqrt(args.hidden_size + 1))
        else:
            raise ValueError(f"load_score_model: init_head must be 'zeros' or 'normal', got {init_head!r}")
    return model


def count_parameters(config_or_path) -> int:
    """Parameters of the model a config describes (tied embeddings counted once), built on the meta
    device: no memory, no weights. Accepts a checkpoint directory, a config.json path, a dict or ModelArgs."""
    if isinstance(config_or_path, ModelArgs):
        args, arch = config_or_path, (config_or_path.hf_config.get("architectures") or ["LlamaForCausalLM"])[0]
    else:
        cfg = config_or_path
        if isinstance(cfg, (str, os.PathLike)):
            cfg = os.path.expanduser(os.fspath(cfg))
            if os.path.isdir(cfg):
                cfg = read_config(cfg)
            else:
                cfg = read_json_object(cfg)
                check_hf_config(cfg, config_or_path)
        arch = _architecture(cfg)
        args = ModelArgs.from_hf_config(cfg)
    with torch.device("meta"):
        model = ScoreModel(args) if arch in ARCHITECTURES_SCORE else CausalLM(args)
    return model.num_parameters()  # parameters() yields a tied tensor once
