"""Parsing and printing of human-written sizes and durations ("8G", "512MiB", "90m"): the one
size parser and printer every component uses (Slurm comments, inventories, CLIs, worker messages)."""

from __future__ import annotations

import math
import re
from decimal import Decimal

from rgpu.errors import InvalidRequest

# Binary units: GPU memory is counted in GiB, and Slurm's --mem suffixes are binary too.
_SIZE_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
# The grammar job_submit.lua accepts too: "8", "8G", "1.5T", ".5G", "8.G", "8GiB", "8gb".
# re.ASCII: "８G" (full-width digits) is not a size.
_SIZE_RE = re.compile(r"^\s*(\d+|\d+\.\d*|\.\d+)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE | re.ASCII)
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$", re.IGNORECASE | re.ASCII)
_MAX_DIGITS = 40    # longer numbers are refused before float() (a hostile value must not cost time)
MAX_BYTES = 2**60
_PRINT_UNITS = (("EiB", 2**60), ("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def _shown(text: object) -> str:
    shown = repr(text)
    return shown if len(shown) <= 42 else shown[:39] + "..."


def parse_size(text: str | int, field: str = "size", *, component: str = "units") -> int:
    """Bytes from '8G', '8GiB', '8gb', '512M', '1.5T', '.5G' or a plain number of bytes; more than 0
    and at most 1 EiB. Errors name `component` and `field` (e.g. "rgpu: units: invalid memory '0G'")."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = _SIZE_RE.fullmatch(text) if isinstance(text, str) else None
        if not m or len(m.group(1)) > _MAX_DIGITS:
            raise InvalidRequest(component, f"invalid {field} {_shown(text)}",
                                 "expected a number with an optional K, M, G or T suffix (binary units)",
                                 "write it like 8G or 512M")
        value = math.floor(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])
    if not 0 < value <= MAX_BYTES:
        raise InvalidRequest(component, f"invalid {field} {_shown(text)}", "must be more than 0 and at most 1 EiB",
                             "give a realistic size such as 8G")
    return value


def parse_duration(text: str | float, field: str = "duration") -> float:
    """Seconds from '90s', '30m', '2h', '1d' or a plain number of seconds."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        m = _DURATION_RE.fullmatch(text) if isinstance(text, str) else None
        if not m or len(m.group(1)) > _MAX_DIGITS:
            raise InvalidRequest("units", f"invalid {field} {_shown(text)}",
                                 "expected a number with an optional s, m, h or d suffix",
                                 "write it like 30m or 2h")
        value = float(m.group(1)) * _DURATION_UNITS[m.group(2).lower()]
    if not math.isfinite(value) or not 0 < value <= 366 * 86400:
        raise InvalidRequest("units", f"invalid {field} {_shown(text)}", "must be more than 0 and at most a year",
                             "give a duration such as 2h")
    return value


def format_bytes(value: int) -> str:
    """'1.5 GiB', '512 B', '-2.0 MiB': fixed-point, never scientific notation, whatever the size."""
    value = int(value)
    magnitude = abs(value)
    for unit, size in _PRINT_UNITS:
        if magnitude >= size:
            # Decimal: exact for any int, and its fixed-point format never switches to exponents.
            return f"{'-' if value < 0 else ''}{Decimal(magnitude) / size:.1f} {unit}"
    return f"{value} B"
