"""Door: a dispatcher's front door in front of a session server, for the client library's handshake
tests. It reads each connection's HELLO, closes the first sessions' with a REFUSE (flagged
REFUSE_RETRY, as the dispatcher's front door does for a connection it closed unread), and passes
every other connection through to the server, HELLO and all."""

from __future__ import annotations

import socket
import threading

from rgpu.remoting.datapath import protocol
from rgpu.remoting.dispatcher.front_door import door_refusal

NOT_RETRIED = "rgpu: session: refused at the door (no retry)"


class Door:
    """Listens on a loopback port; refuses the HELLOs of the first `refusals` sessions (with
    REFUSE_RETRY when `retry`, else with NOT_RETRIED, unflagged), passes the rest to `upstream`.
    `arrivals`: each connection, in the order accepted, as ("lane" or "session", its lane key)."""

    def __init__(self, upstream: str, refusals: int, retry: bool = True) -> None:
        self.upstream = protocol.split_address(upstream)
        self.refusals, self.retry = refusals, retry
        self.arrivals: list[tuple[str, str]] = []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def sessions(self) -> int:
        return sum(kind == "session" for kind, _ in self.arrivals)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            # The client sends its HELLO as soon as it has connected: read here, in accept order.
            conn.settimeout(10)
            try:
                header, payload = protocol.recv_frame(conn)
                hello = protocol.decode_hello(payload)
            except (OSError, ValueError, ConnectionError):
                conn.close()
                continue
            kind = "lane" if hello.flags & protocol.HELLO_LANE else "session"
            self.arrivals.append((kind, str(hello.info.get("lane_key", ""))))
            if kind == "session" and self.sessions() <= self.refusals:
                refusal = door_refusal("127.0.0.1", 16, 256) if self.retry else protocol.encode_refuse(NOT_RETRIED)
                with conn:
                    conn.sendall(refusal)
                continue
            conn.settimeout(None)
            threading.Thread(target=self._pass, args=(conn, protocol.HEADER.pack(*header) + payload),
                             daemon=True).start()

    def _pass(self, conn: socket.socket, hello: bytes) -> None:
        try:
            server = socket.create_connection(self.upstream, timeout=10)
        except OSError:
            conn.close()
            return
        server.settimeout(None)
        server.sendall(hello)
        back = threading.Thread(target=_pump, args=(server, conn), daemon=True)
        back.start()
        _pump(conn, server)
        back.join()
        conn.close()
        server.close()

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "Door":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """src's bytes to dst until src ends; then dst's writing end is shut, as src's was."""
    try:
        while data := src.recv(1 << 20):
            dst.sendall(data)
    except OSError:
        pass
    for sock, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
        try:
            sock.shutdown(how)
        except OSError:
            pass
