"""Static inventories: a TOML file given with `rgpu-dispatcher --inventory FILE` (format in
this package's docstring), for development, demos and CPU-only tests."""

from __future__ import annotations

import os
import stat
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rgpu.remoting.dispatcher.inventory.base import (
    Inventory,
    _CC_RE,
    _CUDA_RE,
    _DRIVER_RE,
    _GPU_KEYS,
    _NAME_RE,
    _TOP_KEYS,
    _TYPE_NAMES,
    COMPONENT,
    INVENTORY_FORMAT,
    MAX_GPUS,
    MAX_INDEX,
    MAX_INVENTORY_BYTES,
    _shown,
)

from rgpu import validate
from rgpu.errors import ConfigError, InvalidRequest
from rgpu.model import GpuInfo
from rgpu.units import parse_size

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
