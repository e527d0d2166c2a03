"""The session's Slurm test clusters with a real rgpu pool behind each.

`rgpu_slurm` is parametrised by Slurm version (22.05, 24.11, 26.05; markers slurm2205,
slurm2411, slurm2605; `--slurm-version` or $RGPU_SLURM_VERSIONS choose, default all): the
host's Slurm where it is that version, else Debian's in a cached root (slurm_plugin/slurmroot.py,
built on first use; scripts/test.sh builds them first, showing progress). Per version it starts,
once per session: rgpu-poold and two rgpu-dispatcher with the static
inventories in examples/ (4 GPUs), then munge, slurmctld and slurmd c1..c3 with job_submit.lua,
its config rendered by `rgpu-admin slurm-config`'s code from the live pool, and the prolog/
scripts. Everything is torn down at the end of the session (also after a failure or Ctrl-C;
an atexit hook backs the fixture up) and the test checks that no daemon is left.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.daemons import EXAMPLES, REPO, RgpuCluster, wait_for
from rgpu.errors import RgpuError
from rgpu.slurm_plugin.slurmroot import VERSIONS, SlurmInstall, install_for
from tests.slurm.cluster import ClusterConfig, SlurmCluster, missing_requirements, wait_until

PROLOG_DIR = REPO / "prolog"
LUA_SCRIPT = REPO / "slurm_plugin" / "job_submit.lua"
MAX_SLICES_PER_JOB = 8


@dataclass
class Harness:
    slurm: SlurmCluster
    pool: RgpuCluster
    run_dir: Path

    @property
    def version(self) -> str:
        return self.slurm.install.version

    def pool_env(self) -> dict[str, str]:
        return self.pool.env(**self.slurm.client_env)

    def client(self):  # type: ignore[no-untyped-def]
        return self.pool.client()

    def leases(self) -> list:  # type: ignore[type-arg]
        with self.client() as c:
            return c.list_leases()

    def job_leases(self, job_id: str) -> list:  # type: ignore[type-arg]
        return [lease for lease in self.leases() if lease.job_key.startswith(f"slurm:rgputest:{job_id}:")]


def pool_ready(pool: RgpuCluster, units: int) -> bool:
    try:
        with pool.client() as c:
            return c.capacity().total_units == units
    except Exception:  # noqa: BLE001 - not up yet
        return False


def lua_conf_from_pool(pool: RgpuCluster) -> str:
    from rgpu.slurm_plugin.licenses import config_values, render_slurm_config

    with pool.client() as c:
        values = config_values(c.list_gpus(), c.capacity().total_units, MAX_SLICES_PER_JOB, str(PROLOG_DIR))
    return render_slurm_config(values, ("job_submit_rgpu.conf",))


def timeout_lines(pool: RgpuCluster, version: str) -> str:
    """`rgpu-admin slurm-config`'s prolog timeout lines for `version`: the cluster runs with them."""
    from rgpu.slurm_plugin.licenses import config_values, render_slurm_config

    with pool.client() as c:
        values = config_values(c.list_gpus(), c.capacity().total_units, MAX_SLICES_PER_JOB, str(PROLOG_DIR),
                               slurm_version=version)
    return "".join(line + "\n" for line in render_slurm_config(values, ("slurm.conf",)).splitlines()
                   if line.startswith(("PrologTimeout=", "EpilogTimeout=", "PrologEpilogTimeout=")))


# The pool daemon's Slurm integration as the session cluster runs it: the reconciler (which also
# starts jobs waiting for the pool) every second, leases of gone jobs released after 10 s. License
# sync is off here only because tests drive their own LicenseSync against the same license.
RECONCILE_INTERVAL_SECONDS = 1.0
RECONCILE_GRACE_SECONDS = 10.0


def start_pool(pool: RgpuCluster, slurm_conf: Path | None = None, install: SlurmInstall | None = None) -> RgpuCluster:
    """The pool and two dispatchers; with `slurm_conf` (where the Slurm cluster will write it) the
    pool runs its Slurm integration as it does by default beside a Slurm cluster (of `install`)."""
    pool.write_config(down_after_seconds=3.0, heartbeat_interval_seconds=0.5, reclaim_interval_seconds=0.5,
                      max_slices_per_job=MAX_SLICES_PER_JOB, slurm_reconcile_interval_seconds=RECONCILE_INTERVAL_SECONDS,
                      slurm_reconcile_grace_seconds=RECONCILE_GRACE_SECONDS, slurm_admission_poll_seconds=0.5,
                      slurm_license_sync=False)
    path = (install or SlurmInstall("")).path(os.environ.get("PATH", "/usr/bin:/bin"))
    pool.start_pool(env=pool.env(SLURM_CONF=str(slurm_conf), PATH=path) if slurm_conf else None)
    for inventory in ("inventory-a.toml", "inventory-b.toml"):
        pool.start_dispatcher(EXAMPLES / inventory)
    try:
        wait_for(lambda: pool_ready(pool, 400), timeout=30, what="4 GPUs registered with the pool")
    except AssertionError as exc:
        logs = "\n".join(f"--- {d.name}\n{d.log()[-1500:]}" for d in pool.daemons)
        raise AssertionError(f"{exc}\n{logs}") from None
    return pool


def slurm_config(pool: RgpuCluster, run_dir: Path, install: SlurmInstall | None = None) -> ClusterConfig:
    py = sys.executable
    scripts = {
        "PrologSlurmctld": [py, str(PROLOG_DIR / "rgpu-prolog-slurmctld")],
        "Prolog": [py, str(PROLOG_DIR / "rgpu-prolog")],
        "TaskProlog": [str(PROLOG_DIR / "rgpu-task-prolog")],
        "Epilog": [py, str(PROLOG_DIR / "rgpu-epilog")],
        "EpilogSlurmctld": [py, str(PROLOG_DIR / "rgpu-epilog-slurmctld")],
    }
    # Three slurmd share this host: each node gets its own run dir, as separate hosts would
    # each have their own /run/rgpu.
    return ClusterConfig(
        license_total=400, gres_per_node=MAX_SLICES_PER_JOB, lua_script=LUA_SCRIPT,
        lua_conf_text=lua_conf_from_pool(pool), scripts=scripts, install=install or SlurmInstall(""),
        extra_conf=timeout_lines(pool, install.version) if install else "",
        root_binds=(str(PROLOG_DIR),),
        script_env={"RGPU_CONFIG": str(pool.root / "rgpu.toml"), "RGPU_POOL": pool.pool_address,
                    "RGPU_SECRET_FILE": str(pool.secret_file), "RGPU_RUN_DIR": f"{run_dir}/${{SLURMD_NODENAME}}",
                    "PYTHONPATH": str(REPO), "PATH": os.environ.get("PATH", "/usr/bin:/bin")})


def leftover_daemons(marker: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in cmdline:
                found.append(f"{proc.name}: {cmdline.strip()}")
    return found


def selected_versions(config: pytest.Config) -> list[str]:
    text = config.getoption("--slurm-version", None) or os.environ.get("RGPU_SLURM_VERSIONS") or "all"
    wanted = list(VERSIONS) if text == "all" else [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in wanted if v not in VERSIONS]
    if unknown:
        raise pytest.UsageError(f"--slurm-version: unknown {unknown} (known: {', '.join(VERSIONS)} or all)")
    return wanted


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = set(selected_versions(config))
    keep, drop = [], []
    for item in items:
        version = getattr(getattr(item, "callspec", None), "params", {}).get("slurm_install")
        (drop if version is not None and version not in wanted else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def version_param(version: str) -> object:
    return pytest.param(version, id=f"slurm{version}", marks=getattr(pytest.mark, "slurm" + version.replace(".", "")))


@pytest.fixture(scope="session", params=[version_param(v) for v in VERSIONS])
def slurm_install(request: pytest.FixtureRequest) -> SlurmInstall:
    reason = missing_requirements()
    if reason:
        pytest.skip(reason)
    try:
        install = install_for(request.param, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except RgpuError as exc:
        pytest.skip(str(exc))
    reason = missing_requirements(install)
    if reason:
        pytest.skip(reason)
    return install


@pytest.fixture(scope="session")
def rgpu_slurm(slurm_install: SlurmInstall) -> Iterator[Harness]:
    root = Path(tempfile.mkdtemp(prefix="rgpu-slurm-"))
    root.chmod(0o755)
    run_dir = root / "run-rgpu"
    started: list[SlurmCluster | RgpuCluster] = []

    def teardown() -> None:
        for thing in reversed(started):
            thing.stop() if isinstance(thing, SlurmCluster) else thing.stop_all()

    atexit.register(teardown)   # backs up the finally below if the interpreter is torn down first
    try:
        pool = RgpuCluster(root / "pool")
        started.append(pool)
        start_pool(pool, slurm_conf=root / "slurm" / "etc" / "slurm.conf", install=slurm_install)
        (root / "slurm").mkdir()
        slurm = SlurmCluster(slurm_config(pool, run_dir, slurm_install), root=root / "slurm")
        started.append(slurm)
        slurm.start()
        # rgpu-poold looks for Slurm when it starts: now that slurm.conf exists, start it again
        # (same state) so it runs its Slurm integration, as beside any configured Slurm.
        assert pool.pool is not None
        pool.pool.stop()
        pool.start_pool(env=pool.env(**slurm.client_env))
        wait_for(lambda: pool_ready(pool, 400), timeout=30, what="4 GPUs registered again")
        yield Harness(slurm, pool, run_dir)
    finally:
        teardown()
        atexit.unregister(teardown)
        left = leftover_daemons(str(root))
        shutil.rmtree(root, ignore_errors=True)
        assert not left, f"daemons left running after teardown: {left}"


@pytest.fixture
def h(rgpu_slurm: Harness) -> Iterator[Harness]:
    """The session cluster, idle before and after each test (no job, no lease, all 4 GPUs up)."""
    rgpu_slurm.slurm.cancel_all_jobs()
    wait_until("all 4 GPUs registered", lambda: pool_ready(rgpu_slurm.pool, 400) or None, 30)
    wait_until("leases of earlier tests to go", lambda: not rgpu_slurm.leases() or None, 20)
    yield rgpu_slurm
    rgpu_slurm.slurm.cancel_all_jobs()
