"""Sharing modes per GPU (mps | isolated | exclusive): the dispatcher's setting, its registration,
`rgpu-admin list-gpus` / `health`, and isolation=strict requests placed only where no other job's
fault reaches them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rgpu.errors import ConfigError, InvalidRequest
from rgpu.model import GpuInfo
from rgpu.remoting.client.flexrun import parse_args
from rgpu.remoting.dispatcher.sharing import parse_sharing
from tests.daemons import RgpuCluster, wait_for
from tests.admin_helpers import admin

REPO = Path(__file__).resolve().parent.parent
INVENTORY_A = REPO / "examples" / "inventory-a.toml"
GPUS = tuple(GpuInfo(f"GPU-{i}", i, "NVIDIA H100", 80 << 30, 80 << 30, "9.0") for i in range(3))


def test_sharing_setting_by_default_index_or_uuid() -> None:
    assert parse_sharing("mps", GPUS) == {"GPU-0": "mps", "GPU-1": "mps", "GPU-2": "mps"}
    assert parse_sharing("", GPUS) == {"GPU-0": "mps", "GPU-1": "mps", "GPU-2": "mps"}
    assert parse_sharing("Isolated", GPUS) == {"GPU-0": "isolated", "GPU-1": "isolated", "GPU-2": "isolated"}
    assert parse_sharing("0=exclusive, GPU-2=isolated", GPUS) == {"GPU-0": "exclusive", "GPU-1": "mps",
                                                                  "GPU-2": "isolated"}
    assert parse_sharing("isolated,1=mps", GPUS) == {"GPU-0": "isolated", "GPU-1": "mps", "GPU-2": "isolated"}


@pytest.mark.parametrize("text, error", [
    ("shared", "unknown mode 'shared'"),
    ("0=shared", "unknown mode 'shared'"),
    ("7=isolated", "names GPU '7'"),
    ("0=isolated,0=mps", "names GPU '0' twice"),
    ("mps,isolated", "two default modes"),
])
def test_bad_sharing_settings_are_one_line_errors(text: str, error: str) -> None:
    with pytest.raises(ConfigError, match=error) as caught:
        parse_sharing(text, GPUS, "$RGPU_GPU_SHARING")
    assert "\n" not in str(caught.value) and "$RGPU_GPU_SHARING" in str(caught.value)


def test_flexrun_isolation_option() -> None:
    assert parse_args(["-n", "1", "-p", "0.5", "--isolation", "strict", "--", "app"]).isolation == "strict"
    assert parse_args(["-n", "1", "--", "app"]).isolation == ""
    with pytest.raises(InvalidRequest, match="--isolation 'loose' is unknown"):
        parse_args(["-n", "1", "--isolation", "loose", "--", "app"])
    with pytest.raises(InvalidRequest, match="cannot be used with -f"):
        parse_args(["-f", "x.conf", "--isolation", "strict", "--", "app"])


@pytest.mark.integration
def test_sharing_modes_registered_listed_and_strict_requests_placed_only_on_them(tmp_path: Path) -> None:
    cluster = RgpuCluster(tmp_path)
    cluster.write_config(down_after_seconds=3.0, heartbeat_interval_seconds=0.5, reclaim_interval_seconds=0.5)
    try:
        cluster.start_pool()
        # inventory-a has two GPUs: 0 isolated, 1 exclusive; a second dispatcher keeps MPS (the default).
        cluster.start_dispatcher(INVENTORY_A, env=cluster.env(RGPU_GPU_SHARING="0=isolated,1=exclusive"))
        cluster.start_dispatcher(REPO / "examples" / "inventory-b.toml")
        with cluster.client() as client:
            wait_for(lambda: len(client.list_gpus()) >= 3, what="both dispatchers registered")
        gpus = json.loads(admin(cluster, "list-gpus", "--json").stdout)
        by_mode = {(g["sharing"]) for g in gpus}
        assert by_mode == {"mps", "isolated", "exclusive"}
        assert "SHARING" in admin(cluster, "list-gpus").stdout
        isolated = next(g for g in gpus if g["sharing"] == "isolated")
        exclusive = next(g for g in gpus if g["sharing"] == "exclusive")

        def request(name: str, *args: str, ok: bool = True) -> dict:
            run = admin(cluster, "request-gpus", "-o", str(tmp_path / f"{name}.conf"), "--job-key", name, *args, ok=ok)
            if not ok:
                assert run.returncode != 0
                return {"error": run.stderr + run.stdout}
            (lease,) = [lease for lease in json.loads(admin(cluster, "leases", "--json").stdout)
                        if lease["job_key"] == name]
            return lease

        # Strict halves go on the isolated GPU only (never MPS, never part of the exclusive GPU).
        for name in ("strict-a", "strict-b"):
            (s,) = request(name, "-n", "1", "-p", "0.5", "--isolation", "strict")["slices"]
            assert s["gpu_uuid"] == isolated["uuid"]
        refused = request("strict-c", "-n", "1", "-p", "0.5", "--isolation", "strict", ok=False)
        assert "isolation=strict" in refused["error"] and "\n" not in refused["error"].strip()
        # A whole GPU may take the exclusive one.
        (s,) = request("strict-whole", "-n", "1", "-p", "1.0", "--isolation", "strict")["slices"]
        assert s["gpu_uuid"] == exclusive["uuid"]
        # Without isolation, partial slices go on MPS GPUs.
        (s,) = request("loose", "-n", "1", "-p", "0.25")["slices"]
        assert s["gpu_uuid"] not in (isolated["uuid"], exclusive["uuid"])

        health = admin(cluster, "health").stdout
        assert "SHARING" in health and "0 isolated; 1 exclusive" in health
        rows = json.loads(admin(cluster, "health", "--json").stdout)
        assert {r["sharing"] for r in rows} == {"mps", "0 isolated; 1 exclusive"}
    finally:
        cluster.stop_all()


@pytest.mark.integration
def test_strict_isolation_in_a_pool_without_isolated_gpus_is_a_usage_error_not_a_wait(cluster: RgpuCluster,
                                                                                     tmp_path: Path) -> None:
    """Issue 29: it said "wait for capacity" with exit 3, though no wait could ever place it."""
    cluster.start_pool()
    cluster.start_dispatcher(INVENTORY_A)   # MPS, the default
    with cluster.client() as client:
        wait_for(lambda: len(client.list_gpus()) >= 2, what="the dispatcher registered")
    run = admin(cluster, "request-gpus", "-o", str(tmp_path / "s.conf"), "--job-key", "s", "-n", "1", "-p", "0.5",
                "--isolation", "strict", ok=False)
    lines = (run.stderr + run.stdout).strip().splitlines()
    assert run.returncode == 2, (run.returncode, lines)
    assert len(lines) == 1 and "this pool has none" in lines[0] and "wait for capacity" not in lines[0], lines
    # The same pool still places what it can hold.
    admin(cluster, "request-gpus", "-o", str(tmp_path / "m.conf"), "--job-key", "m", "-n", "1", "-p", "0.5")


def test_sharing_survives_the_pools_state_and_old_rows_read_as_mps() -> None:
    import json as _json
    from dataclasses import asdict

    from rgpu.model import ServerInfo
    from rgpu.remoting.pool.store import server_from_json

    info = ServerInfo("10.0.0.1:55001", "gpu1", "580", "13.0",
                      (GpuInfo("GPU-0", 0, "NVIDIA H100", 80 << 30, 80 << 30, "9.0", sharing="isolated"),))
    assert server_from_json(_json.dumps(asdict(info))) == info
    old = asdict(info)
    del old["gpus"][0]["sharing"]            # a row written before sharing modes existed
    assert server_from_json(_json.dumps(old)).gpus[0].sharing == "mps"
