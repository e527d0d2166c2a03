"""Validation of every value that reaches a file, a command line or a template.

Each check returns the value or raises InvalidRequest naming the field. Patterns are strict
allow-lists: nothing that could end a line, a quoted string or a shell word gets through.
"""

from __future__ import annotations

import ipaddress
import re
from typing import TYPE_CHECKING

from rgpu.errors import InvalidRequest
from rgpu.model import ISOLATION_LEVELS, SHARING_MODES
from rgpu.netaddr import split_host_port

if TYPE_CHECKING:
    from rgpu.model import ServerInfo

JOB_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:+@-]{0,127}$")
NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.@-]{0,63}$")   # user and account names
HOSTNAME_RE = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,62})(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,62}))*$")
GPU_UUID_RE = re.compile(r"^(?:GPU|MIG)-[A-Za-z0-9-]{1,64}$")
TOKEN_RE = re.compile(r"^[A-Za-z0-9_.-]{1,4096}$")
RFC3339_RE = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:Z|[+-]\d{2}:\d{2})$")

MAX_SLICES = 64
# Job-key prefixes that only daemons (holders of the cluster secret) make: Slurm's PrologSlurmctld
# leases `slurm:<cluster>:<job>:<restart>:<node>` (slurm_plugin/jobkey.py). A user who leased such
# a key first would make the real job's prolog fail, so users' requests with them are refused.
RESERVED_JOB_KEY_PREFIXES = ("slurm:",)


def _bad(field: str, value: object, rule: str) -> InvalidRequest:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return InvalidRequest("request", f"invalid {field} {shown}", rule, f"fix {field} and try again")


def job_key(value: str) -> str:
    if not isinstance(value, str) or not JOB_KEY_RE.fullmatch(value):
        raise _bad("job key", value, "1-128 characters from A-Z a-z 0-9 . _ : + @ -")
    return value


def reserved_job_key_prefix(value: str) -> str:
    """The reserved prefix `value` starts with (case-insensitively), else ''."""
    lowered = value.lower() if isinstance(value, str) else ""
    return next((p for p in RESERVED_JOB_KEY_PREFIXES if lowered.startswith(p)), "")


def name(field: str, value: str) -> str:
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
        raise _bad(field, value, "1-64 characters from A-Z a-z 0-9 _ . @ -, not starting with . @ -")
    return value


def host(value: str) -> str:
    if not isinstance(value, str):
        raise _bad("host", value, "a hostname or IP address")
    if HOSTNAME_RE.fullmatch(value):
        return value
    try:
        ipaddress.ip_address(value.strip("[]"))
    except ValueError:
        raise _bad("host", value, "a hostname or IP address") from None
    return value


def server_address(value: str) -> str:
    """'host:port' or '[v6]:port' (rgpu.netaddr parses it), with a valid host."""
    try:
        hostpart, _port = split_host_port(value, what="server address")
    except InvalidRequest:
        raise _bad("server address", value, "host:port with a port in 1-65535") from None
    host(hostpart)
    return value


def gpu_uuid(value: str) -> str:
    if not isinstance(value, str) or not GPU_UUID_RE.fullmatch(value):
        raise _bad("GPU UUID", value, "GPU-<hex and dashes>")
    return value


def token(value: str) -> str:
    if not isinstance(value, str) or not TOKEN_RE.fullmatch(value):
        raise _bad("token", value, "base64url characters and dots")
    return value


def rfc3339_or_empty(value: str) -> str:
    if value and not RFC3339_RE.fullmatch(value):
        raise _bad("expiry", value, "an RFC 3339 time such as 2026-11-22T10:00:00Z, or empty")
    return value


def percent(value: int) -> int:
    """A slice's size in percent of one GPU (rgpu.slice_size parses what people write)."""
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 100:
        raise _bad("percent", value, "a whole number from 1 to 100 (percent of one GPU per slice)")
    return value


def count(value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_SLICES:
        raise _bad("count", value, f"a whole number of slices from 1 to {MAX_SLICES}")
    return value


def non_negative_int(field: str, value: int, upper: int = 2**63 - 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= upper:
        raise _bad(field, value, f"a whole number from 0 to {upper}")
    return value


# What one registration may claim. A dispatcher serves the GPUs of one node: 64 is more than any
# node holds, and bounds what a compromised or buggy dispatcher can make the pool store and list.
MAX_GPUS_PER_SERVER = 64
MAX_GPU_MEMORY_BYTES = 2**50          # 1 PiB per GPU
_TEXT_RE = re.compile(r"^[\x20-\x7e]*$")   # printable ASCII: nothing that ends a line or a table cell
_CAPABILITY_RE = re.compile(r"^(?:\d{1,2}\.\d{1,2})?$")


def text(field: str, value: str, longest: int) -> str:
    """Free text a dispatcher reports (GPU name, versions): printable ASCII, bounded."""
    if not isinstance(value, str) or len(value) > longest or not _TEXT_RE.match(value):
        raise _bad(field, value, f"up to {longest} printable characters, no control characters or newlines")
    return value


def server_info(info: ServerInfo) -> ServerInfo:
    """Everything a registration claims, checked before the pool stores any of it."""
    server_address(info.address)
    if info.hostname:
        host(info.hostname)
    for field, value in (("driver version", info.driver_version), ("CUDA version", info.cuda_version),
                         ("rgpu version", info.version), ("data ports", info.data_ports),
                         ("compute enforcement", info.compute_enforcement)):
        text(field, value, 64)
    text("launch path", info.launch_path, 256)
    if len(info.gpus) > MAX_GPUS_PER_SERVER:
        raise InvalidRequest("pool", f"server {info.address} registers {len(info.gpus)} GPUs",
                             f"a server may register at most {MAX_GPUS_PER_SERVER}",
                             "check the dispatcher's inventory (RGPU_VISIBLE_DEVICES, --inventory)")
    for gpu in info.gpus:
        gpu_uuid(gpu.uuid)
        text("GPU name", gpu.name, 96)
        if not _CAPABILITY_RE.match(gpu.compute_capability or ""):
            raise _bad("compute capability", gpu.compute_capability, "MAJOR.MINOR such as 9.0")
        non_negative_int("GPU index", gpu.index, MAX_GPUS_PER_SERVER * 16)
        non_negative_int("GPU memory", gpu.total_memory_bytes, MAX_GPU_MEMORY_BYTES)
        non_negative_int("GPU usable memory", gpu.usable_memory_bytes, gpu.total_memory_bytes)
        if gpu.sharing not in SHARING_MODES:
            raise _bad("GPU sharing", gpu.sharing, " or ".join(SHARING_MODES))
    return info


def isolation(value: str) -> str:
    """A request's isolation: "" (any GPU) or "strict" (only GPUs shared isolated or exclusive)."""
    if value not in ISOLATION_LEVELS:
        raise InvalidRequest("pool", f"unknown isolation {value[:40]!r}", "",
                             "ask for isolation=strict, or leave it out")
    return value
