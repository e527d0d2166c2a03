"""The GPUs a dispatcher serves: where they come from, which are selected, how much memory each offers.

Two inventory backends sit behind one small interface (`InventorySource.read() -> Inventory`):

* `NvmlInventory` asks the NVIDIA driver through NVML (`pynvml`, package nvidia-ml-py): per GPU
  name, UUID, index, total memory and compute capability, plus the driver and CUDA versions.
* `StaticInventory` reads a TOML file given with `rgpu-dispatcher --inventory FILE`, for
  development, demos and CPU-only tests. Its GPUs are described, not detected; the dispatcher
  says so in its log and registers with `static_inventory = true`, so `rgpu-admin health` shows it.

Static inventory format (TOML; unknown keys are refused)::

    format = 1                        # optional; the only format so far
    hostname = "demo-gpu-a"           # optional: the host name registered with the pool
    driver_version = "580.82.07"      # required: as nvidia-smi prints it
    cuda_version = "13.0"             # required: the driver's CUDA version, MAJOR.MINOR

    [[gpu]]                           # one table per GPU, 1 to 64 of them
    uuid = "GPU-6f1e...-..."          # required: GPU-... as `nvidia-smi -L` prints, unique
    index = 0                         # required: 0-1023, unique; what RGPU_VISIBLE_DEVICES names
    name = "NVIDIA H100 80GB HBM3"    # required: letters, digits, spaces and . _ ( ) / + -
    memory = "80G"                    # required: "80G", "81559M" (binary units) or bytes as an integer
    compute_capability = "9.0"        # required: a string MAJOR.MINOR

Selection and limits come from the environment (the Bitfusion names are aliases; when both are
set the RGPU_ name wins and the dispatcher logs that the BF_ one was ignored; an empty value
counts as unset):

* `RGPU_VISIBLE_DEVICES` / `BF_VISIBLE_DEVICES`: comma list of GPU indices (NVML order, as
  `nvidia-smi` numbers them) or UUIDs. Unset: every GPU. A name that matches no GPU is an error.
* `RGPU_GPU_DEVICE_MEMORY_LIMIT` / `BF_GPU_DEVICE_MEMORY_LIMIT`: caps each selected GPU's usable
  memory, which is what the pool divides into slices. A size with a unit ("20G", "512M"), a
  percentage of each GPU's memory ("50%"), or a bare number, read as MiB as in Bitfusion's
  recipes ("20480" = 20 GiB). A limit above a GPU's memory leaves that GPU's memory as it is.
* `RGPU_SERVER_PORT_MIN` / `RGPU_SERVER_PORT_MAX` (aliases `BF_SERVER_PORT_MIN` / `_MAX`): the TCP
  port range for data-path connections, default 45201-46225.

Parsing is pure and separate from NVML I/O, so all of it is tested without a GPU.
"""

from __future__ import annotations

import math
import os
import re
import stat
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from rgpu import validate
from rgpu.errors import ConfigError, InvalidRequest, RgpuError
from rgpu.model import GpuInfo
from rgpu.units import format_bytes, parse_size

COMPONENT = "dispatcher"
DEFAULT_PORT_RANGE = (45201, 46225)
INVENTORY_FORMAT = 1
MAX_GPUS = 64
MAX_INDEX = 1023
MAX_INVENTORY_BYTES = 256 * 1024   # a real inventory is a few hundred bytes; refuse anything huge

# Used with fullmatch(): re.match(r"...$") would let a trailing newline through.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._()/+-]{0,95}")
_CC_RE = re.compile(r"[0-9]{1,2}\.[0-9]{1,2}")
_DRIVER_RE = re.compile(r"[0-9][0-9A-Za-z.-]{0,31}")
_CUDA_RE = re.compile(r"[0-9]{1,3}\.[0-9]{1,3}")
_TOP_KEYS = ("format", "hostname", "driver_version", "cuda_version", "gpu")
_GPU_KEYS = ("uuid", "index", "name", "memory", "compute_capability")
_TYPE_NAMES = {str: "a string", int: "an integer"}


def _shown(value: object, limit: int = 60) -> str:
    """repr() keeps hostile values on one line (newlines become \\n); long ones are cut."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- the inventory and its sources -------------------------------------------------------------

@dataclass(frozen=True)
class Inventory:
    """What a backend found: every GPU of the host (before selection and limits)."""

    driver_version: str
    cuda_version: str
    gpus: tuple[GpuInfo, ...]
    static: bool                  # described by a file, not detected through NVML
    hostname: str | None = None   # None: the dispatcher uses the machine's host name


class InventorySource(Protocol):
    backend: str       # the data-path backend that serves these GPUs: "cuda" or "emulated"
    description: str   # for log lines: "NVML" or "static inventory FILE"

    def read(self) -> Inventory: ...


# --- static inventory (pure parsing + one file read) --------------------------------------------

def _inventory_error(source: str, what: str, why: str = "", fix: str = "") -> ConfigError:
    return ConfigError(COMPONENT, f"inventory {source}: {what}", why,
                       fix or "fix the file; examples/README.md documents the format")


def _require(table: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str, source: str) -> Any:
    if key not in table:
        raise _inventory_error(source, f"{where} has no {key}")
    value = table[key]
    # bool is an int in Python; TOML's true/false is never a valid index or size.
    if not isinstance(value, kind) or isinstance(value, bool):
        names = " or ".join(_TYPE_NAMES[k] for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise _inventory_error(source, f"{where}: {key} = {_shown(value)} is not {names}",
                               "write strings in double quotes" if kind is str else "")
    return value


def _refuse_unknown(table: Mapping[str, Any], known: tuple[str, ...], where: str, source: str) -> None:
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise _inventory_error(source, f"unknown keys in {where}: {', '.join(_shown(k, 30) for k in unknown)}",
                               f"known keys: {', '.join(known)}", "remove or correct them")


def _parse_gpu(table: Any, number: int, source: str) -> GpuInfo:
    where = f"[[gpu]] number {number}"
    if not isinstance(table, dict):
        raise _inventory_error(source, f"{where} is not a table", "write each GPU as a [[gpu]] table")
    _refuse_unknown(table, _GPU_KEYS, where, source)
    uuid = _require(table, "uuid", str, where, source)
    try:
        validate.gpu_uuid(uuid)
    except InvalidRequest:
        raise _inventory_error(source, f"{where}: uuid {_shown(uuid)} is not a GPU UUID",
                               "expected GPU- followed by letters, digits and dashes, as `nvidia-smi -L` prints") from None
    index = _require(table, "index", int, where, source)
    if not 0 <= index <= MAX_INDEX:
        raise _inventory_error(source, f"{where}: index {index} is out of range", f"must be 0 to {MAX_INDEX}")
    name = _require(table, "name", str, where, source)
    if not _NAME_RE.fullmatch(name):
        raise _inventory_error(source, f"{where}: name {_shown(name)} is not a GPU model name",
                               "1-96 characters: letters, digits, spaces and . _ ( ) / + -")
    memory = _require(table, "memory", (str, int), where, source)
    try:
        total = parse_size(memory, "memory")
    except InvalidRequest as exc:
        raise _inventory_error(source, f"{where}: memory {_shown(memory)} is not a size",
                               exc.why, "write it like \"80G\" or \"81559M\"") from None
    cc = _require(table, "compute_capability", str, where, source)
    if not _CC_RE.fullmatch(cc):
        raise _inventory_error(source, f"{where}: compute_capability {_shown(cc)} is not MAJOR.MINOR",
                               "e.g. \"9.0\" for H100/H200, \"8.0\" for A100")
    return GpuInfo(uuid=uuid, index=index, name=name, total_memory_bytes=total,
                   usable_memory_bytes=total, compute_capability=cc)


def _refuse_duplicates(gpus: list[GpuInfo], source: str) -> None:
    seen_uuid: dict[str, int] = {}
    seen_index: dict[int, int] = {}
    for number, gpu in enumerate(gpus, 1):
        if gpu.uuid.lower() in seen_uuid:
            raise _inventory_error(source, f"GPUs number {seen_uuid[gpu.uuid.lower()]} and {number} share uuid {gpu.uuid}",
                                   "a UUID names exactly one GPU", "give each [[gpu]] its own uuid")
        if gpu.index in seen_index:
            raise _inventory_error(source, f"GPUs number {seen_index[gpu.index]} and {number} share index {gpu.index}",
                                   "an index names exactly one GPU", "give each [[gpu]] its own index")
        seen_uuid[gpu.uuid.lower()] = number
        seen_index[gpu.index] = number


def parse_inventory(text: str, source: str = "<text>") -> Inventory:
    """Validate a static inventory document; every problem is one ConfigError line naming `source`."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise _inventory_error(source, "is not valid TOML", str(exc)) from None
    _refuse_unknown(data, _TOP_KEYS, "the top level", source)
    fmt = data.get("format", INVENTORY_FORMAT)
    if fmt != INVENTORY_FORMAT or isinstance(fmt, bool):
        raise _inventory_error(source, f"format {_shown(fmt)} is not supported",
                               f"this rgpu reads format {INVENTORY_FORMAT}",
                               "use a file written for this rgpu version")
    hostname = data.get("hostname")
    if hostname is not None and not (isinstance(hostname, str) and validate.HOSTNAME_RE.fullmatch(hostname)):
        raise _inventory_error(source, f"hostname {_shown(hostname)} is not a host name",
                               "letters, digits, dashes and dots")
    driver = _require(data, "driver_version", str, "the top level", source)
    if not _DRIVER_RE.fullmatch(driver):
        raise _inventory_error(source, f"driver_version {_shown(driver)} is not a driver version",
                               "e.g. \"580.82.07\"")
    cuda = _require(data, "cuda_version", str, "the top level", source)
    if not _CUDA_RE.fullmatch(cuda):
        raise _inventory_error(source, f"cuda_version {_shown(cuda)} is not MAJOR.MINOR", "e.g. \"13.0\"")
    tables = data.get("gpu")
    if not isinstance(tables, list) or not tables:
        raise _inventory_error(source, "describes no GPUs", "a dispatcher needs at least one",
                               "add a [[gpu]] table per GPU (examples/inventory-a.toml shows one)")
    if len(tables) > MAX_GPUS:
        raise _inventory_error(source, f"describes {len(tables)} GPUs", f"at most {MAX_GPUS} per dispatcher",
                               "split the GPUs over several dispatchers")
    gpus = [_parse_gpu(table, number, source) for number, table in enumerate(tables, 1)]
    _refuse_duplicates(gpus, source)
    return Inventory(driver_version=driver, cuda_version=cuda, gpus=tuple(gpus), static=True, hostname=hostname)


class StaticInventory:
    backend = "emulated"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.description = f"static inventory {self.path}"

    def read(self) -> Inventory:
        source = str(self.path)
        fix = "check the --inventory path"
        try:
            st = self.path.stat()
            if not stat.S_ISREG(st.st_mode):
                raise _inventory_error(source, "is not a regular file", "", fix)
            if st.st_size > MAX_INVENTORY_BYTES:
                raise _inventory_error(source, f"is {st.st_size} bytes", f"an inventory is at most {MAX_INVENTORY_BYTES}", fix)
            raw = self.path.read_bytes()
        except OSError as exc:
            raise _inventory_error(source, "cannot be read", exc.strerror or type(exc).__name__, fix) from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _inventory_error(source, "is not UTF-8 text", f"byte {exc.start} is not valid UTF-8") from None
        return parse_inventory(text, source)


# --- NVML -------------------------------------------------------------------------------------

def cuda_version_string(version: int) -> str:
    """NVML reports the CUDA driver version as 1000*major + 10*minor (13000 -> "13.0")."""
    return f"{version // 1000}.{(version % 1000) // 10}"


def _text(value: str | bytes) -> str:
    # Older pynvml releases return bytes; current ones return str.
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _no_driver_error(exc: Exception) -> ConfigError:
    return ConfigError(COMPONENT, "no usable NVIDIA driver on this host", f"NVML: {exc}",
                       "install the NVIDIA driver (`nvidia-smi` must work), or pass --inventory FILE "
                       "to serve a static GPU list for development and demos")


class NvmlInventory:
    backend = "cuda"
    description = "NVML"

    def read(self) -> Inventory:
        try:
            import pynvml  # loaded only here, so the static path never touches libnvidia-ml
        except ImportError:
            raise ConfigError(COMPONENT, "cannot read GPUs: the pynvml module is missing",
                              "rgpu needs the nvidia-ml-py package", "pip install nvidia-ml-py") from None

        # Errors that mean "there is no driver to talk to" rather than "the driver failed".
        no_driver = tuple(getattr(pynvml, name) for name in (
            "NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded", "NVMLError_NoPermission")
            if hasattr(pynvml, name))
        try:
            pynvml.nvmlInit()
        except no_driver as exc:
            raise _no_driver_error(exc) from None
        except pynvml.NVMLError as exc:
            raise RgpuError(COMPONENT, "NVML failed to start", str(exc),
                            "check the driver with `nvidia-smi`; see the kernel log (dmesg) for Xid errors") from None
        try:
            return self._query(pynvml)
        except pynvml.NVMLError as exc:
            raise RgpuError(COMPONENT, "NVML query failed", str(exc),
                            "check the GPUs with `nvidia-smi -q`; a GPU that fell off the bus needs a reset") from None
        finally:
            pynvml.nvmlShutdown()

    @staticmethod
    def _query(nvml: Any) -> Inventory:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        get_cuda = getattr(nvml, "nvmlSystemGetCudaDriverVersion_v2", None) or nvml.nvmlSystemGetCudaDriverVersion
        cuda = cuda_version_string(int(get_cuda()))
        gpus = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
            total = int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
            gpus.append(GpuInfo(uuid=_text(nvml.nvmlDeviceGetUUID(handle)), index=index,
                                name=_text(nvml.nvmlDeviceGetName(handle)), total_memory_bytes=total,
                                usable_memory_bytes=total, compute_capability=f"{major}.{minor}"))
        if not gpus:
            raise RgpuError(COMPONENT, "NVML sees no GPUs on this host", "the driver is loaded but lists none",
                            "check `nvidia-smi -L`; run the dispatcher only on GPU nodes")
        return Inventory(driver_version=driver, cuda_version=cuda, gpus=tuple(gpus), static=False)


def open_inventory(path: str | os.PathLike[str] | None) -> InventorySource:
    return StaticInventory(path) if path else NvmlInventory()


# --- selection and limits from the environment (pure) ------------------------------------------

@dataclass(frozen=True)
class EnvValue:
    text: str
    name: str   # the variable it came from, for error messages


@dataclass(frozen=True)
class MemoryLimit:
    """A cap on each GPU's usable memory: a byte count or a percentage of the GPU's memory."""

    source: str
    bytes: int | None = None
    percent: float | None = None

    def usable(self, total: int) -> int:
        if self.percent is not None:
            return max(1, math.floor(total * self.percent / 100))
        assert self.bytes is not None
        return min(total, self.bytes)

    def describe(self) -> str:
        shown = f"{self.percent:g}%" if self.percent is not None else format_bytes(self.bytes or 0)
        return f"{shown} per GPU from ${self.source}"


@dataclass(frozen=True)
class NodeSettings:
    """The dispatcher's environment, parsed."""

    visible: tuple[str, ...] | None        # indices as digit strings, or UUIDs; None: all GPUs
    visible_source: str
    memory_limit: MemoryLimit | None
    port_range: tuple[int, int]
    ignored: tuple[str, ...] = ()          # BF_ variables shadowed by their RGPU_ names


def lookup(env: Mapping[str, str], suffix: str) -> EnvValue | None:
    """RGPU_<suffix>, else the Bitfusion alias BF_<suffix>; empty values count as unset."""
    for name in ("RGPU_" + suffix, "BF_" + suffix):
        text = env.get(name, "")
        if text.strip():
            return EnvValue(text.strip(), name)
    return None


def _env_error(name: str, text: str, why: str, fix: str) -> ConfigError:
    return ConfigError(COMPONENT, f"${name}={_shown(text)} is invalid", why, fix)


def parse_visible_devices(value: EnvValue) -> tuple[str, ...]:
    fix = f"set {value.name} to GPU indices or UUIDs separated by commas, e.g. 0,1 (see `nvidia-smi -L`)"
    items = [item.strip() for item in value.text.split(",")]
    wanted: list[str] = []
    for item in items:
        if not item:
            raise _env_error(value.name, value.text, "it has an empty entry", fix)
        if item.isdigit() and item.isascii():
            item = str(int(item))   # "01" and "1" name the same GPU
        else:
            try:
                validate.gpu_uuid(item)
            except InvalidRequest:
                raise _env_error(value.name, value.text, f"{_shown(item, 40)} is neither an index nor a GPU UUID", fix) from None
        if item.lower() in (w.lower() for w in wanted):
            raise _env_error(value.name, value.text, f"{item} is listed twice", "list each GPU once")
        wanted.append(item)
    return tuple(wanted)


def parse_memory_limit(value: EnvValue) -> MemoryLimit:
    text = value.text
    fix = f"set {value.name} to a size such as 20G, a percentage such as 50%, or MiB as a bare number"
    if text.endswith("%"):
        try:
            percent = float(text[:-1])
        except ValueError:
            raise _env_error(value.name, text, "not a percentage", fix) from None
        if not (math.isfinite(percent) and 0 < percent <= 100):
            raise _env_error(value.name, text, "a percentage must be more than 0 and at most 100", fix)
        return MemoryLimit(source=value.name, percent=percent)
    if text.isdigit() and text.isascii():
        text += "M"   # Bitfusion's recipes give the limit in MiB as a bare number
    try:
        return MemoryLimit(source=value.name, bytes=parse_size(text, value.name))
    except InvalidRequest as exc:
        raise _env_error(value.name, value.text, exc.why, fix) from None


def _parse_port(value: EnvValue | None, default: int) -> int:
    if value is None:
        return default
    if not (value.text.isdigit() and value.text.isascii()) or not 1 <= int(value.text) <= 65535:
        raise _env_error(value.name, value.text, "not a TCP port", f"set {value.name} to a number from 1 to 65535")
    return int(value.text)


def parse_port_range(env: Mapping[str, str]) -> tuple[int, int]:
    low_value, high_value = lookup(env, "SERVER_PORT_MIN"), lookup(env, "SERVER_PORT_MAX")
    low = _parse_port(low_value, DEFAULT_PORT_RANGE[0])
    high = _parse_port(high_value, DEFAULT_PORT_RANGE[1])
    if low > high:
        low_name = low_value.name if low_value else "the default minimum"
        high_name = high_value.name if high_value else "the default maximum"
        raise ConfigError(COMPONENT, f"data-port range {low}-{high} is empty",
                          f"{low_name} ({low}) is above {high_name} ({high})",
                          "set RGPU_SERVER_PORT_MIN to at most RGPU_SERVER_PORT_MAX")
    return low, high


def _ignored_aliases(env: Mapping[str, str]) -> tuple[str, ...]:
    suffixes = ("VISIBLE_DEVICES", "GPU_DEVICE_MEMORY_LIMIT", "SERVER_PORT_MIN", "SERVER_PORT_MAX")
    return tuple(f"BF_{s}" for s in suffixes
                 if env.get(f"RGPU_{s}", "").strip() and env.get(f"BF_{s}", "").strip())


def read_node_settings(env: Mapping[str, str]) -> NodeSettings:
    visible = lookup(env, "VISIBLE_DEVICES")
    limit = lookup(env, "GPU_DEVICE_MEMORY_LIMIT")
    return NodeSettings(
        visible=parse_visible_devices(visible) if visible else None,
        visible_source=visible.name if visible else "",
        memory_limit=parse_memory_limit(limit) if limit else None,
        port_range=parse_port_range(env),
        ignored=_ignored_aliases(env),
    )


def select_gpus(gpus: tuple[GpuInfo, ...], wanted: tuple[str, ...] | None, source: str) -> tuple[GpuInfo, ...]:
    """The GPUs `wanted` names (indices or UUIDs), in inventory order; unknown names are an error."""
    if wanted is None:
        return gpus
    chosen: dict[str, GpuInfo] = {}
    unknown: list[str] = []
    for item in wanted:
        match = next((g for g in gpus if (str(g.index) == item if item.isdigit() else g.uuid.lower() == item.lower())), None)
        if match is None:
            unknown.append(item)
        elif match.uuid in chosen:
            raise ConfigError(COMPONENT, f"${source} selects GPU {match.index} ({match.uuid}) twice",
                              "once by index and once by UUID", f"list each GPU once in {source}")
        else:
            chosen[match.uuid] = match
    if unknown:
        present = ", ".join(f"{g.index}={g.uuid}" for g in gpus)
        raise ConfigError(COMPONENT, f"${source} names GPUs this host does not have: {', '.join(unknown)}",
                          f"its GPUs are {present}", f"fix {source} (indices and UUIDs as `nvidia-smi -L` shows)")
    return tuple(g for g in gpus if g.uuid in chosen)


def apply_memory_limit(gpus: tuple[GpuInfo, ...], limit: MemoryLimit | None) -> tuple[GpuInfo, ...]:
    if limit is None:
        return gpus
    return tuple(replace(g, usable_memory_bytes=limit.usable(g.total_memory_bytes)) for g in gpus)


def served_gpus(inventory: Inventory, node: NodeSettings) -> tuple[GpuInfo, ...]:
    """The GPUs this dispatcher registers: the selection, with each one's usable memory capped."""
    return apply_memory_limit(select_gpus(inventory.gpus, node.visible, node.visible_source), node.memory_limit)
