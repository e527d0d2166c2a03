"""The worker's C loop answers small device-to-host copies on NVIDIA's driver (issue 24: the
`tensor.item()` pattern at one round trip plus the GPU's time).

Run on a GPU machine:  python -m pytest -m gpu tests/remoting/test_gpu_small_copies.py -v -s
(CPU-only CI skips them; tests/remoting/test_native_small_copies.py covers the same loop with a
test double for the driver and with rgpu's own libcuda as "the driver".)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.remoting.conftest import PY, Server
from tests.remoting.gpu_helpers import flexrun
from tests.remoting.small_copies_helpers import item_program
from tests.remoting.worker_profiles import profile_total
from rgpu.remoting.native import build

pytestmark = pytest.mark.gpu


def test_item_pattern_values_are_exact_and_answered_in_c(native_libs: build.Libraries, gpu_server: Server,  # noqa: F811
                                                         tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RGPU_WORKER_PROFILE", str(tmp_path))   # the session server's workers inherit it
    done = flexrun(native_libs, gpu_server, tmp_path, [PY, "-c", item_program(500, big=65536)], name="small-dtoh")
    assert "BAD 0 BIG True" in done.stdout and "AFTER True" in done.stdout, done.stdout + done.stderr
    assert int(done.stdout.split("WILD")[1].split()[0]) != 0, done.stdout
    assert profile_total(tmp_path, "native_small_dtoh", 502) >= 502
