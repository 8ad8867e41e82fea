"""Build the tiny SFT checkpoint of the 'arith' task: `ppo_core/demo/arith-demo/`.

    python scripts/make_arith_checkpoint.py                   # ~9 min on one core of this repository's CPU
    python scripts/make_arith_checkpoint.py --out /tmp/arith --steps 500

1. Builds a character-level tokenizer with the `tokenizers` library: the digits, "+", "-", "=", "#", " ".
2. Trains a small Llama-family model (tied embeddings, GQA) by supervised fine-tuning on a *sloppy*
   demonstrator: for each prompt "a+b=" / "a-b=" it writes the true result as "#### N" with probability
   P_CORRECT, and otherwise makes the classic schoolchild's mistake: it adds column by column and
   forgets every carry (347+85 -> 322), or subtracts the smaller digit from the larger in each column
   and forgets every borrow (904-388 -> 684). A problem with no carry or borrow anywhere (about a
   quarter of them) comes out right either way. The policy learns the format, both procedures and
   which one to pick at the first column where they differ, so it starts well below perfect and PPO has
   a single, learnable thing to fix: always carry.
3. Measures exact-match accuracy (ppo_core.data.tasks.arith_rewards) on the 256 held-out prompts that
   `ppo-train --task arith` evaluates (tasks.eval_prompts(256, seed=0, task="arith")), greedy and
   sampled at T=1 with ppo_core.generate, and writes the Hugging Face layout: config.json,
   model.safetensors, tokenizer.json, tokenizer_config.json. Deterministic for a given seed on a given machine.

Measured 2026-12-03 on the development machine (2-core AMD EPYC, one thread), the shipped checkpoint: 6000
steps in 524 s, final SFT loss 0.07; held-out exact match 0.3359 greedy, 0.5234 sampled at T=1 (this script's
sampling; ppo-train's evaluation draws other noise and reads 0.3359 / 0.5078). `ppo-train --task=arith` (PPO, the
defaults, 60 iterations, 30 s) then reaches 0.9219 greedy / 0.8555 sampled.
"""
import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from ppo_core.engine.generate import generate  # noqa: E402
from ppo_core.data.tasks import arith_answer, arith_rewards, eval_prompts, random_arith_prompt  # noqa: E402
from ppo_core.models.tokenizer import Tokenizer as PPOTokenizer  # noqa: E402
from sft import character_tokenizer, right_pad, tiny_llama, train  # noqa: E402  (scripts/sft.py: model, SFT loop)

PAD, EOS = "<pad>", "<eos>"
CHARACTERS = "0123456789+-=# "
P_CORRECT = 0.35
"""How often the demonstrator carries and borrows as it should."""


def columns(a: int, b: int) -> list[tuple[int, int]]:
    """The digit pairs of a and b, units first, the shorter number padded with zeros: 347, 85 -> (7,5) (4,8) (3,0)."""
    n = max(len(str(a)), len(str(b)))
    return [(a // 10**i % 10, b // 10**i % 10) for i in range(n)]


def add_without_carry(a: int, b: int) -> int:
    """Each column's digit sum mod 10, every carry dropped: 347 + 85 -> 322, 95 + 17 -> 2."""
    return sum((x + y) % 10 * 10**i for i, (x, y) in enumerate(columns(a, b)))


def subtract_without_borrow(a: int, b: int) -> int:
    """Each column's larger digit minus its smaller, never a borrow: 904 - 388 -> 684, 52 - 17 -> 45."""
    return sum(abs(x - y) * 10**i for i, (x, y) in enumerate(columns(a, b)))


def demonstration(prompt: str, rng: random.Random, p_correct: float = P_CORRECT) -> str:
    """What the sloppy demonstrator writes after `prompt`: "#### N", N right with probability p_correct."""
    if rng.random() < p_correct:
        return f"#### {arith_answer(prompt)}"
    a, b = (int(x) for x in prompt.rstrip("=").replace("-", "+").split("+"))
    return f"#### {add_without_carry(a, b) if '+' in prompt else subtract_without_borrow(a, b)}"


@torch.no_grad()
def accuracy(model, tok, prompts, greedy, seed=0, max_new_tokens=12) -> float:
    """Held-out exact-match accuracy: responses from ppo_core.generate (left-padded prompts), scored by arith_rewards."""
    model.eval()
    pad_id, eos_id = tok.token_to_id(PAD), tok.token_to_id(EOS)
    encoded = [tok.encode(p).ids for p in prompts]
    P = max(len(e) for e in encoded)
    ids = torch.tensor([[pad_id] * (P - len(e)) + e for e in encoded])  # [B, P]
    mask = torch.tensor([[0] * (P - len(e)) + [1] * len(e) for e in encoded], dtype=torch.bool)  # [B, P]
    tokens = generate(model, ids, max_new_tokens, attention_mask=mask, temperature=1.0, greedy=greedy,
                      eos_token_id=eos_id, pad_token_id=pad_id, generator=torch.Generator().manual_seed(seed))
    responses = [tok.decode([t for t in row if t not in (pad_id, eos_id)]) for row in tokens.tolist()]  # [B]
    model.train()
    return sum(arith_rewards(prompts, responses)) / len(prompts)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "ppo_core", "demo", "arith-demo"))
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--p_correct", type=float, default=P_CORRECT)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # a model this small runs fastest on one thread
    rng = random.Random(args.seed)
    t0 = time.perf_counter()

    tok = character_tokenizer(CHARACTERS, special_tokens=[PAD, EOS])
    pad_id, eos_id = tok.token_to_id(PAD), tok.token_to_id(EOS)
    model = tiny_llama(tok.get_vocab_size(), pad_id, eos_id)
    held_out_list = eval_prompts(256, seed=0, task="arith")
    held_out = set(held_out_list)

    def batch():
        rows, loss_masks = [], []
        while len(rows) < args.batch:
            prompt = random_arith_prompt(rng)
            if prompt in held_out:
                continue
            prompt_ids = tok.encode(prompt).ids
            answer_ids = tok.encode(demonstration(prompt, rng, args.p_correct)).ids + [eos_id]
            rows.append(prompt_ids + answer_ids)
            loss_masks.append([0] * len(prompt_ids) + [1] * len(answer_ids))
        return [right_pad(rows, loss_masks, pad_id)]

    def held_out_accuracy(step):
        if step % 1000 == 999:
            print(f"    held-out accuracy: greedy {accuracy(model, tok, held_out_list, greedy=True):.4f}, "
                  f"T=1 {accuracy(model, tok, held_out_list, greedy=False):.4f}", flush=True)

    train(model, batch, args.steps, args.lr, log_every=250, after_step=held_out_accuracy)

    greedy, sampled = accuracy(model, tok, held_out_list, greedy=True), accuracy(model, tok, held_out_list, greedy=False)
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out)
    PPOTokenizer(tok, {"eos_token": EOS, "pad_token": PAD, "model_max_length": 64}).save_pretrained(args.out)
    print(f"held-out exact match ({len(held_out_list)} prompts): greedy {greedy:.4f}, sampled at T=1 {sampled:.4f}")
    print(f"wrote {os.path.abspath(args.out)} ({model.num_parameters() / 1e6:.2f}M parameters) "
          f"in {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
