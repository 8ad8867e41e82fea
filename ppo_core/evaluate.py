"""ppo-eval: a checkpoint's held-out scores, written with the protocol behind them (eval.json).

    ppo-eval --policy DIR --task arith --n 8 --k 1,8   # a built-in task's held-out prompts
    ppo-eval --policy DIR --prompts_file addition.jsonl --chat_template \\
             --reward_fn ppo_core.rewards.verifiers:last_number_reward \\
             --temperature 0.8 --max_new_tokens 24
    ppo-eval --run runs/addition --n 8                 # a run's latest checkpoint, with its config

It reads the prompts, the reward and the sampling settings as ppo-train does (every ppo-train key
is accepted, and --config FILE.toml): the rows are ppo-train's held-out rows (a task's held-out
set; a prompts file's last eval_size rows, at most half; or eval_prompts_file's first eval_size
rows), scored by the evaluations' reward (eval_reward_fn, else the training reward). Its own flags:
--run, --n, --k, --threshold, --answer, --out.

Scores, each a mean over the prompts with its standard error over the prompts
(sample std / sqrt(prompts)):
  greedy    accuracy of the greedy response: reward >= threshold ("correct");
            greedy_reward: its mean reward
  pass@k    over n samples per prompt, c of them correct: the unbiased 1 - C(n-c, k) / C(n, k) of
            Chen et al. 2021 ("Evaluating Large Language Models Trained on Code", eq. 1), as their
            stable product
  maj@n     whether the majority answer among the n samples is correct (majority_answer says how)
  mean@n    the mean reward of the n samples (equal to pass@1 for a 0/1 reward)
Sample j (0..n-1) of every prompt draws its noise with seed `seed + EVAL_SEED_OFFSET + j`: with
n = 1 the sampled score is ppo-train's own held-out number (the same code,
ppo_core.rollout.evaluate_rows, and the same seed; ppo-train averages in float32, ppo-eval in
float64). The protocol in full: docs/reproducing.md#the-evaluation-protocol-ppo-eval.
"""
import datetime
import math
import os
import statistics
import sys

import torch

from .config import ConfigError, build_config, load_toml, parse_cli
from .data.prompts import PromptsError, columns_of
from .models.model import CheckpointError, load_model
from .models.tokenizer import load_tokenizer
from .rewards.interface import RewardError
from .rewards.verifiers import (extract_answer, extract_boxed, extract_gsm8k, extract_last_number,
                                normalize_whitespace, parse_number)
from .rollout import EVAL_SEED_OFFSET, evaluate_rows, needs_reference_responses
from .run import checkpoint, runlog
from .models.precision import resolve_precision
from .train import (DEMO_CHECKPOINTS, check_chat_template, check_paths, checkpoint_of,
                    encoded_lengths, fit_context, make_reward_sources, prompt_rows, torch_threads)


# ---------------------------------------------------------------------- the scores (pure functions)

def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with c correct samples out of n (Chen et al. 2021):
    1 - C(n-c, k) / C(n, k) = 1 - prod_{i=n-c+1}^{n} (1 - k / i), a product that neither overflows
    nor cancels."""
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


# --answer: how a response's answer is read for the majority vote (ppo_core.rewards.verifiers)
EXTRACTORS = {
    "final": extract_answer,  # the last \boxed{}, else the "####" line, else the last number
    "gsm8k": extract_gsm8k,
    "boxed": extract_boxed,
    "last_number": extract_last_number,
    "text": normalize_whitespace,  # the whole response, whitespace collapsed
}


def vote_key(answer):
    """What a vote counts: the answer's exact value where it is a number ("0.5", "1/2" and
    "\\frac{1}{2}" are one vote), else its text; None (no answer) does not vote."""
    if answer is None:
        return None
    number = parse_number(answer)
    return ("number", number) if number is not None else ("text", answer)


def majority_answer(answers: list):
    """The index of the sample that stands for the majority answer among `answers` (one per sample,
    None where the extractor found none), or None when no sample has an answer. The most frequent
    vote_key wins; a tie goes to the answer whose first sample comes first; that first sample is the
    representative, whose reward decides maj@n."""
    counts, first = {}, {}
    for j, answer in enumerate(answers):
        key = vote_key(answer)
        if key is not None:
            counts[key] = counts.get(key, 0) + 1
            first.setdefault(key, j)
    if not counts:
        return None
    return min(first[key] for key in counts if counts[key] == max(counts.values()))


def mean_se(values) -> dict:
    """{"mean", "se"} over per-prompt values: se = sample std (n - 1) / sqrt(n), None for one
    prompt."""
    values = [float(v) for v in values]
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None
    return {"mean": statistics.fmean(values), "se": se}


def scores(rewards, greedy_rewards, answers, threshold: float, ks) -> dict:
    """Every score, {name: {"mean", "se"}}. rewards: [prompts][n] the samples' rewards;
    greedy_rewards: [prompts]; answers: [prompts][n] the samples' extracted answers (None: none)."""
    n = len(rewards[0])
    correct = [[r >= threshold for r in row] for row in rewards]
    out = {"greedy": mean_se([g >= threshold for g in greedy_rewards]),
           "greedy_reward": mean_se(greedy_rewards)}
    for k in ks:
        out[f"pass@{k}"] = mean_se([pass_at_k(n, sum(row), k) for row in correct])
    majority = [majority_answer(row) for row in answers]
    out[f"maj@{n}"] = mean_se([j is not None and correct[i][j] for i, j in enumerate(majority)])
    out[f"mean@{n}"] = mean_se([statistics.fmean(row) for row in rewards])
    return out


# ---------------------------------------------------------------------- the command

USAGE = """usage: ppo-eval [--run RUN_DIR | --policy DIR] [--n N] [--k K,K] [--threshold T]
                [--answer WAY] [--out FILE] [--config FILE.toml] [--KEY=VALUE ...]

Scores a checkpoint on ppo-train's held-out prompts: greedy accuracy, pass@k, maj@n, mean@n, with
standard errors.
  --run RUN_DIR   a ppo-train run: its config (config.json) and its latest checkpoint; other keys
                  override them
  --n N           samples per prompt (default 8)
  --k K,K         the pass@k to report, each 1 <= k <= n (default 1 and n)
  --threshold T   a response is correct when its reward >= T (default 1.0: full credit)
  --answer WAY    how maj@n reads an answer: final, gsm8k, boxed, last_number, text, or auto
                  (default: text for the built-in reverse task's reward, else final)
  --out FILE      where eval.json goes (default: RUN_DIR/eval.json with --run, else ./eval.json)
Every ppo-train key (--policy, --task, --prompts_file, --reward_fn, --chat_template,
--temperature, --top_p, --max_new_tokens, --seed, --eval_size, --dtype, ...) means what it means
to ppo-train. Exit status 2: bad input."""

OWN_FLAGS = ("run", "n", "k", "threshold", "answer", "out")


class EvalError(Exception):
    """Bad input to ppo-eval: one line, exit status 2."""


def split_own_flags(argv):
    """(ppo-eval's own flags {name: string}, the rest of argv for ppo-train's parser)."""
    own, rest, i = {}, [], 0
    while i < len(argv):
        key, eq, value = argv[i][2:].partition("=") if argv[i].startswith("--") else ("", "", "")
        key = key.replace("-", "_")
        i += 1
        if key not in OWN_FLAGS:
            rest.append(argv[i - 1])
            continue
        if not eq:
            if i >= len(argv) or argv[i].startswith("--"):
                raise EvalError(f"--{key} needs a value")
            value, i = argv[i], i + 1
        own[key] = value
    return own, rest


def scoring_flags(own: dict):
    """--n, --k, --threshold and --answer checked -> (n, sorted ks, threshold, answer way or
    "auto"); EvalError."""
    try:
        n = int(own.get("n", "8"))
        ks = sorted({int(k) for k in own["k"].split(",")}) if "k" in own else sorted({1, n})
        threshold = float(own.get("threshold", "1.0"))
    except ValueError as e:
        raise EvalError(f"--n, --k and --threshold take numbers: {e}") from None
    if n < 1:
        raise EvalError(f"--n must be at least 1 sample per prompt, got {n}")
    if any(k < 1 or k > n for k in ks):
        bad = next(k for k in ks if k < 1 or k > n)
        raise EvalError(f"--k {bad}: pass@k needs 1 <= k <= n, and --n is {n} samples per prompt")
    answer = own.get("answer", "auto")
    if answer != "auto" and answer not in EXTRACTORS:
        raise EvalError(f"--answer {answer!r}: choose from auto, {', '.join(EXTRACTORS)}")
    return n, ks, threshold, answer


def read_settings(argv):
    """-> (PPOConfig, checkpoint path, n, ks, threshold, answer way, eval.json path);
    EvalError / ConfigError."""
    own, rest = split_own_flags(argv)
    driver, overrides = parse_cli(rest)
    if "resume" in driver:
        raise EvalError(
            "--resume is ppo-train's; to evaluate a run's latest checkpoint: ppo-eval --run RUN_DIR"
        )
    saved = {}
    if "run" in own:
        if "config" in driver:
            raise EvalError(
                "--run takes the run's own config (RUN_DIR/config.json); it cannot go with --config"
            )
        try:
            saved = runlog.RunDir.saved_config(own["run"])
        except runlog.RunDirError as e:  # its message speaks of --resume, ppo-train's flag
            raise EvalError(str(e).replace("--resume", "--run", 1)) from None
    elif "config" in driver:
        saved = load_toml(driver["config"])
    cfg = build_config(saved, overrides, driver.get("config", ""))
    policy = cfg.policy or DEMO_CHECKPOINTS[cfg.task]
    if "run" in own and "policy" not in overrides:
        policy = checkpoint.latest_checkpoint(own["run"])
        if policy is None:
            raise EvalError(f"--run {own['run']}: the run has no checkpoint yet")
    n, ks, threshold, answer = scoring_flags(own)
    # the reverse task's own reward reads the whole response; every other reads an answer
    if answer == "auto":
        own_reward = (cfg.prompts_file or cfg.reward_fn or cfg.reward_model or cfg.eval_reward_fn
                      or cfg.judge)
        answer = "text" if cfg.task == "reverse" and not (own_reward or cfg.reward_url) else "final"
    out = own.get("out") or (os.path.join(own["run"], "eval.json") if "run" in own else "eval.json")
    if os.path.isdir(out):
        out = os.path.join(out, "eval.json")
    # said now, not after the evaluation
    if not os.path.isdir(os.path.dirname(os.path.abspath(out))):
        raise EvalError(
            f"--out {out}: no such directory: {os.path.dirname(os.path.abspath(out))!r}")
    return cfg, policy, n, ks, threshold, answer, out


def evaluate_checkpoint(cfg, policy_path, n, ks, threshold, answer_way) -> dict:
    """Load, sample, score: eval.json's content (without its path), {"scores", "prompts",
    "protocol", "rows"}. EvalError where policy_path is no directory, or where a pairwise judge
    would score without eval_reward_fn; the loaders' and the reward's own errors pass through."""
    torch.set_num_threads(torch_threads(cfg))
    check_paths(cfg)
    if not os.path.isdir(policy_path):
        raise EvalError(f"not a checkpoint directory: {policy_path!r}")
    precision = resolve_precision(cfg)
    with checkpoint_of("policy"):
        tokenizer = load_tokenizer(policy_path)
        policy = load_model(policy_path, dtype=precision.param_dtype,
                            device=precision.device).eval()
    check_chat_template(cfg, tokenizer, policy_path)
    _, held_out, _ = prompt_rows(cfg)
    held_out = fit_context(cfg, policy, [], held_out, None,
                           encoded_lengths(cfg, tokenizer, held_out))[1]
    with checkpoint_of("judge" if cfg.judge else "reward_model"):
        _, eval_source = make_reward_sources(cfg, precision.device, precision.param_dtype)
    # a label column the reward needs is there
    eval_source.check_columns(sorted(columns_of(held_out)))
    if needs_reference_responses(cfg) and not cfg.eval_reward_fn:
        raise EvalError("a pairwise judge compares with reference responses, which ppo-eval does "
                        "not sample; score with a pointwise reward (eval_reward_fn) instead")

    def sample(seed, greedy):  # -> ([prompts] rewards, [prompts] responses)
        rewards, responses = evaluate_rows(policy, tokenizer, held_out, eval_source, cfg, seed,
                                           greedy=greedy, autocast=precision.autocast)
        return rewards.float().cpu().tolist(), responses

    greedy_rewards, greedy_responses = sample(cfg.seed + EVAL_SEED_OFFSET, greedy=True)
    sampled = [sample(cfg.seed + EVAL_SEED_OFFSET + j, greedy=False) for j in range(n)]
    rewards = [[sampled[j][0][i] for j in range(n)] for i in range(len(held_out))]  # [prompts][n]
    responses = [[sampled[j][1][i] for j in range(n)] for i in range(len(held_out))]
    answers = [[EXTRACTORS[answer_way](text) for text in row] for row in responses]
    result = {"scores": scores(rewards, greedy_rewards, answers, threshold, ks),
              "prompts": len(held_out),
              "protocol": protocol(cfg, policy_path, n, ks, threshold, answer_way, precision,
                                   len(held_out))}
    result["rows"] = [{"prompt": row.get("prompt", row.get("messages")),
                       "greedy": greedy_responses[i], "greedy_reward": greedy_rewards[i],
                       "responses": responses[i], "rewards": rewards[i], "answers": answers[i],
                       "majority": (None if (j := majority_answer(answers[i])) is None
                                    else answers[i][j])}
                      for i, row in enumerate(held_out)]
    return result


def protocol(cfg, policy_path, n, ks, threshold, answer_way, precision, prompts) -> dict:
    """Everything that decides the scores, to be stored beside them."""
    files = {key: {"path": os.path.abspath(getattr(cfg, key)),
                   "sha256": checkpoint.file_sha256(getattr(cfg, key))}
             for key in ("prompts_file", "eval_prompts_file") if getattr(cfg, key)}
    if cfg.prompts_file and not cfg.eval_prompts_file:
        which = f"the last {prompts} rows of prompts_file (ppo-train's held-out split)"
    elif cfg.eval_prompts_file:
        which = f"the first {prompts} rows of eval_prompts_file"
    else:
        which = f"the {prompts} held-out prompts of task {cfg.task!r} for seed {cfg.seed}"
    return {
        "checkpoint": os.path.abspath(policy_path),
        "checkpoint_manifest_sha256": checkpoint.manifest_sha256(policy_path),
        "prompts": which, "prompt_files": files,
        "reward": cfg.eval_reward_fn or cfg.reward_model or cfg.judge or cfg.reward_url
        or cfg.reward_fn or f"the reward of task {cfg.task!r}",
        "threshold": threshold, "answer": answer_way,
        "n": n, "k": ks, "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k,
        "max_new_tokens": cfg.max_new_tokens, "seed": cfg.seed,
        "sample_seeds":
            f"sample j of every prompt: {cfg.seed + EVAL_SEED_OFFSET} + j; greedy: no noise",
        "chat_template": cfg.chat_template, "enable_thinking": cfg.enable_thinking,
        "rollout_engine": cfg.rollout_engine, "device": precision.device,
        "precision": precision.describe(),
        "ppo_core_commit": runlog._git_commit(), "versions": runlog._versions(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def table(result) -> str:
    """The short table ppo-eval prints."""
    p = result["protocol"]
    lines = [
        f"{p['checkpoint']}: {result['prompts']} prompts ({p['prompts']}); n={p['n']} samples at "
        f"T={p['temperature']}, top_p={p['top_p']}, max_new_tokens={p['max_new_tokens']}, "
        f"seed {p['seed']}; correct = reward >= {p['threshold']:g}",
        f"{'score':<16}{'mean':>8}{'s.e.':>8}"]
    for name, stat in result["scores"].items():
        se = "-" if stat["se"] is None else f"{stat['se']:.4f}"
        lines.append(f"{name:<16}{stat['mean']:>8.4f}{se:>8}")
    return "\n".join(lines)


def main(argv=None) -> int:
    """ppo-eval on argv (default sys.argv[1:]) -> exit status: 0, with the table printed and
    eval.json written; 2 on bad input, with one line on stderr and nothing written. -h / --help
    prints USAGE."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    try:
        cfg, policy_path, n, ks, threshold, answer_way, out = read_settings(argv)
        result = evaluate_checkpoint(cfg, policy_path, n, ks, threshold, answer_way)
        runlog.write_json(out, result)
    except (EvalError, ConfigError, CheckpointError, RewardError, PromptsError, runlog.RunDirError,
            FileNotFoundError, NotADirectoryError, IsADirectoryError) as e:
        print(f"ppo-eval: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(table(result))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
