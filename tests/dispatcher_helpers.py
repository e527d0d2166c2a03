"""wait_state: waits until the pool reports a GPU server in a given state."""

from __future__ import annotations

from rgpu.errors import RgpuError
from rgpu.proto import rgpu_pb2 as pb

from tests.daemons import RgpuCluster, wait_for


def servers(cluster: RgpuCluster) -> dict[str, pb.Server]:
    try:
        with cluster.client() as client:
            return {s.address: s for s in client.list_servers().servers}
    except RgpuError:
        return {}


def wait_state(cluster: RgpuCluster, address: str, state: str, timeout: float = 15.0) -> pb.Server:
    wait_for(lambda: address in servers(cluster) and servers(cluster)[address].state == state, timeout,
             f"{address} to be {state}")
    return servers(cluster)[address]
