"""slurm_plugin/job_submit.lua run by the standalone lua5.1 interpreter (the Lua Slurm 22.05 links).

Each test writes a small driver that defines the `slurm` table the plugin gets from slurmctld
(constants plus log functions that record what they are given), loads the real script with
dofile and calls its Slurm entry points with job_desc / job_rec tables, then prints one JSON line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "slurm_plugin" / "job_submit.lua"
CASES = json.loads((REPO / "tests" / "data" / "request_cases.json").read_text())
NO_VAL = 4294967294
LUA = shutil.which("lua5.1")

pytestmark = [pytest.mark.integration,   # each case runs the lua5.1 interpreter
              pytest.mark.skipif(LUA is None, reason="lua5.1 is not installed (Debian package lua5.1)")]

CONF = f"""# test config
max_per_node = 8
max_per_job = 10
gpu_memory_bytes = {CASES['gpu_memory_bytes']}
"""

DRIVER = r"""
local messages = {}
local function record(level)
  return function(fmt, ...) messages[#messages + 1] = level .. ": " .. string.format(fmt, ...) end
end
slurm = { SUCCESS = 0, ERROR = -1, NO_VAL = 4294967294, NO_VAL16 = 65534,
          ESLURM_INVALID_LICENSES = 2029, ESLURM_INVALID_NODE_COUNT = 2006, ESLURM_ACCESS_DENIED = 2002,
          log_user = record("user"), log_info = record("info"), log_error = record("error"),
          log_debug = record("debug") }
local function json(v)
  if v == nil then return "null" end
  if type(v) == "number" or type(v) == "boolean" then return tostring(v) end
  return '"' .. string.gsub(v, '[%c"\\\128-\255]', function(c) return string.format("\\u%04x", string.byte(c)) end) .. '"'
end
dofile(SCRIPT_PATH)
local rc
if MODE == "submit" then
  rc = slurm_job_submit(JOB, {}, UID)
else
  rc = slurm_job_modify(JOB, REC, {}, UID)
end
local parts = {}
for _, m in ipairs(messages) do parts[#parts + 1] = json(m) end
print('{"rc": ' .. json(rc) .. ', "licenses": ' .. json(JOB.licenses) .. ', "min_nodes": ' .. json(JOB.min_nodes)
      .. ', "max_nodes": ' .. json(JOB.max_nodes) .. ', "admin_comment": ' .. json(JOB.admin_comment)
      .. ', "comment": ' .. json(JOB.comment) .. ', "priority": ' .. json(JOB.priority)
      .. ', "messages": [' .. table.concat(parts, ", ") .. ']}')
"""


def lua_value(value: Any) -> str:
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        # Every byte outside [A-Za-z0-9 ] as a decimal escape: hostile text stays data.
        return '"' + "".join(c if c.isalnum() and c.isascii() or c == " " else "".join(f"\\{b:03d}" for b in c.encode())
                             for c in value) + '"'
    if isinstance(value, dict):
        return "{" + ", ".join(f"[{lua_value(k)}] = {lua_value(v)}" for k, v in value.items() if v is not None) + "}"
    raise TypeError(value)


@pytest.fixture
def plugin_dir(tmp_path: Path) -> Path:
    shutil.copyfile(SCRIPT, tmp_path / "job_submit.lua")
    (tmp_path / "job_submit_rgpu.conf").write_text(CONF)
    return tmp_path


def call(plugin_dir: Path, job: dict[str, Any], rec: dict[str, Any] | None = None, uid: int | None = None) -> dict[str, Any]:
    """Submit (rec None) as uid 1000, or modify as root (uid 0, an admin); `uid` to choose."""
    uid = (1000 if rec is None else 0) if uid is None else uid
    driver = (f"SCRIPT_PATH = {lua_value(str(plugin_dir / 'job_submit.lua'))}\nUID = {uid}\n"
              f"MODE = {lua_value('submit' if rec is None else 'modify')}\n"
              f"JOB = {lua_value(job)}\nREC = {lua_value(rec or {})}\n" + DRIVER)
    path = plugin_dir / "driver.lua"
    path.write_text(driver)
    proc = subprocess.run([LUA, str(path)], capture_output=True, text=True, timeout=10)
    assert proc.returncode == 0, f"lua5.1 failed ({proc.returncode}): {proc.stderr}"
    return json.loads(proc.stdout)


def job_desc(tres: str | None, comment: str | None, nodes: list[int] | None = None, **extra: Any) -> dict[str, Any]:
    lo, hi = nodes or (NO_VAL, NO_VAL)
    return {"tres_per_node": tres, "comment": comment, "min_nodes": lo, "max_nodes": hi, **extra}


def user_messages(result: dict[str, Any]) -> list[str]:
    return [m[len("user: "):] for m in result["messages"] if m.startswith("user: ")]


@pytest.mark.parametrize("case", [c for c in CASES["cases"] if "error" not in c],
                         ids=lambda c: f"{c['tres']}|{c['comment']}|{c['nodes']}")
def test_accepted_requests_get_the_license(plugin_dir: Path, case: dict[str, Any]) -> None:
    result = call(plugin_dir, job_desc(case["tres"], case["comment"], case["nodes"]))
    assert result["rc"] == 0, result
    if case["units"] is None:
        assert result["licenses"] is None
        assert result["min_nodes"] == (case["nodes"] or [NO_VAL])[0]
    else:
        assert result["licenses"] == f"rgpu:{case['units']}"
        assert result["min_nodes"] == result["max_nodes"] == case["job_nodes"]
    assert result["admin_comment"] == case["record"]   # the same text request.py writes and reads
    assert user_messages(result) == []


@pytest.mark.parametrize("case", [c for c in CASES["cases"] if "error" not in c],
                         ids=lambda c: f"{c['tres']}|{c['comment']}|{c['nodes']}")
def test_every_rgpu_job_keeps_a_size_word_in_its_comment(plugin_dir: Path, case: dict[str, Any]) -> None:
    """The node Prolog asks the pool only for jobs whose comment has one (jobenv.py)."""
    from rgpu.slurm_plugin.jobenv import comment_may_ask_rgpu

    result = call(plugin_dir, job_desc(case["tres"], case["comment"], case["nodes"]))
    if case["units"] is None:
        assert result["comment"] == case["comment"]            # other jobs' comments are theirs
        return
    assert comment_may_ask_rgpu(result["comment"]), result
    if comment_may_ask_rgpu(case["comment"]):
        assert result["comment"] == case["comment"]            # a size word given: left alone
    else:
        assert result["comment"].endswith("fraction=1") and (case["comment"] or "").strip() in result["comment"]


def test_an_update_cannot_take_the_size_word_out_of_an_rgpu_job_comment(plugin_dir: Path) -> None:
    for state in (PENDING, RUNNING):
        rec = job_rec("gres:rgpu:2", "fraction=1 run1", "rgpu:200", state)
        rec["admin_comment"] = "rgpu:v1 nodes=1 count=2 percent=100 units=200"
        result = call(plugin_dir, update(comment="run2"), rec, uid=1000)
        assert (result["rc"], result["comment"]) == (0, "run2 fraction=1"), result
    plain = call(plugin_dir, update(comment="run2"), job_rec("", "run1", None), uid=1000)
    assert (plain["rc"], plain["comment"]) == (0, "run2")


def test_with_hold_until_placed_an_rgpu_job_is_submitted_held_and_marked(plugin_dir: Path) -> None:
    """rgpu-poold releases it once the pool can place it (slurm_plugin/waiting.py); a job given its
    own hold or priority keeps it, unmarked; other jobs are never held."""
    from rgpu.slurm_plugin.request import parse_record
    from rgpu.slurm_plugin.waiting import waiting_record

    (plugin_dir / "job_submit_rgpu.conf").write_text(CONF + "hold_until_placed = 1\n")
    result = call(plugin_dir, job_desc("gres:rgpu:2", "fraction=0.5", priority=NO_VAL))
    assert result["rc"] == 0 and result["priority"] == 0, result
    record = "rgpu:v1 nodes=1 count=2 percent=50 units=100"
    assert result["admin_comment"].startswith(record + " | rgpu: waiting: held until the pool can place")
    assert waiting_record(result["admin_comment"]) == parse_record(record)
    for given in (0, 5000):                                  # sbatch --hold; an admin's --priority
        own = call(plugin_dir, job_desc("gres:rgpu:2", "fraction=0.5", priority=given))
        assert (own["priority"], own["admin_comment"]) == (given, record), own
    plain = call(plugin_dir, job_desc(None, None, priority=NO_VAL))
    assert (plain["priority"], plain["admin_comment"]) == (NO_VAL, None)
    (plugin_dir / "job_submit_rgpu.conf").write_text(CONF)  # the default: jobs start on the license alone
    assert call(plugin_dir, job_desc("gres:rgpu:2", "fraction=0.5", priority=NO_VAL))["priority"] == NO_VAL


def test_root_changing_a_held_job_keeps_rgpus_mark(plugin_dir: Path) -> None:
    rec = job_rec("gres:rgpu:2", "fraction=0.5", "rgpu:100")
    rec["admin_comment"] = "rgpu:v1 nodes=1 count=2 percent=50 units=100 | rgpu: waiting: held until the pool can place"
    result = call(plugin_dir, update(comment="fraction=0.25"), rec, uid=0)
    assert result["admin_comment"] == "rgpu:v1 nodes=1 count=2 percent=25 units=50 | rgpu: waiting: held until the pool can place"
    # A user's update that leaves the request as it is passes, mark or not.
    same = call(plugin_dir, update(comment="note fraction=0.5"), rec, uid=1000)
    assert same["rc"] == 0 and same["admin_comment"] is None


WAITING = ("rgpu:v1 nodes=1 count=2 percent=50 units=100 | rgpu: waiting: held until the pool can place its slices "
           "(rgpu-poold releases the job then)")
INFINITE = 4294967295   # what `scontrol release` asks for (the priority field of the update)


def held_rec(admin_comment: str = WAITING, priority: int = 0) -> dict[str, Any]:
    return {**job_rec("gres:rgpu:2", "fraction=0.5", "rgpu:100"), "admin_comment": admin_comment, "priority": priority}


@pytest.mark.parametrize("priority", [INFINITE, 100])
def test_a_user_cannot_release_a_job_rgpu_holds_for_the_pool(plugin_dir: Path, priority: int) -> None:
    """`scontrol release` (and `update priority=`) of a marked held job by its user would start it
    before the pool's placement check: one line says who releases it and where to see why it waits."""
    refused = call(plugin_dir, update(priority=priority), held_rec(), uid=1000)
    assert refused["rc"] == REFUSAL_CODES["access"], refused
    (line,) = user_messages(refused)
    assert line.startswith("rgpu: job_submit: job 42 is held until the pool can place its slices, "
                           "and only rgpu-poold releases it ("), line
    assert "`scontrol show job 42` (AdminComment)" in line and "rgpu-admin list-gpus" in line and "\n" not in line
    quota = held_rec("rgpu:v1 nodes=1 count=2 percent=50 units=100 | rgpu: waiting for quota: over")
    assert call(plugin_dir, update(priority=priority), quota, uid=1000)["rc"] == REFUSAL_CODES["access"]


def test_the_pool_releases_and_users_hold_or_release_their_own_holds(plugin_dir: Path) -> None:
    # rgpu-poold runs scontrol as root (or SlurmUser: the uid slurmctld, and so this script, runs as).
    assert call(plugin_dir, update(priority=INFINITE), held_rec(), uid=0)["rc"] == 0
    for rec in (held_rec("rgpu:v1 nodes=1 count=2 percent=50 units=100"),   # sbatch --hold: no mark
                held_rec(priority=1000)):                                  # released, mark not yet gone
        assert call(plugin_dir, update(priority=INFINITE), rec, uid=1000)["rc"] == 0, rec
    assert call(plugin_dir, update(priority=0), held_rec(), uid=1000)["rc"] == 0        # scontrol hold
    assert call(plugin_dir, update(comment="fraction=0.5 x"), held_rec(), uid=1000)["rc"] == 0
    # A pool run as a Slurm operator (neither root nor SlurmUser) is named in the config.
    (plugin_dir / "job_submit_rgpu.conf").write_text(CONF + "release_uid = 1000\n")
    assert call(plugin_dir, update(priority=INFINITE), held_rec(), uid=1000)["rc"] == 0
    assert call(plugin_dir, update(priority=INFINITE), held_rec(), uid=1001)["rc"] == REFUSAL_CODES["access"]


def test_slurmuser_is_the_uid_the_script_runs_as(plugin_dir: Path) -> None:
    driver = plugin_dir / "uid.lua"
    driver.write_text(f"dofile({lua_value(str(plugin_dir / 'job_submit.lua'))})\nprint(rgpu_job_submit.own_uid())\n")
    proc = subprocess.run([LUA, str(driver)], capture_output=True, text=True, timeout=10)
    assert proc.stdout.strip() == str(os.getuid()), proc


def test_a_forged_record_in_the_admin_comment_is_refused(plugin_dir: Path) -> None:
    forged = "rgpu:v1 nodes=1 count=4 percent=100 units=400"
    refused = call(plugin_dir, job_desc(None, None, admin_comment=forged))
    assert refused["rc"] == REFUSAL_CODES["access"] and "admin comment holds an rgpu request record" in user_messages(refused)[0]
    # An rgpu job's record is always the plugin's own, whatever came in.
    result = call(plugin_dir, job_desc("gres:rgpu:1", "fraction=0.1", admin_comment=forged))
    assert result["admin_comment"] == "rgpu:v1 nodes=1 count=1 percent=10 units=10"


@pytest.mark.parametrize("case", [c for c in CASES["cases"] if "error" in c],
                         ids=lambda c: f"{c['tres']}|{c['comment']!r}|{c['nodes']}")
def test_bad_requests_are_refused_with_a_message(plugin_dir: Path, case: dict[str, Any]) -> None:
    result = call(plugin_dir, job_desc(case["tres"], case["comment"], case["nodes"]))
    assert result["rc"] in REFUSAL_CODES.values(), result
    (message,) = user_messages(result)
    assert message.startswith("rgpu: job_submit: ")
    assert case["error"] in message
    assert "\n" not in message and "$(" not in message.replace("$(here)", "")
    assert result["licenses"] is None


# The codes the driver's `slurm` table gives (the real ones come from Slurm's Lua API); sbatch prints
# each one's text after rgpu's line, so it must not contradict it.
REFUSAL_CODES = {"gres": 2072, "comment": -1, "license": 2029, "nodes": 2006, "access": 2002}


@pytest.mark.parametrize("job, kind", [
    (job_desc("gres:rgpu:0", None), "gres"),
    (job_desc("gres:rgpu:1", None, tres_per_task="gres:rgpu:1"), "gres"),
    (job_desc("gres:rgpu:1", "fraction=2"), "comment"),
    (job_desc("gres:rgpu:1", "fraction=0.5;$(id)"), "comment"),
    (job_desc("gres:rgpu:1", "memory=99999G"), "comment"),
    (job_desc("gres:rgpu:1", None, licenses="rgpu:10"), "license"),
    (job_desc(None, None, licenses="matlab:1,rgpu:10"), "license"),
    (job_desc("gres:rgpu:1", None, [1, 3]), "nodes"),
    (job_desc("gres:rgpu:4", None, [3, 3]), "nodes"),
    (job_desc(None, None, admin_comment="rgpu:v1 nodes=1 count=4 percent=100 units=400"), "access"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_each_refusal_carries_the_slurm_code_that_fits(plugin_dir: Path, job: dict[str, Any], kind: str) -> None:
    """Not ESLURM_INVALID_GRES ("Invalid generic resource (gres) specification") for everything."""
    result = call(plugin_dir, job)
    assert result["rc"] == REFUSAL_CODES[kind], result
    assert len(user_messages(result)) == 1


@pytest.mark.parametrize("offset", [0, 1])
def test_a_heterogeneous_job_asking_for_rgpu_is_refused(plugin_dir: Path, offset: int) -> None:
    result = call(plugin_dir, job_desc("gres:rgpu:1", "fraction=0.5", het_job_offset=offset))
    (message,) = user_messages(result)
    assert result["rc"] == REFUSAL_CODES["gres"] and "a heterogeneous job cannot ask for rgpu" in message, result
    assert call(plugin_dir, job_desc(None, None, het_job_offset=offset))["rc"] == 0     # without rgpu: untouched
    assert call(plugin_dir, job_desc("gres:rgpu:1", None, het_job_offset=NO_VAL))["rc"] == 0   # not a hetjob


def test_other_licenses_are_kept(plugin_dir: Path) -> None:
    result = call(plugin_dir, job_desc("gres:rgpu:2", "fraction=0.5", licenses="matlab:1,fluent*2"))
    assert result["licenses"] == "matlab:1,fluent*2,rgpu:100"


def test_asking_the_rgpu_license_directly_is_refused(plugin_dir: Path) -> None:
    for tres in ("gres:rgpu:1", None):
        result = call(plugin_dir, job_desc(tres, None, licenses="rgpu:400"))
        assert result["rc"] == REFUSAL_CODES["license"]
        assert "do not ask for the rgpu license yourself" in user_messages(result)[0]


@pytest.mark.parametrize("field", ["tres_per_task", "tres_per_job", "tres_per_socket"])
def test_rgpu_per_task_or_job_is_refused(plugin_dir: Path, field: str) -> None:
    result = call(plugin_dir, job_desc(None, None, **{field: "gres:rgpu:1"}))
    assert result["rc"] == 2072
    assert "rgpu slices are given per node" in user_messages(result)[0]


def test_missing_config_uses_defaults(plugin_dir: Path) -> None:
    (plugin_dir / "job_submit_rgpu.conf").unlink()
    assert call(plugin_dir, job_desc("gres:rgpu:16", None))["licenses"] == "rgpu:1600"
    assert call(plugin_dir, job_desc("gres:rgpu:17", None))["rc"] == 2072
    # Without gpu_memory_bytes a memory slice counts as a whole GPU.
    assert call(plugin_dir, job_desc("gres:rgpu:2", "memory=8G"))["licenses"] == "rgpu:200"


@pytest.mark.parametrize("text, error", [
    ("max_per_node = lots\n", "max_per_node = 'lots'"),
    ("colour = blue\n", "unknown key colour"),
    ("this is not a line\n", "bad line 1"),
    ("max_per_node = 0\n", "must be at least 1"),
])
def test_broken_config_refuses_rgpu_jobs_only(plugin_dir: Path, text: str, error: str) -> None:
    (plugin_dir / "job_submit_rgpu.conf").write_text(text)
    refused = call(plugin_dir, job_desc("gres:rgpu:1", None))
    assert refused["rc"] == -1
    assert error in user_messages(refused)[0] and "job_submit_rgpu.conf" in user_messages(refused)[0]
    assert call(plugin_dir, job_desc(None, "any comment"))["rc"] == 0


def test_config_values_are_used(plugin_dir: Path) -> None:
    (plugin_dir / "job_submit_rgpu.conf").write_text(
        'gres_name = "vgpu"\nlicense_name = pool\nmax_per_node = 2  # small\n')
    assert call(plugin_dir, job_desc("gres:vgpu:2", None))["licenses"] == "pool:200"
    assert call(plugin_dir, job_desc("gres:vgpu:3", None))["rc"] == 2072
    assert call(plugin_dir, job_desc("gres:rgpu:3", None))["licenses"] is None


# ---------------------------------------------------------------- scontrol update

PENDING, RUNNING = 0, 1
REQUEUED_PENDING = 0 + 0x04000000  # JOB_PENDING with the JOB_REQUEUE flag


def job_rec(tres: str, comment: str | None, licenses: str | None, state: int = PENDING, nodes: int = 1) -> dict[str, Any]:
    return {"tres_per_node": tres, "comment": comment, "licenses": licenses, "min_nodes": nodes,
            "max_nodes": nodes, "job_state": state, "job_id": 42}


def update(**fields: Any) -> dict[str, Any]:
    base = {"min_nodes": NO_VAL, "max_nodes": NO_VAL}
    base.update(fields)
    return base


@pytest.mark.parametrize("state", [PENDING, REQUEUED_PENDING])
def test_update_of_a_pending_job_recomputes_the_license(plugin_dir: Path, state: int) -> None:
    rec = job_rec("gres:rgpu:2", "fraction=0.5", "rgpu:100", state)
    assert call(plugin_dir, update(comment="fraction=0.25"), rec)["licenses"] == "rgpu:50"
    assert call(plugin_dir, update(tres_per_node="gres:rgpu:4"), rec)["licenses"] == "rgpu:200"
    result = call(plugin_dir, update(min_nodes=2), rec)
    assert (result["licenses"], result["min_nodes"], result["max_nodes"]) == ("rgpu:200", 2, 2)
    assert call(plugin_dir, update(licenses="matlab:1"), rec)["licenses"] == "matlab:1,rgpu:100"


def test_update_by_root_rewrites_the_record(plugin_dir: Path) -> None:
    rec = job_rec("gres:rgpu:2", "fraction=0.5", "rgpu:100")
    rec["admin_comment"] = "rgpu:v1 nodes=1 count=2 percent=50 units=100"
    result = call(plugin_dir, update(comment="fraction=0.25"), rec, uid=0)
    assert result["admin_comment"] == "rgpu:v1 nodes=1 count=2 percent=25 units=50"


@pytest.mark.parametrize("fields", [{"comment": "fraction=0.25"}, {"comment": " fraction=1"},
                                    {"tres_per_node": "gres:rgpu:4"}, {"min_nodes": 2}])
def test_users_cannot_change_the_request_of_a_pending_job(plugin_dir: Path, fields: dict[str, Any]) -> None:
    rec = job_rec("gres:rgpu:2", "fraction=0.5", "rgpu:100")
    rec["admin_comment"] = "rgpu:v1 nodes=1 count=2 percent=50 units=100"
    result = call(plugin_dir, update(**fields), rec, uid=1000)
    assert result["rc"] == REFUSAL_CODES["access"] and "only an admin can change the rgpu request" in user_messages(result)[0]
    assert result["admin_comment"] is None and result["licenses"] is None


def test_users_may_change_what_does_not_change_the_request(plugin_dir: Path) -> None:
    rec = job_rec("gres:rgpu:2", "fraction=0.5", "rgpu:100")
    rec["admin_comment"] = "rgpu:v1 nodes=1 count=2 percent=50 units=100"
    result = call(plugin_dir, update(comment="note, FRACTION=0.5"), rec, uid=1000)
    assert result["rc"] == 0 and result["admin_comment"] is None
    result = call(plugin_dir, update(licenses="matlab:1"), rec, uid=1000)
    assert result["rc"] == 0 and result["licenses"] == "matlab:1,rgpu:100" and result["admin_comment"] is None


def test_update_that_does_not_touch_rgpu_changes_nothing(plugin_dir: Path) -> None:
    rec = job_rec("gres:rgpu:2", "fraction=0.5", "rgpu:100")
    result = call(plugin_dir, update(), rec)
    assert result["rc"] == 0 and result["licenses"] is None


def test_update_to_rgpu_of_a_plain_pending_job_adds_the_license(plugin_dir: Path) -> None:
    rec = job_rec("", None, None)
    assert call(plugin_dir, update(tres_per_node="gres:rgpu:1"), rec)["licenses"] == "rgpu:100"


@pytest.mark.parametrize("fields, error", [
    ({"comment": "fraction=2"}, "invalid fraction '2'"),
    ({"comment": "fraction=0.5;$(id)"}, "characters rgpu does not accept"),
    ({"tres_per_node": "gres:rgpu:0"}, "count of slices per node"),
    ({"tres_per_node": ""}, "removing rgpu from a job is not supported"),
    ({"min_nodes": 1, "max_nodes": 3}, "variable node count"),
    ({"licenses": "rgpu:10"}, "do not ask for the rgpu license yourself"),
])
def test_bad_updates_of_a_pending_job_are_refused(plugin_dir: Path, fields: dict[str, Any], error: str) -> None:
    result = call(plugin_dir, update(**fields), job_rec("gres:rgpu:2", "fraction=0.5", "rgpu:100"))
    assert result["rc"] in REFUSAL_CODES.values() and result["rc"] != 0
    assert error in user_messages(result)[0]
    assert any(error in m for m in result["messages"] if m.startswith("info: "))  # the log has it too


def test_running_job_cannot_change_its_rgpu_request(plugin_dir: Path) -> None:
    rec = job_rec("gres:rgpu:2", "fraction=0.5 run1", "rgpu:100", RUNNING)
    for fields in ({"comment": "fraction=0.25"}, {"tres_per_node": "gres:rgpu:2"}):
        result = call(plugin_dir, update(**fields), rec)
        assert result["rc"] == REFUSAL_CODES["access"]
        assert "not pending cannot change" in user_messages(result)[0]
    # A comment change that keeps the same slices is fine (admins annotate running jobs).
    assert call(plugin_dir, update(comment="fraction=0.5 run1 checked"), rec)["rc"] == 0


def test_config_rendered_by_slurm_config_is_accepted(plugin_dir: Path) -> None:
    from types import SimpleNamespace

    from rgpu.slurm_plugin.licenses import config_values, render_slurm_config

    gpus = [SimpleNamespace(server=f"s{i // 2}:1", gpu=SimpleNamespace(usable_memory_bytes=80 << 30)) for i in range(4)]
    text = render_slurm_config(config_values(gpus, 400, 16, "/usr/libexec/rgpu"), ("job_submit_rgpu.conf",))
    (plugin_dir / "job_submit_rgpu.conf").write_text(text)
    assert call(plugin_dir, job_desc("gres:rgpu:4", "memory=40G"))["licenses"] == "rgpu:200"
    refused = call(plugin_dir, job_desc("gres:rgpu:5", None))
    assert refused["rc"] == 2072 and "from 1 to 4" in user_messages(refused)[0]
    # The GPUs share by MPS (the default): isolation=strict can never be served.
    refused = call(plugin_dir, job_desc("gres:rgpu:1", "isolation=strict"))
    assert "no GPU of the pool can ever serve" in user_messages(refused)[0]


# ---------------------------------------------------------------- what the pool can ever serve

POOL_CONF = CONF + "pool_gpus = 4\nisolated_gpus = {isolated}\nexclusive_gpus = {exclusive}\n"


@pytest.mark.parametrize("isolated, exclusive, tres, comment, error", [
    (0, 0, "gres:rgpu:1", "fraction=0.5 isolation=strict", "with isolation=strict (the pool has 0 GPU(s) shared isolated"),
    (0, 2, "gres:rgpu:1", "isolation=strict fraction=0.5", "leave isolation=strict out"),
    (1, 0, "gres:rgpu:2", "isolation=strict", "ask for at most 1 slice(s) per node"),
    (0, 4, "gres:rgpu:1", "fraction=0.5", "ask for whole GPUs"),
    (0, 3, "gres:rgpu:2", "fraction=0.5", "the pool has 1 GPU(s) that take fractional slices"),
])
def test_requests_no_gpu_of_the_pool_can_ever_serve_are_refused(plugin_dir: Path, isolated: int, exclusive: int,
                                                                 tres: str, comment: str, error: str) -> None:
    (plugin_dir / "job_submit_rgpu.conf").write_text(POOL_CONF.format(isolated=isolated, exclusive=exclusive))
    result = call(plugin_dir, job_desc(tres, comment))
    (message,) = user_messages(result)
    assert result["rc"] != 0 and message.startswith("rgpu: job_submit: no GPU of the pool can ever serve "), message
    assert error in message, message
    assert result["licenses"] is None


@pytest.mark.parametrize("isolated, exclusive, tres, comment", [
    (1, 0, "gres:rgpu:1", "fraction=0.5 isolation=strict"),
    (0, 1, "gres:rgpu:1", "isolation=strict"),            # a whole GPU may be an exclusive one
    (1, 1, "gres:rgpu:2", "isolation=strict"),
    (0, 3, "gres:rgpu:1", "fraction=0.5"),
    (0, 0, "gres:rgpu:4", "fraction=0.5"),
])
def test_requests_the_pool_can_serve_pass_the_capability_check(plugin_dir: Path, isolated: int, exclusive: int,
                                                               tres: str, comment: str) -> None:
    (plugin_dir / "job_submit_rgpu.conf").write_text(POOL_CONF.format(isolated=isolated, exclusive=exclusive))
    result = call(plugin_dir, job_desc(tres, comment))
    assert result["rc"] == 0 and user_messages(result) == [], result


def test_an_unknown_pool_turns_the_capability_check_off(plugin_dir: Path) -> None:
    assert call(plugin_dir, job_desc("gres:rgpu:1", "isolation=strict"))["rc"] == 0   # CONF has no pool_gpus


SIZES = json.loads((REPO / "tests" / "data" / "slice_size_cases.json").read_text())


@pytest.mark.parametrize("case", SIZES["fractions"] + SIZES["memory"], ids=lambda c: repr(c["text"]))
def test_slurms_gate_takes_and_refuses_the_sizes_every_tool_does(plugin_dir: Path, case: dict[str, Any]) -> None:
    """tests/data/slice_size_cases.json: the cases rgpu.slice_size, rgpu-admin, flexrun and the pool
    are tested against (tests/test_slice_size.py)."""
    word = "fraction" if case in SIZES["fractions"] else "memory"
    result = call(plugin_dir, job_desc("gres:rgpu:1", f"{word}={case['text']}"))
    if "what" in case:
        (message,) = user_messages(result)
        assert message.startswith(f"rgpu: job_submit: {case['what']} (") and case.get("why", "") in message, message
        return
    assert result["rc"] == 0 and user_messages(result) == [], result
    size = f"percent={case['percent']}" if word == "fraction" else f"memory={case['bytes']}"
    assert f" {size} " in result["admin_comment"], result
