"""scripts/compare.py end to end: real `ppo-train` runs at tiny size, its tables recomputed from the runs' own files."""
import json
import os
import re
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
    assert f"| reinforce_pp | 8 x 1 | {s['eval/reward_before']:.4f} (n = 1) |" in md  # one seed: no spread claimed
    assert read_json(out / "compare.json")["estimators"]["reinforce_pp"]["reward_after"] == {
        "mean": s["eval/reward_after"], "std": 0.0, "n": 1}


# ---------------------------------------------------------------------------- --vary: any config key, not only estimators

def load_compare():
    """scripts/compare.py as a module, for its run plan alone (nothing runs)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("compare", COMPARE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_vary_crosses_keys_and_names_each_variant_by_its_settings(tmp_path):
    compare_py = load_compare()
    args = compare_py.parse_args(["--estimators", "grpo", "--vary", "policy_loss_kind=ppo,gspo", "--vary", "clip_high=0.2,0.28",
                                  "--seeds", "0", "1", "--out", str(tmp_path / "out"), "--", *TINY])
    runs = compare_py.run_plan(args)
    names = ["grpo policy_loss_kind=ppo clip_high=0.2", "grpo policy_loss_kind=ppo clip_high=0.28",
             "grpo policy_loss_kind=gspo clip_high=0.2", "grpo policy_loss_kind=gspo clip_high=0.28"]
    assert [(r["variant"], r["seed"]) for r in runs] == [(name, seed) for name in names for seed in (0, 1)]
    last = runs[-1]
    assert last["dir"] == str(tmp_path / "out" / "grpo-policy_loss_kind=gspo-clip_high=0.28-seed1")
    assert last["settings"] == {"adv_estimator": "grpo", "policy_loss_kind": "gspo", "clip_high": "0.28"}
    assert "--policy_loss_kind=gspo" in last["cmd"] and "--clip_high=0.28" in last["cmd"]
    # a list of variants, for settings that go together (GSPO and its own clip range), crossed with a --vary key
    args = compare_py.parse_args(["--estimators", "grpo", "--variant", "", "--variant", "dual_clip=3",
                                  "--variant", "policy_loss_kind=gspo clip_low=3e-4 clip_high=4e-4", "--vary", "lr=1e-3,5e-4",
                                  "--seeds", "0", "--out", str(tmp_path / "out"), "--", *TINY])
    assert [r["variant"] for r in compare_py.run_plan(args)] == [
        "grpo lr=1e-3", "grpo lr=5e-4", "grpo dual_clip=3 lr=1e-3", "grpo dual_clip=3 lr=5e-4",
        "grpo policy_loss_kind=gspo clip_low=3e-4 clip_high=4e-4 lr=1e-3", "grpo policy_loss_kind=gspo clip_low=3e-4 clip_high=4e-4 lr=5e-4"]
    for argv, message in [
        (["--vary", "dual_clip=0,0.5"], "grpo dual_clip=0.5, seed 0: config key 'dual_clip' must be 0 (off) or > 1"),
        # crossing makes every combination: GSPO refuses dual-clip, before any run starts
        (["--vary", "policy_loss_kind=ppo,gspo", "--vary", "dual_clip=0,3"], "grpo policy_loss_kind=gspo dual_clip=3, seed 0: "
                                                                            "config key 'dual_clip' has no effect"),
        (["--vary", "seed=1,2"], "--vary seed: compare.py sets it itself (use --seeds)"),
        (["--variant", "adv_estimator=rloo"], "--variant adv_estimator: compare.py sets it itself (use --estimators)"),
        (["--vary", "dual_clip=3,3"], "--vary dual_clip: a value is given twice"),
        (["--vary", "dual_clip"], "--vary takes KEY=VALUE,VALUE,..."),
        (["--vary", "lr=1e-3,1e-4", "--", "--lr=1e-2"], "--vary lr: also set after --"),
        (["--variant", "lr=1e-3", "--vary", "lr=1e-4,1e-5"], "--variant 'lr=1e-3': lr is set twice"),
        (["--variant", "lr=1e-3", "--variant", "lr=1e-3"], "variant 'grpo lr=1e-3' is given twice"),
    ]:
        with pytest.raises(compare_py.ArgumentError, match=re.escape(message)):
            compare_py.run_plan(compare_py.parse_args(["--estimators", "grpo", "--seeds", "0", "--out", str(tmp_path / "x"),
                                                       *argv]))
    assert not (tmp_path / "out").exists() and not (tmp_path / "x").exists()


def test_vary_a_loss_setting_from_one_initialisation(tmp_path):
    """ppo against gspo, one estimator and seed, tiny: one table row per variant, each run with its own setting."""
    out = tmp_path / "out"
    proc = compare("--estimators", "grpo", "--vary", "policy_loss_kind=ppo,gspo", "--seeds", "0",
                   "--samples_per_iteration", "8", "--group_size", "4", "--jobs", "2", "--out", str(out), "--", *TINY)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    md = (out / "compare.md").read_text()
    report = read_json(out / "compare.json")
    befores = set()
    for kind in ("ppo", "gspo"):
        run_dir = out / f"grpo-policy_loss_kind={kind}-seed0"
        config = read_json(run_dir / "config.json")["config"]
        assert (config["policy_loss_kind"], config["adv_estimator"], config["n_samples_per_prompt"]) == (kind, "grpo", 4)
        s = read_json(run_dir / "summary.json")
        assert md.count(f"\n| grpo policy_loss_kind={kind} | 2 x 4 | {s['eval/reward_before']:.4f} (n = 1) "
                        f"| {s['eval/reward_after']:.4f} (n = 1) |") == 1
        row = report["estimators"][f"grpo policy_loss_kind={kind}"]
        assert row["settings"] == {"adv_estimator": "grpo", "policy_loss_kind": kind}
        assert row["reward_after"] == {"mean": s["eval/reward_after"], "std": 0.0, "n": 1}
        befores.add(s["eval/reward_before"])
    assert len(befores) == 1  # one initialisation, one seed: the same evaluation before training
    assert md.startswith(report["environment"]["date_utc"]) and "| variant |" in md


def test_from_runs_reports_finished_runs_as_the_comparison_did(comparison, tmp_path):
    """--from_runs over the comparison's own run directories starts nothing and reports the same numbers per
    estimator; a run that differs in a setting is another variant, named by that setting; a variant given one seed
    twice is refused with one line, exit 2."""
    out, _ = comparison
    dirs = sorted(str(d) for d in out.iterdir() if (d / "config.json").exists())
    assert len(dirs) == 4
    proc = compare("--out", str(tmp_path / "report"), "--from_runs", *dirs)
    assert proc.returncode == 0 and "[start]" not in proc.stdout, proc.stderr
    original, collected = read_json(out / "compare.json"), read_json(tmp_path / "report" / "compare.json")
    assert collected["estimators"] == original["estimators"]
    assert collected["samples_per_iteration"] == 8 and collected["seeds"] == [0, 1]
    md = (tmp_path / "report" / "compare.md").read_text()
    gae = [read_json(os.path.join(d, "summary.json")) for d in dirs if "gae-" in os.path.basename(d)]
    values = [s["eval/greedy_reward_before"] for s in gae]
    assert f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}" in md  # the greedy "before" column

    import shutil
    other, twin = tmp_path / "gae-lr-seed0", tmp_path / "twin"
    shutil.copytree(dirs[0], other)
    shutil.copytree(dirs[0], twin)
    config = read_json(other / "config.json")
    lr = config["config"]["lr"] * 2
    config["config"]["lr"] = lr
    (other / "config.json").write_text(json.dumps(config))
    proc = compare("--out", str(tmp_path / "two"), "--from_runs", *dirs, str(other))
    assert proc.returncode == 0, proc.stderr
    report = read_json(tmp_path / "two" / "compare.json")
    assert list(report["estimators"]) == ["gae", "grpo", f"gae lr={lr}"]  # another setting: another variant
    assert report["estimators"][f"gae lr={lr}"]["settings"] == {"adv_estimator": "gae", "lr": str(lr)}
    assert report["estimators"]["gae"] == original["estimators"]["gae"]
    proc = compare("--out", str(tmp_path / "bad"), "--from_runs", dirs[0], str(twin))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "a second run of variant 'gae' with seed 0" in proc.stderr


def test_from_runs_reads_runs_written_by_an_older_version(comparison, tmp_path):
    """A run made before a config key existed (its config.json lacks the key) or before the reward modules moved into
    ppo_core/rewards/ (ppo_core.verifiers:f) is the same variant as one made today with the key's default and the new
    path; a key missing on one side but set to another value than its default on the other still differs."""
    import shutil
    out, _ = comparison
    dirs = sorted(d for d in out.iterdir() if d.name.startswith("gae-"))
    old, new = tmp_path / "old-seed0", tmp_path / "new-seed1"
    for src, dst, spec in ((dirs[0], old, "ppo_core.verifiers:last_number_reward"),
                           (dirs[1], new, "ppo_core.rewards.verifiers:last_number_reward")):
        shutil.copytree(src, dst)
        config = read_json(dst / "config.json")
        config["config"]["reward_fn"] = [spec]
        if dst == old:
            del config["config"]["stop_grace_s"], config["config"]["max_tool_calls_per_turn"]
        (dst / "config.json").write_text(json.dumps(config))
    proc = compare("--out", str(tmp_path / "report"), "--from_runs", str(old), str(new))
    assert proc.returncode == 0, proc.stderr
    assert read_json(tmp_path / "report" / "compare.json")["seeds"] == [0, 1]

    config = read_json(new / "config.json")
    config["config"]["stop_grace_s"] = 5.0
    (new / "config.json").write_text(json.dumps(config))
    proc = compare("--out", str(tmp_path / "two"), "--from_runs", str(old), str(new))
    assert proc.returncode == 0, proc.stderr
    assert list(read_json(tmp_path / "two" / "compare.json")["estimators"]) == ["gae", "gae stop_grace_s=5.0"]
