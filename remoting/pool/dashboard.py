"""The pool's web dashboard: a read-only page (site/, package rgpu.site) and the JSON it polls.

No anonymous access: every path but /login needs a session cookie signed with a key derived from
the cluster secret. An admin gets one through a one-time link from `rgpu-admin dashboard-url`
(rgpu/weblogin.py); /login exchanges it for the cookie (HttpOnly, SameSite=Strict, Secure over
TLS) and redirects, so the link leaves the address bar. HTTPS when tls_cert_file and
tls_key_file are set, with the gRPC server's certificate.

    GET /login?t=LINK   exchange a login link for a session   GET /api/state  the pool, as JSON
    GET /               the page                              GET /static/F   its files
    GET /logout         end the session (its cookie is refused from then on, restarts included)
"""

from __future__ import annotations

import errno
import json
import logging
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler
from importlib import resources
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from rgpu import weblogin
from rgpu.config import Settings
from rgpu.errors import AuthError, ConfigError, InvalidRequest, RgpuError
from rgpu.netaddr import split_host_port
from rgpu.remoting.metrics.front import HttpFront
from rgpu.remoting.pool.dashboard_data import dashboard_state
from rgpu.remoting.pool.events import EventLog
from rgpu.remoting.pool.views import PoolView

log = logging.getLogger("rgpu-poold")


class WebNonces(Protocol):
    """What the dashboard needs of the pool's store (store.py, store_pg.py)."""

    def spend_web_nonce(self, nonce: str, expires: float, now: float) -> bool: ...
    def web_nonce_spent(self, nonce: str) -> bool: ...

COOKIE = "rgpu_session"
STATIC_TYPES = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8",
                ".js": "text/javascript; charset=utf-8", ".png": "image/png", ".svg": "image/svg+xml",
                ".json": "application/json"}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer",
}


def _static_files() -> dict[str, tuple[bytes, str]]:
    """site/static/*, read once: the page is a handful of small files."""
    folder = resources.files("rgpu.site").joinpath("static")
    files = {}
    for entry in folder.iterdir():
        suffix = "." + entry.name.rsplit(".", 1)[-1]
        if entry.is_file() and suffix in STATIC_TYPES:
            files[entry.name] = (entry.read_bytes(), STATIC_TYPES[suffix])
    if "index.html" not in files:
        raise ConfigError("poold", "the dashboard's files are missing (rgpu.site/static/index.html)", "",
                          "reinstall rgpu")
    return files


class CredentialLedger:
    """Login links already exchanged and sessions logged out, until they expire, kept in the pool's
    state store: each link works once, a logged-out cookie is refused, a pool restart changes
    neither, and daemons on one PostgreSQL share them. A store that cannot answer refuses."""

    def __init__(self, store: WebNonces) -> None:
        self._store = store

    @staticmethod
    def _key(credential: weblogin.Credential) -> str:
        return f"{credential.kind}:{credential.nonce}"

    def spend(self, credential: weblogin.Credential, now: float) -> bool:
        """True the first time `credential` is used up (a link exchanged, a session logged out)."""
        try:
            return self._store.spend_web_nonce(self._key(credential), credential.expires_unix, now)
        except RgpuError as exc:
            log.warning("rgpu-poold: dashboard: %s", exc)
            return False

    def spent(self, credential: weblogin.Credential) -> bool:
        try:
            return self._store.web_nonce_spent(self._key(credential))
        except RgpuError as exc:
            log.warning("rgpu-poold: dashboard: %s", exc)
            return True


class RefusalLog:
    """Refused logins, logged at most once a minute (anyone who can reach the port can try)."""

    def __init__(self) -> None:
        self._last = -1e9
        self._since = 0
        self._lock = threading.Lock()

    def note(self, peer: str, reason: str) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last < 60:
                self._since += 1
                return
            self._last, more, self._since = now, self._since, 0
        tail = f" ({more} more refused in the last minute)" if more else ""
        log.warning("rgpu-poold: dashboard login from %s refused: %s%s", peer, reason, tail)


@dataclass
class DashboardServer:
    port: int
    url: str
    _front: HttpFront

    def stop(self) -> None:
        self._front.stop()


class _Handler(BaseHTTPRequestHandler):
    server_version = "rgpu-dashboard"
    # Set per server by serve_dashboard (a subclass each).
    secret: bytes
    tls: bool
    files: dict[str, tuple[bytes, str]]
    read_state: Callable[[], dict[str, Any]]
    links: CredentialLedger
    refusals: "RefusalLog"
    clock: Callable[[], float] = time.time

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("rgpu-poold: dashboard: %s %s", self.address_string(), format % args)

    def _send(self, status: HTTPStatus, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for name, value in {**SECURITY_HEADERS, **(headers or {})}.items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _page(self, status: HTTPStatus, title: str, text: str, headers: dict[str, str] | None = None) -> None:
        body = (f"<!doctype html><meta charset=utf-8><title>rgpu: {title}</title>"
                f"<link rel=stylesheet href=/static/style.css><main class=message><h1>{title}</h1>"
                f"<p>{text}</p></main>").encode()
        self._send(status, body, STATIC_TYPES[".html"], headers)

    def _session_credential(self) -> weblogin.Credential | None:
        """The request's session, when its cookie is signed, unexpired (not yet checked against
        logouts)."""
        try:
            cookie = SimpleCookie(self.headers.get("Cookie", ""))
        except CookieError:
            return None
        morsel = cookie.get(COOKIE)
        if morsel is None:
            return None
        try:
            return weblogin.verify(self.secret, weblogin.SESSION, morsel.value, self.clock())
        except AuthError:
            return None

    def _session(self) -> bool:
        credential = self._session_credential()
        return credential is not None and not self.links.spent(credential)

    def _cookie(self, value: str, max_age: int) -> str:
        secure = "; Secure" if self.tls else ""
        return f"{COOKIE}={value}; Max-Age={max_age}; Path=/; HttpOnly; SameSite=Strict{secure}"

    def do_HEAD(self) -> None:
        if urlsplit(self.path).path == "/login":   # a link checker's HEAD must not spend the one-time link
            return self._send(HTTPStatus.OK, b"", STATIC_TYPES[".html"])
        self.do_GET()

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if url.path == "/login":
            return self._login(parse_qs(url.query).get("t", [""])[0])
        if url.path == "/logout":
            session = self._session_credential()
            if session is not None:   # revoked where the pool keeps its state, not only in this browser
                self.links.spend(session, self.clock())
            return self._page(HTTPStatus.OK, "Logged out", "Run <code>rgpu-admin dashboard-url</code> for a new link.",
                              {"Set-Cookie": self._cookie("", 0)})
        if not self._session():
            return self._page(HTTPStatus.UNAUTHORIZED, "Login needed",
                              "The rgpu dashboard needs a login link: run <code>rgpu-admin dashboard-url</code> "
                              "on a host with the cluster secret and open the link it prints.")
        if url.path in ("/", "/index.html"):
            body, kind = self.files["index.html"]
            return self._send(HTTPStatus.OK, body, kind)
        if url.path == "/api/state":
            body = json.dumps(self.read_state(), separators=(",", ":")).encode()
            return self._send(HTTPStatus.OK, body, "application/json")
        name = url.path.removeprefix("/static/")
        if url.path.startswith("/static/") and name in self.files:
            body, kind = self.files[name]
            return self._send(HTTPStatus.OK, body, kind)
        return self._page(HTTPStatus.NOT_FOUND, "Not found", "No such page.")

    def _login(self, token: str) -> None:
        now = self.clock()
        try:
            credential = weblogin.verify(self.secret, weblogin.LINK, token, now)
        except AuthError as exc:
            self.refusals.note(self.client_address[0], exc.what)
            return self._page(HTTPStatus.FORBIDDEN, "Login refused", f"{exc.what}: run "
                              "<code>rgpu-admin dashboard-url</code> for a new link.")
        if not self.links.spend(credential, now):
            self.refusals.note(self.client_address[0], "link used before")
            return self._page(HTTPStatus.FORBIDDEN, "Login refused", "This link was used already (each works once): "
                              "run <code>rgpu-admin dashboard-url</code> for a new link.")
        log.info("rgpu-poold: dashboard login from %s", self.client_address[0])
        session = weblogin.session_token(self.secret, now)
        self.send_response(HTTPStatus.SEE_OTHER)
        self.send_header("Location", "/")
        self.send_header("Set-Cookie", self._cookie(session, int(weblogin.SESSION_TTL_SECONDS)))
        self.send_header("Content-Length", "0")
        for name, value in SECURITY_HEADERS.items():
            self.send_header(name, value)
        self.end_headers()

    def do_POST(self) -> None:
        self._page(HTTPStatus.METHOD_NOT_ALLOWED, "Read-only", "The dashboard changes nothing; use rgpu-admin.")

    do_PUT = do_DELETE = do_PATCH = do_POST


def serve_dashboard(settings: Settings, secret: bytes, read_view: Callable[[], PoolView],
                    events: EventLog, store: WebNonces) -> DashboardServer:
    try:
        host, port = split_host_port(settings.dashboard_listen, what="dashboard_listen", allow_empty_host=True,
                                     allow_port_zero=True)
    except InvalidRequest as exc:
        raise ConfigError("poold", f"dashboard_listen {settings.dashboard_listen!r} is not HOST:PORT", exc.why,
                          "set dashboard_listen to e.g. 0.0.0.0:50080, or empty to turn the dashboard off") from None
    handler = type("DashboardHandler", (_Handler,), {
        "secret": secret, "tls": bool(settings.tls_cert_file), "files": _static_files(), "links": CredentialLedger(store),
        "refusals": RefusalLog(),
        "read_state": staticmethod(lambda: dashboard_state(read_view(), events.recent())),
    })
    context = None
    if settings.tls_cert_file:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError("poold", "cannot load tls_cert_file/tls_key_file for the dashboard", str(exc),
                              "fix the files, or unset dashboard_listen") from None
    try:
        # Timeouts, a worker pool and a cap on connections (front.py); the TLS handshake happens
        # in the front's loop, within the request's deadline.
        front = HttpFront(host or "0.0.0.0", port, handler, name="dashboard", ssl_context=context)
    except OSError as exc:
        why = "the port is in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
        raise ConfigError("poold", f"cannot serve the dashboard on {settings.dashboard_listen}", why,
                          "pick another dashboard_listen (or empty to turn it off), or stop the process on that port") from None
    return DashboardServer(port=front.port, url=weblogin.dashboard_base_url(settings, front.port), _front=front)
