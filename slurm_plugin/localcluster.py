"""A real Slurm cluster on one host: munge, slurmctld and three slurmd (c1..c3).

Used by the tests (tests/slurm/) and the demo (`python -m rgpu.slurm_plugin.demo`).

Everything lives under one temporary directory: a private munge key and socket (AuthInfo points
Slurm at it, so the host's /etc/munge is never touched), slurm.conf, gres.conf, job_submit.lua
with its config, state, spool, logs and pid files. Daemons are children of this process started
in the foreground (-D / -F), so `stop()` can always find and end them by their own pids.

Needs root (slurmd runs jobs as other users) and Debian's Slurm packages; Debian builds slurmd
with MULTIPLE_SLURMD, so three slurmd share this host, each on its own port. The Slurm is the
host's, or another version's in a cached Debian root (`ClusterConfig.install`, slurmroot.py):
then every daemon and command runs through the root's `enter` helper, and host programs (the
pool daemon, the tests) find the root's client commands first on `env`'s PATH.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from rgpu.slurm_plugin.licenses import SCHEDULER_PARAMETERS
from rgpu.slurm_plugin.proc import run_command
from rgpu.slurm_plugin.scontrol import parse_show_job
from rgpu.slurm_plugin.slurmroot import SlurmInstall
from rgpu.slurm_plugin.squeue import _number, _state

T = TypeVar("T")

SLURM_BINARIES = ("slurmctld", "slurmd", "munged", "sbatch", "squeue", "scontrol", "sinfo", "scancel")


def find_binary(name: str) -> str | None:
    return shutil.which(name) or next(
        (str(p) for p in (Path("/usr/sbin") / name, Path("/usr/bin") / name) if p.exists()), None)


def missing_requirements(install: SlurmInstall | None = None) -> str | None:
    """Why this host cannot run the test cluster (of `install`; the host's Slurm by default), or None."""
    if os.geteuid() != 0:
        return "the Slurm test cluster needs root (slurmd starts jobs as other users)"
    if install is not None and install.root is not None:
        gone = [b for b in SLURM_BINARIES if not any((install.root / d / b).exists() for d in ("usr/sbin", "usr/bin"))]
        return f"the Slurm {install.version} root {install.root} lacks {', '.join(gone)}" if gone else None
    missing = [b for b in SLURM_BINARIES if find_binary(b) is None]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} not found); "
                "install the packages in .ci/debian-packages.txt")
    return None


def _ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768                            # Linux's default range is 32768-60999


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports free now, from below the kernel's ephemeral range.

    A port bound to 0 and closed again comes from that range, which is also where outgoing
    connections get theirs: a daemon connecting out (slurmdbd to MariaDB) could take it before
    the daemon meant to listen on it binds ("Address already in use"). Ports below the range
    are never handed out by the kernel, and a random pick keeps two clusters apart."""
    low = _ephemeral_low()
    first = max(1024, low - 16384)
    picker = random.SystemRandom()
    socks: list[socket.socket] = []
    try:
        for _ in range(200 * count):
            if len(socks) == count:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("127.0.0.1", picker.randrange(first, low)))
            except OSError:
                s.close()
                continue
            socks.append(s)
        if len(socks) < count:
            raise RuntimeError(f"localcluster: found {len(socks)} of {count} free loopback ports in "
                               f"{first}-{low - 1}; free some or widen the range below ip_local_port_range")
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_until(what: str, probe: Callable[[], T | None], timeout: float, interval: float = 0.25) -> T:
    """Call probe until it returns something other than None/False; fail naming `what`."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        last = probe()
        if last:
            return last
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what} (last: {last!r})")
        time.sleep(interval)


def plain_job(raw: dict) -> dict:  # type: ignore[type-arg]
    """A job of `squeue --json` in 22.05's flat shape: job_state the base state, numbers plain."""
    out = {}
    for key, value in raw.items():
        if isinstance(value, dict) and "number" in value:
            value = _number(value)
        out[key] = value
    out["job_state"] = _state(raw.get("job_state"))[0]
    return out


@dataclass
class ClusterConfig:
    nodes: tuple[str, ...] = ("c1", "c2", "c3")
    cpus_per_node: int = 4          # more than the host has; SlurmdParameters=config_overrides
    gres_per_node: int = 8
    license_total: int = 400        # GPU percent: 4 whole GPUs
    lua_script: Path | None = None  # installed as job_submit.lua beside slurm.conf
    lua_conf_text: str = ""         # job_submit_rgpu.conf beside it
    # Slurm keys (PrologSlurmctld, Prolog, TaskProlog, Epilog, EpilogSlurmctld) -> argv to run.
    # Each gets a wrapper script that exports `script_env` first.
    scripts: dict[str, Sequence[str]] = field(default_factory=dict)
    script_env: dict[str, str] = field(default_factory=dict)
    extra_conf: str = ""
    # What `rgpu-admin slurm-config` recommends, and backfill every second (a test cluster's jobs
    # are seconds long; Slurm's default is 30 s).
    scheduler_parameters: str = f"bf_interval=1,{SCHEDULER_PARAMETERS}"
    install: SlurmInstall = SlurmInstall("")   # the host's Slurm
    # Host folders that jobs or the TaskProlog read inside a Slurm root (the cluster's own
    # folder and /tmp are always there), e.g. the folder of the TaskProlog script.
    root_binds: tuple[str, ...] = ()


class SlurmCluster:
    def __init__(self, config: ClusterConfig, root: Path | None = None) -> None:
        self.config = config
        # Not under pytest's tmp_path: that is mode 0700, and munge and job users must get in.
        self.root = Path(root or tempfile.mkdtemp(prefix="rgpu-slurm-"))
        self.root.chmod(0o755)
        self.etc = self.root / "etc"
        self.conf = self.etc / "slurm.conf"
        self.munge_dir = self.root / "munge"
        self.munge_socket = self.munge_dir / "munge.socket"
        self.jobs_dir = self.root / "jobs"        # job scripts and output, writable by any user
        self.logs = self.root / "log"
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self.hostname = socket.gethostname().split(".")[0]
        self.ctld_port, *self.node_ports = free_ports(1 + len(config.nodes))

    # ----- environment for client commands -----
    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env.update(self.client_env)
        return env

    @property
    def install(self) -> SlurmInstall:
        return self.config.install

    @property
    def client_env(self) -> dict[str, str]:
        """What a host program needs to use this cluster: SLURM_CONF, and PATH to a root's commands."""
        env = {"SLURM_CONF": str(self.conf), "PATH": self.install.path(os.environ.get("PATH", "/usr/bin:/bin"))}
        if self.install.root:
            env["RGPU_SLURM_ROOT_BINDS"] = ":".join([str(self.root), *self.config.root_binds])
        return env

    def command(self, argv: Sequence[str], *, check: bool = True, timeout: float = 30.0,
                user: str | None = None) -> subprocess.CompletedProcess[str]:
        argv = list(argv)
        if user and user != "root":
            argv = ["runuser", "-u", user, "--", *argv]
        return run_command(self.install.wrap(argv), component="local-cluster", env=self.env, check=check,
                           timeout=timeout)

    # ----- configuration -----
    def _write_configs(self) -> None:
        c = self.config
        for d in (self.etc, self.logs, self.root / "state", self.root / "run", self.jobs_dir,
                  self.root / "bin", *(self.root / "spool" / n for n in c.nodes)):
            d.mkdir(parents=True, exist_ok=True)
        self.jobs_dir.chmod(0o1777)
        nodes = ",".join(c.nodes)
        node_lines = "\n".join(
            f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p} CPUs={c.cpus_per_node} "
            f"RealMemory=1000 Gres=rgpu:{c.gres_per_node} State=UNKNOWN"
            for n, p in zip(c.nodes, self.node_ports))
        script_lines = "\n".join(f"{key}={self._wrapper(key, argv)}" for key, argv in c.scripts.items())
        r = self.root
        self.conf.write_text(f"""\
# rgpu local cluster (generated by rgpu.slurm_plugin.localcluster)
ClusterName=rgputest
SlurmctldHost={self.hostname}(127.0.0.1)
SlurmctldPort={self.ctld_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd.%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
MessageTimeout=10
KillWait=2
MinJobAge=600
SchedulerParameters={c.scheduler_parameters}
GresTypes=rgpu
Licenses=rgpu:{c.license_total}
PrologFlags=Alloc
{"JobSubmitPlugins=lua" if c.lua_script else ""}
{script_lines}
{c.extra_conf}
{node_lines}
PartitionName=cpu Nodes={nodes} Default=YES MaxTime=INFINITE State=UP
""")
        (self.etc / "gres.conf").write_text(
            "".join(f"NodeName={n} Name=rgpu Count={c.gres_per_node}\n" for n in c.nodes))
        (self.etc / "cgroup.conf").write_text("CgroupPlugin=autodetect\n")
        if c.lua_script:
            # job_submit/lua reads job_submit.lua from the directory of slurm.conf ($SLURM_CONF).
            shutil.copyfile(c.lua_script, self.etc / "job_submit.lua")
            (self.etc / "job_submit_rgpu.conf").write_text(c.lua_conf_text)

    def _wrapper(self, key: str, argv: Sequence[str]) -> Path:
        path = self.root / "bin" / key
        # Double quotes: values are trusted test settings and may use the script's environment
        # (e.g. a per-node run dir with ${SLURMD_NODENAME}).
        # PrologSlurmctld/EpilogSlurmctld get no $SLURM_CONF from slurmctld: their scontrol needs it.
        env = {"SLURM_CONF": str(self.conf), **self.config.script_env}
        if self.install.root:
            # Run inside the root; host programs (rgpu's Python) are reached through chroot /.host
            # and find the root's Slurm commands first on PATH.
            env["PATH"] = self.install.path(env.get("PATH", "/usr/bin:/bin"))
            if key != "TaskProlog":   # the job's user cannot chroot; the TaskProlog is sh, run in the root
                argv = [*self.install.host_prefix(), *argv]
        if key == "TaskProlog" and len(argv) == 1 and Path(argv[0]).is_file():
            # It runs as the job's user, who may not reach the script where it lies (a checkout or
            # a venv in a 0700 home: "TaskProlog failed status=126"): run a copy from this folder.
            copy = self.root / "bin" / f"{key}.{Path(argv[0]).name}"
            shutil.copyfile(argv[0], copy)
            copy.chmod(0o755)
            argv = [str(copy)]
        exports = "".join(f'export {k}="{v}"\n' for k, v in env.items())
        # Slurm 22.05 drops prolog output: keep stderr in the cluster's log folder.
        # (Not TaskProlog: it runs as the job's user, who cannot write there.)
        redirect = "" if key == "TaskProlog" else f" 2>>'{self.logs}/{key}.log'"
        path.write_text("#!/bin/sh\n" + exports + "exec " + " ".join(f"'{a}'" for a in argv) + redirect + "\n")
        path.chmod(0o755)
        return path

    def set_lua_conf(self, text: str) -> None:
        """Change job_submit_rgpu.conf; the script reads it on every submission."""
        (self.etc / "job_submit_rgpu.conf").write_text(text)

    # ----- daemons -----
    def _spawn(self, name: str, argv: Sequence[str], user: str | None = None) -> None:
        if user:
            argv = ["runuser", "-u", user, "--", *argv]
        log = open(self.logs / f"{name}.out", "ab")
        self._procs[name] = subprocess.Popen(self.install.wrap(argv), stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, env=self.env,
                                             start_new_session=True)
        log.close()

    def _start_munge(self) -> None:
        uid, gid = self.install.passwd_ids("munge")
        self.munge_dir.mkdir(mode=0o700, exist_ok=True)
        key = self.munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        for p in (self.munge_dir, key):
            os.chown(p, uid, gid)
        self.munge_dir.chmod(0o755)  # clients (job users) must reach the socket
        self._spawn("munged", [self._binary("munged"), "--foreground", "--force",
                               f"--socket={self.munge_socket}", f"--key-file={key}",
                               f"--pid-file={self.munge_dir / 'munged.pid'}",
                               f"--log-file={self.munge_dir / 'munged.log'}",
                               f"--seed-file={self.munge_dir / 'munged.seed'}"], user="munge")
        wait_until("munged socket", lambda: self.munge_socket.exists() or self._died("munged"), 15)

    def _binary(self, name: str) -> str:
        if self.install.root:
            return f"/usr/sbin/{name}"
        return find_binary(name) or name

    def _died(self, name: str) -> bool:
        proc = self._procs[name]
        if proc.poll() is not None:
            out = (self.logs / f"{name}.out").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{name} exited {proc.returncode} at start:\n{out}\n{self.log_tail()}")
        return False

    def start(self, timeout: float = 60.0, keep_on_failure: bool = False) -> SlurmCluster:
        """Start munge, slurmctld and the slurmd; on failure stop what started (`keep_on_failure`:
        leave it running, and its files, for the caller to look at and stop)."""
        try:
            self._write_configs()
            self._start_munge()
            self._spawn("slurmctld", [self._binary("slurmctld"), "-D", "-i", "-f", str(self.conf)])
            wait_until("slurmctld to answer",
                       lambda: self._died("slurmctld") or self.command(["scontrol", "ping"], check=False).returncode == 0,
                       timeout)
            for n in self.config.nodes:
                self._spawn(f"slurmd-{n}", [self._binary("slurmd"), "-D", "-N", n, "-f", str(self.conf)])
            wait_until("all nodes idle", self.all_nodes_idle, timeout, interval=0.5)
        except BaseException:
            if not keep_on_failure:
                self.stop()
            raise
        return self

    def node_states(self) -> dict[str, str]:
        out = self.command(["sinfo", "-h", "-N", "-o", "%N %T"], check=False).stdout
        return dict(line.split(None, 1) for line in out.splitlines() if " " in line)

    def all_nodes_idle(self) -> bool:
        for n in self.config.nodes:
            self._died(f"slurmd-{n}")
        states = self.node_states()
        return len(states) == len(self.config.nodes) and all(s == "idle" for s in states.values())

    def log_tail(self, lines: int = 40) -> str:
        parts = []
        for log in sorted(self.logs.glob("*.log")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log.name}\n" + "\n".join(text))
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancel jobs, shut Slurm down, end every daemon we started. Safe to call twice."""
        if "slurmctld" in self._procs and self._procs["slurmctld"].poll() is None:
            self.cancel_all_jobs()
            self.command(["scontrol", "shutdown"], check=False, timeout=15)
        deadline = time.monotonic() + 15
        for name in sorted(self._procs, key=lambda n: n == "munged"):  # munged last
            proc = self._procs[name]
            if name == "munged" and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        self._kill_leftover_stepds()
        self._procs.clear()

    def live_job_ids(self) -> list[str]:
        out = self.command(["squeue", "-h", "-o", "%i %T"], check=False).stdout
        return [line.split()[0] for line in out.splitlines()
                if line.strip() and line.split()[1] not in ("COMPLETED", "CANCELLED", "FAILED")]

    def cancel_all_jobs(self, timeout: float = 20.0) -> None:
        ids = self.live_job_ids()
        if ids:
            self.command(["scancel", *ids], check=False)
            try:
                wait_until("all jobs to end", lambda: not self.live_job_ids(), timeout)
            except TimeoutError:
                pass

    def _kill_leftover_stepds(self) -> None:
        """slurmstepd processes of this cluster outlive slurmd; end them by pid."""
        marker = str(self.root).encode()
        for proc_dir in Path("/proc").iterdir():
            if not proc_dir.name.isdigit():
                continue
            try:
                cmdline = (proc_dir / "cmdline").read_bytes()
                environ = (proc_dir / "environ").read_bytes() if b"slurmstepd" in cmdline else b""
            except OSError:
                continue
            if b"slurmstepd" in cmdline and marker in environ:
                try:
                    os.kill(int(proc_dir.name), signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    # ----- jobs -----
    def write_job_script(self, name: str, body: str) -> Path:
        path = self.jobs_dir / name
        path.write_text("#!/bin/sh\n" + body)
        path.chmod(0o755)
        return path

    def sbatch(self, args: Sequence[str], body: str = "true\n", *, user: str | None = None,
               check: bool = True) -> subprocess.CompletedProcess[str]:
        script = self.write_job_script(f"job-{time.monotonic_ns()}.sh", body)
        return self.command(["sbatch", "--parsable", f"--chdir={self.jobs_dir}",
                             f"--output={self.jobs_dir}/slurm-%j.out", *args, str(script)],
                            check=check, user=user)

    def submit(self, args: Sequence[str], body: str = "true\n", *, user: str | None = None) -> str:
        return self.sbatch(args, body, user=user).stdout.strip().split(";")[0]

    def show_job(self, job_id: str) -> dict[str, str]:
        out = self.command(["scontrol", "show", "job", "-d", job_id], check=False)
        return parse_show_job(out.stdout) if out.returncode == 0 else {}

    def job_json(self, job_id: str) -> dict:  # type: ignore[type-arg]
        """The job as `squeue --json` shows it (22.05 prints every job; this picks one by id):
        structured, so hostile names or comments cannot shift its fields; in 22.05's flat shape
        whatever the version (`plain_job`)."""
        import json

        jobs = json.loads(self.command(["squeue", "--json", "--states=all"]).stdout).get("jobs") or []
        found = [j for j in jobs if str(_number(j.get("job_id"))) == str(job_id)]
        return plain_job(found[0]) if found else {}

    def job_state(self, job_id: str) -> str:
        return self.show_job(job_id).get("JobState", "")

    def wait_job_state(self, job_id: str, states: set[str] | str, timeout: float = 30.0) -> dict[str, str]:
        wanted = {states} if isinstance(states, str) else states

        def reached() -> dict[str, str] | None:
            job = self.show_job(job_id)
            return job if job.get("JobState") in wanted else None

        return wait_until(f"job {job_id} to reach {sorted(wanted)}", reached, timeout)

    def job_output(self, job_id: str) -> str:
        path = self.jobs_dir / f"slurm-{job_id}.out"
        return path.read_text(errors="replace") if path.exists() else ""


