from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Gpu(_message.Message):
    __slots__ = ("uuid", "index", "name", "total_memory_bytes", "usable_memory_bytes", "compute_capability", "sharing")
    UUID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USABLE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    SHARING_FIELD_NUMBER: _ClassVar[int]
    uuid: str
    index: int
    name: str
    total_memory_bytes: int
    usable_memory_bytes: int
    compute_capability: str
    sharing: str
    def __init__(self, uuid: _Optional[str] = ..., index: _Optional[int] = ..., name: _Optional[str] = ..., total_memory_bytes: _Optional[int] = ..., usable_memory_bytes: _Optional[int] = ..., compute_capability: _Optional[str] = ..., sharing: _Optional[str] = ...) -> None: ...

class Server(_message.Message):
    __slots__ = ("address", "hostname", "driver_version", "cuda_version", "state", "heartbeat_age_seconds", "gpus", "static_inventory", "version", "data_ports", "compute_enforcement", "launch_path", "faults", "telemetry")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    DRIVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    CUDA_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    STATIC_INVENTORY_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DATA_PORTS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_ENFORCEMENT_FIELD_NUMBER: _ClassVar[int]
    LAUNCH_PATH_FIELD_NUMBER: _ClassVar[int]
    FAULTS_FIELD_NUMBER: _ClassVar[int]
    TELEMETRY_FIELD_NUMBER: _ClassVar[int]
    address: str
    hostname: str
    driver_version: str
    cuda_version: str
    state: str
    heartbeat_age_seconds: float
    gpus: _containers.RepeatedCompositeFieldContainer[Gpu]
    static_inventory: bool
    version: str
    data_ports: str
    compute_enforcement: str
    launch_path: str
    faults: _containers.RepeatedCompositeFieldContainer[GpuFault]
    telemetry: _containers.RepeatedCompositeFieldContainer[GpuTelemetry]
    def __init__(self, address: _Optional[str] = ..., hostname: _Optional[str] = ..., driver_version: _Optional[str] = ..., cuda_version: _Optional[str] = ..., state: _Optional[str] = ..., heartbeat_age_seconds: _Optional[float] = ..., gpus: _Optional[_Iterable[_Union[Gpu, _Mapping]]] = ..., static_inventory: _Optional[bool] = ..., version: _Optional[str] = ..., data_ports: _Optional[str] = ..., compute_enforcement: _Optional[str] = ..., launch_path: _Optional[str] = ..., faults: _Optional[_Iterable[_Union[GpuFault, _Mapping]]] = ..., telemetry: _Optional[_Iterable[_Union[GpuTelemetry, _Mapping]]] = ...) -> None: ...

class RegisterServerRequest(_message.Message):
    __slots__ = ("server",)
    SERVER_FIELD_NUMBER: _ClassVar[int]
    server: Server
    def __init__(self, server: _Optional[_Union[Server, _Mapping]] = ...) -> None: ...

class RegisterServerReply(_message.Message):
    __slots__ = ("heartbeat_interval_seconds",)
    HEARTBEAT_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_seconds: float
    def __init__(self, heartbeat_interval_seconds: _Optional[float] = ...) -> None: ...

class SliceUsage(_message.Message):
    __slots__ = ("job_key", "slice_number", "sessions", "busy_seconds", "memory_high_water_bytes", "memory_used_bytes", "last_active_unix", "calls", "compute_used_percent")
    JOB_KEY_FIELD_NUMBER: _ClassVar[int]
    SLICE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_HIGH_WATER_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_ACTIVE_UNIX_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_USED_PERCENT_FIELD_NUMBER: _ClassVar[int]
    job_key: str
    slice_number: int
    sessions: int
    busy_seconds: float
    memory_high_water_bytes: int
    memory_used_bytes: int
    last_active_unix: float
    calls: int
    compute_used_percent: float
    def __init__(self, job_key: _Optional[str] = ..., slice_number: _Optional[int] = ..., sessions: _Optional[int] = ..., busy_seconds: _Optional[float] = ..., memory_high_water_bytes: _Optional[int] = ..., memory_used_bytes: _Optional[int] = ..., last_active_unix: _Optional[float] = ..., calls: _Optional[int] = ..., compute_used_percent: _Optional[float] = ...) -> None: ...

class GpuTelemetry(_message.Message):
    __slots__ = ("gpu_uuid", "source", "utilization_percent", "memory_used_bytes", "temperature_celsius", "power_watts", "power_limit_watts", "ecc_corrected", "ecc_uncorrected", "xid_errors", "last_xid", "read_unix")
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_PERCENT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_CELSIUS_FIELD_NUMBER: _ClassVar[int]
    POWER_WATTS_FIELD_NUMBER: _ClassVar[int]
    POWER_LIMIT_WATTS_FIELD_NUMBER: _ClassVar[int]
    ECC_CORRECTED_FIELD_NUMBER: _ClassVar[int]
    ECC_UNCORRECTED_FIELD_NUMBER: _ClassVar[int]
    XID_ERRORS_FIELD_NUMBER: _ClassVar[int]
    LAST_XID_FIELD_NUMBER: _ClassVar[int]
    READ_UNIX_FIELD_NUMBER: _ClassVar[int]
    gpu_uuid: str
    source: str
    utilization_percent: float
    memory_used_bytes: int
    temperature_celsius: float
    power_watts: float
    power_limit_watts: float
    ecc_corrected: int
    ecc_uncorrected: int
    xid_errors: int
    last_xid: int
    read_unix: float
    def __init__(self, gpu_uuid: _Optional[str] = ..., source: _Optional[str] = ..., utilization_percent: _Optional[float] = ..., memory_used_bytes: _Optional[int] = ..., temperature_celsius: _Optional[float] = ..., power_watts: _Optional[float] = ..., power_limit_watts: _Optional[float] = ..., ecc_corrected: _Optional[int] = ..., ecc_uncorrected: _Optional[int] = ..., xid_errors: _Optional[int] = ..., last_xid: _Optional[int] = ..., read_unix: _Optional[float] = ...) -> None: ...

class GpuFault(_message.Message):
    __slots__ = ("gpu_uuid", "gpu_index", "unix", "error", "cross_tenant", "sessions_ended", "faulting", "recovered_seconds")
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    UNIX_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CROSS_TENANT_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_ENDED_FIELD_NUMBER: _ClassVar[int]
    FAULTING_FIELD_NUMBER: _ClassVar[int]
    RECOVERED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    gpu_uuid: str
    gpu_index: int
    unix: float
    error: str
    cross_tenant: bool
    sessions_ended: int
    faulting: str
    recovered_seconds: float
    def __init__(self, gpu_uuid: _Optional[str] = ..., gpu_index: _Optional[int] = ..., unix: _Optional[float] = ..., error: _Optional[str] = ..., cross_tenant: _Optional[bool] = ..., sessions_ended: _Optional[int] = ..., faulting: _Optional[str] = ..., recovered_seconds: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("address", "usage", "sent_unix", "faults", "telemetry")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SENT_UNIX_FIELD_NUMBER: _ClassVar[int]
    FAULTS_FIELD_NUMBER: _ClassVar[int]
    TELEMETRY_FIELD_NUMBER: _ClassVar[int]
    address: str
    usage: _containers.RepeatedCompositeFieldContainer[SliceUsage]
    sent_unix: float
    faults: _containers.RepeatedCompositeFieldContainer[GpuFault]
    telemetry: _containers.RepeatedCompositeFieldContainer[GpuTelemetry]
    def __init__(self, address: _Optional[str] = ..., usage: _Optional[_Iterable[_Union[SliceUsage, _Mapping]]] = ..., sent_unix: _Optional[float] = ..., faults: _Optional[_Iterable[_Union[GpuFault, _Mapping]]] = ..., telemetry: _Optional[_Iterable[_Union[GpuTelemetry, _Mapping]]] = ...) -> None: ...

class LiveSlice(_message.Message):
    __slots__ = ("job_key", "slice_number", "issued_unix")
    JOB_KEY_FIELD_NUMBER: _ClassVar[int]
    SLICE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    ISSUED_UNIX_FIELD_NUMBER: _ClassVar[int]
    job_key: str
    slice_number: int
    issued_unix: float
    def __init__(self, job_key: _Optional[str] = ..., slice_number: _Optional[int] = ..., issued_unix: _Optional[float] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("known", "live", "pool_unix")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    POOL_UNIX_FIELD_NUMBER: _ClassVar[int]
    known: bool
    live: _containers.RepeatedCompositeFieldContainer[LiveSlice]
    pool_unix: float
    def __init__(self, known: _Optional[bool] = ..., live: _Optional[_Iterable[_Union[LiveSlice, _Mapping]]] = ..., pool_unix: _Optional[float] = ...) -> None: ...

class Slice(_message.Message):
    __slots__ = ("server", "gpu_uuid", "gpu_index", "memory_limit_bytes", "compute_percent", "token", "gpu_name", "usage")
    SERVER_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_PERCENT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    GPU_NAME_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    server: str
    gpu_uuid: str
    gpu_index: int
    memory_limit_bytes: int
    compute_percent: int
    token: str
    gpu_name: str
    usage: SliceUsage
    def __init__(self, server: _Optional[str] = ..., gpu_uuid: _Optional[str] = ..., gpu_index: _Optional[int] = ..., memory_limit_bytes: _Optional[int] = ..., compute_percent: _Optional[int] = ..., token: _Optional[str] = ..., gpu_name: _Optional[str] = ..., usage: _Optional[_Union[SliceUsage, _Mapping]] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("job_key", "user", "account", "slices", "created_unix", "expires_unix", "server_down", "units", "idle_since_unix", "idle")
    JOB_KEY_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    SLICES_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_FIELD_NUMBER: _ClassVar[int]
    SERVER_DOWN_FIELD_NUMBER: _ClassVar[int]
    UNITS_FIELD_NUMBER: _ClassVar[int]
    IDLE_SINCE_UNIX_FIELD_NUMBER: _ClassVar[int]
    IDLE_FIELD_NUMBER: _ClassVar[int]
    job_key: str
    user: str
    account: str
    slices: _containers.RepeatedCompositeFieldContainer[Slice]
    created_unix: float
    expires_unix: float
    server_down: bool
    units: int
    idle_since_unix: float
    idle: bool
    def __init__(self, job_key: _Optional[str] = ..., user: _Optional[str] = ..., account: _Optional[str] = ..., slices: _Optional[_Iterable[_Union[Slice, _Mapping]]] = ..., created_unix: _Optional[float] = ..., expires_unix: _Optional[float] = ..., server_down: _Optional[bool] = ..., units: _Optional[int] = ..., idle_since_unix: _Optional[float] = ..., idle: _Optional[bool] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("job_key", "user", "account", "count", "percent", "memory_bytes", "fraction", "ttl_seconds", "gpu_model", "server", "min_memory_bytes", "isolation", "same_node")
    JOB_KEY_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    PERCENT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    FRACTION_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GPU_MODEL_FIELD_NUMBER: _ClassVar[int]
    SERVER_FIELD_NUMBER: _ClassVar[int]
    MIN_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    ISOLATION_FIELD_NUMBER: _ClassVar[int]
    SAME_NODE_FIELD_NUMBER: _ClassVar[int]
    job_key: str
    user: str
    account: str
    count: int
    percent: int
    memory_bytes: int
    fraction: float
    ttl_seconds: float
    gpu_model: str
    server: str
    min_memory_bytes: int
    isolation: str
    same_node: bool
    def __init__(self, job_key: _Optional[str] = ..., user: _Optional[str] = ..., account: _Optional[str] = ..., count: _Optional[int] = ..., percent: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., fraction: _Optional[float] = ..., ttl_seconds: _Optional[float] = ..., gpu_model: _Optional[str] = ..., server: _Optional[str] = ..., min_memory_bytes: _Optional[int] = ..., isolation: _Optional[str] = ..., same_node: _Optional[bool] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("job_key",)
    JOB_KEY_FIELD_NUMBER: _ClassVar[int]
    job_key: str
    def __init__(self, job_key: _Optional[str] = ...) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("job_key", "ttl_seconds")
    JOB_KEY_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    job_key: str
    ttl_seconds: float
    def __init__(self, job_key: _Optional[str] = ..., ttl_seconds: _Optional[float] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class GetLeaseRequest(_message.Message):
    __slots__ = ("job_key",)
    JOB_KEY_FIELD_NUMBER: _ClassVar[int]
    job_key: str
    def __init__(self, job_key: _Optional[str] = ...) -> None: ...

class ListLeasesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListLeasesReply(_message.Message):
    __slots__ = ("leases",)
    LEASES_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[Lease]
    def __init__(self, leases: _Optional[_Iterable[_Union[Lease, _Mapping]]] = ...) -> None: ...

class GpuStatus(_message.Message):
    __slots__ = ("server", "server_state", "gpu", "allocated_percent", "allocated_memory_bytes", "slices")
    SERVER_FIELD_NUMBER: _ClassVar[int]
    SERVER_STATE_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_PERCENT_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLICES_FIELD_NUMBER: _ClassVar[int]
    server: str
    server_state: str
    gpu: Gpu
    allocated_percent: int
    allocated_memory_bytes: int
    slices: int
    def __init__(self, server: _Optional[str] = ..., server_state: _Optional[str] = ..., gpu: _Optional[_Union[Gpu, _Mapping]] = ..., allocated_percent: _Optional[int] = ..., allocated_memory_bytes: _Optional[int] = ..., slices: _Optional[int] = ...) -> None: ...

class ListGpusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListGpusReply(_message.Message):
    __slots__ = ("gpus",)
    GPUS_FIELD_NUMBER: _ClassVar[int]
    gpus: _containers.RepeatedCompositeFieldContainer[GpuStatus]
    def __init__(self, gpus: _Optional[_Iterable[_Union[GpuStatus, _Mapping]]] = ...) -> None: ...

class ListServersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListServersReply(_message.Message):
    __slots__ = ("servers", "down_after_seconds")
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    DOWN_AFTER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    servers: _containers.RepeatedCompositeFieldContainer[Server]
    down_after_seconds: float
    def __init__(self, servers: _Optional[_Iterable[_Union[Server, _Mapping]]] = ..., down_after_seconds: _Optional[float] = ...) -> None: ...

class RemoveServerRequest(_message.Message):
    __slots__ = ("server",)
    SERVER_FIELD_NUMBER: _ClassVar[int]
    server: str
    def __init__(self, server: _Optional[str] = ...) -> None: ...

class RemoveServerReply(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class SetServerStateRequest(_message.Message):
    __slots__ = ("server", "drained")
    SERVER_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    server: str
    drained: bool
    def __init__(self, server: _Optional[str] = ..., drained: _Optional[bool] = ...) -> None: ...

class Quota(_message.Message):
    __slots__ = ("kind", "name", "limit_units", "used_units")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    LIMIT_UNITS_FIELD_NUMBER: _ClassVar[int]
    USED_UNITS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    name: str
    limit_units: int
    used_units: int
    def __init__(self, kind: _Optional[str] = ..., name: _Optional[str] = ..., limit_units: _Optional[int] = ..., used_units: _Optional[int] = ...) -> None: ...

class SetQuotaRequest(_message.Message):
    __slots__ = ("kind", "name", "limit_units")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    LIMIT_UNITS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    name: str
    limit_units: int
    def __init__(self, kind: _Optional[str] = ..., name: _Optional[str] = ..., limit_units: _Optional[int] = ...) -> None: ...

class ListQuotasRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListQuotasReply(_message.Message):
    __slots__ = ("quotas",)
    QUOTAS_FIELD_NUMBER: _ClassVar[int]
    quotas: _containers.RepeatedCompositeFieldContainer[Quota]
    def __init__(self, quotas: _Optional[_Iterable[_Union[Quota, _Mapping]]] = ...) -> None: ...

class UsageRequest(_message.Message):
    __slots__ = ("since_unix", "until_unix")
    SINCE_UNIX_FIELD_NUMBER: _ClassVar[int]
    UNTIL_UNIX_FIELD_NUMBER: _ClassVar[int]
    since_unix: float
    until_unix: float
    def __init__(self, since_unix: _Optional[float] = ..., until_unix: _Optional[float] = ...) -> None: ...

class UsageRow(_message.Message):
    __slots__ = ("user", "account", "gpu_percent_hours", "leases", "busy_gpu_seconds")
    USER_FIELD_NUMBER: _ClassVar[int]
    ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    GPU_PERCENT_HOURS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    BUSY_GPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    user: str
    account: str
    gpu_percent_hours: float
    leases: int
    busy_gpu_seconds: float
    def __init__(self, user: _Optional[str] = ..., account: _Optional[str] = ..., gpu_percent_hours: _Optional[float] = ..., leases: _Optional[int] = ..., busy_gpu_seconds: _Optional[float] = ...) -> None: ...

class UsageReply(_message.Message):
    __slots__ = ("rows", "since_unix", "until_unix")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    SINCE_UNIX_FIELD_NUMBER: _ClassVar[int]
    UNTIL_UNIX_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[UsageRow]
    since_unix: float
    until_unix: float
    def __init__(self, rows: _Optional[_Iterable[_Union[UsageRow, _Mapping]]] = ..., since_unix: _Optional[float] = ..., until_unix: _Optional[float] = ...) -> None: ...

class CapacityRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CapacityReply(_message.Message):
    __slots__ = ("total_units", "allocated_units", "free_units", "gpus")
    TOTAL_UNITS_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_UNITS_FIELD_NUMBER: _ClassVar[int]
    FREE_UNITS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    total_units: int
    allocated_units: int
    free_units: int
    gpus: int
    def __init__(self, total_units: _Optional[int] = ..., allocated_units: _Optional[int] = ..., free_units: _Optional[int] = ..., gpus: _Optional[int] = ...) -> None: ...

class PoolNameRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolNameReply(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class AdmissionPendingRequest(_message.Message):
    __slots__ = ("job_key_prefix",)
    JOB_KEY_PREFIX_FIELD_NUMBER: _ClassVar[int]
    job_key_prefix: str
    def __init__(self, job_key_prefix: _Optional[str] = ...) -> None: ...

class AdmissionPendingReply(_message.Message):
    __slots__ = ("pending",)
    PENDING_FIELD_NUMBER: _ClassVar[int]
    pending: bool
    def __init__(self, pending: _Optional[bool] = ...) -> None: ...
