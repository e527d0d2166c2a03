"""Slurm host list expressions ("c[1-3,5]", "gpu[01-02]-ib,login1"). Pure: no I/O.

Expanded here rather than with `scontrol show hostnames` so a prolog needs no extra command.
"""

from __future__ import annotations

import re

from rgpu.errors import InvalidRequest

_BRACKET_RE = re.compile(r"\[([^\[\]]*)\]")
MAX_HOSTS = 100_000


def _split_top_level(expr: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(expr):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise InvalidRequest("hostlist", f"unbalanced brackets in {expr!r}", "", "")
        elif ch == "," and depth == 0:
            parts.append(expr[start:i])
            start = i + 1
    if depth != 0:
        raise InvalidRequest("hostlist", f"unbalanced brackets in {expr!r}", "", "")
    parts.append(expr[start:])
    return [p for p in parts if p]


def _expand_ranges(body: str, expr: str) -> list[str]:
    out: list[str] = []
    for item in body.split(","):
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise InvalidRequest("hostlist", f"bad range {item!r} in {expr!r}", "", "")
        if not sep:
            out.append(lo)
            continue
        width = len(lo)
        start, end = int(lo), int(hi)
        if end < start or end - start > MAX_HOSTS:
            raise InvalidRequest("hostlist", f"bad range {item!r} in {expr!r}", "", "")
        out.extend(str(n).zfill(width) for n in range(start, end + 1))
    return out


def _expand_one(name: str, expr: str) -> list[str]:
    m = _BRACKET_RE.search(name)
    if not m:
        return [name]
    head, tail = name[:m.start()], name[m.end():]
    return [head + value + rest for value in _expand_ranges(m.group(1), expr)
            for rest in _expand_one(tail, expr)]


def expand_hostlist(expr: str) -> list[str]:
    """Host names in Slurm's order; empty for "" or "(null)"."""
    expr = (expr or "").strip()
    if expr in ("", "(null)", "None"):
        return []
    hosts: list[str] = []
    for part in _split_top_level(expr):
        hosts.extend(_expand_one(part, expr))
    return hosts
