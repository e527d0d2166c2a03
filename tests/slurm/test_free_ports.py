"""The test daemons' ports come from below the kernel's ephemeral range (CI saw slurmdbd lose its
port to an outgoing connection: "Error binding slurm stream socket: Address already in use")."""

import socket
from pathlib import Path

from rgpu.slurm_plugin.localcluster import _ephemeral_low, free_ports


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    low = _ephemeral_low()
    ports = free_ports(8)
    assert len(set(ports)) == 8
    assert all(1024 <= port < low for port in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_an_unreadable_port_range_falls_back_to_linuxs_default(tmp_path: Path) -> None:
    assert _ephemeral_low(str(tmp_path / "absent")) == 32768
    (tmp_path / "range").write_text("garbage\n")
    assert _ephemeral_low(str(tmp_path / "range")) == 32768
    (tmp_path / "range").write_text("40000\t60999\n")
    assert _ephemeral_low(str(tmp_path / "range")) == 40000
