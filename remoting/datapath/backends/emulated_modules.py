"""The emulated GPU's modules, libraries and functions: PTX parsed for kernel names and parameter
layouts, function attributes checked as the driver checks them, occupancy, tensor maps, the
linker, and kernel launches (refused, except the fake kernels below)."""

from __future__ import annotations

import hashlib
import mmap
import os
import re
import struct

from rgpu.remoting.datapath.backends.emulated_mps import EMULATED_MPS_LOG
from rgpu.remoting.datapath.backends.base import (
    INVALID_HANDLE,
    INVALID_IMAGE,
    INVALID_VALUE,
    NO_BINARY_FOR_GPU,
    NOT_FOUND,
    NOT_SUPPORTED,
    SUCCESS,
    TENSOR_MAP_BYTES,
    TENSOR_MAP_IM2COL_WIDE,
    TENSOR_MAP_REPLACE,
    TENSOR_MAP_TILED,
    CudaError,
    FnInfo,
    TensorMapRequest,
    LoadResult,
)
from rgpu.remoting.datapath.backends.emulated_device import ILLEGAL_ADDRESS
from rgpu.remoting.datapath.backends.emulated_memory import EmulatedMemory
from rgpu.remoting.datapath.fatbin import FATBIN_MAGIC, ImageUnreadable, fatbin_entries, loadable


# CUfunction_attribute values the emulated functions answer and check.
FUNC_SHARED_SIZE_BYTES = 1
FUNC_MAX_DYNAMIC_SHARED = 8
FUNC_CARVEOUT = 9
FUNC_CLUSTER_SIZE_MUST_BE_SET = 10
FUNC_NON_PORTABLE_CLUSTER = 14
FUNC_SCHEDULING_POLICY = 15
_FUNC_DEFAULTS = {0: 1024, 4: 16, 5: 90, 6: 90, FUNC_MAX_DYNAMIC_SHARED: 49152}

_LAUNCH_REFUSED = ("rgpu: worker: kernel launch refused (this dispatcher emulates its GPU and cannot run "
                   "kernels; run the application against a dispatcher started with --backend cuda on a GPU node)")

# Fake kernels, the only ones the emulated GPU "runs", so that CI can test what a real GPU does to
# sessions (no GPU there). A launch of EMULATED_SPIN never finishes: the session's next
# synchronising call blocks for ever, with SIGTERM ignored, as by a driver call that does not return
# to it (so the dispatcher's SIGKILL is what ends it). A launch of EMULATED_WILD_WRITE is a wild
# write: the context's sticky CUDA_ERROR_ILLEGAL_ADDRESS, and on a GPU shared by MPS every other
# session of that GPU gets it too (the fault domain is a marker file in the GPU's shared folder,
# which the dispatcher clears when it recovers the GPU, as a restarted MPS server would be clean).
EMULATED_SPIN = "rgpu_emulated_spin_forever"
# A kernel the emulated GPU runs: it writes the launch's dynamic shared memory size (u32) to its
# first parameter, a device pointer, so tests see what a launch got.
EMULATED_SHARED_PROBE = "rgpu_emulated_shared_probe"
EMULATED_WILD_WRITE = "rgpu_emulated_wild_write"

_PTX_ENTRY = re.compile(r"\.entry\s+([A-Za-z_$][\w$]*)\s*\(([^)]*)\)", re.DOTALL)
_PTX_PARAM = re.compile(r"\.param\s+(?:\.align\s+(\d+)\s+)?\.([busf])(8|16|32|64)\s+[\w$]+(?:\[(\d+)\])?")


def ptx_entries(text: str) -> list[tuple[str, tuple[tuple[int, int], ...]]]:
    """Kernel names and parameter layouts (offset, size) as the driver computes them."""
    out = []
    for m in _PTX_ENTRY.finditer(text):
        offset = 0
        params = []
        for p in _PTX_PARAM.finditer(m.group(2)):
            elem = int(p.group(3)) // 8
            count = int(p.group(4) or 1)
            align = int(p.group(1) or elem)
            offset = (offset + align - 1) // align * align
            params.append((offset, elem * count))
            offset += elem * count
        out.append((m.group(1), tuple(params)))
    return out


def ptx_local_sizes(text: str) -> dict[str, int]:
    """Each kernel's local memory per thread: the size of its `__local_depot` (what the driver
    reports as CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)."""
    starts = [(m.start(), m.group(1)) for m in _PTX_ENTRY.finditer(text)] + [(len(text), "")]
    sizes = {}
    for (at, name), (end, _) in zip(starts, starts[1:]):
        depot = re.search(r"__local_depot\d*\[(\d+)\]", text[at:end])
        if depot:
            sizes[name] = int(depot.group(1))
    return sizes


# Tensor maps (cuTensorMapEncodeTiled's documentation): element sizes of CUtensorMapDataType 0-12 (the
# packed 4- and 6-bit types 13-15 count as bytes), the largest enumerator of each option.
_TENSOR_ELEMENT_BYTES = (1, 2, 4, 4, 8, 8, 2, 4, 8, 2, 4, 4, 4, 1, 1, 1)
_INTERLEAVE_32B = 2
_CORNER_BITS = {3: 16, 4: 8, 5: 5}   # im2col corners: signed, by rank


def _tensor_map_valid(q: TensorMapRequest) -> bool:
    rank = q.rank
    lowest = 3 if q.kind != TENSOR_MAP_TILED or q.interleave else 1
    if not (lowest <= rank <= 5 and q.data_type < len(_TENSOR_ELEMENT_BYTES) and q.interleave <= 2
            and q.swizzle <= 7 and q.l2_promotion <= 3 and q.oob_fill <= 1):
        return False
    stride_align = 32 if q.interleave == _INTERLEAVE_32B else 16
    if any(not 0 < d <= 1 << 32 for d in q.dims[:rank]) or any(not 1 <= e <= 8 for e in q.element_strides[:rank]):
        return False
    if any(s % stride_align or s >= 1 << 40 for s in q.strides[:rank - 1]):
        return False
    if q.kind == TENSOR_MAP_TILED:
        inner_bytes = q.box[0] * _TENSOR_ELEMENT_BYTES[q.data_type]
        return all(1 <= b <= 256 for b in q.box[:rank]) and (q.interleave != 0 or inner_bytes % 16 == 0)
    if not (1 <= q.channels <= 256 and 1 <= q.pixels <= 1024):
        return False
    if q.kind == TENSOR_MAP_IM2COL_WIDE:
        return q.wide_mode <= 1 and -32768 <= q.lower_w <= 32767 and -32768 <= q.upper_w <= 32767
    half = 1 << (_CORNER_BITS[rank] - 1)
    return all(-half <= c < half for c in (*q.lower[:rank - 2], *q.upper[:rank - 2]))


class EmulatedModules(EmulatedMemory):
    """Modules, functions and launches."""

    # ------------------------------------------------------------------ modules

    def load(self, kind: str, image: bytes | mmap.mmap, options: list[tuple[int, int]],
             lib_options: list[tuple[int, int]], want_table: bool = True) -> LoadResult:
        self._need_ctx()
        image = bytes(image)   # the image cache hands out mappings of its files
        option_values = [v for _, v in options]
        local_sizes: dict[str, int] = {}
        if image[:4] == struct.pack("<I", FATBIN_MAGIC) and not self._runs_here(image):
            return LoadResult(code=NO_BINARY_FOR_GPU, option_values=option_values,
                              error_log=b"emulated device: no code in this fatbin for its compute capability")
        if image[:4] == b"\x7fELF" or image[:4] == struct.pack("<I", FATBIN_MAGIC):
            entries: list[tuple[str, tuple[tuple[int, int], ...]]] = []  # accepted: no kernels known
        else:
            text = image.rstrip(b"\0").decode("utf-8", "replace")
            if ".version" not in text or ".target" not in text:
                return LoadResult(code=INVALID_IMAGE, option_values=option_values,
                                  error_log=b"emulated device: not a PTX, cubin or fatbin image")
            entries = ptx_entries(text)
            local_sizes = ptx_local_sizes(text)
        module = self.handles.new()
        fns = []
        for name, params in entries:
            handle = self.handles.new()
            if local_sizes.get(name):
                self.func_attrs[(handle, 3)] = local_sizes[name]   # CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES
            info = FnInfo(handle, name, params)
            self.functions[handle] = (module, info)
            fns.append(info)
        self.modules[module] = fns
        handle = module
        if kind == "library":
            handle = self.handles.new()
            self.libraries[handle] = module
        info_log = f"emulated device: loaded {len(fns)} kernel(s)".encode()
        return LoadResult(handle=handle, option_values=option_values, info_log=info_log,
                          functions=fns if want_table else [])

    def _runs_here(self, image: bytes) -> bool:
        """Whether a fatbin holds code this device can run, as the driver decides (an image this
        cannot read is left for the worker's own checks to refuse)."""
        try:
            return any(loadable(entry, self.cc) for entry in fatbin_entries(image))
        except ImageUnreadable:
            return True

    def get_function(self, module: int, name: str) -> FnInfo:
        for fn in self.modules.get(module, ()):
            if fn.name == name:
                return fn
        raise CudaError(NOT_FOUND if module in self.modules else INVALID_HANDLE)

    # Private table 6e163fbe slot 7 (cuFFT's module walk), emulated: every function of the module,
    # owned by the module, with the words 1, 2, 3, 4 and 5 standing in for the real node's fields.
    def private_table_size(self, uuid: bytes) -> int:
        if uuid != bytes.fromhex("6e163fbeb958444d835ce182aff1991e"):
            raise CudaError(NOT_FOUND)
        return 12 * 8

    def module_nodes(self, ctx: int, module: int) -> list[tuple[int, ...]]:
        module = self.libraries.get(module, module)
        if module not in self.modules:
            raise CudaError(INVALID_HANDLE)
        return [(f.handle, module, 1, 2, 3, 4, 5, 0) for f in self.modules[module]]

    def param_info(self, handle: int) -> FnInfo:
        if handle not in self.functions:
            raise CudaError(INVALID_HANDLE)
        return self.functions[handle][1]

    def unload(self, kind: str, handle: int) -> None:
        module = self.libraries.pop(handle, None) if kind == "library" else handle
        if module is None or module not in self.modules:
            raise CudaError(INVALID_HANDLE)
        for fn in self.modules.pop(module):
            self.functions.pop(fn.handle, None)

    def cuModuleGetFunctionCount(self, module: int) -> tuple[int, int]:
        return (SUCCESS, len(self.modules[module])) if module in self.modules else (INVALID_HANDLE, 0)

    def cuModuleEnumerateFunctions(self, n: int, module: int) -> tuple[int, list[int]]:
        if module not in self.modules:
            return (INVALID_HANDLE, [])
        return (SUCCESS, [f.handle for f in self.modules[module]][:n])

    def cuModuleGetGlobal_v2(self, module: int, name: str) -> tuple[int, int, int]:
        return (NOT_FOUND, 0, 0)

    def cuLibraryGetModule(self, library: int) -> tuple[int, int]:
        return (SUCCESS, self.libraries[library]) if library in self.libraries else (INVALID_HANDLE, 0)

    def cuLibraryGetKernel(self, library: int, name: str) -> tuple[int, int]:
        module = self.libraries.get(library)
        if module is None:
            return (INVALID_HANDLE, 0)
        try:
            return (SUCCESS, self.get_function(module, name).handle)
        except CudaError as exc:
            return (exc.code, 0)

    def cuKernelGetFunction(self, kernel: int) -> tuple[int, int]:
        return (SUCCESS, kernel) if kernel in self.functions else (INVALID_HANDLE, 0)

    def cuLibraryGetKernelCount(self, library: int) -> tuple[int, int]:
        module = self.libraries.get(library)
        return (SUCCESS, len(self.modules[module])) if module else (INVALID_HANDLE, 0)

    def cuLibraryEnumerateKernels(self, n: int, library: int) -> tuple[int, list[int]]:
        module = self.libraries.get(library)
        return (SUCCESS, [f.handle for f in self.modules[module]][:n]) if module else (INVALID_HANDLE, [])

    def cuFuncGetModule(self, f: int) -> tuple[int, int]:
        return (SUCCESS, self.functions[f][0]) if f in self.functions else (INVALID_HANDLE, 0)

    def cuFuncGetAttribute(self, attrib: int, f: int) -> tuple[int, int]:
        if f not in self.functions:
            return (INVALID_HANDLE, 0)
        return (SUCCESS, self.func_attrs.get((f, attrib), _FUNC_DEFAULTS.get(attrib, 0)))

    def cuFuncSetAttribute(self, f: int, attrib: int, value: int) -> tuple[int]:
        """The driver's checks (cuFuncSetAttribute's documentation): read-only attributes, the opt-in
        shared memory limit, a carveout in percent or -1, cluster sizes of 8 (16 non-portable)."""
        if f not in self.functions:
            return (INVALID_HANDLE,)
        static = self.cuFuncGetAttribute(FUNC_SHARED_SIZE_BYTES, f)[1]
        if attrib == FUNC_MAX_DYNAMIC_SHARED:
            valid = 0 <= value <= self.attributes["MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"] - static
            if valid and self.refuse_shared_above and value > self.refuse_shared_above:
                valid = False
        elif attrib == FUNC_CARVEOUT:
            valid = -1 <= value <= 100
        elif FUNC_CLUSTER_SIZE_MUST_BE_SET < attrib < FUNC_NON_PORTABLE_CLUSTER:
            portable = self.func_attrs.get((f, FUNC_NON_PORTABLE_CLUSTER), 0) == 0
            valid = 0 <= value <= (8 if portable else 16)
        elif attrib == FUNC_NON_PORTABLE_CLUSTER:
            valid = value in (0, 1)
        elif attrib == FUNC_SCHEDULING_POLICY:
            valid = value in (0, 1, 2)
        else:   # read-only, or unknown
            valid = False
        if not valid:
            return (INVALID_VALUE,)
        self.func_attrs[(f, attrib)] = value
        return (SUCCESS,)

    # The emulated device's kernels are their own functions (cuKernelGetFunction): one attribute set.
    def cuKernelGetAttribute(self, attrib: int, kernel: int, dev: int) -> tuple[int, int]:
        return self.cuFuncGetAttribute(attrib, kernel)

    def cuKernelSetAttribute(self, attrib: int, value: int, kernel: int, dev: int) -> tuple[int]:
        return self.cuFuncSetAttribute(kernel, attrib, value)

    def cuFuncSetCacheConfig(self, f: int, config: int) -> tuple[int]:
        return (SUCCESS,) if f in self.functions else (INVALID_HANDLE,)

    def cuOccupancyMaxActiveBlocksPerMultiprocessor(self, f: int, block: int, smem: int) -> tuple[int, int]:
        if f not in self.functions:
            return (INVALID_HANDLE, 0)
        return (SUCCESS, max(0, min(32, 2048 // max(block, 1))))

    def cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(self, f: int, block: int, smem: int, flags: int) -> tuple[int, int]:
        return self.cuOccupancyMaxActiveBlocksPerMultiprocessor(f, block, smem)

    def cuOccupancyAvailableDynamicSMemPerBlock(self, f: int, blocks: int, block_size: int) -> tuple[int, int]:
        if f not in self.functions:
            return (INVALID_HANDLE, 0)
        # The SM's shared memory (228 KiB on an H100), 1 KiB of it reserved per block.
        per_sm = self.attributes["MAX_SHARED_MEMORY_PER_MULTIPROCESSOR"]
        return (SUCCESS, max(0, per_sm // max(blocks, 1) - self.attributes["RESERVED_SHARED_MEMORY_PER_BLOCK"]))

    def max_active_clusters(self, f: int, stream: int, grid: tuple[int, int, int], block: tuple[int, int, int],
                            shmem: int, attrs: bytes) -> int:
        if f not in self.functions:
            raise CudaError(INVALID_HANDLE)
        # Cluster dimension attribute (4): {u32 x, y, z} at offset 8 of each 72-byte attribute.
        size = 1
        for i in range(len(attrs) // 72):
            if int.from_bytes(attrs[i * 72:i * 72 + 4], "little") == 4:
                x, y, z = (int.from_bytes(attrs[i * 72 + 8 + 4 * k:i * 72 + 12 + 4 * k], "little") for k in range(3))
                size = max(1, x * y * z)
        return self.attributes["MULTIPROCESSOR_COUNT"] // size

    def max_potential_block_size(self, f: int, smem: int, limit: int, flags: int) -> tuple[int, int]:
        if f not in self.functions:
            raise CudaError(INVALID_HANDLE)
        block = min(1024, limit) if limit > 0 else 1024
        return self.attributes["MULTIPROCESSOR_COUNT"] * (2048 // block), block

    # ------------------------------------------------------------------ tensor maps

    def tensor_map(self, q: TensorMapRequest) -> bytes:
        """A deterministic 128-byte encoding (the address, then a digest of the rest) after the
        checks cuTensorMapEncodeTiled's documentation lists; ReplaceAddress rewrites the address."""
        if not self.attributes["TENSOR_MAP_ACCESS_SUPPORTED"]:
            raise CudaError(NOT_SUPPORTED, f"rgpu: worker: tensor maps need compute capability 9.0 ({self.spec.gpu_name})")
        align = 32 if q.interleave == _INTERLEAVE_32B else 16
        if q.address % align:
            raise CudaError(INVALID_VALUE)
        if q.kind == TENSOR_MAP_REPLACE:
            return struct.pack("<Q", q.address) + q.map[8:]
        if not _tensor_map_valid(q):
            raise CudaError(INVALID_VALUE)
        digest = hashlib.sha256(TensorMapRequest.WIRE.pack(
            q.kind, q.rank, q.data_type, q.interleave, q.swizzle, q.l2_promotion, q.oob_fill, q.wide_mode, 0,
            q.lower_w, q.upper_w, q.channels, q.pixels, *q.dims, *q.strides, *q.box, *q.element_strides, *q.lower,
            *q.upper, bytes(TENSOR_MAP_BYTES))).digest()
        return (struct.pack("<Q", q.address) + digest).ljust(TENSOR_MAP_BYTES, b"\0")

    def link_create(self, options: list[tuple[int, int]]) -> int:
        self._need_ctx()
        h = self.handles.new()
        self.links[h] = []
        return h

    def link_add(self, state: int, kind: int, name: str, options: list[tuple[int, int]], data: bytes) -> tuple[int, bytes, bytes]:
        if state not in self.links:
            return INVALID_HANDLE, b"", b""
        self.links[state].append(data)
        return SUCCESS, f"emulated linker: added {name or 'input'} ({len(data)} bytes)".encode(), b""

    def link_complete(self, state: int) -> tuple[int, bytes, bytes, bytes]:
        if state not in self.links:
            return INVALID_HANDLE, b"", b"", b""
        # The "linked image" of PTX inputs is their concatenation: loadable by this backend.
        return SUCCESS, b"emulated linker: done", b"", b"\n".join(d.rstrip(b"\0") for d in self.links[state]) + b"\0"

    def link_destroy(self, state: int) -> None:
        if self.links.pop(state, None) is None:
            raise CudaError(INVALID_HANDLE)

    def launch(self, f: int, stream: int, grid: tuple[int, int, int], block: tuple[int, int, int], shmem: int,
               cooperative: bool, attrs: bytes, params: memoryview, params_address: int) -> None:
        self._need_ctx()
        if f not in self.functions:
            raise CudaError(INVALID_HANDLE)
        expected = self.functions[f][1].params
        size = max((o + s for o, s in expected), default=0)
        if len(params) != size:
            raise CudaError(INVALID_VALUE, f"rgpu: worker: launch of {self.functions[f][1].name} carried "
                                           f"{len(params)} parameter bytes, expected {size}")
        self.last_launch = (self.functions[f][1].name, bytes(params))
        limit = self.cuFuncGetAttribute(FUNC_MAX_DYNAMIC_SHARED, f)[1]
        if shmem > limit:   # as the driver refuses it: the function's attribute was not raised enough
            raise CudaError(INVALID_VALUE, f"rgpu: worker: launch of {self.last_launch[0]} asked for {shmem} bytes of "
                                           f"dynamic shared memory; its MAX_DYNAMIC_SHARED_SIZE_BYTES is {limit}")
        if self.last_launch[0] == EMULATED_SHARED_PROBE and len(params) >= 8:
            (out,) = struct.unpack_from("<Q", params, 0)
            self._memset(out, struct.pack("<I", shmem), 1)
            return
        if self.last_launch[0] == EMULATED_SPIN:
            self.spinning = True
            return
        if self.last_launch[0] == EMULATED_WILD_WRITE:
            self.sticky = ILLEGAL_ADDRESS
            if self.fault_domain is not None:
                self.fault_domain.touch()
                with open(self.fault_domain.parent / EMULATED_MPS_LOG, "a") as log:
                    log.write(f"[emulated MPS server] client pid {os.getpid()}: fatal GPU exception (illegal address)\n")
            return
        raise CudaError(NOT_SUPPORTED, _LAUNCH_REFUSED)
