"""A reward-model checkpoint as the PPO reward source (and the critic's initialisation), scored as
transformers scores it."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

import ppo_core.train as train
from ppo_core.config import build_config
from ppo_core.rewards.reward_model import RewardModelReward
from ppo_core.train import DEMO_CHECKPOINT
from ppo_core.models.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    """A small random LlamaForSequenceClassification over the demo tokenizer, written by transformers."""
    path = tmp_path_factory.mktemp("rm")
    tok = load_tokenizer(DEMO_CHECKPOINT)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=48, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3,
                                      num_labels=1, pad_token_id=tok.pad_token_id, max_position_embeddings=64)
    model = transformers.LlamaForSequenceClassification(config).eval()
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{DEMO_CHECKPOINT}/{name}", path / name)
    return path, model, tok


def test_reward_model_scores_match_transformers(reward_model_dir):
    path, hf_model, tok = reward_model_dir
    cfg = build_config(overrides={"reward_model": str(path)})
    source = RewardModelReward(str(path), cfg, "cpu", torch.float32, batch_size=3)
    prompts = ["abc=", "kitten=", "xy=", "hello=", "q="]
    responses = ["cba", "nettik", "yxq", "", "q"]
    got, metrics = source(prompts, responses)
    assert metrics == {}  # a reward model has no components
    want = []
    for p, r in zip(prompts, responses):  # one at a time: no padding at all on the reference side
        ids = torch.tensor([tok.encode(p + r)])
        with torch.no_grad():
            want.append(hf_model(input_ids=ids).logits[0, 0].item())
    assert got.dtype == torch.float32 and got.shape == (5,)
    assert torch.allclose(got, torch.tensor(want), atol=1e-5, rtol=0)


def test_ppo_with_reward_model_and_critic_from_it(reward_model_dir, tmp_path):
    path, _, _ = reward_model_dir
    argv = [f"--reward_model={path}", f"--critic={path}", "--iterations=1", "--eval_size=8",
            "--rollout_batch_size=16", "--minibatch_size=16", "--micro_batch_size=16", "--ppo_epochs=1",
            "--progress=false", f"--out={tmp_path / 'r'}"]
    assert train.main(argv) == 0
    assert (tmp_path / "r" / "checkpoints" / "step-1" / "critic" / "model.safetensors").exists()


def test_reward_model_and_reward_fn_conflict(tmp_path, capsys):
    assert train.main(["--reward_model=x", "--reward_fn=a:b", f"--out={tmp_path}/r"]) == 2
    assert "'reward_model' conflicts with reward_fn" in capsys.readouterr().err


def test_sharded_reward_model_under_fsdp_matches_one_process(reward_model_dir, tmp_path):
    """parallel=fsdp shards the frozen reward model's blocks (its score head, read outside forward, stays
    whole) and the reference; 2 processes under torchrun give the run of 1 process."""
    path, _, _ = reward_model_dir
    argv = [f"--reward_model={path}", f"--critic={path}", "--iterations=1", "--eval_size=8",
            "--rollout_batch_size=16", "--minibatch_size=16", "--micro_batch_size=4", "--ppo_epochs=1",
            "--progress=false", "--parallel=fsdp", "--dtype=float32"]  # float32: the tolerances below are its rounding
    assert train.main(argv + [f"--out={tmp_path / 'one'}"]) == 0
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    proc = subprocess.run([*torchrun, "-m", "ppo_core.train", *argv, f"--out={tmp_path / 'two'}"], capture_output=True,
                          text=True, cwd=tmp_path, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for sub in ("model.safetensors", "critic/model.safetensors"):
        a = load_file(str(tmp_path / "one" / "checkpoints" / "step-1" / sub))
        b = load_file(str(tmp_path / "two" / "checkpoints" / "step-1" / sub))
        assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5, sub
    m1, m2 = (json.loads((tmp_path / d / "metrics.jsonl").read_text()) for d in ("one", "two"))
    assert m1["reward/mean"] == pytest.approx(m2["reward/mean"], abs=1e-6)  # the same scores from the shards
