"""Lane settings, copy sizes and striping helpers shared by the copy-lane tests (emulated and real GPU)."""

from __future__ import annotations

import socket
import struct
import threading
from pathlib import Path

from rgpu.remoting.datapath import protocol
from rgpu.remoting.native import client_stats
from rgpu.remoting.native.generated import api_gen


HERE = Path(__file__).parent
LANE_ABORTED = 1   # lanes.h's RGPU_LANE_ABORTED: the frame carries an i32 code, not the chunk
OP = api_gen.OPCODES
MiB = 1 << 20
THRESHOLD = 1 * MiB     # RGPU_LANE_MIN_BYTES in these tests
CHUNK = 64 << 10        # RGPU_LANE_CHUNK_BYTES: the smallest the protocol allows, many chunks per copy
LANES = 3
# Odd sizes, around the threshold and around chunk and stripe boundaries (a stripe: one chunk per lane).
SIZES = [1, CHUNK - 1, CHUNK + 1, THRESHOLD - 1, THRESHOLD, THRESHOLD + 1, THRESHOLD + LANES * CHUNK - 1,
         THRESHOLD + LANES * CHUNK + 1, 5_000_007, 32 * MiB + 13]
STRIPED = sum(1 for n in SIZES if n >= THRESHOLD) * 2 * 2   # pageable and pinned, whole and at an offset
LANE_ENV = {"RGPU_LANES": str(LANES), "RGPU_LANE_MIN_BYTES": str(THRESHOLD), "RGPU_LANE_CHUNK_BYTES": str(CHUNK),
            "RGPU_TRANSPORT": "tcp", "RGPU_LOG": "info",
            "RGPU_SHARED_PINNED": "0"}   # the network path: pinned buffers of one host are read in place (protocol 15)


def _striped(profile_prefix: Path) -> tuple[int, int]:
    """(host-to-device, device-to-host) copies the client striped over its lanes, from its call profile."""
    files = list(profile_prefix.parent.glob(profile_prefix.name + ".*"))
    assert len(files) == 1, files
    ops, _ = client_stats.parse(files[0].read_text())
    htod, dtoh = ops.get(OP["rgpuMemcpyHtoDLanes"]), ops.get(OP["rgpuMemcpyDtoHLanes"])
    return (htod.async_calls if htod else 0), (dtoh.sync_calls if dtoh else 0)


def _sync(sock: socket.socket, op: int, payload: bytes, seq: int, ctx: int = 0) -> tuple[int, bytes]:
    sock.sendall(protocol.pack_frame(op, payload, seq=seq, ctx=ctx))
    while True:
        header, body = protocol.recv_frame(sock)
        if header[1] == protocol.OP_REPLY:
            assert header[3] == seq
            return struct.unpack_from("<i", body)[0], body


def send_striped(ends: list[socket.socket], seq: int, data: bytes, chunk: int, bad_chunk: int = -1,
                 aborted: dict[int, int] | None = None) -> list[threading.Thread]:
    """Threads sending `data` as a client's lanes do, chunk i on lane i % lanes (started): chunk
    `bad_chunk` says it is the next one; a chunk in `aborted` goes as an aborted frame with that code."""
    def send(lane: int) -> None:
        for i in range(lane, (len(data) + chunk - 1) // chunk, len(ends)):
            part = data[i * chunk:(i + 1) * chunk]
            flags = 0
            if aborted and i in aborted:
                part, flags = struct.pack("<i", aborted[i]), LANE_ABORTED
            frame = protocol.HEADER.pack(len(part), protocol.OP_LANE_DATA, flags, seq, i if i != bad_chunk else i + 1,
                                         i * chunk)
            try:
                ends[lane].sendall(frame + part)
            except OSError:
                return
    threads = [threading.Thread(target=send, args=(k,)) for k in range(len(ends))]
    for t in threads:
        t.start()
    return threads
