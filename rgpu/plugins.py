"""Extension points: components contribute to others through entry points, not imports.

Groups:
- `rgpu.pool_plugins`: `start(core, settings, log) -> object with stop()`, run by rgpu-poold after
  its gRPC server started (the Slurm integration: reconciler and license sync).
- `rgpu.account_sources`: `name(settings) -> lookup(user) -> accounts (default first)`, used by
  rgpu-poold to check which accounts a user may charge (`slurm`: sacctmgr).
- `rgpu.admin_commands`: click commands that join `rgpu-admin` (e.g. `slurm-config`).
"""

from __future__ import annotations

import logging
from importlib.metadata import entry_points
from typing import Any

POOL_PLUGINS = "rgpu.pool_plugins"
ADMIN_COMMANDS = "rgpu.admin_commands"
ACCOUNT_SOURCES = "rgpu.account_sources"

log = logging.getLogger("rgpu.plugins")


def load(group: str) -> list[tuple[str, Any]]:
    """(name, loaded object) for every installed entry point of `group`, sorted by name. One that
    fails to import is logged and skipped: an optional component must not stop the others."""
    found = []
    for entry in sorted(entry_points(group=group), key=lambda e: e.name):
        try:
            found.append((entry.name, entry.load()))
        except Exception as exc:  # noqa: BLE001 - any import failure of a plugin is reported, not fatal
            log.warning("rgpu: plugins: %s entry point %r failed to load (%s); reinstall rgpu", group, entry.name, exc)
    return found
