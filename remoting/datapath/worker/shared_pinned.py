"""Same-host page-locked memory the client shares with its worker (protocol 15; the client's half is
remoting/native/src/shared_pinned.c).

The worker opens, for its session alone, a Unix socket under a random abstract name that it tells
the client over the session's connection. The client connects (it can only from this host and
network namespace) and passes each page-locked allocation's memfd with SCM_RIGHTS; the worker maps
it and copies read and write those pages in place. What a client can make the worker map:
- only what it passed, never a name: a file descriptor the client itself holds;
- only a memfd sealed against shrinking, of exactly the size announced on the session (no other
  file: a regular file, a /dev/shm file or a pipe is refused), so no one can cut it short under the
  worker's mapping;
- only from a process of the session's uid (SO_PEERCRED), on a socket it accepts once.
Regions end with rgpuHostUnshare, and all of them with the session (the worker process exits)."""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import secrets
import socket
import stat
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rgpu.remoting.datapath.backends.base import INVALID_VALUE, NOT_SUPPORTED, OUT_OF_MEMORY, CudaError
from rgpu.units import format_bytes

log = logging.getLogger("rgpu.worker")

MESSAGE = struct.Struct("<QQ")            # what comes with the fd: size, nonce (as on the session's frame)
UCRED = struct.Struct("<iII")             # struct ucred: pid, uid, gid
SHARE = struct.Struct("<QQ")              # rgpuHostShare: size (0: the socket's name), nonce
SHARED_COPY = struct.Struct("<QQQQQ")     # rgpuMemcpy*Shared: device address, stream, region, offset, size
ACCEPT_TIMEOUT_S = 3.0                    # the client connects and sends before its frame: this is generous
MAX_BYTES_DEFAULT = 64 << 30              # RGPU_SHARED_PINNED_MAX_BYTES: what one session may have mapped
NAME_PREFIX = "rgpu-pinned-"


def enabled() -> bool:
    """RGPU_SHARED_PINNED=0 in the dispatcher's environment (its workers inherit it) turns sharing off."""
    return os.environ.get("RGPU_SHARED_PINNED", "1").lower() not in ("0", "off", "no")


def is_sealed_memfd(fd: int, size: int) -> str:
    """"" when fd is a memfd sealed against shrinking of exactly `size` bytes, else why not."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file"
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        return "a file that cannot be sealed (not a memfd)"
    if not seals & fcntl.F_SEAL_SHRINK:
        return "a file not sealed against shrinking (not a memfd made by rgpu's client)"
    if info.st_size != size:
        return f"{info.st_size} bytes, not the {size} announced"
    return ""


@dataclass
class Region:
    address: int
    size: int
    mapping: mmap.mmap
    holder: Any             # the ctypes array that pins the mapping's address (released before close)


class SharedRegions:
    """The session's shared regions: the socket they come on, and their mappings by id."""

    def __init__(self, client_uid: object, register: Callable[[int, int], None] | None = None,
                 unregister: Callable[[int], None] | None = None) -> None:
        self.client_uid = client_uid if isinstance(client_uid, int) and not isinstance(client_uid, bool) else None
        self.register, self.unregister = register, unregister
        self.max_bytes = int(os.environ.get("RGPU_SHARED_PINNED_MAX_BYTES") or MAX_BYTES_DEFAULT)
        self.listener: socket.socket | None = None
        self.conn: socket.socket | None = None
        self.regions: dict[int, Region] = {}
        self.mapped = 0
        self.next_id = 1

    def socket_name(self) -> bytes:
        """The abstract name of this session's socket (opened on first use)."""
        if not enabled():
            raise CudaError(NOT_SUPPORTED, "")   # quiet: the client keeps its copies on the wire
        if self.client_uid is None:
            raise CudaError(NOT_SUPPORTED, "")   # a client that names no uid cannot be checked
        if self.listener is None and self.conn is None:
            name = (NAME_PREFIX + secrets.token_hex(16)).encode()
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            listener.bind(b"\0" + name)
            listener.listen(1)
            self.listener, self.name = listener, name
        return self.name

    def _connection(self) -> socket.socket:
        if self.conn is not None:
            return self.conn
        if self.listener is None:
            raise CudaError(INVALID_VALUE, "rgpu: worker: rgpuHostShare before the session's shared-memory socket was "
                                           "asked for (a client that is not rgpu's, or another version)")
        # Abstract names are listed in /proc/net/unix: a process of another uid may connect first.
        # It is refused, and the session's own client may still connect, until the deadline.
        deadline = time.monotonic() + ACCEPT_TIMEOUT_S
        refused: list[int] = []
        conn = None
        while conn is None:
            self.listener.settimeout(max(0.0, deadline - time.monotonic()))
            try:
                conn, _ = self.listener.accept()
            except OSError as exc:
                whose = (f"only processes of uid {', '.join(map(str, refused))}, not the session's "
                         f"({self.client_uid}), connected: page-locked memory is shared only by the session's own "
                         "processes" if refused else f"no client connected ({exc})")
                raise CudaError(INVALID_VALUE, f"rgpu: worker: rgpuHostShare: {whose}") from None
            _pid, uid, _gid = UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, UCRED.size))
            if uid != self.client_uid:
                conn.close()
                conn = None
                refused.append(uid)
                if len(refused) == 1:   # one line, however many try
                    log.warning("rgpu: worker: a process of uid %d connected to the shared-memory socket of a session "
                                "of uid %s: refused", uid, self.client_uid)
        self.listener.close()   # one connection per session, ever
        self.listener = None
        conn.settimeout(ACCEPT_TIMEOUT_S)
        self.conn = conn
        return conn

    def add(self, size: int, nonce: int) -> int:
        """Receive the memfd the client just passed, check it and map it: its region id."""
        if not 0 < size <= self.max_bytes - self.mapped:
            raise CudaError(OUT_OF_MEMORY, f"rgpu: worker: rgpuHostShare of {format_bytes(size)}: this session "
                                           f"shares {format_bytes(self.mapped)} already, at most "
                                           f"{format_bytes(self.max_bytes)} (RGPU_SHARED_PINNED_MAX_BYTES)")
        conn = self._connection()
        try:
            data, fds, _flags, _addr = socket.recv_fds(conn, MESSAGE.size, 4, socket.MSG_CMSG_CLOEXEC)
        except OSError as exc:
            raise CudaError(INVALID_VALUE, f"rgpu: worker: rgpuHostShare: nothing came on the shared-memory socket "
                                           f"({exc})") from None
        try:
            if len(data) != MESSAGE.size or len(fds) != 1:
                raise CudaError(INVALID_VALUE, f"rgpu: worker: rgpuHostShare: the shared-memory socket carried "
                                               f"{len(data)} bytes and {len(fds)} file descriptors, want "
                                               f"{MESSAGE.size} and 1")
            if MESSAGE.unpack(data) != (size, nonce):
                raise CudaError(INVALID_VALUE, "rgpu: worker: rgpuHostShare: the file descriptor on the shared-memory "
                                               "socket is not the one this call announces (size or nonce differ)")
            why = is_sealed_memfd(fds[0], size)
            if why:
                raise CudaError(INVALID_VALUE, f"rgpu: worker: rgpuHostShare: refused the file passed ({why}); only "
                                               "rgpu's page-locked memory is shared")
            mapping = mmap.mmap(fds[0], size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            for fd in fds:
                os.close(fd)
        holder = (ctypes.c_char * size).from_buffer(mapping)
        address = ctypes.addressof(holder)
        if self.register is not None:
            try:
                self.register(address, size)
            except CudaError:
                del holder
                mapping.close()
                raise
        region = self.next_id
        self.next_id += 1
        self.regions[region] = Region(address, size, mapping, holder)
        self.mapped += size
        return region

    def span(self, region: int, offset: int, size: int, what: str) -> tuple[int, memoryview]:
        """(address, view) of bytes [offset, offset+size) of a region, or the CudaError naming the fault."""
        r = self.regions.get(region)
        if r is None:
            raise CudaError(INVALID_VALUE, f"rgpu: worker: {what}: region {region} is not one this session shares "
                                           "(freed, or never shared)")
        if size <= 0 or offset > r.size or size > r.size - offset:
            raise CudaError(INVALID_VALUE, f"rgpu: worker: {what}: bytes {offset}..{offset + size} are outside "
                                           f"region {region} ({r.size} bytes)")
        return r.address + offset, memoryview(r.mapping)[offset:offset + size]

    def remove(self, region: int) -> None:
        r = self.regions.pop(region, None)
        if r is None:
            raise CudaError(INVALID_VALUE, f"rgpu: worker: rgpuHostUnshare: region {region} is not one this "
                                           "session shares")
        self._release(r)

    def _release(self, r: Region) -> None:
        self.mapped -= r.size
        if self.unregister is not None:
            try:
                self.unregister(r.address)
            except CudaError as exc:
                log.warning("unregistering shared page-locked memory failed: %s", exc)
        r.holder = None
        r.mapping.close()

    def close(self) -> None:
        """Every region unmapped (and unregistered), the sockets closed: at the session's end."""
        for r in list(self.regions.values()):
            self._release(r)
        self.regions.clear()
        for s in (self.listener, self.conn):
            if s is not None:
                s.close()
        self.listener = self.conn = None
