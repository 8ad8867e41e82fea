#!/usr/bin/env bash
# The offline install (bench/offline_install.sh, gpu_suite.sh step 1) where it used to fail (gpu-audit-2 item 1):
# a venv with pip 23.2.1 and setuptools 65.5.0, no `wheel`, and PyPI's `kernels` package, whose setuptools entry
# point (egg_info.writers) imports kernels._internals while any package's metadata is written, from a checkout
# whose top-level kernels/ could shadow it. Not in .ci/run: it downloads those three packages (seconds).
#
#     bash bench/offline_install_check.sh             # venv from python3; prints PASS or FAIL per check
#
# Network only to build the venv; then, in a copy of the working tree (tracked and untracked files, not ignored
# ones), with PIP_NO_INDEX=1, pip's config files ignored and, where `unshare -n` works, no network at all:
#   1. bench/offline_install.sh --dry-run, then bench/offline_install.sh (a real install into the venv);
#   2. from outside the checkout: ppo_core and ppo_kernels are found in the venv's site-packages, pip knows
#      ppo-core, and the ppo-train command exists (the venv has no torch: the modules are located, not run);
#   3. from the checkout's root: `import kernels` is PyPI's package, kernels._internals included.
# Exit status: 0 when every check passes.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
venv=$tmp/venv
t0=$SECONDS

python3 -m venv "$venv" || exit 1
"$venv/bin/python" -m pip install -q --disable-pip-version-check "pip==23.2.1" "setuptools==65.5.0" kernels || exit 1
"$venv/bin/python" -m pip uninstall -q -y wheel 2>/dev/null
echo "venv: $("$venv/bin/python" - <<'PY'
import importlib.metadata as md, sys
def v(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "none"
print(f"python {sys.version.split()[0]}, pip {v('pip')}, setuptools {v('setuptools')}, wheel {v('wheel')}, "
      f"kernels {v('kernels')}, torch {v('torch')}")
PY
)"

mkdir "$tmp/src"  # tracked files still present and untracked ones git does not ignore; links as links
(cd "$repo" && git ls-files -co --exclude-standard -z | while IFS= read -r -d '' f; do
   [[ -e $f || -L $f ]] && printf '%s\0' "$f"; done | xargs -0 cp -P --parents -t "$tmp/src") || exit 1

cat > "$tmp/offline.sh" <<'SH'
set -uo pipefail
venv=$1 src=$2
export PATH="$venv/bin:$PATH" VIRTUAL_ENV="$venv" PIP_NO_INDEX=1 PIP_CONFIG_FILE=/dev/null
unset PIP_FIND_LINKS PIP_EXTRA_INDEX_URL PIP_INDEX_URL PIP_CONSTRAINT
status=0
check() {  # check NAME CMD...: PASS when CMD exits 0
  local name=$1
  shift
  if out=$("$@" 2>&1); then
    echo "PASS  $name: $(tail -1 <<< "$out")"
  else
    echo "FAIL  $name:"
    sed 's/^/      /' <<< "$out" | tail -25
    status=1
  fi
}
cd "$src"
check "offline install, dry run" bash bench/offline_install.sh --dry-run
check "offline install" bash bench/offline_install.sh
site=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cd "$venv"  # outside the checkout
check "ppo_core and ppo_kernels come from the venv" python3 -c "
import importlib.util as u
for name in ('ppo_core', 'ppo_kernels'):
    origin = u.find_spec(name).origin
    assert origin.startswith('$site/' + name + '/') or origin.startswith('$src/'), (name, origin)
    print(name, origin)"
check "pip knows ppo-core" bash -c "python3 -m pip show ppo-core | grep -E '^(Name|Version|Location)' | tr '\n' ' '"
check "ppo-train command" ls "$venv/bin/ppo-train"
cd "$src"  # the checkout's root first on sys.path, as in the suite
check "import kernels from the checkout is PyPI's" python3 -c "
import kernels, kernels._internals.locking
assert kernels.__file__.startswith('$site/kernels/'), kernels.__file__
print('kernels:', kernels.__file__)"
exit $status
SH
if unshare -n true 2>/dev/null; then
  echo "no network: unshare -n (loopback only)"
  unshare -n bash -c "ip link set lo up 2>/dev/null; bash '$tmp/offline.sh' '$venv' '$tmp/src'"
else
  echo "unshare -n unavailable: PIP_NO_INDEX=1 only"
  bash "$tmp/offline.sh" "$venv" "$tmp/src"
fi
status=$?
echo "$([[ $status == 0 ]] && echo "all checks passed" || echo "some check FAILED") ($((SECONDS - t0)) s)"
exit $status
