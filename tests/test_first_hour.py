"""What a new user meets in the first hour, on the trainer's side (issue 12, the newcomer review): a checkpoint
without a chat template under --chat_template is one line and exit 2, and a resumed run's summary counts the time of
the whole run."""
import json
import signal
import subprocess
import sys

from ppo_core.train import DEMO_CHECKPOINT, main

from test_resume import DRIVER

SMALL = ["--iterations=3", "--save_every=1", "--eval_size=8", "--rollout_batch_size=8", "--minibatch_size=8",
         "--micro_batch_size=8", "--ppo_epochs=1", "--progress=false", "--max_new_tokens=6"]


def test_chat_template_on_a_checkpoint_without_one_is_one_line(tmp_path, capsys):
    assert main(["--chat_template", f"--out={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"ppo-train: error: config key 'chat_template': the policy {DEMO_CHECKPOINT} cannot render a chat")
    assert "drop --chat_template" in err
    assert not (tmp_path / "run").exists()


def test_summary_time_covers_the_whole_run_across_a_resume(tmp_path):
    run_dir = tmp_path / "run"
    # SIGKILL in the 3rd iteration's rollout (2 eval calls, then one generate per iteration): step-2 is saved
    killed = subprocess.run([sys.executable, "-c", DRIVER, "rollout", "5", *SMALL, f"--out={run_dir}"],
                            capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    with open(run_dir / "checkpoints" / "step-2" / "trainer_state.json") as f:
        before_kill = json.load(f)["elapsed_s"]  # the first segment's time up to its last save
    assert before_kill > 0
    resumed = subprocess.run([sys.executable, "-m", "ppo_core.train", "--resume", str(run_dir)], capture_output=True,
                             text=True, cwd=tmp_path, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    with open(run_dir / "summary.json") as f:
        total = json.load(f)["time/total_s"]
    with open(run_dir / "checkpoints" / "step-3" / "trainer_state.json") as f:
        at_last_save = json.load(f)["elapsed_s"]
    assert before_kill < at_last_save <= total  # the resumed segment adds to the first one's time
