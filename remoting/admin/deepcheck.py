"""`rgpu-admin health --deep`: what to run on each host and what its output means. Pure: no SSH,
no sockets (remoting/admin/ssh.py runs the script; remoting/admin/deep_health.py joins the two).

One shell script per host prints sections (`@@section NAME`, `@@rc N` after a command); parse_report
splits them and the check_* functions turn each into Findings with a fix for each failure.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import asdict, dataclass, field
from typing import Any

OK, WARN, FAIL = "ok", "warn", "fail"
ROLES = ("pool", "dispatcher", "client")

GPU_FIELDS = ("index", "uuid", "name", "driver_version", "clocks.sm", "clocks.max.sm", "ecc.mode.current",
              "ecc.errors.uncorrected.volatile.total", "clocks_throttle_reasons.active")
# Throttle reasons that mean trouble (NVML's nvmlClocksThrottleReason*): SW power cap 0x4 and idle
# 0x1 are routine; hardware slowdown, thermal and power-brake ones are not.
BAD_THROTTLE = {0x8: "hardware slowdown", 0x20: "software thermal", 0x40: "hardware thermal",
                0x80: "hardware power brake"}
MIN_FREE_BYTES = 1 << 30
MIN_FREE_FRACTION = 0.05
SKEW_WARN_S = 2.0
SKEW_FAIL_S = 60.0          # tokens' expiry and the admin API's 300 s credential window need far less
RTT_WARN_MS = 5.0

RTT_PROGRAM = """
import socket, sys, time
for address in sys.argv[1:]:
    host, _, port = address.rpartition(":")
    best = None
    for _ in range(3):
        t0 = time.perf_counter()
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
        except OSError as exc:
            print(address, "error", exc); break
        took = (time.perf_counter() - t0) * 1e3
        best = took if best is None else min(best, took)
    else:
        print(address, "ms", "%.3f" % best)
"""

RGPU_PROGRAM = """
import rgpu
print("version", rgpu.__version__)
import sys
if "build" in sys.argv[1:]:
    from rgpu.remoting.native import build
    print("libraries", build.ensure_built().folder)
"""


@dataclass(frozen=True)
class HostPlan:
    host: str
    roles: frozenset[str]
    dirs: tuple[str, ...]                 # folders whose free space matters on this host
    dispatchers: tuple[str, ...] = ()     # data ports to time from here (clients)
    python: str = "python3"


@dataclass(frozen=True)
class Finding:
    host: str
    check: str
    status: str
    detail: str
    fix: str = ""

    def row(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Report:
    sections: dict[str, list[str]] = field(default_factory=dict)
    rcs: dict[str, int] = field(default_factory=dict)


def build_script(plan: HostPlan) -> str:
    """The shell script run on a host (POSIX sh; every value quoted)."""
    py = shlex.quote(plan.python)
    query = shlex.quote(",".join(GPU_FIELDS))
    lines = [
        "echo '@@section driver'",
        "if command -v nvidia-smi >/dev/null 2>&1; then",
        f"  nvidia-smi --query-gpu={query} --format=csv,noheader,nounits 2>&1; echo \"@@rc $?\"",
        "else echo '@@rc 127'; fi",
        "echo '@@section mps'",
        "ps -eo comm= 2>/dev/null | grep -x nvidia-cuda-mps-control || true",
        "echo '@@section xid'",
        "(dmesg 2>/dev/null || journalctl -k -q --no-pager 2>/dev/null) | grep 'NVRM: Xid' | tail -n 5",
        "echo '@@section disk'",
    ]
    for d in plan.dirs:
        q = shlex.quote(d)
        lines.append(f"p={q}; while [ ! -e \"$p\" ]; do p=$(dirname \"$p\"); done; "
                     f"printf '%s\\t' {q}; df -Pk \"$p\" | tail -n 1")
    build = " build" if plan.roles & {"dispatcher", "client"} else ""
    lines += ["echo '@@section rgpu'",
              f"out=$({py} -c {shlex.quote(RGPU_PROGRAM)}{build} 2>&1); rc=$?; "
              "printf '%s\\n' \"$out\" | tail -n 5; echo \"@@rc $rc\""]
    if plan.dispatchers:
        lines += ["echo '@@section rtt'",
                  f"{py} -c {shlex.quote(RTT_PROGRAM)} {' '.join(shlex.quote(d) for d in plan.dispatchers)} 2>&1; "
                  "echo \"@@rc $?\""]
    return "\n".join(lines) + "\n"


def parse_report(text: str) -> Report:
    report = Report()
    current = ""
    for raw in text.splitlines():
        line = raw.rstrip("\n")
        if line.startswith("@@section "):
            current = line.split(" ", 1)[1].strip()
            report.sections.setdefault(current, [])
        elif line.startswith("@@rc ") and current:
            try:
                report.rcs[current] = int(line.split()[1])
            except (IndexError, ValueError):
                report.rcs[current] = 1
        elif current:
            report.sections[current].append(line)
    return report


# ------------------------------------------------------------------ checks

def check_driver(host: str, roles: frozenset[str], report: Report, static_inventory: bool = False) -> list[Finding]:
    rc = report.rcs.get("driver", 127)
    lines = [line for line in report.sections.get("driver", []) if line.strip()]
    needs_gpu = "dispatcher" in roles and not static_inventory
    if rc == 127:
        if "dispatcher" in roles and static_inventory:
            return [Finding(host, "driver", OK, "no driver (its dispatchers serve a static inventory)")]
        if needs_gpu:
            return [Finding(host, "driver", FAIL, "no driver: nvidia-smi not found on a dispatcher host",
                            "install the NVIDIA driver, or run this dispatcher with --inventory (tests only)")]
        return [Finding(host, "driver", OK, "no driver (CPU host; none needed)")]
    if rc != 0:
        status = FAIL if needs_gpu else WARN
        return [Finding(host, "driver", status, f"nvidia-smi failed: {lines[-1] if lines else f'exit {rc}'}",
                        "check the driver with nvidia-smi; reload it or reboot the node")]
    gpus = [_split_csv(line) for line in lines]
    gpus = [g for g in gpus if len(g) == len(GPU_FIELDS)]
    if not gpus:
        return [Finding(host, "driver", WARN, "nvidia-smi lists no GPU", "check the node's GPUs with nvidia-smi -L")]
    findings = [Finding(host, "driver", OK, f"driver {gpus[0][3]}, {len(gpus)} GPU(s) ({gpus[0][2]})")]
    findings += check_clocks(host, gpus) + check_ecc(host, gpus)
    return findings


def _split_csv(line: str) -> list[str]:
    return [cell.strip() for cell in line.split(",")]


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None    # "[N/A]", "[Not Supported]"


def check_clocks(host: str, gpus: list[list[str]]) -> list[Finding]:
    out = []
    for g in gpus:
        index, sm, sm_max, reasons = g[0], _number(g[4]), _number(g[5]), g[8]
        bad = []
        try:
            mask = int(reasons, 16)
            bad = [name for bit, name in BAD_THROTTLE.items() if mask & bit]
        except ValueError:
            pass
        clock = f"SM {sm:.0f}/{sm_max:.0f} MHz" if sm is not None and sm_max is not None else "SM clock n/a"
        if bad:
            out.append(Finding(host, f"clocks gpu{index}", WARN, f"{clock}, throttled: {', '.join(bad)}",
                               "check cooling and power (nvidia-smi -q -d PERFORMANCE,TEMPERATURE)"))
        else:
            out.append(Finding(host, f"clocks gpu{index}", OK, clock))
    return out


def check_ecc(host: str, gpus: list[list[str]]) -> list[Finding]:
    out = []
    for g in gpus:
        index, mode, errors = g[0], g[6], _number(g[7])
        if errors:
            out.append(Finding(host, f"ecc gpu{index}", FAIL, f"{errors:.0f} uncorrected ECC error(s) since boot",
                               f"drain the server (rgpu-admin drain {host}), then reset the GPU (nvidia-smi -r -i "
                               f"{index}) or replace it"))
        else:
            out.append(Finding(host, f"ecc gpu{index}", OK, f"ECC {mode.lower()}, no uncorrected errors"))
    return out


def check_xid(host: str, roles: frozenset[str], report: Report) -> list[Finding]:
    lines = [line for line in report.sections.get("xid", []) if "Xid" in line]
    if not lines:
        return [Finding(host, "xid", OK, "no Xid errors in the kernel log")] if "dispatcher" in roles else []
    last = re.sub(r"^\[[^\]]*\]\s*", "", lines[-1].strip())
    return [Finding(host, "xid", WARN, f"{len(lines)} recent Xid error(s), last: {last}",
                    "look the Xid up in NVIDIA's Xid table; drain the server if they repeat")]


def check_mps(host: str, roles: frozenset[str], report: Report, enforcement: str = "",
              static_inventory: bool = False) -> list[Finding]:
    if "dispatcher" not in roles:
        return []
    running = any(line.strip() == "nvidia-cuda-mps-control" for line in report.sections.get("mps", []))
    if running or enforcement == "mps":
        return [Finding(host, "limiter", OK, "MPS control daemon running: compute shares enforced")]
    if static_inventory:
        return [Finding(host, "limiter", OK, "no GPU to share (static inventory, emulated GPUs)")]
    if enforcement in ("rgpu limiter", "exclusive"):
        return [Finding(host, "limiter", OK, f"no GPU shared by MPS here: compute shares by {enforcement}")]
    return [Finding(host, "limiter", WARN, f"no MPS ({enforcement or 'not running'}): compute shares are "
                    "time-sliced, not enforced",
                    "run rgpu-dispatcher as root where nvidia-cuda-mps-control is installed")]


def check_disk(host: str, report: Report) -> list[Finding]:
    out = []
    for line in report.sections.get("disk", []):
        folder, _, df_line = line.partition("\t")
        parts = df_line.split()
        if len(parts) < 6:
            continue
        total_k, avail_k, mount = _number(parts[1]), _number(parts[3]), " ".join(parts[5:])
        if total_k is None or avail_k is None:
            continue
        free = int(avail_k) * 1024
        detail = f"{folder}: {_gib(free)} free of {_gib(int(total_k) * 1024)} (on {mount})"
        if free < MIN_FREE_BYTES or (total_k and avail_k / total_k < MIN_FREE_FRACTION):
            out.append(Finding(host, "disk", FAIL, detail, f"free space on {mount} (rgpu writes state and session "
                                                           f"files under {folder})"))
        else:
            out.append(Finding(host, "disk", OK, detail))
    return out


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_rgpu(host: str, roles: frozenset[str], report: Report, python: str) -> list[Finding]:
    lines = [line for line in report.sections.get("rgpu", []) if line.strip()]
    rc = report.rcs.get("rgpu", 1)
    version = next((line.split(None, 1)[1] for line in lines if line.startswith("version ")), "")
    libs = next((line.split(None, 1)[1] for line in lines if line.startswith("libraries ")), "")
    if not version:
        return [Finding(host, "rgpu", FAIL, f"{python} cannot import rgpu: {lines[-1] if lines else f'exit {rc}'}",
                        "install rgpu on the host (pip install rgpu), or set health_remote_python to its Python")]
    if roles & {"dispatcher", "client"} and (rc != 0 or not libs):
        return [Finding(host, "rgpu", FAIL, f"rgpu {version}, client libraries do not build: "
                        f"{lines[-1] if lines else f'exit {rc}'}",
                        "install a C compiler (apt-get install gcc), or set RGPU_NATIVE_DIR to a prebuilt copy")]
    detail = f"rgpu {version}" + (f", client libraries in {libs}" if libs else "")
    return [Finding(host, "rgpu", OK, detail)]


def check_versions(host: str, report: Report, pool_version: str) -> list[Finding]:
    version = next((line.split(None, 1)[1] for line in report.sections.get("rgpu", []) if line.startswith("version ")), "")
    if version and pool_version and version != pool_version:
        return [Finding(host, "version", WARN, f"rgpu {version} there, {pool_version} on this node (rgpu-admin's)",
                        "install the same rgpu version on every host")]
    return []


def check_rtt(host: str, report: Report) -> list[Finding]:
    out = []
    for line in report.sections.get("rtt", []):
        parts = line.split(None, 2)
        if len(parts) < 3:
            continue
        address, kind, value = parts
        if kind == "ms":
            ms = float(value)
            status = WARN if ms > RTT_WARN_MS else OK
            out.append(Finding(host, f"rtt {address}", status, f"TCP connect {ms:.2f} ms",
                               "a slow path to the dispatcher slows every synchronising CUDA call; check the "
                               "route (rgpu-admin net-perf)" if status == WARN else ""))
        elif kind == "error":
            out.append(Finding(host, f"rtt {address}", FAIL, f"cannot reach the dispatcher's data port: {value}",
                               "open the dispatcher's data ports (RGPU_SERVER_PORT_MIN/MAX) between these hosts"))
    if report.rcs.get("rtt", 0) not in (0,) and not out:
        out.append(Finding(host, "rtt", FAIL, "could not time the dispatchers: "
                           + "; ".join(report.sections.get("rtt", [])[-1:]), "check health_remote_python"))
    return out


def clock_offset(remote_unix: float, sent: float, received: float) -> tuple[float, float]:
    """The remote clock minus the local one, and its uncertainty (half the round trip)."""
    return remote_unix - (sent + received) / 2, (received - sent) / 2


def check_skew(host: str, skew_s: float, uncertainty_s: float, reference: str) -> Finding:
    detail = f"{skew_s:+.3f} s against {reference} (+/- {uncertainty_s:.3f} s)"
    if abs(skew_s) - uncertainty_s > SKEW_FAIL_S:
        return Finding(host, "clock", FAIL, detail, "sync the clocks (chrony or systemd-timesyncd): lease tokens "
                                                    "expire by them and the pool refuses stale credentials")
    if abs(skew_s) - uncertainty_s > SKEW_WARN_S:
        return Finding(host, "clock", WARN, detail, "sync the clocks (chrony or systemd-timesyncd)")
    return Finding(host, "clock", OK, detail)


def evaluate(plan: HostPlan, text: str, *, enforcement: str = "", pool_version: str = "",
             static_inventory: bool = False) -> list[Finding]:
    """Every finding for one host from its script's output."""
    report = parse_report(text)
    return (check_driver(plan.host, plan.roles, report, static_inventory) + check_mps(plan.host, plan.roles, report, enforcement, static_inventory)
            + check_xid(plan.host, plan.roles, report) + check_disk(plan.host, report)
            + check_rgpu(plan.host, plan.roles, report, plan.python) + check_versions(plan.host, report, pool_version)
            + check_rtt(plan.host, report))
