"""The exception tree. Messages follow `rgpu: <component>: <what> (<why>; <how to fix>)`.

Only entry points (CLIs, daemons, prologs) turn these into one-line messages and exit codes.
"""

from __future__ import annotations


class RgpuError(Exception):
    """A failure a user or admin can act on."""

    exit_code = 1

    def __init__(self, component: str, what: str, why: str = "", fix: str = "") -> None:
        self.component = component
        self.what = what
        self.why = why
        self.fix = fix
        super().__init__(self.format())

    @classmethod
    def from_message(cls, message: str) -> "RgpuError":
        """An error whose message was already formatted elsewhere (e.g. by the pool daemon)."""
        err = cls.__new__(cls)
        err.component, err.what, err.why, err.fix = "", message, "", ""
        Exception.__init__(err, message)
        return err

    def format(self) -> str:
        detail = "; ".join(part for part in (self.why, self.fix) if part)
        tail = f" ({detail})" if detail else ""
        return f"rgpu: {self.component}: {self.what}{tail}"


class ConfigError(RgpuError):
    """Bad configuration: a file, an environment variable or a flag."""

    exit_code = 2


class InvalidRequest(RgpuError):
    """A request that can never succeed as written (bad fraction, count, ...)."""

    exit_code = 2


class CapacityError(RgpuError):
    """Not enough free GPU capacity (or quota) for a request right now."""

    exit_code = 3


class QuotaExceeded(CapacityError):
    """A request over its user's or account's quota (the pool may have room)."""


class AuthError(RgpuError):
    """Missing, wrong or expired credentials."""

    exit_code = 4


class PermissionDenied(RgpuError):
    """Authenticated, but not allowed (e.g. a quota of zero)."""

    exit_code = 4


class NotFound(RgpuError):
    exit_code = 5


class Unavailable(RgpuError):
    """A daemon that should answer does not."""

    exit_code = 6


class DispatcherUnavailable(Unavailable):
    """A GPU server (rgpu-dispatcher) does not answer: its own exit status (7), so a script tells
    it from a pool that does not answer (6). Caught as Unavailable where the difference does not matter."""

    exit_code = 7


class Unhealthy(RgpuError):
    """The pool answers, but something it serves with is not well: a dispatcher down, none
    registered, or a `health --deep` check failed (exit 6 is kept for a pool that does not answer)."""

    exit_code = 7
