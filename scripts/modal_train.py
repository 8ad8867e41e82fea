"""Run ppo-train on Modal GPUs: torchrun on one node, or on a Modal cluster of nodes. Nothing else.

    pip install -e ".[modal]" && modal setup                         # once: the client and a token
    modal volume put ppo-core ./Qwen3-4B /models/Qwen3-4B            # weights onto the Volume (once)
    modal run scripts/modal_train.py                                 # the default job, 8 x H100
    PPO_MODAL_GPU=H100:1 modal run scripts/modal_train.py --policy /vol/models/Qwen3-4B --iterations 200
    PPO_MODAL_GPU=A100-80GB:8 modal run scripts/modal_train.py --config configs/default.toml --lr 1e-6
    PPO_MODAL_NODES=2 modal run scripts/modal_train.py --policy /vol/models/Qwen3-8B      # 2 nodes x 8 GPUs
    modal volume get ppo-core runs/<run> ./<run>                     # the run directory back
    modal run scripts/modal_train.py --reward_url https://<workspace>--ppo-core-reward-serve.modal.run   # see below

Every argument after the script path goes to `python -m ppo_core.train` unchanged (paths are inside the
container: the Volume is at /vol, this repository's configs/ at /root/src/configs).

A reward model on its own GPU: deploy it with scripts/modal_reward.py (its own GPU type and autoscaling), then
pass the URL it prints as `--reward_url` (several URLs, or the same one repeated, comma-separated); like every
argument it reaches the trainer unchanged, and the reward model then takes no memory on the training GPUs.

Why environment variables and not flags: Modal reads `@app.function(gpu=...)` and `@modal.clustered(size=...)`
when this file is imported, locally and again in the container, before any argument is parsed. So the GPU spec
and node count come from the environment, and the function is built with `app.function(...)(train)` below:
    PPO_MODAL_GPU     GPU spec, "TYPE:COUNT": H100:8 (default), A100-80GB:8, H200:8, H100:1, ...
    PPO_MODAL_NODES   nodes (default 1); > 1 runs a modal.clustered function, which needs all 8 GPUs per node
    PPO_MODAL_VOLUME  Volume for models, run directories and checkpoints (default ppo-core, created if missing)
    PPO_MODAL_SECRET  optional Modal Secret exposed as environment variables, e.g. one holding HF_TOKEN
    PPO_MODAL_RETRIES retries after a failure or preemption (default 3)
The image sets them in the container too, so that both sides build the same function.

Resume: the local entrypoint fixes the run directory once, /vol/runs/<time> unless `--out` is given, and the
function always passes that same `--out`; a retried container (preemption, crash) therefore finds the run
directory and its checkpoints, and the trainer resumes from the latest one. To resume by hand after the
retries are spent, run again with `--out /vol/runs/<run>`. ppo-train's exit status 2 (bad input) is not retried.

Secrets reach the trainer only as environment variables; nothing here prints the environment.
`modal` is an optional extra: the library never imports it, and the pure functions here (`gpu_count`,
`torchrun_args`, `with_run_dir`, `launch`) import and run without it.
"""
import os
import shlex
import subprocess
import sys
import time

try:
    import modal
except ModuleNotFoundError:  # the pure functions below stay importable and testable without Modal
    modal = None

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import modal_common  # noqa: E402  (scripts/modal_common.py: the image, the paths, the run directory rule)
from modal_common import MASTER_PORT, VOLUME_PATH, gpu_count, with_run_dir  # noqa: E402

GPU = os.environ.get("PPO_MODAL_GPU", "H100:8")
NODES = int(os.environ.get("PPO_MODAL_NODES", "1"))
VOLUME_NAME = os.environ.get("PPO_MODAL_VOLUME", "ppo-core")
SECRET_NAME = os.environ.get("PPO_MODAL_SECRET", "")
RETRIES = int(os.environ.get("PPO_MODAL_RETRIES", "3"))


# ---------------------------------------------------------------------------- pure functions

def torchrun_args(nodes, gpus_per_node, node_rank, master_addr, train_args, master_port=MASTER_PORT) -> list[str]:
    """The torchrun command for this node: the normal entry point, `python -m ppo_core.train`, on every GPU."""
    if nodes == 1:
        launcher = ["--standalone", f"--nproc-per-node={gpus_per_node}"]
    else:  # static rendezvous at rank 0's container
        launcher = [f"--nnodes={nodes}", f"--nproc-per-node={gpus_per_node}", f"--node-rank={node_rank}",
                    f"--master-addr={master_addr}", f"--master-port={master_port}"]
    return ["torchrun", *launcher, "-m", "ppo_core.train", *train_args]


def launch(train_args, nodes, gpus_per_node, discover_cluster, run_command) -> int:
    """The body of the Modal function: find this node's place, build the torchrun command, run it.

    discover_cluster() -> (node rank, rank 0's address), called only on more than one node;
    run_command(argv) -> exit status. Raises on a failure worth retrying; returns 0, or 2 for bad input."""
    node_rank, master_addr = discover_cluster() if nodes > 1 else (0, "")
    argv = torchrun_args(nodes, gpus_per_node, node_rank, master_addr, train_args)
    print(f"node {node_rank}/{nodes}: {shlex.join(argv)}", flush=True)
    status = run_command(argv)
    if status not in (0, 2):  # 2 = ppo-train rejected its input: another attempt would too
        raise RuntimeError(f"ppo-train exited with status {status} on node {node_rank}")
    return status


def modal_cluster():
    """(node rank, rank 0's address) from inside a modal.clustered function."""
    if hasattr(modal, "Cluster"):  # modal >= 1.6
        cluster = modal.Cluster.from_context()
        return cluster.container_rank(), cluster.container_ips()[0]
    info = modal.experimental.get_cluster_info()
    return info.rank, info.container_ips[0]


def run_subprocess(argv) -> int:
    return subprocess.run(argv, check=False).returncode


# ---------------------------------------------------------------------------- the Modal App (needs modal)

GPUS_PER_NODE = gpu_count(GPU, "PPO_MODAL_GPU")
if NODES < 1 or (NODES > 1 and GPUS_PER_NODE != 8):
    raise ValueError(f"PPO_MODAL_NODES={NODES} with PPO_MODAL_GPU={GPU}: a cluster node takes all 8 GPUs of its host")

if modal is not None:
    app = modal.App("ppo-core")
    # the same settings in the container, so that its import builds the same function
    image = modal_common.image({"PPO_MODAL_GPU": GPU, "PPO_MODAL_NODES": str(NODES), "PPO_MODAL_VOLUME": VOLUME_NAME,
                                "PPO_MODAL_SECRET": SECRET_NAME, "PPO_MODAL_RETRIES": str(RETRIES)})
    volume = modal.Volume.from_name(VOLUME_NAME, create_if_missing=True)

    def train(train_args: list[str]) -> int:
        """Runs in each container: torchrun over its GPUs. The Volume commits what the run writes in the
        background and when the container stops, for `modal volume get` and for a retry."""
        return launch(train_args, NODES, GPUS_PER_NODE, modal_cluster, run_subprocess)

    if NODES > 1:
        clustered = getattr(modal, "clustered", None) or modal.experimental.clustered
        train = clustered(size=NODES, rdma=True)(train)
    train = app.function(
        image=image,
        gpu=GPU,
        timeout=24 * 60 * 60,  # Modal's longest; a preempted or failed attempt is retried and resumes
        retries=modal.Retries(max_retries=RETRIES, initial_delay=0.0, backoff_coefficient=1.0),
        volumes={VOLUME_PATH: volume},
        secrets=[modal.Secret.from_name(SECRET_NAME)] if SECRET_NAME else [],
    )(train)

    @app.local_entrypoint()
    def main(*train_args: str):
        """`modal run scripts/modal_train.py [ppo-train arguments]`: fixes the run directory, then runs."""
        train_args = with_run_dir(train_args, time.strftime("%Y%m%d-%H%M%S"))
        print(f"{NODES} node(s) x {GPU}, Volume {VOLUME_NAME!r}: ppo-train {shlex.join(train_args)}")
        status = train.remote(train_args)
        if status:
            sys.exit(status)
