"""`rgpu-admin health --deep`: plan the hosts, run deepcheck's script on each over SSH, and judge
the output (deepcheck) including clock skew against the pool's host."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, replace

from rgpu.config import Settings, pool_addresses
from rgpu.errors import RgpuError
from rgpu.proto import rgpu_pb2 as pb
from rgpu.remoting.admin.deepcheck import FAIL, OK, Finding, HostPlan, build_script, check_skew, clock_offset, evaluate
from rgpu.remoting.admin.hosts import host_of, split_node
from rgpu.remoting.admin.ssh import SshSession, SshTarget

DISPATCHER_DIRS = ("/tmp",)                 # session runtime folders (tempfile) live here
CLIENT_DIRS = ("/run/rgpu", "/tmp")         # adaptor.conf per job; the client libraries' build


@dataclass(frozen=True)
class HostJob:
    plan: HostPlan
    target: SshTarget
    enforcement: str = ""
    static_inventory: bool = False     # every dispatcher on the host serves a static inventory


def plan_hosts(settings: Settings, servers: Sequence[pb.Server], client_nodes: Iterable[str],
               only: Iterable[str] = ()) -> list[HostJob]:
    """One job per (host, SSH port), its roles merged: pool, dispatcher, client."""
    jobs: dict[tuple[str, int], HostJob] = {}
    dispatchers = tuple(s.address for s in servers)

    def add(host: str, port: int, role: str, dirs: tuple[str, ...], server: pb.Server | None = None) -> None:
        key = (host, port)
        job = jobs.get(key)
        if job is None:
            job = HostJob(HostPlan(host, frozenset(), (), (), settings.health_remote_python),
                          SshTarget(host, port, settings.ssh_user, settings.ssh_key_file, settings.ssh_known_hosts_file),
                          static_inventory=server is not None and server.static_inventory)
        plan = job.plan
        plan = replace(plan, roles=plan.roles | {role}, dirs=tuple(dict.fromkeys(plan.dirs + dirs)),
                       dispatchers=plan.dispatchers or (dispatchers if role == "client" else ()))
        static = job.static_inventory if server is None else (
            server.static_inventory and (job.static_inventory or "dispatcher" not in job.plan.roles))
        jobs[key] = replace(job, plan=plan, enforcement=job.enforcement or (server.compute_enforcement if server else ""),
                            static_inventory=static)

    for pool in pool_addresses(settings.pool):
        add(host_of(pool), settings.ssh_port, "pool", (os.path.dirname(settings.state) or ".",))
    for s in servers:
        add(host_of(s.address), settings.ssh_port, "dispatcher", DISPATCHER_DIRS, s)
    for node in client_nodes:
        host, port = split_node(node, settings.ssh_port)
        add(host, port, "client", CLIENT_DIRS)
    wanted = set(only)
    return [job for job in jobs.values() if not wanted or job.plan.host in wanted]


@dataclass(frozen=True)
class HostOutcome:
    host: str
    findings: list[Finding]
    offset: tuple[float, float] | None     # clock offset against this node, and its uncertainty


def check_host(job: HostJob, pool_version: str = "") -> HostOutcome:
    host = job.plan.host
    try:
        with SshSession(job.target) as session:
            clock = session.run("date +%s.%N")
            result = session.run(build_script(job.plan))
    except RgpuError as exc:
        return HostOutcome(host, [Finding(host, "ssh", FAIL, exc.what + (f" ({exc.why})" if exc.why else ""),
                                          exc.fix)], None)
    offset = None
    try:
        offset = clock_offset(float(clock.stdout.strip()), clock.sent, clock.received)
    except ValueError:
        pass
    findings = [Finding(host, "ssh", OK, f"{job.target.describe()} ({', '.join(sorted(job.plan.roles))})")]
    findings += evaluate(job.plan, result.stdout, enforcement=job.enforcement, pool_version=pool_version,
                         static_inventory=job.static_inventory)
    return HostOutcome(host, findings, offset)


HOSTS_AT_ONCE = 16


def run_checks(jobs: Sequence[HostJob], *, pool_version: str = "",
               each: Callable[[Iterator[Future[HostOutcome]]], Iterable[Future[HostOutcome]]] = lambda done: done,
               check: Callable[..., HostOutcome] = check_host, at_once: int = HOSTS_AT_ONCE) -> list[Finding]:
    """Check the hosts, `at_once` at a time (`each` sees them complete, e.g. a progress bar), then
    judge clock skew against the pool's host (or this node when the pool's host was not reached).
    Findings come in the order of `jobs`."""
    with ThreadPoolExecutor(max_workers=max(1, min(at_once, len(jobs)))) as executor:
        futures = [executor.submit(check, job, pool_version) for job in jobs]
        for _ in each(as_completed(futures)):
            pass
    outcomes = [(job, future.result()) for job, future in zip(jobs, futures)]
    pool = next((o for job, o in outcomes if "pool" in job.plan.roles and o.offset is not None), None)
    if pool is not None and pool.offset is not None:
        reference, (ref_offset, ref_uncertainty) = f"the pool's host {pool.host}", pool.offset
    else:
        reference, ref_offset, ref_uncertainty = "this node (the pool's host was not reached)", 0.0, 0.0
    findings: list[Finding] = []
    for _job, outcome in outcomes:
        findings += outcome.findings
        if outcome.offset is not None:
            offset, uncertainty = outcome.offset
            findings.append(check_skew(outcome.host, offset - ref_offset, uncertainty + ref_uncertainty, reference))
    return findings
