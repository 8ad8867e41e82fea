"""The run directory under faults, round 2 (issue 49): two trainers on one --out (the second is refused and touches
nothing; a killed first one's lock is taken over), a torn or NUL-padded end of metrics.jsonl and a full disk (dropped
on resume; one line and exit 4, nothing written lost), checkpoint files that are symbolic links out of the checkpoint
(refused, the Hugging Face cache's own links allowed), and `checkpoints/` itself damaged (`latest` gone or naming a
missing step, stray step-like names): the newest intact step is resumed, with a line, never a silent restart."""
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from ppo_core.models.model import CheckpointError, load_model
from ppo_core.models.tokenizer import load_tokenizer
from ppo_core.run import checkpoint, runlog
from ppo_core.train import DEMO_CHECKPOINT, EXIT_DISK_FULL, main

def tiny(iterations=2):
    return [f"--iterations={iterations}", "--save_every=1", "--eval_size=8", "--rollout_batch_size=4",
            "--n_samples_per_prompt=2", "--minibatch_size=8", "--micro_batch_size=8", "--max_new_tokens=8",
            "--progress=false"]


TINY = tiny()


def one_line(capsys):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.rstrip("\n")


def steps(run_dir):
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A tiny run of 2 iterations with checkpoints step-1 and step-2, trained once for the module."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    assert main([*TINY, f"--out={run_dir}"]) == 0
    return run_dir


@pytest.fixture
def stopped_run(finished_run, tmp_path):
    """A copy of finished_run without summary.json: a run stopped (killed) in its final evaluation, which --resume
    finishes."""
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    (run_dir / "summary.json").unlink()
    (run_dir / "run.lock").unlink(missing_ok=True)  # the copy's: not a lock anyone holds
    return run_dir


# ---------------------------------------------------------------------------- 1: two trainers on one --out

def start_trainer(run_dir, extra=()):
    """A real ppo-train (4 iterations, a checkpoint each) in a subprocess; returns once step-1 is saved."""
    proc = subprocess.Popen([sys.executable, "-m", "ppo_core.train", *tiny(4), *extra,
                             f"--out={run_dir}"], stderr=subprocess.PIPE, text=True, cwd=run_dir.parent)
    latest, deadline = run_dir / "checkpoints" / "latest", time.time() + 120
    while not latest.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    assert latest.exists(), proc.communicate(timeout=60)[1][-2000:]
    return proc


def snapshot(run_dir):
    """Every file under the run directory: its inode, size, modification time and bytes."""
    return {str(p.relative_to(run_dir)): (p.stat().st_ino, p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_a_second_trainer_on_the_same_out_is_refused_and_touches_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    first = start_trainer(run_dir)
    try:
        first.send_signal(signal.SIGSTOP)  # held still: whatever changes in the directory now is the second's doing
        before = snapshot(run_dir)
        assert main([*tiny(4), f"--out={run_dir}"]) == 2
        assert one_line(capsys) == (f"ppo-train: error: output directory {run_dir} is in use by another ppo-train "
                                    f"(pid {first.pid}); wait for it to end, or choose another --out")
        assert snapshot(run_dir) == before
    finally:
        first.send_signal(signal.SIGCONT)
        _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err[-2000:]
    assert steps(run_dir) == [1, 2, 3, 4]  # the first's metrics, every one of them


def test_a_killed_trainers_lock_is_taken_over_by_the_resume(tmp_path, capsys):
    run_dir = tmp_path / "run"
    first = start_trainer(run_dir)
    first.kill()  # SIGKILL: no handler runs, the lock file stays; the kernel drops the flock
    first.communicate(timeout=60)
    assert (run_dir / "run.lock").read_text() == f"{first.pid}\n"
    assert main(["--resume", str(run_dir)]) == 0
    assert f"resuming {run_dir} from " in capsys.readouterr().err
    assert steps(run_dir) == [1, 2, 3, 4]
    assert (run_dir / "run.lock").read_text() == f"{os.getpid()}\n"


# ---------------------------------------------------------------------------- 2: torn ends and a full disk

def test_a_torn_last_metrics_line_is_dropped_on_resume(stopped_run, capsys):
    metrics, torn = stopped_run / "metrics.jsonl", '{"step": 3, "reward/mean": 0.1'
    with open(metrics, "a") as f:
        f.write(torn)  # the disk filled half way through a line
    assert main(["--resume", str(stopped_run)]) == 0
    err = capsys.readouterr().err
    assert (f"warning: dropped the torn end of {metrics} (line 3: {len(torn)} bytes, {torn!r}), left by a write that "
            f"did not finish\n") in err, err
    assert steps(stopped_run) == [1, 2] and metrics.read_bytes().endswith(b"}\n")


def test_nul_bytes_at_the_end_of_metrics_are_dropped_on_resume(stopped_run, capsys):
    metrics, samples = stopped_run / "metrics.jsonl", stopped_run / "samples.jsonl"
    with open(metrics, "ab") as f:
        f.write(b"\0" * 4096)  # what a crash leaves where a file's last block was allocated but never written
    samples.write_bytes(b'{"step": 2, "prompt": "abc"}\n{"step": 2, "pro' + b"\0" * 10)  # any JSONL of the run
    assert main(["--resume", str(stopped_run)]) == 0
    err = capsys.readouterr().err
    assert f"warning: dropped the torn end of {metrics} (line 3: 4096 bytes, all NUL), left by a write that did " \
           f"not finish\n" in err, err
    assert f"warning: dropped the torn end of {samples} (line 2: 26 bytes, '{{\"step\": 2, \"pro' and NUL bytes), " \
           f"left by a write that did not finish\n" in err, err
    assert steps(stopped_run) == [1, 2] and samples.read_text() == '{"step": 2, "prompt": "abc"}\n'


def test_a_bad_line_before_whole_ones_is_one_line_and_touches_nothing(stopped_run, capsys):
    metrics = stopped_run / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text(lines[0] + "not json\n" + lines[1])
    before = metrics.read_bytes()
    assert main(["--resume", str(stopped_run)]) == 2
    assert one_line(capsys) == (f"ppo-train: error: {metrics}, line 2: not a JSON object with a \"step\", and whole "
                                f"lines follow it (only a torn end is dropped on resume); remove or repair that line")
    assert metrics.read_bytes() == before


class FillsUp:
    """metrics.jsonl on a disk that fills up: the `room`-th write gets 10 bytes down, then ENOSPC."""

    def __init__(self, file, room):
        self.file, self.room = file, room

    def write(self, data):
        self.room -= 1
        if self.room == 0:
            self.file.write(data[:10])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)


def test_a_full_disk_while_writing_metrics_is_one_line_and_the_run_resumes(tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    real_init = runlog.Logger.__init__

    def filling_up(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.file = FillsUp(self.file, room=2)  # iteration 1's line is written, iteration 2's torn

    monkeypatch.setattr(runlog.Logger, "__init__", filling_up)
    assert main([*TINY, f"--out={run_dir}"]) == EXIT_DISK_FULL
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"ppo-train: error: the disk is full (No space left on device) writing {run_dir / 'metrics.jsonl'}; the "
        f"checkpoint of iteration 1 is intact and no line already written was lost; free space, then continue with: "
        f"ppo-train --resume {run_dir}")
    assert (run_dir / "metrics.jsonl").read_text().count("\n") == 1  # iteration 1's line, then 10 torn bytes
    monkeypatch.setattr(runlog.Logger, "__init__", real_init)  # space freed
    assert main(["--resume", str(run_dir)]) == 0
    assert "warning: dropped the torn end of " in capsys.readouterr().err
    assert steps(run_dir) == [1, 2]


def test_a_full_disk_while_saving_a_checkpoint_is_one_line_and_leaves_nothing_half_written(tmp_path, capsys,
                                                                                          monkeypatch):
    run_dir = tmp_path / "run"
    real_save_file, calls = checkpoint.save_file, [0]

    def filling_up(tensors, filename, *args, **kwargs):  # 2 safetensors files a save: step-2's optimizer fails
        calls[0] += 1
        if calls[0] == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)
        return real_save_file(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_file", filling_up)
    assert main([*TINY, f"--out={run_dir}"]) == EXIT_DISK_FULL
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"ppo-train: error: the disk is full (No space left on device) writing "
        f"{run_dir / 'checkpoints' / '.tmp-step-2' / 'optimizer.safetensors'}; the checkpoint of iteration 1 is intact "
        f"and no line already written was lost; free space, then continue with: ppo-train --resume {run_dir}")
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["latest", "step-1"]  # the half-written step removed
    assert steps(run_dir) == [1, 2]
    monkeypatch.setattr(checkpoint, "save_file", real_save_file)
    assert main(["--resume", str(run_dir)]) == 0
    assert steps(run_dir) == [1, 2] and (run_dir / "checkpoints" / "step-2").is_dir()


def test_a_real_full_disk_stops_the_run_with_its_checkpoint_and_the_resume_finishes(finished_run, tmp_path, capsys):
    """The same on a real file system that fills up: a tmpfs with room for one checkpoint and a half (root only)."""
    step_bytes = sum(p.stat().st_size for p in (finished_run / "checkpoints" / "step-1").rglob("*") if p.is_file())
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={step_bytes * 3 // 2 + (64 << 10)}",
                                            "tmpfs", str(disk)], capture_output=True).returncode != 0:
        pytest.skip("needs root and mount, for a tmpfs of a fixed size")
    try:
        run_dir = disk / "run"
        assert main([*TINY, f"--out={run_dir}"]) == EXIT_DISK_FULL
        assert capsys.readouterr().err.splitlines()[-1] == (
            f"ppo-train: error: the disk is full (No space left on device) writing "
            f"{run_dir / 'checkpoints' / 'step-2'}; the checkpoint of iteration 1 is intact and no line already "
            f"written was lost; free space, then continue with: ppo-train --resume {run_dir}")
        assert sorted(os.listdir(run_dir / "checkpoints")) == ["latest", "step-1"] and steps(run_dir) == [1, 2]
        subprocess.run(["mount", "-o", f"remount,size={step_bytes * 4}", str(disk)], check=True)  # space freed
        assert main(["--resume", str(run_dir)]) == 0
        assert steps(run_dir) == [1, 2] and (run_dir / "checkpoints" / "step-2").is_dir()
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


# ---------------------------------------------------------------------------- 3: links out of a checkpoint

def demo_copy(tmp_path):
    policy = tmp_path / "policy"
    shutil.copytree(DEMO_CHECKPOINT, policy)
    secret = tmp_path / "secret.key"
    secret.write_text("PRIVATE KEY {{ messages }}\n")
    secret.chmod(0o600)
    return policy, secret


def test_a_chat_template_linked_out_of_the_checkpoint_is_refused(tmp_path, capsys):
    policy, secret = demo_copy(tmp_path)
    os.symlink(secret, policy / "chat_template.jinja")
    run_dir = tmp_path / "run"
    assert main([f"--policy={policy}", *TINY, f"--out={run_dir}"]) == 2
    assert one_line(capsys) == (f"ppo-train: error: config key 'policy': {policy / 'chat_template.jinja'} is a symbolic link to "
                                f"{secret}, outside the checkpoint directory {policy}: refused (copy the file into the "
                                f"checkpoint instead)")
    assert not run_dir.exists()


def test_links_out_of_a_checkpoint_are_refused_by_every_loader(tmp_path):
    policy, secret = demo_copy(tmp_path)
    (tmp_path / "templates").mkdir()
    os.symlink(tmp_path / "templates", policy / "additional_chat_templates")  # a linked directory
    with pytest.raises(CheckpointError, match="additional_chat_templates is a symbolic link to .*outside the"):
        load_tokenizer(policy)
    os.remove(policy / "additional_chat_templates")
    (policy / "additional_chat_templates").mkdir()
    os.symlink("../../secret.key", policy / "additional_chat_templates" / "tool_use.jinja")  # relative, climbing out
    with pytest.raises(CheckpointError, match="tool_use.jinja is a symbolic link to .*secret.key, outside the"):
        load_tokenizer(policy)
    shutil.rmtree(policy / "additional_chat_templates")
    os.remove(policy / "model.safetensors")
    os.symlink(os.path.join(DEMO_CHECKPOINT, "model.safetensors"), policy / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors is a symbolic link to "):
        load_model(policy)
    os.remove(policy / "model.safetensors")
    os.symlink(tmp_path / "secret.key", policy / "critic")  # a resume's step directory: the same check
    with pytest.raises(CheckpointError, match="critic is a symbolic link to "):
        checkpoint.load_training_state(policy, policy=None, critic=None, policy_opt=None, critic_opt=None,
                                       generators={})


def test_links_inside_the_checkpoint_and_the_hugging_face_cache_layout_load(tmp_path):
    """A snapshot of the Hugging Face cache: models--ORG--NAME/snapshots/REV/FILE -> ../../blobs/SHA."""
    repo = tmp_path / "hub" / "models--ppo--reverse-demo"
    snapshot_dir = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot_dir.mkdir(parents=True)
    for name in os.listdir(DEMO_CHECKPOINT):
        blob = checkpoint.file_sha256(os.path.join(DEMO_CHECKPOINT, name))
        shutil.copy(os.path.join(DEMO_CHECKPOINT, name), repo / "blobs" / blob)
        os.symlink(f"../../blobs/{blob}", snapshot_dir / name)
    (snapshot_dir / "templates").mkdir()
    (snapshot_dir / "templates" / "plain.jinja").write_text("{{ messages[0]['content'] }}")
    os.symlink("templates/plain.jinja", snapshot_dir / "chat_template.jinja")  # inside the snapshot itself
    assert load_tokenizer(snapshot_dir).apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi"
    load_model(snapshot_dir)
    os.symlink(tmp_path / "hub", snapshot_dir / "elsewhere")  # the cache, but not this model's folder
    with pytest.raises(CheckpointError, match="elsewhere is a symbolic link to .*outside the checkpoint directory "
                                              f"{re.escape(str(repo))}:"):
        load_tokenizer(snapshot_dir)


# ---------------------------------------------------------------------------- 7: checkpoints/ itself damaged

def test_latest_deleted_resumes_the_newest_intact_step_never_iteration_0(stopped_run, capsys):
    ckpts = stopped_run / "checkpoints"
    (ckpts / "latest").unlink()
    assert main(["--resume", str(stopped_run)]) == 0
    err = capsys.readouterr().err
    assert (f"warning: {ckpts / 'latest'} is missing: resuming from {ckpts / 'step-2'}, the newest intact "
                          f"step\nresuming {stopped_run} from {ckpts / 'step-2'} (iteration 2 of 2)\n") in err, err
    assert steps(stopped_run) == [1, 2]


def test_latest_naming_a_missing_step_falls_back_to_the_older_intact_one(stopped_run, capsys):
    """A kill while a step was saved again (its old copy set aside, the new one not yet renamed in): `latest` names
    a step that is not there."""
    ckpts = stopped_run / "checkpoints"
    shutil.rmtree(ckpts / "step-2")
    assert main(["--resume", str(stopped_run)]) == 0
    err = capsys.readouterr().err
    assert (f"warning: {ckpts / 'latest'} names 'step-2', which is not a step in {ckpts}: resuming from "
                          f"{ckpts / 'step-1'}, the newest intact step\nresuming {stopped_run} from {ckpts / 'step-1'} "
                          f"(iteration 1 of 2)\n") in err, err
    assert steps(stopped_run) == [1, 2]
    assert (ckpts / "latest").read_text() == "step-2\n" and (ckpts / "step-2").is_dir()


def test_latest_lost_with_no_step_left_is_an_error_not_a_restart(stopped_run, capsys):
    ckpts = stopped_run / "checkpoints"
    for step in ("step-1", "step-2"):
        shutil.rmtree(ckpts / step)
    before = (stopped_run / "metrics.jsonl").read_bytes()
    assert main(["--resume", str(stopped_run)]) == 2
    assert one_line(capsys) == (f"ppo-train: error: {ckpts / 'latest'} names 'step-2', which is not a step in {ckpts} "
                                f"and no step-N directory is left to resume from; the run cannot continue: choose "
                                f"another --out to start again")
    assert (stopped_run / "metrics.jsonl").read_bytes() == before


def test_stray_step_like_names_are_neither_pruned_nor_resumed(stopped_run, capsys):
    ckpts = stopped_run / "checkpoints"
    shutil.copytree(ckpts / "step-1", ckpts / "step-best")  # a user's copy of a good step
    shutil.copytree(ckpts / "step-1", ckpts / "step-07")
    (ckpts / "step-9").write_text("notes\n")  # a file, not a step
    shutil.rmtree(ckpts / "step-2")
    (ckpts / "latest").write_text("step-1\n")
    assert main(["--resume", str(stopped_run)]) == 0  # iteration 2 redone, saved, pruned
    assert f"resuming {stopped_run} from {ckpts / 'step-1'} (iteration 1 of 2)" in capsys.readouterr().err
    assert sorted(os.listdir(ckpts)) == ["latest", "step-07", "step-1", "step-2", "step-9", "step-best"]
    assert checkpoint.saved_steps(ckpts) == [2, 1]
