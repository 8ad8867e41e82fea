"""The start of a run, before its first iteration: the checks of the config against the files and
processes it names (one ConfigError or CheckpointError naming the key), the models, teacher and
reward sources built and spread over the processes, the prompts split and fitted to the context,
the run directory opened, the KL controller, and the run's first lines. ppo_core.train's run()
calls these in that order."""
import contextlib
import dataclasses
import difflib
import os

import torch

from .. import algo
from ..config import (ConfigError, PPOConfig, records_decode_logprobs, rollout_rows, to_dict,
                      uses_critic)
from ..data.prompts import PromptsError, RowStream, load_rows, split_held_out, where_is
from ..data.tasks import PromptStream, ToolmulStream, eval_prompts, toolmul_rows
from ..models import distributed as dist
from ..models import lora
from ..models.model import CheckpointError, load_model, load_score_model, read_config
from ..models.precision import loss_paths, precision_line
from ..models.tokenizer import load_tokenizer
from ..rewards.source import make_reward_source
from . import checkpoint, plan, recording, runlog, tracking


@dataclasses.dataclass
class Models:
    """The models of a run and what scores their samples, built once (ppo_core.train.set_up) and
    passed together; a function reads the ones it needs."""

    policy: object  # CausalLM
    reference: object  # frozen; the policy itself where its LoRA adapters off give the base weights
    critic: object = None  # ScoreModel; None for the critic-free estimators
    teacher: object = None  # CausalLM; None without cfg.teacher (on-policy distillation)
    tokenizer: object = None
    reward_source: object = None  # scores the rollouts (ppo_core.rewards.source)
    eval_source: object = None  # scores the held-out rows (reward_source or eval_reward_fn's)
    policy_train: object = None  # what the update steps: the policy, or its DDP/FSDP wrapper
    critic_train: object = None


@dataclasses.dataclass
class Setup:
    """What ppo_core.train.set_up hands the loop: the models, the prompts, where the run writes."""

    models: Models
    policy_path: str
    train_rows: list
    held_out: list  # the held-out rows (a pairwise judge's reference responses added once)
    stream: object  # the training prompts' seeded stream; its position is checkpointed
    overlong: int  # rows dropped as longer than the context leaves (drop_overlong_prompts)
    longest: int  # the kept rows' longest prompt, in tokens
    replay: object  # the recording replayed (replay_rollouts), else None
    run_dir: object  # ppo_core.run.runlog.RunDir
    ckpt: object  # the checkpoint a resume starts from, else None
    log: object  # ppo_core.run.runlog.Logger
    tracker: object  # ppo_core.run.tracking.Tracker


@dataclasses.dataclass
class Step:
    """A step's settings, what the passes read beside the models."""

    cfg: PPOConfig
    generator: torch.Generator = None  # the rollouts' sampling noise, reseeded each iteration
    # -> a context manager: bf16 autocast, or nothing (ppo_core.models.precision)
    autocast: object = contextlib.nullcontext
    device: torch.device = None  # where the models are (a rollout read from a state goes there)


def torch_threads(cfg: PPOConfig) -> int:
    """torch's CPU threads for the run: cfg.threads, or 0 = one per core this process may use (its
    CPU affinity, which a container or `taskset` narrows; torch's own default counts every core of
    the machine)."""
    if cfg.threads:
        return cfg.threads
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# each a directory (HF layout)
CHECKPOINT_KEYS = ("policy", "reference", "critic", "reward_model", "judge")
FILE_KEYS = ("prompts_file", "eval_prompts_file")


def check_paths(cfg: PPOConfig):
    """Every path the config names is there and of its kind (a checkpoint directory, a file), before
    anything is read: else one ConfigError naming each key that is not, all of them in one message:
    "config key 'policy': no such directory: '/m/SmolLM2-135M-Instruc' (did you mean
    '/m/SmolLM2-135M-Instruct'?)". Also the files of 'file.py:function' specs (reward_fn,
    eval_reward_fn, environment) and a judge_template given as a file (absolute once
    config.absolute_paths has run)."""
    problems = []
    for key in CHECKPOINT_KEYS + FILE_KEYS:
        path = getattr(cfg, key)
        if path:
            problem = path_problem(path, directory=key in CHECKPOINT_KEYS)
            problems += [f"config key '{key}': {problem}"] if problem else []
    specs = [("reward_fn", spec) for spec in cfg.reward_fn] + [(key, getattr(cfg, key)) for key in
                                                                ("eval_reward_fn", "environment")]
    for key, spec in specs:
        module = spec.rpartition(":")[0]
        problem = path_problem(module, directory=False) if module.endswith(".py") else None
        problems += [f"config key '{key}': {problem}"] if problem else []
    if os.path.isabs(cfg.judge_template):  # else a shipped template's name
        problem = path_problem(cfg.judge_template, directory=False)
        problems += [f"config key 'judge_template': {problem}"] if problem else []
    if problems:
        raise ConfigError(problems[0] if len(problems) == 1
                          else f"{len(problems)} config problems: " + "; ".join(problems))


@contextlib.contextmanager
def checkpoint_of(key):
    """A CheckpointError in the block (a checkpoint directory that cannot be loaded: a file missing,
    a bad config; the tokenizer's loader says FileNotFoundError) is about config key `key`'s
    checkpoint: its message says so, "config key 'policy': no tokenizer.json in '/m/x'"."""
    try:
        yield
    except (CheckpointError, FileNotFoundError) as e:
        raise CheckpointError(f"config key '{key}': {e}") from None


def path_problem(path, directory: bool):
    """Why `path` is not a directory (directory=True) or a file, with the closest name beside it
    when it is missing (a typo); None when it is one."""
    if os.path.isdir(path) if directory else os.path.isfile(path):
        return None
    kind = "directory" if directory else "file"
    if os.path.exists(path):
        return f"not a {kind}: {path!r}"
    parent, name = os.path.split(os.path.normpath(path))
    siblings = os.listdir(parent) if os.path.isdir(parent) else []
    close = difflib.get_close_matches(name, siblings, n=1, cutoff=0.75)
    return f"no such {kind}: {path!r}" + (f" (did you mean {os.path.join(parent, close[0])!r}?)"
                                          if close else "")


def check_process_count(cfg: PPOConfig, world):
    """Every process holds an equal share of a rollout and of each minibatch; recorded rollouts are
    one process's. A ConfigError otherwise."""
    recording.check_processes(cfg, world)
    if rollout_rows(cfg) % world or cfg.minibatch_size % world:
        raise ConfigError(
            "config keys 'rollout_batch_size' (times n_samples_per_prompt) and 'minibatch_size' "
            f"must be multiples of the number of processes ({world})")
    if cfg.max_staleness and world > 1 and not cfg.rollout_ranks:
        raise ConfigError(
            "config key 'max_staleness': without rollout workers, one process only for now (its "
            "checkpoint holds one process's pending rollout)")


def check_batch(cfg: PPOConfig, train_rows, longest_prompt, policy_path, world, device):
    """A batch the data or the memory cannot hold is refused before any work: from a prompts file,
    a rollout_batch_size above the file's training rows (a rollout samples distinct rows) is a
    ConfigError; then the planner's estimate of the rollout and update is checked against the
    memory free now (ppo_core.run.plan.check_run_fits). Why distinct rows:
    docs/reliability.md#check_batch-distinct-prompts-in-a-rollout."""
    if cfg.prompts_file and cfg.rollout_batch_size > len(train_rows):
        raise ConfigError(
            f"config key 'rollout_batch_size': {cfg.rollout_batch_size} prompts per iteration, but "
            f"{cfg.prompts_file} holds {len(train_rows)} training rows (held-out rows apart); "
            f"lower rollout_batch_size to at most {len(train_rows)} (and raise "
            "n_samples_per_prompt to sample each prompt more than once)")
    plan.check_run_fits(cfg, policy_path, longest_prompt, world, device)


def check_roles(cfg: PPOConfig):
    """With rollout workers, at least one process must be left to train, and a rollout's rows must
    split evenly over the workers: a ConfigError otherwise. Every process checks it, workers too, so
    that a job refused here ends on every process with the same line."""
    if cfg.rollout_ranks and dist.job_size() <= cfg.rollout_ranks:
        raise ConfigError(
            f"config key 'rollout_ranks': {cfg.rollout_ranks} rollout worker(s) need a trainer "
            f"beside them: run under torchrun with more than {cfg.rollout_ranks} process(es) (this "
            f"job has {dist.job_size()})")
    if cfg.rollout_ranks and rollout_rows(cfg) % cfg.rollout_ranks:
        raise ConfigError(
            "config keys 'rollout_batch_size' (times n_samples_per_prompt) and 'rollout_ranks': "
            f"the {rollout_rows(cfg)} rows of a rollout must split evenly over {cfg.rollout_ranks} "
            "rollout workers")


def build_models(cfg: PPOConfig, policy_path, tokenizer, device, param_dtype):
    """Policy, critic (None for the critic-free estimators: nothing built, trained or saved) and the
    frozen reference: the policy itself when LoRA adapters switched off give the reference weights.
    `tokenizer`: the policy's, whose vocabulary must fit the model's. A checkpoint that cannot be
    loaded is a CheckpointError naming its config key."""
    with checkpoint_of("policy"):
        policy = load_model(policy_path, dtype=param_dtype, device=device)
    # without a critic, the policy's backbone
    with checkpoint_of("critic" if cfg.critic else "policy"):
        critic = (load_score_model(cfg.critic or policy_path, dtype=param_dtype, device=device)
                  if uses_critic(cfg) else None)
    trainable = [m for m in (policy, critic) if m is not None]
    if cfg.lora_rank:
        # the same adapters on every process
        init = torch.Generator(device=device).manual_seed(cfg.seed + 2)
        for model in trainable:
            lora.add_lora(model, cfg.lora_rank, cfg.lora_alpha or None, generator=init)
    if cfg.lora_rank and not cfg.reference:
        # the base weights: the policy with its adapters off (see rollout.reference_logprobs)
        reference = policy
    else:
        with checkpoint_of("reference" if cfg.reference else "policy"):
            reference = load_model(cfg.reference or policy_path, dtype=param_dtype, device=device)
            reference.eval().requires_grad_(False)
    if tokenizer.vocab_size > policy.args.vocab_size:
        raise CheckpointError(
            f"config key 'policy': the tokenizer of {policy_path} has {tokenizer.vocab_size} "
            f"tokens but the model's vocabulary is {policy.args.vocab_size}")
    for model in trainable:
        model.model.gradient_checkpointing = cfg.gradient_checkpointing
    return policy, critic, reference


def check_teacher(cfg: PPOConfig, policy_path, tokenizer):
    """A teacher (cfg.teacher) must be a checkpoint directory whose tokenizer maps every token to
    the policy's id and whose vocabulary size (its LM head's rows) is the policy's: a ConfigError
    naming the key otherwise, before any model is built. `tokenizer`: the policy's. Why:
    docs/reliability.md#check_teacher-a-teacher-reads-the-policys-token-ids."""
    if not cfg.teacher:
        return
    if not os.path.isdir(cfg.teacher):
        raise ConfigError(f"config key 'teacher': no such checkpoint directory: {cfg.teacher!r}")
    try:
        teacher_vocab, policy_vocab = (load_tokenizer(cfg.teacher).backend.get_vocab(),
                                       tokenizer.backend.get_vocab())
        teacher_size, policy_size = (read_config(cfg.teacher)["vocab_size"],
                                     read_config(policy_path)["vocab_size"])
    except (CheckpointError, FileNotFoundError) as e:
        raise ConfigError(f"config key 'teacher': {e}") from None
    if teacher_vocab != policy_vocab:
        differ = min(set(teacher_vocab.items()) ^ set(policy_vocab.items()),
                     key=lambda item: (item[1], item[0]))[0]
        def where(vocab):
            return f"id {vocab[differ]}" if differ in vocab else "absent"
        raise ConfigError(
            f"config key 'teacher': the tokenizer of {cfg.teacher} differs from the policy's "
            f"({policy_path}): token {differ!r} is {where(teacher_vocab)} in the teacher's, "
            f"{where(policy_vocab)} in the policy's; a teacher must share the policy's tokenizer")
    if teacher_size != policy_size:
        raise ConfigError(
            f"config key 'teacher': {cfg.teacher} has a vocabulary of {teacher_size} tokens, the "
            f"policy {policy_size}; a teacher's log-probs must be over the policy's vocabulary")


def build_teacher(cfg: PPOConfig, device, param_dtype):
    """The frozen teacher of on-policy distillation (cfg.teacher; checked by check_teacher), loaded
    as the reference is; None without one."""
    if not cfg.teacher:
        return None
    return load_model(cfg.teacher, dtype=param_dtype, device=device).eval().requires_grad_(False)


def check_chat_template(cfg: PPOConfig, tokenizer, policy_path):
    """With cfg.chat_template, the policy's tokenizer must have a chat template to render prompts
    with: a ConfigError otherwise."""
    if cfg.chat_template:
        try:
            tokenizer.get_chat_template()
        except ValueError as e:  # none at all, or several and no default
            raise ConfigError(
                f"config key 'chat_template': the policy {policy_path} cannot render a chat: {e}; "
                f"add chat_template.jinja, or drop --chat_template") from None


def make_reward_sources(cfg: PPOConfig, device, param_dtype):
    """(the training reward source, the source that scores the held-out evaluations): the
    evaluations' is the training reward, or cfg.eval_reward_fn alone when it is set
    (ppo_core.rewards.source)."""
    reward_source = make_reward_source(cfg, device, param_dtype)
    eval_source = reward_source
    if cfg.eval_reward_fn:
        eval_source = make_reward_source(
            dataclasses.replace(cfg, reward_fn=[cfg.eval_reward_fn], reward_weights=[],
                                reward_model="", reward_url=[], judge=""),
            key="eval_reward_fn")
    return reward_source, eval_source


def spread_over_processes(policy, critic, reference, teacher, reward_source, cfg, device):
    """With more than one process: FSDP2-shard (cfg.parallel='fsdp') or DDP-wrap the trainable
    models, and shard the frozen ones too with cfg.shard_frozen under FSDP. Returns the modules that
    training forwards run through: (policy, critic) themselves, or their DDP wrappers. One process:
    the models as they are. Every way computes in the precision of one process: the parameters'
    dtype, under the run's autocast."""
    if dist.world_size() == 1:
        return policy, critic
    if cfg.parallel == "ddp":
        return (dist.replicate(policy, device),
                dist.replicate(critic, device) if critic is not None else None)
    for model in (policy, critic):
        if model is not None:
            dist.shard(model, device, cpu_offload=cfg.cpu_offload)
    if cfg.shard_frozen:
        if reference is not policy:
            dist.shard(reference, device)
        if teacher is not None:
            dist.shard(teacher, device)
        # its score() reads the head outside forward: keep the root whole
        if hasattr(reward_source, "model"):
            dist.shard(reward_source.model, device, root=False)
    return policy, critic


def prompt_rows(cfg: PPOConfig):
    """(training rows, held-out rows, the training stream). Rows are dicts with a "prompt" or chat
    "messages" and any extra columns (ppo_core.data.prompts). From prompts_file (its last eval_size
    rows held out, at most half, unless eval_prompts_file is given), or the built-in task's seeded
    prompt stream and held-out set. A prompts file that cannot be read is a ConfigError."""
    if not cfg.prompts_file and cfg.task == "toolmul":  # a task of rows: prompt and answer
        held_out = toolmul_rows(cfg.eval_size, cfg.seed)
        return [], held_out, ToolmulStream(cfg.seed, [r["prompt"] for r in held_out])
    if not cfg.prompts_file:
        held_out = [{"prompt": p} for p in eval_prompts(cfg.eval_size, cfg.seed, cfg.task)]
        return [], held_out, PromptStream(cfg.seed, [r["prompt"] for r in held_out], cfg.task)
    try:
        train_rows = load_rows(cfg.prompts_file)
        if cfg.eval_prompts_file:
            held_out = load_rows(cfg.eval_prompts_file)[: cfg.eval_size]
        else:  # hold out the file's last eval_size prompts (at most half of it)
            train_rows, held_out = split_held_out(train_rows, cfg.eval_size)
    except PromptsError as e:
        raise ConfigError(f"config key 'prompts_file': {e}") from None
    return train_rows, held_out, RowStream(train_rows, cfg.seed)


def fit_context(cfg: PPOConfig, policy, train_rows, held_out, stream, prompt_lengths):
    """Every prompt (prompt_lengths: the token counts of held_out + train_rows) must leave room in
    the policy's context for max_new_tokens: one that does not is a ConfigError naming its file and
    line, or, with drop_overlong_prompts, dropped (a ConfigError if that leaves no held-out or no
    training rows). -> (train_rows, held_out, stream, the number of rows dropped); the stream is
    rebuilt on the rows kept."""
    context = policy.args.max_position_embeddings
    fits = [n + cfg.max_new_tokens <= context for n in prompt_lengths]
    if all(fits):
        return train_rows, held_out, stream, 0
    first = fits.index(False)
    files = {"prompts_file": cfg.prompts_file, "eval_prompts_file": cfg.eval_prompts_file}
    if not cfg.drop_overlong_prompts:
        raise ConfigError(
            f"{where_is((held_out + train_rows)[first], files)}: the prompt has "
            f"{prompt_lengths[first]} tokens; with max_new_tokens={cfg.max_new_tokens} it exceeds "
            f"the model's context of {context} tokens (drop_overlong_prompts=true drops such rows)")
    held_out = [row for row, fit in zip(held_out, fits) if fit]
    kept = [row for row, fit in zip(train_rows, fits[len(fits) - len(train_rows):]) if fit]
    if not held_out or (train_rows and not kept):
        raise ConfigError(
            "config key 'drop_overlong_prompts': every "
            f"{'held-out' if not held_out else 'training'} prompt is longer than the model's "
            f"context of {context} tokens leaves for max_new_tokens={cfg.max_new_tokens}")
    if train_rows:  # a prompts file's stream (a built-in task's makes its own short prompts)
        stream = RowStream(kept, cfg.seed)
    return kept, held_out, stream, fits.count(False)


def open_run_dir(cfg: PPOConfig, policy_path, resume_from, precision):
    """The run directory (ppo_core.run.runlog.RunDir), new or continued, its metrics and samples cut
    back to its latest checkpoint; the log and the trackers open on it.
    -> (run_dir, latest checkpoint or None, log, tracker)."""
    run_dir = runlog.RunDir.open(cfg, policy_path, resume_from, precision.describe())
    # the latest checkpoint verified against its manifest, else an older one
    ckpt, ckpt_notes = checkpoint.resume_checkpoint(run_dir.path)
    # Metrics of iterations after the checkpoint belong to work a resume redoes.
    done = 0 if ckpt is None else checkpoint.checkpoint_step(ckpt)
    # for each file, a line if its torn end was dropped
    torn = [run_dir.truncate_metrics(done), tracking.truncate_samples(run_dir.path, done)]
    log = runlog.Logger(run_dir, progress=cfg.progress)
    # the run's first lines: a checkpoint skipped and why, or used unverified; a file's torn end
    # dropped
    for note in ckpt_notes + [line for line in torn if line]:
        log.info(note)
    # a run that stopped before its first checkpoint, started again with another config
    if run_dir.replaced:
        log.info(run_dir.replaced)
    if run_dir.precision_changed:
        log.info(run_dir.precision_changed)
    tracker = tracking.Tracker(cfg.report_to, run_dir.path,
                               {**to_dict(cfg), "policy": policy_path, "out": run_dir.path},
                               os.path.basename(os.path.normpath(run_dir.path)), resume_step=done)
    return run_dir, ckpt, log, tracker


def kl_controller(cfg: PPOConfig):
    """The KL coefficient beta: adaptive towards cfg.kl_target (Ziegler et al. 2019), or fixed at
    cfg.kl_coef."""
    return (algo.AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)
            if cfg.kl_target > 0 else algo.FixedKLController(cfg.kl_coef))


def log_first_lines(s: Setup, step: Step, world, precision):
    """What a new run says first, to s.log: the policy and where it runs, its teacher, its
    precision, its loss paths, its prompts."""
    log, cfg, device, run_dir = s.log, step.cfg, step.device, s.run_dir
    policy, teacher, policy_path = s.models.policy, s.models.teacher, s.policy_path
    train_rows, held_out = s.train_rows, s.held_out
    log.info(
        f"policy {policy_path} ({policy.num_parameters() / 1e6:.2f}M params), {world} process(es) "
        f"on {device}, run dir {run_dir.path}")
    if teacher is not None:
        trains_on = (
            "the distillation advantage + the task reward's" if cfg.distill_with_reward
            else "the distillation advantage alone; the task reward is logged, not trained on")
        log.info(
            f"teacher {cfg.teacher} ({teacher.num_parameters() / 1e6:.2f}M params): on-policy "
            f"distillation, distill_coef={cfg.distill_coef}, {trains_on}")
    log.info(f"precision: {precision_line(precision)}")
    log.info(f"loss paths: {loss_paths(cfg, device)}")
    # the split of a prompts file is not obvious: a small file holds out half of itself
    if cfg.prompts_file:
        where = (f"from {cfg.eval_prompts_file}" if cfg.eval_prompts_file
                 else "(the file's last rows, at most half)")
        log.info(
            f"prompts: {len(train_rows)} training rows from {cfg.prompts_file}, {len(held_out)} "
            f"held out {where}")


def log_rollout_lines(log, cfg: PPOConfig, run_dir, replay, longest_prompt):
    """A new run's line on recorded rollouts: where they go and their size per iteration, computed
    from the shapes (save_rollouts); or what is replayed and whether it is off-policy for this run
    (replay_rollouts)."""
    if cfg.save_rollouts:
        rows = rollout_rows(cfg)
        per_iteration = recording.tensor_bytes_bound(rows, longest_prompt, cfg.max_new_tokens,
                                                     records_decode_logprobs(cfg),
                                                     bool(cfg.environment))
        size = recording.size_text
        log.info(
            f"rollouts: recording each iteration's to {recording.folder(run_dir.path)}: about "
            f"{size(per_iteration)} an iteration, {size(per_iteration * cfg.iterations)} for "
            f"{cfg.iterations} (tensors, computed from the shapes: {rows} rows x {longest_prompt} "
            f"prompt tokens (the longest held-out or training prompt) + {cfg.max_new_tokens} "
            "response tokens), + the prompt rows and texts as JSON")
    if replay is not None:
        differ = recording.config_differences(replay, cfg)
        what = (
            "the config is the recording's: its weights are reproduced bit for bit (same machine "
            "and precision)"
            if not differ else
            f"the config differs from the recording's in {', '.join(differ[:8])}: from iteration 2 "
            "on the recorded rollouts are off-policy for this run (off_policy/behav_gap_mean, "
            "_max: its log-probs against the recorded sampler's)")
        log.info(
            f"rollouts: replaying the {replay.steps} iterations recorded in {replay.path} (nothing "
            f"is sampled); {what}")
