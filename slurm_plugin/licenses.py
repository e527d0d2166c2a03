"""Capacity consistency between the pool and Slurm's `rgpu` license.

slurm.conf declares `Licenses=rgpu:<all GPUs x 100>`. While some servers are down or drained, a
license-only reservation named `rgpu_capacity` holds back the units the pool cannot serve, so
Slurm starts only jobs the healthy pool can take; when the servers come back the reservation
shrinks or goes. (Changing `Licenses=` itself needs `scontrol reconfigure`, which is too heavy
to run on every heartbeat.)

Pure: `plan_reservation`, `parse_*`, `render_slurm_config`. I/O: `SlurmLicenses` (scontrol) and
`LicenseSync` (pool + Slurm), which the pool daemon runs on capacity changes and periodically.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rgpu.slurm_plugin.proc import run_command
from rgpu.slurm_plugin.versions import TESTED, has_split_prolog_timeouts, tres_gres_prefix

from rgpu.errors import RgpuError
from rgpu.render import render

RESERVATION = "rgpu_capacity"
UNITS_PER_GPU = 100


# ---------------------------------------------------------------- pure

@dataclass(frozen=True)
class LicenseState:
    total: int        # Licenses=rgpu:<total> in slurm.conf
    used: int
    reserved: int


@dataclass(frozen=True)
class ReservationPlan:
    action: str       # "none", "create", "update", "delete"
    units: int        # held back after the action
    warning: str = ""


def plan_reservation(license_total: int, healthy_units: int, current_hold: int | None) -> ReservationPlan:
    """How many units to hold back, and what to do to the reservation (None: it does not exist)."""
    hold = max(0, license_total - healthy_units)
    warning = ""
    if healthy_units > license_total:
        warning = (f"rgpu: slurm: the pool has {healthy_units} healthy GPU-percent but Slurm's rgpu license "
                   f"total is {license_total} (new GPUs?; run `rgpu-admin slurm-config`, update Licenses= in "
                   "slurm.conf and `scontrol reconfigure`)")
    if hold == 0:
        return ReservationPlan("delete" if current_hold is not None else "none", 0, warning)
    if current_hold is None:
        return ReservationPlan("create", hold, warning)
    return ReservationPlan("update" if current_hold != hold else "none", hold, warning)


def parse_show_license(text: str, name: str = "rgpu") -> LicenseState | None:
    """`scontrol show lic NAME` (22.05: `LicenseName=rgpu\\n  Total=400 Used=0 Free=400 Reserved=0 ...`)."""
    fields = dict(re.findall(r"(\w+)=(\S+)", text))
    if fields.get("LicenseName") != name or "Total" not in fields:
        return None
    return LicenseState(total=int(fields["Total"]), used=int(fields.get("Used", 0)),
                        reserved=int(fields.get("Reserved", 0) or 0))


def parse_reservation_licenses(text: str, license_name: str = "rgpu") -> int | None:
    """Units of license_name held by the reservation shown in `scontrol show reservation NAME`."""
    m = re.search(r"\bLicenses=(\S+)", text)
    if not m or "ReservationName=" not in text:
        return None
    for entry in m.group(1).split(","):
        name, _, count = entry.replace("*", ":").partition(":")
        if name == license_name and count.isdigit():
            return int(count)
    return 0


# ---------------------------------------------------------------- scontrol

@dataclass
class SlurmLicenses:
    env: Mapping[str, str] | None = None
    license_name: str = "rgpu"
    reservation: str = RESERVATION
    timeout: float = 10.0

    def _run(self, argv: Sequence[str], check: bool = True) -> Any:
        return run_command(argv, component="slurm", env=self.env, timeout=self.timeout, check=check)

    def license(self) -> LicenseState:
        state = parse_show_license(self._run(["scontrol", "show", "lic", self.license_name]).stdout,
                                   self.license_name)
        if state is None:
            raise RgpuError("slurm", f"Slurm has no license named {self.license_name}",
                            "slurm.conf lacks Licenses=", "add the line `rgpu-admin slurm-config` prints")
        return state

    def current_hold(self) -> int | None:
        out = self._run(["scontrol", "show", "reservation", self.reservation], check=False)
        return parse_reservation_licenses(out.stdout, self.license_name) if out.returncode == 0 else None

    def apply(self, plan: ReservationPlan) -> None:
        lic = f"licenses={self.license_name}:{plan.units}"
        if plan.action == "create":
            self._run(["scontrol", "create", "reservation", f"reservationname={self.reservation}",
                       "starttime=now", "duration=infinite", "flags=license_only", "users=root", lic])
        elif plan.action == "update":
            self._run(["scontrol", "update", f"reservationname={self.reservation}", lic])
        elif plan.action == "delete":
            self._run(["scontrol", "delete", f"reservationname={self.reservation}"])


@dataclass
class LicenseSync:
    """Holds back the units the pool cannot serve. `pool` needs `capacity()` (total_units).

    In rgpu-poold: `start(interval)` runs `sync_once` every interval and at once after
    `trigger()`, which is cheap and never blocks, so it can be the pool core's capacity listener.
    """

    pool: Any
    slurm: SlurmLicenses
    log: logging.Logger | logging.LoggerAdapter[Any]
    _wake: threading.Event = field(default_factory=threading.Event)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def trigger(self) -> None:
        self._wake.set()

    def start(self, interval_seconds: float) -> "LicenseSync":
        def loop() -> None:
            while not self._stop.is_set():
                self._wake.clear()
                try:
                    self.sync_once()
                except Exception:  # noqa: BLE001 - the loop must survive anything
                    self.log.exception("rgpu: slurm: license sync failed (will retry)")
                self._wake.wait(interval_seconds)

        self._thread = threading.Thread(target=loop, name="rgpu-license-sync", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def sync_once(self) -> ReservationPlan | None:
        try:
            healthy = int(self.pool.capacity().total_units)
            lic = self.slurm.license()
            plan = plan_reservation(lic.total, healthy, self.slurm.current_hold())
            if plan.warning:
                self.log.warning("%s", plan.warning)
            if plan.action != "none":
                self.slurm.apply(plan)
                self.log.info("rgpu: slurm: %s reservation %s: holding back %d of %d %s units (pool healthy: %d)",
                              plan.action, self.slurm.reservation, plan.units, lic.total, self.slurm.license_name,
                              healthy)
            return plan
        except RgpuError as exc:
            self.log.warning("rgpu: slurm: license sync skipped: %s", exc)
            return None


# ---------------------------------------------------------------- rgpu-admin slurm-config

@dataclass(frozen=True)
class SlurmConfigValues:
    gpus: int
    servers: int
    healthy_units: int
    gpu_memory_bytes: int          # usable memory of the smallest GPU (0 when the pool has none)
    max_slices_per_job: int
    prolog_dir: str
    gres_name: str = "rgpu"
    license_name: str = "rgpu"
    slurm_version: str = ""        # major.minor of the Slurm the lines are for ("" unknown)
    isolated_gpus: int = 0         # GPUs shared "isolated" (job_submit.lua's capability check)
    exclusive_gpus: int = 0        # GPUs shared "exclusive"

    @property
    def license_total(self) -> int:
        return self.gpus * UNITS_PER_GPU

    @property
    def max_per_node(self) -> int:
        # Each slice of one node's lease is on a distinct GPU.
        return max(1, min(self.gpus, self.max_slices_per_job))


def config_values(gpu_statuses: Sequence[Any], healthy_units: int, max_slices_per_job: int,
                  prolog_dir: str, slurm_version: str = "") -> SlurmConfigValues:
    """From ListGpus records (fields server, gpu.usable_memory_bytes). Pure."""
    memories = [int(g.gpu.usable_memory_bytes) for g in gpu_statuses]
    sharing = [str(getattr(g.gpu, "sharing", "") or "mps") for g in gpu_statuses]
    return SlurmConfigValues(gpus=len(memories), servers=len({g.server for g in gpu_statuses}),
                             healthy_units=healthy_units, gpu_memory_bytes=min(memories, default=0),
                             max_slices_per_job=max_slices_per_job, prolog_dir=prolog_dir.rstrip("/") or "/",
                             slurm_version=slurm_version, isolated_gpus=sharing.count("isolated"),
                             exclusive_gpus=sharing.count("exclusive"))


# What slurm.conf's SchedulerParameters should hold for rgpu (templates/slurm.conf.j2 says why):
# a job rgpu-poold releases starts within about a second (measured: benchmarks/slurm_mixed_batch.py).
SCHEDULER_PARAMETERS = "batch_sched_delay=1"

SECTIONS = {"slurm.conf": "slurm.conf.j2", "gres.conf": "gres.conf.j2", "job_submit_rgpu.conf": "job_submit_rgpu.conf.j2"}


def render_slurm_config(values: SlurmConfigValues, sections: Sequence[str] = tuple(SECTIONS)) -> str:
    ctx = dict(gpus=values.gpus, servers=values.servers, healthy_units=values.healthy_units,
               license_total=values.license_total, license_name=values.license_name, gres_name=values.gres_name,
               gres_per_node=values.max_per_node, max_per_node=values.max_per_node,
               max_per_job=values.max_slices_per_job, gpu_memory_bytes=values.gpu_memory_bytes,
               pool_gpus=values.gpus, isolated_gpus=values.isolated_gpus, exclusive_gpus=values.exclusive_gpus,
               prolog_dir=values.prolog_dir, reservation=RESERVATION, slurm_version=values.slurm_version,
               # Unknown version: "gres/" (23.11 on) and the one timeout every version knows.
               tres_prefix=tres_gres_prefix(values.slurm_version or TESTED[-1]),
               split_prolog_timeouts=has_split_prolog_timeouts(values.slurm_version),
               scheduler_parameters=SCHEDULER_PARAMETERS)
    parts = []
    for section in sections:
        text = render(SECTIONS[section], **ctx)
        parts.append(text if len(sections) == 1 else f"### {section}\n{text}")
    return "\n".join(parts)
