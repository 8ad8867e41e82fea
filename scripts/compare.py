"""Compare estimators, or any other settings, at an equal sample budget: every (variant, seed) is a real `ppo-train` run.

    python scripts/compare.py --out runs/compare                        # gae, grpo, rloo, reinforce_pp x seeds 0 1 2
    python scripts/compare.py --estimators gae,grpo --seeds 0 --out runs/c -- --iterations=30     # extra ppo-train args after --
    python scripts/compare.py --estimators grpo,dr_grpo --group_size 8 --jobs 4 --out runs/g -- --policy=DIR
    python scripts/compare.py --estimators grpo --vary policy_loss_kind=ppo,gspo --vary clip_high=0.2,0.28 --out runs/l
    python scripts/compare.py --estimators grpo --variant "" --variant dual_clip=3 --variant "policy_loss_kind=gspo clip_low=3e-4 clip_high=4e-4" --out runs/loss

A VARIANT is an estimator and the settings (ppo-train config keys) that set it apart. `--vary KEY=V1,V2,...` (repeatable)
crosses: every combination of one value per --vary key is a variant, for every estimator. `--variant "KEY=V KEY=V"`
(repeatable; "" is ppo-train's defaults) lists variants one by one, for settings that only make sense together
(GSPO with its own clip range; dual-clip with the token-level loss only); --vary keys cross with each of them. A value
holding a comma goes in a --variant. Without either, a variant is an estimator. A variant is named by its settings,
"grpo policy_loss_kind=gspo clip_low=3e-4", in the tables, the plot and compare.json; its run directories are that name
with '-' for the spaces (characters other than letters, digits and ._=+- as '_').

Each run is `python -m ppo_core.train` in its own process, into OUT/<variant>-seed<k>, with --progress=false
--threads=1, at most --jobs of them at a time. Every run starts from the same policy checkpoint (ppo-train's default,
the shipped demo, unless the extra args name another); the seed changes the sampling (and the task's prompts) only.

Equal sample budget: every run samples --samples_per_iteration responses per iteration. A group estimator (grpo,
dr_grpo, rloo, reinforce_pp_baseline) samples --group_size responses for each of samples / group_size prompts;
gae and reinforce_pp sample one response for each of `samples` prompts. Everything else is ppo-train's defaults
plus the variant's settings, plus the extra args after `--`, the same for every run.

Writes, in OUT:
  compare.md     the environment, the command, and a table of held-out reward before / after (sampled and greedy),
                 final KL, time and throughput per variant ("mean ± std" over seeds, std with Bessel's correction;
                 "(n = 1)" for one seed), with one row per run below it
  compare.json   all those numbers (per variant, under "estimators" and with its "settings", and per run)
  compare.png    rollout reward and KL against iteration: the seed mean per variant and a min..max band over seeds
                 (needs matplotlib, `pip install -e ".[plot]"`; without it compare.md and compare.json are still written)
  logs/          each run's stdout and stderr
A run that fails is reported with the tail of its stderr and makes the exit status 1 (the outputs are written from
the runs that finished).

    python scripts/compare.py --out runs/report --from_runs runs/grpo-s0 runs/grpo-s1 runs/gae-s0 runs/gae-s1

--from_runs starts nothing: it reads finished run directories (config.json, summary.json, metrics.jsonl), one
variant per estimator (runs of one variant must differ in nothing but their seed and directory), and writes the same
three reports. A directory without summary.json counts as a failed run. Bad arguments are one line on stderr and exit status 2, before any run starts.
"""
import argparse
import concurrent.futures
import dataclasses
import datetime
import itertools
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from ppo_core.config import (ADV_ESTIMATORS, GROUP_ESTIMATORS, ConfigError, PPOConfig, build_config, load_toml,  # noqa: E402
                             parse_cli)
from ppo_core.rewards.functions import specs_as_today  # noqa: E402

DEFAULT_ESTIMATORS = "gae,grpo,rloo,reinforce_pp"
# ppo-train keys compare.py sets itself for every run: extra args may not change them
OWN_KEYS = ("adv_estimator", "n_samples_per_prompt", "rollout_batch_size", "seed", "out")
STDERR_TAIL_LINES = 20


class ArgumentError(Exception):
    """Bad arguments: shown as one line on stderr, exit status 2, nothing started."""


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        raise ArgumentError(message)


def parse_args(argv):
    """compare.py's own flags, and the ppo-train args after `--` (a list of strings, checked by ppo-train's parser)."""
    own, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                       usage="python scripts/compare.py --out DIR [options] [-- ppo-train args]")
    ap.add_argument("--out", required=True, help="output directory: one run directory per (variant, seed) and the reports")
    ap.add_argument("--estimators", default=DEFAULT_ESTIMATORS, help=f"comma-separated, from {', '.join(ADV_ESTIMATORS)}")
    ap.add_argument("--vary", action="append", default=[], metavar="KEY=V1,V2,...",
                    help="a ppo-train config key and its values; repeated, every combination (crossed)")
    ap.add_argument("--variant", action="append", default=[], metavar='"KEY=V KEY=V ..."',
                    help='one variant\'s settings ("" for the defaults); repeated, a list of variants')
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="ppo-train --seed of each run")
    ap.add_argument("--samples_per_iteration", type=int, default=64, help="responses sampled per iteration, every run")
    ap.add_argument("--group_size", type=int, default=4, help="responses per prompt of the group estimators")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs at a time (default: the CPU count)")
    ap.add_argument("--max_reward", type=float, default=1.0,
                    help="the best possible reward, for the headroom closed (after - before) / (max_reward - before)")
    ap.add_argument("--from_runs", nargs="+", default=[], metavar="RUN_DIR",
                    help="start nothing: report on these finished ppo-train run directories (runs made by hand or by "
                         "a recipe), grouped into variants by estimator; the other run flags are not read")
    args = ap.parse_args(own)
    args.estimators = args.estimators.split(",")
    args.extra = extra
    return args


def variants(args, extra_keys):
    """The variants: dicts of ppo-train settings (strings), in the order that names them: adv_estimator, an --variant's
    settings, one value of each --vary key; every estimator x every --variant x every combination of the --vary values.
    extra_keys: the keys the args after `--` set. Raises ArgumentError."""
    def key_of(key, flag):  # a key compare.py sets itself, or the extra args set for every run, cannot vary
        if key in OWN_KEYS:
            instead = {"adv_estimator": "--estimators", "seed": "--seeds", "out": "--out"}.get(key, "--samples_per_iteration and --group_size")
            raise ArgumentError(f"{flag} {key}: compare.py sets it itself (use {instead})")
        if key in extra_keys:
            raise ArgumentError(f"{flag} {key}: also set after --, for every run; give it in one place")
        return key

    crossed = {}
    for spec in args.vary:
        key, sep, values = spec.partition("=")
        if not sep or not key or not values:
            raise ArgumentError(f"--vary takes KEY=VALUE,VALUE,..., got {spec!r}")
        if key_of(key, "--vary") in crossed:
            raise ArgumentError(f"--vary {key}: given twice; put all its values in one --vary")
        crossed[key] = values.split(",")
        if len(set(crossed[key])) != len(crossed[key]):
            raise ArgumentError(f"--vary {key}: a value is given twice: {values}")
    listed = []
    for spec in args.variant if args.variant else [""]:
        settings = {}
        for setting in spec.split():
            key, sep, value = setting.partition("=")
            if not sep or not key:
                raise ArgumentError(f"--variant takes settings KEY=VALUE separated by spaces, got {spec!r}")
            if key_of(key, "--variant") in settings or key in crossed:
                raise ArgumentError(f"--variant {spec!r}: {key} is set twice (in it, or in it and a --vary)")
            settings[key] = value
        listed.append(settings)
    return [{"adv_estimator": est, **settings, **dict(zip(crossed, values))}
            for est in args.estimators for settings in listed for values in itertools.product(*crossed.values())]


def variant_name(settings) -> str:
    """'grpo policy_loss_kind=gspo dual_clip=3': the estimator, then each other setting as KEY=VALUE."""
    return " ".join([settings["adv_estimator"], *(f"{k}={v}" for k, v in settings.items() if k != "adv_estimator")])


def run_plan(args):
    """Check everything and return the runs, variant by variant, seed by seed: dicts with variant (its name), settings
    (its ppo-train settings, see variants), estimator, seed, n (responses per prompt), prompts, dir and cmd (the argv).
    Raises ArgumentError (nothing has been started or created)."""
    for est in args.estimators:
        if est not in ADV_ESTIMATORS:
            raise ArgumentError(f"unknown estimator {est!r} (choose from {', '.join(ADV_ESTIMATORS)})")
    for what, values in (("estimator", args.estimators), ("seed", args.seeds)):
        if len(set(values)) != len(values):
            raise ArgumentError(f"a {what} is given twice: {values}")
    if args.samples_per_iteration < 1 or args.jobs < 1:
        raise ArgumentError("--samples_per_iteration and --jobs must be >= 1")
    if any(est in GROUP_ESTIMATORS for est in args.estimators):
        if args.group_size < 2:
            raise ArgumentError(f"--group_size must be >= 2 (a group estimator's baseline needs other responses), got {args.group_size}")
        if args.samples_per_iteration % args.group_size:
            raise ArgumentError(f"--samples_per_iteration ({args.samples_per_iteration}) must be a multiple of "
                                f"--group_size ({args.group_size})")
    try:
        driver, overrides = parse_cli(args.extra)
    except ConfigError as e:
        raise ArgumentError(f"ppo-train args after --: {e}") from None
    if "resume" in driver:
        raise ArgumentError("ppo-train args after --: --resume cannot be used (every run starts fresh)")
    taken = [key for key in overrides if key in OWN_KEYS]
    if taken:
        raise ArgumentError(f"ppo-train args after --: compare.py sets --{taken[0]} itself (keys it sets: {', '.join(OWN_KEYS)})")
    toml_values = {}
    if "config" in driver:
        try:
            toml_values = load_toml(driver["config"])
        except ConfigError as e:
            raise ArgumentError(str(e)) from None
        taken = [key for key in toml_values if key in OWN_KEYS]
        if taken:
            raise ArgumentError(f"{driver['config']} sets '{taken[0]}', which compare.py sets itself ({', '.join(OWN_KEYS)})")

    runs, dir_names = [], set()
    for settings in variants(args, overrides):
        est, name = settings["adv_estimator"], variant_name(settings)
        dir_name = re.sub(r"[^A-Za-z0-9._=+-]", "_", name.replace(" ", "-"))
        if dir_name in dir_names:
            raise ArgumentError(f"variant {name!r} is given twice (or differs from another only in characters "
                                f"its directory name replaces: {dir_name})")
        dir_names.add(dir_name)
        n = args.group_size if est in GROUP_ESTIMATORS else 1
        varied = {k: v for k, v in settings.items() if k != "adv_estimator"}
        for seed in args.seeds:
            run_dir = os.path.join(args.out, f"{dir_name}-seed{seed}")
            own = {"adv_estimator": est, "n_samples_per_prompt": str(n),
                   "rollout_batch_size": str(args.samples_per_iteration // n), "seed": str(seed), "out": run_dir}
            try:  # the config ppo-train will build, validated now so that a bad one fails before any run starts
                build_config(toml_values, {**overrides, **varied, **own}, driver.get("config", ""))
            except ConfigError as e:
                raise ArgumentError(f"{name}, seed {seed}: {e}") from None
            if os.path.isfile(os.path.join(run_dir, "summary.json")):
                raise ArgumentError(f"{run_dir} already holds a finished run; choose another --out")
            cmd = [sys.executable, "-m", "ppo_core.train", *(f"--{k}={v}" for k, v in own.items()),
                   "--progress=false", "--threads=1", *(f"--{k}={v}" for k, v in varied.items()), *args.extra]
            runs.append({"variant": name, "settings": settings, "estimator": est, "seed": seed, "n": n,
                         "prompts": args.samples_per_iteration // n, "dir": run_dir, "cmd": cmd})
    return runs


# what may differ between the runs of one variant collected by --from_runs
PER_RUN_KEYS = ("seed", "out", "threads", "progress")


def as_written_today(config: dict) -> dict:
    """A run's config.json "config" as this version would write it: keys added since the run was made take their
    defaults (which reproduce the older behaviour: ppo_core.config's docstrings), and reward specs naming a module by
    its place before the subpackages (ppo_core.verifiers:f) name it where it is now (ppo_core.rewards.verifiers:f), so
    that runs made before and after such a change compare as the same variant."""
    return specs_as_today({**dataclasses.asdict(PPOConfig()), **config})


def collected_runs(dirs):
    """--from_runs: the runs of finished run directories, as run_plan and execute describe them (returncode 0 where
    summary.json exists, wall_s its time/total_s), one variant per estimator. Raises ArgumentError for a directory
    that is no run, a variant whose runs differ in more than PER_RUN_KEYS, or one seed given twice."""
    runs, configs = [], {}
    for run_dir in dirs:
        try:
            with open(os.path.join(run_dir, "config.json")) as f:
                config = json.load(f)["config"]
        except (OSError, ValueError, KeyError) as e:
            raise ArgumentError(f"{run_dir}: not a ppo-train run directory ({e})") from None
        config = as_written_today(config)
        est = config["adv_estimator"]
        shared = {k: v for k, v in config.items() if k not in PER_RUN_KEYS}
        if configs.setdefault(est, shared) != shared:
            differ = sorted(k for k in shared if shared[k] != configs[est].get(k))
            raise ArgumentError(f"{run_dir}: its {est} runs differ in more than the seed: {', '.join(differ)}")
        if any(r["estimator"] == est and r["seed"] == config["seed"] for r in runs):
            raise ArgumentError(f"{run_dir}: a second {est} run of seed {config['seed']}")
        finished = os.path.isfile(os.path.join(run_dir, "summary.json"))
        run = {"variant": est, "settings": {"adv_estimator": est}, "estimator": est, "seed": config["seed"],
               "n": config["n_samples_per_prompt"], "prompts": config["rollout_batch_size"], "dir": run_dir, "cmd": [],
               "returncode": 0 if finished else 1, "stderr_tail": "" if finished else "no summary.json: not finished"}
        if finished:
            with open(os.path.join(run_dir, "summary.json")) as f:
                run["wall_s"] = json.load(f)["time/total_s"]
        else:
            run["wall_s"] = 0.0
        runs.append(run)
    return runs


def execute(runs, jobs, log_dir):
    """Run each run's cmd as a subprocess, `jobs` at a time; print each command as it starts. Adds to each run:
    returncode, wall_s (the process's wall time) and stderr_tail (its last lines when it failed). The stdout and
    stderr of each go to log_dir/<its run directory's name>.log."""
    os.makedirs(log_dir, exist_ok=True)
    lock = threading.Lock()

    def one(run):
        name = os.path.basename(run["dir"])
        with lock:
            print(f"[start] {name}: {shlex.join(run['cmd'])}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(run["cmd"], capture_output=True, text=True)
        run["wall_s"] = time.perf_counter() - t0
        run["returncode"] = proc.returncode
        with open(os.path.join(log_dir, f"{name}.log"), "w") as f:
            f.write(f"$ {shlex.join(run['cmd'])}\n--- stdout\n{proc.stdout}--- stderr\n{proc.stderr}")
        run["stderr_tail"] = "" if proc.returncode == 0 else "\n".join(proc.stderr.splitlines()[-STDERR_TAIL_LINES:])
        with lock:
            if proc.returncode == 0:
                print(f"[done]  {name} in {run['wall_s']:.1f} s", flush=True)
            else:
                print(f"[FAILED] {name}: exit status {proc.returncode} after {run['wall_s']:.1f} s; stderr ends:\n"
                      f"{run['stderr_tail']}", flush=True)

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(one, runs))


def read_run(run, max_reward):
    """Load a finished run's summary.json and metrics.jsonl into `run`, and its headroom closed:
    (reward_after - reward_before) / (max_reward - reward_before), on the sampled held-out reward."""
    with open(os.path.join(run["dir"], "summary.json")) as f:
        run["summary"] = json.load(f)
    with open(os.path.join(run["dir"], "metrics.jsonl")) as f:
        run["metrics"] = [json.loads(line) for line in f if line.strip()]
    before, after = run["summary"]["eval/reward_before"], run["summary"]["eval/reward_after"]
    run["headroom_closed"] = (after - before) / (max_reward - before) if before < max_reward else None
    run["tokens_per_s"] = statistics.mean(r["tokens_per_s"] for r in run["metrics"])


def mean_std(values):
    """{"mean", "std", "n"} over `values`: the sample standard deviation (Bessel's correction, n - 1),
    0.0 for a single value; None for none (e.g. no finished run)."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0, "n": len(values)}


SUMMARY_STATS = (  # compare.json key, summary.json key
    ("reward_before", "eval/reward_before"),
    ("reward_after", "eval/reward_after"),
    ("greedy_reward_before", "eval/greedy_reward_before"),
    ("greedy_reward_after", "eval/greedy_reward_after"),
    ("kl_final", "kl/final"),
)


def aggregate(runs, names):
    """Per variant (its name), over its finished runs (seeds): its settings, mean_std of each SUMMARY_STATS entry and
    of the headroom closed; the mean run time (summary time/total_s, s) and the mean tokens/s over all iterations of
    all seeds."""
    table = {}
    for name in names:
        first = next(r for r in runs if r["variant"] == name)
        done = [r for r in runs if r["variant"] == name and r["returncode"] == 0]
        row = {"settings": first["settings"], "n_samples_per_prompt": first["n"], "rollout_batch_size": first["prompts"],
               "seeds": [r["seed"] for r in done]}
        for key, summary_key in SUMMARY_STATS:
            row[key] = mean_std([r["summary"][summary_key] for r in done])
        row["headroom_closed"] = mean_std([r["headroom_closed"] for r in done])
        row["time_s"] = statistics.mean(r["summary"]["time/total_s"] for r in done) if done else None
        row["tokens_per_s"] = statistics.mean(m["tokens_per_s"] for r in done for m in r["metrics"]) if done else None
        table[name] = row
    return table


def environment():
    """Date (UTC), machine and torch version, for the report's header."""
    import torch  # only for its version and the GPU's name

    machine = f"{platform.platform()}, {os.cpu_count()} CPUs"
    if torch.cuda.is_available():
        machine += f", {torch.cuda.get_device_name()}"
    return {"date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine, "torch": torch.__version__}


def fmt(stat, digits=4):
    """'mean ± std' of a mean_std dict, 'value (n = 1)' for one seed (a spread of one run is unknown, not 0), '-' for
    none."""
    if stat is None:
        return "-"
    if stat["n"] == 1:
        return f"{stat['mean']:.{digits}f} (n = 1)"
    return f"{stat['mean']:.{digits}f} ± {stat['std']:.{digits}f}"


def write_markdown(path, report, runs):
    env, table = report["environment"], report["estimators"]
    column = "variant" if report["vary"] or report["variants"] else "estimator"
    lines = [
        f"{env['date_utc']} · {env['machine']} · torch {env['torch']} · `{report['command']}` · "
        f"total wall time {report['total_wall_s']:.1f} s",
        "",
        f"{report['samples_per_iteration']} responses sampled per iteration by every run; held-out reward on the task's "
        f"evaluation prompts before and after training; mean ± std over seeds (Bessel's correction), (n = 1) where "
        f"one seed ran; time: the run's "
        f"time/total_s; headroom closed: (after - before) / ({report['max_reward']:g} - before), sampled reward.",
        "",
        f"| {column} | prompts x responses | reward before (sampled) | after (sampled) | before (greedy) "
        "| after (greedy) | final KL | time/run (s) | tokens/s | headroom closed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in table.items():
        time_s = "-" if row["time_s"] is None else f"{row['time_s']:.1f}"
        tps = "-" if row["tokens_per_s"] is None else f"{row['tokens_per_s']:.0f}"
        lines.append(f"| {name} | {row['rollout_batch_size']} x {row['n_samples_per_prompt']} | {fmt(row['reward_before'])} "
                     f"| {fmt(row['reward_after'])} | {fmt(row['greedy_reward_before'])} "
                     f"| {fmt(row['greedy_reward_after'])} | {fmt(row['kl_final'])} "
                     f"| {time_s} | {tps} | {fmt(row['headroom_closed'], 3)} |")
    lines += ["", "Per run:", "",
              f"| {column} | seed | reward before | after | before (greedy) | after (greedy) | final KL | time (s) |",
              "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        if r["returncode"] == 0:
            s = r["summary"]
            lines.append(f"| {r['variant']} | {r['seed']} | {s['eval/reward_before']:.4f} | {s['eval/reward_after']:.4f} "
                         f"| {s['eval/greedy_reward_before']:.4f} | {s['eval/greedy_reward_after']:.4f} "
                         f"| {s['kl/final']:.4f} | {s['time/total_s']:.1f} |")
        elif not r["cmd"]:  # --from_runs: a directory without summary.json
            lines.append(f"| {r['variant']} | {r['seed']} | not finished ({r['dir']} has no summary.json) | | | | | |")
        else:
            lines.append(f"| {r['variant']} | {r['seed']} | failed (exit status {r['returncode']}, see "
                         f"logs/{os.path.basename(r['dir'])}.log) | | | | | |")
    if report["plot"]:
        lines += ["", f"![rollout reward and KL]({report['plot']})"]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def plot(path, runs, names):
    """Two panels against iteration, rollout reward/mean and kl/mean: per variant the mean over seeds as a line
    and a min..max band over seeds (over the iterations every seed logged); needs a finished run. Returns False
    without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, name in enumerate(names):
        done = [r for r in runs if r["variant"] == name and r["returncode"] == 0]
        if not done:
            continue
        per_seed = [{m["step"]: m for m in r["metrics"]} for r in done]
        steps = sorted(set.intersection(*(set(s) for s in per_seed)))
        for ax, key in zip(axes, ("reward/mean", "kl/mean")):
            values = [[s[step][key] for s in per_seed] for step in steps]  # [iterations][seeds]
            colour = f"C{i}"
            ax.plot(steps, [statistics.mean(v) for v in values], color=colour, label=f"{name} ({len(done)} seeds)")
            ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], color=colour, alpha=0.2, linewidth=0)
    for ax, title in zip(axes, ("rollout reward (mean over the batch)", "KL to reference (nats/token)")):
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("line: mean over seeds; band: min..max over seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    t0 = time.perf_counter()
    try:
        args = parse_args(argv)
        runs = collected_runs(args.from_runs) if args.from_runs else run_plan(args)
    except ArgumentError as e:
        print(f"compare.py: error: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    if args.from_runs:  # the budget and seeds are the runs' own
        args.samples_per_iteration = runs[0]["n"] * runs[0]["prompts"]
        args.group_size = max(r["n"] for r in runs)
        args.seeds = sorted({r["seed"] for r in runs})
    else:
        execute(runs, args.jobs, os.path.join(args.out, "logs"))
    for run in runs:
        if run["returncode"] == 0:
            read_run(run, args.max_reward)

    names = list(dict.fromkeys(run["variant"] for run in runs))  # in plan order
    plotted = False
    if any(run["returncode"] == 0 for run in runs):
        plotted = plot(os.path.join(args.out, "compare.png"), runs, names)
        if not plotted:
            print("compare.py: matplotlib is not installed, no compare.png (pip install -e \".[plot]\")")
    report = {
        "command": shlex.join(["python", sys.argv[0], *argv]),  # the script as the user named it
        "environment": environment(),
        "total_wall_s": time.perf_counter() - t0,
        "samples_per_iteration": args.samples_per_iteration,
        "group_size": args.group_size,
        "seeds": args.seeds,
        "vary": args.vary,
        "variants": args.variant,
        "max_reward": args.max_reward,
        "extra_args": args.extra,
        "plot": "compare.png" if plotted else None,
        "estimators": aggregate(runs, names),  # per variant (per estimator without --vary / --variant)
        "runs": [{"variant": r["variant"], "settings": r["settings"], "estimator": r["estimator"], "seed": r["seed"],
                  "dir": r["dir"], "command": r["cmd"],
                  "returncode": r["returncode"], "wall_s": r["wall_s"], "stderr_tail": r["stderr_tail"],
                  "summary": r.get("summary"), "headroom_closed": r.get("headroom_closed"),
                  "tokens_per_s": r.get("tokens_per_s")} for r in runs],
    }
    with open(os.path.join(args.out, "compare.json"), "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    write_markdown(os.path.join(args.out, "compare.md"), report, runs)
    failed = [r for r in runs if r["returncode"] != 0]
    print(f"wrote {os.path.join(args.out, 'compare.md')} ({len(runs) - len(failed)} of {len(runs)} runs finished, "
          f"{report['total_wall_s']:.1f} s)")
    if failed:
        print(f"compare.py: {len(failed)} run(s) failed: {', '.join(os.path.basename(r['dir']) for r in failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
