"""One whole PPO iteration, end to end: ppo-core against TRL 1.12's PPOTrainer, in fp32 and in bf16.

    pip install torch==2.13.0 && pip install -e ".[bench]"     # the bench extra pins TRL 1.12 and its libraries
    python bench/e2e.py                                         # full shape, both sides, fp32 and bf16, 1 thread
    python bench/e2e.py --iterations 3 --threads 2 --precisions bf16 --sides ppo-core,trl
    python bench/e2e.py --tiny                                  # the same code at a toy shape, seconds

Both sides train the same thing, built here without any network in a scratch directory (--workdir, default a
temporary one): a checkpoint with the architecture of configs/models/SmolLM2-135M and random weights written by
ppo_core.models.model (policy = reference, a value model and a reward model, both *ForSequenceClassification with one
label, as TRL's PPOTrainer requires and ppo-core's `critic` / `reward_model` read), a tokenizer.json that
transformers and ppo_core.models.tokenizer both load, and --batch prompts of exactly --prompt tokens. Per iteration: one
rollout of --batch prompts x exactly --new new tokens (temperature 1), scored by the reward model, old log-probs,
reference log-probs and values, then --ppo-epochs passes over --minibatches minibatches (one micro-batch each:
one optimizer step per minibatch), AdamW with the same lr, betas, eps and no weight decay for policy and value
model, a constant learning rate, no gradient clipping (TRL's PPOTrainer clips nothing; ppo-core's max_grad_norm=0),
kl_coef 0.05 (k1 in the reward), clip ranges 0.2, GAE gamma 1, lambda 0.95.

Exactly --new tokens per row on both sides, forced and counted: the random checkpoint makes its EOS and pad ids
impossible to sample (see `make_specials_unsampleable`), TRL runs with stop_token=None, and each side counts
the rows that decoded --new tokens none of which is EOS or pad (the table's "rows" column).

Each side and precision runs in its own fresh process (same --threads: torch.set_num_threads on both sides), one
warm-up iteration, then --iterations timed ones. The seconds of each iteration are split into
  gen     decoding the rollout (ppo-core: metrics.jsonl's time/generate_s; TRL: batch_generation);
  score   everything from the end of decoding to the first update forward: the reward model, the old / reference
          log-probs, the values, rewards and GAE (ppo-core: time/score_s; TRL: the time
          between batch_generation and the first forward of its PolicyAndValueWrapper);
  update  the PPO epochs (ppo-core: time/train_s; TRL: from that first forward to its per-iteration log call).
"total s" is their sum (wall-clock); "CPU s" the process's CPU time over the same span (time.process_time, all
threads): on a machine shared with other work, wall time grows with the load while CPU time mostly does not, so
the two together say how much of a difference is the load's. The header gives the load average before and after.
Neither side's bookkeeping between iterations (metrics, logging; TRL's gc.collect after each iteration) is counted.
The "o_proj dtype" column is the output dtype of the layer-0 attention output projection of every model (policy,
reference, value model, reward model), recorded by forward hooks during gen / score / update: the dtype their
matmuls really ran in ("bf16+fp32": some models in each; "-": no model ran). (o_proj, not q_proj: ppo-core's CPU
decoding fuses q/k/v into one packed matmul that does not call q_proj, while o_proj runs in every pass of both
libraries.) A bf16 row whose column reads fp32 did not run in bf16.

Precisions. fp32: ppo-core dtype='float32'; TRL fp32 models, no mixed precision. bf16: ppo-core dtype='bf16-mixed'
(fp32 master weights, bf16 autocast); TRL with bf16=True and ACCELERATE_MIXED_PRECISION=bf16 in its environment: its PPOTrainer builds its own Accelerator, which reads the
precision from there; that wraps the update's forward in bf16 autocast, while decoding and the scoring forwards run
on the unwrapped fp32 models (the o_proj column shows it). A third row, "ppo-core-rollout-lp", takes the old
log-probs from decoding (old_logprobs_from_rollout, TRL's way); the plain ppo-core row recomputes them exactly.
"""
import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ppo_core.models import model as ppo_model  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIG = os.path.join(HERE, "..", "configs", "models", "SmolLM2-135M")
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=512)
EOS, PAD = "<|endoftext|>", "<|pad|>"
EOS_ID, PAD_ID = 0, 1  # SmolLM2's EOS id is 0; it has no pad token, the bench takes id 1
PHASES = ("gen", "score", "update")
SIDES = ("ppo-core", "ppo-core-rollout-lp", "trl")

# The optimisation both sides run (see the module docstring).
LR, BETAS, EPS, KL_COEF, CLIP, GAMMA, LAM, TEMPERATURE, SEED = 1e-6, (0.9, 0.95), 1e-8, 0.05, 0.2, 1.0, 0.95, 1.0, 0


# ---------------------------------------------------------------------------------------- the scratch directory
def model_config(args) -> dict:
    """config.json of the checkpoints: the architecture of --config (SmolLM2-135M), cut down with --tiny."""
    config = {**ppo_model.read_config(args.config), "dtype": "float32", "pad_token_id": PAD_ID}
    if args.tiny:
        config.update(TINY)
    return config


def random_weights(model, seed):
    """Matrices ~ N(0, 0.02^2) (SmolLM2's initializer_range), norm weights 1, biases 0."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            else:
                p.fill_(1.0 if "norm" in name else 0.0)
    return model


def make_specials_unsampleable(model, special_ids, constant=0.02, special=-1e5):
    """Make `special_ids` impossible to sample from the causal LM `model`, whatever the input.

    Dimension 0 of the residual stream is made to hold `constant` > 0 at every position and layer: every token's
    embedding has `constant` there, and no layer writes to it (row 0 of each attention o_proj and MLP down_proj is
    zero). The final RMSNorm keeps it positive: n_0 = constant * g_0 / rms(h) > 0. The LM head's row of a special
    token holds `special` (-1e5) at dimension 0 and every other row `constant`, so a special token's logit is
    n_0 * (1e5 + constant) below what it would be: with this script's random SmolLM2-135M at least 1480 below the
    largest logit (measured over 2 x 96 random tokens, in fp32 and under bf16 autocast), where exp() is exactly 0 in
    float32 (from -104 on), so the softmax gives the specials probability 0 (tests/test_e2e_bench.py checks it at
    the toy shape; the table's "rows" column counts the rows that decoded no special).
    Decoding therefore never stops early and never emits the pad id, on both sides, with no option of either
    library involved."""
    head = model.lm_head.weight
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = constant
        head[:, 0] = constant  # the same tensor when the embeddings are tied (SmolLM2)
        head[special_ids, 0] = special
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0].zero_()
            layer.mlp.down_proj.weight[0].zero_()
    return model


def write_checkpoints(workdir, config):
    """policy/ (a *ForCausalLM), critic/ and reward/ (*ForSequenceClassification, num_labels 1): fp32 safetensors."""
    paths = {name: os.path.join(workdir, name) for name in ("policy", "critic", "reward")}
    policy = random_weights(ppo_model.CausalLM(ppo_model.ModelArgs.from_hf_config(config)), SEED)
    make_specials_unsampleable(policy, [EOS_ID, PAD_ID]).save_pretrained(paths["policy"])
    arch = config["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")
    score_config = {**config, "architectures": [arch], "num_labels": 1}
    for seed, name in ((SEED + 1, "critic"), (SEED + 2, "reward")):
        score_model = ppo_model.ScoreModel(ppo_model.ModelArgs.from_hf_config(score_config))
        random_weights(score_model, seed).save_pretrained(paths[name])
    for name in ("critic", "reward"):  # ppo-core's reward model re-tokenizes prompt + response text with its own
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(paths["policy"], f), paths[name])
    return paths


def write_tokenizer(path, vocab_size):
    """A tokenizer over every id, which transformers (PreTrainedTokenizerFast) and ppo_core.models.tokenizer both load.

    Id i is the word "t{i}" (ids 0 and 1: EOS and PAD). Text is split at spaces and each word gets a leading "▁"
    (Metaspace); decoding turns each "▁" back into a space, so a decoded response starts with one: ppo-core's reward
    model scores prompt + response as one text, which then re-encodes to exactly the prompt's and the response's
    ids. Random weights sample any id, and every sampled id must decode."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel

    vocab = {f"▁t{i}": i for i in range(vocab_size)}
    del vocab[f"▁t{EOS_ID}"], vocab[f"▁t{PAD_ID}"]
    vocab[EOS], vocab[PAD] = EOS_ID, PAD_ID
    tokenizer = Tokenizer(WordLevel(vocab, unk_token=PAD))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tokenizer.decoder = decoders.Replace("▁", " ")
    tokenizer.add_special_tokens([EOS, PAD])
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": EOS, "pad_token": PAD, "tokenizer_class": "PreTrainedTokenizerFast"}, f)


def write_prompts(path, n, length, vocab_size, seed=SEED):
    """n prompts of exactly `length` random ordinary tokens ("t5 t1234 ..."), one per line: no padding anywhere."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab_size, (n, length), generator=g)  # [n, length], never EOS_ID / PAD_ID
    with open(path, "w") as f:
        for row in ids.tolist():
            f.write(" ".join(f"t{i}" for i in row) + "\n")


def write_workdir(workdir, args):
    config = model_config(args)
    os.makedirs(os.path.join(workdir, "policy"), exist_ok=True)  # the tokenizer first: the score models copy it
    write_tokenizer(os.path.join(workdir, "policy"), config["vocab_size"])
    paths = write_checkpoints(workdir, config)
    paths["prompts"] = os.path.join(workdir, "prompts.txt")
    paths["eval_prompts"] = os.path.join(workdir, "eval_prompts.txt")
    write_prompts(paths["prompts"], args.batch, args.prompt, config["vocab_size"])
    write_prompts(paths["eval_prompts"], 1, args.prompt, config["vocab_size"], seed=SEED + 1)
    return paths, config


# ---------------------------------------------------------------------------------------- what both workers record
class DtypeProbe:
    """The output dtypes of the projections it is attached to, in each phase of the iterations, from forward hooks."""

    def __init__(self):
        self.phase = None  # "gen", "score", "update", or None outside the timed phases
        self.seen = {}

    def attach(self, module):
        module.register_forward_hook(self.hook)

    def hook(self, module, inputs, output):
        if self.phase is not None:
            self.seen.setdefault(self.phase, set()).add(str(output.dtype).replace("torch.", ""))

    def summary(self):
        short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
        return "/".join("+".join(sorted(short.get(d, d) for d in self.seen.get(p, ()))) or "-" for p in PHASES)


class StepCounter:
    """Optimizer steps per optimizer, counted by torch's global step hook (whatever library made the optimizer)."""

    def __init__(self):
        self.counts = {}
        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(self.hook)

    def hook(self, optimizer, args, kwargs):
        self.counts[id(optimizer)] = self.counts.get(id(optimizer), 0) + 1

    def take(self):
        """The steps since the last take: "2" (one optimizer), "2+2" (two), ..."""
        text = "+".join(str(c) for c in self.counts.values()) or "0"
        self.counts = {}
        return text


def count_full_rows(responses, response_mask, new):
    """Rows that decoded `new` tokens, none of them EOS or pad. responses: [B, R] int64; response_mask: [B, R]."""
    if responses.shape[1] != new:
        return 0, len(responses)
    special = (responses == EOS_ID) | (responses == PAD_ID)  # [B, R]
    return int((response_mask.bool().all(-1) & ~special.any(-1)).sum()), len(responses)


# ---------------------------------------------------------------------------------------- the ppo-core worker
def run_ppo_core(args, paths, precision, side):
    """ppo_core.train.run on the scratch checkpoint, in this process; -> the result dict (see main)."""
    from ppo_core import rollout, train
    from ppo_core.run import runlog, start
    from ppo_core import config as ppo_config
    from ppo_core.config import PPOConfig

    probe, steps = DtypeProbe(), StepCounter()
    state = {"in_iteration": False, "rows": [0, 0], "per_iteration": []}

    real_build, real_sample, real_rollout, real_update = (train.build_models, rollout.sample_responses,
                                                          train.iteration_rollout, train.ppo_update)
    real_reward_source, real_sample_and_score = start.make_reward_source, rollout.sample_and_score

    def build_models(*a, **k):
        policy, critic, reference = real_build(*a, **k)
        for model in {policy, critic, reference}:
            probe.attach(model.model.layers[0].self_attn.o_proj)
        return policy, critic, reference

    def make_reward_source(*a, **k):
        source = real_reward_source(*a, **k)
        if hasattr(source, "model"):  # the reward model (train.run builds the run's reward source first)
            probe.attach(source.model.model.layers[0].self_attn.o_proj)
        return source

    def sample_responses(*a, **k):
        probe.phase = "gen" if state["in_iteration"] else None
        out = real_sample(*a, **k)
        if state["in_iteration"]:
            probe.phase = "score"  # the reward model scores next, inside rollout.sample_and_score
        return out

    def sample_and_score(*a, **k):
        sampled = real_sample_and_score(*a, **k)
        if state["in_iteration"]:
            full, total = count_full_rows(sampled.tokens, sampled.response_mask, args.new)  # [B, R], [B, R]
            state["rows"] = [state["rows"][0] + full, state["rows"][1] + total]
        return sampled

    def iteration_rollout(*a, **k):
        state.update(in_iteration=True, rows=[0, 0], cpu_start=time.process_time())
        steps.take()
        return real_rollout(*a, **k)

    def ppo_update(*a, **k):
        probe.phase = "update"
        try:
            return real_update(*a, **k)
        finally:
            probe.phase = None
            state["in_iteration"] = False
            state["per_iteration"].append({"rows": list(state["rows"]), "steps": steps.take(),
                                           "cpu_s": time.process_time() - state["cpu_start"]})

    train.build_models, start.make_reward_source = build_models, make_reward_source  # where run() and make_reward_sources look them up
    rollout.sample_responses, rollout.sample_and_score = sample_responses, sample_and_score  # where the rollout looks them up
    train.iteration_rollout, train.ppo_update = iteration_rollout, ppo_update
    runlog.RunDir.save_checkpoint = lambda self, step, parts, **kwargs: None  # the final save measures the disk

    dtype = "float32" if precision == "fp32" else "bf16-mixed"
    minibatch = args.batch // args.minibatches
    values = dict(policy=paths["policy"], reference=paths["policy"], critic=paths["critic"],
                  reward_model=paths["reward"], prompts_file=paths["prompts"], eval_prompts_file=paths["eval_prompts"],
                  eval_size=1, iterations=1 + args.iterations, rollout_batch_size=args.batch, minibatch_size=minibatch,
                  micro_batch_size=minibatch, ppo_epochs=args.ppo_epochs, max_new_tokens=args.new,
                  temperature=TEMPERATURE, lr=LR, critic_lr=LR, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_eps=EPS,
                  weight_decay=0.0, warmup_steps=0, min_lr_ratio=1.0, max_grad_norm=0.0, kl_coef=KL_COEF,
                  clip_low=CLIP, clip_high=CLIP, value_clip=CLIP, gamma=GAMMA, lam=LAM, dtype=dtype, device="cpu",
                  threads=args.threads, save_every=0, progress=False, seed=SEED,
                  out=os.path.join(paths["workdir"], f"run-{side}-{precision}"))
    if side == "ppo-core-rollout-lp":
        values["old_logprobs_from_rollout"] = True
    cfg = PPOConfig(**values)
    ppo_config.validate(cfg)
    shutil.rmtree(cfg.out, ignore_errors=True)  # a kept --workdir: a new run, not the resume of an earlier one
    t0 = time.perf_counter()
    train.run(cfg)
    wall = time.perf_counter() - t0
    with open(os.path.join(cfg.out, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f if line.strip()]
    iterations = []
    for m, mine in zip(metrics, state["per_iteration"]):
        iterations.append({"gen_s": m["time/generate_s"], "score_s": m["time/score_s"], "update_s": m["time/train_s"],
                           "cpu_s": mine["cpu_s"], "rows": mine["rows"], "steps": mine["steps"],
                           "length_mean": m["response/length_mean"], "eos_frac": m["response/eos_frac"]})
    return {"iterations": iterations, "dtypes": probe.summary(), "setting": f"dtype={dtype!r}",
            "wall_s": wall}


# ---------------------------------------------------------------------------------------- the TRL worker
def run_trl(args, paths, precision):
    """TRL 1.12's PPOTrainer on the same checkpoint, prompts and optimisation, in this process."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import transformers
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    import trl
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as trl_ppo

    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    probe, steps = DtypeProbe(), StepCounter()
    clock, per_iteration = {}, []

    tokenizer = AutoTokenizer.from_pretrained(paths["policy"])
    with open(paths["prompts"]) as f:
        prompts = [line.rstrip("\n") for line in f if line.strip()]
    input_ids = [tokenizer(p)["input_ids"] for p in prompts]
    assert all(len(ids) == args.prompt for ids in input_ids), "prompts must encode to exactly --prompt tokens"
    dataset = Dataset.from_dict({"input_ids": input_ids})

    def load(cls, path, **kwargs):
        return cls.from_pretrained(path, dtype=torch.float32, **kwargs)

    policy = load(AutoModelForCausalLM, paths["policy"])
    ref_policy = load(AutoModelForCausalLM, paths["policy"])
    value_model = load(AutoModelForSequenceClassification, paths["critic"], num_labels=1)
    reward_model = load(AutoModelForSequenceClassification, paths["reward"], num_labels=1)
    for model in (policy, ref_policy, value_model, reward_model):
        probe.attach(model.model.layers[0].self_attn.o_proj)

    # Phase boundaries, at the level of TRL's own functions (trl/experimental/ppo/ppo_trainer.py calls them by
    # their module-level names): batch_generation is the decoding; the first `forward` of the PolicyAndValueWrapper
    # starts the update; the per-iteration `log` call ends it.
    real_generation, real_forward, real_log = trl_ppo.batch_generation, trl_ppo.forward, PPOTrainer.log

    def batch_generation(model, queries, *a, **k):
        steps.take()
        probe.phase = "gen"
        clock["start"], clock["cpu_start"] = time.perf_counter(), time.process_time()
        query_responses, logits = real_generation(model, queries, *a, **k)
        clock["gen_end"] = time.perf_counter()
        responses = query_responses[:, queries.shape[1]:]  # [B, R]
        clock["rows"] = count_full_rows(responses, torch.ones_like(responses), args.new)
        probe.phase = "score"
        return query_responses, logits

    def forward(model, *a, **k):
        if probe.phase == "score" and hasattr(model, "value_model"):  # the PolicyAndValueWrapper: the update begins
            clock["update_start"] = time.perf_counter()
            probe.phase = "update"
        return real_forward(model, *a, **k)

    def log(self, logs, *a, **k):
        if probe.phase == "update" and "objective/kl" in logs:
            end = time.perf_counter()
            per_iteration.append({"gen_s": clock["gen_end"] - clock["start"],
                                  "score_s": clock["update_start"] - clock["gen_end"],
                                  "update_s": end - clock["update_start"], "rows": list(clock["rows"]),
                                  "cpu_s": time.process_time() - clock["cpu_start"],
                                  "steps": steps.take()})
            probe.phase = None
        return real_log(self, logs, *a, **k)

    trl_ppo.batch_generation, trl_ppo.forward, PPOTrainer.log = batch_generation, forward, log

    minibatch = args.batch // args.minibatches
    config = PPOConfig(
        output_dir=os.path.join(paths["workdir"], f"trl-{precision}"), report_to="none", save_strategy="no",
        logging_strategy="steps", logging_steps=1, disable_tqdm=True, use_cpu=True, seed=SEED, bf16=precision == "bf16",
        # one rollout of args.batch prompts per iteration; each of num_mini_batches minibatches is one micro-batch
        # (per_device_train_batch_size = the rollout, gradient_accumulation_steps 1): one optimizer step each
        per_device_train_batch_size=args.batch, gradient_accumulation_steps=1, num_mini_batches=args.minibatches,
        local_rollout_forward_batch_size=args.batch, total_episodes=args.batch * (1 + args.iterations),
        num_ppo_epochs=args.ppo_epochs, response_length=args.new, stop_token=None, temperature=TEMPERATURE,
        missing_eos_penalty=None, num_sample_generations=0, per_device_eval_batch_size=1,
        learning_rate=LR, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_epsilon=EPS, weight_decay=0.0,
        optim="adamw_torch", lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=0.0,
        kl_coef=KL_COEF, kl_estimator="k1", cliprange=CLIP, cliprange_value=CLIP, gamma=GAMMA, lam=LAM,
        whiten_rewards=False)
    assert minibatch == config.per_device_train_batch_size // config.num_mini_batches
    trainer = PPOTrainer(args=config, processing_class=tokenizer, model=policy, ref_model=ref_policy,
                         reward_model=reward_model, train_dataset=dataset, value_model=value_model,
                         eval_dataset=dataset)
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    setting = f"bf16={config.bf16}, accelerator mixed_precision={trainer.accelerator.mixed_precision!r}"
    return {"iterations": per_iteration, "dtypes": probe.summary(), "setting": setting, "wall_s": wall,
            "versions": {"trl": trl.__version__, "transformers": transformers.__version__}}


# ---------------------------------------------------------------------------------------- the parent: table
def worker(args):
    """--worker SIDE: one side at one precision in this fresh process; the result as JSON in --result."""
    paths = json.loads(args.paths)
    try:
        if args.worker == "trl":
            result = run_trl(args, paths, args.precision)
        else:
            result = run_ppo_core(args, paths, args.precision, args.worker)
        result["ok"] = True
    except Exception as e:
        traceback.print_exc()
        result = {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
    result.update(side=args.worker, precision=args.precision, threads=torch.get_num_threads(), torch=torch.__version__)
    with open(args.result, "w") as f:
        json.dump(result, f)


def spawn(args, paths, side, precision, log_dir):
    """Run one worker in a fresh Python process; -> its result dict. Its own output goes to a log file."""
    result = os.path.join(log_dir, f"{side}-{precision}.json")
    log_path = result[:-5] + ".log"
    command = [sys.executable, os.path.abspath(__file__), "--worker", side, "--precision", precision,
               "--result", result, "--paths", json.dumps(paths), "--threads", str(args.threads),
               "--batch", str(args.batch), "--prompt", str(args.prompt), "--new", str(args.new),
               "--minibatches", str(args.minibatches), "--ppo-epochs", str(args.ppo_epochs),
               "--iterations", str(args.iterations)] + (["--tiny"] if args.tiny else [])
    env = dict(os.environ)
    # TRL's PPOTrainer builds its own Accelerator: its mixed precision comes from here (see the module docstring)
    env["ACCELERATE_MIXED_PRECISION"] = "bf16" if (side == "trl" and precision == "bf16") else "no"
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        code = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    print(f"  {side:<20} {precision}: {time.perf_counter() - t0:6.1f} s in its process (log: {log_path})",
          file=sys.stderr, flush=True)
    if code or not os.path.exists(result) or not json.load(open(result)).get("ok"):
        with open(log_path) as f:  # the scratch directory may be a temporary one: show the end of the log now
            print("".join(f.readlines()[-25:]), file=sys.stderr)
    if not os.path.exists(result):
        return {"ok": False, "side": side, "precision": precision, "error": f"worker exited with status {code}, see {log_path}"}
    with open(result) as f:
        return json.load(f)


def medians(result):
    """Median seconds per phase over the timed iterations (the first, warm-up iteration dropped)."""
    timed = result["iterations"][1:]
    out = {k: statistics.median(it[k] for it in timed) for k in ("gen_s", "score_s", "update_s")}
    out["total_s"] = statistics.median(it["gen_s"] + it["score_s"] + it["update_s"] for it in timed)
    out["cpu_s"] = statistics.median(it["cpu_s"] for it in timed)
    return out


def machine_line():
    """The CPU model, its core count and the bf16 instructions it has (Linux: /proc/cpuinfo)."""
    name, flags = platform.processor() or "unknown CPU", set()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    name = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
    isa = ", ".join(f"{flag}: {'yes' if flag in flags else 'no'}" for flag in ("avx512_bf16", "amx_bf16"))
    return f"{name}, {os.cpu_count()} cores ({isa})"


def print_tables(results, args, config, loads):
    ok = [r for r in results if r.get("ok") and len(r["iterations"]) > 1]
    n_params = ppo_model.count_parameters(config)
    print(f"\n## One PPO iteration, ppo-core vs TRL {next((r['versions']['trl'] for r in ok if 'versions' in r), '1.12')}: "
          f"{n_params / 1e6:.{0 if n_params > 1e7 else 2}f}M-parameter {config['architectures'][0]} (random weights), "
          f"CPU, {args.threads} thread(s), torch {torch.__version__}\n")
    print(f"batch {args.batch} prompts x {args.prompt} tokens, exactly {args.new} new tokens, {args.ppo_epochs} PPO "
          f"epoch(s) x {args.minibatches} minibatches (one optimizer step each), {args.iterations} timed iteration(s) "
          f"after 1 warm-up; medians of the timed iterations. {machine_line()}; 1-minute load average "
          f"{loads[0]:.1f} at the start, {loads[1]:.1f} at the end.\n")
    print("| side | precision | gen s | score s | update s | total s | CPU s | new tokens/s | o_proj dtype (gen/score/update) "
          "| rows of exactly new tokens | optimizer steps | setting |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|---|---|---|")
    for r in results:
        if r not in ok:
            print(f"| {r['side']} | {r['precision']} | failed: {r.get('error', 'no timed iteration')} ||||||||||")
            continue
        m, timed = medians(r), r["iterations"][1:]
        rows = f"{sum(it['rows'][0] for it in timed)}/{sum(it['rows'][1] for it in timed)}"
        steps = ",".join(sorted({it["steps"] for it in timed}))
        print(f"| {r['side']} | {r['precision']} | {m['gen_s']:.2f} | {m['score_s']:.2f} | {m['update_s']:.2f} | "
              f"{m['total_s']:.2f} | {m['cpu_s']:.2f} | {args.batch * args.new / m['total_s']:.1f} | {r['dtypes']} | "
              f"{rows} | {steps} | "
              f"{r['setting']} |")
    print("\nper iteration (s: gen / score / update = total; iteration 1 is the warm-up):\n")
    for r in ok:
        cells = [f"{i + 1}: {it['gen_s']:.2f} / {it['score_s']:.2f} / {it['update_s']:.2f} = "
                 f"{it['gen_s'] + it['score_s'] + it['update_s']:.2f} (CPU {it['cpu_s']:.2f})"
                 for i, it in enumerate(r["iterations"])]
        print(f"- {r['side']}, {r['precision']}: " + "; ".join(cells))

    by = {(r["side"], r["precision"]): medians(r) for r in ok}
    lines = []
    for precision in args.precisions:
        for side in ("ppo-core", "ppo-core-rollout-lp"):
            if (side, precision) in by and ("trl", precision) in by:
                a, b = by[("trl", precision)], by[(side, precision)]
                lines.append(f"- {precision}, TRL / {side}: total {a['total_s'] / b['total_s']:.2f}x (CPU s "
                             f"{a['cpu_s'] / b['cpu_s']:.2f}x; gen "
                             f"{a['gen_s'] / b['gen_s']:.2f}x, score {a['score_s'] / b['score_s']:.2f}x, update "
                             f"{a['update_s'] / b['update_s']:.2f}x)")
    for side in SIDES:
        if (side, "fp32") in by and (side, "bf16") in by:
            a, b = by[(side, "fp32")], by[(side, "bf16")]
            lines.append(f"- {side}, fp32 / bf16: total {a['total_s'] / b['total_s']:.2f}x (CPU s "
                         f"{a['cpu_s'] / b['cpu_s']:.2f}x; gen "
                         f"{a['gen_s'] / b['gen_s']:.2f}x, score {a['score_s'] / b['score_s']:.2f}x, update "
                         f"{a['update_s'] / b['update_s']:.2f}x)")
    if lines:
        print("\nratios of the median seconds (above 1: the second is faster):\n")
        print("\n".join(lines))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=DEFAULT_CONFIG, help="a directory holding config.json (the architecture)")
    ap.add_argument("--tiny", action="store_true", help="toy shape (2 layers, hidden 64, vocabulary 512, batch 8, "
                                                        "8 + 8 tokens): checks the code in seconds")
    ap.add_argument("--sides", default=",".join(SIDES),
                    help=f"comma-separated, of {', '.join(SIDES)}")
    ap.add_argument("--precisions", default="fp32,bf16", help="comma-separated, of fp32, bf16")
    ap.add_argument("--iterations", type=int, default=2, help="timed iterations, after one warm-up iteration")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each side's process")
    ap.add_argument("--batch", type=int, default=None, help="prompts per rollout (default 16; --tiny 8)")
    ap.add_argument("--prompt", type=int, default=None, help="tokens per prompt (default 32; --tiny 8)")
    ap.add_argument("--new", type=int, default=None, help="new tokens per row, exactly (default 64; --tiny 8)")
    ap.add_argument("--minibatches", type=int, default=2, help="minibatches per PPO epoch, one optimizer step each")
    ap.add_argument("--ppo-epochs", type=int, default=1)
    ap.add_argument("--workdir", default=None, help="scratch directory, kept with each process's log (default: a "
                                                    "temporary one, removed)")
    # a worker process (spawned by the parent, not for the command line)
    ap.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--precision", choices=("fp32", "bf16"), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--paths", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.batch = args.batch or (8 if args.tiny else 16)
    args.prompt = args.prompt or (8 if args.tiny else 32)
    args.new = args.new or (8 if args.tiny else 64)
    if args.worker:
        return worker(args)
    if args.batch % args.minibatches:
        sys.exit("bench/e2e.py: --batch must be a multiple of --minibatches")
    args.precisions = [p for p in args.precisions.split(",") if p]
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    unknown = [s for s in sides + args.precisions if s not in SIDES + ("fp32", "bf16")]
    if unknown:
        sys.exit(f"bench/e2e.py: unknown side or precision {unknown[0]!r}")

    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
    with contextlib.nullcontext(args.workdir) if args.workdir else tempfile.TemporaryDirectory() as workdir:
        t0 = time.perf_counter()
        paths, config = write_workdir(workdir, args)
        paths["workdir"] = workdir
        print(f"scratch checkpoints, tokenizer and prompts written in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        load_start = os.getloadavg()[0]
        results = [spawn(args, paths, side, precision, workdir) for precision in args.precisions for side in sides]
        print_tables(results, args, config, (load_start, os.getloadavg()[0]))
    failed = [f"{r['side']} {r['precision']}" for r in results if not r.get("ok")]
    if failed:
        sys.exit(f"bench/e2e.py: failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
