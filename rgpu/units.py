"""Parsing of human-written sizes and durations ("8G", "512MiB", "90m")."""

from __future__ import annotations

import math
import re

from rgpu.errors import InvalidRequest

# Binary units: GPU memory is counted in GiB, and Slurm's --mem suffixes are binary too.
_SIZE_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$", re.IGNORECASE)
MAX_BYTES = 2**60


def parse_size(text: str | int, field: str = "size") -> int:
    """Bytes from '8G', '8GiB', '8gb', '512M', '1.5T' or a plain number of bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = _SIZE_RE.fullmatch(str(text))
        if not m:
            raise InvalidRequest("units", f"invalid {field} {str(text)[:40]!r}",
                                 "expected a number with an optional K, M, G or T suffix (binary units)",
                                 "write it like 8G or 512M")
        value = math.floor(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])
    if not 0 < value <= MAX_BYTES:
        raise InvalidRequest("units", f"invalid {field} {text!r}", "must be more than 0 and at most 1 EiB",
                             "give a realistic size such as 8G")
    return value


def parse_duration(text: str | float, field: str = "duration") -> float:
    """Seconds from '90s', '30m', '2h', '1d' or a plain number of seconds."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        m = _DURATION_RE.fullmatch(str(text))
        if not m:
            raise InvalidRequest("units", f"invalid {field} {str(text)[:40]!r}",
                                 "expected a number with an optional s, m, h or d suffix",
                                 "write it like 30m or 2h")
        value = float(m.group(1)) * _DURATION_UNITS[m.group(2).lower()]
    if not math.isfinite(value) or not 0 < value <= 366 * 86400:
        raise InvalidRequest("units", f"invalid {field} {text!r}", "must be more than 0 and at most a year",
                             "give a duration such as 2h")
    return value


def format_bytes(value: int) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value} B"
