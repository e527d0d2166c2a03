"""ListGpus for large pools: each server's part of the reply is serialized once per change.

Protocol buffers merge concatenated messages by appending repeated fields, so the reply is the
concatenation of every server's serialized part. At 10,000 GPUs this turns a ~100 ms rebuild
that holds the interpreter (and delays every allocation) into a few milliseconds.
"""

from __future__ import annotations

import threading

from rgpu.proto import rgpu_pb2 as pb
from rgpu.remoting.pool.convert import gpu_to_pb
from rgpu.remoting.pool.rules import PoolCore


class GpuListing:
    def __init__(self, core: PoolCore) -> None:
        self._core = core
        self._lock = threading.Lock()
        self._parts: dict[str, tuple[tuple[str, int], bytes]] = {}

    def reply(self) -> pb.ListGpusReply:
        with self._lock:
            known = {address: key for address, (key, _) in self._parts.items()}
            parts: dict[str, tuple[tuple[str, int], bytes]] = {}
            for address, key, records in self._core.gpu_statuses_changed(known):
                if records is None:
                    parts[address] = self._parts[address]
                    continue
                parts[address] = (key, pb.ListGpusReply(gpus=[
                    pb.GpuStatus(server=g.server, server_state=g.server_state, gpu=gpu_to_pb(g.gpu),  # type: ignore[arg-type]
                                 allocated_percent=g.allocated_percent,
                                 allocated_memory_bytes=g.allocated_memory_bytes, slices=g.slices)
                    for g in records]).SerializeToString())
            self._parts = parts   # servers removed since drop out here
        return pb.ListGpusReply.FromString(b"".join(data for _, data in parts.values()))
