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
import signal
import subprocess
import sys

import torch

from . import checkpoint
from .config import PPOConfig, to_dict


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


IGNORED_FOR_IDENTITY = ("progress", "out")  # fields that do not change what a run computes


class RunDir:
    """The run directory: created for a new run, re-opened (after checks) for a resumed one."""

    def __init__(self, path):
        self.path = path

    @staticmethod
    def saved_config(path) -> dict:
        """The resolved config a run directory was started with (for --resume)."""
        cfg_file = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_file):
            raise RunDirError(f"--resume: {path} holds no run (no config.json)")
        try:
            with open(cfg_file) as f:
                return json.load(f)["config"]
        except (json.JSONDecodeError, KeyError):
            raise RunDirError(f"--resume: {cfg_file} is not a ppo-train run config") from None

    @classmethod
    def open(cls, cfg, policy_path, resume_from=None):
        path = resume_from or cfg.out or os.path.join("runs", f"{cfg.task}-{datetime.datetime.now():%Y%m%d-%H%M%S}")
        resolved = to_dict(cfg)
        resolved["policy"] = policy_path
        resolved["out"] = path
        cfg_file = os.path.join(path, "config.json")
        if os.path.isfile(cfg_file):
            # a key the saved config lacks (a field added by a later version) holds its default there
            saved = {**to_dict(PPOConfig()), **cls.saved_config(path)}
            differ = sorted(k for k in set(saved) | set(resolved)
                            if k not in IGNORED_FOR_IDENTITY and saved.get(k) != resolved.get(k))
            if differ:
                raise RunDirError(f"output directory {path} already holds a different run (config differs in: "
                                  f"{', '.join(differ[:6])}); choose another --out or --resume it")
            if os.path.isfile(os.path.join(path, "summary.json")):
                raise RunDirError(f"output directory {path} already holds a finished run")
        elif resume_from:
            raise RunDirError(f"--resume: {path} holds no run (no config.json)")
        elif os.path.exists(os.path.join(path, "metrics.jsonl")):
            raise RunDirError(f"output directory {path} holds metrics.jsonl but no config.json: not a run this tool can continue")
        elif is_rank0():
            os.makedirs(path, exist_ok=True)
            write_json(cfg_file, {
                "config": resolved,
                "versions": _versions(),
                "git_commit": _git_commit(),
                "command": [os.path.basename(sys.argv[0])] + sys.argv[1:],
                "started": datetime.datetime.now().isoformat(timespec="seconds"),
            })
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        run_dir = cls(path)
        if is_rank0():
            checkpoint.clean_partial_saves(path)
        return run_dir

    def latest_checkpoint(self):
        return checkpoint.latest_checkpoint(self.path)

    def truncate_metrics(self, step):
        """Keep the metrics of iterations <= step: later lines belong to iterations a resume redoes."""
        path = os.path.join(self.path, "metrics.jsonl")
        if not is_rank0() or not os.path.isfile(path):
            return
        with open(path) as f:
            kept = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def save_checkpoint(self, step, sharded=False, **kwargs):
        """Rank 0 saves; with sharded (FSDP) models every process takes part."""
        out = os.path.join(self.path, "checkpoints", f"step-{step}")
        if sharded:
            return checkpoint.save_checkpoint(self.path, step, sharded=True, **kwargs)
        if is_rank0():
            out = checkpoint.save_checkpoint(self.path, step, **kwargs)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        return out

    def write_summary(self, summary):
        if is_rank0():
            write_json(os.path.join(self.path, "summary.json"), summary)


class StopSignals:
    """While active, SIGTERM and SIGINT only set `requested`; the loop saves and stops at the end of
    the iteration in flight (a second signal of the same kind stops at once)."""

    def __init__(self):
        self.requested = None
        self._previous = {}

    def __enter__(self):
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.requested == name:
            raise KeyboardInterrupt
        self.requested = name

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False


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
        self._order_epoch, self._order = None, None

    def _epoch_order(self, epoch):
        import random

        if epoch != self._order_epoch:  # one shuffle per pass over the list, not per prompt drawn
            self._order = list(range(len(self.prompts)))
            random.Random(f"{self.seed}-{epoch}").shuffle(self._order)
            self._order_epoch = epoch
        return self._order

    def next_batch(self, n):
        out = []
        while len(out) < n:
            epoch, i = divmod(self.drawn, len(self.prompts))
            out.append(self.prompts[self._epoch_order(epoch)[i]])
            self.drawn += 1
        return out

    def state_dict(self):
        return {"seed": self.seed, "drawn": self.drawn}

    def load_state_dict(self, state):
        self.seed, self.drawn = state["seed"], state["drawn"]
        self._order_epoch = None
