"""Rollout workers: a process of its own that samples and scores the rollouts, while the trainer trains (config
rollout_ranks; under torchrun the last rollout_ranks processes are workers, ppo_core.distributed.split_roles).

    torchrun --nproc-per-node=2 -m ppo_core.train --rollout_ranks=1 --max_staleness=1 --off_policy_correction=tis

The worker holds a copy of the policy (no optimizer), the prompt stream and the reward source, and runs the rollout
engine; the trainer runs the scoring passes (old and reference log-probs, values), the update and the evaluations.
Messages between them are point-to-point torch.distributed sends between the trainer's first process and the
worker (gloo on the CPU, NCCL on GPUs for the weights), in a fixed order that never deadlocks:

    trainer                                      worker
    start: weights, the stream's state      ->   (receives them; samples rollout `first`)
    iteration it:
      rollout it (pending, or received)     <-   sends rollout it
      scoring passes, update                     max_staleness=1: already sampling rollout it+1 with the weights
                                                 iteration it started from (one update stale), meanwhile
      weights of iteration it+1             ->   max_staleness=0: waits for them, then samples rollout it+1
      max_staleness=1: rollout it+1 received     (kept in the checkpoint as in-flight: a resume is exact)

A rollout travels as the JSON of ppo_core.rollout.sampled_state (its tensors as lists, its rows and texts), with
the worker's seconds and its prompt stream's state; the weights as the policy's state-dict tensors in flat buckets of
about BUCKET_BYTES, in their own dtype (fp32 master weights stay fp32: the worker samples with exactly what the
trainer holds, which keeps a worker run equal to the one-process run; bf16 copies would halve the bytes).
What the worker samples is what one process with max_staleness would sample (the same weights, the same noise:
ppo_core.engine's counter noise per iteration and row), so a run with a worker equals the one-process run.
For now: one trainer and one worker, no filter_groups, no LoRA, no pairwise judge's reference samples.
"""
import json
import time

import torch
import torch.distributed as torch_dist

from . import distributed as dist
from .rollout import iteration_rollout, sampled_from_state, sampled_state


# ---------------------------------------------------------------------------- messages

def send_json(obj, dst):
    """A JSON-able object as UTF-8 bytes: its length, then the bytes (CPU tensors: gloo carries them on any device)."""
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    torch_dist.send(torch.tensor([data.numel()], dtype=torch.int64), dst)
    torch_dist.send(data, dst)


def recv_json(src):
    size = torch.zeros(1, dtype=torch.int64)
    torch_dist.recv(size, src)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    torch_dist.recv(data, src)
    return json.loads(bytes(data.numpy()).decode())


BUCKET_BYTES = 64 * 2**20  # the weights travel in flat buckets of about this size: a few large messages, not hundreds


def weight_buckets(policy):
    """The policy's tensors as they travel: its state dict in its order (tied weights once per name), grouped into
    buckets of one dtype and about BUCKET_BYTES. -> lists of tensors; sender and receiver build the same ones."""
    buckets, size = [], 0
    for t in policy.state_dict().values():
        if not buckets or size + t.numel() * t.element_size() > BUCKET_BYTES or buckets[-1][0].dtype != t.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += t.numel() * t.element_size()
    return buckets


def flat_buckets(policy):
    """Each bucket's tensors as one flat tensor (a copy) for sending."""
    with torch.no_grad():
        return [torch.cat([t.detach().reshape(-1) for t in bucket]) for bucket in weight_buckets(policy)]


def send_weights(policy, dst):
    """The weights, exactly (in their own dtype: the worker samples with what the trainer holds). -> seconds."""
    start = time.perf_counter()
    for flat in flat_buckets(policy):
        torch_dist.send(flat, dst)
    return time.perf_counter() - start


def recv_weights(policy, src):
    with torch.no_grad():
        for bucket in weight_buckets(policy):
            flat = torch.empty(sum(t.numel() for t in bucket), dtype=bucket[0].dtype, device=bucket[0].device)
            torch_dist.recv(flat, src)
            for t, part in zip(bucket, flat.split([t.numel() for t in bucket])):
                t.copy_(part.view_as(t))


# ---------------------------------------------------------------------------- the trainer's side

class RolloutClient:
    """The trainer's end (its first process): start the worker, take each iteration's rollout, send the weights."""

    def __init__(self, cfg, policy, stream):
        self.cfg, self.policy, self.stream = cfg, policy, stream
        self.worker = dist.global_rank(0, "rollout", cfg.rollout_ranks)
        self.device = next(policy.parameters()).device

    def start(self, start_iter, state):
        """Tell the worker where the run stands: the iteration, whether a rollout is already in hand (a resume of a
        stale run), the stream's position; then the weights."""
        first = start_iter + 1 if "pending_rollout" in state else start_iter
        send_json({"start": start_iter, "first": first, "stream": self.stream.state_dict()}, self.worker)
        send_weights(self.policy, self.worker)

    def receive(self):
        """The next rollout from the worker -> its sampled_state, the stream's position after it, the worker's times."""
        message = recv_json(self.worker)
        self.stream.load_state_dict(message["stream"])  # the checkpoint holds the worker's position
        return message

    def rollout(self, it, state):
        """Iteration it's rollout: in hand (max_staleness=1) or received now. -> (Sampled, group, stats)."""
        pending = state.pop("pending_rollout", None)
        waiting = time.perf_counter()
        message = ({"rollout": pending, "worker_idle_s": state.pop("pending_worker_idle_s", 0.0)}
                   if pending is not None else self.receive())
        sampled, group, stats = sampled_from_state(message["rollout"], self.device)
        stats = dict(stats, **{"time/trainer_wait_s": time.perf_counter() - waiting if pending is None else 0.0})
        if "worker_idle_s" in message:
            stats["time/worker_idle_s"] = message["worker_idle_s"]
        return sampled, group, stats

    def after_update(self, it, state) -> dict:
        """The update of iteration it is done: the worker gets the new weights (if it samples again); with
        max_staleness=1 the rollout it sampled meanwhile is received and kept for iteration it+1."""
        if it + 1 >= self.cfg.iterations:
            return {}
        if self.cfg.max_staleness:
            sending = time.perf_counter()
            # the worker sends its rollout before it takes the weights: send without waiting, then receive
            flats = flat_buckets(self.policy)  # kept alive until the sends complete
            requests = [torch_dist.isend(flat, self.worker) for flat in flats]
            waiting = time.perf_counter()
            message = self.receive()
            waited = time.perf_counter() - waiting
            for request in requests:
                request.wait()
            state["pending_rollout"] = message["rollout"]
            state["pending_worker_idle_s"] = message["worker_idle_s"]
            return {"time/weights_and_next_rollout_s": time.perf_counter() - sending, "time/trainer_wait_next_s": waited}
        return {"time/weights_s": send_weights(self.policy, self.worker)}


# ---------------------------------------------------------------------------- the worker's side

def serve(cfg, policy, reference, tokenizer, stream, reward_source, sample_gen, autocast):
    """The worker's loop: sample and score each iteration's rollout with the latest weights it has, send it, take
    new weights, in the order of this module's docstring. Returns when the run's last rollout is sent. `policy` is
    overwritten by the trainer's weights before anything is sampled."""
    trainer = dist.global_rank(0, "train", cfg.rollout_ranks)
    start = recv_json(trainer)
    stream.load_state_dict(start["stream"])
    recv_weights(policy, trainer)
    idle = 0.0
    for it in range(start["first"], cfg.iterations):
        if not cfg.max_staleness and it > start["first"]:  # the weights of the update that rollout it-1 fed
            waiting = time.perf_counter()
            recv_weights(policy, trainer)
            idle = time.perf_counter() - waiting
        sampled, group, stats = iteration_rollout(it, stream, policy, reference, None, tokenizer, reward_source, cfg,
                                                  sample_gen, autocast, sample_only=True)
        send_json({"rollout": sampled_state(sampled, group, stats), "stream": stream.state_dict(),
                   "worker_idle_s": idle}, trainer)
        if cfg.max_staleness and it > start["start"]:
            # the trainer sent iteration it's weights just before it took this rollout (after the update of it-1):
            # the next rollout is sampled with them, one update behind the trainer
            waiting = time.perf_counter()
            recv_weights(policy, trainer)
            idle = time.perf_counter() - waiting
    return {}
