"""The GPU node's module image cache: images the workers of one dispatcher received, by SHA-256,
so a library's kernels cross the wire once per node and user instead of once per process.

Layout: ROOT/uid-<uid>/<sha256 hex> (ROOT is the session server's runtime folder's `images`).
An image of one user is never served to another. Files are written to a temp name and renamed;
the bytes are hashed again before every use (a corrupt or planted file is ignored and removed).
The whole cache is bounded: after a store, the least recently used images (by mtime, touched on
every hit) go until it fits. Any failure of the cache (disk full, permissions) leaves the load on
the byte path: one log line, never a failed load.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("rgpu.worker")

HEX_DIGITS = frozenset("0123456789abcdef")
# How a load names its image (cuda_module.c): the bytes, only their SHA-256, or both (cache them).
IMAGE_BYTES, IMAGE_BY_HASH, IMAGE_BYTES_TO_CACHE = 0, 1, 2
DEFAULT_BOUND = 4 << 30


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


# ------------------------------------------------------------------ I/O

class ImageCache:
    def __init__(self, root: str, uid: object, bound: int) -> None:
        folder = user_folder(uid)
        self.root = Path(root) if root else None
        self.folder = self.root / folder if self.root is not None and folder else None
        self.bound = bound
        self.failed = False   # one log line per worker, then silence

    @property
    def enabled(self) -> bool:
        return self.folder is not None and self.bound > 0

    def _warn(self, what: str, exc: OSError) -> None:
        if not self.failed:
            log.warning("rgpu: image cache: cannot %s in %s (%s); images are sent whole (check the "
                        "dispatcher's runtime folder: free space and permissions)", what, self.folder,
                        exc.strerror or exc)
        self.failed = True

    def get(self, digest: bytes) -> bytes | None:
        """The cached image with this SHA-256, verified; None if absent or corrupt (then removed)."""
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
                data = f.read()
        except OSError as exc:
            self._warn("read an image", exc)
            return None
        if hashlib.sha256(data).digest() != digest:
            log.warning("rgpu: image cache: %s does not match its SHA-256; removed, the image is sent again", path)
            try:
                path.unlink()
            except OSError:
                pass
            return None
        try:
            os.utime(path)   # most recently used
        except OSError:
            pass
        return data

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
                os.replace(tmp, path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        except OSError as exc:
            self._warn("store an image", exc)
            return False
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
                out.append(Entry(f.path, st.st_size, st.st_mtime))
        return out

    def evict(self, keep: str = "") -> None:
        try:
            for path in evictions(self.entries(), self.bound, keep):
                Path(path).unlink(missing_ok=True)
        except OSError as exc:
            self._warn("evict images", exc)
