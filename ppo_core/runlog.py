"""The run directory and what is logged to it.

    DIR/config.json        the fully resolved config, package versions, git commit, command line
    DIR/metrics.jsonl      one JSON object per iteration
    DIR/summary.json       evaluation before/after, final KL
    DIR/checkpoints/step-N the policy (and tokenizer) in the Hugging Face layout

Only rank 0 writes; every helper here is a no-op on the other ranks, so the loop never says
`if rank == 0`.
"""
import datetime
import json
import os
import platform
import subprocess
import sys

import torch

from .config import to_dict


class RunDirError(RuntimeError):
    """The output directory cannot be used for this run."""


def is_rank0():
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _git_commit():
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        if out.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                                   capture_output=True, text=True, timeout=5).stdout.strip()
            return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def _versions():
    import numpy
    import safetensors
    import tokenizers

    versions = {"python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__,
                "safetensors": safetensors.__version__, "tokenizers": tokenizers.__version__}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        versions["triton"] = None
    return versions


def write_json(path, obj):
    """Write JSON atomically: a reader sees the old file or the new one, never half of one."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class RunDir:
    def __init__(self, path):
        self.path = path

    @classmethod
    def create(cls, cfg, policy_path):
        path = cfg.out or os.path.join("runs", f"{cfg.task}-{datetime.datetime.now():%Y%m%d-%H%M%S}")
        resolved = to_dict(cfg)
        resolved["policy"] = policy_path
        resolved["out"] = path
        if is_rank0():
            if os.path.exists(os.path.join(path, "metrics.jsonl")) or os.path.exists(os.path.join(path, "summary.json")):
                raise RunDirError(f"output directory {path} already holds a run; choose another --out")
            os.makedirs(path, exist_ok=True)
            write_json(os.path.join(path, "config.json"), {
                "config": resolved,
                "versions": _versions(),
                "git_commit": _git_commit(),
                "command": [os.path.basename(sys.argv[0])] + sys.argv[1:],
                "started": datetime.datetime.now().isoformat(timespec="seconds"),
            })
        return cls(path)

    def save_policy(self, policy, tokenizer, step):
        out = os.path.join(self.path, "checkpoints", f"step-{step}")
        if is_rank0():
            policy.save_pretrained(out)
            tokenizer.save_pretrained(out)
        return out

    def write_summary(self, summary):
        if is_rank0():
            write_json(os.path.join(self.path, "summary.json"), summary)


class Logger:
    """metrics.jsonl, a progress bar, and the final table; quiet on ranks other than 0."""

    def __init__(self, run_dir: RunDir, progress=True):
        self.rank0 = is_rank0()
        self.progress = progress and self.rank0
        self.bar = None
        self.file = open(os.path.join(run_dir.path, "metrics.jsonl"), "a") if self.rank0 else None

    def info(self, msg):
        if self.rank0:
            if self.bar is not None:
                self.bar.write(msg, file=sys.stderr)
            else:
                print(msg, file=sys.stderr, flush=True)

    def iterations(self, n, start=0):
        if not self.progress:
            return range(start, n)
        from tqdm import tqdm

        self.bar = tqdm(range(start, n), initial=start, total=n, desc="ppo", file=sys.stderr, dynamic_ncols=True)
        return self.bar

    def metrics(self, m):
        if not self.rank0:
            return
        self.file.write(json.dumps(m, sort_keys=True) + "\n")
        self.file.flush()
        if self.bar is not None:
            self.bar.set_postfix(reward=f"{m['reward/mean']:.3f}", kl=f"{m['kl/mean']:.3f}", refresh=False)

    def close(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.file is not None:
            self.file.close()
            self.file = None

    def table(self, summary, cfg):
        if not self.rank0:
            return
        rows = [
            (f"held-out reward, sampled (T={cfg.temperature})", summary["eval/reward_before"], summary["eval/reward_after"]),
            ("held-out reward, greedy", summary["eval/greedy_reward_before"], summary["eval/greedy_reward_after"]),
        ]
        width = max(len(r[0]) for r in rows)
        print(f"\n{'':{width}}   before    after")
        for name, b, a in rows:
            print(f"{name:{width}}   {b:6.4f}   {a:6.4f}")
        print(f"{'KL to reference, nats/token (final)':{width}}            {summary['kl/final']:6.4f}")
        print(f"\n{summary['eval/prompts']} held-out prompts, {summary['iterations']} iterations, "
              f"{summary['time/total_s']:.0f}s. Policy: {summary['checkpoint']}")


class ListPromptStream:
    """Training prompts from a list: a seeded shuffle per pass, position kept for resume."""

    def __init__(self, prompts, seed):
        self.prompts, self.seed, self.drawn = list(prompts), seed, 0

    def next_batch(self, n):
        import random

        out = []
        while len(out) < n:
            epoch, i = divmod(self.drawn, len(self.prompts))
            order = list(range(len(self.prompts)))
            random.Random(f"{self.seed}-{epoch}").shuffle(order)
            out.append(self.prompts[order[i]])
            self.drawn += 1
        return out

    def state_dict(self):
        return {"seed": self.seed, "drawn": self.drawn}

    def load_state_dict(self, state):
        self.seed, self.drawn = state["seed"], state["drawn"]
