"""CUDA arrays as the worker sees them: descriptors, element sizes, mipmap levels, the footprint
charged to the slice, and the copy descriptor the client sends (src/cuda_array.c). Pure: bytes in,
records out; both backends and the handlers share it."""

from __future__ import annotations

import struct
from dataclasses import dataclass

# CUarray_format (cuda.h, CUDA 13): bytes per channel for the plain formats, bytes per element for
# the packed ones whose channel count the format fixes.
CHANNEL_BYTES = {0x01: 1, 0x02: 2, 0x03: 4, 0x08: 1, 0x09: 2, 0x0A: 4, 0x10: 2, 0x20: 4}
PACKED_FORMATS = {0xC0: (1, 1), 0xC1: (2, 2), 0xC2: (4, 4), 0xC3: (2, 1), 0xC4: (4, 2), 0xC5: (8, 4),
                  0xC6: (1, 1), 0xC7: (2, 2), 0xC8: (4, 4), 0xC9: (2, 1), 0xCA: (4, 2), 0xCB: (8, 4),
                  0x50: (4, 4)}   # format -> (bytes per element, channels)

# CUDA_ARRAY3D_* flags
LAYERED, SURFACE_LDST, CUBEMAP, TEXTURE_GATHER, DEFERRED_MAPPING = 0x01, 0x02, 0x04, 0x08, 0x80

# CUresourcetype
RESOURCE_ARRAY, RESOURCE_MIPMAPPED_ARRAY, RESOURCE_LINEAR, RESOURCE_PITCH2D = 0, 1, 2, 3

# CUmemorytype
HOST, DEVICE, ARRAY = 1, 2, 3

DESC2D = struct.Struct("<QQiI")      # CUDA_ARRAY_DESCRIPTOR
DESC3D = struct.Struct("<QQQiII4x")  # CUDA_ARRAY3D_DESCRIPTOR
MEMCPY3D = struct.Struct("<4Qi4xQQQQQQ4Qi4xQQQQQQQQQ")   # CUDA_MEMCPY3D, 200 bytes
RESOURCE_DESC_SIZE, TEXTURE_DESC_SIZE, VIEW_DESC_SIZE = 144, 104, 112


@dataclass(frozen=True)
class ArrayDesc:
    """A CUDA_ARRAY3D_DESCRIPTOR (a 2D descriptor has depth 0 and no flags)."""

    width: int
    height: int
    depth: int
    format: int
    channels: int
    flags: int = 0

    @property
    def element_bytes(self) -> int:
        """Bytes per element; 0 for formats whose layout rgpu does not know (block-compressed, YUV)."""
        if self.format in CHANNEL_BYTES:
            return CHANNEL_BYTES[self.format] * self.channels if self.channels in (1, 2, 4) else 0
        packed = PACKED_FORMATS.get(self.format)
        return packed[0] if packed and packed[1] == self.channels else 0

    @property
    def row_bytes(self) -> int:
        return self.width * self.element_bytes

    @property
    def rows(self) -> int:
        return max(self.height, 1)

    @property
    def planes(self) -> int:
        return max(self.depth, 1)

    def pack3d(self) -> bytes:
        return DESC3D.pack(self.width, self.height, self.depth, self.format, self.channels, self.flags)

    def pack2d(self) -> bytes:
        return DESC2D.pack(self.width, self.height, self.format, self.channels)

    def level(self, i: int) -> ArrayDesc:
        """Mipmap level i: each dimension halved i times (at least 1); layers stay."""
        def shrink(n: int) -> int:
            return max(n >> i, 1) if n else 0
        depth = self.depth if self.flags & (LAYERED | CUBEMAP) else shrink(self.depth)
        return ArrayDesc(shrink(self.width), shrink(self.height), depth, self.format, self.channels, self.flags)

    def max_levels(self) -> int:
        """Levels down to 1 x 1 (x 1): layers and cube faces do not shrink."""
        largest = max(self.width, self.height, 0 if self.flags & (LAYERED | CUBEMAP) else self.depth, 1)
        return largest.bit_length()


def parse_desc(data: bytes, three_d: bool) -> ArrayDesc:
    if three_d:
        w, h, d, fmt, ch, flags = DESC3D.unpack_from(data, 0)
        return ArrayDesc(w, h, d, fmt, ch, flags)
    w, h, fmt, ch = DESC2D.unpack_from(data, 0)
    return ArrayDesc(w, h, 0, fmt, ch, 0)


def footprint(desc: ArrayDesc, levels: int = 1) -> int:
    """The device memory charged to the slice for an array (all of its mipmap levels): its texels
    laid out as the GPU's block-linear layout pads them (rows to 64 bytes, 8-row groups). An
    estimate where the driver cannot say (the CUDA backend asks it first: cuda.py). Formats whose
    element size rgpu does not know count 16 bytes per texel, the largest element."""
    total = 0
    for i in range(max(levels, 1)):
        lv = desc.level(i)
        elem = lv.element_bytes or 16
        row = -(-max(lv.width, 1) * elem // 64) * 64
        rows = -(-lv.rows // 8) * 8 if lv.height else 1
        total += row * rows * lv.planes
    return total


@dataclass
class CopySide:
    """One side of a CUDA_MEMCPY3D: where it starts, its memory and layout."""

    x: int
    y: int
    z: int
    lod: int
    kind: int        # HOST, DEVICE or ARRAY
    device: int
    array: int
    pitch: int
    height: int


@dataclass
class Copy3D:
    src: CopySide
    dst: CopySide
    width: int
    height: int
    depth: int


def parse_copy(data: bytes) -> Copy3D:
    v = MEMCPY3D.unpack_from(data, 0)
    sx, sy, sz, slod, skind, _shost, sdev, sarr, _r0, spitch, sheight = v[0:11]
    dx, dy, dz, dlod, dkind, _dhost, ddev, darr, _r1, dpitch, dheight = v[11:22]
    w, h, d = v[22:25]
    return Copy3D(CopySide(sx, sy, sz, slod, skind, sdev, sarr, spitch, sheight),
                  CopySide(dx, dy, dz, dlod, dkind, ddev, darr, dpitch, dheight), w, h, d)
