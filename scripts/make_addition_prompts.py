"""Write the real-checkpoint recipe's task: two-digit addition asked in words, with an exact answer column.

    python scripts/make_addition_prompts.py --out addition.jsonl     # 4096 training rows, then 256 held out
    ppo-train --config configs/grpo-smollm2-135m-addition.toml --policy ~/.cache/ppo-core/SmolLM2-135M-Instruct \
              --prompts_file addition.jsonl

Each row is {"prompt": "What is 59 + 63? Reply with just the number.", "answer": "122"}, both operands drawn
uniformly from 10..99. The file holds --n training rows, then --eval_size held-out rows last (ppo-train's default
split holds out the last eval_size rows), and no held-out (a, b) pair appears among the training rows. The reward is
ppo_core.rewards.verifiers:last_number_reward: the last number in the response equals the answer. SmolLM2-135M-Instruct
starts at about 30% greedy, below 10% sampled at T=0.8, on the held-out rows: room to learn, not zero.
Deterministic for a given --seed.
"""
import argparse
import json
import random

QUESTION = "What is {a} + {b}? Reply with just the number."


def addition_rows(n: int, eval_size: int, seed: int) -> list[dict]:
    """n training rows, then eval_size held-out rows, {"prompt", "answer"} each; the held-out pairs are distinct
    and none of them is a training pair."""
    rng = random.Random(f"addition-{seed}")
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]  # 8,100 pairs
    held_out = rng.sample(pairs, eval_size)
    seen = set(held_out)
    train_pairs = [p for p in pairs if p not in seen]
    train = [rng.choice(train_pairs) for _ in range(n)]
    return [{"prompt": QUESTION.format(a=a, b=b), "answer": str(a + b)} for a, b in train + held_out]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="addition.jsonl", help="the JSONL file to write (default: %(default)s)")
    p.add_argument("--n", type=int, default=4096, help="training rows (default: %(default)s)")
    p.add_argument("--eval_size", type=int, default=256, help="held-out rows, written last (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="which rows (default: %(default)s)")
    args = p.parse_args(argv)
    rows = addition_rows(args.n, args.eval_size, args.seed)
    with open(args.out, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"{args.out}: {args.n} training rows, then {args.eval_size} held-out rows")


if __name__ == "__main__":
    main()
