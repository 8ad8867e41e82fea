"""ppo_core.rewards.sandbox: programs the policy might write, hostile ones included. Each runs in the real sandbox
(namespaces, read-only mounts, rlimits, its own uid) and comes back as a failed SandboxResult, in time, while this
process and the machine are unharmed: an endless loop, a fork bomb, a daemon that outlives its parent, 2 GB of
memory, a connection to this process's socket, writes outside the working directory, a look at the trainer's
secrets, 100 MB of output. The same cases then run under the fallback (a user namespace, as an unprivileged user).
The modal backend's pure parts (its arguments, checked against the installed modal's signatures, and the result
conversion) run offline.

Every hostile program here is bounded in itself, so that a failure of the sandbox could not hurt a 2-core CI
machine either: the fork bomb forks at most 200 children, each a `sleep`; the memory hog asks once.
"""
import inspect
import json
import os
import pwd
import shutil
import socket
import stat
import subprocess
import tempfile
import time
import uuid

import pytest

from ppo_core.rewards import sandbox
from ppo_core.rewards.sandbox import (
    CHILD_ENV, MAX_PROCESSES, OUTPUT_KILL_BYTES, OUTPUT_LIMIT_BYTES, BoundedOutput, SandboxPool, SandboxResult,
    SandboxUnavailable, run_code,
)

ISOLATION = sandbox.isolation()
needs_sandbox = pytest.mark.skipif(ISOLATION.startswith("none"), reason=f"no sandbox on this machine: {ISOLATION}")
MARGIN_S = 0.5  # past the deadline: the kill, the kernel emptying the namespace, the streams closing


def processes_with(marker: str) -> list[int]:
    """Live processes whose command line holds `marker` (a zombie's command line is empty)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(int(entry))
        except (OSError, ValueError):
            pass
    return pids


# ---------------------------------------------------------------------------- ordinary programs

@needs_sandbox
def test_print_stdin_files_and_exit_status():
    result = run_code("print(1)")
    assert (result.stdout, result.stderr, result.exit_code, result.ok) == ("1\n", "", 0, True)
    assert not result.timed_out and not result.truncated and result.killed_by is None and result.error is None

    assert run_code("import sys; print(sys.stdin.read()[::-1])", stdin="abc\ndef").stdout == "fed\ncba\n"
    program = "print(open('numbers.txt').read().split(), open('data/blob.bin', 'rb').read())"
    result = run_code(program, files={"numbers.txt": "3 4", "data/blob.bin": b"\x00\xff"})
    assert result.stdout == "['3', '4'] b'\\x00\\xff'\n" and result.ok

    result = run_code("import sys; print('partial'); sys.exit(3)")
    assert (result.stdout, result.exit_code, result.ok) == ("partial\n", 3, False)


@needs_sandbox
def test_a_syntax_error_is_a_failed_run_with_its_traceback():
    result = run_code("x = (1,\nprint(x)")
    assert result.exit_code == 1 and not result.ok and not result.timed_out and result.error is None
    assert 'File "/tmp/main.py", line 1' in result.stderr and "SyntaxError" in result.stderr
    result = run_code("def f():\n    return 1 / 0\nf()")
    assert result.exit_code == 1 and "return 1 / 0" in result.stderr and "ZeroDivisionError" in result.stderr


@needs_sandbox
def test_a_crash_is_reported_by_its_signal():
    result = run_code("import ctypes\nctypes.string_at(0)")  # a NULL read: SIGSEGV
    assert result.killed_by == "SIGSEGV" and result.exit_code is None and not result.ok and not result.timed_out


@pytest.mark.parametrize("name", ["../escape", "/etc/passwd", "a/../../escape", "", "./x", "a//b", "a/", "main.py"])
def test_a_file_name_outside_the_working_directory_is_refused(name):
    with pytest.raises(ValueError, match="files"):
        run_code("pass", files={name: "x"})


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="timeout_s"):
        run_code("pass", timeout_s=0)
    with pytest.raises(ValueError, match="memory_mb"):
        run_code("pass", memory_mb=8)
    with pytest.raises(ValueError, match="backend"):
        run_code("pass", backend="docker")


# ---------------------------------------------------------------------------- time and processes

@needs_sandbox
def test_an_endless_loop_times_out_and_keeps_what_it_printed():
    start = time.monotonic()
    result = run_code("print('started')\nwhile True:\n    pass", timeout_s=1.0)
    elapsed = time.monotonic() - start
    assert result.timed_out and not result.ok and result.exit_code is None and result.killed_by == "SIGKILL"
    assert result.stdout == "started\n"  # printed before the deadline: python runs unbuffered (-u)
    assert 1.0 <= result.wall_s <= elapsed < 1.0 + MARGIN_S


@needs_sandbox
def test_a_fork_bomb_is_contained():
    marker = f"ppo-bomb-{uuid.uuid4().hex}"
    bomb = f"""
import os, time
forked = 0
for _ in range(200):  # bounded: were the sandbox to fail, 200 sleeping processes would not hurt the machine
    try:
        if os.fork() == 0:
            os.execv("/bin/sleep", ["{marker}", "30"])
    except OSError as e:
        print("fork refused:", e.strerror, flush=True)
        break
    forked += 1
print("forked", forked, flush=True)
time.sleep(30)
"""
    start = time.monotonic()
    result = run_code(bomb, timeout_s=2.0)
    assert time.monotonic() - start < 2.0 + MARGIN_S
    assert result.timed_out and result.killed_by == "SIGKILL"
    # RLIMIT_NPROC on the sandbox's own uid (the python itself is one of its MAX_PROCESSES)
    assert "fork refused: Resource temporarily unavailable" in result.stdout
    assert int(result.stdout.split("forked ")[1]) < MAX_PROCESSES
    assert processes_with(marker) == []  # the PID namespace died with the program: no sleeper is left


@needs_sandbox
def test_a_daemon_does_not_outlive_its_program():
    """A child that double-forks into its own session and the program exits 0 at once: the run is a success, and
    the daemon is gone when run_code returns (it was in the PID namespace, which died with its PID 1)."""
    marker = f"ppo-daemon-{uuid.uuid4().hex}"
    program = f"""
import os
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv("/bin/sleep", ["{marker}", "30"])
    os._exit(0)
os.wait()
print("parent done")
"""
    start = time.monotonic()
    result = run_code(program, timeout_s=5.0)
    assert result.ok and result.stdout == "parent done\n" and time.monotonic() - start < 2.0
    assert processes_with(marker) == []


@needs_sandbox
def test_a_program_that_leaves_the_process_group_is_killed_at_the_deadline():
    """setsid() takes the program (PID 1 of its namespace) out of the process group the deadline kills; the
    parent-death signal, set again after the uid change, kills it when unshare dies."""
    marker = f"ppo-setsid-{uuid.uuid4().hex}"
    program = f"import os\nos.setsid()\nos.execv('/bin/sleep', [{marker!r}, '30'])"
    start = time.monotonic()
    result = run_code(program, timeout_s=1.0)
    assert result.timed_out and time.monotonic() - start < 1.0 + MARGIN_S
    deadline = time.monotonic() + 1.0  # the kill of PID 1 reaches it through its parent's death: give it a moment
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert processes_with(marker) == []


@needs_sandbox
def test_a_memory_hog_fails_and_this_process_is_fine():
    result = run_code("block = bytearray(2 * 1024**3)\nprint('allocated')", memory_mb=256)
    assert result.exit_code == 1 and "MemoryError" in result.stderr and result.stdout == ""
    assert run_code("print(len(bytearray(100 * 1024**2)))", memory_mb=256).stdout == "104857600\n"  # under the limit


@needs_sandbox
def test_the_pool_runs_calls_side_by_side():
    programs = [f"import time; time.sleep(0.5); print({i} * {i})" for i in range(6)]
    start = time.monotonic()
    with SandboxPool(max_workers=6) as pool:
        futures = [pool.submit(program, timeout_s=5.0) for program in programs]
        results = [future.result() for future in futures]
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(6)] and all(r.ok for r in results)
    assert time.monotonic() - start < 6 * 0.5 / 2  # 3.0 s one after the other; side by side about 0.6 s
    assert all(isinstance(r, SandboxResult) for r in results)


# ---------------------------------------------------------------------------- network, files, secrets

@needs_sandbox
def test_no_network_even_to_this_process():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    program = f"""
import socket
for address in [("127.0.0.1", {port}), ("1.1.1.1", 53)]:
    try:
        socket.create_connection(address, timeout=1).close()
        print("connected", address)
    except OSError as e:
        print("refused", address, e.errno)
"""
    try:
        result = run_code(program, timeout_s=5.0)
        # a connection, had one been made, would wait in the listen backlog: accept() would return it at once
        server.settimeout(0.2)
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()
    assert result.ok and "connected" not in result.stdout
    assert result.stdout.count("refused") == 2 and " 101\n" in result.stdout  # ENETUNREACH: no interface is up


@needs_sandbox
def test_writes_outside_the_working_directory_are_refused(tmp_path):
    tag = uuid.uuid4().hex
    outside = [str(tmp_path / "escape"), f"/var/tmp/ppo-sandbox-escape-{tag}",
               os.path.join(os.path.dirname(os.path.abspath(__file__)), f"escape-{tag}")]
    private = [f"/tmp/ppo-sandbox-escape-{tag}", f"/dev/shm/ppo-sandbox-escape-{tag}"]  # the sandbox's own tmpfs
    program = f"""
for path in {outside + private!r}:
    try:
        with open(path, "w") as f:
            f.write("escaped")
        print("wrote", path)
    except OSError as e:
        print("refused", path, e.strerror)
"""
    result = run_code(program)
    assert result.ok
    for path in outside:
        assert f"refused {path}" in result.stdout and not os.path.exists(path)
    assert f"refused /var/tmp/ppo-sandbox-escape-{tag} Read-only file system" in result.stdout  # world-writable dir
    for path in private:
        assert f"wrote {path}" in result.stdout and not os.path.exists(path)  # written inside, never on the host


@needs_sandbox
def test_the_trainers_secrets_are_not_visible(monkeypatch):
    secrets = {"HF_TOKEN": f"hf_{uuid.uuid4().hex}", "WANDB_API_KEY": uuid.uuid4().hex}
    for key, value in secrets.items():
        monkeypatch.setenv(key, value)
    # a home directory anyone may read, with a token file anyone may read: hidden all the same
    home = tempfile.mkdtemp(prefix="ppo-sandbox-home-", dir="/var/tmp")
    try:
        os.chmod(home, 0o755)
        with open(os.path.join(home, "token"), "w") as f:
            f.write(secrets["HF_TOKEN"])
        os.chmod(os.path.join(home, "token"), 0o644)
        monkeypatch.setenv("HOME", home)
        program = f"import json, os\nprint(json.dumps(dict(os.environ)))\nprint(os.listdir({home!r}))"
        result = run_code(program)
    finally:
        shutil.rmtree(home)
    assert result.ok
    environment, listing = result.stdout.splitlines()
    assert json.loads(environment) == CHILD_ENV and listing == "[]"
    assert all(value not in result.stdout + result.stderr for value in secrets.values())


# ---------------------------------------------------------------------------- output

@needs_sandbox
def test_100_mb_of_output_is_cut_and_the_run_stopped():
    start = time.monotonic()
    result = run_code("import sys\nsys.stdout.write('x' * 100_000_000)\nprint('finished', file=sys.stderr)",
                      timeout_s=20.0)
    assert time.monotonic() - start < 5.0 and not result.timed_out
    assert result.truncated and result.stdout == "x" * OUTPUT_LIMIT_BYTES
    assert result.killed_by == "SIGKILL" and result.exit_code is None and "16 MiB" in result.error
    assert "finished" not in result.stderr  # killed at the cap, before the end


@needs_sandbox
def test_output_over_the_limit_is_cut_and_the_run_goes_on():
    result = run_code("import sys\nprint('y' * 1_000_000)\nprint('done', file=sys.stderr)")
    assert result.ok and result.truncated and result.stdout == "y" * OUTPUT_LIMIT_BYTES
    assert result.stderr == "done\n" and result.error is None


def test_bounded_output_keeps_the_first_bytes_and_counts_all():
    output = BoundedOutput(limit=5)
    for chunk in (b"ab", "é".encode() * 3, b"zz"):  # "é" is two bytes: the limit falls inside one
        output.add(chunk)
    assert output.total == 10 and output.truncated and output.text() == "abé\ufffd"
    assert not BoundedOutput(limit=5).truncated


# ---------------------------------------------------------------------------- where no sandbox can be made

def test_without_unshare_run_code_refuses(monkeypatch):
    monkeypatch.setattr(sandbox.shutil, "which", lambda *args, **kwargs: None)  # a machine without util-linux
    launcher, description = sandbox._find_launcher.__wrapped__()
    assert launcher is None and description == "none: no unshare command (util-linux)"
    monkeypatch.setattr(sandbox, "_find_launcher", lambda: (launcher, description))
    with pytest.raises(SandboxUnavailable, match="no way to run code without network on this machine: none: no"):
        run_code("print(1)")


def readable_by_others(path: str) -> bool:
    """Every folder above `path` may be entered by any user, and the file read."""
    folders = [os.path.dirname(path)]
    while folders[-1] != "/":
        folders.append(os.path.dirname(folders[-1]))
    return bool(os.stat(path).st_mode & stat.S_IROTH) and all(os.stat(f).st_mode & stat.S_IXOTH for f in folders)


FALLBACK_SCRIPT = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("sandbox_under_test", sys.argv[1])
sandbox = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sandbox)
results = {"isolation": sandbox.NETWORK_ISOLATION}
for name, program, timeout_s in [
    ("print", "print(1)", 5.0),
    ("uid", "import os; print(os.getuid(), os.environ.get('SECRET'))", 5.0),
    ("network", "import socket; socket.create_connection(('127.0.0.1', 22), timeout=1)", 5.0),
    ("write", f"open('/var/tmp/ppo-sandbox-escape-{sys.argv[2]}', 'w')", 5.0),
    ("bomb", "import os, time\\nfor n in range(200):\\n    try: os.fork() or time.sleep(30)\\n"
             "    except OSError: print('refused after', n, flush=True); break\\ntime.sleep(30)", 1.0),
]:
    result = sandbox.run_code(program, timeout_s=timeout_s)
    results[name] = [result.stdout, result.stderr[-200:], result.exit_code, result.timed_out]
print(json.dumps(results))
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_the_user_namespace_fallback_as_an_unprivileged_user(tmp_path):
    """As `nobody` (no root, no capabilities), the fallback: a user namespace holding the same namespaces; the
    program runs as the caller's own user, mapped to root without capabilities."""
    python = shutil.which("python3", path=sandbox.SYSTEM_PATH)
    module = os.path.abspath(sandbox.__file__)
    if python is None or not readable_by_others(module):
        pytest.skip("no system python3, or ppo_core/rewards/sandbox.py is not readable by others")
    tag = uuid.uuid4().hex
    nobody = pwd.getpwnam("nobody")
    command = ["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups", "--",
               python, "-I", "-S", "-c", FALLBACK_SCRIPT, module, tag]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd="/",
                               env={"PATH": sandbox.SYSTEM_PATH, "HOME": "/nonexistent", "SECRET": "s3cret"})
    assert completed.returncode == 0, completed.stderr
    results = json.loads(completed.stdout)
    if results["isolation"].startswith("none"):
        pytest.skip(f"no unprivileged user namespaces here: {results['isolation']}")
    assert results["isolation"].startswith("user namespace")
    assert results["print"] == ["1\n", "", 0, False]
    assert results["uid"] == ["0 None\n", "", 0, False]  # root inside the namespace: nobody outside
    assert results["network"][2] == 1 and "Network is unreachable" in results["network"][1]
    assert results["write"][2] == 1 and "Read-only file system" in results["write"][1]
    assert not os.path.exists(f"/var/tmp/ppo-sandbox-escape-{tag}")
    stdout, _, exit_code, timed_out = results["bomb"]
    assert timed_out and exit_code is None and int(stdout.split("refused after ")[1]) < MAX_PROCESSES


# ---------------------------------------------------------------------------- the modal backend, offline

def test_modal_arguments():
    assert sandbox.modal_sandbox_args(2.5, 256) == {"block_network": True, "timeout": 3 + sandbox.MODAL_STARTUP_S,
                                                    "memory": (256, 256), "cpu": 1.0, "workdir": "/sandbox"}
    exec_args = sandbox.modal_exec_args(2.5)
    assert exec_args == {"timeout": 3, "workdir": "/sandbox", "text": False,
                         "env": {**CHILD_ENV, "HOME": "/sandbox", "TMPDIR": "/sandbox"}}
    assert sandbox.modal_command() == ["python3", "-I", "-S", "-u", "main.py"]


def test_modal_arguments_fit_the_installed_modal():
    modal = pytest.importorskip("modal")
    # bind() raises TypeError on any keyword the installed modal does not take
    inspect.signature(modal.Sandbox.create).bind(app=None, image=None, **sandbox.modal_sandbox_args(5.0, 512))
    inspect.signature(modal.Sandbox.exec).bind(None, *sandbox.modal_command(), **sandbox.modal_exec_args(5.0))
    inspect.signature(modal.App.lookup).bind(sandbox.MODAL_APP_NAME, create_if_missing=True)
    inspect.signature(modal.Image.debian_slim).bind(python_version=sandbox.MODAL_PYTHON_VERSION)
    assert hasattr(modal.Sandbox, "filesystem") and hasattr(modal.Sandbox, "terminate")


def test_modal_results():
    def output(data):
        bounded = BoundedOutput()
        bounded.add(data)
        return bounded

    finished = sandbox.modal_result(0, output(b"1\n"), output(b""), 1.5, output_capped=False)
    assert (finished.stdout, finished.exit_code, finished.ok, finished.timed_out) == ("1\n", 0, True, False)
    failed = sandbox.modal_result(1, output(b""), output(b"Traceback\n"), 1.5, output_capped=False)
    assert (failed.exit_code, failed.ok, failed.stderr) == (1, False, "Traceback\n")
    timed_out = sandbox.modal_result(-1, output(b"started\n"), output(b""), 5.0, output_capped=False)
    assert timed_out.timed_out and timed_out.exit_code is None and not timed_out.ok
    long = sandbox.modal_result(0, output(b"x" * (OUTPUT_LIMIT_BYTES + 1)), output(b""), 1.0, output_capped=False)
    assert long.truncated and long.ok and long.stdout == "x" * OUTPUT_LIMIT_BYTES


def test_modal_output_is_drained_up_to_the_cap():
    consumed = []

    def stream():  # 1 MiB chunks without end, as a program printing forever would send them
        while True:
            consumed.append(1)
            yield b"z" * (1 << 20)

    output = BoundedOutput()
    assert sandbox.drain_into(stream(), output) is True
    assert len(consumed) == OUTPUT_KILL_BYTES // (1 << 20) + 1  # stopped right after passing the cap
    assert output.text() == "z" * OUTPUT_LIMIT_BYTES and output.truncated
    capped = sandbox.modal_result(None, output, BoundedOutput(), 2.0, output_capped=True)
    assert capped.exit_code is None and not capped.ok and "16 MiB" in capped.error
    text = BoundedOutput()
    assert sandbox.drain_into(["a", "b"], text) is False and text.text() == "ab"  # text=True streams, too


def test_modal_runner_script_drives_a_sandbox_offline(monkeypatch):
    """scripts/modal_sandbox.py (the library never imports modal; run_code(backend='modal') loads this file) against a
    stand-in for the one thing that cannot run here, Modal's cloud: a Sandbox double that records what it was given
    and answers the program with fixed output. The script writes main.py and the files, passes the offline-tested
    arguments, reads both streams, waits, terminates, and returns the result."""
    pytest.importorskip("modal")
    import importlib.util

    spec = importlib.util.spec_from_file_location("modal_sandbox_under_test", sandbox.MODAL_RUNNER)
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    calls = {}

    class Stdin:
        def write(self, data):
            calls["stdin"] = data

        def write_eof(self):
            calls["eof"] = True

        def drain(self):
            pass

    class Process:
        stdin, stdout, stderr = Stdin(), iter([b"4", b"5\n"]), iter([b"warn\n"])

        def wait(self):
            return 0

    class FileSystem:
        def write_bytes(self, content, path):
            calls.setdefault("files", {})[path] = content

    class Sandbox:
        filesystem = FileSystem()

        def exec(self, *command, **kwargs):
            calls["exec"] = (command, kwargs)
            return Process()

        def terminate(self):
            calls["terminated"] = True

    def create(**kwargs):
        calls["create"] = kwargs
        return Sandbox()

    monkeypatch.setattr(runner, "_modal_app_and_image", lambda: ("app", "image"))
    monkeypatch.setattr(runner.modal.Sandbox, "create", create)
    result = runner.run("print(45)", b"in", 2.0, 256, {"data.txt": b"1 2"})
    assert (result.stdout, result.stderr, result.exit_code, result.ok) == ("45\n", "warn\n", 0, True)
    assert calls["create"] == {"app": "app", "image": "image", **sandbox.modal_sandbox_args(2.0, 256)}
    assert calls["files"] == {"/sandbox/main.py": b"print(45)", "/sandbox/data.txt": b"1 2"}
    assert calls["exec"] == (tuple(sandbox.modal_command()), sandbox.modal_exec_args(2.0))
    assert calls["stdin"] == b"in" and calls["eof"] and calls["terminated"]
