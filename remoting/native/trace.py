"""Trace what a CUDA application uses, against NVIDIA's real driver (run it on a GPU node):

    python -m rgpu.remoting.native.trace [-o REPORT] -- app args...

The application runs with rgpu's trace libraries (trace/libcuda.so.1, trace/libnvidia-ml.so.1)
first on LD_LIBRARY_PATH: each forwards every call to NVIDIA's library and counts it, including
the functions the CUDA runtime resolves through cuGetProcAddress and the slots of the driver's
private export tables. The report lists each entry point with its count, summed over every
process of the run, and marks those rgpu does not remote yet: attach it to a request for what
your application lacks.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from rgpu.errors import ConfigError
from rgpu.remoting.native import build
from rgpu.remoting.native.apispec import parse_spec

_LINE = re.compile(r"^(cuda|nvml) (\d+) (\S+)(.*)$")


def rgpu_status() -> dict[str, str]:
    """Each spec'd entry point's mode in rgpu (sync, async, manual, local, unsupported)."""
    status: dict[str, str] = {}
    for name in ("cuda.spec", "nvml.spec"):
        for f in parse_spec(build.SPEC / name).functions:
            status[f.name] = f.mode
    return status


def merge(files: list[Path]) -> tuple[Counter[tuple[str, str]], set[str], list[str]]:
    """Counts by (library, entry point), the export tables asked for, and the programs seen."""
    counts: Counter[tuple[str, str]] = Counter()
    tables: set[str] = set()
    programs: list[str] = []
    for path in files:
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("# rgpu trace"):
                programs.append(line.split(" ", 5)[-1])
                continue
            if line.startswith("table "):
                tables.add(line[6:])
                continue
            m = _LINE.match(line)
            if not m:
                continue
            lib, count, name, rest = m.groups()
            if name == "export":
                name = "export" + rest.split("(")[0].rstrip()
            counts[(lib, name)] += int(count)
    return counts, tables, programs


# How rgpu's libcuda answers each private export table (src/cuda_export.c): "all" slots, the
# listed slots only, or none (NOT_FOUND, or tables whose every slot returns NOT_SUPPORTED).
EXPORT_TABLES: dict[str, tuple[str, set[int] | None]] = {
    "6bd5fb6c-5bf4-e74a-8987-d93912fd9df9": ("CUDART_INTERFACE", {1, 2, 6, 7, 8, 12}),
    "42d85a81-23f6-cb47-8298-f6e78a3aecdc": ("TOOLS_TLS", None),
    "a094798c-2e74-2e74-93f2-0800200c0a66": ("TOOLS_RUNTIME_CALLBACK_HOOKS", None),
    "c693336e-1121-df11-a8c3-68f355d89593": ("CONTEXT_LOCAL_STORAGE", None),
    "d4082055-bde6-704b-8d34-ba123c66e1f2": ("INTEGRITY_CHECK", None),
    "263e8860-7cd2-6143-92f6-bbd5006dfa7e": ("CONTEXT_CHECKS", {1, 2, 3}),
    "21318c60-9714-3248-8ca6-41ff7324c8f2": ("TOOLS_CONTEXT", {4, 39, 51}),
    "1734dc26-800d-4745-8726-c0f1e7dd8bca": ("1734dc26", set()),
    "69a28e9f-2449-8b47-b030-c5da330ea4e9": ("69a28e9f", set()),
}


def export_status(name: str) -> str:
    """'answered in the client' or 'NOT ANSWERED' for an 'export <uuid> slot N' entry."""
    parts = name.split()
    if len(parts) >= 4 and parts[1] == "INTEGRITY_CHECK":
        return "answered in the client"
    if len(parts) < 4 or parts[2] != "slot":
        return "NOT ANSWERED"
    known = EXPORT_TABLES.get(parts[1])
    if known is None:
        return "NOT ANSWERED"
    slots = known[1]
    return "answered in the client" if slots is None or int(parts[3]) in slots else "NOT ANSWERED"


def _base(name: str) -> str:
    return re.sub(r"_(ptds|ptsz)$", "", name)


def render(counts: Counter[tuple[str, str]], tables: set[str], programs: list[str]) -> str:
    status = rgpu_status()
    lines = [f"# rgpu trace: {len(programs)} process(es): {', '.join(sorted(set(programs)))}",
             "# count  entry point  [rgpu: how it is served]"]
    missing = []
    for (lib, name), n in sorted(counts.items(), key=lambda kv: (kv[0][0], -kv[1], kv[0][1])):
        if name.startswith("export"):
            how = export_status(name)
            if how == "NOT ANSWERED":
                missing.append(name)
        else:
            mode = status.get(name) or status.get(_base(name))
            if mode is None and lib == "cuda":
                # cuGetProcAddress labels carry the base name: any versioned variant in the spec.
                mode = next((m for s, m in status.items() if s.startswith(name + "_v") and m != "unsupported"), None)
            how = "NOT REMOTED" if mode in (None, "unsupported") else str(mode)
            if how == "NOT REMOTED":
                missing.append(name)
        lines.append(f"{lib} {n:>9}  {name}  [{how}]")
    for t in sorted(tables):
        lines.append(f"table {t}")
    lines.append(f"# {len(missing)} entry point(s) used that rgpu does not remote: {', '.join(missing) or 'none'}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-o", "--output", type=Path, help="write the report here (default: stderr)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- app args...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("name the application to trace: python -m rgpu.remoting.native.trace -- app args")
    try:
        libs = build.ensure_built()
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    trace_dir = libs.folder / "trace"
    if not (trace_dir / "libcuda.so.1").exists():
        print(f"rgpu: trace: {trace_dir} has no trace libraries (rebuild with "
              "`python -m rgpu.remoting.native.build --force`)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="rgpu-trace-") as tmp:
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(trace_dir), env.get("LD_LIBRARY_PATH", "")) if p)
        env["RGPU_TRACE_OUT"] = str(Path(tmp) / "trace-%p.txt")
        try:
            rc = subprocess.call(command, env=env)
        except OSError as exc:
            print(f"rgpu: trace: cannot run {command[0]}: {exc}", file=sys.stderr)
            return 127
        counts, tables, programs = merge(sorted(Path(tmp).glob("trace-*.txt")))
    report = render(counts, tables, programs)
    if args.output:
        args.output.write_text(report)
        print(f"rgpu: trace: report in {args.output} ({len(counts)} entry points)", file=sys.stderr)
    else:
        sys.stderr.write(report)
    return rc


if __name__ == "__main__":
    sys.exit(main())
