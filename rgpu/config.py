"""Configuration shared by every rgpu component, with one documented precedence:

    built-in defaults  <  /etc/rgpu/rgpu.toml (or --config FILE)  <  RGPU_* environment  <  flags

The file is flat TOML; every key has an environment variable RGPU_<KEY in upper case>.
Unknown keys in the file are refused with a message naming them; a value of the wrong type is
refused naming the key and where it came from.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping

from rgpu import validate
from rgpu.errors import ConfigError, InvalidRequest
from rgpu.netaddr import split_host_port

DEFAULT_CONFIG_FILE = Path("/etc/rgpu/rgpu.toml")
DEFAULT_POOL_PORT = 50001
DEFAULT_DISPATCHER_PORT = 55001


@dataclass(frozen=True)
class Settings:
    # Where clients (dispatchers, prologs, rgpu-admin, flexrun) find the pool: HOST:PORT, or several
    # (a TOML list, or comma-separated) for pools sharing one PostgreSQL store: tried in turn.
    pool: str = f"localhost:{DEFAULT_POOL_PORT}"
    # The pool daemon's own listening address.
    listen: str = f"0.0.0.0:{DEFAULT_POOL_PORT}"
    # The name users' MUNGE credentials must carry (the pool answers it to PoolName): "" is
    # HOSTNAME:PORT of the listening pool. Give each pool its own.
    pool_name: str = ""
    # SQLite file holding leases, quotas and servers.
    state: str = "/var/lib/rgpu/pool.db"
    # PostgreSQL instead (postgresql://USER@HOST:PORT/DB): several pool daemons share it; "" : SQLite.
    store_url: str = ""
    # rgpu-poold processes serving `listen` together on the SQLite `state` (SO_REUSEPORT): one per
    # core the pool host gives it. 1: one process.
    pool_processes: int = 1
    secret_file: str = "/etc/rgpu/secret"
    placement: str = "binpack"                  # or "spread"
    heartbeat_interval_seconds: float = 5.0     # told to dispatchers at registration
    down_after_seconds: float = 15.0            # no heartbeat this long: server is down
    reclaim_interval_seconds: float = 5.0       # how often expired leases are reclaimed
    max_slices_per_job: int = 16
    # Ended leases kept for `rgpu-admin usage`: this many days, and at most this many rows (the
    # oldest go first; at most HISTORY_PRUNE_PER_PASS rows a maintenance pass). 0: no limit.
    history_keep_days: float = 30.0
    history_max_rows: int = 1_000_000
    # Lease calls (Allocate, Renew, Release) one user (MUNGE) may make: a burst, then a rate, per
    # pool process. 0 a second: no limit. Daemons and admins (the secret) are not limited.
    user_lease_calls_burst: int = 30
    user_lease_calls_per_second: float = 10.0
    tls_cert_file: str = ""                     # set cert and key to serve gRPC over TLS
    tls_key_file: str = ""
    tls_ca_file: str = ""                       # clients: trust this CA for the pool's cert
    tls_server_name: str = ""                   # clients: expected name in the pool's cert
    # auto: TLS where the files above are set; required (what install-units writes): no plaintext
    # gRPC at all; off: plaintext even with the files (logged as a warning). See rgpu/grpc_tls.py.
    grpc_tls: str = "auto"
    log_level: str = "info"
    # Slurm integration in rgpu-poold (reconciler, license sync, starting jobs that wait for the
    # pool): on wherever Slurm is configured on the pool's host; 0 turns it off.
    slurm_reconcile_interval_seconds: float = 10.0
    slurm_reconcile_grace_seconds: float = 60.0  # a lease without a live job is released after this
    slurm_admission_poll_seconds: float = 2.0    # look for new held rgpu jobs this often (0: off)
    # The node Epilog of an rgpu job waits at most this long for the pool to let go the jobs its
    # room lets start, so that Slurm starts them at the Epilog's completion (0: no wait).
    slurm_epilog_admission_wait_seconds: float = 1.5
    slurm_cluster: str = ""                      # Slurm ClusterName; "" asks `scontrol show config`
    slurm_backend: str = "auto"                  # auto | squeue | pyslurm
    slurm_license_sync: bool = True              # keep the rgpu license reservation in step with capacity
    slurm_keep_room_for_head: bool = False       # admission: younger jobs leave the oldest waiting job's GPUs alone
    # rgpu-admin health --deep: how to reach hosts over SSH, and which client nodes to check.
    ssh_user: str = ""                           # "" : the user running rgpu-admin
    ssh_port: int = 22
    ssh_key_file: str = ""                       # "" : the SSH agent and ~/.ssh's default keys
    ssh_known_hosts_file: str = ""               # "" : ~/.ssh/known_hosts; unknown host keys are refused
    health_client_nodes: str = ""                # comma-separated; "" : Slurm's nodes (sinfo), if any
    health_remote_python: str = "python3"        # the Python rgpu is installed for on the hosts
    # Idle leases: no session and no GPU work this long. 0 turns the check off.
    idle_after_seconds: float = 3600.0
    idle_release: bool = False                   # release idle leases (Bitfusion's auto_release)
    # Prometheus endpoints (HOST:PORT, plain HTTP, path /metrics); "" turns one off.
    metrics_listen: str = ""                     # rgpu-poold's
    dispatcher_metrics_listen: str = ""          # each rgpu-dispatcher's (its --metrics-listen flag wins)
    # The web dashboard served by rgpu-poold (HTTPS when tls_cert_file/tls_key_file are set); "" off.
    dashboard_listen: str = ""
    dashboard_url: str = ""                      # what `rgpu-admin dashboard-url` links to; "" derives it
    # MUNGE socket users' credentials are made and checked with; "" : libmunge's default.
    munge_socket: str = ""
    # Which accounts a MUNGE-authenticated user may charge: "slurm" (Slurm's associations, asked of
    # sacctmgr), "map" (user_accounts below, for sites without slurmdbd) or "off" (any account).
    account_check: str = "slurm"
    # account_check = "map": user -> the accounts they may charge, the first their default, e.g.
    # user_accounts = { alice = ["physics", "chem"], bob = ["bio"] }.
    user_accounts: dict[str, list[str]] = field(default_factory=dict)
    account_cache_seconds: float = 60.0          # how long an answer of sacctmgr is kept per user
    # Leases flexrun -n/-l takes for one run: renewed every third of this while the application
    # runs, so a killed flexrun's lease is reclaimed within this long.
    flexrun_lease_ttl_seconds: float = 60.0
    # rgpu-dispatcher's front door: a session's HELLO must arrive this long after the connection
    # opened; at most this many handshakes in progress, in all and per source address.
    session_hello_deadline_seconds: float = 10.0
    session_handshakes_max: int = 256
    session_handshakes_per_address: int = 16
    # rgpu-dispatcher: sessions one slice (a lease token) may hold at once, per kind; sessions of the
    # whole dispatcher; session opens per slice (a burst, then a rate); see dispatcher/admission.py.
    session_cuda_per_slice: int = 32
    session_nvml_per_slice: int = 16
    session_perf_per_slice: int = 2
    session_perf_max: int = 8
    sessions_max: int = 512
    session_opens_burst: int = 40
    session_opens_per_second: float = 5.0
    # rgpu-dispatcher: an unfinished request frame whose bytes stop coming this long ends its session;
    # a net-perf session idle this long ends.
    session_frame_stall_seconds: float = 30.0
    session_perf_idle_seconds: float = 10.0
    # rgpu-dispatcher: how its GPUs are shared: mps | isolated | exclusive, for all GPUs or per GPU
    # ("0=exclusive,1=isolated"; a bare mode is the default for the rest). See dispatcher/sharing.py.
    gpu_sharing: str = "mps"
    # rgpu-dispatcher, isolated GPUs: a busy session may use the shares its GPU's other sessions leave idle.
    compute_lending: bool = False
    # rgpu-dispatcher: bound of its module image cache (all users together, LRU); 0 turns it off.
    # One PyTorch 2.11 process with cuDNN and cuBLAS loads about 5 GB of fatbins: below that, every
    # process evicts what the next one needs first and the cache serves nothing.
    image_cache_bytes: int = 16 << 30
    # rgpu-dispatcher: what carries its sessions' host<->device copies: auto (UCX when the client
    # offers it), ucx, tcp (remoting/datapath/transport.py). Clients read RGPU_TRANSPORT themselves.
    transport: str = "auto"
    # Data lanes (protocol 12, remoting/native/README.md "Data lanes"): host<->device copies of at least
    # lane_min_bytes striped over `lanes` TCP connections of a session, in chunks of lane_chunk_bytes.
    # Read by applications (flexrun passes the file's values on as RGPU_LANES...; the environment wins).
    # 1: the session's one connection; the client library's default is 8 (RGPU_DEFAULT_LANES).
    lanes: int = 8
    lane_min_bytes: int = 8 << 20
    lane_chunk_bytes: int = 2 << 20
    # SO_SNDBUF/SO_RCVBUF of every data-path socket, in applications (through flexrun) and in the
    # dispatcher's workers; 0: the kernel's autotuning.
    socket_buffer_bytes: int = 4 << 20
    origins: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def origin(self, key: str) -> str:
        return self.origins.get(key, "default")


_TYPES: dict[str, type] = {"str": str, "int": int, "float": float, "bool": bool, "dict[str, list[str]]": dict}
ACCOUNT_CHECKS = ("slurm", "map", "off")
KEYS: dict[str, type] = {f.name: _TYPES[str(f.type)] for f in fields(Settings) if f.name != "origins"}


def env_name(key: str) -> str:
    return "RGPU_" + key.upper()


def pool_addresses(pool: str) -> list[str]:
    """The pool addresses of a `pool` setting, in the order clients try them."""
    return [part.strip() for part in pool.split(",") if part.strip()]


def _user_accounts(key: str, value: Any, source: str) -> dict[str, list[str]]:
    """A map of user -> accounts: a TOML table, or its inline text in the environment."""
    if isinstance(value, str):
        try:
            value = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("config", f"{key} from {source} is not a TOML inline table", str(exc),
                              'write it as { alice = ["physics", "chem"], bob = ["bio"] }') from None
    if not isinstance(value, dict):
        raise ConfigError("config", f"{key} from {source} is not a table", "",
                          'write it as { alice = ["physics", "chem"], bob = ["bio"] }')
    out: dict[str, list[str]] = {}
    for user, accounts in value.items():
        if isinstance(accounts, str):
            accounts = [accounts]
        try:
            validate.name("user", user)
            if not isinstance(accounts, list):
                raise InvalidRequest("config", f"the accounts of {user} are not a list", "", "")
            out[user] = [validate.name("account", a) for a in accounts]
        except InvalidRequest as exc:
            raise ConfigError("config", f"{key} from {source}: {exc.what}", exc.why,
                              'write it as { alice = ["physics", "chem"], bob = ["bio"] }') from None
    return out


def _coerce(key: str, value: Any, source: str) -> Any:
    want = KEYS[key]
    if want is dict:
        return _user_accounts(key, value, source)
    if key == "pool" and isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return ",".join(value)   # pool = ["a:50001", "b:50001"]
    try:
        if want is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if want is int and isinstance(value, float):
            raise ValueError
        if isinstance(value, bool) and want is not bool:
            raise ValueError
        if want is str and not isinstance(value, str):
            raise ValueError
        return want(value)
    except (TypeError, ValueError):
        raise ConfigError("config", f"{key} = {value!r} from {source} is not a {want.__name__}", "",
                          f"fix {key} in {source}") from None


# The data lanes' keys and their bounds (the client library's, remoting/native/src/transport.c).
MAX_LANES = 16
LANE_KEYS = {"lanes": (1, MAX_LANES, "e.g. 4 (1: no lanes)"),
             "lane_min_bytes": (1, 1 << 62, "e.g. 8388608 (8 MiB)"),
             "lane_chunk_bytes": (64 << 10, 64 << 20, "64 KiB to 64 MiB, e.g. 2097152 (2 MiB)"),
             "socket_buffer_bytes": (0, 1 << 30, "0 (the kernel's autotuning) to 1 GiB, e.g. 4194304")}


def check_lanes(settings: Settings) -> None:
    """The data lanes' keys within their bounds, or one line naming the key, its value and source."""
    for key, (lo, hi, example) in LANE_KEYS.items():
        value = getattr(settings, key)
        if not lo <= value <= hi:
            raise ConfigError("config", f"{key} = {value} from {settings.origin(key)} is out of range",
                              f"it must be {lo} to {hi}", f"set {key} to {example}")


def lane_environment(settings: Settings) -> dict[str, str]:
    """RGPU_LANES, RGPU_LANE_MIN_BYTES, ... for an application, from the keys rgpu.toml sets (the
    environment's own values stay; defaults are the client library's)."""
    return {env_name(key): str(getattr(settings, key)) for key in LANE_KEYS
            if settings.origin(key) not in ("default",) and not settings.origin(key).startswith(("$", "--"))}


def load_settings(config_file: str | os.PathLike[str] | None = None,
                  env: Mapping[str, str] | None = None,
                  flags: Mapping[str, Any] | None = None) -> Settings:
    """Merge defaults, file, environment and flags (None-valued flags are ignored)."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}

    explicit = config_file is not None or bool(env.get("RGPU_CONFIG"))
    path = Path(config_file or env.get("RGPU_CONFIG") or DEFAULT_CONFIG_FILE)
    if path.exists() or explicit:
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError("config", f"cannot read {path}", exc.strerror or str(exc),
                              "check the --config path") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("config", f"{path} is not valid TOML", str(exc), "fix the file") from None
        unknown = sorted(set(data) - set(KEYS))
        if unknown:
            raise ConfigError("config", f"unknown keys in {path}: {', '.join(unknown)}",
                              f"known keys: {', '.join(sorted(KEYS))}", "remove or correct them")
        for key, value in data.items():
            values[key] = _coerce(key, value, str(path))
            origins[key] = str(path)

    for key in KEYS:
        name = env_name(key)
        if name in env and env[name] != "":
            values[key] = _coerce(key, env[name], f"${name}")
            origins[key] = f"${name}"

    for key, value in (flags or {}).items():
        if value is None:
            continue
        if key not in KEYS:
            raise ConfigError("config", f"unknown setting {key}", "", "this is a bug in the caller")
        values[key] = _coerce(key, value, f"--{key.replace('_', '-')}")
        origins[key] = f"--{key.replace('_', '-')}"

    settings = replace(Settings(), **values, origins=origins)
    if settings.placement not in ("binpack", "spread"):
        raise ConfigError("config", f"placement {settings.placement!r} from {settings.origin('placement')} is unknown",
                          "", "use binpack or spread")
    if settings.slurm_backend not in ("auto", "squeue", "pyslurm"):
        raise ConfigError("config", f"slurm_backend {settings.slurm_backend!r} from {settings.origin('slurm_backend')} "
                          "is unknown", "", "use auto, squeue or pyslurm")
    if settings.account_check not in ACCOUNT_CHECKS:
        raise ConfigError("config", f"account_check {settings.account_check[:40]!r} from "
                          f"{settings.origin('account_check')} is unknown", "", "use slurm, map or off")
    if settings.account_cache_seconds < 0:
        raise ConfigError("config", "account_cache_seconds must not be negative", "",
                          "set 0 (ask sacctmgr every time) or a positive number of seconds")
    if min(settings.slurm_reconcile_grace_seconds, settings.slurm_reconcile_interval_seconds,
           settings.slurm_admission_poll_seconds, settings.slurm_epilog_admission_wait_seconds) < 0:
        raise ConfigError("config", "slurm_reconcile_*, slurm_admission_poll_seconds and slurm_epilog_admission_wait_seconds must not be negative", "",
                          "set 0 or a positive number of seconds")
    if settings.grpc_tls not in ("auto", "required", "off"):
        raise ConfigError("config", f"grpc_tls {settings.grpc_tls[:40]!r} from {settings.origin('grpc_tls')} is unknown",
                          "", "use required (production), off (plaintext) or auto")
    if bool(settings.tls_cert_file) != bool(settings.tls_key_file):
        raise ConfigError("config", "tls_cert_file and tls_key_file must be set together", "",
                          "set both to serve TLS, or neither")
    for key in ("history_keep_days", "history_max_rows", "user_lease_calls_per_second"):
        if getattr(settings, key) < 0:
            raise ConfigError("config", f"{key} must not be negative", f"it is {getattr(settings, key)} from "
                              f"{settings.origin(key)}", "set 0 (no limit) or a positive number")
    if settings.user_lease_calls_burst < 1:
        raise ConfigError("config", "user_lease_calls_burst must be at least 1", f"it is "
                          f"{settings.user_lease_calls_burst} from {settings.origin('user_lease_calls_burst')}",
                          "set the calls a user may make at once, e.g. 30")
    if settings.idle_after_seconds < 0:
        raise ConfigError("config", "idle_after_seconds must not be negative", "",
                          "set 0 (off) or a positive number of seconds")
    for key in ("metrics_listen", "dispatcher_metrics_listen", "dashboard_listen"):
        value = getattr(settings, key)
        try:
            if value:
                split_host_port(value, what=key, allow_empty_host=True, allow_port_zero=True)
        except InvalidRequest as exc:
            raise ConfigError("config", f"{key} {value!r} from {settings.origin(key)} is not HOST:PORT", exc.why,
                              f"set {key} to an address such as 127.0.0.1:9401, or empty to turn it off") from None
    check_lanes(settings)
    for key in ("heartbeat_interval_seconds", "down_after_seconds", "reclaim_interval_seconds"):
        if getattr(settings, key) <= 0:
            raise ConfigError("config", f"{key} must be positive", f"it is {getattr(settings, key)} from {settings.origin(key)}",
                              "set a positive number of seconds")
    return settings
