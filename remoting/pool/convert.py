"""Conversions between domain types (rgpu.model) and gRPC messages. Pure."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rgpu.live_leases import LiveLeases
from rgpu.model import GpuInfo, ServerInfo
from rgpu.proto import rgpu_pb2 as pb
from rgpu.slice_size import percent_of_fraction_value

if TYPE_CHECKING:
    from rgpu.adaptor import AdaptorConf
    from rgpu.remoting.pool.accounting import SliceUsageRecord


def size_from_pb(request: pb.AllocateRequest) -> tuple[int | None, int | None]:
    """(percent, memory_bytes) an Allocate asks for, one of them None (both None: neither was
    given). The `fraction` of clients before the percent field is read as Slurm reads a fraction."""
    which = request.WhichOneof("size")
    if which == "percent":
        return request.percent, None
    if which == "memory_bytes":
        return None, request.memory_bytes
    if which == "fraction":
        return percent_of_fraction_value(request.fraction, component="pool"), None
    return None, None


def gpu_to_pb(gpu: GpuInfo) -> pb.Gpu:
    return pb.Gpu(uuid=gpu.uuid, index=gpu.index, name=gpu.name, total_memory_bytes=gpu.total_memory_bytes,
                  usable_memory_bytes=gpu.usable_memory_bytes, compute_capability=gpu.compute_capability,
                  sharing=gpu.sharing)


def gpu_from_pb(msg: pb.Gpu) -> GpuInfo:
    return GpuInfo(uuid=msg.uuid, index=msg.index, name=msg.name, total_memory_bytes=msg.total_memory_bytes,
                   usable_memory_bytes=msg.usable_memory_bytes or msg.total_memory_bytes,
                   compute_capability=msg.compute_capability, sharing=msg.sharing or "mps")


def server_to_pb(info: ServerInfo, state: str = "", heartbeat_age: float = 0.0) -> pb.Server:
    return pb.Server(address=info.address, hostname=info.hostname, driver_version=info.driver_version,
                     cuda_version=info.cuda_version, state=state, heartbeat_age_seconds=heartbeat_age,
                     gpus=[gpu_to_pb(g) for g in info.gpus], static_inventory=info.static_inventory,
                     version=info.version, data_ports=info.data_ports,
                     compute_enforcement=info.compute_enforcement, launch_path=info.launch_path)


def server_from_pb(msg: pb.Server) -> ServerInfo:
    return ServerInfo(address=msg.address, hostname=msg.hostname, driver_version=msg.driver_version,
                      cuda_version=msg.cuda_version, gpus=tuple(gpu_from_pb(g) for g in msg.gpus),
                      static_inventory=msg.static_inventory, version=msg.version, data_ports=msg.data_ports,
                      compute_enforcement=msg.compute_enforcement, launch_path=msg.launch_path)


def live_to_pb(live: LiveLeases) -> pb.HeartbeatReply:
    return pb.HeartbeatReply(known=True, pool_unix=live.pool_unix, live=[
        pb.LiveSlice(job_key=job_key, slice_number=number, issued_unix=issued)
        for job_key, number, issued in sorted(live.slices)])


def live_from_pb(reply: pb.HeartbeatReply) -> LiveLeases | None:
    """None when the pool does not report live slices (an older pool)."""
    if reply.pool_unix <= 0:
        return None
    return LiveLeases.of(reply.pool_unix, ((s.job_key, s.slice_number, s.issued_unix) for s in reply.live))


def lease_to_adaptor(lease: pb.Lease, slices: list[pb.Slice] | None = None) -> "AdaptorConf":
    """The adaptor.conf for a lease (or for some of its slices, e.g. one node's share)."""
    from rgpu.adaptor import AdaptorConf, AdaptorSlice, expires_text

    chosen = list(lease.slices) if slices is None else slices
    return AdaptorConf(
        job_id=lease.job_key, user=lease.user, expires=expires_text(lease.expires_unix),
        slices=tuple(AdaptorSlice(server=s.server, gpu_uuid=s.gpu_uuid, gpu_index=s.gpu_index,
                                  memory_limit_bytes=s.memory_limit_bytes, compute_percent=s.compute_percent,
                                  token=s.token) for s in chosen))


def usage_from_pb(msg: pb.SliceUsage) -> tuple[str, int, "SliceUsageRecord"]:
    from rgpu.remoting.pool.accounting import SliceUsageRecord
    return msg.job_key, msg.slice_number, SliceUsageRecord(
        sessions=msg.sessions, busy_seconds=msg.busy_seconds, memory_high_water_bytes=msg.memory_high_water_bytes,
        memory_used_bytes=msg.memory_used_bytes, last_active_unix=msg.last_active_unix, calls=msg.calls)


def usage_to_pb(job_key: str, number: int, usage: "SliceUsageRecord | None",
                compute_used_percent: float = -1.0) -> pb.SliceUsage:
    """compute_used_percent < 0: not reported (the message's default 0 would read as idle)."""
    if usage is None:
        return pb.SliceUsage(job_key=job_key, slice_number=number, compute_used_percent=compute_used_percent)
    return pb.SliceUsage(job_key=job_key, slice_number=number, sessions=usage.sessions,
                         busy_seconds=usage.busy_seconds, memory_high_water_bytes=usage.memory_high_water_bytes,
                         memory_used_bytes=usage.memory_used_bytes, last_active_unix=usage.last_active_unix,
                         calls=usage.calls, compute_used_percent=compute_used_percent)
