"""The Python reading of an rgpu request agrees with the Lua gate on the shared cases."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rgpu.errors import InvalidRequest
from rgpu.slurm_plugin.request import RgpuRequest, parse_comment, parse_tres_per_node

CASES = json.loads((Path(__file__).parent / "data" / "request_cases.json").read_text())
GPU_MEMORY = CASES["gpu_memory_bytes"]
# Checks only the Lua gate makes (they need its config or the job's node counts).
LUA_ONLY = ("count of slices per node", "variable node count", "slices per job", "more than one GPU holds")


def read(case: dict[str, Any]) -> RgpuRequest | None:
    count = parse_tres_per_node(case["tres"])
    return None if count is None else parse_comment(case["comment"], count)


@pytest.mark.parametrize("case", [c for c in CASES["cases"] if "error" not in c], ids=lambda c: repr(c["comment"]))
def test_accepted_cases_read_the_same(case: dict[str, Any]) -> None:
    req = read(case)
    if case["units"] is None:
        assert req is None
        return
    assert req is not None and req.count == case["count"]
    assert req.license_units(case["job_nodes"], GPU_MEMORY) == case["units"]


@pytest.mark.parametrize("case", [c for c in CASES["cases"] if "error" in c and not c["error"].startswith(LUA_ONLY)
                                  and not any(x in c["error"] for x in LUA_ONLY)], ids=lambda c: repr(c["comment"]))
def test_refused_cases_are_refused_the_same(case: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest) as info:
        read(case)
    assert case["error"] in str(info.value)
    assert str(info.value).startswith("rgpu: job_submit: ")


def test_memory_request() -> None:
    req = parse_comment("memory=8G", 2)
    assert (req.memory_bytes, req.fraction) == (8 * 2**30, 0.0)
    assert req.units_per_slice(0) == 100
    assert req.units_per_slice(80 * 2**30) == 10
