"""`flexrun local`: which of the pool's GPU servers run on this node.

A dispatcher is on this node when the host of the address it serves sessions on resolves to an
address of this node (one it can bind to: loopback, or any interface's). Its sessions then share a
host with the application, and their copies take the same-host path (UCX's shared-memory
transports; see remoting/native/README.md, "The same-host path").
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterable

from rgpu.errors import InvalidRequest
from rgpu.netaddr import split_host_port

Resolve = Callable[[str], list[str]]
Bindable = Callable[[str], bool]


def resolve(host: str) -> list[str]:
    """The IP addresses `host` names ([] when it does not resolve)."""
    try:
        return sorted({str(info[4][0]) for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)})
    except (socket.gaierror, UnicodeError, OSError):
        return []


def bindable(ip: str) -> bool:
    """Whether this node owns `ip` (a socket can bind to it)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((ip, 0))
        return True
    except OSError:
        return False


def is_local(address: str, resolve: Resolve = resolve, bindable: Bindable = bindable) -> bool:
    """Whether a dispatcher serving sessions on `address` ("host:port") runs on this node."""
    try:
        host, _ = split_host_port(address, what="server address")
    except InvalidRequest:
        return False
    ips = resolve(host)
    return bool(ips) and any(bindable(ip) for ip in ips)


def local_servers(addresses: Iterable[str], states: Iterable[str] | None = None, resolve: Resolve = resolve,
                  bindable: Bindable = bindable) -> list[str]:
    """The addresses, of those given (with their states, when known), of dispatchers up on this node."""
    addresses = list(addresses)
    state_list = list(states) if states is not None else ["up"] * len(addresses)
    return [a for a, state in zip(addresses, state_list) if state == "up" and is_local(a, resolve, bindable)]
