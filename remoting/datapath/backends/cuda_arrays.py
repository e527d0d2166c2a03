"""The real-GPU backend's CUDA arrays, texture objects and 2D/3D copies with arrays."""

from __future__ import annotations

import ctypes
import struct
from typing import Any

from rgpu.remoting.datapath.backends.arrays import DEFERRED_MAPPING, HOST, ArrayDesc, footprint
from rgpu.remoting.datapath.backends.base import SUCCESS, CudaError
from rgpu.remoting.datapath.backends.cuda_driver import (c_void_p, byref, STAGING_CHUNK, DTOH_CHUNK, CUDA_MEMCPY2D,
                                                         CUDA_MEMCPY3D)
from rgpu.remoting.datapath.backends.cuda_copies import CudaCopies


class CudaArrays(CudaCopies):
    """Arrays and their copies (host sides through the staging buffers)."""

    # ------------------------------------------------------------------ arrays, texture objects, copies with arrays

    def array_footprint(self, desc: ArrayDesc, levels: int) -> int:
        """The device memory an array takes: the driver's own figure for a deferred-mapping array of
        the same shape (cuArrayGetMemoryRequirements; nothing is allocated for it), else rgpu's
        estimate of the block-linear layout (arrays.footprint)."""
        probe = ArrayDesc(desc.width, desc.height, desc.depth, desc.format, desc.channels, desc.flags | DEFERRED_MAPPING)
        buf = ctypes.create_string_buffer(probe.pack3d(), 40)
        handle, req = c_void_p(), ctypes.create_string_buffer(32)
        mipmapped = levels > 1
        if mipmapped:
            r = self._call("cuMipmappedArrayCreate", byref(handle), buf, levels)
        else:
            r = self._call("cuArray3DCreate_v2", byref(handle), buf)
        if r == SUCCESS:
            r = self._call("cuMipmappedArrayGetMemoryRequirements" if mipmapped else "cuArrayGetMemoryRequirements",
                           req, handle, 0)
            self._call("cuMipmappedArrayDestroy" if mipmapped else "cuArrayDestroy", handle)
        size = struct.unpack_from("<Q", req.raw, 0)[0] if r == SUCCESS else 0
        return size or footprint(desc, levels)

    def array_create(self, kind: str, desc: ArrayDesc, levels: int) -> int:
        handle = c_void_p()
        if kind == "2d":
            self._check("cuArrayCreate_v2", byref(handle), ctypes.create_string_buffer(desc.pack2d(), 24))
        elif kind == "3d":
            self._check("cuArray3DCreate_v2", byref(handle), ctypes.create_string_buffer(desc.pack3d(), 40))
        else:
            self._check("cuMipmappedArrayCreate", byref(handle), ctypes.create_string_buffer(desc.pack3d(), 40), levels)
        return handle.value or 0

    def array_destroy(self, kind: str, handle: int) -> None:
        self._check("cuMipmappedArrayDestroy" if kind == "mipmapped" else "cuArrayDestroy", handle or None)

    def tex_object_create(self, res: bytes, tex: bytes, view: bytes | None) -> int:
        handle = ctypes.c_ulonglong()
        view_buf = ctypes.create_string_buffer(view, len(view)) if view is not None else None
        self._check("cuTexObjectCreate", byref(handle), ctypes.create_string_buffer(res, len(res)),
                    ctypes.create_string_buffer(tex, len(tex)), view_buf)
        return handle.value

    def _copy_nd(self, kind: int, m: CUDA_MEMCPY3D, stream: int) -> None:
        """kind 2: cuMemcpy3DAsync; 0: cuMemcpy2DAsync; 1: cuMemcpy2DUnaligned (the fields in 3D form)."""
        if kind == 2:
            self._check("cuMemcpy3DAsync_v2", byref(m), stream or None)
            return
        p = CUDA_MEMCPY2D(srcXInBytes=m.srcXInBytes, srcY=m.srcY, srcMemoryType=m.srcMemoryType, srcHost=m.srcHost,
                          srcDevice=m.srcDevice, srcArray=m.srcArray, srcPitch=m.srcPitch,
                          dstXInBytes=m.dstXInBytes, dstY=m.dstY, dstMemoryType=m.dstMemoryType, dstHost=m.dstHost,
                          dstDevice=m.dstDevice, dstArray=m.dstArray, dstPitch=m.dstPitch,
                          WidthInBytes=m.WidthInBytes, Height=m.Height)
        if kind == 1:
            self._check("cuMemcpy2DUnaligned_v2", byref(p))
        else:
            self._check("cuMemcpy2DAsync_v2", byref(p), stream or None)

    def memcpy_array(self, kind: int, desc: bytes, stream: int, data: memoryview, address: int) -> None:
        """A copy whose host side (if any) is the request's data: through the pinned ring, as
        host-to-device copies go (queued, the ring's event tracks its DMA); a piece larger than the
        ring takes (not what rgpu's client sends) is copied from the receive buffer, waited for."""
        m = CUDA_MEMCPY3D.from_buffer_copy(desc)
        if m.srcMemoryType != HOST:
            self._copy_nd(kind, m, stream)
            return
        self._refuse_capture(stream, "a 2D/3D copy from this process's memory")
        n = len(data)
        if n > STAGING_CHUNK:
            m.srcHost = address
            self._copy_nd(kind, m, stream)
            self._check("cuStreamSynchronize", stream or None)
            return
        staging, event = self._stage(n)
        ctypes.memmove(staging, address, n)
        m.srcHost = staging
        try:
            self._copy_nd(kind, m, stream)
        except CudaError:
            self._call("cuStreamSynchronize", stream or None)   # nothing tracks the staged bytes: wait
            raise
        r = self._call("cuEventRecord", event, stream or None)
        if r != SUCCESS:
            self._call("cuStreamSynchronize", stream or None)
            raise CudaError(r)

    def memcpy_array_to_host(self, kind: int, desc: bytes, stream: int) -> memoryview:
        """Into a pinned buffer of the worker's (a piece of at most DTOH_CHUNK, as rgpu's client
        asks for), else a plain one; the handler sends it before the next call may reuse it."""
        self._refuse_capture(stream, "a 2D/3D copy to this process's memory")
        m = CUDA_MEMCPY3D.from_buffer_copy(desc)
        n = m.WidthInBytes * m.Height * (max(m.Depth, 1) if kind == 2 else 1)
        if n <= DTOH_CHUNK:
            if not self._dtoh:
                self._make_staging()
            m.dstHost = self._dtoh[0]
            out: Any = (ctypes.c_char * max(n, 1)).from_address(self._dtoh[0])
        else:
            out = ctypes.create_string_buffer(max(n, 1))
            m.dstHost = ctypes.addressof(out)
        self._copy_nd(kind, m, stream)
        self._check("cuStreamSynchronize", stream or None)
        return memoryview(out).cast("B")[:n]
