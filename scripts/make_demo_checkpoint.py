"""Build the tiny SFT checkpoint that the default job trains: `checkpoints/reverse-demo/`.

    python scripts/make_demo_checkpoint.py                    # ~3 min on one CPU core
    python scripts/make_demo_checkpoint.py --out /tmp/demo --steps 300

1. Trains a character-level tokenizer with the `tokenizers` library on the task's text.
2. Trains a 4-layer Llama-family model (tied embeddings, GQA) by supervised fine-tuning on a *sloppy*
   demonstrator: for each word it reverses it with probability 0.4, else copies it, and misspells
   each character with probability 0.1. The resulting policy knows the format and both behaviours,
   starts near reward 0.4 and leaves PPO real headroom (see ppo_core/tasks.py).
3. Writes the Hugging Face layout: config.json, model.safetensors, tokenizer.json,
   tokenizer_config.json. Deterministic for a given seed on a given machine.
"""
import argparse
import math
import os
import random
import sys

import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from ppo_core.model import CausalLM, ModelArgs  # noqa: E402
from ppo_core.tasks import ALPHABET, SEPARATOR, eval_prompts, random_word  # noqa: E402
from ppo_core.tokenizer import Tokenizer as PPOTokenizer  # noqa: E402

PAD, EOS = "<pad>", "<eos>"


def train_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.WordLevel(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token a character
    tok.decoder = decoders.Fuse()  # decode by concatenation, no spaces
    trainer = trainers.WordLevelTrainer(special_tokens=[PAD, EOS], min_frequency=1)
    corpus = [ALPHABET + SEPARATOR] * 4
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


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

    tok = train_tokenizer()
    pad_id, eos_id = tok.token_to_id(PAD), tok.token_to_id(EOS)
    vocab = tok.get_vocab_size()
    hf_config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "pad_token_id": pad_id,
        "eos_token_id": eos_id,
        "bos_token_id": None,
        "torch_dtype": "float32",
    }
    model = CausalLM(ModelArgs.from_hf_config(hf_config))
    for name, p in model.named_parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
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
        T = max(len(r) for r in rows)
        ids = torch.tensor([r + [pad_id] * (T - len(r)) for r in rows])
        lm = torch.tensor([m + [0] * (T - len(m)) for m in loss_masks], dtype=torch.float32)
        attn = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])
        return ids, attn, lm

    model.train()
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        ids, attn, loss_mask = batch()
        logits = model(ids, attn)[:, :-1]  # predict token t+1 from position t
        nll = F.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1), reduction="none")
        loss = (nll * loss_mask[:, 1:].reshape(-1)).sum() / loss_mask[:, 1:].sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  sft loss {loss.item():.4f}  lr {lr:.2e}", flush=True)

    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out)
    PPOTokenizer(tok, {"eos_token": EOS, "pad_token": PAD, "model_max_length": 64}).save_pretrained(args.out)
    print(f"wrote {os.path.abspath(args.out)} ({model.num_parameters() / 1e6:.2f}M parameters)")


if __name__ == "__main__":
    main()
