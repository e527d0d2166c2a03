"""The core's one host:port parser (rgpu.netaddr), size parser and printer (rgpu.units), run-dir
names (rgpu.paths) and port files (rgpu.portfile), against hostile values."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rgpu import paths
from rgpu.errors import ConfigError, InvalidRequest
from rgpu.netaddr import bound_address, join_host_port, split_host_port
from rgpu.portfile import read_port_file, write_port_file
from rgpu.units import MAX_BYTES, format_bytes, parse_duration, parse_size

GiB = 2**30


# --- host:port ----------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("pool1:50001", ("pool1", 50001)),
    ("pool1.example.org:1", ("pool1.example.org", 1)),
    ("10.0.0.7:65535", ("10.0.0.7", 65535)),
    ("[fd00::1]:50001", ("fd00::1", 50001)),
    ("[::1]:8", ("::1", 8)),
    ("[fe80::1%eth0]:50001", ("fe80::1%eth0", 50001)),
])
def test_split_host_port(text: str, expected: tuple[str, int]) -> None:
    assert split_host_port(text) == expected
    assert join_host_port(*expected) == text


@pytest.mark.parametrize("text", [
    "", ":", "pool1", "pool1:", ":50001", "pool1:0", "pool1:65536", "pool1:99999999999999999999999999",
    "pool1:-1", "pool1:+5", "pool1: 50001", " pool1:50001", "pool1:50001\n", "pool1:5\x000",
    "fd00::1:50001",              # IPv6 without brackets: which colon ends the host?
    "[fd00::1]50001", "[fd00::1]:", "[]:50001", "[[::1]]:50001", "[pool1]:50001",
    "pool1:５０００１",             # full-width digits: str.isdigit() says yes, a port they are not
    "pool1:²", "pool1:٥", "pöol:50001\u202e", "a" * 400 + ":50001", "pool1:" + "9" * 5000,
])
def test_split_host_port_refuses_hostile_values(text: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        split_host_port(text, what="pool address")
    message = str(info.value)
    assert message.startswith("rgpu: config: pool address ") and "is not HOST:PORT" in message
    assert "\n" not in message and len(message) < 300


def test_split_host_port_options() -> None:
    assert split_host_port(":50001", allow_empty_host=True) == ("", 50001)
    assert split_host_port("[::]:0", allow_port_zero=True) == ("::", 0)
    with pytest.raises(InvalidRequest):
        split_host_port("pool1:0")
    with pytest.raises(InvalidRequest, match="rgpu: config: address 50001 is not text"):
        split_host_port(50001)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="rgpu: flexrun: "):
        split_host_port("x", component="flexrun")


def test_bound_address_names_the_port_a_listener_got() -> None:
    assert bound_address("127.0.0.1:0", 43211) == "127.0.0.1:43211"
    assert bound_address("[::]:0", 50080) == "[::]:50080"
    assert bound_address(":0", 50001) == ":50001"
    assert bound_address("not an address", 7) == "not an address (port 7)"


@given(st.text(max_size=60))
def test_split_host_port_never_crashes(text: str) -> None:
    try:
        host, port = split_host_port(text)
    except InvalidRequest:
        return
    assert 0 < port < 65536 and text.endswith(str(port)) and host


# --- sizes and durations ------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("8G", 8 * GiB), ("8GiB", 8 * GiB), ("8gb", 8 * GiB), ("512M", 512 << 20), ("1.5T", 3 << 39),
    (".5G", GiB // 2), ("8.G", 8 * GiB), ("4096", 4096), ("1K", 1024), (" 2 G ", 2 * GiB), (7, 7),
    ("1024T", 2**50),
])
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", [
    "", "G", "0", "0G", "-1G", "8Q", "8 G B", "1e3", "inf", "nan", "8,5G", "８G", "٨G", "8GG",
    "1" * 400, "9" * 30 + "T", "99999999999999999999T", "1.0.0G", "1048577T", True, None, 0, -5, 2**61,
])
def test_parse_size_refuses_hostile_values(text: object) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_size(text, "memory")  # type: ignore[arg-type]
    message = str(info.value)
    assert message.startswith("rgpu: units: invalid memory ") and "\n" not in message and len(message) < 300


def test_parse_size_names_its_component() -> None:
    with pytest.raises(InvalidRequest, match=r"^rgpu: flexrun: invalid memory per slice '0G' \(must be more than 0"):
        parse_size("0G", "memory per slice", component="flexrun")
    assert parse_size(MAX_BYTES) == MAX_BYTES


@pytest.mark.parametrize("value, shown", [
    (0, "0 B"), (1, "1 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"), (GiB, "1.0 GiB"),
    (int(1.1 * GiB), "1.1 GiB"), (6 << 30, "6.0 GiB"), (99999 * GiB, "97.7 TiB"), (2**60, "1.0 EiB"),
    (10**30, "867361737988.4 EiB"), (-(2 << 20), "-2.0 MiB"),
])
def test_format_bytes(value: int, shown: str) -> None:
    assert format_bytes(value) == shown


@given(st.integers(min_value=-(2**200), max_value=2**200))
def test_format_bytes_never_uses_exponents(value: int) -> None:
    shown = format_bytes(value)
    assert "e" not in shown.split(" ")[0].lower() and shown.split(" ")[1] in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


@given(st.integers(min_value=1, max_value=MAX_BYTES))
def test_sizes_print_and_parse_back_close(value: int) -> None:
    number, unit = format_bytes(value).split(" ")
    back = parse_size(number + unit[0] if unit != "B" else number) if unit not in ("PiB", "EiB") else value
    assert abs(back - value) <= value / 20 + 1


@pytest.mark.parametrize("text", ["", "0", "-1h", "1y", "1" * 400, "9" * 30 + "d", "inf", "２h", None])
def test_parse_duration_refuses_hostile_values(text: object) -> None:
    with pytest.raises(InvalidRequest):
        parse_duration(text)  # type: ignore[arg-type]
    assert parse_duration("90m") == 5400


# --- run-dir names and port files ------------------------------------------------------------------

def test_run_dir_names() -> None:
    assert paths.run_dir({}) == Path("/run/rgpu")
    assert paths.run_dir({"RGPU_RUN_DIR": ""}) == Path("/run/rgpu")            # empty counts as unset
    assert paths.job_dir("42", {"RGPU_RUN_DIR": "/tmp/r ü"}) == Path("/tmp/r ü/42")
    assert paths.job_dir("42", {}) / paths.ERROR_NAME == Path("/run/rgpu/42/error")
    assert paths.ADAPTOR_CONF_NAME == "adaptor.conf"


def test_flexrun_reads_the_prolog_error_where_the_prolog_writes_it(tmp_path: Path) -> None:
    from rgpu.remoting.client.flexrun import prolog_error_files

    env = {"RGPU_RUN_DIR": str(tmp_path), "SLURM_JOB_ID": "7", "RGPU_ADAPTOR_CONF": str(tmp_path / "x" / "adaptor.conf")}
    assert prolog_error_files(env) == [tmp_path / "x" / "error", paths.job_dir("7", env) / paths.ERROR_NAME]
    # A job id that is not plain ASCII digits names no folder (no path tricks, no "٧").
    for job in ("../7", "٧", "7 ", ""):
        assert prolog_error_files({"RGPU_RUN_DIR": str(tmp_path), "SLURM_JOB_ID": job}) == []


def test_port_file_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "d.port"
    assert read_port_file(path) is None
    write_port_file(path, 50123, "poold")
    assert path.read_text() == "50123\n" and read_port_file(path) == 50123
    assert [p.name for p in tmp_path.iterdir()] == ["d.port"]      # no temporary file left behind
    path.write_text("１２\n")
    with pytest.raises(ValueError):
        read_port_file(path)
    with pytest.raises(ConfigError, match=r"^rgpu: poold: cannot write the port file"):
        write_port_file(tmp_path / "missing" / "d.port", 1, "poold")
