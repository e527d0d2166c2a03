"""Which transport carries a session's copies (issue 25): pure decisions, no I/O.

`transport = auto | ucx | tcp` on each end (the client: RGPU_TRANSPORT in the slice environment; the
GPU node: RGPU_TRANSPORT in the dispatcher's environment, which its workers inherit). The client
offers UCX in HELLO (its UCX worker address, info key "ucx") unless it says tcp or cannot load UCX;
the worker answers with its own address in WELCOME when it takes UCX. Copies of at least
RGPU_UCX_MIN_BYTES (1 MiB) then carry their bytes on UCX; everything else stays on the TCP stream.
"""

from __future__ import annotations

from dataclasses import dataclass

from rgpu.errors import ConfigError

TRANSPORTS = ("auto", "ucx", "tcp")
# A client's UCX worker address, hex in HELLO's info: UCX 1.13's are a few hundred bytes with
# shared memory and TCP; RDMA devices add some. Larger is refused, not trusted.
MAX_ADDRESS_BYTES = 16 << 10


def parse_transport(text: str | None, source: str = "RGPU_TRANSPORT", origin: str = "") -> str:
    """The setting, "auto" when unset; a ConfigError that says what is accepted otherwise."""
    value = (text or "").strip().lower() or "auto"
    if value not in TRANSPORTS:
        where = f" from {origin}" if origin else ""
        raise ConfigError("transport", f"{source} = {text!r}{where} is not a transport", "want auto, ucx or tcp",
                          f"fix {source}, or unset it for auto")
    return value


def parse_peer_address(info: dict) -> bytes:
    """The client's UCX worker address from HELLO's info (b"": it offered none, or a malformed one)."""
    text = info.get("ucx")
    if not isinstance(text, str) or not text or len(text) > 2 * MAX_ADDRESS_BYTES or len(text) % 2:
        return b""
    try:
        return bytes.fromhex(text)
    except ValueError:
        return b""


@dataclass(frozen=True)
class Choice:
    """What the worker does: open UCX (then it may still fail, see `after_open_failure`), or stay
    on TCP for `why`."""
    try_ucx: bool
    why: str


def worker_choice(setting: str, client_offered: bool, mode: str, backend: str = "emulated") -> Choice:
    if mode != "cuda":
        return Choice(False, "an NVML session moves no bulk data")
    if setting == "tcp":
        return Choice(False, "the dispatcher's transport setting is tcp (RGPU_TRANSPORT)")
    if setting == "auto" and backend == "cuda":
        # On an H100 UCX's bytes, landing in a host buffer and copied again into the pinned ring,
        # were no faster than TCP's receive straight into pinned memory (3.2-3.4 against 3.0-4.5
        # GB/s on shared memory). They now land in pinned memory, one DMA from there (2026-11-28),
        # not yet measured on a GPU: a GPU node takes UCX only when its setting asks for it until then.
        return Choice(False, "on a GPU node UCX copies are not measured faster than TCP yet: set transport = ucx "
                             "on the dispatcher (rgpu.toml or RGPU_TRANSPORT) to use them")
    if not client_offered:
        return Choice(False, "the client did not offer UCX (its RGPU_TRANSPORT is tcp, or it cannot load "
                             "libucp; its RGPU_LOG=info line says which)")
    return Choice(True, "")


def fallback_line(why: str) -> str:
    """The one log line a session that stays on TCP gets."""
    return f"copies of this session go over TCP, not UCX ({why})"
