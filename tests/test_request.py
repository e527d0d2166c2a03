"""The Python reading of an rgpu request agrees with the Lua gate on the shared cases."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rgpu.errors import InvalidRequest
from rgpu.slurm_plugin.request import RgpuRequest, parse_comment, parse_record, parse_tres_per_node

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
    # The record Lua writes (tests/test_job_submit_lua.py checks the same text) reads back as the
    # request that was validated, and the license agrees with what will be leased.
    assert req.record(case["job_nodes"], GPU_MEMORY) == case["record"]
    record = parse_record(case["record"])
    assert (record.nodes, record.units, record.request.count) == (case["job_nodes"], case["units"], case["count"])
    if req.memory_bytes:
        assert record.request.memory_bytes == req.memory_bytes
    else:
        assert record.request.size.percent == record.percent == req.units_per_slice()
        assert record.units == record.nodes * record.request.count * record.percent


@pytest.mark.parametrize("text", [
    None, "", "fraction=1", "rgpu:v1 nodes=1 count=4 percent=100 units=400 ", "rgpu:v1 nodes=1 count=4 percent=100",
    "rgpu:v1 nodes=1 count=4 percent=100 units=100", "rgpu:v1 nodes=1 count=1 percent=101 units=101",
    "rgpu:v1 nodes=1 count=1 percent=50 units=50\nrgpu:v1 nodes=1 count=4 percent=100 units=400",
    "x rgpu:v1 nodes=1 count=1 percent=50 units=50", "rgpu:v1 nodes=01 count=1 percent=50 units=50",
    "rgpu:v1  nodes=1 count=1 percent=50 units=50", "rgpu:v1 nodes=1 count=1 percent=0 units=0",
])
def test_anything_but_a_whole_record_is_refused(text: str | None) -> None:
    if text == "rgpu:v1 nodes=1 count=4 percent=100 units=400 ":
        assert parse_record(text).units == 400     # Slurm shows a trailing space
        return
    with pytest.raises(InvalidRequest) as info:
        parse_record(text)
    assert str(info.value).startswith("rgpu: prolog-slurmctld: ")


@pytest.mark.parametrize("case", [c for c in CASES["cases"] if "error" in c and not c["error"].startswith(LUA_ONLY)
                                  and not any(x in c["error"] for x in LUA_ONLY)], ids=lambda c: repr(c["comment"]))
def test_refused_cases_are_refused_the_same(case: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest) as info:
        read(case)
    assert case["error"] in str(info.value)
    assert str(info.value).startswith("rgpu: job_submit: ")


def test_memory_request() -> None:
    req = parse_comment("memory=8G", 2)
    assert (req.size.memory_bytes, req.size.percent) == (8 * 2**30, 0)
    assert req.units_per_slice(0) == 100
    assert req.units_per_slice(80 * 2**30) == 10
