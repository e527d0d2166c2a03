"""Selection and limits from the environment (RGPU_VISIBLE_DEVICES, RGPU_GPU_DEVICE_MEMORY_LIMIT,
RGPU_SERVER_PORT_MIN/MAX, with Bitfusion's BF_ names as aliases): pure parsing."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from rgpu.remoting.dispatcher.inventory.base import (
    Inventory,
    COMPONENT,
    DEFAULT_PORT_RANGE,
    _shown,
)

from rgpu import validate
from rgpu.errors import ConfigError, InvalidRequest
from rgpu.model import GpuInfo
from rgpu.units import format_bytes, parse_size

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
    port_range: tuple[int, int]            # the session port must lie in it when port_range_source is set
    ignored: tuple[str, ...] = ()          # BF_ variables shadowed by their RGPU_ names
    port_range_source: str = ""            # the variables that set the range; "": not set (any port)


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
        port_range_source=" and ".join(v.name for v in (lookup(env, "SERVER_PORT_MIN"), lookup(env, "SERVER_PORT_MAX"))
                                       if v is not None),
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
