"""The worker's handlers for copies whose bytes travel apart from the session's connection: over
UCX, through the client's shared page-locked memory, striped over data lanes."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from rgpu.remoting.datapath import protocol
from rgpu.remoting.datapath.backends.base import INVALID_VALUE, NOT_SUPPORTED, SUCCESS, CudaError
from rgpu.remoting.datapath.worker.codecs import U64
from rgpu.remoting.datapath.worker.shared_pinned import SHARE, SHARED_COPY, SharedRegions
from rgpu.units import format_bytes
from rgpu.remoting.datapath.worker.handler_state import HandlerState

log = logging.getLogger("rgpu.worker")


class TransferHandlers(HandlerState):
    """UCX, shared page-locked memory, data lanes."""

    # ---- copies whose bytes travel on UCX (protocol 10; datapath/transport.py) ----

    def _ucx_copy(self, p: memoryview, name: str) -> tuple[Any, int, int, int]:
        """(the session's UCX link, device address, size, the driver's stream) of a UCX copy frame,
        or a CudaError that says what is wrong with it."""
        link = getattr(self, "ucx", None)
        if link is None:
            raise CudaError(INVALID_VALUE, f"rgpu: worker: {name} on a session that did not negotiate UCX (a client "
                            "of another rgpu version, or not rgpu's; install the same rgpu version on both sides)")
        if len(p) < protocol.UCX_COPY.size:
            raise CudaError(INVALID_VALUE, f"rgpu: worker: truncated {name} frame ({len(p)} bytes, want "
                            f"{protocol.UCX_COPY.size}; install the same rgpu version on both sides)")
        dev, stream, size = protocol.UCX_COPY.unpack_from(p, 0)
        if not 0 < size <= self.spec.memory_limit:
            raise CudaError(INVALID_VALUE, f"rgpu: worker: {name} of {size} bytes (want 1 byte up to the slice's "
                            f"{format_bytes(self.spec.memory_limit)})")
        return link, dev, size, stream

    def _ucx_staging(self, size: int) -> Any:
        """A host buffer for a backend whose device memory the worker cannot address and that has
        no pinned buffer for the copy (_ucx_pinned): kept between copies. Bytes land here, then take
        the backend's htod (through its pinned ring); device-to-host gathers the backend's chunks
        here before sending (whole on an H100, tests/remoting/test_gpu_ucx.py, before the pinned
        buffer; the second copy kept it no faster than TCP)."""
        import ctypes
        buf = getattr(self, "_ucx_buf", None)
        if buf is None or ctypes.sizeof(buf) < size:
            buf = self._ucx_buf = (ctypes.c_char * size)()
        return buf

    def _ucx_pinned(self, size: int) -> int:
        """The backend's pinned buffer for a UCX copy of `size` bytes (the CUDA backend: its DMA goes
        straight from or into it, no second host copy), or 0: none (a backend without one, or a copy
        larger than it keeps), then the bytes take _ucx_staging."""
        buffer = getattr(self.backend, "ucx_buffer", None)
        return buffer(size) if buffer is not None else 0

    def h_htod_ucx(self, p: memoryview, address: int, seq: int) -> None:
        """Protocol 15: the bytes come in chunks (protocol.ucx_chunks); on a GPU each chunk's DMA is
        queued the moment it is in, so PCIe moves one chunk while the next arrives."""
        import ctypes
        link, dst, size, stream = self._ucx_copy(p, "rgpuMemcpyHtoDUcx")
        fd = self.sock.fileno()
        chunks = protocol.ucx_chunks(size)
        try:
            real = self.client_streams.real(stream, "cuMemcpyHtoDAsync")
            window = getattr(self.backend, "device_window", None)
            target = window(dst, size, real, "cuMemcpyHtoDAsync") if window is not None else None
        except CudaError:
            # The client sends the bytes whatever the answer: take them off the wire (truncated into
            # a scratch word), so the next copy's messages are not mistaken for this one's.
            scratch = ctypes.c_uint64()
            for i, _at, _n in chunks:
                try:
                    link.recv(protocol.ucx_tag(seq, i), ctypes.addressof(scratch), ctypes.sizeof(scratch), fd)
                except CudaError:
                    pass
            raise
        if target is not None:   # the emulated device: straight into its memory
            holder = (ctypes.c_char * size).from_buffer(target)
            base = ctypes.addressof(holder)
            for i, at, n in chunks:
                link.recv(protocol.ucx_tag(seq, i), base + at, n, fd)
            del holder
        elif (pinned := self._ucx_pinned(size)):   # a real GPU: into pinned memory, a DMA per chunk from there
            for i, at, n in chunks:
                link.recv(protocol.ucx_tag(seq, i), pinned + at, n, fd)
                self.backend.htod_ucx(dst + at, real, n, at)
        else:
            staging = self._ucx_staging(size)
            base, view = ctypes.addressof(staging), memoryview(staging).cast("B")
            for i, at, n in chunks:
                link.recv(protocol.ucx_tag(seq, i), base + at, n, fd)
                self.backend.htod(dst + at, real, view[at:at + n], base + at)
            del view
        self.ucx_received = getattr(self, "ucx_received", 0) + size

    def h_dtoh_ucx(self, p: memoryview, address: int, seq: int) -> None:
        """Protocol 15: the bytes go in chunks; on a GPU every chunk's DMA is queued at once and each
        chunk is sent the moment its DMA is done, so the network moves one while PCIe fills the next."""
        import ctypes
        link, src, size, stream = self._ucx_copy(p, "rgpuMemcpyDtoHUcx")
        real = self.client_streams.real(stream, "cuMemcpyDtoHAsync")
        chunks = protocol.ucx_chunks(size)
        window = getattr(self.backend, "device_window", None)
        ready: Any = ((at, n) for _, at, n in chunks)
        if window is not None:
            holder: Any = (ctypes.c_char * size).from_buffer(window(src, size, real, "cuMemcpyDtoHAsync"))
        elif (pinned := self._ucx_pinned(size)):   # a real GPU: DMAs into pinned memory, sent from there
            holder = (ctypes.c_char * size).from_address(pinned)
            ready = self.backend.dtoh_ucx_chunks(src, real, size, protocol.UCX_CHUNK_BYTES)
        else:
            holder = self._ucx_staging(size)
            view, at = memoryview(holder).cast("B"), 0
            for chunk in self.backend.dtoh_chunks(src, real, size, protocol.CHUNK_BYTES):
                view[at:at + len(chunk)] = chunk
                at += len(chunk)
            del view
        # Each chunk's send is posted (the client's receives are), the REPLY on TCP after the first;
        # the sends complete once the client, having read the reply, takes them.
        base, sends, replied, why = ctypes.addressof(holder), [], False, ""
        try:
            for i, (at, n) in enumerate(ready):
                sends.append((link.post_send(protocol.ucx_tag(seq, i), base + at, n), n))
                if not replied:
                    self._reply(seq, SUCCESS, b"", "")
                    replied = True
        except CudaError as exc:
            if not replied:
                raise            # nothing was sent: the client gets the error
            why = exc.message    # the client was told success: the session cannot go on truthfully
        for req, n in sends:
            why = link.finish_send(req, n, self.sock.fileno()) or why
        del holder
        if why:
            log.error("rgpu: worker: a device-to-host copy over UCX failed after its reply (%s); ending the session", why)
            raise ConnectionError(why)
        self.sent += size
        return None

    # ---- same-host page-locked memory read in place (protocol 15; worker/shared_pinned.py) ----

    def _shared(self) -> SharedRegions:
        regions: SharedRegions | None = getattr(self, "shared_regions", None)
        if regions is None:
            regions = self.shared_regions = SharedRegions(self.spec.client.get("uid"),
                                                          getattr(self.backend, "host_register", None),
                                                          getattr(self.backend, "host_unregister", None))
        return regions

    def h_host_share(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        size, nonce = SHARE.unpack_from(p, 0)
        if not hasattr(self.backend, "device_window") and not hasattr(self.backend, "htod_host"):
            raise CudaError(NOT_SUPPORTED, "")   # a backend that cannot copy from host memory in place
        if size == 0:
            return SUCCESS, self._shared().socket_name()
        return SUCCESS, U64.pack(self._shared().add(size, nonce))

    def h_host_unshare(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        (region,) = U64.unpack_from(p, 0)
        self._shared().remove(region)
        return SUCCESS, b""

    def h_htod_shared(self, wait: bool) -> Callable[[memoryview, int, int], tuple[int, bytes]]:
        def run(p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
            dst, stream, region, offset, size = SHARED_COPY.unpack_from(p, 0)
            at, host = self._shared().span(region, offset, size, "cuMemcpyHtoD from shared page-locked memory")
            real = self.client_streams.real(stream, "cuMemcpyHtoDAsync")
            window = getattr(self.backend, "device_window", None)
            if window is not None:   # the emulated device: from the client's pages into its memory
                window(dst, size, real, "cuMemcpyHtoDAsync")[:] = host
            else:                    # a GPU: one DMA from the client's registered pages
                self.backend.htod_host(dst, real, at, size, wait)
            del host
            self.shared_bytes = getattr(self, "shared_bytes", 0) + size
            return SUCCESS, b""
        return run

    def h_dtoh_shared(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        src, stream, region, offset, size = SHARED_COPY.unpack_from(p, 0)
        at, host = self._shared().span(region, offset, size, "cuMemcpyDtoH into shared page-locked memory")
        real = self.client_streams.real(stream, "cuMemcpyDtoHAsync")
        window = getattr(self.backend, "device_window", None)
        if window is not None:
            host[:] = window(src, size, real, "cuMemcpyDtoHAsync")
        else:
            self.backend.dtoh_host(src, real, at, size)
        del host
        self.shared_bytes = getattr(self, "shared_bytes", 0) + size
        return SUCCESS, b""

    # ---- copies whose bytes come striped over the session's data lanes (protocol 12; worker/lanes.py) ----

    def _striped_copy(self, p: memoryview, name: str, close_if_truncated: bool) -> tuple[Any, tuple[int, int, int, int]]:
        """The session's lanes and a striped copy's (address, stream, size, chunk), or the CudaError
        that refuses the frame (no lanes, a truncated frame, sizes the lanes refuse)."""
        self.settle_lane_receive(wait=True)   # the lanes carry one copy at a time
        lanes = getattr(self, "lanes", None)
        if lanes is None:
            raise CudaError(INVALID_VALUE, f"rgpu: worker: {name} on a session that has no data lanes (a client of "
                                           "another rgpu version, or not rgpu's; install the same rgpu version on "
                                           "both sides)")
        if len(p) < protocol.LANES_COPY.size:
            if close_if_truncated:
                lanes.close("a truncated striped copy frame")
            raise CudaError(INVALID_VALUE, f"rgpu: worker: truncated {name} frame ({len(p)} bytes, want "
                                           f"{protocol.LANES_COPY.size}; install the same rgpu version on both sides)")
        fields = protocol.LANES_COPY.unpack_from(p, 0)
        lanes.check(fields[2], fields[3])
        return lanes, fields

    def h_htod_lanes(self, p: memoryview, address: int, seq: int) -> None:
        import ctypes
        lanes, (dst, stream, size, chunk) = self._striped_copy(p, "rgpuMemcpyHtoDLanes", close_if_truncated=True)
        try:
            if size > self.spec.memory_limit:
                raise CudaError(INVALID_VALUE, f"rgpu: worker: a host-to-device copy of {size} bytes (more than the "
                                               f"slice's {format_bytes(self.spec.memory_limit)})")
            real = self.client_streams.real(stream, "cuMemcpyHtoDAsync")
            striped = getattr(self.backend, "htod_lanes", None)
            window = getattr(self.backend, "device_window", None)
            target = None if striped is not None or window is None else window(dst, size, real, "cuMemcpyHtoDAsync")
        except CudaError:
            lanes.receive(seq, size, chunk, 0)   # the client sends the bytes whatever the answer: drop them
            raise
        background = getattr(self.backend, "htod_lanes_background", None)
        if background is not None and background(dst, real, size, chunk, seq, lanes):
            self.lane_receive_live = True   # a thread receives it; the loop serves the next frames
        elif striped is not None:   # a real GPU: through pinned staging, each chunk's copy queued as it lands
            striped(dst, real, size, chunk, seq, lanes)
        elif target is not None:   # the emulated device: straight into its memory
            holder = (ctypes.c_char * size).from_buffer(target)
            try:
                lanes.receive(seq, size, chunk, ctypes.addressof(holder))
            finally:
                del holder
        else:
            lanes.receive(seq, size, chunk, 0)
            raise CudaError(NOT_SUPPORTED, "rgpu: worker: this backend cannot take striped copies")

    def settle_lane_receive(self, wait: bool) -> None:
        """Collect the striped copy a thread receives in the background (backends/cuda_copies.py) once it
        is over (`wait`: wait for it): its failure answers the session's next synchronising call, as
        an asynchronous copy's does on a local GPU."""
        settle = getattr(self.backend, "lane_receive_settle", None)
        if settle is None:
            return
        live, error = settle(wait)
        self.lane_receive_live = live
        if error is not None:
            log.warning("%s", error.message or f"rgpu: worker: a striped host-to-device copy failed (CUDA error "
                                               f"{error.code})")
            self._defer(error.code, error.message)

    def h_dtoh_lanes(self, p: memoryview, address: int, seq: int) -> None:
        """The REPLY goes first (an error: nothing follows on the lanes), then the bytes, striped."""
        import ctypes
        lanes, (src, stream, size, chunk) = self._striped_copy(p, "rgpuMemcpyDtoHLanes", close_if_truncated=False)
        if size > self.spec.memory_limit:
            raise CudaError(INVALID_VALUE, f"rgpu: worker: a device-to-host copy of {size} bytes (more than the "
                                           f"slice's {format_bytes(self.spec.memory_limit)})")
        real = self.client_streams.real(stream, "cuMemcpyDtoHAsync")
        striped = getattr(self.backend, "dtoh_lanes", None)
        if striped is not None:   # a real GPU: through pinned staging, each chunk sent as its copy completes
            gpu = striped(src, real, size, chunk, lanes)
            self._reply(seq, SUCCESS, b"", "")
            why = lanes.send(seq, size, chunk, 0, gpu)
        else:
            window = getattr(self.backend, "device_window", None)
            if window is None:
                raise CudaError(NOT_SUPPORTED, "rgpu: worker: this backend cannot send striped copies")
            holder = (ctypes.c_char * size).from_buffer(window(src, size, real, "cuMemcpyDtoHAsync"))
            self._reply(seq, SUCCESS, b"", "")
            try:
                why = lanes.send(seq, size, chunk, ctypes.addressof(holder))
            finally:
                del holder
        if why:   # the client was told success and reads its lanes: it sees them fail too
            log.warning("rgpu: worker: a device-to-host copy of %d bytes over data lanes failed (%s); the session's "
                        "lanes are closed, its later copies use its one connection", size, why)
        return None
