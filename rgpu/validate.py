"""Validation of every value that reaches a file, a command line or a template.

Each check returns the value or raises InvalidRequest naming the field. Patterns are strict
allow-lists: nothing that could end a line, a quoted string or a shell word gets through.
"""

from __future__ import annotations

import ipaddress
import math
import re

from rgpu.errors import InvalidRequest
from rgpu.netaddr import split_host_port

JOB_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:+@-]{0,127}$")
NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.@-]{0,63}$")   # user and account names
HOSTNAME_RE = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,62})(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,62}))*$")
GPU_UUID_RE = re.compile(r"^(?:GPU|MIG)-[A-Za-z0-9-]{1,64}$")
TOKEN_RE = re.compile(r"^[A-Za-z0-9_.-]{1,4096}$")
RFC3339_RE = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:Z|[+-]\d{2}:\d{2})$")

MAX_SLICES = 64


def _bad(field: str, value: object, rule: str) -> InvalidRequest:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return InvalidRequest("request", f"invalid {field} {shown}", rule, f"fix {field} and try again")


def job_key(value: str) -> str:
    if not isinstance(value, str) or not JOB_KEY_RE.fullmatch(value):
        raise _bad("job key", value, "1-128 characters from A-Z a-z 0-9 . _ : + @ -")
    return value


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


def fraction(value: float) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or not 0 < value <= 1:
        raise _bad("fraction", value, "a number in (0, 1], e.g. 0.5 for half a GPU")
    return float(value)


def count(value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_SLICES:
        raise _bad("count", value, f"a whole number of slices from 1 to {MAX_SLICES}")
    return value


def non_negative_int(field: str, value: int, upper: int = 2**63 - 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= upper:
        raise _bad(field, value, f"a whole number from 0 to {upper}")
    return value
