"""Which hosts `rgpu-admin health --deep` checks: the pool's host, each dispatcher's host (from the
pool), and the client nodes (health_client_nodes, else Slurm's nodes from sinfo)."""

from __future__ import annotations

import shutil
import subprocess

from rgpu.netaddr import split_host_port

# %n: the nodes' hostnames (NodeHostname), which SSH reaches; several slurmd on one host collapse.
SINFO = ["sinfo", "--noheader", "--Node", "--format=%n"]


def host_of(address: str) -> str:
    return split_host_port(address, what="address", component="health")[0]


def parse_node_list(text: str) -> list[str]:
    """Nodes from `health_client_nodes` or sinfo's output: commas, spaces or lines; duplicates dropped."""
    seen: list[str] = []
    for part in text.replace(",", " ").split():
        if part not in seen:
            seen.append(part)
    return seen


def slurm_nodes(timeout: float = 15.0) -> list[str]:
    """Slurm's node names, or [] where Slurm is not installed or does not answer."""
    if shutil.which(SINFO[0]) is None:
        return []
    try:
        run = subprocess.run(SINFO, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return parse_node_list(run.stdout) if run.returncode == 0 else []


def split_node(node: str, default_port: int) -> tuple[str, int]:
    """`host` or `host:port` (a client node listed with its own SSH port)."""
    if node.count(":") == 1 or node.startswith("["):
        host, port = split_host_port(node, what="client node", component="health")
        return host, port
    return node, default_port
