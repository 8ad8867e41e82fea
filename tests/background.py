"""Long subprocess runs that tests read, started in the background as the suite begins, and runs launched side by side.

Every test runs in one thread (conftest.one_thread), and so does `ppo-train` (threads=1): on the 2-core machines
this suite is sized for, one core idles through most of it. So a test module lists the reference runs its fixtures
make (the default job in both precisions, the reference runs of the kill-and-resume and torchrun tests) as
`BACKGROUND = {fixture name: function that calls background.start(...)}`. After collection, tests/conftest.py calls
those whose fixture a selected test uses; they run one after another on one background lane while the other tests
run on the other core. The fixture takes its run with `background.result(key, cmd, cwd)`: the lane's result, waited
for, or the command run there and then when the lane has not reached it (or was never asked to). Same commands,
same checks, same results: only the time a run starts moves.

`together(*commands)`: independent launches of one test (a run and the run it must equal) at the same time.
"""
import os
import queue
import shutil
import subprocess
import tempfile
import threading

TIMEOUT_S = 600  # one run, as the tests' own subprocess.run calls allow

_lock = threading.Lock()
_jobs = {}  # key -> Job
_lane = queue.Queue()  # jobs in the order they were started
_base = None  # the directory runs started here write into; removed at the end of the session


class Job:
    def __init__(self, cmd, cwd, env):
        self.cmd, self.cwd, self.env = [str(c) for c in cmd], str(cwd), env
        self.state = "queued"  # -> "taken" (by the lane or by a test that needs it now)
        self.proc = None
        self.result = None
        self.done = threading.Event()

    def take(self) -> bool:
        """True for the one caller that gets to run this job."""
        with _lock:
            if self.state != "queued":
                return False
            self.state = "taken"
            return True

    def run(self):
        try:
            # output to files, not pipes: nobody reads a pipe while the job runs, and a full one would stall it
            with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
                self.proc = subprocess.Popen(self.cmd, cwd=self.cwd, env=self.env, stdout=out, stderr=err, text=True)
                try:
                    code = self.proc.wait(timeout=TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    code = self.proc.wait()
                out.seek(0)
                err.seek(0)
                self.result = subprocess.CompletedProcess(self.cmd, code, out.read(), err.read())
        except Exception as e:  # the test that reads it fails with this, instead of waiting forever
            self.result = subprocess.CompletedProcess(self.cmd, -1, "", f"background.Job: {e!r}")
        finally:
            self.done.set()


def _work():
    while True:
        job = _lane.get()
        if job is None:
            return
        if job.take():
            job.run()


def directory(key) -> str:
    """A directory for run `key`, the same one at collection and in the fixture (made on first use)."""
    global _base
    with _lock:
        if _base is None:
            _base = tempfile.mkdtemp(prefix="ppo-core-tests-")
    path = os.path.join(_base, key)
    os.makedirs(path, exist_ok=True)
    return path


def start(key, cmd, cwd, env=None):
    """Queue `cmd` (run in `cwd`, environment `env`) on the background lane under `key`."""
    job = Job(cmd, cwd, env)
    with _lock:
        first = not _jobs
        _jobs[key] = job
    if first:
        threading.Thread(target=_work, name="background-runs", daemon=True).start()
    _lane.put(job)


def result(key, cmd, cwd, env=None) -> subprocess.CompletedProcess:
    """Run `key`'s result: the background one (started with the same cmd), or cmd run now."""
    with _lock:
        job = _jobs.get(key)
    if job is None or job.cmd != [str(c) for c in cmd]:
        job = Job(cmd, cwd, env)
        with _lock:
            _jobs[key] = job
    if job.take():
        job.run()
    job.done.wait()
    return job.result


def together(*commands) -> list:
    """Launch every (cmd, cwd[, env]) at once; -> their CompletedProcess, in order."""
    jobs = [Job(*c) if len(c) == 3 else Job(*c, None) for c in commands]
    threads = [threading.Thread(target=j.run) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [j.result for j in jobs]


def stop():
    """End of the session: kill what still runs, drop what never started, remove the runs' directory."""
    with _lock:
        jobs = list(_jobs.values())
        for job in jobs:
            if job.state == "queued":
                job.state = "dropped"
    _lane.put(None)
    for job in jobs:
        if job.proc is not None and job.proc.poll() is None:
            job.proc.kill()
    if _base is not None:
        shutil.rmtree(_base, ignore_errors=True)
