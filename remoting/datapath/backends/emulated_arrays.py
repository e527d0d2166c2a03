"""The emulated GPU's CUDA arrays (plain, layered, cube, mipmapped), texture and surface
objects, and the 2D/3D copies between arrays, device and host memory."""

from __future__ import annotations

import struct
from typing import Any

from rgpu.remoting.datapath.backends.arrays import (ARRAY, CHANNEL_BYTES, CUBEMAP, DEFERRED_MAPPING, DEVICE, HOST,
                                                    LAYERED, RESOURCE_ARRAY, RESOURCE_LINEAR, RESOURCE_MIPMAPPED_ARRAY,
                                                    RESOURCE_PITCH2D, SURFACE_LDST, VIEW_DESC_SIZE, ArrayDesc, CopySide,
                                                    parse_copy)
from rgpu.remoting.datapath.backends.base import (
    INVALID_HANDLE,
    INVALID_VALUE,
    NOT_SUPPORTED,
    SUCCESS,
    CudaError,
)
from rgpu.remoting.datapath.backends.emulated_device import _ALIGN, _ATTRIBUTES, NODE_TYPE_MEMCPY, EmulatedDevice
from rgpu.remoting.datapath.backends.emulated_objects import _EmuArray


# CUarray_format values of cuda.h (CUDA 13): what an array may be created with.
_KNOWN_FORMATS = frozenset({0x01, 0x02, 0x03, 0x08, 0x09, 0x0A, 0x10, 0x20, 0x50, 0xB0, *range(0xC0, 0xCC),
                            *range(0x91, 0xA0), *range(0xA1, 0xAA), *range(0xB1, 0xB6)})


class EmulatedArrays(EmulatedDevice):
    """Arrays and texture and surface objects."""

    # ------------------------------------------------------------------ arrays, texture and surface objects
    # An array is its texels in row-major order, rows packed (width x element size bytes), planes
    # after one another; texture and surface objects keep their descriptors, to be read back.

    def _check_desc(self, desc: ArrayDesc, levels: int) -> None:
        if desc.format not in _KNOWN_FORMATS or (desc.format in CHANNEL_BYTES and desc.channels not in (1, 2, 4)):
            raise CudaError(INVALID_VALUE, f"rgpu: worker: array format {desc.format:#x} with {desc.channels} "
                                           "channel(s) is not a CUDA array format")
        if not desc.element_bytes:
            raise CudaError(NOT_SUPPORTED, f"rgpu: worker: the emulated device has no layout for array format "
                                           f"{desc.format:#x} (block-compressed and YUV formats need a real GPU)")
        layered, cube = desc.flags & LAYERED, desc.flags & CUBEMAP
        if (not desc.width or (desc.depth and not desc.height and not layered) or desc.width > 1 << 17
                or desc.height > 1 << 16 or desc.depth > (2048 if layered else 1 << 14)
                or (layered and not desc.depth) or (cube and (desc.width != desc.height or desc.depth % 6))
                or desc.flags & ~0xFF):
            raise CudaError(INVALID_VALUE)
        if not 1 <= levels <= desc.max_levels():
            raise CudaError(INVALID_VALUE)

    def array_footprint(self, desc: ArrayDesc, levels: int) -> int:
        self._need_ctx()
        self._check_desc(desc, levels)
        return sum(_EmuArray.size_of(desc.level(i)) for i in range(levels))

    def array_create(self, kind: str, desc: ArrayDesc, levels: int) -> int:
        self._need_ctx()
        self._check_desc(desc, levels)
        handle = self.handles.new()
        if kind != "mipmapped":
            self.arrays[handle] = _EmuArray(desc)
            return handle
        self.mipmaps[handle] = []
        for i in range(levels):
            level = self.handles.new()
            self.arrays[level] = _EmuArray(desc.level(i), owner=handle)
            self.mipmaps[handle].append(level)
        return handle

    def array_destroy(self, kind: str, handle: int) -> None:
        self._need_ctx()
        if kind == "mipmapped":
            if handle not in self.mipmaps:
                raise CudaError(INVALID_HANDLE)
            for level in self.mipmaps.pop(handle):
                del self.arrays[level]
            return
        array = self.arrays.get(handle)
        if array is None or array.owner:   # a mipmap level goes with its mipmapped array
            raise CudaError(INVALID_HANDLE)
        del self.arrays[handle]

    def cuArrayGetDescriptor_v2(self, array: int) -> tuple[int, bytes]:
        a = self.arrays.get(array)
        return (SUCCESS, a.desc.pack2d()) if a is not None else (INVALID_HANDLE, b"")

    def cuArray3DGetDescriptor_v2(self, array: int) -> tuple[int, bytes]:
        a = self.arrays.get(array)
        return (SUCCESS, a.desc.pack3d()) if a is not None else (INVALID_HANDLE, b"")

    def cuArrayGetMemoryRequirements(self, array: int, device: int) -> tuple[int, bytes]:
        """As the driver: only for arrays made with CUDA_ARRAY3D_DEFERRED_MAPPING."""
        a = self.arrays.get(array)
        if a is None:
            return (INVALID_HANDLE, b"")
        if not a.desc.flags & DEFERRED_MAPPING:
            return (INVALID_VALUE, b"")
        return (SUCCESS, struct.pack("<QQ16x", len(a.data), _ALIGN))

    def cuMipmappedArrayGetMemoryRequirements(self, mipmap: int, device: int) -> tuple[int, bytes]:
        levels = self.mipmaps.get(mipmap)
        if levels is None:
            return (INVALID_HANDLE, b"")
        if not self.arrays[levels[0]].desc.flags & DEFERRED_MAPPING:
            return (INVALID_VALUE, b"")
        return (SUCCESS, struct.pack("<QQ16x", sum(len(self.arrays[lv].data) for lv in levels), _ALIGN))

    def cuMipmappedArrayGetLevel(self, mipmap: int, level: int) -> tuple[int, int]:
        levels = self.mipmaps.get(mipmap)
        if levels is None:
            return (INVALID_HANDLE, 0)
        return (SUCCESS, levels[level]) if level < len(levels) else (INVALID_VALUE, 0)

    def _check_resource(self, res: bytes, surface: bool) -> None:
        kind, flags = struct.unpack_from("<i", res, 0)[0], struct.unpack_from("<I", res, 136)[0]
        if flags:
            raise CudaError(INVALID_VALUE)
        if kind == RESOURCE_ARRAY:
            array = self.arrays.get(struct.unpack_from("<Q", res, 8)[0])
            if array is None:
                raise CudaError(INVALID_HANDLE)
            if surface and not array.desc.flags & SURFACE_LDST:
                raise CudaError(INVALID_VALUE, "rgpu: worker: a surface object needs an array created with "
                                               "CUDA_ARRAY3D_SURFACE_LDST")
            return
        if surface:
            raise CudaError(INVALID_VALUE)
        if kind == RESOURCE_MIPMAPPED_ARRAY:
            if struct.unpack_from("<Q", res, 8)[0] not in self.mipmaps:
                raise CudaError(INVALID_HANDLE)
            return
        if kind not in (RESOURCE_LINEAR, RESOURCE_PITCH2D):
            raise CudaError(INVALID_VALUE)
        ptr, fmt, channels = struct.unpack_from("<QiI", res, 8)
        elem = ArrayDesc(1, 0, 0, fmt, channels).element_bytes
        if not elem or ptr % _ATTRIBUTES["TEXTURE_ALIGNMENT"]:
            raise CudaError(INVALID_VALUE)
        if kind == RESOURCE_LINEAR:
            (size,) = struct.unpack_from("<Q", res, 24)
            extent = size
        else:
            width, height, pitch = struct.unpack_from("<QQQ", res, 24)
            if not width or not height or pitch < width * elem:
                raise CudaError(INVALID_VALUE)
            extent = pitch * (height - 1) + width * elem
        self._locate(ptr, max(extent, 1))

    def tex_object_create(self, res: bytes, tex: bytes, view: bytes | None) -> int:
        self._need_ctx()
        self._check_resource(res, surface=False)
        handle = self.handles.new()
        self.tex_objects[handle] = (res, tex, view or bytes(VIEW_DESC_SIZE))
        return handle

    def cuTexObjectDestroy(self, tex: int) -> tuple[int]:
        return (SUCCESS,) if self.tex_objects.pop(tex, None) is not None else (INVALID_VALUE,)

    def _tex_part(self, tex: int, i: int) -> tuple[int, bytes]:
        entry = self.tex_objects.get(tex)
        return (SUCCESS, entry[i]) if entry is not None else (INVALID_VALUE, b"")

    def cuTexObjectGetResourceDesc(self, tex: int) -> tuple[int, bytes]:
        return self._tex_part(tex, 0)

    def cuTexObjectGetTextureDesc(self, tex: int) -> tuple[int, bytes]:
        return self._tex_part(tex, 1)

    def cuTexObjectGetResourceViewDesc(self, tex: int) -> tuple[int, bytes]:
        return self._tex_part(tex, 2)

    def cuSurfObjectCreate(self, res: bytes) -> tuple[int, int]:
        self._need_ctx()
        self._check_resource(res, surface=True)
        handle = self.handles.new()
        self.surf_objects[handle] = res
        return (SUCCESS, handle)

    def cuSurfObjectDestroy(self, surf: int) -> tuple[int]:
        return (SUCCESS,) if self.surf_objects.pop(surf, None) is not None else (INVALID_VALUE,)

    def cuSurfObjectGetResourceDesc(self, surf: int) -> tuple[int, bytes]:
        res = self.surf_objects.get(surf)
        return (SUCCESS, res) if res is not None else (INVALID_VALUE, b"")

    def _rows(self, side: CopySide, w: int, h: int, d: int, host: Any) -> list[tuple[Any, int]]:
        """(buffer, offset) of each of the h x d rows of w bytes on one side of a copy."""
        if side.kind == ARRAY:
            array = self.arrays.get(side.array)
            if array is None:
                raise CudaError(INVALID_HANDLE)
            desc, elem = array.desc, array.desc.element_bytes
            if (side.lod or side.x % elem or w % elem or side.x + w > desc.row_bytes or side.y + h > desc.rows
                    or side.z + d > desc.planes):
                raise CudaError(INVALID_VALUE)
            row, plane = desc.row_bytes, desc.row_bytes * desc.rows
            return [(array.data, side.x + (side.y + y) * row + (side.z + z) * plane) for z in range(d) for y in range(h)]
        if (h > 1 or d > 1) and side.pitch < w or (d > 1 and side.height < side.y + h):
            raise CudaError(INVALID_VALUE)
        plane = side.pitch * side.height
        last = side.x + (side.y + h - 1) * side.pitch + (side.z + d - 1) * plane   # checked before any row
        if side.kind == HOST:
            if last + w > len(host):
                raise CudaError(INVALID_VALUE)
            return [(host, side.x + (side.y + y) * side.pitch + (side.z + z) * plane) for z in range(d) for y in range(h)]
        if side.kind != DEVICE:
            raise CudaError(INVALID_VALUE)
        self._locate(side.device + last, w)
        return [self._locate(side.device + side.x + (side.y + y) * side.pitch + (side.z + z) * plane, w)
                for z in range(d) for y in range(h)]

    def _copy_nd(self, kind: int, desc: bytes, data: Any, out: bytearray | None) -> None:
        c = parse_copy(desc)
        w, h, d = c.width, c.height, (c.depth if kind == 2 else 1)
        if kind != 2:
            c.src.z = c.dst.z = c.src.lod = c.dst.lod = c.src.height = c.dst.height = 0
        if not w or not h or not d:
            return
        src = self._rows(c.src, w, h, d, data)
        dst = self._rows(c.dst, w, h, d, out)
        rows = [bytes(buf[off:off + w]) for buf, off in src]   # read first: a copy within one array
        for (buf, off), row in zip(dst, rows):
            buf[off:off + w] = row

    def memcpy_array(self, kind: int, desc: bytes, stream: int, data: memoryview, address: int) -> None:
        self._need_ctx()
        if parse_copy(desc).src.kind == HOST:
            self._refuse_capture(stream, "a 2D/3D copy from this process's memory")
            self._copy_nd(kind, desc, data, None)
            return

        def run() -> tuple[int]:
            self._copy_nd(kind, desc, None, None)
            return (SUCCESS,)
        r = self._on_stream(stream, run, NODE_TYPE_MEMCPY)[0]
        if r != SUCCESS:
            raise CudaError(r)

    def memcpy_array_to_host(self, kind: int, desc: bytes, stream: int) -> bytes:
        self._need_ctx()
        self._refuse_capture(stream, "a 2D/3D copy to this process's memory")
        c = parse_copy(desc)
        out = bytearray(c.width * c.height * (max(c.depth, 1) if kind == 2 else 1))
        self._copy_nd(kind, desc, None, out)
        return bytes(out)
