"""Does ppo-core's GRPO policy gradient equal TRL's on the same batch? One batch, both libraries' own loss code, fp32.

    /work/trl-venv/bin/python bench/grad_vs_trl.py --prompts_file /tmp/rl/addition.jsonl      # 8-13 min, 1 thread

The recipe (configs/grpo-smollm2-135m-addition.toml) on the real checkpoint, with no autocast anywhere:
  models   the checkpoint loaded twice in float32, as transformers' LlamaForCausalLM (what GRPOTrainer trains) and
           through ppo_core.load_model; the two must hold equal weights
  batch    8 prompts x 8 completions, sampled by ppo-core's rollout (sample_responses: the chat-rendered prompt, T=0.8,
           up to 24 tokens, ending at <|im_end|>), scored by last_number_reward. Prompts are taken in file order among
           the first --pool rows, those whose group has mixed rewards first; a group that is still all 0 (or all 1)
           gets its last completion replaced by the correct answer + <|im_end|> (or a wrong one), so every group
           carries a gradient. Old log-probs are the policy's own (ratio 1); reference log-probs are a copy of the
           policy with Gaussian noise (--ref_noise x each tensor's std) added, so the k3 term has a gradient. Both
           libraries get the same token ids, masks, old and reference log-probs
  TRL      GRPOTrainer (bench/trl_grpo.py's grpo_config, bf16=False) built on the transformers model; its own
           _compute_loss (via compute_loss) on all 64 rows as ONE minibatch, in the dict layout that
           _generate_and_score_completions returns, advantages computed as TRL does ((r - mean) / (std + 1e-4))
  ppo-core update.compute_advantages ((r - mean) / (std + 1e-6)), then update.minibatch_gradients on the same 64 rows
           as one minibatch: fused kernels on and off, packed (micro_batch_tokens 2048, the recipe) and padded
           (micro-batches of micro_batch_size rows)
The table compares each path's gradient with TRL's: whole model and by parameter group (cosine, norm ratio, max abs
difference over TRL's max abs gradient). Two ppo-core paths that compute the same math differently (fused vs
reference) show how large fp32 rounding alone is. Then what could make the gradients differ is tested one at a time:
on the per-token level (dL/dlogp_t of each library's loss on the same log-probs: the advantage eps, the mask at EOS,
normalisation, the KL term's sign and clamp), then on the parameters (ppo-core rerun with TRL's advantages; where the
rest of the difference sits, and TRL rerun without transformers' nn.Embedding padding_idx, which stops the gradient of
the pad token's embedding row from the input side; this checkpoint's pad token is <|im_end|>). Temperature and the
EOS/padding masks are checked by the transformer blocks' gradients and the printed masks and labels; tied embeddings
by the parameters' identity.
"""
import argparse
import copy
import dataclasses
import os
import sys
import time

# The repository root in place of bench/, whose kernels.py would shadow the PyPI package `kernels` that transformers
# imports (as bench/trl_grpo.py does).
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
from trl import GRPOTrainer  # noqa: E402
from trl.trainer.utils import nanstd  # noqa: E402

from bench.trl_grpo import (DEFAULT_CONFIG, chat_dataset, check_prompt_tokens, grpo_config,  # noqa: E402
                            last_number_reward_on_messages, recipe)
from bench.weights_moved import GROUPS, group_of  # noqa: E402
from ppo_core import algo, load_model, load_tokenizer  # noqa: E402
from ppo_core.data.packing import token_budget_micro_batches  # noqa: E402
from ppo_core.data.prompts import load_rows  # noqa: E402
from ppo_core.heads import micro_batches, response_labels, response_logprobs  # noqa: E402
from ppo_core.rollout import Rollout, encode_prompts, sample_responses  # noqa: E402
from ppo_core.update import Minibatch, compute_advantages, minibatch_gradients  # noqa: E402
from ppo_core.run.start import Step  # noqa: E402
from ppo_core.rewards.verifiers import last_number_reward  # noqa: E402

TRL_ADV_EPS = 1e-4  # grpo_trainer.py, _generate_and_score_completions: advantages / (std_rewards + 1e-4)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", default="~/.cache/ppo-core/SmolLM2-135M-Instruct")
    p.add_argument("--prompts_file", required=True, help="JSONL of {prompt, answer}")
    p.add_argument("--config", default=DEFAULT_CONFIG)
    p.add_argument("--seed", type=int, default=0, help="sampling noise and the reference's noise")
    p.add_argument("--pool", type=int, default=24, help="the first rows of the file sampled to find mixed groups")
    p.add_argument("--ref_noise", type=float, default=0.02, help="reference = policy + N(0, (ref_noise * std)^2)")
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args()


# ---------------------------------------------------------------------------- models

def load_both(path):
    """The checkpoint as transformers' model and as ppo-core's, both float32; their weights must be equal."""
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ppo_model = load_model(path, dtype=torch.float32)
    hf_params, ppo_params = dict(hf_model.named_parameters()), dict(ppo_model.named_parameters())
    if hf_params.keys() != ppo_params.keys():
        raise SystemExit(f"parameter names differ: {sorted(hf_params.keys() ^ ppo_params.keys())}")
    worst = max((hf_params[n] - ppo_params[n]).abs().max().item() for n in hf_params)
    tied_hf = hf_model.lm_head.weight is hf_model.model.embed_tokens.weight
    tied_ppo = ppo_model.lm_head.weight is ppo_model.model.embed_tokens.weight
    print(f"weights: {len(hf_params)} tensors, {sum(p.numel() for p in hf_params.values()) / 1e6:.1f}M parameters, "
          f"max |transformers - ppo-core| = {worst:.1e}; lm_head tied to embed_tokens (same Parameter): "
          f"transformers {tied_hf}, ppo-core {tied_ppo}")
    if worst != 0.0:
        raise SystemExit("the two models' weights differ")
    return hf_model, ppo_model


def noisy_copy(model, rel, seed):
    """model's copy with N(0, (rel * std(W))^2) added to each tensor W: the reference, close to but not the policy."""
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for p in ref.parameters():  # a tied tensor once
            p.add_(torch.randn(p.shape, generator=g) * rel * p.float().std())
    return ref


# ---------------------------------------------------------------------------- the batch

def make_batch(policy, tokenizer, hf_tokenizer, rows, cfg, seed, pool):
    """8 prompts x 8 completions sampled by ppo-core's rollout, scored; prompts with mixed rewards first. -> dict."""
    n, k = cfg.rollout_batch_size, cfg.n_samples_per_prompt
    candidates = rows[:pool]
    t0 = time.perf_counter()
    out = sample_responses(policy, tokenizer, [r for r in candidates for _ in range(k)],
                           Step(cfg, torch.Generator().manual_seed(seed)))
    tokens, mask, texts = out.tokens, out.response_mask, out.texts
    scores = last_number_reward(None, texts, [r["answer"] for r in candidates for _ in range(k)])
    scores = torch.tensor(scores).view(pool, k)  # [pool, k]
    mixed = [i for i in range(pool) if scores[i].min() != scores[i].max()]
    chosen = (mixed + [i for i in range(pool) if i not in mixed])[:n]
    chosen.sort()
    print(f"sampled {pool} prompts x {k} in {time.perf_counter() - t0:.0f}s; mean reward {scores.mean():.3f}; "
          f"{len(mixed)} groups with mixed rewards; chosen rows {chosen}")
    R = cfg.max_new_tokens
    eos = tokenizer.eos_token_ids[0]
    batch_rows, batch_tokens, batch_texts, injected = [], [], [], 0
    for i in chosen:
        group_tokens = tokens.view(pool, k, R)[i].clone()
        group_texts = texts[i * k:(i + 1) * k]
        if scores[i].min() == scores[i].max():  # no reward variance: make the last completion right (or wrong)
            answer = candidates[i]["answer"] if scores[i, 0] == 0 else str(int(candidates[i]["answer"]) + 1)
            ids = hf_tokenizer(answer, add_special_tokens=False).input_ids + [eos]
            group_tokens[-1] = torch.tensor(ids + [tokenizer.pad_token_id] * (R - len(ids)))
            group_texts = group_texts[:-1] + [answer]
            injected += 1
        batch_rows += [candidates[i]] * k
        batch_tokens.append(group_tokens)
        batch_texts += group_texts
    tokens = torch.cat(batch_tokens)  # [64, R]
    # the response is every token up to and including the first EOS (ppo_core.rollout.sample_responses)
    is_eos = tokens == eos
    response_mask = (~((is_eos.long().cumsum(-1) - is_eos.long()) > 0)).float()  # [64, R]
    scores = torch.tensor(last_number_reward(None, batch_texts, [r["answer"] for r in batch_rows]))  # [64]
    prompt_ids, prompt_mask = encode_prompts(tokenizer, batch_rows, "cpu", cfg=cfg)  # [64, P] left-padded
    print(f"batch: {injected} of {n} groups got a constructed completion; rewards per group "
          f"{scores.view(n, k).mean(1).tolist()}; response lengths {response_mask.sum(1).int().tolist()}")
    return dict(rows=batch_rows, texts=batch_texts, prompt_ids=prompt_ids, prompt_mask=prompt_mask, tokens=tokens,
                response_mask=response_mask, ended=is_eos.any(-1), scores=scores,
                group=torch.arange(n).repeat_interleave(k))


@torch.no_grad()
def logprobs_of(model, batch, cfg):
    """[64, R] log-probs of the response tokens at the recipe's temperature (ppo-core's reference head, padded)."""
    input_ids = torch.cat([batch["prompt_ids"], batch["tokens"]], 1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["response_mask"].bool()], 1)
    P = batch["prompt_ids"].shape[1]
    out = [response_logprobs(model, input_ids[rows], attention_mask[rows], batch["response_mask"][rows], P,
                             cfg.temperature, fused=False)[0] for rows in micro_batches(len(input_ids), 32)]
    return torch.cat(out)


# ---------------------------------------------------------------------------- the two libraries' gradients

def trl_advantages(scores, k):
    """GRPOTrainer._generate_and_score_completions, multi_objective_aggregation='sum_then_normalize',
    scale_rewards='group': (r - group mean) / (group nanstd + 1e-4). -> [B]"""
    mean = torch.nanmean(scores.view(-1, k), dim=1).repeat_interleave(k)
    std = nanstd(scores.view(-1, k), dim=1).repeat_interleave(k)
    return (scores - mean) / (std + TRL_ADV_EPS)


def trl_inputs(batch, old_logp, ref_logp, advantages, eos_ids):
    """The dict TRL 1.16's _generate_and_score_completions returns for these rows (one process): completions cut
    after the first EOS (_generate_single_turn), right-padded to the longest with the pad token, mask 1 on each
    completion's tokens (the EOS included)."""
    tokens = batch["tokens"]
    is_eos = torch.isin(tokens, torch.tensor(eos_ids))
    eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long)
    eos_idx[is_eos.any(dim=1)] = is_eos.int().argmax(dim=1)[is_eos.any(dim=1)]
    keep = torch.arange(is_eos.size(1)).expand(is_eos.size(0), -1) <= eos_idx.unsqueeze(1)
    C = int(keep.sum(1).max())  # TRL pads to the longest completion
    pad = 2  # the checkpoint's pad_token_id (= <|im_end|>)
    completion_ids = torch.where(keep, tokens, pad)[:, :C]
    completion_mask = keep[:, :C].long()
    return {"prompt_ids": batch["prompt_ids"], "prompt_mask": batch["prompt_mask"].long(),
            "completion_ids": completion_ids, "completion_mask": completion_mask, "advantages": advantages,
            "num_items_in_batch": completion_mask.sum(), "old_per_token_logps": old_logp[:, :C].clone(),
            "ref_per_token_logps": ref_logp[:, :C].clone()}


def make_trainer(hf_model, cfg, policy_path, rows):
    args = grpo_config(cfg, seed=0, iterations=1, bf16=False, output_dir="/tmp/grad_vs_trl/trainer")
    trainer = GRPOTrainer(model=hf_model, reward_funcs=last_number_reward_on_messages, args=args,
                          train_dataset=chat_dataset(rows))
    check_prompt_tokens(trainer, policy_path, rows[0], cfg)  # TRL renders the prompt to the same token ids
    if not hasattr(trainer, "current_gradient_accumulation_steps"):
        trainer.current_gradient_accumulation_steps = 1  # what Trainer's loop sets for gradient_accumulation_steps=1
    return trainer


def trl_gradient(trainer, inputs):
    model = trainer.model
    model.train()
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    with trainer.compute_loss_context_manager():  # what Trainer.training_step wraps compute_loss in
        loss = trainer.compute_loss(model, inputs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    kl = trainer._metrics["train"]["kl"][-1]
    return grads, {"loss": loss.item(), "kl (k3 mean)": kl, "s": time.perf_counter() - t0}


def ppo_rollout(batch, old_logp, ref_logp):
    input_ids = torch.cat([batch["prompt_ids"], batch["tokens"]], 1)  # [64, P+R]
    attention_mask = torch.cat([batch["prompt_mask"], batch["response_mask"].bool()], 1)
    zeros = torch.zeros_like(old_logp)
    return Rollout(batch["texts"], batch["texts"], input_ids, attention_mask, batch["response_mask"],
                   batch["prompt_ids"].shape[1], old_logp, ref_logp, zeros, zeros, batch["scores"], batch["group"],
                   host_mask=attention_mask.cpu())


def ppo_gradient(policy, rollout, cfg, fused, packed):
    """ppo-core's update code on all rows as one minibatch: minibatch_gradients, as ppo_update calls it."""
    cfg = dataclasses.replace(cfg, fused_kernels=fused, micro_batch_tokens=cfg.micro_batch_tokens if packed else 0)
    rows = list(range(rollout.input_ids.shape[0]))
    if packed:
        lengths = rollout.host_mask.sum(-1).tolist()
        chunks = [torch.tensor(b) for b in token_budget_micro_batches(rows, lengths, cfg.micro_batch_tokens)]
    else:
        chunks = micro_batches(len(rows), cfg.micro_batch_size, torch.tensor(rows))
    policy.train()
    policy.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    sums, counts, _ = minibatch_gradients(policy, None, rollout, Minibatch(chunks, len(chunks)), Step(cfg),
                                          cfg.kl_coef)
    grads = {n: p.grad.detach().clone() for n, p in policy.named_parameters()}
    pg, kl = sums["policy/loss"].item(), sums["policy/kl_loss"].item()
    return grads, {"loss": pg + cfg.kl_coef * kl, "kl (k3 mean)": kl, "s": time.perf_counter() - t0,
                   "micro-batches": len(chunks)}


# ---------------------------------------------------------------------------- comparison

def flat(grads, group=None):
    return torch.cat([g.double().reshape(-1) for n, g in sorted(grads.items()) if group in (None, group_of(n))])


def compare(grads, ref):
    """-> (norm, cosine whole, cosine per group, norm ratio, max |diff| / max |ref|) against ref (TRL's)."""
    a, b = flat(grads), flat(ref)
    cos = lambda x, y: (x @ y / (x.norm() * y.norm())).item()  # noqa: E731
    per_group = [cos(flat(grads, g), flat(ref, g)) for g in GROUPS]
    return a.norm().item(), cos(a, b), per_group, (a.norm() / b.norm()).item(), ((a - b).abs().max() / b.abs().max()).item()


def print_table(results, trl_name):
    ref = results[trl_name][0]
    print(f"\n| path | grad norm | cosine vs TRL (all) | {' | '.join(GROUPS)} | norm ratio | max abs diff / max abs "
          f"grad | loss | k3 mean | s |")
    print("|---" * (8 + len(GROUPS)) + "|")
    for name, (grads, info) in results.items():
        norm, cos, per_group, ratio, maxdiff = compare(grads, ref)
        print(f"| {name} | {norm:.6e} | {cos:.8f} | {' | '.join(f'{c:.8f}' for c in per_group)} | {ratio:.6f} | "
              f"{maxdiff:.2e} | {info['loss']:.8f} | {info['kl (k3 mean)']:.6f} | {info['s']:.0f} |")


def show_masks(batch, inputs, rollout):
    """What each library trains on: token counts, and the first row's tokens, masks and labels around its EOS."""
    trl_mask, ppo_mask = inputs["completion_mask"], rollout.response_mask
    print(f"\nloss-mask tokens: TRL {int(trl_mask.sum())} (num_items_in_batch {int(inputs['num_items_in_batch'])}), "
          f"ppo-core {int(ppo_mask.sum())}; rows ending in EOS {int(batch['ended'].sum())} of {len(ppo_mask)}; "
          f"masks equal where both have columns: {bool((trl_mask == ppo_mask[:, :trl_mask.shape[1]]).all())}, "
          f"ppo-core's extra columns all 0: {bool((ppo_mask[:, trl_mask.shape[1]:] == 0).all())}")
    row = int(batch["ended"].nonzero()[0])
    e = int((batch["tokens"][row] == 2).nonzero()[0])
    # TRL's labels (_get_per_token_logps_and_entropies): input_ids, -100 where attention_mask is 0 or in the prompt
    trl_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)[row]
    trl_att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)[row]
    P = inputs["prompt_ids"].shape[1]
    trl_labels = trl_ids.masked_fill(trl_att == 0, -100)[P:]
    ppo_labels = response_labels(rollout.input_ids, rollout.response_mask, rollout.prompt_len)[row]
    print(f"row {row} around its EOS (response position {e}): position / token / TRL mask / TRL label / "
          f"ppo-core mask / ppo-core label")
    for t in range(max(0, e - 2), min(e + 3, ppo_labels.shape[0])):
        tm = int(inputs["completion_mask"][row, t]) if t < trl_labels.shape[0] else "-"
        tl = int(trl_labels[t]) if t < trl_labels.shape[0] else "-"
        print(f"  {t:2d}  {int(batch['tokens'][row, t]):6d}  {tm}  {tl}  {int(rollout.response_mask[row, t])}  "
              f"{int(ppo_labels[t])}")


# ---------------------------------------------------------------------------- hypotheses

def per_token_checks(batch, inputs, rollout, trl_adv, cfg):
    """The per-token loss weights each library applies, on identical log-probs: for a loss L(logp), dL/dlogp_t is the
    only thing that reaches the model (through logp_t), so equal dL/dlogp means equal parameter gradients up to how
    logp_t itself is computed. TRL's _compute_loss body and ppo-core's loss (algo.policy_loss + kl_estimate) are
    evaluated on the same leaf logp = old_logp (ratio 1) and their dL/dlogp compared."""
    C = inputs["completion_mask"].shape[1]
    mask = rollout.response_mask[:, :C]
    old, ref = rollout.old_logprobs[:, :C], rollout.ref_logprobs[:, :C]

    def trl_loss(logp, adv, beta=cfg.kl_coef, eps=(cfg.clip_low, cfg.clip_high)):
        # grpo_trainer.py _compute_loss, loss_type "bnpo", importance_sampling_level "token"
        coef_1 = torch.exp(logp - old)
        coef_2 = torch.clamp(coef_1, 1 - eps[0], 1 + eps[1])
        per_token_loss = -torch.min(coef_1 * adv.unsqueeze(1), coef_2 * adv.unsqueeze(1))
        per_token_kl = torch.exp(ref - logp) - (ref - logp) - 1
        per_token_loss = per_token_loss + beta * per_token_kl
        m = inputs["completion_mask"].to(logp.dtype)
        return (per_token_loss * m).sum() / m.sum().clamp(min=1.0)

    def ppo_loss(logp, adv):
        agg = algo.Aggregation("token-mean", num_tokens=mask.sum())
        pg, _ = algo.policy_loss(logp, old, adv, mask, cfg.clip_low, cfg.clip_high, agg=agg)
        return pg + cfg.kl_coef * algo.aggregate(algo.kl_estimate(logp, ref, "k3"), mask, agg)

    def dlogp(loss_fn, adv):
        logp = old.clone().double().requires_grad_(True)
        loss = loss_fn(logp, adv.double())
        loss.backward()
        return loss.item(), logp.grad

    ppo_adv = rollout.advantages[:, 0]  # a row's advantage, the same on every token
    trl_l, trl_g = dlogp(trl_loss, trl_adv)
    ppo_l, ppo_g = dlogp(ppo_loss, ppo_adv.double()[:, None].expand(-1, C))
    same_adv_l, same_adv_g = dlogp(ppo_loss, trl_adv.double()[:, None].expand(-1, C))
    rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()  # noqa: E731
    print("\nper-token check: dL/dlogp_t of each library's loss on the same log-probs (float64)")
    print(f"  advantages: max |ppo-core - TRL| = {(ppo_adv - trl_adv).abs().max():.2e} (eps 1e-6 vs 1e-4; "
          f"relative {((ppo_adv - trl_adv).abs() / trl_adv.abs().clamp(min=1e-12)).max():.2e})")
    print(f"  losses: TRL {trl_l:.10f}, ppo-core {ppo_l:.10f}, ppo-core with TRL's advantages {same_adv_l:.10f}")
    print(f"  dL/dlogp: max |ppo-core - TRL| / max |TRL| = {rel(ppo_g, trl_g):.2e}; with TRL's advantages "
          f"{rel(same_adv_g, trl_g):.2e}")
    # the KL term alone: its sign and clamp
    k3 = torch.exp(ref - old) - (ref - old) - 1
    print(f"  k3 on the batch: mean {algo.masked_mean(k3, mask):.4f}, max {k3[mask > 0].max():.4f} (ppo-core's clamp "
          f"binds above {algo.K3_CLAMP}, its log-ratio clamp beyond +-{algo.LOG_RATIO_CLAMP}: "
          f"{int(((k3 > algo.K3_CLAMP) & (mask > 0)).sum())} tokens)")
    # what each variant would change, for scale (dL/dlogp relative to TRL's)
    no_eos = mask.clone()
    no_eos[torch.arange(len(mask)), (mask.sum(1) - 1).long()] *= (~batch["ended"]).float()  # drop the EOS token
    _, g = dlogp(lambda lp, a: algo.policy_loss(lp, old, a, no_eos, agg="token-mean")[0]
                 + cfg.kl_coef * algo.aggregate(algo.kl_estimate(lp, ref, "k3"), no_eos, "token-mean"),
                 trl_adv.double()[:, None].expand(-1, C))
    print(f"  (for scale) EOS left out of the loss mask: dL/dlogp differs by {rel(g, trl_g):.2e}; per-sequence mean "
          f"instead of token mean: ", end="")
    _, g = dlogp(lambda lp, a: algo.policy_loss(lp, old, a, mask, agg="seq-mean-token-mean")[0]
                 + cfg.kl_coef * algo.aggregate(algo.kl_estimate(lp, ref, "k3"), mask, "seq-mean-token-mean"),
                 trl_adv.double()[:, None].expand(-1, C))
    print(f"{rel(g, trl_g):.2e}; KL term with the opposite sign: ", end="")
    _, g = dlogp(lambda lp, a: trl_loss(lp, a[:, 0], beta=-cfg.kl_coef), trl_adv.double()[:, None].expand(-1, C))
    print(f"{rel(g, trl_g):.2e}")


def gradient_hypotheses(results, trl_name, trainer, inputs, ppo_model, rollout, batch, adv_trl, cfg):
    """The parameter-level differences explained one at a time: (1) the advantage eps (ppo-core rerun with TRL's
    advantages); (2) what is left sits in one embedding row: transformers' nn.Embedding(padding_idx=pad_token_id)
    gives the pad token's row no gradient from the input side, and this checkpoint's pad token is <|im_end|> (id 2),
    a real token of every chat prompt; TRL rerun with padding_idx=None."""
    E = "model.embed_tokens.weight"
    trl_grads = results[trl_name][0]
    fused, padded = results["ppo-core fused packed 2048 (the recipe)"][0], results["ppo-core reference padded 32-row"][0]
    _, cos, per_group, ratio, maxdiff = compare(fused, padded)
    print(f"\nfp32 rounding floor: ppo-core fused packed vs reference padded (same math, other order): cosine "
          f"{cos:.10f} (embed/lm_head {per_group[0]:.10f}), norm ratio {ratio:.7f}, max abs diff {maxdiff:.1e}")

    rollout.advantages = adv_trl[:, None] * rollout.response_mask  # [64, R] TRL's (eps 1e-4)
    same_adv, info = ppo_gradient(ppo_model, rollout, cfg, fused=True, packed=True)
    _, cos, per_group, ratio, maxdiff = compare(same_adv, trl_grads)
    print(f"(1) ppo-core (fused packed) with TRL's advantages: loss {info['loss']:.8f} (TRL {results[trl_name][1]['loss']:.8f}); "
          f"vs TRL cosine {cos:.8f} ({', '.join(f'{g} {c:.8f}' for g, c in zip(GROUPS, per_group))}), norm ratio "
          f"{ratio:.7f}, max abs diff / max abs {maxdiff:.2e}")
    diff_rows = (same_adv[E] - trl_grads[E]).double().norm(dim=1)  # [V]
    worst = int(diff_rows.argmax())
    share = (diff_rows[worst] ** 2 / (diff_rows ** 2).sum()).item()
    pad_idx = trainer.model.model.embed_tokens.padding_idx
    input_eos = int((rollout.host_mask & (rollout.input_ids == worst)).sum())
    print(f"(2) the embedding's difference is {share:.6%} (squared norm) in row {worst}; its gradient norm there: TRL "
          f"{trl_grads[E][worst].norm():.6f}, ppo-core {same_adv[E][worst].norm():.6f}. transformers' embed_tokens has "
          f"padding_idx={pad_idx} (config pad_token_id), ppo-core's none; token {worst} is a real input token "
          f"{input_eos} times in this batch ({input_eos / len(rollout.input_ids):.1f} a row: the chat template's turn ends, "
          f"and each EOS-ended response's last token)")
    trainer.model.model.embed_tokens.padding_idx = None
    trl_no_pad, info = trl_gradient(trainer, inputs)
    trainer.model.model.embed_tokens.padding_idx = pad_idx
    _, cos, per_group, ratio, maxdiff = compare(same_adv, trl_no_pad)
    print(f"    TRL with padding_idx=None vs ppo-core with TRL's advantages: cosine {cos:.10f} "
          f"({', '.join(f'{g} {c:.10f}' for g, c in zip(GROUPS, per_group))}), norm ratio {ratio:.7f}, max abs diff / "
          f"max abs {maxdiff:.2e}; row {worst}: TRL {trl_no_pad[E][worst].norm():.6f}, ppo-core "
          f"{same_adv[E][worst].norm():.6f}")


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(args.seed)
    policy_path = os.path.expanduser(args.policy)
    cfg = recipe(args.config, smoke=False)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, TRL {trl.__version__}; threads "
          f"{torch.get_num_threads()}; float32 weights, no autocast; recipe {os.path.basename(args.config)}: "
          f"T={cfg.temperature}, clip {cfg.clip_low}/{cfg.clip_high}, k3 KL loss {cfg.kl_coef}, {cfg.loss_agg}")

    hf_model, ppo_model = load_both(policy_path)
    tokenizer = load_tokenizer(policy_path)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(policy_path)
    rows = load_rows(args.prompts_file)
    batch = make_batch(ppo_model, tokenizer, hf_tokenizer, rows, cfg, args.seed, args.pool)

    reference = noisy_copy(ppo_model, args.ref_noise, args.seed)
    old_logp = logprobs_of(ppo_model, batch, cfg)  # [64, R], the policy's own: ratio 1
    ref_logp = logprobs_of(reference, batch, cfg)
    del reference

    rollout = ppo_rollout(batch, old_logp, ref_logp)
    compute_advantages(rollout, cfg, cfg.kl_coef, batch["ended"])  # ppo-core's advantages [64, R]
    adv_trl = trl_advantages(batch["scores"], cfg.n_samples_per_prompt)
    inputs = trl_inputs(batch, old_logp, ref_logp, adv_trl, tokenizer.eos_token_ids)

    trainer = make_trainer(hf_model, cfg, policy_path, batch["rows"])
    show_masks(batch, inputs, rollout)

    results = {}
    trl_name = f"TRL {trl.__version__} GRPOTrainer._compute_loss (padded, 64 rows)"
    results[trl_name] = trl_gradient(trainer, inputs)
    print(f"{trl_name}: {results[trl_name][1]}", flush=True)
    for fused in (True, False):
        for packed in (True, False):
            name = (f"ppo-core {'fused' if fused else 'reference'} {'packed 2048' if packed else 'padded 32-row'}"
                    + (" (the recipe)" if fused and packed else ""))
            results[name] = ppo_gradient(ppo_model, rollout, cfg, fused, packed)
            print(f"{name}: {results[name][1]}", flush=True)
    print_table(results, trl_name)
    per_token_checks(batch, inputs, rollout, adv_trl, cfg)
    gradient_hypotheses(results, trl_name, trainer, inputs, ppo_model, rollout, batch, adv_trl, cfg)


if __name__ == "__main__":
    main()
