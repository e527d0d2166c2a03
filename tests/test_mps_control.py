"""The dispatcher's MPS supervision (remoting/dispatcher/mps.py): terminate_client for runaway work,
recovery after a fault, the server log read for the faulting pid.

NVIDIA's nvidia-cuda-mps-control cannot run without a GPU, so a fake control program stands in
for it (named as such): it answers get_server_list with one server pid, records every command, and
can be told to stop answering (a control daemon that died) until it is started again with -d."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from rgpu.remoting.dispatcher.mps import MpsDaemon

pytestmark = pytest.mark.integration   # runs the fake control program

FAKE_CONTROL = """#!{python}
import os, sys
from pathlib import Path
base = Path(os.environ["CUDA_MPS_PIPE_DIRECTORY"]).parent
log = base / "fake-control.log"
down = base / "fake-control.down"
if sys.argv[1:] == ["-d"]:
    down.unlink(missing_ok=True)
    with open(log, "a") as f:
        f.write("-d " + os.environ.get("CUDA_VISIBLE_DEVICES", "") + "\\n")
    sys.exit(0)
command = sys.stdin.read().strip()
with open(log, "a") as f:
    f.write(command + "\\n")
if down.exists():
    sys.exit(1)
if command == "get_server_list":
    print("4242")
"""


@pytest.fixture
def mps(tmp_path: Path) -> MpsDaemon:
    fake = tmp_path / "fake-nvidia-cuda-mps-control"
    fake.write_text(FAKE_CONTROL.format(python=sys.executable))
    fake.chmod(0o755)
    daemon = MpsDaemon(["GPU-a", "GPU-b"], tmp_path / "mps", logging.getLogger("test.mps"), binary=str(fake))
    daemon.start()
    yield daemon
    daemon.stop()


def commands(mps: MpsDaemon) -> list[str]:
    return (mps.pipe_dir.parent / "fake-control.log").read_text().splitlines()


def test_started_for_its_gpus_only_and_clients_get_their_share(mps: MpsDaemon) -> None:
    assert mps.running and mps.enforcement == "mps"
    assert commands(mps)[0] == "-d GPU-a,GPU-b"
    assert mps.client_env(25)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"


def test_terminate_client_names_each_server(mps: MpsDaemon) -> None:
    mps.terminate_client(1234)
    assert "terminate_client 4242 1234" in commands(mps)


def test_recover_restarts_a_control_daemon_that_stopped_answering(mps: MpsDaemon) -> None:
    assert mps.recover("a test") and mps.restarts == 0          # answering: nothing to do
    (mps.pipe_dir.parent / "fake-control.down").touch()
    assert mps.recover("a fault on GPU 0")
    assert mps.restarts == 1 and mps.running
    log = commands(mps)
    assert log.count("-d GPU-a,GPU-b") == 2 and "quit" in log


def test_server_log_tail(mps: MpsDaemon) -> None:
    assert mps.server_log() == ""
    mps.log_dir.mkdir(parents=True, exist_ok=True)
    (mps.log_dir / "server.log").write_text("x" * 100_000 + "\n[ERROR] client pid 77 fault\n")
    tail = mps.server_log()
    assert tail.endswith("client pid 77 fault\n") and len(tail) <= 64 << 10
