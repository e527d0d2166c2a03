"""One slice size, read the same by every edge that takes one from a person: rgpu.slice_size itself,
Slurm's comment as PrologSlurmctld reads it, `flexrun -p/-m` and `rgpu-admin request-gpus -p/-m`, each
against tests/data/slice_size_cases.json (tests/test_job_submit_lua.py holds the Lua gate to the
same file; tests/test_pool_daemon.py the pool's Allocate). In-process: no process starts here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from rgpu.errors import InvalidRequest
from rgpu.remoting.admin.cli import main as admin_main
from rgpu.remoting.client import flexrun
from rgpu.slice_size import SliceLimits, SliceSize, format_hundredths, parse_fraction, parse_memory, percent_of_fraction_value
from rgpu.slurm_plugin.request import parse_comment

SIZES = json.loads((Path(__file__).parent / "data" / "slice_size_cases.json").read_text())
FRACTIONS, MEMORY = SIZES["fractions"], SIZES["memory"]
ALL = [pytest.param(flag, c, id=f"{flag} {c['text']!r}") for flag, cases in (("-p", FRACTIONS), ("-m", MEMORY))
       for c in cases]


def _expect_refusal(exc: InvalidRequest, case: dict[str, Any]) -> None:
    assert exc.what == case["what"] and case.get("why", "") in exc.why, str(exc)


@pytest.mark.parametrize("case", FRACTIONS, ids=lambda c: repr(c["text"]))
def test_the_one_parser_reads_every_fraction_case(case: dict[str, Any]) -> None:
    if "what" in case:
        with pytest.raises(InvalidRequest) as info:
            parse_fraction(case["text"], component="test")
        _expect_refusal(info.value, case)
    else:
        assert parse_fraction(case["text"], component="test") == case["percent"]


@pytest.mark.parametrize("case", MEMORY, ids=lambda c: repr(c["text"]))
def test_the_one_parser_reads_every_memory_case(case: dict[str, Any]) -> None:
    if "what" in case:
        with pytest.raises(InvalidRequest) as info:
            parse_memory(case["text"], component="test")
        _expect_refusal(info.value, case)
    else:
        assert parse_memory(case["text"], component="test") == case["bytes"]


@pytest.mark.parametrize("flag, case", ALL)
def test_slurms_comment_reads_every_case_the_same(flag: str, case: dict[str, Any]) -> None:
    comment = f"{'fraction' if flag == '-p' else 'memory'}={case['text']}"
    if "what" in case:
        with pytest.raises(InvalidRequest) as info:
            parse_comment(comment, 1)
        assert info.value.component == "job_submit"
        _expect_refusal(info.value, case)
    else:
        size = parse_comment(comment, 1).size
        assert (size.percent, size.memory_bytes) == (case.get("percent", 0), case.get("bytes", 0))


@pytest.mark.parametrize("flag, case", ALL)
def test_flexrun_takes_and_refuses_every_case_the_same(flag: str, case: dict[str, Any]) -> None:
    argv = ["-n", "1", flag, case["text"], "--", "app"]
    if "what" in case:
        result = CliRunner().invoke(flexrun.cli, argv)
        assert result.exit_code == 2, result.output
        assert result.stderr.count("\n") == 1, result.stderr
        assert result.stderr.startswith(f"rgpu: flexrun: {case['what']} ("), result.stderr
        assert case.get("why", "") in result.stderr
    else:
        size = flexrun.parse_args(argv).size
        assert (size.percent, size.memory_bytes) == (case.get("percent", 0), case.get("bytes", 0))


@pytest.mark.parametrize("flag, case", [p for p in ALL if "what" in p.values[1]])
def test_rgpu_admin_refuses_every_bad_case_the_same_before_it_calls_the_pool(tmp_path: Path, flag: str,
                                                                          case: dict[str, Any]) -> None:
    # No pool is configured: a refusal here is the command line's own (accepted sizes: test_admin_cli.py).
    out = tmp_path / "a.conf"
    result = CliRunner().invoke(admin_main, ["request-gpus", "-n", "1", flag, case["text"], "-o", str(out)],
                                env={"RGPU_POOL": "127.0.0.1:9"}, prog_name="rgpu-admin")
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"rgpu: admin: {case['what']} ("), result.stderr
    assert case.get("why", "") in result.stderr and not out.exists()


def test_a_thousandth_of_a_gpu_is_refused_by_every_tool_as_slurm_refuses_it() -> None:
    """`rgpu-admin request-gpus -p 0.001` once leased 1% (81.9 MiB); Slurm refused it."""
    why = "the smallest slice is 0.01 of a GPU"
    for component, option in (("job_submit", "fraction="), ("admin", "-p "), ("flexrun", "-p ")):
        with pytest.raises(InvalidRequest) as info:
            parse_fraction("0.001", component=component, option=option)
        assert str(info.value) == f"rgpu: {component}: invalid fraction '0.001' ({why}; ask for {option}0.01 or more)"
    with pytest.raises(InvalidRequest, match=why):      # a client before the percent field, on the wire
        percent_of_fraction_value(0.001, component="pool")


@pytest.mark.parametrize("flags, message", [
    (["-p", "0.5", "-m", "8G"], "-p and -m cannot be used together"),
    ([], "no slice size given"),
])
def test_rgpu_admin_wants_exactly_one_size(tmp_path: Path, flags: list[str], message: str) -> None:
    result = CliRunner().invoke(admin_main, ["request-gpus", "-n", "1", *flags, "-o", str(tmp_path / "a")],
                                env={"RGPU_POOL": "127.0.0.1:9"}, prog_name="rgpu-admin")
    assert result.exit_code == 2 and result.stderr.startswith(f"rgpu: admin: {message} ("), result.stderr


def test_a_fraction_sent_as_a_number_by_an_older_client_rounds_to_whole_percent() -> None:
    assert [percent_of_fraction_value(v, component="pool") for v in (1.0, 0.5, 0.125, 0.333, 0.005)] == \
        [100, 50, 13, 33, 1]
    for bad in (0.0, -0.5, 1.5, float("nan"), float("inf")):
        with pytest.raises(InvalidRequest, match="more than 0 and at most 1"):
            percent_of_fraction_value(bad, component="pool")


def test_a_slice_size_is_a_percent_or_bytes_never_both_nor_neither() -> None:
    assert SliceSize(percent=50).describe() == "fraction 0.5"
    assert SliceSize(memory_bytes=8 << 30).describe() == "memory 8.0 GiB"
    for bad in (dict(), dict(percent=50, memory_bytes=1), dict(percent=101), dict(percent=-1), dict(memory_bytes=-1)):
        with pytest.raises(InvalidRequest):
            SliceSize(**bad)
    assert [format_hundredths(p) for p in (1, 10, 33, 50, 100)] == ["0.01", "0.1", "0.33", "0.5", "1"]


def test_a_granted_slices_limits_are_bytes_and_percent_both_set_checked_with_the_readers_name() -> None:
    limits = SliceLimits(8 << 30, 25)
    assert limits.share == 0.25 and limits == SliceLimits(8 << 30, 25, component="token")
    for memory, percent, what in ((8 << 30, 0, "invalid compute_percent 0"), (8 << 30, 101, "invalid compute_percent 101"),
                                  (8 << 30, 50.0, "invalid compute_percent 50.0"), (0, 50, "invalid memory_limit_bytes 0"),
                                  (True, 50, "invalid memory_limit_bytes True")):
        with pytest.raises(InvalidRequest) as info:
            SliceLimits(memory, percent, component="adaptor.conf")   # type: ignore[arg-type]
        assert str(info.value).startswith(f"rgpu: adaptor.conf: {what} (") and "\n" not in str(info.value)
