"""Users' MUNGE credentials, checked without letting munged's health decide the pool's.

libmunge asks munged over a UNIX socket, and a dead munged costs each decode about 2.3 s of
libmunge's own retries (a paused one 10 s, measured). Decoded where the call arrives, that time
was taken from the pool's serving threads (issue 26, HIGH 2). Here each credential is decoded on a
small pool of decoder threads; the caller waits at most `timeout` seconds, and at most
`decoders + queue` credentials are in flight (a full queue is refused at once). When munged does not
answer (a timeout, or libmunge's socket error) the gate opens for `retry_after` seconds: every
MUNGE call is refused at once with one line naming munged's socket, then one call probes munged
again, and a probe that munged answers (even to refuse the credential) closes the gate.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from rgpu import munge
from rgpu.errors import Unavailable

DECODERS = 2          # munged answers in ~1-2 ms; two keep up with a flood on a 2-core host
QUEUE = 4             # credentials waiting for a decoder beyond those being decoded
TIMEOUT_SECONDS = 1.0
RETRY_AFTER_SECONDS = 5.0

Decoder = Callable[[str, str], munge.Identity]


class MungeGate:
    """Decodes MUNGE credentials with a deadline, a bounded queue and a breaker (module text)."""

    def __init__(self, socket_path: str, *, decoders: int = DECODERS, queue: int = QUEUE,
                 timeout: float = TIMEOUT_SECONDS, retry_after: float = RETRY_AFTER_SECONDS,
                 decode: Decoder = munge.decode, clock: Callable[[], float] = time.monotonic) -> None:
        self.socket_path = socket_path
        self.capacity = decoders + queue
        self._where = socket_path or munge.DEFAULT_SOCKET
        self._decode, self._clock = decode, clock
        self._timeout, self._retry_after = timeout, retry_after
        self._decoders = ThreadPoolExecutor(decoders, thread_name_prefix="munge-decode")
        self._in_flight = threading.BoundedSemaphore(self.capacity)   # released when a decode ends
        self._lock = threading.Lock()
        self._open_until = 0.0    # while the clock is before this, munged is taken as down
        self._why = ""
        self._refusal: Unavailable | None = None
        self._probing = False

    def refusing(self) -> bool:
        """True while munged is taken as down and it is not yet time to probe it again, or another
        call probes it now (cheap: the caller may answer at once, without a serving thread)."""
        return self._probing or self._clock() < self._open_until

    def unavailable(self) -> Unavailable:
        """The one-line refusal while munged is taken as down (made once per trip: a flood of calls
        is answered with the same object)."""
        refusal = self._refusal
        if refusal is None or refusal.why != self._why_text():
            refusal = self._refusal = Unavailable("pool", "cannot check the MUNGE credential", self._why_text(),
                                                  "start munged on the pool host (or fix munge_socket in rgpu.toml); retry")
        return refusal

    def _why_text(self) -> str:
        return f"munged at {self._where} is not answering: {self._why or 'no answer'}"

    def decode(self, credential: str) -> munge.Identity:
        """Who made `credential`. Raises AuthError (munged refused it) or Unavailable (munged did
        not answer in time, is taken as down, or too many credentials wait for it)."""
        probe = self._admit()
        if not self._in_flight.acquire(blocking=False):
            if self._open_until:   # munged was down and its last decodes still hang: still down
                self._trip(self._why, probe)
                raise self.unavailable()
            raise Unavailable("pool", "cannot check the MUNGE credential",
                              f"{self.capacity} credentials already wait for munged at {self._where}",
                              "retry in a moment; if it lasts, see munged on the pool host")
        try:
            future = self._decoders.submit(self._run, credential)
        except RuntimeError:   # shut down
            self._in_flight.release()
            self._end_probe(probe)
            raise self.unavailable() from None
        try:
            identity = future.result(timeout=self._timeout)
        except FutureTimeout:
            self._trip(f"no answer within {self._timeout:g} s", probe)
            raise self.unavailable() from None
        except munge.MungedUnreachable as exc:
            self._trip(exc.why, probe)
            raise self.unavailable() from None
        except BaseException:
            self._heal(probe)   # munged answered: it refused the credential
            raise
        self._heal(probe)
        return identity

    def close(self) -> None:
        self._decoders.shutdown(wait=False, cancel_futures=True)

    def _run(self, credential: str) -> munge.Identity:
        try:
            return self._decode(credential, self.socket_path)
        finally:
            self._in_flight.release()

    def _admit(self) -> bool:
        """Whether this call is the probe of an open gate; raises Unavailable while the gate is
        open, or while another call probes."""
        with self._lock:
            if self._open_until == 0.0:
                return False
            if self._clock() < self._open_until or self._probing:
                raise self.unavailable()
            self._probing = True
            return True

    def _end_probe(self, probe: bool) -> None:
        if probe:
            with self._lock:
                self._probing = False

    def _trip(self, why: str, probe: bool) -> None:
        with self._lock:
            self._open_until = self._clock() + self._retry_after
            self._why = why
            if probe:
                self._probing = False

    def _heal(self, probe: bool) -> None:
        if probe or self._open_until:
            with self._lock:
                self._open_until, self._why, self._probing = 0.0, "", False
