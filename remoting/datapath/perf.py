"""Network probes on the data path (`rgpu-admin net-perf`): round trip and bandwidth between a
node and a dispatcher's session port, through the same token check every session passes.

A client opens a session with HELLO_PERF and a lease token; the dispatcher's acceptor verifies
the token as for any session and then, instead of starting a worker, answers ECHO, SINK and
SOURCE frames itself (serve_perf) until BYE, the time limit, or the client leaving. A client that
offers UCX (its UCX worker address in HELLO, as a CUDA session's does) is served by a helper
process (perf_ucx.py) that also answers UCX_SINK and UCX_SOURCE: bulk bytes over UCX, the way a
copy's go. measure() is the client side; summarise() and the result types are pure.
"""

from __future__ import annotations

import ctypes
import dataclasses
import socket
import statistics
import struct
import time
from collections import deque
from dataclasses import dataclass

from rgpu.errors import RgpuError, Unavailable
from rgpu.remoting.datapath import protocol
from rgpu.remoting.datapath.worker.ucx import UcxBroken, UcxLink, UcxUnavailable

PERF_SESSION_LIMIT_S = 120.0       # a perf session never holds an acceptor thread longer
PERF_IDLE_S = 10.0                 # ... nor waits longer than this for the next bytes of a frame
MAX_PERF_FRAME = 4 << 20
_FILLER = bytes(MAX_PERF_FRAME)    # SOURCE's data, one copy for all sessions (it was 4 MiB each)
MAX_SOURCE_BYTES = 1 << 30
_SOURCE = struct.Struct("<QI")
_U64 = struct.Struct("<Q")
UCX_WINDOW = 8                     # UCX messages in flight at once, each way
# A perf session's WELCOME description names the UCX transports it took, or why it took none.
UCX_TAKEN = "; ucx: "
UCX_NOT_TAKEN = "; no ucx: "
# ... and, after the transports, why that dispatcher's CUDA sessions keep TCP all the same (a GPU
# node under `transport = auto`): the probe measures the link, not what sessions choose.
UCX_SESSIONS_KEEP_TCP = "; sessions keep tcp: "


def ucx_stream(link: UcxLink, *, recv: bool, seq: int, total: int, fd: int) -> None:
    """Move `total` bytes over UCX as a copy's are (protocol.ucx_chunks, tagged ucx_tag(seq, i)),
    UCX_WINDOW messages in flight. All go through one chunk-sized buffer: a probe's bytes are
    never read, so receives may land on each other. UcxBroken when a message does not arrive or
    leave (the others are cancelled)."""
    buffer = ctypes.create_string_buffer(min(total, protocol.UCX_CHUNK_BYTES) or 1)
    address = ctypes.addressof(buffer)
    pending: deque[tuple[int, int]] = deque()
    try:
        for index, _, n in protocol.ucx_chunks(total):
            if len(pending) >= UCX_WINDOW:
                req, size = pending.popleft()   # wait frees it, done or not
                link.wait(req, recv, size, fd)
            pending.append((link.post(recv, protocol.ucx_tag(seq, index), address, n), n))
        while pending:
            req, size = pending.popleft()
            link.wait(req, recv, size, fd)
    finally:
        for req, _ in pending:
            link.cancel(req, recv)


# ------------------------------------------------------------------ server side (dispatcher)

def serve_perf(conn: socket.socket, limit_s: float = PERF_SESSION_LIMIT_S, idle_s: float = PERF_IDLE_S,
               ucx: UcxLink | None = None) -> int:
    """Answer perf frames on an accepted, token-checked connection (and UCX_SINK/UCX_SOURCE when
    `ucx` is the session's link); returns bytes moved. The session ends at `limit_s`, or when the
    client sends nothing (or stops sending a frame, or stops reading) for `idle_s`, or when a UCX
    transfer fails (UcxBroken, after the connection is closed)."""
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
            elif op in (protocol.OP_UCX_SINK, protocol.OP_UCX_SOURCE) and ucx is not None and \
                    len(payload) >= _U64.size:
                total = min(_U64.unpack_from(payload)[0], MAX_SOURCE_BYTES)
                ucx_stream(ucx, recv=op == protocol.OP_UCX_SINK, seq=seq, total=total, fd=conn.fileno())
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
class UcxResult:
    transports: str                # UCX's lanes on the client's end ("tcp/lo", "rc_mlx5/mlx5_0:1")
    connect_ms: float              # its own session: TCP connect, token check, the helper's UCX ready
    upload_bytes_per_s: float
    download_bytes_per_s: float
    sessions_keep_tcp: str = ""    # why that dispatcher's sessions copy over TCP all the same ("": they take UCX)


@dataclass(frozen=True)
class PerfResult:
    server: str
    connect_ms: float              # TCP connect + token check (HELLO to WELCOME)
    rtt_min_us: float
    rtt_p50_us: float
    rtt_p99_us: float
    upload_bytes_per_s: float      # this node to the dispatcher
    download_bytes_per_s: float    # the dispatcher to this node
    ucx: UcxResult | None = None   # bulk both ways over UCX, when both ends took it
    ucx_why_not: str = ""          # why not, when UCX was offered or asked for and not measured


def percentile(samples: list[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank; samples need not be sorted."""
    if not samples:
        raise ValueError("no samples")
    ordered = sorted(samples)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[rank]


def _rate(moved: tuple[int, float]) -> float:
    return moved[0] / moved[1] if moved[1] > 0 else 0.0


def summarise(server: str, connect_s: float, rtts_s: list[float], upload: tuple[int, float],
              download: tuple[int, float]) -> PerfResult:
    """A PerfResult from raw timings: round trips in seconds, (bytes, seconds) per direction."""
    return PerfResult(server=server, connect_ms=connect_s * 1e3,
                      rtt_min_us=min(rtts_s) * 1e6, rtt_p50_us=statistics.median(rtts_s) * 1e6,
                      rtt_p99_us=percentile(rtts_s, 99) * 1e6,
                      upload_bytes_per_s=_rate(upload), download_bytes_per_s=_rate(download))


def ucx_why_not(welcome: protocol.Welcome) -> str:
    """Why a perf session's server took no UCX, from its WELCOME (a dispatcher before UCX perf
    sessions says nothing)."""
    said = welcome.description.partition(UCX_NOT_TAKEN)[2]
    return f"the dispatcher took no UCX: {said}" if said else \
        "the dispatcher took no UCX (it runs an rgpu without UCX perf sessions: upgrade it)"


def sessions_keep_tcp(welcome: protocol.Welcome) -> str:
    """Why the dispatcher's sessions copy over TCP though its perf session took UCX ("": they take UCX)."""
    return welcome.description.partition(UCX_SESSIONS_KEEP_TCP)[2]


def _expect(sock: socket.socket, op: int, server: str) -> bytes:
    (_, got, _, _, _, _), payload = protocol.recv_frame(sock, MAX_PERF_FRAME)
    if got != op:
        raise Unavailable("net-perf", f"{server} answered frame {got} where {op} was due",
                          "the dispatcher speaks another rgpu version", "install the same rgpu version everywhere")
    return payload


def _round_trips(sock: socket.socket, server: str, pings: int) -> list[float]:
    ping = protocol.pack_frame(protocol.OP_ECHO, b"\0" * 8)
    rtts = []
    for _ in range(max(1, pings)):
        t0 = time.perf_counter()
        sock.sendall(ping)
        _expect(sock, protocol.OP_ECHO, server)
        rtts.append(time.perf_counter() - t0)
    return rtts


def _tcp_upload(sock: socket.socket, server: str, bulk_bytes: int, chunk_bytes: int) -> tuple[int, float]:
    block = bytes(chunk_bytes)
    t0 = time.perf_counter()
    left = bulk_bytes
    while left > 0:
        n = min(chunk_bytes, left)
        left -= n
        sock.sendall(protocol.pack_frame(protocol.OP_SINK, block[:n], aux=1 if left == 0 else 0))
    (got,) = _U64.unpack(_expect(sock, protocol.OP_REPLY, server))
    return got, time.perf_counter() - t0


def _tcp_download(sock: socket.socket, server: str, bulk_bytes: int, chunk_bytes: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    sock.sendall(protocol.pack_frame(protocol.OP_SOURCE, _SOURCE.pack(bulk_bytes, chunk_bytes)))
    received = 0
    while True:
        (_, op, _, _, _, _), payload = protocol.recv_frame(sock, MAX_PERF_FRAME)
        if op == protocol.OP_DATA:
            received += len(payload)
        elif op == protocol.OP_REPLY:
            return received, time.perf_counter() - t0
        else:
            raise Unavailable("net-perf", f"{server} sent frame {op} during a download", "",
                              "install the same rgpu version everywhere")


def _ucx_bulk(sock: socket.socket, server: str, link: UcxLink, op: int, seq: int, bulk_bytes: int) -> tuple[int, float]:
    """One UCX transfer of bulk_bytes (UCX_SINK: upload; UCX_SOURCE: download), timed from its frame
    to the server's REPLY."""
    t0 = time.perf_counter()
    sock.sendall(protocol.pack_frame(op, _U64.pack(bulk_bytes), seq=seq))
    ucx_stream(link, recv=op == protocol.OP_UCX_SOURCE, seq=seq, total=bulk_bytes, fd=sock.fileno())
    (got,) = _U64.unpack(_expect(sock, protocol.OP_REPLY, server))
    if got != bulk_bytes:
        raise UcxBroken(f"the dispatcher moved {got} of {bulk_bytes} bytes (it takes at most {MAX_SOURCE_BYTES})")
    return got, time.perf_counter() - t0


def _measure_ucx(server: str, token: str, link: UcxLink, bulk_bytes: int, timeout: float) -> UcxResult | str:
    """A second perf session, offering `link`: its set-up time and the bulk each way over UCX; or
    why there are none (nothing raised: the TCP figures stand)."""
    started = time.perf_counter()
    try:
        sock, welcome = protocol.handshake(server, token, flags=protocol.HELLO_PERF, timeout=timeout,
                                           ucx_address=link.address)
    except RgpuError as exc:
        return f"the UCX perf session was refused: {exc}"
    connect_s = time.perf_counter() - started
    try:
        if not welcome.ucx_address:
            return ucx_why_not(welcome)
        sock.settimeout(timeout)
        link.connect(welcome.ucx_address)
        up = _ucx_bulk(sock, server, link, protocol.OP_UCX_SINK, 1, bulk_bytes)
        down = _ucx_bulk(sock, server, link, protocol.OP_UCX_SOURCE, 2, bulk_bytes)
        sock.sendall(protocol.pack_frame(protocol.OP_BYE))
    except (UcxUnavailable, UcxBroken) as exc:
        return f"a transfer over UCX failed: {exc}"
    except (OSError, ConnectionError, ValueError, RgpuError) as exc:
        return f"the UCX perf session broke off: {exc}"
    finally:
        sock.close()
    return UcxResult(transports=link.carriers() or "ucx", connect_ms=connect_s * 1e3,
                     upload_bytes_per_s=_rate(up), download_bytes_per_s=_rate(down),
                     sessions_keep_tcp=sessions_keep_tcp(welcome))


def measure(server: str, token: str, *, pings: int = 50, bulk_bytes: int = 64 << 20,
            chunk_bytes: int = protocol.CHUNK_BYTES, timeout: float = 30.0, ucx: UcxLink | None = None) -> PerfResult:
    """Round trips (`pings` 8-byte echoes) and bulk transfers of `bulk_bytes` each way over a perf
    session's TCP stream; with `ucx` (this end's link), a second session offers it and, when the
    dispatcher takes it, moves the same bulk each way over UCX. A UCX failure is reported in the
    result (ucx_why_not), not raised."""
    started = time.perf_counter()
    sock, welcome = protocol.handshake(server, token, flags=protocol.HELLO_PERF, timeout=timeout)
    connect_s = time.perf_counter() - started
    try:
        if not welcome.flags & protocol.WELCOME_PERF:
            raise Unavailable("net-perf", f"the dispatcher at {server} does not answer perf sessions",
                              "it runs an older rgpu", "upgrade rgpu-dispatcher there")
        sock.settimeout(timeout)
        rtts = _round_trips(sock, server, pings)
        upload = _tcp_upload(sock, server, bulk_bytes, chunk_bytes)
        download = _tcp_download(sock, server, bulk_bytes, chunk_bytes)
        sock.sendall(protocol.pack_frame(protocol.OP_BYE))
    except (OSError, ConnectionError, ValueError) as exc:
        raise Unavailable("net-perf", f"the perf session with {server} broke off", str(exc),
                          "check the network path and the dispatcher's log") from None
    finally:
        sock.close()
    result = summarise(server, connect_s, rtts, upload, download)
    if ucx is None:
        return result
    over_ucx = _measure_ucx(server, token, ucx, bulk_bytes, timeout)
    if isinstance(over_ucx, str):
        return dataclasses.replace(result, ucx_why_not=over_ucx)
    return dataclasses.replace(result, ucx=over_ucx)
