"""Read the client library's call profile (RGPU_CLIENT_STATS) and print it by operation name.

    RGPU_CLIENT_STATS=/tmp/prof flexrun -n 1 -- app ...
    python -m rgpu.remoting.native.client_stats /tmp/prof.*

Each process of the application writes PATH.<pid> at exit: per remoted operation, the
synchronous calls (each one a round trip to the worker), the time they waited for their
replies, and the asynchronous calls (pipelined, no wait). Calls answered in the client (caches,
local state) do not appear. Synchronous calls with the largest total wait are what slows an
application down through rgpu.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from rgpu.errors import ConfigError
from rgpu.remoting.native.generated import api_gen


@dataclass
class OpProfile:
    name: str
    sync_calls: int = 0
    sync_wait_ns: int = 0
    async_calls: int = 0


def parse(text: str, source: str = "profile") -> tuple[dict[int, OpProfile], int]:
    """(per-op profile, sends) from one PATH.<pid> file's text."""
    ops: dict[int, OpProfile] = {}
    sends = 0
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("#"):
            if "(sends " in line:
                sends = int(line.rsplit("(sends ", 1)[1].rstrip(")"))
            continue
        fields = line.split()
        if len(fields) != 4 or not all(f.isdigit() for f in fields):
            raise ConfigError("client-stats", f"{source} line {number} is not 'op sync wait_ns async': {line[:60]!r}",
                              fix="pass the PATH.<pid> files the client library wrote")
        op, sync, wait, async_ = (int(f) for f in fields)
        ops[op] = OpProfile(api_gen.OPS.get(op, f"op {op}"), sync, wait, async_)
    return ops, sends


def images(text: str) -> dict[str, int]:
    """The module image line of one PATH.<pid> file: loads, cache_hits (loads the GPU node's image
    cache served: no image bytes sent) and bytes_sent (image bytes that crossed the wire)."""
    for line in text.splitlines():
        if line.startswith("# module images:"):
            words = line.split(":", 1)[1].split()
            return {k: int(v) for k, v in zip(words[::2], words[1::2]) if v.isdigit()}
    return {"loads": 0, "cache_hits": 0, "bytes_sent": 0}


def merge(profiles: list[dict[int, OpProfile]]) -> dict[int, OpProfile]:
    total: dict[int, OpProfile] = {}
    for ops in profiles:
        for op, p in ops.items():
            t = total.setdefault(op, OpProfile(p.name))
            t.sync_calls += p.sync_calls
            t.sync_wait_ns += p.sync_wait_ns
            t.async_calls += p.async_calls
    return total


def subtract(after: dict[int, OpProfile], before: dict[int, OpProfile]) -> dict[int, OpProfile]:
    """What happened between two snapshots of one process (rgpuClientStatsWrite): `after` less `before`."""
    out: dict[int, OpProfile] = {}
    for op, a in after.items():
        b = before.get(op, OpProfile(a.name))
        d = OpProfile(a.name, a.sync_calls - b.sync_calls, a.sync_wait_ns - b.sync_wait_ns, a.async_calls - b.async_calls)
        if d.sync_calls or d.async_calls:
            out[op] = d
    return out


def render(ops: dict[int, OpProfile], sends: int, top: int = 25) -> str:
    rows = sorted(ops.values(), key=lambda p: (p.sync_wait_ns, p.async_calls), reverse=True)[:top]
    sync_total = sum(p.sync_calls for p in ops.values())
    wait_total = sum(p.sync_wait_ns for p in ops.values())
    async_total = sum(p.async_calls for p in ops.values())
    lines = [f"round trips {sync_total} (waited {wait_total / 1e6:.1f} ms), pipelined calls {async_total}, sends {sends}",
             f"{'operation':<44} {'sync':>9} {'wait ms':>10} {'us/call':>8} {'async':>9}"]
    for p in rows:
        per = p.sync_wait_ns / p.sync_calls / 1e3 if p.sync_calls else 0.0
        lines.append(f"{p.name:<44} {p.sync_calls:>9} {p.sync_wait_ns / 1e6:>10.1f} {per:>8.1f} {p.async_calls:>9}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--between", action="store_true",
                        help="two snapshots of one process (cuGetProcAddress(\"rgpuClientStatsWrite\")(suffix) writes "
                             "PATH.<pid>.<suffix>): print what happened between them")
    args = parser.parse_args(argv)
    if args.between:
        if len(args.files) != 2:
            print("rgpu: client-stats: --between takes exactly two snapshot files (earlier, later)", file=sys.stderr)
            return 2
        try:
            (before, sent_before), (after, sent_after) = (parse(f.read_text(), str(f)) for f in args.files)
        except (OSError, ConfigError) as exc:
            print(exc if isinstance(exc, ConfigError) else f"rgpu: client-stats: cannot read {exc.filename} ({exc.strerror})",
                  file=sys.stderr)
            return 2
        print(render(subtract(after, before), sent_after - sent_before, args.top))
        return 0
    profiles, sends = [], 0
    loaded = {"loads": 0, "cache_hits": 0, "bytes_sent": 0}
    try:
        for f in args.files:
            text = f.read_text()
            ops, s = parse(text, str(f))
            profiles.append(ops)
            sends += s
            for k, v in images(text).items():
                loaded[k] = loaded.get(k, 0) + v
    except (OSError, ConfigError) as exc:
        print(exc if isinstance(exc, ConfigError) else f"rgpu: client-stats: cannot read {exc.filename} ({exc.strerror})",
              file=sys.stderr)
        return 2
    print(render(merge(profiles), sends, args.top))
    print(f"module images: {loaded['loads']} loaded, {loaded['cache_hits']} from the GPU node's cache, "
          f"{loaded['bytes_sent']} bytes sent, {loaded.get('bytes_hashed', 0)} bytes hashed here in "
          f"{loaded.get('hash_ns', 0) / 1e6:.0f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
