# Sourced by scripts/demo.sh (and its test): which Python makes rgpu's virtual environment.
# bash; no side effects beyond running the candidates and, as root, `runuser -u nobody`.
#
# As root the environment must be usable by every user (Slurm runs jobs, and flexrun in them, as
# the job's user; users run flexrun and rgpu-admin themselves), so its Python must be one that
# `nobody` can run. A pyenv shim (~/.pyenv/shims/python3) is a script that runs the real
# interpreter under ~/.pyenv/versions/: each candidate is judged by the interpreter it really runs
# (sys.executable), which under root's 0700 home no other user can reach.

rgpu_real_python() {  # CANDIDATE: the interpreter it really runs, or nothing
  "$1" -c 'import os, sys; print(os.path.realpath(sys.executable))' 2>/dev/null
}

rgpu_usable_python() {  # PYTHON: true when it is 3.11+ and, as root, `nobody` can run it
  "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || return 1
  [ "$(id -u)" != 0 ] && return 0
  runuser -u nobody -- "$1" -c 'import sys' >/dev/null 2>&1
}

pick_python() {  # CANDIDATE...: print the first usable real interpreter; false when none is
  local candidate real
  for candidate in "$@"; do
    [ -n "$candidate" ] && [ -x "$candidate" ] || continue
    real=$(rgpu_real_python "$candidate") || continue
    [ -n "$real" ] && rgpu_usable_python "$real" && { echo "$real"; return 0; }
  done
  return 1
}

why_no_python() {  # CANDIDATE...: one line saying why none will do and what to do
  local candidate real seen=""
  for candidate in "$@"; do
    [ -n "$candidate" ] && [ -x "$candidate" ] || continue
    real=$(rgpu_real_python "$candidate") || real=""
    if [ -z "$real" ]; then
      seen="$seen${seen:+; }$candidate does not run"
    elif ! "$real" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      seen="$seen${seen:+; }$candidate is older than 3.11"
    else
      seen="$seen${seen:+; }$candidate runs $real, which user nobody cannot run"
    fi
  done
  echo "rgpu: demo: no Python 3.11 or later that every user can run (${seen:-no python3 found}; install Debian's python3 and python3-venv: apt-get install python3 python3-venv, or set RGPU_PYTHON to a Python 3.11+ outside any 0700 folder)"
}
