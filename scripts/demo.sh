#!/usr/bin/env bash
# rgpu demo on one machine, no GPU needed. Everything runs on loopback under a temporary
# directory and is stopped at the end.
#
# As root: a real Slurm cluster (munge, slurmctld, three slurmd; Slurm is installed with apt when
# missing) with rgpu's job_submit plugin, prologs and epilogs, a pool daemon and two dispatchers
# with the example static inventories; it submits the mission's
#   sbatch --gres=rgpu:2 --comment=fraction=0.5 job.sh
# and shows the job's adaptor.conf and `rgpu-admin list-gpus` while it runs.
#
# Otherwise, or with --no-slurm: the pool daemon and two dispatchers alone, then
# `rgpu-admin request-gpus -n 2 -p 0.5` and the adaptor.conf it wrote.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" != "--no-slurm" ] && [ "$(id -u)" = 0 ]; then
  # Run from outside the checkout: its rgpu/ folder would hide the installed package.
  export RGPU_SOURCE_TREE="$PWD"
  cd /
  exec python3 -m rgpu.slurm_plugin.demo "$@"
fi

work=$(mktemp -d -t rgpu-demo.XXXXXX)
here=$(cd "$(dirname "$0")/.." && pwd)
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

echo "== two rgpu-dispatchers with static inventories"
for name in a b; do
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
