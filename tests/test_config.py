"""Configuration precedence: defaults < file < RGPU_* environment < flags; unknown keys refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from rgpu.config import load_settings
from rgpu.errors import ConfigError


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "rgpu.toml"
    path.write_text(text)
    return path


def test_precedence(tmp_path: Path) -> None:
    cfg = write(tmp_path, 'placement = "spread"\nlisten = "127.0.0.1:1"\nstate = "/file.db"\n')
    env = {"RGPU_LISTEN": "127.0.0.1:2", "RGPU_STATE": "/env.db"}
    s = load_settings(cfg, env=env, flags={"state": "/flag.db", "pool": None})
    assert (s.placement, s.listen, s.state) == ("spread", "127.0.0.1:2", "/flag.db")
    assert (s.origin("placement"), s.origin("listen"), s.origin("state")) == (str(cfg), "$RGPU_LISTEN", "--state")
    assert s.origin("pool") == "default" and s.pool == "localhost:50001"


def test_defaults_without_any_file(tmp_path: Path) -> None:
    s = load_settings(None, env={"RGPU_CONFIG": ""})
    assert s.listen == "0.0.0.0:50001" and s.placement == "binpack"


def test_unknown_keys_are_named(tmp_path: Path) -> None:
    cfg = write(tmp_path, 'placment = "spread"\nfoo = 1\n')
    with pytest.raises(ConfigError, match=r"unknown keys in .*: foo, placment"):
        load_settings(cfg, env={})


@pytest.mark.parametrize("text, message", [
    ('down_after_seconds = "soon"\n', "is not a float"),
    ('max_slices_per_job = 1.5\n', "is not a int"),
    ('placement = "random"\n', "placement 'random'"),
    ('listen = [1, 2]\n', "is not a str"),
    ('tls_cert_file = "/c.pem"\n', "must be set together"),
    ('down_after_seconds = -1\n', "must be positive"),
    ('this is not toml', "not valid TOML"),
])
def test_bad_values_are_clear(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        load_settings(write(tmp_path, text), env={})
    assert str(err.value).startswith("rgpu: config: ") and "\n" not in str(err.value)


def test_bad_environment_value_names_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"\$RGPU_DOWN_AFTER_SECONDS"):
        load_settings(None, env={"RGPU_DOWN_AFTER_SECONDS": "x", "RGPU_CONFIG": ""})


def test_explicit_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(tmp_path / "nope.toml", env={})


@pytest.mark.parametrize("text, message", [
    ("lanes = 0\n", "lanes = 0 from .* is out of range \\(it must be 1 to 16; set lanes to e.g. 4"),
    ("lanes = 17\n", "lanes = 17 from .* is out of range"),
    ('lanes = "four"\n', "lanes = 'four' from .* is not a int"),
    ("lane_chunk_bytes = 1024\n", "lane_chunk_bytes = 1024 from .* is out of range \\(it must be 65536 to 67108864"),
    ("lane_min_bytes = 0\n", "lane_min_bytes = 0 from .* is out of range"),
    ("socket_buffer_bytes = -1\n", "socket_buffer_bytes = -1 from .* is out of range"),
])
def test_data_lane_keys_out_of_range_are_one_line(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        load_settings(write(tmp_path, text), env={})
    assert str(err.value).startswith("rgpu: config: ") and "\n" not in str(err.value)


def test_data_lane_keys_reach_applications_unless_their_environment_sets_them(tmp_path: Path) -> None:
    from rgpu.config import lane_environment

    cfg = write(tmp_path, "lanes = 4\nlane_chunk_bytes = 1048576\nsocket_buffer_bytes = 0\n")
    s = load_settings(cfg, env={"RGPU_SOCKET_BUFFER_BYTES": "65536"})
    assert (s.lanes, s.lane_chunk_bytes, s.lane_min_bytes, s.socket_buffer_bytes) == (4, 1 << 20, 8 << 20, 65536)
    # The file's keys only: the environment's own value is already the application's; defaults are the library's.
    assert lane_environment(s) == {"RGPU_LANES": "4", "RGPU_LANE_CHUNK_BYTES": "1048576"}
    assert lane_environment(load_settings(None, env={"RGPU_CONFIG": ""})) == {}


def test_the_lane_bound_is_the_protocols() -> None:
    from rgpu.config import MAX_LANES
    from rgpu.remoting.datapath import protocol

    assert MAX_LANES == protocol.MAX_LANES
