"""Run code the policy writes: a child process with no network, none of the trainer's secrets, a private /tmp as
its working directory, a read-only view of the rest of the machine, and limits on time, memory, processes, output.

    from ppo_core.rewards.sandbox import run_code, SandboxPool
    result = run_code("print(sum(range(10)))")           # result.ok, result.stdout == "45\\n"
    result = run_code("print(input()[::-1])", stdin="abc", timeout_s=2.0, files={"data.txt": "1 2 3"})
    with SandboxPool(max_workers=8) as pool:              # tool calls alongside decoding
        futures = [pool.submit(code, timeout_s=5.0) for code in programs]

The program is written to main.py in the working directory and run as `python3 -I -S -u main.py`: a file rather than
`-c` so that a traceback quotes the failing line (`File "/tmp/main.py", line 3` and its source), which the policy can
use, and so that no program is too long for one argument (Linux caps one at 128 KiB). `-I` isolated mode (no
PYTHON* variables, no user site), `-S` no site-packages (the standard library only), `-u` unbuffered, so that what a
program printed before a timeout reaches the result. The interpreter is the system's python3 (/usr/local/bin,
/usr/bin, /bin), else the trainer's own: the first that works in the sandbox, as found by running `pass` in it.

What the local backend does, in this order (`_sandbox_init` below is the part that runs inside):
  1. Where the machine lets this process make one (see "Memory" below), a memory cgroup for the call, limited to
     memory_mb: the sandbox's first process joins it before anything else, so everything the call starts counts.
  2. `unshare --net --pid --fork --kill-child --mount-proc --ipc --uts` makes new namespaces. Network: only a
     loopback that is down, so nothing connects anywhere, not even to 127.0.0.1. PID: the program is PID 1 of its
     own namespace; when it dies the kernel kills every process left in the namespace (a fork bomb, a daemonised
     child), and it sees and can signal no process outside it. Mount: the changes below are the child's alone.
  3. The whole mount tree is made read-only, nosuid and nodev, recursively (mount_setattr(2), Linux 5.12+): no
     device node of the machine can be opened from any mount (a world-writable /dev/nvidia* on a GPU machine,
     /dev/kmsg). On top: a new /dev, an empty read-only tmpfs with bind mounts of DEVICES (null, zero, full,
     random, urandom: the only mounts without nodev), the fd/stdin/stdout/stderr links and a private /dev/shm; a
     private tmpfs of WORKDIR_MB on /tmp, the working directory (HOME and TMPDIR too), gone with the namespace; an
     empty read-only tmpfs over the trainer's home directory, where credentials live (~/.cache/huggingface/token,
     ~/.netrc, ~/.modal.toml), over its working directory (run directories) and over the checkout ppo_core is
     imported from (the repository), each unless the interpreter itself lives there.
  4. Privileges: the capability bounding set emptied, no_new_privs (setuid binaries gain nothing), and, as root, a
     switch to a uid of its own for this one call (SANDBOX_UID_BASE + n): so it can read only world-readable files,
     and RLIMIT_NPROC, which the kernel never applies to root, holds (a uid per call: concurrent calls do not share
     the count). The parent-death signal is set again afterwards (a uid change clears it): if the launcher dies,
     the program dies.
  5. rlimits: CPU seconds (timeout + 1), address space (memory_mb, per process: a single process past it gets a
     MemoryError, which the policy can read), MAX_PROCESSES processes and threads, FILE_SIZE_MB per file,
     MAX_OPEN_FILES, no core files.
  6. The environment is built from scratch (CHILD_ENV): nothing of the trainer's (HF_TOKEN, WANDB_API_KEY, ...).
  7. On the host: a wall-clock deadline from launch; past it the process group (unshare and the program) gets
     SIGKILL, and through --kill-child and the PID namespace so does everything it started. stdout and stderr are
     read as they come: the first OUTPUT_LIMIT_BYTES of each are kept, the rest drained and counted; a stream past
     OUTPUT_KILL_BYTES ends the run (no answer needs 16 MiB, and draining more only spends the trainer's CPU).
No preexec_fn: SandboxPool calls run_code from threads, and preexec_fn is not safe in a threaded parent (the
subprocess documentation says so); everything runs in the child, after exec.

NETWORK_ISOLATION (module attribute, read lazily: the first read runs the probe) says which of these is in use,
tried in this order:
  - as root: the namespaces above, the program as its own uid;
  - otherwise, where unprivileged user namespaces are allowed: the same inside a user namespace
    (`unshare --user --map-root-user ...`), where the program is the trainer's own user, without capabilities;
  - neither: "none: <why>", and run_code raises SandboxUnavailable. There is no unisolated mode.
Each is tried with the memory cgroup first, then without it (where joining one fails); the description says which.

Memory: the bound on a call as a whole is memory_mb only where it runs in a cgroup. The first of these in which
this process can make a group and write its limit is used (probed once; memory_bound_per_call() and
NETWORK_ISOLATION say which): under its own cgroup v2 (a delegated subtree, or the root of the hierarchy with the
memory controller enabled for its children), beside it (its parent's children have the controller: a systemd scope
as root), or under its own group of the cgroup v1 memory controller. Swap is held to the same bound where the kernel
counts it. Past the bound the kernel kills the call's largest process, and the result's error says so. Without a
cgroup (an unprivileged trainer without a delegated subtree, a container whose cgroup is read-only), RLIMIT_AS is
the only bound and it is per process: a call can hold up to MAX_PROCESSES x memory_mb (32 x 512 MB = 16 GB by
default) plus 2 x WORKDIR_MB of tmpfs (/tmp, /dev/shm); on such a machine run the trainer where that much is
affordable, or use the modal backend, whose memory limit covers the container.

What this does NOT protect against:
  - reading what is world-readable outside the hidden folders (/etc, other users' files, model weights elsewhere,
    /proc and /sys); as the fallback user namespace, everything the trainer's user can read outside them;
  - unix sockets on the filesystem that the program's user may connect to (connect() works on a read-only mount);
  - memory beyond memory_mb per process where no cgroup can be made (above);
  - CPU time until the deadline, and the kernel itself (no seccomp filter: a kernel exploit escapes).
It needs Linux 5.12+ and util-linux's unshare; the probe says so (NETWORK_ISOLATION) where either is missing.

The modal backend (scripts/modal_sandbox.py, loaded from the repository checkout when asked for: the library never
imports modal) runs the same command in a Modal Sandbox (a gVisor container by default, `block_network=True`,
a memory limit, a lifetime), with the program and files written in and the output read back and bounded the same
way. Its pure parts (`modal_sandbox_args`, `modal_exec_args`, `modal_result`, `drain_into`) are tested without
Modal; nothing here has run against Modal itself (no credentials where it was written).
"""
import concurrent.futures
import functools
import importlib.util
import inspect
import itertools
import marshal
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

OUTPUT_LIMIT_BYTES = 64 * 1024  # kept of each of stdout and stderr
OUTPUT_KILL_BYTES = 16 * 1024 * 1024  # a stream past this ends the run
WORKDIR = "/tmp"  # the working directory inside the sandbox: a private tmpfs
WORKDIR_MB = 64  # size of that tmpfs (and of the private /dev/shm)
FILE_SIZE_MB = 16  # RLIMIT_FSIZE: the largest file the program may write
MAX_PROCESSES = 32  # RLIMIT_NPROC: processes and threads of the sandbox's uid
MAX_OPEN_FILES = 256  # RLIMIT_NOFILE
DEVICES = ("null", "zero", "full", "random", "urandom")  # the only device nodes in the sandbox's /dev
SANDBOX_UID_BASE = 2_000_000_000  # as root, each call runs as a uid of its own from here: no user has these
MAIN = "main.py"
PYTHON_FLAGS = ("-I", "-S", "-u")
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
# The program's whole environment.
CHILD_ENV = {"PATH": SYSTEM_PATH, "HOME": WORKDIR, "TMPDIR": WORKDIR, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
# Exit status of _sandbox_init when it could not build the sandbox, with a line on stderr starting with this.
SETUP_FAILED_STATUS = 125
SETUP_FAILED = "ppo-sandbox: setup failed"


class SandboxUnavailable(RuntimeError):
    """Nothing on this machine isolates the child's network: run_code refuses rather than run without it."""


@dataclass
class SandboxResult:
    stdout: str
    """The program's stdout, its first OUTPUT_LIMIT_BYTES (decoded as UTF-8, bad bytes replaced)."""
    stderr: str
    """The program's stderr, bounded the same way (a traceback ends up here)."""
    exit_code: int | None
    """The program's exit status; None when a signal ended it (a timeout, the output cap, a crash) or it never ran."""
    timed_out: bool
    """The wall-clock deadline passed and the run was killed."""
    wall_s: float
    """Seconds from launch until the process and its output were done."""
    truncated: bool
    """stdout or stderr was longer than OUTPUT_LIMIT_BYTES and was cut."""
    killed_by: str | None = None
    """The signal that ended the program ("SIGKILL" after a timeout, "SIGXCPU" at the CPU limit, "SIGSEGV", ...)."""
    error: str | None = None
    """Why the sandbox, not the program, failed or stopped the run (setup failed, output cap); None otherwise."""

    @property
    def ok(self) -> bool:
        """The program ran to the end and exited 0."""
        return self.exit_code == 0 and not self.timed_out


class BoundedOutput:
    """The first `limit` bytes of a stream and a count of all of it: memory stays bounded whatever the child
    writes."""

    def __init__(self, limit: int = OUTPUT_LIMIT_BYTES):
        self.limit, self.kept, self.total = limit, bytearray(), 0

    def add(self, chunk: bytes):
        room = self.limit - len(self.kept)
        if room > 0:
            self.kept += chunk[:room]
        self.total += len(chunk)

    @property
    def truncated(self) -> bool:
        return self.total > self.limit

    def text(self) -> str:
        # a cut can split a UTF-8 character: it becomes U+FFFD, never an exception
        return self.kept.decode("utf-8", errors="replace")


def check_files(files: dict | None) -> dict[str, bytes]:
    """run_code's `files` as {relative path: bytes}. A name must stay inside the working directory: plain relative
    parts ("data/in.txt"), no absolute path, no "." or ".." part, not main.py (the program's own file)."""
    checked = {}
    for name, content in (files or {}).items():
        if not isinstance(name, str) or not name or name.startswith("/") or "\0" in name:
            raise ValueError(f"files: {name!r} is not a relative file name")
        if any(part in ("", ".", "..") for part in name.split("/")):
            raise ValueError(f"files: {name!r} must be a plain relative path (no '..', '.' or empty part)")
        if name == MAIN:
            raise ValueError(f"files: {MAIN} is the program itself; pass the program as `code`")
        if isinstance(content, str):
            content = content.encode()
        if not isinstance(content, (bytes, bytearray)):
            raise ValueError(f"files: {name!r} must be str or bytes, got {type(content).__name__}")
        checked[name] = bytes(content)
    return checked


# ---------------------------------------------------------------------------- inside the sandbox

def _sandbox_init(setup_failed: str, setup_failed_status: int):
    """PID 1 of the new namespaces, as (namespace) root: join the call's memory cgroup, make the mounts read-only,
    nosuid and nodev, build the new /dev, mount the private tmpfs directories and hide the trainer's folders, drop
    privileges, write the program and its files, set the rlimits, exec the program.

    It runs in the child from its source text (`python -c`, see _INIT_PROGRAM), so it imports what it needs
    itself and uses nothing else from this module. Its instructions come first on stdin: a 16-digit length, then
    a marshal of {"config": ..., "files": {name: bytes}} (marshal is built into the interpreter: json would cost
    this start-up ~20 ms in imports); the rest of stdin is the program's. Any failure exits setup_failed_status
    with one line on stderr: the program never runs in a half-built sandbox."""
    import ctypes
    import marshal
    import os
    import resource

    libc = ctypes.CDLL(None, use_errno=True)
    SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE = 442, -100, 0x8000  # the same syscall number on every architecture
    MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV, MOUNT_ATTR_NOEXEC = 0x1, 0x2, 0x4, 0x8
    MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_MOVE = 0x1, 0x2, 0x4, 0x8, 0x1000, 0x2000
    PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 24, 38

    def fail(step, errno=None):
        reason = os.strerror(errno if errno is not None else ctypes.get_errno())
        os.write(2, f"{setup_failed} at {step}: {reason}\n".encode())
        os._exit(setup_failed_status)

    def mount_tmpfs(target, flags, options):
        if libc.mount(b"tmpfs", target.encode(), b"tmpfs", ctypes.c_ulong(flags), options.encode()) != 0:
            fail(f"mount tmpfs on {target}")

    def read_exactly(size):
        data = bytearray()
        while len(data) < size:
            chunk = os.read(0, size - len(data))
            if not chunk:
                fail("reading the program from stdin", errno=5)  # EIO: the launcher closed stdin early
            data += chunk
        return bytes(data)

    def set_mount_attributes(path, set_flags, clear_flags=0, recursive=False):
        attr = (ctypes.c_uint64 * 4)(set_flags, clear_flags, 0, 0)  # struct mount_attr: set, clear, propagation, userns
        flags = ctypes.c_uint(AT_RECURSIVE if recursive else 0)
        if libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), path.encode(), flags, attr,
                        ctypes.c_size_t(ctypes.sizeof(attr))) != 0:
            fail(f"mount_setattr (Linux 5.12+) on {path}")

    instructions = marshal.loads(read_exactly(int(read_exactly(16))))
    config, files = instructions["config"], instructions["files"]

    if config["cgroup"]:  # first: everything this process starts from now on is charged to the call's memory bound
        try:
            with open(os.path.join(config["cgroup"], "cgroup.procs"), "w") as f:
                f.write("0")  # 0: the writer itself
        except OSError as e:
            fail("joining the call's memory cgroup", e.errno)

    # the whole tree read-only, nosuid and nodev, every mount below / included (/proc, /dev, /sys, ...): no device
    # node anywhere can be opened (a world-writable /dev/nvidia*, /dev/kmsg), but for the few the new /dev holds
    set_mount_attributes("/", MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, recursive=True)
    uid = config["uid"] if config["uid"] is not None else 0
    mount_tmpfs(config["workdir"], MS_NOSUID | MS_NODEV,
                f"size={config['workdir_mb']}m,nr_inodes=16384,mode=0700,uid={uid},gid={uid}")
    # a new /dev: built on a tmpfs in the working directory, bind mounts of the harmless device nodes (the only
    # mounts without nodev), then moved over /dev, which hides every other node of the machine's
    try:
        staging = os.path.join(config["workdir"], ".dev")
        os.mkdir(staging)
        mount_tmpfs(staging, MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=64k,nr_inodes=64,mode=0755")
        for name in config["devices"]:
            if os.path.exists("/dev/" + name):
                open(os.path.join(staging, name), "w").close()
                if libc.mount(f"/dev/{name}".encode(), os.path.join(staging, name).encode(), None,
                              ctypes.c_ulong(MS_BIND), None) != 0:
                    fail(f"bind-mounting /dev/{name}")
                set_mount_attributes(os.path.join(staging, name), MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID
                                     | MOUNT_ATTR_NOEXEC, clear_flags=MOUNT_ATTR_NODEV)
        for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                             ("stderr", "/proc/self/fd/2")):
            os.symlink(target, os.path.join(staging, name))
        os.mkdir(os.path.join(staging, "shm"))
        set_mount_attributes(staging, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC)
        if libc.mount(staging.encode(), b"/dev", None, ctypes.c_ulong(MS_MOVE), None) != 0:
            fail("moving the new /dev into place")
        os.rmdir(staging)
    except OSError as e:
        fail("building /dev", e.errno)
    mount_tmpfs("/dev/shm", MS_NOSUID | MS_NODEV, f"size={config['workdir_mb']}m,nr_inodes=1024,mode=1777")
    for folder in config["hide"]:  # the trainer's home directory and working tree: an empty read-only tmpfs over each
        mount_tmpfs(folder, MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,nr_inodes=1,mode=0755")

    with open("/proc/sys/kernel/cap_last_cap") as f:
        last_cap = int(f.read())
    for cap in range(last_cap + 1):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            fail(f"dropping capability {cap}")
    try:
        if config["uid"] is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
    except OSError as e:
        fail("switching to the sandbox uid", e.errno)
    # after the uid change, which clears the parent-death signal that unshare --kill-child set
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0) != 0:
        fail("prctl")

    try:
        os.chdir(config["workdir"])
        for name, content in files.items():  # as the sandbox's uid, into its own tmpfs
            if os.path.dirname(name):
                os.makedirs(os.path.dirname(name), exist_ok=True)
            with open(name, "wb") as f:
                f.write(content)
        for limit, value in config["rlimits"].items():
            resource.setrlimit(getattr(resource, limit), value)
        os.execve(config["argv"][0], config["argv"], config["env"])
    except OSError as e:
        fail("starting the program", e.errno)


# `python -I -S -c _INIT_PROGRAM`
_INIT_PROGRAM = inspect.getsource(_sandbox_init) + f"\n_sandbox_init({SETUP_FAILED!r}, {SETUP_FAILED_STATUS})\n"


# ---------------------------------------------------------------------------- the local backend

@dataclass(frozen=True)
class _Launcher:
    description: str
    """What NETWORK_ISOLATION says."""
    unshare: tuple
    """The unshare command that makes the namespaces."""
    python: str
    """The interpreter, as a real path (a symlinked venv python would need its venv, maybe under the hidden home)."""
    own_uid: bool
    """Switch to a uid of its own (as root)."""
    memory_cgroup: bool
    """Each call in a memory cgroup of its own (_memory_cgroup), which bounds all its processes together."""


_next_uid = itertools.count()


def _python_candidates() -> list[str]:
    found = [shutil.which("python3", path=SYSTEM_PATH), sys.executable]
    return list(dict.fromkeys(os.path.realpath(path) for path in found if path))


def _folders_to_hide(python: str) -> list[str]:
    """The trainer's home directory (where credentials live), its working directory and the checkout ppo_core is
    imported from (the repository: its code, configs, run directories), each unless it would hide the interpreter,
    is /, holds or lies in /tmp, or lies in one already hidden."""
    home = os.path.expanduser("~")
    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        cwd = os.getcwd()
    except OSError:  # a working directory deleted since: nothing there to hide
        cwd = home
    inside = lambda path, folder: path == folder or path.startswith(folder.rstrip("/") + "/")  # noqa: E731
    hidden = []
    for folder in sorted({os.path.realpath(path) for path in (home, cwd, checkout)}, key=len):
        if (os.path.isdir(folder) and folder != "/" and not inside(python, folder) and not inside(WORKDIR, folder)
                and not inside(folder, WORKDIR) and not any(inside(folder, outer) for outer in hidden)):
            hidden.append(folder)
    return hidden


# ---------------------------------------------------------------------------- the memory cgroup

_next_cgroup = itertools.count()


def _cgroup_candidates() -> list[tuple[str, str]]:
    """(folder, limit file) where this process might make a memory cgroup per call, in the order tried: under its own
    cgroup v2 or beside it (where the memory controller is enabled for the children: a delegated subtree, or the
    root of the hierarchy), then under its own group of the cgroup v1 memory controller."""
    mounts = {}  # "cgroup2" or "memory" -> (mount point, the mount's root within the hierarchy)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            fstype, options = fields[fields.index("-") + 1], fields[-1].split(",")
            if fstype == "cgroup2" or (fstype == "cgroup" and "memory" in options):
                mounts.setdefault("cgroup2" if fstype == "cgroup2" else "memory", (fields[4], fields[3]))
    candidates = []
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            kind = "cgroup2" if controllers == "" else "memory" if "memory" in controllers.split(",") else None
            if kind not in mounts:
                continue
            mount_point, root = mounts[kind]
            relative = os.path.relpath(path, root)
            if relative.startswith(".."):  # outside what is mounted here
                continue
            own = mount_point if relative == "." else os.path.join(mount_point, relative)
            if kind == "cgroup2":
                candidates.append((own, "memory.max"))
                if own != mount_point:
                    candidates.append((os.path.dirname(own), "memory.max"))
            else:
                candidates.append((own, "memory.limit_in_bytes"))
    return candidates


@functools.lru_cache(maxsize=None)
def _memory_cgroup() -> tuple[tuple[str, str] | None, str]:
    """The first of _cgroup_candidates in which a group can be made and given a memory limit here, and why none
    could (runs once per process)."""
    failures = []
    for folder, limit_file in _cgroup_candidates():
        probe = os.path.join(folder, f"ppo-sandbox-{os.getpid()}-probe")
        try:
            os.mkdir(probe)
            try:
                with open(os.path.join(probe, limit_file), "w") as f:
                    f.write(str(64 << 20))
            finally:
                os.rmdir(probe)
            return (folder, limit_file), f"{folder} ({limit_file})"
        except OSError as e:
            failures.append(f"{folder}: {e.strerror}")
    return None, "; ".join(failures) or "no cgroup v2 or v1 memory controller mounted"


def _make_call_cgroup(memory_mb: int) -> str | None:
    """A new memory cgroup for one call, limited to memory_mb (swap included where the kernel counts it); None where
    the machine gives none. Raises OSError when one was available but could not be made."""
    found, _ = _memory_cgroup()
    if found is None:
        return None
    folder, limit_file = found
    path = os.path.join(folder, f"ppo-sandbox-{os.getpid()}-{next(_next_cgroup)}")
    os.mkdir(path)
    # no swap beyond the bound (v2: swap counted apart; v1: memory + swap together); absent without swap accounting
    swap_file, swap_value = (("memory.swap.max", 0) if limit_file == "memory.max"
                             else ("memory.memsw.limit_in_bytes", memory_mb << 20))
    try:
        with open(os.path.join(path, limit_file), "w") as f:
            f.write(str(memory_mb << 20))
        if os.path.exists(os.path.join(path, swap_file)):
            with open(os.path.join(path, swap_file), "w") as f:
                f.write(str(swap_value))
    except OSError:
        os.rmdir(path)
        raise
    return path


def _remove_call_cgroup(path: str) -> int:
    """Remove a call's cgroup once its processes are gone -> how many processes the kernel killed at its memory
    bound. The PID namespace's last processes can take a moment to be reaped after unshare: retried for 2 s."""
    oom_kills = 0
    for events in ("memory.events", "memory.oom_control"):  # v2, v1: a line "oom_kill N"
        try:
            with open(os.path.join(path, events)) as f:
                oom_kills = max([oom_kills] + [int(line.split()[1]) for line in f if line.startswith("oom_kill ")])
        except OSError:
            pass
    for _ in range(100):
        try:
            os.rmdir(path)
            break
        except FileNotFoundError:
            break
        except OSError:
            time.sleep(0.02)
    return oom_kills


def _run_local(launcher: _Launcher, code: str, stdin: bytes, timeout_s: float, memory_mb: int,
               files: dict[str, bytes]) -> SandboxResult:
    cpu_s = math.ceil(timeout_s) + 1
    uid = None
    if launcher.own_uid:  # unique among this process's calls in flight (up to 1000), most likely among others'
        uid = SANDBOX_UID_BASE + (os.getpid() % 1000) * 1000 + next(_next_uid) % 1000
    start = time.monotonic()
    try:
        cgroup = _make_call_cgroup(memory_mb) if launcher.memory_cgroup else None
    except OSError as e:
        return SandboxResult(stdout="", stderr="", exit_code=None, timed_out=False, wall_s=time.monotonic() - start,
                             truncated=False, error=f"{SETUP_FAILED} at making the call's memory cgroup: {e}")
    config = {
        "uid": uid, "cgroup": cgroup,
        "workdir": WORKDIR, "workdir_mb": WORKDIR_MB, "hide": _folders_to_hide(launcher.python), "devices": DEVICES,
        "argv": [launcher.python, *PYTHON_FLAGS, MAIN], "env": CHILD_ENV,
        "rlimits": {"RLIMIT_CPU": (cpu_s, cpu_s + 1),  # SIGXCPU at the soft limit, SIGKILL at the hard one
                    "RLIMIT_AS": (memory_mb << 20,) * 2, "RLIMIT_NPROC": (MAX_PROCESSES,) * 2,
                    "RLIMIT_FSIZE": (FILE_SIZE_MB << 20,) * 2, "RLIMIT_NOFILE": (MAX_OPEN_FILES,) * 2,
                    "RLIMIT_CORE": (0, 0)},
    }
    # marshal format 4 (Python 3.4+): readable by whichever python3 the child runs
    instructions = marshal.dumps({"config": config, "files": {MAIN: code.encode(), **files}}, 4)
    argv = [*launcher.unshare, launcher.python, "-I", "-S", "-c", _INIT_PROGRAM]
    # start_new_session: unshare and the namespace's PID 1 form a process group, killed as one at the deadline
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={"PATH": SYSTEM_PATH, "LANG": "C.UTF-8"}, start_new_session=True)
    stdout, stderr, stopped = _communicate(proc, b"%016d" % len(instructions) + instructions + stdin, start + timeout_s)
    wall_s = time.monotonic() - start
    oom_kills = _remove_call_cgroup(cgroup) if cgroup is not None else 0

    exit_code = proc.returncode if proc.returncode >= 0 else None
    killed_by = signal.Signals(-proc.returncode).name if proc.returncode < 0 else None
    error = {"output": f"output passed {OUTPUT_KILL_BYTES >> 20} MiB: the run was killed"}.get(stopped)
    if exit_code == SETUP_FAILED_STATUS and stderr.text().startswith(SETUP_FAILED):
        exit_code, error = None, stderr.text().strip()
    if oom_kills and error is None:
        error = (f"the call's memory bound ({memory_mb} MiB, all its processes together) was reached: the kernel "
                 f"killed {oom_kills} process{'es' if oom_kills > 1 else ''}")
    return SandboxResult(stdout=stdout.text(), stderr=stderr.text(), exit_code=exit_code,
                         timed_out=stopped == "timeout", wall_s=wall_s,
                         truncated=stdout.truncated or stderr.truncated, killed_by=killed_by, error=error)


def _communicate(proc: subprocess.Popen, stdin: bytes,
                 deadline: float) -> tuple[BoundedOutput, BoundedOutput, str | None]:
    """Popen.communicate with bounds: feed stdin, read stdout and stderr into BoundedOutput, kill the process group
    at the deadline or when a stream passes OUTPUT_KILL_BYTES. Returns (stdout, stderr, why it was stopped:
    "timeout", "output" or None) once the process has exited and its streams are closed."""
    stdout, stderr = BoundedOutput(), BoundedOutput()
    outputs = {proc.stdout.fileno(): stdout, proc.stderr.fileno(): stderr}
    stdin_fd, written = proc.stdin.fileno(), 0
    os.set_blocking(stdin_fd, False)
    stopped = None

    def kill(why):
        nonlocal stopped, deadline
        stopped = stopped or why
        deadline = time.monotonic() + 2.0  # to see the streams close: the kernel empties the namespace
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # unshare has not been reaped yet: its pid is not reused
        except ProcessLookupError:
            pass

    with selectors.DefaultSelector() as selector:
        for fd in outputs:
            selector.register(fd, selectors.EVENT_READ)
        selector.register(stdin_fd, selectors.EVENT_WRITE)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if stopped:
                    break  # killed, yet something holds a stream open: stop waiting for it
                kill("timeout")
                continue
            for key, _ in selector.select(remaining):
                if key.fd == stdin_fd:
                    try:
                        written += os.write(stdin_fd, stdin[written:written + 65536])
                    except BlockingIOError:  # the pipe filled up meanwhile: the next select says when
                        continue
                    except BrokenPipeError:  # the program stopped reading: the rest is dropped
                        written = len(stdin)
                    if written == len(stdin):
                        selector.unregister(stdin_fd)
                        proc.stdin.close()
                    continue
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                outputs[key.fd].add(chunk)
                if outputs[key.fd].total > OUTPUT_KILL_BYTES and not stopped:
                    kill("output")
    if not proc.stdin.closed:
        proc.stdin.close()
    try:  # the streams can close before the process exits (it closed them itself)
        proc.wait(max(deadline - time.monotonic(), 0))
    except subprocess.TimeoutExpired:
        kill("timeout")
        proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    return stdout, stderr, stopped


@functools.lru_cache(maxsize=None)
def _find_launcher() -> tuple[_Launcher | None, str]:
    """The first launcher that runs `pass` in a sandbox here, tried in the order the module docstring gives, and a
    description of it (or of why none works). Runs once per process."""
    unshare = shutil.which("unshare") or shutil.which("unshare", path="/usr/bin:/bin")
    if unshare is None:
        return None, "none: no unshare command (util-linux)"
    namespaces = ("--net", "--pid", "--fork", "--kill-child", "--mount-proc", "--ipc", "--uts")
    modes = [("user namespace (unshare --user --map-root-user --net --pid --mount --ipc --uts), the program as the "
              "trainer's user without capabilities", (unshare, "--user", "--map-root-user", *namespaces), False)]
    if os.geteuid() == 0:
        modes.insert(0, ("namespaces (unshare --net --pid --mount --ipc --uts) as root, the program as a uid of its "
                         "own", (unshare, *namespaces), True))
    cgroup, where = _memory_cgroup()
    no_cgroup = where
    failures = []
    for description, command, own_uid in modes:
        for python in _python_candidates():
            for memory_cgroup in [True, False] if cgroup else [False]:  # without the cgroup where joining it fails
                memory = (f"memory: a cgroup per call under {where}" if memory_cgroup
                          else f"memory: per process only (RLIMIT_AS), no cgroup: {no_cgroup}")
                launcher = _Launcher(f"{description}; {python}; {memory}", command, python, own_uid, memory_cgroup)
                probe = _run_local(launcher, "pass", b"", timeout_s=10.0, memory_mb=256, files={})
                if probe.ok:
                    return launcher, launcher.description
                why = probe.error or probe.stderr.strip()[-200:] or f"exit status {probe.exit_code}"
                failures.append(f"{description.split(' (')[0]} with {python}{' in a cgroup' * memory_cgroup}: {why}")
                if memory_cgroup:
                    no_cgroup = f"joining one under {where} failed: {why}"
    return None, "none: " + "; ".join(failures)


def isolation() -> str:
    """What isolates the sandbox here (the first call probes, later ones are free); "none: <why>" where nothing
    does."""
    return _find_launcher()[1]


def memory_bound_per_call() -> bool:
    """Whether each call runs in a memory cgroup of its own, which bounds its processes together (and the files it
    writes to its tmpfs); False: memory_mb bounds each process only (see the module docstring)."""
    launcher = _find_launcher()[0]
    return bool(launcher and launcher.memory_cgroup)


def interpreter() -> str | None:
    """The python3 the sandbox runs programs with (a real path); None where there is no sandbox."""
    launcher = _find_launcher()[0]
    return launcher.python if launcher else None


def __getattr__(name):  # PEP 562: NETWORK_ISOLATION is probed on first read, not at import
    if name == "NETWORK_ISOLATION":
        return isolation()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------- the modal backend

MODAL_APP_NAME = "ppo-core-sandbox"
MODAL_PYTHON_VERSION = "3.11"
MODAL_WORKDIR = "/sandbox"
MODAL_STARTUP_S = 60  # the Sandbox's lifetime beyond the program's timeout: creation and writing the files


def modal_sandbox_args(timeout_s: float, memory_mb: int) -> dict:
    """Keyword arguments for modal.Sandbox.create (besides app and image): no network at all, a memory limit
    (request and limit, MiB), one CPU, a lifetime after which Modal ends it whatever happens here."""
    return {"block_network": True, "timeout": math.ceil(timeout_s) + MODAL_STARTUP_S,
            "memory": (memory_mb, memory_mb), "cpu": 1.0, "workdir": MODAL_WORKDIR}


def modal_exec_args(timeout_s: float) -> dict:
    """Keyword arguments for Sandbox.exec: the program's timeout (whole seconds: Modal's unit), its working
    directory, the environment built from scratch, bytes rather than text (bounded the same way as locally)."""
    env = dict(CHILD_ENV, HOME=MODAL_WORKDIR, TMPDIR=MODAL_WORKDIR)
    return {"timeout": math.ceil(timeout_s), "workdir": MODAL_WORKDIR, "env": env, "text": False}


def modal_command() -> list[str]:
    """The program's command line in the Modal image: the local one, with the image's python3."""
    return ["python3", *PYTHON_FLAGS, MAIN]


def drain_into(chunks, output: BoundedOutput) -> bool:
    """Read a stream of chunks (bytes or str) into `output`; stop and return True once it passes
    OUTPUT_KILL_BYTES."""
    for chunk in chunks:
        output.add(chunk.encode() if isinstance(chunk, str) else chunk)
        if output.total > OUTPUT_KILL_BYTES:
            return True
    return False


def modal_result(returncode: int | None, stdout: BoundedOutput, stderr: BoundedOutput, wall_s: float,
                 output_capped: bool) -> SandboxResult:
    """A Modal exec's outcome as a SandboxResult. Modal reports an exec past its timeout as returncode -1, and a
    signal as 128 + its number, which is kept as the exit code (it cannot be told from the program's own exit)."""
    timed_out = returncode == -1
    error = f"output passed {OUTPUT_KILL_BYTES >> 20} MiB: the run was killed" if output_capped else None
    return SandboxResult(stdout=stdout.text(), stderr=stderr.text(),
                         exit_code=None if timed_out or output_capped else returncode, timed_out=timed_out,
                         wall_s=wall_s, truncated=stdout.truncated or stderr.truncated, error=error)


MODAL_RUNNER = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts", "modal_sandbox.py")


def _run_modal(code: str, stdin: bytes, timeout_s: float, memory_mb: int, files: dict[str, bytes]) -> SandboxResult:
    """The modal backend: scripts/modal_sandbox.py's run (the library itself never imports modal: Modal lives in
    scripts/, as the launchers do), loaded from the repository checkout."""
    if not os.path.isfile(MODAL_RUNNER):
        raise SandboxUnavailable(f"the modal backend runs {MODAL_RUNNER}, which this installation lacks (it ships "
                                 f"with the repository, not the package)")
    spec = importlib.util.spec_from_file_location("ppo_modal_sandbox", MODAL_RUNNER)
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    return runner.run(code, stdin, timeout_s, memory_mb, files)


# ---------------------------------------------------------------------------- the entry points

def run_code(code: str, *, stdin: str | bytes = "", timeout_s: float = 5.0, memory_mb: int = 512,
             files: dict[str, str | bytes] | None = None, backend: str = "local") -> SandboxResult:
    """Run a Python program in a sandbox; a failing, hanging or hostile program is a failed SandboxResult, never an
    exception here. Raises ValueError for bad arguments (a file name outside the working directory) and
    SandboxUnavailable where nothing can isolate the network (local backend)."""
    if not isinstance(code, str):
        raise ValueError(f"code must be str, got {type(code).__name__}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if not memory_mb >= 64:
        raise ValueError(f"memory_mb must be >= 64 (the interpreter itself needs ~30 MB), got {memory_mb}")
    checked = check_files(files)
    stdin = stdin.encode() if isinstance(stdin, str) else bytes(stdin)
    if backend == "modal":
        return _run_modal(code, stdin, timeout_s, memory_mb, checked)
    if backend != "local":
        raise ValueError(f"backend must be 'local' or 'modal', got {backend!r}")
    launcher, description = _find_launcher()
    if launcher is None:
        raise SandboxUnavailable(f"no way to run code without network on this machine: {description}")
    return _run_local(launcher, code, stdin, timeout_s, memory_mb, checked)


class SandboxPool:
    """run_code on worker threads, so that tool calls run alongside decoding. Each call is a subprocess (or a Modal
    Sandbox): the threads only wait, and the GIL is no bottleneck.

        with SandboxPool(max_workers=8) as pool:
            future = pool.submit("print(6 * 7)", timeout_s=2.0)
            future.result().stdout   # "42\\n"
    """

    def __init__(self, max_workers: int = 8):
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="sandbox")

    def submit(self, code: str, **kwargs) -> "concurrent.futures.Future[SandboxResult]":
        """run_code(code, **kwargs) on a worker; the Future holds its SandboxResult."""
        return self.executor.submit(run_code, code, **kwargs)

    def shutdown(self, wait: bool = True):
        self.executor.shutdown(wait=wait, cancel_futures=not wait)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
