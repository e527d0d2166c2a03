"""Refresh the committed facts in spec/ from a CUDA toolkit's headers (a maintainer's tool).

The build never needs cuda.h: CPU-only nodes have no CUDA toolkit. What the client library must
know about the driver's ABI (exported names, which versioned symbol `cuGetProcAddress` returns
for a requested CUDA version, enum values, error names) is extracted once from the headers by
this tool and committed as plain-text tables:

    python -m rgpu.remoting.native.refresh_from_cuda_h /usr/local/cuda/include

Review the diff; then regenerate with `python -m rgpu.remoting.native.generate`.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
from pathlib import Path

SPEC_DIR = Path(__file__).parent / "spec"

# Enums whose values the emulated backend, the generator or the tests use by name.
ENUMS = ("cudaError_enum", "CUdevice_attribute_enum", "CUpointer_attribute_enum",
         "CUfunction_attribute_enum", "CUjit_option_enum", "CUlimit_enum", "CUmemorytype_enum",
         "CUdriverProcAddress_flags_enum", "CUdriverProcAddressQueryResult_enum",
         "CUstreamCaptureStatus_enum", "CUctx_flags_enum", "CUmoduleLoadingMode_enum",
         "CUlaunchAttributeID_enum", "CUfunc_cache_enum", "CUmemPool_attribute_enum")


def preprocess(include: Path, header: str, *defines: str) -> str:
    cmd = ["gcc", "-E", "-P", f"-I{include}", *[f"-D{d}" for d in defines], "-x", "c", "-"]
    done = subprocess.run(cmd, input=f"#include <{header}>\n", capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"rgpu: refresh: {' '.join(cmd)} failed ({done.stderr.strip()[:500]})")
    return done.stdout


def exported_symbols(include: Path) -> list[str]:
    """Every `cu*` entry point the driver exports: current, legacy (_v1) and per-thread ones."""
    names: set[str] = set()
    for defines in ((), ("__CUDA_API_VERSION_INTERNAL",), ("CUDA_API_PER_THREAD_DEFAULT_STREAM",)):
        text = preprocess(include, "cuda.h", *defines) + preprocess(include, "cudaProfiler.h", *defines)
        names.update(re.findall(r"\bCUresult\s+(cu[A-Za-z0-9_]+)\s*\(", text))
    return sorted(names)


def proc_versions(include: Path) -> list[tuple[str, int, str]]:
    text = preprocess(include, "cudaTypedefs.h", "__CUDA_API_VERSION_INTERNAL")
    out = set()
    for m in re.finditer(r"\bPFN_(cu[A-Za-z0-9_]+?)_v(\d+)(_ptds|_ptsz)?\)", text):
        out.add((m.group(1), int(m.group(2)), m.group(3) or ""))
    return sorted(out)


def enums(include: Path) -> list[tuple[str, str, int]]:
    text = preprocess(include, "cuda.h")
    rows: list[tuple[str, str, int]] = []
    for enum in ENUMS:
        m = re.search(r"typedef\s+enum\s+" + enum + r"\s*\{(.*?)\}\s*(\w+)\s*;", text, re.DOTALL)
        if not m:
            sys.exit(f"rgpu: refresh: enum {enum} not found in cuda.h")
        body, typename = m.group(1), m.group(2)
        value = -1
        known: dict[str, int] = {}
        for item in body.split(","):
            item = item.strip()
            if not item:
                continue
            name, _, expr = item.partition("=")
            name = name.strip()
            if expr.strip():
                expr = expr.strip()
                for k, v in known.items():
                    expr = re.sub(rf"\b{k}\b", str(v), expr)
                value = int(eval(expr.replace("U", "").replace("L", ""), {"__builtins__": {}}))
            else:
                value += 1
            known[name] = value
            rows.append((typename, name, value))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("include", type=Path, help="the CUDA include folder, e.g. /usr/local/cuda/include")
    args = parser.parse_args(argv)
    found = re.search(r"#define\s+CUDA_VERSION\s+(\d+)", (args.include / "cuda.h").read_text())
    if found is None:
        raise SystemExit(f"rgpu: refresh_from_cuda_h: {args.include / 'cuda.h'} defines no CUDA_VERSION "
                         "(is this a CUDA include folder?)")
    version = found.group(1)
    head = f"# Extracted from CUDA {version} headers by refresh_from_cuda_h.py; do not edit by hand.\n"
    syms = exported_symbols(args.include)
    (SPEC_DIR / "cuda_exports.txt").write_text(head + "\n".join(syms) + "\n")
    procs = proc_versions(args.include)
    plain: dict[str, list[int]] = collections.defaultdict(list)
    for base, ver, suffix in procs:
        if not suffix:
            plain[base].append(ver)
    lines = ["# base-name  cuda-version  symbol   (cuGetProcAddress: newest version <= requested)"]
    for base, ver, suffix in procs:
        versions = sorted(plain[base])
        if suffix:
            # A per-thread variant belongs to the newest plain version at or below its own.
            idx = max(i for i, v in enumerate(versions) if v <= ver)
        else:
            idx = versions.index(ver)
        symbol = (base if idx == 0 else f"{base}_v{idx + 1}") + suffix
        if symbol not in syms:
            sys.exit(f"rgpu: refresh: {base} v{ver}{suffix} maps to {symbol}, which cuda.h does not declare")
        lines.append(f"{base} {ver} {symbol}")
    (SPEC_DIR / "cuda_procs.txt").write_text(head + "\n".join(lines) + "\n")
    rows = enums(args.include)
    (SPEC_DIR / "cuda_enums.txt").write_text(head + "\n".join(f"{t} {n} {v}" for t, n, v in rows) + "\n")
    print(f"{len(syms)} symbols, {len(procs)} proc versions, {len(rows)} enum values (CUDA {version})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
