"""Names of the files rgpu shares between components on a node: one place for each."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

DEFAULT_RUN_DIR = "/run/rgpu"     # per-job folders on CPU nodes; $RGPU_RUN_DIR overrides
ADAPTOR_CONF_NAME = "adaptor.conf"
ERROR_NAME = "error"              # why the node Prolog could not prepare the job (read by flexrun)
# <run dir>/<job id>.ended: left by the node Epilog of an rgpu job, removed by its next Prolog. A task
# that finds it and no job folder belongs to an attempt whose Prolog never ran here (Slurm 22.05
# can restart a requeued job on the same node without it): the TaskProlog refuses to start it.
ENDED_SUFFIX = ".ended"
ENDED_KEEP_SECONDS = 7 * 24 * 3600   # the Prolog's sweep removes older marks
# <run dir>/<job id>/.lease-gone: left by another job's Prolog that found the job's lease ended while
# its folder is still there. EpilogSlurmctld ends the lease while, or before, the job's node Epilog
# runs (that one waits for the job's Prolog and its tasks' end), so only a folder noted this long
# ago is taken for one its Epilog never got to remove (slurmd crashed).
LEASE_GONE_NAME = ".lease-gone"
LEASE_GONE_KEEP_SECONDS = 3600


def run_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(env.get("RGPU_RUN_DIR") or DEFAULT_RUN_DIR)


def job_dir(job_id: str, env: Mapping[str, str] | None = None) -> Path:
    return run_dir(env) / job_id


def unreadable_folder(path: Path) -> Path | None:
    """The outermost folder on `path` other users cannot enter or list (no r-x for others), or None."""
    path = Path(os.path.realpath(path))
    for folder in reversed((path, *path.parents) if path.is_dir() else path.parents):
        try:
            if folder.stat().st_mode & 0o005 != 0o005:
                return folder
        except OSError:
            return folder
    return None
