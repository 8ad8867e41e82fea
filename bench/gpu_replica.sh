#!/usr/bin/env bash
# The GPU machine's software rebuilt on this CPU machine as closely as pip allows, then the offline install and the
# smoke run of bench/gpu_suite.sh there, from a fresh copy of the code (gpu-audit-2's method, as a script).
# Not run by .ci/run: it downloads a second torch (about 3.5 GB with the CUDA libraries its wheel requires).
#
#     bash bench/gpu_replica.sh                  # a fresh `git clone` of this checkout's HEAD (committed code only)
#     bash bench/gpu_replica.sh --worktree       # a copy of the working tree instead: tracked and untracked files,
#                                                # not ignored ones (`git ls-files -co --exclude-standard`)
#     bash bench/gpu_replica.sh --venv DIR       # build the venv in DIR and keep it (a second run reuses it);
#                                                # default: a temporary one, removed at the end
#
# The GPU machine (gpu_suite.sh's header): torch 2.11, triton 3.6, transformers 5.17, pytest, no network. Here, a
# venv made by `python3 -m venv` (its own pip and setuptools, e.g. pip 23.2.1 and setuptools 65.5.0 on python
# 3.11, and no `wheel`: the case where the offline install must copy), with, from the configured index:
#   torch==2.11.0      PyPI's Linux wheel is the CUDA 13 build: it requires the CUDA libraries (cuda-toolkit,
#                      cuDNN, NCCL, ...) and runs on the CPU. (The CPU-only build's index is not reachable here;
#                      the wheel alone, --no-deps, does not import: libcudnn.so.9 is missing.)
#   triton==3.6.0      the version torch 2.11 pins
#   transformers==5.17.0, pytest, and the package's other install_requires (safetensors, tokenizers, jinja2, tqdm)
#   numpy<2.4          triton 3.6's interpreter does int() of a 1-element array, which numpy 2.4 rejects (the
#                      smoke run's step 2 reports that pair as INCOMPATIBLE)
# Then, with no network (`unshare -n`, loopback only, where it works; else PIP_NO_INDEX=1 alone), pip's config
# files and find-links ignored, in the fresh copy: bench/offline_install.sh (a real install into the venv), an
# import check from outside the checkout, and `bash bench/gpu_suite.sh --cpu-smoke` (its tables are kept in
# runs/gpu-replica/ of this checkout). Prints the versions, each phase's result and time; exits 0 when the install,
# the import check and the smoke run all passed.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

source_kind=clone
venv=""
while (($#)); do
  case $1 in
    --worktree) source_kind=worktree ;;
    --venv) venv=$(realpath -m "${2:?--venv needs a directory}"); shift ;;
    *) echo "usage: bash bench/gpu_replica.sh [--worktree] [--venv DIR]" >&2; exit 2 ;;
  esac
  shift
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
[[ -z $venv ]] && venv=$tmp/venv
out=$repo/runs/gpu-replica  # runs/ is git-ignored
t_start=$SECONDS
PACKAGES=("torch==2.11.0" "triton==3.6.0" "transformers==5.17.0" pytest "numpy<2.4"
          "safetensors>=0.4" "tokenizers>=0.19" "jinja2>=3.1" "tqdm>=4.60")

# ------------------------------------------------------------------------------------------------ 1. the venv
t0=$SECONDS
echo "=== venv: $venv"
[[ -x $venv/bin/python ]] || python3 -m venv "$venv" || exit 1
# (in a kept venv that already has them, this only checks)
"$venv/bin/python" -m pip install -q --disable-pip-version-check "${PACKAGES[@]}" 2>&1 \
  | grep -v "is ignored: it is neither a file nor a directory"
[[ ${PIPESTATUS[0]} == 0 ]] || { echo "venv: pip install failed"; exit 1; }
"$venv/bin/python" - <<'PY' | tee "$tmp/versions"
import importlib.metadata as md
import sys

def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "none"

names = ["torch", "triton", "transformers", "numpy", "pytest", "pip", "setuptools", "wheel", "kernels"]
print(f"versions: python {sys.version.split()[0]}, " + ", ".join(f"{n} {version(n)}" for n in names))
PY
t_venv=$((SECONDS - t0))

# ------------------------------------------------------------------------------------------------ 2. the code
mkdir "$tmp/src"
if [[ $source_kind == clone ]]; then
  git clone -q --no-hardlinks "$repo" "$tmp/src" || exit 1
  echo "=== code: git clone of $(git -C "$repo" log -1 --format='%h %s' | cut -c1-100)"
else
  # tracked files still present (a deleted one is listed too) and untracked ones git does not ignore; links as links
  (cd "$repo" && git ls-files -co --exclude-standard -z | while IFS= read -r -d '' f; do
     [[ -e $f || -L $f ]] && printf '%s\0' "$f"; done | xargs -0 cp -P --parents -t "$tmp/src") || exit 1
  echo "=== code: a copy of the working tree at $(git -C "$repo" log -1 --format='%h') plus its uncommitted changes" \
       "($(git -C "$repo" status --porcelain | wc -l) changed or untracked paths)"
fi

# ------------------------------------------------------------------------------------------------ 3. offline
cat > "$tmp/offline.sh" <<'SH'
set -uo pipefail
venv=$1 src=$2 out=$3 results=$4
export PATH="$venv/bin:$PATH" VIRTUAL_ENV="$venv" PIP_NO_INDEX=1 PIP_CONFIG_FILE=/dev/null
unset PIP_FIND_LINKS PIP_EXTRA_INDEX_URL PIP_INDEX_URL PIP_CONSTRAINT
cd "$src"
t0=$SECONDS
echo "=== offline install: bash bench/offline_install.sh"
bash bench/offline_install.sh
echo "install $? $((SECONDS - t0))" >> "$results"
t0=$SECONDS
echo "=== import check, from outside the checkout"
(cd "$venv" && python3 -c "
import ppo_core, ppo_kernels, torch
print('ppo_core', ppo_core.__file__); print('ppo_kernels', ppo_kernels.__file__); print('torch', torch.__version__)")
echo "import $? $((SECONDS - t0))" >> "$results"
t0=$SECONDS
echo "=== bash bench/gpu_suite.sh --cpu-smoke"
OUT=$out bash bench/gpu_suite.sh --cpu-smoke
echo "smoke $? $((SECONDS - t0))" >> "$results"
SH
rm -rf "$out"
mkdir -p "$out"
: > "$tmp/results"
if unshare -n true 2>/dev/null; then
  echo "=== no network from here on: unshare -n (loopback only)"
  unshare -n bash -c "ip link set lo up && bash '$tmp/offline.sh' '$venv' '$tmp/src' '$out' '$tmp/results'"
else
  echo "=== unshare -n is not available: PIP_NO_INDEX=1 only (the network is still there)"
  bash "$tmp/offline.sh" "$venv" "$tmp/src" "$out" "$tmp/results"
fi

# ------------------------------------------------------------------------------------------------ summary
echo
echo "=== replica summary"
cat "$tmp/versions"
echo "code: $source_kind"
echo "venv: $t_venv s"
status=0
for phase in install import smoke; do
  read -r _ rc took < <(grep "^$phase " "$tmp/results") || { rc=missing took=0; }
  [[ $rc == 0 ]] || status=1
  echo "$phase: $([[ $rc == 0 ]] && echo ok || echo "FAILED (exit $rc)"), $took s"
done
[[ -f $out/tables.md ]] && { grep -E '^exit status|^cut by' "$out/tables.md"; echo "smoke tables: $out/tables.md"; }
echo "total: $((SECONDS - t_start)) s"
exit $status
