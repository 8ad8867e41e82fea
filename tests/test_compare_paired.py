"""scripts/compare.py's paired statistics: Student's t quantile against textbook values, paired differences against
hand-worked numbers, and the pairing itself on real runs (seed s of two variants shares prompts and noise)."""
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPARE = os.path.join(ROOT, "scripts", "compare.py")
TINY = ["--iterations=2", "--eval_size=8", "--minibatch_size=8", "--micro_batch_size=8", "--max_new_tokens=6"]


def load_compare():
    spec = importlib.util.spec_from_file_location("compare", COMPARE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


compare_py = load_compare()


def read_json(path):
    with open(path) as f:
        return json.load(f)


@pytest.mark.parametrize("df, t", [(1, 12.706205), (2, 4.302653), (3, 3.182446), (4, 2.776445), (10, 2.228139),
                                   (19, 2.093024), (20, 2.085963), (30, 2.042272), (1000, 1.962339)])
def test_t_quantile_against_textbook_values(df, t):
    """t_{0.975, df} from the tables (six decimals: the tables' own rounding)."""
    assert abs(compare_py.t_quantile(0.975, df) - t) <= 5e-7


def test_t_coverage_against_closed_forms():
    """df = 1 is Cauchy: P(|T| <= t) = 2 atan(t) / pi; df = 2: t / sqrt(2 + t^2)."""
    for t in (0.1, 1.0, 3.0, 40.0):
        assert compare_py.t_coverage(t, 1) == pytest.approx(2 * math.atan(t) / math.pi, abs=1e-15)
        assert compare_py.t_coverage(t, 2) == pytest.approx(t / math.sqrt(2 + t * t), abs=1e-15)


def test_a_resolved_difference_by_hand():
    """Three seeds, b - a = 0.05, 0.08, 0.05: mean 0.06, sd sqrt(0.0006 / 2) = 0.0173205, se 0.01, the interval
    0.06 +- 4.302653 * 0.01; the unpaired se sqrt(0.01 / 3 + 0.0103 / 3) (the two variants' variances 0.01 and
    0.0103); 3 seeds resolve it (2 give 12.706 * 0.0173205 / sqrt 2 = 0.156 > 0.06)."""
    a, b = {0: 0.50, 1: 0.60, 2: 0.70}, {0: 0.55, 1: 0.68, 2: 0.75}
    d = compare_py.paired_difference(a, b)
    assert d["seeds"] == [0, 1, 2]
    assert d["mean"] == pytest.approx(0.06, abs=1e-12)
    assert d["sd_paired"] == pytest.approx(math.sqrt(0.0003), abs=1e-12)
    assert d["se_paired"] == pytest.approx(0.01, abs=1e-12)
    assert d["lo"] == pytest.approx(0.06 - 0.04302653, abs=1e-8)
    assert d["hi"] == pytest.approx(0.06 + 0.04302653, abs=1e-8)
    assert d["se_unpaired"] == pytest.approx(math.sqrt(0.0203 / 3), abs=1e-12)  # 8.2x the paired one
    assert d["resolved"] is True and d["seeds_to_resolve"] == 3
    assert compare_py.paired_difference(b, a)["mean"] == pytest.approx(-0.06, abs=1e-12)  # b - a, in that order
    assert compare_py.paired_difference(b, a)["resolved"] is True


def test_an_unresolved_difference_by_hand():
    """b - a = 0.05, -0.03, 0.04: mean 0.02, sd sqrt(0.0038 / 2) = 0.0435890, se 0.0251661: the interval 0.02 +-
    0.108280 holds 0. Seeds to resolve at that sd: 20 give 2.093024 * 0.043589 / sqrt(20) = 0.020400 > 0.02, 21 give
    2.085963 * 0.043589 / sqrt(21) = 0.019841 < 0.02."""
    a, b = {0: 0.5, 1: 0.5, 2: 0.5, 7: 0.9}, {0: 0.55, 1: 0.47, 2: 0.54}  # seed 7 has no pair: out of the difference
    d = compare_py.paired_difference(a, b)
    assert d["seeds"] == [0, 1, 2] and d["mean"] == pytest.approx(0.02, abs=1e-12)
    assert d["se_paired"] == pytest.approx(math.sqrt(0.0019 / 3), abs=1e-12)
    assert d["hi"] - d["mean"] == pytest.approx(4.302653 * math.sqrt(0.0019 / 3), abs=1e-7)
    assert d["resolved"] is False and d["seeds_to_resolve"] == 21
    # the unpaired se reads every seed of each variant: a's four (variance of 0.5, 0.5, 0.5, 0.9 = 0.04) and b's three
    assert d["se_unpaired"] == pytest.approx(math.sqrt(0.04 / 4 + 0.0019 / 3), abs=1e-12)
    assert compare_py.paired_difference({0: 1.0}, {0: 2.0}) is None  # one common seed: no spread, no interval
    assert compare_py.seeds_to_resolve(0.0, 0.1) is None and compare_py.seeds_to_resolve(0.1, 0.0) == 2
    assert compare_py.seeds_to_resolve(1e-4, 1.0) is None  # past MAX_SEEDS


def test_interval_by_hand():
    i = compare_py.interval([0.50, 0.60, 0.70])  # sd 0.1, se 0.1 / sqrt 3
    assert i["n"] == 3 and i["mean"] == pytest.approx(0.6, abs=1e-12)
    assert i["hi"] - i["mean"] == pytest.approx(4.302653 * 0.1 / math.sqrt(3), abs=1e-7)
    assert compare_py.interval([0.3]) == {"mean": 0.3, "lo": 0.3, "hi": 0.3, "n": 1}
    assert compare_py.interval([None]) is None


@pytest.fixture(scope="module")
def loss_comparison(tmp_path_factory):
    """ppo against gspo (the update's loss alone differs), seeds 0 and 1, two iterations, each run then scored by
    ppo-eval with 2 samples per prompt (--eval)."""
    out = tmp_path_factory.mktemp("paired") / "out"
    proc = subprocess.run([sys.executable, COMPARE, "--estimators", "grpo", "--vary", "policy_loss_kind=ppo,gspo",
                           "--seeds", "0", "1", "--samples_per_iteration", "8", "--group_size", "4", "--jobs", "2",
                           "--eval", "--n 2", "--out", str(out), "--", *TINY],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_seed_s_of_two_variants_shares_prompts_and_noise(loss_comparison):
    """The first iteration samples before any update: with the same seed both variants draw the same prompts with the
    same noise from the same weights, so their first rollouts score alike; another seed draws others."""
    out = loss_comparison
    first = {}
    for kind in ("ppo", "gspo"):
        for seed in (0, 1):
            with open(out / f"grpo-policy_loss_kind={kind}-seed{seed}" / "metrics.jsonl") as f:
                first[kind, seed] = json.loads(f.readline())
    for seed in (0, 1):
        for key in ("reward/mean", "reward/std", "response/length_mean", "kl/mean"):
            assert first["ppo", seed][key] == first["gspo", seed][key], (seed, key)
    assert first["ppo", 0]["reward/mean"] != first["ppo", 1]["reward/mean"]


def test_paired_report_recomputed_from_the_runs(loss_comparison):
    out = loss_comparison
    report = read_json(out / "compare.json")
    names = ["grpo policy_loss_kind=ppo", "grpo policy_loss_kind=gspo"]
    dirs = {name: [out / f"grpo-policy_loss_kind={name.split('=')[1]}-seed{seed}" for seed in (0, 1)] for name in names}
    pairs = {p["score"]: p for p in report["paired"]}
    assert {p["a"] for p in report["paired"]} == {names[0]} and {p["b"] for p in report["paired"]} == {names[1]}
    values = {}
    for name in names:
        values[name, "reward_after"] = [read_json(d / "summary.json")["eval/reward_after"] for d in dirs[name]]
        values[name, "pass@2"] = [read_json(d / "eval.json")["scores"]["pass@2"]["mean"] for d in dirs[name]]
        evaluated = read_json(dirs[name][0] / "eval.json")["protocol"]
        assert evaluated["n"] == 2 and evaluated["checkpoint"].endswith("checkpoints/step-2")
    for score in ("reward_after", "pass@2"):
        a, b = values[names[0], score], values[names[1], score]
        d = [y - x for x, y in zip(a, b)]
        p = pairs[score]
        assert p["mean"] == pytest.approx(statistics.fmean(d), abs=1e-12)
        se = abs(d[0] - d[1]) / 2  # two seeds: sd = |d0 - d1| / sqrt 2, se = sd / sqrt 2
        assert p["se_paired"] == pytest.approx(se, abs=1e-12)
        assert p["hi"] - p["mean"] == pytest.approx(12.706205 * se, rel=1e-6)
        assert p["se_unpaired"] == pytest.approx(math.sqrt(statistics.variance(a) / 2 + statistics.variance(b) / 2),
                                                 abs=1e-12)
        assert p["resolved"] == (p["lo"] > 0 or p["hi"] < 0)
        interval = report["estimators"][names[1]]["intervals"][score]
        assert interval["mean"] == pytest.approx(statistics.fmean(b), abs=1e-12) and interval["n"] == 2
    md = (out / "compare.md").read_text()
    p = pairs["reward_after"]
    assert f"| reward_after | {names[1]} | {names[0]} | 2 | {p['mean']:+.4f} [{p['lo']:+.4f}, {p['hi']:+.4f}] |" in md


def test_from_runs_gives_the_same_paired_report(loss_comparison, tmp_path):
    """--from_runs on finished run directories that hold eval.json reads their scores back: the same intervals per
    variant and the same paired differences as the comparison's. Its variants are named by the settings where they
    differ from the estimator's first one (ppo's runs are read first: plain "grpo")."""
    out = loss_comparison
    dirs = [str(out / f"grpo-policy_loss_kind={kind}-seed{seed}") for kind in ("ppo", "gspo") for seed in (0, 1)]
    proc = subprocess.run([sys.executable, COMPARE, "--out", str(tmp_path / "r"), "--from_runs", *dirs],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = read_json(tmp_path / "r" / "compare.json")
    original = read_json(out / "compare.json")
    renamed = {"grpo": "grpo policy_loss_kind=ppo", "grpo policy_loss_kind=gspo": "grpo policy_loss_kind=gspo"}
    assert list(report["estimators"]) == list(renamed)
    for name, before in renamed.items():  # eval.json's scores read back from the run dirs
        assert report["estimators"][name]["intervals"] == original["estimators"][before]["intervals"]
    assert len(report["paired"]) == len(original["paired"]) > 0
    for got, want in zip(report["paired"], original["paired"]):
        assert renamed[got["a"]] == want["a"] and renamed[got["b"]] == want["b"]
        assert {k: v for k, v in got.items() if k not in ("a", "b")} == {k: v for k, v in want.items() if k not in ("a", "b")}


@pytest.mark.parametrize("eval_args, message", [("--n 2 --k 4", "--k 4: pass@k needs 1 <= k <= n"),
                                                ("--run x", "gives ppo-eval --run RUN_DIR"),
                                                ("--n 'two", "No closing quotation")])
def test_bad_eval_args_start_nothing(tmp_path, eval_args, message):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, COMPARE, "--estimators", "grpo", "--seeds", "0", "--eval", eval_args,
                           "--out", str(out), "--", *TINY], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    assert proc.stdout == "" and not out.exists()
