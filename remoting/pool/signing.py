"""The client's half of the control plane's request authentication: what a pool client puts on
each call. The pool's checks of it are in auth.py (server side only: a pool client loads neither it
nor the call guards behind it).

Every call carries `x-rgpu-auth: <unix time>.<nonce>.<hex HMAC>` computed with a key derived from
the cluster secret over the method name, time and nonce; the secret itself never crosses the wire.
Users' calls carry a MUNGE credential under `x-rgpu-munge` instead.
"""

from __future__ import annotations

import hmac
import secrets
import time

from rgpu.secret import derive_key

AUTH_HEADER = "x-rgpu-auth"
MUNGE_HEADER = "x-rgpu-munge"   # users: a MUNGE credential for one call (method, pool, request hash)
PURPOSE = "grpc-request"        # the key derived from the cluster secret for these credentials


def mac(key: bytes, method: str, stamp: str, nonce: str) -> str:
    return hmac.digest(key, f"{method}\n{stamp}\n{nonce}".encode(), "sha256").hex()   # one-shot: the fast C path


def request_credential(secret: bytes, method: str, now: float | None = None) -> str:
    stamp = f"{time.time() if now is None else now:.3f}"
    nonce = secrets.token_hex(12)
    return f"{stamp}.{nonce}.{mac(derive_key(secret, PURPOSE), method, stamp, nonce)}"
