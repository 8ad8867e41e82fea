"""The first hour's faults that no single line of input shows (issue 38, items 9 and 10): a batch the data or the
memory cannot hold is refused before any work; a second SIGTERM, or stop_grace_s after the first, abandons the
iteration in flight with the last checkpoint intact (exit 143, one line, --resume works); a reward file that does not
import is one line naming its file and line, exit 2, with the traceback in the run's error.log."""
import json
import math
import signal
import subprocess
import sys
import time

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
