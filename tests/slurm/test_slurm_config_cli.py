"""`rgpu-admin slurm-config` (the click command in slurm_plugin/cli.py) against a real pool."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from rgpu.slurm_plugin.cli import slurm_config

from tests.daemons import EXAMPLES, RgpuCluster, wait_for


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[RgpuCluster]:
    c = RgpuCluster(tmp_path / "pool")
    c.write_config(down_after_seconds=3.0, heartbeat_interval_seconds=0.5, max_slices_per_job=16)
    c.start_pool()
    c.start_dispatcher(EXAMPLES / "inventory-a.toml")

    def ready() -> bool:
        with c.client() as client:
            return client.capacity().total_units == 200

    wait_for(ready, timeout=30, what="2 GPUs in the pool")
    yield c
    c.stop_all()


def test_prints_all_sections_with_live_numbers(pool: RgpuCluster) -> None:
    result = CliRunner().invoke(slurm_config, ["--prolog-dir", "/opt/rgpu/prolog"], env=pool.env())
    assert result.exit_code == 0, result.output
    out = result.output
    assert "### slurm.conf\n" in out and "### gres.conf\n" in out and "### job_submit_rgpu.conf\n" in out
    assert "Licenses=rgpu:200\n" in out and "Name=rgpu Count=2\n" in out and "max_per_node = 2\n" in out
    assert "Prolog=/opt/rgpu/prolog/rgpu-prolog\n" in out
    assert "gpu_memory_bytes = " in out and "gpu_memory_bytes = 0\n" not in out


def test_one_section(pool: RgpuCluster) -> None:
    result = CliRunner().invoke(slurm_config, ["--section", "gres.conf"], env=pool.env())
    assert result.exit_code == 0 and result.output.startswith("# rgpu: lines for gres.conf")


def test_refuses_a_prolog_dir_that_would_break_slurm_conf(pool: RgpuCluster) -> None:
    result = CliRunner().invoke(slurm_config, ["--prolog-dir", "/opt/x\nEpilog=/tmp/evil"], env=pool.env())
    assert result.exit_code == 2 and "rgpu: slurm-config: --prolog-dir" in result.output


def test_a_task_prolog_other_users_cannot_reach_is_named_in_one_line(pool: RgpuCluster, tmp_path: Path) -> None:
    """Issue 23, finding 1 on a real cluster: a TaskProlog in a 0700 folder (a venv in root's home)
    fails every job, rgpu or not; slurm-config says so before the admin pastes the lines."""
    import shutil
    import tempfile

    from tests.daemons import REPO

    assert tmp_path.parent.stat().st_mode & 0o077 == 0     # pytest's folders are 0700
    hidden = tmp_path / "venv" / "bin"
    hidden.mkdir(parents=True)
    shutil.copy(REPO / "prolog" / "rgpu-task-prolog", hidden)
    result = CliRunner().invoke(slurm_config, ["--prolog-dir", str(hidden)], env=pool.env())
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("rgpu: ")]
    assert len(lines) == 1 and "other users cannot reach the TaskProlog" in lines[0], result.stderr
    assert "TaskProlog failed status=126" in lines[0] and "/opt/rgpu" in lines[0]
    assert f"TaskProlog={hidden}/rgpu-task-prolog\n" in result.stdout     # the lines still come
    shared = Path(tempfile.mkdtemp(prefix="rgpu-prolog-"))
    try:
        shared.chmod(0o755)
        shutil.copy(REPO / "prolog" / "rgpu-task-prolog", shared)
        (shared / "rgpu-task-prolog").chmod(0o755)
        result = CliRunner().invoke(slurm_config, ["--prolog-dir", str(shared)], env=pool.env())
        assert result.exit_code == 0 and "rgpu: " not in result.stderr, result.stderr
    finally:
        shutil.rmtree(shared)


def test_unreachable_pool_is_one_line(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("x" * 32)
    secret.chmod(0o600)
    env = {"RGPU_POOL": "127.0.0.1:1", "RGPU_SECRET_FILE": str(secret), "RGPU_CONFIG": str(tmp_path / "none.toml")}
    (tmp_path / "none.toml").write_text("")
    result = CliRunner().invoke(slurm_config, [], env=env)
    assert result.exit_code == 6 and result.output.startswith("rgpu: pool: pool daemon at 127.0.0.1:1 did not answer")


def test_is_a_command_of_rgpu_admin(pool: RgpuCluster) -> None:
    from rgpu.remoting.admin.cli import main

    result = CliRunner().invoke(main, ["slurm-config", "--section", "job_submit_rgpu.conf"], env=pool.env())
    assert result.exit_code == 0, result.output
    assert "max_per_node = 2\n" in result.output
