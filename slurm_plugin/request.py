"""A job's rgpu request, read from Slurm's view of it. Pure: no I/O.

The grammar is the one job_submit.lua enforces at submit time (the Lua script is the gate; this
is the same reading on the Python side, for PrologSlurmctld). tests/data/request_cases.json holds
cases that both implementations are tested against, so the two cannot drift apart.

- `tres_per_node`: comma-separated entries `gres:NAME[:COUNT]` (Slurm <= 23.02) or
  `gres/NAME[:COUNT]` (>= 23.11); a missing count means 1; typed requests (`rgpu:a100:2`) are
  refused: rgpu GRES has no types.
- `comment`: words separated by spaces or commas; `fraction=F` (0 < F <= 1, at most two decimals
  matter: units are round(100 F)) or `memory=SIZE` (binary K/M/G/T suffix) per slice; other words
  are left alone. Only letters, digits, space and `. , _ = : / + @ -` may appear in the comment of
  an rgpu job.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from rgpu.errors import InvalidRequest

UNITS_PER_GPU = 100
COMMENT_ALLOWED_RE = re.compile(r"^[A-Za-z0-9 .,_=:/+@-]*$")
_NUMBER_RE = re.compile(r"^(?:\d+|\d+\.\d*|\.\d+)$")
_SIZE_RE = re.compile(r"^(\d+|\d+\.\d*|\.\d+)([KMGT]?)(?:I?B)?$", re.IGNORECASE)
_SIZE_MULT = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


@dataclass(frozen=True)
class RgpuRequest:
    count: int                 # slices per node
    fraction: float = 1.0      # of one GPU, per slice; 0 when memory_bytes is set
    memory_bytes: int = 0      # per slice; 0 when fraction is used

    def units_per_slice(self, gpu_memory_bytes: int = 0) -> int:
        """GPU percent one slice counts for in the Slurm license."""
        if self.memory_bytes:
            if gpu_memory_bytes <= 0:
                return UNITS_PER_GPU
            return min(UNITS_PER_GPU, math.ceil(UNITS_PER_GPU * self.memory_bytes / gpu_memory_bytes))
        return int(math.floor(UNITS_PER_GPU * self.fraction + 0.5))

    def license_units(self, nodes: int, gpu_memory_bytes: int = 0) -> int:
        return nodes * self.count * self.units_per_slice(gpu_memory_bytes)


def _bad(what: str, why: str, fix: str) -> InvalidRequest:
    return InvalidRequest("job_submit", what, why, fix)


def parse_tres_per_node(tres: str | None, gres_name: str = "rgpu") -> int | None:
    """Slices per node asked with --gres=rgpu:N, or None when rgpu is not asked for."""
    found: int | None = None
    for entry in (tres or "").split(","):
        entry = entry.strip()
        for prefix in ("gres:", "gres/"):
            if entry.startswith(prefix):
                entry = entry[len(prefix):]
                break
        else:
            continue
        parts = entry.split(":")
        if parts[0] != gres_name:
            continue
        if found is not None:
            raise _bad(f"--gres names {gres_name} twice", f"tres_per_node is {tres!r}", f"give --gres={gres_name}:N once")
        if len(parts) == 1:
            found = 1
        elif len(parts) == 2 and parts[1].isdigit():
            found = int(parts[1])
        else:
            raise _bad(f"invalid --gres={entry}", f"{gres_name} GRES has no types; the count must be a whole number",
                       f"write --gres={gres_name}:N")
    return found


def _parse_fraction(text: str) -> float:
    if not _NUMBER_RE.match(text):
        raise _bad(f"invalid fraction {text!r}", "not a number", "write e.g. --comment=fraction=0.5")
    value = float(text)
    if not 0 < value <= 1:
        raise _bad(f"invalid fraction {text!r}", "it must be more than 0 and at most 1",
                   "write e.g. --comment=fraction=0.5")
    if math.floor(UNITS_PER_GPU * value + 0.5) < 1:
        raise _bad(f"invalid fraction {text!r}", "the smallest slice is 0.01 of a GPU", "ask for fraction=0.01 or more")
    return value


def _parse_memory(text: str) -> int:
    m = _SIZE_RE.match(text)
    if not m:
        raise _bad(f"invalid memory {text!r}", "not a size", "write e.g. --comment=memory=8G")
    value = math.floor(float(m.group(1)) * _SIZE_MULT[m.group(2).upper()])
    if value <= 0:
        raise _bad(f"invalid memory {text!r}", "it must be more than 0", "write e.g. --comment=memory=8G")
    return value


def parse_comment(comment: str | None, count: int) -> RgpuRequest:
    comment = comment or ""
    if not COMMENT_ALLOWED_RE.match(comment):
        raise _bad("the job comment holds characters rgpu does not accept",
                   "only letters, digits, space and . , _ = : / + @ - are allowed in the comment of an rgpu job",
                   "write e.g. --comment=fraction=0.5")
    fraction: float | None = None
    memory: int | None = None
    for word in re.split(r"[ ,]+", comment):
        key, sep, value = word.partition("=")
        key = key.lower()
        if not sep or key not in ("fraction", "memory"):
            continue
        if key == "fraction":
            if fraction is not None:
                raise _bad("fraction is given twice", f"comment is {comment!r}", "give fraction=F once")
            fraction = _parse_fraction(value)
        else:
            if memory is not None:
                raise _bad("memory is given twice", f"comment is {comment!r}", "give memory=SIZE once")
            memory = _parse_memory(value)
    if fraction is not None and memory is not None:
        raise _bad("both fraction and memory are given", "a slice is sized by one of them",
                   "give either fraction=F or memory=SIZE")
    if memory is not None:
        return RgpuRequest(count=count, fraction=0.0, memory_bytes=memory)
    return RgpuRequest(count=count, fraction=1.0 if fraction is None else fraction)
