"""The worker's handlers for CUDA arrays, texture objects and 2D/3D copies with arrays."""

from __future__ import annotations

import struct
from collections.abc import Callable

from rgpu.remoting.datapath import protocol
from rgpu.remoting.datapath.backends.arrays import (DESC2D, DESC3D, HOST, MEMCPY3D, RESOURCE_DESC_SIZE,
                                                    TEXTURE_DESC_SIZE, VIEW_DESC_SIZE, parse_copy, parse_desc)
from rgpu.remoting.datapath.backends.base import INVALID_VALUE, SUCCESS, CudaError
from rgpu.remoting.datapath.worker.codecs import HEADER, U32, U64
from rgpu.units import format_bytes
from rgpu.remoting.datapath.worker.handler_state import HandlerState

MAX_ARRAY_READ = 64 << 20   # one rgpuMemcpyArrayToHost request (the client sends 4 MiB pieces)


class ArrayHandlers(HandlerState):
    """Arrays (counted against the slice), texture objects, array copies."""

    # ------------------------------------------------------------------ arrays, texture and surface objects
    # Every array counts against the slice from its creation until it is destroyed, at the footprint
    # the backend gives (the driver's own figure where it can say, cuda.py). Keys in the accounting
    # lie below -2**64, apart from device pointers (positive) and VMM handles (negated).

    @staticmethod
    def _array_key(kind: str, handle: int) -> int:
        return -((2 if kind == "mipmapped" else 1) << 64) - handle

    def h_array_create(self, kind: str) -> Callable[[memoryview, int, int], tuple[int, bytes]]:
        what = {"2d": "cuArrayCreate", "3d": "cuArray3DCreate", "mipmapped": "cuMipmappedArrayCreate"}[kind]

        def run(p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
            (levels,) = U32.unpack_from(p, 0)
            size = DESC2D.size if kind == "2d" else DESC3D.size
            if len(p) < 8 + size:
                raise CudaError(INVALID_VALUE, f"rgpu: worker: truncated {what} request")
            desc = parse_desc(bytes(p[8:8 + size]), kind != "2d")
            levels = levels if kind == "mipmapped" else 1
            if not 1 <= levels <= desc.max_levels():
                raise CudaError(INVALID_VALUE, f"rgpu: worker: {what}: {levels} mipmap levels for a "
                                               f"{desc.width} x {desc.height} x {desc.depth} array (at most "
                                               f"{desc.max_levels()})")
            footprint = self.backend.array_footprint(desc, levels)
            label = (f"{what} ({desc.width} x {desc.height} x {desc.depth}, format {desc.format:#x} x {desc.channels}"
                     + (f", {levels} levels" if kind == "mipmapped" else "") + ")")
            assert self.memory is not None
            self.memory.check(footprint, label)
            try:
                handle = self.backend.array_create(kind, desc, levels)
            except BaseException:
                self.memory.cancel()
                raise
            self.memory.add(self._array_key(kind, handle), footprint, label)
            return SUCCESS, U64.pack(handle)
        return run

    def h_array_destroy(self, kind: str) -> Callable[[memoryview, int, int], tuple[int, bytes]]:
        def run(p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
            (handle,) = U64.unpack_from(p, 0)
            self.backend.array_destroy(kind, handle)
            if self.memory is not None:
                self.memory.remove(self._array_key(kind, handle))
            return SUCCESS, b""
        return run

    def h_tex_object_create(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        at = RESOURCE_DESC_SIZE + TEXTURE_DESC_SIZE
        if len(p) < at + 8 + VIEW_DESC_SIZE:
            raise CudaError(INVALID_VALUE, "rgpu: worker: truncated cuTexObjectCreate request")
        (has_view,) = U32.unpack_from(p, at)
        view = bytes(p[at + 8:at + 8 + VIEW_DESC_SIZE]) if has_view else None
        handle = self.backend.tex_object_create(bytes(p[:RESOURCE_DESC_SIZE]), bytes(p[RESOURCE_DESC_SIZE:at]), view)
        return SUCCESS, U64.pack(handle)

    @staticmethod
    def _array_copy(p: memoryview, to_host: bool) -> tuple[int, int, bytes, int]:
        """(kind, stream, descriptor, packed host bytes) of rgpuMemcpyArray / ...ToHost. The host side
        (the request's data, or the worker's buffer for the reply) must be exactly the packed box:
        a pitch or offset past it would have the driver read or write the worker's own memory."""
        kind, _, stream = struct.unpack_from("<IIQ", p, 0)
        desc = bytes(p[16:16 + MEMCPY3D.size])
        if len(desc) != MEMCPY3D.size or kind not in (0, 1, 2):
            raise CudaError(INVALID_VALUE, "rgpu: worker: malformed 2D/3D copy request")
        c = parse_copy(desc)
        depth = c.depth if kind == 2 else 1
        host = c.dst if to_host else c.src
        packed = c.width * c.height * depth
        if host.kind == HOST and (host.x or host.y or host.pitch != c.width or
                                  (kind == 2 and (host.z or host.lod or host.height != c.height))):
            raise CudaError(INVALID_VALUE, "rgpu: worker: a 2D/3D copy's host side is not its packed data")
        if c.dst.kind == HOST if not to_host else (c.dst.kind != HOST or c.src.kind == HOST):
            raise CudaError(INVALID_VALUE, "rgpu: worker: a 2D/3D copy request names the wrong host side")
        return kind, stream, desc, packed if host.kind == HOST else 0

    def h_memcpy_array(self, p: memoryview, address: int, seq: int) -> None:
        """A 2D/3D copy with no host side, or with this request's data as its (packed) source."""
        kind, stream, desc, packed = self._array_copy(p, to_host=False)
        stream = self.client_streams.real(stream, "a 2D/3D copy")
        (size,) = U64.unpack_from(p, 16 + MEMCPY3D.size)
        at = 24 + MEMCPY3D.size
        data = p[at:at + size]
        if len(data) != size or size != packed:
            raise CudaError(INVALID_VALUE, "rgpu: worker: a 2D/3D copy's data does not match its extent")
        self.backend.memcpy_array(kind, desc, stream, data, address + at)

    def h_memcpy_array_to_host(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        """A 2D/3D copy into the client's memory: the packed rows come back as DATA frames."""
        kind, stream, desc, packed = self._array_copy(p, to_host=True)
        stream = self.client_streams.real(stream, "a 2D/3D copy to this process")
        if packed > MAX_ARRAY_READ:
            raise CudaError(INVALID_VALUE, f"rgpu: worker: a 2D/3D copy of {format_bytes(packed)} to the client refused "
                                           f"(at most {format_bytes(MAX_ARRAY_READ)} a request; rgpu's client library "
                                           "sends pieces of 4 MiB: install the same rgpu version on both sides)")
        data = memoryview(self.backend.memcpy_array_to_host(kind, desc, stream))
        for start in range(0, len(data), protocol.CHUNK_BYTES):
            chunk = data[start:start + protocol.CHUNK_BYTES]
            self.sock.sendmsg([HEADER.pack(len(chunk), protocol.OP_DATA, 0, 0, 0, 0), chunk])
            self.sent += protocol.HEADER_SIZE + len(chunk)
        return SUCCESS, b""
