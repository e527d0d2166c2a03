"""Slowloris: a client that sends its request a byte at a time, for the front-door tests."""

from __future__ import annotations

import selectors
import socket
import threading
import time

from rgpu.remoting.datapath import protocol


class Slowloris:
    """Keeps `count` connections open to the port from source addresses 127.0.0.2.. (`sources` of
    them), each sending one byte of a HELLO header every `every` seconds, and opens a new one
    whenever the dispatcher closes one. `trickle`: the bytes sent, one at a time (default: a HELLO
    header's first byte, over and over); `data_port`: read the dispatcher's refusals."""

    def __init__(self, port: int, count: int, sources: int, every: float = 0.5, trickle: bytes = b"\x40",
                 data_port: bool = True) -> None:
        self.port, self.count, self.sources, self.every = port, count, sources, every
        self.trickle, self.data_port = trickle, data_port
        self.sel = selectors.DefaultSelector()
        self.opened = 0
        self.closed_by_server = 0
        self.lifetimes: list[float] = []
        self.bytes_sent: list[int] = []       # of each connection the dispatcher closed, sent before
        self.refusals: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _open(self) -> None:
        n = self.opened
        self.opened += 1
        s = socket.socket()
        s.bind((self._source_address(n), 0))
        s.setblocking(False)
        try:
            s.connect(("127.0.0.1", self.port))
        except BlockingIOError:
            pass
        self.sel.register(s, selectors.EVENT_READ, [time.monotonic(), b"", 0])

    def _source_address(self, n: int) -> str:
        return f"127.0.0.{2 + n % self.sources}"

    def held(self) -> int:
        return len(self.sel.get_map())

    def _run(self) -> None:
        for _ in range(self.count):
            self._open()
        last, sent = 0.0, 0
        while not self._stop.is_set():
            for key, _ in self.sel.select(timeout=0.05):
                s, (born, got, sent_here) = key.fileobj, key.data
                try:
                    chunk = s.recv(4096)   # type: ignore[union-attr]
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    chunk = b""
                if chunk:
                    key.data[1] = got + chunk
                    continue
                self.closed_by_server += 1
                self.lifetimes.append(time.monotonic() - born)
                self.bytes_sent.append(sent_here)
                if self.data_port and len(got) > protocol.HEADER_SIZE:
                    self.refusals.append(protocol.decode_refuse(got[protocol.HEADER_SIZE:])[1])
                self.sel.unregister(s)
                s.close()   # type: ignore[union-attr]
                self._open()
            if time.monotonic() - last >= self.every:
                last = time.monotonic()
                byte = self.trickle[sent % len(self.trickle):][:1]
                sent += 1
                for key in list(self.sel.get_map().values()):
                    try:
                        key.fileobj.send(byte)   # type: ignore[union-attr]
                        key.data[2] += 1
                    except OSError:
                        pass

    def __enter__(self) -> "Slowloris":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()   # type: ignore[union-attr]
