"""Event and stream handles and the frame builder shared by the tests of the worker's native event path."""

from __future__ import annotations

import struct
from rgpu.remoting.datapath import protocol
from tests.remoting.native_launches_helpers import CTX


EVENT = 0x7E00_0001_0000_0001     # client handles as the client library makes them (protocol 8)


STREAM = 0x7D00_0001_0000_0001


def frame(op: int, fmt: str, *values: int, ctx: int = CTX) -> bytes:
    body = struct.pack(fmt, *values)
    return protocol.pack_frame(op, body + b"\0" * (-len(body) % 8), seq=1, ctx=ctx)
