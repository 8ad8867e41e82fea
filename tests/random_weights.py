"""Random weights for tiny test models, at unit scale so that every layer matters in the logits."""
import torch


def randomize(model, seed=0):
    """Unit-scale weights: matrices ~ N(0, 1/fan_in), norm weights ~ 1 + N(0, 0.3^2), biases ~ N(0, 0.1^2)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_((1.0 if "norm" in name else 0.0) + (0.3 if "norm" in name else 0.1) * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model
