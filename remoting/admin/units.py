"""systemd units for rgpu-poold and rgpu-dispatcher: rendered from templates/*.service.j2 and
written by `rgpu-admin install-units`.

Rendering is pure (argument lists in, unit text out); writing is one small function. ExecStart
arguments are quoted for systemd's own command-line syntax, so a path with spaces, quotes, `%`
or `$` reaches the daemon unchanged.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from rgpu.errors import ConfigError, InvalidRequest
from rgpu.render import render

COMPONENT = "install-units"
UNITS = {"rgpu-poold": "rgpu-poold.service.j2", "rgpu-dispatcher": "rgpu-dispatcher.service.j2"}
DEFAULT_UNIT_DIR = Path("/etc/systemd/system")
_PLAIN = re.compile(r"[A-Za-z0-9_./:=@+,-]+")
_USER = re.compile(r"[a-z_][a-z0-9_-]{0,31}\$?")


def systemd_quote(arg: str) -> str:
    """One argument in systemd's ExecStart syntax: `%` and `$` are specifiers and variables there,
    so they are doubled; anything beyond a plain word is double-quoted with C escapes."""
    if "\n" in arg or "\0" in arg:
        raise InvalidRequest(COMPONENT, f"argument {arg!r} has a newline or NUL", "systemd units cannot carry it",
                             "use a path without control characters")
    escaped = arg.replace("%", "%%").replace("$", "$$")
    if _PLAIN.fullmatch(arg):
        return escaped
    return '"' + escaped.replace("\\", "\\\\").replace('"', '\\"') + '"'


def exec_start(argv: list[str]) -> str:
    return " ".join(systemd_quote(a) for a in argv)


@dataclass(frozen=True)
class UnitOptions:
    poold: str                     # absolute path of the rgpu-poold executable
    dispatcher: str                # absolute path of the rgpu-dispatcher executable
    config: str = "/etc/rgpu/rgpu.toml"
    poold_user: str = "rgpu"
    dispatcher_user: str = "root"  # MPS and the GPU device files need root on most nodes
    dispatcher_args: tuple[str, ...] = ()


def default_executable(name: str) -> str:
    """The console script beside this Python (the venv rgpu is installed in), else on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise ConfigError(COMPONENT, f"cannot find {name}", "it is neither beside this Python nor on PATH",
                          f"install rgpu (pip install rgpu) or pass --{name.split('-')[1]}-bin PATH")
    return found


def _checked(options: UnitOptions) -> None:
    for what, path in (("rgpu-poold", options.poold), ("rgpu-dispatcher", options.dispatcher),
                       ("config file", options.config)):
        if not os.path.isabs(path):
            raise InvalidRequest(COMPONENT, f"{what} path {path!r} is not absolute", "systemd needs absolute paths",
                                 "give the full path")
    for user in (options.poold_user, options.dispatcher_user):
        if not _USER.fullmatch(user):
            raise InvalidRequest(COMPONENT, f"user {user!r} is not a valid user name", "", "give a login name")


def render_units(options: UnitOptions) -> dict[str, str]:
    """{unit file name: text} for both daemons."""
    _checked(options)
    poold = [options.poold, "--config", options.config]
    dispatcher = [options.dispatcher, "--config", options.config, *options.dispatcher_args]
    return {
        "rgpu-poold.service": render(UNITS["rgpu-poold"], user=options.poold_user, exec_start=exec_start(poold)),
        "rgpu-dispatcher.service": render(UNITS["rgpu-dispatcher"], user=options.dispatcher_user,
                                          exec_start=exec_start(dispatcher)),
    }


def write_units(units: dict[str, str], directory: Path) -> list[Path]:
    """Write the unit files (mode 0644, atomically); returns their paths."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        written = []
        for name, text in units.items():
            path = directory / name
            tmp = path.with_name(f".{name}.tmp")
            tmp.write_text(text)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
            written.append(path)
    except OSError as exc:
        raise ConfigError(COMPONENT, f"cannot write units to {directory}", exc.strerror or str(exc),
                          "run as root, or give --dest a writable folder") from None
    return written
