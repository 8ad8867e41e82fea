"""On-policy distillation (config teacher): algo.distillation_advantages against a hand-worked case and a float64
plain loop; the teacher refused in one line naming the key (no directory, another tokenizer, another vocabulary
size); the teacher pass computed exactly as the reference pass (the same checkpoint gives the same bits, padded and
packed, fused and not, float32 and bf16 autocast) and wired into the advantages; and ppo-train --teacher, which
drives the reverse KL to a teacher trained by the default job down and resumes after a kill as if never stopped."""
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

import background
from ppo_core import algo, train
from ppo_core.config import ConfigError, build_config, uses_critic
from ppo_core.models.tokenizer import load_tokenizer
from ppo_core.rollout import Sampled, rollout_forward
from ppo_core.update import compute_advantages
from ppo_core.run.start import Models, Step
from random_weights import randomize

DEMO = train.DEMO_CHECKPOINT  # the reverse task's SFT checkpoint: vocabulary 29, context 64
FLOAT32_U = 2.0 ** -24  # float32's unit roundoff


# ---------------------------------------------------------------------------- the math

def test_distillation_advantages_hand_worked():
    """A_t = -coef * (log pi(y_t) - log pi_teacher(y_t)) on real tokens, 0 elsewhere (a hole, a fully masked row,
    even where the teacher's log-prob is -inf); no discounting: each token keeps its own term."""
    logp = torch.tensor([[-1.0, -0.5, -2.0], [-0.25, -3.0, 0.0], [-1.0, -1.0, -1.0]])
    teacher = torch.tensor([[-0.5, -1.5, -2.0], [-1.0, -1.0, -4.0], [-float("inf"), -2.0, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    got = algo.distillation_advantages(logp, teacher, mask, coef=2.0)
    # row 0: -2 (-1 + 0.5) = 1, -2 (-0.5 + 1.5) = -2 (the student likes y_1 more than the teacher: pushed down)
    # row 1: -2 (-0.25 + 1) = -1.5, hole, -2 (0 + 4) = -8;  row 2: nothing
    want = torch.tensor([[1.0, -2.0, 0.0], [-1.5, 0.0, -8.0], [0.0, 0.0, 0.0]])
    assert torch.equal(got, want) and got.dtype == torch.float32
    assert torch.equal(algo.distillation_advantages(logp, teacher, mask), want / 2)  # coef defaults to 1


def test_distillation_advantages_against_a_float64_plain_loop():
    """Random log-probs with holes and empty rows: float64 inputs give the loop's bits; float32 inputs are within
    float32's rounding of the float64 result (one subtraction, coef rounded to float32, one product: 3 u)."""
    g = torch.Generator().manual_seed(0)
    B, T, coef = 7, 11, 0.7
    logp64 = torch.log_softmax(torch.randn(B, T, 29, generator=g, dtype=torch.float64), -1)[..., 3]
    teacher64 = torch.log_softmax(3 * torch.randn(B, T, 29, generator=g, dtype=torch.float64), -1)[..., 3]
    mask = (torch.rand(B, T, generator=g) < 0.7).float()
    mask[2] = 0.0  # a row with no token
    want = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            if mask[b, t] > 0:
                want[b, t] = -coef * (logp64[b, t].item() - teacher64[b, t].item())
    assert torch.equal(algo.distillation_advantages(logp64, teacher64, mask.double(), coef), want)
    got32 = algo.distillation_advantages(logp64.float(), teacher64.float(), mask, coef)
    # the float32 inputs are themselves rounded: compare with the float64 result on those inputs
    want32 = torch.where(mask > 0, -coef * (logp64.float().double() - teacher64.float().double()), 0.0)
    assert got32.dtype == torch.float32 and torch.equal(got32 == 0, want32 == 0)
    assert ((got32.double() - want32).abs() <= 3 * FLOAT32_U * want32.abs()).all()


# ---------------------------------------------------------------------------- the config

def test_the_distillation_keys_are_checked_and_drop_the_critic():
    assert build_config({}, {"teacher": "~/t"}).teacher == os.path.expanduser("~/t")
    with pytest.raises(ConfigError, match="^config key 'distill_coef' has no effect with teacher=''"):
        build_config({}, {"distill_coef": "2"})
    with pytest.raises(ConfigError, match="^config key 'distill_coef' must be a finite number > 0, got 0.0$"):
        build_config({}, {"teacher": "t", "distill_coef": "0"})
    # distillation alone reads neither the estimator nor the reward's shaping, and builds no critic
    with pytest.raises(ConfigError, match="^config key 'adv_estimator' has no effect with distill_with_reward=False"):
        build_config({}, {"teacher": "t", "adv_estimator": "grpo", "n_samples_per_prompt": "4"})
    with pytest.raises(ConfigError, match="^config key 'kl_coef' has no effect with distill_with_reward=False"):
        build_config({}, {"teacher": "t", "kl_coef": "0.1"})
    assert not uses_critic(build_config({}, {"teacher": "t"}))
    assert build_config({}, {"teacher": "t", "kl_in_reward": "false", "kl_coef": "0.1"}).kl_coef == 0.1  # a loss term
    assert uses_critic(build_config({}, {"teacher": "t", "distill_with_reward": "true"}))
    assert not uses_critic(build_config({}, {"teacher": "t", "distill_with_reward": "true", "adv_estimator": "grpo",
                                             "n_samples_per_prompt": "4"}))


def copy_of_demo(tmp_path, name):
    path = tmp_path / name
    shutil.copytree(DEMO, path)
    return path


def refused(argv, tmp_path, capsys):
    """ppo-train's exit status 2 and its one line, with the run directory never made."""
    out = tmp_path / "run"
    assert train.main([*argv, f"--out={out}", "--progress=false"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and not out.exists(), err
    return err.strip()


def test_a_teacher_that_cannot_score_the_policys_tokens_is_refused_in_one_line(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    assert refused([f"--teacher={missing}"], tmp_path, capsys) == (
        f"ppo-train: error: config key 'teacher': no such checkpoint directory: '{missing}'")

    other = copy_of_demo(tmp_path, "other-tokenizer")  # 'a' and 'b' trade ids: the same words, other token ids
    tok = json.loads((other / "tokenizer.json").read_text())
    tok["model"]["vocab"]["a"], tok["model"]["vocab"]["b"] = 4, 3
    (other / "tokenizer.json").write_text(json.dumps(tok))
    assert load_tokenizer(other).vocab_size == load_tokenizer(DEMO).vocab_size  # same size, other mapping
    assert refused([f"--teacher={other}"], tmp_path, capsys) == (
        f"ppo-train: error: config key 'teacher': the tokenizer of {other} differs from the policy's ({DEMO}): "
        f"token 'a' is id 4 in the teacher's, id 3 in the policy's; a teacher must share the policy's tokenizer")

    wider = copy_of_demo(tmp_path, "wider-vocab")  # the same tokenizer, an LM head of 32 rows
    config = json.loads((wider / "config.json").read_text())
    (wider / "config.json").write_text(json.dumps({**config, "vocab_size": 32}))
    assert refused([f"--teacher={wider}"], tmp_path, capsys) == (
        f"ppo-train: error: config key 'teacher': {wider} has a vocabulary of 32 tokens, the policy 29; a teacher's "
        f"log-probs must be over the policy's vocabulary")


# ---------------------------------------------------------------------------- the teacher pass

B, P, R = 8, 5, 9
RESPONSE_LENS = [9, 2, 5, 1, 7, 3, 9, 4]
PROMPT_LENS = [5, 3, 4, 5, 2, 5, 1, 4]  # left-padded to P


def sampled_batch():
    """B prompts left-padded to P, responses right-padded to R, random tokens of the demo's vocabulary."""
    g = torch.Generator().manual_seed(0)
    prompt_ids, tokens = torch.randint(2, 29, (B, P), generator=g), torch.randint(2, 29, (B, R), generator=g)
    prompt_mask = torch.arange(P)[None] >= (P - torch.tensor(PROMPT_LENS))[:, None]  # [B, P]
    response_mask = (torch.arange(R)[None] < torch.tensor(RESPONSE_LENS)[:, None]).float()  # [B, R]
    prompt_ids, tokens = prompt_ids.masked_fill(~prompt_mask, 0), tokens.masked_fill(response_mask == 0, 0)
    return Sampled([{"prompt": "p"}] * B, ["p"] * B, ["r"] * B, prompt_ids, prompt_mask, tokens, response_mask,
                   torch.ones(B, dtype=torch.bool), torch.rand(B, generator=g), {})


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "reference-head"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_teacher_pass_is_the_reference_pass(packed, fused, bf16):
    """teacher = reference = the demo checkpoint, each loaded by the trainer (build_models, build_teacher), the policy
    another model: the teacher's log-probs are the reference's bit for bit, and the advantages are the distillation
    term -(log pi_old - log pi_teacher) alone, or the estimator's plus it with distill_with_reward."""
    sizes = {"micro_batch_tokens": "24"} if packed else {"micro_batch_size": "2"}
    cfg = build_config({}, {"teacher": DEMO, "reference": DEMO, "rollout_batch_size": str(B // 2),
                            "n_samples_per_prompt": "2", "minibatch_size": str(B), "max_new_tokens": str(R),
                            "fused_kernels": str(fused).lower(), **sizes})
    cpu = torch.device("cpu")
    policy, critic, reference = train.build_models(cfg, DEMO, load_tokenizer(DEMO), cpu, torch.float32)
    teacher = train.build_teacher(cfg, cpu, torch.float32)
    assert critic is None and teacher is not reference and reference is not policy
    randomize(policy, seed=0)  # a student other than the teacher
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    rollout = rollout_forward(Models(policy, reference, teacher=teacher), sampled_batch(), torch.arange(B) // 2,
                              Step(cfg, autocast=autocast))
    mask = rollout.response_mask
    assert rollout.teacher_logprobs.shape == (B, R) and rollout.teacher_logprobs.dtype == torch.float32
    assert torch.equal(rollout.teacher_logprobs, rollout.ref_logprobs)
    assert (rollout.teacher_logprobs[mask > 0] < 0).all() and (rollout.teacher_logprobs[mask == 0] == 0).all()
    assert (rollout.old_logprobs != rollout.teacher_logprobs)[mask > 0].all()

    compute_advantages(rollout, cfg, 0.05, torch.ones(B, dtype=torch.bool))  # distillation alone
    distill = -(rollout.old_logprobs.double() - rollout.teacher_logprobs.double()) * mask
    assert torch.equal(rollout.advantages == 0, mask == 0)
    assert ((rollout.advantages.double() - distill).abs() <= FLOAT32_U * distill.abs()).all()  # one rounding
    distill = rollout.advantages.clone()

    estimator = dict(adv_estimator="grpo", whiten_rewards="true")  # any estimator: its advantages, then + distill
    compute_advantages(rollout, build_config({}, {**estimator, "n_samples_per_prompt": "2"}), 0.05, rollout.sampled.ended)
    plain = rollout.advantages.clone()
    both = build_config({}, {"teacher": DEMO, "distill_with_reward": "true", **estimator, "n_samples_per_prompt": "2"})
    compute_advantages(rollout, both, 0.05, rollout.sampled.ended)
    assert torch.equal(rollout.advantages, plain + distill) and plain.abs().sum() > 0


def test_no_teacher_no_teacher_pass():
    cfg = build_config({}, {"rollout_batch_size": str(B), "minibatch_size": str(B), "micro_batch_size": str(B),
                            "max_new_tokens": str(R)})
    model = train.load_model(DEMO)
    rollout = rollout_forward(Models(model, model), sampled_batch(), torch.arange(B), Step(cfg))
    assert rollout.teacher_logprobs is None


# ---------------------------------------------------------------------------- ppo-train --teacher

def teacher_run_command():
    """The default job, 20 iterations: a teacher that knows the task better than the demo checkpoint it starts from."""
    d = background.directory("distill-teacher")
    return "distill-teacher", [sys.executable, "-m", "ppo_core.train", "--iterations=20", "--progress=false",
                               f"--out={d}/run"], d


BACKGROUND = {"teacher_checkpoint": lambda: background.start(*teacher_run_command())}  # started as the suite begins


@pytest.fixture(scope="module")
def teacher_checkpoint():
    key, cmd, cwd = teacher_run_command()
    proc = background.result(key, cmd, cwd)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return os.path.join(cwd, "run", "checkpoints", "step-20")


def metrics_of(run_dir, wall_clock=True):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return rows if wall_clock else [{k: v for k, v in r.items() if not k.startswith(("time/", "tokens_per_s"))}
                                    for r in rows]


def test_ppo_train_with_a_teacher_drives_the_reverse_kl_down(teacher_checkpoint, tmp_path):
    """The base demo checkpoint distilled from the default job's 20-iteration checkpoint, 6 iterations, no reward
    trained on: the reverse KL to the teacher falls, the held-out reward rises with it, and no critic is built."""
    out = tmp_path / "student"
    proc = subprocess.run([sys.executable, "-m", "ppo_core.train", f"--teacher={teacher_checkpoint}", "--iterations=6",
                           "--eval_size=64", "--progress=false", f"--out={out}"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"teacher {teacher_checkpoint} (0.19M params): on-policy distillation" in proc.stderr
    rows = metrics_of(out)
    kl = [r["distill/reverse_kl"] for r in rows]
    assert kl[-1] < kl[0] / 2 and kl[0] > 0.1, kl  # measured: 0.65 -> 0.14
    for r in rows:  # the advantages are -(log pi_old - log pi_teacher) alone: their mean is minus the metric
        assert r["advantages/mean"] == -r["distill/reverse_kl"]
        assert not any(k.startswith("value/") for k in r)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval/greedy_reward_after"] > summary["eval/greedy_reward_before"], summary
    assert not (out / "checkpoints" / "step-6" / "critic").exists()


# the trainer, killed (SIGKILL) in the n-th compute_advantages call: iteration n, after iteration n-1's checkpoint
KILLED_IN_ITERATION = r'''
import os, signal, sys
import ppo_core.train as train
real, calls = train.compute_advantages, [0]
def compute_advantages(*a, **k):
    calls[0] += 1
    if calls[0] == int(sys.argv[1]):
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*a, **k)
train.compute_advantages = compute_advantages
sys.exit(train.main(sys.argv[2:]))
'''


def test_a_distillation_run_killed_and_resumed_is_the_run_that_never_stopped(teacher_checkpoint, tmp_path):
    args = ["--iterations=3", "--save_every=1", "--eval_size=8", "--rollout_batch_size=16", "--minibatch_size=8",
            "--micro_batch_size=8", "--ppo_epochs=1", "--progress=false", "--dtype=float32",
            f"--teacher={teacher_checkpoint}"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    done, died = background.together(([sys.executable, "-m", "ppo_core.train", *args, f"--out={whole}"], tmp_path),
                                      ([sys.executable, "-c", KILLED_IN_ITERATION, "2", *args, f"--out={killed}"],
                                       tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    assert died.returncode == -signal.SIGKILL, died.stderr[-2000:]
    resumed = subprocess.run([sys.executable, "-m", "ppo_core.train", "--resume", str(killed), "--progress=false"],
                             capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert resumed.returncode == 0 and "resuming" in resumed.stderr, resumed.stderr[-2000:]
    assert metrics_of(killed, wall_clock=False) == metrics_of(whole, wall_clock=False)
    assert all("distill/reverse_kl" in r for r in metrics_of(whole))
    weights = "checkpoints/step-3/model.safetensors"
    assert (killed / weights).read_bytes() == (whole / weights).read_bytes()
