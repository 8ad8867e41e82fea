"""Kill a real run in the middle, resume it, and compare it byte for byte with the same run left alone.

    python bench/kill_resume.py --kill_after 3 -- --config configs/grpo-smollm2-135m-addition.toml \
        --policy ~/.cache/ppo-core/SmolLM2-135M-Instruct --prompts_file addition.jsonl --iterations 6 --save_every 3

Everything after `--` goes to ppo-train as it is. Two runs start side by side (one torch thread each, unless the
arguments say otherwise): one is left alone; the other gets SIGKILL from outside, with no warning, as soon as it has
written the checkpoint of iteration --kill_after and started the next iteration, and is then continued with
`ppo-train --resume DIR`. The table compares the final policy's model.safetensors (sha256), every other file of the
final checkpoint (trainer_state.json without its elapsed_s), and metrics.jsonl without its wall-clock fields (time/*, tokens_per_s).
"""
import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

WALL_CLOCK = ("time/", "tokens_per_s")


def sha256(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def metrics_without_clock(run_dir) -> list:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(WALL_CLOCK)} for line in f]


def without_clock(path) -> dict:
    with open(path) as f:
        state = json.load(f)
    state.pop("elapsed_s", None)
    return state


def final_checkpoint(run_dir) -> str:
    with open(os.path.join(run_dir, "checkpoints", "latest")) as f:
        return os.path.join(run_dir, "checkpoints", f.read().strip())


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kill_after", type=int, default=3, help="SIGKILL once this iteration's checkpoint is written")
    p.add_argument("--out", default="", help="keep both run directories here (default: a temporary directory)")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then ppo-train's arguments")
    args = p.parse_args()
    train_args = [a for a in args.train_args if a != "--"]
    if not any(a.startswith("--threads") for a in train_args):
        train_args.append("--threads=1")
    out = args.out or tempfile.mkdtemp(prefix="kill-resume-")
    alone, killed = os.path.join(out, "alone"), os.path.join(out, "killed")
    command = [sys.executable, "-m", "ppo_core.train", *train_args, "--progress=false"]
    t0 = time.perf_counter()
    reference = subprocess.Popen([*command, f"--out={alone}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    victim = subprocess.Popen([*command, f"--out={killed}"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)
    # the checkpoint of --kill_after is written, and the next iteration's line of metrics is not: mid-iteration
    latest = os.path.join(killed, "checkpoints", "latest")
    while victim.poll() is None:
        if os.path.exists(latest) and open(latest).read().strip() == f"step-{args.kill_after}":
            time.sleep(5)  # well inside the next iteration's rollout
            break
        time.sleep(0.2)
    if victim.poll() is not None:
        sys.exit(f"kill_resume: the run ended before iteration {args.kill_after}'s checkpoint: "
                 f"{victim.stderr.read()[-2000:]}")
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    lines_at_kill = len(metrics_without_clock(killed))
    resumed = subprocess.run([sys.executable, "-m", "ppo_core.train", "--resume", killed, "--progress=false"],
                             capture_output=True, text=True)
    reference.wait()
    if resumed.returncode or reference.returncode:
        sys.exit(f"kill_resume: exit {resumed.returncode} / {reference.returncode}: {resumed.stderr[-2000:]}")
    a, b = final_checkpoint(alone), final_checkpoint(killed)
    rows = [("killed after", f"iteration {args.kill_after}'s checkpoint, {lines_at_kill} lines of metrics"),
            ("final checkpoint", f"{os.path.basename(a)} / {os.path.basename(b)}")]
    same = True
    for name in sorted(os.listdir(a)):
        if name == "trainer_state.json":  # its elapsed_s is wall clock; every other entry must match
            equal = without_clock(os.path.join(a, name)) == without_clock(os.path.join(b, name))
        else:
            equal = sha256(os.path.join(a, name)) == sha256(os.path.join(b, name))
        same &= equal
        rows.append((name, "identical" if equal else "DIFFERENT"))
    equal = metrics_without_clock(alone) == metrics_without_clock(killed)
    same &= equal
    rows.append(("metrics.jsonl (no wall clock)", "identical" if equal else "DIFFERENT"))
    rows.append(("model.safetensors sha256", sha256(os.path.join(a, "model.safetensors"))[:16]))
    rows.append(("wall time, both", f"{time.perf_counter() - t0:.0f} s"))
    print("| what | alone vs killed and resumed |\n|---|---|")
    for what, result in rows:
        print(f"| {what} | {result} |")
    print(f"\nrun directories: {out}")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
