"""What the file system under a state file says, for errors about it: where it is mounted, whether
it is read-only, how much room is left ("the file system at /var (read-only)", "... has 0 B free of
1.0 MiB")."""

from __future__ import annotations

import os
from pathlib import Path

from rgpu.units import format_bytes


def mount_point(path: Path) -> Path:
    """The folder `path` (or its nearest existing parent) is mounted at."""
    here = path
    while not here.exists() and here != here.parent:
        here = here.parent
    here = here.resolve()
    device = here.stat().st_dev
    while here != here.parent and here.parent.stat().st_dev == device:
        here = here.parent
    return here


def read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(mount_point(path)).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def describe(path: Path) -> str:
    """One clause about the file system holding `path`; "" when it cannot be read."""
    try:
        mount = mount_point(path)
        stats = os.statvfs(mount)
    except OSError:
        return ""
    if stats.f_flag & os.ST_RDONLY:
        return f"the file system at {mount} is mounted read-only"
    return (f"the file system at {mount} has {format_bytes(stats.f_bavail * stats.f_frsize)} free of "
            f"{format_bytes(stats.f_blocks * stats.f_frsize)}")
