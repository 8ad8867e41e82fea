"""A resume trusts nothing on disk it has not checked (issue 38, item 5): every file of a checkpoint against the
SHA-256 in its manifest.json (a step that does not match is skipped for the newest intact one, and the run says so
first), trainer_state.json against a schema, optimizer moments against the parameters' shapes. Each attempt here is
a real tiny run's checkpoint damaged on disk, then `ppo-train --resume` as a user types it."""
import hashlib
import json
import os
import shutil
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import ppo_core.train as train
from ppo_core.run import checkpoint

# 2 iterations, a checkpoint after each, 8 rollouts of 6 tokens: ~1 s in process
TINY = ["--iterations=2", "--save_every=1", "--eval_size=8", "--rollout_batch_size=8", "--minibatch_size=8",
        "--micro_batch_size=8", "--max_new_tokens=6", "--progress=false", "--dtype=float32"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("hostile-checkpoint") / "run"
    assert train.main(TINY + [f"--out={run}"]) == 0
    return run


@pytest.fixture
def run(finished_run, tmp_path):
    """A copy of the finished run made resumable again (summary.json gone): a resume loads step-2, its latest."""
    copy = tmp_path / "run"
    shutil.copytree(finished_run, copy)
    os.remove(copy / "summary.json")
    return copy


def resume(run_dir, capsys):
    capsys.readouterr()
    code = train.main(["--resume", str(run_dir), "--progress=false"])
    return code, capsys.readouterr().err


def flip_exponent_bits(path, every=50):
    """The issue's damage: the top exponent bit of every 50th float32 (2%) of a safetensors file flipped in place."""
    with open(path, "r+b") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
        f.seek(8 + header_len)
        words = np.frombuffer(bytearray(f.read()), dtype=np.uint32).copy()
        words[::every] ^= np.uint32(1 << 30)
        f.seek(8 + header_len)
        f.write(words.tobytes())


def test_file_sha256_reads_in_chunks_and_matches_hashlib(tmp_path):
    data = os.urandom(2500)
    (tmp_path / "f").write_bytes(data)
    assert checkpoint.file_sha256(tmp_path / "f", chunk_bytes=1000) == hashlib.sha256(data).hexdigest()  # 3 reads
    assert checkpoint.file_sha256(tmp_path / "f") == hashlib.sha256(data).hexdigest()


def test_the_manifest_lists_every_file_of_the_step(finished_run):
    step = finished_run / "checkpoints" / "step-2"
    listed = json.loads((step / "manifest.json").read_text())["files"]
    on_disk = sorted(str(p.relative_to(step)) for p in step.rglob("*") if p.is_file() and p.name != "manifest.json")
    assert sorted(listed) == on_disk
    assert {"config.json", "tokenizer.json", "model.safetensors", "optimizer.safetensors", "rng.safetensors",
            "trainer_state.json", "critic/model.safetensors"} <= set(listed)
    for rel, entry in listed.items():
        data = (step / rel).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert checkpoint.verify_step(step) is True


@pytest.mark.parametrize("damage", ["flip", "truncate", "unlisted file", "manifest not JSON"])
def test_a_damaged_step_is_skipped_for_the_older_intact_one(finished_run, run, capsys, damage):
    """Before: 2% of exponent bits flipped resumed from the damaged step, exit 0, no word. Now the step is refused
    with a line naming the file, the run resumes from step-1 and redoes iteration 2 byte for byte."""
    step2 = run / "checkpoints" / "step-2"
    model = step2 / "model.safetensors"
    size = model.stat().st_size
    if damage == "flip":
        flip_exponent_bits(model)
        why = f"{model} does not match its SHA-256 in manifest.json"
    elif damage == "truncate":
        os.truncate(model, size - 100)
        why = f"{model} has {size - 100} bytes, manifest.json says {size}"
    elif damage == "unlisted file":  # e.g. an index that would make the loader read other weights
        (step2 / "model.safetensors.index.json").write_text("{}")
        why = f"{step2 / 'model.safetensors.index.json'} is not listed in manifest.json: not written by the save"
    else:
        (step2 / "manifest.json").write_text('{"files": {"config.json": ')
        why = f"{step2 / 'manifest.json'} is malformed (JSONDecodeError: Expecting value: line 1 column 27 (char 26))"
    code, err = resume(run, capsys)
    assert code == 0, err
    lines = err.splitlines()
    refused = [i for i, line in enumerate(lines) if line.startswith("warning: checkpoint refused:")]
    assert len(refused) == 1 and lines[refused[0]] == f"warning: checkpoint refused: {why}", err
    step1 = run / "checkpoints" / "step-1"
    assert lines[refused[0] + 1].startswith(f"warning: resuming from {step1}, the newest intact checkpoint")
    resuming = next(i for i, line in enumerate(lines) if line.startswith("resuming "))
    assert refused[0] < resuming and f"from {step1} (iteration 1 of 2)" in lines[resuming]
    # iteration 2 redone from step-1: the same weights as the run that never had a damaged file
    assert model.read_bytes() == (finished_run / "checkpoints" / "step-2" / "model.safetensors").read_bytes()
    assert checkpoint.verify_step(step2) is True


def test_no_intact_step_is_one_line_and_exit_2(run, capsys):
    for step in ("step-1", "step-2"):
        flip_exponent_bits(run / "checkpoints" / step / "model.safetensors")
    metrics_before = (run / "metrics.jsonl").read_bytes()
    code, err = resume(run, capsys)
    assert code == 2
    root = run / "checkpoints"
    assert err == (f"ppo-train: error: no intact checkpoint in {root}: "
                   f"{root / 'step-2' / 'model.safetensors'} does not match its SHA-256 in manifest.json; "
                   f"{root / 'step-1' / 'model.safetensors'} does not match its SHA-256 in manifest.json\n")
    assert (run / "metrics.jsonl").read_bytes() == metrics_before  # nothing written is cut back or lost


def test_a_missing_manifest_is_refused_and_a_step_from_before_manifests_is_used_unverified(finished_run, run, capsys):
    """A step whose trainer_state.json says it was saved with a manifest and has none is refused; a step saved by a
    version without manifests (no manifest.json, no "manifest" key) is used, with a line saying it is unverified."""
    os.remove(run / "checkpoints" / "step-2" / "manifest.json")
    step1 = run / "checkpoints" / "step-1"
    os.remove(step1 / "manifest.json")
    state = json.loads((step1 / "trainer_state.json").read_text())
    del state["manifest"]
    (step1 / "trainer_state.json").write_text(json.dumps(state))
    code, err = resume(run, capsys)
    assert code == 0, err
    assert (f"warning: checkpoint refused: {run / 'checkpoints' / 'step-2' / 'manifest.json'} is missing "
            f"(its trainer_state.json says the save wrote one)") in err
    assert (f"warning: {step1} has no manifest.json (saved before checkpoints carried one): its files are used "
            f"unverified") in err
    step2 = run / "checkpoints" / "step-2"
    assert (step2 / "model.safetensors").read_bytes() == \
        (finished_run / "checkpoints" / "step-2" / "model.safetensors").read_bytes()


def _state_edit(edit):
    def apply(step):
        path = step / "trainer_state.json"
        state = json.loads(path.read_text())
        edit(state)
        path.write_text(json.dumps(state))
    return apply


def _truncate_state(step):
    path = step / "trainer_state.json"
    path.write_bytes(path.read_bytes()[:2000])


def _optimizer_edit(edit):
    def apply(step):
        tensors = load_file(str(step / "optimizer.safetensors"))
        edit(tensors)
        save_file(tensors, str(step / "optimizer.safetensors"))
    return apply


def _rename(tensors, old, new):
    tensors[new] = tensors.pop(old)


# (damage done to step-2, then its manifest re-written so that the schema check, not the hash, must catch it;
#  the file and what the error line says after it)
MALFORMED = {
    "truncated state": (_truncate_state, "trainer_state.json", ": cannot read ("),
    "no python_rng": (_state_edit(lambda s: s.pop("python_rng")), "trainer_state.json", ": python_rng: missing"),
    "step a string": (_state_edit(lambda s: s.update(step="4")), "trainer_state.json",
                      ': step: expected int, found "4"'),
    "step a bool": (_state_edit(lambda s: s.update(step=True)), "trainer_state.json",
                    ": step: expected int, found true"),
    "no kl_controller (the loop's key)": (_state_edit(lambda s: s.pop("kl_controller")), "trainer_state.json",
                                          ": kl_controller: missing"),
    "stream position a float": (_state_edit(lambda s: s["prompt_stream"].update(drawn=1.5)), "trainer_state.json",
                                ": prompt_stream.drawn: expected int, found 1.5"),
    "rng list of str": (_state_edit(lambda s: s["python_rng"]["internal"].__setitem__(3, "x")), "trainer_state.json",
                        ': python_rng.internal[3]: expected int, found "x"'),
    "optimizer key without dots": (_optimizer_edit(lambda t: _rename(t, "policy.0.exp_avg", "policy0exp_avg")),
                                   "optimizer.safetensors", ": key 'policy0exp_avg' is not '<policy|critic>."),
    "optimizer index out of range": (_optimizer_edit(lambda t: _rename(t, "policy.0.exp_avg", "policy.999.exp_avg")),
                                     "optimizer.safetensors", ": key 'policy.999.exp_avg' is not"),
    "moment of the wrong shape": (_optimizer_edit(lambda t: t.update({"policy.1.exp_avg_sq": torch.zeros(3)})),
                                  "optimizer.safetensors",
                                  ": policy.1.exp_avg_sq is torch.float32 of shape (3,), the optimizer's parameter "
                                  "needs floating point of shape ("),
    "moment missing": (_optimizer_edit(lambda t: t.pop("critic.2.exp_avg")), "optimizer.safetensors",
                       ": critic.2 lacks ['exp_avg']"),
}


@pytest.mark.parametrize("attempt", list(MALFORMED))
def test_a_malformed_state_file_is_one_line_naming_the_file_and_key(run, capsys, attempt):
    """Before: a traceback (exit 1), or for the moment of the wrong shape, accepted. The files match their manifest (a
    save that wrote them wrong, not a disk that changed them): no fallback, CheckpointError, exit 2."""
    damage, name, says = MALFORMED[attempt]
    step = run / "checkpoints" / "step-2"
    damage(step)
    checkpoint.write_manifest(step)
    code, err = resume(run, capsys)
    assert code == 2, err
    assert err.startswith(f"ppo-train: error: {step / name}{says}"), err
    assert err.count("\n") == 1 and "Traceback" not in err
