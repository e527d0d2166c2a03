"""Lease tokens: a pool-signed statement that one slice of one GPU belongs to one job.

A dispatcher verifies a token offline with the cluster secret: no call to the pool. The token
binds job key, slice number, dispatcher address, GPU UUID and index, the slice's limits and an
expiry, so a token for one GPU, dispatcher or job is useless for another.

Format: ``rgpu1.<base64url(JSON claims)>.<base64url(HMAC-SHA256)>`` (no padding).
"""

from __future__ import annotations

import base64
import hmac
import json
import time
from dataclasses import dataclass

from rgpu.errors import AuthError, InvalidRequest
from rgpu.secret import derive_key
from rgpu.slice_size import SliceLimits

TOKEN_PREFIX = "rgpu1"
_PURPOSE = "lease-token"


@dataclass(frozen=True)
class SliceClaims:
    job_key: str
    slice_number: int
    server: str            # dispatcher "host:port"
    gpu_uuid: str
    gpu_index: int
    memory_limit_bytes: int
    compute_percent: int
    expires_unix: float    # 0: valid until the lease is released
    issued_unix: float


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


# json.dumps with these options builds an encoder per call; one made once writes the same bytes.
_CLAIMS_JSON = json.JSONEncoder(separators=(",", ":"), sort_keys=True)


def sign(secret: bytes, claims: SliceClaims) -> str:
    body = _b64(_CLAIMS_JSON.encode(vars(claims)).encode())
    mac = hmac.digest(derive_key(secret, _PURPOSE), f"{TOKEN_PREFIX}.{body}".encode(), "sha256")
    return f"{TOKEN_PREFIX}.{body}.{_b64(mac)}"


def unverified_claims(token: str) -> SliceClaims | None:
    """What a token says, its signature unchecked; None for text that is not a token this rgpu reads.
    For a holder without the cluster secret (flexrun) to compare with what it was told; it grants
    nothing: only a dispatcher's verify() does."""
    parts = token.split(".") if isinstance(token, str) else []
    if len(parts) != 3 or parts[0] != TOKEN_PREFIX:
        return None
    try:
        return SliceClaims(**json.loads(_unb64(parts[1])))
    except (ValueError, TypeError):
        return None


def verify(
    secret: bytes,
    token: str,
    *,
    server: str | None = None,
    gpu_uuids: set[str] | None = None,
    now: float | None = None,
) -> SliceClaims:
    """Check signature, expiry and binding; return the claims or raise AuthError."""

    def refuse(why: str, fix: str = "request a new lease (sbatch again, or rgpu-admin request-gpus)") -> AuthError:
        return AuthError("token", "lease token refused", why, fix)

    parts = token.split(".") if isinstance(token, str) else []
    if len(parts) != 3 or parts[0] != TOKEN_PREFIX:
        raise refuse("malformed token")
    body, mac_text = parts[1], parts[2]
    expected = hmac.digest(derive_key(secret, _PURPOSE), f"{TOKEN_PREFIX}.{body}".encode(), "sha256")
    try:
        given = _unb64(mac_text)
    except ValueError:
        raise refuse("malformed signature") from None
    if not hmac.compare_digest(expected, given):
        raise refuse("bad signature", "the token was altered or signed with another cluster secret")
    try:
        claims = SliceClaims(**json.loads(_unb64(body)))
    except (ValueError, TypeError):
        raise refuse("malformed claims") from None
    try:
        SliceLimits(claims.memory_limit_bytes, claims.compute_percent, component="token")
    except InvalidRequest as exc:
        raise refuse(f"malformed claims: {exc.what}, which must be {exc.why}") from None
    current = time.time() if now is None else now
    if claims.expires_unix and current > claims.expires_unix:
        raise refuse(f"expired {current - claims.expires_unix:.0f} s ago")
    if server is not None and claims.server != server:
        raise refuse(f"issued for dispatcher {claims.server}, not {server}",
                     "use the adaptor.conf written for this job")
    if gpu_uuids is not None and claims.gpu_uuid not in gpu_uuids:
        raise refuse(f"issued for GPU {claims.gpu_uuid}, which this dispatcher does not serve",
                     "use the adaptor.conf written for this job")
    return claims
