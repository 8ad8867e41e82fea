"""bench/e2e.py: the pieces that make its comparison fair, and its ppo-core half run as a user runs it (toy shape).

The TRL half needs the bench extra (TRL 1.12 with its own transformers): it runs here only where trl is importable.
"""
import argparse
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from ppo_core.models import model as ppo_model
from ppo_core.models.tokenizer import load_tokenizer

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SCRIPT = os.path.join(ROOT, "bench", "e2e.py")


def load_e2e():
    spec = importlib.util.spec_from_file_location("bench_e2e", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


e2e = load_e2e()


def tiny_policy():
    config = e2e.model_config(argparse.Namespace(config=e2e.DEFAULT_CONFIG, tiny=True))
    policy = e2e.random_weights(ppo_model.CausalLM(ppo_model.ModelArgs.from_hf_config(config)), seed=0)
    return e2e.make_specials_unsampleable(policy, [e2e.EOS_ID, e2e.PAD_ID]), config


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_specials_have_probability_exactly_zero(autocast):
    """EOS and pad cannot be sampled, whatever the (ordinary) input: their softmax probability is exactly 0.0 at
    every position, in fp32 and under CPU bf16 autocast. Exactly 0, no tolerance: the logit gap (~400 here) is far
    past float32's exp underflow (-104), so anything but 0 means the construction broke."""
    policy, config = tiny_policy()
    ids = torch.randint(2, config["vocab_size"], (4, 24), generator=torch.Generator().manual_seed(1))  # [B, T]
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        logits = policy(ids).float()  # [B, T, V]
    probs = logits.softmax(-1)
    assert probs[..., [e2e.EOS_ID, e2e.PAD_ID]].max().item() == 0.0
    # and only those: every ordinary token keeps a positive probability (the model is not otherwise degenerate)
    assert probs[..., 2:].min().item() > 0.0


def test_tokenizer_round_trip_in_both_libraries(tmp_path):
    """The bench tokenizer: "t{i}" is id i; a decoded response starts with a space, so ppo-core's reward model,
    which re-encodes prompt + response as one text, gets exactly the prompt's ids followed by the response's; and
    transformers reads the same ids from the same files as ppo_core.models.tokenizer."""
    e2e.write_tokenizer(str(tmp_path), vocab_size=64)
    tok = load_tokenizer(str(tmp_path))
    assert (tok.eos_token_id, tok.pad_token_id) == (e2e.EOS_ID, e2e.PAD_ID)
    prompt = "t5 t63 t2"
    assert tok.encode_prompt(prompt) == [5, 63, 2]
    response = tok.decode([9, 10, 11])
    assert response == " t9 t10 t11"
    assert tok.encode(prompt + response) == [5, 63, 2, 9, 10, 11]
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf(prompt + response)["input_ids"] == [5, 63, 2, 9, 10, 11]
    assert (hf.eos_token_id, hf.pad_token_id) == (e2e.EOS_ID, e2e.PAD_ID)


def table_rows(output):
    """The main table's rows of the script's output -> {(side, precision): [cells]}."""
    rows = {}
    for line in output.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 12 and cells[1] in ("fp32", "bf16"):
            rows[(cells[0], cells[1])] = cells
    return rows


def test_e2e_tiny_runs_as_a_user_runs_it(tmp_path):
    """`python bench/e2e.py --tiny` in a fresh process: each side in its own subprocess, a row per side and
    precision in which every row decoded exactly --new tokens, both of ppo-core's optimizers stepped once per
    minibatch, and the projections' matmuls ran in fp32 (fp32 row) and in bf16 in every phase (bf16 row)."""
    sides = "ppo-core,trl" if importlib.util.find_spec("trl") else "ppo-core"
    out = subprocess.run([sys.executable, SCRIPT, "--tiny", "--sides", sides, "--precisions", "fp32,bf16",
                          "--iterations", "1", "--workdir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = table_rows(out.stdout)
    assert set(rows) == {(side, p) for side in sides.split(",") for p in ("fp32", "bf16")}, out.stdout
    batch = 8  # --tiny: 8 prompts, one timed iteration
    for (side, precision), cells in rows.items():
        gen, score, update, total = (float(c) for c in cells[2:6])
        assert min(gen, score, update) > 0 and abs(gen + score + update - total) < 0.02  # medians of one iteration,
        # printed to 0.01 s: the sum of three rounded numbers is within 3 * 0.005 of the rounded total
        assert float(cells[6]) > 0  # CPU seconds
        assert cells[9] == f"{batch}/{batch}", cells  # every row: exactly --new tokens, no EOS, no pad
        assert cells[10] == ("2+2" if side == "ppo-core" else "2"), cells  # 2 minibatches: one step each
    assert rows[("ppo-core", "fp32")][8] == "fp32/fp32/fp32"
    assert rows[("ppo-core", "bf16")][8] == "bf16/bf16/bf16"
    if ("trl", "bf16") in rows:  # TRL 1.12 under ACCELERATE_MIXED_PRECISION=bf16: only its update's forward is bf16
        assert rows[("trl", "fp32")][8] == "fp32/fp32/fp32"
        assert rows[("trl", "bf16")][8] == "fp32/fp32/bf16"
    assert "ppo-core, fp32 / bf16" in out.stdout
