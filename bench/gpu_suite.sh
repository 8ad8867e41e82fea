#!/usr/bin/env bash
# Everything GPU-side in one call, for a bare H100/H200 with torch, triton, pytest (transformers optional) and no
# network: offline install, preflight, the GPU test tier, kernel / decode / PPO-iteration benchmarks, a 2-iteration
# default job. Every step has its own time limit, a failing step does not stop the others, and the tables go to
# $OUT/tables.md (all output to $OUT/steps.log; $OUT defaults to runs/gpu-suite).
#
#     bash bench/gpu_suite.sh               # on the GPU machine; then copy the tables into bench/results/gpu-h200.md
#     bash bench/gpu_suite.sh --cpu-smoke   # every step on the CPU (Triton interpreter, toy shapes); CI runs it
#
# Budget on one H100/H200 (expected time: estimates, not measurements; limit: the step's `timeout`). A step also
# never runs past DEADLINE_S = 500 s from the start, so the whole suite ends within about 8.5 minutes (the
# device time is 15 minutes in all, with the machine's start-up and room for one more try). Every distinct
# Triton kernel variant compiles on its first launch (1-7 s each with triton 3.6, one process): the ~10
# variants of the benchmarks fit their steps; the ~70 of the compiled Triton test tier (138 s of compiling
# alone on a loaded CPU) do not fit a fixed early slot, so that tier runs last and gets whatever time is left
# (about 205 s when the steps before it take their expected time). Each step prints as it goes (kernel rows,
# decode rows, attention rows, test names), so a step cut by its limit still leaves its finished rows in the
# tables.
#   step                                            expected   limit
#   0 environment (nvidia-smi, versions; a cold        5 s      60 s
#     torch import and CUDA init)
#   1 offline install (bench/offline_install.sh:       5 s      60 s
#     pip -e, or a setuptools copy without wheel)
#   2 preflight: imports + one Triton launch           10 s      60 s
#   2b GPU-only paths (bench/gpu_first_checks.py:      60 s     120 s
#     CUDA graph under autocast, the engine's decode
#     graphs on vs off (step times), mm_fp32 probe, RNG
#     in checkpoints, NCCL group, backward on CUDA)
#   3 CUDA-only tests (CUDA graphs of generate and     50 s      70 s
#     of the engine, fused attention, Qwen-sized
#     kernels, varlen attention of packed passes;
#     few Triton variants)
#   4 bench/kernels.py --device cuda                   40 s      65 s
#   5 bench/generate.py --device cuda                  30 s      45 s
#   5b bench/rollout.py --device cuda (the rollout     30 s      45 s
#     engine, Qwen3-0.6B shape, workloads A and C)
#   6 bench/ppo_step.py (attention, Qwen3-0.6B shape)  45 s      75 s
#   7 default job, 2 iterations, on CUDA               20 s      35 s
#   8 kernel test tier (compiled Triton cases)        205 s    the rest (to the deadline)
#   sum                                               500 s     500 s (the deadline)
# Results and exit status. The tables end with one row per step: ok (with pytest's counts), FAILED, or cut.
# A check that should take seconds (steps 0-2b) FAILS when it times out; a test tier or benchmark (3-8) that
# reaches its limit is "cut": a result, not a failure (its rows so far are in the tables; a test tier says how
# many of its selected tests ran and how they went), and so is a step the deadline leaves no time for. Exit
# status: 0 if nothing FAILED (cut steps are listed in the last lines), 1 if a step failed, 2 if ppo_core /
# ppo_kernels cannot be imported at all. Every step has its turn either way.
# --cpu-smoke: the same steps on the CPU with PIP_NO_INDEX=1, pip's install only as a dry run, and the Triton
# interpreter (under 2 minutes on the idle 2-core machine, several times that under load); the first lines and
# the summary say which python, torch, triton, transformers and numpy ran. Triton's interpreter must accept the
# installed numpy (triton 3.6's needs numpy<2.4): step 2 checks that, and if it does not, the interpreter steps
# (4, 8) are reported FAILED with that reason instead of failing on an obscure numpy TypeError. SUITE_DEADLINE_S
# overrides the deadline (to try the cut and not-reached paths, or to give a slow machine more).
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
  DEADLINE_S=500
fi
DEADLINE_S=${SUITE_DEADLINE_S:-$DEADLINE_S}

start=$SECONDS
failures=()  # steps that FAILED: the exit status
cut=()       # steps cut by a time limit, or not reached: partial results, not failures
status_rows=()
versions=""

# step [--cut-ok] NAME LIMIT_S CMD...: run CMD under a time limit (never past the deadline); its stdout is the
# step's table (appended to tables.md under a heading), stdout and stderr both go to steps.log. CMD may write one
# line to $STEP_NOTE (test counts, say) for the results row. --cut-ok: reaching the limit is a result ("cut"), not
# a failure (test tiers and benchmarks, which print as they go). Returns CMD's status.
step() {
  local cut_ok=0
  if [[ $1 == --cut-ok ]]; then
    cut_ok=1
    shift
  fi
  local name=$1 limit=$2
  shift 2
  local left=$((DEADLINE_S - (SECONDS - start)))
  ((limit > left)) && limit=$left
  if ((limit < 5)); then
    status_rows+=("| $name | not reached: the suite's $DEADLINE_S s were used up | 0 s |")
    cut+=("$name")
    echo "--- $name: not reached (out of time)"
    return 124
  fi
  echo "--- $name (limit ${limit} s)"
  local t0=$SECONDS rc
  {
    echo
    echo "=================== $name (limit ${limit} s) ==================="
  } >> "$log"
  : > "$scratch/note"
  # STEP_LIMIT: the command may stop its own work a few seconds early to print a summary (pytest_tier)
  STEP_LIMIT=$limit STEP_NOTE=$scratch/note timeout --kill-after=2 "$limit" "$@" > "$scratch/stdout" 2> "$scratch/stderr"
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
  local took=$((SECONDS - t0)) verdict note
  note=$(head -1 "$scratch/note" | cut -c1-300)
  if ((rc == 0)); then
    verdict="ok${note:+ ($note)}"
  elif ((rc == 124 || rc == 137)) && ((cut_ok)); then
    verdict="cut by its time limit ($limit s): ${note:-what it printed before the cut is above}"
    cut+=("$name")
  elif ((rc == 124 || rc == 137)); then
    verdict="FAILED: TIMED OUT after $limit s${note:+ ($note)}"
  else
    verdict="FAILED (exit $rc): ${note:-$(grep -v '^\s*$' "$scratch/stderr" | tail -1 | cut -c1-160)}"
  fi
  if [[ $verdict == FAILED* ]]; then
    failures+=("$name")
    { echo; echo "**$name: $verdict** (last lines of stderr:)"; echo '```'; tail -15 "$scratch/stderr"; echo '```'; } >> "$tables"
  fi
  status_rows+=("| $name | $verdict | $took s |")
  echo "    $verdict, $took s"
  return $rc
}

# not_run NAME REASON: a step that cannot run here, counted as a failure (the check it stands for did not happen)
not_run() {
  status_rows+=("| $1 | FAILED (not run): $2 | 0 s |")
  failures+=("$1")
  echo "--- $1: FAILED (not run): $2"
  { echo; echo "## $1"; echo; echo "**not run: $2**"; } >> "$tables"
}

# ---------------------------------------------------------------------------------------- 0. environment
step "0 environment" 60 bash -c '
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "nvidia-smi: not available"
  python3 - <<"PY"
import importlib.metadata as md
import sys

import torch

def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "none"

triton, transformers, numpy = (version(name) for name in ("triton", "transformers", "numpy"))
cuda = f" (CUDA {torch.version.cuda})" if torch.version.cuda else ""
print(f"versions: python {sys.version.split()[0]}, torch {torch.__version__}{cuda}, triton {triton}, "
      f"transformers {transformers}, numpy {numpy}")
print("gpu:", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
PY
  nproc | sed "s/^/cpu cores: /"
  git log -1 --format="commit %h %s" 2>/dev/null || true'
versions=$(grep -m1 '^versions: ' "$scratch/stdout" | sed 's/^versions: //')
[[ -n $versions ]] && echo "    $versions"

# ---------------------------------------------------------------------------------------- 1. offline install
# bench/offline_install.sh: only this package (--no-deps: the image's torch/triton stay), no build isolation (the
# installed setuptools, since none can be fetched), as pip's editable install, or as setuptools' copy where no
# bdist_wheel exists (no `wheel` package, setuptools < 70.1). The smoke run must not disturb the editable install
# CI made, so it only builds and checks (--dry-run): that exercises the same offline path without changing anything.
shim=$scratch/shim
mkdir -p "$shim"
ln -s "$repo/kernels" "$shim/ppo_kernels"
install_cmd=(bash bench/offline_install.sh)
[[ $smoke == 1 ]] && install_cmd+=(--dry-run)
step "1 offline install" 60 "${install_cmd[@]}"
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
step "2 preflight" 60 python3 bench/preflight.py
if [[ $? == 2 ]]; then
  echo "ppo_core / ppo_kernels cannot be imported even with the shim: stopping here (see $log)" | tee -a "$tables"
  exit 2
fi
# the smoke run's Triton interpreter against this numpy (preflight's "triton interpreter INCOMPATIBLE ..." line)
interpreter_problem=""
if [[ $smoke == 1 ]] && grep -q "triton interpreter INCOMPATIBLE" "$scratch/stdout"; then
  interpreter_problem="triton's interpreter cannot run with this numpy (step 2: $(grep -o "INCOMPATIBLE with numpy [^:]*" \
    "$scratch/stdout"); pip install 'numpy<2.4' for triton 3.6)"
fi

# ---------------------------------------------------------------------------------------- 2b. GPU-only paths
# Each path no CPU check runs, once, at toy size, before the long steps: CUDA-graph decoding under bf16 autocast,
# the fp32-output matmul the Triton backward chose, CUDA RNG state through a checkpoint, the cpu:gloo,cuda:nccl
# group and DDP, a backward on CUDA against float64. On the CPU: the CPU parts; the CUDA-only ones say skipped.
step "2b GPU-only paths" 120 python3 bench/gpu_first_checks.py --device "$([[ $smoke == 1 ]] && echo cpu || echo cuda)"

# ---------------------------------------------------------------------------------------- 3. CUDA-only tests
# pytest_tier SELECTION FILES...: pytest -k SELECTION, its full output (each test's name as it runs, tracebacks)
# streamed to the log; the table gets the FAILED/ERROR lines and the counts, the results row pytest's summary.
# pytest runs under its own limit, 6 s inside the step's, so that when time runs out the counts of what finished
# still reach the table: "cut after N of M selected tests: P passed, F failed, S skipped" (exit 124, a cut; exit
# 1 if any test that ran failed).
cat > "$scratch/pytest_tier.sh" <<'SH'
selection=$1
shift
inner=$(( ${STEP_LIMIT:-600} - 6 ))
((inner < 5)) && inner=5
out=$TMPDIR_SUITE/pytest.txt
timeout --kill-after=2 "$inner" python3 -m pytest -v -rfE --tb=short -p no:cacheprovider --maxfail=20 \
  -k "$selection" "$@" 2>&1 | tee "$out" >&2
rc=${PIPESTATUS[0]}
if ((rc == 124 || rc == 137)); then
  count() { grep -cE "::\S* $1" "$out"; }
  passed=$(count PASSED) failed=$(count "(FAILED|ERROR)") skipped=$(count SKIPPED) xfail=$(count "(XFAIL|XPASS)")
  ran=$((passed + failed + skipped + xfail))
  selected=$(grep -m1 -oE '[0-9]+ selected' "$out" | grep -oE '[0-9]+')
  [[ -z $selected ]] && selected=$(grep -m1 -oE 'collected [0-9]+ item' "$out" | grep -oE '[0-9]+')
  note="cut after $ran of ${selected:-?} selected tests: $passed passed, $failed failed, $skipped skipped"
  echo "$note"
  grep -E '^tests/.* (FAILED|ERROR)' "$out" | tail -40
  echo "$note" > "$STEP_NOTE"
  ((failed > 0)) && exit 1
  exit 124
fi
grep -E "^(FAILED|ERROR) " "$out" | tail -40
summary=$(grep -E '^=+ .*[0-9]+ (passed|failed|skipped|deselected|errors?).* in [0-9.]+s' "$out" | tail -1 | sed -E 's/^=+ //; s/ =+$//')
echo "$summary"
echo "$summary" > "$STEP_NOTE"
exit $rc
SH
kernel_test_files=(tests/test_kernels_logprobs.py tests/test_kernels_linear.py tests/test_kernels_loss.py)
test_files=("${kernel_test_files[@]}")
for f in tests/test_generate.py tests/test_engine.py tests/test_*gpu*.py tests/test_*attention*.py \
  tests/test_packing.py; do
  [[ -f $f ]] && test_files+=("$f")
done
# The tests gated on CUDA (CUDA-graph decoding in generate and in the engine, every attention pass on a fused kernel,
# the large-vocabulary and Qwen-sized kernel cases): few Triton variants, so they fit early; on the CPU everything
# here skips but the argument checks and the engine's interpreter-only tests.
step --cut-ok "3 CUDA-only tests" 70 bash "$scratch/pytest_tier.sh" "gpu or cuda" "${test_files[@]}"

# ---------------------------------------------------------------------------------------- 4. kernels
if [[ $smoke == 1 && -n $interpreter_problem ]]; then
  not_run "4 kernels (smoke)" "$interpreter_problem"
elif [[ $smoke == 1 ]]; then
  step --cut-ok "4 kernels (smoke)" 120 env PPO_KERNELS_BACKEND=triton python3 bench/kernels.py --device cpu --smoke
else
  step --cut-ok "4 kernels" 65 python3 bench/kernels.py --device cuda --no-compile --repeats 3
fi

# ---------------------------------------------------------------------------------------- 5. decoding
if [[ $smoke == 1 ]]; then
  step --cut-ok "5 decode (smoke)" 120 python3 bench/generate.py --smoke
else
  step --cut-ok "5 decode" 45 python3 bench/generate.py --device cuda --repeats 3
fi
if [[ $smoke == 1 ]]; then
  step --cut-ok "5b rollout engine (smoke)" 120 python3 bench/rollout.py --quick --systems engine generate --threads 1
else
  step --cut-ok "5b rollout engine" 45 python3 bench/rollout.py --device cuda --models Qwen3-0.6B --workloads A C
fi

# ---------------------------------------------------------------------------------------- 6. one PPO iteration
if [[ $smoke == 1 ]]; then
  step --cut-ok "6 PPO iteration + attention (tiny)" 120 python3 bench/ppo_step.py --tiny --workdir "$scratch"
else
  step --cut-ok "6 PPO iteration + attention" 75 python3 bench/ppo_step.py --workdir "$scratch"
fi

# ---------------------------------------------------------------------------------------- 7. the default job
device=cuda
[[ $smoke == 1 ]] && device=cpu
# The job runs under its own limit, 5 s inside the step's, so that the iterations it finished still print.
step --cut-ok "7 default job, 2 iterations" 35 bash -c "
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
    open(os.environ['STEP_NOTE'], 'w').write(f'{len(rows)} of 2 iterations finished')
PY
  report=\$?
  exit \$((rc != 0 ? rc : report))"

# ---------------------------------------------------------------------------------------- 8. Triton test tier
# The rest of the kernel tests: their "triton" cases (and the split-V / all-ignored / dispatch tests) run the
# compiled kernels on CUDA tensors (on the CPU: the interpreter, as in CI), ~70 distinct kernel variants, each
# compiled on its first launch: hence last, with the time that is left. The torch-path cases run on the CPU
# (about 10 s of the step).
if [[ $smoke == 1 && -n $interpreter_problem ]]; then
  not_run "8 kernel test tier (Triton interpreter)" "$interpreter_problem"
else
  step --cut-ok "8 kernel test tier (compiled Triton)" 600 bash "$scratch/pytest_tier.sh" "not gpu and not cuda" \
    "${kernel_test_files[@]}"
fi

# ---------------------------------------------------------------------------------------- summary
{
  echo
  echo "## Steps ($((SECONDS - start)) s in all$([[ $smoke == 1 ]] && echo ', --cpu-smoke'); ${versions:-versions unknown})"
  echo
  echo "| step | result | time |"
  echo "|---|---|---:|"
  printf '%s\n' "${status_rows[@]}"
  echo
  if ((${#failures[@]})); then
    echo "exit status 1: FAILED: $(printf '%s; ' "${failures[@]}" | sed 's/; $//')"
  else
    echo "exit status 0: nothing failed"
  fi
  if ((${#cut[@]})); then
    echo "cut by a time limit (partial results above, not failures): $(printf '%s; ' "${cut[@]}" | sed 's/; $//')"
  fi
} >> "$tables"
echo
cat "$tables"
echo
echo "tables: $tables   full log: $log"
((${#failures[@]})) && exit 1
exit 0
