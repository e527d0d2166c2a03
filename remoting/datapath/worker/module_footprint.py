"""The device memory a module image's data takes once loaded: its `__device__`, `__managed__` and
`__constant__` variables, read from the image itself so a load can be charged to the slice (and
refused) before the driver reserves it.

Pure: bytes in, a byte count out. What is counted:
- a cubin (ELF): the sizes of its `.nv.global*` sections (zero-initialised globals, which take no
  room in the file, and initialised ones) and `.nv.constant*` banks;
- PTX text (JIT-compiled by the driver): the sizes of its module-scope `.global` and `.const`
  variables (arrays by their dimensions, vector types by their width);
- a fatbin: the entries the driver could load on this device, the largest of them, decompressed
  (LZ4 or Zstandard) where the image is compressed. The driver runs a cubin of the same major
  compute capability and no higher minor where the fatbin has one, and JIT-compiles its PTX (of
  no higher capability) only where it has none: so the PTX counts only then. (PyTorch's fatbins
  carry PTX beside their sm_90 cubins; reading it was most of a module load's time.)
Kernel code is not counted (it is at most the image's size, which the frame limit bounds, and
lazy loading brings it in per kernel).

An image this module cannot read (a damaged ELF, a fatbin entry compressed in a way it does not
know) raises ImageUnreadable: a load whose memory cannot be counted is refused, never let through.
"""

from __future__ import annotations

import io
import mmap
import re
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

from rgpu.remoting.datapath.fatbin import (ENTRY_ELF, ENTRY_PTX, FATBIN_MAGIC, FLAG_LZ4, FLAG_ZSTD, FatbinEntry,
                                          ImageUnreadable, fatbin_entries, loadable)

__all__ = ["ENTRY_ELF", "ENTRY_PTX", "FATBIN_MAGIC", "FLAG_LZ4", "FLAG_ZSTD", "FatbinEntry", "ImageFootprints",
           "ImageUnreadable", "fatbin_entries", "image_data_bytes", "loadable", "parse_capability"]

ELF_MAGIC = b"\x7fELF"
# An entry that claims to expand beyond this is refused (a decompression bomb; real cubins of the
# largest libraries are tens of MiB). One entry is expanded at a time, so this bounds the host
# memory counting takes (the worker's frame bound is the same).
MAX_EXPANDED_BYTES = 256 << 20

_SHT_NOBITS = 8
_COUNTED_SECTIONS = (b".nv.global", b".nv.constant")


# ------------------------------------------------------------------ ELF (cubin)

def elf_data_bytes(image: bytes) -> int:
    """The bytes of an ELF cubin's global-variable and constant-bank sections."""
    if image[:4] != ELF_MAGIC or len(image) < 64:
        raise ImageUnreadable("not an ELF image")
    if image[4] != 2 or image[5] != 1:
        raise ImageUnreadable("not a 64-bit little-endian ELF (as every cubin is)")
    shoff, = struct.unpack_from("<Q", image, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", image, 0x3A)
    if shnum == 0:
        return 0
    if shentsize < 64 or shstrndx >= shnum or shoff + shnum * shentsize > len(image):
        raise ImageUnreadable("its section headers lie outside the image")

    def header(i: int) -> tuple[int, int, int, int]:
        name, kind, _flags, _addr, offset, size = struct.unpack_from("<IIQQQQ", image, shoff + i * shentsize)
        return name, kind, offset, size

    _, _, names_at, names_size = header(shstrndx)
    if names_at + names_size > len(image):
        raise ImageUnreadable("its section names lie outside the image")
    names = image[names_at:names_at + names_size]
    total = 0
    for i in range(shnum):
        name_at, kind, offset, size = header(i)
        end = names.find(b"\0", name_at)
        name = names[name_at:end if end >= 0 else len(names)]
        if not name.startswith(_COUNTED_SECTIONS):
            continue
        if kind != _SHT_NOBITS and offset + size > len(image):
            raise ImageUnreadable(f"section {name.decode(errors='replace')[:40]} lies outside the image")
        total += size
    return total


# ------------------------------------------------------------------ PTX

_PTX_TYPE_BYTES = {"b8": 1, "u8": 1, "s8": 1, "b16": 2, "u16": 2, "s16": 2, "f16": 2, "bf16": 2,
                   "b32": 4, "u32": 4, "s32": 4, "f32": 4, "f16x2": 4, "bf16x2": 4,
                   "b64": 8, "u64": 8, "s64": 8, "f64": 8, "b128": 16}
_PTX_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
# A module-scope variable: `[.visible|.weak|.common] .global|.const <attributes, alignment, type>
# name[dims]... [= init];` (`.extern` ones have no storage here and do not match).
_PTX_VARIABLE = re.compile(
    r"^[ \t]*(?:\.(?:visible|weak|common)\s+)*\.(?:global|const)\s+((?:[^;=\[\n]*?\s)?)"
    r"([A-Za-z_$%][\w$]*)\s*((?:\[\s*\d*\s*\]\s*)*)(=|;)", re.M)
_PTX_TYPE = re.compile(r"\.(v2|v4|v8)?\s*\.?(" + "|".join(sorted(_PTX_TYPE_BYTES, key=len, reverse=True)) + r")\b")


def _initializer_items(text: str, start: int) -> int:
    """How many scalar items the initializer at text[start:] (after '=') lists, up to its ';'."""
    end = text.find(";", start)
    body = text[start:end if end >= 0 else len(text)]
    return len([item for item in re.split(r"[{},]", body) if item.strip()])


def ptx_data_bytes(text: str) -> int:
    """The bytes of a PTX module's `.global` and `.const` variables."""
    text = _PTX_COMMENT.sub(" ", text)
    total = 0
    for match in _PTX_VARIABLE.finditer(text):
        qualifiers, _name, dims, after = match.groups()
        if re.search(r"\.(texref|samplerref|surfref)\b", qualifiers):
            continue
        typed = list(_PTX_TYPE.finditer(qualifiers))
        if not typed:
            raise ImageUnreadable(f"PTX variable {_name[:40]} has a type this worker cannot size")
        vector, base = typed[-1].groups()
        size = _PTX_TYPE_BYTES[base] * (int(vector[1:]) if vector else 1)
        counts = re.findall(r"\[\s*(\d*)\s*\]", dims)
        for i, count in enumerate(counts):
            if count:
                size *= int(count)
            elif i == 0 and after == "=":   # `name[] = {...}`: sized by its initializer
                size *= _initializer_items(text, match.end())
            else:
                raise ImageUnreadable(f"PTX variable {_name[:40]} has an array dimension without a size")
        total += size
    return total


# ------------------------------------------------------------------ fatbin

def expanded_payload(entry: FatbinEntry) -> bytes:
    """An entry's payload, decompressed where it is compressed."""
    if not entry.flags & (FLAG_LZ4 | FLAG_ZSTD):
        return entry.payload
    if not 0 < entry.expanded_size <= MAX_EXPANDED_BYTES:
        raise ImageUnreadable(f"a compressed fatbin entry claims {entry.expanded_size} bytes expanded")
    try:
        if entry.flags & FLAG_LZ4:
            import lz4.block
            data: bytes = lz4.block.decompress(entry.payload, uncompressed_size=entry.expanded_size)
        else:
            import zstandard
            # Streamed and cut at the size the header gives: a frame that claims a huge content
            # size never gets a buffer of that size.
            pieces, have = [], 0
            with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(entry.payload)) as reader:
                while have <= entry.expanded_size:
                    piece = reader.read(min(entry.expanded_size + 1 - have, 16 << 20))
                    if not piece:
                        break
                    pieces.append(piece)
                    have += len(piece)
            data = b"".join(pieces)
    except ImportError as exc:
        raise ImageUnreadable(f"its fatbin is compressed and {exc.name} is not installed "
                              f"(install rgpu's dependencies on the GPU node)") from None
    except Exception as exc:
        raise ImageUnreadable(f"a compressed fatbin entry does not decompress ({type(exc).__name__})") from None
    if len(data) != entry.expanded_size:
        raise ImageUnreadable("a compressed fatbin entry expands to another size than its header says")
    return data


def entry_data_bytes(entry: FatbinEntry) -> int:
    payload = expanded_payload(entry)
    if entry.kind == ENTRY_ELF:
        return elf_data_bytes(payload)
    return ptx_data_bytes(payload.rstrip(b"\0").decode("utf-8", "replace"))


# ------------------------------------------------------------------ any image

def image_data_bytes(image: bytes, capability: tuple[int, int]) -> int:
    """The device memory the data of a module image takes on a device of this capability."""
    if image[:4] == ELF_MAGIC:
        return elf_data_bytes(image)
    if len(image) >= 4 and struct.unpack_from("<I", image)[0] == FATBIN_MAGIC:
        entries = [e for e in fatbin_entries(image) if loadable(e, capability)]
        cubins = [e for e in entries if e.kind == ENTRY_ELF]
        return max((entry_data_bytes(e) for e in (cubins or entries)), default=0)
    # Anything else the driver takes is PTX text (NUL-terminated); what it rejects costs nothing.
    return ptx_data_bytes(image.split(b"\0", 1)[0].decode("utf-8", "replace"))


def parse_capability(text: str) -> tuple[int, int]:
    """"9.0" -> (9, 0); anything unreadable as the newest capability (every entry counts)."""
    major, _, minor = (text or "").partition(".")
    try:
        return int(major), int(minor or 0)
    except ValueError:
        return 99, 9


class FootprintStore(Protocol):
    """Where footprints outlive the worker (the image cache's facts), by checked digest."""

    def known_footprint(self, digest: bytes, key: str) -> int | None: ...

    def remember_footprint(self, digest: bytes, key: str, size: int) -> None: ...


# Part of a stored footprint's key: a change to what is counted must not reuse older counts.
COUNTING_RULE = "cubin-first-1"


@dataclass
class ImageFootprints:
    """image_data_bytes per image, remembered by the image's SHA-256 where the worker checked it
    (libraries load the same image on every slice and in every process; a compressed fatbin is
    expanded once): in this worker, and in `store` for the workers after it. A digest the client
    sent but nobody checked is never a key: another image under it could hide its size."""

    capability: tuple[int, int]
    bound: int = 4096
    store: FootprintStore | None = None
    _known: OrderedDict[bytes, int] = field(default_factory=OrderedDict)

    @property
    def key(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}/{COUNTING_RULE}"

    def of(self, image: bytes | mmap.mmap, digest: bytes | None) -> int:
        """`image`: bytes or any buffer (the image cache maps its files); read only when its
        footprint is not known yet."""
        if digest is None:
            return image_data_bytes(bytes(image), self.capability)
        if digest in self._known:
            self._known.move_to_end(digest)
            return self._known[digest]
        size = self.store.known_footprint(digest, self.key) if self.store is not None else None
        if size is None:
            size = image_data_bytes(bytes(image), self.capability)
            if self.store is not None:
                self.store.remember_footprint(digest, self.key, size)
        self._known[digest] = size
        if len(self._known) > self.bound:
            self._known.popitem(last=False)
        return size
