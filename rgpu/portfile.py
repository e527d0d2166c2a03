"""`--port-file PATH`: a daemon started on port 0 tells its starter which port it got.

The file holds the port in decimal and a newline, and appears (atomically, by rename) only once
the daemon serves on that port, so whoever waits for it can connect at once. This replaces the
pick-a-free-port-then-start race in tests and scripts."""

from __future__ import annotations

import os
from pathlib import Path

from rgpu.errors import ConfigError


def write_port_file(path: str | os.PathLike[str], port: int, component: str) -> None:
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(f"{port}\n", encoding="ascii")
        os.replace(tmp, target)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ConfigError(component, f"cannot write the port file {target}", exc.strerror or str(exc),
                          "give --port-file a path in a writable folder") from None


def read_port_file(path: str | os.PathLike[str]) -> int | None:
    """The port a daemon wrote, or None while the file does not exist (yet)."""
    try:
        text = Path(path).read_text(encoding="ascii").strip()
    except FileNotFoundError:
        return None
    if not (text.isascii() and text.isdigit() and 0 < int(text) < 65536):
        raise ValueError(f"port file {path} holds {text[:20]!r}, not a port")
    return int(text)
