"""Compare estimators, or any other settings, at an equal sample budget: every (variant, seed) is a real `ppo-train` run.

    python scripts/compare.py --out runs/compare                        # gae, grpo, rloo, reinforce_pp x seeds 0 1 2
    python scripts/compare.py --estimators gae,grpo --seeds 0 --out runs/c -- --iterations=30     # extra ppo-train args after --
    python scripts/compare.py --estimators grpo,dr_grpo --group_size 8 --jobs 4 --out runs/g -- --policy=DIR
    python scripts/compare.py --estimators grpo --vary policy_loss_kind=ppo,gspo --vary clip_high=0.2,0.28 --out runs/l
    python scripts/compare.py --estimators grpo --variant "" --variant dual_clip=3 --variant "policy_loss_kind=gspo clip_low=3e-4 clip_high=4e-4" --out runs/loss
    python scripts/compare.py --estimators gae,grpo --seeds 0 1 2 3 --eval "--n 8 --k 1,8" --out runs/p   # + ppo-eval

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

Paired seeds: seed s of every variant gets the same --seed, and with it the same held-out prompts, the same training
prompts in the same order, and the same sampling noise for the same (iteration, row): the engine draws a token's noise
from a function of (seed, iteration, row, token index) alone (ppo_core.rollout.iteration_rollout, the engine's
counter_uniforms). So seed s of variant A and seed s of variant B differ by the variant and by what it changed since;
their first iteration's rollout is identical where the variant changes only the update (a loss, a clip range). Variants
whose rollouts differ in shape (gae's 64 prompts x 1 against grpo's 16 x 4) share the held-out set and the prompt
order, but their rows meet different noise. Per pair of variants compare.md gives the difference seed by seed: its
95% interval (paired t), "resolved" where it excludes 0, the seeds that would resolve it, and the unpaired standard
error beside the paired one (docs/reproducing.md).

Equal sample budget: every run samples --samples_per_iteration responses per iteration. A group estimator (grpo,
dr_grpo, rloo, reinforce_pp_baseline) samples --group_size responses for each of samples / group_size prompts;
gae and reinforce_pp sample one response for each of `samples` prompts. Everything else is ppo-train's defaults
plus the variant's settings, plus the extra args after `--`, the same for every run.

Writes, in OUT:
  compare.md     the environment, the command, and a table of held-out reward before / after (sampled and greedy),
                 final KL, time and throughput per variant ("mean ± std" over seeds, std with Bessel's correction;
                 "(n = 1)" for one seed), with one row per run below it
                 then each score's mean and 95% interval per variant, and the paired differences per pair of variants
                 (held-out rewards after training; with --eval or an eval.json in each run directory, ppo-eval's
                 greedy accuracy, pass@k, maj@n, mean@n too)
  compare.json   all those numbers (per variant under "estimators", with its "settings"; under "paired"; per run)
  compare.png    rollout reward and KL against iteration: the seed mean per variant and a min..max band over seeds
                 (needs matplotlib, `pip install -e ".[plot]"`; without it compare.md and compare.json are still written)
  logs/          each run's stdout and stderr
A run that fails is reported with the tail of its stderr and makes the exit status 1 (the outputs are written from
the runs that finished).

    python scripts/compare.py --out runs/report --from_runs runs/grpo-s0 runs/grpo-s1 runs/gae-s0 runs/gae-s1

--from_runs starts nothing: it reads finished run directories (config.json, summary.json, metrics.jsonl) and writes
the same three reports. Runs whose configs differ in nothing but their seed, directory and thread count are one variant;
a variant is named by its estimator and the settings where it differs from that estimator's first variant, so runs
of several compare.py invocations (a loss comparison and an estimator comparison) report as one. A directory without summary.json counts as a failed run. Bad arguments are one line on stderr and exit status 2, before any run starts.
"""
import argparse
import concurrent.futures
import dataclasses
import datetime
import itertools
import json
import math
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
    ap.add_argument("--eval", default=None, metavar='"PPO-EVAL ARGS"',
                    help="after the runs, score each finished run's final checkpoint with ppo-eval --run RUN_DIR ARGS "
                         "(e.g. --eval \"--n 8 --k 1,8\"; \"\" for its defaults) into RUN_DIR/eval.json; a run "
                         "directory's eval.json, written so or by hand, adds its scores to the report")
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


def check_eval_args(eval_args):
    """--eval's ppo-eval flags checked before any run starts (ppo_core.evaluate's own checks); ArgumentError."""
    from ppo_core import evaluate

    try:
        own, rest = evaluate.split_own_flags(shlex.split(eval_args))
        if "run" in own or "out" in own:
            raise evaluate.EvalError("compare.py gives ppo-eval --run RUN_DIR and its eval.json itself")
        evaluate.scoring_flags(own)
        parse_cli(rest)
    except (ValueError, evaluate.EvalError, ConfigError) as e:
        raise ArgumentError(f"--eval {eval_args!r}: {e}") from None


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


# what may differ between the runs of one variant collected by --from_runs (every other setting names a variant)
PER_RUN_KEYS = ("seed", "out", "threads", "progress")


def as_written_today(config: dict) -> dict:
    """A run's config.json "config" as this version would write it: keys added since the run was made take their
    defaults (which reproduce the older behaviour: ppo_core.config's docstrings), and reward specs naming a module by
    its place before the subpackages (ppo_core.verifiers:f) name it where it is now (ppo_core.rewards.verifiers:f), so
    that runs made before and after such a change compare as the same variant."""
    return specs_as_today({**dataclasses.asdict(PPOConfig()), **config})


def collected_runs(dirs):
    """--from_runs: the runs of finished run directories, as run_plan and execute describe them (returncode 0 where
    summary.json exists, wall_s its time/total_s). Runs whose configs differ in nothing but PER_RUN_KEYS are one
    variant; a variant is named by its estimator, then the settings where it differs from the first variant of that
    estimator (as run_plan names a --variant: "grpo policy_loss_kind=gspo clip_low=0.0003"). Raises ArgumentError
    for a directory that is no run, or a variant given one seed twice."""
    runs, groups = [], []  # groups: the shared settings of each variant, in the order first seen
    for run_dir in dirs:
        try:
            with open(os.path.join(run_dir, "config.json")) as f:
                config = json.load(f)["config"]
        except (OSError, ValueError, KeyError) as e:
            raise ArgumentError(f"{run_dir}: not a ppo-train run directory ({e})") from None
        config = as_written_today(config)
        est = config["adv_estimator"]
        shared = {k: v for k, v in config.items() if k not in PER_RUN_KEYS}
        if shared not in groups:
            groups.append(shared)
        first = next(g for g in groups if g["adv_estimator"] == est)
        settings = {"adv_estimator": est, **{k: str(v) for k, v in shared.items() if v != first.get(k)}}
        name = variant_name(settings)
        if any(r["variant"] == name and r["seed"] == config["seed"] for r in runs):
            raise ArgumentError(f"{run_dir}: a second run of variant {name!r} with seed {config['seed']}")
        finished = os.path.isfile(os.path.join(run_dir, "summary.json"))
        run = {"variant": name, "settings": settings, "estimator": est, "seed": config["seed"],
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
    run["scores"] = {"reward_after": after, "greedy_reward_after": run["summary"]["eval/greedy_reward_after"]}
    eval_json = os.path.join(run["dir"], "eval.json")
    if os.path.isfile(eval_json):  # ppo-eval's scores of the run's checkpoint (--eval, or by hand)
        with open(eval_json) as f:
            run["scores"].update({name: stat["mean"] for name, stat in json.load(f)["scores"].items()})


def evaluate_runs(runs, eval_args, jobs, log_dir):
    """ppo-eval --run RUN_DIR eval_args on every finished run, `jobs` at a time, into RUN_DIR/eval.json; a run whose
    evaluation fails is reported as failed (returncode, stderr_tail), its log in log_dir/<run>.eval.log."""
    os.makedirs(log_dir, exist_ok=True)

    def one(run):
        cmd = [sys.executable, "-m", "ppo_core.evaluate", "--run", run["dir"], *shlex.split(eval_args)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        with open(os.path.join(log_dir, f"{os.path.basename(run['dir'])}.eval.log"), "w") as f:
            f.write(f"$ {shlex.join(cmd)}\n--- stdout\n{proc.stdout}--- stderr\n{proc.stderr}")
        if proc.returncode != 0:
            run["returncode"] = proc.returncode
            run["stderr_tail"] = "ppo-eval: " + "\n".join(proc.stderr.splitlines()[-STDERR_TAIL_LINES:])
            print(f"[FAILED] ppo-eval of {run['dir']}: {run['stderr_tail']}", flush=True)

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(one, [r for r in runs if r["returncode"] == 0]))


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
        names_of_scores = [k for k in done[0]["scores"] if all(k in r["scores"] for r in done)] if done else []
        row["intervals"] = {k: interval([r["scores"][k] for r in done]) for k in names_of_scores}
        row["time_s"] = statistics.mean(r["summary"]["time/total_s"] for r in done) if done else None
        row["tokens_per_s"] = statistics.mean(m["tokens_per_s"] for r in done for m in r["metrics"]) if done else None
        table[name] = row
    return table


def paired(runs, names) -> list:
    """Every pair of variants (a before b in plan order) and every score both have on each of their finished runs:
    paired_difference(a, b) with the variants and the score named; pairs with fewer than two common seeds left out."""
    by_variant = {name: [r for r in runs if r["variant"] == name and r["returncode"] == 0] for name in names}
    out = []
    for a, b in itertools.combinations(names, 2):
        if not by_variant[a] or not by_variant[b]:
            continue
        shared = [k for k in by_variant[a][0]["scores"]
                  if all(k in r["scores"] for r in by_variant[a] + by_variant[b])]
        for score in shared:
            diff = paired_difference({r["seed"]: r["scores"][score] for r in by_variant[a]},
                                     {r["seed"]: r["scores"][score] for r in by_variant[b]})
            if diff is not None:
                out.append({"a": a, "b": b, "score": score, **diff})
    return out


# ---------------------------------------------------------------------------- paired statistics over seeds
# Seed s of every variant shares what does not belong to the variant: the initial policy, the held-out prompts, the
# training prompts' order and the sampling noise (the engine's counter noise, a function of seed, iteration and row).
# A difference between two variants is therefore measured seed by seed (docs/reproducing.md).

MAX_SEEDS = 1000  # seeds_to_resolve searches no further


def t_coverage(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with df (integer) degrees of freedom, in closed form (Abramowitz and Stegun 26.7.3
    and 26.7.4): with theta = atan(t / sqrt(df)), odd df: (2/pi) (theta + sin theta (cos theta + 2/3 cos^3 theta
    + ... + (2*4*...*(df-3)) / (1*3*...*(df-2)) cos^(df-2) theta)), even df: sin theta (1 + 1/2 cos^2 theta + ...
    + (1*3*...*(df-3)) / (2*4*...*(df-2)) cos^(df-2) theta)."""
    theta = math.atan(t / math.sqrt(df))
    sin, cos2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2:
        term = total = math.cos(theta) if df > 1 else 0.0
        for j in range(1, (df - 1) // 2):
            term *= cos2 * (2 * j) / (2 * j + 1)
            total += term
        return 2 / math.pi * (theta + sin * total)
    term = total = 1.0
    for j in range(1, df // 2):
        term *= cos2 * (2 * j - 1) / (2 * j)
        total += term
    return sin * total


def t_quantile(p: float, df: int) -> float:
    """The p quantile (p > 0.5) of Student's t with df degrees of freedom: t_coverage inverted by bisection."""
    lo, hi = 0.0, 1.0
    while t_coverage(hi, df) < 2 * p - 1:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_coverage(mid, df) < 2 * p - 1 else (lo, mid)
    return (lo + hi) / 2


def interval(values) -> dict | None:
    """The mean of `values` (one per seed) and its 95% interval, mean +- t_{0.975, n-1} s / sqrt(n); lo = hi = the
    mean for one value (no spread known); None for none."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    mean = statistics.fmean(values)
    n = len(values)
    half = t_quantile(0.975, n - 1) * statistics.stdev(values) / math.sqrt(n) if n > 1 else 0.0
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "n": len(values)}


def seeds_to_resolve(difference: float, sd: float) -> int | None:
    """The fewest paired seeds m >= 2 whose 95% interval, t_{0.975, m-1} sd / sqrt(m), would exclude 0 around the
    observed `difference` at the paired standard deviation `sd`; None for no difference or more than MAX_SEEDS."""
    def resolves(m):
        return t_quantile(0.975, m - 1) * sd / math.sqrt(m) < abs(difference)

    if difference == 0 or not resolves(MAX_SEEDS):
        return None
    lo, hi = 1, MAX_SEEDS  # resolves(hi); t_{m-1} / sqrt(m) falls with m: the first m that resolves, by halving
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if resolves(mid) else (mid, hi)
    return hi


def paired_difference(a: dict, b: dict) -> dict | None:
    """b - a over the seeds both have (a, b: {seed: value}): the mean difference, its paired standard error (the
    differences' sample std / sqrt(n)), the 95% interval mean +- t_{0.975, n-1} se, whether it excludes 0
    ("resolved"), the seeds that would resolve it, and beside them the unpaired standard error of the same difference
    of means, sqrt(s_a^2 / n_a + s_b^2 / n_b), over every seed of each: what independent seeds would give. None with
    fewer than two common seeds."""
    seeds = sorted(set(a) & set(b))
    if len(seeds) < 2:
        return None
    d = [b[s] - a[s] for s in seeds]
    n, mean, sd = len(d), statistics.fmean(d), statistics.stdev(d)
    se = sd / math.sqrt(n)
    half = t_quantile(0.975, n - 1) * se
    unpaired = math.sqrt(statistics.variance(a.values()) / len(a) + statistics.variance(b.values()) / len(b))
    return {"seeds": seeds, "mean": mean, "lo": mean - half, "hi": mean + half, "se_paired": se, "sd_paired": sd,
            "se_unpaired": unpaired, "resolved": mean - half > 0 or mean + half < 0,
            "seeds_to_resolve": seeds_to_resolve(mean, sd)}


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


def interval_lines(table, column) -> list:
    """Each score per variant: its mean over seeds and 95% interval (t with n - 1 degrees of freedom)."""
    names = list(dict.fromkeys(k for row in table.values() for k in row["intervals"]))
    if not names:
        return []
    lines = ["", "Each score, mean over seeds and its 95% interval (Student's t, seeds - 1 degrees of freedom); "
             "reward_after / greedy_reward_after: summary.json's held-out rewards; the others from each run's "
             "eval.json (ppo-eval):", "",
             f"| {column} | seeds | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for name, row in table.items():
        cells = []
        for k in names:
            stat = row["intervals"].get(k)
            cells.append("-" if stat is None else f"{stat['mean']:.4f} (n = 1)" if stat["n"] == 1
                         else f"{stat['mean']:.4f} [{stat['lo']:.4f}, {stat['hi']:.4f}]")
        lines.append(f"| {name} | {len(row['seeds'])} | " + " | ".join(cells) + " |")
    return lines


def paired_lines(pairs) -> list:
    """The paired differences, one line per score and pair of variants."""
    if not pairs:
        return []
    lines = ["", "Paired differences b - a, seed by seed (the same seed shares the initial policy, the prompts and the "
             "sampling noise): the mean and its 95% interval (paired t); resolved where the interval excludes 0; the "
             "seeds that would resolve the observed difference at the measured paired spread; beside the paired "
             "standard error, the unpaired one (sqrt(s_a^2/n_a + s_b^2/n_b)) that independent seeds would give:", "",
             "| score | b | a | seeds | b - a [95% interval] | s.e. paired | s.e. unpaired | unpaired / paired "
             "| resolved | seeds to resolve |", "|---|---|---|---|---|---|---|---|---|---|"]
    for p in pairs:
        gain = f"{p['se_unpaired'] / p['se_paired']:.2f}x" if p["se_paired"] > 0 else "-"
        need = p["seeds_to_resolve"] if p["seeds_to_resolve"] is not None else f"> {MAX_SEEDS} or no difference"
        lines.append(f"| {p['score']} | {p['b']} | {p['a']} | {len(p['seeds'])} | {p['mean']:+.4f} "
                     f"[{p['lo']:+.4f}, {p['hi']:+.4f}] | {p['se_paired']:.4f} | {p['se_unpaired']:.4f} | {gain} "
                     f"| {'resolved' if p['resolved'] else 'not resolved'} | {need} |")
    return lines


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
    lines += interval_lines(table, column) + paired_lines(report["paired"])
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
        if args.eval is not None:
            check_eval_args(args.eval)
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
    if args.eval is not None:
        evaluate_runs(runs, args.eval, args.jobs, os.path.join(args.out, "logs"))
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
        "paired": paired(runs, names),  # per pair of variants and score: the difference seed by seed
        "runs": [{"variant": r["variant"], "settings": r["settings"], "estimator": r["estimator"], "seed": r["seed"],
                  "dir": r["dir"], "command": r["cmd"],
                  "returncode": r["returncode"], "wall_s": r["wall_s"], "stderr_tail": r["stderr_tail"],
                  "summary": r.get("summary"), "headroom_closed": r.get("headroom_closed"),
                  "tokens_per_s": r.get("tokens_per_s"), "scores": r.get("scores")} for r in runs],
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
