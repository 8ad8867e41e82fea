"""The update's first minibatch takes its old log-probs from its own forward (update.fresh_first_minibatch): the
scoring pass skips the policy over those rows, and the update, before its first step, is the policy that scored them.
Checked against the run that scores every row (float64, tiny models, padded and packed, fused and reference heads):
the same gradients, statistics and filled-in log-probs to float64 rounding; the permutation predicted without
drawing from the stream; None wherever the old log-probs are read before the update; and the default job, end to
end, byte for byte the same weights and metrics as with every row scored."""
import json

import pytest
import torch

from ppo_core import train
from ppo_core.config import build_config
from ppo_core.update import compute_advantages, fresh_first_minibatch, ppo_update
from ppo_core.rollout import rollout_forward
from ppo_core.run.start import Models, Step

from test_packed_update import B, models, sampled_batch

MINIBATCH = 4  # of B = 8 rows: the first minibatch is half the rollout


def config(packed, fused=True, **overrides):
    values = {"rollout_batch_size": str(B // 2), "n_samples_per_prompt": "2", "minibatch_size": str(MINIBATCH),
              "max_new_tokens": "9", "ppo_epochs": "2", "fused_kernels": str(fused).lower(), "entropy_coef": "0",
              "kl_in_reward": "false",
              **{k: str(v) for k, v in overrides.items()}}
    values["micro_batch_tokens" if packed else "micro_batch_size"] = "24" if packed else "2"
    return build_config({}, values)


def test_the_prediction_is_the_updates_first_minibatch_and_leaves_the_stream_alone():
    cfg = config(packed=False)
    gen = torch.Generator().manual_seed(11)
    fresh = fresh_first_minibatch(cfg, B, gen)
    assert torch.equal(fresh, torch.randperm(B, generator=torch.Generator().manual_seed(11))[:MINIBATCH])
    assert torch.equal(torch.randperm(B, generator=gen), torch.randperm(B, generator=torch.Generator().manual_seed(11)))


@pytest.mark.parametrize("overrides", [{"kl_in_reward": "true"}, {"off_policy_correction": "tis"},
                                       {"old_logprobs_from_rollout": "true"}, {"save_rollouts": "true"}, "warm-up"])
def test_none_where_the_old_logprobs_are_read_before_the_update_or_come_from_elsewhere(overrides):
    cfg = config(packed=False, **({} if overrides == "warm-up" else overrides))
    train_policy = overrides != "warm-up"  # a critic warm-up iteration runs no policy forward
    assert fresh_first_minibatch(cfg, B, torch.Generator().manual_seed(0), train_policy) is None


def test_none_with_a_teacher(tmp_path):  # distillation's advantages read log pi_old before the update
    cfg = config(packed=False)
    cfg.teacher = str(tmp_path)
    assert fresh_first_minibatch(cfg, B, torch.Generator().manual_seed(0)) is None


class RowsSeen:
    """The token positions a model's forwards run over (padded rows whole, packed rows their real tokens)."""

    def __init__(self, model):
        self.tokens = 0
        self.handle = model.register_forward_hook(self)

    def __call__(self, module, args, out):
        self.tokens += args[0].numel()


def run_update(cfg, fresh, models_):
    """Score the rollout (fresh: the update's first minibatch left to the update), then ppo_update with a step_fn that
    records each step's gradients and steps nothing. -> (rollout, stats, [gradients of each step], policy rows seen
    by scoring, reference rows seen by scoring)."""
    policy, reference, _ = models_
    shuffle = torch.Generator().manual_seed(3)
    fresh_rows = fresh_first_minibatch(cfg, B, shuffle) if fresh else None
    seen_policy, seen_reference = RowsSeen(policy), RowsSeen(reference)
    rollout = rollout_forward(Models(policy, reference), sampled_batch(), torch.arange(B) // 2, Step(cfg),
                              fresh_rows=fresh_rows)
    scored = (seen_policy.tokens, seen_reference.tokens)
    seen_policy.handle.remove()
    seen_reference.handle.remove()
    compute_advantages(rollout, cfg, 0.05, torch.ones(B, dtype=torch.bool))
    grads = []

    def step_fn(train_policy=True):
        grads.append({n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None})
        policy.zero_grad(set_to_none=True)
        return {"policy/grad_norm": 0.0}

    stats = ppo_update(policy, None, rollout, Step(cfg, shuffle), 0.05, step_fn)
    return rollout, stats, grads, scored


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "reference-head"])
def test_fresh_first_minibatch_equals_scoring_every_row(packed, fused):
    models_ = models()
    cfg = config(packed, fused)
    full, full_stats, full_grads, full_seen = run_update(cfg, False, models_)
    fresh, fresh_stats, fresh_grads, fresh_seen = run_update(cfg, True, models_)
    # the scoring pass ran the policy over the other rows only; the reference over every row, as before
    assert fresh_seen[1] == full_seen[1]
    assert 0 < fresh_seen[0] < full_seen[0]
    # the update filled in what scoring left: log pi_old and the entropy of the first minibatch's rows
    for name in ("old_logprobs", "entropy"):
        a, b = getattr(full, name), getattr(fresh, name)
        assert torch.equal(a == 0, b == 0), name
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12, msg=name)
    # 2 epochs x 2 minibatches: every step's gradient, and the statistics, as with every row scored. The rollout keeps
    # log-probs in float32, so the scored run's first ratio is 1 to a float32 rounding of log pi_old (2^-24 |log p|,
    # ~2e-7 here), the fresh run's exactly 1 (the forward's float64 log-probs): the gradients agree to that much.
    dev = full_stats["policy/first_ratio_max_dev"]
    assert 0 < dev < 2.0 ** -24 * 16 and fresh_stats["policy/first_ratio_max_dev"] == 0.0
    assert len(fresh_grads) == len(full_grads) == 4
    for step, (g_full, g_fresh) in enumerate(zip(full_grads, fresh_grads)):
        assert g_full.keys() == g_fresh.keys()
        for n in g_full:
            scale = g_full[n].abs().max().item()
            torch.testing.assert_close(g_fresh[n], g_full[n], rtol=0, atol=2 * dev * scale, msg=f"step {step} {n}")
    assert fresh_stats.keys() == full_stats.keys()
    for k in full_stats.keys() - {"policy/first_ratio_max_dev"}:
        assert fresh_stats[k] == pytest.approx(full_stats[k], rel=2 * dev, abs=1e-13), k


def test_a_wrong_prediction_is_refused():
    models_ = models()
    cfg = config(packed=False)
    policy, reference, _ = models_
    rollout = rollout_forward(Models(policy, reference), sampled_batch(), torch.arange(B) // 2, Step(cfg),
                              fresh_rows=torch.tensor([0, 1, 2, 3]))
    compute_advantages(rollout, cfg, 0.05, torch.ones(B, dtype=torch.bool))
    order = torch.randperm(B, generator=torch.Generator().manual_seed(3))
    assert set(order[:MINIBATCH].tolist()) != {0, 1, 2, 3}  # (this seed's first minibatch is another)
    with pytest.raises(RuntimeError, match="first minibatch"):
        ppo_update(policy, None, rollout, Step(cfg, torch.Generator().manual_seed(3)), 0.05,
                   lambda train_policy=True: {})


def test_the_default_job_with_the_kl_in_the_loss_is_the_same_bits_as_scoring_every_row(tmp_path, monkeypatch):
    """3 iterations of the default job with the KL as a loss term (minibatch 32 of 64 rows): the same weights byte for
    byte and the same metrics (but the clocks) as the run whose scoring pass computes every row's old log-probs."""
    args = ["--iterations", "3", "--eval_size", "8", "--save_every", "3", "--kl_in_reward", "false"]
    predicted, predict = [], train.fresh_first_minibatch
    monkeypatch.setattr(train, "fresh_first_minibatch", lambda *a, **k: predicted.append(predict(*a, **k)) or predicted[-1])
    train.main(args + ["--out", str(tmp_path / "fresh")])
    assert [len(rows) for rows in predicted] == [32] * 3  # the fresh path ran: half of each 64-row rollout
    monkeypatch.setattr(train, "fresh_first_minibatch", lambda *a, **k: None)
    train.main(args + ["--out", str(tmp_path / "full")])
    runs = [tmp_path / "fresh", tmp_path / "full"]
    weights = [(r / "checkpoints" / "step-3" / "model.safetensors").read_bytes() for r in runs]
    assert weights[0] == weights[1]
    fresh, full = ([json.loads(line) for line in (r / "metrics.jsonl").read_text().splitlines()] for r in runs)
    drop = ("time/", "tokens_per_s", "perf/")
    for a, b in zip(fresh, full):
        assert {k: v for k, v in a.items() if not k.startswith(drop)} == {
            k: v for k, v in b.items() if not k.startswith(drop)}
