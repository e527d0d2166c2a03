"""The session server's front door: limits on connections that have not sent their HELLO yet, and
which handshake gives way to a newcomer when they are reached."""

from __future__ import annotations

import fcntl
import resource
import socket
import struct
import termios
from collections.abc import Iterable
from dataclasses import dataclass

from rgpu.remoting.datapath import protocol


@dataclass(frozen=True)
class FrontDoor:
    """Limits on connections that have not yet sent their HELLO (config keys session_*)."""
    hello_deadline_s: float = 10.0     # counted from the accept, never reset by a byte
    max_handshakes: int = 256          # in progress at once, all sources
    per_address: int = 16              # in progress at once from one source address
    evict_after_s: float = 1.0         # when full, a handshake older than this gives way to a new one
    first_byte_s: float = 3.0          # a connection that has sent nothing this long is closed

    def first_byte_deadline_s(self) -> float:
        return min(self.first_byte_s, self.hello_deadline_s)

    def capped_by_open_files(self) -> int:
        """max_handshakes, lowered so that handshakes can never use up the process's file
        descriptors (accept() would then fail for everyone, the legitimate client included)."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return self.max_handshakes
        return max(4, min(self.max_handshakes, (soft - 64) // 2))


@dataclass
class _Pending:
    conn: socket.socket
    host: str
    accepted: float
    evicted: bool = False
    got: int = 0       # bytes of the HELLO read so far (its handshake thread counts them)
    need: int = 0      # the whole HELLO's size, once its header is read; 0 before

    def waiting_bytes(self) -> int:
        """Bytes that arrived but are not read yet (FIONREAD); 0 if it cannot tell."""
        try:
            return struct.unpack("i", fcntl.ioctl(self.conn.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
        except (OSError, ValueError):
            return 0

    def hello_in_hand(self) -> bool:
        """The whole HELLO has arrived (read or waiting): a client that means it, about to be served."""
        if self.need:
            return self.got + self.waiting_bytes() >= self.need
        if self.got:
            # A whole header read and its size not recorded yet (its thread is between the two, and
            # the accept loop may look then): as a header waiting. Part of a header: a trickle.
            return self.got >= protocol.HEADER_SIZE
        # A header waiting, not read yet: its thread reads it within moments and knows the size
        # then; until then it is taken as a HELLO in hand (a peek here could block the accept loop).
        return self.waiting_bytes() >= protocol.HEADER_SIZE


def door_refusal(host: str, per_address: int | None, max_handshakes: int) -> bytes:
    """The REFUSE a connection closed at the front door gets: flagged REFUSE_RETRY, since its HELLO was
    not read (protocol.handshake sends it again). per_address: it made way at its address's cap (None:
    at the cap of all sources)."""
    if per_address is not None:
        full = f"the {per_address} handshake slots of {host} were taken (session_handshakes_per_address)"
        hint = f"if this repeats, something on {host} holds connections to this port open without sending"
    else:
        full = f"all {max_handshakes} handshake slots of this dispatcher were taken (session_handshakes_max)"
        hint = "if this repeats, the port is flooded: see the dispatcher's log, and firewall it"
    return protocol.encode_refuse(f"rgpu: session: {full}, so this connection was closed before its HELLO "
                                  f"was read (retry; {hint})", retry=True)


def door_victim(pending: Iterable[_Pending], now: float, min_age_s: float) -> _Pending | None:
    """Which of these handshakes (oldest first) gives way to a newcomer: the oldest one at least
    min_age_s old whose whole HELLO has not arrived (idle or trickling); never one whose has, so
    a client that means it never loses its slot to idle ones. Lazy: usually one ioctl."""
    return next((p for p in pending if now - p.accepted >= min_age_s and not p.hello_in_hand()), None)
