"""The packed passes (config micro_batch_tokens) against the padded ones, in float64 on tiny models: the scoring passes'
log-probs, entropy and values, and the update's gradients, statistics and micro-batch plan for every loss_agg mode,
estimator and loss kind, on the fused and the reference heads. Packing changes only the order of floating-point sums,
so the two agree to float64 rounding."""

import pytest
import torch

from ppo_core import algo
from ppo_core.config import build_config
from ppo_core.models.model import ModelArgs, ScoreModel
from ppo_core.rollout import Sampled, rollout_forward
from ppo_core.update import Minibatch, compute_advantages, minibatch_gradients, ppo_update
from ppo_core.run.start import Models, Step

from test_generate import BASE, tiny

B, P, R = 8, 5, 9
RESPONSE_LENS = [9, 2, 5, 1, 7, 3, 9, 4]  # heavy-ish tail: several rows at the limit, most short
PROMPT_LENS = [5, 3, 4, 5, 2, 5, 1, 4]  # left-padded to P
BUDGET = 24  # tokens per packed micro-batch: several micro-batches, one row alone (5 + 9 = 14 > 24 / 2)


def sampled_batch(seed=0):
    """B prompts left-padded to P, responses right-padded to R (EOS-free; lengths as above), random tokens."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, BASE["vocab_size"], (B, P), generator=g)
    tokens = torch.randint(3, BASE["vocab_size"], (B, R), generator=g)
    prompt_mask = torch.arange(P)[None] >= (P - torch.tensor(PROMPT_LENS))[:, None]  # [B, P]
    response_mask = (torch.arange(R)[None] < torch.tensor(RESPONSE_LENS)[:, None]).float()  # [B, R]
    prompt_ids, tokens = prompt_ids.masked_fill(~prompt_mask, 0), tokens.masked_fill(response_mask == 0, 0)
    scores = torch.randn(B, generator=g)
    return Sampled([{"prompt": "p"}] * B, ["p"] * B, ["r"] * B, prompt_ids, prompt_mask, tokens, response_mask,
                   torch.ones(B, dtype=torch.bool), scores, {})


def models():
    policy, reference = tiny("qwen3", seed=0).double(), tiny("qwen3", seed=1).double()
    torch.manual_seed(2)
    critic = ScoreModel(ModelArgs.from_hf_config({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 14})).double()
    with torch.no_grad():
        for name, p in critic.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) / p.shape[-1] ** 0.5)
    return policy, reference, critic


def config(packed, **overrides):
    values = {"rollout_batch_size": str(B // 2), "n_samples_per_prompt": "2", "minibatch_size": str(B),
              "max_new_tokens": str(R), "ppo_epochs": "1", **{k: str(v) for k, v in overrides.items()}}
    if packed:
        values["micro_batch_tokens"] = str(BUDGET)
    else:
        values["micro_batch_size"] = "2"
    return build_config({}, values)


def scored(cfg, policy, reference, critic):
    sampled = sampled_batch()
    if cfg.off_policy_correction != "none":  # the sampler's log-probs (each test sets the behaviour it needs)
        sampled.decode_logprobs = torch.zeros(B, R, dtype=torch.float64)
    rollout = rollout_forward(Models(policy, reference, critic if cfg.adv_estimator == "gae" else None), sampled,
                              torch.arange(B) // 2, Step(cfg))
    compute_advantages(rollout, cfg, 0.05, sampled.ended)
    return rollout


def test_scoring_passes_packed_equal_padded_to_float64_rounding():
    policy, reference, critic = models()
    padded, packed = (scored(config(p), policy, reference, critic) for p in (False, True))
    for name in ("old_logprobs", "ref_logprobs", "entropy", "old_values", "advantages", "returns"):
        a, b = getattr(padded, name), getattr(packed, name)
        assert torch.equal(a == 0, b == 0), name  # the same tokens (none beyond a response)
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12, msg=name)


FLOAT32_ULP = 2.0 ** -23


def assert_close_grad(got, want, name):
    """float64 rounding for the policy; for the critic, one float32 rounding of its values (ScoreModel.forward returns
    float32 values: padded and packed float64 values a few ulps apart can round to neighbouring float32 values)."""
    scale = max(want.abs().max().item(), 1.0)
    tol = (FLOAT32_ULP if name.startswith("critic.") else 1e-12) * scale
    torch.testing.assert_close(got, want, rtol=0, atol=tol, msg=name)


def gradients(cfg, policy, critic, rollout, chunks, n_micro):
    for m in (policy, critic):
        m.zero_grad(set_to_none=True)
    use_critic = critic if cfg.adv_estimator == "gae" else None
    sums, counts, devs = minibatch_gradients(policy, use_critic, rollout, Minibatch(chunks, n_micro), Step(cfg),
                                             0.05)
    grads = {f"policy.{n}": p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    if use_critic is not None:
        grads.update({f"critic.{n}": p.grad.clone() for n, p in critic.named_parameters() if p.grad is not None})
    return grads, sums, counts, devs


VARIANTS = [dict(loss_agg=agg) for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                           "seq-mean-token-sum-norm")] + [
    dict(adv_estimator="grpo"),
    dict(adv_estimator="rloo", kl_in_reward="false", kl_loss_kind="k3", loss_agg="seq-mean-token-mean"),
    dict(entropy_coef=0.01, dual_clip=3.0),
    dict(adv_estimator="grpo", policy_loss_kind="gspo", clip_low=3e-4, clip_high=4e-4),
]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()))
def test_update_gradients_packed_equal_padded_to_float64_rounding(variant, fused):
    """One minibatch, all B rows: padded in micro-batches of 2 rows vs packed in micro-batches of <= BUDGET tokens; the
    policy's and critic's gradients and the summed statistics agree to float64 rounding."""
    policy, reference, critic = models()
    results = []
    for packed in (False, True):
        cfg = config(packed, fused_kernels=str(fused).lower(), **variant)
        rollout = scored(cfg, policy, reference, critic)
        if packed:
            from ppo_core.data.packing import token_budget_micro_batches
            lengths = rollout.host_mask.sum(-1).tolist()
            plan = token_budget_micro_batches(list(range(B)), lengths, BUDGET)
            assert all(sum(lengths[r] for r in rows) <= BUDGET or len(rows) == 1 for rows in plan)
            chunks = [torch.tensor(rows) for rows in plan]
        else:
            chunks = list(torch.arange(B).split(2))
        results.append(gradients(cfg, policy, critic, rollout, chunks, len(chunks)))
    (g_pad, sums_pad, c_pad, _), (g_pack, sums_pack, c_pack, _) = results
    names = list(sums_pad)
    assert list(sums_pack) == names and "policy/clipfrac" in names
    s_pad, s_pack = (torch.stack([sums[name] for name in names]) for sums in (sums_pad, sums_pack))
    VALUE_STATS = torch.tensor([name.startswith("value/") for name in names])
    assert g_pad.keys() == g_pack.keys() and len(g_pad) > 10
    for name in g_pad:
        assert_close_grad(g_pack[name], g_pad[name], name)
    # the statistics: float64 sums, except the critic's, whose values ScoreModel.forward returns in float32
    torch.testing.assert_close(s_pack[VALUE_STATS], s_pad[VALUE_STATS], rtol=FLOAT32_ULP, atol=0)
    exact = ~VALUE_STATS
    if variant.get("policy_loss_kind") == "gspo":
        # GSPO's clipfrac and ratio_mean are means over a micro-batch's rows, summed weighted by its token count:
        # they depend on how rows are grouped into micro-batches, padded or packed alike
        exact &= torch.tensor([name not in ("policy/clipfrac", "policy/ratio_mean") for name in names])
    torch.testing.assert_close(s_pack[exact], s_pad[exact], rtol=1e-11, atol=1e-13)
    assert torch.equal(c_pack, c_pad)


def test_packed_update_steps_like_the_padded_one():
    """ppo_update end to end (its micro-batch plan, the optimizer steps are the caller's): each step's gradients of
    packed and padded runs agree to float64 rounding, and the statistics it returns too."""
    policy, reference, critic = models()
    runs = []
    for packed in (False, True):
        cfg = config(packed, minibatch_size=4)
        rollout = scored(cfg, policy, reference, critic)
        seen = []

        def step_fn(train_policy=True):
            seen.append({f"{kind}.{n}": p.grad.clone() for kind, m in (("policy", policy), ("critic", critic))
                         for n, p in m.named_parameters() if p.grad is not None})
            for m in (policy, critic):
                m.zero_grad(set_to_none=True)
            return {"policy/grad_norm": 0.0}

        stats = ppo_update(policy, critic, rollout, Step(cfg, torch.Generator().manual_seed(0)), 0.05, step_fn)
        runs.append((seen, stats))
    (seen_pad, stats_pad), (seen_pack, stats_pack) = runs
    assert len(seen_pad) == len(seen_pack) == 2
    for a, b in zip(seen_pad, seen_pack):
        assert a.keys() == b.keys()
        for name in a:
            assert_close_grad(b[name], a[name], name)
    assert stats_pack.keys() == stats_pad.keys()
    for k in stats_pad:
        rel = FLOAT32_ULP if k.startswith("value/") else 1e-10
        assert stats_pack[k] == pytest.approx(stats_pad[k], rel=rel, abs=1e-12), k


@pytest.mark.parametrize("correction", ["tis", "decoupled", "icepop"])
def test_off_policy_correction_fused_equals_reference_and_is_exact_on_policy(correction):
    """cfg.off_policy_correction in the update, float64: the fused kernel (advantages times the weights) and the
    reference path (algo.policy_loss_off_policy) give the same gradients and statistics for a behaviour policy that
    differs from pi_old; with mu = pi_old the correction changes nothing, bit for bit."""
    policy, reference, critic = models()
    g = torch.Generator().manual_seed(5)
    runs = {}
    for fused in (True, False):
        cfg = config(False, fused_kernels=str(fused).lower(), off_policy_correction=correction, adv_estimator="grpo",
                     **({"off_policy_band_low": 0.8, "off_policy_band_high": 1.25} if correction == "icepop" else
                        {"off_policy_cap": 1.3}))
        rollout = scored(cfg, policy, reference, critic)
        rollout.behav_logprobs = None
        plain = gradients(cfg, policy, critic, rollout, list(torch.arange(B).split(2)), B // 2)
        rollout.behav_logprobs = rollout.old_logprobs.clone()  # mu = pi_old: weights exactly 1
        same = gradients(cfg, policy, critic, rollout, list(torch.arange(B).split(2)), B // 2)
        for name in plain[0]:
            assert torch.equal(plain[0][name], same[0][name]), name
        noise = torch.randn(rollout.old_logprobs.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        rollout.behav_logprobs = (rollout.old_logprobs + 0.4 * noise) * rollout.response_mask  # mu != pi_old
        runs[fused] = gradients(cfg, policy, critic, rollout, list(torch.arange(B).split(2)), B // 2)
        assert runs[fused][1]["off_policy/corrected_frac"] > 0  # some tokens truncated or dropped
        # the largest gap |log pi_old - log mu| over the minibatch's response tokens, a plain loop over them
        old, behav, mask = (t.tolist() for t in (rollout.old_logprobs, rollout.behav_logprobs, rollout.response_mask))
        gap_max = max(abs(o - m) for o_row, m_row, k_row in zip(old, behav, mask)
                      for o, m, k in zip(o_row, m_row, k_row) if k)
        assert runs[fused][3][2].item() == gap_max > 0
    (g_fused, s_fused, *_), (g_ref, s_ref, *_) = runs[True], runs[False]
    changed = False
    for name in g_ref:
        assert_close_grad(g_fused[name], g_ref[name], name)
        changed |= not torch.allclose(g_ref[name], plain[0][name])
    assert changed  # the correction moved the gradient
    torch.testing.assert_close(s_fused, s_ref, rtol=1e-11, atol=1e-13)


def test_ppo_train_logs_the_samplers_gap_under_an_off_policy_correction(tmp_path):
    """ppo-train --off_policy_correction=icepop on the demo: the rollout keeps the sampler's log-probs, the update
    weights by pi_old / mu, and metrics.jsonl reports the gap and the share of tokens dropped."""
    import json
    import subprocess
    import sys

    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "ppo_core.train", "--iterations=2", "--rollout_batch_size=16",
                           "--minibatch_size=16", "--micro_batch_size=16", "--eval_size=8", "--progress=false",
                           "--off_policy_correction=icepop", "--off_policy_band_high=2", f"--out={out}"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for line in (out / "metrics.jsonl").read_text().splitlines():
        metrics = json.loads(line)
        assert 0 <= metrics["off_policy/behav_gap_mean"] < 0.1 and 0 <= metrics["off_policy/corrected_frac"] <= 1


def bf16_autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


@pytest.mark.parametrize("fused", [True, False])
def test_one_autocast_region_per_pass_gives_the_bits_of_one_region_per_micro_batch(fused):
    """The scoring pass and the minibatch's forwards and backwards run in ONE bf16 autocast region, so that its cast
    cache casts each trained weight once for all micro-batches. Against a plain loop that opens a region per
    micro-batch (each weight cast again each time, backward outside the region): the same log-probs and the same
    accumulated gradients, bit for bit, float32 models under CPU bf16 autocast (the run's dtype='bf16-mixed')."""
    from ppo_core.data.packing import pack_rows, token_budget_micro_batches
    from ppo_core.heads import reference_logprobs, response_logprobs
    from ppo_core.update import micro_batch, policy_objective

    policy, reference, critic = (m.float() for m in models())
    cfg = config(True, fused_kernels=str(fused).lower(), adv_estimator="gae")
    rollout = rollout_forward(Models(policy, reference, critic), sampled_batch(), torch.arange(B) // 2,
                              Step(cfg, autocast=bf16_autocast))
    compute_advantages(rollout, cfg, 0.05, torch.ones(B, dtype=torch.bool))
    fp32 = rollout_forward(Models(policy, reference), sampled_batch(), torch.arange(B) // 2, Step(cfg))
    assert not torch.equal(fp32.old_logprobs, rollout.old_logprobs)  # the bf16 matmuls took effect
    lengths = rollout.host_mask.sum(-1).tolist()
    chunks = [torch.tensor(rows) for rows in token_budget_micro_batches(list(range(B)), lengths, BUDGET)]
    assert len(chunks) >= 3

    # scoring: each micro-batch in a region of its own
    with torch.no_grad():
        for mb in chunks:
            args = (rollout.input_ids[mb], rollout.attention_mask[mb], rollout.response_mask[mb], P, cfg.temperature,
                    cfg.fused_kernels)
            packed = pack_rows(rollout.input_ids[mb], rollout.host_mask[mb], P)
            with bf16_autocast():
                lp, ent = response_logprobs(policy, *args, packed=packed)
                ref_lp, _ = reference_logprobs(policy, reference, *args, packed=packed)
            assert torch.equal(lp.float(), rollout.old_logprobs[mb]) and torch.equal(ent.float(), rollout.entropy[mb])
            assert torch.equal(ref_lp.float(), rollout.ref_logprobs[mb])

    # the update's gradients: a region per micro-batch, backward after it, the minibatch's global token count
    policy.zero_grad(set_to_none=True)
    mask = rollout.response_mask
    agg = algo.Aggregation(cfg.loss_agg, num_tokens=mask.sum(), num_seqs=(mask.sum(-1) > 0).sum().float())
    for rows in chunks:
        with bf16_autocast():
            loss, *_ = policy_objective(policy, micro_batch(rollout, rows, packed=True), cfg, 0.05, agg)
        loss.backward()
    want = {n: p.grad.clone() for n, p in policy.named_parameters()}
    policy.zero_grad(set_to_none=True)
    minibatch_gradients(policy, None, rollout, Minibatch(chunks, len(chunks)), Step(cfg, autocast=bf16_autocast), 0.05)
    assert any(p.grad.abs().sum() > 0 for p in policy.parameters())
    for n, p in policy.named_parameters():
        assert torch.equal(p.grad, want[n]), n
