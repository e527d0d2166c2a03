"""What is left of a worker whose GPU context died under MPS (faults.py): no CUDA, no GPU, only
the client's socket. It answers each call that waits for a reply with the sticky error and the
dispatcher's one-line message (asynchronous calls get none, as from a live worker), until the
application says goodbye, disconnects, or TOMBSTONE_LIFETIME_S passes."""

from __future__ import annotations

import argparse
import os
import socket
import struct
from pathlib import Path

from rgpu.remoting.datapath import protocol
from rgpu.remoting.datapath.worker.faults import RELEASED
from rgpu.remoting.native.generated import api_gen

TOMBSTONE_LIFETIME_S = 600.0
MESSAGES_MAX = 8


def _exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def _skip(sock: socket.socket, n: int) -> None:
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise EOFError
        n -= len(chunk)


def serve(sock: socket.socket, code: int, message: str) -> None:
    # Unasked: a client that answers idle synchronisations itself must stop and ask (NOTICE).
    sock.sendall(protocol.HEADER.pack(0, protocol.OP_NOTICE, 0, 0, 0, 0))
    sent_messages = 0
    while True:
        length, op, _flags, seq, _aux, _ctx = protocol.HEADER.unpack(_exact(sock, protocol.HEADER_SIZE))
        _skip(sock, length)
        if op == protocol.OP_BYE or op < 32:
            return
        if op in api_gen.ASYNC_OPS:
            continue
        body = struct.pack("<i", code)
        flags = 0
        if sent_messages < MESSAGES_MAX:
            sent_messages += 1
            flags = protocol.REPLY_HAS_MESSAGE
            text = message.encode()
            body += struct.pack("<I", len(text)) + text
        sock.sendall(protocol.HEADER.pack(len(body), protocol.OP_REPLY, flags, seq, 0, 0) + body)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="rgpu worker tombstone (after an MPS fault)")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--code", type=int, required=True)
    parser.add_argument("--message", required=True)
    parser.add_argument("--faults-dir", default="")
    args = parser.parse_args(argv)
    if args.faults_dir:   # tell the dispatcher this client has let go of the GPU
        try:
            folder = Path(args.faults_dir) / RELEASED
            folder.mkdir(parents=True, exist_ok=True)
            (folder / str(os.getpid())).touch()
        except OSError:
            pass
    sock = socket.socket(fileno=args.fd)
    sock.settimeout(TOMBSTONE_LIFETIME_S)
    try:
        serve(sock, args.code, args.message)
    except (EOFError, OSError, struct.error):
        pass
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
