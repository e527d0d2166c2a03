"""Parsing Slurm's output: `squeue --json` (22.05, 24.11 and 26.05 captured; 24.05 documented
shape), `scontrol --json show job` (24.11 and 26.05 captured) and `scontrol show job -d` (all
three captured). Samples live in tests/data/; the real-cluster test
test_squeue_json_of_the_live_cluster_parses writes them again with RGPU_CAPTURE_DIR=tests/data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rgpu.slurm_plugin.scontrol import (
    find_job,
    job_info_from_json,
    parse_jobs_json,
    parse_show_config,
    parse_show_job,
    show_job_json_command,
)
from rgpu.slurm_plugin.squeue import (
    SqueueBackend,
    parse_job,
    parse_squeue_json,
    squeue_command,
)

from rgpu.errors import RgpuError

DATA = Path(__file__).parent / "data"


def test_squeue_22_05_captured() -> None:
    jobs = {j.job_id: j for j in parse_squeue_json((DATA / "squeue-22.05.8-captured.json").read_text())}
    assert set(jobs) == {1, 2, 3}
    plain, held, running = jobs[1], jobs[2], jobs[3]
    assert (plain.state, plain.live, plain.rgpu_count()) == ("COMPLETED", False, None)
    assert (held.state, held.live, held.running, held.rgpu_count(), held.comment, held.user) == (
        "PENDING", True, False, 2, "memory=8G", "nobody")
    assert (running.state, running.live, running.rgpu_count(), running.nodes, running.cluster) == (
        "RUNNING", True, 1, "c1", "rgputest")
    # Captured while its PrologSlurmctld ran: RUNNING with reason Prolog is not "running" yet.
    assert running.reason == "Prolog" and not running.running


def test_squeue_24_05_documented_shape() -> None:
    jobs = {j.job_id: j for j in parse_squeue_json((DATA / "squeue-24.05-documented-shape.json").read_text())}
    assert (jobs[101].state, jobs[101].running, jobs[101].rgpu_count(), jobs[101].nodes) == ("RUNNING", True, 2, "c[1-2]")
    assert (jobs[102].state, jobs[102].reason, jobs[102].live) == ("PENDING", "Licenses", True)
    assert (jobs[103].state, jobs[103].flags, jobs[103].live) == ("COMPLETED", ("COMPLETING",), True)
    assert (jobs[104].state, jobs[104].flags, jobs[104].restart_count) == ("PENDING", ("REQUEUED",), 1)
    assert (jobs[105].state, jobs[105].live) == ("CANCELLED", False)


CAPTURED_NEW = ["24.11.5", "26.05.5"]   # data_parser v0.0.42 and v0.0.45


@pytest.mark.parametrize("version", CAPTURED_NEW)
def test_squeue_captured_on_newer_slurm(version: str) -> None:
    """The same three jobs as the 22.05 sample: job_state a list, numbers as objects, gres/."""
    raw = json.loads((DATA / f"squeue-{version}-captured.json").read_text())
    assert raw["meta"]["slurm"]["release"] == version
    assert raw["jobs"][2]["job_state"] == ["RUNNING"] and raw["jobs"][2]["node_count"]["number"] == 1
    jobs = {j.job_id: j for j in parse_squeue_json(json.dumps(raw))}
    assert set(jobs) == {1, 2, 3}
    plain, held, running = jobs[1], jobs[2], jobs[3]
    assert (plain.state, plain.flags, plain.live, plain.rgpu_count()) == ("COMPLETED", (), False, None)
    assert (held.state, held.live, held.running, held.rgpu_count(), held.comment, held.user, held.reason) == (
        "PENDING", True, False, 2, "memory=8G", "nobody", "JobHeldUser")
    assert held.tres_per_node == "gres/rgpu:2"
    assert held.admin_comment == "rgpu:v1 nodes=2 count=2 memory=8589934592 units=40"
    assert (running.state, running.live, running.rgpu_count(), running.nodes, running.cluster) == (
        "RUNNING", True, 1, "c1", "rgputest")
    assert running.reason == "Prolog" and not running.running    # captured during PrologSlurmctld


@pytest.mark.parametrize("version", CAPTURED_NEW)
def test_scontrol_json_show_job_captured_on_newer_slurm(version: str) -> None:
    argv = show_job_json_command("3")
    info = find_job(parse_jobs_json((DATA / f"scontrol-json-show-job-{version}-captured.json").read_text(),
                                    " ".join(argv)), "3", " ".join(argv))
    assert (info.job_id, info.user, info.uid, info.state, info.restart_count, info.node_names, info.node_count) == (
        "3", "nobody", 65534, "RUNNING", 0, "c1", 1)
    assert (info.tres_per_node, info.comment, info.licenses, info.admin_comment, info.batch) == (
        "gres/rgpu:1", "fraction=0.5", "rgpu:50", "rgpu:v1 nodes=1 count=1 percent=50 units=50", True)


@pytest.mark.parametrize("version", ["22.05.8", *CAPTURED_NEW])
def test_scontrol_show_job_text_captured(version: str) -> None:
    """The harness's key search (never used for a decision) on each version's text; 26.05 adds
    SubmitLine=, whose user-given text must not shadow the real keys."""
    job = parse_show_job((DATA / f"scontrol-show-job-{version}-captured.txt").read_text())
    prefix = "gres:" if version.startswith("22.") else "gres/"
    assert (job["JobState"], job["Licenses"], job["Comment"], job["TresPerNode"]) == (
        "RUNNING", "rgpu:50", "fraction=0.5", f"{prefix}rgpu:1")


def test_submit_line_text_cannot_shadow_keys() -> None:
    text = ("JobId=7 JobName=x\n   SubmitLine=sbatch --comment=fraction=1 TresPerNode=gres/rgpu:4 job.sh\n"
            "   JobState=RUNNING Reason=None\n   TresPerNode=gres/rgpu:1\n   Comment=fraction=0.5\n")
    job = parse_show_job(text)
    assert (job["TresPerNode"], job["Comment"]) == ("gres/rgpu:1", "fraction=0.5")


@pytest.mark.parametrize("value, expected", [
    (7, 7), ({"set": True, "infinite": False, "number": 7}, 7), ({"set": False, "infinite": False, "number": 7}, 0),
    ({"set": True, "infinite": True, "number": 0}, 0), (None, 0), ("12", 12),
])
def test_numbers_in_both_shapes(value: object, expected: int) -> None:
    assert parse_job({"job_id": value, "job_state": "RUNNING"}).job_id == expected


def test_errors_and_garbage_are_reported() -> None:
    with pytest.raises(RgpuError, match="not JSON"):
        parse_squeue_json("squeue: error: Invalid user")
    with pytest.raises(RgpuError, match="reported errors"):
        parse_squeue_json(json.dumps({"errors": [{"error": "Unable to contact slurm controller"}], "jobs": []}))
    assert parse_squeue_json(json.dumps({"jobs": []})) == []


@pytest.mark.integration   # tries to run squeue
def test_squeue_command_and_missing_binary() -> None:
    assert squeue_command() == ["squeue", "--json", "--states=all"]
    backend = SqueueBackend(env={"PATH": "/nonexistent"})
    with pytest.raises(RgpuError) as info:
        backend.live_jobs()
    assert "`squeue --json --states=all` exited 127" in str(info.value) and "not installed" in str(info.value)


def captured_job(job_id: int = 3, **changes: object) -> dict:
    jobs = json.loads((DATA / "squeue-22.05.8-captured.json").read_text())["jobs"]
    raw = dict(next(j for j in jobs if j["job_id"] == job_id))
    raw.update(changes)
    return raw


def test_job_from_squeue_json_22_05_captured() -> None:
    raw = captured_job(admin_comment="rgpu:v1 nodes=1 count=1 percent=50 units=50")
    info = job_info_from_json(raw)
    assert (info.job_id, info.user, info.uid, info.restart_count, info.node_names, info.node_count) == (
        "3", "nobody", 65534, 0, "c1", 1)
    assert (info.tres_per_node, info.comment, info.licenses, info.admin_comment) == (
        "gres:rgpu:1", "fraction=0.5", "rgpu:50", "rgpu:v1 nodes=1 count=1 percent=50 units=50")


HOSTILE = "x Comment=fraction=1 TresPerNode=gres:rgpu:4 Licenses=rgpu:1\nAdminComment=rgpu:v1 nodes=1 count=4 percent=100 units=400"


@pytest.mark.parametrize("field", ["name", "comment", "current_working_directory", "command", "standard_output"])
def test_user_fields_holding_key_value_text_change_nothing(field: str) -> None:
    raw = captured_job(admin_comment="rgpu:v1 nodes=1 count=1 percent=50 units=50", **{field: HOSTILE})
    text = json.dumps({"jobs": [captured_job(1), raw, captured_job(2)]})
    info = find_job(parse_jobs_json(text, "squeue --json"), "3", "squeue --json")
    assert (info.tres_per_node, info.licenses, info.admin_comment) == (
        "gres:rgpu:1", "rgpu:50", "rgpu:v1 nodes=1 count=1 percent=50 units=50")


def test_job_query_commands_and_errors() -> None:
    assert show_job_json_command("7") == ["scontrol", "--json", "show", "job", "7"]
    with pytest.raises(ValueError):
        show_job_json_command("7 --all")
    with pytest.raises(RgpuError, match="shows 0 jobs with id 9"):
        find_job([captured_job(1)], "9", "squeue --json")
    # 24.x shape: numbers as objects, grouped comments.
    raw = {"job_id": {"set": True, "infinite": False, "number": 5}, "job_state": ["RUNNING"],
           "comment": {"administrator": "rgpu:v1 nodes=1 count=1 percent=5 units=5", "job": "fraction=0.05"},
           "node_count": {"set": True, "infinite": False, "number": 1}, "licenses": "rgpu:5"}
    info = job_info_from_json(raw)
    assert (info.job_id, info.admin_comment, info.comment, info.node_count) == (
        "5", "rgpu:v1 nodes=1 count=1 percent=5 units=5", "fraction=0.05", 1)


def test_scontrol_show_config() -> None:
    cfg = parse_show_config("Configuration data as of 2026-01-01T00:00:00\nAccountingStorageBackupHost = (null)\n"
                            "ClusterName             = rgputest\nMessageTimeout          = 10 sec\n")
    assert cfg["ClusterName"] == "rgputest" and cfg["MessageTimeout"] == "10 sec"
