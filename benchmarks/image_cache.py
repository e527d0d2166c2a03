"""A worker's module image cache on a process's first start: storing N images (each hashed, written,
its facts written, the cache kept within its bound), as PyTorch's first process on a GPU node does
with about 6,000 fatbins. Prints the seconds to store them all, per image, and how many times the
cache was scanned for eviction.

    python benchmarks/image_cache.py [--images 6292] [--mib 1400] [--bound-gib 16]

Images are random bytes (the cost does not depend on what they hold); the folder is a temporary one
under $TMPDIR, removed afterwards.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rgpu.remoting.datapath.worker.image_cache import ImageCache  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=6292, help="images stored (PyTorch 2.14's CUDA wheels: 6,292)")
    parser.add_argument("--mib", type=int, default=1400, help="their size together (those wheels: 1,404 MiB)")
    parser.add_argument("--bound-gib", type=float, default=16.0, help="image_cache_bytes (the dispatcher's default: 16)")
    args = parser.parse_args()
    size = max(64, (args.mib << 20) // max(args.images, 1))
    root = tempfile.mkdtemp(prefix="rgpu-image-cache-bench-")
    try:
        cache = ImageCache(root, os.getuid(), int(args.bound_gib * (1 << 30)))
        scans = 0
        entries = cache.entries

        def counted() -> list:  # type: ignore[type-arg]
            nonlocal scans
            scans += 1
            return entries()
        cache.entries = counted  # type: ignore[method-assign]
        pieces = [os.urandom(size) for _ in range(min(args.images, 64))]
        images = [i.to_bytes(8, "little") + pieces[i % len(pieces)][8:] for i in range(args.images)]
        digests = [hashlib.sha256(image).digest() for image in images]
        started = time.perf_counter()
        for image, digest in zip(images, digests):
            if not cache.put(digest, image):
                sys.exit("image_cache benchmark: a store failed (see the log line above)")
        took = time.perf_counter() - started
        print(f"stored {args.images} images of {size:,} bytes ({args.images * size / 1e9:.2f} GB) in {took:.2f} s "
              f"({took / max(args.images, 1) * 1e3:.2f} ms each); cache scanned {scans} times")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
