"""Fatbin containers as the driver reads them: the entries of a container chain (PTX or ELF, per
compute capability, maybe compressed) and which of them a device of a given capability can load.
Pure: bytes in. The worker counts the memory an image's variables take from these
(worker/module_footprint.py); the emulated backend refuses, as the driver does, a fatbin with
nothing its device can load."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

FATBIN_MAGIC = 0xBA55ED50
# A fatbin entry's kind, and the flags of its compression (seen from nvcc 12.x/13.x:
# `--compress-mode=speed` writes LZ4 blocks, the default and `size` Zstandard frames).
ENTRY_PTX, ENTRY_ELF = 1, 2
FLAG_LZ4, FLAG_ZSTD = 0x2000, 0x8000


class ImageUnreadable(ValueError):
    """The image cannot be read as what it claims to be; the message says why (one line)."""


@dataclass(frozen=True)
class FatbinEntry:
    kind: int            # ENTRY_PTX or ENTRY_ELF (others are skipped)
    arch: int            # compute capability as major * 10 + minor (90 for sm_90)
    flags: int
    payload: bytes       # as stored (maybe compressed)
    expanded_size: int   # size once decompressed (0: not compressed)


def fatbin_entries(image: bytes) -> Iterator[FatbinEntry]:
    """The entries of a fatbin (one or more containers back to back)."""
    at = 0
    while at + 16 <= len(image):
        magic, _version, header_size, body_size = struct.unpack_from("<IHHQ", image, at)
        if magic != FATBIN_MAGIC:
            if at == 0:
                raise ImageUnreadable("not a fatbin")
            break   # padding or trailing bytes after the last container
        if header_size < 16 or at + header_size + body_size > len(image):
            raise ImageUnreadable("a fatbin container is longer than the image")
        entry_at, end = at + header_size, at + header_size + body_size
        while entry_at + 16 <= end:
            kind, _v, entry_header, payload_size = struct.unpack_from("<HHIQ", image, entry_at)
            if entry_header < 16 or entry_at + entry_header + payload_size > end:
                raise ImageUnreadable("a fatbin entry is longer than its container")
            arch = flags = expanded = 0
            stored = payload_size
            if entry_header >= 64:
                stored, = struct.unpack_from("<I", image, entry_at + 16)
                arch, = struct.unpack_from("<I", image, entry_at + 28)
                flags, = struct.unpack_from("<Q", image, entry_at + 40)
                expanded, = struct.unpack_from("<Q", image, entry_at + 56)
            if not flags & (FLAG_LZ4 | FLAG_ZSTD) or not 0 < stored <= payload_size:
                stored = payload_size
            body = image[entry_at + entry_header:entry_at + entry_header + stored]
            yield FatbinEntry(kind, arch, flags, body, expanded if flags & (FLAG_LZ4 | FLAG_ZSTD) else 0)
            entry_at += entry_header + payload_size
        at = end
        if at + 4 <= len(image) and struct.unpack_from("<I", image, at)[0] != FATBIN_MAGIC:
            at = (end + 7) & ~7   # containers may be padded to 8 bytes


def loadable(entry: FatbinEntry, capability: tuple[int, int]) -> bool:
    """Whether the driver could load this entry on a device of this compute capability."""
    major, minor = capability
    if entry.kind == ENTRY_ELF:
        return entry.arch // 10 == major and entry.arch % 10 <= minor
    if entry.kind == ENTRY_PTX:
        return entry.arch <= major * 10 + minor
    return False
