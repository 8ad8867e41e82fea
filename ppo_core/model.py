"""The decoder: one readable Llama-family transformer, loaded from and saved to the Hugging Face layout.

    model = load_model("checkpoints/reverse-demo")           # config.json + model.safetensors
    logits = model(input_ids, attention_mask)                 # [B, T, V]
    model.save_pretrained("out/")                             # loads unchanged in `transformers`

Module names mirror the Hugging Face ones (`model.layers.0.self_attn.q_proj.weight`, `lm_head.weight`,
`score.weight`), so a checkpoint's tensors map onto parameters by name with no renaming table.

Two heads share one backbone class:
  - `CausalLM`    (`*ForCausalLM`): policy and reference; `lm_head` over the vocabulary.
  - `ScoreModel`  (`*ForSequenceClassification` with one label): critic and reward model; a scalar
                  `score` head on every position (the critic reads all of them, a reward model the
                  last real token).

Shapes: B batch, T sequence, H hidden, nh query heads, nkv key/value heads, hs head size, V vocab.
"""
import json
import math
import os
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

ARCHITECTURES_LM = ("LlamaForCausalLM", "Qwen3ForCausalLM")
ARCHITECTURES_SCORE = ("LlamaForSequenceClassification", "Qwen3ForSequenceClassification")


@dataclass
class ModelArgs:
    """The architecture, read from a Hugging Face `config.json` (field names as there)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    """Qwen3: RMSNorm over each head of q and k before RoPE."""
    pad_token_id: int | None = None
    hf_config: dict = field(default_factory=dict, repr=False)
    """The config.json as it came, written back unchanged by `save_pretrained`."""

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArgs":
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        supported = ARCHITECTURES_LM + ARCHITECTURES_SCORE
        if arch not in supported:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(supported)}")
        n_heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", 10000.0),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", False),
            mlp_bias=cfg.get("mlp_bias", False),
            qk_norm=arch.startswith("Qwen3"),
            pad_token_id=cfg.get("pad_token_id"),
            hf_config=dict(cfg),
        )


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32 as Hugging Face does."""

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions, head_dim, theta, dtype):
    """RoPE tables for integer positions [B, T] -> cos, sin [B, T, hs] (the HF 'rotate_half' layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim))
    freqs = positions.float()[..., None] * inv_freq  # [B, T, hs/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, hs]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x, cos, sin):
    """x: [B, nh, T, hs]; cos/sin: [B, T, hs]. x*cos + rotate_half(x)*sin."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


class KVCache:
    """A static cache: keys/values for every layer, preallocated for `max_len` positions.

    k, v: [L, B, nkv, max_len, hs]. `length` is how many positions are filled; `mask` [B, max_len]
    marks real (non-pad) positions, so attention never looks at padding or unfilled slots.
    """

    def __init__(self, args: ModelArgs, batch_size, max_len, device, dtype):
        shape = (args.num_hidden_layers, batch_size, args.num_key_value_heads, max_len, args.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.mask = torch.zeros(batch_size, max_len, device=device, dtype=torch.bool)
        self.length = 0


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        H, hs, bias = args.hidden_size, args.head_dim, args.attention_bias
        self.q_proj = nn.Linear(H, self.n_heads * hs, bias=bias)
        self.k_proj = nn.Linear(H, self.n_kv * hs, bias=bias)
        self.v_proj = nn.Linear(H, self.n_kv * hs, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hs, H, bias=bias)
        if args.qk_norm:
            self.q_norm = RMSNorm(hs, args.rms_norm_eps)
            self.k_norm = RMSNorm(hs, args.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, allowed, cache: KVCache | None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, nh|nkv, T, hs]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            start = cache.length
            cache.k[self.layer_idx, :, :, start : start + T] = k
            cache.v[self.layer_idx, :, :, start : start + T] = v
            k = cache.k[self.layer_idx, :, :, : start + T]
            v = cache.v[self.layer_idx, :, :, : start + T]
        # allowed: [B, 1, T, S] bool; GQA by sharing each kv head among nh/nkv query heads
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=self.n_heads != self.n_kv)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        return self.o_proj(y)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        H, I, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = nn.Linear(H, I, bias=bias)
        self.up_proj = nn.Linear(H, I, bias=bias)
        self.down_proj = nn.Linear(I, H, bias=bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(args, layer_idx)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, cos, sin, allowed, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, allowed, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Embeddings, blocks, final norm: input ids [B, T] -> hidden states [B, T, H]."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.gradient_checkpointing = False

    def forward(self, input_ids, attention_mask=None, cache: KVCache | None = None):
        B, T = input_ids.shape
        device = input_ids.device
        if attention_mask is None:
            attention_mask = torch.ones(B, T, dtype=torch.bool, device=device)
        attention_mask = attention_mask.bool()
        if cache is None:
            key_mask, start = attention_mask, 0  # [B, S=T]
        else:
            start = cache.length
            cache.mask[:, start : start + T] = attention_mask
            key_mask = cache.mask[:, : start + T]  # [B, S]
        # Positions count real tokens only, so a left-padded prompt gets the same positions as alone.
        positions = (key_mask.long().cumsum(-1) - 1).clamp(min=0)[:, start:]  # [B, T]
        S = key_mask.shape[1]
        q_pos = torch.arange(start, start + T, device=device)
        causal = q_pos[:, None] >= torch.arange(S, device=device)[None, :]  # [T, S]
        allowed = causal[None] & key_mask[:, None, :]  # [B, T, S]
        # A pad query has no real key before it; let it see itself so softmax stays finite (its
        # output is never read).
        allowed = allowed | (q_pos[:, None] == torch.arange(S, device=device)[None, :])[None]
        allowed = allowed[:, None]  # [B, 1, T, S]

        x = self.embed_tokens(input_ids)  # [B, T, H]
        cos, sin = rope_cos_sin(positions, self.args.head_dim, self.args.rope_theta, x.dtype)
        for layer in self.layers:
            if self.gradient_checkpointing and self.training and cache is None:
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, allowed, None, use_reentrant=False)
            else:
                x = layer(x, cos, sin, allowed, cache)
        if cache is not None:
            cache.length = start + T
        return self.norm(x)


class PretrainedMixin:
    """Saving to the Hugging Face layout; shared by both heads."""

    def save_pretrained(self, out_dir):
        """Write config.json (as it came) + model.safetensors, atomically per file."""
        from safetensors.torch import save_file

        os.makedirs(out_dir, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        if self.args.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        _atomic_write(os.path.join(out_dir, "model.safetensors"), lambda p: save_file(state, p, metadata={"format": "pt"}))
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
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, attention_mask=None, cache=None, return_hidden=False):
        """input_ids [B, T] -> logits [B, T, V] (or the final hidden states [B, T, H])."""
        hidden = self.model(input_ids, attention_mask, cache)
        return hidden if return_hidden else self.lm_head(hidden)


class ScoreModel(nn.Module, PretrainedMixin):
    """Critic / reward model: a scalar per position from the same backbone."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Backbone(args)
        self.score = nn.Linear(args.hidden_size, 1, bias=False)

    def forward(self, input_ids, attention_mask=None):
        """input_ids [B, T] -> values [B, T] (float32)."""
        return self.score(self.model(input_ids, attention_mask)).squeeze(-1).float()

    def sequence_score(self, input_ids, attention_mask):
        """The reward-model reading: the score at the last non-pad token of each row -> [B]."""
        values = self(input_ids, attention_mask)  # [B, T]
        T = input_ids.shape[1]
        last = T - 1 - attention_mask.long().flip(-1).argmax(-1)  # index of last real token
        return values.gather(1, last[:, None]).squeeze(1)


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


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded (missing file, missing tensor, bad config)."""


def read_config(path) -> dict:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"no config.json in checkpoint directory {path!r}")
    try:
        with open(cfg_path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None


def _safetensors_files(path) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
        return [os.path.join(path, f) for f in files]
    if os.path.isfile(single):
        return [single]
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {path!r}")


def _load_weights(module: nn.Module, path, device, dtype):
    """Stream tensors from safetensors into `module` (built on the meta device) one at a time."""
    from safetensors import safe_open

    module.to_empty(device=device)
    params = dict(module.named_parameters(remove_duplicate=False))
    params.update(dict(module.named_buffers()))
    seen = set()
    for file in _safetensors_files(path):
        if not os.path.isfile(file):
            raise CheckpointError(f"missing checkpoint shard {file!r}")
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name not in params:
                        continue  # e.g. a ForCausalLM's lm_head when loading a critic
                    tensor = f.get_tensor(name)
                    target = params[name]
                    if tuple(tensor.shape) != tuple(target.shape):
                        raise CheckpointError(f"{file}: tensor {name} has shape {tuple(tensor.shape)}, model expects {tuple(target.shape)}")
                    with torch.no_grad():
                        target.copy_(tensor.to(dtype))
                    seen.add(name)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for truncated files
            raise CheckpointError(f"cannot read {file}: {e}") from None
    tied = {"lm_head.weight"} if getattr(module.args, "tie_word_embeddings", False) else set()
    missing = sorted(set(params) - seen - tied)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise CheckpointError(f"checkpoint {path!r} is missing {len(missing)} tensor(s): {shown}")


def _build(cls, path, dtype, device, args=None):
    args = args or ModelArgs.from_hf_config(read_config(path))
    dtype = dtype or torch.float32
    device = torch.device(device or "cpu")
    with torch.device("meta"):
        model = cls(args)
    _load_weights(model, path, device, dtype)
    if args.tie_word_embeddings and isinstance(model, CausalLM):
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def load_model(path, dtype=None, device=None) -> CausalLM:
    """Load a `*ForCausalLM` checkpoint directory (config.json + safetensors) as a CausalLM."""
    return _build(CausalLM, path, dtype, device)


def load_score_model(path, dtype=None, device=None, *, init_head="zeros") -> ScoreModel:
    """A ScoreModel from a directory: a reward model / critic checkpoint (with `score.weight`), or a
    causal-LM checkpoint whose backbone initialises a fresh critic (head set per `init_head`)."""
    cfg = read_config(path)
    arch = (cfg.get("architectures") or [""])[0]
    if arch.endswith("ForSequenceClassification"):
        return _build(ScoreModel, path, dtype, device)
    # Critic initialised from a policy checkpoint: same backbone, new scalar head.
    args = ModelArgs.from_hf_config(cfg)
    lm_arch = arch or "LlamaForCausalLM"
    args.hf_config = {**cfg, "architectures": [lm_arch.replace("ForCausalLM", "ForSequenceClassification")], "num_labels": 1}
    args.hf_config.pop("id2label", None)
    with torch.device("meta"):
        model = ScoreModel(args)
    model.score.weight.requires_grad_(False)
    # score.weight is not in a causal-LM checkpoint: load everything else, then initialise the head.
    head = model.score
    model.score = nn.Identity()
    _load_weights(model, path, torch.device(device or "cpu"), dtype or torch.float32)
    model.score = head.to_empty(device=device or "cpu")
    with torch.no_grad():
        if init_head == "zeros":
            model.score.weight.zero_()
        else:
            model.score.weight.normal_(0.0, 1.0 / math.sqrt(args.hidden_size + 1))
    model.score.weight.requires_grad_(True)
    return model
