"""ppo_kernels: the PPO hot path: per-token log-probs and entropy, any loss of them fused with the LM head, decode attention.

No loss formula lives here: linear_logprob_loss takes the loss as a function (ppo_core.algo's math) and does the
[N, V] work around it.

Every operation here has one public function that dispatches on the device: CUDA tensors run the
Triton kernel, CPU tensors run a chunked (memory-lean) PyTorch path; `*_reference` is the plain PyTorch
the others are tested against. `PPO_KERNELS_BACKEND=triton|torch`
forces one (the tests run the Triton kernels on the CPU under `TRITON_INTERPRET=1`).
"""
import sys

if __name__ == "kernels":
    # This folder is the package `ppo_kernels` (setup.py's package_dir). A Python started in the checkout's root has
    # the root on sys.path and would find this folder under its folder name, `kernels`, which is also a PyPI package
    # (transformers imports it). Step aside: import whatever `kernels` the rest of sys.path holds, or fail exactly as
    # if this folder were not there. Nothing of ppo_kernels runs under this name.
    import importlib
    import os

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _saved_path = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    del sys.modules[__name__]
    try:
        sys.modules[__name__] = importlib.import_module(__name__)  # the import machinery returns this entry
    finally:
        sys.path[:] = _saved_path
else:
    from .linear_logprobs import linear_token_logprobs, linear_token_logprobs_reference
    from .logprobs import _backend as backend  # backend(device) -> "triton" or "torch": what runs for its tensors
    from .logprobs import token_logprobs, token_logprobs_reference
    from .loss import linear_logprob_loss, linear_logprob_loss_reference
    from .paged_attention import decode_attention, paged_decode_attention, paged_decode_attention_reference

    __all__ = [
        "backend",
        "token_logprobs", "token_logprobs_reference",
        "linear_token_logprobs", "linear_token_logprobs_reference",
        "linear_logprob_loss", "linear_logprob_loss_reference",
        "decode_attention", "paged_decode_attention", "paged_decode_attention_reference",
    ]
