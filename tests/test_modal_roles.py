"""scripts/modal_roles.py offline: no network, no Modal credentials, no GPU.

The pure functions (GPU specs, --rollout_ranks, each process's environment and command) are tested with exact values;
the supervisor with real subprocesses; and both containers' bodies together on this machine: the trainer's body and
the rollout workers' body each start their real `python -m ppo_core.train` processes, which run one tiny job with
gloo on the CPU, checked against the same job under plain torchrun. The stand-ins: the rollout container is spawned
as a process group on this machine instead of on Modal (`LocalRolloutFunction`: its FunctionCall's `get` and
`cancel`), and the containers' private addresses are the loopback's. Where the App object is needed, `modal` must be
installed (pytest.importorskip); its resources are read back from private attributes where this modal has them, as
tests/test_modal_launcher.py and tests/test_modal_reward.py do.
"""
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "modal_roles.py")
ENV_KEYS = ("PPO_MODAL_TRAIN_GPU", "PPO_MODAL_ROLLOUT_GPU", "PPO_MODAL_REGION", "PPO_MODAL_VOLUME", "PPO_MODAL_SECRET",
            "PPO_MODAL_RETRIES", "PPO_MODAL_GPU", "PPO_MODAL_NODES")
CONFIGURED = dict(PPO_MODAL_TRAIN_GPU="A100-80GB:2", PPO_MODAL_ROLLOUT_GPU="L40S", PPO_MODAL_REGION="us-west-2",
                  PPO_MODAL_VOLUME="weights", PPO_MODAL_SECRET="hf-token", PPO_MODAL_RETRIES="5")
PYTHON = sys.executable


def load_script(monkeypatch, path=SCRIPT, name="modal_roles_under_test", **env):
    """Import a script as a fresh module, with PPO_MODAL_* set as given (and the others unset)."""
    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def roles(monkeypatch):
    return load_script(monkeypatch)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- settings and pure functions

def test_settings_default(roles):
    assert (roles.TRAIN_GPU, roles.TRAIN_GPUS, roles.ROLLOUT_GPU, roles.ROLLOUT_GPUS) == ("H100:8", 8, "H100:4", 4)
    assert (roles.REGION, roles.VOLUME_NAME, roles.SECRET_NAME, roles.RETRIES) == ("us-east-1", "ppo-core", "", 3)


def test_gpu_specs(roles):
    assert [roles.gpu_count(s, "X") for s in ("H100:8", "A100-80GB:8", "L40S:4", "H100:1", "L40S", "H100!:2")] == [
        8, 8, 4, 1, 1, 2]
    for bad in ("H100:0", "H100:16", "H100:x", "", "H100 8", "L40S:4:1"):
        with pytest.raises(ValueError, match="PPO_MODAL_ROLLOUT_GPU must look like"):
            roles.gpu_count(bad, "PPO_MODAL_ROLLOUT_GPU")


@pytest.mark.parametrize("variable", ["PPO_MODAL_TRAIN_GPU", "PPO_MODAL_ROLLOUT_GPU"])
def test_a_bad_spec_stops_the_import_naming_its_variable(monkeypatch, variable):
    with pytest.raises(ValueError, match=f"{variable} must look like .* got 'H100:9'"):
        load_script(monkeypatch, **{variable: "H100:9"})


def test_the_image_and_the_run_directory_are_modal_train_s(monkeypatch, roles):
    """Both from scripts/modal_common.py: the same image (Modal builds its layers once for both), paths and port, and
    the same run directory rule."""
    single = load_script(monkeypatch, path=os.path.join(ROOT, "scripts", "modal_train.py"), name="modal_train_beside")
    assert roles.modal_common is single.modal_common
    for name in ("VOLUME_PATH", "MASTER_PORT"):
        assert getattr(roles, name) == getattr(single, name), name
    for args in (["--lr=1e-6"], ["--out", "/vol/runs/mine"], ["--out=/vol/runs/mine"]):
        assert roles.with_run_dir(args, "20261202-120000") == single.with_run_dir(args, "20261202-120000")
    assert roles.with_run_dir(["--lr=1e-6"], "20261202-120000") == ["--lr=1e-6", "--out=/vol/runs/20261202-120000"]


def test_rollout_ranks_is_added_or_a_conflicting_one_refused(roles):
    assert roles.with_rollout_ranks(["--lr=1e-6", "--out=/vol/runs/a"], 4) == [
        "--lr=1e-6", "--out=/vol/runs/a", "--rollout_ranks=4"]
    # the caller's own, saying the same, is kept as it is (so adding it twice changes nothing)
    for same in (["--rollout_ranks=4"], ["--rollout_ranks", "4", "--lr=1e-6"], ["--rollout-ranks=4"]):
        assert roles.with_rollout_ranks(same, 4) == same
    assert roles.with_rollout_ranks(roles.with_rollout_ranks([], 4), 4) == ["--rollout_ranks=4"]
    for conflicting, value in ((["--rollout_ranks=1"], "1"), (["--rollout_ranks", "8"], "8"),
                               (["--rollout-ranks=0"], "0"), (["--lr=1", "--rollout_ranks"], "")):
        with pytest.raises(ValueError) as error:
            roles.with_rollout_ranks(conflicting, 4)
        assert str(error.value) == (f"--rollout_ranks={value} conflicts with PPO_MODAL_ROLLOUT_GPU: the rollout "
                                    "workers are the 4 GPU(s) of their own container here; leave --rollout_ranks out")


def test_each_process_environment(roles):
    assert roles.process_env(9, 1, 4, 12, "fdaa:5137::7", 29500, "host-afdaa:5137::9") == {
        "RANK": "9", "LOCAL_RANK": "1", "WORLD_SIZE": "12", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "fdaa:5137::7",
        "MASTER_PORT": "29500", "NCCL_HOSTID": "host-afdaa:5137::9"}


def test_the_two_containers_processes_8_trainers_and_4_workers(roles):
    """The trainer container holds ranks 0..7 (LOCAL_RANK 0..7), the workers' container ranks 8..11 (LOCAL_RANK 0..3,
    its own GPUs); every process runs the normal entry point with the same arguments and rank 0's address."""
    args = ["--policy", "/vol/models/Qwen3-8B", "--out=/vol/runs/r", "--rollout_ranks=4"]
    argv = [PYTHON, "-m", "ppo_core.train", *args]
    trainer = roles.role_processes(0, 8, 12, "fdaa::a", 29500, "host-afdaa::a", args)
    workers = roles.role_processes(8, 4, 12, "fdaa::a", 29500, "host-bfdaa::b", args)

    def env(rank, local, local_size, host):
        return {"RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": "12", "LOCAL_WORLD_SIZE": str(local_size),
                "MASTER_ADDR": "fdaa::a", "MASTER_PORT": "29500", "NCCL_HOSTID": host}

    assert trainer == [(f"rank {r}", argv, env(r, r, 8, "host-afdaa::a")) for r in range(8)]
    assert workers == [(f"rank {8 + r}", argv, env(8 + r, r, 4, "host-bfdaa::b")) for r in range(4)]
    assert workers[0] == ("rank 8", argv, {"RANK": "8", "LOCAL_RANK": "0", "WORLD_SIZE": "12", "LOCAL_WORLD_SIZE": "4",
                                           "MASTER_ADDR": "fdaa::a", "MASTER_PORT": "29500",
                                           "NCCL_HOSTID": "host-bfdaa::b"})


def test_the_pure_functions_import_without_modal(monkeypatch):
    monkeypatch.setitem(sys.modules, "modal", None)  # `import modal` now fails as if it were not installed
    module = load_script(monkeypatch)
    assert module.modal is None and not hasattr(module, "app")
    assert module.with_rollout_ranks([], 1) == ["--rollout_ranks=1"]
    assert module.role_processes(1, 1, 2, "::1", 1234, "h", [])[0][2]["RANK"] == "1"


# ---------------------------------------------------------------------------- the supervisor, with real processes

def python_c(code):
    return [PYTHON, "-c", code]


def test_every_process_succeeding_returns_0_and_each_sees_its_environment(roles, tmp_path):
    write_rank = ("import os, pathlib, time; time.sleep(0.1 * int(os.environ['RANK'])); "
                  f"pathlib.Path(r'{tmp_path}', os.environ['RANK']).write_text(os.environ['MASTER_ADDR'])")
    commands = [(f"rank {r}", python_c(write_rank), {"RANK": str(r), "MASTER_ADDR": "::1"}) for r in range(3)]
    assert roles.run_processes(commands, poll_s=0.05) == 0
    assert sorted(os.listdir(tmp_path)) == ["0", "1", "2"]
    assert all((tmp_path / r).read_text() == "::1" for r in "012")


def test_a_failing_process_stops_the_others_and_its_status_is_returned(roles, tmp_path, capsys):
    """Like torchrun: rank 1 exits with 3; rank 0 (which would sleep a minute) gets SIGTERM, and rank 2, which ignores
    SIGTERM, gets SIGKILL after the grace period. Nothing is left running."""
    on_sigterm = f"""
import os, pathlib, signal, sys, time
pathlib.Path(r'{tmp_path}', 'pid0').write_text(str(os.getpid()))
def stop(*_):
    pathlib.Path(r'{tmp_path}', 'terminated').touch()
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
time.sleep(60)
"""
    deaf = f"""
import os, pathlib, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
pathlib.Path(r'{tmp_path}', 'pid2').write_text(str(os.getpid()))
time.sleep(60)
"""
    fails = "import time; time.sleep(1.0); raise SystemExit(3)"
    commands = [("rank 0", python_c(on_sigterm), {}), ("rank 1", python_c(fails), {}), ("rank 2", python_c(deaf), {})]
    start = time.monotonic()
    assert roles.run_processes(commands, grace_s=1.0, poll_s=0.05) == 3
    assert time.monotonic() - start < 15
    assert (tmp_path / "terminated").exists()
    for pid in ((tmp_path / "pid0").read_text(), (tmp_path / "pid2").read_text()):
        assert not os.path.exists(f"/proc/{pid}")  # ended and reaped
    assert "rank 1 exited with status 3: stopping the job" in capsys.readouterr().out


class FakeCall:
    """Test double for a modal.FunctionCall: running for `polls` looks (get raises TimeoutError), then it returns
    `result` or raises it; records cancel()."""

    def __init__(self, polls, result):
        self.polls, self.result, self.cancelled = polls, result, []

    def get(self, timeout=None):
        assert timeout == 0
        if self.polls > 0:
            self.polls -= 1
            raise TimeoutError
        if isinstance(self.result, Exception):
            raise self.result
        return self.result

    def cancel(self, terminate_containers=False):
        self.cancelled.append(terminate_containers)


def test_the_other_container_finishing_first_leaves_the_processes_running(roles, tmp_path):
    """The rollout workers end when they have sent the last rollout; the trainer then still updates and saves."""
    call = FakeCall(polls=1, result=0)
    finish = f"import time, pathlib; time.sleep(1.0); pathlib.Path(r'{tmp_path}', 'done').touch()"
    remote = roles.RemoteCall(call, "the rollout workers' container")
    assert roles.run_processes([("rank 0", python_c(finish), {})], others=[remote], poll_s=0.05) == 0
    assert (tmp_path / "done").exists() and call.cancelled == []


@pytest.mark.parametrize("result, status", [(RuntimeError("preempted"), 1), (2, 2), (143, 143)])
def test_the_other_container_failing_stops_the_processes(roles, result, status, capsys):
    call = FakeCall(polls=2, result=result)
    remote = roles.RemoteCall(call, "the rollout workers' container")
    start = time.monotonic()
    assert roles.run_processes([("rank 0", python_c("import time; time.sleep(60)"), {})], others=[remote],
                               poll_s=0.05) == status
    assert time.monotonic() - start < 15 and call.cancelled == []  # it ended by itself: nothing to cancel
    out = capsys.readouterr().out
    assert f"the rollout workers' container exited with status {status}: stopping the job" in out
    if status == 1:
        assert "the rollout workers' container failed: RuntimeError('preempted')" in out


def test_the_job_is_done_when_every_process_here_succeeded(roles):
    """The trainer's processes all exited 0 (the run is saved): a workers' container still running is stopped."""
    call = FakeCall(polls=10**6, result=0)
    remote = roles.RemoteCall(call, "the rollout workers' container")
    assert roles.run_processes([("rank 0", python_c("pass"), {})], others=[remote], poll_s=0.05) == 0
    assert call.cancelled == [True]


def test_a_failing_process_cancels_the_other_container(roles):
    call = FakeCall(polls=10**6, result=0)
    remote = roles.RemoteCall(call, "the rollout workers' container")
    assert roles.run_processes([("rank 0", python_c("raise SystemExit(1)"), {})], others=[remote], poll_s=0.05) == 1
    assert call.cancelled == [True] and remote.returncode == -15  # its container stopped at once


# ---------------------------------------------------------------------------- both containers' bodies, real processes

ARGS = ["--rollout_batch_size=16", "--minibatch_size=8", "--micro_batch_size=4", "--ppo_epochs=1", "--eval_size=8",
        "--progress=false", "--save_every=1", "--dtype=float32", "--iterations=2"]  # as tests/test_distributed.py
WALL_CLOCK = ("time/", "tokens_per_s")

# The rollout workers' container, on this machine: a process (group) that imports the script and runs its worker body.
WORKER_CONTAINER = r'''
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("modal_roles", sys.argv[1])
roles = importlib.util.module_from_spec(spec)
spec.loader.exec_module(roles)
sys.exit(roles.run_workers(**json.loads(sys.argv[2])))
'''


class LocalContainerCall:
    """Test double for the FunctionCall of a spawned container: get(timeout) and cancel() over a local process group."""

    def __init__(self, process):
        self.process = process

    def get(self, timeout=None):
        try:
            status = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError from None
        if status < 0:  # killed: a Modal call would raise
            raise RuntimeError(f"container killed by signal {-status}")
        return status

    def cancel(self, terminate_containers=False):
        os.killpg(self.process.pid, signal.SIGKILL)


class LocalRolloutFunction:
    """Test double for the rollout modal.Function: spawn() runs the workers' body in a new process group here, with
    its own private address the loopback's, as Modal would run `rollout` in its own container."""

    def __init__(self, workers, address, cwd):
        self.workers, self.address, self.cwd, self.spawned, self.containers = workers, address, cwd, [], []

    def spawn(self, master_addr, master_port, trainer_ranks, train_args):
        body = dict(train_args=train_args, trainer_ranks=trainer_ranks, worker_gpus=self.workers,
                    master_addr=master_addr, port=master_port, address=self.address)
        self.spawned.append(body)
        self.containers.append(subprocess.Popen([PYTHON, "-c", WORKER_CONTAINER, SCRIPT, json.dumps(body)],
                                                cwd=self.cwd, start_new_session=True))
        return LocalContainerCall(self.containers[-1])


def loopback():
    """The IPv6 loopback where this machine has one: rank 0's address is an IPv6 literal on i6pn."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return "::1"
    except OSError:
        return "127.0.0.1"


def weights(run_dir, step):
    return load_file(str(run_dir / "checkpoints" / f"step-{step}" / "model.safetensors"))


def metrics(run_dir):
    with open(run_dir / "metrics.jsonl") as f:
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(WALL_CLOCK)} for line in f]


def test_both_containers_run_one_real_job_equal_to_torchrun(roles, tmp_path, monkeypatch):
    """The trainer's body and the rollout workers' body, each starting its real `python -m ppo_core.train` process:
    rank 0 trains, rank 1 samples (gloo between them, rank 0 at an IPv6 address), and the run equals the same job
    under `torchrun --nproc-per-node=2` byte for byte: the final weights and every metric but the wall-clock ones."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    (tmp_path / "workers").mkdir()
    address = loopback()
    rollout = LocalRolloutFunction(workers=1, address=address, cwd=tmp_path / "workers")
    port = free_port()
    start = time.monotonic()
    status = roles.run_trainer([*ARGS, f"--out={tmp_path / 'roles'}"], 1, 1, address, rollout, port=port)
    seconds = time.monotonic() - start
    assert status == 0
    assert rollout.spawned == [dict(train_args=[*ARGS, f"--out={tmp_path / 'roles'}", "--rollout_ranks=1"],
                                    trainer_ranks=1, worker_gpus=1, master_addr=address, port=port, address=address)]
    torchrun = subprocess.run([PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                               "-m", "ppo_core.train", *ARGS, "--rollout_ranks=1", f"--out={tmp_path / 'torchrun'}"],
                              capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert torchrun.returncode == 0, torchrun.stderr[-3000:]

    run = tmp_path / "roles"
    assert (run / "summary.json").exists() and json.loads((run / "summary.json").read_text())["iterations"] == 2
    assert len(metrics(run)) == 2
    assert "time/trainer_wait_s" in json.loads((run / "metrics.jsonl").read_text().splitlines()[0])  # a worker's run
    assert metrics(run) == metrics(tmp_path / "torchrun")
    a, b = weights(run, 2), weights(tmp_path / "torchrun", 2)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert os.listdir(tmp_path / "workers") == []  # the workers' container writes nothing
    assert seconds < 120


def test_a_failed_rollout_container_stops_the_trainer_and_raises_for_a_retry(roles, tmp_path, capsys):
    """The workers' container dies (preempted) while rank 0 waits for it in the rendezvous: the trainer's real process
    is stopped at once (not after torch.distributed's 30-minute timeout) and the body raises, so Modal retries."""
    class DyingRolloutFunction:
        def spawn(self, *args):
            return FakeCall(polls=2, result=RuntimeError("preempted"))

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="the job exited with status 1"):
        roles.run_trainer([*ARGS, f"--out={tmp_path / 'run'}"], 1, 1, "127.0.0.1", DyingRolloutFunction(),
                          port=free_port())
    assert time.monotonic() - start < 60
    assert "the rollout workers' container failed: RuntimeError('preempted')" in capsys.readouterr().out


def test_bad_input_stops_both_containers_and_is_not_retried(roles, tmp_path, capsys):
    """ppo-train rejects the arguments (exit status 2) in both containers, whichever reports first: the body returns 2
    rather than raising, so Modal does not retry, and nothing is left running."""
    rollout = LocalRolloutFunction(workers=1, address="127.0.0.1", cwd=tmp_path)
    status = roles.run_trainer(["--no_such_key=1", f"--out={tmp_path / 'run'}"], 1, 1, "127.0.0.1", rollout,
                               port=free_port())
    assert status == 2 and not (tmp_path / "run").exists()
    [container] = rollout.containers
    assert container.wait(timeout=30) in (2, -signal.SIGKILL)  # ended by itself, or cancelled: its container killed
    out = capsys.readouterr().out
    assert ("rank 0 exited with status 2: stopping the job" in out
            or "the rollout workers' container exited with status 2: stopping the job" in out)


# ---------------------------------------------------------------------------- the App (needs modal)

def function_settings(function):
    """The settings Modal will deploy a Function with, as its loader holds them (private: {} where this modal
    keeps them elsewhere)."""
    raw = next((getattr(function, a) for a in dir(function) if a.startswith("_sync_original")), None)
    load = getattr(raw, "_load", None)
    if load is None or not load.__closure__:
        return {}
    return dict(zip(load.__code__.co_freevars, (cell.cell_contents for cell in load.__closure__)))


@pytest.fixture
def no_credentials(monkeypatch):
    monkeypatch.setenv("HOME", "/nonexistent")  # no ~/.modal.toml: no credentials to find
    for key in ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET"):
        monkeypatch.delenv(key, raising=False)


@pytest.mark.parametrize("env", [{}, CONFIGURED], ids=["default", "configured"])
def test_the_app_defines_without_network_with_a_gpu_type_per_role(monkeypatch, no_credentials, env):
    modal = pytest.importorskip("modal")
    module = load_script(monkeypatch, **env)
    assert isinstance(module.app, modal.App) and module.app.name == "ppo-core-roles"
    assert isinstance(module.train, modal.Function) and isinstance(module.rollout, modal.Function)
    expected = {"train": (env.get("PPO_MODAL_TRAIN_GPU", "H100:8"), False, int(env.get("PPO_MODAL_RETRIES", "3"))),
                "rollout": (env.get("PPO_MODAL_ROLLOUT_GPU", "H100:4"), True, 0)}
    for name, (gpu, read_only, retries) in expected.items():
        function = getattr(module, name)
        spec = getattr(function, "_spec_", None)  # private, so only checked where this modal has it
        if spec is not None:
            assert spec.gpus == gpu and list(spec.volumes) == ["/vol"], name
            assert list(spec.scheduler_placement.regions) == [env.get("PPO_MODAL_REGION", "us-east-1")], name
            mount_options = getattr(spec.volumes["/vol"], "_mount_options", None)
            assert bool(mount_options and mount_options.read_only) == read_only, name
            assert [repr(s) for s in spec.secrets] == (["modal.Secret.from_name('hf-token')"] if env else []), name
        settings = function_settings(function)
        if settings:
            assert settings["i6pn_enabled"] is True, name
            assert settings["retry_policy"].retries == retries and settings["timeout"] == 24 * 60 * 60, name


def test_the_modal_functions_hand_their_settings_to_the_bodies(monkeypatch, no_credentials):
    """The Modal functions themselves, run locally (`Function.local`), with recorders in place of the bodies and
    fixed private addresses: the trainer's gets its GPU counts, its address and the rollout Function to spawn; the
    rollout's gets what the trainer passed, its GPU count and its own address."""
    pytest.importorskip("modal")
    module = load_script(monkeypatch, PPO_MODAL_TRAIN_GPU="H200:8", PPO_MODAL_ROLLOUT_GPU="L40S:4")
    calls = []
    monkeypatch.setattr(module, "run_trainer", lambda *args: calls.append(("trainer", *args)) or 0)
    monkeypatch.setattr(module, "run_workers", lambda *args: calls.append(("workers", *args)) or 0)
    addresses = iter(["fdaa:1::a", "fdaa:1::b"])  # the trainer's container, then the workers'
    monkeypatch.setattr(module, "i6pn_address", lambda: next(addresses))
    args = ["--out=/vol/runs/r", "--rollout_ranks=4"]
    with pytest.warns(UserWarning, match="executing locally"):  # Modal: no Volume when run locally
        assert module.train.local(args) == 0
        assert module.rollout.local("fdaa:1::a", 29500, 8, args) == 0
    assert calls == [("trainer", args, 8, 4, "fdaa:1::a", module.rollout),
                     ("workers", args, 8, 4, "fdaa:1::a", 29500, "fdaa:1::b")]


def test_the_local_entrypoint_fixes_the_run_directory_and_the_rollout_ranks(monkeypatch, no_credentials):
    pytest.importorskip("modal")
    module = load_script(monkeypatch, PPO_MODAL_ROLLOUT_GPU="H100:2")
    entrypoint = getattr(getattr(module.main, "info", None), "raw_f", None)  # private, so only where this modal has it
    if entrypoint is None:
        pytest.skip("this modal keeps a local entrypoint's function elsewhere")
    sent = []

    class RecordingTrain:
        @staticmethod
        def remote(train_args):
            sent.append(train_args)
            return 0

    monkeypatch.setattr(module, "train", RecordingTrain)
    entrypoint("--policy", "/vol/models/Qwen3-4B")
    [train_args] = sent
    assert train_args[:2] == ["--policy", "/vol/models/Qwen3-4B"] and train_args[3] == "--rollout_ranks=2"
    assert train_args[2].startswith("--out=/vol/runs/2") and len(train_args) == 4
    with pytest.raises(ValueError, match="--rollout_ranks=1 conflicts with PPO_MODAL_ROLLOUT_GPU"):
        entrypoint("--rollout_ranks=1")  # refused here, before any container starts
    assert len(sent) == 1
