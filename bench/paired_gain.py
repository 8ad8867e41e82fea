"""What the paired design bought in one comparison: for each score, the standard error of a difference between two
variants with paired seeds against what independent seeds would give, pooled over every pair of variants.

    python bench/paired_gain.py runs/compare-smollm2/report/compare.json [--scores greedy,pass@1,pass@8,maj@8]

Reads compare.json's runs (each run's scores, from summary.json and ppo-eval's eval.json) and, per score, over the pairs
(a, b) of variants that share their seeds:
  paired      Var(mean of d_s), d_s = b_s - a_s seed by seed: the squared standard error compare.py reports
  unpaired    s_a^2/n + s_b^2/n: the same difference of means from independent seeds (the same variances, no
              covariance); what compare.py reports as "s.e. unpaired"
  shifted     the d_s of seed s of a against seed s+1 (mod n) of b, independent runs: the unpaired design measured
              once, not computed
  corr        the correlation over seeds of a's and b's score: gain = 1/sqrt(1 - corr) for equal variances
The pooled gain is sqrt(sum of unpaired variances / sum of paired variances) over the pairs: how many times smaller the
standard error of a difference is with pairing; the seeds it saves are its square. Each pair's own ratio, from a few
seeds, is noisy (a ratio of two variances with n - 1 degrees of freedom each); the pooled figure and the spread of the
per-pair ones are printed. Pairs whose variants sample rows of different shapes (gae's 64 x 1 against a group
estimator's 8 x 8) are pooled apart: their rows meet different sampling noise.
"""
import argparse
import itertools
import json
import math
import statistics
import sys


def variance_of_mean(values):
    return statistics.variance(values) / len(values)


def pair_stats(a: dict, b: dict):
    """a, b: {seed: value} over the same seeds. -> (paired, unpaired, shifted variances of the mean difference, corr)."""
    seeds = sorted(a)
    n = len(seeds)
    d = [b[s] - a[s] for s in seeds]
    shifted = [b[seeds[(i + 1) % n]] - a[s] for i, s in enumerate(seeds)]
    xa, xb = [a[s] for s in seeds], [b[s] for s in seeds]
    sa, sb = statistics.stdev(xa), statistics.stdev(xb)
    corr = statistics.correlation(xa, xb) if sa > 0 and sb > 0 else float("nan")
    return (variance_of_mean(d), variance_of_mean(xa) + variance_of_mean(xb), variance_of_mean(shifted), corr)


def gains(report: dict, score: str):
    """{group: rows}: per pair of variants, (a, b, paired, unpaired, shifted, corr); group 'same shape' or 'mixed'."""
    by_variant, shape = {}, {}
    for run in report["runs"]:
        if run["returncode"] == 0 and run.get("scores") and score in run["scores"]:
            by_variant.setdefault(run["variant"], {})[run["seed"]] = run["scores"][score]
            shape[run["variant"]] = run["estimator"] == "gae"
    out = {"same shape": [], "mixed": []}
    for a, b in itertools.combinations(by_variant, 2):
        if set(by_variant[a]) != set(by_variant[b]) or len(by_variant[a]) < 2:
            continue
        group = "same shape" if shape[a] == shape[b] else "mixed"
        out[group].append((a, b, *pair_stats(by_variant[a], by_variant[b])))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("compare_json")
    ap.add_argument("--scores", default="greedy,pass@1,pass@8,maj@8")
    args = ap.parse_args(argv)
    with open(args.compare_json) as f:
        report = json.load(f)
    print("| score | pairs of variants | s.e. paired (rms) | s.e. unpaired (rms) | shifted (rms) | pooled gain "
          "| per-pair gain: median [min, max] | corr over seeds: median |")
    print("|---|---|---|---|---|---|---|---|")
    for score in args.scores.split(","):
        for group, rows in gains(report, score).items():
            if not rows:
                continue
            paired, unpaired, shifted = (sum(r[i] for r in rows) for i in (2, 3, 4))
            per_pair = [math.sqrt(r[3] / r[2]) for r in rows if r[2] > 0]
            corrs = [r[5] for r in rows if not math.isnan(r[5])]
            rms = lambda total: math.sqrt(total / len(rows))  # noqa: E731
            gain = math.sqrt(unpaired / paired) if paired > 0 else float("inf")
            print(f"| {score} | {len(rows)} ({group}) | {rms(paired):.4f} | {rms(unpaired):.4f} | {rms(shifted):.4f} "
                  f"| {gain:.2f}x | {statistics.median(per_pair):.2f}x [{min(per_pair):.2f}, {max(per_pair):.2f}] "
                  f"| {statistics.median(corrs):+.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
