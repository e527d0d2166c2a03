"""The README's main command as the most common newcomer runs it (issue 23): root, a fresh copy of
the checkout inside a 0700 folder (root's home on Debian), `./scripts/demo.sh`. The demo makes its
own virtual environment (here in a test folder, not /opt/rgpu), starts a real Slurm cluster with the
host's Slurm, and runs its job as `nobody`, whose HOME (/nonexistent) cannot be written.

Then `--keep` with a job that fails: the cluster stays up, and `nobody` uses it with MUNGE
(`flexrun -n`), until SIGTERM ends it and every daemon with it."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.daemons import REPO
from tests.slurm.cluster import missing_requirements
from tests.slurm.conftest import leftover_daemons

pytestmark = pytest.mark.slurm
RUNUSER = shutil.which("runuser") or "/usr/sbin/runuser"
COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                     ".hypothesis", "*.so", "*.so.*", ".whl", ".gl", ".devbuild")


@dataclass
class Demo:
    clone: Path
    venv: Path
    output: str
    seconds: float


@pytest.fixture(scope="module")
def demo() -> Iterator[Demo]:
    """`./scripts/demo.sh` run once from a 0700 folder, as root, with a fresh virtual environment."""
    reason = missing_requirements()
    if reason:
        pytest.skip(reason)
    home = Path(tempfile.mkdtemp(prefix="rgpu-newcomer-"))    # 0700, as /root
    venvs = Path(tempfile.mkdtemp(prefix="rgpu-demo-venv-"))
    venvs.chmod(0o755)
    try:
        clone = home / "rgpu"
        shutil.copytree(REPO, clone, ignore=COPY_IGNORE)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RGPU_", "SLURM_", "VIRTUAL_ENV"))}
        env["RGPU_VENV"] = str(venvs / "rgpu")
        t0 = time.monotonic()
        done = subprocess.run(["./scripts/demo.sh"], cwd=clone, env=env, capture_output=True, text=True, timeout=900,
                              check=False)
        seconds = time.monotonic() - t0
        output = done.stdout + done.stderr
        assert done.returncode == 0, output[-6000:]
        yield Demo(clone, venvs / "rgpu", output, seconds)
    finally:
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(venvs, ignore_errors=True)


def test_the_readme_demo_runs_as_root_from_a_fresh_clone_in_a_0700_folder(demo: Demo) -> None:
    out = demo.output
    print(f"\n./scripts/demo.sh from a 0700 folder, fresh venv: {demo.seconds:.0f} s")
    assert demo.clone.parent.stat().st_mode & 0o777 == 0o700
    assert "TaskProlog failed" not in out and "Traceback" not in out, out[-4000:]
    assert re.search(r"^job \d+ COMPLETED; its output:", out, re.MULTILINE), out[-4000:]
    assert f"demo: making the virtual environment {demo.venv} with " in out


def test_the_demo_pool_runs_with_its_slurm_settings(demo: Demo) -> None:
    assert re.search(r"pool at 127\.0\.0\.1:\d+: Slurm reconciler every 2 s \(grace 20 s\), new held jobs looked for every 2 s, "
                     r"license sync on", demo.output), \
        demo.output[:3000]


def test_flexrun_runs_in_the_demo_job_as_nobody_whose_home_is_not_writable(demo: Demo) -> None:
    out = demo.output
    assert "$ flexrun -- nvidia-smi    # in the job, as nobody, HOME=/nonexistent" in out, out[-4000:]
    assert "RGPU-SMI (remote slices)" in out and out.count("NVIDIA H100 80GB HBM3") >= 2
    job_part = out.split("$ flexrun -- nvidia-smi", 1)[1].split("$ rgpu-admin leases", 1)[0]
    assert "rgpu: " not in job_part and "PermissionError" not in job_part, job_part


def test_nobody_leases_and_releases_with_munge_in_the_demo(demo: Demo) -> None:
    out = demo.output
    assert re.search(r"^leased 1 slice\(s\) as manual-nobody-\w+; adaptor\.conf written to", out, re.MULTILINE), out[-3000:]
    assert re.search(r"^manual-nobody-\w+\s+nobody\s+25\s", out, re.MULTILINE), out[-3000:]
    assert re.search(r"^released manual-nobody-\w+$", out, re.MULTILINE), out[-3000:]


def test_the_demo_caps_its_emulated_gpus_at_what_the_host_can_hold_and_says_so(demo: Demo) -> None:
    match = re.search(r'demo: the 4 emulated GPUs keep their "device" memory in this host\'s RAM: each offers '
                      r'([\d.]+) (MiB|GiB) \(RGPU_GPU_DEVICE_MEMORY_LIMIT; 50% of the ([\d.]+) GiB available here', demo.output)
    assert match, demo.output[:3000]
    each = float(match.group(1)) / (1024 if match.group(2) == "MiB" else 1)
    assert 4 * each <= float(match.group(3)) / 2 + 0.25     # both shown rounded to 0.1
    table = demo.output.split("$ rgpu-admin list-gpus", 1)[1].split("\n\n", 1)[0]
    rows = [line for line in table.splitlines() if "NVIDIA H100" in line]
    assert len(rows) == 4 and all(f"{match.group(1)} {match.group(2)}" in row for row in rows), table


def _wait_for_text(path: Path, text: str, proc: subprocess.Popen[bytes], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = path.read_text(errors="replace") if path.exists() else ""
        if text in got:
            return got
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    raise AssertionError(f"no {text!r} in {path} (demo exit {proc.poll()}):\n{path.read_text(errors='replace')[-4000:]}")


@dataclass
class Kept:
    stdout: str
    stderr: str
    env: dict[str, str]
    rgpu_config: str


@contextmanager
def kept_demo(demo: Demo, *args: str) -> Iterator[Kept]:
    """`python -m rgpu.slurm_plugin.demo --keep ARGS` until it says it is ready; then SIGTERM, and
    every daemon and file of it must be gone."""
    logs = Path(tempfile.mkdtemp(prefix="rgpu-demo-keep-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RGPU_", "SLURM_", "VIRTUAL_ENV"))}
    env["RGPU_SOURCE_TREE"] = str(demo.clone)
    with open(logs / "out", "wb") as out, open(logs / "err", "wb") as err:
        proc = subprocess.Popen([str(demo.venv / "bin" / "python"), "-m", "rgpu.slurm_plugin.demo", "--keep", *args],
                                cwd="/", env=env, stdout=out, stderr=err)
    marker = ""
    try:
        stderr = _wait_for_text(logs / "err", "demo: ready", proc, 300)
        stdout = (logs / "out").read_text()
        match = re.search(r"export SLURM_CONF=(\S+) RGPU_CONFIG=(\S+) PATH=", stdout)
        assert match, stdout
        marker = str(Path(match.group(2)).parents[1])
        yield Kept(stdout, stderr, env, match.group(2))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    assert proc.returncode != 0
    assert marker and not Path(marker).exists()
    assert not leftover_daemons(marker), leftover_daemons(marker)
    shutil.rmtree(logs, ignore_errors=True)


def test_keep_keeps_a_failed_demo_and_a_user_uses_it_with_munge(demo: Demo) -> None:
    with kept_demo(demo, "--job-script", "echo failing on purpose; exit 3\n") as kept:
        failure = [line for line in kept.stderr.splitlines() if line.startswith("rgpu: demo:")]
        assert failure == [("rgpu: demo: the demo job ended FAILED (its output is above; the cluster is kept below: "
                            "look at its logs)")], kept.stderr
        assert "failing on purpose" in kept.stdout
        slurm_conf = re.search(r"export SLURM_CONF=(\S+) ", kept.stdout).group(1)  # type: ignore[union-attr]
        ping = subprocess.run(["scontrol", "ping"], env={**kept.env, "SLURM_CONF": slurm_conf}, capture_output=True,
                              text=True, timeout=30, check=False)
        assert ping.returncode == 0 and "UP" in ping.stdout, ping
        # The user's commands as the kept demo prints them: nobody, MUNGE, no writable home.
        line = next(line.strip() for line in kept.stdout.splitlines() if "rgpu.remoting.client.flexrun -n 1" in line)
        assert line.startswith(f"runuser -u nobody -- env RGPU_CONFIG={kept.rgpu_config} HOME=/nonexistent "
                               "PATH=/usr/bin:/bin ")
        argv = line.split()
        argv[0] = RUNUSER
        done = subprocess.run(argv, capture_output=True, text=True, timeout=240, check=False, cwd="/")
        assert done.returncode == 0, done.stdout + done.stderr
        assert "RGPU-SMI (remote slices)" in done.stdout and "Traceback" not in done.stderr, done.stdout + done.stderr
        # The three 12 GiB slices got two emulated workers OOM-killed: no GPU of the demo offers that now.
        line = next(line.strip() for line in kept.stdout.splitlines() if "rgpu-admin request-gpus -n 1" in line)
        argv = line.replace("-p 0.25", "-m 12G").split()
        argv[0] = RUNUSER
        big = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False, cwd="/")
        assert big.returncode != 0 and len(big.stderr.strip().splitlines()) == 1, big
        assert big.stderr.startswith("rgpu: ") and "12" in big.stderr, big.stderr
        print(f"\nnobody asks for a 12 GiB slice on the demo: {big.stderr.strip()}")


def test_keep_keeps_a_cluster_whose_start_failed_until_sigterm(demo: Demo) -> None:
    """slurmctld refuses its configuration: with --keep the demo says so in one line, keeps the
    pool, munge and the cluster's files and logs for a look, and ends them all on SIGTERM."""
    with kept_demo(demo, "--extra-slurm-conf", "RgpuNoSuchKey=1") as kept:
        failure = [line for line in kept.stderr.splitlines() if line.startswith("rgpu: demo:")]
        assert len(failure) == 1 and "slurmctld exited" in failure[0], kept.stderr
        assert "the cluster is kept as far as it came, until Ctrl-C; logs: " in failure[0], kept.stderr
        slurm_logs = Path(failure[0].split("logs: ", 1)[1].split("/ and ", 1)[0])
        assert "RgpuNoSuchKey" in (slurm_logs / "slurmctld.out").read_text(errors="replace")
        listing = subprocess.run([str(demo.venv / "bin" / "python"), "-m", "rgpu.remoting.admin.cli", "list-gpus"],
                                 cwd="/", env={**kept.env, "RGPU_CONFIG": kept.rgpu_config}, capture_output=True,
                                 text=True, timeout=60, check=False)
        assert listing.returncode == 0 and listing.stdout.count("NVIDIA H100") == 4, listing   # the pool is kept
        assert leftover_daemons(str(Path(kept.rgpu_config).parents[1]))     # munged and the pool still run
