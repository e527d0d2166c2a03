"""MUNGE credentials through libmunge (ctypes): who a user is, without a secret on their disk.

Users (flexrun -n, rgpu-admin request-gpus/release-gpus/leases/list-gpus) authenticate to the pool
with a MUNGE credential, the one Slurm sites already run: munged on every node shares a key, a
credential names the uid and gid of the process that made it, and munged decodes each credential
once only (its own replay cache) within its TTL (300 s by default). The payload binds the
credential to one call: the gRPC method, the pool's name (which the pool answers to PoolName, asked
without a credential) and the SHA-256 of the serialized request, so a credential seen on the wire
can be neither sent with another request nor to another pool. Daemons and admins use the cluster
secret instead (rgpu.secret).

Debian packages: munge (munged) and libmunge2 (libmunge.so.2).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import hmac
import pwd
import re
from dataclasses import dataclass

from rgpu.errors import AuthError, ConfigError, Unavailable

MUNGE_OPT_SOCKET = 8
EMUNGE_SOCKET = 6
EMUNGE_TIMEOUT = 7
EMUNGE_CRED_REPLAYED = 17
# Where libmunge looks when no socket is configured (Debian's munged default).
DEFAULT_SOCKET = "/run/munge/munge.socket.2"
PAYLOAD_PREFIX = "rgpu-grpc-2:"   # changed with what the payload binds: an older rgpu's credentials are refused

_lib: ctypes.CDLL | None = None


def call_payload(method: str, pool: str, request: bytes) -> str:
    """The payload of a credential for one call: `method` with the serialized `request`, at `pool`."""
    return f"{PAYLOAD_PREFIX}{method}\n{pool}\n{hashlib.sha256(request).hexdigest()}"


# What munged makes: "MUNGE:", base64 (its own, standard alphabet, no line breaks), ":".
_CREDENTIAL_SHAPE = re.compile(r"MUNGE:[A-Za-z0-9+/]+=*:")
MAX_CREDENTIAL = 8192   # bytes handed to munged at most


def credential_shape_fault(credential: str) -> str | None:
    """None when `credential` looks like one munged made (worth asking munged about), else why not."""
    if len(credential) > MAX_CREDENTIAL:
        return f"over {MAX_CREDENTIAL} characters"
    if _CREDENTIAL_SHAPE.fullmatch(credential) is None:
        return "not a MUNGE credential (MUNGE:<base64>:)"
    return None


def payload_mismatch(payload: str, method: str, pool: str, request: bytes) -> str | None:
    """None when `payload` was made for this call at this pool, else what does not match."""
    parts = payload.split("\n")
    if len(parts) != 3 or not parts[0].startswith(PAYLOAD_PREFIX):
        return "MUNGE credential is not in this rgpu's format (the client runs another rgpu version)"
    made_method, made_pool, made_hash = parts[0][len(PAYLOAD_PREFIX):], parts[1], parts[2]
    if made_method != method:
        return "MUNGE credential made for another call"
    if made_pool != pool:
        return f"MUNGE credential made for another pool (this is {pool!r})"   # nothing the caller chose: log lines stay few
    if not hmac.compare_digest(made_hash, hashlib.sha256(request).hexdigest()):
        return "MUNGE credential made for another request (the request was changed after it was signed)"
    return None


def _libmunge() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        name = ctypes.util.find_library("munge") or "libmunge.so.2"
        try:
            lib = ctypes.CDLL(name)
        except OSError as exc:
            raise ConfigError("munge", "cannot load libmunge", str(exc),
                              "install MUNGE (Debian: munge and libmunge2), or use the cluster secret") from None
        lib.munge_ctx_create.restype = ctypes.c_void_p
        lib.munge_ctx_destroy.argtypes = [ctypes.c_void_p]
        lib.munge_ctx_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p]
        lib.munge_encode.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        lib.munge_decode.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                     ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_uint32),
                                     ctypes.POINTER(ctypes.c_uint32)]
        lib.munge_strerror.restype = ctypes.c_char_p
        lib.munge_strerror.argtypes = [ctypes.c_int]
        _lib = lib
    return _lib


def _ctx(lib: ctypes.CDLL, socket_path: str) -> int:
    ctx = lib.munge_ctx_create()
    if not ctx:
        raise ConfigError("munge", "cannot create a MUNGE context", "out of memory", "")
    if socket_path:
        lib.munge_ctx_set(ctx, MUNGE_OPT_SOCKET, socket_path.encode())
    return ctx


def encode(payload: str, socket_path: str = "") -> str:
    """A credential for the calling process's uid carrying `payload`."""
    lib = _libmunge()
    ctx = _ctx(lib, socket_path)
    cred = ctypes.c_char_p()
    data = payload.encode()
    try:
        err = lib.munge_encode(ctypes.byref(cred), ctx, data, len(data))
        if err:
            raise AuthError("munge", "cannot get a MUNGE credential", lib.munge_strerror(err).decode(errors="replace"),
                            "check that munged runs on this node (and munge_socket in rgpu.toml)")
        return cred.value.decode() if cred.value else ""
    finally:
        lib.munge_ctx_destroy(ctx)


class MungedUnreachable(Unavailable):
    """munged did not answer (not running, or its socket gone): the credential was not judged."""


@dataclass(frozen=True)
class Identity:
    uid: int
    gid: int
    user: str
    payload: str


def decode(credential: str, socket_path: str = "") -> Identity:
    """Who made `credential` (munged checks it, its TTL and that it is used once). Raises AuthError,
    or MungedUnreachable when munged did not answer (libmunge retries for about 2 s first)."""
    lib = _libmunge()
    ctx = _ctx(lib, socket_path)
    buf = ctypes.c_void_p()
    length = ctypes.c_int()
    uid, gid = ctypes.c_uint32(), ctypes.c_uint32()
    try:
        err = lib.munge_decode(credential.encode()[:MAX_CREDENTIAL], ctx, ctypes.byref(buf), ctypes.byref(length),
                               ctypes.byref(uid), ctypes.byref(gid))
        payload = ctypes.string_at(buf, length.value).decode(errors="replace") if buf.value else ""
        if buf.value:
            ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").free(buf)
        if err:
            why = lib.munge_strerror(err).decode(errors="replace")
            if err in (EMUNGE_SOCKET, EMUNGE_TIMEOUT):
                raise MungedUnreachable("munge", f"munged at {socket_path or DEFAULT_SOCKET} is not answering", why,
                                        "start munged (or fix munge_socket in rgpu.toml)")
            raise AuthError("munge", "MUNGE credential refused", "replayed" if err == EMUNGE_CRED_REPLAYED else why,
                            "make a new credential for each call; check munged and the nodes' clocks")
    finally:
        lib.munge_ctx_destroy(ctx)
    try:
        user = pwd.getpwuid(uid.value).pw_name
    except KeyError:
        user = str(uid.value)
    return Identity(uid.value, gid.value, user, payload)
