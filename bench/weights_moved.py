"""How far trained models moved from their starting checkpoint: the Frobenius norm of (trained - start), by group of
tensors (embeddings and LM head, attention, MLP, norms). Any library's output works, as long as it writes safetensors
with Hugging Face's tensor names (ppo-core's checkpoints, TRL's save_pretrained).

    python bench/weights_moved.py --start ~/.cache/ppo-core/SmolLM2-135M-Instruct \\
        runs/grpo-s0/checkpoints/step-50 trl50/seed0/model

Written for issue 37's question whether TRL learns faster per iteration because it takes larger steps.
"""
import argparse
import os

from safetensors.torch import load_file


GROUPS = ("embed/lm_head", "attention", "mlp", "norms")


def group_of(name: str) -> str:
    """A Llama-family tensor's group (GROUPS) by its Hugging Face name; bench/grad_vs_trl.py groups gradients so."""
    if "embed_tokens" in name or "lm_head" in name:
        return "embed/lm_head"
    if "self_attn" in name:
        return "attention"
    if ".mlp." in name:
        return "mlp"
    if "norm" in name:
        return "norms"
    raise ValueError(name)


def moved(start: dict, trained: dict) -> dict:
    """{group: ||trained - start||_F over the group's tensors} for the tensors both hold."""
    squares = {}
    for name, tensor in start.items():
        if name in trained:
            group = group_of(name)
            squares[group] = squares.get(group, 0.0) + (trained[name].double() - tensor.double()).pow(2).sum().item()
    return {group: total ** 0.5 for group, total in squares.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--start", required=True, help="the checkpoint training started from")
    p.add_argument("trained", nargs="+", help="trained checkpoint directories")
    args = p.parse_args()
    start = load_file(os.path.join(os.path.expanduser(args.start), "model.safetensors"))
    print("| checkpoint | " + " | ".join(GROUPS) + " |\n|---|" + "---:|" * len(GROUPS))
    for path in args.trained:
        distance = moved(start, load_file(os.path.join(path, "model.safetensors")))
        print(f"| {path} | " + " | ".join(f"{distance.get(g, 0.0):.3f}" for g in GROUPS) + " |")


if __name__ == "__main__":
    main()
