"""What the Modal launchers share: scripts/modal_train.py, scripts/modal_roles.py and scripts/modal_reward.py build one
container image (Modal then builds its layers once for all three), see this repository at the same paths inside it,
and put a run directory on the Volume by the same rule.

Each launcher imports this file from its own folder, locally and again in its containers (the image carries it to
SOURCE_PATH, on the container's PYTHONPATH). `modal` is imported only by `image()`, so the pure parts stay importable
and testable without it.
"""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VOLUME_PATH = "/vol"  # the Volume inside a container: models, run directories, checkpoints
SOURCE_PATH = "/root/src"  # this repository inside a container
MASTER_PORT = 29500
CUDA_IMAGE = "nvidia/cuda:12.8.1-devel-ubuntu22.04"  # -devel: a compiler and the CUDA toolkit for Triton's JIT
TORCH = "torch==2.13.0"
# ppo-core's install_requires (setup.py); the source itself is mounted at container start, not installed
REQUIREMENTS = ["safetensors>=0.4", "tokenizers>=0.19", "numpy>=1.24", "jinja2>=3.1", "tqdm>=4.60"]


def gpu_count(spec: str, variable: str = "PPO_MODAL_GPU") -> int:
    """GPUs in a Modal GPU spec: "H100:8" -> 8, "L40S" -> 1; ValueError naming the environment variable it came from."""
    match = re.fullmatch(r"([A-Za-z0-9-]+!?)(?::(\d+))?", spec)
    if not match or (match.group(2) is not None and not 1 <= int(match.group(2)) <= 8):
        raise ValueError(f"{variable} must look like H100:8, A100-80GB:8 or L40S:4 (1 to 8 GPUs), got {spec!r}")
    return int(match.group(2) or 1)


def with_run_dir(train_args, run_name) -> list[str]:
    """train_args with `--out` on the Volume: the caller's own `--out`, else /vol/runs/<run_name>."""
    if any(arg == "--out" or arg.startswith("--out=") for arg in train_args):
        return list(train_args)
    return [*train_args, f"--out={VOLUME_PATH}/runs/{run_name}"]


def image(settings: dict[str, str]):
    """The container image: CUDA, Python 3.11, torch and ppo-core's requirements; `settings` (the launcher's
    PPO_MODAL_* variables) in the environment, so that the container's import of the launcher builds the same
    functions; and, mounted at container start (no rebuild when the code changes), ppo_core/, kernels/ and configs/
    under the import names setup.py gives, with this file beside them."""
    import modal

    return (
        modal.Image.from_registry(CUDA_IMAGE, add_python="3.11")
        .apt_install("build-essential")
        .pip_install(TORCH, *REQUIREMENTS)
        .env({"PYTHONPATH": SOURCE_PATH, "TOKENIZERS_PARALLELISM": "false", **settings})
        .workdir(SOURCE_PATH)
        .add_local_dir(REPO / "ppo_core", f"{SOURCE_PATH}/ppo_core", ignore=["**/__pycache__"])
        .add_local_dir(REPO / "kernels", f"{SOURCE_PATH}/ppo_kernels", ignore=["**/__pycache__"])
        .add_local_dir(REPO / "configs", f"{SOURCE_PATH}/configs")
        .add_local_file(Path(__file__).resolve(), f"{SOURCE_PATH}/modal_common.py")
    )


def read_only(volume):
    """The Volume mounted read-only (the API's name changed in modal 1.x)."""
    return volume.with_mount_options(read_only=True) if hasattr(volume, "with_mount_options") else volume.read_only()
