"""Build the tiny SFT checkpoint that the default job trains: `checkpoints/reverse-demo/`.

    python scripts/make_demo_checkpoint.py                    # ~3 min on one CPU core
    python scripts/make_demo_checkpoint.py --out /tmp/demo --steps 300

1. Trains a character-level tokenizer with the `tokenizers` library on the task's text.
2. Trains a 4-layer Llama-family model (tied embeddings, GQA) by supervised fine-tuning on a *sloppy*
   demonstrator: for each word it reverses it with probability 0.4, else copies it, and misspells
   each character with probability 0.1. The resulting policy knows the format and both behaviours,
   starts near reward 0.4 and leaves PPO real headroom (see ppo_core/data/tasks.py).
3. Writes the Hugging Face layout: config.json, model.safetensors, tokenizer.json,
   tokenizer_config.json. Deterministic for a given seed on a given machine.
"""
import argparse
import os
import random
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from ppo_core.data.tasks import ALPHABET, SEPARATOR, eval_prompts, random_word  # noqa: E402
from ppo_core.models.tokenizer import Tokenizer as PPOTokenizer  # noqa: E402
from sft import character_tokenizer, right_pad, tiny_llama, train  # noqa: E402  (scripts/sft.py: model, SFT loop)

PAD, EOS = "<pad>", "<eos>"


def demonstration(word: str, rng: random.Random) -> str:
    """What the sloppy demonstrator writes for `word`."""
    out = word[::-1] if rng.random() < 0.4 else word
    return "".join(rng.choice(ALPHABET) if rng.random() < 0.1 else c for c in out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "ppo_core", "demo", "reverse-demo"))
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # a model this small runs fastest on one thread
    rng = random.Random(args.seed)

    tok = character_tokenizer(ALPHABET + SEPARATOR, special_tokens=[PAD, EOS])
    pad_id, eos_id = tok.token_to_id(PAD), tok.token_to_id(EOS)
    model = tiny_llama(tok.get_vocab_size(), pad_id, eos_id)
    held_out = set(eval_prompts(256, seed=0))

    def batch():
        rows, loss_masks = [], []
        while len(rows) < args.batch:
            w = random_word(rng)
            if w + SEPARATOR in held_out:
                continue
            prompt = tok.encode(w + SEPARATOR).ids
            answer = tok.encode(demonstration(w, rng)).ids + [eos_id]
            rows.append(prompt + answer)
            loss_masks.append([0] * len(prompt) + [1] * len(answer))
        return [right_pad(rows, loss_masks, pad_id)]

    train(model, batch, args.steps, args.lr, log_every=100)

    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out)
    PPOTokenizer(tok, {"eos_token": EOS, "pad_token": PAD, "model_max_length": 64}).save_pretrained(args.out)
    print(f"wrote {os.path.abspath(args.out)} ({model.num_parameters() / 1e6:.2f}M parameters)")


if __name__ == "__main__":
    main()
