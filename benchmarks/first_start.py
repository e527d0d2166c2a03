"""A process's first start through rgpu: every module image of a set of CUDA libraries loaded, as
cudart does for PyTorch at start-up (about 6,000 fatbins), first on a cold GPU node (empty image
cache, no remembered digests), then again in a second process (both warm). Prints the seconds each
process took to load them all and where the worker's time went (RGPU_WORKER_PROFILE's
`load_steps`: the image from the wire or the cache, counting its variables, the driver's load).

    python benchmarks/first_start.py --libs /path/to/site-packages/torch/lib [--libs DIR ...]
        [--backend emulated|cuda] [--limit N]

The images are the `.nv_fatbin` sections of the shared libraries under each --libs folder, split
into their fatbin containers (what cudart hands cuLibraryLoadData); the client maps the libraries
read-only, as the dynamic loader does, so its digest memo applies. The emulated backend (CPU only)
measures what rgpu adds to a load; `--backend cuda` adds the real driver's load behind it, and first
runs the same loads on NVIDIA's driver alone ("local") in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
FATBIN_MAGIC = 0xBA55ED50


def fatbin_section(path: Path) -> tuple[int, int] | None:
    """(file offset, size) of an ELF shared library's .nv_fatbin section, or None."""
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2:
            return None
        shoff, = struct.unpack_from("<Q", head, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", head, 0x3A)
        f.seek(shoff)
        table = f.read(shentsize * shnum)
        headers = [struct.unpack_from("<IIQQQQ", table, i * shentsize) for i in range(shnum)]
        names_at, names_size = headers[shstrndx][4], headers[shstrndx][5]
        f.seek(names_at)
        names = f.read(names_size)
    for name_at, _kind, _flags, _addr, offset, size in headers:
        if names[name_at:names.index(b"\0", name_at)] == b".nv_fatbin":
            return offset, size
    return None


def containers(section: bytes) -> Iterator[tuple[int, int]]:
    """(offset, length) of each fatbin container in a .nv_fatbin section (8-byte aligned)."""
    at = 0
    while at + 16 <= len(section):
        magic, _version, header_size, body_size = struct.unpack_from("<IHHQ", section, at)
        if magic != FATBIN_MAGIC:
            at += 8
            continue
        yield at, header_size + body_size
        at = (at + header_size + body_size + 7) & ~7


def find_images(folders: list[Path], limit: int) -> list[tuple[str, int, int]]:
    """(library, file offset, length) of each image, up to `limit` (0: all)."""
    images: list[tuple[str, int, int]] = []
    for folder in folders:
        for path in sorted(p for p in folder.rglob("*.so*") if p.is_file() and not p.is_symlink()):
            found = fatbin_section(path)
            if found is None:
                continue
            offset, size = found
            with open(path, "rb") as f:
                f.seek(offset)
                section = f.read(size)
            images.extend((str(path), offset + at, length) for at, length in containers(section))
    return images[:limit] if limit else images


def child(listing: Path) -> None:
    """Through rgpu's libcuda.so.1: load every image straight from its library's read-only mapping."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    prot_read, map_private = 1, 2
    images = json.loads(listing.read_text())
    started = time.perf_counter()
    lib = ctypes.CDLL("libcuda.so.1")
    ctx, library = ctypes.c_void_p(), ctypes.c_void_p()
    for name, *args in (("cuInit", 0), ("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), 0)):
        if getattr(lib, name)(*args) != 0:
            raise SystemExit(f"first_start: {name} failed")
    lib.cuCtxSetCurrent(ctx)
    bases: dict[str, int] = {}
    failed = loaded_bytes = 0
    for path, offset, length in images:
        if path not in bases:
            fd = os.open(path, os.O_RDONLY)
            bases[path] = libc.mmap(None, os.fstat(fd).st_size, prot_read, map_private, fd, 0)
            os.close(fd)
        r = lib.cuLibraryLoadData(ctypes.byref(library), ctypes.c_void_p(bases[path] + offset),
                                  None, None, 0, None, None, 0)
        failed += r != 0
        loaded_bytes += length
    took = time.perf_counter() - started
    print(json.dumps({"seconds": took, "images": len(images), "bytes": loaded_bytes, "failed": failed}))


def load_steps(profile_dir: Path) -> dict[str, list[int]]:
    """The workers' load_steps (RGPU_WORKER_PROFILE) summed: step -> [calls, ns, image bytes]."""
    total: dict[str, list[int]] = {}
    for path in profile_dir.glob("worker-*.json"):
        for step, figures in json.loads(path.read_text()).get("load_steps", {}).items():
            entry = total.setdefault(step, [0, 0, 0])
            entry[0] += figures["calls"]
            entry[1] += figures["ns"]
            entry[2] += figures["bytes"]
    return total


def run_local(listing: Path) -> dict[str, object]:
    """The same loads on NVIDIA's driver, no rgpu on the library path (the baseline on a GPU machine)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RGPU_", "UCX_"))}
    env.pop("LD_PRELOAD", None)
    done = subprocess.run([sys.executable, __file__, "--child", str(listing)], capture_output=True, text=True,
                          timeout=3600, check=False, env=env)
    if done.returncode != 0:
        raise SystemExit(f"first_start: the local process failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    result["load_steps"] = {}
    return result


def run_process(label: str, env: dict[str, str], listing: Path, profile_dir: Path) -> dict[str, object]:
    profile_dir.mkdir()
    os.environ["RGPU_WORKER_PROFILE"] = str(profile_dir)   # the worker's, which the session server starts
    try:
        done = subprocess.run([sys.executable, __file__, "--child", str(listing)], capture_output=True, text=True,
                              timeout=3600, check=False, env=env)
    finally:
        os.environ.pop("RGPU_WORKER_PROFILE", None)
    if done.returncode != 0:
        raise SystemExit(f"first_start: the {label} process failed (exit {done.returncode}):\n"
                         f"{done.stdout}\n{done.stderr[-3000:]}")
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    deadline = time.monotonic() + 30   # the worker writes its profile as its session ends
    while not list(profile_dir.glob("worker-*.json")) and time.monotonic() < deadline:
        time.sleep(0.2)
    result["load_steps"] = load_steps(profile_dir)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--libs", type=Path, action="append", required=True,
                        help="a folder of CUDA libraries (searched recursively for .so files)")
    parser.add_argument("--backend", choices=("emulated", "cuda"), default="emulated")
    parser.add_argument("--limit", type=int, default=0, help="load only the first N images (0: all)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)

    images = find_images(args.libs, args.limit)
    if not images:
        raise SystemExit(f"first_start: no fatbin images in {', '.join(map(str, args.libs))}")
    total = sum(length for _p, _o, length in images)
    print(f"{len(images)} images, {total / 1e9:.2f} GB, from {len({p for p, _o, _l in images})} libraries")

    from rgpu.remoting.native.build import ensure_built
    sys.path.insert(0, str(HERE))
    from remoting import local_gpu, slice_env, start_session_server  # type: ignore[import-not-found]
    from copies import gpu_info  # type: ignore[import-not-found]

    work = Path(tempfile.mkdtemp(prefix="rgpu-first-start-"))
    try:
        libs = ensure_built()
        gpu = local_gpu() if args.backend == "cuda" else gpu_info("emulated")
        secret = os.urandom(32)
        server, address = start_session_server(gpu, secret, args.backend)   # its own, empty, image cache
        try:
            listing = work / "images.json"
            listing.write_text(json.dumps(images))
            base = {k: v for k, v in os.environ.items() if not k.startswith(("RGPU_", "UCX_"))}
            base.update(RGPU_DIGEST_MEMO=str(work / "image-digests"))
            env = slice_env(base, libs.folder, secret, address, gpu, "bench-first-start")
            results = {"local": run_local(listing)} if args.backend == "cuda" else {}
            results.update({label: run_process(label, env, listing, work / label) for label in ("cold", "warm")})
        finally:
            server.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    for label, result in results.items():
        print(f"\n{label}: {result['seconds']:.2f} s for {result['images']} images "
              f"({float(result['seconds']) / max(int(result['images']), 1) * 1e3:.2f} ms each), "  # type: ignore[arg-type]
              f"{result['failed']} refused")
        steps = result["load_steps"]
        for step, (calls, ns, size) in sorted(steps.items(), key=lambda kv: -kv[1][1]):  # type: ignore[union-attr]
            print(f"  {step:<40} {calls:>6} calls {ns / 1e9:8.2f} s" + (f"  {size / 1e9:.2f} GB" if size else ""))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(Path(sys.argv[2]))
    else:
        sys.exit(main())
