"""The emulated GPU's contexts (primary and created) and its device queries."""

from __future__ import annotations

from rgpu.remoting.datapath.backends.base import (
    INVALID_CONTEXT,
    INVALID_VALUE,
    SUCCESS,
    CudaError,
)
from rgpu.remoting.datapath.backends.emulated_device import _ATTRIBUTES, EmulatedDevice


class EmulatedContexts(EmulatedDevice):
    """Contexts and device attributes, as the driver answers them."""

    def primary_ctx_retain(self) -> int:
        self.primary_refs += 1
        return self.primary

    def ctx_create(self, flags: int) -> int:
        ctx = self.ctx_handles.new()
        self.contexts.add(ctx)
        self.current = ctx
        return ctx

    def ctx_destroy(self, ctx: int) -> None:
        if ctx not in self.contexts:
            raise CudaError(INVALID_CONTEXT)
        self.contexts.discard(ctx)
        if self.current == ctx:
            self.current = 0

    def cuDevicePrimaryCtxRelease_v2(self, dev: int) -> tuple[int]:
        if self.primary_refs <= 0:
            return (INVALID_CONTEXT,)
        self.primary_refs -= 1
        return (SUCCESS,)

    def cuDevicePrimaryCtxReset_v2(self, dev: int) -> tuple[int]:
        self.primary_refs = 0
        self.allocs.clear()
        self.bases.clear()
        for table in (self.arrays, self.mipmaps, self.tex_objects, self.surf_objects):
            table.clear()
        return (SUCCESS,)

    def cuDevicePrimaryCtxGetState(self, dev: int) -> tuple[int, int, int]:
        return (SUCCESS, self.primary_flags, int(self.primary_refs > 0))

    def cuDevicePrimaryCtxSetFlags_v2(self, dev: int, flags: int) -> tuple[int]:
        self.primary_flags = flags
        return (SUCCESS,)

    def cuCtxGetDevice(self) -> tuple[int, int]:
        self._need_ctx()
        return (SUCCESS, 0)

    def cuCtxGetDevice_v2(self, ctx: int) -> tuple[int, int]:
        return (SUCCESS, 0) if self._ctx_ok(ctx or self.current) else (INVALID_CONTEXT, 0)

    def cuCtxSynchronize(self) -> tuple[int]:
        self._need_ctx()
        self._wait_for_kernels()
        return (SUCCESS,)

    def cuCtxSynchronize_v2(self, ctx: int) -> tuple[int]:
        return (SUCCESS,) if self._ctx_ok(ctx or self.current) else (INVALID_CONTEXT,)

    def cuCtxGetApiVersion(self, ctx: int) -> tuple[int, int]:
        return (SUCCESS, 13000) if self._ctx_ok(ctx or self.current) else (INVALID_CONTEXT, 0)

    def cuCtxGetFlags(self) -> tuple[int, int]:
        self._need_ctx()
        return (SUCCESS, self.primary_flags)

    def cuCtxSetFlags(self, flags: int) -> tuple[int]:
        self._need_ctx()
        self.primary_flags = flags
        return (SUCCESS,)

    def cuCtxGetId(self, ctx: int) -> tuple[int, int]:
        ctx = ctx or self.current
        return (SUCCESS, ctx & 0xFFFFFF) if self._ctx_ok(ctx) else (INVALID_CONTEXT, 0)

    def cuCtxGetLimit(self, limit: int) -> tuple[int, int]:
        self._need_ctx()
        return (SUCCESS, self.limits.get(limit, 1024))

    def cuCtxSetLimit(self, limit: int, value: int) -> tuple[int]:
        self._need_ctx()
        self.limits[limit] = value
        return (SUCCESS,)

    def cuCtxGetCacheConfig(self) -> tuple[int, int]:
        return (SUCCESS, 0)

    def cuCtxSetCacheConfig(self, config: int) -> tuple[int]:
        return (SUCCESS,)

    def cuCtxGetStreamPriorityRange(self) -> tuple[int, int, int]:
        return (SUCCESS, 0, -5)

    # ------------------------------------------------------------------ device

    def cuDeviceGetName(self, len_: int, dev: int) -> tuple[int, bytes]:
        return (SUCCESS, (self.spec.gpu_name.encode() + b"\0")[:max(len_, 0)])

    def cuDeviceGetUuid(self, dev: int) -> tuple[int, bytes]:
        return (SUCCESS, self.uuid)

    cuDeviceGetUuid_v2 = cuDeviceGetUuid

    def cuDeviceGetAttribute(self, attrib: int, dev: int) -> tuple[int, int]:
        name = self.attr_names.get(attrib)
        if name is None:
            return (INVALID_VALUE, 0)
        if name == "COMPUTE_CAPABILITY_MAJOR":
            return (SUCCESS, self.cc[0])
        if name == "COMPUTE_CAPABILITY_MINOR":
            return (SUCCESS, self.cc[1])
        return (SUCCESS, self.attributes.get(name, 0))

    def cuDeviceComputeCapability(self, dev: int) -> tuple[int, int, int]:
        return (SUCCESS, self.cc[0], self.cc[1])

    def cuDeviceGetPCIBusId(self, len_: int, dev: int) -> tuple[int, bytes]:
        return (SUCCESS, f"0000:{_ATTRIBUTES['PCI_BUS_ID']:02x}:00.0\0".encode()[:max(len_, 0)])

    def cuDeviceGetDefaultMemPool(self, dev: int) -> tuple[int, int]:
        return (SUCCESS, 0xA000_0000)

    cuDeviceGetMemPool = cuDeviceGetDefaultMemPool
