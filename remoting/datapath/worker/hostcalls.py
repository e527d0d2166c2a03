"""Host nodes: the application's host function runs in the client process, in graph order.

A host node of the worker's graph (cuGraphAddHostNode, or cuLaunchHostFunc on a capturing
stream) calls `HostCalls.run` with the id the client registered for its function: on a driver
thread with a real GPU, on the serving thread itself on the emulated device. `run` sends a
HOST_CALL frame and blocks until the client's HOST_DONE for it arrives, so the node's dependents
start only after the function returned in the client. The client runs it when it next reads
from the connection (every synchronising call does). If the application makes no further call,
the graph waits, as a real host node waits for a busy host thread; when the connection ends, the
node gives up and returns, so closing a session never hangs the worker.

Who reads HOST_DONE: the serving loop when it reads frames (it hands them to `done`). But the loop
may be blocked inside a handler waiting for the very graph that waits for the host function
(cuStreamSynchronize, a blocking copy, the emulated device's cuGraphLaunch). So the loop holds
`reader_lock` while it reads and lends it out while a handler runs (once a host node exists in
the session); a waiting `run` takes it then and reads on the loop's behalf: it appends what
arrives to the receive buffer (past `end`, never moving the bytes before, where the running
handler's payload lies) and scans the complete frames there for its HOST_DONE, leaving every
frame, HOST_DONE included, for the loop to process in order (a HOST_DONE already seen is a no-op).

Host memory: a graph's copy nodes with a host side go through pinned worker buffers that stand
for the client's memory while the graph runs (refreshed before a launch, read back after it). So
HOST_CALL carries the host node's graph's regions and the device-to-host ones' data as they are
now (the copies before the node have finished): the client writes them into its memory, runs the
function, and returns every region's data in HOST_DONE, which goes into the buffers before the
node's dependents start (simpleCudaGraphs' callback reads the result a copy node just wrote, and
resets it).

When the buffer is full of frames the loop has not run yet (a large cuMemcpyHtoDAsync queued
behind a handler blocked on the graph), `run` reads on into the reader's spill, which the loop
reads before the socket.

Limits: past MAX_SPILL bytes queued behind a blocked handler nothing more is read until the
handler returns. The native launch path does not lend the reader: a launch blocking on a full
driver queue (about a thousand launches) behind a waiting host node would wait for the loop's
next read.
"""

from __future__ import annotations

import itertools
import logging
import os
import select
import socket
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from rgpu.remoting.datapath import protocol
from rgpu.remoting.datapath.worker.frames import FrameReader

# A host-copy region of the host node's graph: (worker buffer, size, to_host).
Region = tuple[int, int, bool]
_REGION = struct.Struct("<QQII")

log = logging.getLogger("rgpu.worker")

# How long a waiting host node waits for the reader, and for the socket while it holds the reader
# (a serving loop that wants its reader back wakes it at once through a pipe).
_TURN_S = 0.02
_SELECT_S = 0.05
# The most a waiting host node reads past a full receive buffer (frames queued behind a handler
# blocked on the graph, e.g. a large cuMemcpyHtoDAsync behind it on its stream).
MAX_SPILL = 1 << 30


class HostCalls:
    def __init__(self, sock: socket.socket, reader: FrameReader, send_lock: threading.Lock, backend: object) -> None:
        self.sock = sock
        self.backend = backend
        self.reader = reader
        self.send_lock = send_lock
        self.reader_lock = threading.Lock()
        # True once the session made a host node: from then on the loop lends the reader while a
        # handler runs (before, no node can wait, and the loop pays nothing).
        self.active = False
        self.closed = False
        self.lent = False                         # the serving loop lent the reader (a handler runs)
        self.loop_thread = threading.get_ident()  # the serving loop's thread
        self._numbers = itertools.count(1)
        self._waiting: dict[int, list] = {}   # call number -> [threading.Event, verdict, HOST_DONE payload]
        self._lock = threading.Lock()
        self.sent = 0
        self._scratch = bytearray(1 << 20)
        self._scanned = 0   # the stream offset up to which whole frames were scanned for HOST_DONE
        # The loop writes a byte here when it wants its reader back from a waiting node's select.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    # ------------------------------------------------------------------ the host node's side

    def run(self, fn_id: int, status: int = 0, regions: list[Region] | None = None) -> int:
        """Run the client's function `fn_id` and wait until it returned; the client's verdict
        (protocol.HOST_DONE_*), or -1 when the connection ended first. `regions`: the host-copy
        buffers of the node's graph, brought into the client's memory and back around the call."""
        if threading.get_ident() == self.loop_thread and not self.lent:
            log.error("a host node ran on the serving thread outside a handler; it cannot wait for the client")
            return -1
        number = next(self._numbers) & 0xFFFFFFFF
        entry: list = [threading.Event(), -1, b""]
        regions = list(regions or ())
        with self._lock:
            if self.closed:
                return -1
            self._waiting[number] = entry
        try:
            body = self._call_payload(regions)
            frame = protocol.HEADER.pack(len(body), protocol.OP_HOST_CALL, 0, number, status & 0xFFFFFFFF, fn_id) + body
            try:
                with self.send_lock:
                    self.sock.sendall(frame)
                self.sent += len(frame)
            except OSError:
                self.close()
                return -1
            event = entry[0]
            while not event.is_set() and not self.closed:
                if self.reader_lock.acquire(timeout=_TURN_S):
                    try:
                        self._read_turn(event)
                    finally:
                        self.reader_lock.release()
                    if not event.is_set():
                        event.wait(0.001)   # let the serving loop take the reader
            if entry[1] == protocol.HOST_DONE_UNKNOWN_ID:
                log.warning("the client refused host function id %d (it never registered it)", fn_id)
            elif entry[1] == protocol.HOST_DONE_RAN and regions:
                self._take_back(regions, entry[2])
            return entry[1]
        finally:
            with self._lock:
                self._waiting.pop(number, None)

    def _call_payload(self, regions: list[Region]) -> bytes:
        """u32 count, u32 0, {u64 buffer, u64 size, u32 to_host, u32 0} each, then the data of the
        device-to-host regions in that order."""
        if not regions:
            return b""
        head = struct.pack("<II", len(regions), 0) + b"".join(_REGION.pack(b, n, int(t), 0) for b, n, t in regions)
        peek = self.backend.graph_host_peek   # type: ignore[attr-defined]
        return head + b"".join(peek(b, n) for b, n, t in regions if t)

    def _take_back(self, regions: list[Region], payload: bytes) -> None:
        """HOST_DONE's {u64 buffer, u64 size, data} records: the client's memory after its function
        ran, into the buffers. Only regions of this call are written, at their own size."""
        allowed = {(b, n) for b, n, _ in regions}
        poke = self.backend.graph_host_poke   # type: ignore[attr-defined]
        off = 0
        while off + 16 <= len(payload):
            buffer, size = struct.unpack_from("<QQ", payload, off)
            off += 16
            if (buffer, size) not in allowed or off + size > len(payload):
                log.warning("the client's host function answer names an unknown region; ignored")
                return
            poke(buffer, payload[off:off + size])
            off += size

    def _read_turn(self, event: threading.Event) -> None:
        """Scan the frames not yet run (the receive buffer's, then the spill's) for HOST_DONE, each
        once (a HOST_DONE seen went to its waiter, which existed before the client could send it);
        read more while none is there: into the buffer while it has room, else into its spill."""
        r = self.reader
        size = protocol.HEADER_SIZE
        at = r.origin + r.start   # the stream offset of the first frame not yet run
        pos = max(self._scanned - at, 0)   # offset past r.start: the buffer's bytes, then the spill's
        while True:
            while True:
                head = self._peek(pos, size)
                if head is None:
                    break
                length, op, _flags, seq, aux, _ctx = protocol.HEADER.unpack(head)
                if (r.end - r.start) + len(r.spill) < pos + size + length:
                    break
                if op == protocol.OP_HOST_DONE:
                    self.done(seq, aux, self._peek(pos + size, length) or b"")
                pos += size + length
                self._scanned = at + pos
            if event.is_set() or self.closed:
                return
            room = r.size - r.end
            if r.spill or room < 4096:
                if len(r.spill) >= MAX_SPILL:
                    return   # the loop must run what is queued first (see the module's limits)
                target = memoryview(self._scratch)
                room = len(self._scratch)
            else:
                target = r.view[r.end:]
            try:
                readable, _, _ = select.select([self.sock, self._wake_r], [], [], _SELECT_S)  # type: ignore[type-var]
                if self._wake_r in readable:
                    self._drain_wake()
                    return   # the loop wants its reader: it reads the rest itself, or lends it again
                if not readable:
                    return
                k = self.sock.recv_into(target, room)
            except (OSError, ValueError):
                self.close()
                return
            if k == 0:
                self.close()   # the loop sees the end of the stream too, at its next read
                return
            if target.obj is self._scratch:   # counted by the loop when it reads the spill
                if not r.spill:
                    log.debug("a waiting host node reads past the full receive buffer")
                r.spill += target[:k]
            else:
                r.end += k
                r.received += k

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _peek(self, pos: int, n: int) -> bytes | None:
        """n bytes at `pos` past the reader's start, across its buffer and spill; None if not there yet."""
        r = self.reader
        in_buffer = r.end - r.start
        if pos + n > in_buffer + len(r.spill):
            return None
        if pos + n <= in_buffer:
            return bytes(r.view[r.start + pos:r.start + pos + n])
        head = bytes(r.view[r.start + pos:r.end]) if pos < in_buffer else b""
        at = max(pos - in_buffer, 0)
        return head + bytes(r.spill[at:at + n - len(head)])

    @contextmanager
    def lending(self) -> Iterator[None]:
        """The serving loop lends its reader while it runs something that may wait for the GPU
        (a handler, the compute limiter's fence): a host node may then read its HOST_DONE."""
        if not self.active or self.lent or self.closed or threading.get_ident() != self.loop_thread:
            yield
            return
        self.lent = True
        self.reader_lock.release()
        try:
            yield
        finally:
            if not self.reader_lock.acquire(blocking=False):
                try:
                    os.write(self._wake_w, b"w")   # a waiting node holds the reader: ask for it back
                except BlockingIOError:
                    pass   # asked already
                self.reader_lock.acquire()
            self.lent = False

    # ------------------------------------------------------------------ the serving loop's side

    def done(self, number: int, verdict: int, payload: bytes = b"") -> None:
        """A HOST_DONE frame (read by the loop or by `run`); a second sight of it does nothing."""
        with self._lock:
            entry = self._waiting.get(number)
        if entry is not None and not entry[0].is_set():
            entry[1] = verdict
            entry[2] = payload
            entry[0].set()

    def close(self) -> None:
        """The connection ended: every waiting host node gives up."""
        with self._lock:
            self.closed = True
            entries = list(self._waiting.values())
        for entry in entries:
            entry[0].set()
