"""What the tests of the worker's native memsets share (test_native_memsets.py, test_gpu_memsets.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path


def memsets_in_c(profiles: Path, want: int) -> int:
    """Memsets the C loop ran, from the workers' profiles (RGPU_WORKER_PROFILE), waiting up to 20 s
    for `want` (a worker writes its profile when its session ends)."""
    deadline = time.monotonic() + 20
    ran = 0
    while time.monotonic() < deadline and ran < want:
        ran = sum(json.loads(p.read_text()).get("native_memsets", 0) for p in profiles.glob("worker-*.json"))
        time.sleep(0.1)
    return ran
