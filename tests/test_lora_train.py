"""The PPO loop with LoRA (lora_rank > 0): only the adapters and the critic's head train, the reference is
the policy's own base weights (adapters off), checkpoints hold the merged policy in the Hugging Face layout
plus the adapters, and a run killed mid-rollout resumes to the same bytes."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from ppo_core.models import lora
from ppo_core.models.model import load_model
from ppo_core.train import DEMO_CHECKPOINT
from test_resume import DRIVER

RANK = 4
ARGS = ["--iterations=2", "--save_every=1", "--eval_size=8", "--rollout_batch_size=16", "--minibatch_size=8",
        "--micro_batch_size=8", "--ppo_epochs=1", "--progress=false", f"--lora_rank={RANK}", "--lora_alpha=8",
        "--lr=2e-3", "--dtype=float32"]  # float32: the 2-process tolerances below are its rounding


def trainer(args, cwd, script=("-m", "ppo_core.train")):
    return subprocess.run([sys.executable, *script, *args], capture_output=True, text=True, cwd=cwd, timeout=600)


def metrics(run_dir):
    with open(run_dir / "metrics.jsonl") as f:
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "tokens_per_s"))} for line in f]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    proc = trainer(ARGS + [f"--out={d / 'run'}"], d)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return d / "run"


def test_reference_is_the_base_and_only_adapters_train(lora_run):
    first, second = metrics(lora_run)
    # B starts at zero, so in iteration 1 the policy computes exactly what its base (the reference) does
    assert first["kl/mean"] == 0.0 and first["kl/k3_mean"] == 0.0
    assert second["kl/mean"] != 0.0  # and then the adapters have moved it
    trainable = load_file(str(lora_run / "checkpoints" / "step-2" / "trainable.safetensors"))
    base = load_model(DEMO_CHECKPOINT)
    n_layers, H = base.args.num_hidden_layers, base.args.hidden_size
    adapters = set(lora.lora_state_dict(lora.add_lora(load_model(DEMO_CHECKPOINT), RANK)))  # ...q_proj.lora_A, ...
    assert set(trainable) == ({f"policy.{n}" for n in adapters} | {f"critic.{n}" for n in adapters}
                              | {"critic.score_head.weight"})
    assert len([k for k in trainable if k.startswith("policy.")]) == 7 * 2 * n_layers
    assert trainable["critic.score_head.weight"].shape == (1, H)


def test_checkpoint_policy_is_the_merged_adapted_model(lora_run):
    ckpt = lora_run / "checkpoints" / "step-2"
    merged = load_model(str(ckpt))  # a plain HF checkpoint: no lora tensors in it
    assert not any("lora" in k for k in load_file(str(ckpt / "model.safetensors")))
    adapted = lora.add_lora(load_model(DEMO_CHECKPOINT), RANK, alpha=8)
    trainable = load_file(str(ckpt / "trainable.safetensors"))
    lora.load_lora_state_dict(adapted, {k[len("policy."):]: v for k, v in trainable.items() if k.startswith("policy.")})
    ids = torch.randint(0, merged.args.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, m = adapted(ids).double(), merged(ids).double()
        with lora.adapters_disabled(adapted):
            base = adapted(ids).double()
    # merging rounds W + s B A to float32 once per weight: a few ulps of the logits (|logits| ~ 10)
    assert (a - m).abs().max().item() <= 1e-4
    assert (a - base).abs().max().item() > 1e-2  # training did change the policy
    # the base weights themselves never moved: merged - base weight is exactly the adapters' update
    q = "model.layers.0.self_attn.q_proj"
    delta = adapted.get_submodule(q).delta_weight()
    w0 = load_model(DEMO_CHECKPOINT).get_submodule(q).weight
    assert (merged.get_submodule(q).weight - (w0 + delta)).abs().max().item() <= 1e-6


def test_lora_run_killed_mid_rollout_resumes_identically(lora_run, tmp_path):
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    run_dir = tmp_path / "run"
    # generate calls: two for the 'before' eval, then one an iteration: the 4th is iteration 2's rollout
    killed = trainer(["rollout", "4", *ARGS, f"--out={run_dir}"], tmp_path, script=(str(driver),))
    assert killed.returncode != 0 and not (run_dir / "summary.json").exists()
    resumed = trainer(["--resume", str(run_dir)], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    for name in ("model.safetensors", "trainable.safetensors", "optimizer.safetensors"):
        assert (run_dir / "checkpoints" / "step-2" / name).read_bytes() == (lora_run / "checkpoints" / "step-2" / name).read_bytes(), name
    assert metrics(run_dir) == metrics(lora_run)


def test_lora_under_fsdp_two_processes_match_one(lora_run, tmp_path):
    """Adapters sharded with their frozen base (FSDP2 units mix trainable and frozen parameters); the
    consolidated checkpoint is merged on rank 0 from the gathered base and adapters."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    proc = subprocess.run([*torchrun, "-m", "ppo_core.train", *ARGS, "--parallel=fsdp", f"--out={tmp_path / 'two'}"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for sub in ("model.safetensors", "critic/model.safetensors"):
        a = load_file(str(lora_run / "checkpoints" / "step-2" / sub))
        b = load_file(str(tmp_path / "two" / "checkpoints" / "step-2" / sub))
        assert a.keys() == b.keys() and not any("lora" in k for k in b)
        assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5, sub  # float32 sums in another order
    for m1, m2 in zip(metrics(lora_run), metrics(tmp_path / "two"), strict=True):
        for key in m1:
            tol = 0.02 if key.endswith("clipfrac") else 1e-5
            assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=tol), key
