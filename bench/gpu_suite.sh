#!/usr/bin/env bash
# Everything GPU-side in one go (< 10 minutes on one H100/H200): build check, GPU test tier, the default
# job on CUDA with fused kernels, and the kernel/generation benchmarks. Tables go to $OUT (or ./gpu-out).
#
#     bash bench/gpu_suite.sh            # then copy the tables into bench/RESULTS.md with the date and GPU
#
# Not yet run on a GPU: no session so far has had one (see bench/RESULTS.md).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
} 2>&1 | tee "$out/env.txt"
pip install -q -e ".[test]" --no-deps 2>&1 | tail -2

# 1. GPU test tier (bf16 kernel paths; the CPU tier runs in CI)
timeout 180 python3 -m pytest -q tests/test_kernels_logprobs.py tests/test_kernels_linear.py tests/test_kernels_loss.py 2>&1 | tee "$out/gpu_tests.txt" | tail -5
# the static-cache decode step and its CUDA-graph capture (tokens equal eager decoding)
timeout 120 python3 -m pytest -q tests/test_generate.py -k "cuda or static" 2>&1 | tee -a "$out/gpu_tests.txt" | tail -3

# 2. the default job on CUDA with fused kernels: reward before/after, tokens/s per phase, peak memory
timeout 180 python3 -m ppo_core.train --device=cuda --threads=0 --progress=false --out="$out/default-job" 2>&1 | tail -8 | tee "$out/default_job.txt"
python3 - "$out/default-job" <<'PY' | tee -a "$out/default_job.txt"
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl")]
print(f"median rollout {statistics.median(r['time/rollout_s'] for r in rows):.3f}s, "
      f"train {statistics.median(r['time/train_s'] for r in rows):.3f}s, "
      f"{statistics.median(r['tokens_per_s'] for r in rows):.0f} tokens/s per iteration")
PY
python3 -m ppo_core.plan --policy ppo_core/demo/reverse-demo --gpus 1 2>&1 | tail -20 | tee "$out/plan.txt"

# 3. kernel and generation benchmarks
timeout 240 python3 bench/kernels.py 2>&1 | tee "$out/kernels.txt" | tail -40
timeout 60 python3 bench/generate.py 2>&1 | tee "$out/generate.txt" | tail -12
