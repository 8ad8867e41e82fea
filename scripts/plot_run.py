"""Draw a run's training curves to a PNG.

    python scripts/plot_run.py runs/reverse-demo-20261202-120000            # writes DIR/curves.png
    python scripts/plot_run.py DIR --out curves.png

A panel whose metric the run did not log (the critic's explained variance in a critic-free run) is left empty.

Needs matplotlib (`pip install -e ".[plot]"`); the library itself never imports it.
"""
import argparse
import json
import os
import sys

PANELS = [
    ("reward/mean", "reward (rollout mean)"),
    ("kl/mean", "KL to reference (nats/token)"),
    ("entropy/mean", "entropy (nats/token)"),
    ("policy/clipfrac", "policy clip fraction"),
    ("value/explained_var", "critic explained variance"),
    ("response/length_mean", "response length (tokens)"),
]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    ap.add_argument("--out", default=None, help="PNG path (default RUN_DIR/curves.png)")
    args = ap.parse_args(argv)
    path = os.path.join(args.run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        print(f"plot_run: error: no metrics.jsonl in {args.run_dir}", file=sys.stderr)
        return 2
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    steps = [r["step"] for r in rows]
    for ax, (key, title) in zip(axes.flat, PANELS):
        ax.set_title(title)
        if not any(key in r for r in rows):
            # e.g. value/explained_var of a critic-free run (adv_estimator other than gae): nothing to draw
            ax.text(0.5, 0.5, f"{key}\nnot in metrics.jsonl", ha="center", va="center", transform=ax.transAxes, color="gray")
            ax.set_xticks([]), ax.set_yticks([])
            continue
        ax.plot(steps, [r.get(key, float("nan")) for r in rows])
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    summary_path = os.path.join(args.run_dir, "summary.json")
    if os.path.isfile(summary_path):
        with open(summary_path) as f:
            s = json.load(f)
        fig.suptitle(f"held-out reward {s['eval/reward_before']:.3f} -> {s['eval/reward_after']:.3f}, "
                     f"final KL {s['kl/final']:.3f} nats/token")
    fig.tight_layout()
    out = args.out or os.path.join(args.run_dir, "curves.png")
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
