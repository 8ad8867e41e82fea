"""torch.distributed, the few pieces the loop needs: the same code path for 1 or N processes.

    torchrun --standalone --nproc-per-node=8 -m ppo_core.train --config run.toml

Data parallelism: every process draws the same global prompt batch and keeps its slice; gradients
are summed across processes with one all-reduce per optimizer step (losses are normalised by the
GLOBAL token/sequence counts, so the sum is exactly the single-process gradient of the same batch).
With one process every helper here is the identity.
"""
import os

import torch
import torch.distributed as dist


def init(device_kind: str):
    """Join the process group when launched by torchrun. Returns (rank, world_size, device)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device_kind == "cuda" else "gloo"
        dist.init_process_group(backend)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if device_kind == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")


def world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


def rank():
    return dist.get_rank() if dist.is_initialized() else 0


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_max_int(x: int) -> int:
    if not dist.is_initialized():
        return x
    t = torch.tensor([x], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def all_gather_rows(t: torch.Tensor) -> torch.Tensor:
    """Concatenate every process's [b, ...] tensor along dim 0, in rank order -> [world*b, ...]."""
    if not dist.is_initialized():
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def sum_gradients(params):
    """Sum .grad over processes in one flat all-reduce (what DDP's bucketed reduction does, without
    the averaging: the losses are already normalised by global counts)."""
    if not dist.is_initialized():
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n


def barrier():
    if dist.is_initialized():
        dist.barrier()


def shutdown():
    if dist.is_initialized():
        dist.destroy_process_group()
