"""Does ppo-core sample from the distribution transformers samples from? The same float32 checkpoint, the recipe's
held-out prompts in its chat template, T=0.8, up to 24 new tokens, stop at its EOS: the rollout engine, ppo-core's
padded generate() and transformers' generate, each drawing --samples responses per prompt with its own noise.

    python bench/sampler_vs_transformers.py --prompts_file addition.jsonl        # 64 prompts x 8, 1 thread: minutes
    python bench/sampler_vs_transformers.py --prompts_file addition.jsonl --dtype bf16-mixed \\
        --policy runs/X/checkpoints/step-40

--dtype bf16-mixed samples as a bf16-mixed run does: ppo-core under bf16 autocast (the engine then decodes with
oneDNN-packed bf16 weight copies), transformers' generate under the same autocast (as TRL's GRPOTrainer with bf16=True
samples); the weights stay float32 in both.

The three draw different tokens (counter-based noise per row and token against torch's global generator), so only
the distributions can agree: the table gives each sampler's accuracy (last_number_reward), share of responses ended
at EOS and mean length, with their standard errors. Written for issue 37's question whether TRL (which samples with
transformers' generate) learns faster because its samples come from another distribution.
"""
import argparse
import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
import transformers  # noqa: E402  (bench/kernels.py would shadow the `kernels` package transformers imports)

from bench.packed_passes import cpu_name  # noqa: E402
from ppo_core import load_model  # noqa: E402
from ppo_core.config import build_config, load_toml  # noqa: E402
from ppo_core.data.prompts import load_rows  # noqa: E402
from ppo_core.models.tokenizer import load_tokenizer  # noqa: E402
from ppo_core.rewards.verifiers import last_number_reward  # noqa: E402
from ppo_core.rollout import prompt_token_ids, sample_responses  # noqa: E402
from ppo_core.run.start import Step  # noqa: E402

CONFIG = os.path.join(os.path.dirname(HERE), "configs", "grpo-smollm2-135m-addition.toml")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", default="~/.cache/ppo-core/SmolLM2-135M-Instruct")
    p.add_argument("--prompts_file", required=True, help="the recipe's JSONL (scripts/make_addition_prompts.py)")
    p.add_argument("--prompts", type=int, default=64, help="the first held-out rows (the file's last 256)")
    p.add_argument("--samples", type=int, default=8, help="responses per prompt and sampler")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", choices=["float32", "bf16-mixed"], default="float32",
                   help="float32 throughout, or bf16 autocast over the float32 weights (as a bf16-mixed run samples)")
    return p.parse_args()


def row_stats(name, rows, texts, lengths, ended):
    """One table row: accuracy, EOS share and mean length, each +- its standard error."""
    n = len(texts)
    rewards = last_number_reward([r["prompt"] for r in rows], texts, [r["answer"] for r in rows])
    acc, eos = sum(rewards) / n, sum(ended) / n
    mean = sum(lengths) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in lengths) / (n - 1))
    return (f"| {name} | {n} | {acc:.3f} ± {math.sqrt(acc * (1 - acc) / n):.3f} | {eos:.3f} ± "
            f"{math.sqrt(eos * (1 - eos) / n):.3f} | {mean:.2f} ± {sd / math.sqrt(n):.2f} |")


def ppo_core_samples(policy, tokenizer, rows, cfg, samples, autocast):
    texts, lengths, ended = [], [], []
    for s in range(samples):
        out = sample_responses(policy, tokenizer, rows, Step(cfg, torch.Generator().manual_seed(1000 + s), autocast))
        mask, t, e = out.response_mask, out.texts, out.ended
        texts += t
        lengths += mask.sum(-1).int().tolist()
        ended += e.tolist()
    return texts, lengths, ended


def transformers_samples(path, tokenizer, rows, cfg, samples, autocast):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    encoded = [prompt_token_ids(tokenizer, r, cfg) for r in rows]
    width = max(map(len, encoded))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(x)) + x for x in encoded])  # left-padded
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in encoded])
    eos = tokenizer.eos_token_ids
    texts, lengths, ended = [], [], []
    for s in range(samples):
        torch.manual_seed(2000 + s)
        with torch.no_grad(), autocast():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=cfg.temperature,
                                 top_k=0, top_p=1.0, max_new_tokens=cfg.max_new_tokens, eos_token_id=eos,
                                 pad_token_id=tokenizer.pad_token_id)
        for row in out[:, width:].tolist():
            stop = next((i for i, t in enumerate(row) if t in eos), None)
            length = len(row) if stop is None else stop + 1
            texts.append(tokenizer.decode(row[:length]))
            lengths.append(length)
            ended.append(stop is not None)
    return texts, lengths, ended


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    path = os.path.expanduser(args.policy)
    rows = load_rows(args.prompts_file)[-256:][: args.prompts]
    tokenizer = load_tokenizer(path)
    policy = load_model(path, dtype=torch.float32, device=torch.device("cpu"))
    bf16 = args.dtype == "bf16-mixed"
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)  # noqa: E731
    table = ["| sampler | responses | accuracy | ended at EOS | mean length (tokens) |", "|---|---:|---|---|---|"]
    all_rows = rows * args.samples
    for engine, name in (("paged", "ppo-core rollout engine"), ("padded", "ppo-core generate()")):
        cfg = build_config(load_toml(CONFIG), {"policy": path, "rollout_engine": engine})
        table.append(row_stats(name, all_rows, *ppo_core_samples(policy, tokenizer, rows, cfg, args.samples, autocast)))
        print(table[-1], flush=True)
    cfg = build_config(load_toml(CONFIG), {"policy": path})
    table.append(row_stats("transformers generate", all_rows,
                           *transformers_samples(path, tokenizer, rows, cfg, args.samples, autocast)))
    print(f"\n{cpu_name()}, {args.threads} thread(s), {args.dtype}, {args.policy}, T={cfg.temperature}, "
          f"{cfg.max_new_tokens} new tokens, {args.prompts} held-out prompts x {args.samples}\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
