"""The GPU node's module image cache: images the workers of one dispatcher received, by SHA-256,
so a library's kernels cross the wire once per node and user instead of once per process.

Layout: ROOT/uid-<uid>/<sha256 hex> (ROOT is the session server's runtime folder's `images`),
and beside each image its facts, <sha256 hex>.facts: the file's identity (inode, size, mtime) when
a worker last checked its hash, and the device memory its variables take per compute capability
(module_footprint.py). An image of one user is never served to another. Files are written to a
temp name and renamed. An image is hashed when it is stored and whenever its file no longer
matches its facts (replaced, changed in place, or no facts yet): a corrupt or planted file is
removed, never served. A file that matches is not hashed again, so a warm cache costs a read,
not a hash, per load (PyTorch loads GBs of fatbins per process). The whole cache is bounded:
when a worker's count of it passes the bound (a scan, plus what it stored since; rescanned after
each 1/16 of the bound it stores, so the others' images count too), the least recently used images
(by the facts' mtime, touched on every hit) go until it fits. Any failure of the cache (disk full,
permissions) leaves the load on the byte path: one log line, never a failed load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("rgpu.worker")

HEX_DIGITS = frozenset("0123456789abcdef")
# How a load names its image (cuda_module.c): the bytes, only their SHA-256, or both (cache them).
IMAGE_BYTES, IMAGE_BY_HASH, IMAGE_BYTES_TO_CACHE = 0, 1, 2
# Or'ed into it: the client wants the function table (always for modules; for libraries only
# where it has several slices, to match kernels between them, library_mirror.c).
IMAGE_WANT_TABLE = 0x80
DEFAULT_BOUND = 16 << 30
FACTS_SUFFIX = ".facts"
THRASH_SECONDS = 600   # evicting an image used this recently means the cache is too small for its users
# A worker scans the whole cache (a stat per image) when what it knows of the cache's size passes the
# bound, and after storing this fraction of the bound since its last scan: other workers of the node
# store too, and their images are seen at the next scan. Scanning after every store was quadratic:
# a PyTorch process stores about 6,000 images on its first start (benchmarks/image_cache.py, 6,292
# images of 1.47 GB on a 2-core machine: 288 s before, 4.5-5.8 s with this).
RESCAN_FRACTION = 16


# ------------------------------------------------------------------ pure: naming and eviction

def user_folder(uid: object) -> str | None:
    """The cache folder of a client uid; None (no caching) for anything but a plain uid."""
    if not isinstance(uid, int) or isinstance(uid, bool) or not 0 <= uid < 2**32:
        return None
    return f"uid-{uid}"


def image_name(digest: bytes) -> str:
    if len(digest) != 32:
        raise ValueError(f"rgpu: image cache: a SHA-256 digest has 32 bytes, not {len(digest)}")
    return digest.hex()


def is_image_name(name: str) -> bool:
    return len(name) == 64 and set(name) <= HEX_DIGITS


@dataclass(frozen=True)
class Entry:
    path: str
    size: int
    last_used: float


def evictions(entries: list[Entry], bound: int, keep: str = "") -> list[str]:
    """The entries to remove, least recently used first, so the rest fit in `bound` bytes; `keep`
    (the image just stored) goes last, only if it alone exceeds the bound."""
    total = sum(e.size for e in entries)
    out: list[str] = []
    for e in sorted(entries, key=lambda e: (e.path == keep, e.last_used, e.path)):
        if total <= bound:
            break
        out.append(e.path)
        total -= e.size
    return out


def file_identity(st: os.stat_result) -> list[int]:
    """What tells one file apart from a replaced or rewritten one: inode, size, mtime (ns)."""
    return [st.st_ino, st.st_size, st.st_mtime_ns]


# ------------------------------------------------------------------ I/O

class ImageCache:
    def __init__(self, root: str, uid: object, bound: int) -> None:
        folder = user_folder(uid)
        self.root = Path(root) if root else None
        self.folder = self.root / folder if self.root is not None and folder else None
        self.bound = bound
        self.failed = False   # one log line per worker, then silence
        self.thrash_told = False
        self.scanned_bytes: int | None = None   # the cache's bytes at this worker's last scan (None: none yet)
        self.stored_since_scan = 0              # what this worker stored since

    @property
    def enabled(self) -> bool:
        return self.folder is not None and self.bound > 0

    def _warn(self, what: str, exc: OSError) -> None:
        if not self.failed:
            log.warning("rgpu: image cache: cannot %s in %s (%s); images are sent whole (check the "
                        "dispatcher's runtime folder: free space and permissions)", what, self.folder,
                        exc.strerror or exc)
        self.failed = True

    def get(self, digest: bytes) -> bytes | mmap.mmap | None:
        """The cached image with this SHA-256, verified; None if absent or corrupt (then removed).
        The hash is computed only when the file does not match the identity its facts recorded.
        The image comes as a private, copy-on-write mapping of the file: the driver reads it from
        the page cache, and no copy is made in this process (PyTorch loads GBs of images)."""
        if not self.enabled:
            return None
        assert self.folder is not None
        path = self.folder / image_name(digest)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._warn("read an image", exc)
            return None
        try:
            with os.fdopen(fd, "rb") as f:
                identity = file_identity(os.fstat(f.fileno()))
                if identity[1] == 0:
                    return None   # an empty file is no image (and cannot be mapped)
                data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as exc:
            self._warn("read an image", exc if isinstance(exc, OSError) else OSError(str(exc)))
            return None
        if self._facts(digest).get("identity") == identity:
            self._touch_facts(digest)   # most recently used
            return data
        if hashlib.sha256(data).digest() != digest:
            log.warning("rgpu: image cache: %s does not match its SHA-256; removed, the image is sent again", path)
            data.close()
            self._remove(path)
            return None
        self._write_facts(digest, {"identity": identity})   # what was known of an older file is not this one's
        return data

    def known_footprint(self, digest: bytes, key: str) -> int | None:
        """The footprint recorded for this cached image under `key` (capability and rule)."""
        value = self._facts(digest).get("footprints", {}).get(key) if self.enabled else None
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None

    def remember_footprint(self, digest: bytes, key: str, size: int) -> None:
        """Record the footprint of an image this cache holds (and checked) under `key`."""
        if not self.enabled:
            return
        facts = self._facts(digest)
        if "identity" not in facts:
            return   # facts of no checked file: nothing to attach it to
        facts.setdefault("footprints", {})[key] = size
        self._write_facts(digest, facts)

    def _facts_path(self, digest: bytes) -> Path:
        assert self.folder is not None
        return self.folder / (image_name(digest) + FACTS_SUFFIX)

    def _facts(self, digest: bytes) -> dict:  # type: ignore[type-arg]
        try:
            fd = os.open(self._facts_path(digest), os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as f:
                facts = json.loads(f.read(1 << 16))
        except (OSError, ValueError):
            return {}
        return facts if isinstance(facts, dict) else {}

    def _write_facts(self, digest: bytes, facts: dict) -> None:  # type: ignore[type-arg]
        path = self._facts_path(digest)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(facts, f)
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            self._warn("record an image's facts", exc)

    def _touch_facts(self, digest: bytes) -> None:
        try:
            os.utime(self._facts_path(digest), follow_symlinks=False)
        except OSError as exc:
            self._warn("record an image's use", exc)

    @staticmethod
    def _remove(path: Path) -> None:
        for p in (path, path.with_name(path.name + FACTS_SUFFIX)):
            try:
                p.unlink()
            except OSError:
                pass

    def put(self, digest: bytes, data: bytes) -> bool:
        """Store received bytes under their SHA-256 (verified here), then keep the cache in bound."""
        if not self.enabled or len(data) > self.bound or hashlib.sha256(data).digest() != digest:
            return False
        assert self.folder is not None and self.root is not None
        path = self.folder / image_name(digest)
        tmp = self.folder / f".{image_name(digest)}.{os.getpid()}.tmp"
        try:
            self.root.mkdir(mode=0o700, exist_ok=True)
            self.folder.mkdir(mode=0o700, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    identity = file_identity(os.fstat(f.fileno()))
                os.replace(tmp, path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        except OSError as exc:
            self._warn("store an image", exc)
            return False
        self._write_facts(digest, {"identity": identity})   # hashed above: checked
        self.stored_since_scan += len(data)
        if (self.scanned_bytes is None or self.scanned_bytes + self.stored_since_scan > self.bound
                or self.stored_since_scan >= self.bound // RESCAN_FRACTION):
            self.evict(keep=str(path))
        return True

    def entries(self) -> list[Entry]:
        out: list[Entry] = []
        assert self.root is not None
        for user in os.scandir(self.root):
            if not user.is_dir(follow_symlinks=False):
                continue
            for f in os.scandir(user.path):
                if not is_image_name(f.name) or not f.is_file(follow_symlinks=False):
                    continue
                try:
                    st = f.stat(follow_symlinks=False)
                except OSError:
                    continue
                try:   # used: its facts are rewritten on every hit
                    used = max(st.st_mtime, os.stat(f.path + FACTS_SUFFIX, follow_symlinks=False).st_mtime)
                except OSError:
                    used = st.st_mtime
                out.append(Entry(f.path, st.st_size, used))
        return out

    def evict(self, keep: str = "") -> None:
        try:
            entries = self.entries()
            used = {e.path: e.last_used for e in entries}
            gone = evictions(entries, self.bound, keep)
            going = set(gone)
            self.scanned_bytes = sum(e.size for e in entries if e.path not in going)
            self.stored_since_scan = 0
            recent = [p for p in gone if used[p] > time.time() - THRASH_SECONDS]
            if recent and not self.thrash_told:
                self.thrash_told = True
                log.warning("rgpu: image cache: images used in the last %d minutes were evicted to stay within "
                            "image_cache_bytes = %d: the images this node's users load do not fit, and are sent "
                            "again by every process; raise image_cache_bytes in the dispatcher's configuration "
                            "(a PyTorch process loads about 5 GB)", THRASH_SECONDS // 60, self.bound)
            for path in gone:
                self._remove(Path(path))
        except OSError as exc:
            self._warn("evict images", exc)
