"""Exit status and --version across rgpu's commands (issue 29): a pool that does not answer (6)
and a GPU server that does not (7) differ everywhere, the README's one table says what each
status means and names no other, and every command answers --version."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from rgpu import __version__, errors
from rgpu.remoting.datapath import protocol
from tests.daemons import REPO, RgpuCluster


def test_the_readme_table_gives_every_exit_status_the_commands_use_and_no_other() -> None:
    readme = (REPO / "README.md").read_text()
    table = readme.split("### Exit status", 1)[1].split("\n\n", 3)[2]
    documented = {int(n) for n in re.findall(r"^\| (\d+) \|", table, re.M)}
    used = {0, 1} | {cls.exit_code for cls in vars(errors).values()
                     if isinstance(cls, type) and issubclass(cls, errors.RgpuError)}
    assert documented == used, f"README documents {sorted(documented)}, the code uses {sorted(used)}"


def test_a_gpu_server_that_does_not_answer_is_exit_7_and_still_unavailable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(errors.Unavailable) as caught:   # callers catching Unavailable still do
        protocol.handshake(f"127.0.0.1:{port}", "token", timeout=2.0)
    assert isinstance(caught.value, errors.DispatcherUnavailable) and caught.value.exit_code == 7
    assert str(caught.value).startswith(f"rgpu: flexrun: cannot reach the GPU server 127.0.0.1:{port}")
    assert errors.Unavailable("pool", "x").exit_code == 6


SCRIPTS = sorted(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"])


@pytest.mark.integration
@pytest.mark.parametrize("script", SCRIPTS)
def test_every_command_answers_version(script: str) -> None:
    path = Path(sys.executable).parent / script
    if not path.exists():
        pytest.skip(f"{script} is not installed in this environment")
    done = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=60, check=False,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0 and done.stdout.strip() == f"{script}, version {__version__}", (done.stdout,
                                                                                                 done.stderr)


@pytest.mark.integration
def test_net_perf_tells_no_dispatcher_from_no_pool(cluster: RgpuCluster) -> None:
    def net_perf() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "rgpu.remoting.admin.cli", "net-perf"], env=cluster.env(),
                              capture_output=True, text=True, timeout=60, check=False)

    pool = cluster.start_pool()
    done = net_perf()
    assert done.returncode == 7 and done.stderr.startswith("rgpu: net-perf: no dispatcher to measure"), done.stderr
    pool.kill()
    done = net_perf()
    assert done.returncode == 6 and done.stderr.startswith("rgpu: pool: "), done.stderr
