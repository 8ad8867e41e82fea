"""The first hour's faults that no single line of input shows (issue 38, items 9 and 10): a batch the data or the
memory cannot hold is refused before any work; a second SIGTERM, or stop_grace_s after the first, abandons the
iteration in flight with the last checkpoint intact (exit 143, one line, --resume works); a reward file that does not
import is one line naming its file and line, exit 2, with the traceback in the run's error.log. Issue 47: stop_grace_s
is kept even where the iteration is stuck out of the interpreter's reach, and a stop before the first checkpoint does
not say "resume with"."""
import json
import math
import signal
import subprocess
import sys
import time

import pytest
import torch

from ppo_core.run import plan
from ppo_core.data.tasks import eval_prompts
from ppo_core.train import main

SMALL = ["--iterations=1", "--eval_size=8", "--rollout_batch_size=16", "--minibatch_size=16",
         "--micro_batch_size=16", "--ppo_epochs=1", "--progress=false"]


def one_line(capsys):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.rstrip("\n")


# ---------------------------------------------------------------------------- 9a: a batch the data or memory cannot hold

def test_a_batch_the_memory_cannot_hold_is_refused_before_any_work(tmp_path, capsys):
    available, where = plan.available_memory(torch.device("cpu"))
    # twice what the host term alone needs: whatever the machine, it cannot hold this batch
    rows = 32 * math.ceil(2 * available / plan.HOST_BYTES_PER_ROLLOUT_ROW / 32)
    assert main([f"--rollout_batch_size={rows}", "--minibatch_size=32", f"--out={tmp_path / 'run'}"]) == 2
    err = one_line(capsys)
    assert err.startswith(f"ppo-train: error: config key 'rollout_batch_size': a rollout of {rows} sequences of up to ")
    need = float(err.split(" need about ")[1].split(" GB")[0])
    assert need * 1e9 >= 1.9 * available  # at least the host term: 2x available, rounded
    assert f"this machine has {available / 1e9:.1f} GB ({where}); lower rollout_batch_size" in err \
        or f"GB ({where}); lower rollout_batch_size" in err  # MemAvailable moves a little between the two readings
    assert not (tmp_path / "run").exists()


def test_a_batch_larger_than_the_training_rows_is_refused(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(p + "\n" for p in eval_prompts(20, seed=5)))  # 20 rows, the last 8 held out (eval_size 8)
    assert main([f"--prompts_file={prompts}", f"--out={tmp_path / 'run'}", *SMALL]) == 2
    assert one_line(capsys) == (f"ppo-train: error: config key 'rollout_batch_size': 16 prompts per iteration, but "
                                f"{prompts} holds 12 training rows (held-out rows apart); lower rollout_batch_size to "
                                f"at most 12 (and raise n_samples_per_prompt to sample each prompt more than once)")
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------- 9b: a run that must stop now

SLOW = ["--iterations=2", "--save_every=1", "--eval_size=8", "--rollout_batch_size=1024", "--minibatch_size=1024",
        "--micro_batch_size=64", "--ppo_epochs=1", "--progress=false"]


def start_and_stop(run_dir, extra, signals):
    """ppo-train on the demo; once iteration 1's checkpoint is saved, `signals` SIGTERMs 0.2 s apart, in iteration 2's
    work (an iteration of 1024 rollouts takes about 3 s on an idle 2-core Zen 4, longer under load: the signals and a
    short stop_grace_s land inside its work on any machine; 256 rollouts took 0.7 s, too short). -> (exit status,
    stderr, seconds from the first signal to the exit; the interpreter's own teardown of torch takes about 3 s of it
    on this 2-core machine)."""
    proc = subprocess.Popen([sys.executable, "-m", "ppo_core.train", *SLOW, *extra, f"--out={run_dir}"],
                            stderr=subprocess.PIPE, text=True, cwd=run_dir.parent)
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.time() + 120
    while not (latest.exists() and latest.read_text().strip() == "step-1") and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # past iteration 1's stop check: in iteration 2's rollout
    t0 = time.time()
    for i in range(signals):
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err, time.time() - t0


def test_a_second_sigterm_abandons_the_iteration_and_the_run_resumes(tmp_path):
    run_dir = tmp_path / "run"
    status, err, seconds = start_and_stop(run_dir, [], signals=2)
    assert status == 143 and seconds < 10, (seconds, err[-2000:])
    assert err.splitlines()[-1] == (f"ppo-train: received SIGTERM, then SIGTERM: abandoned iteration 2; the checkpoint "
                                    f"of iteration 1 is intact; resume with: ppo-train --resume {run_dir}")
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 1  # no line of the abandoned iteration
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step-1"]  # nothing half-written
    resumed = subprocess.run([sys.executable, "-m", "ppo_core.train", "--resume", str(run_dir)], capture_output=True,
                             text=True, timeout=120, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming {run_dir} from {run_dir / 'checkpoints' / 'step-1'} (iteration 1 of 2)" in resumed.stderr
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_stop_grace_s_abandons_the_iteration_after_one_sigterm(tmp_path):
    run_dir = tmp_path / "run"
    status, err, seconds = start_and_stop(run_dir, ["--stop_grace_s=0.3"], signals=1)
    assert status == 143 and seconds < 10, (seconds, err[-2000:])
    assert err.splitlines()[-1] == (f"ppo-train: received SIGTERM 0.3 s ago (stop_grace_s): abandoned iteration 2; the "
                                    f"checkpoint of iteration 1 is intact; resume with: ppo-train --resume {run_dir}")


# ---------------------------------------------------------------------------- 10: a user file that does not import

def test_a_reward_file_with_a_syntax_error_is_one_line_and_error_log(tmp_path, capsys):
    module = tmp_path / "broken.py"
    module.write_text("def score(prompts, responses):\n    return [0.0 for r in responses\n\nx = 1\n")
    run_dir = tmp_path / "run"
    assert main([f"--reward_fn={module}:score", f"--out={run_dir}", *SMALL]) == 2
    err = one_line(capsys)
    assert err.startswith(f"ppo-train: error: cannot load reward_fn '{module}:score': SyntaxError: ")
    assert err.endswith(f"; raised at {module}:2; full traceback in {run_dir / 'error.log'}")
    log = (run_dir / "error.log").read_text()
    assert f'File "{module}", line 2' in log and "SyntaxError" in log.rstrip().splitlines()[-1]
    assert sorted(p.name for p in run_dir.iterdir()) == ["error.log"]  # no run was started: nothing else written


def test_a_reward_file_that_raises_at_import_is_one_line_and_error_log(tmp_path, capsys):
    module = tmp_path / "raises.py"
    module.write_text("import os\n\nTABLE = {'a': 1}\nLIMIT = TABLE['b']\n\ndef score(prompts, responses):\n"
                      "    return [0.0] * len(responses)\n")
    run_dir = tmp_path / "run"
    assert main([f"--reward_fn={module}:score", f"--out={run_dir}", *SMALL]) == 2
    assert one_line(capsys) == (f"ppo-train: error: cannot load reward_fn '{module}:score': KeyError: 'b'; raised at "
                                f"{module}:4; full traceback in {run_dir / 'error.log'}")
    log = (run_dir / "error.log").read_text()
    assert "Traceback (most recent call last):" in log and f'File "{module}", line 4, in <module>' in log
    assert log.rstrip().endswith("KeyError: 'b'")


def test_a_missing_function_names_the_file_and_what_it_defines(tmp_path, capsys):
    module = tmp_path / "rewards.py"
    module.write_text("def scorer(prompts, responses):\n    return [0.0] * len(responses)\n")
    assert main([f"--reward_fn={module}:score", f"--out={tmp_path / 'run'}", *SMALL]) == 2
    assert one_line(capsys) == (f"ppo-train: error: cannot load reward_fn '{module}:score': {module} has no 'score' "
                                f"(it defines: scorer)")


# ---------------------------------------------------------------------------- issue 47: a stop that must end now

STUCK = ["--iterations=2", "--save_every=1", "--eval_size=8", "--rollout_batch_size=16", "--minibatch_size=16",
         "--micro_batch_size=16", "--ppo_epochs=1", "--progress=false"]

# A reward function whose scoring, once the run has a checkpoint (iteration 2), sleeps for a minute in a thread of its
# own pool, as one that calls a slow service does; the main thread waits for the answer. The pool outlives the call,
# so the interpreter's exit would join its thread: a minute more.
POOL_REWARD = '''import concurrent.futures, os, time
POOL = concurrent.futures.ThreadPoolExecutor(1)
def score(prompts, responses):
    if os.path.exists({latest!r}) and not os.path.exists({stuck!r}):
        open({stuck!r}, "w").close()
        return POOL.submit(lambda: (time.sleep(60), [0.0] * len(responses))[1]).result()
    return [0.0] * len(responses)
'''

# ppo-train whose decode step, once the run has a checkpoint (iteration 2), does not come back to the interpreter for a
# minute, as a decode step of a large model on a loaded machine may not: no signal handler runs in the main thread
# meanwhile (its signals blocked while it sleeps: what a long call in C amounts to for Python's handlers).
SLOW_DECODE = '''import os, signal, sys, time
from ppo_core import train
from ppo_core.engine import rollout_engine
latest, stuck = sys.argv[1], sys.argv[2]
sample = rollout_engine.sample
def slow_sample(*args, **kwargs):
    if os.path.exists(latest) and not os.path.exists(stuck):
        open(stuck, "w").close()
        signals = {signal.SIGTERM, signal.SIGINT, signal.SIGALRM}
        signal.pthread_sigmask(signal.SIG_BLOCK, signals)
        time.sleep(60)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
    return sample(*args, **kwargs)
rollout_engine.sample = slow_sample
sys.exit(train.main(sys.argv[3:]))
'''


@pytest.mark.parametrize("where", ["reward_fn_pool", "decode_step"])
def test_stop_grace_s_is_kept_whatever_the_iteration_is_doing(tmp_path, where):
    """One SIGTERM while iteration 2 is stuck where the interpreter cannot stop it: the process is gone within a few
    seconds of stop_grace_s (not the minute the stuck call takes), exit 143, with the line saying what it abandoned;
    metrics.jsonl keeps iteration 1's whole line, the checkpoint of iteration 1 is intact, and the run resumes."""
    run_dir, stuck = tmp_path / "run", tmp_path / "stuck"
    latest = run_dir / "checkpoints" / "latest"
    args = [*STUCK, "--stop_grace_s=1", f"--out={run_dir}"]
    if where == "reward_fn_pool":
        reward = tmp_path / "pool_reward.py"
        reward.write_text(POOL_REWARD.format(latest=str(latest), stuck=str(stuck)))
        command = [sys.executable, "-m", "ppo_core.train", *args, f"--reward_fn={reward}:score"]
    else:
        command = [sys.executable, "-c", SLOW_DECODE, str(latest), str(stuck), *args]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        deadline = time.time() + 120
        while not stuck.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert stuck.exists(), proc.communicate()[1][-2000:]
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)  # the old loop: ~60 s, the stuck call's own time
        seconds = time.time() - t0
    finally:
        proc.kill()
    assert proc.returncode == 143 and seconds < 1 + 6, (seconds, err[-2000:])  # grace + HARD_STOP_S + start-up slack
    assert err.splitlines()[-1] == (f"ppo-train: received SIGTERM 1 s ago (stop_grace_s): abandoned iteration 2; the "
                                    f"checkpoint of iteration 1 is intact; resume with: ppo-train --resume {run_dir}")
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1]
    assert latest.read_text().strip() == "step-1"
    resumed = subprocess.run([*command[:command.index(args[0])], "--resume", str(run_dir)], capture_output=True,
                             text=True, timeout=120, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming {run_dir} from {run_dir / 'checkpoints' / 'step-1'} (iteration 1 of 2)" in resumed.stderr
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_a_stop_before_the_first_checkpoint_does_not_say_resume(tmp_path):
    """SIGTERM in iteration 1, abandoned after stop_grace_s: the line says there is nothing to resume, and no
    'resume with' (issue 47: it named a run directory with no checkpoint)."""
    run_dir, stuck = tmp_path / "run", tmp_path / "stuck"
    reward = tmp_path / "sleepy.py"  # the rollout's 16 responses (the evaluation scores 8 at a time)
    reward.write_text(f"import time\ndef score(prompts, responses):\n    if len(responses) == 16:\n"
                      f"        open({str(stuck)!r}, 'w').close()\n        time.sleep(60)\n"
                      f"    return [0.0] * len(responses)\n")
    proc = subprocess.Popen([sys.executable, "-m", "ppo_core.train", *STUCK, "--stop_grace_s=0.5",
                             f"--reward_fn={reward}:score", f"--out={run_dir}"], stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path)
    try:
        deadline = time.time() + 120
        while not stuck.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 143, err[-2000:]
    assert err.splitlines()[-1] == ("ppo-train: received SIGTERM 0.5 s ago (stop_grace_s): abandoned iteration 1; no "
                                    "checkpoint was saved yet, so there is nothing to resume: run the same command "
                                    "again to start over")
