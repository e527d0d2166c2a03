"""A client and a pool of different rgpu versions (issue 28, finding 1): this client sends a slice's
size as whole percent (AllocateRequest.percent, field 12); a pool from before that field skips it
and finds no size. The pool here is a real one of that version: rgpu-poold from the last commit
before the field, taken from git with its component folders linked into its rgpu/ as this
checkout's are, and run with this test's Python."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from rgpu import __version__
from rgpu.errors import InvalidRequest
from tests.daemons import REPO, RgpuCluster

pytestmark = pytest.mark.integration

# The last commit whose pool reads only `fraction` and `memory_bytes` (the commit after it added
# AllocateRequest.percent).
BEFORE_PERCENT = "7874605"


@pytest.fixture(scope="module")
def old_pool_code(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """That commit's tree at its import paths (a PYTHONPATH entry that shadows the installed rgpu)."""
    base = tmp_path_factory.mktemp("old-pool")
    tree = base / "tree"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", BEFORE_PERCENT], capture_output=True)
    if archive.returncode != 0:
        pytest.skip(f"this checkout has no commit {BEFORE_PERCENT} (a shallow clone): {archive.stderr.decode()[:200]}")
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    # That commit predates the links rgpu/remoting -> ../remoting (one per package-dir folder).
    package_dir = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for name, folder in package_dir.items():
        link = tree / name.replace(".", "/")
        if name != "rgpu" and not link.is_symlink():
            link.symlink_to(Path("..") / folder, target_is_directory=True)
    return tree


@pytest.fixture
def old_pool(tmp_path: Path, old_pool_code: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[RgpuCluster]:
    cluster = RgpuCluster(tmp_path / "cluster")
    monkeypatch.chdir(tmp_path)    # not the checkout: `python -m` puts the cwd, whose rgpu/ is today's, first
    cluster.start_pool(env=cluster.env(PYTHONPATH=str(old_pool_code)))
    try:
        yield cluster
    finally:
        cluster.stop_all()


def test_the_old_pool_is_the_old_code(old_pool: RgpuCluster, old_pool_code: Path) -> None:
    probe = subprocess.run([sys.executable, "-m", "rgpu.remoting.pool.daemon", "--help"],
                           env=old_pool.env(PYTHONPATH=str(old_pool_code), PYTHONVERBOSE="1"), capture_output=True,
                           text=True)     # as the pool was started: same cwd, same environment
    assert f"{old_pool_code}/rgpu/remoting/pool/daemon.py" in probe.stderr, probe.stderr[-2000:]


def test_a_size_in_percent_sent_to_an_older_pool_says_the_pool_is_older_and_what_to_upgrade(
        old_pool: RgpuCluster) -> None:
    with pytest.raises(InvalidRequest) as info:
        old_pool.client().allocate("job-1", "alice", 1, percent=50)
    message = str(info.value)
    assert message.startswith(f"rgpu: pool: the pool daemon at {old_pool.pool_address} is older than this client: "
                              "it does not read slice sizes in percent"), message
    assert f"install this client's rgpu release (rgpu {__version__} with AllocateRequest.percent) on the pool host " \
        "and restart rgpu-poold" in message
    assert "-m 8G" in message and "\n" not in message


def test_the_tools_say_it_in_one_line_with_exit_2(old_pool: RgpuCluster) -> None:
    done = subprocess.run([sys.executable, "-m", "rgpu.remoting.admin.cli", "request-gpus", "-n", "1", "-p", "0.5",
                           "-o", str(old_pool.root / "adaptor.conf")], env=old_pool.env(), capture_output=True,
                          text=True, timeout=60, cwd="/")
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("rgpu: pool: the pool daemon at ") and done.stderr.count("\n") == 1, done.stderr


def test_a_memory_size_still_reaches_an_older_pool(old_pool: RgpuCluster) -> None:
    # The field it shares with this client: the old pool reads the size and answers about capacity
    # (it has no GPUs), not about a missing size.
    with pytest.raises(Exception) as info:
        old_pool.client().allocate("job-2", "alice", 1, memory_bytes=8 << 30)
    assert "older than this client" not in str(info.value) and "neither" not in str(info.value), str(info.value)
