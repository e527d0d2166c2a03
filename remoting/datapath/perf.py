"""Network probes on the data path (`rgpu-admin net-perf`): round trip and bandwidth between a
node and a dispatcher's session port, through the same token check every session passes.

A client opens a session with HELLO_PERF and a lease token; the dispatcher's acceptor verifies
the token as for any session and then, instead of starting a worker, answers ECHO, SINK and
SOURCE frames itself (serve_perf) until BYE, the time limit, or the client leaving. measure()
is the client side; summarise() and the result type are pure.
"""

from __future__ import annotations

import socket
import statistics
import struct
import time
from dataclasses import dataclass

from rgpu.errors import Unavailable
from rgpu.remoting.datapath import protocol

PERF_SESSION_LIMIT_S = 120.0       # a perf session never holds an acceptor thread longer
PERF_IDLE_S = 10.0                 # ... nor waits longer than this for the next bytes of a frame
MAX_PERF_FRAME = 4 << 20
_FILLER = bytes(MAX_PERF_FRAME)    # SOURCE's data, one copy for all sessions (it was 4 MiB each)
MAX_SOURCE_BYTES = 1 << 30
_SOURCE = struct.Struct("<QI")
_U64 = struct.Struct("<Q")


# ------------------------------------------------------------------ server side (dispatcher)

def serve_perf(conn: socket.socket, limit_s: float = PERF_SESSION_LIMIT_S, idle_s: float = PERF_IDLE_S) -> int:
    """Answer perf frames on an accepted, token-checked connection; returns bytes moved. The
    session ends at `limit_s`, or when the client sends nothing (or stops sending a frame, or
    stops reading) for `idle_s`."""
    deadline = time.monotonic() + limit_s
    moved = 0
    received = 0
    filler = _FILLER
    try:
        while time.monotonic() < deadline:
            conn.settimeout(max(0.1, min(idle_s, deadline - time.monotonic())))
            try:
                (_, op, _, seq, aux, _), payload = protocol.recv_frame(conn, MAX_PERF_FRAME)
            except (OSError, ValueError, ConnectionError):
                break
            if op == protocol.OP_ECHO:
                conn.sendall(protocol.pack_frame(protocol.OP_ECHO, payload, seq=seq))
                moved += 2 * len(payload)
            elif op == protocol.OP_SINK:
                received += len(payload)
                moved += len(payload)
                if aux == 1:
                    conn.sendall(protocol.pack_frame(protocol.OP_REPLY, _U64.pack(received), seq=seq))
                    received = 0
            elif op == protocol.OP_SOURCE and len(payload) >= _SOURCE.size:
                total, chunk = _SOURCE.unpack_from(payload)
                total, chunk = min(total, MAX_SOURCE_BYTES), max(1, min(chunk, MAX_PERF_FRAME))
                left = total
                while left > 0:
                    n = min(chunk, left)
                    conn.sendall(protocol.pack_frame(protocol.OP_DATA, filler[:n], seq=seq))
                    left -= n
                conn.sendall(protocol.pack_frame(protocol.OP_REPLY, _U64.pack(total), seq=seq))
                moved += total
            else:   # BYE, or anything a perf session does not know
                break
    except (OSError, ConnectionError):   # a client that stops reading, or leaves, mid-answer
        pass
    finally:
        conn.close()
    return moved


# ------------------------------------------------------------------ client side

@dataclass(frozen=True)
class PerfResult:
    server: str
    connect_ms: float              # TCP connect + token check (HELLO to WELCOME)
    rtt_min_us: float
    rtt_p50_us: float
    rtt_p99_us: float
    upload_bytes_per_s: float      # this node to the dispatcher
    download_bytes_per_s: float    # the dispatcher to this node


def percentile(samples: list[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank; samples need not be sorted."""
    if not samples:
        raise ValueError("no samples")
    ordered = sorted(samples)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[rank]


def summarise(server: str, connect_s: float, rtts_s: list[float], upload: tuple[int, float],
              download: tuple[int, float]) -> PerfResult:
    """A PerfResult from raw timings: round trips in seconds, (bytes, seconds) per direction."""
    def rate(moved: tuple[int, float]) -> float:
        return moved[0] / moved[1] if moved[1] > 0 else 0.0
    return PerfResult(server=server, connect_ms=connect_s * 1e3,
                      rtt_min_us=min(rtts_s) * 1e6, rtt_p50_us=statistics.median(rtts_s) * 1e6,
                      rtt_p99_us=percentile(rtts_s, 99) * 1e6,
                      upload_bytes_per_s=rate(upload), download_bytes_per_s=rate(download))


def _expect(sock: socket.socket, op: int, server: str) -> bytes:
    (_, got, _, _, _, _), payload = protocol.recv_frame(sock, MAX_PERF_FRAME)
    if got != op:
        raise Unavailable("net-perf", f"{server} answered frame {got} where {op} was due",
                          "the dispatcher speaks another rgpu version", "install the same rgpu version everywhere")
    return payload


def measure(server: str, token: str, *, pings: int = 50, bulk_bytes: int = 64 << 20,
            chunk_bytes: int = protocol.CHUNK_BYTES, timeout: float = 30.0) -> PerfResult:
    """Round trips (`pings` 8-byte echoes) and bulk transfers of `bulk_bytes` each way."""
    started = time.perf_counter()
    sock, welcome = protocol.handshake(server, token, flags=protocol.HELLO_PERF, timeout=timeout)
    connect_s = time.perf_counter() - started
    try:
        if not welcome.flags & protocol.WELCOME_PERF:
            raise Unavailable("net-perf", f"the dispatcher at {server} does not answer perf sessions",
                              "it runs an older rgpu", "upgrade rgpu-dispatcher there")
        sock.settimeout(timeout)
        ping = protocol.pack_frame(protocol.OP_ECHO, b"\0" * 8)
        rtts = []
        for _ in range(max(1, pings)):
            t0 = time.perf_counter()
            sock.sendall(ping)
            _expect(sock, protocol.OP_ECHO, server)
            rtts.append(time.perf_counter() - t0)
        block = bytes(chunk_bytes)
        t0 = time.perf_counter()
        left = bulk_bytes
        while left > 0:
            n = min(chunk_bytes, left)
            left -= n
            sock.sendall(protocol.pack_frame(protocol.OP_SINK, block[:n], aux=1 if left == 0 else 0))
        (got,) = _U64.unpack(_expect(sock, protocol.OP_REPLY, server))
        upload = (got, time.perf_counter() - t0)
        t0 = time.perf_counter()
        sock.sendall(protocol.pack_frame(protocol.OP_SOURCE, _SOURCE.pack(bulk_bytes, chunk_bytes)))
        received = 0
        while True:
            (_, op, _, _, _, _), payload = protocol.recv_frame(sock, MAX_PERF_FRAME)
            if op == protocol.OP_DATA:
                received += len(payload)
            elif op == protocol.OP_REPLY:
                break
            else:
                raise Unavailable("net-perf", f"{server} sent frame {op} during a download", "",
                                  "install the same rgpu version everywhere")
        download = (received, time.perf_counter() - t0)
        sock.sendall(protocol.pack_frame(protocol.OP_BYE))
    except (OSError, ConnectionError, ValueError) as exc:
        raise Unavailable("net-perf", f"the perf session with {server} broke off", str(exc),
                          "check the network path and the dispatcher's log") from None
    finally:
        sock.close()
    return summarise(server, connect_s, rtts, upload, download)
