"""Rollout workers: processes of their own that sample and score the rollouts while the trainers train (config
rollout_ranks; under torchrun the last rollout_ranks processes are workers, ppo_core.models.distributed.split_roles).

    torchrun --nproc-per-node=2 -m ppo_core.train --rollout_ranks=1 --max_staleness=1 --off_policy_correction=tis
    torchrun --nproc-per-node=8 -m ppo_core.train --rollout_ranks=2 --parallel=fsdp ...   # 6 trainers, 2 workers

Each worker holds a copy of the policy (no optimizer), the prompt stream and the reward source, and runs the rollout
engine over its rows of each rollout (the workers split the rows as data-parallel processes do); the trainers run
the scoring passes (old and reference log-probs, values), the update (DDP or FSDP among themselves) and the
evaluations. The first trainer talks to the workers, in a fixed order that never deadlocks:

    first trainer                                every worker
    start: the stream's state, weights      ->   (receives them; samples its rows of rollout `first`)
    iteration it:
      rollout it (pending, or received)     <-   sends its rows of rollout it
      each other trainer gets its rows
      scoring passes, update (all trainers)      max_staleness=1: already sampling rollout it+1 with the weights
                                                 iteration it started from (one update stale), meanwhile
      weights of iteration it+1             ->   max_staleness=0: waits for them, then samples rollout it+1
      max_staleness=1: rollout it+1 received     (kept in the checkpoint as in-flight: a resume is exact)

Rollouts and the stream's state travel as point-to-point messages (send_message): a JSON header (the rows, texts,
statistics, and a placeholder for each tensor) and then each tensor's bytes (ppo_core.rollout.sampled_state with
lists=False; gloo carries CPU tensors on any device): 150x faster than JSON text for 512 responses of 4096 tokens
(bench/rollout_transport.py). The weights are broadcast from the first trainer to the workers
(distributed.weights_group; NCCL on GPUs): the policy's state-dict tensors, gathered from the FSDP shards first, in
flat buckets of about BUCKET_BYTES, each in the dtype decoding reads it in (wire_dtypes: under bf16-mixed the blocks'
Linear weights in bf16, half the bytes; the rest, and everything in a float32 run, as the trainers hold it), so the
workers decode exactly as the trainers' own weights would; after the first time only what an update changes
(updated_names: with LoRA, the adapters). What the workers sample is what one process with max_staleness would
sample (the same weights, the same noise: ppo_core.engine's counter noise per iteration and row), so a run with one
trainer and one worker equals the one-process run, and as many trainers as workers hold the rows data-parallel
processes would. With LoRA the workers' policies carry the same adapters, whose values travel with the weights;
with a pairwise judge each worker holds the frozen reference (or the policy with its adapters off) for the
reference responses, as a trainer would.
"""
import json
import time

import torch
import torch.distributed as torch_dist

from ..models import distributed as dist
from ..models.model import Linear


# ---------------------------------------------------------------------------- messages

def pack_message(obj):
    """obj (dicts, lists, JSON values, and tensors anywhere) -> (header: UTF-8 JSON bytes in which each tensor is a
    placeholder {"tensor": i, "dtype", "shape"}, the tensors as flat CPU byte tensors in placeholder order)."""
    tensors = []
    def strip(x):
        if isinstance(x, torch.Tensor):
            tensors.append(x.detach().cpu().contiguous().reshape(-1).view(torch.uint8))  # [bytes]
            return {"tensor": len(tensors) - 1, "dtype": str(x.dtype).removeprefix("torch."), "shape": list(x.shape)}
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [strip(v) for v in x]
        return x
    header = json.dumps({"message": strip(obj)}).encode()
    return header, tensors


def unpack_message(header: bytes, receive):
    """pack_message's inverse: receive(i, flat uint8 tensor) fills placeholder i's bytes, in placeholder order."""
    empties = []
    def fill(x):
        if isinstance(x, dict) and set(x) == {"tensor", "dtype", "shape"}:
            t = torch.empty(x["shape"], dtype=getattr(torch, x["dtype"]))
            empties.append((x["tensor"], t))
            return t
        if isinstance(x, dict):
            return {k: fill(v) for k, v in x.items()}
        if isinstance(x, list):
            return [fill(v) for v in x]
        return x
    obj = fill(json.loads(header.decode())["message"])
    for i, t in sorted(empties, key=lambda e: e[0]):
        receive(i, t.reshape(-1).view(torch.uint8))
    return obj


def send_message(obj, dst):
    """obj to process dst: the header's length, the header, then each tensor's bytes as one message (CPU tensors: gloo
    carries them whatever the job's device; a rollout's tensors travel as they are, not as text)."""
    header, tensors = pack_message(obj)
    torch_dist.send(torch.tensor([len(header)], dtype=torch.int64), dst)
    torch_dist.send(torch.frombuffer(bytearray(header), dtype=torch.uint8), dst)
    for flat in tensors:
        if flat.numel():
            torch_dist.send(flat, dst)


def recv_message(src):
    """send_message's other end."""
    size = torch.zeros(1, dtype=torch.int64)
    torch_dist.recv(size, src)
    header = torch.empty(int(size.item()), dtype=torch.uint8)
    torch_dist.recv(header, src)

    def receive(_, flat):  # the tensors' bytes arrive in placeholder order (empty ones are not sent)
        if flat.numel():
            torch_dist.recv(flat, src)
    return unpack_message(bytes(header.numpy()), receive)


BUCKET_BYTES = 64 * 2**20  # the weights travel in flat buckets of about this size: a few large messages, not hundreds


def wire_dtypes(policy, autocast_dtype) -> dict:
    """The dtype each of the policy's state-dict tensors travels in: under autocast (bf16-mixed), the weights of the
    decoder blocks' Linear layers in the autocast dtype, because decoding reads them only through autocast's copies
    (and oneDNN's packed ones, made alike), and bf16(float32(bf16(w))) = bf16(w): the workers decode exactly as with
    the float32 weights, for about half the bytes. Everything else (embeddings, norms, the head, LoRA adapters) in its
    own dtype. Sender and receiver compute the same. -> {state-dict name: dtype}"""
    autocast_only = set()
    if autocast_dtype is not None:
        autocast_only = {f"{name}.weight" for name, module in policy.named_modules()
                         if isinstance(module, Linear) and name.startswith("model.layers.")}
    return {name: autocast_dtype if name in autocast_only and t.dtype == torch.float32 else t.dtype
            for name, t in policy.state_dict().items()}


def updated_names(policy) -> list:
    """The state-dict names an update changes, in state-dict order: every parameter that trains (all of them, or the
    adapters alone with LoRA, whose frozen base weights then travel only once, at the start)."""
    trains = {name for name, p in policy.named_parameters() if p.requires_grad}
    return [name for name in policy.state_dict() if name in trains]


def weight_buckets(tensors: list, dtypes: list) -> list:
    """The policy's tensors as they travel, in its state dict's order (tied weights once under each name), grouped into
    buckets of one wire dtype (wire_dtypes) and about BUCKET_BYTES. -> lists of (tensor, its wire dtype); sender and
    receiver build the same ones."""
    buckets, size = [], 0
    for t, dtype in zip(tensors, dtypes, strict=True):
        nbytes = t.numel() * dtype.itemsize
        if not buckets or size + nbytes > BUCKET_BYTES or buckets[-1][0][1] != dtype:
            buckets.append([])
            size = 0
        buckets[-1].append((t, dtype))
        size += nbytes
    return buckets


def broadcast_weights(tensors: list, dtypes: list, async_op=False) -> list:
    """The first trainer's side: the full weights (in the policy's state-dict order, in their wire dtypes) to every
    worker, bucket by bucket, on the loop's device (NCCL on GPUs). -> the requests with async_op (wait on them; the
    flat copies live as long as they do), else []."""
    with torch.no_grad():
        flats = [torch.cat([t.detach().to(dist.device(), dtype).reshape(-1) for t, dtype in bucket])
                 for bucket in weight_buckets(tensors, dtypes)]
    requests = [(torch_dist.broadcast(flat, src=0, group=dist.weights_group(), async_op=async_op), flat)
                for flat in flats]
    return requests if async_op else []


def receive_weights(policy, wire: dict, names: list):
    """A worker's side of broadcast_weights: its policy's tensors `names` overwritten with the trainer's."""
    state = policy.state_dict()
    with torch.no_grad():
        for bucket in weight_buckets([state[name] for name in names], [wire[name] for name in names]):
            flat = torch.empty(sum(t.numel() for t, _ in bucket), dtype=bucket[0][1], device=bucket[0][0].device)
            torch_dist.broadcast(flat, src=0, group=dist.weights_group())
            for (t, _), part in zip(bucket, flat.split([t.numel() for t, _ in bucket])):
                t.copy_(part.view_as(t))  # (a bf16 part into a float32 tensor: exactly its value)


# ---------------------------------------------------------------------------- a rollout's rows, from workers to trainers

_RESPONSE_TENSORS = ("tokens", "response_mask", "decode_logprobs", "decode_entropy", "attended")  # [b, R]: right-padded


def with_tensors(state: dict) -> dict:
    """A sampled_state whose values are lists (read back from a checkpoint) with tensors in their place."""
    def tensor(t):
        if t is None or isinstance(t["values"], torch.Tensor):
            return t
        return {"dtype": t["dtype"], "values": torch.tensor(t["values"], dtype=getattr(torch, t["dtype"]))}
    return {**state, "tensors": {k: tensor(t) for k, t in state["tensors"].items()},
            "reward_metrics": {k: tensor(t) for k, t in state["reward_metrics"].items()}, "group": tensor(state["group"])}


def merge_rollouts(parts: list, pad_token_id) -> dict:
    """Consecutive row ranges of one rollout (ppo_core.rollout.sampled_state each, lists=False) as one: rows
    concatenated, the responses right-padded to the widest part (the prompts have one width: the workers agree on
    it). Statistics are the first part's (the workers reduce them over all of them), the decoding seconds the slowest
    part's."""
    if len(parts) == 1:
        return parts[0]
    width = max(p["tensors"]["tokens"]["values"].shape[1] for p in parts)  # R
    def joined(name, tensors):
        if tensors[0] is None:
            return None
        values = [t["values"] for t in tensors]
        if name in _RESPONSE_TENSORS:  # [b, R_part] -> [b, R]
            pad = pad_token_id if name == "tokens" else 0
            values = [torch.nn.functional.pad(v, (0, width - v.shape[1]), value=pad) for v in values]
        return {"dtype": tensors[0]["dtype"], "values": torch.cat(values)}
    first = parts[0]
    stats = dict(first["stats"])
    if "time/generate_s" in stats:
        stats["time/generate_s"] = max(p["stats"]["time/generate_s"] for p in parts)
    return {"rows": [r for p in parts for r in p["rows"]], "prompts": [r for p in parts for r in p["prompts"]],
            "responses": [r for p in parts for r in p["responses"]],
            "tensors": {name: joined(name, [p["tensors"][name] for p in parts]) for name in first["tensors"]},
            "reward_metrics": {k: joined(k, [p["reward_metrics"][k] for p in parts]) for k in first["reward_metrics"]},
            "reward_texts": {k: [t for p in parts for t in p["reward_texts"][k]] for k in first["reward_texts"]},
            "generate_s": max(p["generate_s"] for p in parts), "group": joined("group", [p["group"] for p in parts]),
            "stats": stats}


def rows_of(state: dict, lo: int, hi: int) -> dict:
    """Rows lo..hi-1 of a sampled_state."""
    def cut(t):
        return None if t is None else {"dtype": t["dtype"], "values": t["values"][lo:hi]}
    return {**state, "rows": state["rows"][lo:hi], "prompts": state["prompts"][lo:hi],
            "responses": state["responses"][lo:hi], "tensors": {k: cut(t) for k, t in state["tensors"].items()},
            "reward_metrics": {k: cut(t) for k, t in state["reward_metrics"].items()},
            "reward_texts": {k: v[lo:hi] for k, v in state["reward_texts"].items()}, "group": cut(state["group"])}


def trainer_shares(parts: list, trainers: int, pad_token_id) -> list:
    """The workers' parts of a rollout (each worker's consecutive rows, in worker order) as the trainers take them:
    trainer t the rows t*B/T .. (t+1)*B/T - 1, merged from the parts they come from (as many trainers as workers:
    each trainer exactly one worker's part, as data-parallel processes hold them). -> T sampled_states."""
    parts = [with_tensors(p) for p in parts]  # (a checkpoint's pending rollout holds lists)
    sizes = [len(p["rows"]) for p in parts]
    starts = [sum(sizes[:i]) for i in range(len(parts))]
    b = sum(sizes) // trainers
    shares = []
    for t in range(trainers):
        lo, hi = t * b, (t + 1) * b
        covering = [i for i in range(len(parts)) if starts[i] < hi and starts[i] + sizes[i] > lo]
        merged = merge_rollouts([parts[i] for i in covering], pad_token_id)
        offset = starts[covering[0]]
        shares.append(merged if (lo - offset, hi - offset) == (0, len(merged["rows"])) else
                      rows_of(merged, lo - offset, hi - offset))
    return shares


# ---------------------------------------------------------------------------- the trainers' side

class RolloutClient:
    """The trainers' end: start the workers, take each iteration's rollout, send the weights. Every trainer calls
    every method (with FSDP, gathering the weights is collective); the first trainer talks to the workers and hands
    each other trainer its share of the rows."""

    def __init__(self, cfg, policy, stream, pad_token_id, autocast_dtype):
        self.cfg, self.policy, self.stream, self.pad_token_id = cfg, policy, stream, pad_token_id
        self.wire, self.updated = wire_dtypes(policy, autocast_dtype), updated_names(policy)
        self.first = dist.rank() == 0
        self.workers = [dist.global_rank(w, "rollout", cfg.rollout_ranks) for w in range(cfg.rollout_ranks)]
        self.device = next(policy.parameters()).device

    def send_weights(self, names, async_op=False) -> list:
        """The policy's full tensors `names` to the workers, in their wire dtypes (the first trainer broadcasts;
        gathering FSDP's shards first is collective over the trainers). -> broadcast_weights' requests."""
        full = dist.full_state_dict(self.policy)
        if not self.first:
            return []
        return broadcast_weights([full[name] for name in names], [self.wire[name] for name in names], async_op)

    def start(self, start_iter, state):
        """Tell the workers where the run stands: the iteration, whether a rollout is already in hand (a resume of a
        stale run), the stream's position; then the weights."""
        if self.first:
            first = start_iter + 1 if "pending_rollout" in state else start_iter
            for worker in self.workers:
                send_message({"start": start_iter, "first": first, "stream": self.stream.state_dict()}, worker)
        self.send_weights(list(self.policy.state_dict()))  # all of them

    def receive(self) -> dict:
        """The next rollout from the workers (the first trainer) -> {"parts": each worker's rows, "worker_idle_s":
        the longest a worker waited}; the stream's position after it is the first worker's (all draw alike)."""
        messages = [recv_message(worker) for worker in self.workers]
        self.stream.load_state_dict(messages[0]["stream"])  # the checkpoint holds the workers' position
        return {"parts": [m["rollout"] for m in messages], "worker_idle_s": max(m["worker_idle_s"] for m in messages),
                "weights_version": min(m["weights_version"] for m in messages)}

    def rollout(self, it, state):
        """Iteration it's rollout, this trainer's rows of it: in hand (max_staleness=1) or received now.
        -> (its state, as ppo_core.rollout.sampled_state wrote it: the caller decodes it with sampled_from_state, so
        that nothing here imports the loop; the stats it adds). stats["off_policy/staleness"]: how many updates behind
        the weights it was sampled with are (the workers number their weights by the iteration they start; never more
        than max_staleness)."""
        waiting = time.perf_counter()
        if self.first:
            pending = state.pop("pending_rollout", None)
            message = pending if pending is not None else self.receive()
            staleness = it - message["weights_version"]
            if not 0 <= staleness <= self.cfg.max_staleness:
                raise RuntimeError(f"iteration {it}'s rollout was sampled with the weights of iteration "
                                   f"{message['weights_version']}: {staleness} update(s) stale, max_staleness is "
                                   f"{self.cfg.max_staleness}")
            shares = trainer_shares(message["parts"], dist.world_size(), self.pad_token_id)
            for t in range(1, len(shares)):  # trainer t's global rank: t
                send_message({"rollout": shares[t], "stream": self.stream.state_dict(), "staleness": staleness}, t)
            mine, idle = shares[0], message["worker_idle_s"]
        else:
            message = recv_message(0)
            self.stream.load_state_dict(message["stream"])
            mine, idle, pending, staleness = message["rollout"], None, None, message["staleness"]
        stats = {"time/trainer_wait_s": time.perf_counter() - waiting if pending is None else 0.0,
                 "off_policy/staleness": staleness}
        if idle is not None:
            stats["time/worker_idle_s"] = idle
        return mine, stats

    def after_update(self, it, state) -> dict:
        """The update of iteration it is done: the workers get the new weights (if they sample again); with
        max_staleness=1 the rollout they sampled meanwhile is received and kept for iteration it+1."""
        if it + 1 >= self.cfg.iterations:
            return {}
        sending = time.perf_counter()
        if not self.first:
            self.send_weights(self.updated)  # (its part of FSDP's gather)
            return {}
        if self.cfg.max_staleness:
            # a worker sends its rollout before it takes the weights: broadcast without waiting, then receive
            requests = self.send_weights(self.updated, async_op=True)
            waiting = time.perf_counter()
            state["pending_rollout"] = self.receive()
            waited = time.perf_counter() - waiting
            for request, _ in requests:
                request.wait()
            return {"time/weights_and_next_rollout_s": time.perf_counter() - sending, "time/trainer_wait_next_s": waited}
        self.send_weights(self.updated)
        return {"time/weights_s": time.perf_counter() - sending}


# ---------------------------------------------------------------------------- the workers' side

def serve(cfg, policy, stream, sample, autocast_dtype):
    """A worker's loop: sample and score its rows of each iteration's rollout (the workers split the rows as
    data-parallel processes do) with the latest weights it has, send them, take new weights, in the order of this
    module's docstring. Returns when the run's last rollout is sent. `policy` is overwritten by the trainer's
    weights before anything is sampled. sample(it) -> iteration it's rows as a sampled_state (lists=False): the
    loop's own rollout (ppo_core.train.serve_rollouts passes it), so that nothing here imports the loop."""
    trainer = dist.global_rank(0, "train", cfg.rollout_ranks)
    wire, updated = wire_dtypes(policy, autocast_dtype), updated_names(policy)
    start = recv_message(trainer)
    stream.load_state_dict(start["stream"])
    receive_weights(policy, wire, list(policy.state_dict()))
    version = start["start"]  # the weights' version: the iteration they start (the updates they have had)
    idle = 0.0
    for it in range(start["first"], cfg.iterations):
        if not cfg.max_staleness and it > start["first"]:  # the weights of the update that rollout it-1 fed
            waiting = time.perf_counter()
            receive_weights(policy, wire, updated)
            version += 1
            idle = time.perf_counter() - waiting
        send_message({"rollout": sample(it), "stream": stream.state_dict(),
                      "worker_idle_s": idle, "weights_version": version}, trainer)
        if cfg.max_staleness and it > start["start"]:
            # the trainer sent iteration it's weights just before it took this rollout (after the update of it-1):
            # the next rollout is sampled with them, one update behind the trainer
            waiting = time.perf_counter()
            receive_weights(policy, wire, updated)
            version += 1
            idle = time.perf_counter() - waiting
    return {}
