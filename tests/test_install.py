"""A fresh CPU install, as a newcomer gets it (issue 12, the newcomer review #9, #10, #21): triton is not a
requirement, so the library imports and the default job trains without it; a run without --out is named after
its policy and task; the progress bar is drawn only on a terminal."""
import ast
import datetime
import json
import os
import re
import subprocess
import sys

import pytest

from ppo_core.config import build_config
from ppo_core.run.runlog import Logger, RunDir, default_run_path
from ppo_core.train import DEMO_CHECKPOINT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--iterations=1", "--eval_size=8", "--rollout_batch_size=8", "--minibatch_size=8", "--micro_batch_size=8",
        "--max_new_tokens=6"]
# Imported first by every Python process started with this directory on PYTHONPATH: `import triton` then fails as
# it does where triton is not installed (ModuleNotFoundError; importlib.util.find_spec("triton") is None).
HIDE_TRITON = 'import sys\nsys.modules["triton"] = None\n'


@pytest.fixture(scope="module")
def without_triton(tmp_path_factory):
    """The environment of a subprocess that cannot import triton."""
    hide = tmp_path_factory.mktemp("hide_triton")
    (hide / "sitecustomize.py").write_text(HIDE_TRITON)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(hide), os.environ.get("PYTHONPATH")) if p)}


@pytest.fixture(scope="module")
def default_job_without_triton(tmp_path_factory, without_triton):
    """The default job at toy size, with no --out, triton hidden and stderr a pipe (not a terminal)."""
    cwd = tmp_path_factory.mktemp("fresh")
    proc = subprocess.run([sys.executable, "-m", "ppo_core.train", *TINY], capture_output=True, text=True, cwd=cwd,
                          env=without_triton, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return cwd, proc


def test_triton_is_only_a_test_requirement():
    """setup.py: no triton in install_requires (torch's CUDA wheels bring their own); the test extra has it
    (the kernel tests run the Triton kernels in its interpreter)."""
    call = next(node for node in ast.walk(ast.parse(open(os.path.join(ROOT, "setup.py")).read()))
                if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setup")
    kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}
    assert not [r for r in kwargs["install_requires"] if r.startswith("triton")]
    assert "triton>=3.0; platform_system == 'Linux'" in kwargs["extras_require"]["test"]


def test_the_library_imports_without_triton(without_triton):
    check = ("import importlib.util; assert importlib.util.find_spec('triton') is None\n"
             "import ppo_kernels, ppo_core, ppo_core.train\n"
             "from ppo_kernels import linear_logprobs, logprobs, loss\n"
             "assert linear_logprobs.triton is logprobs.triton is loss.triton is None\n")
    proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=without_triton,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_default_job_trains_without_triton(default_job_without_triton):
    cwd, proc = default_job_without_triton
    (run_dir,) = (cwd / "runs").iterdir()
    assert json.loads((run_dir / "config.json").read_text())["versions"]["triton"] is None
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 1
    assert (run_dir / "summary.json").exists() and (run_dir / "checkpoints" / "step-1").is_dir()


def test_a_run_without_out_is_named_after_its_policy_and_task(default_job_without_triton):
    cwd, proc = default_job_without_triton
    (run_dir,) = (cwd / "runs").iterdir()
    assert re.fullmatch(r"reverse-demo-\d{8}-\d{6}", run_dir.name), run_dir.name
    assert f"run dir {os.path.join('runs', run_dir.name)}" in proc.stderr


def test_default_run_path():
    """runs/<policy directory>-<task or "custom">-<date>-<time>; the task is left out when the policy's name holds it."""
    started = datetime.datetime(2026, 1, 2, 15, 4, 5)
    demo = build_config()
    assert default_run_path(demo, DEMO_CHECKPOINT, started) == os.path.join("runs", "reverse-demo-20260102-150405")
    assert default_run_path(demo, "/ckpt/Qwen3-0.6B/", started) == os.path.join("runs", "Qwen3-0.6B-reverse-20260102-150405")
    assert default_run_path(demo, "~/models/reversed-tiny", started) == \
        os.path.join("runs", "reversed-tiny-reverse-20260102-150405")  # "reversed" is not the word "reverse"
    for custom in ({"reward_fn": "my_rewards.py:score"}, {"prompts_file": "prompts.txt"},
                   {"reward_model": "ckpt/Skywork-Reward-V2"}, {"reward_url": "http://127.0.0.1:8000"}):
        assert default_run_path(build_config(overrides=custom), "~/models/tiny-qwen3", started) == \
            os.path.join("runs", "tiny-qwen3-custom-20260102-150405"), custom


def test_no_progress_bar_when_stderr_is_not_a_terminal(default_job_without_triton, tmp_path, monkeypatch):
    """The default job asks for a bar (progress = true); piped, stderr gets none of tqdm's carriage-return frames.
    On a terminal (a real pseudo-terminal here) the Logger does draw it."""
    cwd, proc = default_job_without_triton
    assert build_config().progress is True
    assert "\r" not in proc.stderr and "ppo:" not in proc.stderr
    run_dir = RunDir(str(tmp_path))
    with open(tmp_path / "stderr.txt", "w") as piped:
        monkeypatch.setattr(sys, "stderr", piped)
        log = Logger(run_dir, progress=True)
        assert not log.progress and isinstance(log.iterations(3), range)
        log.close()
    leader, follower = os.openpty()
    with open(follower, "w") as terminal:
        monkeypatch.setattr(sys, "stderr", terminal)
        log = Logger(run_dir, progress=True)
        assert log.progress and not isinstance(log.iterations(3), range)
        log.close()
        assert not Logger(run_dir, progress=False).progress  # --progress=false still turns it off
    os.close(leader)


# ------------------------------------------------------------------------------- the folder kernels/ shadows nothing


def import_kernels(cwd, pythonpath, *flags):
    """`import kernels` (and its submodule `_internals`, as transformers and kernels' setuptools entry point do) in a
    fresh Python started in `cwd`, which Python puts first on sys.path as `python -c` and `python -m pytest` do."""
    code = "import kernels, kernels._internals as i; print(kernels.__file__); print(i.MARK)"
    env = {**os.environ, "PYTHONPATH": pythonpath}
    return subprocess.run([sys.executable, *flags, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def test_the_checkouts_kernels_folder_never_shadows_a_package_named_kernels(tmp_path):
    """The top-level folder kernels/ is the package ppo_kernels. Started in the checkout's root, Python finds it first
    under its folder name, which is also a PyPI package (transformers >= 5.25 imports it): `import kernels` must give
    the other package, from the root, from tests/ and from anywhere else, or fail as if the folder were not there."""
    other = tmp_path / "site" / "kernels"  # a stand-in for PyPI's package, after the checkout on sys.path
    os.makedirs(other / "_internals")
    (other / "__init__.py").write_text("")
    (other / "_internals" / "__init__.py").write_text("MARK = 'the other kernels'\n")
    for cwd in (ROOT, os.path.join(ROOT, "tests"), str(tmp_path)):
        proc = import_kernels(cwd, os.pathsep.join([ROOT, str(tmp_path / "site")]))
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.split() == [str(other / "__init__.py"), "the", "other", "kernels"]
    # no other `kernels` anywhere (-S: no site-packages): the same error as without the folder
    alone = import_kernels(ROOT, "", "-S")
    assert alone.returncode == 1 and alone.stderr.strip().splitlines()[-1] == "ModuleNotFoundError: No module named 'kernels'"
    # and under its own name the folder is the library
    proc = subprocess.run([sys.executable, "-c", "import ppo_kernels; print(ppo_kernels.linear_logprob_loss.__module__)"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "ppo_kernels.loss", proc.stderr[-2000:]
