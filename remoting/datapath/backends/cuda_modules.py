"""The real-GPU backend's modules and launches: loads that report every function's parameter
layout, links, the private table cuFFT uses, launches from one packed parameter buffer,
occupancy, tensor maps."""

from __future__ import annotations

import ctypes
import mmap
import time
from typing import Any

from rgpu.remoting.datapath.backends.base import (INVALID_HANDLE, INVALID_VALUE, NOT_FOUND, SUCCESS, CudaError,
                                                  TENSOR_MAP_BYTES, TENSOR_MAP_IM2COL, TENSOR_MAP_IM2COL_WIDE,
                                                  TENSOR_MAP_REPLACE, FnInfo, LoadResult, TensorMapRequest)
from rgpu.remoting.datapath.backends.cuda_driver import (c_void_p, c_int, c_uint, c_size_t, c_uint64, byref, P,
                                                         MAX_PARAM_BYTES, JIT_INFO_LOG_BUFFER, JIT_ERROR_LOG_BUFFER,
                                                         MODULE_NODES_TABLE, LAUNCH_ATTRIBUTE_COOPERATIVE,
                                                         CUlaunchConfig, _Link, preserved_library_options)
from rgpu.remoting.datapath.backends.cuda_device import CudaDevice


class CudaModules(CudaDevice):
    """Modules, functions, links and launches."""

    # ------------------------------------------------------------------ modules

    def _params(self, handle: int, kernel: bool) -> tuple[int, list[tuple[int, int]]]:
        fn = self.f["cuKernelGetParamInfo" if kernel else "cuFuncGetParamInfo"]
        out: list[tuple[int, int]] = []
        off, size = c_size_t(), c_size_t()
        while True:
            r = fn(handle, len(out), byref(off), byref(size))
            if r == INVALID_VALUE:
                return SUCCESS, out           # past the last parameter
            if r != SUCCESS:
                return r, out
            out.append((off.value, size.value))

    def _fn_info(self, handle: int, kernel: bool = False) -> FnInfo:
        name = ctypes.c_char_p()
        r = self._call("cuKernelGetName" if kernel else "cuFuncGetName", byref(name), handle)
        if r != SUCCESS and not kernel:
            return self._fn_info(handle, kernel=True)  # a CUkernel used as a CUfunction
        if r != SUCCESS:
            raise CudaError(r)
        r, params = self._params(handle, kernel)
        if r != SUCCESS and not kernel:
            self._call("cuFuncLoad", handle)  # lazily loaded: load it, then ask again
            r, params = self._params(handle, kernel)
        if r != SUCCESS:
            raise CudaError(r)
        return FnInfo(handle, (name.value or b"").decode("utf-8", "replace"), tuple(params))

    def _enumerate(self, handle: int, kind: str) -> list[FnInfo]:
        count = c_uint()
        getcount, enum = (("cuLibraryGetKernelCount", "cuLibraryEnumerateKernels") if kind == "library"
                          else ("cuModuleGetFunctionCount", "cuModuleEnumerateFunctions"))
        if self._call(getcount, byref(count), handle) != SUCCESS or count.value == 0:
            return []
        arr = (c_void_p * count.value)()
        if self._call(enum, arr, count.value, handle) != SUCCESS:
            return []
        out: list[FnInfo] = []
        for h in arr:
            try:
                out.append(self._fn_info(h or 0, kernel=(kind == "library")))
            except CudaError:
                continue  # the client asks for it at its first launch and sees the error then
        return out

    def load(self, kind: str, image: bytes | mmap.mmap, options: list[tuple[int, int]],
             lib_options: list[tuple[int, int]], want_table: bool = True) -> LoadResult:
        sizes = {o: v for o, v in options}
        logs: dict[int, Any] = {}
        values = []
        for opt, value in options:
            if opt in (JIT_INFO_LOG_BUFFER, JIT_ERROR_LOG_BUFFER):
                size = max(1, min(sizes.get(opt + 1, 0), 1 << 20))
                logs[opt] = ctypes.create_string_buffer(size)
                values.append(ctypes.addressof(logs[opt]))
            else:
                values.append(value)
        n = len(options)
        opts = (c_int * max(n, 1))(*[o for o, _ in options])
        vals = (c_void_p * max(n, 1))(*values)
        # No copy: ctypes hands the driver a pointer into the bytes, or into the image cache's
        # mapping of its file; the driver keeps its own copy of what it needs (no
        # CU_LIBRARY_BINARY_IS_PRESERVED is passed).
        data = image if isinstance(image, bytes) else (ctypes.c_char * len(image)).from_buffer(image)
        handle = c_void_p()
        if kind == "library":
            # The driver's own copy of each image cost PyTorch's start about 10 ms a library (an
            # image of ~90 MB read through): the image (bytes, or the cache file's mapping) is
            # kept instead, until the library is unloaded, as cudart keeps its fatbins locally.
            lib_options = preserved_library_options(lib_options)
            m = len(lib_options)
            lopts = (c_int * max(m, 1))(*[o for o, _ in lib_options])
            lvals = (c_void_p * max(m, 1))(*[v for _, v in lib_options])
            r = self._call("cuLibraryLoadData", byref(handle), data, opts if n else None, vals if n else None, n,
                           lopts if m else None, lvals if m else None, m)
        else:
            r = self._call("cuModuleLoadDataEx", byref(handle), data, n, opts if n else None, vals if n else None)
        result = LoadResult(code=r, handle=handle.value or 0, option_values=[vals[i] or 0 for i in range(n)],
                            info_log=logs[JIT_INFO_LOG_BUFFER].value if JIT_INFO_LOG_BUFFER in logs else b"",
                            error_log=logs[JIT_ERROR_LOG_BUFFER].value if JIT_ERROR_LOG_BUFFER in logs else b"")
        # The table saves the client a round trip per function. Clients with one slice ask for no
        # library's: cudart registers every fatbin of PyTorch's libraries as a library (tens of
        # thousands of kernels in all) and runs a few hundred of them; asking each kernel's name
        # and parameters here took about half a second per process, and the client asks for the
        # few it launches (rgpuParamInfo, once per kernel).
        if r == SUCCESS and kind == "library":
            self._preserved[result.handle] = (image, data)
        if r == SUCCESS and want_table:
            t0 = time.perf_counter_ns()
            result.functions = self._enumerate(result.handle, kind)
            self.enumerate_ns += time.perf_counter_ns() - t0
        return result

    def get_function(self, module: int, name: str) -> FnInfo:
        fn = c_void_p()
        self._check("cuModuleGetFunction", byref(fn), module, name.encode())
        return self._fn_info(fn.value or 0)

    # ------------------------------------------------------------------ private table 6e163fbe (cuFFT)

    def _private_table(self, uuid: bytes) -> Any:
        """The driver's private table with this UUID as an array of words (word 0: its byte size)."""
        table = c_void_p()
        r = self.lib.cuGetExportTable(byref(table), ctypes.create_string_buffer(uuid, 16))
        if r != SUCCESS or not table.value:
            raise CudaError(NOT_FOUND if r == SUCCESS else r)
        return ctypes.cast(table, P(c_uint64))

    def private_table_size(self, uuid: bytes) -> int:
        return int(self._private_table(uuid)[0])

    def module_nodes(self, ctx: int, module: int) -> list[tuple[int, ...]]:
        """Slot 7 of table 6e163fbe: walk the module's function nodes with a callback, as cuFFT does
        in the client; each node comes back with its owner and the fields the client copies."""
        words = self._private_table(MODULE_NODES_TABLE)
        if words[0] <= 7 * 8 or not words[7]:
            raise CudaError(NOT_FOUND)
        walk = ctypes.CFUNCTYPE(c_uint64, c_uint64, c_uint64, c_uint64, c_uint64, c_uint64, c_uint64)(words[7])
        found: list[tuple[int, int]] = []
        callback = ctypes.CFUNCTYPE(None, c_void_p, c_void_p, c_uint64)(
            lambda _opaque, node, owner: found.append((node or 0, owner)))
        walk(ctx, module, ctypes.cast(callback, c_void_p).value or 0, 0, module, 0)
        nodes: list[tuple[int, ...]] = []
        for node, owner in found:
            word = lambda off, n=node: c_uint64.from_address(n + off).value  # noqa: E731
            nodes.append((node, owner, word(0x0), word(0x10), word(0x18), word(0x28),
                          ctypes.c_uint32.from_address(node + 0x370).value, 0))
        return nodes

    def param_info(self, handle: int) -> FnInfo:
        return self._fn_info(handle)

    def unload(self, kind: str, handle: int) -> None:
        self._check("cuLibraryUnload" if kind == "library" else "cuModuleUnload", handle)
        if kind == "library":
            self._preserved.pop(handle, None)

    def link_create(self, options: list[tuple[int, int]]) -> int:
        link = _Link(options)
        state = c_void_p()
        self._check("cuLinkCreate_v2", link.n, link.opts, link.vals, byref(state))
        self._links[state.value or 0] = link
        return state.value or 0

    def link_add(self, state: int, kind: int, name: str, options: list[tuple[int, int]], data: bytes) -> tuple[int, bytes, bytes]:
        link = self._links.get(state)
        if link is None:
            return INVALID_HANDLE, b"", b""
        buf = ctypes.create_string_buffer(data, len(data))
        link.inputs.append(buf)  # type: ignore[arg-type]
        n = len(options)
        opts = (c_int * max(n, 1))(*[o for o, _ in options])
        vals = (c_void_p * max(n, 1))(*[v for _, v in options])
        r = self._call("cuLinkAddData_v2", state, kind, buf, len(data), name.encode(), n, opts if n else None,
                       vals if n else None)
        return r, link.info.value, link.error.value

    def link_complete(self, state: int) -> tuple[int, bytes, bytes, bytes]:
        link = self._links.get(state)
        if link is None:
            return INVALID_HANDLE, b"", b"", b""
        cubin, size = c_void_p(), c_size_t()
        r = self._call("cuLinkComplete", state, byref(cubin), byref(size))
        image = ctypes.string_at(cubin.value, size.value) if r == SUCCESS and cubin.value else b""
        return r, link.info.value, link.error.value, image

    def link_destroy(self, state: int) -> None:
        self._links.pop(state, None)
        self._check("cuLinkDestroy", state)

    # ------------------------------------------------------------------ launches

    def launch(self, f: int, stream: int, grid: tuple[int, int, int], block: tuple[int, int, int], shmem: int,
               cooperative: bool, attrs: bytes, params: memoryview, params_address: int) -> None:
        n = len(params)
        if n > MAX_PARAM_BYTES:
            raise CudaError(INVALID_VALUE)
        ctypes.memmove(self._param_buf, params_address, n)  # an aligned copy the driver reads
        self._extra[1] = ctypes.addressof(self._param_buf)
        self._param_size.value = n
        if not attrs and not cooperative:
            r = self.f["cuLaunchKernel"](f, grid[0], grid[1], grid[2], block[0], block[1], block[2], shmem,
                                         stream or None, None, self._extra)
        else:
            if cooperative:
                coop = bytearray(72)
                coop[0:4] = LAUNCH_ATTRIBUTE_COOPERATIVE.to_bytes(4, "little")
                coop[8:12] = (1).to_bytes(4, "little")
                attrs = attrs + bytes(coop)
            raw = ctypes.create_string_buffer(attrs, len(attrs))
            config = CUlaunchConfig(grid[0], grid[1], grid[2], block[0], block[1], block[2], shmem, stream or None,
                                    ctypes.addressof(raw), len(attrs) // 72)
            r = self.f["cuLaunchKernelEx"](byref(config), f, None, self._extra)
        if r != SUCCESS:
            raise CudaError(r)

    def launch_entry(self) -> int:
        """The address of the driver's cuLaunchKernel, for the worker's native launch loop."""
        return int(ctypes.cast(self._launch, c_void_p).value or 0)

    def launch_ex_entry(self) -> int:
        """The driver's cuLaunchKernelEx, for the native loop's launches with attributes (0: they
        stay in Python)."""
        return self._entry("cuLaunchKernelEx")

    def event_entries(self) -> tuple[int, int, int, int, int]:
        """The driver's cuEventCreate, cuEventRecord, cuEventRecordWithFlags, cuStreamWaitEvent and
        cuEventDestroy_v2, by the exact symbols the Python path calls, for the native loop
        (worker/native_loop.py's EventEntries; 0 where the driver lacks one: it stays in Python)."""
        address = self._entry
        return (address("cuEventCreate"), address("cuEventRecord"), address("cuEventRecordWithFlags"),
                address("cuStreamWaitEvent"), address("cuEventDestroy_v2"))

    def memset_entries(self) -> tuple[int, int, int]:
        """The driver's cuMemsetD8Async, cuMemsetD16Async and cuMemsetD32Async, by the exact symbols
        the Python path calls (not the _ptsz variants), for the native loop (worker/native_loop.py's
        MemsetEntries; 0 where the driver lacks one: that width stays in Python)."""
        address = self._entry
        return address("cuMemsetD8Async"), address("cuMemsetD16Async"), address("cuMemsetD32Async")

    def copy_entries(self) -> tuple[int, int]:
        """The driver's cuMemcpyDtoHAsync_v2 and cuStreamIsCapturing, for the native loop's small
        device-to-host copies (worker/native_loop.py's CopyEntries; 0: they stay in Python)."""
        return self._entry("cuMemcpyDtoHAsync_v2"), self._entry("cuStreamIsCapturing")

    def launch_fast(self, f: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shmem: int, stream: int,
                    address: int, argsize: int) -> int:
        """A plain launch taken straight from the worker's receive buffer (frames are 8-aligned)."""
        if address & 7 or argsize > MAX_PARAM_BYTES:
            if argsize > MAX_PARAM_BYTES:
                return INVALID_VALUE
            ctypes.memmove(self._param_buf, address, argsize)
            address = ctypes.addressof(self._param_buf)
        self._extra[1] = address
        self._param_size.value = argsize
        return self._launch(f, gx, gy, gz, bx, by, bz, shmem, stream, None, self._extra)

    def max_potential_block_size(self, f: int, smem: int, limit: int, flags: int) -> tuple[int, int]:
        grid, block = c_int(), c_int()
        self._check("cuOccupancyMaxPotentialBlockSizeWithFlags", byref(grid), byref(block), f, None, smem, limit, flags)
        return grid.value, block.value

    def max_active_clusters(self, f: int, stream: int, grid: tuple[int, int, int], block: tuple[int, int, int],
                            shmem: int, attrs: bytes) -> int:
        raw = ctypes.create_string_buffer(attrs, max(len(attrs), 1))
        config = CUlaunchConfig(grid[0], grid[1], grid[2], block[0], block[1], block[2], shmem, stream or None,
                                ctypes.addressof(raw) if attrs else None, len(attrs) // 72)
        clusters = c_int()
        self._check("cuOccupancyMaxActiveClusters", byref(clusters), f, byref(config))
        return clusters.value

    def tensor_map(self, q: TensorMapRequest) -> bytes:
        """The driver's encoding, made in a 64-byte aligned buffer as it requires. The entry points
        are looked up at first use: drivers before CUDA 12.8 lack cuTensorMapEncodeIm2colWide."""
        raw = ctypes.create_string_buffer(TENSOR_MAP_BYTES + 64)
        at = (ctypes.addressof(raw) + 63) & ~63
        u64s, u32s, i32s = c_uint64 * 5, ctypes.c_uint32 * 5, c_int * 5
        dims, strides, elem = u64s(*q.dims), u64s(*q.strides), u32s(*q.element_strides)
        address = q.address or None
        if q.kind == TENSOR_MAP_REPLACE:
            ctypes.memmove(at, q.map, TENSOR_MAP_BYTES)
            r = self._late_fn("cuTensorMapReplaceAddress", [c_void_p, c_void_p])(at, address)
        elif q.kind == TENSOR_MAP_IM2COL:
            r = self._late_fn("cuTensorMapEncodeIm2col", [
                c_void_p, c_int, ctypes.c_uint32, c_void_p, P(c_uint64), P(c_uint64), P(c_int), P(c_int),
                ctypes.c_uint32, ctypes.c_uint32, P(ctypes.c_uint32), c_int, c_int, c_int, c_int])(
                at, q.data_type, q.rank, address, dims, strides, i32s(*q.lower), i32s(*q.upper), q.channels, q.pixels,
                elem, q.interleave, q.swizzle, q.l2_promotion, q.oob_fill)
        elif q.kind == TENSOR_MAP_IM2COL_WIDE:
            r = self._late_fn("cuTensorMapEncodeIm2colWide", [
                c_void_p, c_int, ctypes.c_uint32, c_void_p, P(c_uint64), P(c_uint64), c_int, c_int, ctypes.c_uint32,
                ctypes.c_uint32, P(ctypes.c_uint32), c_int, c_int, c_int, c_int, c_int])(
                at, q.data_type, q.rank, address, dims, strides, q.lower_w, q.upper_w, q.channels, q.pixels, elem,
                q.interleave, q.wide_mode, q.swizzle, q.l2_promotion, q.oob_fill)
        else:
            r = self._late_fn("cuTensorMapEncodeTiled", [
                c_void_p, c_int, ctypes.c_uint32, c_void_p, P(c_uint64), P(c_uint64), P(ctypes.c_uint32),
                P(ctypes.c_uint32), c_int, c_int, c_int, c_int])(
                at, q.data_type, q.rank, address, dims, strides, u32s(*q.box), elem, q.interleave, q.swizzle,
                q.l2_promotion, q.oob_fill)
        if r != SUCCESS:
            raise CudaError(r)
        return ctypes.string_at(at, TENSOR_MAP_BYTES)
