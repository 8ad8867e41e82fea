"""Write the 'arith' task as a prompts file with an "answer" column, in the layout RLVR data sets use.

    python scripts/make_arith_prompts.py --out arith.parquet           # or arith.jsonl / arith.json
    ppo-train --task=arith --prompts_file=arith.parquet --reward_fn=ppo_core.data.tasks:arith_answer_reward

Each row is {"prompt": "347+85=", "answer": "432"}: the answer is a string, as GSM8K's ground truths are. The
file holds --n training prompts drawn from the task's seeded stream, then the task's held-out prompts
(tasks.eval_prompts(--eval_size, seed=--seed, task="arith")) last, so that ppo-train's default split (the last
eval_size rows of a prompts file are held out) evaluates exactly the prompts a `--task=arith` run evaluates,
and no training prompt is a held-out one. The format is the file's extension (ppo_core.data.prompts.load_rows reads
it back); Parquet needs pyarrow (`pip install -e '.[parquet]'`).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ppo_core.data.tasks import PromptStream, arith_answer, eval_prompts  # noqa: E402


def arith_rows(n: int, eval_size: int, seed: int) -> list[dict]:
    """n training rows, then eval_size held-out rows: {"prompt", "answer"} each."""
    held_out = eval_prompts(eval_size, seed, task="arith")
    train = PromptStream(seed, held_out, task="arith").next_batch(n)
    return [{"prompt": p, "answer": str(arith_answer(p))} for p in train + held_out]


def write_rows(path: str, rows: list[dict]):
    """rows to `path` as .parquet, .jsonl or .json (one JSON object per line, which load_rows reads)."""
    extension = os.path.splitext(path)[1].lower()
    if extension == ".parquet":
        try:
            import pyarrow
            import pyarrow.parquet
        except ImportError:
            sys.exit("make_arith_prompts: writing Parquet needs pyarrow: pip install -e '.[parquet]'")
        pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    elif extension in (".jsonl", ".json"):
        with open(path, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    else:
        sys.exit(f"make_arith_prompts: --out must end in .parquet, .jsonl or .json, not {path!r}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the file to write: .parquet, .jsonl or .json")
    ap.add_argument("--n", type=int, default=4096, help="training prompts (default 4096)")
    ap.add_argument("--eval_size", type=int, default=256, help="held-out prompts, written last (default 256)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the task's prompts (default 0, ppo-train's)")
    args = ap.parse_args(argv)
    rows = arith_rows(args.n, args.eval_size, args.seed)
    write_rows(args.out, rows)
    print(f"wrote {len(rows)} rows ({args.n} training, {args.eval_size} held out, last) to {args.out}")


if __name__ == "__main__":
    main()
