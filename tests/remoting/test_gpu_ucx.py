"""UCX under host<->device copies on a real GPU (issue 25): the path a GPU node takes (bytes land in
the worker's pinned UCX buffer and go to the device in one DMA from there; device-to-host, one DMA
into it before they leave), run with the GPU node's transport set to ucx.

Run on a GPU machine with UCX (libucp.so.0):
    python -m pytest -m gpu tests/remoting/test_gpu_ucx.py -v -s
"""

from __future__ import annotations

from pathlib import Path

import pytest
from rgpu.remoting.native import build

from tests.remoting.conftest import run_client, serving
from tests.remoting.conftest import local_gpu
from tests.remoting.ucx_helpers import UCX_COPIES, _have_ucx, _ucx_ops

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _have_ucx(), reason="UCX is not installed (no libucp.so.0)")]


@pytest.mark.parametrize("tls", ["posix,cma,self", "tcp"], ids=["shared-memory", "tcp"])
def test_copies_of_every_size_arrive_whole_over_ucx_on_a_gpu(copies: Path, native_libs: build.Libraries,  # noqa: F811
                                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            tls: str) -> None:
    monkeypatch.setenv("UCX_TLS", tls)            # both ends: the client's environment and the worker's
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")   # TCP on loopback only, not also this host's other addresses
    monkeypatch.setenv("RGPU_TRANSPORT", "ucx")   # the GPU node's setting (read when its server starts)
    with serving("cuda", [local_gpu()]) as s:
        done = run_client(native_libs, s.slices(s.token(memory_limit=1 << 30)), [str(copies)], timeout=300,
                          RGPU_LOG="info", RGPU_CLIENT_STATS=str(tmp_path / "p"))
    # (UCX may print its own warnings on stdout, e.g. a transport its build lacks: the program's
    # verdict is its last line.)
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1:] == ["OK"], done.stdout + done.stderr
    assert "; transport ucx: " in done.stderr, done.stderr   # with the UCX transports that carry the copies
    assert _ucx_ops(tmp_path / "p") == UCX_COPIES
