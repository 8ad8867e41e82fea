"""What a new user meets in the first hour, when something is wrong (issue 21): a prompt character the tokenizer
cannot encode, an --out that cannot be a directory, and a reward function of their own that raises. Each is one line
and exit status 2; nothing already written is lost, and nothing is written when the error is found before any work."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from ppo_core.models import tokenizer
from ppo_core.train import DEMO_CHECKPOINT, main

SMALL = ["--iterations=1", "--eval_size=8", "--rollout_batch_size=16", "--minibatch_size=16",
         "--micro_batch_size=16", "--ppo_epochs=1", "--progress=false"]


def fail(argv, capsys, before_any_work=True):
    """Exit status 2 and one error line, with no traceback. Found before any work, it is all that is printed; found
    later, the run's progress lines come before it, and it is the last line."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert lines[-1].startswith("ppo-train: error: ") and "Traceback" not in err, err
    assert sum("error" in line for line in lines) == 1 and (len(lines) == 1 or not before_any_work), err
    return lines[-1]


# ---------------------------------------------------------------------------- 4: a character the vocabulary lacks

def test_prompt_character_missing_from_the_vocabulary_names_the_row_and_the_character(tmp_path):
    """The demo's character vocabulary has no 'é': the one line names the file, its line and the character
    (the file's line, blank lines counted), as `ppo-train` prints it, and no run directory is made. Found before any
    model is built: a critic directory that holds no checkpoint is never read."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("abc=\n\ncafé=\nxyz=\nqrs=\n")
    (tmp_path / "not-a-checkpoint").mkdir()
    proc = subprocess.run([sys.executable, "-m", "ppo_core.train", f"--prompts_file={prompts}",
                           f"--critic={tmp_path / 'not-a-checkpoint'}", f"--out={tmp_path / 'run'}", *SMALL],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr == (f"ppo-train: error: config key 'prompts_file': {prompts}:3: no token for 'é' (U+00E9) in "
                           f"the tokenizer's vocabulary, and no unknown token to stand for it\n")
    assert not (tmp_path / "run").exists()


def test_held_out_prompt_with_a_character_missing_from_the_vocabulary(tmp_path, capsys):
    train_file, eval_file = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train_file.write_text('{"prompt": "abc="}\n{"prompt": "xyz="}\n')
    eval_file.write_text('{"prompt": "abc="}\n\n{"prompt": "ab€="}\n')
    err = fail([f"--prompts_file={train_file}", f"--eval_prompts_file={eval_file}", f"--out={tmp_path / 'run'}", *SMALL],
               capsys)
    assert err == (f"ppo-train: error: config key 'eval_prompts_file': {eval_file}:3: no token for '€' (U+20AC) in the "
                   f"tokenizer's vocabulary, and no unknown token to stand for it")
    assert not (tmp_path / "run").exists()


def test_a_tokenizer_with_an_unknown_token_is_not_affected(tmp_path):
    """Only a tokenizer without an unknown token refuses text: one with an unknown token encodes 'é' as that token."""
    with pytest.raises(tokenizer.UnknownTextError, match=r"^no token for ' ' \(U\+0020\)"):
        tokenizer.load_tokenizer(DEMO_CHECKPOINT).encode("ab cd=")
    shutil.copytree(DEMO_CHECKPOINT, tmp_path / "ckpt")
    tok = json.loads((tmp_path / "ckpt" / "tokenizer.json").read_text())
    tok["model"]["unk_token"] = "<pad>"  # a token of the vocabulary
    (tmp_path / "ckpt" / "tokenizer.json").write_text(json.dumps(tok))
    with_unk = tokenizer.load_tokenizer(tmp_path / "ckpt")
    assert with_unk.encode("café=") == with_unk.encode("caf") + [with_unk.pad_token_id] + with_unk.encode("=")
    assert with_unk.encode_prompt("café=") == with_unk.encode("café=")


# ---------------------------------------------------------------------------- 5: an --out that cannot be a directory

def test_out_under_a_regular_file(tmp_path, capsys):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine\n")
    err = fail([f"--out={a_file / 'run'}", *SMALL], capsys)
    assert err == f"ppo-train: error: output directory {a_file / 'run'}: {a_file} is a file, not a directory"
    err = fail([f"--out={a_file}", *SMALL], capsys)
    assert err == f"ppo-train: error: output directory {a_file}: is a file, not a directory"
    assert a_file.read_text() == "mine\n"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_out_where_nothing_can_be_written(capsys):
    err = fail(["--out=/proc/ppo-core-test/run", *SMALL], capsys)
    assert err.startswith("ppo-train: error: output directory /proc/ppo-core-test/run: cannot write in /proc (")


# ---------------------------------------------------------------------------- 7: a reward function that raises

def test_reward_function_that_raises_names_the_line_in_the_users_file(tmp_path, capsys):
    module = tmp_path / "my_rewards.py"
    module.write_text("def ratio(response):\n"
                      "    return len(response) / 0\n"
                      "\n"
                      "def score(prompts, responses):\n"
                      "    if len(prompts) == 8:  # the evaluation before training passes; the rollout's batch fails\n"
                      "        return [0.0] * 8\n"
                      "    return [ratio(r) for r in responses]\n")
    run_dir = tmp_path / "run"
    err = fail([f"--reward_fn={module}:score", f"--out={run_dir}", *SMALL], capsys, before_any_work=False)
    assert err.startswith(f"ppo-train: error: reward function {module}:score raised ZeroDivisionError: division by "
                          f"zero on sample 0 (prompt ")
    assert err.endswith(f"; raised at {module}:2 in ratio; full traceback in {run_dir / 'error.log'}")
    log = (run_dir / "error.log").read_text()
    assert "Traceback (most recent call last):" in log and f'File "{module}", line 7, in score' in log
    assert log.rstrip().endswith("ZeroDivisionError: division by zero")
    # the run directory keeps what it had: the config, and no metrics line for the failed iteration
    assert json.loads((run_dir / "config.json").read_text())["config"]["reward_fn"] == [f"{module}:score"]
    assert (run_dir / "metrics.jsonl").read_text() == ""
