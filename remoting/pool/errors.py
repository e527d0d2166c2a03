"""The one table between rgpu errors and gRPC status codes, used by the pool daemon (error to
status) and the pool client (status back to error), so the two cannot drift apart."""

from __future__ import annotations

import grpc

from rgpu.errors import (AuthError, CapacityError, InvalidRequest, NotFound, PermissionDenied, RgpuError,
                         Unavailable)

# Most specific first: the daemon takes the first entry the error is an instance of.
ERROR_STATUS: tuple[tuple[type[RgpuError], grpc.StatusCode], ...] = (
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (AuthError, grpc.StatusCode.UNAUTHENTICATED),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    # The pool's own store is unreachable (PostgreSQL down or failing over): another pool daemon
    # may still answer, so clients go to the next address as for a pool that is down.
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
)
# Any other rgpu error: the request cannot be served in the pool's present state.
OTHER_ERROR_STATUS = grpc.StatusCode.FAILED_PRECONDITION
# Statuses that mean the pool did not answer at all.
UNAVAILABLE_STATUSES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

_STATUS_ERROR: dict[grpc.StatusCode, type[RgpuError]] = {code: err for err, code in ERROR_STATUS}
_STATUS_ERROR[OTHER_ERROR_STATUS] = InvalidRequest


def status_for(exc: RgpuError) -> grpc.StatusCode:
    """The status the pool daemon answers `exc` with."""
    return next((code for err_type, code in ERROR_STATUS if isinstance(exc, err_type)), OTHER_ERROR_STATUS)


def error_from_status(code: grpc.StatusCode, detail: str, address: str) -> RgpuError:
    """The rgpu error a client raises for a failed call to the pool at `address`."""
    if code in UNAVAILABLE_STATUSES and detail.startswith("rgpu:"):
        return Unavailable.from_message(detail)   # the pool answered: its store is unreachable
    if code in UNAVAILABLE_STATUSES:
        return Unavailable("pool", f"pool daemon at {address} did not answer",
                           f"{code.name.lower()}: is rgpu-poold running and reachable?",
                           "check that rgpu-poold runs on that host (its log) and the --pool / RGPU_POOL address")
    err_type = _STATUS_ERROR.get(code, RgpuError)
    # The pool's messages are already in `rgpu: pool: what (why; fix)` form: keep them whole.
    return err_type.from_message(detail if detail.startswith("rgpu:") else f"rgpu: pool: {detail} ({code.name})")
