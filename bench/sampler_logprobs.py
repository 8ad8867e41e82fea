"""Could the trainer reuse the sampler's log-probs as the old log-probs? How far the rollout engine's per-token
log-probs lie from the training forward's over the same sampled responses, in float32 and in bf16-mixed.

    python bench/sampler_logprobs.py                     # the real checkpoint, 32 chat prompts, 24 tokens at T=0.8
    python bench/sampler_logprobs.py --policy DIR --prompts 64 --threads 2

The engine decodes one token at a time from a paged KV cache (on the CPU under bf16 autocast: oneDNN-packed bf16
weight copies); the training forward runs each whole sequence at once. The same weights, other summation orders: in
float32 the two agree to rounding, and `old_logprobs_from_rollout` saves one forward per iteration at no cost; in
bf16 the roundings compound through the layers, and the first minibatch's ratio pi_theta / pi_old would start away
from 1 by what the table's last column says (where PPO's clip at 0.2 would already bite). The trainer therefore
recomputes the old log-probs by default (old_logprobs_from_rollout = false).
"""
import argparse
import os

import torch

from packed_passes import cpu_name  # bench/, first on the path when this script runs
from ppo_core.engine import RolloutEngine
from ppo_core.models.model import load_model
from ppo_core.models.tokenizer import load_tokenizer

QUESTIONS = ["What is {a} + {b}? Reply with just the number.", "Name a colour that starts with the letter {c}.",
             "Write one sentence about the number {a}.", "What is {a} times {b}?"]


def prompts(tokenizer, n):
    """n chat prompts, the checkpoint's template with its generation prompt."""
    texts = [QUESTIONS[i % len(QUESTIONS)].format(a=10 + 7 * i % 90, b=11 + 13 * i % 89, c="ABCDEFGHIKLMNOPRST"[i % 18])
             for i in range(n)]
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts]


def deviations(model, tokenizer, prompt_ids, max_new_tokens, temperature, dtype):
    """|engine log-prob - training-forward log-prob| of every sampled token, float64 [N]."""
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16-mixed")
    with autocast:
        tokens, engine_logprobs = RolloutEngine(model).generate(
            prompt_ids, max_new_tokens, temperature=temperature, seed=1, eos_token_id=tokenizer.eos_token_ids,
            return_logprobs=True)
    out = []
    for prompt, response, decoded in zip(prompt_ids, tokens, engine_logprobs):
        ids = torch.tensor([prompt + response])  # [1, P + R]
        with torch.no_grad(), autocast:
            logits = model(ids).float()[0, len(prompt) - 1 : -1] / temperature  # [R, V]
        forward = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
        out.append((forward - torch.tensor(decoded, dtype=torch.float64)).abs())
    return torch.cat(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", default=os.path.expanduser("~/.cache/ppo-core/SmolLM2-135M-Instruct"))
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max_new_tokens", type=int, default=24)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.policy, dtype=torch.float32).eval(), load_tokenizer(args.policy)
    prompt_ids = prompts(tokenizer, args.prompts)
    print(f"{cpu_name()}, torch {torch.__version__}, {args.threads} thread(s); "
          f"{args.policy}, {args.prompts} prompts, {args.max_new_tokens} new tokens at T={args.temperature}\n")
    print("| precision | tokens | max abs log-prob difference | mean | max abs(ratio - 1) at the first minibatch |")
    print("|---|---:|---:|---:|---:|")
    for dtype in ("float32", "bf16-mixed"):
        dev = deviations(model, tokenizer, prompt_ids, args.max_new_tokens, args.temperature, dtype)
        print(f"| {dtype} | {dev.numel()} | {dev.max().item():.2e} | {dev.mean().item():.2e} "
              f"| {torch.expm1(dev.max()).item():.2e} |")


if __name__ == "__main__":
    main()
