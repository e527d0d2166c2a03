"""How the pool answers a call it refuses before running it (no credential, a wrong secret, munged
taken as down): on no serving thread, without reading the request, and paced.

A refusal used to be a unary handler run on a serving thread: it waited there for the request,
then answered, several thread hand-overs per call, queued beside the calls made with the cluster
secret. A flood of garbage MUNGE headers while munged was down so doubled and tripled admins'
latency (issue 26, HIGH 2). Here:

- gRPC runs a handler on the executor its behaviour names (`experimental_thread_pool`); a
  refusal names one of its own, never the serving threads. Its handler is client-streaming: the
  request is an iterator it never reads, where a unary handler's would first wait for the message.
  Were gRPC to drop that attribute, refusals would still be answered, on a serving thread.
- That executor answers each refusal `delay` seconds after it came, from one thread: a client that
  calls again as soon as it is refused (a retry loop, a flood) is slowed to one call per `delay`,
  so it costs the pool a few calls a second instead of thousands. At most `held` refusals wait;
  beyond that one is answered at once, where it arrived (gRPC's polling thread), so what a flood
  with many calls in flight can hold is bounded.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc

DELAY_SECONDS = 0.1     # a refused caller hears why within this; a client looping on refusals is slowed to 10 calls/s
HELD = 512              # refusals waiting at once (a few KB each); beyond this they are answered at once


def _settle(done: "futures.Future[Any]", fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    try:
        done.set_result(fn(*args, **kwargs))
    except BaseException as exc:   # gRPC's own work item logs its errors; this keeps the thread alive
        done.set_exception(exc)


class PacedRefusals(futures.ThreadPoolExecutor):
    """Runs each piece of work `delay` seconds after it is submitted, in order, on one thread of its
    own (started on first use); at most `held` wait, and work beyond that runs at once on the
    submitting thread."""

    def __init__(self, delay: float = DELAY_SECONDS, held: int = HELD,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(max_workers=1)   # for gRPC's isinstance check: this executor starts no worker of its own
        self._delay, self._held, self._clock = delay, held, clock
        self._due: deque[tuple[float, futures.Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = deque()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> "futures.Future[Any]":
        done: futures.Future[Any] = futures.Future()
        with self._wake:
            if self._delay > 0 and len(self._due) < self._held:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._answer, name="refusals", daemon=True)
                    self._thread.start()
                self._due.append((self._clock() + self._delay, done, fn, args, kwargs))
                self._wake.notify()
                return done
        _settle(done, fn, args, kwargs)
        return done

    @property
    def waiting(self) -> int:
        return len(self._due)

    def _answer(self) -> None:
        while True:
            with self._wake:
                while not self._due:
                    self._wake.wait()
                left = self._due[0][0] - self._clock()
                if left > 0:
                    self._wake.wait(left)
                    continue
                _due, done, fn, args, kwargs = self._due.popleft()
            _settle(done, fn, args, kwargs)


PACED = PacedRefusals()


def refusal(code: grpc.StatusCode, message: str, executor: futures.ThreadPoolExecutor = PACED) -> Any:
    """A handler that answers every call with `code` and the one-line `message` (module text)."""
    def deny(requests: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, message)

    deny.experimental_thread_pool = executor   # type: ignore[attr-defined]
    return grpc.stream_unary_rpc_method_handler(deny)
