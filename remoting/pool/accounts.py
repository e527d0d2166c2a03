"""Which account a user's lease is charged: the user may only charge accounts they belong to.

Applies to users (MUNGE); daemons and admins (the cluster secret: Slurm's prologs) charge the
account Slurm gave the job. `account_check` in rgpu.toml picks where membership comes from:
- "slurm" (default): Slurm's associations, through the `rgpu.account_sources` entry point
  `slurm` (sacctmgr), kept `account_cache_seconds` per user. When sacctmgr cannot answer, the
  lease is refused (fail closed), and the failure is kept a few seconds so a flood of requests
  does not start a flood of sacctmgr. One sacctmgr runs at a time: a second user's request that
  needs one waits at most LOOKUP_WAIT_SECONDS and is then refused as unavailable, so a hung
  slurmdbd can hold at most one of the pool's few request threads (prologs and dispatchers keep
  the others).
- "map": `user_accounts` in rgpu.toml, for sites without slurmdbd.
- "off": any account, as the request names it.
A user who names no account is charged their default one (Slurm's DefaultAccount, or the first
in the map); a user who belongs to no account may not lease.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

from rgpu import plugins, validate
from rgpu.config import Settings
from rgpu.errors import PermissionDenied, RgpuError, Unavailable

Lookup = Callable[[str], Sequence[str]]
FAILURE_KEPT_SECONDS = 5.0    # a failed lookup answers for this long without running sacctmgr again
CACHED_USERS = 4096
LOOKUP_WAIT_SECONDS = 1.0     # how long a request waits for another user's sacctmgr to finish


class AccountPolicy:
    """`account_for(user, asked)`: the account to charge, or an error naming why not."""

    def __init__(self, mode: str, user_map: Mapping[str, Sequence[str]] | None = None,
                 lookup: Lookup | None = None, cache_seconds: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, lookup_wait_seconds: float = LOOKUP_WAIT_SECONDS) -> None:
        self.mode = mode
        self._map = {user: tuple(accounts) for user, accounts in (user_map or {}).items()}
        self._lookup = lookup
        self._cache_seconds = cache_seconds
        self._clock = clock
        self._cache: OrderedDict[str, tuple[float, tuple[str, ...]]] = OrderedDict()
        self._failure: tuple[float, RgpuError] | None = None
        self._lock = threading.Lock()
        self._lookup_gate = threading.Lock()   # one sacctmgr at a time
        self._lookup_wait = lookup_wait_seconds

    def accounts_of(self, user: str) -> tuple[str, ...]:
        """The accounts `user` may charge, default first."""
        if self.mode == "map":
            return self._map.get(user, ())
        now = self._clock()
        with self._lock:
            cached = self._cache.get(user)
            if cached is not None and cached[0] > now:
                return cached[1]
            if self._failure is not None and self._failure[0] > now:
                raise self._failure[1]
        if self._lookup is None:
            raise RgpuError("pool", "cannot check the accounts of users against Slurm",
                            "the Slurm account source (rgpu.account_sources entry point) is not installed",
                            "reinstall rgpu, or set account_check = \"map\" or \"off\" in rgpu.toml")
        if not self._lookup_gate.acquire(timeout=self._lookup_wait):
            raise Unavailable("pool", f"cannot check which accounts {user[:64]} may charge now",
                              "another user's account lookup (sacctmgr) is still running",
                              "retry in a few seconds; if it persists, check that slurmdbd answers")
        try:
            with self._lock:   # answered (or failed) while this request waited for the gate?
                cached = self._cache.get(user)
                if cached is not None and cached[0] > self._clock():
                    return cached[1]
                if self._failure is not None and self._failure[0] > self._clock():
                    raise self._failure[1]
            accounts = tuple(self._lookup(user))
        except RgpuError as exc:
            error = RgpuError("pool", f"cannot check which accounts {user[:64]} may charge",
                              f"{exc.what}: {exc.why}"[:400], exc.fix)
            with self._lock:
                self._failure = (self._clock() + min(FAILURE_KEPT_SECONDS, self._cache_seconds), error)
            raise error from None
        finally:
            self._lookup_gate.release()
        with self._lock:
            self._failure = None
            self._cache[user] = (self._clock() + self._cache_seconds, accounts)
            self._cache.move_to_end(user)
            while len(self._cache) > CACHED_USERS:
                self._cache.popitem(last=False)
        return accounts

    def account_for(self, user: str, asked: str) -> str:
        """The account a lease of `user` that asked for `asked` ("" : none named) is charged."""
        if asked:
            validate.name("account", asked)
        if self.mode == "off":
            return asked
        accounts = self.accounts_of(user)
        source = "Slurm's associations (sacctmgr)" if self.mode == "slurm" else "user_accounts in rgpu.toml"
        if not accounts:
            raise PermissionDenied("pool", f"{user[:64]} may not charge any account",
                                   f"{source} list none for {user[:64]}",
                                   "ask an admin to add you to an account"
                                   + (" (sacctmgr add user)" if self.mode == "slurm" else ""))
        if not asked:
            return accounts[0]
        if asked not in accounts:
            shown = ", ".join(accounts[:8]) + (", ..." if len(accounts) > 8 else "")
            raise PermissionDenied("pool", f"{user[:64]} may not charge account {asked}",
                                   f"{source} give {user[:64]} only: {shown}",
                                   "name one of those with --account, or leave it out for your default")
        return asked


def account_policy(settings: Settings) -> AccountPolicy:
    """The policy `settings` ask for; with "slurm", sacctmgr through the installed account source."""
    lookup: Lookup | None = None
    if settings.account_check == "slurm":
        sources = dict(plugins.load(plugins.ACCOUNT_SOURCES))
        if "slurm" in sources:
            lookup = sources["slurm"](settings)
    return AccountPolicy(settings.account_check, settings.user_accounts, lookup, settings.account_cache_seconds)
