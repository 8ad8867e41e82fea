"""Held-out accuracy against iterations: every step checkpoint of one or more ppo-train runs scored by ppo-eval, and
the first step at which each run reaches a greedy accuracy.

    python bench/checkpoint_curve.py --runs runs/grpo runs/distill --reach 0.6 -- \\
        --config configs/grpo-smollm2-135m-addition.toml --prompts_file addition.jsonl --n 1 --k 1 --threads 2

Everything after `--` goes to ppo-eval as it is (its --policy is each checkpoint in turn): the same held-out rows,
reward and sampling for every run. A checkpoint already scored (RUN/curve/step-N.json) is read, not scored again, so an
interrupted table continues. Prints one row per step that any run saved: greedy accuracy and pass@1 (the first of
--n samples, at the config's temperature) with their standard errors over the prompts, and then, per run, the first
step whose greedy accuracy is >= --reach (or that none did). A run's starting checkpoint is its step 0 when --base
names it (scored once, shared by every run that starts from it).
"""
import argparse
import json
import os
import subprocess
import sys


def steps_of(run_dir):
    """{step: checkpoint dir} of a run's checkpoints/step-N folders."""
    folder = os.path.join(run_dir, "checkpoints")
    return {int(name.split("-", 1)[1]): os.path.join(folder, name) for name in os.listdir(folder)
            if name.startswith("step-") and name.split("-", 1)[1].isdigit()}


def scored(checkpoint, out, eval_args):
    """ppo-eval's eval.json for `checkpoint` at `out` (made if missing) -> its scores."""
    if not os.path.exists(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        cmd = ["ppo-eval", "--policy", checkpoint, "--out", out, *eval_args]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"checkpoint_curve: ppo-eval failed on {checkpoint}: {done.stderr.strip().splitlines()[-1:]}")
    return json.load(open(out))["scores"]


def main():
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", nargs="+", required=True, help="ppo-train run directories")
    ap.add_argument("--reach", type=float, default=0.6, help="the greedy accuracy whose first step is reported")
    ap.add_argument("--base", default=None, help="the runs' starting checkpoint, scored as step 0")
    args = ap.parse_args(argv[:cut])
    eval_args = argv[cut + 1:]
    curves = {}
    for run in args.runs:
        curve = {}
        if args.base:
            curve[0] = scored(args.base, os.path.join(args.runs[0], "curve", "base.json"), eval_args)
        for step, checkpoint in sorted(steps_of(run).items()):
            curve[step] = scored(checkpoint, os.path.join(run, "curve", f"step-{step}.json"), eval_args)
        curves[run] = curve
    names = [os.path.basename(os.path.normpath(run)) for run in args.runs]
    print("| step | " + " | ".join(f"{n} greedy | {n} pass@1" for n in names) + " |")
    print("|---:|" + "---:|---:|" * len(names))
    for step in sorted({s for c in curves.values() for s in c}):
        cells = []
        for run in args.runs:
            s = curves[run].get(step)
            cells += ([f"{s['greedy']['mean']:.3f} ± {s['greedy']['se']:.3f}", f"{s['pass@1']['mean']:.3f}"]
                      if s else ["", ""])
        print(f"| {step} | " + " | ".join(cells) + " |")
    print()
    for name, run in zip(names, args.runs):
        first = next((s for s in sorted(curves[run]) if curves[run][s]["greedy"]["mean"] >= args.reach), None)
        print(f"{name}: greedy >= {args.reach} first at step {first}" if first is not None else
              f"{name}: greedy < {args.reach} at every step scored")


if __name__ == "__main__":
    main()
