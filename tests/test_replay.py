"""Rollouts recorded and replayed (config save_rollouts, replay_rollouts; ppo_core.run.recording), on real ppo-train
runs of the demo checkpoint: a replay with the recording's own config reproduces its weights byte for byte and its
metrics; what is recorded is what the run sampled and scored (the reverse task's reward recomputed from the recorded
texts); the size the log gives from the shapes is the size written; another estimator trains on the same data and
says it is off-policy; a resume picks the recorded file by its iteration; a recording from another checkpoint,
tokenizer or rollout shape, with too few iterations or a torn file, is refused in one line (exit 2), touching nothing.

    python -m pytest -q tests/test_replay.py
"""
import contextlib
import io
import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ppo_core.config import ConfigError, build_config
from ppo_core.data.tasks import reverse_reward
from ppo_core.run import recording
from ppo_core.train import DEMO_CHECKPOINT, main

WALL_CLOCK = ("time/", "tokens_per_s")


def tiny(iterations=3, max_new_tokens=8):
    return [f"--iterations={iterations}", "--save_every=1", "--keep_checkpoints=3", "--eval_size=8",
            "--rollout_batch_size=4", "--n_samples_per_prompt=2", "--minibatch_size=8", "--micro_batch_size=8",
            f"--max_new_tokens={max_new_tokens}", "--progress=false"]


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def one_line(capsys):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.rstrip("\n")


def snapshot(path):
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def weights(run_dir, step=3):
    return (run_dir / "checkpoints" / f"step-{step}" / "model.safetensors").read_bytes()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A 3-iteration run of the demo (a critic, GAE) that records its rollouts, a checkpoint each iteration; and its
    stderr."""
    run_dir = tmp_path_factory.mktemp("recorded") / "run"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):  # the log's lines (a module fixture has no capsys)
        assert main([*tiny(), "--save_rollouts", f"--out={run_dir}"]) == 0
    return run_dir, err.getvalue()


@pytest.fixture(scope="module")
def replayed(recorded, tmp_path_factory):
    """The same config, replaying the recording."""
    run_dir = tmp_path_factory.mktemp("replayed") / "run"
    assert main([*tiny(), f"--replay_rollouts={recorded[0]}", f"--out={run_dir}"]) == 0
    return run_dir


# ---------------------------------------------------------------------------- the same config: the same run

def test_a_replay_with_the_recordings_config_reproduces_its_weights_and_metrics(recorded, replayed):
    source = recorded[0]
    for step in (1, 2, 3):
        assert weights(replayed, step) == weights(source, step)
    critic = "checkpoints/step-3/critic/model.safetensors"
    assert (replayed / critic).read_bytes() == (source / critic).read_bytes()
    got, want = metrics(replayed), metrics(source)
    assert len(got) == len(want) == 3
    for line_got, line_want in zip(got, want):
        # every metric but the clocks; the replay adds the gap to the recorded sampler, 0 on every iteration
        assert {k: v for k, v in line_got.items() if not k.startswith(("off_policy/",) + WALL_CLOCK)} == \
               {k: v for k, v in line_want.items() if not k.startswith(WALL_CLOCK)}
        assert line_got["off_policy/behav_gap_mean"] == line_got["off_policy/behav_gap_max"] == 0.0
        assert line_got["time/generate_s"] == 0.0
    summary_got = json.loads((replayed / "summary.json").read_text())
    summary_want = json.loads((source / "summary.json").read_text())
    for key in ("eval/reward_after", "eval/greedy_reward_after", "kl/final"):
        assert summary_got[key] == summary_want[key]


def test_the_recording_holds_what_the_run_sampled_and_scored(recorded):
    """Each step's recorded responses, rescored by the reverse task's reward (the shipped function, called here
    apart), give the recorded scores, and their mean is that iteration's reward/mean; the masks' lengths give
    response/length_mean; the texts are the decoded tokens."""
    from ppo_core.models.tokenizer import load_tokenizer
    source, _ = recorded
    tokenizer = load_tokenizer(DEMO_CHECKPOINT)
    reader = recording.Recording(str(source), {}, 3)
    for step, line in zip((1, 2, 3), metrics(source)):
        state = reader.read(step)
        sampled, tensors = state["sampled"], state["sampled"]["tensors"]
        scores = tensors["scores"]["values"]
        rescored = [reverse_reward(row["prompt"], response)
                    for row, response in zip(sampled["rows"], sampled["responses"])]
        assert scores.tolist() == torch.tensor(rescored, dtype=torch.float32).tolist()  # scores are float32
        assert scores.mean().item() == pytest.approx(line["reward/mean"], rel=1e-6)
        mask = tensors["response_mask"]["values"]
        assert mask.sum(-1).mean().item() == line["response/length_mean"]
        assert [tokenizer.decode(t[m.bool()].tolist()) for t, m in zip(tensors["tokens"]["values"], mask)] == \
               sampled["responses"]
        assert sampled["group"]["values"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]  # a prompt's 2 samples together
        assert state["sampler"]["old_logprobs"].shape == mask.shape
        assert (state["sampler"]["old_logprobs"] * (1 - mask)).abs().sum() == 0


def test_the_size_the_log_gives_is_computed_from_the_shapes_written(recorded):
    source, err = recorded
    tensors = load_file(source / "rollouts" / "step-1.safetensors")
    prompt_len = tensors["sampled.tensors.prompt_ids.values"].shape[1]
    rows, response_len = tensors["sampled.tensors.tokens.values"].shape
    components = sum(t.numel() * t.element_size() for k, t in tensors.items() if k.startswith("sampled.reward_metrics"))
    written = sum(t.numel() * t.element_size() for t in tensors.values())
    assert recording.tensor_bytes_bound(rows, prompt_len, response_len, False, False) == written - components
    # hand-worked: per row 9 bytes a prompt token, 20 a response token, 13 for ended, score and group
    assert recording.tensor_bytes_bound(8, prompt_len, 8, False, False) == 8 * (9 * prompt_len + 20 * 8 + 13)
    line = next(line for line in err.splitlines() if line.startswith("rollouts: recording"))
    # the longest prompt the run knows before sampling: a prompts file's rows, or (here) a built-in task's held-out
    # ones, which its training stream may exceed: "about"
    longest = int(re.search(r"8 rows x (\d+) prompt tokens \(the longest held-out or training prompt\)",
                            line).group(1))
    per_iteration = recording.tensor_bytes_bound(8, longest, 8, False, False)
    assert f"about {recording.size_text(per_iteration)} an iteration" in line
    measured = next(line for line in err.splitlines() if line.startswith("rollouts: iteration 1 recorded"))
    files = sum(os.path.getsize(source / "rollouts" / f"step-1.{ext}") for ext in ("safetensors", "json"))
    assert f"recorded in {recording.size_text(files)}" in measured


# ---------------------------------------------------------------------------- another estimator, the same data

def test_another_estimator_trains_on_the_same_data_and_reports_how_far_off_policy(recorded, tmp_path, capsys):
    source, _ = recorded
    run_dir = tmp_path / "rloo"
    assert main([*tiny(), "--adv_estimator=rloo", f"--replay_rollouts={source}", f"--out={run_dir}"]) == 0
    err = capsys.readouterr().err
    assert sum("off-policy" in line for line in err.splitlines()) == 1
    assert "differs from the recording's in adv_estimator:" in err
    got, want = metrics(run_dir), metrics(source)
    for line_got, line_want in zip(got, want):  # the same rollouts: their rewards and lengths
        for key in ("reward/mean", "reward/std", "response/length_mean", "response/eos_frac"):
            assert line_got[key] == line_want[key]
    # iteration 1 starts from the checkpoint that sampled: on-policy; then RLOO's updates move away from GAE's
    assert got[0]["off_policy/behav_gap_max"] == 0.0
    assert got[1]["off_policy/behav_gap_mean"] > 0 and got[2]["off_policy/behav_gap_max"] > 0
    assert weights(run_dir) != weights(source)


# ---------------------------------------------------------------------------- resume

def stopped_at_step_2(run_dir, copy):
    """A copy of a finished 3-iteration run as if killed in iteration 3: step-3's checkpoint, summary and (for a
    recording) its rollout gone."""
    shutil.copytree(run_dir, copy)
    shutil.rmtree(copy / "checkpoints" / "step-3")
    (copy / "checkpoints" / "latest").write_text("step-2")
    (copy / "summary.json").unlink()
    (copy / "run.lock").unlink(missing_ok=True)
    for ext in ("safetensors", "json"):
        (copy / "rollouts" / f"step-3.{ext}").unlink(missing_ok=True)
    return copy


def test_a_resumed_recording_writes_the_same_rollout_and_weights(recorded, tmp_path):
    source, _ = recorded
    copy = stopped_at_step_2(source, tmp_path / "run")
    assert main(["--resume", str(copy)]) == 0
    name = os.path.join("rollouts", "step-3.safetensors")
    assert (copy / name).read_bytes() == (source / name).read_bytes()
    got, want = (json.loads((run / "rollouts" / "step-3.json").read_text()) for run in (copy, source))
    for record in (got, want):  # the seconds decoding took differ; the rest is the same
        record["state"]["sampled"].pop("generate_s"), record["state"]["sampled"]["stats"].pop("time/generate_s")
    assert got == want
    assert weights(copy) == weights(source)


def test_a_resumed_replay_reads_the_iteration_it_resumes_at(recorded, replayed, tmp_path):
    copy = stopped_at_step_2(replayed, tmp_path / "run")
    assert main(["--resume", str(copy)]) == 0
    assert weights(copy) == weights(recorded[0])
    assert [m["step"] for m in metrics(copy)] == [1, 2, 3]


# ---------------------------------------------------------------------------- refused, in one line, touching nothing

def copy_of_demo(tmp_path, change):
    """The demo checkpoint copied, then change(directory) applied."""
    policy = tmp_path / "policy"
    shutil.copytree(DEMO_CHECKPOINT, policy)
    change(policy)
    return policy


def nudged_weights(policy):
    tensors = load_file(policy / "model.safetensors")
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1e-3
    save_file(tensors, policy / "model.safetensors")


def other_tokenizer_config(policy):
    config = json.loads((policy / "tokenizer_config.json").read_text())
    (policy / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 77}))


def torn(name, cut):
    def tear(recording_dir):
        path = recording_dir / "rollouts" / name
        if cut is None:
            path.unlink()
        else:
            path.write_bytes(path.read_bytes()[:cut])
    return tear


@pytest.mark.parametrize("case", ["weights", "tokenizer", "shape", "iterations", "torn tensors", "missing tensors",
                                  "torn json", "missing json", "no recording"])
def test_a_recording_that_does_not_fit_is_refused_in_one_line(recorded, tmp_path, capsys, case):
    source = tmp_path / "recording"
    shutil.copytree(recorded[0], source)
    args, expect = [*tiny()], None
    if case == "weights":
        args.append(f"--policy={copy_of_demo(tmp_path, nudged_weights)}")
        expect = "sampled from another checkpoint"
    elif case == "tokenizer":
        args.append(f"--policy={copy_of_demo(tmp_path, other_tokenizer_config)}")
        expect = "tokenized by another tokenizer"
    elif case == "shape":
        args.append("--max_new_tokens=6")
        expect = "max_new_tokens 8 there, 6 here"
    elif case == "iterations":
        args = [*tiny(4)]
        expect = "holds 3 recorded iteration(s); this run asks for iterations=4"
    elif case == "torn tensors":
        torn("step-2.safetensors", 100)(source)
        expect = "step-2.safetensors has 100 bytes"
    elif case == "missing tensors":
        torn("step-3.safetensors", None)(source)
        expect = "step-3.safetensors is missing"
    elif case == "torn json":
        torn("step-2.json", 50)(source)
        expect = "step-2.json is unreadable or torn"
    elif case == "missing json":
        torn("step-2.json", None)(source)
        expect = "holds 1 recorded iteration(s); this run asks for iterations=3"
    else:
        shutil.rmtree(source / "rollouts")
        expect = "holds no recorded rollouts"
    before = snapshot(source)
    out = tmp_path / "out"
    assert main([*args, f"--replay_rollouts={source}", f"--out={out}"]) == 2
    line = one_line(capsys)
    assert line.startswith("ppo-train: error: config key 'replay_rollouts': ") and expect in line, line
    assert snapshot(source) == before
    assert not out.exists()


def test_a_step_edited_by_hand_stops_the_replay_in_one_line_keeping_what_it_saved(recorded, tmp_path, capsys):
    """step-2.json's tensors still match its SHA-256, but its state no longer holds a rollout: found when the replay
    reaches it (the start checks the tensors' hashes, not the meaning of the JSON); step-1's checkpoint stays."""
    source = tmp_path / "recording"
    shutil.copytree(recorded[0], source)
    step = source / "rollouts" / "step-2.json"
    record = json.loads(step.read_text())
    del record["state"]["sampled"]["rows"]
    step.write_text(json.dumps(record))
    out = tmp_path / "out"
    assert main([*tiny(), f"--replay_rollouts={source}", f"--out={out}"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[-1] == (f"ppo-train: error: config key 'replay_rollouts': {source}'s iteration 2 is not a "
                                    f"recorded rollout (KeyError: 'rows')")
    assert weights(out, 1) == weights(recorded[0], 1)


@pytest.mark.parametrize("mode, max_new_tokens, kept", [
    (["--adv_estimator=grpo", "--filter_groups"], 8, None),
    (["--off_policy_correction=tis"], 8, "decode_logprobs"),
    (["--task=toolmul", "--environment=tools", "--max_turns=2"], 48, "attended"),
], ids=["dapo-filter", "decode-logprobs", "episodes"])
def test_a_replay_reproduces_the_recording_in_other_modes(tmp_path, mode, max_new_tokens, kept):
    """DAPO's group filter (the rollout chosen from several batches), the decoding pass's log-probs recorded (an
    off-policy correction reads them as mu), multi-turn episodes (observation tokens: `attended`)."""
    args = [*tiny(2, max_new_tokens), *mode]
    assert main([*args, "--save_rollouts", f"--out={tmp_path / 'a'}"]) == 0
    if kept:
        assert f"sampled.tensors.{kept}.values" in load_file(tmp_path / "a" / "rollouts" / "step-1.safetensors")
    assert main([*args, f"--replay_rollouts={tmp_path / 'a'}", f"--out={tmp_path / 'b'}"]) == 0
    assert weights(tmp_path / "b", 2) == weights(tmp_path / "a", 2)
    replayed = metrics(tmp_path / "b")
    if kept == "decode_logprobs":  # mu is the decoding pass's: off the training path by rounding only
        assert 0 < replayed[0]["off_policy/behav_gap_max"] < 1e-5
    else:
        assert all(m["off_policy/behav_gap_max"] == 0.0 for m in replayed)


def test_replay_with_sampling_or_more_processes_is_refused_by_the_config(tmp_path):
    with pytest.raises(ConfigError, match="config key 'save_rollouts' does not combine with replay_rollouts"):
        build_config({}, {"replay_rollouts": str(tmp_path), "save_rollouts": "true"})
    with pytest.raises(ConfigError, match="config key 'max_staleness' does not combine with replay_rollouts"):
        build_config({}, {"replay_rollouts": str(tmp_path), "max_staleness": "1"})
    for key, value in (("save_rollouts", "true"), ("replay_rollouts", str(tmp_path))):
        with pytest.raises(ConfigError, match=f"config key '{key}' runs in one process, without rollout workers"):
            build_config({}, {key: value, "rollout_ranks": "1"})
        cfg = build_config({}, {key: value})
        with pytest.raises(ConfigError, match=f"config key '{key}': recorded rollouts are written and replayed by one "
                                              f"process; this run has 2"):
            recording.check_processes(cfg, 2)
        recording.check_processes(cfg, 1)


def test_replay_rollouts_is_made_absolute_for_resume(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert build_config({}, {"replay_rollouts": "runs/a"}).replay_rollouts == str(tmp_path / "runs" / "a")


def test_size_text():
    assert [recording.size_text(n) for n in (812, 3100, 1_620_000, 2_050_000_000)] == \
           ["812 B", "3.1 kB", "1.62 MB", "2.05 GB"]


def test_split_tensors_round_trips_a_nested_state(tmp_path):
    state = {"a": {"values": torch.arange(3), "dtype": "int64"}, "b": [torch.ones(2, dtype=torch.bool), None, "x"],
             "c": 1.5}
    tensors = {}
    record = recording.split_tensors(state, tensors)
    assert record == {"a": {"values": {"tensor": "a.values"}, "dtype": "int64"},
                      "b": [{"tensor": "b.0"}, None, "x"], "c": 1.5}
    assert set(tensors) == {"a.values", "b.0"}
