"""Data parallelism under real `torchrun` with the gloo backend: 2 processes compute the same update
as 1 process on the same global batch, with DDP (the default) and with FSDP2, and a 2-process run killed
mid-rollout resumes identically (FSDP: from its sharded checkpoint)."""
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import background

from ppo_core.train import DEMO_CHECKPOINT
from test_resume import DRIVER

ARGS = ["--rollout_batch_size=16", "--minibatch_size=8", "--micro_batch_size=4", "--ppo_epochs=1",
        "--eval_size=8", "--progress=false", "--save_every=1", "--dtype=float32"]  # bf16: test_..._in_bf16 below
WALL_CLOCK = ("time/", "tokens_per_s")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]


def one_thread_env():
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def launch(cmd, cwd):
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=600, env=one_thread_env())


def side_by_side(*cmds, cwd):
    """Launch every command at once (a run and the run it must equal: one process and torchrun's two, on 2 cores),
    each checked for exit status 0 -> their CompletedProcess, in order."""
    procs = background.together(*[(cmd, cwd, one_thread_env()) for cmd in cmds])
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return procs


def weights(run_dir, step):
    return load_file(str(run_dir / "checkpoints" / f"step-{step}" / "model.safetensors"))


def metrics(run_dir):
    with open(run_dir / "metrics.jsonl") as f:
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(WALL_CLOCK)} for line in f]


def assert_same_run(one, two, step):
    a, b = weights(one, step), weights(two, step)
    assert a.keys() == b.keys()
    # float32: the two processes sum the same gradients in a different order
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5
    for m1, m2 in zip(metrics(one), metrics(two), strict=True):
        assert m1.keys() == m2.keys()
        for key in m1:
            # clip fractions count tokens across a threshold: allow one token of an 8-sequence minibatch
            tol = 0.02 if key.endswith("clipfrac") else 1e-5
            assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=tol), key


def assert_identical_runs(one, two, step):
    """Byte for byte: the same weights and every metric of `one` equal in `two` (a worker run adds its own time/ and
    off_policy/staleness keys)."""
    a, b = weights(one, step), weights(two, step)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for m1, m2 in zip(metrics(one), metrics(two), strict=True):
        assert m1 == {k: v for k, v in m2.items() if k in m1}


TOKEN_MEAN = ARGS + ["--iterations=2", "--loss_agg=token-mean"]


def reference_runs():
    """The module's reference runs, key -> (command, working directory): TOKEN_MEAN in one process, in two (DDP)
    and in two FSDP processes, into the directory "dp"; STALE in one process and with a rollout worker (below),
    into "stale"."""
    dp, stale = pathlib.Path(background.directory("dp")), pathlib.Path(background.directory("stale"))
    train = ["-m", "ppo_core.train"]
    return {"dp-one": ([sys.executable, *train, *TOKEN_MEAN, f"--out={dp / 'one'}"], dp),
            "dp-two": (TORCHRUN + [*train, *TOKEN_MEAN, f"--out={dp / 'two'}"], dp),
            "dp-fsdp": (TORCHRUN + [*train, *TOKEN_MEAN, "--parallel=fsdp", f"--out={dp / 'fsdp'}"], dp),
            "stale-one": ([sys.executable, *train, *STALE, f"--out={stale / 'one'}"], stale),
            "stale-two": (TORCHRUN + [*train, *STALE, "--rollout_ranks=1", f"--out={stale / 'two'}"], stale)}


def reference_run(key):
    cmd, cwd = reference_runs()[key]
    proc = background.result(key, cmd, cwd, one_thread_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def start_reference_runs(*keys):
    for key, (cmd, cwd) in reference_runs().items():
        if key in keys:
            background.start(key, cmd, cwd, one_thread_env())


# started as the suite begins (tests/background.py)
BACKGROUND = {"token_mean_runs": lambda: start_reference_runs("dp-one", "dp-two"),
              "fsdp_run": lambda: start_reference_runs("dp-fsdp"),
              "stale_runs": lambda: start_reference_runs("stale-one", "stale-two")}


@pytest.fixture(scope="module")
def token_mean_runs():
    """TOKEN_MEAN in one process and in two (DDP) -> (their directory, holding one/ and two/, the arguments)."""
    reference_run("dp-one")
    reference_run("dp-two")
    return pathlib.Path(background.directory("dp")), TOKEN_MEAN


def test_two_processes_match_one_token_mean(token_mean_runs):
    d, _ = token_mean_runs
    assert_same_run(d / "one", d / "two", step=2)


def test_two_processes_match_one_in_bf16(tmp_path):
    """bf16-mixed, DDP, one iteration of one optimizer step (the whole batch is the minibatch: every ratio is 1 up to
    rounding). Each process multiplies its own rows (bf16 operands, fp32 accumulation, outputs rounded to bf16) and
    a micro-batch's weight gradient leaves its bf16 GEMM rounded to bf16 before the fp32 sum, so 1 and 2 processes
    differ where those roundings fall differently: the losses and gradient norms by bf16's relative 2^-8 at most.
    The weights: Adam's first step is lr * g / |g| per element, so an element whose gradient sign the rounding flips
    (a sum of terms that nearly cancel) moves the other way; the difference is held to 2^-4 of the update's norm
    (measured: 2%)."""
    args = [a.replace("--dtype=float32", "--dtype=bf16-mixed") for a in ARGS if not a.startswith("--minibatch_size")]
    args += ["--minibatch_size=16", "--iterations=1"]
    _, double = side_by_side([sys.executable, "-m", "ppo_core.train", *args, f"--out={tmp_path / 'one'}"],
                             TORCHRUN + ["-m", "ppo_core.train", *args, f"--out={tmp_path / 'two'}"], cwd=tmp_path)
    assert "non-finite" not in double.stderr and "bfloat16 autocast" in double.stderr
    start = load_file(os.path.join(DEMO_CHECKPOINT, "model.safetensors"))
    a, b = weights(tmp_path / "one", 1), weights(tmp_path / "two", 1)
    update = sum(((a[k] - start[k]) ** 2).sum() for k in a) ** 0.5
    assert sum(((a[k] - b[k]) ** 2).sum() for k in a) ** 0.5 <= 2.0 ** -4 * update
    (m1,), (m2,) = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert m1["train/skipped_updates"] == m2["train/skipped_updates"] == 0 and m1["train/steps"] == 1
    for key in m1:
        tol = 0.02 if key.endswith("clipfrac") else 1e-6  # clip fractions: one token of an 8-sequence minibatch
        assert m1[key] == pytest.approx(m2[key], rel=2.0 ** -8, abs=tol), key


def test_two_processes_match_one_seq_mean(tmp_path):
    args = ARGS + ["--iterations=1", "--loss_agg=seq-mean-token-mean"]
    side_by_side([sys.executable, "-m", "ppo_core.train", *args, f"--out={tmp_path / 'one'}"],
                 TORCHRUN + ["-m", "ppo_core.train", *args, f"--out={tmp_path / 'two'}"], cwd=tmp_path)
    assert_same_run(tmp_path / "one", tmp_path / "two", step=1)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_match_one_grpo_groups(tmp_path, parallel):
    """GRPO, 4 prompts x 4 responses: each process holds 2 whole groups, the groups' statistics are over the global
    batch; with dynamic sampling on, the kept groups are chosen globally. No critic anywhere."""
    args = ARGS + ["--iterations=2", "--adv_estimator=grpo", "--n_samples_per_prompt=4", "--rollout_batch_size=4",
                   "--filter_groups", "--filter_groups_max_batches=2"]
    side_by_side([sys.executable, "-m", "ppo_core.train", *args, f"--out={tmp_path / 'one'}"],
                 TORCHRUN + ["-m", "ppo_core.train", *args, f"--parallel={parallel}", f"--out={tmp_path / 'two'}"],
                 cwd=tmp_path)
    assert_same_run(tmp_path / "one", tmp_path / "two", step=2)
    assert not (tmp_path / "two" / "checkpoints" / "step-2" / "critic").exists()
    assert all(r["filter/batches"] >= 1 for r in metrics(tmp_path / "two"))


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_match_one_packed(tmp_path, parallel):
    """Packed micro-batches (micro_batch_tokens): each minibatch's rows are split across the processes by token count,
    not by which process sampled them, and each process runs as many micro-batches as the busiest (FSDP's collectives
    pair up); scoring passes pad their count likewise. The update is 1 process's up to the order of sums."""
    args = [a for a in ARGS if not a.startswith("--micro_batch_size")]
    args += ["--iterations=2", "--micro_batch_tokens=48", "--adv_estimator=grpo", "--n_samples_per_prompt=4",
             "--rollout_batch_size=4"]
    side_by_side([sys.executable, "-m", "ppo_core.train", *args, f"--out={tmp_path / 'one'}"],
                 TORCHRUN + ["-m", "ppo_core.train", *args, f"--parallel={parallel}", f"--out={tmp_path / 'two'}"],
                 cwd=tmp_path)
    assert_same_run(tmp_path / "one", tmp_path / "two", step=2)


def kill_mid_rollout_and_resume(args, tmp_path):
    """A 2-process run SIGKILLed in its 2nd iteration's rollout, then resumed under torchrun -> its dir."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    run_dir = tmp_path / "run"
    # each process's 4th generate call is the 2nd iteration's rollout (two eval calls come first)
    killed = launch(TORCHRUN + [str(driver), "rollout", "4", *args, f"--out={run_dir}"], tmp_path)
    assert killed.returncode != 0 and not (run_dir / "summary.json").exists()
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-1"
    resumed = launch(TORCHRUN + ["-m", "ppo_core.train", "--resume", str(run_dir)], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return run_dir


def assert_bitwise_same_run(one, two, step):
    """Same processes, same order of operations: the same bytes, policy and critic, and the same metrics."""
    for sub in ("model.safetensors", "critic/model.safetensors"):
        a = load_file(str(one / "checkpoints" / f"step-{step}" / sub))
        b = load_file(str(two / "checkpoints" / f"step-{step}" / sub))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), sub
    assert metrics(one) == metrics(two)


def test_two_process_run_killed_mid_rollout_resumes_identically(token_mean_runs, tmp_path):
    d, args = token_mean_runs
    assert_bitwise_same_run(d / "two", kill_mid_rollout_and_resume(args, tmp_path), step=2)


# ---------------------------------------------------------------------------- FSDP2 (parallel=fsdp)

@pytest.fixture(scope="module")
def fsdp_run(token_mean_runs):
    d, args = token_mean_runs
    reference_run("dp-fsdp")
    return d, args + ["--parallel=fsdp"]


def test_fsdp_two_processes_match_one(fsdp_run):
    d, _ = fsdp_run
    assert_same_run(d / "one", d / "fsdp", step=2)
    # the consolidated critic too (the HF policy is compared in assert_same_run)
    a = load_file(str(d / "one" / "checkpoints" / "step-2" / "critic" / "model.safetensors"))
    b = load_file(str(d / "fsdp" / "checkpoints" / "step-2" / "critic" / "model.safetensors"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5


def test_fsdp_checkpoint_is_sharded_per_process(fsdp_run):
    d, _ = fsdp_run
    ckpt = d / "fsdp" / "checkpoints" / "step-2"
    shards = sorted(p.name for p in (ckpt / "sharded").iterdir())
    assert shards == ["shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"]
    assert not (ckpt / "optimizer.safetensors").exists()  # AdamW moments live only in the shards
    full = weights(d / "fsdp", 2)
    first, second = (load_file(str(ckpt / "sharded" / s)) for s in shards)
    name = "model.layers.0.mlp.down_proj.weight"
    # each process holds its half of every parameter (dim-0 chunks) and of its AdamW moments
    rows = full[name].shape[0]
    assert first[f"policy.{name}"].shape[0] + second[f"policy.{name}"].shape[0] == rows
    assert first[f"policy.{name}"].shape[0] == (rows + 1) // 2
    assert torch.equal(torch.cat([first[f"policy.{name}"], second[f"policy.{name}"]]), full[name])
    assert first[f"policy_optimizer.{name}.exp_avg"].shape == first[f"policy.{name}"].shape


def test_fsdp_run_killed_mid_rollout_resumes_identically_from_shards(fsdp_run, tmp_path):
    d, args = fsdp_run
    assert_bitwise_same_run(d / "fsdp", kill_mid_rollout_and_resume(args, tmp_path), step=2)


def test_fsdp_checkpoint_resumes_on_one_process(fsdp_run, tmp_path):
    """The shards carry their offsets: a 2-process FSDP checkpoint continues on 1 process (plain models)
    and lands on the update of the uninterrupted runs (float32 sums in another order)."""
    d, _ = fsdp_run
    run_dir = tmp_path / "run"
    shutil.copytree(d / "fsdp", run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step-2")
    (run_dir / "summary.json").unlink()
    (run_dir / "checkpoints" / "latest").write_text("step-1\n")
    resumed = launch([sys.executable, "-m", "ppo_core.train", "--resume", str(run_dir)], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(d / "fsdp", run_dir, step=2)
    assert_same_run(d / "one", run_dir, step=2)


STALE = ARGS + ["--iterations=2", "--max_staleness=1", "--off_policy_correction=tis"]  # one update stale, with TIS


def alone_and_with_a_worker(args, where):
    """ppo-train with `args` in one process (into where/one) and, at the same time, under torchrun with the second
    process a rollout worker (where/two). -> (one, two), the run directories."""
    side_by_side([sys.executable, "-m", "ppo_core.train", *args, f"--out={where / 'one'}"],
                 TORCHRUN + ["-m", "ppo_core.train", *args, "--rollout_ranks=1", f"--out={where / 'two'}"], cwd=where)
    return where / "one", where / "two"


@pytest.fixture(scope="module")
def stale_runs():
    """One update stale with TIS (STALE): in one process, and under torchrun with rollout_ranks=1 (process 1 the
    worker). -> (the directory holding both, one-process run dir, worker run dir)."""
    reference_run("stale-one")
    reference_run("stale-two")
    d = pathlib.Path(background.directory("stale"))
    return d, d / "one", d / "two"


def test_a_rollout_worker_one_update_stale_is_the_one_process_run(stale_runs):
    """rollout_ranks=1 under torchrun: process 1 samples and scores with weights sent from the trainer, process 0
    trains, the two overlapping (max_staleness=1). The worker samples what one process would (the same weights, the
    same noise), so the run equals the one-process run one update stale, byte for byte."""
    _, one, two = stale_runs
    assert_identical_runs(one, two, step=2)


def test_a_rollout_worker_taking_turns_is_the_one_process_run(token_mean_runs, tmp_path):
    """As above, for the synchronous loop (max_staleness=0: the roles take turns): the one-process run above."""
    d, args = token_mean_runs
    double = launch(TORCHRUN + ["-m", "ppo_core.train", *args, "--rollout_ranks=1", f"--out={tmp_path / 'two'}"],
                    tmp_path)
    assert double.returncode == 0, double.stderr[-3000:]
    assert_identical_runs(d / "one", tmp_path / "two", step=2)


def test_a_rollout_worker_in_bf16_is_the_one_process_run(tmp_path):
    """As above under bf16-mixed, one update stale: the blocks' Linear weights travel in bf16 (decoding reads only
    their bf16 autocast copies), the rest in float32; still byte for byte, on any CPU (bf16 hardware or not)."""
    args = [a.replace("--dtype=float32", "--dtype=bf16-mixed") for a in STALE]
    assert_identical_runs(*alone_and_with_a_worker(args, tmp_path), step=2)


@pytest.mark.parametrize("processes, parallel", [(2, "ddp"), (3, "fsdp")])
def test_a_rollout_worker_run_killed_mid_update_resumes_identically(stale_runs, tmp_path, processes, parallel):
    """max_staleness=1 with a worker: the first trainer's checkpoint holds the rollout received and not yet trained
    on, and the worker restarts from the trainer's weights and stream: the resumed run ends byte-identical. With 3
    processes, two FSDP trainers: their shards are saved and loaded within the trainers' group."""
    launcher = TORCHRUN[:-1] + [f"--nproc-per-node={processes}"]
    args = STALE + ["--rollout_ranks=1", f"--parallel={parallel}"]
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    run_dir = tmp_path / "run"
    # killed at the trainer's 7th value-loss call: in the second iteration's update (4 micro-batch calls an
    # iteration here), after the first checkpoint, which holds the rollout in flight
    kill = (launcher + [str(driver), "update", "7", *args, f"--out={run_dir}"], tmp_path, one_thread_env())
    if processes == 2:  # the run of the fixture (DDP is the default)
        whole = stale_runs[2]
        (killed,) = background.together(kill)
    else:  # the whole run beside the one that is killed
        whole = tmp_path / "whole"
        proc, killed = background.together(
            (launcher + ["-m", "ppo_core.train", *args, f"--out={whole}"], tmp_path, one_thread_env()), kill)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert killed.returncode != 0 and not (run_dir / "summary.json").exists()
    assert (run_dir / "checkpoints" / "step-1").is_dir() and not (run_dir / "checkpoints" / "step-2").exists()
    resumed = launch(launcher + ["-m", "ppo_core.train", "--resume", str(run_dir)], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = weights(whole, 2), weights(run_dir, 2)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert metrics(whole) == metrics(run_dir)


def test_a_rollout_worker_needs_a_trainer_beside_it(tmp_path):
    """rollout_ranks=1 in one process (no torchrun): one line and exit status 2, before the run directory is made."""
    proc = launch([sys.executable, "-m", "ppo_core.train", "--rollout_ranks=1", f"--out={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("ppo-train: error: config key 'rollout_ranks': 1 rollout worker(s) need a trainer "
                                   "beside them: run under torchrun with more than 1 process(es) (this job has 1)")
    assert not (tmp_path / "run").exists()


def test_two_rollout_workers_beside_one_trainer_are_the_one_process_run(stale_runs, tmp_path):
    """rollout_ranks=2: each worker samples half of every rollout's rows (noise per global row), the trainer merges
    them in worker order; one update stale, with TIS. The same run as one process, byte for byte."""
    three = launch(TORCHRUN[:-1] + ["--nproc-per-node=3", "-m", "ppo_core.train", *STALE, "--rollout_ranks=2",
                                    f"--out={tmp_path / 'three'}"], tmp_path)
    assert three.returncode == 0, three.stderr[-3000:]
    assert_identical_runs(stale_runs[1], tmp_path / "three", step=2)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_trainers_beside_a_rollout_worker_are_the_two_process_run(fsdp_run, tmp_path, parallel):
    """rollout_ranks=1 under 3 processes: two trainers (DDP, or FSDP whose weights are gathered before they go to the
    worker) and one worker that samples every row; the first trainer hands the second its half. The same run as two
    data-parallel processes that sample their own halves (they draw the same tokens: noise per global row): the
    2-process runs above (token-mean is the default loss_agg)."""
    d, args = fsdp_run
    args = [a for a in args if a != "--parallel=fsdp"] + [f"--parallel={parallel}"]
    three = launch(TORCHRUN[:-1] + ["--nproc-per-node=3", "-m", "ppo_core.train", *args, "--rollout_ranks=1",
                                    f"--out={tmp_path / 'three'}"], tmp_path)
    assert three.returncode == 0, three.stderr[-3000:]
    assert_identical_runs(d / ("two" if parallel == "ddp" else "fsdp"), tmp_path / "three", step=2)


JUDGE = os.path.join(os.path.dirname(DEMO_CHECKPOINT), "judge-demo")


@pytest.mark.parametrize("case", ["lora", "filter_groups", "pairwise_judge"])
def test_a_rollout_worker_run_with_lora_dynamic_sampling_or_a_pairwise_judge_is_the_one_process_run(tmp_path, case):
    """LoRA (the worker's policy carries the same adapters; their values travel with the weights), DAPO's dynamic
    sampling (the worker draws prompt batches until enough groups vary) and a pairwise judge (the worker samples the
    reference responses from the frozen reference) on a rollout worker, one update stale: byte for byte the
    one-process run."""
    args = ARGS + ["--iterations=2", "--max_staleness=1", "--off_policy_correction=tis"] + {
        "lora": ["--lora_rank=4", "--lr=1e-3"],
        "filter_groups": ["--adv_estimator=grpo", "--n_samples_per_prompt=4", "--rollout_batch_size=4",
                          "--filter_groups", "--filter_groups_max_batches=2"],
        "pairwise_judge": [f"--judge={JUDGE}", "--judge_mode=pairwise", "--judge_max_new_tokens=24",
                           "--adv_estimator=grpo", "--n_samples_per_prompt=2", "--rollout_batch_size=8"]}[case]
    one, two = alone_and_with_a_worker(args, tmp_path)
    assert_identical_runs(one, two, step=2)
    if case == "filter_groups":  # the second prompt batch was drawn at least once
        assert any(m["filter/batches"] == 2 for m in metrics(one))
