"""Build the tiny SFT checkpoint of the 'toolmul' task: `ppo_core/demo/tool-demo/`, a chat model that multiplies two
3-digit numbers by calling the calculator tool, but only some of the time.

    python scripts/make_tool_checkpoint.py                    # ~5 min on one core of this repository's CPU
    python scripts/make_tool_checkpoint.py --out /tmp/tool --steps 500

1. Builds a character-level tokenizer with the `tokenizers` library: printable ASCII and the newline (every character
   of the calculator's answers and error messages, short of a non-ASCII one the model spells as a JSON \\u escape:
   that is ppo_core.models.tokenizer's UnknownTextError), the special tokens <|endoftext|> (pad), <|im_start|> and <|im_end|>
   (EOS: the end of every turn), and, as Qwen3's tokenizer has them, <tool_call> and </tool_call> as single
   (non-special) tokens. Its chat template renders every message verbatim, so a conversation grows by appending only
   (what ppo_core.agents.environments needs to play it turn by turn):

       <|im_start|>user\\n123*456<|im_end|>\\n<|im_start|>assistant\\n                    (the generation prompt)
       <tool_call>{"name":"calculator","arguments":{"expression":"123*456"}}</tool_call><|im_end|>\\n
       <|im_start|>tool\\n56088<|im_end|>\\n<|im_start|>assistant\\n56088<|im_end|>\\n

   (`tools` is not rendered: the demo's model knows its one tool from training.)
2. Trains a small Llama-family model (tied embeddings, GQA) by supervised fine-tuning, the loss on the assistant's
   tokens only (each turn's closing <|im_end|> included), on conversations of a demonstrator that calls the tool with
   probability P_TOOL, prompt-independent: its first turn is the calculator call above (compact JSON, the prompt's
   expression copied), the tool message carries ppo_core.agents.tools.Calculator's answer, and its second turn copies it.
   Otherwise it answers at once with the rounded product, each operand rounded to the nearest hundred
   (123*456 -> 100*500 = 50000): plausible, and wrong unless both operands are multiples of 100. The model learns the
   JSON, to copy three digits of the prompt into it and five or six digits of the tool's answer out of it, and the
   rounded product (a 10x10 table); it cannot multiply, so its exact match is its tool rate, and an RL policy that
   always calls the tool reaches ~1.0. Greedy decoding takes the most likely first token: the rounded product's first
   digit (~1 - P_TOOL) over <tool_call> (~P_TOOL), so greedy never calls the tool until RL raises P(<tool_call>)
   past one half.
3. Measures, with the rollout engine (ppo_core.engine.RolloutEngine), ppo_core.agents.environments.run_episodes and
   ToolEnvironment({"calculator": Calculator()}, max_turns=3), on the 256 held-out rows tasks.toolmul_rows(256, seed=0)
   (the SFT never sees the first 1024 rows of that set): exact match greedy and sampled at T=1, and the fraction of
   episodes that call the tool, with max_new_tokens=96 per episode and max_turn_tokens=64 per turn (a call is 61
   tokens with its <|im_end|>; a whole tool episode at most 94 after its 26-token prompt). Then writes the Hugging Face
   layout: config.json, model.safetensors, tokenizer.json, tokenizer_config.json (chat_template, eos and pad tokens).
   Deterministic for a given seed on a given machine.

Measured 2026-12-04 on the development machine (2-core AMD EPYC, one thread), the shipped checkpoint (0.19M
parameters, 770 KB): 2000 steps of 64 conversations in 280 s of training (283 s in all), final SFT loss 0.025 (the
floor, the entropy of the tool-or-not choice, is ~0.023); on the 256 held-out rows, sampled at T=1: tool rate 0.3359,
exact match 0.3359 (every called episode right; seeds 1-3 give 0.352 / 0.379 / 0.355, one wrong copy in 279 calls);
greedy: tool rate 0.0039, exact match 0.0039 (the other 255 answers are the rounded product). Forced to open with
<tool_call> (the first token fixed, the rest decoded): exact match 1.0000 greedy, 0.9961 at T=1, so the headroom for
RL is ~0.66 sampled and ~1.0 greedy. Rebuilt, the same model.safetensors byte for byte; transformers 5.25 loads it
with the same logits and renders the same template.
"""
import argparse
import json
import os
import random
import string
import sys
import time

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from ppo_core.engine import RolloutEngine  # noqa: E402
from ppo_core.agents.environments import ToolEnvironment, run_episodes  # noqa: E402
from ppo_core.data.tasks import ToolmulStream, toolmul_rows  # noqa: E402
from ppo_core.models.tokenizer import Tokenizer as PPOTokenizer  # noqa: E402
from ppo_core.agents.tools import TOOL_CALL_END, TOOL_CALL_START, Calculator  # noqa: E402
from sft import right_pad, tiny_llama, train  # noqa: E402  (scripts/sft.py: model, SFT loop)

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHARACTERS = "\n" + "".join(c for c in string.printable if c not in "\t\r\x0b\x0c\n")  # newline, then ' ' .. '~'
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
P_TOOL = 0.35
"""How often the demonstrator calls the calculator (whatever the prompt)."""
MAX_NEW_TOKENS, MAX_TURN_TOKENS = 96, 64
"""The episode's token budget after its prompt (turns and observations) and one turn's, as measured."""
HELD_OUT_SEED, HELD_OUT_RESERVED = 0, 1024
"""The held-out rows are toolmul_rows(n, HELD_OUT_SEED); SFT skips the first HELD_OUT_RESERVED of them (any eval_size
up to that)."""
CALCULATOR = Calculator()


def build_tokenizer() -> PPOTokenizer:
    """One token a character (CHARACTERS), the three special tokens, and the two tool-call tags as single tokens."""
    vocab = {token: i for i, token in enumerate([PAD, IM_START, IM_END, *CHARACTERS, TOOL_CALL_START, TOOL_CALL_END])}
    # "<unk>" is in no vocabulary: a character outside CHARACTERS is ppo_core.models.tokenizer's UnknownTextError, not a token
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # a token a character, "\n" too
    tok.decoder = decoders.Fuse()  # decode by concatenation
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (PAD, IM_START, IM_END)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (TOOL_CALL_START, TOOL_CALL_END)])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": IM_END, "pad_token": PAD, "bos_token": None,
              "model_max_length": 128, "chat_template": CHAT_TEMPLATE}
    return PPOTokenizer(tok, config)


def tool_call(expression: str) -> str:
    """The demonstrator's call: <tool_call>{"name":"calculator","arguments":{"expression":"123*456"}}</tool_call>."""
    body = json.dumps({"name": "calculator", "arguments": {"expression": expression}}, separators=(",", ":"))
    return TOOL_CALL_START + body + TOOL_CALL_END


def rounded_product(prompt: str) -> str:
    """Each operand rounded to the nearest hundred, then multiplied: "123*456" -> 100*500 -> "50000"."""
    a, b = (int(x) for x in prompt.split("*"))
    return str((a + 50) // 100 * ((b + 50) // 100) * 10000)


def demonstration(row: dict, rng: random.Random, p_tool: float = P_TOOL) -> list[dict]:
    """The whole conversation of the demonstrator on `row`: with probability p_tool the calculator call, the tool's
    answer and that answer copied; otherwise the rounded product at once."""
    user = {"role": "user", "content": row["prompt"]}
    if rng.random() < p_tool:
        result = CALCULATOR({"expression": row["prompt"]})
        return [user, {"role": "assistant", "content": tool_call(row["prompt"])}, {"role": "tool", "content": result},
                {"role": "assistant", "content": result}]
    return [user, {"role": "assistant", "content": rounded_product(row["prompt"])}]


def encode_conversation(tok: PPOTokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """-> (ids, loss mask) of CHAT_TEMPLATE's rendering of `messages`: mask 1 on an assistant message's content and the
    <|im_end|> that closes it (what the policy writes in an episode), 0 elsewhere. Built a piece at a time, which
    this template allows (it renders each message on its own); main() checks it against apply_chat_template."""
    ids, mask = [], []
    for message in messages:
        policy = int(message["role"] == "assistant")
        for text, m in ((f"{IM_START}{message['role']}\n", 0), (message["content"] + IM_END, policy), ("\n", 0)):
            piece = tok.encode(text)
            ids += piece
            mask += [m] * len(piece)
    return ids, mask


@torch.no_grad()
def evaluate(model, tok, rows, greedy, seed=0) -> dict:
    """Play one ToolEnvironment episode per row on the rollout engine -> exact match (the mean reward), tool rate (the
    fraction of episodes with a tool call), exact match among the episodes that called the tool, malformed calls."""
    model.eval()
    envs = [ToolEnvironment({"calculator": CALCULATOR}, max_turns=3) for _ in rows]
    episodes = run_episodes(RolloutEngine(model), tok, envs, rows, max_new_tokens=MAX_NEW_TOKENS,
                            max_turn_tokens=MAX_TURN_TOKENS, greedy=greedy, seed=seed, temperature=1.0)
    model.train()
    called = [e.reward for e, env in zip(episodes, envs) if env.counts["tool_calls"] > 0]
    return {"exact_match": sum(e.reward for e in episodes) / len(episodes), "tool_rate": len(called) / len(episodes),
            "exact_match_with_tool": sum(called) / max(1, len(called)),
            "malformed_calls": sum(env.counts["malformed_calls"] for env in envs)}


def summary(metrics: dict) -> str:
    return (f"exact match {metrics['exact_match']:.4f}, tool rate {metrics['tool_rate']:.4f} (exact match when called "
            f"{metrics['exact_match_with_tool']:.4f}, malformed calls {metrics['malformed_calls']})")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "ppo_core", "demo", "tool-demo"))
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--p_tool", type=float, default=P_TOOL)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval_every", type=int, default=500, help="steps between held-out evaluations (0: none)")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # a model this small runs fastest on one thread
    rng = random.Random(args.seed)
    t0 = time.perf_counter()

    tok = build_tokenizer()
    for messages in (demonstration({"prompt": "123*456"}, random.Random(s)) for s in range(8)):  # both shapes
        ids, _ = encode_conversation(tok, messages)
        assert ids == tok.apply_chat_template(messages), "the pieces must be the template's own rendering"
    # max_positions: a 26-token prompt + MAX_NEW_TOKENS
    model = tiny_llama(tok.vocab_size, tok.pad_token_id, tok.eos_token_id, max_positions=128)
    held_out = toolmul_rows(256, seed=HELD_OUT_SEED)
    stream = ToolmulStream(args.seed, [r["prompt"] for r in toolmul_rows(HELD_OUT_RESERVED, seed=HELD_OUT_SEED)])

    def batch():
        """Two padded batches, the conversations with a tool call (~120 tokens) and those without (~33): padding them
        together would spend most of the step on padding."""
        conversations = [demonstration(row, rng, args.p_tool) for row in stream.next_batch(args.batch)]
        batches = []
        for group in ([c for c in conversations if len(c) > 2], [c for c in conversations if len(c) == 2]):
            if group:
                encoded = [encode_conversation(tok, c) for c in group]
                batches.append(right_pad([ids for ids, _ in encoded], [mask for _, mask in encoded], tok.pad_token_id))
        return batches

    def held_out_evaluation(step):
        if args.eval_every and step % args.eval_every == args.eval_every - 1 and step != args.steps - 1:
            print(f"    held-out, sampled at T=1: {summary(evaluate(model, tok, held_out, greedy=False))}", flush=True)

    loss, train_s = train(model, batch, args.steps, args.lr, log_every=250, after_step=held_out_evaluation)

    greedy, sampled = evaluate(model, tok, held_out, greedy=True), evaluate(model, tok, held_out, greedy=False)
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    print(f"held-out ({len(held_out)} rows), greedy: {summary(greedy)}")
    print(f"held-out ({len(held_out)} rows), sampled at T=1: {summary(sampled)}")
    print(f"wrote {os.path.abspath(args.out)} ({model.num_parameters() / 1e6:.2f}M parameters): "
          f"{args.steps} steps in {train_s:.0f}s of training, final SFT loss {loss:.4f}, "
          f"{time.perf_counter() - t0:.0f}s in all")


if __name__ == "__main__":
    main()
