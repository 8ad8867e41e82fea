"""Run ppo-train on Modal with a GPU type per role: the trainer in one container, the rollout workers in another.

    pip install -e ".[modal]" && modal setup                         # once: the client and a token
    modal volume put ppo-core ./Qwen3-4B /models/Qwen3-4B            # weights onto the Volume (once)
    PPO_MODAL_TRAIN_GPU=H100:1 PPO_MODAL_ROLLOUT_GPU=H100:1 modal run scripts/modal_roles.py \\
        --policy /vol/models/Qwen3-4B --max_staleness=1 --off_policy_correction=tis    # 1 trainer + 1 worker
    PPO_MODAL_TRAIN_GPU=H100:1 PPO_MODAL_ROLLOUT_GPU=L40S:1 modal run scripts/modal_roles.py \\
        --policy /vol/models/Qwen3-0.6B                              # the workers on a cheaper GPU type
    modal run scripts/modal_roles.py --policy /vol/models/Qwen3-8B   # the defaults: 8 x H100 train, 4 x H100 roll out
    modal volume get ppo-core runs/<run> ./<run>                     # the run directory back

The trainers (DDP, or FSDP with --parallel=fsdp) and the workers may be any number each, as long as a rollout's rows
split evenly over both (ppo_core.run.rollout_worker).

One torch.distributed job spans the two containers, as ppo_core.run.rollout_worker expects it under torchrun: the
trainer container runs ranks 0..T-1 (T = its GPU count), the rollout workers' container ranks T..T+W-1 (W = its GPU
count), WORLD_SIZE = T+W, MASTER_ADDR = the trainer container's private address, and `--rollout_ranks=W` is added to
the arguments (a caller's own, different --rollout_ranks is refused: the GPU specs decide it; it also overrides a
config file's). torchrun cannot give two nodes different process counts with fixed rank ranges, so each container
starts its processes itself (`role_processes`, `run_processes`), as torchrun would: the same variables, and the
first process to fail stops the others and gives the job's exit status. The flow: the local entrypoint calls the
trainer function; it finds its address, spawns the rollout function with that address, the port and T, then runs
its own ranks and watches the rollout container as one more process of the job. Rank 0 waits for the workers in the
rendezvous up to torch.distributed's default timeout (30 minutes for ppo_core's group): if the region has no free GPUs
of the workers' type for that long, the attempt fails and Modal retries it.

Why torch.distributed over i6pn between two Functions, and not a Modal Queue + Volume transport: the trainer and the
workers already talk over torch.distributed (ppo_core/run/rollout_worker.py): the weights after each update as sends from
GPU memory (NCCL), the rollouts as small gloo messages, in an order that cannot deadlock and that keeps a worker run
equal to the one-process run. Spanning two containers changes none of that: this file only decides which container
runs which ranks. i6pn (`i6pn=True`, https://modal.com/docs/guide/private-networking) connects the containers
directly, workspace-private, at >= 50 Gbit/s, so the weights of an 8B policy in fp32 (32 GB) cross in seconds. A
Queue carries small items and a Volume files made visible by commit and reload: the weights would go through storage
each iteration (tens of GB written and read per update) and ppo_core would need a second transport beside
torch.distributed, with its own message order and resume logic. The price: the two containers live and die together
(either failing stops the other, and the trainer's retry restarts both), and they must share a region, because i6pn
connects containers only within one.

Why environment variables and not flags: Modal reads `@app.function(gpu=..., region=...)` when this file is imported,
locally and again in each container, before any argument is parsed. So:
    PPO_MODAL_TRAIN_GPU   the trainer container, "TYPE:COUNT" (default H100:8): ranks 0..T-1
    PPO_MODAL_ROLLOUT_GPU the rollout workers' container (default H100:4): ranks T..T+W-1. H100 like the trainer: the
                          same kernels and numerics on both sides, and 80 GB for the policy's copy in the trainer's
                          dtype (fp32 master weights travel as they are: 32 GB for 8B) beside the engine's KV cache and
                          a reward model; an L40S (48 GB, cheaper) fits policies up to about 4B. Four, half the
                          trainer's eight: a worker holds no optimizer, critic or reference model; tune it with the
                          metrics time/trainer_wait_s (the trainer waits: add rollout GPUs) and time/worker_idle_s
                          (the workers wait: fewer)
    PPO_MODAL_REGION      the one region both containers run in (default us-east-1, where Modal's control plane is):
                          a narrow region, so that both land on one cloud's network. Modal charges a multiplier for
                          a pinned region; pick one that has both GPU types
    PPO_MODAL_VOLUME      Volume for models, run directories and checkpoints (default ppo-core, created if missing);
                          the rollout container mounts it read-only: it writes nothing, the trainer owns the run
    PPO_MODAL_SECRET      optional Modal Secret exposed as environment variables in both containers, e.g. HF_TOKEN,
                          or GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to pin the interface the processes connect on
    PPO_MODAL_RETRIES     the trainer's retries after a failure or preemption (default 3); the rollout function is
                          never retried by Modal: a retry of the trainer spawns a fresh one
The image sets them in the container too, so that both sides build the same functions.

Resume, as in scripts/modal_train.py: the local entrypoint fixes the run directory once, /vol/runs/<time> unless
`--out` is given, so a retried trainer container finds the run directory and its checkpoints and the trainer resumes
from the latest one (the workers take the weights and the prompt stream's position from the trainer). To resume by
hand after the retries are spent, run again with `--out /vol/runs/<run>`. Exit status 2 (bad input) is not retried.

Not yet run against a Modal account from this repository (tests/test_modal_roles.py runs both containers' bodies on
one machine, on the CPU). Not verified: that gloo and NCCL find the i6pn interface by themselves (gloo binds to what
the hostname resolves to; if that is not the i6pn address, set GLOO_SOCKET_IFNAME through the Secret).

`modal` is an optional extra: the library never imports it, and the pure functions here (`gpu_count`, `with_run_dir`,
`with_rollout_ranks`, `process_env`, `role_processes`, `run_processes`, `run_trainer`, `run_workers`) import and run
without it.
"""
import os
import shlex
import socket
import subprocess
import sys
import time

try:
    import modal
except ModuleNotFoundError:  # the pure functions below stay importable and testable without Modal
    modal = None

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# scripts/modal_common.py: the same image as scripts/modal_train.py (Modal builds its layers once for both), the same
# paths and port, the same run directory rule
import modal_common  # noqa: E402
from modal_common import MASTER_PORT, VOLUME_PATH, gpu_count, with_run_dir  # noqa: E402

STOP_GRACE_S = 30  # as torchrun: SIGTERM to the processes left, SIGKILL to those still running after this long
POLL_S = 1.0  # how often the processes (and the other container) are looked at

TRAIN_GPU = os.environ.get("PPO_MODAL_TRAIN_GPU", "H100:8")
ROLLOUT_GPU = os.environ.get("PPO_MODAL_ROLLOUT_GPU", "H100:4")
REGION = os.environ.get("PPO_MODAL_REGION", "us-east-1")
VOLUME_NAME = os.environ.get("PPO_MODAL_VOLUME", "ppo-core")
SECRET_NAME = os.environ.get("PPO_MODAL_SECRET", "")
RETRIES = int(os.environ.get("PPO_MODAL_RETRIES", "3"))


# ---------------------------------------------------------------------------- pure functions

def with_rollout_ranks(train_args, workers) -> list[str]:
    """train_args with `--rollout_ranks=workers`: the last `workers` processes of the job are the rollout workers. A
    caller's own --rollout_ranks (either spelling, either form) is kept if it says the same, else ValueError."""
    for i, arg in enumerate(train_args):
        key, has_value, value = arg.partition("=")
        if key[:2] != "--" or key[2:].replace("-", "_") != "rollout_ranks":
            continue
        value = value if has_value else (train_args[i + 1] if i + 1 < len(train_args) else "")
        if value.strip() != str(workers):
            raise ValueError(f"--rollout_ranks={value} conflicts with PPO_MODAL_ROLLOUT_GPU: the rollout workers are "
                             f"the {workers} GPU(s) of their own container here; leave --rollout_ranks out")
        return list(train_args)
    return [*train_args, f"--rollout_ranks={workers}"]


def process_env(rank, local_rank, local_world_size, world_size, master_addr, master_port, host_id) -> dict[str, str]:
    """The variables torchrun would give one process that torch.distributed's env:// and ppo_core read, and NCCL's host
    id: NCCL tells hosts apart by hostname and boot id, which two containers on one machine can share, and would then
    take them for one host and try shared memory between them (Modal's clustered functions set it too:
    modal/_cluster.py, MOD-4067)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(local_world_size), "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
            "NCCL_HOSTID": host_id}


def role_processes(first_rank, gpus, world_size, master_addr, master_port, host_id, train_args) -> list[tuple]:
    """One container's processes, one a GPU: ranks first_rank .. first_rank+gpus-1 of the job, each running the normal
    entry point. -> [(name, argv, env)]."""
    argv = [sys.executable, "-m", "ppo_core.train", *train_args]
    return [(f"rank {first_rank + local}", argv,
             process_env(first_rank + local, local, gpus, world_size, master_addr, master_port, host_id))
            for local in range(gpus)]


def run_processes(commands, others=(), grace_s=STOP_GRACE_S, poll_s=POLL_S) -> int:
    """Start each (name, argv, env) (env added to this process's own) and wait for them, as torchrun does: the first to
    exit non-zero stops the others (SIGTERM, then SIGKILL after grace_s) and its status is returned; 0 when every one
    exits 0. `others`: what else belongs to the job (the other container, RemoteCall), watched the same way; once every
    process started here has exited 0 the job is done, and what is left of them (normally nothing) is stopped. An
    exception here (Modal stopping this container) stops everything too."""
    watched = [(process.name, process) for process in others]
    started = []
    try:
        for name, argv, env in commands:
            started.append((name, subprocess.Popen(argv, env={**os.environ, **env})))
        while True:
            for name, process in started + watched:
                status = process.poll()
                if status not in (None, 0):
                    print(f"{name} exited with status {status}: stopping the job", flush=True)
                    return status
            if all(process.poll() == 0 for _, process in started):
                return 0
            time.sleep(poll_s)
    finally:
        stop([process for _, process in started + watched], grace_s)


def stop(processes, grace_s):
    """SIGTERM each process still running, then SIGKILL those still running after grace_s."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class RemoteCall:
    """The other container's modal.FunctionCall, watched as one more process of the job (poll, wait, terminate, kill as
    subprocess.Popen has them): poll() is None while it runs, then the exit status it returned, 1 if it raised
    (preempted, crashed); terminate() cancels it and stops its container at once, which leaves nothing to wait for."""

    def __init__(self, call, name):
        self.call, self.name, self.returncode = call, name, None

    def poll(self):
        if self.returncode is None:
            try:
                self.returncode = self.call.get(timeout=0)
            except TimeoutError:  # still running (FunctionCall.get raises the builtin one)
                return None
            except Exception as e:
                print(f"{self.name} failed: {e!r}", flush=True)
                self.returncode = 1
        return self.returncode

    def wait(self, timeout=None):
        return self.returncode  # only after terminate() or poll() has seen the end (see stop)

    def terminate(self):
        self.call.cancel(terminate_containers=True)
        self.returncode = -15  # as a process ended by SIGTERM

    kill = terminate


def run_trainer(train_args, trainer_gpus, worker_gpus, address, rollout_function, port=MASTER_PORT) -> int:
    """The trainer container's body: spawn the rollout workers' container (rollout_function.spawn, a modal.Function's:
    it gets this container's address, the port, T and the arguments), then run ranks 0..T-1 here, with the other
    container watched as one more process of the job. Raises on a failure worth retrying (every process and the
    other container stopped first); returns 0, or 2 for bad input."""
    train_args = with_rollout_ranks(train_args, worker_gpus)
    world_size = trainer_gpus + worker_gpus
    commands = role_processes(0, trainer_gpus, world_size, address, port, socket.gethostname() + address, train_args)
    print(f"trainer container at {address}: ranks 0..{trainer_gpus - 1} of {world_size}: {shlex.join(commands[0][1])}",
          flush=True)
    call = rollout_function.spawn(address, port, trainer_gpus, train_args)
    workers = RemoteCall(call, "the rollout workers' container")
    status = run_processes(commands, others=[workers])
    if status not in (0, 2):  # 2 = ppo-train rejected its input: another attempt would too
        raise RuntimeError(f"the job exited with status {status} (the line above names the process)")
    return status


def run_workers(train_args, trainer_ranks, worker_gpus, master_addr, port, address) -> int:
    """The rollout workers' container's body: ranks T..T+W-1 of the job whose rank 0 listens at master_addr:port.
    Returns their exit status, never raises for it: the trainer container decides (and retries with a fresh one)."""
    world_size = trainer_ranks + worker_gpus
    commands = role_processes(trainer_ranks, worker_gpus, world_size, master_addr, port,
                              socket.gethostname() + address, train_args)
    print(f"rollout workers' container at {address}: ranks {trainer_ranks}..{world_size - 1} of {world_size}, "
          f"rank 0 at {master_addr}:{port}", flush=True)
    return run_processes(commands)


def i6pn_address() -> str:
    """This container's address on Modal's private network (a function with i6pn=True)."""
    return socket.getaddrinfo("i6pn.modal.local", None, socket.AF_INET6)[0][4][0]


# ---------------------------------------------------------------------------- the Modal App (needs modal)

TRAIN_GPUS = gpu_count(TRAIN_GPU, "PPO_MODAL_TRAIN_GPU")
ROLLOUT_GPUS = gpu_count(ROLLOUT_GPU, "PPO_MODAL_ROLLOUT_GPU")

if modal is not None:
    app = modal.App("ppo-core-roles")
    # the same settings in the container, so that its import builds the same functions
    image = modal_common.image({"PPO_MODAL_TRAIN_GPU": TRAIN_GPU, "PPO_MODAL_ROLLOUT_GPU": ROLLOUT_GPU,
                                "PPO_MODAL_REGION": REGION, "PPO_MODAL_VOLUME": VOLUME_NAME,
                                "PPO_MODAL_SECRET": SECRET_NAME, "PPO_MODAL_RETRIES": str(RETRIES)})
    volume = modal.Volume.from_name(VOLUME_NAME, create_if_missing=True)
    read_only = modal_common.read_only(volume)
    secrets = [modal.Secret.from_name(SECRET_NAME)] if SECRET_NAME else []

    def rollout(master_addr: str, master_port: int, trainer_ranks: int, train_args: list[str]) -> int:
        """Runs in the rollout workers' container, spawned by the trainer's."""
        return run_workers(train_args, trainer_ranks, ROLLOUT_GPUS, master_addr, master_port, i6pn_address())

    rollout = app.function(
        image=image,
        gpu=ROLLOUT_GPU,
        region=REGION,
        i6pn=True,
        timeout=24 * 60 * 60,
        retries=0,  # a retried worker would wait for a trainer that is gone: the trainer's retry spawns a fresh one
        volumes={VOLUME_PATH: read_only},
        secrets=secrets,
    )(rollout)

    def train(train_args: list[str]) -> int:
        """Runs in the trainer's container: spawns the rollout workers' container, then trains. The Volume commits
        what the run writes in the background and when the container stops, for `modal volume get` and for a retry."""
        return run_trainer(train_args, TRAIN_GPUS, ROLLOUT_GPUS, i6pn_address(), rollout)

    train = app.function(
        image=image,
        gpu=TRAIN_GPU,
        region=REGION,
        i6pn=True,
        timeout=24 * 60 * 60,  # Modal's longest; a preempted or failed attempt is retried and resumes
        retries=modal.Retries(max_retries=RETRIES, initial_delay=0.0, backoff_coefficient=1.0),
        volumes={VOLUME_PATH: volume},
        secrets=secrets,
    )(train)

    @app.local_entrypoint()
    def main(*train_args: str):
        """`modal run scripts/modal_roles.py [ppo-train arguments]`: fixes the run directory, then runs."""
        train_args = with_rollout_ranks(with_run_dir(train_args, time.strftime("%Y%m%d-%H%M%S")), ROLLOUT_GPUS)
        print(f"trainer {TRAIN_GPU} + rollout workers {ROLLOUT_GPU} in {REGION}, Volume {VOLUME_NAME!r}: "
              f"ppo-train {shlex.join(train_args)}")
        status = train.remote(train_args)
        if status:
            sys.exit(status)
