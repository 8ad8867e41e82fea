"""scripts/modal_train.py offline: no network, no Modal credentials, no GPU.

The pure functions (GPU spec, torchrun argument lists, the run directory, the launch body) are tested without
Modal. Where the App object is needed, `modal` must be installed (pytest.importorskip). The one place with
stand-ins is the launch itself: there is no Modal cluster or GPU here, so cluster discovery and the subprocess
runner are replaced by two minimal test doubles — one returns a fixed (node rank, address), the other records
the command it was given and returns an exit status.
"""
import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "modal_train.py")
ENV_KEYS = ("PPO_MODAL_GPU", "PPO_MODAL_NODES", "PPO_MODAL_VOLUME", "PPO_MODAL_SECRET", "PPO_MODAL_RETRIES")


def load_launcher(monkeypatch, **env):
    """Import the script as a fresh module, with PPO_MODAL_* set as given (and the others unset)."""
    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    spec = importlib.util.spec_from_file_location("modal_train_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def launcher(monkeypatch):
    return load_launcher(monkeypatch)


def test_gpu_spec(launcher):
    assert launcher.GPU == "H100:8" and launcher.GPUS_PER_NODE == 8  # the default
    assert [launcher.gpu_count(s) for s in ("H100:8", "A100-80GB:8", "H200:8", "H100:1", "H100")] == [8, 8, 8, 1, 1]
    for bad in ("H100:0", "H100:16", "H100:x", "", "H100 8"):
        with pytest.raises(ValueError, match="PPO_MODAL_GPU"):
            launcher.gpu_count(bad)


def test_torchrun_args_one_node_eight_gpus(launcher):
    assert launcher.torchrun_args(1, 8, 0, "", ["--iterations=100", "--out=/vol/runs/a"]) == [
        "torchrun", "--standalone", "--nproc-per-node=8",
        "-m", "ppo_core.train", "--iterations=100", "--out=/vol/runs/a",
    ]


def test_torchrun_args_two_nodes_eight_gpus(launcher):
    train_args = ["--policy", "/vol/models/Qwen3-8B", "--out=/vol/runs/b"]
    for node_rank in (0, 1):
        assert launcher.torchrun_args(2, 8, node_rank, "fdaa:0:1::2", train_args) == [
            "torchrun", "--nnodes=2", "--nproc-per-node=8", f"--node-rank={node_rank}",
            "--master-addr=fdaa:0:1::2", "--master-port=29500",
            "-m", "ppo_core.train", "--policy", "/vol/models/Qwen3-8B", "--out=/vol/runs/b",
        ]


def test_the_run_directory_is_on_the_volume_and_fixed(launcher):
    assert launcher.with_run_dir(["--lr=1e-6"], "20261202-120000") == ["--lr=1e-6", "--out=/vol/runs/20261202-120000"]
    # the caller's own --out, in either form, is kept as is
    assert launcher.with_run_dir(["--out", "/vol/runs/mine"], "x") == ["--out", "/vol/runs/mine"]
    assert launcher.with_run_dir(["--out=/vol/runs/mine"], "x") == ["--out=/vol/runs/mine"]


class RecordingRunner:
    """Test double for the subprocess runner: records each command, returns a fixed exit status."""

    def __init__(self, status=0):
        self.status, self.commands = status, []

    def __call__(self, argv):
        self.commands.append(list(argv))
        return self.status


def no_cluster():
    raise AssertionError("a single node must not ask for cluster information")


def test_launch_one_node_runs_torchrun_standalone(launcher):
    runner = RecordingRunner()
    assert launcher.launch(["--out=/vol/runs/a"], 1, 8, no_cluster, runner) == 0
    assert runner.commands == [["torchrun", "--standalone", "--nproc-per-node=8", "-m", "ppo_core.train",
                                "--out=/vol/runs/a"]]


def test_launch_two_nodes_takes_rank_and_address_from_the_cluster(launcher):
    runner = RecordingRunner()
    assert launcher.launch(["--out=/vol/runs/b"], 2, 8, lambda: (1, "fdaa::7"), runner) == 0
    assert runner.commands == [["torchrun", "--nnodes=2", "--nproc-per-node=8", "--node-rank=1",
                                "--master-addr=fdaa::7", "--master-port=29500", "-m", "ppo_core.train",
                                "--out=/vol/runs/b"]]


def test_launch_failures_raise_for_a_retry_but_bad_input_does_not(launcher):
    with pytest.raises(RuntimeError, match="status 1"):  # Modal retries a raised attempt
        launcher.launch([], 1, 8, no_cluster, RecordingRunner(status=1))
    assert launcher.launch([], 1, 8, no_cluster, RecordingRunner(status=2)) == 2  # ppo-train's bad input


def test_the_pure_functions_import_without_modal(monkeypatch):
    monkeypatch.setitem(sys.modules, "modal", None)  # `import modal` now fails as if it were not installed
    module = load_launcher(monkeypatch)
    assert module.modal is None and not hasattr(module, "app")
    assert module.torchrun_args(1, 8, 0, "", []) == ["torchrun", "--standalone", "--nproc-per-node=8", "-m", "ppo_core.train"]


def test_multi_node_needs_whole_nodes(monkeypatch):
    with pytest.raises(ValueError, match="all 8 GPUs"):
        load_launcher(monkeypatch, PPO_MODAL_NODES="2", PPO_MODAL_GPU="H100:4")


# ---------------------------------------------------------------------------- the App (needs modal)

def test_the_app_defines_without_network(monkeypatch):
    modal = pytest.importorskip("modal")
    monkeypatch.setenv("HOME", "/nonexistent")  # no ~/.modal.toml: no credentials to find
    for key in ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET"):
        monkeypatch.delenv(key, raising=False)
    module = load_launcher(monkeypatch, PPO_MODAL_GPU="A100-80GB:8")
    assert isinstance(module.app, modal.App) and module.app.name == "ppo-core"
    assert isinstance(module.train, modal.Function)
    assert module.GPU == "A100-80GB:8" and module.GPUS_PER_NODE == 8
    spec = getattr(module.train, "_spec_", None)  # private, so only checked where this modal has it
    if spec is not None:
        assert spec.gpus == "A100-80GB:8" and list(spec.volumes) == ["/vol"]


@pytest.mark.parametrize("nodes, cluster, expected", [
    ("1", None, ["torchrun", "--standalone", "--nproc-per-node=8", "-m", "ppo_core.train", "--iterations=5",
                 "--out=/vol/runs/r"]),
    ("2", (0, "fdaa::1"), ["torchrun", "--nnodes=2", "--nproc-per-node=8", "--node-rank=0", "--master-addr=fdaa::1",
                           "--master-port=29500", "-m", "ppo_core.train", "--iterations=5", "--out=/vol/runs/r"]),
])
def test_the_modal_function_body_hands_the_arguments_to_torchrun(monkeypatch, nodes, cluster, expected):
    """The Modal function itself, run locally (`Function.local`), with the two doubles in place of the cluster
    lookup and the subprocess; with PPO_MODAL_NODES=2 it is the clustered function."""
    pytest.importorskip("modal")
    module = load_launcher(monkeypatch, PPO_MODAL_NODES=nodes, PPO_MODAL_GPU="H200:8")
    runner = RecordingRunner()
    monkeypatch.setattr(module, "run_subprocess", runner)
    monkeypatch.setattr(module, "modal_cluster", (lambda: cluster) if cluster else no_cluster)
    with pytest.warns(UserWarning, match="executing locally"):  # Modal: no Volume when run locally
        assert module.train.local(["--iterations=5", "--out=/vol/runs/r"]) == 0
    assert runner.commands == [expected]
