"""How far trained models moved from their starting checkpoint: the Frobenius norm of (trained - start), by group of
tensors (embeddings and LM head, attention, MLP, norms). Any library's output works, as long as it writes safetensors
with Hugging Face's tensor names (ppo-core's checkpoints, TRL's save_pretrained).

    python bench/weights_moved.py --start ~/.cache/ppo-core/SmolLM2-135M-Instruct \\
        runs/grpo-s0/checkpoints/step-50 trl50/seed0/model
    python bench/weights_moved.py --start ... --embedding_rows 2 -- DIR ...   # also the distance of token 2's row

--embedding_rows: token ids whose embedding row's distance is printed beside the median row's (a tied row is also that
token's LM-head row; 2 is <|im_end|>, SmolLM2's EOS and pad token, whose input-side gradient TRL's padding_idx stops).

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


def row_distances(start: dict, trained: dict, rows) -> tuple[list, float]:
    """([||trained row r - start row r||_2 for r in rows], the median row's) of the embedding matrix."""
    name = next(n for n in start if "embed_tokens" in n)
    distance = (trained[name].double() - start[name].double()).norm(dim=1)
    return [distance[r].item() for r in rows], distance.median().item()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--start", required=True, help="the checkpoint training started from")
    p.add_argument("trained", nargs="+", help="trained checkpoint directories")
    p.add_argument("--embedding_rows", type=int, nargs="*", default=[],
                   help="token ids whose embedding row's distance is printed")
    args = p.parse_args()
    start = load_file(os.path.join(os.path.expanduser(args.start), "model.safetensors"))
    rows = [f"row {r}" for r in args.embedding_rows] + (["median row"] if args.embedding_rows else [])
    columns = list(GROUPS) + rows
    print("| checkpoint | " + " | ".join(columns) + " |\n|---|" + "---:|" * len(columns))
    for path in args.trained:
        trained = load_file(os.path.join(path, "model.safetensors"))
        distance = moved(start, trained)
        cells = [f"{distance.get(g, 0.0):.3f}" for g in GROUPS]
        if args.embedding_rows:
            picked, median = row_distances(start, trained, args.embedding_rows)
            cells += [f"{d:.4f}" for d in picked + [median]]
        print(f"| {path} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
