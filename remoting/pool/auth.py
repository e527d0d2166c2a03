"""Request authentication for the control plane, the pool's side: no anonymous gRPC call.

Every call carries `x-rgpu-auth: <unix time>.<nonce>.<hex HMAC>` computed with a key derived
from the cluster secret over the method name, time and nonce (signing.py: the client's half). The
secret itself never crosses the wire. The server refuses stale times (clock skew beyond AUTH_WINDOW_SECONDS), replays of
a nonce inside the window, and credentials stamped before the server started (its nonce cache
is in memory; this keeps a restart from reopening the window).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import grpc

from rgpu import munge
from rgpu.errors import AuthError, Unavailable
from rgpu.log_limit import LogLimit, held_note
from rgpu.remoting.pool.call_guards import CallGuards, GuardError, MemoryCallGuards
from rgpu.remoting.pool.munge_gate import MungeGate
from rgpu.remoting.pool.refusals import PacedRefusals, refusal
# The client's names stay importable from here for the pool's own code and older callers.
from rgpu.remoting.pool.signing import AUTH_HEADER, MUNGE_HEADER, PURPOSE, mac, request_credential
from rgpu.secret import derive_key

log = logging.getLogger("rgpu-poold")

__all__ = ["AUTH_HEADER", "MUNGE_HEADER", "request_credential", "ServerAuth", "Caller", "current_caller"]

POOL_NAME_METHOD = "/rgpu.v1.Pool/PoolName"   # open: a user's client asks it before making credentials
AUTH_WINDOW_SECONDS = 300.0


@dataclass(frozen=True)
class Caller:
    """Who made a call: a daemon or admin (holds the cluster secret) or a user (MUNGE: uid and
    name from munged, never from the request)."""
    kind: str                 # "daemon" or "user"
    user: str = ""
    uid: int = -1

    @property
    def is_daemon(self) -> bool:
        return self.kind == "daemon"


DAEMON = Caller("daemon")
_current = threading.local()


def current_caller() -> Caller:
    """The caller of the gRPC method running on this thread (set by ServerAuth)."""
    return getattr(_current, "caller", DAEMON)


class Refused(Exception):
    """A call refused before it ran: the status and the one-line message to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def _as_caller(handler: Any, caller_of: Callable[[bytes], Caller]) -> Any:
    """`handler` run as the caller `caller_of(request bytes)` names, asked on the serving thread that
    runs the call (never on gRPC's polling thread, which every call shares); Refused is answered as
    its status. The bytes are the request as it came on the wire (a MUNGE credential binds their
    hash). The pool's calls are all unary: any other kind is refused, never run unchecked."""
    if handler is None:
        return None
    if handler.unary_unary is None:
        return refusal(grpc.StatusCode.UNIMPLEMENTED, "rgpu: pool: only unary calls are served")
    inner = handler.unary_unary
    parse = handler.request_deserializer or (lambda raw: raw)

    def keep_raw(raw: bytes) -> tuple[bytes, Any]:
        return raw, parse(raw)

    def call(request: tuple[bytes, Any], context: Any) -> Any:
        raw, parsed = request
        try:
            caller = caller_of(raw)
        except Refused as refused:
            context.abort(refused.code, refused.message)
        _current.caller = caller
        try:
            return inner(parsed, context)
        finally:
            _current.caller = DAEMON

    return grpc.unary_unary_rpc_method_handler(call, request_deserializer=keep_raw,
                                               response_serializer=handler.response_serializer)


MUNGE_FIX = ("users: check that munged runs on this node; daemons and admins: give this host the cluster "
             "secret via secret_file in rgpu.toml or RGPU_SECRET_FILE")
# A credential made for another call, request or pool (munge.payload_mismatch).
MISMATCH_FIX = ("make a new credential for each call, with the same rgpu version as the pool's "
                "(rgpu's client does); the pool's name is what PoolName answers")


class ServerAuth(grpc.ServerInterceptor):
    """Refuses calls without a valid credential, except the standard health service and PoolName."""

    OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.", POOL_NAME_METHOD)

    def __init__(self, secret: bytes, window: float = AUTH_WINDOW_SECONDS, not_before: float | None = None,
                 munge_socket: str | None = None, guards: CallGuards | None = None,
                 munge_gate: MungeGate | None = None, pool_name: str = "",
                 refusals: PacedRefusals | None = None) -> None:
        self._key = derive_key(secret, PURPOSE)
        # Calls refused here are answered off the serving threads, paced (refusals.py).
        self._paced = refusals or PacedRefusals()
        # What users' credentials must name (set once the pool knows its port; see daemon.pool_name).
        self.pool_name = pool_name
        # None: users (MUNGE) are not accepted. Decoded off gRPC's threads, with a deadline (munge_gate.py).
        self._munge: MungeGate | None = munge_gate or (MungeGate(munge_socket) if munge_socket is not None else None)
        self._munge_down: tuple[Unavailable, Any] | None = None
        self._window = window
        # The nonce cache lives in memory, so a restarted pool has forgotten the nonces it saw.
        # Credentials made before this pool started are refused, so none of those can be replayed:
        # a restart cannot reopen the window. (A caller whose clock is behind the pool's is refused
        # for that long after a restart; callers retry.)
        self._not_before = time.time() if not_before is None else not_before
        # Nonces seen within the window: this process's, or those of all processes of one rgpu-poold.
        self._guards: CallGuards = guards or MemoryCallGuards()
        self._refusals = LogLimit()
        # Handlers that run as a daemon, per method: built once, not on every call.
        self._as_daemon: dict[str, Any] = {}

    def check(self, method: str, credential: str | None, now: float | None = None) -> str | None:
        """None when the credential is good, else the reason it is not. Raises GuardError when its
        nonce cannot be recorded (the shared guards are away): the call is then not run."""
        if not credential:
            return "no credential (the caller has no cluster secret configured)"
        parts = credential.split(".", 3)
        if len(parts) != 4:
            return "malformed credential"
        stamp, nonce, given = f"{parts[0]}.{parts[1]}", parts[2], parts[3]
        try:
            when = float(stamp)
        except ValueError:
            return "malformed credential"
        current = time.time() if now is None else now
        if abs(current - when) > self._window:
            return f"credential time is {current - when:+.0f} s off (clocks out of step?)"
        if not hmac.compare_digest(mac(self._key, method, stamp, nonce), given):
            return "wrong cluster secret"
        if when < self._not_before:
            return ("credential made before this pool started (a replay, or this host's clock is "
                    f"{self._not_before - when:.1f} s behind the pool's; retry)")
        return None if self._guards.first_use(nonce, current, self._window) else "replayed credential"

    def check_munge(self, method: str, credential: str, request: bytes) -> tuple[Caller | None, str]:
        """(the user, "") for a good MUNGE credential made for `method` with the serialized `request`
        at this pool, else (None, why). Raises
        Unavailable when munged does not answer in time or the call guards are away (nothing is
        then known about the credential)."""
        if self._munge is None:
            return None, "MUNGE credentials are not accepted here"
        try:
            identity = self._munge.decode(credential)
        except AuthError as exc:
            return None, f"MUNGE credential refused: {exc.why or exc.what}"
        mismatch = munge.payload_mismatch(identity.payload, method, self.pool_name, request)
        if mismatch is not None:
            return None, mismatch
        # munged refuses a replay only to itself: the pool's other processes or daemons (other
        # hosts, other munged) share what was seen in the call guards, for munged's TTL.
        seen = "munge:" + hashlib.sha256(credential.encode()).hexdigest()
        try:
            fresh = self._guards.first_use(seen, time.time(), self._window)
        except GuardError as exc:
            raise Unavailable("pool", "cannot check the call's credential now", str(exc),
                              "nothing was done: retry, and see the pool host's disk or PostgreSQL") from None
        if not fresh:
            return None, "MUNGE credential refused: replayed (used at this pool before)"
        return Caller("user", identity.user, identity.uid), ""

    def _munge_caller(self, method: str, credential: str, request: bytes) -> Caller:
        """The user behind `credential`, or Refused (run on the call's own serving thread)."""
        try:
            caller, reason = self.check_munge(method, credential, request)
        except Unavailable as exc:
            self._log_refusal(method, exc.why or exc.what)
            raise Refused(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
        if caller is None:
            self._log_refusal(method, reason)
            fix = MISMATCH_FIX if reason.startswith("MUNGE credential made for") or "rgpu version" in reason \
                else MUNGE_FIX
            raise Refused(grpc.StatusCode.UNAUTHENTICATED, f"rgpu: pool: call refused ({reason}; {fix})")
        return caller

    def _munge_down_handler(self) -> Any:
        """The handler that answers users while munged is taken as down: one per refusal text."""
        assert self._munge is not None
        down = self._munge.unavailable()
        cached = self._munge_down
        if cached is None or cached[0] is not down:
            cached = self._munge_down = (down, self._refuse(grpc.StatusCode.UNAVAILABLE, str(down)))
        return cached[1]

    @property
    def munge_waiters(self) -> int:
        """How many serving threads users' calls may hold waiting for munged at once."""
        return self._munge.capacity if self._munge is not None else 0

    def close(self) -> None:
        if self._munge is not None:
            self._munge.close()

    def _log_refusal(self, method: str, reason: str) -> None:
        # One line per reason per minute: a misconfigured host retrying must not flood the log.
        held = self._refusals.allow(reason)
        if held is not None:
            log.warning("rgpu-poold: refused %s: %s%s", method, reason, held_note(held))

    def intercept_service(self, continuation: Callable[..., Any], handler_call_details: Any) -> Any:
        method = handler_call_details.method
        if method.startswith(self.OPEN_PREFIXES):
            return continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        credential = metadata.get(AUTH_HEADER)
        munge_credential = metadata.get(MUNGE_HEADER)
        reason: str | None
        if munge_credential and not credential and self._munge is not None:
            # This runs on gRPC's one polling thread: nothing here may wait for munged.
            fault = munge.credential_shape_fault(munge_credential)
            if fault is not None:   # munged would refuse it too: refused without a serving thread or a decoder
                reason = f"MUNGE credential refused: {fault}"
                self._log_refusal(method, reason)
                return self._refuse(grpc.StatusCode.UNAUTHENTICATED, f"rgpu: pool: call refused ({reason}; {MUNGE_FIX})")
            if self._munge.refusing():
                self._log_refusal(method, "munged is not answering")
                return self._munge_down_handler()
            return _as_caller(continuation(handler_call_details),
                              lambda request: self._munge_caller(method, munge_credential, request))
        else:
            try:
                reason = self.check(method, credential)
            except GuardError as exc:   # fail closed, but as a retry: an unrecorded nonce could be replayed
                return self._refuse(grpc.StatusCode.UNAVAILABLE, f"rgpu: pool: cannot check the call's credential now "
                               f"({exc}); nothing was done: retry, and see the pool host's disk or PostgreSQL")
            if reason is None:
                handler = self._as_daemon.get(method)
                if handler is None:
                    handler = _as_caller(continuation(handler_call_details), lambda _request: DAEMON)
                    if handler is not None and len(self._as_daemon) < 256:   # known methods only
                        self._as_daemon[method] = handler
                return handler
        fix = MUNGE_FIX if munge_credential else (
               "give this host the cluster secret via secret_file in rgpu.toml or RGPU_SECRET_FILE")
        self._log_refusal(method, reason)
        return self._refuse(grpc.StatusCode.UNAUTHENTICATED, f"rgpu: pool: call refused ({reason}; {fix})")

    def _refuse(self, code: grpc.StatusCode, message: str) -> Any:
        return refusal(code, message, self._paced)
