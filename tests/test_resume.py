"""Runs you can trust: SIGKILL at several points (mid-rollout, mid-update, mid-save), resume, and get
the same final weights and metrics as a run that never stopped; NaN updates are skipped, then stop."""
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

import background
import ppo_core.train as train
import ppo_core.update as update
from ppo_core.config import build_config
from ppo_core.run.runlog import RunDir, RunDirError

ARGS = ["--iterations=3", "--save_every=1", "--eval_size=8", "--rollout_batch_size=16", "--minibatch_size=8",
        "--micro_batch_size=8", "--ppo_epochs=1", "--progress=false"]
WALL_CLOCK = ("time/", "tokens_per_s")

# A driver that runs the real trainer but SIGKILLs its own process at a chosen point: the n-th call
# of a function inside the loop. This is the test's fault injection; the trainer has no such switch.
DRIVER = r'''
import os, signal, sys
import ppo_core.train as train
import ppo_core.run.checkpoint as checkpoint
import ppo_core.rollout as rollout
where, n = sys.argv[1], int(sys.argv[2])
calls = [0]
def die_on_nth(fn, after=False):
    def wrapped(*a, **k):
        calls[0] += 1
        if calls[0] == n and not after:
            os.kill(os.getpid(), signal.SIGKILL)
        out = fn(*a, **k)
        if calls[0] == n and after:
            os.kill(os.getpid(), signal.SIGKILL)
        return out
    return wrapped
if where == "rollout":    # inside sampling: the decoder is called twice for the 'before' eval, then once an iteration
    rollout.RolloutEngine.generate = die_on_nth(rollout.RolloutEngine.generate)  # rollout_engine='paged'
    rollout.generate = die_on_nth(rollout.generate)  # rollout_engine='padded'
elif where == "update":   # inside the PPO update, between two micro-batch backward passes
    train.algo.value_loss = die_on_nth(train.algo.value_loss)
elif where == "save":     # inside a checkpoint save: after the n-th safetensors file is written, before the rename (2 calls a save)
    checkpoint.save_file = die_on_nth(checkpoint.save_file, after=True)
elif where == "pointer":  # the n-th save: step-N renamed into place, `latest` not yet pointing at it
    real_save = checkpoint.save_checkpoint
    saves = [0]
    def save_then_die_before_pointer(*a, **k):
        saves[0] += 1
        hook = (lambda stage: stage == "renamed" and os.kill(os.getpid(), signal.SIGKILL)) if saves[0] == n else None
        return real_save(*a, **k, write_hook=hook)
    checkpoint.save_checkpoint = save_then_die_before_pointer
sys.exit(train.main(sys.argv[3:]))
'''


def run_trainer(args, cwd):
    return subprocess.run([sys.executable, "-m", "ppo_core.train", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=600)


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [{k: v for k, v in r.items() if not k.startswith(WALL_CLOCK)} for r in rows]


def reference(key, extra):
    """A run that never stopped, with ARGS + extra -> (key, command, working directory, run directory)."""
    d = background.directory(key)
    return key, [sys.executable, "-m", "ppo_core.train", *ARGS, *extra, f"--out={d}/run"], d, pathlib.Path(d) / "run"


REFERENCES = {"reference_run": ("resume-reference", ["--dtype=float32"]),
              "reference_run_bf16": ("resume-reference-bf16", ["--dtype=bf16-mixed"]),
              "stale_reference_run": ("resume-reference-stale", ["--max_staleness=1", "--off_policy_correction=tis",
                                                                 "--dtype=float32"])}
# started as the suite begins (tests/background.py)
BACKGROUND = {fixture: (lambda key=key, extra=extra: background.start(*reference(key, extra)[:3]))
              for fixture, (key, extra) in REFERENCES.items()}


def reference_result(fixture):
    key, cmd, cwd, run_dir = reference(*REFERENCES[fixture])
    proc = background.result(key, cmd, cwd)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return run_dir


@pytest.fixture(scope="module")
def reference_run():
    return reference_result("reference_run")


@pytest.fixture(scope="module")
def reference_run_bf16():
    return reference_result("reference_run_bf16")


def final_weights(run_dir):
    return (run_dir / "checkpoints" / "step-3" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("where, n", [
    ("rollout", 4),   # the 2nd iteration's rollout (2 eval calls come first)
    ("update", 3),    # the 2nd iteration's update, between its 2 minibatches (2 value-loss calls an iteration)
    ("save", 3),      # the 2nd save, half written: after optimizer.safetensors, before rng.safetensors
    ("pointer", 2),   # the 2nd save, complete on disk but `latest` not yet moved
])
def test_kill_and_resume_is_identical(reference_run, tmp_path, where, n):
    assert_kill_and_resume_is_identical(reference_run, tmp_path, where, n, "float32")


@pytest.mark.parametrize("where, n", [("rollout", 4), ("update", 3)])
def test_kill_and_resume_is_identical_in_bf16(reference_run_bf16, tmp_path, where, n):
    """bf16-mixed on the same machine: the same oneDNN kernels on the same shapes, so still bit-exact."""
    assert_kill_and_resume_is_identical(reference_run_bf16, tmp_path, where, n, "bf16-mixed")


def assert_kill_and_resume_is_identical(reference_run, tmp_path, where, n, dtype):
    run_dir = tmp_path / "run"
    killed = subprocess.run([sys.executable, "-c", DRIVER, where, str(n), *ARGS, f"--dtype={dtype}", f"--out={run_dir}"],
                            capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not (run_dir / "summary.json").exists()
    resumed = run_trainer(["--resume", str(run_dir), "--progress=false"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming" in resumed.stderr
    assert metrics(run_dir) == metrics(reference_run)
    assert final_weights(run_dir) == final_weights(reference_run)
    ref_critic = load_file(str(reference_run / "checkpoints" / "step-3" / "critic" / "model.safetensors"))
    got_critic = load_file(str(run_dir / "checkpoints" / "step-3" / "critic" / "model.safetensors"))
    assert all(torch.equal(ref_critic[k], got_critic[k]) for k in ref_critic)
    assert not [d for d in os.listdir(run_dir / "checkpoints") if d.startswith(".tmp-")]


def test_automatic_resume_when_the_run_directory_has_a_checkpoint(reference_run, tmp_path):
    """What a retried Modal container does: the same command again, no --resume."""
    run_dir = tmp_path / "run"
    killed = subprocess.run([sys.executable, "-c", DRIVER, "update", "5", *ARGS, "--dtype=float32", f"--out={run_dir}"],
                            capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert killed.returncode == -signal.SIGKILL
    again = run_trainer(ARGS + ["--dtype=float32", f"--out={run_dir}"], cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert metrics(run_dir) == metrics(reference_run) and final_weights(run_dir) == final_weights(reference_run)


def test_sigterm_saves_and_exits_cleanly(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "ppo_core.train", *ARGS, "--iterations=200", "--save_every=0",
                             f"--out={run_dir}"], stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    deadline = time.time() + 300
    while time.time() < deadline and not (run_dir / "metrics.jsonl").exists() or \
            (run_dir / "metrics.jsonl").stat().st_size == 0:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-2000:]
    assert "received SIGTERM; saved checkpoint at iteration" in err and "--resume" in err
    done = len(metrics(run_dir))
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step-{done}" and 1 <= done < 200


def test_a_run_started_with_relative_paths_resumes_from_any_directory(tmp_path, monkeypatch, capsys):
    """Issue 47: a run started with relative paths (prompts file, reward file, out) stores them absolute in config.json,
    so `--resume` from another directory finds them; the run continues from its checkpoint."""
    from ppo_core.data.tasks import eval_prompts

    start, elsewhere = tmp_path / "start", tmp_path / "elsewhere"
    start.mkdir(), elsewhere.mkdir()
    (start / "prompts.txt").write_text("".join(p + "\n" for p in eval_prompts(20, seed=5)))  # 16 train, 4 held out
    (start / "rewards.py").write_text("def score(prompts, responses):\n    return [float(len(r)) for r in responses]\n")

    class Stopped(Exception):
        pass

    real_update, updates = train.ppo_update, []

    def stopped_in_the_second_update(*args, **kwargs):  # the run stops after the checkpoint of iteration 1
        updates.append(1)
        if len(updates) == 2:
            raise Stopped
        return real_update(*args, **kwargs)

    monkeypatch.chdir(start)
    monkeypatch.setattr(train, "ppo_update", stopped_in_the_second_update)
    args = ["--prompts_file=prompts.txt", "--reward_fn=rewards.py:score", "--out=run", "--iterations=2",
            "--save_every=1", "--eval_size=4", "--rollout_batch_size=8", "--minibatch_size=8", "--micro_batch_size=8",
            "--ppo_epochs=1", "--progress=false"]
    with pytest.raises(Stopped):
        train.main(args)
    saved = json.loads((start / "run" / "config.json").read_text())["config"]
    assert saved["prompts_file"] == str(start / "prompts.txt")
    assert saved["reward_fn"] == [f"{start / 'rewards.py'}:score"]
    monkeypatch.setattr(train, "ppo_update", real_update)
    monkeypatch.chdir(elsewhere)
    assert train.main(["--resume", str(start / "run")]) == 0, capsys.readouterr().err[-2000:]
    assert f"(iteration 1 of 2)" in capsys.readouterr().err
    assert [row["step"] for row in metrics(start / "run")] == [1, 2]
    assert os.listdir(elsewhere) == []  # nothing written where the resume was typed


def test_resume_errors(tmp_path, capsys):
    assert train.main(["--resume", str(tmp_path / "empty")]) == 2
    assert f"--resume: {tmp_path / 'empty'} holds no run" in capsys.readouterr().err
    assert train.main(["--resume", str(tmp_path), "--lr=1"]) == 2
    assert "cannot be combined" in capsys.readouterr().err


def test_non_finite_updates_are_skipped_then_the_run_stops(tmp_path, monkeypatch, capsys):
    """Fault injection through a pytest fixture: the policy loss turns NaN from the 3rd micro-batch on."""
    real_objective = update.policy_objective  # the policy's micro-batch loss, fused or reference path
    calls = [0]

    def poisoned(*args, **kwargs):
        loss, *rest = real_objective(*args, **kwargs)
        calls[0] += 1
        return (loss * float("nan") if calls[0] >= 3 else loss), *rest

    monkeypatch.setattr(update, "policy_objective", poisoned)
    cfg = build_config(overrides={"out": str(tmp_path / "run"), "iterations": "3", "eval_size": "8",
                                  "rollout_batch_size": "32", "minibatch_size": "16", "micro_batch_size": "16",
                                  "ppo_epochs": "2", "max_skipped_updates": "3", "progress": "false"})
    with pytest.raises(train.NonFiniteUpdates, match="stopping at iteration 2: 3 consecutive updates"):
        train.run(cfg)
    err = capsys.readouterr().err
    # each skipped update is logged with its iteration and step; no weight changed after the first two
    assert "iteration 1: non-finite loss or gradient, update 2 skipped" in err
    assert "iteration 1: non-finite loss or gradient, update 3 skipped" in err
    assert "iteration 2: non-finite loss or gradient, update 4 skipped" in err
    rows = metrics(tmp_path / "run")
    assert len(rows) == 1 and rows[0]["train/skipped_updates"] == 2


def test_run_started_before_a_config_field_existed_is_still_the_same_run(tmp_path):
    """A run directory written by a version without some config field (here lora_rank) resumes: the
    missing key counts as its default. A real difference is still refused."""
    cfg = build_config(overrides={"out": str(tmp_path / "run")})
    RunDir.open(cfg, train.DEMO_CHECKPOINT)
    cfg_file = tmp_path / "run" / "config.json"
    saved = json.loads(cfg_file.read_text())
    del saved["config"]["lora_rank"]
    cfg_file.write_text(json.dumps(saved))
    RunDir.open(cfg, train.DEMO_CHECKPOINT)  # the same run
    os.makedirs(tmp_path / "run" / "checkpoints" / "step-1")  # without a checkpoint a different run would replace it
    with pytest.raises(RunDirError, match="config differs in: lora_rank"):
        RunDir.open(build_config(overrides={"out": str(tmp_path / "run"), "lora_rank": "4"}), train.DEMO_CHECKPOINT)


def test_run_that_names_a_reward_module_by_its_old_path_is_still_the_same_run(tmp_path):
    """A run directory written before the subpackages move names its reward function 'ppo_core.verifiers:f'; today the
    same function is 'ppo_core.rewards.verifiers:f' (rewards.functions.MOVED_MODULES): the same run, so --resume
    continues it. Another function is still a different run."""
    spec = "ppo_core.rewards.verifiers:last_number_reward"
    cfg = build_config(overrides={"out": str(tmp_path / "run"), "reward_fn": spec, "eval_reward_fn": spec})
    RunDir.open(cfg, train.DEMO_CHECKPOINT)
    cfg_file = tmp_path / "run" / "config.json"
    saved = json.loads(cfg_file.read_text())
    saved["config"]["reward_fn"] = ["ppo_core.verifiers:last_number_reward"]
    saved["config"]["eval_reward_fn"] = "ppo_core.verifiers:last_number_reward"
    cfg_file.write_text(json.dumps(saved))
    os.makedirs(tmp_path / "run" / "checkpoints" / "step-1")  # so a different run is refused, not replaced
    RunDir.open(cfg, train.DEMO_CHECKPOINT)  # the same run
    other = "ppo_core.rewards.verifiers:math_reward"
    with pytest.raises(RunDirError, match="config differs in: eval_reward_fn, reward_fn"):
        RunDir.open(build_config(overrides={"out": str(tmp_path / "run"), "reward_fn": other, "eval_reward_fn": other}),
                    train.DEMO_CHECKPOINT)


def test_a_finished_run_says_how_to_train_it_further_and_that_way_starts_where_it_ended(tmp_path, capsys):
    """--resume on a finished run is refused with the arguments of a new run from its last checkpoint (newcomer
    review #20); that run starts from the finished one's policy, critic and KL reference: its 'before' evaluation
    (same held-out prompts, same sampling seed) is the finished run's 'after' one, sampled and greedy."""
    tiny = ["--iterations=1", "--eval_size=8", "--rollout_batch_size=8", "--minibatch_size=8", "--micro_batch_size=8",
            "--max_new_tokens=6", "--progress=false"]
    first = tmp_path / "first"
    assert train.main(tiny + [f"--out={first}"]) == 0
    capsys.readouterr()
    assert train.main(["--resume", str(first)]) == 2
    err = capsys.readouterr().err
    ckpt = first / "checkpoints" / "step-1"
    assert err == (f"ppo-train: error: output directory {first} already holds a finished run; choose another --out "
                   f"(to train it further, start the new run from its last checkpoint: --policy {ckpt} "
                   f"--critic {ckpt / 'critic'} --reference {train.DEMO_CHECKPOINT})\n")
    hint = err.split("last checkpoint: ")[1].rstrip(")\n").split()
    assert train.main(tiny + hint + [f"--out={tmp_path / 'further'}"]) == 0
    ended = json.loads((first / "summary.json").read_text())
    started = json.loads((tmp_path / "further" / "summary.json").read_text())
    assert started["eval/reward_before"] == ended["eval/reward_after"]
    assert started["eval/greedy_reward_before"] == ended["eval/greedy_reward_after"]


STALE = ["--max_staleness=1", "--off_policy_correction=tis"]


@pytest.fixture(scope="module")
def stale_reference_run():
    return reference_result("stale_reference_run")


@pytest.mark.parametrize("where, n", [
    ("rollout", 5),  # the 2nd iteration's sampling of the 3rd rollout: the checkpoint of step 1 holds the 2nd, unused
    ("update", 3),   # the 2nd iteration's update
])
def test_kill_and_resume_with_a_rollout_in_flight_is_identical(stale_reference_run, tmp_path, where, n):
    """max_staleness=1: each checkpoint holds the rollout sampled one update early and not yet trained on; a run
    killed and resumed trains on exactly that one, and ends byte-identical to one that never stopped."""
    run_dir = tmp_path / "run"
    killed = subprocess.run([sys.executable, "-c", DRIVER, where, str(n), *ARGS, *STALE, "--dtype=float32",
                             f"--out={run_dir}"], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed = run_trainer(["--resume", str(run_dir), "--progress=false"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming" in resumed.stderr
    assert metrics(run_dir) == metrics(stale_reference_run)
    assert final_weights(run_dir) == final_weights(stale_reference_run)
    stale = metrics(stale_reference_run)
    assert stale[0]["off_policy/behav_gap_mean"] < stale[1]["off_policy/behav_gap_mean"]  # from iteration 2 on: stale


def test_max_staleness_zero_is_the_synchronous_loop(reference_run, tmp_path):
    """max_staleness=0 written out is today's loop, byte for byte."""
    run_dir = tmp_path / "run"
    proc = run_trainer(ARGS + ["--max_staleness=0", "--dtype=float32", f"--out={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert metrics(run_dir) == metrics(reference_run) and final_weights(run_dir) == final_weights(reference_run)
