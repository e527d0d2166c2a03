"""ListGpus built from per-server parts serialized once per change: always the pool as it is now."""

from __future__ import annotations

from pathlib import Path

from rgpu.remoting.pool.gpu_listing import GpuListing
from tests.poolcore_helpers import Clock, make_core, req


def test_listing_follows_leases_drains_down_servers_and_removals(tmp_path: Path) -> None:
    clock = Clock()
    core = make_core(tmp_path / "p.db", clock, servers=3)
    listing = GpuListing(core)

    def view() -> list[tuple[str, str, int, int]]:
        return [(g.server, g.server_state, g.gpu.index, g.allocated_percent) for g in listing.reply().gpus]

    def expected() -> list[tuple[str, str, int, int]]:
        return [(g.server, g.server_state, g.gpu.index, g.allocated_percent) for g in core.gpu_statuses()]

    assert view() == expected() and len(view()) == 6
    core.allocate(req("a", count=2, percent=50))
    assert view() == expected()
    core.set_drained("gpu1", True)
    assert view() == expected()
    clock.now += 11          # every server misses heartbeats: all down
    core.heartbeat("127.0.0.1:55001")
    assert view() == expected()
    core.remove_server("gpu2")
    assert view() == expected() and len(view()) == 4
    core.release("a")
    assert view() == expected()
