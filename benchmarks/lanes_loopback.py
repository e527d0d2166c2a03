"""rgpu's data lanes alone (remoting/native/src/lanes.c: rgpu_lanes_send to rgpu_lanes_recv straight
into memory, no GPU, no session) beside raw loopback TCP on as many streams, in one run: how much of
a striped copy's gap to raw TCP lies in the lanes' own code rather than in the GPU's side of it.

    python benchmarks/lanes_loopback.py [--lanes 1,2,8] [--mib 256] [--reps 5] [--chunk-bytes 2097152]

Both sides' buffers span the copy (as a copy between an application's buffer and device memory the
worker writes straight into); raw TCP runs just before the lanes for each lane count. GB/s, medians.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MiB = 1 << 20


def connected_pairs(n: int, buffer_bytes: int) -> tuple[list[socket.socket], list[socket.socket]]:
    """n loopback TCP connections: (sending ends, receiving ends)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(n)
        senders, receivers = [], []
        for _ in range(n):
            sender = socket.create_connection(listener.getsockname())
            receiver, _ = listener.accept()
            for s in (sender, receiver):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
            senders.append(sender)
            receivers.append(receiver)
    return senders, receivers


def lanes_gbps(lib: ctypes.CDLL, lanes: int, size: int, chunk: int, reps: int, buffer_bytes: int) -> float:
    senders, receivers = connected_pairs(lanes, buffer_bytes)
    src, dst = mmap.mmap(-1, size), mmap.mmap(-1, size)
    src.write(b"\x01" * size)   # touched before the clock, as an application's buffer is
    dst.write(b"\x00" * size)
    src_at = ctypes.addressof(ctypes.c_char.from_buffer(src))
    dst_at = ctypes.addressof(ctypes.c_char.from_buffer(dst))
    send_fds = (ctypes.c_int * lanes)(*[s.fileno() for s in senders])
    recv_fds = (ctypes.c_int * lanes)(*[s.fileno() for s in receivers])
    runs = []
    try:
        for seq in range(1, reps + 1):
            why_send, why_recv = ctypes.create_string_buffer(512), ctypes.create_string_buffer(512)
            aborted, sent = ctypes.c_int32(0), []
            sender = threading.Thread(target=lambda seq=seq, why=why_send: sent.append(lib.rgpu_lanes_send(
                send_fds, lanes, seq, src_at, size, chunk, -1, None, None, 30.0, why, 512)))
            started = time.perf_counter()
            sender.start()
            received = lib.rgpu_lanes_recv(recv_fds, lanes, seq, size, chunk, dst_at, None, -1, None, None, 30.0,
                                           ctypes.byref(aborted), why_recv, 512)
            sender.join()
            elapsed = time.perf_counter() - started
            if received or sent != [0]:
                raise SystemExit(f"lanes_loopback: the copy failed: {why_send.value.decode()} "
                                 f"{why_recv.value.decode()}".strip())
            runs.append(size / elapsed / 1e9)
        if dst[:4096] != src[:4096] or dst[-4096:] != src[-4096:]:
            raise SystemExit("lanes_loopback: the bytes that arrived are not the bytes sent")
    finally:
        for s in senders + receivers:
            s.close()
    return statistics.median(runs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lanes", default="1,2,8", help="lane counts, comma-separated (1 to 16)")
    parser.add_argument("--mib", type=int, default=256, help="MiB per copy")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--chunk-bytes", type=int, default=2 * MiB)
    parser.add_argument("--socket-buffer", type=int, default=4 * MiB)
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.lanes.split(",")]
    if not all(1 <= n <= 16 for n in counts) or args.mib < 1 or args.reps < 1:
        parser.error("--lanes takes counts of 1 to 16; --mib and --reps at least 1")
    sys.path.insert(0, str(HERE.parent))
    from benchmarks.copies import RAW_TCP_C, _compile, raw_tcp
    from rgpu.remoting.native.build import ensure_built

    lib = ctypes.CDLL(str(ensure_built().folder / "librgpu-worker.so"))
    lib.rgpu_lanes_send.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint64,
                                    ctypes.c_uint64, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_double,
                                    ctypes.c_char_p, ctypes.c_size_t]
    lib.rgpu_lanes_recv.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_uint64,
                                    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                    ctypes.c_double, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    size = args.mib * MiB
    print(f"lanes.c alone vs raw loopback TCP, {args.mib} MiB, chunks of {args.chunk_bytes} bytes, socket buffers "
          f"{args.socket_buffer}, median of {args.reps} (GB/s)")
    with tempfile.TemporaryDirectory(prefix="rgpu-lanes-") as tmp:
        raw_bin = _compile(RAW_TCP_C, Path(tmp) / "raw_tcp", "-pthread")
        for n in counts:
            raw = raw_tcp(raw_bin, args.mib * 8, args.reps, n, args.socket_buffer, span_mib=args.mib, span_side="both")
            lanes = lanes_gbps(lib, n, size, args.chunk_bytes, args.reps, args.socket_buffer)
            print(f"{n:>2} lane{'s' if n > 1 else ' '}: lanes.c {lanes:6.2f}   raw TCP {raw:6.2f}   {lanes / raw:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
