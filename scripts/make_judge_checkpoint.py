"""Build the tiny generative judge of the reverse task: `ppo_core/demo/judge-demo/`.

    python scripts/make_judge_checkpoint.py                    # ~8 min on one CPU thread
    python scripts/make_judge_checkpoint.py --out /tmp/judge --steps 300
    python scripts/make_judge_checkpoint.py --eval_only        # measure the shipped judge again

A judge reads a prompt and response(s) of the *reverse* task (ppo_core/data/tasks.py: "kitten=" -> "nettik") and writes a
short rationale, then a verdict, as GRAM, RM-R1 and CE-RM do with billions of parameters (ppo_core/rewards/judges.py reads it):

    pointwise   "rate kitten=nettak|"               -> "nn1 ee2 tt3 tt4 ia4 kk5 Score: 5/6"
    pairwise    "pick kitten=A:nettak B:kitten|"    -> "nnk10 eei20 ttt31 ttt42 iae42 kkn52 A=5/6 B=2/6 [[A]]"

The rationale aligns the correct reversal with the response, one group per position of the longer of the two: the
right character, the response's ("_" where one has none) and the running count of matches. Each step thus
compares two characters it has just written and adds one to a count: a tiny model learns that, where it does not
learn to compare characters far apart in its context, nor to count a row of marks at once (a first design, the
reversal followed by a row of +/- marks, reached a score correlation of 0.07). The score is the count over the
number of positions: exactly the task's reward k/n. A pairwise group holds the right character, A's, B's and the two
running counts, so that the verdict, for the response with the larger k/n, is read from the last few characters;
equal rewards get [[A]], so the two orders that ppo_core.rewards.judges.JudgeReward judges give a tie 0.5.

1. Builds a character-level tokenizer with the `tokenizers` library (letters, digits, the marks, "<unk>").
2. Trains a Llama-family model (tied embeddings, GQA) by supervised fine-tuning on judgements of responses drawn like
   the reverse demo's sloppy demonstrator and what PPO makes of it: reversed or copied words, misspelt characters,
   cut or overlong responses up to the policy's 12 tokens, now and then random letters or nothing. Half the rows
   are pointwise, half pairwise. The task's 256 held-out prompts (tasks.eval_prompts(256, seed=0)) are never used.
3. Writes the Hugging Face layout (config.json, model.safetensors, tokenizer.json, tokenizer_config.json) and the
   judge's own prompt templates pointwise.jinja and pairwise.jinja, which JudgeReward picks up by default.
4. Measures the judge through ppo_core.rewards.judges.JudgeReward on the held-out prompts, with responses sampled at T=1 from
   the shipped reverse-demo policy (what PPO starts from) and from the demonstrator: pointwise, the correlation and
   mean absolute error of the score against tasks.reverse_rewards and the parse rate; pairwise, the accuracy of each
   verdict on pairs whose true rewards differ, the both-orders reward's agreement, and the parse rate.

Measured 2026-12-03 on the development machine (2-core AMD EPYC, one thread, other jobs sharing the cores), the
shipped checkpoint (0.18M parameters): 2400 steps of 64 rows in 447 s, final SFT loss 0.0006. On the 256 held-out
prompts, each with one reverse-demo sample and one demonstrator sample (512 answers): pointwise parse rate 1.0,
Pearson correlation 0.9992 with tasks.reverse_rewards, mean absolute error 0.0015, exact score 98.8%; pairwise (512
pairs: the policy's sample against the demonstrator's and against a second policy sample), parse rate 99.9% of
the 1024 verdicts, verdict accuracy 98.7% on the 375 pairs whose true rewards differ (both orders), both-orders
reward right (1 or 0) on 97.3% of them, and 0.5 on 92.0% of the 137 ties; measuring takes 7 s. Two earlier designs
fell short in the same budget: the reversal then a row of +/- marks (pointwise correlation 0.07), and the
alignment groups with each pairwise response in its own row (pairwise verdict accuracy 0.53).
"""
import argparse
import math
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from ppo_core.data.tasks import ALPHABET, SEPARATOR, eval_prompts, random_word, reverse_reward  # noqa: E402
from ppo_core.models.tokenizer import Tokenizer as PPOTokenizer  # noqa: E402
from sft import character_tokenizer, right_pad, tiny_llama, train  # noqa: E402  (scripts/sft.py: model, SFT loop)

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
CHARACTERS = ALPHABET + "0123456789=_/:[]| ABS"
"""The judge's alphabet: the task's letters and "=", digits, the rationale's marks, "rate", "pick", "Score"."""
MAX_RESPONSE = 12
"""The longest response judged in training: ppo-train's max_new_tokens for the reverse task."""

POINTWISE_TEMPLATE = "rate {{ prompt }}{{ response }}|"
PAIRWISE_TEMPLATE = "pick {{ prompt }}A:{{ response_a }} B:{{ response_b }}|"


# ---------------------------------------------------------------------------------------------- what is judged

def policy_like_response(word: str, rng: random.Random) -> str:
    """A response to `word` + "=" as the reverse demo's policy writes one at some point of PPO: the reversal or a
    copy (the sloppy demonstrator's two behaviours, in changing proportions), misspelt at a rate of 0 to 0.5, now and
    then cut short or run on, rarely random letters or nothing at all."""
    u = rng.random()
    if u < 0.03:
        return ""
    if u < 0.10:
        return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, MAX_RESPONSE)))
    out = word[::-1] if rng.random() < 0.55 else word
    # up to every other letter wrong: each position's match must be read, not guessed from its neighbours
    p_typo = rng.choice([0.0, 0.0, 0.1, 0.2, 0.3, 0.5])
    out = "".join(rng.choice(ALPHABET) if rng.random() < p_typo else c for c in out)
    v = rng.random()
    if v < 0.12 and len(out) > 1:
        out = out[: rng.randint(1, len(out) - 1)]
    elif v < 0.24:
        out += "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 4)))
    return out[:MAX_RESPONSE]


GAP = "_"
"""Stands for a missing character where the reversal and the response differ in length."""


def alignment(target: str, response: str) -> tuple[str, int, int]:
    """The per-position rationale: for each of the n = max(len) positions, the right character, the response's
    and the running count of matches ("nn1 ee2 tt3 tt4 ia4 kk5"), so that every step compares two characters
    written just before it and adds one to a count -> (text, k, n), k/n = tasks.reverse_reward."""
    n = max(len(target), len(response))
    groups, k = [], 0
    for i in range(n):
        t = target[i] if i < len(target) else GAP
        r = response[i] if i < len(response) else GAP
        k += t == r and t != GAP
        groups.append(f"{t}{r}{k}")
    return " ".join(groups), k, n


def pointwise_judgement(prompt: str, response: str) -> str:
    text, k, n = alignment(prompt.rstrip(SEPARATOR)[::-1], response)
    return f"{text} Score: {k}/{n}"


def pairwise_judgement(prompt: str, response_a: str, response_b: str) -> str:
    """Both responses aligned with the reversal in one row of groups (the right character, A's, B's, A's running
    count, B's), then each one's k/n and the verdict, all from characters a few positions back. Ties name A: the
    both-orders reward then gives them 0.5."""
    target = prompt.rstrip(SEPARATOR)[::-1]
    n = max(len(target), len(response_a), len(response_b))
    groups, k_a, k_b = [], 0, 0
    for i in range(n):
        t, a, b = (s[i] if i < len(s) else GAP for s in (target, response_a, response_b))
        k_a += t == a and t != GAP
        k_b += t == b and t != GAP
        groups.append(f"{t}{a}{b}{k_a}{k_b}")
    n_a, n_b = max(len(target), len(response_a)), max(len(target), len(response_b))
    better = "A" if k_a * max(n_b, 1) >= k_b * max(n_a, 1) else "B"  # k_a/n_a >= k_b/n_b, without dividing by 0
    return f"{' '.join(groups)} A={k_a}/{n_a} B={k_b}/{n_b} [[{better}]]"


def render(template: str, **variables) -> str:
    from ppo_core.rewards.judges import render_judge_prompt

    return render_judge_prompt(template, **variables)


def example(rng: random.Random, held_out: set) -> tuple[str, str]:
    """One training row: (judge prompt, judgement), pointwise or pairwise with equal probability."""
    while True:
        word = random_word(rng)
        if word + SEPARATOR not in held_out:
            break
    prompt = word + SEPARATOR
    if rng.random() < 0.5:
        response = policy_like_response(word, rng)
        return render(POINTWISE_TEMPLATE, prompt=prompt, response=response), pointwise_judgement(prompt, response)
    a, b = policy_like_response(word, rng), policy_like_response(word, rng)
    return (render(PAIRWISE_TEMPLATE, prompt=prompt, response_a=a, response_b=b),
            pairwise_judgement(prompt, a, b))


# ---------------------------------------------------------------------------------------------- measuring the judge

def pearson(xs, ys) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx, syy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else float("nan")


@torch.no_grad()
def policy_samples(prompts, seed=0) -> list[str]:
    """One response per prompt from the shipped reverse-demo policy at T=1 (ppo-train's rollout)."""
    from ppo_core.engine.generate import generate
    from ppo_core.models.model import load_model
    from ppo_core.models.tokenizer import load_tokenizer

    path = os.path.join(os.path.dirname(__file__), "..", "ppo_core", "demo", "reverse-demo")
    model, tok = load_model(path).eval(), load_tokenizer(path)
    encoded = [tok.encode_prompt(p) for p in prompts]
    P = max(len(e) for e in encoded)
    ids = torch.tensor([[tok.pad_token_id] * (P - len(e)) + e for e in encoded])  # [B, P] left-padded
    mask = torch.tensor([[0] * (P - len(e)) + [1] * len(e) for e in encoded])  # [B, P]
    tokens = generate(model, ids, MAX_RESPONSE, attention_mask=mask, eos_token_id=tok.eos_token_ids,
                      pad_token_id=tok.pad_token_id, generator=torch.Generator().manual_seed(seed))
    return [tok.decode(row) for row in tokens.tolist()]


def measure(path, n_prompts=256, seed=0) -> dict:
    """The judge's agreement with the true reward on held-out prompts (see the module docstring, step 4)."""
    from ppo_core.rewards.judges import JudgeReward

    prompts = eval_prompts(n_prompts, seed=0)
    rng = random.Random(f"judge-eval-{seed}")
    policy = policy_samples(prompts, seed)
    sloppy = [policy_like_response(p.rstrip(SEPARATOR), rng) for p in prompts]
    out = {}
    t0 = time.perf_counter()
    pointwise = JudgeReward(path, "pointwise", batch_size=64)
    all_prompts, all_responses = prompts + prompts, policy + sloppy
    scores, metrics = pointwise(all_prompts, all_responses)
    true = [reverse_reward(p, r) for p, r in zip(all_prompts, all_responses)]
    parsed = [i for i in range(len(true)) if metrics["judge/unparsed"][i] == 0]
    out["pointwise_n"] = len(true)
    out["pointwise_parse_rate"] = len(parsed) / len(true)
    out["pointwise_pearson"] = pearson([float(scores[i]) for i in parsed], [true[i] for i in parsed])
    out["pointwise_mae"] = sum(abs(float(scores[i]) - true[i]) for i in parsed) / max(len(parsed), 1)
    out["pointwise_exact"] = sum(abs(float(scores[i]) - true[i]) < 1e-6 for i in parsed) / max(len(parsed), 1)
    out["pointwise_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    # unparsed_score -1 marks an order without a verdict in the per-order metrics (a tie would read 0.5)
    pairwise = JudgeReward(path, "pairwise", batch_size=64, unparsed_score=-1.0)
    # the policy's sample against the demonstrator's, and against a second policy sample
    references = sloppy + policy_samples(prompts, seed + 1)
    rewards, metrics = pairwise(all_prompts, policy + policy, columns={"reference": references})
    true_policy = [reverse_reward(p, r) for p, r in zip(all_prompts, policy + policy)]
    true_ref = [reverse_reward(p, r) for p, r in zip(all_prompts, references)]
    differ = [i for i in range(len(true_policy)) if true_policy[i] != true_ref[i]]
    orders = [metrics["judge/pref_policy_as_a"], metrics["judge/pref_policy_as_b"]]
    right = sum(float(pref[i]) == float(true_policy[i] > true_ref[i]) for i in differ for pref in orders)
    out["pairwise_pairs"] = len(true_policy)
    out["pairwise_pairs_differ"] = len(differ)
    out["pairwise_verdict_accuracy"] = right / max(2 * len(differ), 1)
    out["pairwise_reward_accuracy"] = sum(float(rewards[i]) == float(true_policy[i] > true_ref[i])
                                          for i in differ) / max(len(differ), 1)
    ties = [i for i in range(len(true_policy)) if true_policy[i] == true_ref[i]]
    out["pairwise_ties"] = len(ties)
    out["pairwise_tie_reward_half"] = sum(float(rewards[i]) == 0.5 for i in ties) / max(len(ties), 1)
    out["pairwise_parse_rate"] = sum(float(pref[i]) != -1.0 for pref in orders
                                     for i in range(len(true_policy))) / (2 * len(true_policy))
    out["pairwise_s"] = time.perf_counter() - t0
    return out


# ---------------------------------------------------------------------------------------------- training

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "ppo_core", "demo", "judge-demo"))
    ap.add_argument("--steps", type=int, default=2400)
    ap.add_argument("--hidden", type=int, default=64, help="hidden size (heads of 16, two key/value heads)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval_only", action="store_true", help="measure the judge in --out, train nothing")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # a model this small runs fastest on one thread, and others share the machine
    if args.eval_only:
        for key, value in measure(args.out).items():
            print(f"{key:28s} {value:.4f}" if isinstance(value, float) else f"{key:28s} {value}")
        return
    rng = random.Random(args.seed)

    tok = character_tokenizer(CHARACTERS, special_tokens=[PAD, EOS, UNK], unk_token=UNK)
    pad_id, eos_id = tok.token_to_id(PAD), tok.token_to_id(EOS)
    max_positions = 192
    model = tiny_llama(tok.get_vocab_size(), pad_id, eos_id, hidden_size=args.hidden,
                       intermediate_size=args.hidden * 8 // 3 // 16 * 16, layers=args.layers,
                       max_positions=max_positions)
    held_out = set(eval_prompts(256, seed=0))

    def batches():
        """Batches of rows of similar length (less padding): 16 batches' worth drawn, sorted, cut, shuffled."""
        rows = []
        for _ in range(16 * args.batch):
            judge_prompt, judgement = example(rng, held_out)
            prompt_ids, answer_ids = tok.encode(judge_prompt).ids, tok.encode(judgement).ids + [eos_id]
            rows.append((prompt_ids + answer_ids, [0] * len(prompt_ids) + [1] * len(answer_ids)))
        rows.sort(key=lambda row: len(row[0]))
        chunks = [rows[i : i + args.batch] for i in range(0, len(rows), args.batch)]
        rng.shuffle(chunks)
        for chunk in chunks:
            yield right_pad([ids for ids, _ in chunk], [mask for _, mask in chunk], pad_id)

    def endless():
        while True:
            yield from batches()

    stream = endless()
    _, train_s = train(model, lambda: [next(stream)], args.steps, args.lr, log_every=100)

    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out)
    PPOTokenizer(tok, {"eos_token": EOS, "pad_token": PAD, "unk_token": UNK,
                       "model_max_length": max_positions}).save_pretrained(args.out)
    for name, template in (("pointwise.jinja", POINTWISE_TEMPLATE), ("pairwise.jinja", PAIRWISE_TEMPLATE)):
        with open(os.path.join(args.out, name), "w", encoding="utf-8") as f:
            f.write(template)
    print(f"wrote {os.path.abspath(args.out)} ({model.num_parameters() / 1e6:.2f}M parameters), "
          f"{args.steps} steps in {train_s:.0f}s")
    for key, value in measure(args.out).items():
        print(f"{key:28s} {value:.4f}" if isinstance(value, float) else f"{key:28s} {value}")


if __name__ == "__main__":
    main()
