"""Call-profile snapshots taken while an application runs (benchmarks count the round trips of a
training step's steady state with them): cuGetProcAddress("rgpuClientStatsWrite") and
`client_stats --between`, against a real session server with an emulated GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
from rgpu.remoting.native import build, client_stats

from tests.remoting.conftest import Server
from tests.remoting.client_helpers import py_client

SNAPSHOTS = """
    setup()
    write = ctypes.c_void_p()
    check("cuGetProcAddress_v2", b"rgpuClientStatsWrite", ctypes.byref(write), 12000, ctypes.c_uint64(0), None)
    snapshot = ctypes.CFUNCTYPE(None, ctypes.c_char_p)(write.value)
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    check("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
    snapshot(b"start")
    for _ in range(7):
        check("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
    snapshot(b"end")
    print("DONE")
    """


def test_the_round_trips_between_two_snapshots_are_counted(native_libs: build.Libraries, emulated: Server,
                                                           tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stats = tmp_path / "prof"
    done = py_client(native_libs, emulated.slices(emulated.token()), SNAPSHOTS, RGPU_CLIENT_STATS=str(stats))
    assert "DONE" in done.stdout, done.stdout + done.stderr
    (start,) = tmp_path.glob("prof.*.start")
    (end,) = tmp_path.glob("prof.*.end")
    between = client_stats.subtract(client_stats.parse(end.read_text())[0], client_stats.parse(start.read_text())[0])
    assert {p.name: p.sync_calls for p in between.values()} == {"cuMemGetInfo_v2": 7}
    assert client_stats.main(["--between", str(start), str(end)]) == 0
    assert capsys.readouterr().out.startswith("round trips 7 ")
    assert client_stats.main(["--between", str(start)]) == 2   # one file is no interval


def test_snapshots_are_a_no_op_without_a_profile(native_libs: build.Libraries, emulated: Server) -> None:
    done = py_client(native_libs, emulated.slices(emulated.token()), SNAPSHOTS)
    assert done.returncode == 0 and "DONE" in done.stdout, done.stdout + done.stderr
