"""Same-host page-locked memory read in place on NVIDIA's driver (protocol 15): the worker maps the
application's cuMemHostAlloc pages from their memfd, registers them (cuMemHostRegister) and copies
with one DMA from and into them; no byte of the copy crosses the session's socket.

Run on a GPU machine:  python -m pytest -m gpu tests/remoting/test_gpu_shared_pinned.py -v -s
(CPU-only CI skips it; tests/remoting/test_shared_pinned_emulated.py covers the rest.)
Speeds: benchmarks/copies.py --backend cuda --configs local,same-host (never asserted here).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from rgpu.remoting.native import build

from tests.remoting.conftest import Server
from tests.remoting.client_helpers import py_client
from tests.remoting.shared_pinned_helpers import COPIES, _ops

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("zero_copy", ["1", "0"], ids=["at-the-workers-address", "anywhere"])
def test_page_locked_copies_on_a_gpu_are_dmas_from_the_applications_pages(
        native_libs: build.Libraries, gpu_server: Server, tmp_path: Path, zero_copy: str) -> None:
    done = py_client(native_libs, gpu_server.slices(gpu_server.token()), COPIES, timeout=300,
                     RGPU_CLIENT_STATS=str(tmp_path / "p"), RGPU_ZERO_COPY=zero_copy, RGPU_LOG="info")
    assert "SYNC True" in done.stdout and "ASYNC True" in done.stdout, done.stdout + done.stderr
    assert "page-locked memory is shared with the worker" in done.stderr, done.stderr
    ops = _ops(tmp_path / "p")
    assert ops.get("rgpuMemcpyHtoDSharedWait") == 1 and ops.get("rgpuMemcpyHtoDShared") == 1, ops
    assert ops.get("rgpuMemcpyDtoHShared") == 2 and ops.get("rgpuHostUnshare") == 1, ops
    deadline = time.monotonic() + 30
    while gpu_server.server.observe()["sessions"] and time.monotonic() < deadline:
        time.sleep(0.05)
    traffic = gpu_server.server.observe()["traffic"][gpu_server.gpus[0].uuid]
    assert traffic["received_bytes"] < 1 << 20 and traffic["sent_bytes"] < 1 << 20, traffic
