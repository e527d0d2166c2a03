"""Names of the files rgpu shares between components on a node: one place for each."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

DEFAULT_RUN_DIR = "/run/rgpu"     # per-job folders on CPU nodes; $RGPU_RUN_DIR overrides
ADAPTOR_CONF_NAME = "adaptor.conf"
ERROR_NAME = "error"              # why the node Prolog could not prepare the job (read by flexrun)


def run_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(env.get("RGPU_RUN_DIR") or DEFAULT_RUN_DIR)


def job_dir(job_id: str, env: Mapping[str, str] | None = None) -> Path:
    return run_dir(env) / job_id
