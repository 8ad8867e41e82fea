"""ppo_kernels: the PPO hot path (per-token log-probs, entropy, the clipped loss).

Every operation here has one public function that dispatches on the device: CUDA tensors run the
Triton kernel, CPU tensors run the plain PyTorch reference. `PPO_KERNELS_BACKEND=triton|torch`
forces one (the tests run the Triton kernels on the CPU under `TRITON_INTERPRET=1`).
"""
from .logprobs import token_logprobs, token_logprobs_reference

__all__ = ["token_logprobs", "token_logprobs_reference"]
