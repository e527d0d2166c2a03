"""`host:port` addresses: the one parser every component uses (IPv4, names, `[v6]:port`)."""

from __future__ import annotations

from rgpu.errors import InvalidRequest


def split_host_port(value: str, *, what: str = "address", allow_empty_host: bool = False) -> tuple[str, int]:
    """('host', port) from 'host:port' or '[v6]:port' (brackets removed). A port must be 1-65535;
    an empty host ('' in ':50001') is allowed only where binding to every address makes sense."""
    if not isinstance(value, str):
        raise InvalidRequest("config", f"{what} {value!r} is not text", "", "use HOST:PORT, e.g. pool1:50001")
    if value.startswith("["):
        head, sep, port = value.rpartition("]:")
        host = head[1:]
    else:
        host, sep, port = value.rpartition(":")
        if ":" in host:  # an unbracketed IPv6 address: the port is ambiguous
            sep = ""
    if not sep or not port.isdigit() or not 0 < int(port) < 65536 or (not host and not allow_empty_host):
        shown = value if len(value) <= 80 else value[:77] + "..."
        raise InvalidRequest("config", f"{what} {shown!r} is not HOST:PORT", "the port must be 1-65535; "
                             "IPv6 addresses go in brackets", "e.g. pool1:50001 or [fd00::1]:50001")
    return host, int(port)


def join_host_port(host: str, port: int) -> str:
    """'host:port', bracketing an IPv6 address."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
