"""The run directory and what is logged to it.

    DIR/config.json        the fully resolved config, package versions, git commit, command line
    DIR/metrics.jsonl      one JSON object per iteration
    DIR/summary.json       evaluation before/after, final KL
    DIR/checkpoints/step-N the policy (and tokenizer) in the Hugging Face layout
    DIR/error.log          when a reward function or environment of the user's raised, or its file did not import:
                           the time, the error line and the full traceback, one entry per failed attempt (log_error)
    DIR/run.lock           the pid of the process that owns the run, which holds an flock on it (lock_run_dir): a
                           second ppo-train on the same directory is refused before it reads or writes anything

Without --out, DIR is runs/<policy directory's name>-<task>-<date>-<time> (see default_run_path).
Only rank 0 writes; every helper here is a no-op on the other ranks, so the loop never says
`if rank == 0`.
"""
import datetime
import errno
import fcntl
import json
import os
import platform
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

import torch

from . import checkpoint
from ..models import distributed as dist
from ..config import PPOConfig, absolute_paths, to_dict
from ..rewards.functions import specs_as_today
from ..rewards.redact import redact


class RunDirError(RuntimeError):
    """The output directory cannot be used for this run."""


def is_rank0():
    """The first process of this role (the trainers': ppo_core.models.distributed.split_roles)."""
    return dist.rank() == 0


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


# fields that do not change what a run computes (a reward server's address: the same server may come back elsewhere)
IGNORED_FOR_IDENTITY = ("progress", "out", "report_to", "log_samples_every", "reward_url", "reward_timeout_s",
                        "reward_retries")


def default_run_path(cfg, policy_path, started: datetime.datetime) -> str:
    """The run directory of a run without --out: runs/<policy>-<task>-<date>-<time>.

    <policy> is the name of the policy directory; <task> is cfg.task, or "custom" when prompts_file, reward_fn,
    reward_model, reward_url or judge replace the task's prompts or reward. The task is left out when the policy's name already
    holds it as a dash-separated word, so the default job goes to runs/reverse-demo-20260102-150405 and a
    custom run on ~/models/tiny-qwen3 to runs/tiny-qwen3-custom-20260102-150405."""
    policy_name = os.path.basename(os.path.normpath(os.path.expanduser(policy_path)))
    task = "custom" if (cfg.prompts_file or cfg.reward_fn or cfg.reward_model or cfg.reward_url or cfg.judge) else cfg.task
    words = [policy_name] if task in policy_name.split("-") else [policy_name, task]
    return os.path.join("runs", "-".join(words + [f"{started:%Y%m%d-%H%M%S}"]))


def _start_time() -> datetime.datetime:
    """Now, to the second, as rank 0 sees it: every process must name the same default run directory."""
    seconds = torch.tensor([int(datetime.datetime.now().timestamp())], dtype=torch.int64)  # CPU tensor: gloo
    dist.broadcast_from_first(seconds)
    return datetime.datetime.fromtimestamp(int(seconds.item()))


def check_out_dir(path):
    """RunDirError unless `path` is a directory this process can write in, or one it can create: nothing may be a
    regular file along it, and the nearest directory that exists must take a new entry (tried with a temporary
    directory, removed at once: a read-only file system, a directory of another user, /proc). Writes nothing else;
    cheap enough to run before any model is built."""
    path = os.fspath(path)
    existing = path
    while not os.path.isdir(existing):  # up to the nearest directory that exists ("." for a relative path)
        if os.path.lexists(existing):  # a regular file (or a link to nowhere) where a directory must go
            what = "a file, not a directory" if os.path.isfile(existing) else "not a directory"
            raise RunDirError(f"output directory {path}: {'' if existing == path else existing + ' '}is {what}")
        parent = os.path.dirname(existing) or "."
        if parent == existing:  # not even "." or "/" is a directory: mkdtemp below says why
            break
        existing = parent
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".ppo-train-check-", dir=existing))
    except OSError as e:
        raise RunDirError(f"output directory {path}: cannot write in {existing} ({e.strerror})") from None


def _has_checkpoint(path) -> bool:
    """Whether DIR/checkpoints holds anything but half-written saves (`.tmp-*`, removed on open)."""
    root = os.path.join(path, "checkpoints")
    return os.path.isdir(root) and any(not d.startswith(".tmp-") for d in os.listdir(root))


def _continue_hint(path, saved: dict) -> str:
    """How to train a finished run further: a new run that starts from its last checkpoint (policy and
    critic) and keeps its KL reference."""
    ckpt = checkpoint.latest_checkpoint(path)
    if ckpt is None:
        return ""
    critic = os.path.join(ckpt, "critic")
    reference = saved.get("reference") or saved.get("policy")
    return (f" (to train it further, start the new run from its last checkpoint: --policy {ckpt}"
            + (f" --critic {critic}" if os.path.isdir(critic) else "")
            + (f" --reference {reference}" if reference else "") + ")")


def _read_json(path) -> dict:
    with open(path) as f:
        return json.load(f)


def _jsonl_row(line: bytes):
    """A line of a JSON-lines log as its object, or None unless it is a JSON object with an integer "step"."""
    try:
        row = json.loads(line)
    except (ValueError, RecursionError):  # torn, NUL bytes, not UTF-8
        return None
    return row if isinstance(row, dict) and isinstance(row.get("step"), int) else None


def truncate_jsonl(path, step):
    """Keep the lines of a JSON-lines log (metrics.jsonl, samples.jsonl) whose "step" is <= step, replacing the file
    atomically (rank 0 only; a missing file is left missing). Its torn end, what a crash or a full disk leaves after
    the last whole line (half a line, NUL bytes), is dropped: -> a line saying what was dropped, else None. A line
    that is not a JSON object with a "step" before a whole one is no torn end: RunDirError naming file and line."""
    if not is_rank0() or not os.path.isfile(path):
        return None
    kept, torn = [], []  # torn: (line number, bytes) of the lines since the last whole one
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = _jsonl_row(line)
            if row is None:
                torn.append((number, line))
                continue
            if torn:
                raise RunDirError(f"{path}, line {torn[0][0]}: not a JSON object with a \"step\", and whole lines "
                                  f"follow it (only a torn end is dropped on resume); remove or repair that line")
            if row["step"] <= step:
                kept.append(line if line.endswith(b"\n") else line + b"\n")
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    if not torn:
        return None
    dropped = b"".join(line for _, line in torn)
    text = dropped.replace(b"\0", b"").decode("utf-8", "replace").strip()  # what the torn line said, if anything
    if not text:
        what = "all NUL"
    else:
        what = repr(text[:60]) + (" and NUL bytes" if b"\0" in dropped else "")
    lines = f"line {torn[0][0]}" if len(torn) == 1 else f"lines {torn[0][0]}-{torn[-1][0]}"
    return (f"warning: dropped the torn end of {path} ({lines}: {len(dropped)} bytes, {what}), left by a write that "
            f"did not finish")


def lock_run_dir(path):
    """Make this process the owner of run directory `path` (created if missing): an exclusive flock on DIR/run.lock,
    held until the process ends (or release_run_dir), and its pid written there. RunDirError naming the holder's pid
    when another process owns it; nothing else is read or written then. The kernel drops the lock of a process that
    dies, however it dies (SIGKILL included): a killed run's directory is never locked for the next one."""
    global _run_lock
    release_run_dir()  # a run this process ran before (tests run several in one process)
    os.makedirs(path, exist_ok=True)
    fd = os.open(os.path.join(path, "run.lock"), os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by subprocesses
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        raise RunDirError(f"output directory {path} is in use by another ppo-train (pid {holder}); wait for it to "
                          f"end, or choose another --out") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _run_lock = fd


def release_run_dir():
    """Give up the run directory this process owns, if any (lock_run_dir)."""
    global _run_lock
    if _run_lock is not None:
        os.close(_run_lock)  # closing the descriptor releases the flock
        _run_lock = None


_run_lock = None  # the descriptor of DIR/run.lock while this process owns a run directory


def _lock_on_first(path):
    """lock_run_dir on the first process, which alone writes; every process raises its RunDirError."""
    refused = torch.zeros(1, dtype=torch.int64)  # CPU tensor: gloo
    error = None
    if is_rank0():
        try:
            lock_run_dir(path)
        except RunDirError as e:
            error, refused[0] = e, 1
    dist.broadcast_from_first(refused)
    if error or refused.item():
        raise error or RunDirError(f"output directory {path} is in use by another ppo-train")


def disk_full(error) -> bool:
    """Whether `error` says the disk (or the user's quota) is full: an OSError with ENOSPC / EDQUOT, or a library's
    error carrying the system's words for it (safetensors' SafetensorError)."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return any(words in str(error) for words in (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT), "StorageFull"))


def disk_full_line(error, run_path) -> str:
    """The one line of a run stopped by a full disk (exit status 4, ppo_core.run.checkpoints.EXIT_DISK_FULL): which file, what
    is kept, and how to continue once there is space. A failed save left nothing half-written (RunDir.save_checkpoint);
    metrics.jsonl keeps its whole lines (a torn last one is dropped on resume)."""
    global _open_run_dir
    _open_run_dir = None  # the error ends the run
    where = getattr(error, "filename", None) or run_path
    try:
        ckpt = checkpoint.latest_checkpoint(run_path) if run_path else None
        kept = (f"the checkpoint of iteration {checkpoint.checkpoint_step(ckpt)} is intact" if ckpt
                else "no checkpoint was saved yet")
    except checkpoint.CheckpointError:
        kept = "the newest intact checkpoint is kept"
    return (f"the disk is full ({os.strerror(errno.ENOSPC)}) writing {where}; {kept} and no line already written was "
            f"lost; free space, then continue with: ppo-train --resume {run_path}")


def interrupted_line(run_path) -> str:
    """The one line of a SIGINT (Ctrl-C) that came where StopSignals does not take it: in the start-up, or after the
    last iteration (exit status 130). Every file is written whole (write_json, RunDir.save_checkpoint), so what was
    written is kept; the line says whether there is a checkpoint to continue from."""
    global _open_run_dir
    _open_run_dir = None  # the interrupt ends the run
    try:
        ckpt = checkpoint.latest_checkpoint(run_path) if run_path and os.path.isdir(run_path) else None
    except checkpoint.CheckpointError:
        ckpt = None
    if ckpt is None:
        return "interrupted during start-up (SIGINT); no checkpoint was saved yet, nothing else was lost"
    return (f"interrupted (SIGINT) outside the iterations; the checkpoint of iteration "
            f"{checkpoint.checkpoint_step(ckpt)} is intact: continue with ppo-train --resume {run_path}")


class RunDir:
    """The run directory: created for a new run, re-opened (after checks) for a resumed one."""

    def __init__(self, path, replaced=None, precision_changed=None):
        self.path = path
        self.replaced = replaced  # None, or a line for the log: open() replaced a run that never saved a checkpoint
        self.precision_changed = precision_changed  # None, or a line for the log: resumed under another precision

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
    def open(cls, cfg, policy_path, resume_from=None, precision=None):
        """The run directory of this run. Its path: resume_from, else cfg.out, else default_run_path().

        A new directory gets config.json, with `precision` (precision.Precision.describe(): how dtype='auto' resolved on
        this machine) beside the config. A run resumed where it resolves differently is still the same run (the config
        is), but not a bit-exact continuation: `precision_changed` then holds a line for the log. One that already holds a config.json is:
          - the same config (IGNORED_FOR_IDENTITY aside), not finished: re-opened; the loop continues from its
            latest checkpoint, if it has one (what `--resume` and a retried container do);
          - finished (summary.json): refused, with the arguments that train further from its last checkpoint;
          - a different config with a checkpoint: refused;
          - a different config without a checkpoint (a run that failed before its first save): replaced. Its
            config.json is rewritten, its metrics.jsonl removed, and `replaced` holds a line saying so.
        Raises RunDirError. With several processes every one calls this; only rank 0 writes."""
        if resume_from or cfg.out:
            path = resume_from or cfg.out
        else:
            path = default_run_path(cfg, policy_path, _start_time())
        resolved = redact(to_dict(cfg))  # reward_url's credentials are never written
        resolved["policy"] = policy_path
        resolved["out"] = path
        cfg_file = os.path.join(path, "config.json")
        replaced = precision_changed = None
        if not (resume_from and not os.path.isfile(cfg_file)):  # (that error, below, creates nothing)
            _lock_on_first(path)  # before anything here is read, rewritten or removed
        if os.path.isfile(cfg_file):
            # a key the saved config lacks (a field added by a later version) holds its default there
            saved = {**to_dict(PPOConfig()), **cls.saved_config(path)}
            # a list field an older version saved as one comma-separated string (reward_fn = "m:f" or "")
            saved = {k: [x.strip() for x in v.split(",") if x.strip()] if isinstance(v, str) and isinstance(resolved.get(k), list)
                     else v for k, v in saved.items()}
            saved = specs_as_today(saved)  # specs naming a module where it was before the subpackages
            saved = absolute_paths(saved)  # a run saved with relative paths: as this directory reads them
            differ = sorted(k for k in set(saved) | set(resolved)
                            if k not in IGNORED_FOR_IDENTITY and saved.get(k) != resolved.get(k))
            finished = os.path.isfile(os.path.join(path, "summary.json"))
            if differ and not finished and not _has_checkpoint(path):
                replaced = (f"output directory {path} held a run that stopped before its first checkpoint "
                            f"(config differed in: {', '.join(differ[:6])}); replaced its config.json and metrics.jsonl")
            elif differ:
                raise RunDirError(f"output directory {path} already holds a different run (config differs in: "
                                  f"{', '.join(differ[:6])})" + (", finished; choose another --out" + _continue_hint(path, saved)
                                                                 if finished else "; choose another --out or --resume it"))
            elif finished:
                raise RunDirError(f"output directory {path} already holds a finished run; choose another --out"
                                  + _continue_hint(path, saved))
            before = _read_json(cfg_file).get("precision")
            if not differ and precision and before and before["matmuls"] != precision["matmuls"]:
                precision_changed = (f"this run started with {before['matmuls']} matmuls ({before['why']}) and continues "
                                     f"with {precision['matmuls']} ({precision['why']}): not a bit-exact continuation")
        elif resume_from:
            raise RunDirError(f"--resume: {path} holds no run (no config.json)")
        elif os.path.exists(os.path.join(path, "metrics.jsonl")):
            raise RunDirError(f"output directory {path} holds metrics.jsonl but no config.json: not a run this tool can continue")
        if is_rank0() and (replaced or not os.path.isfile(cfg_file)):
            os.makedirs(path, exist_ok=True)
            write_json(cfg_file, {
                "config": resolved,
                **({"precision": precision} if precision else {}),
                "versions": _versions(),
                "git_commit": _git_commit(),
                "command": redact([os.path.basename(sys.argv[0])] + sys.argv[1:]),
                "started": datetime.datetime.now().isoformat(timespec="seconds"),
            })
            if replaced and os.path.exists(os.path.join(path, "metrics.jsonl")):
                os.remove(os.path.join(path, "metrics.jsonl"))
        dist.barrier()
        run_dir = cls(path, replaced, precision_changed)
        if is_rank0():
            checkpoint.clean_partial_saves(path)
        return run_dir

    def latest_checkpoint(self):
        return checkpoint.latest_checkpoint(self.path)

    def truncate_metrics(self, step):
        """Keep the metrics of iterations <= step: later lines belong to iterations a resume redoes. -> a line for the
        log when a torn end was dropped (truncate_jsonl), else None."""
        return truncate_jsonl(os.path.join(self.path, "metrics.jsonl"), step)

    def save_checkpoint(self, step, parts, sharded=False, **kwargs):
        """checkpoint.save_checkpoint of `parts` (a CheckpointParts): rank 0 saves; with sharded (FSDP)
        models every process takes part."""
        out = os.path.join(self.path, "checkpoints", f"step-{step}")
        if sharded:
            return checkpoint.save_checkpoint(self.path, step, parts, sharded=True, **kwargs)
        if is_rank0():
            try:
                out = checkpoint.save_checkpoint(self.path, step, parts, **kwargs)
            except Exception as e:  # a full disk, say: the half-written step goes now, and the space it took
                checkpoint.clean_partial_saves(self.path)
                if disk_full(e) and not getattr(e, "filename", None):  # safetensors' error, a write's: name the step
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), out) from e
                raise
        dist.barrier()
        return out

    def write_summary(self, summary):
        if is_rank0():
            write_json(os.path.join(self.path, "summary.json"), summary)


class IterationAbandoned(BaseException):
    """A second SIGTERM / SIGINT, or stop_grace_s after the first, ended the iteration in flight (StopSignals). A
    BaseException, as KeyboardInterrupt is: no `except Exception` on the way (a reward function's wrapper) may take
    it for an error of the code it interrupted."""


HARD_STOP_S = 2.0  # seconds an abandoned iteration may take to unwind before the watchdog ends the process


class StopSignals:
    """While active, SIGTERM and SIGINT only set `requested`; the loop saves a checkpoint and stops at the end of the
    iteration in flight (exit status 143). The iteration is abandoned instead, its work lost and the last checkpoint
    left as it is, when a second SIGTERM or SIGINT comes, or `grace_s` seconds (config stop_grace_s; 0: no limit)
    after the first: IterationAbandoned is raised in the loop where it is, but only between work_starts() and
    work_ends(), the iteration's work (rollout, update, evaluation), which writes nothing to the run directory.
    Arriving anywhere else (its metrics line, its samples, a checkpoint save), it waits for that to finish and the run
    stops there, as after one signal.

    The interpreter runs a signal's handler only between two bytecodes of the main thread: not while it is inside
    one long call (a decode step of a large model on a loaded machine, a reward function's own C code); and the
    exception, raised once, does not bring the main thread out of a later wait for a thread the abandoned work left
    running (a reward function's pool joined as it unwinds; ppo_core.train.main ends the process itself rather than
    let the interpreter's exit join them). So the clock is kept by a watchdog thread, which hears
    every signal at once (signal.set_wakeup_fd: the C-level handler writes the signal's number to a pipe, whatever
    the main thread is doing). At the moment to abandon it interrupts the main thread (SIGALRM, whose handler raises
    IterationAbandoned there); if the loop is still inside this block HARD_STOP_S seconds later, the watchdog takes
    `writing` (held by the loop while a metrics or samples line is written, so no line is ever cut), prints
    last_words(why, iteration) on stderr and ends the process, os._exit(143). Nothing written is lost: metrics.jsonl
    and samples.jsonl are whole lines, and a checkpoint save is atomic against a kill anywhere
    (ppo_core.run.checkpoint), so the last complete one stays; a resume cuts the metrics back to it.

    What a scheduler's pre-emption gets: SIGTERM, then SIGKILL after its grace period (Slurm's KillWait and Kubernetes'
    terminationGracePeriodSeconds default to 30 s, `docker stop` 10 s, `timeout` never unless given -k). The run stops
    at the end of the iteration in flight if it ends within stop_grace_s, with a checkpoint of it; else it is abandoned
    then, and the process is gone within HARD_STOP_S more, exit 143 with the line of StopRequested. A SIGKILL that
    comes first still leaves the last checkpoint intact, only without that line. With several processes each abandons
    on its own signal; one blocked in a collective is ended by its watchdog."""

    def __init__(self, grace_s: float = 0.0, last_words=None, hard_stop_s: float = HARD_STOP_S):
        self.requested = None  # the first signal's name
        self.abandon = None  # why the iteration in flight is to be abandoned, once it is
        self.grace_s, self.hard_stop_s = grace_s, hard_stop_s
        self.last_words = last_words or (lambda why, iteration: f"{why}: abandoned iteration {iteration}")
        self.writing = threading.Lock()  # held while a line of the run directory is written: the watchdog waits
        self.iteration = None
        self._abandonable = False
        self._active = False  # the loop is inside the block; under _state, which the watchdog's exit takes too
        self._state = threading.Lock()
        self._previous = {}
        self._wakeup = None  # (read end, write end, the wakeup fd before ours)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM):
                self._previous[sig] = signal.signal(sig, self._handle)
            read_fd, write_fd = os.pipe()
            os.set_blocking(write_fd, False)  # set_wakeup_fd's requirement: a full pipe never blocks a handler
            self._wakeup = (read_fd, write_fd, signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False))
            threading.Thread(target=self._watch, args=(read_fd,), name="stop-watchdog", daemon=True).start()
        self._active = True
        return self

    def _handle(self, signum, frame):
        """The main thread's handler: the first SIGTERM / SIGINT asks for a stop, a second abandons; SIGALRM comes
        from the watchdog when stop_grace_s is over (self.abandon already says why)."""
        name = signal.Signals(signum).name
        if signum == signal.SIGALRM:
            self._abandon(self.abandon or f"received {self.requested} {self.grace_s:g} s ago (stop_grace_s)")
        elif self.requested is None:
            self.requested = name
        else:
            self._abandon(f"received {self.requested}, then {name}")

    def _abandon(self, why):
        self.abandon = why
        if self._abandonable:
            self._abandonable = False  # raised once
            raise IterationAbandoned(why)

    def _watch(self, read_fd):
        """The watchdog thread: reads the signals' numbers from the wakeup pipe (closed by __exit__) and keeps two
        deadlines, when to abandon (stop_grace_s after the first signal) and when to end the process (HARD_STOP_S
        after abandoning, or after a second signal)."""
        first = why = abandon_at = end_at = None
        try:
            while True:
                due = [t for t in (abandon_at, end_at) if t is not None]
                wait = max(0.0, min(due) - time.monotonic()) if due else None
                if select.select([read_fd], [], [], wait)[0]:
                    numbers = os.read(read_fd, 512)
                    if not numbers:
                        return  # the block is over
                    for name in (signal.Signals(n).name for n in numbers if n in (signal.SIGTERM, signal.SIGINT)):
                        if first is None:
                            first = name
                            if self.grace_s > 0:
                                abandon_at = time.monotonic() + self.grace_s
                        elif end_at is None:  # the main thread's handler abandons as soon as it runs
                            why, abandon_at = f"received {first}, then {name}", None
                            end_at = time.monotonic() + self.hard_stop_s
                elif abandon_at is not None and time.monotonic() >= abandon_at:
                    why, abandon_at = f"received {first} {self.grace_s:g} s ago (stop_grace_s)", None
                    self.abandon = self.abandon or why
                    with self._state:  # not once the handlers are restored: SIGALRM's default ends the process
                        if self._active:
                            signal.pthread_kill(threading.main_thread().ident, signal.SIGALRM)
                    end_at = time.monotonic() + self.hard_stop_s
                elif end_at is not None and time.monotonic() >= end_at:
                    self._end_process(why)
                    return
        finally:
            os.close(read_fd)

    def _end_process(self, why):
        """The loop did not come out of the block in time: the line, then os._exit(143), once no line of the run
        directory is half-written. Nothing if the loop has just come out (it says the line itself)."""
        with self.writing, self._state:
            if not self._active:
                return
            try:
                line = self.last_words(why, self.iteration)
            except Exception as e:  # the line must not keep the process alive
                line = f"{why}: abandoned iteration {self.iteration} ({type(e).__name__} in saying more: {e})"
            sys.stdout.flush()
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
            os._exit(143)

    def work_starts(self, iteration):
        """Iteration `iteration`'s work (rollout, update, evaluation) begins: a second signal, or the grace period, may
        end it from here on with IterationAbandoned."""
        self.iteration = iteration
        if self.abandon:
            raise IterationAbandoned(self.abandon)
        self._abandonable = True

    def work_ends(self):
        """What follows (metrics, samples, a checkpoint) is written whole: a second signal now waits for it."""
        self._abandonable = False

    def __exit__(self, *exc):
        with self._state:
            self._active = False
            if self._wakeup is not None:
                read_fd, write_fd, before = self._wakeup
                signal.set_wakeup_fd(before)
                os.close(write_fd)  # the watchdog reads the end of the pipe and returns
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
        return False


# The run directory of the Logger open in this process (rank 0), for log_error: the error that stops a run is caught
# by train.main(), far from the loop that knows where the run writes.
_open_run_dir = None


def log_error(error: BaseException, run_path=None) -> str:
    """The error's one line for the user, after the full traceback it may carry (`error.traceback`, set by
    ppo_core.rewards when a reward function raised, and by rewards.functions.import_callable when a user's file did not
    import) went to DIR/error.log (appended, after the time and the line; earlier entries are kept). DIR: the run
    directory of the Logger open, else `run_path`, the directory the run would have written (created for it: an error
    found before the run directory was opened). The line is str(error), then "; raised at FILE:LINE[ in FUNCTION]"
    (`error.raised_at`) and "; full traceback in DIR/error.log"; both with their credentials redacted."""
    global _open_run_dir
    line = redact(str(error))  # a config error quotes the value it refuses, a URL's password included
    if getattr(error, "raised_at", None):
        line += f"; raised at {error.raised_at}"
    details = redact(getattr(error, "traceback", None))
    run_path = _open_run_dir or run_path
    if details and run_path is not None and is_rank0():
        path = os.path.join(run_path, "error.log")
        os.makedirs(run_path, exist_ok=True)
        with open(path, "a") as f:
            f.write(f"--- {datetime.datetime.now().isoformat(timespec='seconds')}\nppo-train: error: {line}\n\n{details}\n")
        line += f"; full traceback in {path}"
        _open_run_dir = None  # the error ends the run
    return line


def iteration_line(m: dict, total: int, seconds: float) -> str:
    """The line printed for one iteration where there is no progress bar:
    'iteration 3/50  reward 0.2031  kl 0.0123  length 14.2  eos 0.95  21.3s' (kl: the k3 mean, never negative)."""
    line = (f"iteration {m['step']}/{total}  reward {m['reward/mean']:.4f}  kl {m['kl/k3_mean']:.4f}  "
            f"length {m['response/length_mean']:.1f}  eos {m['response/eos_frac']:.2f}  {seconds:.1f}s")
    if "eval/reward" in m:
        line += f"  held-out {m['eval/reward']:.4f}"
    return line


class Logger:
    """metrics.jsonl, a progress bar (when stderr is a terminal), and the final table; quiet on ranks other than 0.
    While it is open, log_error writes to its run directory."""

    def __init__(self, run_dir: RunDir, progress=True):
        global _open_run_dir
        self.rank0 = is_rank0()
        _open_run_dir = run_dir.path if self.rank0 else None
        # a bar only on a terminal: redirected to a file, tqdm's carriage-return frames are noise
        self.progress = progress and self.rank0 and sys.stderr.isatty()
        self.bar = None
        # unbuffered: a write the disk refuses is lost at once, never retried from a buffer at exit
        self.file = open(os.path.join(run_dir.path, "metrics.jsonl"), "ab", buffering=0) if self.rank0 else None
        self.total = 0  # iterations in the run, for the per-iteration lines
        self.last = time.perf_counter()

    def info(self, msg):
        msg = redact(msg)  # a line may quote a URL of the config (ppo_core.rewards.redact)
        if self.rank0:
            if self.bar is not None:
                self.bar.write(msg, file=sys.stderr)
            else:
                print(msg, file=sys.stderr, flush=True)

    def iterations(self, n, start=0):
        self.total, self.last = n, time.perf_counter()
        if not self.progress:
            return range(start, n)
        from tqdm import tqdm

        self.bar = tqdm(range(start, n), initial=start, total=n, desc="ppo", file=sys.stderr, dynamic_ncols=True)
        return self.bar

    def metrics(self, m):
        if not self.rank0:
            return
        line = memoryview((json.dumps(m, sort_keys=True) + "\n").encode())
        try:
            while line:  # a raw write may take part of it
                line = line[self.file.write(line):]
        except OSError as e:  # a write's error names no file: this one does (disk_full_line)
            e.filename = e.filename or self.file.name
            raise
        if self.bar is not None:
            self.bar.set_postfix(reward=f"{m['reward/mean']:.3f}", kl=f"{m['kl/mean']:.3f}", refresh=False)
        else:  # no terminal (nohup, a scheduler, | tee): one line an iteration, so a watcher sees the run move
            now = time.perf_counter()
            print(iteration_line(m, self.total, now - self.last), file=sys.stderr, flush=True)
            self.last = now

    def close(self):
        global _open_run_dir
        _open_run_dir = None
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
        kl_name = "KL to reference, nats/token (final, k3)"
        width = max(len(name) for name in [kl_name] + [r[0] for r in rows])
        print(f"\n{'':{width}}   before    after")
        for name, b, a in rows:
            print(f"{name:{width}}   {b:6.4f}   {a:6.4f}")
        print(f"{kl_name:{width}}            {summary['kl/final']:6.4f}")
        print(f"\n{summary['eval/prompts']} held-out prompts, {summary['iterations']} iterations, "
              f"{summary['time/total_s']:.0f}s. Policy: {summary['checkpoint']}")

