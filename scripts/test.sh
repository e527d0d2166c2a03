#!/usr/bin/env bash
# Install what the tests need on a fresh Debian machine, then run them.
#   ./scripts/test.sh            all tests (GPU tests skip themselves without a GPU)
#   ./scripts/test.sh -m 'not slurm'   extra arguments go to pytest
# As root with apt-get available, installs the Debian packages in .ci/debian-packages.txt (Slurm,
# munge, Lua, a C compiler) for the real-Slurm and native-library tests; otherwise those tests skip.
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

python3 -m pip install -q --disable-pip-version-check -e '.[test]'
exec python3 -m pytest "$@"
