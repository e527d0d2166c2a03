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
