"""Test tiers, selectable by marker (`-m unit`, `-m integration`, `-m slurm`, `-m gpu`):

- unit: pure logic: no processes, no daemons, nothing built. Every test without another tier's marker
  is one, and one that starts a process (compilers included) while it sets up, fixtures of any scope
  included, or while it runs fails, saying to mark it `integration` (tests/test_tiers.py).
- integration: real rgpu daemons, session servers, worker processes, the C client libraries.
  A test is one by its marker, or by using a fixture that starts such things (below).
- slurm: a real Slurm cluster on this host. gpu: a real NVIDIA GPU.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemons import RgpuCluster

TIERS = ("unit", "integration", "slurm", "gpu")
# Fixtures that start servers or processes (tests/remoting/conftest.py, tests/slurm/conftest.py,
# and the `cluster` fixtures of the daemon tests): a test that uses one is an integration test.
INTEGRATION_FIXTURES = frozenset({"emulated", "native_libs", "demo_binary", "rgpu_slurm", "cluster", "pool"})


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slurm-version", default=None,
                     help="Slurm versions for the real-cluster tests: comma-separated of 22.05, 24.11, 26.05, "
                          "or all (default: $RGPU_SLURM_VERSIONS, else all)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "unit: pure logic, no processes or daemons (the default tier)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if names & INTEGRATION_FIXTURES and not any(item.get_closest_marker(t) for t in ("integration", "slurm", "gpu")):
            item.add_marker(pytest.mark.integration)
        if not any(item.get_closest_marker(t) for t in ("integration", "slurm", "gpu")):
            item.add_marker(pytest.mark.unit)


class _NoProcesses:
    def __init__(self, nodeid: str) -> None:
        self.nodeid = nodeid

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise AssertionError(f"{self.nodeid} is a unit test but starts a process "
                             f"({args[0] if args else kwargs.get('args')!r}): mark it @pytest.mark.integration "
                             "(or give it a fixture that does not build or start anything)")


_PROCESS_STARTERS = ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "execv", "execve", "execvp", "execvpe")


@contextlib.contextmanager
def _no_processes(item: pytest.Item) -> Iterator[None]:
    """While a unit test sets up and runs, nothing may start a process: not the test, and not a fixture
    of any scope set up for it (a session fixture that compiles C runs during its first user's setup).
    Compilers, daemons and helper programs all start through these."""
    if item.get_closest_marker("unit") is None:
        yield
        return
    guard = _NoProcesses(item.nodeid)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", guard)
        for name in _PROCESS_STARTERS:
            if hasattr(os, name):
                patch.setattr(os, name, guard)
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with _no_processes(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with _no_processes(item):
        yield


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RgpuCluster]:
    """A pool and its dispatchers as real processes (tests/daemons.py), quick heartbeats; a module
    that needs other timings defines its own `cluster`."""
    c = RgpuCluster(tmp_path / "cluster")
    c.write_config(heartbeat_interval_seconds=0.5, down_after_seconds=3.0, reclaim_interval_seconds=0.5)
    try:
        yield c
    finally:
        c.stop_all()
