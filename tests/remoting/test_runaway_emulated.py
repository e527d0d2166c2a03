"""Runaway work: a session whose lease ends (released, or expired) while its kernel runs for ever is
stopped within one heartbeat, and its slice serves the next lease. Real rgpu-poold and
rgpu-dispatcher daemons; the emulated GPU's fake kernel `rgpu_emulated_spin_forever` never
finishes, so the session's synchronise blocks for ever, with SIGTERM ignored (a driver call that
does not return to it): only the dispatcher's SIGKILL ends it."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from rgpu.adaptor import read_adaptor_conf
from rgpu.remoting.native import build
from tests.daemons import RgpuCluster, wait_for
from tests.remoting.conftest import client_env
from tests.remoting.faults_helpers import PRELUDE, PY, attacker_code, start_client, wait_line
from tests.admin_helpers import admin

REPO = Path(__file__).resolve().parents[2]
HEARTBEAT_S = 0.5


@pytest.mark.integration
@pytest.mark.parametrize("how", ["released", "expired"])
def test_a_kernel_that_runs_for_ever_is_stopped_when_its_lease_ends(native_libs: build.Libraries, tmp_path: Path,
                                                                     how: str) -> None:
    cluster = RgpuCluster(tmp_path)
    cluster.write_config(down_after_seconds=3.0, heartbeat_interval_seconds=HEARTBEAT_S, reclaim_interval_seconds=0.2)
    try:
        cluster.start_pool()
        dispatcher, port = cluster.start_dispatcher(REPO / "examples" / "inventory-a.toml")
        with cluster.client() as client:
            wait_for(lambda: len(client.list_gpus()) == 2, what="the dispatcher registered")
        conf_path = tmp_path / "spin.conf"
        ttl = ["--ttl", "3s"] if how == "expired" else []
        admin(cluster, "request-gpus", "-n", "1", "-p", "1.0", "--job-key", "spin", "-o", str(conf_path), *ttl)
        (s,) = read_adaptor_conf(conf_path).slices
        spinner = start_client(native_libs, f"{s.server},{s.token}", attacker_code("rgpu_emulated_spin_forever", """
            print("SPINNING", flush=True)
            print("SYNC", lib.cuCtxSynchronize(), flush=True)
            """))
        wait_line(spinner, "SPINNING")
        time.sleep(0.5)   # the worker is now inside the synchronise that never returns
        assert spinner.poll() is None
        if how == "released":
            admin(cluster, "release-gpus", "--job-key", "spin")
        ended_at = time.monotonic()
        out, err = spinner.communicate(timeout=30)
        stopped_after = time.monotonic() - ended_at
        assert "SYNC 0" not in out, out + err
        assert "lost the session" in err or "SYNC" in out, out + err
        wait_for(lambda: "did not end on SIGTERM" in dispatcher.log(), what="the dispatcher's SIGKILL")
        assert "its lease was released or reclaimed" in dispatcher.log()
        since = "its release" if how == "released" else "the spin began (its 3 s TTL included)"
        print(f"\nlease {how}: the spinning session ended {stopped_after:.2f} s after {since} (heartbeat "
              f"{HEARTBEAT_S} s, SIGTERM ignored, SIGKILL after 1 s)")
        # The slice serves the next lease: the same whole GPU, a session, an allocation.
        admin(cluster, "request-gpus", "-n", "1", "-p", "1.0", "--server", s.server, "--model", "H100",
              "--job-key", "next", "-o", str(tmp_path / "next.conf"))
        (n,) = read_adaptor_conf(tmp_path / "next.conf").slices
        done = subprocess.run([PY, "-c", PRELUDE + "setup()\nr, p = alloc(1 << 30)\nprint('NEXT', r, "
                               "lib.cuCtxSynchronize(), flush=True)\n"],
                              env=client_env(native_libs, f"{n.server},{n.token}"), capture_output=True, text=True,
                              timeout=60)
        assert "NEXT 0 0" in done.stdout, done.stdout + done.stderr
    finally:
        cluster.stop_all()
