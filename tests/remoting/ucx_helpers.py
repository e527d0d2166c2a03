"""The UCX copy list and operations shared by the UCX tests (emulated and real GPU)."""

from __future__ import annotations

import ctypes
from pathlib import Path

from rgpu.remoting.native import client_stats
from rgpu.remoting.native.generated import api_gen


HERE = Path(__file__).parent
OP = api_gen.OPCODES


def _have_ucx() -> bool:
    try:
        ctypes.CDLL("libucp.so.0")
        return True
    except OSError:
        return False


def _ucx_ops(profile_prefix: Path) -> tuple[int, int]:
    """(host-to-device, device-to-host) copies the client sent as UCX copies, from its call profile."""
    files = list(profile_prefix.parent.glob(profile_prefix.name + ".*"))
    assert len(files) == 1, files
    ops, _ = client_stats.parse(files[0].read_text())
    htod = ops.get(OP["rgpuMemcpyHtoDUcx"])
    dtoh = ops.get(OP["rgpuMemcpyDtoHUcx"])
    return (htod.async_calls if htod else 0), (dtoh.sync_calls if dtoh else 0)


# ucx_copies.c copies 4 sizes of at least 1 MiB whole and 2 at an offset: 6 each way go on UCX.
UCX_COPIES = (6, 6)
