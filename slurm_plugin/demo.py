"""The Slurm demo: `sudo python3 -m rgpu.slurm_plugin.demo` from the rgpu source tree.

Starts, under one temporary folder on this machine: rgpu-poold, two rgpu-dispatcher serving the
example static inventories (4 GPUs), munge, slurmctld and three slurmd with rgpu's job_submit.lua
and prologs; submits `sbatch --gres=rgpu:2 --comment=fraction=0.5 job.sh` as user nobody; shows
the job's adaptor.conf and `rgpu-admin list-gpus` while it runs; then stops everything.
Installs Slurm with apt-get when it is missing (root only).
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
from rgpu.slurm_plugin.licenses import config_values, render_slurm_config
from rgpu.slurm_plugin.localcluster import (
    ClusterConfig,
    SlurmCluster,
    free_ports,
    missing_requirements,
    wait_until,
)

from rgpu.errors import RgpuError

SLURM_PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
SUBMIT = ["--gres=rgpu:2", "--comment=fraction=0.5"]
# Lease tokens are credentials: the demo shows only their first characters (job output included).
JOB = ('echo "RGPU_ADAPTOR_CONF=$RGPU_ADAPTOR_CONF"; '
       "sed -E 's/^(token = \"[^\"]{12})[^\"]*\"/\\1...\" # cut by the demo/' \"$RGPU_ADAPTOR_CONF\"; sleep 8\n")
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
    if os.geteuid() != 0:
        raise RgpuError("demo", "the Slurm demo needs root", "slurmd starts jobs as other users",
                        "run it with sudo")
    if missing_requirements() is None:
        return
    if not shutil.which("apt-get"):
        raise RgpuError("demo", "Slurm is not installed", "no apt-get here", f"install {' '.join(SLURM_PACKAGES)}")
    click.echo(f"demo: installing {' '.join(SLURM_PACKAGES)} with apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *SLURM_PACKAGES], check=True, env=env)
    reason = missing_requirements()
    if reason:
        raise RgpuError("demo", "Slurm is still missing after apt-get", reason, "install it by hand")


class Daemons:
    """rgpu daemons as child processes in their own sessions, ended by process group."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.root, self.env, self.procs = root, env, []  # type: ignore[var-annotated]

    def start(self, name: str, *args: str) -> None:
        log = open(self.root / f"{name}.log", "ab")  # noqa: SIM115 - the child keeps it
        self.procs.append(subprocess.Popen([sys.executable, "-m", *args], stdout=log, stderr=subprocess.STDOUT,
                                           env=self.env, start_new_session=True))
        log.close()

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def admin(env: dict[str, str], *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "rgpu.remoting.admin.cli", *args], env=env, capture_output=True, text=True,
                         timeout=30)
    return out.stdout + out.stderr


def run_demo(keep: bool = False) -> None:
    from rgpu.remoting.pool.client import connect

    from rgpu.config import load_settings
    from rgpu.netaddr import join_host_port
    from rgpu.secret import create_secret

    ensure_slurm()
    tree = source_tree()
    root = Path(tempfile.mkdtemp(prefix="rgpu-demo-"))
    root.chmod(0o755)
    (root / "pool").mkdir()
    secret = create_secret(root / "pool" / "secret")
    pool_port, disp_a, disp_b = free_ports(3)
    pool_addr = join_host_port("127.0.0.1", pool_port)
    (root / "pool" / "rgpu.toml").write_text(f'pool = "{pool_addr}"\nlisten = "{pool_addr}"\n'
                                             f'state = "{root}/pool/pool.db"\nsecret_file = "{secret}"\n'
                                             "heartbeat_interval_seconds = 1.0\ndown_after_seconds = 5.0\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RGPU_", "SLURM_"))}
    env["RGPU_CONFIG"] = str(root / "pool" / "rgpu.toml")
    daemons = Daemons(root / "pool", env)
    slurm: SlurmCluster | None = None
    try:
        daemons.start("poold", "rgpu.remoting.pool.daemon")
        for port, inventory in ((disp_a, "inventory-a.toml"), (disp_b, "inventory-b.toml")):
            daemons.start(f"dispatcher-{port}", "rgpu.remoting.dispatcher.daemon", "-p", str(port), "--host", "127.0.0.1",
                          "--advertise", "127.0.0.1", "--inventory", str(tree / "examples" / inventory))
        client = connect(load_settings(env=env), timeout=3.0)

        def four_gpus() -> bool:
            try:
                return client.capacity().total_units == 400
            except RgpuError:
                return False

        wait_until("4 GPUs in the pool", four_gpus, 30)
        values = config_values(client.list_gpus(), 400, 16, str(tree / "prolog"))
        py, prolog = sys.executable, tree / "prolog"
        config = ClusterConfig(
            lua_script=tree / "slurm_plugin" / "job_submit.lua",
            lua_conf_text=render_slurm_config(values, ("job_submit_rgpu.conf",)),
            scripts={"PrologSlurmctld": [py, str(prolog / "rgpu-prolog-slurmctld")],
                     "Prolog": [py, str(prolog / "rgpu-prolog")], "TaskProlog": [str(prolog / "rgpu-task-prolog")],
                     "Epilog": [py, str(prolog / "rgpu-epilog")],
                     "EpilogSlurmctld": [py, str(prolog / "rgpu-epilog-slurmctld")]},
            script_env={"RGPU_CONFIG": env["RGPU_CONFIG"], "RGPU_RUN_DIR": f"{root}/run-rgpu/${{SLURMD_NODENAME}}",
                        "PATH": os.environ.get("PATH", "/usr/bin:/bin")})
        (root / "slurm").mkdir()
        slurm = SlurmCluster(config, root=root / "slurm").start()
        click.echo(f"demo: Slurm cluster up (nodes c1-c3, Licenses=rgpu:400), pool at {pool_addr}\n")
        click.echo(f"$ sbatch {' '.join(SUBMIT)} job.sh        # as user nobody")
        job = slurm.submit(SUBMIT, JOB, user="nobody")
        info = slurm.wait_job_state(job, {"RUNNING", "FAILED", "CANCELLED"}, 60)
        node = info.get("NodeList", "")
        conf = root / "run-rgpu" / node / job / "adaptor.conf"
        wait_until("the job's adaptor.conf", conf.exists, 15)
        click.echo(f"job {job} is {info['JobState']} on {node}, Licenses={info.get('Licenses')}\n")
        click.echo(f"$ cat {conf}   # tokens cut\n{without_tokens(conf.read_text())}")
        click.echo(f"$ rgpu-admin list-gpus\n{admin(env, 'list-gpus')}")
        final = slurm.wait_job_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, 60)
        click.echo(f"job {job} {final['JobState']}; its output:\n{slurm.job_output(job)}")
        if final["JobState"] != "COMPLETED":
            raise RgpuError("demo", f"the demo job ended {final['JobState']}", "its output is above",
                            "run it again with --keep to inspect the cluster")
        wait_until("the lease to be released", lambda: not client.list_leases(), 15)
        click.echo(f"$ rgpu-admin leases\n{admin(env, 'leases')}")
        if keep:
            click.echo(f"demo: running until Ctrl-C; export SLURM_CONF={slurm.conf} RGPU_CONFIG={env['RGPU_CONFIG']}")
            while True:
                time.sleep(3600)
    finally:
        if slurm is not None:
            slurm.stop()
        daemons.stop()
        shutil.rmtree(root, ignore_errors=True)


@click.command()
@click.option("--keep", is_flag=True, help="Keep the cluster running after the demo job, until Ctrl-C.")
def main(keep: bool) -> None:
    """Run rgpu with a real local Slurm cluster and one sbatch job."""
    try:
        run_demo(keep)
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
