"""A killed dispatcher's /tmp/rgpu-sessions-* folder is removed by the next dispatcher (issue 10)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from rgpu.remoting.dispatcher.session_state import OWNER_FILE, RUNTIME_PREFIX, sweep_dead_runtime_dirs


def test_only_folders_of_dead_owners_are_removed(tmp_path: Path) -> None:
    limit = int(Path("/proc/sys/kernel/pid_max").read_text())
    dead = str(next(pid for pid in range(limit - 1, 1, -1) if not Path(f"/proc/{pid}").exists()))
    for name, owner in (("killed", dead), ("alive", str(os.getpid())), ("legacy", None)):
        folder = tmp_path / f"{RUNTIME_PREFIX}{name}"
        (folder / "mps").mkdir(parents=True)
        if owner is not None:
            (folder / OWNER_FILE).write_text(owner + "\n")
    (tmp_path / "unrelated").mkdir()
    removed = sweep_dead_runtime_dirs(tmp_path, logging.getLogger("t"))
    assert [p.name for p in removed] == [f"{RUNTIME_PREFIX}killed"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{RUNTIME_PREFIX}alive", f"{RUNTIME_PREFIX}legacy", "unrelated"]
