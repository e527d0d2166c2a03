"""Browser credentials for the pool's web dashboard, made with keys derived from the cluster secret.

Whoever holds the secret (an admin, `rgpu-admin dashboard-url`) signs a short-lived login link;
the pool exchanges it, once, for a session cookie it signs with another derived key. The secret
never reaches the browser, and a leaked link is useless after its first use or its expiry.

Format of both: ``<kind>.<expiry unix>.<nonce>.<hex HMAC-SHA256>``. Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from rgpu.config import Settings, pool_addresses
from rgpu.errors import AuthError, ConfigError
from rgpu.netaddr import join_host_port, split_host_port
from rgpu.secret import derive_key

LINK = "link1"
SESSION = "sess1"
LINK_TTL_SECONDS = 300.0
SESSION_TTL_SECONDS = 12 * 3600.0
_PURPOSES = {LINK: "dashboard-login-link", SESSION: "dashboard-session"}


@dataclass(frozen=True)
class Credential:
    kind: str
    expires_unix: float
    nonce: str


def _mac(secret: bytes, kind: str, expires: str, nonce: str) -> str:
    return hmac.new(derive_key(secret, _PURPOSES[kind]), f"{kind}.{expires}.{nonce}".encode(),
                    hashlib.sha256).hexdigest()


def sign(secret: bytes, kind: str, now: float, ttl_seconds: float) -> str:
    expires = f"{int(now + ttl_seconds)}"
    nonce = secrets.token_hex(16)
    return f"{kind}.{expires}.{nonce}.{_mac(secret, kind, expires, nonce)}"


def login_link_token(secret: bytes, now: float, ttl_seconds: float = LINK_TTL_SECONDS) -> str:
    return sign(secret, LINK, now, ttl_seconds)


def session_token(secret: bytes, now: float, ttl_seconds: float = SESSION_TTL_SECONDS) -> str:
    return sign(secret, SESSION, now, ttl_seconds)


def verify(secret: bytes, kind: str, token: str, now: float) -> Credential:
    """The credential, or AuthError saying why it is refused."""
    parts = token.split(".") if isinstance(token, str) and len(token) < 256 else []
    if len(parts) != 4 or parts[0] != kind or not parts[1].isdigit():
        raise AuthError("dashboard", "malformed credential", "", "get a new link with `rgpu-admin dashboard-url`")
    _, expires, nonce, mac = parts
    if not hmac.compare_digest(_mac(secret, kind, expires, nonce), mac):
        raise AuthError("dashboard", "credential not signed with this pool's cluster secret", "",
                        "get a new link with `rgpu-admin dashboard-url` on a host with the pool's secret")
    if now >= int(expires):
        raise AuthError("dashboard", "credential expired", "", "get a new link with `rgpu-admin dashboard-url`")
    return Credential(kind, float(expires), nonce)


def dashboard_base_url(settings: Settings, port: int | None = None) -> str:
    """Where browsers reach the dashboard: dashboard_url, else the pool's host and the dashboard's port."""
    if settings.dashboard_url:
        return settings.dashboard_url.rstrip("/")
    scheme = "https" if settings.tls_cert_file or settings.tls_ca_file else "http"
    pool_host = split_host_port((pool_addresses(settings.pool) or [""])[0], what="pool")[0]
    listen_host, listen_port = split_host_port(settings.dashboard_listen, what="dashboard_listen",
                                               allow_empty_host=True, allow_port_zero=True)
    host = listen_host if listen_host not in ("", "0.0.0.0", "::") else pool_host
    if not port and not listen_port:
        # Port 0: rgpu-poold picked a free port when it started, and only it knows which.
        raise ConfigError("dashboard", "the dashboard's port is unknown here",
                          f"dashboard_listen = {settings.dashboard_listen!r} lets rgpu-poold pick one when it starts",
                          "set dashboard_url to the address rgpu-poold's log names (\"dashboard on http://HOST:PORT\"), "
                          "or give dashboard_listen a fixed port")
    return f"{scheme}://{join_host_port(host, port or listen_port)}"


def login_url(settings: Settings, secret: bytes, now: float) -> str:
    """A one-time login link to the dashboard (valid LINK_TTL_SECONDS)."""
    return f"{dashboard_base_url(settings)}/login?t={login_link_token(secret, now)}"
