"""`host:port` addresses: the one parser every component uses (IPv4, names, `[v6]:port`)."""

from __future__ import annotations

from rgpu.errors import InvalidRequest

MAX_ADDRESS_LENGTH = 300   # a host name is at most 253 characters; longer text is not an address


def _is_port(text: str, lowest: int) -> bool:
    # ASCII digits only: str.isdigit() accepts "²" and "５", which int() rejects or misreads.
    return 0 < len(text) <= 5 and text.isascii() and text.isdigit() and lowest <= int(text) < 65536


def split_host_port(value: str, *, what: str = "address", allow_empty_host: bool = False,
                    allow_port_zero: bool = False, component: str = "config") -> tuple[str, int]:
    """('host', port) from 'host:port' or '[v6]:port' (brackets removed). A port must be 1-65535;
    an empty host ('' in ':50001') is allowed only where binding to every address makes sense, and
    port 0 only where a listener may pick a free port.
    The host is not resolved or checked further (rgpu.validate.host does that)."""
    if not isinstance(value, str):
        raise InvalidRequest(component, f"{what} {value!r} is not text", "", "use HOST:PORT, e.g. pool1:50001")
    host, sep, port = "", "", ""
    if len(value) <= MAX_ADDRESS_LENGTH and value.isprintable() and not any(c.isspace() for c in value):
        if value.startswith("["):
            head, sep, port = value.rpartition("]:")
            host = head[1:]
            if "[" in host or "]" in host or (sep and ":" not in host):
                sep = ""   # brackets hold exactly one IPv6 address
        else:
            host, sep, port = value.rpartition(":")
            if ":" in host or "[" in host or "]" in host:  # an unbracketed IPv6 address: the port is ambiguous
                sep = ""
    if not sep or not _is_port(port, 0 if allow_port_zero else 1) or (not host and not allow_empty_host):
        shown = repr(value) if len(value) <= 80 else repr(value[:77] + "...")
        raise InvalidRequest(component, f"{what} {shown} is not HOST:PORT", "the port must be 1-65535; "
                             "IPv6 addresses go in brackets", "e.g. pool1:50001 or [fd00::1]:50001")
    return host, int(port)


def join_host_port(host: str, port: int) -> str:
    """'host:port', bracketing an IPv6 address (inverse of split_host_port)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bound_address(listen: str, port: int) -> str:
    """What a listener configured as `listen` (port 0: any free one) really listens on, for logs:
    ':0' becomes the bound port. `listen` that does not parse is returned with the port beside it."""
    try:
        host, _ = split_host_port(listen, allow_empty_host=True, allow_port_zero=True)
    except InvalidRequest:
        return f"{listen} (port {port})"
    return join_host_port(host, port)
