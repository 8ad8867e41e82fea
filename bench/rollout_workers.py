"""Rollout workers on the CPU: one process samples, one trains, taking turns (max_staleness=0) or overlapping
(max_staleness=1), against today's loop on the same two processes (DDP, both roles on both).

    python bench/rollout_workers.py                # SmolLM2-135M shape, random weights, 2 processes x 1 thread (~8 min)
    python bench/rollout_workers.py --batch 8 --samples 4 --new 128   # a shape where the trainer's work dominates
    python bench/rollout_workers.py --tiny         # the same at a toy shape, a minute

Each run is `ppo-train` under torchrun (2 processes, OMP_NUM_THREADS=1 each: the 2 cores) on a scratch checkpoint
(bench/e2e.py's: random weights with EOS and pad made unsampleable, so every response has exactly --new tokens), a
prompts file of --prompt-token prompts, and a reward function (the response's length in characters, cheap on purpose:
the roles' work is the model's). By default GRPO (no critic: the trainer's passes are the old and reference log-probs
and the policy's update), --batch 2 responses in a group of 2, 256 new tokens each, lr 1e-6: a shape where decoding
(256 steps at batch 2, about 8 s here) and training (about 11 s) take comparable time on this CPU, as long
chain-of-thought responses at a small batch do (at 8 x 128 tokens the trainer's work is four times the rollout's,
and overlapping can hide only the smaller part); one epoch of one minibatch, float32,
--iterations iterations; the table takes the median of the iterations after the first (warm-up) from metrics.jsonl:
  s / iteration    time/rollout_s + time/train_s on the trainer (its whole iteration);
  trainer idle     the share of that the trainer spent waiting for a rollout (time/trainer_wait_s and, one update
                   stale, time/trainer_wait_next_s);
  worker idle      the share the worker spent waiting for weights (time/worker_idle_s);
  weights s        sending the weights (with max_staleness=1, also the wait for the next rollout: one call);
  gap              off_policy/behav_gap_mean, mean |log pi_old - log mu| per token (the TIS correction's input).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))
from e2e import model_config, write_checkpoints, write_prompts, write_tokenizer  # noqa: E402

REWARD = "def length(prompts, responses):\n    return [float(len(r)) / 100 for r in responses]\n"


def scratch(workdir, args):
    config = model_config(argparse.Namespace(config=os.path.join(HERE, "..", "configs", "models", "SmolLM2-135M"),
                                             tiny=args.tiny))
    os.makedirs(os.path.join(workdir, "policy"), exist_ok=True)
    write_tokenizer(os.path.join(workdir, "policy"), config["vocab_size"])
    write_checkpoints(workdir, config)
    write_prompts(os.path.join(workdir, "prompts.txt"), 16 * args.batch, args.prompt, config["vocab_size"])
    with open(os.path.join(workdir, "reward.py"), "w") as f:
        f.write(REWARD)


def run(workdir, args, name, extra):
    out = os.path.join(workdir, name)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
               "ppo_core.train", f"--policy={workdir}/policy", f"--prompts_file={workdir}/prompts.txt",
               f"--reward_fn={workdir}/reward.py:length", f"--iterations={args.iterations}",
               f"--rollout_batch_size={args.batch // args.samples}", f"--n_samples_per_prompt={args.samples}",
               f"--adv_estimator={args.estimator}", f"--lr={args.lr}", f"--minibatch_size={args.batch}",
               f"--micro_batch_size={args.batch // 2}", "--ppo_epochs=1", f"--max_new_tokens={args.new}",
               "--eval_size=2", "--eval_every=0", "--dtype=float32", "--threads=1", "--progress=false",
               "--save_every=0", "--keep_checkpoints=1", f"--out={out}", *extra]
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          cwd=workdir)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: {proc.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f][1:]  # the first iteration warms up
    return rows, time.perf_counter() - start


def median(rows, key, default=0.0):
    return statistics.median(r.get(key, default) for r in rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--batch", type=int, default=2, help="responses per iteration")
    parser.add_argument("--samples", type=int, default=2, help="responses per prompt (a group)")
    parser.add_argument("--estimator", default="grpo")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="ppo-workers-")
    scratch(workdir, args)
    shape = "toy shape" if args.tiny else "SmolLM2-135M shape"
    print(f"\n--rollout workers: {shape}, random weights, float32, 2 processes x 1 thread, {args.batch} responses "
          f"({args.samples} per prompt) x {args.prompt} + {args.new} tokens, {args.estimator}, lr {args.lr:g}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| run | s / iteration | trainer idle | worker idle | weights s | gap (nats/token) |")
    print("|---|---:|---:|---:|---:|---:|")
    runs = [("DDP, both roles on both processes (today's loop)", []),
            ("rollout_ranks=1, max_staleness=0 (the roles take turns)", ["--rollout_ranks=1"]),
            ("rollout_ranks=1, max_staleness=1 (the roles overlap), TIS",
             ["--rollout_ranks=1", "--max_staleness=1", "--off_policy_correction=tis"])]
    seconds = {}
    for name, extra in runs:
        rows, _ = run(workdir, args, name.split(",")[0].replace("=", "").replace(" ", "_") + str(len(extra)), extra)
        per_iteration = [r["time/rollout_s"] + r["time/train_s"] for r in rows]
        s = statistics.median(per_iteration)
        seconds[name] = s
        if extra:
            trainer_idle = median(rows, "time/trainer_wait_s") + median(rows, "time/trainer_wait_next_s")
            worker_idle = median(rows, "time/worker_idle_s")
            weights = median(rows, "time/weights_s") + median(rows, "time/weights_and_next_rollout_s")
            cells = f"{trainer_idle / s:.2f} | {worker_idle / s:.2f} | {weights:.2f}"
        else:
            cells = "- | - | -"
        gap = f"{median(rows, 'off_policy/behav_gap_mean'):.4f}" if "--max_staleness=1" in extra else "-"
        print(f"| {name} | {s:.2f} | {cells} | {gap} |", flush=True)
    names = [n for n, _ in runs]
    print(f"| overlap / turns | {seconds[names[2]] / seconds[names[1]]:.2f}x the time | | | | |")


if __name__ == "__main__":
    main()
