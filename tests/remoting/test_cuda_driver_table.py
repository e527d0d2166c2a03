"""The real-GPU backend calls the driver by name (`_call("cuX", ...)`, `_check`, `self.f["cuX"]`),
looked up in a table bound from libcuda when the worker starts. A name missing from that table
fails only on a GPU, at the first call (cuEventQuery did so in the background receive, whose
no-GPU tests use a fake driver that answers any name): check every name here, without a GPU."""

from __future__ import annotations

import re
from pathlib import Path

from rgpu.remoting.datapath.backends.cuda_driver import _MANUAL
from rgpu.remoting.native.generated.api_gen import CUDA_ARGTYPES

BACKENDS = Path(__file__).resolve().parents[2] / "rgpu" / "remoting" / "datapath" / "backends"
BY_NAME = re.compile(r"""(?:\._call|\._check|\.f\[|\.f\.get)\(?\s*["'](cu\w+)["']""")
GENERATED = re.compile(r"""\._fn_(cu\w+)""")
LATE = re.compile(r"""_late_fn\(\s*["'](cu\w+)["']""")


def _sources() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(BACKENDS.glob("cuda_*.py"))}


def test_every_driver_call_by_name_is_in_the_bound_table() -> None:
    late = {name for text in _sources().values() for name in LATE.findall(text)}
    unbound = sorted({f"{file}: {name}" for file, text in _sources().items() for name in BY_NAME.findall(text)
                      if name not in _MANUAL and name not in late})
    assert not unbound, f"driver calls by name that the worker never binds (add them to cuda_driver._MANUAL): {unbound}"


def test_every_generated_entry_point_used_is_bound() -> None:
    unbound = sorted({f"{file}: {name}" for file, text in _sources().items() for name in GENERATED.findall(text)
                      if name not in CUDA_ARGTYPES})
    assert not unbound, f"_fn_ entry points not in the generated table: {unbound}"


def test_the_scan_finds_the_calls_it_checks() -> None:
    found = {name for text in _sources().values() for name in BY_NAME.findall(text)}
    assert {"cuEventQuery", "cuEventRecord", "cuLaunchKernel", "cuCtxSynchronize"} <= found
