"""Whether gRPC to the pool is TLS, decided once from the settings for servers and clients alike.

`grpc_tls` says it: `auto` (the built-in default, for tests and the demo) is TLS where the TLS files
are set and plaintext otherwise; `required` (what `rgpu-admin install-units` writes) refuses to
serve or dial without them; `off` is the admin's explicit opt-out, plaintext even where the files
are set, and the daemons log PLAINTEXT_WARNING when they start.
"""

from __future__ import annotations

from rgpu.config import Settings
from rgpu.errors import ConfigError

MODES = ("auto", "required", "off")
PLAINTEXT_WARNING = ("rgpu: {component}: gRPC to the pool is PLAINTEXT (grpc_tls = \"off\" from {origin}): anyone on "
                     "the network can read and alter calls, lease tokens included; run `rgpu-admin install-units` "
                     "without --plaintext to set up TLS")


def server_files(settings: Settings) -> tuple[str, str] | None:
    """(certificate, key) the pool serves gRPC with, or None for plaintext."""
    if settings.grpc_tls == "off":
        return None
    if settings.tls_cert_file and settings.tls_key_file:
        return settings.tls_cert_file, settings.tls_key_file
    if settings.grpc_tls == "required":
        raise ConfigError("poold", "plaintext gRPC is refused (grpc_tls = \"required\" from "
                          f"{settings.origin('grpc_tls')})", "tls_cert_file and tls_key_file are not set",
                          "run `rgpu-admin install-units` on this host to make the pool's certificate, or set "
                          "grpc_tls = \"off\" to serve plaintext (not for production)")
    return None


def client_ca(settings: Settings, component: str = "pool") -> str | None:
    """The CA file clients verify the pool's certificate with, or None for plaintext."""
    if settings.grpc_tls == "off":
        return None
    if settings.tls_ca_file:
        return settings.tls_ca_file
    if settings.grpc_tls == "required":
        raise ConfigError(component, "plaintext gRPC is refused (grpc_tls = \"required\" from "
                          f"{settings.origin('grpc_tls')})", "tls_ca_file is not set",
                          "copy the pool's CA certificate to this host and set tls_ca_file in rgpu.toml "
                          "(`rgpu-admin install-units` does both from the pool's rgpu.toml)")
    return None


def plaintext_warning(settings: Settings, component: str) -> str | None:
    """The line a daemon logs at start when the admin turned TLS off, else None."""
    if settings.grpc_tls != "off":
        return None
    return PLAINTEXT_WARNING.format(component=component, origin=settings.origin("grpc_tls"))
