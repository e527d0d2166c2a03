"""Conversions between domain types (rgpu.model) and gRPC messages. Pure."""

from __future__ import annotations

from rgpu.model import GpuInfo, ServerInfo
from rgpu.proto import rgpu_pb2 as pb


def gpu_to_pb(gpu: GpuInfo) -> pb.Gpu:
    return pb.Gpu(uuid=gpu.uuid, index=gpu.index, name=gpu.name, total_memory_bytes=gpu.total_memory_bytes,
                  usable_memory_bytes=gpu.usable_memory_bytes, compute_capability=gpu.compute_capability)


def gpu_from_pb(msg: pb.Gpu) -> GpuInfo:
    return GpuInfo(uuid=msg.uuid, index=msg.index, name=msg.name, total_memory_bytes=msg.total_memory_bytes,
                   usable_memory_bytes=msg.usable_memory_bytes or msg.total_memory_bytes,
                   compute_capability=msg.compute_capability)


def server_to_pb(info: ServerInfo, state: str = "", heartbeat_age: float = 0.0) -> pb.Server:
    return pb.Server(address=info.address, hostname=info.hostname, driver_version=info.driver_version,
                     cuda_version=info.cuda_version, state=state, heartbeat_age_seconds=heartbeat_age,
                     gpus=[gpu_to_pb(g) for g in info.gpus], static_inventory=info.static_inventory,
                     version=info.version, data_ports=info.data_ports,
                     compute_enforcement=info.compute_enforcement)


def server_from_pb(msg: pb.Server) -> ServerInfo:
    return ServerInfo(address=msg.address, hostname=msg.hostname, driver_version=msg.driver_version,
                      cuda_version=msg.cuda_version, gpus=tuple(gpu_from_pb(g) for g in msg.gpus),
                      static_inventory=msg.static_inventory, version=msg.version, data_ports=msg.data_ports,
                      compute_enforcement=msg.compute_enforcement)
