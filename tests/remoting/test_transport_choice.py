"""The transport decisions and the handshake's UCX fields (datapath/transport.py, protocol.py): pure."""

from __future__ import annotations

import pytest
from rgpu.errors import ConfigError
from rgpu.remoting.datapath import protocol
from rgpu.remoting.datapath.transport import (MAX_ADDRESS_BYTES, fallback_line, parse_peer_address, parse_transport,
                                              worker_choice)


@pytest.mark.parametrize("text,want", [(None, "auto"), ("", "auto"), (" UCX ", "ucx"), ("tcp", "tcp"), ("auto", "auto")])
def test_transport_settings_parse(text: str | None, want: str) -> None:
    assert parse_transport(text) == want


def test_an_unknown_transport_is_refused_with_what_is_accepted() -> None:
    with pytest.raises(ConfigError, match=r"RGPU_TRANSPORT = 'rdma' is not a transport \(want auto, ucx or tcp; "
                                          r"fix RGPU_TRANSPORT, or unset it for auto\)"):
        parse_transport("rdma")
    with pytest.raises(ConfigError, match=r"transport = 'rdma' from /etc/rgpu/rgpu.toml is not a transport"):
        parse_transport("rdma", "transport", "/etc/rgpu/rgpu.toml")


def test_the_dispatcher_takes_its_transport_from_its_settings() -> None:
    import socket
    from dataclasses import replace

    from rgpu.config import Settings
    from rgpu.remoting.dispatcher.daemon import start_data_path
    with socket.socket() as sock:
        with pytest.raises(ConfigError, match="transport = 'rdma' from default is not a transport"):
            start_data_path(sock, "127.0.0.1:1", (), b"s" * 32, (45201, 45300), "emulated",
                            replace(Settings(), transport="rdma"))


def test_the_worker_takes_ucx_only_when_offered_allowed_and_a_cuda_session() -> None:
    assert worker_choice("auto", True, "cuda").try_ucx
    assert worker_choice("ucx", True, "cuda").try_ucx
    tcp = worker_choice("tcp", True, "cuda")
    assert not tcp.try_ucx and "transport setting is tcp" in tcp.why
    unoffered = worker_choice("auto", False, "cuda")
    assert not unoffered.try_ucx and "the client did not offer UCX" in unoffered.why
    assert not worker_choice("auto", True, "nvml").try_ucx
    # A real GPU takes UCX only when asked: its path is not measured faster than TCP yet.
    real = worker_choice("auto", True, "cuda", "cuda")
    assert not real.try_ucx and "transport = ucx" in real.why
    assert worker_choice("ucx", True, "cuda", "cuda").try_ucx
    assert fallback_line("x") == "copies of this session go over TCP, not UCX (x)"


@pytest.mark.parametrize("info,want", [
    ({"ucx": "00ff10"}, b"\x00\xff\x10"),
    ({}, b""),
    ({"ucx": 5}, b""),                  # not a string
    ({"ucx": "abc"}, b""),              # odd length
    ({"ucx": "zz"}, b""),               # not hex
    ({"ucx": "00" * (MAX_ADDRESS_BYTES + 1)}, b""),   # larger than any worker address
])
def test_a_clients_ucx_address_is_taken_only_when_well_formed(info: dict, want: bytes) -> None:
    assert parse_peer_address(info) == want


def test_welcome_carries_the_workers_ucx_address_and_older_layouts_read_as_none() -> None:
    frame = protocol.encode_welcome(driver_version=13000, memory_limit_bytes=5, compute_percent=50, flags=1,
                                    description="d", ucx_address=b"\x01\x02")
    w = protocol.decode_welcome(frame[protocol.HEADER_SIZE:])
    assert (w.description, w.ucx_address) == ("d", b"\x01\x02")
    bare = protocol.encode_welcome(driver_version=1, memory_limit_bytes=1, compute_percent=1, flags=0, description="e")
    assert protocol.decode_welcome(bare[protocol.HEADER_SIZE:]).ucx_address == b""
    # Without the field at all (a version-9 WELCOME's layout): none, not an error.
    assert protocol.decode_welcome(bare[protocol.HEADER_SIZE:-4]).ucx_address == b""
    assert protocol.UCX_COPY.size == 24


@pytest.mark.integration   # runs the C compiler
def test_the_ucx_link_builds_without_ucx_headers(tmp_path) -> None:   # type: ignore[no-untyped-def]
    """Nodes without libucx-dev still build the client: ucx_link.c then declares UCP's types itself."""
    import shutil
    import subprocess

    from rgpu.remoting.native.build import CFLAGS, SRC
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    flags = [f for f in CFLAGS if f != "-shared"]
    done = subprocess.run([cc, *flags, "-Werror", "-DRGPU_UCX_NO_HEADER", "-c", str(SRC / "ucx_link.c"),
                           "-o", str(tmp_path / "ucx_link.o")], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
