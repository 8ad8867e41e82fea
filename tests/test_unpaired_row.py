"""bench/unpaired_row.py: an unpaired row (another library's checkpoints, scored by ppo-eval) against a report's
variants: Welch's interval and the seeds a side that would resolve a difference, against hand-worked numbers
(t quantiles from tables: t_{0.975, 2} = 4.302653, t_{0.975, 4} = 2.776445, t_{0.975, 7} = 2.364624,
t_{0.975, 8} = 2.306004).

    python -m pytest -q tests/test_unpaired_row.py
"""
import importlib.util
import json
import math
import os

import pytest

# loaded by its path: bench/ on sys.path would shadow the PyPI package `kernels` (bench/kernels.py), which
# transformers imports, for every test after this module's collection
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
spec = importlib.util.spec_from_file_location("unpaired_row", os.path.join(ROOT, "bench", "unpaired_row.py"))
unpaired_row = importlib.util.module_from_spec(spec)
spec.loader.exec_module(unpaired_row)


def test_an_unresolved_difference_hand_worked():
    # row 2, 4, 6 (mean 4, variance 4) against 1, 2, 3 (mean 2, variance 1): d = 2, se = sqrt(4/3 + 1/3)
    # Welch df = (5/3)^2 / ((4/3)^2 / 2 + (1/3)^2 / 2) = 50/17 = 2.94 -> 2; half = 4.302653 se = 5.5548
    d = unpaired_row.unpaired_difference([2.0, 4.0, 6.0], [1.0, 2.0, 3.0])
    assert d["mean"] == 2.0 and d["df"] == 2
    assert d["se"] == pytest.approx(math.sqrt(5 / 3), abs=1e-15)
    assert d["hi"] - d["mean"] == pytest.approx(4.302653 * math.sqrt(5 / 3), abs=2e-6)
    assert not d["resolved"]
    # m a side: df(m) = floor(25 (m - 1) / 17); m = 6: df 7, 2.364624 sqrt(5/6) = 2.159 > 2;
    # m = 7: df 8, 2.306004 sqrt(5/7) = 1.949 < 2
    assert d["seeds_per_side"] == 7


def test_a_resolved_difference_hand_worked():
    # 10, 11, 12 against 1, 2, 3: d = 9, se = sqrt(2/3), df = (2/3)^2 / (2 (1/3)^2 / 2) = 4, half = 2.776445 se
    d = unpaired_row.unpaired_difference([10.0, 11.0, 12.0], [1.0, 2.0, 3.0])
    assert d["df"] == 4 and d["resolved"]
    assert d["lo"] == pytest.approx(9 - 2.776445 * math.sqrt(2 / 3), abs=2e-6)
    assert d["seeds_per_side"] == 2  # df 2 at m = 2: 4.302653 * 1 < 9
    assert unpaired_row.seeds_per_side(0.0, 1.0, 1.0) is None
    assert unpaired_row.seeds_per_side(1e-6, 1.0, 1.0) is None  # beyond MAX_SEEDS


def test_the_command_reads_a_report_and_eval_files(tmp_path, capsys):
    runs = [{"variant": "grpo", "seed": s, "returncode": 0, "scores": {"greedy": v}} for s, v in enumerate([1, 2, 3])]
    runs.append({"variant": "failed", "seed": 0, "returncode": 1, "scores": None})
    (tmp_path / "compare.json").write_text(json.dumps({"runs": runs}))
    evals = []
    for s, v in enumerate([2.0, 4.0, 6.0]):
        path = tmp_path / f"eval{s}.json"
        path.write_text(json.dumps({"scores": {"greedy": {"mean": v, "se": 0.1}}}))
        evals.append(str(path))
    unpaired_row.main([str(tmp_path / "compare.json"), "--name", "other", "--evals", *evals, "--scores", "greedy",
                       "--json", str(tmp_path / "out.json")])
    printed = capsys.readouterr().out
    assert "greedy: other 4.000 [" in printed
    assert "| grpo | +2.000 | [-3.555, +7.555] (2) | no | 7 |" in printed
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["scores"]["greedy"]["differences"]["grpo"]["seeds_per_side"] == 7
    assert "failed" not in out["scores"]["greedy"]["differences"]
