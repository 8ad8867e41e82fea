"""The real-checkpoint recipe's phases against the CPU's matmul rate, measured in the same process.

    python scripts/make_smollm2_checkpoint.py                     # -> ~/.cache/ppo-core/SmolLM2-135M-Instruct (once)
    python scripts/make_addition_prompts.py --out addition.jsonl  # the recipe's prompts (once)
    python bench/recipe_phases.py --prompts_file addition.jsonl   # 5 iterations of the GRPO recipe, 2 threads: ~3 min
    python bench/recipe_phases.py --prompts_file addition.jsonl --config configs/ppo-smollm2-135m-addition.toml

What it does: runs `ppo_core.train.run` on --config (the recipe as shipped; only the run's length, its held-out set,
checkpoints and sample logging are overridden: --iterations, eval_size 8, save_every 0, log_samples_every 1), then,
in the same process and at the same thread count, the matmul rate of this CPU in the run's matmul dtype: the best of
torch.mm at the model's own GEMM shapes (a packed micro-batch of micro_batch_tokens rows times each linear layer's
weight) and at 2048^3. The table gives, per phase, the median over the iterations after the first (the first warms
oneDNN up) of its seconds, the arithmetic it needs, and the rate that makes:

  generate  the rollout engine (prefill + decode of 64 responses); decode is bound by memory, not matmuls: reported,
            no goal
  score     the forwards that give the old (policy) and reference log-probs, and the critic's values under GAE
            (time/score_s: the rollout's time after decoding, the reward function included, which is microseconds);
            the policy's over the rows outside the update's first minibatch only, where that minibatch's own forward
            gives its old log-probs (update.fresh_first_minibatch)
  update    forward + backward of each minibatch through the loss, the optimizer steps included

Arithmetic a pass needs (multiply-adds x 2), counted from the checkpoint's config.json and the iteration's tokens:
per token, 2 x the linear layers' weights (q, k, v, o, gate, up, down in every layer); per response token the LM head
(2 x vocab x hidden; the fused head computes no other position); causal attention 4 x heads x head_dim per
(query, key) pair, over each row's real tokens (packed passes compute no padding). A backward is twice its forward.
Tokens per iteration come from the run's samples.jsonl: each row's prompt as the loop encodes it
(ppo_core.rollout.prompt_token_ids) and the iteration's mean response length (metrics.jsonl) for every row, so the
attention term is approximate (it is 1-2% of the total) and the rest exact.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]

import torch  # noqa: E402

from ppo_core import train  # noqa: E402
from ppo_core.config import build_config, load_toml  # noqa: E402
from ppo_core.models.tokenizer import load_tokenizer  # noqa: E402
from ppo_core.rollout import prompt_token_ids  # noqa: E402
from ppo_core.models.precision import resolve_precision  # noqa: E402
from ppo_core.update import fresh_first_minibatch  # noqa: E402


def linear_weights(mc) -> list[tuple[int, int]]:
    """(in, out) of every linear layer of one decoder layer."""
    h, hd = mc["hidden_size"], mc.get("head_dim") or mc["hidden_size"] // mc["num_attention_heads"]
    q, kv, inter = mc["num_attention_heads"] * hd, mc["num_key_value_heads"] * hd, mc["intermediate_size"]
    return [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]


def forward_flops(mc, prompt_lens, response_len):
    """FLOPs of one forward over rows of prompt_lens[i] + response_len real tokens -> (body, head, attention)."""
    body_params = mc["num_hidden_layers"] * sum(i * o for i, o in linear_weights(mc))
    hd = mc.get("head_dim") or mc["hidden_size"] // mc["num_attention_heads"]
    tokens = sum(prompt_lens) + response_len * len(prompt_lens)
    pairs = sum((n := p + response_len) * (n + 1) / 2 for p in prompt_lens)  # causal (query, key) pairs
    attention = 4 * mc["num_attention_heads"] * hd * pairs * mc["num_hidden_layers"]
    head = 2 * mc["vocab_size"] * mc["hidden_size"] * response_len * len(prompt_lens)
    return 2 * body_params * tokens, head, attention


def matmul_rate(mc, dtype, tokens, repeats=10):
    """The best TFLOP/s of torch.mm in `dtype` at the model's GEMM shapes ([tokens, in] @ [in, out]) and at 2048^3
    -> (best, {shape: TFLOP/s})."""
    shapes = sorted({(tokens, i, o) for i, o in linear_weights(mc)} | {(tokens, mc["hidden_size"], mc["vocab_size"]),
                                                                        (2048, 2048, 2048)})
    rates = {}
    for m, k, n in shapes:
        a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
        for _ in range(3):
            torch.mm(a, b)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
        rates[f"{m}x{k}x{n}"] = 2 * m * k * n / best / 1e12
    return max(rates.values()), rates


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=os.path.join(os.path.dirname(HERE), "configs", "grpo-smollm2-135m-addition.toml"))
    ap.add_argument("--policy", default=os.path.expanduser("~/.cache/ppo-core/SmolLM2-135M-Instruct"))
    ap.add_argument("--prompts_file", default="addition.jsonl")
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default=None, help="override the recipe's dtype (auto, float32, bf16-mixed)")
    ap.add_argument("--out", default=None, help="run directory (default: a temporary one, deleted)")
    args = ap.parse_args()
    if args.iterations < 2:
        sys.exit("bench/recipe_phases.py: --iterations must be at least 2 (the first one warms up)")

    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or os.path.join(tmp, "run")
        overrides = {"policy": args.policy, "prompts_file": args.prompts_file, "out": out, "iterations": args.iterations,
                     "threads": args.threads, "eval_size": 8, "save_every": 0, "log_samples_every": 1}
        if args.dtype:
            overrides["dtype"] = args.dtype
        cfg = build_config(load_toml(args.config), overrides, toml_path=args.config)
        precision = resolve_precision(cfg)
        train.run(cfg)
        metrics = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
        samples = [json.loads(line) for line in open(os.path.join(out, "samples.jsonl"))]
        mc = json.load(open(os.path.join(args.policy, "config.json")))
        tokenizer = load_tokenizer(args.policy)

        rows = len(samples) // args.iterations
        critic = cfg.adv_estimator == "gae"
        # old (policy) + reference log-probs; the policy skips the update's first minibatch where that minibatch's
        # forward gives its old log-probs (update.fresh_first_minibatch): the other rows' share of the tokens, about
        old_share = 1 - cfg.minibatch_size / rows if fresh_first_minibatch(cfg, rows, torch.Generator()) is not None else 1
        score_passes = (0 if cfg.old_logprobs_from_rollout else old_share) + 1
        per_phase = {"generate": [], "score": [], "update": []}
        flops = {"generate": [], "score": [], "update": []}
        for it, m in enumerate(metrics):
            it_rows = samples[it * rows : (it + 1) * rows]
            prompt_lens = [len(prompt_token_ids(tokenizer, {"prompt": r["prompt"]}, cfg)) for r in it_rows]
            body, head, attention = forward_flops(mc, prompt_lens, m["response/length_mean"])
            fwd = body + head + attention
            value_fwd = body + attention  # the critic: the same backbone, a scalar head
            flops["generate"].append(fwd)
            flops["score"].append(score_passes * fwd + (value_fwd if critic else 0))
            flops["update"].append(3 * cfg.ppo_epochs * (fwd + (value_fwd if critic else 0)))
            per_phase["generate"].append(m["time/generate_s"])
            per_phase["score"].append(m["time/score_s"])
            per_phase["update"].append(m["time/train_s"])
            tokens_in_iteration = sum(prompt_lens) + m["response/length_mean"] * len(prompt_lens)

        dtype = precision.autocast_dtype or precision.param_dtype
        mm_tokens = min(cfg.micro_batch_tokens or 2048, 2048)
        ceiling, rates = matmul_rate(mc, dtype, mm_tokens)

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"\n{os.path.basename(args.config)}, {args.iterations} iterations, {rows} rows each; {cpu}, "
          f"{args.threads} threads, torch {torch.__version__}; matmuls in {str(dtype).replace('torch.', '')} "
          f"({precision.why}); {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"tokens in the last iteration: {tokens_in_iteration:.0f} (prompt + response, {rows} rows)")
    print(f"matmul rate here ({str(dtype).replace('torch.', '')}, torch.mm, best of 10): " +
          ", ".join(f"{k} {v:.2f}" for k, v in rates.items()) + f" TFLOP/s; ceiling {ceiling:.2f}\n")
    print("| phase | s (median, iterations 2+) | GFLOP needed | TFLOP/s | % of the matmul ceiling |")
    print("|---|---:|---:|---:|---:|")
    for phase in per_phase:
        s = statistics.median(per_phase[phase][1:])
        g = statistics.median(flops[phase][1:]) / 1e9
        print(f"| {phase} | {s:.2f} | {g:.1f} | {g / s / 1e3:.3f} | {100 * g / s / 1e3 / ceiling:.0f}% |")


if __name__ == "__main__":
    main()
