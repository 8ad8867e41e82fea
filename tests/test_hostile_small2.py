"""The smaller findings of the second hostile probe (issue 49, finding 9), each through the real component: a
tokenizer.json whose split regex backtracks past the regex engine's limit (a Rust panic), a lone surrogate escape in a
prompts file, a tool's answer quoting a character the demo tokenizer cannot encode, RoPE and norm settings in
config.json that load and train on NaN, and SIGINT during the start-up. Each is one line (exit 2, or 130 for the
interrupt) with nothing written lost, or, for the tool's answer, data that is replaced and counted."""
import json
import math
import os
import shutil
import signal
import subprocess
import sys

import pytest

from ppo_core.agents.environments import OBSERVATION_REPLACEMENT, ToolEnvironment, run_episodes
from ppo_core.agents.tools import Calculator
from ppo_core.data.prompts import PromptsError, load_rows
from ppo_core.engine import RolloutEngine
from ppo_core.models.model import load_model
from ppo_core.models.tokenizer import UnknownTextError, load_tokenizer
from ppo_core.train import DEMO_CHECKPOINT, DEMO_CHECKPOINTS, main

TINY = ["--iterations=1", "--eval_size=2", "--rollout_batch_size=4", "--n_samples_per_prompt=2", "--minibatch_size=8",
        "--micro_batch_size=8", "--max_new_tokens=8", "--progress=false"]


def demo_copy(tmp_path, name="policy"):
    """A copy of the reverse task's demo checkpoint, to damage."""
    return shutil.copytree(DEMO_CHECKPOINT, tmp_path / name)


def edit_json(path, change):
    value = json.loads(path.read_text())
    change(value)
    path.write_text(json.dumps(value))  # NaN and Infinity as Python writes them (and reads them back)


# ---------------------------------------------------------------------------- a split regex that backtracks too far

def test_a_split_regex_past_the_regex_engine_s_limit_is_one_line_naming_the_file(tmp_path, capfd):
    policy = demo_copy(tmp_path)
    # (a|aa)* tries every split of a run of a's before failing on the x: 2^n tries, past Oniguruma's retry limit at
    # 60 a's; every other text falls to the '.' (one character a piece, as the demo's own regex splits)
    edit_json(policy / "tokenizer.json", lambda t: t["pre_tokenizer"]["pattern"].update(Regex="(a|aa)*x|."))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("abc=\ncab=\n" + "a" * 80 + "=\nbca=\n")
    assert main([*TINY, f"--policy={policy}", f"--prompts_file={prompts}", f"--out={tmp_path / 'run'}"]) == 2
    out, err = capfd.readouterr()  # file descriptor 2 as well: where the Rust panic writes its message
    assert err == (f"ppo-train: error: {policy / 'tokenizer.json'}: the tokenizers library failed encoding a text "
                   f"of 81 characters (Onig: Regex search error: retry-limit-in-match over); its pre-tokenizer's regex "
                   f"backtracks past the regex engine's limit\n"), err
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------- a lone surrogate in a prompts file

def test_a_lone_surrogate_escape_in_a_prompts_file_is_one_line_with_file_and_line(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "abc="}\n{"prompt": "cab="}\n{"prompt": "ab\\ud800c="}\n{"prompt": "bca="}\n')
    assert main([*TINY, f"--prompts_file={prompts}", f"--out={tmp_path / 'run'}"]) == 2
    assert capsys.readouterr().err == (
        f"ppo-train: error: config key 'prompts_file': {prompts}:3: \"prompt\" holds a lone surrogate escape "
        f"(\\ud800), half of a UTF-16 pair and not a character: write the character itself, or both halves\n")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("text, name, where, escape", [
    ('{"messages": [{"role": "user", "content": "hi \\udfff"}]}\n', "p.jsonl", "p.jsonl:1: \"messages\"[0]['content']",
     "\\udfff"),
    ('[{"prompt": "ok"}, {"prompt": "ok", "answer": ["1", "\\udc00"]}]', "p.json", "p.json: row 2: \"answer\"[1]",
     "\\udc00"),
])
def test_a_lone_surrogate_anywhere_in_a_row_is_named(tmp_path, text, name, where, escape):
    (tmp_path / name).write_text(text)
    with pytest.raises(PromptsError) as e:
        load_rows(tmp_path / name)
    assert str(e.value) == (f"{tmp_path / where} holds a lone surrogate escape ({escape}), half of a UTF-16 pair and "
                            f"not a character: write the character itself, or both halves")


def test_a_surrogate_pair_is_one_character_and_reads(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "smile \\ud83d\\ude00"}\n')
    assert load_rows(tmp_path / "p.jsonl") == [{"prompt": "smile \U0001F600"}]


# ---------------------------------------------------------------------------- a tool's answer it cannot encode

class TimesSign(ToolEnvironment):
    """The shipped ToolEnvironment fed a call whose JSON escapes a multiplication sign (U+00D7), which the tool-demo's
    character vocabulary lacks: the calculator's error quotes it back. A tiny policy cannot be made to write it."""
    CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6\\u00d77"}}\n</tool_call>'

    def step(self, assistant_text):
        return super().step(self.CALL)


def test_a_tool_answer_the_tokenizer_cannot_encode_is_replaced_and_counted():
    tokenizer = load_tokenizer(DEMO_CHECKPOINTS["toolmul"])
    with pytest.raises(UnknownTextError):  # what the toolmul demo died of
        tokenizer.encode("\u00d7")
    policy = load_model(DEMO_CHECKPOINTS["toolmul"]).eval()
    rows = [{"prompt": "6*7=", "answer": "42"}, {"prompt": "12*3=", "answer": "36"}]
    envs = [TimesSign({"calculator": Calculator()}, max_turns=3) for _ in rows]
    episodes = run_episodes(RolloutEngine(policy), tokenizer, envs, rows, max_new_tokens=300, max_turn_tokens=6,
                            greedy=True)
    for episode in episodes:
        answers = [m["content"] for m in episode.messages if m["role"] == "tool"]
        assert len(answers) == 2 and episode.turns == 3  # the episode went on after each answer
        assert answers == [f"error: not an arithmetic expression: invalid character '{OBSERVATION_REPLACEMENT}' "
                           f"(U+00D7)"] * 2
        assert episode.observation_chars_replaced == 2
        # the sequence holds the answer's tokens as the tokenizer encodes the replaced text
        assert tokenizer.decode(episode.tokens, skip_special_tokens=False).count(answers[0]) == 2


# ---------------------------------------------------------------------------- RoPE and norm settings in config.json

@pytest.mark.parametrize("change, key, shown", [
    (dict(rope_scaling={"rope_type": "linear", "factor": 0}), "key 'rope_scaling': 'factor'", "0"),
    (dict(rope_scaling={"rope_type": "linear", "factor": -2.0}), "key 'rope_scaling': 'factor'", "-2.0"),
    (dict(rope_scaling={"rope_type": "linear", "factor": math.inf}), "key 'rope_scaling': 'factor'", "inf"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": math.nan}), "key 'rope_parameters': 'rope_theta'",
     "nan"),
    (dict(rope_theta=math.inf), "key 'rope_theta'", "inf"),
    (dict(rope_theta=math.nan), "key 'rope_theta'", "nan"),
    (dict(rope_theta=0), "key 'rope_theta'", "0"),
    (dict(rope_theta=-10000.0), "key 'rope_theta'", "-10000.0"),
    (dict(rms_norm_eps=math.inf), "key 'rms_norm_eps'", "inf"),
    (dict(rms_norm_eps=math.nan), "key 'rms_norm_eps'", "nan"),
    (dict(rms_norm_eps=-1e-6), "key 'rms_norm_eps'", "-1e-06"),
], ids=lambda v: None if isinstance(v, dict) else str(v).replace(" ", ""))
def test_rope_and_norm_settings_that_give_nan_are_refused_at_load(tmp_path, capsys, change, key, shown):
    policy = demo_copy(tmp_path)
    edit_json(policy / "config.json", lambda c: c.update(change))
    assert main([*TINY, f"--policy={policy}", f"--out={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err == (f"ppo-train: error: config key 'policy': {policy / 'config.json'}: {key} must be a positive finite "
                   f"number, got {shown}\n"), err
    assert not (tmp_path / "run").exists()


def test_a_linear_rope_factor_in_range_still_loads(tmp_path):
    policy = demo_copy(tmp_path)
    edit_json(policy / "config.json", lambda c: c.update(rope_scaling={"rope_type": "linear", "factor": 0.5}))
    assert load_model(policy).args.rope_parameters


# ---------------------------------------------------------------------------- SIGINT during the start-up

SLOW_IMPORT = "import sys, time\nprint('reward file: importing', file=sys.stderr, flush=True)\ntime.sleep(120)\n" \
              "def score(prompts, responses):\n    return [0.0] * len(responses)\n"
SLOW_SCORE = "import sys, time\ndef score(prompts, responses):\n" \
             "    print('reward file: scoring', file=sys.stderr, flush=True)\n    time.sleep(120)\n" \
             "    return [0.0] * len(responses)\n"


def interrupted(tmp_path, reward_file, marker):
    """A real ppo-train whose reward file prints `marker` and then sleeps 2 minutes (in its import, or in its first
    call: the evaluation before training), sent SIGINT once the marker is on its stderr. -> (exit status, stderr
    after the marker, the run directory)."""
    reward = tmp_path / "reward.py"
    reward.write_text(reward_file)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "ppo_core.train", *TINY, f"--reward_fn={reward}:score",
                             f"--out={run_dir}"], stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line == f"{marker}\n":
            break
    assert seen and seen[-1] == f"{marker}\n", "".join(seen)
    proc.send_signal(signal.SIGINT)
    _, after = proc.communicate(timeout=60)
    return proc.returncode, after, run_dir


def test_sigint_while_a_reward_file_imports_is_one_line_exit_130(tmp_path):
    code, after, run_dir = interrupted(tmp_path, SLOW_IMPORT, "reward file: importing")
    assert (code, after) == (130, "ppo-train: interrupted during start-up (SIGINT); no checkpoint was saved yet, "
                                  "nothing else was lost\n")
    assert not run_dir.exists()


def test_sigint_in_the_evaluation_before_training_is_one_line_and_keeps_config_json(tmp_path):
    code, after, run_dir = interrupted(tmp_path, SLOW_SCORE, "reward file: scoring")
    assert (code, after) == (130, "ppo-train: interrupted during start-up (SIGINT); no checkpoint was saved yet, "
                                  "nothing else was lost\n")
    saved = json.loads((run_dir / "config.json").read_text())  # written whole before the interrupt
    assert saved["config"]["reward_fn"] == [f"{tmp_path / 'reward.py'}:score"]
    assert (run_dir / "metrics.jsonl").read_text() == "" and not (run_dir / "checkpoints").exists()
