"""Lease tokens: wrong GPU, wrong server, expired, tampered, wrong secret."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import pytest

from rgpu import tokens
from rgpu.errors import AuthError, ConfigError
from rgpu.secret import create_secret, load_secret

SECRET = b"k" * 32
CLAIMS = tokens.SliceClaims(job_key="slurm-42-0", slice_number=0, server="gpu1:55001", gpu_uuid="GPU-aaa",
                            gpu_index=0, memory_limit_bytes=2**30, compute_percent=50, expires_unix=2000.0,
                            issued_unix=1000.0)


def test_round_trip() -> None:
    token = tokens.sign(SECRET, CLAIMS)
    assert tokens.verify(SECRET, token, server="gpu1:55001", gpu_uuids={"GPU-aaa"}, now=1500) == CLAIMS


@pytest.mark.parametrize("kwargs, reason", [
    ({"server": "gpu2:55001"}, "issued for dispatcher gpu1:55001"),
    ({"gpu_uuids": {"GPU-bbb"}}, "issued for GPU GPU-aaa"),
    ({"now": 2001.0}, "expired"),
])
def test_binding_and_expiry(kwargs, reason) -> None:  # type: ignore[no-untyped-def]
    token = tokens.sign(SECRET, CLAIMS)
    kwargs.setdefault("now", 1500.0)
    with pytest.raises(AuthError, match=reason):
        tokens.verify(SECRET, token, **kwargs)


def test_tampered_claims_and_wrong_secret() -> None:
    token = tokens.sign(SECRET, CLAIMS)
    prefix, body, mac = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(body + "=="))
    claims["memory_limit_bytes"] = 2**40  # ask for more memory than leased
    forged = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    with pytest.raises(AuthError, match="bad signature"):
        tokens.verify(SECRET, f"{prefix}.{forged}.{mac}", now=1500)
    with pytest.raises(AuthError, match="bad signature"):
        tokens.verify(b"x" * 32, token, now=1500)
    for junk in ["", "abc", "rgpu1..", "rgpu1.e30.!!!", f"rgpu2.{body}.{mac}"]:
        with pytest.raises(AuthError):
            tokens.verify(SECRET, junk, now=1500)


def test_no_expiry_means_valid_until_release() -> None:
    claims = tokens.SliceClaims(**{**CLAIMS.__dict__, "expires_unix": 0.0})
    assert tokens.verify(SECRET, tokens.sign(SECRET, claims), now=10**10) == claims


def test_secret_file_rules(tmp_path: Path) -> None:
    path = create_secret(tmp_path / "secret")
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert len(load_secret(path)) == 64
    with pytest.raises(ConfigError, match="already exists"):
        create_secret(path)
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match=r"readable by others \(mode 0644\).*chmod 600"):
        load_secret(path)
    with pytest.raises(ConfigError, match="does not exist.*rgpu-admin secret create"):
        load_secret(tmp_path / "missing")
    short = tmp_path / "short"
    short.write_text("abc")
    os.chmod(short, 0o600)
    with pytest.raises(ConfigError, match="holds 3 bytes"):
        load_secret(short)


@pytest.mark.parametrize("field, value", [("compute_percent", 0), ("compute_percent", 250), ("memory_limit_bytes", 0),
                                          ("memory_limit_bytes", "8G")])
def test_signed_claims_with_impossible_limits_are_refused_in_one_line(field: str, value: object) -> None:
    # Signed with the secret (a broken pool, or a program holding the secret): the limits are still
    # checked as every reader of a slice's limits checks them (rgpu.slice_size.SliceLimits).
    token = tokens.sign(SECRET, tokens.SliceClaims(**{**CLAIMS.__dict__, field: value}))
    with pytest.raises(AuthError) as info:
        tokens.verify(SECRET, token, now=1500.0)
    assert str(info.value).startswith(f"rgpu: token: lease token refused (malformed claims: invalid {field} ")
    assert "\n" not in str(info.value)
