"""A job's rgpu request, read from Slurm's view of it. Pure: no I/O.

The grammar is the one job_submit.lua enforces at submit time (the Lua script is the gate; this
is the same reading on the Python side, for PrologSlurmctld). tests/data/request_cases.json holds
cases that both implementations are tested against, so the two cannot drift apart.

- `tres_per_node`: comma-separated entries `gres:NAME[:COUNT]` (Slurm <= 23.02) or
  `gres/NAME[:COUNT]` (>= 23.11); a missing count means 1; typed requests (`rgpu:a100:2`) are
  refused: rgpu GRES has no types.
- `comment`: words separated by runs of spaces or commas (leading and trailing ones too); keys are
  case-insensitive; `fraction=F` (0 < F <= 1, at most two decimals matter: units are round(100 F))
  or `memory=SIZE` (binary K/M/G/T suffix) per slice; other words are left alone, but a bare
  `fraction` or `memory` word (as in `fraction = 0.5`) is refused. Only ASCII letters, digits,
  space and `. , _ = : / + @ -` may appear in the comment of an rgpu job (no tabs, newlines or
  other unicode). `isolation=strict` (the only level; case-insensitive) asks for GPUs shared
  `isolated` or `exclusive` only; a bare `isolation` word or a second one is refused. `pack=node`
  (the only packing; case-insensitive) asks for each node's slices on one GPU server, so NCCL's
  collectives between them stay on that server's NVLink or PCIe; a bare `pack` or a second one is
  refused.
- the **record**: job_submit.lua writes the normalised request into the job's admin comment,
  which only Slurm and admins can write: `rgpu:v1 nodes=N count=C percent=P units=U` or
  `rgpu:v1 nodes=N count=C memory=BYTES units=U`, either followed by ` isolation=strict` and then ` pack=node` when asked. PrologSlurmctld leases exactly this
  (`parse_record`, which accepts nothing else), never what it reads from user-controlled fields.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rgpu.errors import InvalidRequest
from rgpu.slice_size import PERCENT_PER_GPU, WHOLE_GPU, SliceSize, parse_fraction, parse_memory, percent_of_memory

UNITS_PER_GPU = PERCENT_PER_GPU
COMMENT_ALLOWED_RE = re.compile(r"^[A-Za-z0-9 .,_=:/+@-]*$")


@dataclass(frozen=True)
class RgpuRequest:
    count: int                      # slices per node
    size: SliceSize = WHOLE_GPU     # of each slice
    isolation: str = ""             # "" or "strict"
    pack: str = ""                  # "" or "node": each node's slices on one GPU server

    @property
    def memory_bytes(self) -> int:
        return self.size.memory_bytes

    def units_per_slice(self, gpu_memory_bytes: int = 0) -> int:
        """GPU percent one slice counts for in the Slurm license."""
        if self.size.memory_bytes:
            return percent_of_memory(self.size.memory_bytes, gpu_memory_bytes)
        return self.size.percent

    def license_units(self, nodes: int, gpu_memory_bytes: int = 0) -> int:
        return nodes * self.count * self.units_per_slice(gpu_memory_bytes)

    def record(self, nodes: int, gpu_memory_bytes: int = 0) -> str:
        """The admin-comment record job_submit.lua writes for this request (same text)."""
        size = f"memory={self.memory_bytes}" if self.memory_bytes else f"percent={self.units_per_slice()}"
        isolation = f" isolation={self.isolation}" if self.isolation else ""
        pack = f" pack={self.pack}" if self.pack else ""
        return (f"{RECORD_PREFIX}nodes={nodes} count={self.count} {size} "
                f"units={self.license_units(nodes, gpu_memory_bytes)}{isolation}{pack}")


RECORD_PREFIX = "rgpu:v1 "
# PrologSlurmctld appends "<separator><mark> <why>" while the pool cannot place the job (waiting.py).
RECORD_SEPARATOR = " | "
WAITING_MARK = "rgpu: waiting:"
_RECORD_RE = re.compile(r"rgpu:v1 nodes=([1-9]\d{0,5}) count=([1-9]\d{0,5}) "
                        r"(?:percent=([1-9]\d{0,2})|memory=([1-9]\d{0,18})) units=(\d{1,9})( isolation=strict)?( pack=node)?")


@dataclass(frozen=True)
class RequestRecord:
    """The request as job_submit.lua recorded it (what PrologSlurmctld leases)."""

    nodes: int
    request: RgpuRequest
    units: int               # license units of the whole job

    @property
    def percent(self) -> int:
        return self.units // (self.nodes * self.request.count)


def is_record(text: str | None) -> bool:
    return (text or "").startswith(RECORD_PREFIX.rstrip())


def parse_record(text: str | None) -> RequestRecord:
    """The whole admin comment, matched in full against the one grammar; anything else is refused."""
    m = _RECORD_RE.fullmatch((text or "").strip().split(RECORD_SEPARATOR, 1)[0])
    if not m:
        raise InvalidRequest("prolog-slurmctld", f"the job's rgpu record {str(text)[:80]!r} is not one job_submit.lua writes",
                             "the admin comment was changed, or the job was submitted before rgpu recorded requests",
                             "scancel the job and submit it again")
    nodes, count, percent, memory, units, strict, packed = m.groups()
    isolation = "strict" if strict else ""
    pack = "node" if packed else ""
    if percent is not None:
        if int(percent) > UNITS_PER_GPU or int(units) != int(nodes) * int(count) * int(percent):
            raise InvalidRequest("prolog-slurmctld", f"the job's rgpu record {text!r} does not add up",
                                 "units must be nodes x count x percent (percent at most 100)",
                                 "scancel the job and submit it again")
        request = RgpuRequest(count=int(count), size=SliceSize(percent=int(percent)), isolation=isolation, pack=pack)
    else:
        request = RgpuRequest(count=int(count), size=SliceSize(memory_bytes=int(memory)), isolation=isolation, pack=pack)
    return RequestRecord(nodes=int(nodes), request=request, units=int(units))


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


def _the_one_choice(comment: str, key: str, value: str, seen: str | None, choice: str, why: str) -> str:
    """A comment word whose one allowed value is `choice` (isolation=strict, pack=node), given once."""
    if seen is not None:
        raise _bad(f"{key} is given twice", f"comment is {comment!r}", f"give {key}={choice} once")
    if value.lower() != choice:
        raise _bad(f"invalid {key} {value!r}", why, f"write --comment={key}={choice}, or leave it out")
    return choice


def parse_comment(comment: str | None, count: int) -> RgpuRequest:
    comment = comment or ""
    if not COMMENT_ALLOWED_RE.fullmatch(comment):
        raise _bad("the job comment holds characters rgpu does not accept",
                   "only letters, digits, space and . , _ = : / + @ - are allowed in the comment of an rgpu job",
                   "write e.g. --comment=fraction=0.5")
    percent: int | None = None
    memory: int | None = None
    isolation: str | None = None
    pack: str | None = None
    keys = ("fraction", "memory", "isolation", "pack")
    for word in re.split(r"[ ,]+", comment):
        key, sep, value = word.partition("=")
        key = key.lower()
        bare = word.replace("=", "").lower()
        if not key and bare in keys or not sep and key in keys:
            raise _bad(f"the comment names {bare} without its value", f"comment is {comment!r}",
                       f"write {bare}=VALUE as one word, e.g. --comment=fraction=0.5")
        if not sep or key not in keys:
            continue
        if key == "isolation":
            isolation = _the_one_choice(comment, key, value, isolation, "strict",
                                        "the one level is strict (only GPUs no other job's fault can reach)")
        elif key == "pack":
            pack = _the_one_choice(comment, key, value, pack, "node",
                                   "the one packing is node (each node's slices on one GPU server, so NCCL stays on "
                                   "its NVLink or PCIe)")
        elif key == "fraction":
            if percent is not None:
                raise _bad("fraction is given twice", f"comment is {comment!r}", "give fraction=F once")
            # One slice-size grammar for the whole project (rgpu.slice_size); job_submit.lua mirrors it.
            percent = parse_fraction(value, component="job_submit", option="fraction=",
                                     example="--comment=fraction=0.5")
        else:
            if memory is not None:
                raise _bad("memory is given twice", f"comment is {comment!r}", "give memory=SIZE once")
            memory = parse_memory(value, component="job_submit")
    if percent is not None and memory is not None:
        raise _bad("both fraction and memory are given", "a slice is sized by one of them",
                   "give either fraction=F or memory=SIZE")
    if memory is not None:
        return RgpuRequest(count=count, size=SliceSize(memory_bytes=memory), isolation=isolation or "", pack=pack or "")
    return RgpuRequest(count=count, size=WHOLE_GPU if percent is None else SliceSize(percent=percent),
                       isolation=isolation or "", pack=pack or "")
