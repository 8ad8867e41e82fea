"""Bad input: one clear line, exit status 2, no traceback, nothing already written lost or half written."""
import json
import os
import shutil

import pytest

import ppo_core.train as train
from ppo_core.train import DEMO_CHECKPOINT

SMALL = ["--iterations=1", "--eval_size=8", "--rollout_batch_size=16", "--minibatch_size=16",
         "--micro_batch_size=16", "--ppo_epochs=1", "--progress=false"]


def fail(argv, capsys):
    """Exit status 2 and exactly one error line, the last thing printed (progress lines may precede it)."""
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("ppo-train: error: ") and "Traceback" not in err
    assert sum("error" in line for line in lines) == 1
    return lines[-1]


@pytest.fixture
def demo_copy(tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(DEMO_CHECKPOINT, path)
    return path


def test_truncated_checkpoint(demo_copy, tmp_path, capsys):
    weights = demo_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    err = fail([f"--policy={demo_copy}", f"--out={tmp_path / 'r'}", *SMALL], capsys)
    assert "model.safetensors" in err
    assert not (tmp_path / "r").exists()


def test_missing_weights_file(demo_copy, tmp_path, capsys):
    os.remove(demo_copy / "model.safetensors")
    err = fail([f"--policy={demo_copy}", f"--out={tmp_path / 'r'}", *SMALL], capsys)
    assert "no model.safetensors" in err


def test_tokenizer_that_does_not_match_the_model(demo_copy, tmp_path, capsys):
    tok = json.loads((demo_copy / "tokenizer.json").read_text())
    for i in range(40):  # a vocabulary larger than the model's embedding table
        tok["model"]["vocab"][f"extra{i}"] = len(tok["model"]["vocab"])
    (demo_copy / "tokenizer.json").write_text(json.dumps(tok))
    err = fail([f"--policy={demo_copy}", f"--out={tmp_path / 'r'}", *SMALL], capsys)
    assert "tokenizer" in err and "vocabulary" in err


def test_prompt_longer_than_the_context(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("abc=\n" + "x" * 70 + "=\n")
    err = fail([f"--prompts_file={prompts}", f"--out={tmp_path / 'r'}", *SMALL], capsys)
    assert "exceeds the model's context of 64 tokens" in err


@pytest.mark.parametrize("body, message", [
    ("return [0.5]", "returned 1 scores for 16 responses"),
    ("return [float('nan')] * len(prompts)", "returned nan for sample 0"),
    ("return None", "must return a list of numbers"),
])
def test_reward_function_with_a_wrong_answer(tmp_path, capsys, body, message):
    module = tmp_path / "reward.py"
    # the 'before' evaluation scores 8 prompts first: make it pass, then fail on the rollout's 16
    module.write_text("def fn(prompts, responses):\n"
                      "    if len(prompts) == 8:\n        return [0.0] * 8\n"
                      f"    {body}\n")
    err = fail([f"--reward_fn={module}:fn", f"--out={tmp_path / 'r'}", *SMALL], capsys)
    assert message in err
    # the run directory keeps what it had: the config, and no metrics line for the failed iteration
    assert json.loads((tmp_path / "r" / "config.json").read_text())["config"]["reward_fn"] == f"{module}:fn"
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == ""


def test_unknown_reward_function(tmp_path, capsys):
    err = fail(["--reward_fn=ppo_core.tasks:nope", f"--out={tmp_path / 'r'}", *SMALL], capsys)
    assert "cannot load reward_fn 'ppo_core.tasks:nope'" in err


def test_conflicting_settings(tmp_path, capsys):
    err = fail(["--kl_target=0.1", "--kl_coef=0", f"--out={tmp_path / 'r'}"], capsys)
    assert "'kl_coef' must be > 0 when kl_target > 0" in err


def test_output_directory_holding_a_different_run(tmp_path, capsys):
    run_dir = tmp_path / "r"
    assert train.main([f"--out={run_dir}", *SMALL]) == 0
    capsys.readouterr()
    files = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    err = fail([f"--out={run_dir}", *SMALL, "--lr=1e-4"], capsys)
    assert "already holds a different run (config differs in: lr)" in err
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == files  # untouched
    err = fail([f"--out={run_dir}", *SMALL], capsys)
    assert "already holds a finished run" in err


def test_secrets_in_the_environment_are_not_written(tmp_path, monkeypatch, capsys):
    secret = "hf_SECRETtoken1234567890"
    monkeypatch.setenv("HF_TOKEN", secret)
    run_dir = tmp_path / "r"
    assert train.main([f"--out={run_dir}", *SMALL]) == 0
    out = capsys.readouterr()
    assert secret not in out.out + out.err
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path
