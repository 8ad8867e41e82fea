"""scripts/modal_reward.py offline: no network, no Modal credentials, no GPU.

The settings read from the environment, the served command line and the start-up wait are tested without Modal;
the wait and the served command run real subprocesses (the real reward server on 127.0.0.1 among them). Where the
App object is needed, `modal` must be installed (pytest.importorskip); its resources are read back from the
Function object (private attributes, checked where this modal has them, as tests/test_modal_launcher.py does).
The one stand-in: the Modal function body run locally records what it would start instead of starting a server
on port 8000 of this machine.
"""
import ast
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "modal_reward.py")
ENV_KEYS = ("PPO_MODAL_REWARD_GPU", "PPO_MODAL_REWARD_ARGS", "PPO_MODAL_REWARD_MIN_CONTAINERS",
            "PPO_MODAL_REWARD_MAX_CONTAINERS", "PPO_MODAL_REWARD_CONCURRENCY", "PPO_MODAL_REWARD_SCALEDOWN_S",
            "PPO_MODAL_REWARD_PROXY_AUTH", "PPO_MODAL_REWARD_APP", "PPO_MODAL_VOLUME", "PPO_MODAL_SECRET")
CONFIGURED = dict(PPO_MODAL_REWARD_GPU="L4", PPO_MODAL_REWARD_ARGS="--judge '/vol/models/CE RM 4B' --dtype=bfloat16",
                  PPO_MODAL_REWARD_MIN_CONTAINERS="1", PPO_MODAL_REWARD_MAX_CONTAINERS="3",
                  PPO_MODAL_REWARD_CONCURRENCY="16", PPO_MODAL_REWARD_SCALEDOWN_S="120",
                  PPO_MODAL_REWARD_PROXY_AUTH="1", PPO_MODAL_REWARD_APP="ppo-core-judge",
                  PPO_MODAL_VOLUME="weights", PPO_MODAL_SECRET="hf-token")


def load_script(monkeypatch, path=SCRIPT, name="modal_reward_under_test", **env):
    """Import a script as a fresh module, with PPO_MODAL_* set as given (and the others unset)."""
    for key in ENV_KEYS + ("PPO_MODAL_GPU", "PPO_MODAL_NODES", "PPO_MODAL_RETRIES"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- settings and command line

def test_settings_default(monkeypatch):
    module = load_script(monkeypatch)
    assert (module.GPU, module.REWARD_ARGS, module.MIN_CONTAINERS, module.MAX_CONTAINERS, module.CONCURRENCY,
            module.SCALEDOWN_S, module.PROXY_AUTH) == ("A100-80GB", [], 0, 4, 8, 600, False)
    assert (module.APP_NAME, module.VOLUME_NAME, module.SECRET_NAME) == ("ppo-core-reward", "ppo-core", "")


def test_settings_from_the_environment(monkeypatch):
    module = load_script(monkeypatch, **CONFIGURED)
    assert module.GPU == "L4"
    assert module.REWARD_ARGS == ["--judge", "/vol/models/CE RM 4B", "--dtype=bfloat16"]  # split as a shell would
    assert (module.MIN_CONTAINERS, module.MAX_CONTAINERS, module.CONCURRENCY, module.SCALEDOWN_S) == (1, 3, 16, 120)
    assert module.PROXY_AUTH is True
    assert (module.APP_NAME, module.VOLUME_NAME, module.SECRET_NAME) == ("ppo-core-judge", "weights", "hf-token")


@pytest.mark.parametrize("env, message", [
    (dict(PPO_MODAL_REWARD_GPU="H100:2"), "PPO_MODAL_REWARD_GPU must be one GPU type"),
    (dict(PPO_MODAL_REWARD_GPU="A100 80GB"), "PPO_MODAL_REWARD_GPU must be one GPU type"),
    (dict(PPO_MODAL_REWARD_MIN_CONTAINERS="-1"), "PPO_MODAL_REWARD_MIN_CONTAINERS must be an integer >= 0, got '-1'"),
    (dict(PPO_MODAL_REWARD_MAX_CONTAINERS="0"), "PPO_MODAL_REWARD_MAX_CONTAINERS must be an integer >= 1, got '0'"),
    (dict(PPO_MODAL_REWARD_CONCURRENCY="eight"), "PPO_MODAL_REWARD_CONCURRENCY must be an integer >= 1"),
    (dict(PPO_MODAL_REWARD_MIN_CONTAINERS="5"), "MIN_CONTAINERS=5 is more than PPO_MODAL_REWARD_MAX_CONTAINERS=4"),
    (dict(PPO_MODAL_REWARD_ARGS="--reward_model /vol/models/rm --port 9000"), "--port is set by scripts/modal_reward"),
    (dict(PPO_MODAL_REWARD_ARGS="--host=127.0.0.1"), "--host is set by scripts/modal_reward"),
    (dict(PPO_MODAL_REWARD_ARGS="--reward_fn 'rewards.py:score"), "PPO_MODAL_REWARD_ARGS: No closing quotation"),
])
def test_bad_settings_name_the_variable(monkeypatch, env, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        load_script(monkeypatch, **env)


def test_server_command(monkeypatch):
    module = load_script(monkeypatch)
    assert module.server_command(["--reward_model", "/vol/models/rm", "--dtype=bfloat16"]) == [
        "python", "-m", "ppo_core.rewards.server", "--host", "0.0.0.0", "--port", "8000",
        "--reward_model", "/vol/models/rm", "--dtype=bfloat16"]


def test_the_image_is_modal_trains(monkeypatch):
    """One image definition for both apps, scripts/modal_common.py's (Modal builds it once), and the same Volume."""
    reward = load_script(monkeypatch)
    train = load_script(monkeypatch, os.path.join(ROOT, "scripts", "modal_train.py"), "modal_train_under_test")
    assert reward.modal_common is train.modal_common
    assert (reward.VOLUME_PATH, reward.VOLUME_NAME) == (train.VOLUME_PATH, train.VOLUME_NAME)


# ---------------------------------------------------------------------------- start-up, with real processes

def test_start_server_returns_once_the_port_accepts_connections(monkeypatch):
    module = load_script(monkeypatch)
    port = free_port()
    process = module.start_server([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], port, 60)
    try:
        assert process.poll() is None
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        process.kill()
        process.wait()


def test_start_server_fails_at_once_when_the_server_exits(monkeypatch):
    module = load_script(monkeypatch)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with status 2 before listening on port"):
        module.start_server([sys.executable, "-c", "import sys; sys.exit(2)"], free_port(), 600)
    assert time.monotonic() - start < 30  # not the 600 s timeout


def test_start_server_gives_up_after_the_timeout_and_stops_the_process(monkeypatch):
    module = load_script(monkeypatch)
    processes, popen = [], subprocess.Popen
    monkeypatch.setattr(module.subprocess, "Popen", lambda argv: processes.append(popen(argv)) or processes[-1])
    with pytest.raises(TimeoutError, match="not listening on port .* after 1 s"):
        module.start_server([sys.executable, "-c", "import time; time.sleep(60)"], free_port(), 1)
    assert processes[0].poll() is not None  # killed, not left behind


def test_the_served_command_starts_the_reward_server(monkeypatch):
    """The command a container runs, on this machine: the real ppo-serve-reward (the default task's reward)
    answers /health and scores; a bad option stops the start at once. Bound to 127.0.0.1 here instead of the
    container's 0.0.0.0, so that the test opens no port beyond this machine."""
    module = load_script(monkeypatch)
    monkeypatch.setenv("PYTHONPATH", ROOT)  # this checkout's ppo_core, whatever the installed one
    port = free_port()
    command = module.server_command([], port)
    command[0], command[command.index("0.0.0.0")] = sys.executable, "127.0.0.1"
    process = module.start_server(command, port, 120)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as answer:
            assert json.load(answer)["source"] == "the reward of task 'reverse'"
        body = json.dumps({"prompts": ["abc=", "abc="], "responses": ["cba", "abc"]}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/", data=body, method="POST")
        with urllib.request.urlopen(request, timeout=30) as answer:
            rewards = json.load(answer)["rewards"]
        assert rewards[0] == 1.0 and rewards[1] < 1.0  # the reversed string, and one that is not
    finally:
        process.terminate()
        process.wait()
    bad = module.server_command(["--no_such_key=1"], free_port())
    bad[0], bad[bad.index("0.0.0.0")] = sys.executable, "127.0.0.1"
    with pytest.raises(RuntimeError, match="exited with status 2"):
        module.start_server(bad, int(bad[bad.index("--port") + 1]), 120)


# ---------------------------------------------------------------------------- modal stays out of the library

def test_the_pure_functions_import_without_modal(monkeypatch):
    monkeypatch.setitem(sys.modules, "modal", None)  # `import modal` now fails as if it were not installed
    module = load_script(monkeypatch)
    assert module.modal is None and not hasattr(module, "app")
    assert module.server_command(["--task=reverse"], 8000)[-1] == "--task=reverse"


def test_no_library_module_imports_modal():
    """No `import modal` anywhere in ppo_core/ or kernels/ (read from the source), and importing every library
    module (in a fresh process) leaves modal out of sys.modules."""
    importers = []
    for package in ("ppo_core", "kernels"):
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    for node in ast.walk(ast.parse(open(path).read(), path)):
                        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                            [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                        if any(n == "modal" or n.startswith("modal.") for n in names):
                            importers.append(os.path.relpath(path, ROOT))
    assert importers == []
    code = ("import importlib, pkgutil, sys, ppo_core, ppo_kernels\n"
            "for package in (ppo_core, ppo_kernels):\n"
            "    for m in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):\n"
            "        importlib.import_module(m.name)\n"
            "print(sorted(m for m in sys.modules if m == 'modal' or m.startswith('modal.')))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split("\n")[-2] == "[]"


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
def test_the_app_defines_without_network_with_the_configured_resources(monkeypatch, no_credentials, env):
    modal = pytest.importorskip("modal")
    module = load_script(monkeypatch, **env)
    assert isinstance(module.app, modal.App) and module.app.name == env.get("PPO_MODAL_REWARD_APP", "ppo-core-reward")
    assert isinstance(module.serve, modal.Function)
    spec = getattr(module.serve, "_spec_", None)
    if spec is not None:
        assert spec.gpus == env.get("PPO_MODAL_REWARD_GPU", "A100-80GB") and list(spec.volumes) == ["/vol"]
        mount_options = getattr(spec.volumes["/vol"], "_mount_options", None)
        if mount_options is not None:
            assert mount_options.read_only
        secrets = [repr(s) for s in spec.secrets]
        assert secrets == (["modal.Secret.from_name('hf-token')"] if env else [])
    settings = function_settings(module.serve)
    if settings:
        scaling = settings["autoscaler_settings"]
        assert (scaling.min_containers, scaling.max_containers, scaling.scaledown_window) == (
            (1, 3, 120) if env else (0, 4, 600))
        assert settings["max_concurrent_inputs"] == (16 if env else 8)
        web = settings["webhook_config"]
        assert (web.web_server_port, web.web_server_startup_timeout, web.requires_proxy_auth) == (
            8000, 900, bool(env))
        assert settings["timeout"] == 900


def test_the_modal_function_body_starts_the_configured_server(monkeypatch, no_credentials):
    """The Modal function itself, run locally (`Function.local`), hands the configured command to start_server."""
    pytest.importorskip("modal")
    module = load_script(monkeypatch, **CONFIGURED)
    started = []
    monkeypatch.setattr(module, "start_server", lambda argv, port, timeout_s: started.append((argv, port, timeout_s)))
    with pytest.warns(UserWarning, match="executing locally"):  # Modal: no Volume when run locally
        module.serve.local()
    assert started == [(["python", "-m", "ppo_core.rewards.server", "--host", "0.0.0.0", "--port", "8000",
                         "--judge", "/vol/models/CE RM 4B", "--dtype=bfloat16"], 8000, 900)]
