"""Reading the workers' profiles (RGPU_WORKER_PROFILE) in tests of what the C loop ran."""

from __future__ import annotations

import json
import time
from pathlib import Path


def profile_total(profiles: Path, key: str, want: int) -> int:
    """The sum of `key` (e.g. "native_memsets", "native_small_dtoh") over the workers' profiles in
    `profiles`, waiting up to 20 s for it to reach `want` (a worker writes its profile when its
    session ends)."""
    deadline = time.monotonic() + 20
    total = 0
    while time.monotonic() < deadline and total < want:
        total = sum(json.loads(p.read_text()).get(key, 0) for p in profiles.glob("worker-*.json"))
        time.sleep(0.1)
    return total
