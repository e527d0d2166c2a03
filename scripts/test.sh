#!/usr/bin/env bash
# Install what the tests need on a fresh Debian machine, then run them.
#   ./scripts/test.sh            all tests (GPU tests skip themselves without a GPU)
#   ./scripts/test.sh -m 'not slurm'   extra arguments go to pytest
# As root with apt-get available, installs the Debian packages in .ci/debian-packages.txt (Slurm,
# munge, Lua, a C compiler, mmdebstrap) for the real-Slurm and native-library tests; otherwise those
# tests skip. RGPU_SLURM_VERSIONS=22.05,24.11 picks the Slurm versions of the real-cluster tests.
# rgpu and the test tools go into a virtual environment (Debian's own Python refuses `pip install`
# outside one): the active one ($VIRTUAL_ENV), else .venv in this checkout (made here; git ignores it).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && [ -s .ci/debian-packages.txt ]; then
  mapfile -t wanted < <(grep -v '^\s*#' .ci/debian-packages.txt | sed '/^\s*$/d')
  missing=()
  for pkg in "${wanted[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "test.sh: installing Debian packages: ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
fi

if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
  py=$VIRTUAL_ENV/bin/python
else
  py=$PWD/.venv/bin/python
  if [ ! -x "$py" ]; then
    if ! python3 -m venv .venv; then
      rm -rf .venv
      # Debian keeps venv's ensurepip in a package of its own.
      if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
        python3 -m venv .venv
      else
        echo "rgpu: test.sh: cannot make the virtual environment .venv (python3 -m venv failed; install python3-venv)" >&2
        exit 1
      fi
    fi
  fi
fi
"$py" -m pip install -q --disable-pip-version-check -e '.[test]'
export PATH="$(dirname "$py"):$PATH"    # its console scripts (rgpu-admin, flexrun...), as when activated

# The real-cluster tests run on each Slurm version in $RGPU_SLURM_VERSIONS (default all three:
# 22.05, 24.11, 26.05). Versions other than the host's run from Debian roots built with mmdebstrap
# (about 20 s each, progress shown) and cached in /var/cache/rgpu-slurm-roots between runs.
if [ "$(id -u)" = 0 ] && command -v mmdebstrap >/dev/null; then
  if ! "$py" -m rgpu.slurm_plugin.slurmroot build "${RGPU_SLURM_VERSIONS:-all}"; then
    echo "test.sh: a Slurm root could not be built (above); set RGPU_SLURM_VERSIONS to the versions this" \
         "machine can run (e.g. RGPU_SLURM_VERSIONS=22.05) or fix its apt mirror" >&2
    exit 1
  fi
fi
exec "$py" -m pytest "$@"
