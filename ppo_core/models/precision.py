"""How a run computes on this machine: cfg.dtype and cfg.device resolved (`resolve_precision`), and which code
computes each head's log-probs and loss (`loss_paths`). The run's first lines say both (`precision_line`).

    precision = resolve_precision(cfg)       # Precision(device, param_dtype, autocast_dtype, why)
    with precision.autocast():               # every forward of the run: rollout, scoring, update, evaluation
        ...

dtype='auto' turns on bf16 autocast where bf16 matmuls are fast (`bf16_matmul_hardware`: a GPU, or an x86 CPU whose
oneDNN runs AMX or AVX512-BF16); ppo-train and ppo-serve-reward (ppo_core.rewards.server) resolve it alike.
"""
import contextlib
import dataclasses

import torch

import ppo_kernels

from .. import algo
from ..config import ConfigError, PPOConfig, uses_critic
from .model import onednn_bf16_supported


def bf16_matmul_hardware(device) -> str:
    """What makes bf16 matmuls fast on `device`: "CUDA", "AMX" or "AVX512-BF16" (x86 CPUs, through oneDNN), or ""
    where they are not (other CPUs emulate bf16 and run it slower than fp32)."""
    if device == "cuda":
        return "CUDA"
    if device != "cpu" or not onednn_bf16_supported():  # e.g. ONEDNN_MAX_CPU_ISA=AVX2 on an AVX-512 CPU
        return ""
    if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        return "AMX"
    if getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)():
        return "AVX512-BF16"
    return ""


@dataclasses.dataclass(frozen=True)
class Precision:
    """How a run computes (cfg.dtype resolved on this machine): the device, the parameters' dtype and the autocast
    dtype of the matmuls (None = no autocast). Under bf16-mixed, fp32 master weights feed bf16 matmuls (and bf16
    attention on a GPU; on the CPU attention computes in fp32, where it is faster: model.attention); norms,
    log-softmax, losses, GAE and the optimizer stay fp32."""
    device: str
    param_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    why: str

    def autocast(self):
        """The context every forward of the run (rollout, scoring, update, evaluation, reward model) runs in."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device, dtype=self.autocast_dtype)

    def describe(self) -> dict:
        """What config.json and the log report."""
        name = lambda d: str(d).replace("torch.", "")  # noqa: E731
        return {"device": self.device, "weights": name(self.param_dtype),
                "matmuls": name(self.autocast_dtype or self.param_dtype), "why": self.why}


def precision_line(p: Precision) -> str:
    d = p.describe()
    if d["matmuls"] == d["weights"]:
        return f"{d['weights']} throughout ({d['why']})"
    attention = "float32 attention" if d["device"] == "cpu" else f"{d['matmuls']} attention"  # model.attention
    line = f"{d['weights']} weights, {d['matmuls']} autocast for the matmuls, {attention} ({d['why']})"
    return line + ("; " + cpu_bf16_path() if d["device"] == "cpu" else "")


def loss_paths(cfg: PPOConfig, device) -> str:
    """Which code computes each head's log-probs and loss, and why (said in the run's first lines): ppo_kernels' fused
    kernels (Triton on CUDA, a chunked torch path on the CPU; PPO_KERNELS_BACKEND forces one) or the plain torch
    reference, which forms the full [B, T, V] logits. The policy loss is cfg.policy_loss_kind's function
    (algo.policy_loss_function) on either path, as update.policy_objective calls it."""
    kind = cfg.policy_loss_kind
    reference_loss = f"algo.{algo.policy_loss_function(kind).__name__}"
    correction = cfg.off_policy_correction
    weighted = (f", each token weighted by algo.off_policy_weights (off_policy_correction={correction!r})"
                if correction != "none" else "")
    if not cfg.fused_kernels:
        return (f"the torch reference for every head: full logits, log_softmax + gather, {reference_loss}{weighted} "
                f"(fused_kernels=false)")
    kernels = "Triton" if ppo_kernels.backend(torch.device(device)) == "triton" else "chunked torch"
    rows = {"token": "per tile of tokens", "row": "per chunk of rows", "batch": "all rows at once"}[algo.loss_coupling(kind)]
    terms = "".join([" + the KL term" if not cfg.kl_in_reward else "", " - the entropy bonus" if cfg.entropy_coef else ""])
    update = (f"policy loss: {reference_loss}{weighted}{terms}, on fused linear_logprob_loss ({kernels}; the loss's "
              f"per-token gradient taken {rows}, no [T, V] logits)")
    old = "old log-probs from decoding, reference" if cfg.old_logprobs_from_rollout else "old and reference"
    value = "; value loss: the critic's scalar head + algo.value_loss (no [T, V] logits)" if uses_critic(cfg) else ""
    return f"{update}; {old} log-probs: fused linear_token_logprobs ({kernels}){value}"


def cpu_bf16_path() -> str:
    """Which kernels multiply in bf16 on this CPU (said in the run's first lines): oneDNN's, with packed weight
    copies for decoding, or, on CPUs oneDNN runs no bf16 on, torch's generic ones (model.onednn_bf16_supported)."""
    if onednn_bf16_supported():
        return "bf16 matmuls on oneDNN's bf16 kernels, packed weights for decoding"
    return ("bf16 matmuls on torch's generic kernels, unpacked weights (oneDNN runs no bf16 on this CPU: it needs "
            "AVX512-BW/VL/DQ or AVX-NE-CONVERT); slower than float32 here")


def resolve_precision(cfg) -> Precision:
    device = "cuda" if cfg.device == "auto" and torch.cuda.is_available() else ("cpu" if cfg.device == "auto" else cfg.device)
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("config key 'device' is 'cuda' but no CUDA device is available")
    if cfg.dtype == "bfloat16":
        return Precision(device, torch.bfloat16, None, "dtype='bfloat16': bf16 parameters, no fp32 master copy")
    if cfg.dtype == "float32":
        return Precision(device, torch.float32, None, "dtype='float32'")
    if cfg.dtype == "bf16-mixed":
        return Precision(device, torch.float32, torch.bfloat16, "dtype='bf16-mixed'")
    hardware = bf16_matmul_hardware(device)  # dtype='auto'
    if hardware:
        return Precision(device, torch.float32, torch.bfloat16, f"dtype='auto': bf16 matmuls are fast here ({hardware})")
    return Precision(device, torch.float32, None, "dtype='auto': oneDNN has neither AMX nor AVX512-BF16 on this CPU "
                                                  "(bf16 would run on generic kernels, slower than fp32)")
