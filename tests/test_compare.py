"""scripts/compare.py end to end: real `ppo-train` runs at tiny size, its tables recomputed from the runs' own files."""
import json
import os
import statistics
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPARE = os.path.join(ROOT, "scripts", "compare.py")
TINY = ["--iterations=2", "--eval_size=8", "--minibatch_size=8", "--micro_batch_size=8", "--max_new_tokens=6"]
SUMMARY_KEYS = {"reward_before": "eval/reward_before", "reward_after": "eval/reward_after",
                "greedy_reward_after": "eval/greedy_reward_after", "kl_final": "kl/final"}


def compare(*args, env=None):
    return subprocess.run([sys.executable, COMPARE, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


def read_json(path):
    with open(path) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    """gae and grpo x seeds 0 1, 8 responses per iteration (grpo: 2 prompts x 4), two iterations each."""
    out = tmp_path_factory.mktemp("compare") / "out"
    proc = compare("--estimators", "gae,grpo", "--seeds", "0", "1", "--samples_per_iteration", "8", "--group_size", "4",
                   "--jobs", "2", "--out", str(out), "--", *TINY)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc


def test_runs_and_table(comparison):
    out, proc = comparison
    assert proc.stdout.count("[start] ") == 4 and "--adv_estimator=grpo --n_samples_per_prompt=4 --rollout_batch_size=2 --seed=1" in proc.stdout
    md = (out / "compare.md").read_text()
    assert md.count("\n| gae | 8 x 1 |") == 1 and md.count("\n| grpo | 2 x 4 |") == 1  # one table row per estimator
    report = read_json(out / "compare.json")
    for est in ("gae", "grpo"):
        summaries = [read_json(out / f"{est}-seed{seed}" / "summary.json") for seed in (0, 1)]
        row = report["estimators"][est]
        for key, summary_key in SUMMARY_KEYS.items():
            values = [s[summary_key] for s in summaries]
            assert row[key] == {"mean": statistics.mean(values), "std": statistics.stdev(values), "n": 2}, key
            # the markdown shows the same numbers
            assert f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}" in md
        headroom = []
        for s in summaries:
            headroom.append((s["eval/reward_after"] - s["eval/reward_before"]) / (1.0 - s["eval/reward_before"]))
        assert row["headroom_closed"] == {"mean": statistics.mean(headroom), "std": statistics.stdev(headroom), "n": 2}
        assert row["time_s"] == statistics.mean(s["time/total_s"] for s in summaries)
        tokens_per_s = []
        for seed in (0, 1):
            with open(out / f"{est}-seed{seed}" / "metrics.jsonl") as f:
                tokens_per_s += [json.loads(line)["tokens_per_s"] for line in f]
        assert len(tokens_per_s) == 4 and row["tokens_per_s"] == statistics.mean(tokens_per_s)
    # the same initial policy and held-out set for a seed: the evaluation before training is the same for every estimator
    for seed in (0, 1):
        before = {read_json(out / f"{est}-seed{seed}" / "summary.json")["eval/reward_before"] for est in ("gae", "grpo")}
        assert len(before) == 1


def test_equal_sample_budget_and_no_critic(comparison):
    out, _ = comparison
    for seed in (0, 1):
        grpo = read_json(out / f"grpo-seed{seed}" / "config.json")["config"]
        gae = read_json(out / f"gae-seed{seed}" / "config.json")["config"]
        assert (grpo["adv_estimator"], grpo["n_samples_per_prompt"], grpo["rollout_batch_size"], grpo["seed"]) == ("grpo", 4, 2, seed)
        assert (gae["adv_estimator"], gae["n_samples_per_prompt"], gae["rollout_batch_size"], gae["seed"]) == ("gae", 1, 8, seed)
        assert grpo["policy"] == gae["policy"] and (grpo["threads"], grpo["progress"], grpo["iterations"]) == (1, False, 2)
    assert not (out / "grpo-seed0" / "checkpoints" / "step-2" / "critic").exists()
    assert (out / "gae-seed0" / "checkpoints" / "step-2" / "critic").is_dir()  # where a critic would be


def test_png(comparison):
    out, _ = comparison
    png = (out / "compare.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_bad_estimator_starts_nothing(tmp_path):
    out = tmp_path / "out"
    proc = compare("--estimators", "gae,grpoo", "--out", str(out), "--", *TINY)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "grpoo" in proc.stderr and proc.stdout == ""
    assert not out.exists()


def test_without_matplotlib_still_writes_the_report(tmp_path):
    """A `matplotlib` package that fails to import, first on the path: one line says so, compare.md is written, exit 0."""
    hide = tmp_path / "hide" / "matplotlib"
    hide.mkdir(parents=True)
    (hide / "__init__.py").write_text("raise ImportError('hidden by test_compare')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hide.parent), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "out"
    proc = compare("--estimators", "reinforce_pp", "--seeds", "0", "--samples_per_iteration", "8", "--out", str(out),
                   "--", *TINY, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sum("matplotlib is not installed" in line for line in proc.stdout.splitlines()) == 1
    assert not (out / "compare.png").exists()
    md = (out / "compare.md").read_text()
    s = read_json(out / "reinforce_pp-seed0" / "summary.json")
    assert f"| reinforce_pp | 8 x 1 | {s['eval/reward_before']:.4f} ± 0 |" in md  # one seed: "± 0"
    assert read_json(out / "compare.json")["estimators"]["reinforce_pp"]["reward_after"] == {
        "mean": s["eval/reward_after"], "std": 0.0, "n": 1}
