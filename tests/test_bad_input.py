"""Bad input: one clear line, exit status 2, no traceback, nothing already written lost or half written."""
import json
import os
import shutil

import pytest
import torch

import ppo_core.train as train
from ppo_core.config import build_config, to_dict
from ppo_core.run.runlog import RunDir, RunDirError
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
    prompts.write_text("abc=\n" * 24 + "x" * 70 + "=\n")  # enough rows for SMALL's batch of 16 (and 8 held out)
    err = fail([f"--prompts_file={prompts}", f"--out={tmp_path / 'r'}", *SMALL], capsys)
    assert f"{prompts}:25: the prompt has 71 tokens" in err and "exceeds the model's context of 64 tokens" in err


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
    assert json.loads((tmp_path / "r" / "config.json").read_text())["config"]["reward_fn"] == [f"{module}:fn"]
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == ""


def test_unknown_reward_function(tmp_path, capsys):
    err = fail(["--reward_fn=ppo_core.data.tasks:nope", f"--out={tmp_path / 'r'}", *SMALL], capsys)
    assert "cannot load reward_fn 'ppo_core.data.tasks:nope'" in err


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


# ---------------------------------------------------------------------------- checkpoint paths (newcomer review #11)

def test_policy_directory_that_does_not_exist(tmp_path, capsys):
    err = fail([f"--policy={tmp_path / 'nope'}", f"--out={tmp_path / 'r'}", *SMALL], capsys)
    assert err == f"ppo-train: error: config key 'policy': no such directory: {str(tmp_path / 'nope')!r}"
    assert not (tmp_path / "r").exists()


JUDGE_DEMO = os.path.join(os.path.dirname(DEMO_CHECKPOINT), "judge-demo")


@pytest.mark.parametrize("args, key, kind, missing", [  # issue 47: every path error names its config key
    (["--reference={x}"], "reference", "directory", "x"),
    (["--critic={x}"], "critic", "directory", "x"),
    (["--reward_model={x}"], "reward_model", "directory", "x"),
    (["--judge={x}"], "judge", "directory", "x"),
    (["--prompts_file={x}.jsonl"], "prompts_file", "file", "x.jsonl"),
    (["--prompts_file={prompts}", "--eval_prompts_file={x}.jsonl"], "eval_prompts_file", "file", "x.jsonl"),
    (["--reward_fn={x}.py:score"], "reward_fn", "file", "x.py"),
    (["--eval_reward_fn={x}.py:score"], "eval_reward_fn", "file", "x.py"),
    (["--environment={x}.py:Env"], "environment", "file", "x.py"),
    ([f"--judge={JUDGE_DEMO}", "--judge_template={x}.jinja"], "judge_template", "file", "x.jinja"),
])
def test_a_path_that_is_not_there_names_its_key(tmp_path, capsys, args, key, kind, missing):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("abc\n" * 40)
    argv = [a.format(x=tmp_path / "x", prompts=prompts) for a in args]
    err = fail([*argv, f"--out={tmp_path / 'r'}", *SMALL], capsys)
    assert err == f"ppo-train: error: config key '{key}': no such {kind}: {str(tmp_path / missing)!r}"
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("key, says", [("policy", "no tokenizer.json in"),
                                       ("critic", "no config.json in checkpoint directory")])
def test_a_directory_that_holds_no_checkpoint_names_its_key(tmp_path, capsys, key, says):
    (tmp_path / "empty").mkdir()
    err = fail([f"--{key}={tmp_path / 'empty'}", f"--out={tmp_path / 'r'}", *SMALL], capsys)
    assert err == f"ppo-train: error: config key '{key}': {says} {str(tmp_path / 'empty')!r}"


def test_path_errors_come_together_with_the_name_a_typo_meant(tmp_path, capsys, monkeypatch):
    """Relative paths are the working directory's; a near miss names the directory that is there (issue 47's
    '~/.cache/ppo-core/SmolLM2-135M-Instruc')."""
    shutil.copytree(DEMO_CHECKPOINT, tmp_path / "SmolLM2-135M-Instruct")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "abc"}\n')
    monkeypatch.chdir(tmp_path)
    err = fail(["--policy=SmolLM2-135M-Instruc", "--critic=prompts.jsonl", "--prompts_file=prompt.jsonl",
                f"--out={tmp_path / 'r'}", *SMALL], capsys)
    assert err == (f"ppo-train: error: 3 config problems: config key 'policy': no such directory: "
                   f"{str(tmp_path / 'SmolLM2-135M-Instruc')!r} (did you mean "
                   f"{str(tmp_path / 'SmolLM2-135M-Instruct')!r}?); "
                   f"config key 'critic': not a directory: {str(tmp_path / 'prompts.jsonl')!r}; "
                   f"config key 'prompts_file': no such file: {str(tmp_path / 'prompt.jsonl')!r} (did you mean "
                   f"{str(tmp_path / 'prompts.jsonl')!r}?)")


def test_loaders_expand_the_home_directory_and_name_a_missing_one(demo_copy, tmp_path, monkeypatch):
    """Direct API callers get what the CLI gets: `~` expanded, and "no such directory" for a path that is not there
    (rather than the first file the loader looks for)."""
    from ppo_core.models.model import CheckpointError, load_model, load_reward_model, load_score_model, read_config
    from ppo_core.models.tokenizer import load_tokenizer

    monkeypatch.setenv("HOME", str(tmp_path))  # demo_copy is tmp_path/ckpt, so "~/ckpt" names it
    assert load_tokenizer("~/ckpt").encode("abc=") == load_tokenizer(str(demo_copy)).encode("abc=")
    expected = load_model(str(demo_copy)).state_dict()
    got = load_model("~/ckpt").state_dict()
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
    assert load_score_model("~/ckpt").args.hidden_size == expected["model.embed_tokens.weight"].shape[1]
    for loader in (load_tokenizer, load_model, load_score_model, load_reward_model, read_config):
        with pytest.raises(CheckpointError) as e:
            loader("~/nope")
        assert str(e.value) == f"no such directory: {str(tmp_path / 'nope')!r}", loader.__name__
    with pytest.raises(CheckpointError, match="^not a directory: "):
        load_model(str(demo_copy / "config.json"))


# ---------------------------------------------------------------------------- reusing an --out (newcomer review #3)

def test_a_run_that_failed_before_its_first_checkpoint_is_replaced_by_a_corrected_one(tmp_path, capsys):
    """The review's path: a broken reward function stops the run in its first rollout; the fixed one, with the
    same --out, trains there instead of being refused."""
    run_dir = tmp_path / "r"
    broken, fixed = tmp_path / "broken.py", tmp_path / "fixed.py"
    broken.write_text("def fn(prompts, responses):\n    if len(prompts) == 8:\n        return [0.0] * 8\n"
                      "    raise ValueError('a bug')\n")
    fixed.write_text("def fn(prompts, responses):\n    return [float(len(r)) for r in responses]\n")
    err = fail([f"--reward_fn={broken}:fn", f"--out={run_dir}", *SMALL], capsys)
    assert "a bug" in err
    assert (run_dir / "config.json").exists() and not (run_dir / "checkpoints").exists()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "left": "by the failed run"}\n')

    assert train.main([f"--reward_fn={fixed}:fn", f"--out={run_dir}", *SMALL]) == 0
    saved = RunDir.saved_config(str(run_dir))
    assert saved["reward_fn"] == to_dict(build_config(overrides={"reward_fn": f"{fixed}:fn"}))["reward_fn"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and "left" not in rows[0]
    assert (run_dir / "summary.json").exists() and (run_dir / "checkpoints" / "step-1").is_dir()


def test_replacing_needs_a_run_without_any_checkpoint(tmp_path):
    """RunDir.open's rule, on the directory alone: a different config replaces a run with no checkpoint (a
    half-written `.tmp-*` save does not count, and is removed); one complete checkpoint and it is refused."""
    out = str(tmp_path / "r")
    first, second = (build_config(overrides={"out": out, "lr": lr}) for lr in ("1e-3", "2e-3"))
    assert RunDir.open(first, DEMO_CHECKPOINT).replaced is None
    (tmp_path / "r" / "metrics.jsonl").write_text('{"step": 1}\n')
    os.makedirs(tmp_path / "r" / "checkpoints" / ".tmp-step-1")
    run_dir = RunDir.open(second, DEMO_CHECKPOINT)
    assert run_dir.replaced == (f"output directory {out} held a run that stopped before its first checkpoint "
                                f"(config differed in: lr); replaced its config.json and metrics.jsonl")
    assert RunDir.saved_config(out)["lr"] == 2e-3
    assert not (tmp_path / "r" / "metrics.jsonl").exists()
    assert os.listdir(tmp_path / "r" / "checkpoints") == []
    assert RunDir.open(second, DEMO_CHECKPOINT).replaced is None  # now the same run: re-opened as it is
    os.makedirs(tmp_path / "r" / "checkpoints" / "step-1")
    with pytest.raises(RunDirError, match=r"already holds a different run \(config differs in: lr\); "
                                          r"choose another --out or --resume it$"):
        RunDir.open(first, DEMO_CHECKPOINT)
    assert RunDir.saved_config(out)["lr"] == 2e-3
