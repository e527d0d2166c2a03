"""The cluster secret: loading it safely and deriving purpose-bound keys from it.

One secret file (readable only by its owner) authenticates daemons and admin calls and signs
lease tokens. Each use gets its own derived key, so a value computed for one purpose (a request
signature) can never be replayed as another (a lease token).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

from rgpu.errors import ConfigError

MIN_SECRET_BYTES = 16


def load_secret(path: str | os.PathLike[str]) -> bytes:
    """Read the secret, refusing files that others could read."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise ConfigError(
            "secret", f"secret file {p} does not exist",
            "every rgpu daemon and admin call needs the cluster secret",
            f"create it with `rgpu-admin secret create {p}` and copy it to every rgpu host",
        ) from None
    except PermissionError:
        raise ConfigError("secret", f"cannot read secret file {p}", "permission denied",
                          "run as the secret's owner or root") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError("secret", f"secret file {p} is not a regular file", "",
                          "point secret_file / RGPU_SECRET_FILE at the secret itself")
    if st.st_mode & 0o077:
        raise ConfigError(
            "secret", f"secret file {p} is readable by others (mode {stat.S_IMODE(st.st_mode):04o})",
            "anyone who can read it can sign leases", f"run `chmod 600 {p}`",
        )
    try:
        value = p.read_bytes().strip()
    except PermissionError:
        raise ConfigError("secret", f"cannot read secret file {p}", "permission denied",
                          "run as the secret's owner or root") from None
    if len(value) < MIN_SECRET_BYTES:
        raise ConfigError("secret", f"secret file {p} holds {len(value)} bytes",
                          f"at least {MIN_SECRET_BYTES} are needed",
                          f"recreate it with `rgpu-admin secret create --force {p}`")
    return value


def create_secret(path: str | os.PathLike[str], force: bool = False) -> Path:
    """Write a new random secret with mode 0600, atomically; never silently overwrite."""
    p = Path(path)
    if p.exists() and not force:
        raise ConfigError("secret", f"{p} already exists", "replacing it invalidates every lease token",
                          "pass --force to replace it")
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, (secrets.token_hex(32) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, p)
    return p


@functools.lru_cache(maxsize=64)
def derive_key(secret: bytes, purpose: str) -> bytes:
    # Cached: it is called for every request credential and every token signature.
    return hmac.new(secret, b"rgpu-v1:" + purpose.encode(), hashlib.sha256).digest()
