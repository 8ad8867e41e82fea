"""ppo-eval (ppo_core/evaluate.py): its scores against brute force and hand-worked cases, the command end to end on the
shipped arith checkpoint against a plain greedy loop and transformers, a run's own held-out numbers reproduced, and
bad input refused in one line."""
import hashlib
import itertools
import json
import math
import os
import subprocess
import sys
from fractions import Fraction

import pytest
import torch

from ppo_core.data.tasks import arith_rewards, eval_prompts
from ppo_core.evaluate import majority_answer, mean_se, pass_at_k, scores
from ppo_core.models.model import load_model
from ppo_core.models.tokenizer import load_tokenizer
from ppo_core.rewards.verifiers import extract_answer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARITH_DEMO = os.path.join(ROOT, "ppo_core", "demo", "arith-demo")


def ppo_eval(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "ppo_core.evaluate", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=600)


def read_json(path):
    with open(path) as f:
        return json.load(f)


# ---------------------------------------------------------------------------- the scores

def brute_force_pass_at_k(correct: list, k: int) -> Fraction:
    """The share of all k-subsets of the samples that hold a correct one, counted."""
    subsets = list(itertools.combinations(range(len(correct)), k))
    return Fraction(sum(any(correct[i] for i in s) for s in subsets), len(subsets))


def test_pass_at_k_is_the_share_of_k_subsets_with_a_correct_sample():
    for n in range(1, 8):
        for c in range(n + 1):
            correct = [False] * (n - c) + [True] * c  # where the correct samples sit does not matter
            for k in range(1, n + 1):
                assert abs(pass_at_k(n, c, k) - brute_force_pass_at_k(correct, k)) <= 1e-15, (n, c, k)
    # large n: the product against the exact ratio of binomials, where C(200, 100) overflows a float
    exact = 1 - Fraction(math.comb(197, 100), math.comb(200, 100))
    assert abs(pass_at_k(200, 3, 100) - exact) <= 1e-15
    assert pass_at_k(10, 0, 5) == 0.0 and pass_at_k(10, 6, 5) == 1.0 and pass_at_k(4, 1, 1) == 0.25


def test_majority_answer_and_its_ties():
    assert majority_answer(["3", "4", "4"]) == 1  # "4" twice: its first sample stands for it
    assert majority_answer(["4", "3", "3", "4"]) == 0  # a tie: the answer seen first wins
    assert majority_answer(["3", "4", "3", "4"]) == 0
    assert majority_answer([None, "7", None]) == 1  # no answer does not vote
    assert majority_answer([None, None]) is None
    assert majority_answer(["x", "0.5", "1/2"]) == 1  # one number written two ways: two votes against one
    assert majority_answer(["1,000", "1000", "999", "999", "999"]) == 2  # 3 votes beat 2
    assert majority_answer(["abc", "abd", "abd"]) == 1  # text answers compare as text


def test_scores_hand_worked():
    """Three prompts, three samples each, threshold 1."""
    rewards = [[1.0, 0.0, 1.0],   # c = 2; answers 7 7 8: the majority 7 is the first sample's, correct
               [0.0, 0.0, 0.5],   # c = 0
               [0.0, 1.0, 0.0]]   # c = 1; answers 3 4 3: the majority 3 is wrong although a sample is right
    answers = [["7", "7", "8"], ["1", None, "2"], ["3", "4", "3"]]  # prompt 2: a tie of 1 and 2 -> "1", wrong
    greedy = [1.0, 0.5, 0.0]
    s = scores(rewards, greedy, answers, 1.0, [1, 2, 3])
    assert s["greedy"]["mean"] == pytest.approx(1 / 3, abs=1e-15)
    assert s["greedy_reward"]["mean"] == pytest.approx(0.5, abs=1e-15)
    # pass@1 per prompt: c / n = 2/3, 0, 1/3; pass@2: 1 - C(1,2)/C(3,2) = 1, 0, 1 - C(2,2)/C(3,2) = 2/3; pass@3: 1, 0, 1
    for k, per_prompt in ((1, [2 / 3, 0, 1 / 3]), (2, [1, 0, 2 / 3]), (3, [1, 0, 1])):
        mean = sum(per_prompt) / 3
        sd = math.sqrt(sum((v - mean) ** 2 for v in per_prompt) / 2)
        assert s[f"pass@{k}"]["mean"] == pytest.approx(mean, abs=1e-15)
        assert s[f"pass@{k}"]["se"] == pytest.approx(sd / math.sqrt(3), abs=1e-15)
    assert s["maj@3"]["mean"] == pytest.approx(1 / 3, abs=1e-15)  # only prompt 0's majority is right
    assert s["mean@3"]["mean"] == pytest.approx((2 / 3 + 0.5 / 3 + 1 / 3) / 3, abs=1e-15)
    assert mean_se([1, 0, 0, 1]) == {"mean": 0.5, "se": pytest.approx(math.sqrt(1 / 3) / 2, abs=1e-15)}
    assert mean_se([0.25]) == {"mean": 0.25, "se": None}


# ---------------------------------------------------------------------------- the command on the arith checkpoint

N, K, PROMPTS = 4, [1, 2, 4], 24


@pytest.fixture(scope="module")
def arith_eval(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "eval.json"
    proc = ppo_eval("--task=arith", f"--eval_size={PROMPTS}", f"--n={N}", "--k", "1,2,4", "--dtype=float32",
                    "--device=cpu", f"--out={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_json(out), proc


def manifest_hash(directory) -> str:
    """checkpoint.py's manifest of a directory, built here from the files and hashed."""
    files = {}
    for root, _, names in os.walk(directory):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), directory).replace(os.sep, "/")
            if rel != "manifest.json":
                data = open(os.path.join(root, name), "rb").read()
                files[rel] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest = {"format": 1, "files": dict(sorted(files.items()))}
    return hashlib.sha256(json.dumps(manifest, indent=1).encode()).hexdigest()


def test_eval_json_holds_the_scores_and_the_protocol(arith_eval):
    result, proc = arith_eval
    p = result["protocol"]
    assert (p["n"], p["k"], p["temperature"], p["top_p"], p["max_new_tokens"], p["seed"]) == (N, K, 1.0, 1.0, 12, 0)
    assert (p["chat_template"], p["threshold"], p["answer"], p["device"]) == (False, 1.0, "final", "cpu")
    assert p["checkpoint"] == ARITH_DEMO and p["checkpoint_manifest_sha256"] == manifest_hash(ARITH_DEMO)
    assert p["versions"]["torch"] == torch.__version__ and p["precision"]["matmuls"] == "float32"
    assert p["ppo_core_commit"] is None or len(p["ppo_core_commit"].removesuffix("-dirty")) == 40
    rows = result["rows"]
    assert result["prompts"] == len(rows) == PROMPTS
    assert [r["prompt"] for r in rows] == eval_prompts(PROMPTS, 0, "arith")  # ppo-train's held-out set of the task
    # every score recomputed from the rows, independently: pass@k by counting subsets, the majority by hand
    for r in rows:
        assert r["rewards"] == arith_rewards([r["prompt"]] * N, r["responses"])
        assert r["answers"] == [extract_answer(text) for text in r["responses"]]
    for k in K:
        per_prompt = [float(brute_force_pass_at_k([x >= 1 for x in r["rewards"]], k)) for r in rows]
        assert result["scores"][f"pass@{k}"]["mean"] == pytest.approx(sum(per_prompt) / PROMPTS, abs=1e-12)
    majority_right = 0
    for r in rows:
        votes = [a for a in r["answers"] if a is not None]
        if votes:
            best = max(votes.count(a) for a in votes)
            first = next(a for a in votes if votes.count(a) == best)
            majority_right += r["rewards"][r["answers"].index(first)] >= 1
    assert result["scores"][f"maj@{N}"]["mean"] == pytest.approx(majority_right / PROMPTS, abs=1e-12)
    greedy = [r["greedy_reward"] for r in rows]
    assert result["scores"]["greedy"]["mean"] == pytest.approx(sum(g >= 1 for g in greedy) / PROMPTS, abs=1e-12)
    assert 0 < result["scores"]["greedy"]["mean"] < 1  # the checkpoint forgets some carries: both kinds of rows
    # the printed table names each score with its value
    for name, stat in result["scores"].items():
        assert f"{name:<16}{stat['mean']:>8.4f}" in proc.stdout


def plain_greedy(model, ids, eos, max_new_tokens) -> list:
    """Greedy decoding of one prompt, a full forward per token (no cache, no batch)."""
    out = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids + out]))[0, -1]
            token = int(logits.argmax())
            out.append(token)
            if token in eos:
                break
    return out


def test_greedy_equals_a_plain_loop_one_prompt_at_a_time(arith_eval):
    result, _ = arith_eval
    model, tok = load_model(ARITH_DEMO).eval(), load_tokenizer(ARITH_DEMO)
    for row in result["rows"]:
        tokens = plain_greedy(model, tok.encode_prompt(row["prompt"]), tok.eos_token_ids, 12)
        text = tok.decode(tokens)
        assert text == row["greedy"], row["prompt"]
        assert arith_rewards([row["prompt"]], [text]) == [row["greedy_reward"]]


def test_greedy_equals_transformers_generate(arith_eval):
    transformers = pytest.importorskip("transformers")
    result, _ = arith_eval
    hf = transformers.AutoModelForCausalLM.from_pretrained(ARITH_DEMO).eval()
    tok = load_tokenizer(ARITH_DEMO)
    for row in result["rows"][:6]:
        ids = torch.tensor([tok.encode_prompt(row["prompt"])])
        with torch.no_grad():
            new = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                              eos_token_id=tok.eos_token_ids, pad_token_id=0)[0, ids.shape[1]:].tolist()
        assert tok.decode([t for t in new if t not in tok.eos_token_ids and t != 0]) == row["greedy"], row["prompt"]


def test_one_sample_reproduces_a_runs_own_held_out_numbers(tmp_path):
    """ppo-train's evaluations and ppo-eval share the code and the seed: on a run's final checkpoint, ppo-eval --run
    with n=1 gives summary.json's sampled and greedy held-out rewards (averaged there in float32, here in float64:
    1e-7 apart at most); the checkpoint's manifest hash is the SHA-256 of its manifest.json."""
    run = tmp_path / "run"
    train = subprocess.run([sys.executable, "-m", "ppo_core.train", "--task=arith", "--iterations=2", "--eval_size=16",
                            "--rollout_batch_size=8", "--progress=false", f"--out={run}"], capture_output=True,
                           text=True, cwd=ROOT, timeout=600)
    assert train.returncode == 0, train.stderr[-3000:]
    proc = ppo_eval("--run", str(run), "--n=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary, result = read_json(run / "summary.json"), read_json(run / "eval.json")
    assert result["scores"]["mean@1"]["mean"] == pytest.approx(summary["eval/reward_after"], abs=1e-7)
    assert result["scores"]["greedy_reward"]["mean"] == pytest.approx(summary["eval/greedy_reward_after"], abs=1e-7)
    step = run / "checkpoints" / "step-2"
    assert result["protocol"]["checkpoint"] == str(step)
    with open(step / "manifest.json", "rb") as f:
        assert result["protocol"]["checkpoint_manifest_sha256"] == hashlib.sha256(f.read()).hexdigest()


# ---------------------------------------------------------------------------- bad input

def test_bad_input_is_one_line_and_exit_2(tmp_path):
    not_a_checkpoint = tmp_path / "empty"
    not_a_checkpoint.mkdir()
    no_answer = tmp_path / "rows.jsonl"
    no_answer.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in eval_prompts(8, 0, "arith")))
    out = tmp_path / "eval.json"
    for args, message in [
        ([f"--policy={not_a_checkpoint}"], "config key 'policy'"),
        ([f"--policy={tmp_path / 'nowhere'}"], "no such directory"),
        (["--task=arith", "--n=4", "--k=1,8"], "--k 8: pass@k needs 1 <= k <= n, and --n is 4"),
        (["--task=arith", "--n=0"], "--n must be at least 1"),
        ([f"--run={tmp_path}"], f"--run: {tmp_path} holds no run (no config.json)"),
        (["--task=arith", f"--prompts_file={no_answer}", "--reward_fn=ppo_core.data.tasks:arith_answer_reward"],
         "needs column 'answer'"),
        (["--task=arith", "--answer=vote"], "--answer 'vote'"),
        (["--task=arith", f"--out={tmp_path / 'no' / 'eval.json'}"], "no such directory"),
    ]:
        proc = ppo_eval(f"--out={out}", *args, "--eval_size=4")  # a later --out wins
        assert proc.returncode == 2, (args, proc.stderr[-2000:])
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("ppo-eval: error: "), proc.stderr
        assert message in proc.stderr, (message, proc.stderr)
        assert not out.exists()
