"""The worker's module handlers: loads (image cache, footprint counted against the slice), functions,
links, the private table cuFFT uses."""

from __future__ import annotations

import mmap
import struct
import time
from collections.abc import Callable

from rgpu.remoting.datapath.backends.base import (CDP_NOT_SUPPORTED, INVALID_IMAGE, INVALID_VALUE, NOT_FOUND, SUCCESS,
                                                  CudaError, LoadResult)
from rgpu.remoting.datapath.worker.codecs import (MAX_MODULE_NODES, MODULE_NODE, U32, U64, fn_bytes, fn_without_handle,
                                                  lp, read_options, take_str)
from rgpu.remoting.datapath.worker.image_cache import IMAGE_BY_HASH, IMAGE_BYTES, IMAGE_BYTES_TO_CACHE, IMAGE_WANT_TABLE
from rgpu.remoting.datapath.worker.module_footprint import ImageUnreadable
from rgpu.remoting.datapath.worker.spec import SessionSpec
from rgpu.units import format_bytes
from rgpu.remoting.datapath.worker.handler_state import HandlerState


def cdp_refused_message(kind: str, spec: SessionSpec) -> str:
    """The line an application gets when the driver refuses a module that uses dynamic parallelism
    (kernels that launch kernels): NVIDIA MPS does not run those, an isolated GPU does."""
    what = "cuLibraryLoadData" if kind == "library" else "cuModuleLoadData"
    gpu = f"GPU {spec.gpu_index} ({spec.gpu_name}) of {spec.server}"
    if spec.sharing == "mps":
        return (f"rgpu: worker: {what}: this module uses CUDA dynamic parallelism (kernels that launch kernels), "
                f"which NVIDIA MPS does not support, and {gpu} is shared through MPS: ask for isolation=strict "
                f"(an isolated or exclusive GPU) to run it")
    return f"rgpu: worker: {what}: the driver of {gpu} does not support CUDA dynamic parallelism here"


class ModuleHandlers(HandlerState):
    """Modules, functions and links."""

    # ------------------------------------------------------------------ modules

    def _load_reply(self, res: LoadResult, with_functions: bool) -> bytes:
        parts = [U64.pack(res.handle), U32.pack(len(res.option_values))]
        parts.extend(U64.pack(v & 0xFFFFFFFFFFFFFFFF) for v in res.option_values)
        parts += [lp(res.info_log), lp(res.error_log)]
        if with_functions:
            parts.append(U32.pack(len(res.functions)))
            parts.extend(fn_bytes(fn) for fn in res.functions)
        return b"".join(parts)

    def h_load(self, kind: str) -> Callable[[memoryview, int, int], tuple[int, bytes]]:
        def run(p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
            options, off = read_options(p, 0)
            lib_options, off = read_options(p, off)
            (size,) = U64.unpack_from(p, off)
            how, want_table = p[off + 8] & ~IMAGE_WANT_TABLE, bool(p[off + 8] & IMAGE_WANT_TABLE)
            digest = bytes(p[off + 9:off + 41])
            off += 41
            if how not in (IMAGE_BYTES, IMAGE_BY_HASH, IMAGE_BYTES_TO_CACHE) or len(digest) != 32:
                raise CudaError(INVALID_VALUE, "rgpu: worker: a module load names its image in no way this worker "
                                "knows (install the same rgpu version on the CPU and GPU nodes)")
            checked = False   # whether `digest` is the image's, as the worker computed it
            step = self._load_step
            t = step("", 0)
            if how == IMAGE_BY_HASH:
                image = self.image_cache.get(digest)
                if image is None or len(image) != size:
                    return SUCCESS, b""   # not cached here: the client sends the bytes
                checked = True
            else:
                image = bytes(p[off:off + size])
                if how == IMAGE_BYTES_TO_CACHE:
                    checked = self.image_cache.put(digest, image)
            t = step("image from the cache" if how == IMAGE_BY_HASH else "image from the wire (stored)"
                     if checked else "image from the wire", t, len(image))
            # The module's variables live in device memory from the load on: charged first.
            footprint, label = self._module_footprint(kind, image, digest if checked else None)
            t = step("footprint", t)
            try:
                res = self.backend.load(kind, image, options, lib_options, want_table)
                step("driver load and function table", t)
            except BaseException:
                if footprint and self.memory is not None:
                    self.memory.cancel()
                raise
            code = getattr(res, "code", SUCCESS)
            if footprint and self.memory is not None:
                if code == SUCCESS:
                    self.memory.add(self._module_key(kind, res.handle), footprint, label)
                else:
                    self.memory.cancel()
            if code == CDP_NOT_SUPPORTED:
                raise CudaError(code, cdp_refused_message(kind, self.spec))
            return code, self._load_reply(res, code == SUCCESS)
        return run

    def _load_step(self, name: str, since: int, image_bytes: int = 0) -> int:
        """RGPU_WORKER_PROFILE: time spent in each step of module loads (`load_steps` in the profile)."""
        now = time.perf_counter_ns()
        if self.load_steps is not None and name:
            entry = self.load_steps.setdefault(name, [0, 0, 0])
            entry[0] += 1
            entry[1] += now - since
            entry[2] += image_bytes
        return now

    @staticmethod
    def _module_key(kind: str, handle: int) -> int:
        return -((4 if kind == "library" else 3) << 64) - handle

    def _module_footprint(self, kind: str, image: bytes | mmap.mmap, digest: bytes | None) -> tuple[int, str]:
        """The device memory the image's variables take, claimed against the slice (0: nothing
        claimed); an image whose variables cannot be counted is refused."""
        what = "cuLibraryLoadData" if kind == "library" else "cuModuleLoadData"
        try:
            footprint = self.footprints.of(image, digest)
        except ImageUnreadable as exc:
            raise CudaError(INVALID_IMAGE, f"rgpu: worker: {what} refused: the memory its variables take cannot be "
                            f"counted against the slice ({exc}); load a cubin, PTX or fatbin made by nvcc, NVRTC or "
                            f"nvJitLink") from None
        label = f"{what} (the module's __device__ and __constant__ variables take {format_bytes(footprint)})"
        if footprint and self.memory is not None:
            self.memory.check(footprint, label)
        return footprint, label

    def h_get_function(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        (module,) = U64.unpack_from(p, 0)
        name, _ = take_str(p, 8)
        return SUCCESS, fn_bytes(self.backend.get_function(module, name))

    def h_param_info(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        (handle,) = U64.unpack_from(p, 0)
        return SUCCESS, fn_without_handle(self.backend.param_info(handle))

    def h_unload(self, kind: str) -> Callable[[memoryview, int, int], tuple[int, bytes]]:
        def run(p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
            (handle,) = U64.unpack_from(p, 0)
            self.backend.unload(kind, handle)
            if self.memory is not None:
                self.memory.remove(self._module_key(kind, handle))
            return SUCCESS, b""
        return run

    def h_link_create(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        options, _ = read_options(p, 0)
        return SUCCESS, U64.pack(self.backend.link_create(options))

    def h_link_add(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        state, kind = struct.unpack_from("<Qi", p, 0)
        name, off = take_str(p, 12)
        options, off = read_options(p, off)
        (size,) = U64.unpack_from(p, off)
        off += 8
        code, info, error = self.backend.link_add(state, kind, name, options, bytes(p[off:off + size]))
        return code, lp(info) + lp(error)

    def h_link_complete(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        (state,) = U64.unpack_from(p, 0)
        code, info, error, cubin = self.backend.link_complete(state)
        body = lp(info) + lp(error)
        if code == SUCCESS:
            body += U64.pack(len(cubin)) + cubin
        return code, body

    def h_link_destroy(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        (state,) = U64.unpack_from(p, 0)
        self.backend.link_destroy(state)
        return SUCCESS, b""

    def h_private_table_size(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        size = getattr(self.backend, "private_table_size", None)
        if size is None or len(p) < 16:
            return NOT_FOUND, b""
        return SUCCESS, U64.pack(size(bytes(p[:16])))

    def h_module_nodes(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        """Private table 6e163fbe slot 7 on the worker's driver: the module's function nodes, each
        with its owner and the fields the client copies into its own node (module_nodes.c)."""
        walk = getattr(self.backend, "module_nodes", None)
        if walk is None:
            return NOT_FOUND, b""
        ctx, module = struct.unpack_from("<QQ", p, 0)
        nodes = walk(ctx, module)[:MAX_MODULE_NODES]
        return SUCCESS, U32.pack(len(nodes)) + b"".join(MODULE_NODE.pack(*n) for n in nodes)
