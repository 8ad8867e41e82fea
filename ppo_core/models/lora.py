"""LoRA: low-rank adapters on the attention and MLP projections, the memory lever for PPO (Hu et al. 2021,
https://arxiv.org/abs/2106.09685). The base weights are frozen; each adapted projection learns a rank-r update.

    policy = add_lora(load_model(path), rank=64)             # base frozen, only lora_A / lora_B train
    logits = policy(ids, mask)                                # the adapted policy
    with adapters_disabled(policy), torch.no_grad():
        ref_logits = policy(ids, mask)                        # the reference: the base, no second copy
    save_merged(policy, "out/")                               # a plain HF checkpoint; training goes on
    write_safetensors("adapters.safetensors", lora_state_dict(policy))   # resumable: adapters only (model.py)
    merge_lora(policy).save_pretrained("out/")                # or fold in place for good

The update (section 4.1 of the paper), for a projection W [out, in] with bias b and scale s = alpha / r:

    y = W x + b + s * B (A x)        A [r, in], B [out, r]

Init as in the paper and peft: A Kaiming-uniform (nn.Linear's default, bound 1/sqrt(in)), B zeros, so B A = 0
and a freshly adapted model computes exactly what the base does. alpha defaults to r (s = 1): the paper sets
alpha to the first r tried and does not tune it; dividing by r means less retuning of the learning rate
when r changes.

The reference policy of PPO is the model before training: with LoRA that is the base, so `adapters_disabled`
drops the s B A x term and the same weights serve as both policy and reference. Run the reference under
torch.no_grad(): with gradient checkpointing, a backward outside the block would recompute with adapters on.

Names: the base keeps its Hugging Face names (`model.layers.0.self_attn.q_proj.weight`), the adapters sit beside
it (`...q_proj.lora_A`, `...q_proj.lora_B`), so the base still loads and saves by HF names and
`lora_state_dict` holds only the adapter tensors. Adapters are float32 whatever the base's dtype (the trainable
parameters are fp32 master weights, as ppo_core/run/plan.py counts them); the forward casts them to the input's
dtype, so no float32 copy of the activations is made or saved.

What the caller must know:
  - `model.cpu_packed_linears` fuses q/k/v and gate/up into one packed matmul that never calls the adapted
    modules; while `has_lora(model)`, do not pack (ppo_core.models.model.can_pack_for_cpu should return False).
  - `model.save_pretrained` of an adapted model writes the un-merged base plus lora_* tensors, which
    transformers ignores (and so does load_model): export with `save_merged` or `merge_lora`.
  - A ScoreModel's `score_head` stays trainable (a critic initialised from a policy starts with a new head
    that must learn); `trainable_extra` changes which parameters besides the adapters train.
"""
import math
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from .model import Linear, PretrainedMixin, ScoreModel

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # every block's linears


class LoRALinear(Linear):
    """A frozen Linear plus a trainable low-rank update: y = W x + b + (alpha / r) * B (A x).

    Holds the very `weight` and `bias` Parameters of the Linear it replaces (no copy), so the base keeps its
    name and its storage."""

    def __init__(self, base: Linear, rank: int, alpha: float, dropout: float = 0.0, dtype=torch.float32,
                 generator=None):
        nn.Module.__init__(self)  # not nn.Linear.__init__: that would allocate a new weight
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        device = base.weight.device
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, device=device, dtype=dtype))  # [r, in]
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, device=device, dtype=dtype))  # [out, r]
        # a = sqrt(5): nn.Linear's own init, uniform in +-1/sqrt(in), as in the paper's code and peft
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5), generator=generator)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_enabled = True

    def forward(self, x):
        y = super().forward(x)  # W x + b, through the packed weight when there is one
        if not self.lora_enabled:
            return y
        # s * B (A x): scaled at the rank-r intermediate (r numbers per token instead of out); A and B cast to
        # x's dtype (a no-op in float32), so autograd saves x itself for A's gradient, not a float32 copy
        h = F.linear(self.lora_dropout(x), self.lora_A.to(x.dtype)) * self.scale  # [..., r]
        return y + F.linear(h, self.lora_B.to(x.dtype))  # [..., out]

    def delta_weight(self, device=None):
        """s * B @ A [out, in] in float32 (on `device`, default the adapters'): what merging adds to W."""
        A, B = self.lora_A.detach().to(device, torch.float32), self.lora_B.detach().to(device, torch.float32)
        return (B @ A) * self.scale

    def extra_repr(self):
        return super().extra_repr() + f", rank={self.rank}, alpha={self.alpha}"


def _lora_modules(model):
    """(name, LoRALinear) of every adapted projection."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoRALinear)]


def _replace(model, name, module):
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def add_lora(model, rank: int, alpha: float | None = None, targets=LORA_TARGETS, dropout: float = 0.0, *,
             trainable_extra=None, dtype=torch.float32, generator=None):
    """Freeze every parameter of `model` and put a rank-`rank` adapter on each Linear whose name ends in one of
    `targets` (default: q/k/v/o and gate/up/down of every block, LORA_TARGETS). In place;
    returns the model.

    alpha: the update is scaled by alpha / rank; None means alpha = rank (scale 1).
    dropout: on the adapter's input only (peft's lora_dropout); it makes the policy stochastic in train mode,
        so the PPO ratio of the first epoch is no longer 1 unless rollouts score in eval mode. Default off.
    trainable_extra: parameter-name prefixes that stay trainable besides the adapters; None means
        ("score_head",) for a ScoreModel (the critic's head) and () for a CausalLM.
    dtype: of the adapters (float32: they are the fp32 master weights of what trains).
    generator: for A's random init (all processes must agree: seed it, or broadcast after)."""
    if rank < 1:
        raise ValueError(f"add_lora: rank must be >= 1, got {rank}")
    if dropout < 0 or dropout >= 1:
        raise ValueError(f"add_lora: dropout must be in [0, 1), got {dropout}")
    if has_lora(model):
        raise ValueError("add_lora: the model already has adapters (merge_lora first to stack a new set)")
    alpha = float(rank if alpha is None else alpha)
    if trainable_extra is None:
        trainable_extra = ("score_head",) if isinstance(model, ScoreModel) else ()
    chosen = [(name, m) for name, m in model.named_modules()
              if isinstance(m, Linear) and name.rsplit(".", 1)[-1] in targets]
    found = {name.rsplit(".", 1)[-1] for name, _ in chosen}
    unknown = sorted(set(targets) - found)
    if unknown or not chosen:
        raise ValueError(f"add_lora: no Linear named {unknown or list(targets)} in the model "
                         f"(targets are module names such as {', '.join(LORA_TARGETS)})")
    uses = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    tied = [name for name, m in chosen if uses[id(m.weight)] > 1]
    if tied:  # merging would change the tensor it is tied to as well (e.g. a tied lm_head and embed_tokens)
        raise ValueError(f"add_lora: {tied[0]}.weight is tied to another parameter; it cannot take an adapter")
    for name, p in model.named_parameters():
        p.requires_grad_(any(name == e or name.startswith(e + ".") for e in trainable_extra))
    for name, linear in chosen:
        _replace(model, name, LoRALinear(linear, rank, alpha, dropout, dtype, generator))
    return model


def has_lora(model) -> bool:
    """Whether any projection of `model` carries an adapter."""
    return any(isinstance(m, LoRALinear) for m in model.modules())


def count_lora_parameters(model) -> int:
    """Adapter parameters: sum of r (in + out) over the adapted projections (ppo_core.run.plan's `lora`)."""
    return sum(m.lora_A.numel() + m.lora_B.numel() for _, m in _lora_modules(model))


@contextmanager
def adapters_disabled(model):
    """Inside this block every adapter contributes nothing: `model` computes its base, the PPO reference."""
    modules = [m for _, m in _lora_modules(model)]
    was_enabled = [m.lora_enabled for m in modules]
    try:
        for m in modules:
            m.lora_enabled = False
        yield model
    finally:
        for m, enabled in zip(modules, was_enabled):
            m.lora_enabled = enabled


def merge_lora(model):
    """Fold every adapter into its base weight in place, W <- W + s B A (computed in float32, then cast to W's
    dtype), and put the plain Linear back: `model.save_pretrained` then writes a plain HF checkpoint.
    Irreversible (W + s B A - s B A is not W in floating point), so not for a run that keeps training with
    the base as reference: use `save_merged` there. The merged weights stay frozen (requires_grad False)."""
    for name, m in _lora_modules(model):
        with torch.no_grad():
            merged = m.weight.float() + m.delta_weight(m.weight.device)  # [out, in] float32
            m.weight.copy_(merged.to(m.weight.dtype))
        with torch.device("meta"):  # a Linear without allocating a weight, then given the base's
            plain = Linear(m.in_features, m.out_features, bias=m.bias is not None)
        plain.weight, plain.bias = m.weight, m.bias
        _replace(model, name, plain)
    return model


def merged_state_dict(model, device=None, state=None) -> dict:
    """`model.state_dict()` as it would be after `merge_lora`, without touching the model: the lora_* tensors
    left out, each adapted weight replaced by a new merged tensor (float32 sum, cast to W's dtype, on `device`,
    default W's). Costs one copy of the adapted weights; every other tensor is the live one, not copied.
    state: merge this state dict of the model instead of its own (e.g. the full tensors gathered from
    FSDP shards)."""
    state = model.state_dict() if state is None else state
    merged = {}
    for name, m in _lora_modules(model):
        W = state[f"{name}.weight"].detach()
        A, B = (state[f"{name}.{k}"].detach().to(device, torch.float32) for k in ("lora_A", "lora_B"))
        merged[f"{name}.weight"] = (W.to(device, torch.float32) + (B @ A) * m.scale).to(W.dtype)
    out = {}
    for name, tensor in state.items():
        if name.rsplit(".", 1)[-1] in ("lora_A", "lora_B"):
            continue
        out[name] = merged.get(name, tensor)
    return out


class _MergedView(PretrainedMixin):
    """What `save_pretrained` reads of a model (args, hf_names, state_dict), with the adapters folded in."""

    def __init__(self, model, device):
        self.args, self.hf_names = model.args, model.hf_names
        self.model, self.device = model, device

    def state_dict(self):
        return merged_state_dict(self.model, self.device)


def save_merged(model, out_dir, max_shard_size=None, device=None):
    """`model.save_pretrained(out_dir)` with the adapters merged into the written weights, the model itself
    unchanged (a mid-run export: training continues on the same base and adapters). `device="cpu"` builds the
    merged copies in host memory instead of beside the model."""
    _MergedView(model, device).save_pretrained(out_dir, max_shard_size)


def lora_state_dict(model) -> dict:
    """{"...q_proj.lora_A": [r, in], "...q_proj.lora_B": [out, r], ...}: the adapter tensors only (detached,
    the live storage), for resumable checkpoints; the base comes from the checkpoint the run started from.
    alpha is not a tensor and is not stored: resume with the same alpha."""
    out = {}
    for name, m in _lora_modules(model):
        out[f"{name}.lora_A"] = m.lora_A.detach()
        out[f"{name}.lora_B"] = m.lora_B.detach()
    return out


def load_lora_state_dict(model, state: dict):
    """Copy adapter tensors (as from `lora_state_dict`) into the model's adapters, in place (an optimizer
    holding them keeps working). Every adapter must be present with its shape, and nothing else."""
    own = lora_state_dict(model)
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(f"load_lora_state_dict: missing {missing[:4]}{' ...' if len(missing) > 4 else ''}, "
                         f"unexpected {unexpected[:4]}{' ...' if len(unexpected) > 4 else ''}")
    for name, target in own.items():
        if tuple(state[name].shape) != tuple(target.shape):
            raise ValueError(f"load_lora_state_dict: {name} has shape {tuple(state[name].shape)}, the model's "
                             f"adapter is {tuple(target.shape)} (a different rank?)")
    with torch.no_grad():
        for name, target in own.items():
            target.copy_(state[name])
    return model
