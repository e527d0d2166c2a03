"""The Slurm demo: `./scripts/demo.sh` as root (or `python3 -m rgpu.slurm_plugin.demo` with rgpu
installed), from the rgpu source tree.

Starts, under one temporary folder on this machine (mode 0755: munge, slurmd and the job's user
must get in): munge, slurmctld and three slurmd with rgpu's job_submit.lua and prologs; rgpu-poold
as a site runs it (its Slurm integration on: the reconciler and the license sync; users
authenticate with the cluster's MUNGE); two rgpu-dispatcher serving the example static
inventories (4 emulated GPUs, each capped at what this host's memory can hold: their "device"
memory is host RAM). It submits `sbatch --gres=rgpu:2 --comment=fraction=0.5 job.sh` as user
nobody (whose HOME is not writable), shows the job's adaptor.conf, `flexrun -- nvidia-smi` in the
job and `rgpu-admin list-gpus` while it runs, then `rgpu-admin request-gpus` run by nobody with
MUNGE, and stops everything; with --keep the cluster stays up (also when the demo failed) until
Ctrl-C, with the commands to try it as root and as a user.

The TaskProlog, which Slurm runs as the job's user, runs from a copy in the cluster's folder, so
the demo works from a checkout or venv other users cannot read (a 0700 home); flexrun in the job
and as a user needs this Python and rgpu readable by every user, and the demo says which folder is
not when they are not (scripts/demo.sh installs them in /opt/rgpu). Installs Slurm, munge and gcc
(flexrun builds its client libraries with it) with apt-get when they are missing (root only).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
from rgpu import __version__
from rgpu.paths import unreadable_folder
from rgpu.slurm_plugin.licenses import config_values, render_slurm_config
from rgpu.slurm_plugin.localcluster import (
    ClusterConfig,
    SlurmCluster,
    free_ports,
    missing_requirements,
    wait_until,
)

from rgpu.errors import RgpuError
from rgpu.units import format_bytes

RUNUSER = shutil.which("runuser") or "/usr/sbin/runuser"
SLURM_PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
SUBMIT = ["--gres=rgpu:2", "--comment=fraction=0.5"]
USER = "nobody"            # the demo's job user and the user who tries rgpu with MUNGE
# Lease tokens are credentials: the demo shows only their first characters (job output included).
JOB = ('echo "RGPU_ADAPTOR_CONF=$RGPU_ADAPTOR_CONF"; '
       "sed -E 's/^(token = \"[^\"]{12})[^\"]*\"/\\1...\" # cut by the demo/' \"$RGPU_ADAPTOR_CONF\"\n")
# Emulated GPUs keep their "device" memory in this host's RAM: together they may take this share
# of the memory available when the demo starts.
EMULATED_SHARE = 0.5
DEMO_GPUS = 4
_TOKEN_RE = re.compile(r'^(token = "[^"]{12})[^"]*"', re.MULTILINE)


def without_tokens(text: str) -> str:
    """adaptor.conf text with each lease token cut to its first 12 characters."""
    return _TOKEN_RE.sub(r'\1..." # cut by the demo', text)


def source_tree() -> Path:
    """The checkout: named by scripts/demo.sh (which runs this from outside it, so that its
    rgpu/ folder cannot hide the installed package), else this file's tree, else the cwd."""
    named = [Path(os.environ["RGPU_SOURCE_TREE"])] if os.environ.get("RGPU_SOURCE_TREE") else []
    for base in (*named, Path(__file__).resolve().parents[1], Path.cwd()):
        if (base / "examples" / "inventory-a.toml").exists() and (base / "prolog" / "rgpu-prolog").exists():
            return base
    raise RgpuError("demo", "cannot find examples/ and prolog/", "the demo runs from the rgpu source tree",
                    "cd into the rgpu checkout and run it again")


def ensure_slurm() -> None:
    """Root, the host's Slurm and munge, and a C compiler (flexrun builds its client libraries with
    it): what is missing is installed with apt-get."""
    if os.geteuid() != 0:
        raise RgpuError("demo", "the Slurm demo needs root", "slurmd starts jobs as other users",
                        "run it with sudo")
    slurm_missing = missing_requirements() is not None
    wanted = [*(SLURM_PACKAGES if slurm_missing else ()), *(() if shutil.which("cc") else ("gcc",))]
    if not wanted:
        return
    if not shutil.which("apt-get"):
        if slurm_missing:
            raise RgpuError("demo", "Slurm is not installed", "no apt-get here", f"install {' '.join(SLURM_PACKAGES)}")
        return     # no compiler: the job skips flexrun (run_demo says so)
    click.echo(f"demo: installing {' '.join(wanted)} with apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *wanted], check=True, env=env)
    reason = missing_requirements()
    if reason:
        raise RgpuError("demo", "Slurm is still missing after apt-get", reason, "install it by hand")


def host_available_memory(meminfo: str | None = None) -> int:
    """MemAvailable of /proc/meminfo, in bytes (0 where unknown)."""
    if meminfo is None:
        try:
            meminfo = Path("/proc/meminfo").read_text()
        except OSError:
            return 0
    match = re.search(r"^MemAvailable:\s+(\d+) kB", meminfo, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else 0


def emulated_gpu_memory(available: int, gpus: int = DEMO_GPUS, described: int = 80 << 30) -> int:
    """Bytes each emulated GPU may offer: its share of EMULATED_SHARE of the available memory, in
    whole MiB, at most what the inventory describes and at least 256 MiB."""
    share = int(available * EMULATED_SHARE) // gpus >> 20 << 20
    return max(256 << 20, min(described, share)) if available else described


def users_can_run_rgpu(user: str = USER) -> str | None:
    """None when `user` can run this Python and import rgpu's client tools; else one line saying
    which folder stands in the way and what to do."""
    import rgpu

    probe = subprocess.run([RUNUSER, "-u", user, "--", sys.executable, "-c", "import rgpu.remoting.client.flexrun"],
                           capture_output=True, text=True, timeout=60, check=False, cwd="/",
                           env={"PATH": "/usr/bin:/bin", "HOME": "/"})
    if probe.returncode == 0:
        return None
    blocked = unreadable_folder(Path(sys.executable)) or unreadable_folder(Path(rgpu.__file__).parent)
    why = (f"{blocked} is mode {blocked.stat().st_mode & 0o777:04o}" if blocked
           else (probe.stderr.strip().splitlines() or ["it failed"])[-1])
    return (f"rgpu: demo: {user} cannot run {sys.executable} with rgpu, so the demo skips flexrun in the job and "
            f"the user steps ({why}; jobs, flexrun and rgpu-admin run as each user: install rgpu in a virtual "
            "environment every user can read, as ./scripts/demo.sh does in /opt/rgpu)")


class Daemons:
    """rgpu daemons as child processes in their own sessions, ended by process group."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.root, self.env = root, env
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> None:
        log = open(self.root / f"{name}.log", "ab")  # noqa: SIM115 - the child keeps it
        self.procs[name] = subprocess.Popen([sys.executable, "-m", *args], stdout=log, stderr=subprocess.STDOUT,
                                            env=env or self.env, start_new_session=True)
        log.close()

    def stop(self, name: str | None = None) -> None:
        for key in reversed(list(self.procs) if name is None else [name]):
            proc = self.procs.pop(key)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def admin(env: dict[str, str], *args: str, user: str | None = None) -> str:
    argv = [sys.executable, "-m", "rgpu.remoting.admin.cli", *args]
    if user:
        argv = [RUNUSER, "-u", user, "--", "env", *(f"{k}={v}" for k, v in env.items()), *argv]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, cwd="/", check=False)
    return out.stdout + out.stderr


def job_body(flexrun_in_job: bool) -> str:
    if not flexrun_in_job:
        return JOB + "sleep 8\n"
    # The job's user (nobody) has no writable home: flexrun builds its libraries under $TMPDIR.
    return (JOB + 'echo "$ flexrun -- nvidia-smi    # in the job, as $(id -un), HOME=$HOME"\n'
            f"'{sys.executable}' -m rgpu.remoting.client.flexrun -- nvidia-smi\nsleep 4\n")


def show_user_steps(env: dict[str, str], user_env: dict[str, str], jobs_dir: Path) -> None:
    """rgpu-admin run by USER, who holds no secret: the pool knows them by their MUNGE credential."""
    conf = jobs_dir / f"{USER}-adaptor.conf"
    shown = " ".join(f"{k}={v}" for k, v in user_env.items() if k != "PATH")
    click.echo(f"$ runuser -u {USER} -- env {shown} rgpu-admin request-gpus -n 1 -p 0.25 -o {conf}   # MUNGE")
    click.echo(admin(user_env, "request-gpus", "-n", "1", "-p", "0.25", "-o", str(conf), "--ttl", "10m", user=USER))
    click.echo(f"$ rgpu-admin leases     # as root: {USER}'s lease among them\n{admin(env, 'leases')}")
    click.echo(f"$ runuser -u {USER} -- ... rgpu-admin release-gpus -f {conf}")
    click.echo(admin(user_env, "release-gpus", "-f", str(conf), user=USER))


def hold(slurm: SlurmCluster, env: dict[str, str], user_env: dict[str, str], users_ok: bool) -> None:
    """Keep everything running until Ctrl-C, saying how to use it."""
    py = sys.executable
    bin_dir = Path(py).parent
    user_vars = " ".join(f"{k}={v}" for k, v in user_env.items())
    click.echo(f"""
demo: the cluster runs until Ctrl-C (or SIGTERM). In another shell, as root:
  export SLURM_CONF={slurm.conf} RGPU_CONFIG={env['RGPU_CONFIG']} PATH={bin_dir}:$PATH
  sinfo; sbatch --gres=rgpu:1 --comment=fraction=0.25 --wrap 'flexrun -- nvidia-smi'; rgpu-admin leases
  logs: {slurm.logs}/ and {Path(env['RGPU_CONFIG']).parent}/*.log""")
    if users_ok:
        click.echo(f"""As a user (MUNGE; {USER} here, any user works):
  runuser -u {USER} -- env {user_vars} {bin_dir}/rgpu-admin request-gpus -n 1 -p 0.25 -o /tmp/{USER}-adaptor.conf
  runuser -u {USER} -- env {user_vars} {py} -m rgpu.remoting.client.flexrun -n 1 -p 0.25 -- nvidia-smi""")
    else:
        click.echo("demo: users cannot run this rgpu (said above): install it where every user can read it to try "
                   "flexrun -n and rgpu-admin request-gpus as a user")
    click.echo("demo: ready", err=True)   # for scripts and tests waiting on the kept cluster
    while True:
        time.sleep(3600)


def run_demo(keep: bool = False, job_script: str | None = None, extra_slurm_conf: str = "") -> None:
    from rgpu.remoting.pool.client import connect

    from rgpu.config import load_settings
    from rgpu.netaddr import join_host_port
    from rgpu.secret import create_secret

    ensure_slurm()
    tree = source_tree()
    users_problem = users_can_run_rgpu()
    if users_problem:
        click.echo(users_problem, err=True)
    root = Path(tempfile.mkdtemp(prefix="rgpu-demo-"))
    root.chmod(0o755)    # munge, slurmd and the job's user reach the cluster's files through it
    (root / "pool").mkdir(mode=0o755)
    (root / "pool-state").mkdir(mode=0o700)     # leases (with their tokens) and the secret: root's only
    secret = create_secret(root / "pool-state" / "secret")
    pool_port, disp_a, disp_b = free_ports(3)
    pool_addr = join_host_port("127.0.0.1", pool_port)
    (root / "slurm").mkdir()
    slurm = SlurmCluster(ClusterConfig(), root=root / "slurm")   # configured below, once the pool is up
    # Users read this file too: the pool's address and the cluster's MUNGE socket. The secret it
    # names is root's alone, so users' tools authenticate with MUNGE. The demo has no slurmdbd to
    # ask which accounts a user may charge: any.
    (root / "pool" / "rgpu.toml").write_text(
        f'pool = "{pool_addr}"\nlisten = "{pool_addr}"\nstate = "{root}/pool-state/pool.db"\nsecret_file = "{secret}"\n'
        f'munge_socket = "{slurm.munge_socket}"\naccount_check = "off"\nslurm_cluster = "rgputest"\n'
        "heartbeat_interval_seconds = 1.0\ndown_after_seconds = 5.0\n"
        "slurm_reconcile_interval_seconds = 2.0\nslurm_reconcile_grace_seconds = 20.0\nslurm_license_sync = true\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RGPU_", "SLURM_", "BF_"))}
    env["RGPU_CONFIG"] = str(root / "pool" / "rgpu.toml")
    available = host_available_memory()
    gpu_memory = emulated_gpu_memory(available)
    daemons = Daemons(root / "pool", env)
    started = False
    failure: BaseException | None = None
    try:
        daemons.start("poold", "rgpu.remoting.pool.daemon")
        for port, inventory in ((disp_a, "inventory-a.toml"), (disp_b, "inventory-b.toml")):
            daemons.start(f"dispatcher-{port}", "rgpu.remoting.dispatcher.daemon", "-p", str(port), "--host", "127.0.0.1",
                          "--advertise", "127.0.0.1", "--inventory", str(tree / "examples" / inventory),
                          env={**env, "RGPU_GPU_DEVICE_MEMORY_LIMIT": f"{gpu_memory >> 20}M"})
        click.echo(f"demo: the {DEMO_GPUS} emulated GPUs keep their \"device\" memory in this host's RAM: each offers "
                   f"{format_bytes(gpu_memory)} (RGPU_GPU_DEVICE_MEMORY_LIMIT; {EMULATED_SHARE:.0%} of the "
                   f"{format_bytes(available)} available here, shared by {DEMO_GPUS}), not the 80 GiB "
                   "their inventories describe")
        client = connect(load_settings(env=env), timeout=3.0)

        def four_gpus() -> bool:
            try:
                return client.capacity().total_units == 100 * DEMO_GPUS
            except RgpuError:
                return False

        wait_until("4 GPUs in the pool", four_gpus, 30)
        values = config_values(client.list_gpus(), 100 * DEMO_GPUS, 16, str(tree / "prolog"))
        py, prolog = sys.executable, tree / "prolog"
        slurm.config = ClusterConfig(
            lua_script=tree / "slurm_plugin" / "job_submit.lua",
            lua_conf_text=render_slurm_config(values, ("job_submit_rgpu.conf",)),
            scripts={"PrologSlurmctld": [py, str(prolog / "rgpu-prolog-slurmctld")],
                     "Prolog": [py, str(prolog / "rgpu-prolog")], "TaskProlog": [str(prolog / "rgpu-task-prolog")],
                     "Epilog": [py, str(prolog / "rgpu-epilog")],
                     "EpilogSlurmctld": [py, str(prolog / "rgpu-epilog-slurmctld")]},
            script_env={"RGPU_CONFIG": env["RGPU_CONFIG"], "RGPU_RUN_DIR": f"{root}/run-rgpu/${{SLURMD_NODENAME}}",
                        "PATH": os.environ.get("PATH", "/usr/bin:/bin")})
        if extra_slurm_conf:
            slurm.config.extra_conf = extra_slurm_conf
        started = True
        user_env = {"RGPU_CONFIG": env["RGPU_CONFIG"], "HOME": "/nonexistent", "PATH": "/usr/bin:/bin"}
        try:
            # With --keep a cluster whose start failed stays as far as it came, to be looked at.
            slurm.start(keep_on_failure=keep)
            # rgpu-poold looks for Slurm when it starts: now that slurm.conf exists, start it again
            # (same state, same port) beside it, as a site runs it: reconciler and license sync on.
            daemons.stop("poold")
            pool_log = root / "pool" / "poold.log"
            seen = pool_log.stat().st_size
            daemons.start("poold", "rgpu.remoting.pool.daemon", env={**env, **slurm.client_env})
            wait_until("4 GPUs registered again", four_gpus, 30)
            integration = wait_until("the pool's Slurm integration", lambda: next(
                (line.split("rgpu-poold: ", 1)[-1] for line in pool_log.read_bytes()[seen:].decode(errors="replace").splitlines()
                 if "Slurm reconciler every" in line or "Slurm integration off" in line), None), 20)
            click.echo(f"demo: Slurm cluster up (nodes c1-c3, Licenses=rgpu:{100 * DEMO_GPUS}), pool at {pool_addr}: "
                       f"{integration}\n")
            flexrun_in_job = users_problem is None and shutil.which("cc") is not None
            if users_problem is None and not flexrun_in_job:
                click.echo("rgpu: demo: no C compiler (cc) here, so the job skips flexrun (it builds its client "
                           "libraries with one on first use; install gcc)", err=True)
            click.echo(f"$ sbatch {' '.join(SUBMIT)} job.sh        # as user {USER}")
            job = slurm.submit(SUBMIT, job_script or job_body(flexrun_in_job), user=USER)
            info = slurm.wait_job_state(job, {"RUNNING", "COMPLETED", "FAILED", "CANCELLED"}, 60)
            node = info.get("NodeList", "")
            conf = root / "run-rgpu" / node / job / "adaptor.conf"
            if info["JobState"] == "RUNNING":
                # A short job can end, and its epilog remove the file, before the file is seen.
                wait_until("the job's adaptor.conf", lambda: conf.exists() or slurm.job_state(job) != "RUNNING", 15)
                click.echo(f"job {job} is {info['JobState']} on {node}, Licenses={info.get('Licenses')}\n")
                try:
                    text: str | None = conf.read_text()
                except FileNotFoundError:   # the job has ended already
                    text = None
                if text is not None:
                    click.echo(f"$ cat {conf}   # tokens cut\n{without_tokens(text)}")
                    click.echo(f"$ rgpu-admin list-gpus\n{admin(env, 'list-gpus')}")
            final = slurm.wait_job_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, 120)
            click.echo(f"job {job} {final['JobState']}; its output:\n{slurm.job_output(job)}")
            if final["JobState"] != "COMPLETED":
                raise RgpuError("demo", f"the demo job ended {final['JobState']}", "its output is above",
                                "the cluster is kept below: look at its logs" if keep else
                                "run it again with --keep to keep the cluster and inspect it")
            wait_until("the lease to be released", lambda: not client.list_leases(), 15)
            click.echo(f"$ rgpu-admin leases\n{admin(env, 'leases')}")
            if users_problem is None:
                show_user_steps(env, user_env, slurm.jobs_dir)
        except (RgpuError, TimeoutError, RuntimeError) as exc:
            if not keep:
                raise
            failure = exc
            if isinstance(exc, RgpuError):
                click.echo(str(exc), err=True)
            else:   # the cluster's start failed: its first line, and where the rest is
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                click.echo(f"rgpu: demo: {first} (the cluster is kept as far as it came, until Ctrl-C; "
                           f"logs: {slurm.logs}/ and {root / 'pool'}/)", err=True)
        if keep:
            hold(slurm, env, user_env, users_problem is None)
    finally:
        if started:
            slurm.stop()
        daemons.stop()
        shutil.rmtree(root, ignore_errors=True)
    if failure is not None:
        raise failure


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


@click.command()
@click.version_option(__version__, prog_name="rgpu-slurm-demo")
@click.option("--keep", is_flag=True,
              help="Keep the cluster running after the demo job, until Ctrl-C (also when the demo failed).")
@click.option("--job-script", hidden=True, help="The demo job's script body instead of the demo's (tests).")
@click.option("--extra-slurm-conf", hidden=True, default="", help="Lines added to slurm.conf (tests).")
def main(keep: bool, job_script: str | None, extra_slurm_conf: str) -> None:
    """Run rgpu with a real local Slurm cluster and one sbatch job."""
    signal.signal(signal.SIGTERM, _interrupt)     # a kept cluster ends on SIGTERM as on Ctrl-C
    try:
        run_demo(keep, job_script, extra_slurm_conf)
    except RgpuError as exc:
        click.echo(str(exc), err=True)
        sys.exit(exc.exit_code)
    except (TimeoutError, RuntimeError) as exc:
        click.echo(f"rgpu: demo: {exc}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
