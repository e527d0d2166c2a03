"""adaptor.conf: the TOML file that tells flexrun which slices a job holds.

Pure logic (validation, rendering, parsing) plus one atomic writer. Format (see
templates/adaptor.conf.j2): top-level `format`, `job_id`, `user`, `expires` (RFC 3339 or empty)
and one `[[slice]]` table per slice with `server`, `gpu_uuid`, `gpu_index`,
`memory_limit_bytes`, `compute_percent`, `token`.
"""

from __future__ import annotations

import datetime as dt
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from rgpu import validate
from rgpu.errors import ConfigError, InvalidRequest
from rgpu.render import render
from rgpu.slice_size import SliceLimits
from rgpu.tokens import unverified_claims
from rgpu.units import format_bytes

FORMAT_VERSION = 1


@dataclass(frozen=True)
class AdaptorSlice:
    server: str
    gpu_uuid: str
    gpu_index: int
    memory_limit_bytes: int
    compute_percent: int
    token: str

    def validated(self) -> "AdaptorSlice":
        validate.server_address(self.server)
        validate.gpu_uuid(self.gpu_uuid)
        validate.non_negative_int("gpu_index", self.gpu_index, 1023)
        SliceLimits(self.memory_limit_bytes, self.compute_percent, component="adaptor.conf")
        validate.token(self.token)
        return self


@dataclass(frozen=True)
class AdaptorConf:
    job_id: str
    user: str
    expires: str = ""  # RFC 3339, or "" for no expiry
    slices: tuple[AdaptorSlice, ...] = field(default_factory=tuple)

    def validated(self) -> "AdaptorConf":
        validate.job_key(self.job_id)
        validate.name("user", self.user)
        validate.rfc3339_or_empty(self.expires)
        if not 1 <= len(self.slices) <= validate.MAX_SLICES:
            raise InvalidRequest("adaptor.conf", f"{len(self.slices)} slices", 
                                 f"an adaptor.conf holds 1 to {validate.MAX_SLICES} slices", "")
        for s in self.slices:
            s.validated()
        return self


def expires_text(expires_unix: float) -> str:
    if not expires_unix:
        return ""
    return dt.datetime.fromtimestamp(expires_unix, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def render_adaptor_conf(conf: AdaptorConf) -> str:
    conf.validated()
    return render("adaptor.conf.j2", job_id=conf.job_id, user=conf.user, expires=conf.expires,
                  slices=conf.slices)


def parse_adaptor_conf(text: str, source: str = "adaptor.conf") -> AdaptorConf:
    def bad(why: str) -> ConfigError:
        return ConfigError("adaptor.conf", f"cannot use {source}", why,
                           "ask for a new one (rerun the job, or rgpu-admin request-gpus)")

    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise bad(f"not valid TOML: {exc}") from None
    if data.get("format", FORMAT_VERSION) != FORMAT_VERSION:
        raise bad(f"format {data.get('format')!r} is not supported by this rgpu (supports {FORMAT_VERSION})")
    unknown = set(data) - {"format", "job_id", "user", "expires", "slice"}
    if unknown:
        raise bad(f"unknown keys {sorted(unknown)}")
    try:
        slices = []
        for raw in data.get("slice", []):
            extra = set(raw) - set(AdaptorSlice.__dataclass_fields__)
            if extra:
                raise bad(f"unknown slice keys {sorted(extra)}")
            slices.append(AdaptorSlice(**raw))
        conf = AdaptorConf(job_id=data["job_id"], user=data["user"], expires=data.get("expires", ""),
                           slices=tuple(slices))
        return conf.validated()
    except KeyError as exc:
        raise bad(f"missing key {exc}") from None
    except TypeError as exc:
        raise bad(f"missing or wrong slice keys ({exc})") from None
    except InvalidRequest as exc:
        raise bad(exc.what + (f": {exc.why}" if exc.why else "")) from None


def check_limits_match_tokens(conf: AdaptorConf, source: str = "adaptor.conf") -> None:
    """Each slice's limits as the file states them are those its token grants. The token is what the GPU
    server enforces, so a file that says otherwise was edited, or pairs a token with another lease's
    limits: refused in one line rather than run on limits other than those written. A token this rgpu
    cannot read is left to the GPU server, which refuses it with its own line."""
    for number, piece in enumerate(conf.slices):
        claims = unverified_claims(piece.token)
        if claims is None:
            continue
        if (piece.memory_limit_bytes, piece.compute_percent) != (claims.memory_limit_bytes, claims.compute_percent):
            said, granted = format_bytes(piece.memory_limit_bytes), format_bytes(claims.memory_limit_bytes)
            if said == granted and piece.memory_limit_bytes != claims.memory_limit_bytes:   # closer than the rounding shows
                said, granted = f"{piece.memory_limit_bytes} bytes", f"{claims.memory_limit_bytes} bytes"
            raise ConfigError("adaptor.conf", f"cannot use {source}",
                              f"slice {number} says {said} and {piece.compute_percent}% compute, but its token "
                              f"grants {granted} and {claims.compute_percent}% (the file "
                              "was changed after rgpu wrote it, or holds another lease's token)",
                              "use the adaptor.conf rgpu wrote for this job, or ask for a new one (rerun the job, "
                              "or rgpu-admin request-gpus)")


def read_adaptor_conf(path: str | os.PathLike[str]) -> AdaptorConf:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError("adaptor.conf", f"cannot read {p}", exc.strerror or str(exc),
                          "check the path, or that this job was given rgpu slices") from None
    return parse_adaptor_conf(text, str(p))


def write_private_file(path: str | os.PathLike[str], text: str, uid: int | None = None,
                       gid: int | None = None) -> Path:
    """Write text atomically with mode 0600 (optionally owned by uid/gid): never a partial file."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, text.encode("utf-8"))
        os.fsync(fd)
        if uid is not None:
            os.fchown(fd, uid, -1 if gid is None else gid)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, p)
    return p


def write_adaptor_conf(path: str | os.PathLike[str], conf: AdaptorConf, uid: int | None = None,
                       gid: int | None = None) -> Path:
    return write_private_file(path, render_adaptor_conf(conf), uid, gid)
