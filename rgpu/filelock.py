"""An exclusive lock on an open file (flock), held for a `with` block: between processes of one host
(the processes of one rgpu-poold: its state file and its call guards)."""

from __future__ import annotations

import contextlib
import fcntl
from typing import Iterator


@contextlib.contextmanager
def held(fd: int) -> Iterator[None]:
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
