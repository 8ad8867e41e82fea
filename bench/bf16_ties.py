"""Why the first optimizer step of a bf16-mixed run moves the policy so far: weights that sit on bf16 rounding ties.

    python bench/bf16_ties.py --prompts_file addition.jsonl            # ~1 min, the real SmolLM2 checkpoint

Under bf16 autocast the matmuls see bf16(w) of the float32 master weights w, rounded to nearest (ties to even). A
checkpoint whose float32 values have few significant bits (upcast from float16, or dequantized from GGUF, whose blocks
are float16 scales times small integers) holds many values exactly halfway between two bf16 numbers. An optimizer step
of any size moves each of those by a whole bf16 step (0.4-0.8% of the value; at this checkpoint's ties a median
2.4e-4, ~100x the recipe's first step) when it goes away from the even neighbour, and not at all when it goes toward
it: always in the step's direction. So the first step along a gradient is several times larger in the bf16 forward
than in float32; a random step of the same size is not (its jumps cancel to first order).

What it prints, on --rows chat-rendered prompts followed by their answer and <|im_end|>:
  1. the share of the checkpoint's float32 values that are exactly bf16 numbers, and exactly halfway between two;
  2. the KL(theta0 || theta1) per token, in float32 and under bf16 autocast, where theta1 = theta0 - lr * sign(g)
     (Adam's first step: m/sqrt(v) = sign(g)) and g is the float32 gradient of a policy-gradient loss
     -A * log p(answer) (A = +-1 per row), then of a random sign step of the same size, then of the same gradient
     step taken from the weights rounded to bf16 first (the values the bf16 matmuls saw anyway: no ties left).
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]

import torch  # noqa: E402

from ppo_core import load_model, load_tokenizer  # noqa: E402
from ppo_core.data.prompts import load_rows  # noqa: E402


def tie_shares(tensors):
    """(share exactly a bf16 number, share exactly halfway between two, the median gap between the two bf16 numbers
    around a tie: how far a tie's bf16 value jumps) of the float32 values."""
    total = exact = halfway = 0
    gaps = []
    for t in tensors:
        bits = t.detach().float().contiguous().view(torch.int32)
        low = bits & 0xFFFF  # the 16 bits bf16 drops
        total, exact, halfway = total + t.numel(), exact + int((low == 0).sum()), halfway + int((low == 0x8000).sum())
        below = bits[low == 0x8000] & ~0xFFFF  # the bf16 number below a tie (toward zero), and the next one up
        gaps.append(((below + 0x10000).view(torch.float32) - below.view(torch.float32)).abs())
    return exact / total, halfway / total, torch.cat(gaps).median().item()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--policy", default="~/.cache/ppo-core/SmolLM2-135M-Instruct")
    p.add_argument("--prompts_file", required=True, help="rows with 'prompt' and 'answer' (make_addition_prompts.py)")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--lr", type=float, default=2.5e-6, help="the step: the recipe's first (lr 1e-5 x 1/4 warm-up)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    path = os.path.expanduser(args.policy)
    model, tok = load_model(path), load_tokenizer(path)
    rows = load_rows(args.prompts_file)[: args.rows]
    ids = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True)
           + tok.encode(str(r["answer"])) + [tok.token_to_id("<|im_end|>")] for r in rows]
    width = max(map(len, ids))
    x = torch.tensor([i + [0] * (width - len(i)) for i in ids])
    mask = torch.tensor([[True] * len(i) + [False] * (width - len(i)) for i in ids])
    advantage = torch.randn(len(ids), 1).sign()
    params = dict(model.named_parameters())
    theta0 = {k: v.detach().clone() for k, v in params.items()}

    def set_weights(weights):
        with torch.no_grad():
            for k, v in params.items():
                v.copy_(weights[k])

    def logprobs(bf16):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return torch.log_softmax(model(x, attention_mask=mask).float(), -1)

    def kl(start, step, bf16):  # KL(start || start + step) per real token
        with torch.no_grad():
            set_weights(start)
            a = logprobs(bf16)
            set_weights({k: start[k] + step[k] for k in start})
            b = logprobs(bf16)
        return float((a.exp() * (a - b)).sum(-1)[mask].mean())

    set_weights(theta0)
    logp = logprobs(False)[:, :-1].gather(-1, x[:, 1:, None])[..., 0]
    (-(advantage * logp * mask[:, 1:]).sum() / mask[:, 1:].sum()).backward()
    grad_step = {k: -args.lr * v.grad.sign() for k, v in params.items()}
    gen = torch.Generator().manual_seed(1)
    random_step = {k: args.lr * torch.randn(v.shape, generator=gen).sign() for k, v in params.items()}
    rounded = {k: v.bfloat16().float() for k, v in theta0.items()}

    exact, halfway, gap = tie_shares(theta0.values())
    print(f"{path}: {sum(v.numel() for v in theta0.values()):,} float32 values; {exact:.1%} are bf16 numbers, "
          f"{halfway:.1%} lie exactly halfway between two (a tie), which a step of any size moves by their gap: "
          f"median {gap:.2g}, {gap / args.lr:.0f}x the step below")
    print(f"{len(ids)} rows, {int(mask.sum())} tokens; one sign step of {args.lr:g} per value; "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}\n")
    print("| step | KL per token, float32 forward | KL per token, bf16 autocast forward | bf16 / float32 |")
    print("|---|---:|---:|---:|")
    for name, start, step in (("along the gradient, from the checkpoint", theta0, grad_step),
                              ("random signs, from the checkpoint", theta0, random_step),
                              ("along the gradient, from the checkpoint rounded to bf16", rounded, grad_step)):
        f32, bf16 = kl(start, step, False), kl(start, step, True)
        print(f"| {name} | {f32:.2e} | {bf16:.2e} | {bf16 / f32:.2g}x |")


if __name__ == "__main__":
    main()
