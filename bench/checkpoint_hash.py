"""What checkpoint manifests cost: the SHA-256 of every file at save (checkpoint.write_manifest) and its check at
resume (checkpoint.verify_step).

    python bench/checkpoint_hash.py                # the default job's checkpoint and a 0.6B one
    python bench/checkpoint_hash.py --skip_large   # the default job's only

Two checkpoints: the default job's after 2 iterations (`ppo-train --iterations 2`: the shipped demo policy and its
critic, both AdamW states), and a Qwen3-0.6B-shaped policy (configs/models/Qwen3-0.6B/config.json) with random
float32 weights, saved as a run's checkpoint without a critic and before its first optimizer step (no AdamW moments:
with them a GRPO checkpoint holds 3x the bytes, and both times below scale with the bytes). Each is saved with
checkpoint.save_checkpoint as the trainer saves it, with write_manifest a no-op ("no hash") and as it is ("hash"),
then verified. The files are in the page cache, as right after a save (a cold resume reads at the disk's speed
instead). Medians of --repeats after one warm-up; the 0.6B checkpoint is written in a temporary directory and
deleted. Times are wall-clock seconds, and for the verify also this process's CPU seconds, which another job on the
machine does not stretch; MB/s: the checkpoint's bytes over each (1 MB = 10^6 bytes). The header gives the load
average the run saw.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from bench.packed_passes import cpu_name  # noqa: E402
from ppo_core.run import checkpoint  # noqa: E402
from ppo_core.models.model import CausalLM, ModelArgs, load_model, load_score_model, read_config  # noqa: E402
from ppo_core.models.tokenizer import load_tokenizer  # noqa: E402
from ppo_core.train import DEMO_CHECKPOINT  # noqa: E402
from random_weights import randomize  # noqa: E402

QWEN3_06B = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "models", "Qwen3-0.6B")


def adamw(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)


def demo_checkpoint(work):
    """The default job after 2 iterations -> what save_checkpoint takes, rebuilt from its final checkpoint."""
    run = os.path.join(work, "demo-run")
    subprocess.run([sys.executable, "-m", "ppo_core.train", "--iterations=2", "--progress=false", f"--out={run}"],
                   check=True, capture_output=True)
    step = checkpoint.latest_checkpoint(run)
    policy, critic = load_model(step), load_score_model(os.path.join(step, "critic"))
    policy_opt, critic_opt = adamw(policy), adamw(critic)
    moments = load_file(os.path.join(step, "optimizer.safetensors"))
    checkpoint.load_optimizer_tensors(policy_opt, moments, "policy")
    checkpoint.load_optimizer_tensors(critic_opt, moments, "critic")
    state = {k: v for k, v in checkpoint.read_state(step).items()
             if k not in ("step", "python_rng", "numpy_rng", "manifest")}
    return dict(policy=policy, critic=critic, tokenizer=load_tokenizer(step), policy_opt=policy_opt,
                critic_opt=critic_opt, state=state)


def qwen3_checkpoint():
    """Qwen3-0.6B's shape, random float32 weights, no critic, AdamW before its first step; the demo's tokenizer (a
    few kB: the weights are the bytes that matter)."""
    policy = randomize(CausalLM(ModelArgs.from_hf_config(read_config(QWEN3_06B))))
    if policy.args.tie_word_embeddings:
        policy.lm_head.weight = policy.model.embed_tokens.weight
    state = {"optimizer_step": 0, "skipped_updates": 0, "kl_controller": {"value": 0.001},
             "prompt_stream": {"seed": 0, "drawn": 0}, "eval_before": 0.0, "eval_before_greedy": 0.0, "last_kl": 0.0}
    return dict(policy=policy, critic=None, tokenizer=load_tokenizer(DEMO_CHECKPOINT), policy_opt=adamw(policy),
                critic_opt=None, state=state)


def measure(name, parts, work, repeats):
    """-> one table row: save without and with the manifest, then verify, medians of `repeats` after a warm-up."""
    run = os.path.join(work, name.split()[0])
    generators = {"sample": torch.Generator().manual_seed(0), "shuffle": torch.Generator().manual_seed(1)}
    real_write_manifest = checkpoint.write_manifest

    def save(hashing):
        checkpoint.write_manifest = real_write_manifest if hashing else (lambda step_dir: None)
        try:
            t = time.perf_counter()
            path = checkpoint.save_checkpoint(run, 1, checkpoint.CheckpointParts(generators=generators, **parts),
                                              keep=1)
            return time.perf_counter() - t, path
        finally:
            checkpoint.write_manifest = real_write_manifest

    save(True)  # warm-up: the directories exist, the allocator and the page cache are warm
    plain = statistics.median(save(False)[0] for _ in range(repeats))
    hashed, path = zip(*(save(True) for _ in range(repeats)))
    path = path[-1]

    def verify():
        t, cpu = time.perf_counter(), time.process_time()
        assert checkpoint.verify_step(path) is True
        return time.perf_counter() - t, time.process_time() - cpu

    wall, cpu = zip(*(verify() for _ in range(repeats)))
    verify_s, verify_cpu = statistics.median(wall), statistics.median(cpu)
    files = json.load(open(os.path.join(path, checkpoint.MANIFEST)))["files"]
    size = sum(entry["bytes"] for entry in files.values())
    shutil.rmtree(run)
    return (f"| {name} | {len(files)} | {size / 1e6:,.1f} MB | {plain:.3f} | {statistics.median(hashed):.3f} | "
            f"{verify_s:.3f} | {verify_cpu:.3f} | {size / 1e6 / verify_s:,.0f} | {size / 1e6 / verify_cpu:,.0f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip_large", action="store_true", help="the default job's checkpoint only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory(prefix="checkpoint-hash-") as work:
        rows.append(measure("default job (demo policy + critic, AdamW moments)", demo_checkpoint(work), work,
                            args.repeats))
        if not args.skip_large:
            parts = qwen3_checkpoint()
            rows.append(measure("Qwen3-0.6B shape, random fp32 weights (no critic, no moments)", parts, work,
                                args.repeats))
            del parts
    print(f"{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {os.getloadavg()[0]:.1f}, "
          f"medians of {args.repeats}, files in the page cache")
    print("| checkpoint | files | bytes | save s, no hash | save s, hash | verify s | verify CPU s | verify MB/s "
          "| MB/s per CPU s |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
