"""The GPU path's device audit, without a GPU: one whole PPO iteration on fake CUDA tensors.

torch's FakeTensorMode runs every op on metadata only (shape, dtype, device) and raises when an op mixes
devices, so a rollout (generate, old/reference log-probs, values, scores), the advantages and a policy + critic
update with the real optimizers run here with every model and batch tensor on "cuda" and no GPU. Decoding runs
the rollout engine (ppo_core.engine: its paged pool, step batches and sampling on the device; attention on the
kernels' torch path, as every ppo_kernels call here). On top
of it, `DeviceAudit` (a dispatch mode):
  - runs work on real CPU tensors for real (shuffling, row selection), as a GPU run would;
  - rejects `cat`/`stack` of tensors on different devices, which real CUDA rejects but fake tensors let through
    for a CPU 0-dim tensor;
  - answers host reads (.item(), .tolist(), bool(), data-dependent shapes), which have no value on fake tensors,
    and records where each read or copy to the host of a device value happens: the update must read in the
    places ppo_core.update.ppo_update names.

On a CPU-only build torch has no CUDA device guard, so indexing a fake CUDA tensor fails before reaching the fake
mode: `_fake_cuda_runtime` compiles the no-op CUDA guard torch itself installed for this case in earlier releases
(`torch._C._ensureCUDADeviceGuardSet`) into a tiny shared library. It is process-wide and permanent, so the audit
runs in a fresh process (this file run as a script). The autograd engine needs a real CUDA runtime for its stream
bookkeeping, so on a CPU-only build each backward is replaced by fake zero gradients (`FakeBackward`): the backward
kernels are followed only on a CUDA build (where the rest runs as well). torch.autocast("cuda") turns itself off
without CUDA, so `fake_cuda_autocast` sets its state directly.

The rollout engine's decode-only steps on ppo_core.engine.static_decode's fixed-shape buffers (what its CUDA graphs
capture; the capture itself needs a GPU) are audited the same way on their own (`audit_static_decode`).

Two processes: a process group whose only backend serves CUDA tensors is what `init_process_group("nccl")`
gives, and torch's fake process group ("cuda:fake", torch.testing._internal.distributed.fake_pg) is such a group
on a CPU build: a collective on a CPU tensor raises "No backend type associated with device type cpu", as under
NCCL. The audit runs rank 0 of 2 in it, so every collective of the loop must be on the loop's device.
"""
import contextlib
import inspect
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import ppo_kernels

from ppo_core import train
from ppo_core.config import build_config
from ppo_core.models.model import load_model, load_score_model
from ppo_core.rewards.source import make_reward_source
from ppo_core.rollout import collect_rollout
from ppo_core.data.tasks import eval_prompts
from ppo_core.models.tokenizer import load_tokenizer
from ppo_core.update import MB_STATS, Optimizers, compute_advantages, ppo_update
from ppo_core.run.start import Models, Step

PPO_CORE = os.path.dirname(os.path.abspath(train.__file__))
KERNELS = os.path.dirname(os.path.abspath(ppo_kernels.__file__))
LOOP_FILES = ("train.py:", "rollout.py:", "update.py:")  # the loop (ppo_core.train) and its two rooms
GUARD_SOURCE = """#include <c10/core/impl/DeviceGuardImplInterface.h>
C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::CUDA>);
"""


def _fake_cuda_runtime(tmp_dir):
    """On a CPU-only build: a CUDA device guard for fake CUDA tensors (see above)."""
    if torch.cuda.is_available():
        return
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler to build the no-op CUDA device guard")
    torch_dir = os.path.dirname(torch.__file__)
    src, lib = os.path.join(tmp_dir, "guard.cpp"), os.path.join(tmp_dir, "fake_cuda_guard.so")
    with open(src, "w") as f:
        f.write(GUARD_SOURCE)
    subprocess.run([compiler, "-shared", "-fPIC", "-std=c++17", f"-I{torch_dir}/include", src, f"-L{torch_dir}/lib",
                    "-lc10", "-o", lib], check=True, capture_output=True, text=True)
    import ctypes

    ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)  # its static initialiser registers the guard


@contextlib.contextmanager
def fake_cuda_autocast(dtype=torch.bfloat16):
    """What `torch.autocast("cuda", dtype)` sets up, set directly (the context manager needs a real GPU)."""
    enabled, old_dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", old_dtype)


def _caller():
    """'file.py:function' of the innermost ppo_core or ppo_kernels frame on the stack (where a host read is); a file in
    a subpackage as 'engine/rollout_engine.py:function', so that the loop's own files are told apart from the rest."""
    for frame in inspect.stack(context=0)[2:]:
        path = os.path.abspath(frame.filename)
        for root in (PPO_CORE, KERNELS):
            if path.startswith(root + os.sep):
                return f"{os.path.relpath(path, root).replace(os.sep, '/')}:{frame.function}"
    return "?"


class DeviceAudit(TorchDispatchMode):
    """Above a FakeTensorMode: strict device checks for cat, answers and records host reads."""

    def __init__(self):
        super().__init__()
        self.device_reads = []  # 'file.py:function' of each read of a CUDA value, in order

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        device = kwargs.get("device")
        if not any(isinstance(t, FakeTensor) for t in tensors) and (device is None or torch.device(device).type == "cpu"):
            with unset_fake_temporarily():  # CPU work (shuffling, row selection, token ids) runs for real
                return func(*args, **kwargs)
        if func is torch.ops.aten._to_copy.default and args[0].device.type != "cpu" and device is not None \
                and torch.device(device).type == "cpu":
            self.device_reads.append(_caller())  # a copy to the host waits for the device like a read
        if func in (torch.ops.aten.cat.default, torch.ops.aten.stack.default):
            devices = {t.device for t in args[0]}
            if len(devices) > 1:
                raise RuntimeError(f"{func}: Expected all tensors to be on the same device, got {sorted(map(str, devices))}")
        if func is torch.ops.aten._local_scalar_dense.default:
            t = args[0]
            if t.device.type != "cpu":
                self.device_reads.append(_caller())
            if t.dtype == torch.bool:  # gradients finite (update steps), a padded batch, decoding not done yet
                return _caller().endswith(":step")
            return 1 if not t.dtype.is_floating_point else 0.5
        if func is torch.ops.aten.nonzero.default:  # data-dependent shape: answer "all true"
            if args[0].device.type != "cpu":
                self.device_reads.append(_caller())
            t = args[0]
            return torch.empty((t.numel(), t.dim()), dtype=torch.long, device=t.device)
        if func is torch.ops.aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
            indices = []  # a boolean mask selects by its nonzero positions: answer "all true", as above
            for i in args[1]:
                if i is None or i.dtype != torch.bool:
                    indices.append(i)
                    continue
                if i.device.type != "cpu":
                    self.device_reads.append(_caller())
                grids = torch.meshgrid(*[torch.arange(n, device=i.device) for n in i.shape], indexing="ij")
                indices.extend(g.reshape(-1) for g in grids)
            return func(args[0], indices)
        return func(*args, **kwargs)


class FakeBackward(TorchFunctionMode):
    """CPU-only build: `loss.backward()` gives each trainable parameter without a gradient a fake zero one, and
    `torch.autograd.grad(loss, inputs)` (the fused head's per-token gradient of the loss) fake zeros like its inputs."""

    def __init__(self, params):
        super().__init__()
        self.params, self.calls = params, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.backward:
            loss = args[0]
            assert loss.requires_grad and loss.dim() == 0 and loss.device.type == "cuda", loss
            self.calls += 1
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            return None
        if func is torch.autograd.grad:
            outputs, inputs = args[0], args[1]  # autograd.grad hands its own tuples to the mode
            outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
            assert all(t.dim() == 0 and t.device.type == "cuda" for t in outputs), outputs
            assert all(t.device.type == "cuda" for t in inputs), [t.device for t in inputs]
            return tuple(torch.zeros_like(t) for t in inputs)
        return func(*args, **(kwargs or {}))


def to_fake_cuda(module, mode):
    """Replace every parameter by a fake CUDA copy (tied parameters stay tied)."""
    done = {}
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None:
                if id(p) not in done:
                    fake = mode.from_tensor(p.detach())
                    with mode:
                        done[id(p)] = torch.nn.Parameter(fake.to("cuda"), p.requires_grad)
                m._parameters[name] = done[id(p)]
    return module


def join_cuda_only_group(world=2):
    """Rank 0 of `world` in a process group with a backend for CUDA tensors only (as NCCL alone), no peers needed."""
    import torch.distributed as c10d
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ppo_core.models import distributed

    c10d.init_process_group("cuda:fake", store=FakeStore(), rank=0, world_size=world)
    distributed._device = torch.device("cuda")  # what distributed.init("cuda") sets (it also needs a real GPU)


def audit_one_iteration(fused, kl_in_reward, autocast, world=1, packed=False):
    """One PPO iteration (rollout, advantages, two optimizer steps) on fake CUDA tensors; asserts what it checks.
    world=2: as rank 0 of two processes in a CUDA-only process group (join_cuda_only_group). packed: every pass on
    packed micro-batches (micro_batch_tokens; a budget of 1 token puts each row in a micro-batch of its own)."""
    # The Triton launch cannot run on fake tensors; the fused entry points' torch path has the same signature.
    os.environ["PPO_KERNELS_BACKEND"] = "torch"
    batching = {"micro_batch_tokens": "1"} if packed else {"micro_batch_size": "1"}
    cfg = build_config({}, {**batching, "rollout_batch_size": "4", "minibatch_size": "2",
                            "max_new_tokens": "6", "ppo_epochs": "1", "fused_kernels": str(fused).lower(),
                            "kl_in_reward": str(kl_in_reward).lower(), "cuda_graph": "false",
                            # the engine's default budget reads the GPU's free memory, which fake CUDA has not got
                            "rollout_kv_cache_gb": "1"})
    tokenizer = load_tokenizer(train.DEMO_CHECKPOINT)
    policy = load_model(train.DEMO_CHECKPOINT)
    critic = load_score_model(train.DEMO_CHECKPOINT)
    reference = load_model(train.DEMO_CHECKPOINT).eval().requires_grad_(False)
    prompts = eval_prompts(4, seed=0)
    b = len(prompts) // world  # this process's rows: 0..b-1 of the global batch
    ac = fake_cuda_autocast if autocast else contextlib.nullcontext

    mode, audit = FakeTensorMode(allow_non_fake_inputs=True), DeviceAudit()
    for model in (policy, critic, reference):
        to_fake_cuda(model, mode)
    opts = Optimizers(policy, critic, cfg, steps_per_iter=2, log=None)
    with mode, audit:
        assert next(policy.parameters()).device.type == "cuda"
        # a CUDA generator cannot exist without CUDA; the rollout then draws from torch's default CUDA stream
        # as train.run does: the same prompt width on every process, each process's rows of the global batch
        encoded = [tokenizer.encode(p) for p in prompts[:b]]
        pad_to = train.dist.all_reduce_max_int(max(len(e) for e in encoded))
        rows = (0, len(prompts)) if world > 1 else None
        models = Models(policy, reference, critic, tokenizer=tokenizer, reward_source=make_reward_source(cfg))
        rollout, ended = collect_rollout(models, Step(cfg, None, ac), prompts[:b], pad_to, rows, encoded,
                                         torch.arange(b))
        for name in ("input_ids", "attention_mask", "response_mask", "old_logprobs", "ref_logprobs",
                     "old_values", "entropy", "scores", "group"):
            assert getattr(rollout, name).device.type == "cuda", name
        assert rollout.old_logprobs.dtype == rollout.old_values.dtype == torch.float32
        compute_advantages(rollout, cfg, 0.05, ended)
        rollout_reads = list(audit.device_reads)
        audit.device_reads.clear()
        step_count = opts.step_count
        trainable = [p for m in (policy, critic) for p in m.parameters() if p.requires_grad]
        backward = contextlib.nullcontext() if torch.cuda.is_available() else FakeBackward(trainable)
        with backward:
            stats = ppo_update(policy, critic, rollout, Step(cfg, torch.Generator().manual_seed(0), ac), 0.05, opts.step)
        assert torch.cuda.is_available() or backward.calls == 2 * 2 * 2  # steps x micro-batches x (policy, critic)
        assert opts.step_count == step_count + 2 and opts.skipped == 0  # two minibatches, both stepped
        assert all(p.grad is None for p in policy.parameters())  # zero_grad after the step
        assert isinstance(stats["policy/first_ratio_max_dev"], float)

    # Device reads of the loop's files in the rollout: the sampled tokens and their mask brought to the host, once each,
    # and the attention mask once (what packing plans on, and ppo_update reads: nothing is read in the micro-batch loop).
    if world == 1:  # (with two processes, all_reduce_max_int's result is read as well)
        want = ["rollout.py:sample_responses"] * 2 + ["rollout.py:rollout_forward"]
        assert [r for r in rollout_reads if r.startswith(LOOP_FILES)] == want, rollout_reads
    # Device reads of the loop's files in the update, per optimizer step: the statistics in one read, then the finite
    # check; nothing inside the micro-batch loop (reads of the model and kernels are theirs: listed on stdout).
    ours = [r for r in audit.device_reads if r.startswith(LOOP_FILES)]
    # sums (MB_STATS, then PPO's clipfrac, approx_kl, ratio_mean), token count, first and max ratio deviation, largest
    # behaviour gap: one .tolist()
    n_stats = len(MB_STATS) + 3 + 4
    n_norms = 2  # the policy's and the critic's gradient norm: one .tolist()
    assert ours == (["update.py:_read_step_stats"] * n_stats + ["update.py:step"] * n_norms) * 2, ours
    others = sorted(set(r for r in rollout_reads + audit.device_reads if not r.startswith(LOOP_FILES)))
    print("device reads outside the loop's files:", " ".join(others), file=sys.stderr)


CASES = [
    (False, True, True),   # the default kl_in_reward (kl_loss is a constant 0) on the plain torch head
    (True, False, True),   # the KL as a loss term, LM-head-fused kernels (their torch path)
    (True, True, False),   # dtype=float32 on a GPU: no autocast
    (True, True, True, True),  # packed micro-batches (micro_batch_tokens): varlen attention under bf16 autocast
]


def run_audit(*args, tmp_path):
    """This file as a script in a fresh process (see the module docstring). -> CompletedProcess."""
    root = os.path.dirname(PPO_CORE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, os.path.abspath(__file__), str(tmp_path), *args],
                          capture_output=True, text=True, timeout=300, cwd=root, env=env)


def test_one_ppo_iteration_on_fake_cuda_mixes_no_devices(tmp_path):
    proc = run_audit(*("".join(str(int(flag)) for flag in case) for case in CASES), tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert proc.stdout.split() == ["ok"] * len(CASES), proc.stdout


def test_two_processes_collect_on_the_device_only(tmp_path):
    """Rank 0 of 2 in a CUDA-only process group (as NCCL alone): the loop's collectives never get a CPU tensor."""
    proc = run_audit("w2", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert proc.stdout.split() == ["ok"], proc.stdout


def test_the_audit_catches_what_fake_tensors_let_through(tmp_path):
    proc = run_audit("catches", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert proc.stdout.split() == ["ok"], proc.stdout


def test_the_engine_static_decode_steps_on_fake_cuda_mix_no_devices(tmp_path):
    proc = run_audit("static", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert proc.stdout.split() == ["ok"], proc.stdout


def audit_static_decode():
    """The rollout engine's decode-only steps on ppo_core.engine.static_decode's fixed-shape buffers, forced on (the graphs
    need the Triton backend, which fake tensors cannot launch), under bf16 autocast: every buffer on the device and
    no op mixing devices. Capturing and replaying the graphs needs a real GPU (tests/test_engine.py's GPU tier)."""
    from ppo_core.engine import RolloutEngine

    os.environ["PPO_KERNELS_BACKEND"] = "torch"
    policy = load_model(train.DEMO_CHECKPOINT)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    to_fake_cuda(policy, mode)
    engine = RolloutEngine(policy, kv_cache_gb=1, block_size=4, static_decode=True)
    with mode, DeviceAudit(), fake_cuda_autocast():
        tokens, logprobs = engine.generate([[1, 5, 9], [1, 7], [2, 3, 4, 5, 6, 7]], [6, 3, 5], return_logprobs=True)
    assert [len(t) for t in tokens] == [6, 3, 5]
    s = engine.stats
    assert s["static_steps"] >= 4 and s["cuda_graphs"].startswith("off: PPO_KERNELS_BACKEND=torch"), s


def audit_catches_what_fake_tensors_let_through():
    """A 0-dim CPU tensor stacked with CUDA ones passes FakeTensorMode but raises on a real GPU: the audit raises."""
    with FakeTensorMode():
        loss = torch.ones((), device="cuda")
        torch.stack([loss, torch.zeros(())])  # fake tensors let this through
        with DeviceAudit(), pytest.raises(RuntimeError, match="same device"):
            torch.stack([loss, torch.zeros(())])
        sums = torch.zeros(2, dtype=torch.float64)
        with pytest.raises(RuntimeError, match="same device|two devices"):
            sums += torch.stack([loss, loss]).double()  # and a CPU accumulator of CUDA values raises anyway


if __name__ == "__main__":  # python tests/test_fake_cuda.py TMP_DIR CASE...   (CASE: digits fused, kl_in_reward, autocast[, packed])
    _fake_cuda_runtime(sys.argv[1])
    for case in sys.argv[2:]:
        if case == "catches":
            audit_catches_what_fake_tensors_let_through()
        elif case == "static":
            audit_static_decode()
        elif case == "w2":
            join_cuda_only_group(world=2)
            audit_one_iteration(True, False, True, world=2)
        else:
            flags = [c == "1" for c in case]
            audit_one_iteration(*flags[:3], packed=len(flags) > 3 and flags[3])
        print("ok", flush=True)
