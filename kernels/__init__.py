"""ppo_kernels: the PPO hot path (per-token log-probs, entropy, the clipped loss).

Every operation here has one public function that dispatches on the device: CUDA tensors run the
Triton kernel, CPU tensors run a chunked (memory-lean) PyTorch path; `*_reference` is the plain PyTorch
the others are tested against. `PPO_KERNELS_BACKEND=triton|torch`
forces one (the tests run the Triton kernels on the CPU under `TRITON_INTERPRET=1`).
"""
from .linear_logprobs import linear_token_logprobs, linear_token_logprobs_reference
from .logprobs import token_logprobs, token_logprobs_reference
from .loss import linear_policy_loss, linear_policy_loss_reference, policy_loss, policy_loss_reference

__all__ = [
    "token_logprobs", "token_logprobs_reference",
    "linear_token_logprobs", "linear_token_logprobs_reference",
    "policy_loss", "policy_loss_reference",
    "linear_policy_loss", "linear_policy_loss_reference",
]
