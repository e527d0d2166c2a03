#!/usr/bin/env bash
# rgpu demo on one machine, no GPU needed: `./scripts/demo.sh [--keep]` from any folder, as root or not.
#
# First it installs rgpu from this checkout into a virtual environment (Debian's own Python refuses
# `pip install` outside one): $RGPU_VENV, by default /opt/rgpu as root, else
# ~/.local/share/rgpu/venv. As root that environment must be readable by every user: Slurm runs
# jobs (and flexrun in them) as the job's user, and users run flexrun and rgpu-admin themselves;
# so it is made with a Python every user can run (not a pyenv under /root), never inside the
# checkout, which may lie in a 0700 home.
#
# As root: a real Slurm cluster (munge, slurmctld, three slurmd; Slurm, munge and gcc are installed
# with apt when missing) with rgpu's job_submit plugin, prologs and epilogs, the pool daemon with its Slurm
# integration and MUNGE for users, and two dispatchers with the example static inventories; it
# submits the mission's
#   sbatch --gres=rgpu:2 --comment=fraction=0.5 job.sh
# as user nobody, and shows the job's adaptor.conf, `flexrun -- nvidia-smi` in the job,
# `rgpu-admin list-gpus` while it runs and `rgpu-admin request-gpus` run by nobody. With --keep
# the cluster stays up until Ctrl-C, also when the demo failed (python -m rgpu.slurm_plugin.demo).
#
# Otherwise, or with --no-slurm: the pool daemon and two dispatchers alone, then
# `rgpu-admin request-gpus -n 2 -p 0.5` and the adaptor.conf it wrote.
set -euo pipefail
umask 022
here=$(cd "$(dirname "$0")/.." && pwd)

die() { echo "rgpu: demo: $*" >&2; exit 1; }

if [ "$(id -u)" = 0 ]; then
  venv=${RGPU_VENV:-/opt/rgpu}
else
  venv=${RGPU_VENV:-${XDG_DATA_HOME:-$HOME/.local/share}/rgpu/venv}
fi

# A Python >= 3.11 for the venv; as root one that every user can run (nobody stands for them).
# shellcheck source=scripts/pick-python.sh
. "$here/scripts/pick-python.sh"
candidates=("${RGPU_PYTHON:-}" "$(command -v python3 || true)" /usr/bin/python3 /usr/local/bin/python3)
apt_install() {
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || return 1
  echo "demo: installing $* with apt-get"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

if [ ! -x "$venv/bin/python" ]; then
  if ! python=$(pick_python "${candidates[@]}"); then
    apt_install python3 python3-venv || true
    python=$(pick_python "${candidates[@]}") || { why_no_python "${candidates[@]}" >&2; exit 1; }
  fi
  echo "demo: making the virtual environment $venv with $python"
  mkdir -p "$(dirname "$venv")"
  if ! "$python" -m venv "$venv" 2>/dev/null; then
    rm -rf "$venv"
    # Debian keeps venv's ensurepip in a package of its own.
    apt_install python3-venv || die "cannot make a virtual environment with $python (install python3-venv)"
    "$python" -m venv "$venv" || die "cannot make a virtual environment with $python in $venv"
  fi
fi
echo "demo: installing rgpu from $here into $venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check "$here" \
  || die "pip could not install rgpu into $venv (above); set RGPU_VENV to use another virtual environment"
export PATH="$venv/bin:$PATH"

if [ "${1:-}" != "--no-slurm" ] && [ "$(id -u)" = 0 ]; then
  # Run from outside the checkout: `python -m` (here and for the daemons the demo starts) puts the
  # cwd first on sys.path, and the checkout's rgpu/ (the whole package, through its links) would
  # stand in for the installed one, which every user can read and which holds the built libraries.
  export RGPU_SOURCE_TREE="$here"
  cd /
  exec "$venv/bin/python" -m rgpu.slurm_plugin.demo "$@"
fi

work=$(mktemp -d -t rgpu-demo.XXXXXX)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

# Daemons bind port 0 and write the port they got to --port-file once they serve.
wait_port() {  # FILE PID LOG: the port in FILE, once the daemon PID wrote it
  for _ in $(seq 300); do
    [ -s "$1" ] && { cat "$1"; return; }
    kill -0 "$2" 2>/dev/null || { echo "demo: a daemon exited at startup:" >&2; cat "$3" >&2; exit 1; }
    sleep 0.1
  done
  echo "demo: no port in $1 after 30 s" >&2; exit 1
}
export RGPU_CONFIG="$work/rgpu.toml" RGPU_SECRET_FILE="$work/secret"
printf 'heartbeat_interval_seconds = 1.0\ndown_after_seconds = 5.0\n' > "$RGPU_CONFIG"

echo "== cluster secret"
rgpu-admin secret create "$RGPU_SECRET_FILE"

rgpu-poold --listen 127.0.0.1:0 --port-file "$work/poold.port" --state "$work/pool.db" 2> "$work/poold.log" &
pids+=($!)
export RGPU_POOL="127.0.0.1:$(wait_port "$work/poold.port" "$!" "$work/poold.log")"
echo "== rgpu-poold on $RGPU_POOL (state $work/pool.db)"

# Emulated GPUs keep their "device" memory in this host's RAM: the four share half of what is available.
per_gpu_mib=$(awk '/^MemAvailable:/ { m = int($2 / 1024 / 2 / 4); if (m > 81920) m = 81920; if (m < 256) m = 256; print m }' /proc/meminfo)
echo "== two rgpu-dispatchers with static inventories; each emulated GPU offers ${per_gpu_mib} MiB (RGPU_GPU_DEVICE_MEMORY_LIMIT: its device memory is this host's RAM)"
for name in a b; do
  RGPU_GPU_DEVICE_MEMORY_LIMIT="${per_gpu_mib}M" \
  rgpu-dispatcher -p 0 --port-file "$work/dispatcher-$name.port" --host 127.0.0.1 --advertise 127.0.0.1 \
    --pool "$RGPU_POOL" --inventory "$here/examples/inventory-$name.toml" 2> "$work/dispatcher-$name.log" &
  pids+=($!)
  wait_port "$work/dispatcher-$name.port" "$!" "$work/dispatcher-$name.log" >/dev/null
done

for _ in $(seq 100); do
  n=$(rgpu-admin --json list-gpus 2>/dev/null | python3 -c 'import json,sys; print(len(json.load(sys.stdin)))' 2>/dev/null || echo 0)
  [ "$n" -ge 4 ] && break
  sleep 0.2
done
rgpu-admin health

echo; echo "== rgpu-admin request-gpus -n 2 -p 0.5 -o $work/adaptor.conf"
rgpu-admin request-gpus -n 2 -p 0.5 -o "$work/adaptor.conf"
echo; echo "== $work/adaptor.conf"
cat "$work/adaptor.conf"
echo; echo "== rgpu-admin list-gpus"
rgpu-admin list-gpus
echo; echo "== rgpu-admin leases"
rgpu-admin leases
echo; echo "== rgpu-admin release-gpus"
rgpu-admin release-gpus -f "$work/adaptor.conf"
