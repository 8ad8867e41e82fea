#!/usr/bin/env bash
# Everything GPU-side in one call, for a bare H100/H200 with torch, triton, pytest (transformers optional) and no
# network: offline install, preflight, the GPU test tier, kernel / decode / PPO-iteration benchmarks, a 2-iteration
# default job. Every step has its own time limit, a failing step does not stop the others, and the tables go to
# $OUT/tables.md (all output to $OUT/steps.log; $OUT defaults to runs/gpu-suite).
#
#     bash bench/gpu_suite.sh               # on the GPU machine; then copy the tables into bench/RESULTS.md
#     bash bench/gpu_suite.sh --cpu-smoke   # every step on the CPU (Triton interpreter, toy shapes); CI runs it
#
# Budget on one H100 (expected time: estimates, not measurements; limit: the step's `timeout`). A step also
# never runs past DEADLINE_S = 350 s from the start, so the whole suite ends within 6 minutes. Every distinct
# Triton kernel variant compiles on its first launch (about 1-3 s each, one process): the ~10 variants of the
# benchmarks fit their steps, the ~70 of the compiled Triton test tier do not fit a fixed early slot, so that
# tier runs last and gets whatever time is left (at least 25 s; about 150 s when the steps before it take
# their expected time). Each step prints as it goes (kernel rows, decode rows, attention rows, test names), so
# a step cut by its limit still leaves its finished rows in the tables.
#   step                                            expected   limit
#   0 environment (nvidia-smi, versions)                2 s      10 s
#   1 offline install (pip: no index, no build          5 s      20 s
#     isolation, no deps) or the PYTHONPATH shim
#   2 preflight: imports + one Triton launch           10 s      20 s
#   3 CUDA-only tests (CUDA graphs, fused attention,   35 s      55 s
#     Qwen-sized kernels; few Triton variants)
#   4 bench/kernels.py --device cuda                   40 s      65 s
#   5 bench/generate.py --device cuda                  30 s      45 s
#   6 bench/ppo_step.py (attention, Qwen3-0.6B shape)  45 s      75 s
#   7 default job, 2 iterations, on CUDA               20 s      35 s
#   8 kernel test tier (compiled Triton cases)        150 s    the rest (to the deadline)
#   sum                                               337 s     350 s (the deadline)
# --cpu-smoke: the same steps on the CPU with PIP_NO_INDEX=1 (about 1-2 minutes on 2 cores); it exits non-zero
# if any step fails. The GPU run also exits non-zero then, but only after every step has had its turn.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

smoke=0
if [[ "${1:-}" == "--cpu-smoke" ]]; then
  smoke=1
elif [[ $# -gt 0 ]]; then
  echo "usage: bash bench/gpu_suite.sh [--cpu-smoke]" >&2
  exit 2
fi

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
export TMPDIR_SUITE=$scratch
if [[ $smoke == 1 ]]; then
  out=${OUT:-$scratch/out}
else
  out=${OUT:-runs/gpu-suite}  # runs/ is git-ignored
fi
mkdir -p "$out"
tables=$out/tables.md
log=$out/steps.log
: > "$tables"
: > "$log"

export PYTHONUNBUFFERED=1
export CUBLAS_WORKSPACE_CONFIG=:4096:8   # before any process initialises cuBLAS (tests turn on deterministic mode)
export PIP_NO_INDEX=1                    # offline: pip must never try to reach an index
export PIP_DISABLE_PIP_VERSION_CHECK=1
export TOKENIZERS_PARALLELISM=false
if [[ $smoke == 1 ]]; then
  export TRITON_INTERPRET=1              # Triton kernels run in its CPU interpreter
  export CUDA_VISIBLE_DEVICES=""
  DEADLINE_S=900
else
  DEADLINE_S=350
fi

start=$SECONDS
failures=()
status_rows=()

# step NAME LIMIT_S CMD...: run CMD under a time limit (never past the deadline); its stdout is the step's table
# (appended to tables.md under a heading), stdout and stderr both go to steps.log. Returns CMD's status.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((DEADLINE_S - (SECONDS - start)))
  ((limit > left)) && limit=$left
  if ((limit < 5)); then
    status_rows+=("| $name | skipped: out of time | 0 s |")
    failures+=("$name")
    echo "--- $name: skipped (out of time)"
    return 124
  fi
  echo "--- $name (limit ${limit} s)"
  local t0=$SECONDS rc
  {
    echo
    echo "=================== $name (limit ${limit} s) ==================="
  } >> "$log"
  # STEP_LIMIT: the command may stop its own work a few seconds early to print a summary (pytest_tier)
  STEP_LIMIT=$limit timeout --kill-after=2 "$limit" "$@" > "$scratch/stdout" 2> "$scratch/stderr"
  rc=$?
  cat "$scratch/stdout" >> "$log"
  echo "--- stderr ---" >> "$log"
  cat "$scratch/stderr" >> "$log"
  {
    echo
    echo "## $name"
    echo
    cat "$scratch/stdout"
  } >> "$tables"
  local took=$((SECONDS - t0)) verdict=ok
  if ((rc == 124 || rc == 137)); then
    verdict="TIMED OUT after $limit s"
  elif ((rc != 0)); then
    verdict="FAILED (exit $rc): $(grep -v '^\s*$' "$scratch/stderr" | tail -1 | cut -c1-160)"
  fi
  if [[ $verdict != ok ]]; then
    failures+=("$name")
    { echo; echo "**$name: $verdict** (last lines of stderr:)"; echo '```'; tail -15 "$scratch/stderr"; echo '```'; } >> "$tables"
  fi
  status_rows+=("| $name | $verdict | $took s |")
  echo "    $verdict, $took s"
  return $rc
}

# ---------------------------------------------------------------------------------------- 0. environment
step "0 environment" 10 bash -c '
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "nvidia-smi: not available"
  python3 -c "import sys, torch; print(\"python\", sys.version.split()[0], \"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"gpu\", torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
  nproc | sed "s/^/cpu cores: /"
  git log -1 --format="commit %h %s" 2>/dev/null || true'

# ---------------------------------------------------------------------------------------- 1. offline install
# --no-deps: only this package (pip must not replace the image's torch/triton); --no-build-isolation: use the
# installed setuptools instead of fetching one into an isolated build environment (impossible offline).
# The smoke run must not disturb the editable install CI made, so it only resolves and builds the metadata
# (--dry-run): that exercises exactly the offline, no-isolation path without changing the environment.
shim=$scratch/shim
mkdir -p "$shim"
ln -s "$repo/kernels" "$shim/ppo_kernels"
install_cmd=(python3 -m pip install --no-build-isolation --no-deps -e .)
[[ $smoke == 1 ]] && install_cmd+=(--dry-run)
step "1 offline install" 20 "${install_cmd[@]}"
# Is the package importable from outside the checkout (where `ppo_kernels` is not a folder name)? Else the shim:
# ppo_kernels -> kernels/ on PYTHONPATH, with the checkout itself for ppo_core.
if ! (cd "$scratch" && python3 -c "import ppo_core, ppo_kernels" 2>/dev/null); then
  export PYTHONPATH="$shim:$repo${PYTHONPATH:+:$PYTHONPATH}"
  echo "    not importable after the install: using the shim ppo_kernels -> kernels/ (PYTHONPATH=$PYTHONPATH)"
  echo "install: ppo_kernels not importable after pip; shim PYTHONPATH=$PYTHONPATH" >> "$tables"
fi
if [[ $smoke == 1 ]]; then  # the fallback must work too: check the shim resolves ppo_kernels to kernels/
  step "1b shim check" 30 bash -c "cd '$scratch' && PYTHONPATH='$shim:$repo' python3 -c \
    'import ppo_kernels, ppo_core; assert ppo_kernels.__file__.startswith(\"$shim/\"), ppo_kernels.__file__; print(\"shim ok:\", ppo_kernels.__file__)'"
fi

# ---------------------------------------------------------------------------------------- 2. preflight
step "2 preflight" 20 python3 bench/preflight.py
if [[ $? == 2 ]]; then
  echo "ppo_core / ppo_kernels cannot be imported even with the shim: stopping here (see $log)" | tee -a "$tables"
  exit 2
fi

# ---------------------------------------------------------------------------------------- 3. CUDA-only tests
# pytest_tier SELECTION FILES...: pytest -k SELECTION, its full output (each test's name as it runs, tracebacks)
# streamed to the log; the table gets the FAILED/ERROR lines and the counts. pytest runs under its own limit,
# 6 s inside the step's, so that when time runs out the counts of what finished still reach the table.
cat > "$scratch/pytest_tier.sh" <<'SH'
selection=$1
shift
inner=$(( ${STEP_LIMIT:-600} - 6 ))
((inner < 5)) && inner=5
timeout --kill-after=2 "$inner" python3 -m pytest -v -rfE --tb=short -p no:cacheprovider --maxfail=20 \
  -k "$selection" "$@" 2>&1 | tee "$TMPDIR_SUITE/pytest.txt" >&2
rc=${PIPESTATUS[0]}
if ((rc == 124 || rc == 137)); then
  echo "pytest stopped by the time limit (${inner} s) after $(grep -cE ' (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)' \
    "$TMPDIR_SUITE/pytest.txt") tests:" \
    "$(grep -cE ' PASSED' "$TMPDIR_SUITE/pytest.txt") passed," \
    "$(grep -cE ' (FAILED|ERROR)' "$TMPDIR_SUITE/pytest.txt") failed or errors," \
    "$(grep -cE ' SKIPPED' "$TMPDIR_SUITE/pytest.txt") skipped"
  grep -E '^tests/.* (FAILED|ERROR)' "$TMPDIR_SUITE/pytest.txt" | tail -40
else
  grep -E "^(FAILED|ERROR) |[0-9]+ (passed|failed|skipped|deselected|errors?)" "$TMPDIR_SUITE/pytest.txt" | tail -40
fi
exit $rc
SH
kernel_test_files=(tests/test_kernels_logprobs.py tests/test_kernels_linear.py tests/test_kernels_loss.py)
test_files=("${kernel_test_files[@]}")
for f in tests/test_generate.py tests/test_*gpu*.py tests/test_*attention*.py; do
  [[ -f $f ]] && test_files+=("$f")
done
# The tests gated on CUDA (CUDA-graph decoding, every attention pass on a fused kernel, the large-vocabulary and
# Qwen-sized kernel cases): few Triton variants, so they fit early; on the CPU everything here skips but the
# argument checks.
step "3 CUDA-only tests" 55 bash "$scratch/pytest_tier.sh" "gpu or cuda" "${test_files[@]}"

# ---------------------------------------------------------------------------------------- 4. kernels
if [[ $smoke == 1 ]]; then
  step "4 kernels (smoke)" 120 env PPO_KERNELS_BACKEND=triton python3 bench/kernels.py --device cpu --smoke
else
  step "4 kernels" 65 python3 bench/kernels.py --device cuda --no-compile --repeats 3
fi

# ---------------------------------------------------------------------------------------- 5. decoding
if [[ $smoke == 1 ]]; then
  step "5 decode (smoke)" 120 python3 bench/generate.py --smoke
else
  step "5 decode" 45 python3 bench/generate.py --device cuda --repeats 3
fi

# ---------------------------------------------------------------------------------------- 6. one PPO iteration
if [[ $smoke == 1 ]]; then
  step "6 PPO iteration + attention (tiny)" 120 python3 bench/ppo_step.py --tiny --workdir "$scratch"
else
  step "6 PPO iteration + attention" 75 python3 bench/ppo_step.py --workdir "$scratch"
fi

# ---------------------------------------------------------------------------------------- 7. the default job
device=cuda
[[ $smoke == 1 ]] && device=cpu
# The job runs under its own limit, 5 s inside the step's, so that the iterations it finished still print.
step "7 default job, 2 iterations" 35 bash -c "
  timeout --kill-after=2 \$((STEP_LIMIT - 5)) python3 -m ppo_core.train --device=$device --iterations=2 \
    --eval_size=16 --progress=false --out='$scratch/default-job' >&2
  rc=\$?
  python3 - '$scratch/default-job' <<'PY'
import json, os, sys
run = sys.argv[1]
path = os.path.join(run, 'metrics.jsonl')
rows = []
for line in (open(path) if os.path.exists(path) else []):
    try:
        rows.append(json.loads(line))
    except ValueError:  # blank, or the last line cut by the time limit
        pass
print('| iteration | rollout s | update s | tokens/s | reward | first ratio max dev |')
print('|---:|---:|---:|---:|---:|---:|')
for r in rows:
    print(f\"| {r['step']} | {r['time/rollout_s']:.3f} | {r['time/train_s']:.3f} | {r['tokens_per_s']:.0f} | \"
          f\"{r['reward/mean']:.3f} | {r['policy/first_ratio_max_dev']:.2e} |\")
if os.path.exists(os.path.join(run, 'summary.json')):
    summary = json.load(open(os.path.join(run, 'summary.json')))
    print(f\"\\nheld-out reward (16 prompts) before {summary['eval/reward_before']:.4f}, after {summary['eval/reward_after']:.4f} \"
          f\"(2 iterations: a run check, not a learning check); whole run {summary['time/total_s']:.1f} s\")
else:
    print(f'\\nthe job did not finish: {len(rows)} iteration(s) recorded, no summary')
PY
  report=\$?
  exit \$((rc != 0 ? rc : report))"

# ---------------------------------------------------------------------------------------- 8. Triton test tier
# The rest of the kernel tests: their "triton" cases (and the split-V / all-ignored / dispatch tests) run the
# compiled kernels on CUDA tensors (on the CPU: the interpreter, as in CI), ~70 distinct kernel variants, each
# compiled on its first launch: hence last, with the time that is left. The torch-path cases run on the CPU
# (about 10 s of the step).
step "8 kernel test tier (compiled Triton)" 600 bash "$scratch/pytest_tier.sh" "not gpu and not cuda" \
  "${kernel_test_files[@]}"

# ---------------------------------------------------------------------------------------- summary
{
  echo
  echo "## Steps ($((SECONDS - start)) s in all$([[ $smoke == 1 ]] && echo ', --cpu-smoke'))"
  echo
  echo "| step | result | time |"
  echo "|---|---|---:|"
  printf '%s\n' "${status_rows[@]}"
} >> "$tables"
echo
cat "$tables"
echo
echo "tables: $tables   full log: $log"
if ((${#failures[@]})); then
  echo "failed steps: ${failures[*]}"
  exit 1
fi
