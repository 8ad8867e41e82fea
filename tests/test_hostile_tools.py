"""Hostile input to the tools and the sandbox (issue 38, items 1 and 8): whatever the policy writes in a turn is data,
answered and counted, never an exception out of the run; the sandbox bounds a call's memory as a whole (where the
machine gives it a cgroup), opens no device node where it mounted, and shows nothing of the trainer's checkout.
Everything runs the real parser, tools, environment, engine and sandbox (no mocks)."""
import os
import stat
import sys
import time

import pytest

from ppo_core.rewards import sandbox
from ppo_core.config import ConfigError, build_config
from ppo_core.engine import RolloutEngine
from ppo_core.agents.environments import ToolEnvironment, make_environment, run_episodes
from ppo_core.agents.tools import (
    MAX_CALL_BYTES,
    MAX_JSON_DEPTH,
    Calculator,
    MalformedCall,
    ToolCall,
    parse_tool_calls,
    run_tool_calls,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_environments import ROWS, policy, tokenizer  # noqa: E402,F401  (tokenizer: a fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ISOLATION = sandbox.isolation()
needs_sandbox = pytest.mark.skipif(ISOLATION.startswith("none"), reason=f"no sandbox on this machine: {ISOLATION}")

NESTED = "[" * 1000  # json.loads: RecursionError
LONG_INT = '{"name": "calculator", "arguments": {"expression": "1", "n": ' + "1" * 4301 + "}}"  # ValueError
HOSTILE_TURN = f"<tool_call>{NESTED}</tool_call><tool_call>{LONG_INT}</tool_call>"


def block(body):
    return f"<tool_call>{body}</tool_call>"


# ------------------------------------------------------------------------------------- item 1: the parser


def test_a_call_nested_1000_deep_is_a_malformed_call():
    assert parse_tool_calls(block(NESTED)) == [MalformedCall(f"nested deeper than {MAX_JSON_DEPTH} levels", NESTED)]
    # closed too, and inside the arguments, and inside an "arguments" string that is decoded again
    closed = '{"name": "calculator", "arguments": ' + "[" * 1000 + "]" * 1000 + "}"
    assert parse_tool_calls(block(closed))[0].reason == f"nested deeper than {MAX_JSON_DEPTH} levels"
    as_string = '{"name": "calculator", "arguments": "' + "[" * 1000 + '"}'
    reason = f'"arguments" is a string: nested deeper than {MAX_JSON_DEPTH} levels'
    assert parse_tool_calls(block(as_string))[0].reason == reason


def test_brackets_inside_strings_are_not_nesting():
    # a string of 1,000 brackets, an escaped quote (the string goes on) and 100 braces: one level of nesting
    body = '{"name": "python", "arguments": {"code": "' + "[" * 1000 + '\\"' + "{" * 100 + '"}}'
    assert parse_tool_calls(block(body)) == [ToolCall("python", {"code": "[" * 1000 + '"' + "{" * 100})]


def test_an_integer_past_pythons_digit_limit_is_a_malformed_call():
    (call,) = parse_tool_calls(block(LONG_INT))
    assert isinstance(call, MalformedCall) and call.reason.startswith("bad JSON: Exceeds the limit (4300 digits)")


def test_a_call_past_the_byte_cap_is_refused_before_decoding():
    body = '{"name": "python", "arguments": {"code": "' + "é" * (MAX_CALL_BYTES // 2) + '"}}'  # 2 bytes a character
    (call,) = parse_tool_calls(block(body))
    assert call.reason == f"longer than {MAX_CALL_BYTES} bytes ({MAX_CALL_BYTES + len(body) - MAX_CALL_BYTES // 2})"
    fits = '{"name": "python", "arguments": {"code": "' + "x" * (MAX_CALL_BYTES - 50) + '"}}'
    assert isinstance(parse_tool_calls(block(fits))[0], ToolCall)


def test_the_nesting_scan_is_linear_in_the_block():
    # an unterminated string of 30,000 escaped quotes: a scan that retried from each quote would take seconds
    body = '"' + '\\"' * 30000
    start = time.perf_counter()
    (call,) = parse_tool_calls(block(body))
    assert call.reason.startswith("bad JSON: Unterminated string") and time.perf_counter() - start < 0.5


def test_hostile_blocks_are_answered_and_counted_as_malformed():
    observations, counts = run_tool_calls(HOSTILE_TURN, {"calculator": Calculator()})
    assert observations[0] == f"error: malformed tool call: nested deeper than {MAX_JSON_DEPTH} levels"
    assert observations[1].startswith("error: malformed tool call: bad JSON: Exceeds the limit (4300 digits)")
    assert counts == {"tool_calls": 2, "malformed_calls": 2, "tool_errors": 0, "calls_not_run": 0}


# ---------------------------------------------------------------------------- item 1: calls in one turn


class Tally:
    """A tool that counts its runs."""
    name = "tally"

    def __init__(self):
        self.runs = 0

    def __call__(self, arguments):
        self.runs += 1
        return str(self.runs)


def test_calls_past_the_per_turn_cap_are_not_run():
    tally = Tally()
    text = block('{"name": "tally"}') * 5000
    observations, counts = run_tool_calls(text, {"tally": tally}, max_calls=8)
    assert tally.runs == 8
    assert observations == [str(k) for k in range(1, 9)] + ["error: 4992 more tool calls not run: at most 8 per turn"]
    assert counts == {"tool_calls": 5000, "malformed_calls": 0, "tool_errors": 0, "calls_not_run": 4992}


def test_the_cap_is_a_config_field_that_reaches_the_environment():
    assert build_config().max_tool_calls_per_turn == 8
    with pytest.raises(ConfigError, match="max_tool_calls_per_turn"):
        build_config({}, {"environment": "tools", "rollout_engine": "paged", "max_tool_calls_per_turn": "0"})
    build, _ = make_environment("tools", "calculator", 4, 2)
    env = build()
    env.reset({"prompt": "go", "answer": "4"})
    observation, reward, done = env.step(block('{"name": "calculator", "arguments": {"expression": "2+2"}}') * 3)
    assert [m["content"] for m in observation] == ["4", "4", "error: 1 more tool calls not run: at most 2 per turn"]
    assert env.counts["calls_not_run"] == 1 and env.counts["tool_calls"] == 3


# ---------------------------------------------------------------------------------- item 1: the calculator


@pytest.mark.parametrize("expression, value", [("-" * 999 + "1", "-1"), ("-" * 998 + "1", "1"),
                                               ("-+" * 499 + "7", "-7"), ("1" + "-1" * 499, "-498"),
                                               ("2**" * 3 + "2", "65536"), ("2**3**2", "512"), ("10-4-3", "3")],
                         ids=["999 minus", "998 minus", "499 -+", "499 -1", "2**2**2**2", "2**3**2", "10-4-3"])
def test_the_calculator_evaluates_deep_expressions_without_recursion(expression, value):
    # hand-worked: 999 minus signs negate an odd number of times; 1 - 1 * 499 = -498; 2**(2**(2**2)) = 2**16;
    # ** is right-associative, - left-associative
    assert Calculator()({"expression": expression}) == value


# ----------------------------------------------------------------------------------- item 1: end to end


def test_an_environment_step_fed_hostile_text_returns():
    env = ToolEnvironment({"calculator": Calculator()})
    env.reset({"prompt": "go", "answer": "1"})
    calculation = block('{"name": "calculator", "arguments": {"expression": "---1"}}')
    observation, reward, done = env.step(HOSTILE_TURN + calculation)
    assert [m["content"] for m in observation][2] == "-1" and (reward, done) == (0.0, False)
    assert env.counts["malformed_calls"] == 2 and env.counts["tool_calls"] == 3


class HostileTurns(ToolEnvironment):
    """The shipped ToolEnvironment, fed the hostile turn in place of whatever the policy wrote: a random tiny policy
    cannot be made to write it, and what matters is that the step runs inside the engine's turn callback."""
    max_turns = 2

    def step(self, assistant_text):
        return super().step(HOSTILE_TURN)


def test_episodes_on_the_engine_survive_hostile_turns(tokenizer):  # noqa: F811
    envs = [HostileTurns({"calculator": Calculator()}, max_turns=2) for _ in ROWS]
    episodes = run_episodes(RolloutEngine(policy(tokenizer.vocab_size)), tokenizer, envs, ROWS, max_new_tokens=400,
                            max_turn_tokens=4, greedy=True)
    for episode, env in zip(episodes, envs):
        assert episode.done and episode.turns == 2
        assert env.counts["malformed_calls"] == 4  # two turns, two hostile blocks each


# ------------------------------------------------------------------------------ item 8: the sandbox's bounds


@needs_sandbox
def test_the_trainers_checkout_and_working_directory_are_not_visible(monkeypatch):
    # a working directory outside the checkout and /tmp, holding a world-readable file, as a run directory would
    workdir = f"/var/tmp/ppo-hostile-{os.getpid()}"
    os.makedirs(workdir, exist_ok=True)
    with open(f"{workdir}/run.txt", "w") as f:
        f.write("the trainer's")
    os.chmod(f"{workdir}/run.txt", 0o644)
    monkeypatch.chdir(workdir)
    try:
        program = (f"import os\nfor path in [{ROOT!r} + '/ppo_core/rewards/sandbox.py', {workdir!r} + '/run.txt']:\n"
                   "    try:\n        print(len(open(path).read()))\n"
                   "    except OSError as e:\n        print(type(e).__name__)\n"
                   f"for folder in [{ROOT!r}, {workdir!r}]:\n"
                   "    try:\n        print(os.listdir(folder))\n"
                   "    except OSError as e:\n        print(type(e).__name__)\n")
        result = sandbox.run_code(program)
    finally:
        os.remove(f"{workdir}/run.txt")
        os.rmdir(workdir)
    lines = result.stdout.splitlines()
    assert len(lines) == 4, (result.stdout, result.stderr)
    sandbox_py, run_txt, checkout_listing, workdir_listing = lines
    assert (sandbox_py, run_txt) == ("FileNotFoundError", "FileNotFoundError"), result.stderr
    # hidden either way: an empty mount point where the folder's path lies on a tmpfs the sandbox mounts over (the
    # checkout under /tmp: the sandbox's own /tmp has no such folder), or an empty folder
    assert checkout_listing in ("[]", "FileNotFoundError"), result.stdout
    assert workdir_listing in ("[]", "FileNotFoundError"), result.stdout


MOUNTS = """
import os
print(sorted(os.listdir("/dev")))
for line in open("/proc/self/mountinfo"):
    fields = line.split()
    print(fields[4], fields[5])  # the mount point, its per-mount options
"""


@needs_sandbox
def test_every_mount_is_nodev_but_the_few_device_nodes_it_offers():
    result = sandbox.run_code(MOUNTS)
    lines = result.stdout.splitlines()
    assert lines[0] == str(sorted(sandbox.DEVICES + ("fd", "shm", "stderr", "stdin", "stdout")))
    options = dict(line.split(" ", 1) for line in lines[1:])  # the last mount on a point is the one seen
    assert options["/"].split(",")[:3] == ["ro", "nosuid", "nodev"]
    for mount_point, flags in options.items():
        if mount_point in {f"/dev/{name}" for name in sandbox.DEVICES}:
            assert "nodev" not in flags and "ro" in flags.split(",") and "nosuid" in flags
        else:
            assert "nodev" in flags.split(","), (mount_point, flags)


DEVICE_PROGRAM = """
import os, subprocess
for path in {paths!r}:
    try:
        os.close(os.open(path, os.O_RDONLY))
        print(path, "opened")
    except OSError as e:
        print(path, type(e).__name__)
open("/dev/null", "w").write("x")
print(len(os.urandom(8)), open("/dev/zero", "rb").read(2), subprocess.run(["true"], stdout=subprocess.DEVNULL).returncode)
"""


@needs_sandbox
def test_a_device_node_of_the_machine_cannot_be_opened_but_dev_null_works():
    # the machine's world-readable or -writable device nodes the sandbox does not offer (/dev/kmsg, /dev/tty, a GPU's
    # /dev/nvidia*): none can be opened inside; those it offers work as programs expect
    others = []
    for name in sorted(os.listdir("/dev")):
        mode = os.lstat(f"/dev/{name}").st_mode
        if name not in sandbox.DEVICES and mode & 0o006 and (stat.S_ISCHR(mode) or stat.S_ISBLK(mode)):
            others.append(f"/dev/{name}")
    result = sandbox.run_code(DEVICE_PROGRAM.format(paths=others))
    assert result.stdout.splitlines() == [f"{path} FileNotFoundError" for path in others] + ["8 b'\\x00\\x00' 0"], \
        result.stderr


@needs_sandbox
@pytest.mark.skipif(not sandbox.memory_bound_per_call(),
                    reason=f"no memory cgroup for the sandbox here: memory_mb bounds each process only ({ISOLATION})")
def test_children_together_past_the_memory_bound_are_stopped():
    """Four children of 50 MB each, every one under memory_mb=128 alone (RLIMIT_AS), 200 MB together: at most two
    can hold theirs at once; the others are killed by the kernel at the call's bound, and the result says so."""
    program = """
import os, time
children = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        block = b"x" * (50 << 20)  # written, so resident: 50 MB
        time.sleep(0.5)  # held while the others allocate theirs
        os._exit(0)
    children.append(pid)
statuses = [os.waitpid(pid, 0)[1] for pid in children]
print(sum(os.WIFEXITED(s) and os.WEXITSTATUS(s) == 0 for s in statuses), sum(os.WIFSIGNALED(s) for s in statuses))
"""
    result = sandbox.run_code(program, memory_mb=128, timeout_s=10.0)
    completed, killed = map(int, result.stdout.split())
    assert completed <= 2 and killed == 4 - completed, result.stdout
    assert result.error.startswith("the call's memory bound (128 MiB, all its processes together) was reached")
    assert sandbox.run_code("print(len(b'x' * (80 << 20)))", memory_mb=128).stdout == f"{80 << 20}\n"  # one fits
