"""The estimators and loss knobs as the training loop wires them (ppo_core/update.py, rollout.py): advantages of each
`adv_estimator` on a hand-built rollout against plain Python loops, the penalties on raw scores, the LR schedule's
end, prompts' BOS, and real `ppo-train` runs: critic-free checkpoints, resume, target_kl, critic warm-up, DAPO's
dynamic sampling, GSPO and the entropy bonus (fused and plain paths agree)."""
import json
import math
import os
import signal
import statistics
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import ppo_core.train as train
from ppo_core import algo
from ppo_core.config import build_config
from ppo_core.models.model import load_model
from ppo_core.models.precision import loss_paths
from ppo_core.rewards.source import make_reward_source
from ppo_core.heads import response_logprobs
from ppo_core.rollout import Rollout, iteration_rollout, prompt_token_ids, sample_responses
from ppo_core.data.tasks import PromptStream, eval_prompts, reverse_reward
from ppo_core.models.tokenizer import load_tokenizer
from ppo_core.update import MicroBatch, compute_advantages, lr_at, policy_objective
from ppo_core.run.start import Models, Step

from test_resume import DRIVER
from test_tokenizer import write_word_level

SMALL = ["--eval_size=8", "--rollout_batch_size=4", "--n_samples_per_prompt=4", "--minibatch_size=8",
         "--micro_batch_size=8", "--ppo_epochs=1", "--progress=false", "--max_new_tokens=8"]
WALL_CLOCK = ("time/", "tokens_per_s")


def ppo_train(*args, cwd):
    proc = subprocess.run([sys.executable, "-m", "ppo_core.train", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


# ---------------------------------------------------------------------------- the LR schedule

def test_lr_schedule_reaches_min_lr_ratio_at_the_last_step():
    cfg = build_config({}, {"warmup_steps": "2", "min_lr_ratio": "0.1"})
    got = [lr_at(step, 6, cfg) for step in range(6)]
    # warm-up (step + 1) / 2, then 0.1 + 0.9 * (1 + cos(pi * k / 4)) / 2 for k = 1..4 (hand-worked)
    want = [0.5, 1.0, 0.1 + 0.45 * (1 + math.sqrt(0.5)), 0.55, 0.1 + 0.45 * (1 - math.sqrt(0.5)), 0.1]
    assert got == pytest.approx(want, abs=1e-12)


# ---------------------------------------------------------------------------- advantages per estimator

def hand_rollout():
    """4 responses to 2 prompts (rows 0, 1 and rows 2, 3), up to 3 tokens; row 1 has 2 tokens, row 3 one."""
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.float32)
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.1, 0.0], [-2.0, -0.2, -0.7], [-0.9, 0.0, 0.0]])
    ref = torch.tensor([[-1.2, -1.5, -0.5], [-0.4, -1.0, 0.0], [-1.8, -0.6, -0.9], [-1.4, 0.0, 0.0]])
    scores = torch.tensor([1.0, 0.25, 0.5, 0.0])
    ended = torch.tensor([True, False, True, True])
    B, R = mask.shape
    ids = torch.zeros(B, 2 + R, dtype=torch.long)
    rollout = Rollout(["a", "a", "b", "b"], ["", "", "", ""], ids, ids.bool(), mask, 2, old * mask, ref * mask,
                            torch.zeros(B, R), torch.zeros(B, R), scores, torch.tensor([0, 0, 1, 1]))
    return rollout, ended


def python_token_rewards(rollout, scores, kl_coef):
    """r_t = -beta (old - ref) on real tokens, + the score on the last real token: lists of lists."""
    rows = []
    for i in range(len(scores)):
        n = int(rollout.response_mask[i].sum())
        r = [-kl_coef * (float(rollout.old_logprobs[i, t]) - float(rollout.ref_logprobs[i, t])) for t in range(n)]
        r[-1] += scores[i]
        rows.append(r)
    return rows


def python_whiten(rows):
    """(x - mean) / sqrt(var + 1e-8) over every real token, unbiased variance."""
    flat = [x for row in rows for x in row]
    mean, var = statistics.fmean(flat), statistics.variance(flat)
    return [[(x - mean) / math.sqrt(var + 1e-8) for x in row] for row in rows]


def python_advantages(kind, rows):
    """Plain loops over the two groups {0, 1} and {2, 3} of `rows` (per-token rewards)."""
    totals = [sum(row) for row in rows]
    groups = [[0, 1], [2, 3]]
    per_row = [0.0] * 4
    for g in groups:
        s = [totals[i] for i in g]
        mean, std = statistics.fmean(s), statistics.stdev(s)
        for i in g:
            if kind == "grpo":
                per_row[i] = (totals[i] - mean) / (std + 1e-6)
            elif kind in ("dr_grpo", "reinforce_pp_baseline"):
                per_row[i] = totals[i] - mean
            elif kind == "rloo":
                others = [totals[j] for j in g if j != i]
                per_row[i] = totals[i] - statistics.fmean(others)
    advantages = [[per_row[i]] * len(rows[i]) for i in range(4)]
    if kind == "reinforce_pp_baseline":
        advantages = python_whiten(advantages)
    return advantages


def python_discounted(rows, gamma):
    out = []
    for row in rows:
        g, returns = 0.0, []
        for r in reversed(row):
            g = r + gamma * g
            returns.append(g)
        out.append(returns[::-1])
    return out


def as_rows(tensor, mask):
    return [[float(tensor[i, t]) for t in range(int(mask[i].sum()))] for i in range(tensor.shape[0])]


def flat(rows):
    return [x for row in rows for x in row]


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "reinforce_pp"])
def test_compute_advantages_of_each_estimator_is_the_plain_loop(kind):
    rollout, ended = hand_rollout()
    n = "1" if kind == "reinforce_pp" else "2"
    cfg = build_config({}, {"adv_estimator": kind, "n_samples_per_prompt": n, "gamma": "0.9", "rollout_batch_size": "4",
                            "minibatch_size": "4", "micro_batch_size": "4"})
    compute_advantages(rollout, cfg, 0.1, ended)
    rows = python_token_rewards(rollout, [1.0, 0.25, 0.5, 0.0], 0.1)
    assert flat(as_rows(rollout.rewards, rollout.response_mask)) == pytest.approx(flat(rows), abs=1e-6)
    returns = python_discounted(rows, 0.9)
    want = python_whiten(returns) if kind == "reinforce_pp" else python_advantages(kind, rows)
    assert flat(as_rows(rollout.advantages, rollout.response_mask)) == pytest.approx(flat(want), abs=1e-5)
    assert flat(as_rows(rollout.returns, rollout.response_mask)) == pytest.approx(flat(returns), abs=1e-6)
    assert (rollout.advantages[rollout.response_mask == 0] == 0).all()


@pytest.mark.parametrize("kind", ["k2", "k3"])
def test_kl_reward_kind_picks_the_estimator_in_the_reward(kind):
    rollout, ended = hand_rollout()
    cfg = build_config({}, {"kl_reward_kind": kind, "rollout_batch_size": "4", "minibatch_size": "4", "micro_batch_size": "4"})
    compute_advantages(rollout, cfg, 0.1, ended)
    want = []
    for i, score in enumerate([1.0, 0.25, 0.5, 0.0]):
        n = int(rollout.response_mask[i].sum())
        for t in range(n):
            d = float(rollout.old_logprobs[i, t]) - float(rollout.ref_logprobs[i, t])  # log pi - log ref
            kl = 0.5 * d * d if kind == "k2" else math.exp(-d) + d - 1  # k3 = e^(ref - pi) - (ref - pi) - 1
            want.append(-0.1 * kl + (score if t == n - 1 else 0.0))
    assert flat(as_rows(rollout.rewards, rollout.response_mask)) == pytest.approx(want, abs=1e-6)


def test_penalties_apply_to_raw_scores_before_whitening_and_clipping():
    rollout, ended = hand_rollout()
    cfg = build_config({}, {"missing_eos_penalty": "2.0", "whiten_rewards": "true", "reward_clip": "1.0",
                            "overlong_buffer": "2", "overlong_penalty": "0.5", "max_new_tokens": "3",
                            "rollout_batch_size": "4", "minibatch_size": "4", "micro_batch_size": "4"})
    compute_advantages(rollout, cfg, 0.0, ended)
    # raw scores 1, 0.25, 0.5, 0; row 1 has no EOS: -2; lengths 3, 2, 3, 1 with L_max 3, L_cache 2: the penalty
    # (1 - L) / 2 * 0.5 for L in (1, 3]: -0.5, -0.25, -0.5, 0
    raw = [1.0 - 0.5, 0.25 - 2.0 - 0.25, 0.5 - 0.5, 0.0]
    mean, std = statistics.fmean(raw), statistics.stdev(raw)
    want = [max(-1.0, min(1.0, (s - mean) / (std + 1e-8))) for s in raw]
    last = [2, 1, 2, 0]
    assert [float(rollout.rewards[i, last[i]]) for i in range(4)] == pytest.approx(want, abs=1e-6)


# ---------------------------------------------------------------------------- prompts

def test_prompts_get_the_bos_their_tokenizer_adds_and_no_eos(tmp_path):
    from tokenizers import processors

    bos_eos = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)])
    tok = load_tokenizer(write_word_level(tmp_path / "tok", bos_eos))
    cfg = build_config({}, {})
    assert prompt_token_ids(tok, "reverse the word banana =", cfg) == [1, 3, 4, 5, 6, 7]
    demo = load_tokenizer(train.DEMO_CHECKPOINT)  # no post-processor: the plain encoding
    assert prompt_token_ids(demo, "abc=", cfg) == demo.encode("abc=")


# ---------------------------------------------------------------------------- real runs

@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("grpo")
    args = SMALL + ["--adv_estimator=grpo", "--iterations=3", "--save_every=1"]
    ppo_train(*args, f"--out={d / 'run'}", cwd=d)
    return d, args


def test_critic_free_run_builds_trains_and_saves_no_critic(grpo_run):
    d, _ = grpo_run
    step = d / "run" / "checkpoints" / "step-3"
    assert not (step / "critic").exists()
    optimizer = load_file(str(step / "optimizer.safetensors"))
    assert optimizer and all(k.startswith("policy.") for k in optimizer)
    rows = read_metrics(d / "run")
    assert not [k for r in rows for k in r if k.startswith("value/")]
    assert all(r["train/steps"] == 2 and r["policy/grad_norm"] > 0 for r in rows)
    # 3 iterations x 2 steps, warm-up 10 > 6: the last step is still warming up, (5 + 1) / 10 of the peak
    assert rows[-1]["lr"] == pytest.approx(5e-4 * 0.6)


def test_critic_free_run_resumes_identically(grpo_run, tmp_path):
    d, args = grpo_run
    run_dir = tmp_path / "run"
    killed = subprocess.run([sys.executable, "-c", DRIVER, "rollout", "4", *args, f"--out={run_dir}"],
                            capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    ppo_train("--resume", str(run_dir), "--progress=false", cwd=tmp_path)
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(WALL_CLOCK)} for r in rows]  # noqa: E731
    assert strip(read_metrics(run_dir)) == strip(read_metrics(d / "run"))
    final = "checkpoints/step-3/model.safetensors"
    assert (run_dir / final).read_bytes() == (d / "run" / final).read_bytes()


def test_target_kl_stops_the_epoch_loop(tmp_path):
    # 2 epochs of 2 minibatches; the first step's ratio is exactly 1 on the CPU (approx KL 0, no stop), the
    # second step's approx KL is > 1e-12, so every iteration stops after 2 of its 4 steps
    ppo_train(*SMALL, "--adv_estimator=rloo", "--iterations=2", "--ppo_epochs=2", "--target_kl=1e-12",
              f"--out={tmp_path / 'run'}", cwd=tmp_path)
    rows = read_metrics(tmp_path / "run")
    assert [r["train/steps"] for r in rows] == [2, 2]
    # the schedule stays on time: iteration 2's steps are numbers 4 and 5 of 8 (warm-up 10): lr (5 + 1) / 10
    assert rows[-1]["lr"] == pytest.approx(5e-4 * 0.6)


def test_critic_warmup_trains_the_critic_alone(tmp_path):
    ppo_train("--eval_size=8", "--rollout_batch_size=8", "--minibatch_size=8", "--micro_batch_size=8",
              "--ppo_epochs=1", "--progress=false", "--iterations=2", "--critic_warmup=1", "--save_every=1",
              f"--out={tmp_path / 'run'}", cwd=tmp_path)
    demo = load_file(os.path.join(train.DEMO_CHECKPOINT, "model.safetensors"))
    step1 = load_file(str(tmp_path / "run" / "checkpoints" / "step-1" / "model.safetensors"))
    assert all(torch.equal(demo[k], step1[k]) for k in demo)  # the policy did not move
    critic1 = load_file(str(tmp_path / "run" / "checkpoints" / "step-1" / "critic" / "model.safetensors"))
    assert critic1["score.weight"].abs().sum() > 0  # the zero-initialised head did
    first, second = read_metrics(tmp_path / "run")
    assert "policy/loss" not in first and "value/loss" in first
    assert "policy/loss" in second and second["policy/first_ratio_max_dev"] == 0.0


def test_gspo_and_entropy_bonus_runs(tmp_path):
    ppo_train(*SMALL, "--adv_estimator=grpo", "--iterations=2", "--policy_loss_kind=gspo", "--clip_low=3e-4",
              "--clip_high=4e-4", "--entropy_coef=0.01", f"--out={tmp_path / 'run'}", cwd=tmp_path)
    rows = read_metrics(tmp_path / "run")
    assert all(0 <= r["policy/clipfrac"] <= 1 and r["policy/entropy"] > 0 for r in rows)
    assert rows[0]["policy/first_ratio_max_dev"] == 0.0


# ---------------------------------------------------------------------------- dynamic sampling

ODD_WORDS_SCORE_ZERO = '''
from ppo_core.data.tasks import reverse_reward
def score(prompts, responses):
    # words of odd length always score 0 (a group with no signal); the others get the reverse task's reward
    return [0.0 if len(p.rstrip("=")) % 2 else reverse_reward(p, r) for p, r in zip(prompts, responses)]
'''


def test_filter_groups_keeps_only_groups_with_varied_scores(tmp_path, monkeypatch):
    (tmp_path / "odd_zero.py").write_text(ODD_WORDS_SCORE_ZERO)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = build_config({}, {"adv_estimator": "grpo", "n_samples_per_prompt": "4", "rollout_batch_size": "4",
                            "minibatch_size": "16", "micro_batch_size": "16", "filter_groups": "true",
                            "filter_groups_max_batches": "6", "reward_fn": "odd_zero:score"})
    tok = load_tokenizer(train.DEMO_CHECKPOINT)
    policy = load_model(train.DEMO_CHECKPOINT)
    stream = PromptStream(0, eval_prompts(8, 0))
    models = Models(policy, policy, tokenizer=tok, reward_source=make_reward_source(cfg))
    rollout, ended, stats = iteration_rollout(0, stream, models, Step(cfg, torch.Generator().manual_seed(0)))
    assert rollout.input_ids.shape[0] == 16 and ended.shape == (16,)
    assert torch.equal(rollout.group, torch.arange(16) // 4)
    assert stats["filter/batches"] >= 2  # about half the words have odd length: one batch cannot fill the quota
    for g in range(4):
        rows = slice(4 * g, 4 * g + 4)
        prompts = set(rollout.prompts[rows])
        assert len(prompts) == 1 and len(next(iter(prompts)).rstrip("=")) % 2 == 0  # a group, of an even word
        assert rollout.scores[rows].max() > rollout.scores[rows].min()  # with a signal
    # the scores are the reward function's for the rows as assembled (prompts and responses kept together)
    want = [0.0 if len(p.rstrip("=")) % 2 else reverse_reward(p, r) for p, r in zip(rollout.prompts, rollout.responses)]
    assert rollout.scores.tolist() == pytest.approx(want)
    # and the log-probs are of the assembled rows: recompute row 5's alone
    lp, _ = response_logprobs(policy, rollout.input_ids[5:6], rollout.attention_mask[5:6],
                                    rollout.response_mask[5:6], rollout.prompt_len, 1.0, True)
    assert torch.allclose(lp, rollout.old_logprobs[5:6], atol=1e-6)


# ---------------------------------------------------------------------------- fused and plain objectives

@pytest.mark.parametrize("knobs", [
    {"entropy_coef": "0.05"},
    {"entropy_coef": "0.05", "kl_in_reward": "false", "kl_loss_kind": "k3", "dual_clip": "3"},
    {"policy_loss_kind": "gspo", "entropy_coef": "0.02", "clip_low": "3e-4", "clip_high": "4e-4"},
])
def test_fused_and_plain_policy_objectives_agree(knobs):
    """policy_objective's fused path (kernels) and plain path (full logits + ppo_core.algo): loss and gradients."""
    tok = load_tokenizer(train.DEMO_CHECKPOINT)
    policy = load_model(train.DEMO_CHECKPOINT)
    gen = torch.Generator().manual_seed(0)
    prompts = eval_prompts(6, 0)
    cfg0 = build_config({}, {"rollout_batch_size": "6", "minibatch_size": "6", "micro_batch_size": "6"})
    out = sample_responses(policy, tok, prompts, Step(cfg0, gen))
    prompt_ids, prompt_mask, tokens, rm = out.prompt_ids, out.prompt_mask, out.tokens, out.response_mask
    ids, am, P = torch.cat([prompt_ids, tokens], 1), torch.cat([prompt_mask, rm.bool()], 1), prompt_ids.shape[1]
    old = response_logprobs(policy, ids, am, rm, P, 1.0, False)[0].detach() - 0.05 * rm  # a ratio != 1
    ref = old + 0.1 * torch.randn(old.shape, generator=gen) * rm
    adv = torch.randn(old.shape, generator=gen) * rm
    agg = algo.Aggregation("seq-mean-token-mean", num_tokens=rm.sum(), num_seqs=torch.tensor(6.0))
    results = []
    for fused in ("true", "false"):
        cfg = build_config({}, {**knobs, "fused_kernels": fused, "rollout_batch_size": "6", "minibatch_size": "6",
                                "micro_batch_size": "6"})
        policy.zero_grad()
        batch = MicroBatch(input_ids=ids, attention_mask=am, response_mask=rm, prompt_len=P, old_logprobs=old,
                           advantages=adv, ref_logprobs=ref)
        loss, pg_loss, kl_loss, stats = policy_objective(policy, batch, cfg, 0.2, agg)
        loss.backward()
        results.append((loss.item(), pg_loss.item(), kl_loss.item(), stats["entropy"].item(),
                        {n: p.grad.clone() for n, p in policy.named_parameters()}))
    (l1, pg1, kl1, h1, g1), (l2, pg2, kl2, h2, g2) = results
    assert l1 == pytest.approx(l2, abs=1e-6) and pg1 == pytest.approx(pg2, abs=1e-6) and kl1 == pytest.approx(kl2, abs=1e-6)
    assert h1 == pytest.approx(h2, rel=1e-5)
    for name in g1:
        assert torch.allclose(g1[name], g2[name], rtol=1e-4, atol=1e-6), name


@pytest.mark.parametrize("knobs, kernels_called", [
    ({}, ["linear_logprob_loss"]),
    ({"dual_clip": "3", "entropy_coef": "0.05", "kl_in_reward": "false"}, ["linear_logprob_loss"]),
    ({"policy_loss_kind": "gspo"}, ["linear_logprob_loss"]),
    ({"fused_kernels": "false"}, []),
])
def test_the_loss_path_line_names_what_the_policy_objective_runs(monkeypatch, knobs, kernels_called):
    """The run's first lines say which code computes the policy loss (ppo_core.models.precision.loss_paths); here the real
    kernels are wrapped to record their calls in one policy_objective, and the line names exactly those (or the
    reference)."""
    import ppo_kernels

    calls = []
    for name in ("linear_logprob_loss", "linear_token_logprobs"):
        real = getattr(ppo_kernels, name)
        monkeypatch.setattr(ppo_kernels, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    cfg = build_config({}, {**knobs, "rollout_batch_size": "2", "minibatch_size": "2", "micro_batch_size": "2"})
    policy = load_model(train.DEMO_CHECKPOINT)
    ids = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 9, 8, 7]])
    am, rm = torch.ones_like(ids, dtype=torch.bool), torch.ones(2, 3)
    zeros = torch.zeros(2, 3)
    agg = algo.Aggregation("token-mean", num_tokens=rm.sum(), num_seqs=torch.tensor(2.0))
    policy_objective(policy, MicroBatch(input_ids=ids, attention_mask=am, response_mask=rm, prompt_len=2,
                                        old_logprobs=zeros, advantages=zeros + 1, ref_logprobs=zeros), cfg, 0.1, agg)
    line = loss_paths(cfg, "cpu")
    policy_part = line.split(";")[0]
    assert calls == kernels_called, calls
    if kernels_called:
        kind = cfg.policy_loss_kind
        # the terms added around the loss, as cfg adds them: the KL term in the loss, the entropy bonus
        terms = (" + the KL term" if not cfg.kl_in_reward else "") + (" - the entropy bonus" if cfg.entropy_coef else "")
        assert policy_part.startswith(f"policy loss: algo.{algo.policy_loss_function(kind).__name__}{terms}, ")
        assert f"on fused {kernels_called[0]} (chunked torch" in policy_part
    else:
        assert line.startswith("the torch reference for every head") and "fused linear" not in line
