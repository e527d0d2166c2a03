"""systemd units: rendered from templates, KillMode=control-group, ExecStart quoted for systemd,
written by `rgpu-admin install-units`."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from rgpu.errors import InvalidRequest
from rgpu.remoting.admin.cli import main as admin_main
from rgpu.remoting.admin.units import UnitOptions, render_units, systemd_quote


def service_section(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    section = ""
    for line in text.splitlines():
        if line.startswith("["):
            section = line.strip("[]")
        elif "=" in line and not line.startswith("#") and section == "Service":
            key, value = line.split("=", 1)
            out[key] = value
    return out


def test_both_units_kill_the_whole_control_group() -> None:
    units = render_units(UnitOptions(poold="/opt/rgpu/bin/rgpu-poold", dispatcher="/opt/rgpu/bin/rgpu-dispatcher",
                                     dispatcher_args=("-p", "55001", "--host", "10.0.0.5")))
    assert set(units) == {"rgpu-poold.service", "rgpu-dispatcher.service"}
    poold, dispatcher = (service_section(units[n]) for n in ("rgpu-poold.service", "rgpu-dispatcher.service"))
    assert poold["KillMode"] == dispatcher["KillMode"] == "control-group"
    assert poold["ExecStart"] == "/opt/rgpu/bin/rgpu-poold --config /etc/rgpu/rgpu.toml"
    assert dispatcher["ExecStart"] == ("/opt/rgpu/bin/rgpu-dispatcher --config /etc/rgpu/rgpu.toml "
                                       "-p 55001 --host 10.0.0.5")
    assert poold["User"] == "rgpu" and dispatcher["User"] == "root"
    assert poold["Restart"] == dispatcher["Restart"] == "on-failure"


def test_hostile_paths_are_quoted_for_systemd() -> None:
    assert systemd_quote("/opt/my venv/bin/rgpu-poold") == '"/opt/my venv/bin/rgpu-poold"'
    assert systemd_quote("a'; echo $HOME 100%") == '"a\'; echo $$HOME 100%%"'
    assert systemd_quote('say "hi" \\') == '"say \\"hi\\" \\\\"'
    with pytest.raises(InvalidRequest, match="newline"):
        systemd_quote("a\nExecStartPre=/bin/rm")


def test_relative_paths_and_bad_users_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="not absolute"):
        render_units(UnitOptions(poold="rgpu-poold", dispatcher="/x/rgpu-dispatcher"))
    with pytest.raises(InvalidRequest, match="valid user"):
        render_units(UnitOptions(poold="/x/p", dispatcher="/x/d", poold_user="root\nUser=x"))


def test_install_units_writes_both_files(tmp_path: Path) -> None:
    result = CliRunner().invoke(admin_main, ["install-units", "--dest", str(tmp_path), "--poold-bin", "/x/rgpu-poold",
                                             "--dispatcher-bin", "/x/rgpu-dispatcher", "--dispatcher-arg=-p",
                                             "--dispatcher-arg=55001", "--config", str(tmp_path / "rgpu.toml"),
                                             "--tls-dir", str(tmp_path / "tls"), "--poold-user", "root"])
    assert result.exit_code == 0, result.output
    assert "systemctl daemon-reload" in result.output
    text = (tmp_path / "rgpu-dispatcher.service").read_text()
    assert f"ExecStart=/x/rgpu-dispatcher --config {tmp_path / 'rgpu.toml'} -p 55001\n" in text
    assert oct((tmp_path / "rgpu-poold.service").stat().st_mode & 0o777) == "0o644"


@pytest.mark.integration
@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_systemd_analyze_accepts_the_units(tmp_path: Path) -> None:
    poold, dispatcher = shutil.which("true"), shutil.which("false")
    assert poold and dispatcher
    units = render_units(UnitOptions(poold=poold, dispatcher=dispatcher))
    for name, text in units.items():
        (tmp_path / name).write_text(text)
    run = subprocess.run(["systemd-analyze", "verify", "--man=no", *(str(tmp_path / n) for n in units)],
                         capture_output=True, text=True, check=False)
    complaints = [line for line in run.stderr.splitlines() if "rgpu-" in line and "User=" not in line]
    assert run.returncode == 0 or not complaints, run.stderr
