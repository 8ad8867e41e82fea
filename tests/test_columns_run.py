"""Prompt files with extra columns, end to end through `ppo-train` (issue 12): the `answer` column of a JSONL and of a
Parquet file reaches a reward function that checks it, the function's own metrics are logged, samples.jsonl and
TensorBoard get the rollout, and a reward function returning a dict of scores stops the run with one line. On the
`arith` task, a reward function checking the answer column trains the shipped checkpoint to a higher held-out
exact-match accuracy, with PPO (JSONL) and with GRPO (Parquet)."""
import importlib.util
import json
import os
import shlex
import subprocess
import sys

import pytest

import background
from ppo_core.data.tasks import eval_prompts

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

SMALL = ["--iterations=2", "--eval_size=8", "--rollout_batch_size=8", "--minibatch_size=8", "--micro_batch_size=8",
         "--ppo_epochs=1", "--progress=false", "--max_new_tokens=10"]

ANSWER_REWARD = '''
def exact(prompts, responses, answer):
    """1.0 when the response is the answer column exactly, and the share of right characters as a metric."""
    right = [sum(a == b for a, b in zip(r, t)) / max(len(r), len(t), 1) for r, t in zip(responses, answer)]
    return {"rewards": [float(r == t) + 0.5 * c for r, t, c in zip(responses, answer, right)], "chars": right}

def keys_as_scores(prompts, responses):
    return {i: 1.0 for i in range(len(responses))}
'''


def write_prompts(path, kind):
    """Reverse-task prompts with the reversed word as an `answer` column (and a `level` column nobody asks for)."""
    rows = [{"prompt": p, "answer": p.rstrip("=")[::-1], "level": i % 3} for i, p in enumerate(eval_prompts(40, seed=5))]
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), str(path))
    return rows


def ppo_train(*args, cwd):
    return subprocess.run([sys.executable, "-m", "ppo_core.train", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=600)


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_answer_column_reaches_the_reward_function(tmp_path, kind):
    (tmp_path / "answers.py").write_text(ANSWER_REWARD)
    rows = write_prompts(tmp_path / f"prompts.{kind}", kind)
    run = tmp_path / "run"
    proc = ppo_train(*SMALL, f"--prompts_file=prompts.{kind}", "--reward_fn=answers.py:exact", "--log_samples_every=1",
                     "--report_to=tensorboard", f"--out={run}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert all(0 <= m["reward/exact/chars"] <= 1 and "reward/exact" in m for m in metrics)
    samples = [json.loads(line) for line in open(run / "samples.jsonl")]
    assert [s["step"] for s in samples] == [1] * 8 + [2] * 8
    by_prompt = {r["prompt"]: r for r in rows[:-8]}  # the last 8 rows are held out
    for s in samples:  # every sample carries its row's columns, and its reward is the function's on them
        row = by_prompt[s["prompt"]]
        assert s["answer"] == row["answer"] and s["level"] == row["level"]
        chars = sum(a == b for a, b in zip(s["response"], row["answer"])) / max(len(s["response"]), len(row["answer"]), 1)
        assert s["reward/exact/chars"] == pytest.approx(chars, abs=1e-6)
        assert s["reward"] == pytest.approx(float(s["response"] == row["answer"]) + 0.5 * chars, abs=1e-6)
        assert s["policy_prompt"] == s["prompt"]  # no chat template, and the demo tokenizer adds no BOS
        # a character a token: a response that ran into the limit has max_new_tokens characters
        assert (s["stop"] == "length") == (len(s["response"]) == 10), s
    for step in (1, 2):  # the metric counts what the samples say
        eos_frac = sum(s["stop"] == "eos" for s in samples if s["step"] == step) / 8
        assert metrics[step - 1]["response/eos_frac"] == pytest.approx(eos_frac)
    # stderr is not a terminal here: one line an iteration, its numbers those of metrics.jsonl
    lines = [line for line in proc.stderr.splitlines() if line.startswith("iteration ")]
    assert [line.split()[1] for line in lines] == ["1/2", "2/2"], proc.stderr
    for line, m in zip(lines, metrics):
        words = line.split()
        assert words[words.index("reward") + 1] == f"{m['reward/mean']:.4f}"
        assert words[words.index("kl") + 1] == f"{m['kl/k3_mean']:.4f}"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard")).Reload()
    assert [e.value for e in events.Scalars("reward/mean")] == pytest.approx([m["reward/mean"] for m in metrics])


def test_reward_function_returning_a_dict_of_scores_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "answers.py").write_text(ANSWER_REWARD)
    write_prompts(tmp_path / "prompts.jsonl", "jsonl")
    proc = ppo_train(*SMALL, "--prompts_file=prompts.jsonl", "--reward_fn=answers.py:keys_as_scores",
                     f"--out={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 2
    last = proc.stderr.splitlines()[-1]  # after the run's start line: the error, one line
    assert proc.stderr.count("ppo-train: error:") == 1  # the spec as config.json holds it: the file made absolute
    assert last.startswith(f"ppo-train: error: reward function {tmp_path / 'answers.py'}:keys_as_scores")
    assert "returned a dict with keys [0, 1, 2, 3" in last


def test_a_column_the_reward_needs_and_the_file_lacks_is_one_line(tmp_path):
    (tmp_path / "answers.py").write_text(ANSWER_REWARD)
    (tmp_path / "prompts.txt").write_text("".join(p + "\n" for p in eval_prompts(20, seed=5)))
    proc = ppo_train(*SMALL, "--prompts_file=prompts.txt", "--reward_fn=answers.py:exact", f"--out={tmp_path / 'run'}",
                     cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "needs column 'answer', which the prompts file does not have" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_column_that_would_hide_a_samples_field_is_one_line_before_the_run(tmp_path):
    (tmp_path / "answers.py").write_text(ANSWER_REWARD)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": "x", "reward": 1}) + "\n"
                                                    for p in eval_prompts(20, seed=5)))
    proc = ppo_train(*SMALL, "--prompts_file=prompts.jsonl", "--reward_fn=answers.py:exact", "--log_samples_every=1",
                     f"--out={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "the prompts file's column 'reward' would hide samples.jsonl's own 'reward'" in proc.stderr
    assert not (tmp_path / "run").exists()


EXACT_MATCH = '''
from ppo_core.rewards.verifiers import extract_gsm8k, numbers_equal

def exact_match(prompts, responses, answer):
    return [float(numbers_equal(extract_gsm8k(r), a)) for r, a in zip(responses, answer)]
'''


ARITH_RUNS = {"jsonl": ["--adv_estimator=gae"],
              "parquet": ["--adv_estimator=grpo", "--n_samples_per_prompt=8", "--rollout_batch_size=16"]}


def arith_run(kind):
    """scripts/make_arith_prompts.py, then ppo-train on its file, as one shell command -> (key, command, directory)."""
    key = f"columns-arith-{kind}"
    d = background.directory(key)
    with open(os.path.join(d, "my_reward.py"), "w") as f:
        f.write(EXACT_MATCH)
    make = [sys.executable, os.path.join(ROOT, "scripts", "make_arith_prompts.py"), f"--out=arith.{kind}", "--n=512",
            "--eval_size=128"]
    train = [sys.executable, "-m", "ppo_core.train", "--task=arith", f"--prompts_file=arith.{kind}",
             "--reward_fn=my_reward.py:exact_match", "--iterations=20", "--eval_size=128", "--progress=false",
             *ARITH_RUNS[kind], f"--out={d}/run"]
    return key, ["sh", "-c", f"{shlex.join(make)} > /dev/null && exec {shlex.join(train)}"], d


def start_arith_runs():
    for kind in ARITH_RUNS:
        if kind == "jsonl" or importlib.util.find_spec("pyarrow") is not None:
            background.start(*arith_run(kind))


BACKGROUND = {"arith_kind": start_arith_runs}  # started as the suite begins (tests/background.py)


@pytest.fixture(params=list(ARITH_RUNS))
def arith_kind(request):
    return request.param


def test_answer_column_reward_raises_held_out_exact_match_on_arith(arith_kind):
    """The issue's acceptance run, small: scripts/make_arith_prompts.py writes 512 training rows and the task's 128
    held-out rows last ({"prompt": "347+85=", "answer": "432"}); 20 iterations from the shipped arith checkpoint,
    with PPO on JSONL and GRPO on Parquet. The held-out prompts are the task's own, so the accuracy before training
    is the built-in arith reward's."""
    kind = arith_kind
    if kind == "parquet":
        pytest.importorskip("pyarrow")
    proc = background.result(*arith_run(kind))
    assert proc.returncode == 0, proc.stderr[-3000:]
    where = os.path.join(background.directory(f"columns-arith-{kind}"), f"arith.{kind}")  # as config.json holds it
    assert f"prompts: 512 training rows from {where}, 128 held out (the file's last rows, at most half)" in proc.stderr
    with open(os.path.join(background.directory(f"columns-arith-{kind}"), "run", "summary.json")) as f:
        summary = json.load(f)
    # the shipped checkpoint forgets most carries: about 3 in 10 right greedily (the problems with none to forget)
    assert 0.2 < summary["eval/greedy_reward_before"] < 0.4
    # 128 prompts: a binomial standard error of at most 0.045; the rise asked for is over four of them
    assert summary["eval/greedy_reward_after"] > summary["eval/greedy_reward_before"] + 0.2
    assert summary["eval/reward_after"] > summary["eval/reward_before"]
