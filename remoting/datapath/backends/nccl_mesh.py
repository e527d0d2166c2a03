"""The emulated GPU's NCCL transport: a communicator's ranks, one worker process each, find each other
through a rendezvous named by the unique id and exchange host memory over TCP, every rank with every
other (a full mesh: communicators here have a handful of ranks).

The unique id (128 bytes, as NCCL's) is `MAGIC | format (u16, 1) | port (u16) | tag (16 random bytes) |
host (NUL padded)`: binary, with a NUL in its fifth word, as real NCCL's ids may be anywhere: the address of a rendezvous listener in the worker that made it. Each rank's worker opens a
listener of its own for its peers, tells the rendezvous (tag, nranks, rank, its address), and gets
every rank's address back once all have come; then rank i connects to each lower rank. Every message
is length-prefixed, sent by one thread per peer (a rank may send to a peer that is sending to it) and
received in the order the ranks issue their operations, which NCCL requires to be the same on all.

A peer that goes away (its worker died, its socket closed) or sends nothing for `timeout_s` ends the
operation with `MeshError`, whose text names the peer and why.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import struct
import threading
import time
from dataclasses import dataclass

MAGIC = b"RGPUNCL1"
ID_BYTES = 128
ID_FORMAT = 1
_ID_HEAD = struct.Struct("<8sHH16s")
_LEN = struct.Struct("<Q")
DEFAULT_TIMEOUT_S = 300.0


class MeshError(Exception):
    """An exchange with a peer failed; the text says which peer and why."""


def _gone(peer: int, exc: BaseException) -> str:
    """Why a peer's connection failed, in the same words however the kernel noticed it (end of stream,
    reset, broken pipe: its worker or host went away)."""
    if isinstance(exc, (EOFError, ConnectionResetError, BrokenPipeError, ConnectionAbortedError)):
        return f"rank {peer}'s worker went away (its connection closed)"
    return f"rank {peer}'s worker went away ({getattr(exc, 'strerror', None) or exc})"


@dataclass(frozen=True)
class UniqueId:
    host: str
    port: int
    tag: bytes

    def pack(self) -> bytes:
        host = self.host.encode()
        if len(host) > ID_BYTES - _ID_HEAD.size - 1:
            raise ValueError(f"host name {self.host!r} is too long for an NCCL unique id")
        return (_ID_HEAD.pack(MAGIC, ID_FORMAT, self.port, self.tag) + host).ljust(ID_BYTES, b"\0")

    @classmethod
    def unpack(cls, data: bytes) -> UniqueId:
        if len(data) != ID_BYTES:
            raise ValueError(f"an NCCL unique id has {ID_BYTES} bytes, not {len(data)}")
        magic, form, port, tag = _ID_HEAD.unpack_from(data)
        if magic != MAGIC or form != ID_FORMAT:
            raise ValueError("not a unique id of rgpu's emulated NCCL (made by another NCCL, or not by ncclGetUniqueId)")
        host = data[_ID_HEAD.size:].split(b"\0", 1)[0].decode()
        return cls(host, port, tag)


def timeout_from_env() -> float:
    """RGPU_NCCL_TIMEOUT_S (the worker's environment): how long a rank waits for its peers."""
    try:
        value = float(os.environ.get("RGPU_NCCL_TIMEOUT_S", "") or DEFAULT_TIMEOUT_S)
    except ValueError:
        return DEFAULT_TIMEOUT_S
    return value if value > 0 else DEFAULT_TIMEOUT_S


def _send_json(sock: socket.socket, obj: object) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray(n)
    view = memoryview(out)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("connection closed")
        got += k
    return bytes(out)


def _recv_json(sock: socket.socket) -> dict:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > 1 << 20:
        raise ValueError("rendezvous message too large")
    return json.loads(_recv_exact(sock, n))


class Rendezvous:
    """The listener behind one unique id, in the worker that made it: collects every rank's address and
    hands each the whole table. It serves one communicator and closes when that one has formed (or after
    the timeout)."""

    def __init__(self, host: str, timeout_s: float) -> None:
        self.sock = socket.create_server((host, 0))
        self.id = UniqueId(host, self.sock.getsockname()[1], os.urandom(16))
        self.timeout_s = timeout_s
        threading.Thread(target=self._serve, name="rgpu-nccl-rendezvous", daemon=True).start()

    def _serve(self) -> None:
        members: dict[int, tuple[socket.socket, str, int]] = {}
        nranks = 0
        deadline = time.monotonic() + self.timeout_s + 5   # the ranks' own wait ends first, with its reason
        try:
            while not nranks or len(members) < nranks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self.sock.settimeout(left)
                conn, _ = self.sock.accept()
                conn.settimeout(self.timeout_s)
                try:
                    hello = _recv_json(conn)
                except (OSError, ValueError, EOFError):
                    conn.close()
                    continue
                if bytes.fromhex(hello.get("tag", "")) != self.id.tag or hello.get("rank") in members or \
                        (nranks and hello.get("nranks") != nranks):
                    _send_json(conn, {"error": "this rank does not fit the communicator (another id, a rank taken "
                                               "twice, or another rank count)"})
                    conn.close()
                    continue
                nranks = int(hello["nranks"])
                members[int(hello["rank"])] = (conn, str(hello["host"]), int(hello["port"]))
            table = [[members[r][1], members[r][2]] for r in range(nranks)]
            for conn, _, _ in members.values():
                try:
                    _send_json(conn, {"peers": table})
                except OSError:
                    pass
        except OSError:
            return
        finally:
            for conn, _, _ in members.values():
                conn.close()
            self.sock.close()


class Mesh:
    """One rank's connections to every other rank of its communicator."""

    def __init__(self, unique_id: bytes, nranks: int, rank: int, host: str, timeout_s: float) -> None:
        self.rank, self.nranks, self.timeout_s = rank, nranks, timeout_s
        self.peers: dict[int, socket.socket] = {}
        self.outboxes: dict[int, queue.Queue[bytes | None]] = {}
        self.senders: list[threading.Thread] = []
        self.failure = ""          # the first send that failed, said at the next operation
        self._closed = False
        uid = UniqueId.unpack(unique_id)
        listener = socket.create_server((host, 0), backlog=max(nranks, 8))
        try:
            table = self._register(uid, host, listener.getsockname()[1])
            self._connect(uid, table, listener)
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()
        for peer, sock in self.peers.items():
            box: queue.Queue[bytes | None] = queue.Queue()
            self.outboxes[peer] = box
            sender = threading.Thread(target=self._sender, args=(peer, sock, box), name=f"rgpu-nccl-send-{peer}",
                                      daemon=True)
            sender.start()
            self.senders.append(sender)

    def _register(self, uid: UniqueId, host: str, port: int) -> list[list]:
        try:
            rv = socket.create_connection((uid.host, uid.port), timeout=self.timeout_s)
        except OSError as exc:
            raise MeshError(f"cannot reach the communicator's rendezvous at {uid.host}:{uid.port} ({exc.strerror or exc}; "
                            "the worker that made the unique id is gone, or the id is from an earlier run)") from exc
        with rv:
            try:
                _send_json(rv, {"tag": uid.tag.hex(), "nranks": self.nranks, "rank": self.rank, "host": host, "port": port})
                answer = _recv_json(rv)
            except socket.timeout as exc:
                raise MeshError(f"not every rank joined within {self.timeout_s:g} s (RGPU_NCCL_TIMEOUT_S)") from exc
            except (OSError, EOFError, ValueError) as exc:
                raise MeshError(f"the rendezvous at {uid.host}:{uid.port} closed before every rank joined ({exc})") from exc
        if "error" in answer:
            raise MeshError(f"the rendezvous refused rank {self.rank}: {answer['error']}")
        return answer["peers"]

    def _connect(self, uid: UniqueId, table: list[list], listener: socket.socket) -> None:
        hello = struct.Struct("<16si")
        for peer in range(self.rank):
            sock = socket.create_connection((table[peer][0], int(table[peer][1])), timeout=self.timeout_s)
            sock.sendall(hello.pack(uid.tag, self.rank))
            self._keep(peer, sock)
        listener.settimeout(self.timeout_s)
        while len(self.peers) < self.nranks - 1:
            try:
                sock, _ = listener.accept()
            except socket.timeout as exc:
                raise MeshError(f"not every rank connected within {self.timeout_s:g} s") from exc
            sock.settimeout(self.timeout_s)
            tag, peer = hello.unpack(_recv_exact(sock, hello.size))
            if tag != uid.tag or not self.rank < peer < self.nranks or peer in self.peers:
                sock.close()
                continue
            self._keep(peer, sock)

    def _keep(self, peer: int, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(self.timeout_s)
        self.peers[peer] = sock

    def _sender(self, peer: int, sock: socket.socket, box: queue.Queue[bytes | None]) -> None:
        while (data := box.get()) is not None:
            try:
                sock.sendall(_LEN.pack(len(data)))
                sock.sendall(data)
            except OSError as exc:
                if not self.failure:
                    self.failure = _gone(peer, exc)
                return

    def send(self, peer: int, data: bytes) -> None:
        if self.failure:
            raise MeshError(self.failure)
        self.outboxes[peer].put(data)

    def recv(self, peer: int, nbytes: int) -> bytes:
        sock = self.peers[peer]
        try:
            (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
            if n != nbytes:
                raise MeshError(f"rank {peer} sent {n} bytes where this rank expected {nbytes} (the ranks called "
                                "different operations or counts)")
            return _recv_exact(sock, n)
        except socket.timeout as exc:
            raise MeshError(f"rank {peer} sent nothing for {self.timeout_s:g} s (RGPU_NCCL_TIMEOUT_S)") from exc
        except (EOFError, OSError) as exc:
            raise MeshError(_gone(peer, exc)) from exc

    def close(self, flush_s: float = 0.0) -> None:
        """`flush_s`: how long the messages still queued may take to leave (a rank that destroys its
        communicator right after its last collective has sent its part to peers still receiving it)."""
        if self._closed:
            return
        self._closed = True
        for box in self.outboxes.values():
            box.put(None)
        deadline = time.monotonic() + flush_s
        for sender in self.senders:
            sender.join(max(deadline - time.monotonic(), 0.0))
        for sock in self.peers.values():
            try:
                sock.close()
            except OSError:
                pass
