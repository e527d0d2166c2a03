"""Reading frames from the session socket into one reusable, driver-addressable buffer."""

from __future__ import annotations

import ctypes
import socket

from rgpu.remoting.datapath import protocol

_HEADER = protocol.HEADER


class FrameReader:
    """Reads frames into one reusable buffer; payload views stay valid until the next read.

    The buffer is a ctypes array so backends can hand its addresses to the driver (the CUDA
    backend pins it, so host-to-device copies go straight from the socket buffer by DMA).
    """

    def __init__(self, sock: socket.socket, size: int = 8 << 20) -> None:
        self.sock = sock
        self.size = size
        self.cbuf = (ctypes.c_char * size)()
        self.base = ctypes.addressof(self.cbuf)
        self.view = memoryview(self.cbuf).cast("B")
        self.start = 0
        self.end = 0
        self.big: ctypes.Array | None = None
        self.received = 0   # bytes read from the socket (the session's traffic counters)

    def _fill(self, need: int) -> None:
        if self.end - self.start >= need:
            return
        if self.start + need > self.size:
            n = self.end - self.start
            self.view[0:n] = self.view[self.start:self.end]
            self.start, self.end = 0, n
        while self.end - self.start < need:
            k = self.sock.recv_into(self.view[self.end:], self.size - self.end)
            if k == 0:
                raise EOFError
            self.end += k
            self.received += k

    def next(self) -> tuple[int, int, int, int, int, memoryview, int]:
        """(op, flags, seq, aux, ctx, payload, payload_address)."""
        self._fill(protocol.HEADER_SIZE)
        length, op, flags, seq, aux, ctx = _HEADER.unpack_from(self.view, self.start)
        self.start += protocol.HEADER_SIZE
        if length > protocol.MAX_FRAME:
            raise ValueError(f"frame of {length} bytes")
        if length + 64 <= self.size:
            self._fill(length)
            payload = self.view[self.start:self.start + length]
            address = self.base + self.start
            self.start += length
            return op, flags, seq, aux, ctx, payload, address
        # Larger than the buffer (a big module image): read it into its own array.
        big = (ctypes.c_char * length)()
        bview = memoryview(big).cast("B")
        have = min(self.end - self.start, length)
        bview[0:have] = self.view[self.start:self.start + have]
        self.start += have
        got = have
        while got < length:
            k = self.sock.recv_into(bview[got:], length - got)
            if k == 0:
                raise EOFError
            got += k
            self.received += k
        self.big = big
        return op, flags, seq, aux, ctx, bview, ctypes.addressof(big)

