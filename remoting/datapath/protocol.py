"""The data-path wire protocol: framing, the session handshake, and a small Python client for it.

Every frame is a 24-byte little-endian header followed by `length` payload bytes:

    u32 length | u16 op | u16 flags | u32 seq | u32 aux | u64 ctx

`op` 1-31 are session control frames (below); higher ones are API calls whose numbers the
generator assigns from spec/cuda.spec (and spec/nvml.spec). `ctx` is the server-side handle of
the context the calling thread has current (0: none): the worker makes it current before it
runs the call, so client threads keep their own context stacks without extra round trips.

A session:
  client -> HELLO   magic "RGPU", u32 version, u32 flags, u32 len + lease token, u32 len + info
  server -> WELCOME u32 version, i32 driver version, u64 memory limit, u32 compute percent,
                    u32 flags, u32 len + description, u32 len + UCX worker address (protocol 10; len 0:
                    copies stay on TCP)                  (or REFUSE: u32 version, u32 len + text;
                    flag REFUSE_RETRY: closed before its HELLO was read, the client may send it again)
  Protocol 10: HELLO's info may carry "ucx": the client's UCX worker address in hex (it offers UCX;
  datapath/transport.py decides). A session with UCX sends copies of at least 1 MiB as
  rgpuMemcpyHtoDUcx / rgpuMemcpyDtoHUcx frames (u64 device address, u64 stream, u64 size) whose
  bytes travel as one UCP tag message tagged with the frame's seq: after the frame for host to
  device, after the REPLY for device to host.
  Protocol 12 (data lanes): HELLO's info may carry "lanes" (2-16) and "lane_key" (32 random bytes,
  hex): the client then opens that many more connections to the same port, each sending a HELLO
  with HELLO_LANE, the same token and info {"lane_key", "lane": index}. The dispatcher gives the
  worker the lanes whose token and key match the session's (any other is refused and closed), and
  WELCOME ends with u32 lanes: how many it took (0: none; copies stay on this connection). A session
  with lanes sends host-to-device copies of at least RGPU_LANE_MIN_BYTES as rgpuMemcpyHtoDLanes
  frames (u64 device address, u64 stream, u64 size, u64 chunk) whose bytes follow on the lanes,
  striped: chunk i on lane i % lanes, as a LANE_DATA frame (seq: the copy's seq, aux: i, ctx: the
  chunk's offset). A lane that fails ends the lanes of the session (both ends): that copy fails,
  later ones travel on this connection.
  then API frames. A `sync` call gets one REPLY (i32 CUresult, optional message, outputs),
  preceded by DATA frames when it returns bulk data (device-to-host copies). `async` calls get
  no reply: the worker keeps the first error and answers the next sync call with it instead of
  running that call, so an error surfaces at the next synchronising call.
  Between any two frames the worker may send HOST_CALL (protocol 5): a graph's host node asks the
  client to run a host function; the client answers HOST_DONE when it next reads (below).

Both sides check the version: the first 8 bytes of HELLO and WELCOME/REFUSE never change.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

from rgpu.errors import AuthError, ConfigError, DispatcherUnavailable, InvalidRequest, RgpuError, Unavailable
from rgpu.netaddr import split_host_port

# The data path's protocol version. It is also recorded in spec/cuda.spec: a spec change that
# alters the wire format must bump both (tests/remoting/test_generator.py checks the pairing).
PROTOCOL_VERSION = 16
MAGIC = b"RGPU"

HEADER = struct.Struct("<IHHIIQ")
HEADER_SIZE = HEADER.size  # 24

# Control frames.
OP_HELLO = 1
OP_WELCOME = 2
OP_REFUSE = 3
OP_REPLY = 4
OP_DATA = 5
OP_BYE = 6
# A perf session (HELLO_PERF; rgpu.remoting.datapath.perf): the acceptor answers these itself.
OP_ECHO = 7       # the server sends the frame back as it came
OP_SINK = 8       # the server discards the payload; aux=1 on the last frame asks for a REPLY (u64 bytes)
OP_SOURCE = 9     # payload u64 total, u32 chunk: the server sends DATA frames of that much, then a REPLY
# Host nodes (protocol 5): a graph's host node runs the application's function in the client.
# The worker sends HOST_CALL (seq: the call's number, ctx: the id the client registered for the
# function, aux: the CUresult a stream callback gets) at any point between other frames, and its
# node waits for HOST_DONE (seq: that number; aux: 0 ran, 1 the id is unknown to the client).
# The client answers it whenever it reads (every synchronising call does); worker/hostcalls.py.
# HOST_CALL's payload (may be empty): u32 count, u32 0, count x {u64 buffer, u64 size, u32 to_host,
# u32 0} (the host-copy buffers of the node's graph), then the to_host ones' data in that order.
# HOST_DONE's payload: {u64 buffer, u64 size, data} for each of those regions the client knows.
OP_HOST_CALL = 10
OP_HOST_DONE = 11
HOST_DONE_RAN = 0
HOST_DONE_UNKNOWN_ID = 1
# Protocol 8: the server tells the client, unasked, that its session's GPU context is gone (an MPS
# fault of another tenant; worker/tombstone.py sends it when it takes over). The client skips it
# where it reads; its arrival makes the client stop answering synchronisations itself
# (idle_streams.c), so the next one meets the sticky error. Payload: none.
OP_NOTICE = 12
# Protocol 12: a chunk of a striped copy on a data lane (seq: the copy's, aux: the chunk's index,
# ctx: its offset in the copy). Only on lanes, never on the session's connection.
OP_LANE_DATA = 13
# A perf session that took UCX (its WELCOME carries the server's UCX address): payload u64 total;
# the bytes go over UCX as ucx_chunks messages tagged ucx_tag(seq, i), as a UCX copy's do, and the
# server answers REPLY (u64 bytes) on the stream once they have all arrived (UCX_SINK) or left
# (UCX_SOURCE).
OP_UCX_SINK = 14     # the client sends the bytes
OP_UCX_SOURCE = 15   # the server sends them

# HELLO flags.
HELLO_PROBE = 1   # verify the token and versions, start no worker (flexrun's pre-flight check)
HELLO_NVML = 2    # a management session: NVML queries only, no CUDA context on the GPU
HELLO_PERF = 4    # a network probe (rgpu-admin net-perf): echo and bulk frames, no worker
HELLO_LANE = 8    # a data lane of a session being opened (protocol 12; info: lane_key, lane)

# WELCOME flags.
WELCOME_EMULATED = 1  # the server emulates the device (no GPU): launches are refused
WELCOME_PERF = 2      # the server serves a perf session (older servers ignore HELLO_PERF)

# REPLY flags.
REPLY_HAS_MESSAGE = 1  # payload: i32 result, u32 len, message, outputs

# REFUSE flags (older clients ignore them).
REFUSE_RETRY = 1  # the front door closed the connection unread (its slots were full): no session started

# A HELLO the front door closed unread goes again on a new connection after each of these pauses.
DOOR_RETRY_PAUSES_S = (0.05, 0.25)

# A UCX copy's control frame (rgpuMemcpyHtoDUcx / rgpuMemcpyDtoHUcx): device address, stream, size
# (the layout of cuMemcpyHtoDAsync_v2's, without the bytes).
UCX_COPY = struct.Struct("<QQQ")
# Protocol 15: a UCX copy's bytes go as messages of UCX_CHUNK_BYTES (the last one shorter), chunk i
# tagged seq | i << 32, so the worker moves each chunk over PCIe while the next one arrives.
UCX_CHUNK_BYTES = 4 << 20


def ucx_chunks(size: int) -> list[tuple[int, int, int]]:
    """(index, offset, length) of each message of a UCX copy of `size` bytes."""
    return [(i, at, min(UCX_CHUNK_BYTES, size - at)) for i, at in enumerate(range(0, size, UCX_CHUNK_BYTES))]


def ucx_tag(seq: int, index: int) -> int:
    """The UCX tag of chunk `index` of the copy whose frame has `seq`."""
    return seq | index << 32
# A striped copy's control frame (rgpuMemcpyHtoDLanes): device address, stream, size, chunk size.
LANES_COPY = struct.Struct("<QQQQ")
MAX_LANES = 16
LANE_KEY_BYTES = 32
# A striped copy's chunks are at least 64 KiB and at most 64 MiB (the worker's staging slots).
MIN_LANE_CHUNK = 64 << 10
MAX_LANE_CHUNK = 64 << 20

# Copies travel in chunks of this size so that network transfer and PCIe copies overlap.
CHUNK_BYTES = 1 << 20
MAX_FRAME = 1 << 30

HELLO_TIMEOUT_S = 15.0


class ProtocolError(RgpuError):
    exit_code = 6


class DoorFull(Unavailable):
    """The dispatcher closed the connection before reading its HELLO (REFUSE_RETRY): its handshake
    slots were full, e.g. of a neighbour's idle connections. No session was started."""


@dataclass(frozen=True)
class Hello:
    version: int
    flags: int
    token: str
    info: dict


@dataclass(frozen=True)
class Welcome:
    version: int
    driver_version: int
    memory_limit_bytes: int
    compute_percent: int
    flags: int
    description: str
    ucx_address: bytes = b""
    lanes: int = 0


def pack_frame(op: int, payload: bytes = b"", *, flags: int = 0, seq: int = 0, aux: int = 0,
               ctx: int = 0) -> bytes:
    return HEADER.pack(len(payload), op, flags, seq, aux, ctx) + payload


def _lp(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


def _take_lp(buf: bytes, off: int) -> tuple[bytes, int]:
    if off + 4 > len(buf):
        raise ValueError("truncated field")
    (n,) = struct.unpack_from("<I", buf, off)
    off += 4
    if off + n > len(buf):
        raise ValueError("truncated field")
    return bytes(buf[off:off + n]), off + n


def encode_hello(token: str, *, flags: int = 0, info: dict | None = None,
                 version: int = PROTOCOL_VERSION) -> bytes:
    body = MAGIC + struct.pack("<II", version, flags) + _lp(token.encode()) + \
        _lp(json.dumps(info or {}, separators=(",", ":")).encode())
    return pack_frame(OP_HELLO, body)


def decode_hello_version(payload: bytes) -> int:
    """The version alone: readable from any protocol version's HELLO."""
    if len(payload) < 8 or payload[:4] != MAGIC:
        raise ValueError("not an rgpu HELLO (bad magic)")
    return struct.unpack_from("<I", payload, 4)[0]


def decode_hello(payload: bytes) -> Hello:
    version = decode_hello_version(payload)
    if len(payload) < 12:
        raise ValueError(f"HELLO of {len(payload)} bytes is too short")
    (flags,) = struct.unpack_from("<I", payload, 8)
    token, off = _take_lp(payload, 12)
    info_raw, off = _take_lp(payload, off)
    try:
        info = json.loads(info_raw or b"{}")
    except ValueError:
        info = {}
    return Hello(version=version, flags=flags, token=token.decode("ascii", "replace"),
                 info=info if isinstance(info, dict) else {})


def encode_welcome(*, driver_version: int, memory_limit_bytes: int, compute_percent: int,
                   flags: int, description: str, version: int = PROTOCOL_VERSION, ucx_address: bytes = b"",
                   lanes: int = 0) -> bytes:
    body = struct.pack("<IiQII", version, driver_version, memory_limit_bytes, compute_percent, flags) + \
        _lp(description.encode()) + _lp(ucx_address) + struct.pack("<I", lanes)
    return pack_frame(OP_WELCOME, body)


def decode_welcome(payload: bytes) -> Welcome:
    version, driver, limit, percent, flags = struct.unpack_from("<IiQII", payload, 0)
    text, off = _take_lp(payload, struct.calcsize("<IiQII"))
    ucx, lanes = b"", 0
    if off + 4 <= len(payload):
        ucx, off = _take_lp(payload, off)
        if off + 4 <= len(payload):
            (lanes,) = struct.unpack_from("<I", payload, off)
    return Welcome(version, driver, limit, percent, flags, text.decode("utf-8", "replace"), ucx, lanes)


def encode_refuse(message: str, version: int = PROTOCOL_VERSION, *, retry: bool = False) -> bytes:
    """retry: the HELLO was never read (REFUSE_RETRY), so sending it again cannot start a second session."""
    return pack_frame(OP_REFUSE, struct.pack("<I", version) + _lp(message.encode()),
                      flags=REFUSE_RETRY if retry else 0)


def decode_refuse(payload: bytes) -> tuple[int, str]:
    (version,) = struct.unpack_from("<I", payload, 0)
    text, _ = _take_lp(payload, 4)
    return version, text.decode("utf-8", "replace")


def version_mismatch_error(client_version: int, server_version: int) -> ProtocolError:
    return ProtocolError("session", "protocol version mismatch",
                         f"client speaks {client_version}, server speaks {server_version}",
                         "install the same rgpu version on the CPU and GPU nodes")


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("connection closed by peer")
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket, max_payload: int = MAX_FRAME) -> tuple[tuple[int, int, int, int, int, int], bytes]:
    header = HEADER.unpack(recv_exact(sock, HEADER_SIZE))
    if header[0] > max_payload:
        raise ValueError(f"frame of {header[0]} bytes is larger than allowed ({max_payload})")
    return header, recv_exact(sock, header[0]) if header[0] else b""


def split_address(server: str) -> tuple[str, int]:
    """(host, port) of a GPU server address, as `socket.create_connection` takes it."""
    try:
        return split_host_port(server, what="GPU server address", component="flexrun")
    except InvalidRequest as exc:
        raise ConfigError("flexrun", exc.what, exc.why, "fix the server in adaptor.conf, -l or RGPU_SLICES") from None


def client_info() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "uid": os.getuid()}


def _connect(server: str, timeout: float) -> socket.socket:
    host, port = split_address(server)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise DispatcherUnavailable("flexrun", f"cannot reach the GPU server {server}",
                          exc.strerror or str(exc),
                          "check that rgpu-dispatcher runs there and that the port is open") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def open_lane(server: str, token: str, key: bytes, index: int, *, timeout: float = HELLO_TIMEOUT_S,
              version: int = PROTOCOL_VERSION) -> socket.socket:
    """One data lane of a session being opened (protocol 12): a connection whose HELLO proves it
    belongs to the session (its token and lane key). The dispatcher answers nothing on it when it
    takes it; it refuses (and closes) one that belongs to no session."""
    sock = _connect(server, timeout)
    try:
        sock.sendall(encode_hello(token, flags=HELLO_LANE, info={"lane_key": key.hex(), "lane": index},
                                  version=version))
    except OSError:
        sock.close()
        raise
    return sock


def handshake_with_lanes(server: str, token: str, lanes: int, *, timeout: float = HELLO_TIMEOUT_S,
                         key: bytes | None = None) -> tuple[socket.socket, Welcome, list[socket.socket]]:
    """A session with `lanes` data lanes (protocol 12): the session's socket, its WELCOME and the
    lanes the worker took (all of them, or none when WELCOME says 0)."""
    key = key if key is not None else os.urandom(LANE_KEY_BYTES)
    opened: list[socket.socket] = []

    def open_all() -> None:
        for i in range(lanes):
            opened.append(open_lane(server, token, key, i, timeout=timeout))
    sock, welcome = handshake(server, token, timeout=timeout, info_extra={"lanes": lanes, "lane_key": key.hex()},
                              after_hello=open_all)
    if welcome.lanes != lanes:
        for lane in opened:
            lane.close()
        opened = []
    for lane in opened:
        lane.settimeout(None)
    return sock, welcome, opened


def handshake(server: str, token: str, *, flags: int = 0, timeout: float = HELLO_TIMEOUT_S,
              version: int = PROTOCOL_VERSION, ucx_address: bytes = b"", info_extra: dict | None = None,
              after_hello: Callable[[], None] | None = None) -> tuple[socket.socket, Welcome]:
    """Open a session (or, with HELLO_PROBE, just check one could be opened). `ucx_address`: this
    end's UCX worker address, offering UCX (the WELCOME then carries the worker's, or none).

    A connection the dispatcher's front door closed before reading its HELLO (DoorFull) is opened
    again after each of DOOR_RETRY_PAUSES_S: at an address's cap, a young connection whose HELLO
    has not arrived yet looks idle and makes way for a newer one, which a neighbour that reconnects
    as fast as it is closed can make happen to a client descheduled for a few milliseconds. Not with
    `after_hello`: its connections go with this HELLO.

    Raises Unavailable when the server cannot be reached, AuthError when it refuses the token,
    ProtocolError on a version mismatch; each message names the server and what to do.
    """
    for pause in DOOR_RETRY_PAUSES_S if after_hello is None else ():
        try:
            return _handshake_once(server, token, flags=flags, timeout=timeout, version=version,
                                   ucx_address=ucx_address, info_extra=info_extra, after_hello=after_hello)
        except DoorFull:
            time.sleep(pause)
    return _handshake_once(server, token, flags=flags, timeout=timeout, version=version, ucx_address=ucx_address,
                           info_extra=info_extra, after_hello=after_hello)


def _handshake_once(server: str, token: str, *, flags: int, timeout: float, version: int, ucx_address: bytes,
                    info_extra: dict | None, after_hello: Callable[[], None] | None) -> tuple[socket.socket, Welcome]:
    sock = _connect(server, timeout)
    try:
        info = client_info() | ({"ucx": ucx_address.hex()} if ucx_address else {}) | (info_extra or {})
        sock.sendall(encode_hello(token, flags=flags, info=info, version=version))
        if after_hello is not None:
            after_hello()
        (_, op, frame_flags, _, _, _), payload = recv_frame(sock, 1 << 20)
    except (OSError, ValueError, ConnectionError) as exc:
        sock.close()
        raise DispatcherUnavailable("flexrun", f"the GPU server {server} ended the handshake", str(exc),
                          "check the dispatcher's log") from None
    if op == OP_REFUSE:
        sock.close()
        peer_version, text = decode_refuse(payload)
        if peer_version != version:
            raise version_mismatch_error(version, peer_version)
        if frame_flags & REFUSE_RETRY:
            err: RgpuError = DoorFull("session", text)
        elif "token" in text:
            err = AuthError("session", text)
        else:
            err = Unavailable("session", text)
        err.args = ((text if text.startswith("rgpu:") else f"rgpu: session: {text}") + f" [server {server}]",)
        raise err
    if op != OP_WELCOME:
        sock.close()
        raise ProtocolError("session", f"unexpected frame {op} from {server} during the handshake",
                            "is that port an rgpu dispatcher?", "check the adaptor.conf server address")
    welcome = decode_welcome(payload)
    if welcome.version != version:
        sock.close()
        raise version_mismatch_error(version, welcome.version)
    sock.settimeout(None)
    return sock, welcome


def probe(server: str, token: str, timeout: float = HELLO_TIMEOUT_S) -> Welcome:
    """Check that `server` accepts `token` without starting a worker."""
    sock, welcome = handshake(server, token, flags=HELLO_PROBE, timeout=timeout)
    sock.close()
    return welcome

