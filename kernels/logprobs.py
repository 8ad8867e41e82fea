"""Per-token log-probs (and entropy) from logits: log_softmax + gather.

The plain PyTorch reference lives here; the fused Triton kernel is to be added beside it.
"""
import torch

IGNORE_INDEX = -100


def token_logprobs_reference(logits, labels, *, temperature=1.0, return_entropy=False):
    """log p(label) under softmax(logits / temperature), in float32.

    logits: [..., V] any float dtype; labels: [...] int64, IGNORE_INDEX (-100) rows give 0.
    Returns logprobs [...] float32, or (logprobs, entropy) with return_entropy=True.
    """
    logits = logits.float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)  # [..., V]
    ignored = labels == IGNORE_INDEX
    safe_labels = labels.masked_fill(ignored, 0)
    logprobs = logp_all.gather(-1, safe_labels.unsqueeze(-1)).squeeze(-1)
    logprobs = logprobs.masked_fill(ignored, 0.0)
    if not return_entropy:
        return logprobs
    probs = logp_all.exp()
    # H = -sum_v p_v log p_v; 0 * -inf is taken as 0 for tokens with zero probability
    entropy = -(probs * logp_all.masked_fill(probs == 0, 0.0)).sum(-1)
    entropy = entropy.masked_fill(ignored, 0.0)
    return logprobs, entropy


def token_logprobs(logits, labels, *, temperature=1.0, return_entropy=False):
    """Dispatching entry point (for now always the reference)."""
    return token_logprobs_reference(logits, labels, temperature=temperature, return_entropy=return_entropy)
