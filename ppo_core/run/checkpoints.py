"""When the loop saves, resumes and stops: `Checkpoints` writes a checkpoint (its format is
ppo_core.run.checkpoint), resumes a run from one, and stops a run early with what the README
documents (a reward server down: a checkpoint and exit status 3; SIGTERM / SIGINT: a checkpoint
and 143; a full disk: 4); `resume_point` lets an iteration the reward server failed be redone
exactly. ppo_core.train's run() holds one Checkpoints; main() turns its exceptions into exit
statuses."""
import contextlib
import random
import time

import numpy as np
import torch

from ..config import PPOConfig
from ..models import distributed as dist
from ..rewards.remote import RewardUnavailable
from . import checkpoint, runlog
from .checkpoint import CheckpointParts, state_lists
from .tracking import write_iteration_samples


class StopRequested(Exception):
    """SIGTERM / SIGINT arrived; the run saved a checkpoint and stops, or (abandoned=True) stops
    without one: its iteration was abandoned, and what that iteration started may still be running
    (a reward function's threads)."""

    def __init__(self, message, abandoned=False):
        super().__init__(message)
        self.abandoned = abandoned


class RewardServerDown(Exception):
    """A reward server stayed unreachable (ppo_core.rewards.remote.RewardUnavailable); the run saved
    what it could and stops with exit status 3, to be continued with --resume once the server is
    back."""


# not 2 (bad input): nothing is wrong with the run, it can continue
EXIT_REWARD_SERVER_DOWN = 3
# not 2 either: the run can continue (--resume) once there is space (runlog.disk_full_line)
EXIT_DISK_FULL = 4
# 128 + SIGINT, as a shell reports it: a Ctrl-C in the start-up (runlog.interrupted_line)
EXIT_INTERRUPTED = 130


def resume_point(stream, generators, opts):
    """What a rollout advances and a checkpoint saves, as of now (the end of the previous
    iteration): the prompt stream's position, every RNG state and the optimizer step count. -> a
    function that puts them back, so that a checkpoint saved after a rollout the reward server
    failed resumes by redoing that iteration exactly. Why these suffice:
    docs/reliability.md#resume_point-redoing-an-iteration-exactly."""
    stream_state, step_count, iteration = stream.state_dict(), opts.step_count, opts.iteration
    generator_states = {name: g.get_state() for name, g in generators.items()}
    cpu_rng, cuda_rng = (torch.get_rng_state(),
                         torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    python_rng, numpy_rng = random.getstate(), np.random.get_state()

    def restore():
        stream.load_state_dict(stream_state)
        for name, g in generators.items():
            g.set_state(generator_states[name])
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        random.setstate(python_rng), np.random.set_state(numpy_rng)
        opts.step_count, opts.iteration = step_count, iteration

    return restore


# What the loop keeps in a checkpoint's trainer_state.json beside ppo_core.run.checkpoint's own
# keys, checked on resume (checkpoint.STATE_SCHEMA's form: a type, a nested dict, [type] for a
# list; a '?' key may be absent).
NUMBER = (int, float)
TRAINER_STATE = {"optimizer_step": int, "skipped_updates": int, "kl_controller": {"value": NUMBER},
                 "prompt_stream": {"seed": int, "drawn": int}, "eval_before": NUMBER,
                 "eval_before_greedy": NUMBER, "last_kl": NUMBER, "last_kl_k3?": NUMBER,
                 "elapsed_s?": NUMBER, "pending_metrics?": dict, "pending_rollout?": dict}


class Checkpoints:
    """The run's checkpoints: saving one, resuming from one, and the early stops, which save one
    where there is something to save and raise what main() turns into the exit status the README
    documents.

    A checkpoint (ppo_core.run.checkpoint) holds the policy and critic with their optimizers, the
    generators and every RNG, and `state`: the optimizer step count and skipped updates, the KL
    controller, the prompt stream's position, the evaluations before training, the last
    iteration's mean KL, the run's wall time so far and, when a reward server failed an
    iteration's evaluation, that iteration's metrics ("pending_metrics"), which a resume
    completes."""

    def __init__(self, cfg: PPOConfig, setup, opts, generators, kl_ctl):
        """setup: the run's ppo_core.run.start.Setup (its models, stream, run directory, log and
        trackers); opts: the Optimizers; generators: {name: torch.Generator} saved and restored."""
        m = setup.models
        self.cfg, self.run_dir, self.log, self.tracker = (cfg, setup.run_dir, setup.log,
                                                          setup.tracker)
        self.policy, self.critic, self.tokenizer, self.sharded = (m.policy, m.critic, m.tokenizer,
                                                                  dist.is_sharded(m.policy))
        self.opts, self.generators, self.kl_ctl = opts, generators, kl_ctl
        self.stream = setup.stream
        # + eval_before(_greedy); a resume loads the saved one into this dict (see save)
        self.state = {"last_kl": 0.0, "last_kl_k3": 0.0}
        self.t0 = time.perf_counter()

    def elapsed(self):
        """Seconds of this run so far: the segments before a resume, and this one."""
        return self.state.get("elapsed_s", 0.0) + time.perf_counter() - self.t0

    def resume(self, ckpt) -> int:
        """Checkpoint `ckpt` put back into the models, optimizers, generators, KL controller, prompt
        stream and `state`; -> the iteration it was saved at."""
        opts = self.opts
        self.state.clear()  # the same dict, loaded in place: the loop holds it
        self.state.update(checkpoint.load_training_state(
            ckpt, policy=self.policy, critic=self.critic, policy_opt=opts.policy_opt,
            critic_opt=opts.critic_opt, generators=self.generators, sharded=self.sharded))
        # the loop's own keys, before any is used
        checkpoint.check_state(self.state, TRAINER_STATE, ckpt)
        opts.step_count, opts.skipped = self.state["optimizer_step"], self.state["skipped_updates"]
        self.kl_ctl.load_state_dict(self.state["kl_controller"])
        self.stream.load_state_dict(self.state["prompt_stream"])
        self.log.info(
            f"resuming {self.run_dir.path} from {ckpt} (iteration {self.state['step']} of "
            f"{self.cfg.iterations})")
        return self.state["step"]

    def save(self, step):
        """Write checkpoints/step-{step}: the models, optimizers, generators and RNGs, and `state`
        (ppo_core.run.checkpoint)."""
        opts, state = self.opts, self.state
        return self.run_dir.save_checkpoint(step, CheckpointParts(
            policy=self.policy, critic=self.critic, tokenizer=self.tokenizer,
            policy_opt=opts.policy_opt, critic_opt=opts.critic_opt, generators=self.generators,
            state={"optimizer_step": opts.step_count, "skipped_updates": opts.skipped,
                   "kl_controller": self.kl_ctl.state_dict(),
                   "prompt_stream": self.stream.state_dict(),
                   "eval_before": state["eval_before"],
                   "eval_before_greedy": state["eval_before_greedy"],
                   "last_kl": state["last_kl"],
                   "last_kl_k3": state.get("last_kl_k3", 0.0),
                   "elapsed_s": self.elapsed(),
                   **({"pending_metrics": state["pending_metrics"]}
                      if "pending_metrics" in state else {}),
                   **({"pending_rollout": state_lists(state["pending_rollout"])}
                      if "pending_rollout" in state else {})}),
            sharded=self.sharded, keep=self.cfg.keep_checkpoints)

    def close(self):
        """The log and the trackers closed: the run ends here."""
        self.log.close(), self.tracker.close()

    def saved_line(self, step) -> str:
        """Where the checkpoint of an early stop is, and the command that continues the run."""
        path = self.run_dir.path
        return (f"saved checkpoint at iteration {step} of {self.cfg.iterations} in {path}; "
                f"continue with: ppo-train --resume {path}")

    @contextlib.contextmanager
    def saved_if_server_down(self, step, where="", pending=None, samples=None, first=None):
        """A reward server that stays down in the block (RemoteReward's RewardUnavailable) stops the
        run: first() (it puts back what a resume redoes), iteration samples[0]'s samples written,
        metrics `pending` kept for a resume to complete, a checkpoint at iteration `step`, and
        RewardServerDown, naming `where` and how to continue."""
        try:
            yield
        except RewardUnavailable as e:
            if first is not None:
                first()
            if samples is not None:
                write_iteration_samples(self.cfg, self.run_dir, self.tracker, self.tokenizer,
                                        *samples)
            if pending is not None:
                self.state["pending_metrics"] = pending
            self.save(step)
            self.close()
            raise RewardServerDown(f"{e}{where}; {self.saved_line(step)}") from None

    @contextlib.contextmanager
    def redone_if_server_down(self, it):
        """saved_if_server_down for iteration `it`'s rollout: the checkpoint is that of the
        iteration's start (the prompt stream, the RNGs and the step count as they were), so a resume
        redoes the iteration exactly."""
        with self.saved_if_server_down(
                it, first=resume_point(self.stream, self.generators, self.opts)):
            yield

    @contextlib.contextmanager
    def stopped_if_server_down(self, what):
        """A reward server down in the block stops the run with nothing (more) to save:
        RewardServerDown "{e} {what}"."""
        try:
            yield
        except RewardUnavailable as e:
            self.close()
            raise RewardServerDown(f"{e} {what}") from None

    def finish_pending_iteration(self, step, evaluate_policy):
        """A run stopped in iteration `step`'s evaluation (its update saved, its samples written):
        the evaluation, then the iteration's metrics logged, and a checkpoint without them, so that
        a later resume does not log them twice."""
        metrics = self.state.pop("pending_metrics")
        with self.saved_if_server_down(step, f" in the evaluation of iteration {step}",
                                       pending=metrics):
            metrics["eval/reward"] = evaluate_policy()
        self.log.metrics(metrics)  # its samples were written before the stop
        self.tracker.log(metrics, step)
        self.save(step)

    def abandoned_line(self, why, iteration) -> str:
        """What a run says when iteration `iteration` was abandoned (runlog.StopSignals says `why`):
        the checkpoint that is intact and how to resume from it, or, before the first checkpoint,
        that there is nothing to resume."""
        ckpt = self.run_dir.latest_checkpoint()
        if ckpt is None:
            return (
                f"{why}: abandoned iteration {iteration}; no checkpoint was saved yet, so there is "
                "nothing to resume: run the same command again to start over")
        return (
            f"{why}: abandoned iteration {iteration}; the checkpoint of iteration "
            f"{checkpoint.checkpoint_step(ckpt)} is intact; resume with: ppo-train --resume "
            f"{self.run_dir.path}")

    @contextlib.contextmanager
    def stopped_if_abandoned(self, stop: runlog.StopSignals):
        """An iteration abandoned in its work (runlog.StopSignals: a second SIGTERM / SIGINT, or
        stop_grace_s after the first) stops the run with the last checkpoint as it was:
        StopRequested (exit status 143, abandoned=True), with abandoned_line. (A loop that does not
        come out in time is ended by StopSignals' watchdog, same line.)"""
        try:
            yield
        except runlog.IterationAbandoned as e:
            self.close()
            raise StopRequested(self.abandoned_line(e, stop.iteration), abandoned=True) from None

    def stop_if_requested(self, stop: runlog.StopSignals, step):
        """SIGTERM / SIGINT arrived during iteration `step`, whose checkpoint is saved, and more
        were to come: StopRequested (exit status 143)."""
        if stop.requested and step < self.cfg.iterations:
            self.close()
            raise StopRequested(f"received {stop.requested}; {self.saved_line(step)}")
