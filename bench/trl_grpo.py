"""TRL's GRPOTrainer on ppo-core's real-checkpoint RLVR recipe (configs/grpo-smollm2-135m-addition.toml), timed, and
judged on the held-out rows by ppo-core's own evaluator.

    # TRL in a venv of its own that reuses torch 2.13.0+cpu and transformers from the main environment (pip wants no
    # other torch today; if it ever does, add torch==2.13.0 to the same pip line)
    python3 -m venv --system-site-packages /work/trl-venv
    /work/trl-venv/bin/pip install trl==1.16.0 datasets

    python scripts/make_smollm2_checkpoint.py                        # -> ~/.cache/ppo-core/SmolLM2-135M-Instruct
    python scripts/make_addition_prompts.py --out addition.jsonl
    /work/trl-venv/bin/python bench/trl_grpo.py --prompts_file addition.jsonl --out runs/trl-grpo    # 50 its, seeds 0,1
    /work/trl-venv/bin/python bench/trl_grpo.py --prompts_file addition.jsonl --out /tmp/trl-smoke \
        --smoke --iterations 2 --seeds 0 --threads 1 --eval_size 8                                  # runs end to end

The recipe is read from --config (a PPOConfig TOML) and mapped onto GRPOConfig by `grpo_config`: 8 samples per prompt,
8 prompts per iteration, one pass over each rollout in 2 minibatches of 32, AdamW (0.9, 0.95), lr 1e-5 after a 4-step
warm-up, clip 0.2, a k3 KL loss term of 0.01, group-normalised advantages, token-mean loss, 24 new tokens at T=0.8,
the prompt as a user turn in the checkpoint's chat template, fp32 weights with bf16 autocast where ppo-core's
dtype='auto' picks it on this CPU. A config that asks for something the mapping does not cover is refused
(RECIPE_ASSUMPTIONS). What TRL cannot match is listed in SETTINGS_NOT_MATCHED and printed under the table.

One iteration = one generation round and its optimizer steps. Its seconds are split into
  gen     GRPOTrainer._generate: chat template, transformers' generate, decoding;
  score   the rest of _generate_and_score_completions: the reward, the old and reference log-prob forwards, advantages;
  update  the rest of the iteration: forward + backward of each minibatch, gradient clipping, the AdamW steps.
An iteration runs from the trainer's on_step_begin of its first optimizer step to on_step_end of its last, so logging
between iterations is not counted; the table gives medians over the iterations after the first (the first warms up).
"matmul dtype" is the output dtype of the policy's layer-0 attention output projection in each phase: the dtype its
matmuls really ran in.

Evaluation: the TRL model is saved with save_pretrained into --out/seed<N>/model with the checkpoint's tokenizer files,
and both it ("after") and the starting checkpoint ("before") are scored on the first --eval_size of the recipe's
held-out rows (the file's last eval_size rows, never trained on) by ppo_core.rollout.evaluate, the function ppo-train
calls, with ppo-train's evaluation seed (seed + 12345): greedy, and sampled at the recipe's temperature. At
--eval_size 256 and the same seed and threads, "before" is computed exactly as ppo-train's own "eval before training"
line, so the two should agree.
"""
import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import time
from collections import defaultdict

# The repository root in place of bench/, whose kernels.py would shadow the PyPI package `kernels` that transformers
# imports (as bench/rollout.py does).
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is read from local directories

import datasets  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from transformers.trainer_callback import PrinterCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from bench.packed_passes import cpu_name  # noqa: E402  (bench/ is off the path, the repository root on it)
from ppo_core import load_model, load_tokenizer  # noqa: E402
from ppo_core.config import build_config, load_toml, rollout_rows  # noqa: E402
from ppo_core.models.precision import resolve_precision  # noqa: E402
from ppo_core.data.prompts import load_rows, split_held_out  # noqa: E402
from ppo_core.rewards.source import make_reward_source  # noqa: E402
from ppo_core.rollout import evaluate, prompt_token_ids  # noqa: E402
from ppo_core.rewards.verifiers import last_number_reward  # noqa: E402

DEFAULT_CONFIG = os.path.join(os.path.dirname(HERE), "configs", "grpo-smollm2-135m-addition.toml")
EVAL_SEED_OFFSET = 12345  # ppo_core.train: eval_seed = cfg.seed + 12345
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json")  # generation_config.json: the checkpoint's stop tokens, not TRL's copy
SMOKE_OVERRIDES = {"rollout_batch_size": "2", "n_samples_per_prompt": "4", "minibatch_size": "4"}  # 8 rows, 2 steps

RECIPE_ASSUMPTIONS = {  # PPOConfig field: the value `grpo_config`'s mapping assumes (anything else is refused)
    "adv_estimator": "grpo",  # TRL: group-normalised advantages
    "policy_loss_kind": "ppo",  # the token-level clipped surrogate
    "loss_agg": "token-mean",  # TRL: loss_type="bnpo"
    "kl_in_reward": False, "kl_loss_kind": "k3",  # TRL: beta * k3 added to the per-token loss
    "min_lr_ratio": 1.0,  # constant after the warm-up: TRL's constant_with_warmup
    "chat_template": True, "reward_fn": ["ppo_core.rewards.verifiers:last_number_reward"],
    "dual_clip": 0.0, "entropy_coef": 0.0, "target_kl": 0.0, "lora_rank": 0,
    "missing_eos_penalty": 0.0, "overlong_buffer": 0, "reward_clip": 0.0, "whiten_rewards": False,
    "filter_groups": False, "old_logprobs_from_rollout": False, "off_policy_correction": "none",
    "rollout_ranks": 0, "max_staleness": 0, "gradient_checkpointing": False,
}

SETTINGS_NOT_MATCHED = [
    "sampling: TRL decodes with transformers' generate (a left-padded batch, a growing KV cache) and draws its noise "
    "from torch's global generator; ppo-core decodes on its paged RolloutEngine with counter-based noise per (seed, "
    "row, token). Same distribution (T=0.8, top_p 1, top_k 0, stop at <|im_end|>), different draws",
    "prompt order and minibatch split: TRL's RepeatSampler and shuffle_sequence_dict against ppo-core's RowStream and "
    "shuffle generator, both seeded by the seed but not the same permutations",
    "training passes: TRL runs padded [rows, prompt + 24] forwards (old, reference and update log-probs, 32 rows a "
    "pass); ppo-core packs the rows into micro-batches of at most micro_batch_tokens=2048 tokens. Same loss, different "
    "compute and rounding",
    "attention precision: TRL's SDPA runs under CPU bf16 autocast (bf16 attention); ppo-core computes attention in "
    "float32 on the CPU (only the linear layers in bf16) and decodes with oneDNN-packed bf16 weight copies",
    "LR warm-up off by one step: transformers' constant_with_warmup gives optimizer step k (0-based) the factor k/4 "
    "(0, 0.25, 0.5, 0.75, then 1: TRL's first step has LR 0); ppo-core's lr_at gives (k+1)/4 (0.25, 0.5, 0.75, 1)",
    "advantage epsilon: TRL divides by (group std + 1e-4), ppo-core by (group std + 1e-6); both the unbiased std",
    "k3 clamp: ppo-core clamps log(ref/pi) to [-20, 20] and k3 to at most 10 (verl's low_var_kl), zero gradient "
    "beyond; TRL's k3 is unclamped",
]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", default="~/.cache/ppo-core/SmolLM2-135M-Instruct", help="the starting checkpoint")
    p.add_argument("--prompts_file", required=True, help="JSONL of {prompt, answer} (scripts/make_addition_prompts.py)")
    p.add_argument("--config", default=DEFAULT_CONFIG, help="the ppo-core recipe whose settings TRL gets")
    p.add_argument("--iterations", type=int, default=50, help="generation rounds (each with its optimizer steps)")
    p.add_argument("--seeds", default="0,1", help="comma-separated; each seed is one training run")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads, for training and evaluation")
    p.add_argument("--eval_size", type=int, default=256, help="held-out rows evaluated (the first of the recipe's)")
    p.add_argument("--out", default="runs/trl-grpo", help="directory: seed<N>/model for each seed, summary.json")
    p.add_argument("--smoke", action="store_true", help="a tiny rollout (2 prompts x 4 samples, minibatches of 4): "
                                                        "checks the script end to end; its numbers mean nothing")
    return p.parse_args()


def recipe(config_path, smoke):
    """The PPOConfig of the recipe, refused where it asks for something `grpo_config` does not map."""
    cfg = build_config(load_toml(config_path), SMOKE_OVERRIDES if smoke else {}, toml_path=config_path)
    for field, assumed in RECIPE_ASSUMPTIONS.items():
        if getattr(cfg, field) != assumed:
            raise SystemExit(f"{config_path}: {field} = {getattr(cfg, field)!r}; this benchmark maps only "
                             f"{field} = {assumed!r} onto TRL's GRPOConfig")
    if rollout_rows(cfg) % cfg.minibatch_size:
        raise SystemExit(f"{config_path}: minibatch_size {cfg.minibatch_size} does not divide the rollout's "
                         f"{rollout_rows(cfg)} rows")
    return cfg


def grpo_config(cfg, seed, iterations, bf16, output_dir):
    """The recipe as GRPOConfig. One generation round of rollout_batch_size x n_samples_per_prompt completions feeds
    steps_per_generation optimizer steps of minibatch_size rows each (no gradient accumulation), ppo_epochs times."""
    steps_per_generation = rollout_rows(cfg) // cfg.minibatch_size  # 64 // 32 = 2
    return GRPOConfig(
        output_dir=output_dir,
        # the rollout: generation_batch_size = per_device_train_batch_size * steps_per_generation = 64 completions
        num_generations=cfg.n_samples_per_prompt,
        per_device_train_batch_size=cfg.minibatch_size,
        gradient_accumulation_steps=1,
        steps_per_generation=steps_per_generation,
        max_completion_length=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        # the update
        num_iterations=cfg.ppo_epochs,  # passes over each rollout
        max_steps=iterations * steps_per_generation * cfg.ppo_epochs,
        learning_rate=cfg.lr,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=cfg.warmup_steps,
        optim="adamw_torch_fused",  # torch.optim.AdamW(fused=True), as ppo-core's Optimizers
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_epsilon=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm,
        epsilon=cfg.clip_low,
        epsilon_high=cfg.clip_high,
        # "bnpo": sum(loss * mask) / mask.sum() over the local batch, here the whole 32-row minibatch: ppo-core's
        # token-mean. ("dapo", TRL's default, divides by the generation batch's token count / steps_per_generation,
        # the mean over both minibatches; "grpo" averages per sequence first; "dr_grpo" divides by rows x 24.)
        loss_type="bnpo",
        beta=cfg.kl_coef,  # TRL's per-token KL is k3: exp(ref - logp) - (ref - logp) - 1
        use_bias_correction_kl=False,  # ppo-core's k3 term is not weighted by the importance ratio
        scale_rewards="group",  # (r - group mean) / (group std + eps)
        # precision and machine
        bf16=bf16,
        use_cpu=True,
        gradient_checkpointing=False,  # TRL's default is True; ppo-core recomputes nothing (gradient_checkpointing=false)
        disable_dropout=True,  # the checkpoint has no dropout; ppo-core's model none either
        seed=seed,
        # no hubs, no checkpoints, one log per iteration (read by IterationClock)
        report_to="none",
        save_strategy="no",
        logging_steps=steps_per_generation * cfg.ppo_epochs,
        disable_tqdm=True,
    )


def chat_dataset(rows):
    """The training rows as conversational prompts, so that GRPOTrainer renders them with the checkpoint's chat
    template (its default system turn included), and the answer column the reward reads."""
    return datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": row["prompt"]}], "answer": row["answer"]}
                                       for row in rows])


def last_number_reward_on_messages(prompts, completions, answer, **kwargs):
    """ppo_core.rewards.verifiers.last_number_reward under TRL's reward-function signature: conversational prompts and
    completions arrive as lists of messages; the reward reads the completion's text and the row's answer."""
    return last_number_reward([p[-1]["content"] for p in prompts], [c[-1]["content"] for c in completions], answer)


class TimedGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that times its two rollout phases per generation round (gen, score), and records the output dtype of
    the policy's layer-0 attention output projection in every phase (gen, score, update)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.phase = "update"
        self.phase_seconds = defaultdict(list)  # "gen" / "score" -> seconds per generation round
        self.matmul_dtypes = defaultdict(set)  # phase -> dtypes seen
        o_proj = self.model.model.layers[0].self_attn.o_proj
        o_proj.register_forward_hook(lambda module, inputs, out: self.matmul_dtypes[self.phase].add(out.dtype))

    def _generate(self, prompts):
        self.phase, start = "gen", time.perf_counter()
        out = super()._generate(prompts)
        self.phase_seconds["gen"].append(time.perf_counter() - start)
        self.phase = "score"
        return out

    def _generate_and_score_completions(self, inputs):
        start = time.perf_counter()
        out = super()._generate_and_score_completions(inputs)
        self.phase_seconds["score"].append(time.perf_counter() - start - self.phase_seconds["gen"][-1])
        self.phase = "update"
        return out


class IterationClock(TrainerCallback):
    """Seconds per iteration (one generation round and its optimizer steps), from on_step_begin of its first step to
    on_step_end of its last, and one line per iteration from the trainer's log."""

    def __init__(self, steps_per_iteration, iterations, seed):
        self.steps_per_iteration, self.iterations, self.seed = steps_per_iteration, iterations, seed
        self.seconds = []
        self.start = None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step % self.steps_per_iteration == 0:
            self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.steps_per_iteration == 0:
            self.seconds.append(time.perf_counter() - self.start)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            print(f"seed {self.seed} iteration {len(self.seconds)}/{self.iterations}  reward {logs['reward']:.4f}  "
                  f"kl {logs.get('kl', float('nan')):.4f}  length {logs.get('completions/mean_length', 0):.1f}  "
                  f"{self.seconds[-1]:.1f}s", flush=True)


def check_prompt_tokens(trainer, policy_path, row, cfg):
    """TRL's rendering of a prompt (transformers' apply_chat_template on its processing class) must give the token ids
    ppo-core's does; otherwise the two libraries would not train on the same input. -> the prompt's token count."""
    trl_ids = trainer.processing_class.apply_chat_template([[{"role": "user", "content": row["prompt"]}]],
                                                           add_generation_prompt=True, tokenize=True,
                                                           return_dict=True)["input_ids"][0]
    ppo_ids = prompt_token_ids(load_tokenizer(policy_path), row, cfg)
    if list(trl_ids) != list(ppo_ids):
        raise SystemExit(f"the prompt renders differently in TRL ({len(trl_ids)} tokens) and ppo-core "
                         f"({len(ppo_ids)} tokens): {list(trl_ids)} vs {list(ppo_ids)}")
    return len(ppo_ids)


def train_trl(cfg, policy_path, train_rows, held_out, seed, iterations, bf16, seed_dir):
    """One TRL run. -> (model directory, the run's timings and dtypes)."""
    steps_per_iteration = rollout_rows(cfg) // cfg.minibatch_size * cfg.ppo_epochs
    clock = IterationClock(steps_per_iteration, iterations, seed)
    trainer = TimedGRPOTrainer(
        model=policy_path,
        reward_funcs=last_number_reward_on_messages,
        args=grpo_config(cfg, seed, iterations, bf16, os.path.join(seed_dir, "trainer")),
        train_dataset=chat_dataset(train_rows),
        callbacks=[clock],
    )
    trainer.remove_callback(PrinterCallback)  # IterationClock prints one line per iteration instead
    prompt_tokens = check_prompt_tokens(trainer, policy_path, held_out[0], cfg)
    trainer.train()

    model_dir = os.path.join(seed_dir, "model")
    trainer.model.save_pretrained(model_dir)
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(policy_path, name)):
            shutil.copy(os.path.join(policy_path, name), model_dir)
    run = {"iteration_s": clock.seconds, "gen_s": trainer.phase_seconds["gen"], "score_s": trainer.phase_seconds["score"],
           "matmul_dtypes": {phase: sorted(str(d).replace("torch.", "") for d in dtypes)
                             for phase, dtypes in trainer.matmul_dtypes.items()},
           "prompt_tokens": prompt_tokens, "grpo_config": trainer.args.to_dict()}
    run["update_s"] = [t - g - s for t, g, s in zip(run["iteration_s"], run["gen_s"], run["score_s"])]
    del trainer
    gc.collect()
    return model_dir, run


def evaluate_checkpoint(path, held_out, cfg, seed):
    """(greedy, sampled) mean reward of a checkpoint on the held-out rows, computed as ppo-train computes its own:
    ppo_core.rollout.evaluate (the rollout engine, the chat-rendered prompt, the checkpoint's stop tokens,
    max_new_tokens, the recipe's temperature, last_number_reward) under the recipe's precision, with ppo-train's
    evaluation seed."""
    precision = resolve_precision(cfg)
    policy = load_model(path, dtype=precision.param_dtype, device=precision.device)
    tokenizer = load_tokenizer(path)
    reward_source = make_reward_source(cfg, precision.device, precision.param_dtype)
    eval_seed = seed + EVAL_SEED_OFFSET
    greedy = evaluate(policy, tokenizer, held_out, reward_source, cfg, eval_seed, greedy=True, autocast=precision.autocast)
    sampled = evaluate(policy, tokenizer, held_out, reward_source, cfg, eval_seed, autocast=precision.autocast)
    return greedy, sampled


def median_after_first(values):
    """The median over the iterations after the first (the first warms up); the only one when there is one."""
    return statistics.median(values[1:] or values)


def table(results, cfg, args, bf16, load_before):
    precision = "fp32 weights, bf16 autocast" if bf16 else "fp32"
    rollout = f"{cfg.rollout_batch_size} prompts x {cfg.n_samples_per_prompt} samples, minibatches of {cfg.minibatch_size}"
    lines = [
        f"TRL GRPOTrainer on {os.path.basename(args.config)}{' (SMOKE: ' + rollout + ')' if args.smoke else ''}",
        f"CPU: {cpu_name()}; torch {torch.__version__}, transformers {transformers.__version__}, TRL {trl.__version__}, "
        f"datasets {datasets.__version__}; threads {torch.get_num_threads()}; {precision}; load average "
        f"{load_before:.2f} -> {os.getloadavg()[0]:.2f}",
        f"held out: the first {results[0]['eval_rows']} of the file's last {cfg.eval_size} rows, scored by "
        f"ppo_core.rollout.evaluate (greedy, and T={cfg.temperature} with seed + {EVAL_SEED_OFFSET})",
        "",
        "| library | seed | iterations | s/iteration (median) | gen / score / update s (median) | "
        "held-out greedy before -> after | held-out sampled before -> after | matmul dtype gen / score / update |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        run = r["run"]
        dtypes = " / ".join("+".join(run["matmul_dtypes"].get(p, ["-"])) for p in ("gen", "score", "update"))
        lines.append(
            f"| trl {trl.__version__} | {r['seed']} | {len(run['iteration_s'])} | "
            f"{median_after_first(run['iteration_s']):.2f} | {median_after_first(run['gen_s']):.2f} / "
            f"{median_after_first(run['score_s']):.2f} / {median_after_first(run['update_s']):.2f} | "
            f"{r['greedy_before']:.4f} -> {r['greedy_after']:.4f} | {r['sampled_before']:.4f} -> {r['sampled_after']:.4f} "
            f"| {dtypes} |")
    lines += ["", "Settings not matched:"] + [f"- {s}" for s in SETTINGS_NOT_MATCHED]
    return "\n".join(lines)


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()  # the weight-loading and shard-writing bars
    load_before = os.getloadavg()[0]
    policy_path = os.path.expanduser(args.policy)
    cfg = recipe(args.config, args.smoke)
    bf16 = resolve_precision(cfg).autocast_dtype == torch.bfloat16  # what ppo-train's dtype='auto' picks here
    train_rows, held_out = split_held_out(load_rows(args.prompts_file), cfg.eval_size)
    held_out = held_out[:args.eval_size]
    os.makedirs(args.out, exist_ok=True)

    results = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        seed_dir = os.path.join(args.out, f"seed{seed}")
        greedy_before, sampled_before = evaluate_checkpoint(policy_path, held_out, cfg, seed)
        print(f"seed {seed} before: held-out reward {greedy_before:.4f} (greedy), {sampled_before:.4f} "
              f"(T={cfg.temperature})", flush=True)
        model_dir, run = train_trl(cfg, policy_path, train_rows, held_out, seed, args.iterations, bf16, seed_dir)
        greedy_after, sampled_after = evaluate_checkpoint(model_dir, held_out, cfg, seed)
        print(f"seed {seed} after: held-out reward {greedy_after:.4f} (greedy), {sampled_after:.4f} "
              f"(T={cfg.temperature}); model in {model_dir}", flush=True)
        results.append({"seed": seed, "run": run, "eval_rows": len(held_out),
                        "greedy_before": greedy_before, "greedy_after": greedy_after,
                        "sampled_before": sampled_before, "sampled_after": sampled_after})
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump({"args": vars(args), "results": results, "settings_not_matched": SETTINGS_NOT_MATCHED}, f, indent=1)
    print()
    print(table(results, cfg, args, bf16, load_before))


if __name__ == "__main__":
    main()
