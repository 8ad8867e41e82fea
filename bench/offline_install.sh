#!/usr/bin/env bash
# Install this checkout with no network, no index and no build isolation, with whatever pip and setuptools the
# machine has (bench/gpu_suite.sh step 1; bench/offline_install_check.sh tests it in a venv without `wheel`).
#
#     bash bench/offline_install.sh              # install into the running python3's environment
#     bash bench/offline_install.sh --dry-run    # build and check everything, install nothing
#
# Only this package (--no-deps: the machine's torch/triton stay as they are). Two ways, the first that applies:
#   editable  `pip install --no-build-isolation --no-deps --use-pep517 -e .` (PEP 660; without --use-pep517, pip 24.0
#             with setuptools 81 on the H200 machine took the legacy `setup.py develop`, which runs pip again with build
#             isolation and failed offline). It builds an editable wheel, so it needs
#             setuptools' bdist_wheel command: setuptools >= 70.1 carries it, older ones take it from the `wheel`
#             package. Without it (e.g. pip 23.2 + setuptools 65.5, a fresh python 3.11 venv) metadata generation
#             stops with "error: invalid command 'bdist_wheel'".
#   copy      `setup.py install --single-version-externally-managed`: setuptools alone copies ppo_core/ and kernels/
#             (as ppo_kernels/) into site-packages, with the package's metadata and the ppo-* commands; not
#             editable (run it again after editing the checkout). Needs no wheel and fetches nothing.
# Neither `pip install --no-use-pep517 -e .` (pip refuses it without wheel) nor `setup.py develop` (it puts the
# checkout root on sys.path, where kernels/ is not importable as ppo_kernels) would do.
# If the chosen way fails, the other is tried. Prints what it found and which way installed the package; exits 0
# if one of them did (with --dry-run: built it), else 1. build/ and the egg-info go to a temporary directory.
set -uo pipefail
cd "$(dirname "$0")/.."

dry_run=0
if [[ "${1:-}" == "--dry-run" ]]; then
  dry_run=1
elif [[ $# -gt 0 ]]; then
  echo "usage: bash bench/offline_install.sh [--dry-run]" >&2
  exit 2
fi
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# What the machine has: pip, setuptools, wheel, and whether setuptools can run bdist_wheel.
python3 - > "$work/found" <<'PY'
import importlib.metadata as md
import importlib.util

def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "none"

try:
    from setuptools.dist import Distribution
    Distribution().get_command_class("bdist_wheel")
    bdist_wheel = "yes"
except Exception as e:  # DistutilsModuleError: invalid command 'bdist_wheel'; ImportError: no setuptools
    bdist_wheel = f"no ({type(e).__name__})"
pip = version("pip") if importlib.util.find_spec("pip") else "none"
print(f"pip {pip}, setuptools {version('setuptools')}, wheel {version('wheel')}, bdist_wheel available: {bdist_wheel}")
PY
echo "found: $(cat "$work/found")"

editable() {
  local cmd=(python3 -m pip install --no-build-isolation --no-deps --use-pep517 -e .)
  ((dry_run)) && cmd+=(--dry-run)
  echo "editable: ${cmd[*]}"
  "${cmd[@]}" > "$work/editable.log" 2>&1
  local rc=$?
  if ((rc != 0)); then
    echo "editable: FAILED (exit $rc): $(grep -E '^\s*(error|ERROR)' "$work/editable.log" | tail -1 | sed 's/^ *//')" 
    tail -20 "$work/editable.log" >&2
  fi
  return $rc
}

copy() {
  # egg_info and build write into $work, not into the checkout; --dry-run installs under a staging root instead
  local cmd=(python3 setup.py -q egg_info --egg-base "$work" build --build-base "$work/build"
             install --single-version-externally-managed --record "$work/installed.txt")
  ((dry_run)) && cmd+=(--root "$work/stage")
  echo "copy: ${cmd[*]}"
  "${cmd[@]}" > "$work/copy.log" 2>&1
  local rc=$?
  if ((rc == 0)) && ! grep -q "/ppo_kernels/__init__.py$" "$work/installed.txt"; then
    echo "copy: setup.py exited 0 but installed no ppo_kernels/__init__.py" >&2
    rc=1
  fi
  if ((rc != 0)); then
    echo "copy: FAILED (exit $rc): $(grep -iE 'error' "$work/copy.log" | tail -1)"
    tail -20 "$work/copy.log" >&2
  else
    echo "copy: $(wc -l < "$work/installed.txt") files ($(grep -m1 "/ppo_kernels/__init__.py$" "$work/installed.txt" |
      sed 's|/ppo_kernels/__init__.py$||')$( ((dry_run)) && echo ', under a staging root: the dry run installs nothing'))"
  fi
  return $rc
}

if grep -q "bdist_wheel available: yes" "$work/found"; then
  order=(editable copy)
else
  order=(copy editable)
  echo "no bdist_wheel command (no wheel package, setuptools < 70.1): a pip editable install cannot build; copying instead"
fi
for way in "${order[@]}"; do
  if "$way"; then
    echo "installed by: $way$( ((dry_run)) && echo ' (dry run: nothing changed)')" | tee "${STEP_NOTE:-/dev/null}"
    exit 0
  fi
done
echo "offline install: neither way worked (see stderr)"
exit 1
