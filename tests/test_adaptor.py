"""adaptor.conf rendering: golden file, round trip through tomllib, hostile values refused."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest

from rgpu import tokens
from rgpu.adaptor import (AdaptorConf, AdaptorSlice, check_limits_match_tokens, parse_adaptor_conf, read_adaptor_conf,
                          render_adaptor_conf, write_adaptor_conf)
from rgpu.errors import ConfigError, InvalidRequest

GOLDEN = Path(__file__).parent / "golden" / "adaptor.conf"


def sample(**overrides: object) -> AdaptorConf:
    slices = (
        AdaptorSlice("gpu1.example.org:55001", "GPU-7f3a2b1c-0000-1111-2222-333344445555", 0, 42949672960, 50,
                     "rgpu1.eyJhIjoxfQ.c2ln"),
        AdaptorSlice("[::1]:55002", "GPU-7f3a2b1c-0000-1111-2222-333344446666", 3, 42949672960, 50,
                     "rgpu1.eyJiIjoyfQ.c2ln"),
    )
    values: dict[str, object] = {"job_id": "slurm-1234-0", "user": "alice", "expires": "2026-11-22T10:00:00Z",
                                 "slices": slices}
    values.update(overrides)
    return AdaptorConf(**values)  # type: ignore[arg-type]


def test_golden_file() -> None:
    text = render_adaptor_conf(sample())
    if os.environ.get("RGPU_UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), (
        "adaptor.conf output changed; if intended, rerun with RGPU_UPDATE_GOLDEN=1 and review the diff of "
        "tests/golden/adaptor.conf")


def test_round_trip_through_tomllib() -> None:
    conf = sample()
    text = render_adaptor_conf(conf)
    data = tomllib.loads(text)
    assert data["job_id"] == "slurm-1234-0" and len(data["slice"]) == 2
    assert parse_adaptor_conf(text) == conf


HOSTILE = [
    {"job_id": 'x"\n[[slice]]\nserver = "evil:1'},
    {"job_id": "1; rm -rf /"},
    {"user": "alice\nuser = \"root\""},
    {"user": "$(id)"},
    {"expires": "tomorrow"},
    {"slices": (AdaptorSlice("evil\n:1", "GPU-a", 0, 1, 50, "t"),)},
    {"slices": (AdaptorSlice("host:99999", "GPU-a", 0, 1, 50, "t"),)},
    {"slices": (AdaptorSlice("host:1", "GPU-a\"", 0, 1, 50, "t"),)},
    {"slices": (AdaptorSlice("host:1", "GPU-a", 0, 1, 101, "t"),)},
    {"slices": (AdaptorSlice("host:1", "GPU-a", -1, 1, 50, "t"),)},
    {"slices": (AdaptorSlice("host:1", "GPU-a", 0, 1, 50, 't"\nx="'),)},
    {"slices": (AdaptorSlice("host:1", "GPU-a", 0, 0, 50, "t"),)},      # no memory: no slice
    {"slices": ()},
]


@pytest.mark.parametrize("overrides", HOSTILE)
def test_hostile_values_are_refused_before_rendering(overrides: dict[str, object]) -> None:
    with pytest.raises(InvalidRequest) as err:
        render_adaptor_conf(sample(**overrides))
    assert "\n" not in str(err.value)


def test_atomic_private_write_and_read(tmp_path: Path) -> None:
    path = write_adaptor_conf(tmp_path / "run" / "adaptor.conf", sample())
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert read_adaptor_conf(path) == sample()
    assert [p.name for p in path.parent.iterdir()] == ["adaptor.conf"]  # no temp file left


def test_a_failed_write_leaves_the_old_file(tmp_path: Path) -> None:
    path = write_adaptor_conf(tmp_path / "adaptor.conf", sample())
    with pytest.raises(InvalidRequest):
        write_adaptor_conf(path, sample(user="bad user"))
    assert read_adaptor_conf(path) == sample()


@pytest.mark.parametrize("text, why", [
    ("not toml [", "not valid TOML"),
    ('format = 9\njob_id = "1"\nuser = "a"\n', "format 9"),
    ('job_id = "1"\nuser = "a"\nextra = 1\n', "unknown keys"),
    ('user = "a"\n', "missing key"),
    ('job_id = "1"\nuser = "a"\n[[slice]]\nserver = "h:1"\n', "missing or wrong slice keys"),
])
def test_malformed_files_give_one_line(text: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why) as err:
        parse_adaptor_conf(text)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("field, value, what", [("compute_percent", 0, "invalid compute_percent 0"),
                                                ("memory_limit_bytes", 0, "invalid memory_limit_bytes 0")])
def test_a_slice_without_compute_or_memory_is_refused_in_one_line(field: str, value: int, what: str) -> None:
    text = render_adaptor_conf(sample()).replace(f"{field} = {getattr(sample().slices[0], field)}", f"{field} = {value}", 1)
    with pytest.raises(ConfigError) as err:
        parse_adaptor_conf(text, "/run/rgpu/7/adaptor.conf")
    assert str(err.value).startswith(f"rgpu: adaptor.conf: cannot use /run/rgpu/7/adaptor.conf ({what}: ")
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------ the file's limits against its tokens

SECRET = b"test-secret-0123456789abcdef-0123456789"


def _signed(memory: int, percent: int) -> str:
    return tokens.sign(SECRET, tokens.SliceClaims(
        job_key="slurm-1234-0", slice_number=0, server="gpu1.example.org:55001",
        gpu_uuid="GPU-7f3a2b1c-0000-1111-2222-333344445555", gpu_index=0, memory_limit_bytes=memory,
        compute_percent=percent, expires_unix=0.0, issued_unix=1.0))


def _one_slice(memory: int, percent: int, token: str) -> AdaptorConf:
    return AdaptorConf(job_id="slurm-1234-0", user="alice", slices=(AdaptorSlice(
        "gpu1.example.org:55001", "GPU-7f3a2b1c-0000-1111-2222-333344445555", 0, memory, percent, token),))


def test_limits_that_are_the_tokens_pass() -> None:
    check_limits_match_tokens(_one_slice(40 << 30, 50, _signed(40 << 30, 50)))
    # A token this rgpu cannot read is the GPU server's to refuse, in its own line.
    check_limits_match_tokens(_one_slice(40 << 30, 50, "rgpu1.eyJhIjoxfQ.c2ln"))


@pytest.mark.parametrize("memory, percent, why", [
    (80 << 30, 50, "slice 0 says 80.0 GiB and 50% compute, but its token grants 40.0 GiB and 50%"),
    (40 << 30, 100, "slice 0 says 40.0 GiB and 100% compute, but its token grants 40.0 GiB and 50%"),
    ((40 << 30) + 1, 50, f"slice 0 says {(40 << 30) + 1} bytes and 50% compute, but its token grants {40 << 30} bytes"),
])
def test_limits_other_than_the_tokens_are_refused_in_one_line(memory: int, percent: int, why: str) -> None:
    with pytest.raises(ConfigError) as caught:
        check_limits_match_tokens(_one_slice(memory, percent, _signed(40 << 30, 50)), "/run/rgpu/1234/adaptor.conf")
    text = str(caught.value)
    assert text.startswith("rgpu: adaptor.conf: cannot use /run/rgpu/1234/adaptor.conf (" + why), text
    assert "changed after rgpu wrote it" in text and "\n" not in text
