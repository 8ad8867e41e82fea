"""bench/paired_gain.py, what the paired design bought, against numbers worked by hand."""
import importlib.util
import json
import math
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
spec = importlib.util.spec_from_file_location("paired_gain", os.path.join(ROOT, "bench", "paired_gain.py"))
paired_gain = importlib.util.module_from_spec(spec)
spec.loader.exec_module(paired_gain)

A = {0: 0.50, 1: 0.60, 2: 0.70}
B = {0: 0.52, 1: 0.63, 2: 0.71}


def test_pair_stats_by_hand():
    """d = (0.02, 0.03, 0.01): variance 1e-4, of the mean 1e-4 / 3. Unpaired: s_a^2 = 0.01, s_b^2 = 0.0182 / 2 = 0.0091,
    each over 3. Shifted (b[s+1] - a[s]): 0.13, 0.11, -0.18, mean 0.02, squared deviations 0.0121 + 0.0081 + 0.04 over
    2, then over 3. Correlation: covariance (0.01 + 0 + 0.009) / 2 over 0.1 * sqrt(0.0091)."""
    paired, unpaired, shifted, corr = paired_gain.pair_stats(A, B)
    assert paired == pytest.approx(1e-4 / 3, rel=1e-9)
    assert unpaired == pytest.approx(0.01 / 3 + 0.0091 / 3, rel=1e-9)
    assert shifted == pytest.approx(0.0602 / 2 / 3, rel=1e-9)
    assert corr == pytest.approx(0.0095 / (0.1 * math.sqrt(0.0091)), rel=1e-9)


def test_pairs_are_pooled_by_rollout_shape(tmp_path, capsys):
    """Two group-estimator variants pair as 'same shape'; gae against either is 'mixed'. The printed pooled gain of the
    one same-shape pair is sqrt(unpaired / paired) of the hand-worked numbers."""
    runs = [{"variant": v, "estimator": est, "seed": s, "returncode": 0, "scores": {"greedy": x[s]}}
            for v, est, x in (("grpo", "grpo", A), ("rloo", "rloo", B), ("gae", "gae", B)) for s in x]
    groups = paired_gain.gains({"runs": runs}, "greedy")
    assert [(a, b) for a, b, *_ in groups["same shape"]] == [("grpo", "rloo")]
    assert [(a, b) for a, b, *_ in groups["mixed"]] == [("grpo", "gae"), ("rloo", "gae")]
    path = tmp_path / "compare.json"
    path.write_text(json.dumps({"runs": runs}))
    assert paired_gain.main([str(path), "--scores", "greedy"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if "(same shape)" in line)
    gain = math.sqrt((0.01 / 3 + 0.0091 / 3) / (1e-4 / 3))
    assert f"| {gain:.2f}x |" in row
