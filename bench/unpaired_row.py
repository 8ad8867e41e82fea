"""One more row for a compare.py report: a variant trained outside ppo-core (TRL's GRPOTrainer, bench/trl_grpo.py),
its checkpoints scored by the same ppo-eval, set against the report's variants with independent seeds.

    python bench/unpaired_row.py REPORT/compare.json --name "TRL GRPOTrainer" --evals trl/seed0/eval.json \
        trl/seed1/eval.json trl/seed2/eval.json [--scores greedy,pass@1,pass@8,maj@8] [--json out.json]

Such a row cannot share the report's random stream (another library draws its own prompts order and sampling noise),
so each difference is unpaired: row - variant over every seed of each, its standard error sqrt(s_r^2/n_r + s_v^2/n_v),
its 95% interval with Welch's degrees of freedom rounded down to an integer (conservative: a smaller df gives a wider
interval), "resolved" where the interval excludes 0, and the seeds per side that would resolve the observed
difference at the measured variances (the fewest m with t_{0.975, df(m)} sqrt((s_r^2 + s_v^2) / m) < |difference|,
df(m) Welch's for m seeds a side, rounded down). Prints a markdown table per score.
"""
import argparse
import json
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from compare import interval, t_quantile  # noqa: E402  (scripts/compare.py: Student's t, in closed form)

MAX_SEEDS = 1000


def welch_df(var_a, n_a, var_b, n_b) -> int:
    """Welch-Satterthwaite degrees of freedom of a difference of two means, rounded down (at least 1)."""
    a, b = var_a / n_a, var_b / n_b
    if a + b == 0:
        return max(1, n_a + n_b - 2)
    return max(1, math.floor((a + b) ** 2 / (a * a / (n_a - 1) + b * b / (n_b - 1))))


def seeds_per_side(difference, var_a, var_b) -> int | None:
    """The fewest seeds m >= 2 a side whose unpaired 95% interval would exclude 0 around `difference` at these
    variances; None for no difference or more than MAX_SEEDS."""
    def resolves(m):
        return t_quantile(0.975, welch_df(var_a, m, var_b, m)) * math.sqrt((var_a + var_b) / m) < abs(difference)

    if difference == 0:
        return None
    for m in range(2, MAX_SEEDS + 1):
        if resolves(m):
            return m
    return None


def unpaired_difference(row: list, other: list) -> dict:
    """row - other (a list of per-seed values each, at least two): mean, standard error, Welch df, 95% interval,
    resolved, and the seeds per side that would resolve it."""
    var_r, var_o = statistics.variance(row), statistics.variance(other)
    mean = statistics.fmean(row) - statistics.fmean(other)
    se = math.sqrt(var_r / len(row) + var_o / len(other))
    df = welch_df(var_r, len(row), var_o, len(other))
    half = t_quantile(0.975, df) * se
    return {"mean": mean, "se": se, "df": df, "lo": mean - half, "hi": mean + half,
            "resolved": mean - half > 0 or mean + half < 0, "seeds_per_side": seeds_per_side(mean, var_r, var_o)}


def report_variants(report: dict, score: str) -> dict:
    """{variant: [per-seed values]} of one score from compare.json's runs."""
    out = {}
    for run in report["runs"]:
        if run["returncode"] == 0 and run.get("scores") and run["scores"].get(score) is not None:
            out.setdefault(run["variant"], []).append(run["scores"][score])
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report", help="compare.json of compare.py (a comparison or --from_runs)")
    p.add_argument("--name", required=True, help="the row's name")
    p.add_argument("--evals", nargs="+", required=True, help="ppo-eval's eval.json of each of the row's seeds")
    p.add_argument("--scores", default="greedy,pass@1,pass@8,maj@8")
    p.add_argument("--json", help="also write the numbers here")
    args = p.parse_args(argv)
    with open(args.report) as f:
        report = json.load(f)
    evals = []
    for path in args.evals:
        with open(path) as f:
            evals.append(json.load(f)["scores"])
    if len(evals) < 2:
        sys.exit("unpaired_row: need the eval.json of at least two seeds")
    out = {"name": args.name, "evals": args.evals, "scores": {}}
    for score in args.scores.split(","):
        row = [e[score]["mean"] for e in evals]
        stat = interval(row)
        print(f"\n{score}: {args.name} {stat['mean']:.3f} [{stat['lo']:.3f}, {stat['hi']:.3f}] "
              f"({', '.join(f'{v:.3f}' for v in row)})\n")
        print(f"| {args.name} - variant | difference | 95% interval (Welch df) | resolved | seeds a side to resolve |")
        print("|---|---|---|---|---|")
        diffs = {}
        for variant, values in report_variants(report, score).items():
            if len(values) < 2:
                continue
            d = diffs[variant] = unpaired_difference(row, values)
            print(f"| {variant} | {d['mean']:+.3f} | [{d['lo']:+.3f}, {d['hi']:+.3f}] ({d['df']}) | "
                  f"{'yes' if d['resolved'] else 'no'} | {d['seeds_per_side'] or '> ' + str(MAX_SEEDS)} |")
        out["scores"][score] = {"values": row, "interval": stat, "differences": diffs}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
