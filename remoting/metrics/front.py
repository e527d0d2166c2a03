"""An HTTP front that slow or idle clients cannot exhaust, for the daemons' endpoints anyone on
the network can reach (the pool's dashboard, the pool's and dispatchers' `/metrics`).

http.server gives each connection a thread that waits on it for ever: 300 slow connections made
300 threads, and a thousand idle ones took the daemon's open files (issue 26, HIGH 4). Here one
asyncio loop holds the connections (an idle one costs a socket, no thread) and:

- at most `connections` are open at once (capped to a share of the process's open-file limit);
  a newcomer then displaces a connection still sending its request head (the busiest address's
  oldest, else the oldest if older than a second, as the dispatcher's data port does), or is
  closed as soon as it is accepted;
- the whole request head (and a TLS handshake) must arrive within `head_seconds` of connecting,
  however it trickles, and be at most `head_bytes`; the answer must be taken within
  `write_seconds`; then the connection is closed (one request per connection);
- at most `accepts_per_second` connections are accepted, so clients that reconnect as fast as
  they are closed wait in the kernel's queue instead of taking this process's CPU;
- a complete request is answered by a BaseHTTPRequestHandler on one of `workers` threads, reading
  the head from memory and writing to memory, so no worker ever waits on a client.

    front = HttpFront("127.0.0.1", 0, handler_class, name="metrics")   # port 0 picks a free one
    front.port; front.stop()
"""

from __future__ import annotations

import asyncio
import io
import logging
import resource
import socket
import ssl
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any

log = logging.getLogger("rgpu.http")

# Each endpoint may hold this share of the process's open files (the rest are the daemon's).
OPEN_FILES_SHARE = 8
BACKLOG = 128
# A connection from the busiest address, or one at least this old, makes way for a newcomer at the cap.
MIN_HOLD_SECONDS = 1.0


@dataclass(frozen=True)
class FrontLimits:
    connections: int = 256
    head_seconds: float = 10.0
    write_seconds: float = 10.0
    head_bytes: int = 16 * 1024
    workers: int = 4
    accepts_per_second: float = 200.0


def connection_cap(wanted: int, share: int = OPEN_FILES_SHARE) -> int:
    """`wanted`, lowered to 1/share of the open-file limit (never below 8)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(8, min(wanted, soft // share))


@dataclass(eq=False)
class _Slot:
    """One accepted connection."""
    address: str
    started_at: float
    conn: socket.socket
    transport: asyncio.BaseTransport | None = None
    task: "asyncio.Task[None] | None" = None
    started: bool = False     # its task has begun (a task cancelled before that never runs)
    closed: bool = False


class _Buffered:
    """Mixed in before a BaseHTTPRequestHandler: the request comes from memory, the answer goes
    to memory (the front's loop does the socket work)."""

    def __init__(self, head: bytes, client_address: tuple[str, int], server: Any) -> None:
        self._head = head
        super().__init__(None, client_address, server)   # type: ignore[call-arg]

    def setup(self) -> None:
        self.rfile = io.BytesIO(self._head)
        self.wfile = io.BytesIO()
        self.close_connection = True

    def finish(self) -> None:
        pass


class HttpFront:
    """Serves `handler_class` (a BaseHTTPRequestHandler) on host:port within FrontLimits."""

    def __init__(self, host: str, port: int, handler_class: type[BaseHTTPRequestHandler], *, name: str,
                 limits: FrontLimits = FrontLimits(), ssl_context: ssl.SSLContext | None = None) -> None:
        self.name = name
        self.limits = limits
        self.max_connections = connection_cap(limits.connections)
        self.open_connections = 0
        self.refused_connections = 0
        self.displaced_connections = 0
        # Connections still sending their request head, oldest first.
        self._pending: dict[_Slot, None] = {}
        self._per_address: Counter[str] = Counter()
        self._last_error_log = -1e9
        self._tls = ssl_context
        self._handler = type(f"Buffered{handler_class.__name__}", (_Buffered, handler_class), {})
        self._workers = ThreadPoolExecutor(limits.workers, thread_name_prefix=f"{name}-http")
        self._loop = asyncio.new_event_loop()
        self._loop.set_exception_handler(self._loop_error)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._sock = socket.create_server((host, port), family=family, backlog=BACKLOG)
        except BaseException:
            self._loop.close()
            self._workers.shutdown(wait=False)
            raise
        self._sock.setblocking(False)
        self.host: str = self._sock.getsockname()[0]
        self.port: int = self._sock.getsockname()[1]
        self._next_accept = 0.0
        self._loop.create_task(self._accept_loop())
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"{name}-http-front", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        async def close() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks, timeout=2) if tasks else None

        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()
        self._sock.close()
        self._workers.shutdown(wait=False, cancel_futures=True)

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        # Clients that vanish mid-handshake are the norm here, not news.
        log.debug("rgpu: %s: http: %s", self.name, context.get("message"))

    async def _accept_loop(self) -> None:
        """Accepts at most `accepts_per_second` (bursts of a second's worth): beyond, clients wait in
        the kernel's listen queue, and their kernels retry dropped SYNs with backoff, so a client
        that reconnects as soon as it is closed cannot keep this process busy."""
        loop = asyncio.get_running_loop()
        spacing = 1.0 / self.limits.accepts_per_second
        while True:
            now = loop.time()
            if self._next_accept > now:
                await asyncio.sleep(self._next_accept - now)
            self._next_accept = max(loop.time() - 1.0, self._next_accept) + spacing
            try:
                conn, addr = await loop.sock_accept(self._sock)
            except OSError as exc:   # out of open files, or the like: wait rather than spin
                log.debug("rgpu: %s: http: accept failed: %s", self.name, exc)
                await asyncio.sleep(0.1)
                continue
            address = str(addr[0])
            if self.open_connections >= self.max_connections:
                victim = self._victim(address)
                if victim is None:   # every slot is answering, or young: this one waits outside
                    self.refused_connections += 1
                    conn.close()
                    continue
                self.displaced_connections += 1
                self._drop(victim)
            slot = _Slot(address, time.monotonic(), conn)
            self.open_connections += 1
            self._pending[slot] = None
            self._per_address[address] += 1
            slot.task = loop.create_task(self._serve(slot, (address, int(addr[1]))))

    async def _serve(self, slot: "_Slot", peer: tuple[str, int]) -> None:
        slot.started = True
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.limits.head_seconds):
                # TLS (when on) is set up on the accepted socket, so the handshake counts as a
                # connection and shares the head's deadline.
                reader = asyncio.StreamReader(limit=self.limits.head_bytes)
                protocol = asyncio.StreamReaderProtocol(reader)
                slot.transport, _ = await loop.connect_accepted_socket(
                    lambda: protocol, sock=slot.conn, ssl=self._tls,
                    ssl_handshake_timeout=self.limits.head_seconds if self._tls else None)
                head = await reader.readuntil(b"\r\n\r\n")
            self._forget(slot)
            answer = await loop.run_in_executor(self._workers, self._run_handler, head, peer)
            writer = asyncio.StreamWriter(slot.transport, protocol, reader, loop)   # type: ignore[arg-type]
            writer.write(answer)
            async with asyncio.timeout(self.limits.write_seconds):
                await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError,
                ssl.SSLError, OSError, ValueError):
            log.debug("rgpu: %s: http: connection from %s ended", self.name, peer[0], exc_info=True)
        finally:
            self._close(slot)

    def _victim(self, address: str) -> "_Slot | None":
        """The connection still sending its head that makes way for a newcomer from `address`:
        the oldest of the busiest address's, when that address holds more than the newcomer's;
        else the oldest, when older than MIN_HOLD_SECONDS; else none. So a client that sends its
        request at once gets in, whatever slow clients at other addresses do."""
        if not self._pending:
            return None
        most = max(self._per_address.values())
        for slot in self._pending:   # oldest first
            if most > self._per_address[address] and self._per_address[slot.address] == most:
                return slot
            if most <= self._per_address[address]:
                return slot if time.monotonic() - slot.started_at >= MIN_HOLD_SECONDS else None
        return None

    def _drop(self, slot: "_Slot") -> None:
        """Ends a connection still sending its head, whether or not its task has begun: its slot
        is free at once (the cap holds however many are accepted before the task runs again)."""
        assert slot.task is not None
        slot.task.cancel()
        self._close(slot, ending=False)

    def _close(self, slot: "_Slot", ending: bool = True) -> None:
        """Frees the slot (once) and closes the connection. Not `ending` (another task drops it)
        while its task is setting the connection up: the cancelled setup closes what it made."""
        if not slot.closed:
            slot.closed = True
            self._forget(slot)
            self.open_connections -= 1
        if slot.transport is not None:
            slot.transport.abort()   # type: ignore[attr-defined]
        elif ending or not slot.started:
            slot.conn.close()

    def _forget(self, slot: "_Slot") -> None:
        if self._pending.pop(slot, 0) is None:
            self._per_address[slot.address] -= 1
            if self._per_address[slot.address] <= 0:
                del self._per_address[slot.address]

    def _run_handler(self, head: bytes, peer: tuple[str, int]) -> bytes:
        try:
            handler = self._handler(head, peer, self)
        except Exception:
            now = time.monotonic()
            if now - self._last_error_log >= 60:   # one traceback a minute: clients choose how often this runs
                self._last_error_log = now
                log.exception("rgpu: %s: http: answering %s failed", self.name, peer[0])
            return b"HTTP/1.0 500 Internal Server Error\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        return handler.wfile.getvalue()
