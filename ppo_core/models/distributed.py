"""torch.distributed, the few pieces the loop needs: the same code path for 1 or N processes.

    torchrun --standalone --nproc-per-node=8 -m ppo_core.train --config run.toml [--parallel=fsdp]

Data parallelism: every process draws the same global prompt batch and keeps its slice; losses are
normalised by the GLOBAL token/sequence counts, so the SUM of the processes' gradients is exactly the
single-process gradient of the same batch. Two ways to spread the trainable models (cfg.parallel):
  - 'ddp':  DistributedDataParallel replicas; its bucketed all-reduce, overlapped with the backward,
            sums the gradients (a comm hook replaces DDP's mean by the sum).
  - 'fsdp': FSDP2 `fully_shard` on every decoder block and then the whole model (embeddings, final
            norm, head): parameters, gradients and AdamW moments live sharded; each block's weights are
            all-gathered for its forward/backward and the gradients reduce-scattered (summed: divide
            factor 1). For decoding, `gathered` all-gathers the weights once for the whole generate call.
With one process every helper here is the identity and the models are used as they are.

Devices. On CUDA the process group has two backends, "cpu:gloo,cuda:nccl": NCCL for tensors on the GPU,
gloo for any CPU tensor; the loop's own collectives (counts, statistics, gathered rows, `all_reduce_max_int`)
run on the loop's device. On the CPU it is gloo alone.

Precision, one rule for 1 and N processes: the parameters keep the run's dtype (fp32 master weights with
dtype='auto') and compute happens under the same bf16 autocast as on one GPU, so norms, the residual stream
and the LM head stay fp32 exactly as in a single-process run. FSDP therefore all-gathers fp32 parameters
(no MixedPrecisionPolicy param_dtype: bf16 parameters would make every norm, the residual stream and the head
bf16, numerics no single process uses) and reduces gradients in fp32. The price is twice the all-gather
bytes of bf16 parameters.
"""
import contextlib
import datetime
import os

import torch
import torch.distributed as dist


_device = torch.device("cpu")  # the loop's device, set by init: where this module's own tensors live
_group = None  # this process's role's group (split_roles): every helper below works within it; None = all processes
_weights_group = None  # the first trainer and the rollout workers (split_roles): the weights' broadcast


ROLES_TIMEOUT = datetime.timedelta(hours=4)
"""How long a collective or message may wait with rollout workers (split_roles): a worker waits through the trainers'
whole update (max_staleness=0) and, at the end, their final evaluation and checkpoint; the default (30 minutes with
gloo, 10 with NCCL) could end a large run there."""


def init(device_kind: str, roles=False):
    """Join the process group when launched by torchrun. roles: rollout workers will split the job
    (ROLES_TIMEOUT). Returns (rank, world_size, device)."""
    global _device
    _device = torch.device("cpu")
    if device_kind == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        _device = torch.device("cuda", local)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        # NCCL for CUDA tensors and gloo for CPU ones: NCCL alone cannot reduce a CPU tensor
        dist.init_process_group("cpu:gloo,cuda:nccl" if device_kind == "cuda" else "gloo",
                                timeout=ROLES_TIMEOUT if roles else None)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    return rank, world, _device


def split_roles(rollout_ranks: int) -> str:
    """With rollout workers (config rollout_ranks): the last `rollout_ranks` processes roll out (ppo_core.run.rollout_worker)
    and the others train, each role in a process group of its own, which every helper here then works within (a
    trainer's world_size() counts the trainers); a third group, the first trainer and the workers, carries the
    weights (weights_group). Every process calls it, once, after init. -> "train" or "rollout"."""
    global _group, _weights_group
    if not rollout_ranks or not dist.is_initialized() or dist.get_world_size() <= rollout_ranks:
        return "train"  # (no trainer left: ppo_core.train refuses the job with one line)
    world = dist.get_world_size()
    trainers, workers = list(range(world - rollout_ranks)), list(range(world - rollout_ranks, world))
    # every process creates every group, in this order
    groups = [dist.new_group(trainers, timeout=ROLES_TIMEOUT), dist.new_group(workers, timeout=ROLES_TIMEOUT)]
    _weights_group = dist.new_group([0] + workers, timeout=ROLES_TIMEOUT)
    mine = 0 if dist.get_rank() in trainers else 1
    _group = groups[mine]
    return ("train", "rollout")[mine]


def role_group():
    """This process's role's group (split_roles), None = every process: for collectives made elsewhere (checkpoints)."""
    return _group


def weights_group():
    """The first trainer and the rollout workers (split_roles): the group the weights are broadcast in."""
    return _weights_group


def device():
    """The loop's device (init): where collectives of CUDA tensors run (NCCL) and of CPU ones (gloo)."""
    return _device


def global_rank(role_rank: int, role: str, rollout_ranks: int) -> int:
    """The rank in the whole job of a role's process `role_rank` (point-to-point messages between the roles)."""
    return role_rank if role == "train" else dist.get_world_size() - rollout_ranks + role_rank


def world_size():
    return dist.get_world_size(_group) if dist.is_initialized() else 1


def job_size():
    """Every process of the job, whatever its role."""
    return dist.get_world_size() if dist.is_initialized() else 1


def rank():
    return dist.get_rank(_group) if dist.is_initialized() else 0


def broadcast_from_first(t: torch.Tensor) -> torch.Tensor:
    """t as the role's first process has it, on every process of the role."""
    if dist.is_initialized():
        dist.broadcast(t, src=dist.get_global_rank(_group, 0) if _group is not None else 0, group=_group)
    return t


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=_group)
    return t


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_group)
    return t


def all_reduce_max_int(x: int) -> int:
    if not dist.is_initialized():
        return x
    t = torch.tensor([x], dtype=torch.long, device=_device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_group)
    return int(t.item())


def all_gather_rows(t: torch.Tensor) -> torch.Tensor:
    """Concatenate every process's [b, ...] tensor along dim 0, in rank order -> [world*b, ...]."""
    if not dist.is_initialized():
        return t
    parts = [torch.empty_like(t) for _ in range(world_size())]
    dist.all_gather(parts, t.contiguous(), group=_group)
    return torch.cat(parts)


# ---------------------------------------------------------------------------- DDP and FSDP2

def _sum_allreduce(_, bucket):
    """DDP comm hook: sum the bucket over processes (DDP's default divides by the world size)."""
    return dist.all_reduce(bucket.buffer(), group=_group, async_op=True).get_future().then(lambda fut: fut.value()[0])


def replicate(model, device):
    """A DDP wrapper of `model` for training forwards (the module itself stays usable for the rest)."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                  broadcast_buffers=False,  # the only buffers are RoPE tables, equal everywhere
                                  process_group=_group)
    ddp.register_comm_hook(None, _sum_allreduce)
    return ddp


def shard(model, device, *, root=True, cpu_offload=False):
    """FSDP2: `fully_shard` every decoder block, then (root=True) the model itself, which holds the
    embeddings, the final norm and the head. Gradients are summed over processes, not averaged.
    root=False leaves those replicated (a frozen model whose head runs outside forward, e.g. score()).
    Parameters are all-gathered in their own dtype and gradients reduced in fp32 (see the module docstring:
    the same numerics as one process). cpu_offload: shards, gradients and optimizer state in CPU memory."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

    # the role's own processes (the trainers beside rollout workers: a mesh made from the group, since a new mesh
    # over all processes would wait for the workers to join it)
    mesh = (DeviceMesh.from_group(_group, device.type) if _group is not None
            else init_device_mesh(device.type, (world_size(),)))
    kwargs = {"mesh": mesh,
              "mp_policy": MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in model.model.layers:
        fully_shard(block, **kwargs)
    if root:
        fully_shard(model, **kwargs)
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
    return model


def _fsdp_units(model):
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model) -> bool:
    return bool(_fsdp_units(model))


@contextlib.contextmanager
def gathered(model):
    """Full weights on every process for the duration (decoding): each FSDP unit is all-gathered once
    and kept, so a generate call makes no collective per step and processes may stop decoding at
    different steps. Identity for a model that is not sharded."""
    units = _fsdp_units(model)
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            # blocks free their full weights after forward again; the root keeps FSDP's own choice
            # for it (no reshard: its weights are needed again right away in the backward)
            unit.set_reshard_after_forward(unit is not model, recurse=False)


@contextlib.contextmanager
def gradient_sync(trainable, enabled: bool):
    """Gradient accumulation: with enabled=False the backward keeps gradients local (DDP's no_sync,
    FSDP's requires_gradient_sync); the micro-batch with enabled=True reduces the accumulated sum."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(trainable, DistributedDataParallel) and not enabled:
        with trainable.no_sync():
            yield
        return
    units = _fsdp_units(trainable)
    for unit in units:
        unit.set_requires_gradient_sync(enabled, recurse=False)
    yield


def full_state_dict(model) -> dict:
    """The model's full tensors on rank 0 (CPU), {} on the other ranks; collective for a sharded model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not is_sharded(model):
        return model.state_dict()
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def local_tensor(t):
    """A DTensor's full value (collective) or the tensor itself: for scalars such as a gradient norm."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def barrier():
    if dist.is_initialized():
        dist.barrier(group=_group)


def job_barrier():
    """Every process of the job, whatever its role: with rollout workers, the roles leave together at the end (a
    worker that tore its process groups down while the trainers still ran sometimes aborted in gloo's teardown)."""
    if dist.is_initialized():
        dist.barrier()


def shutdown():
    if dist.is_initialized():
        dist.destroy_process_group()
