"""How each served GPU is shared (the dispatcher's `gpu_sharing` setting). Pure: no I/O.

    gpu_sharing = "mps"                          # every GPU (the default)
    gpu_sharing = "isolated"                     # every GPU
    gpu_sharing = "0=exclusive,1=isolated"       # by NVML index (or GPU UUID); the rest: mps
    gpu_sharing = "isolated,3=mps"               # a bare mode is the default for unnamed GPUs

Modes (rgpu.model.SHARING_MODES): `mps` runs every session of the GPU as an MPS client held to its
slice's active-thread percentage (one fault domain: NVIDIA documents that a fatal fault in one
client reaches the others); `isolated` runs each session in its own CUDA context without MPS
(time-sliced by the driver, so a fault ends only that context) and the worker's own limiter holds
it to its share (limiter.py); `exclusive` serves whole GPUs only (the pool places nothing smaller).
"""

from __future__ import annotations

from dataclasses import replace

from rgpu.errors import ConfigError
from rgpu.model import SHARING_MODES, GpuInfo

COMPONENT = "dispatcher"


def parse_sharing(text: str, gpus: tuple[GpuInfo, ...], origin: str = "gpu_sharing") -> dict[str, str]:
    """GPU UUID -> sharing mode for every served GPU; ConfigError naming the bad part."""
    default = "mps"
    named: dict[str, str] = {}
    by_index = {str(g.index): g.uuid for g in gpus}
    uuids = {g.uuid for g in gpus}
    seen_default = False
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, mode = part.partition("=")
        mode = (mode if sep else key).strip().lower()
        if mode not in SHARING_MODES:
            raise ConfigError(COMPONENT, f"gpu_sharing {text!r} from {origin}: unknown mode {mode!r}", "",
                              f"use {', '.join(SHARING_MODES)}, alone or as INDEX=MODE (e.g. 0=isolated)")
        if not sep:
            if seen_default:
                raise ConfigError(COMPONENT, f"gpu_sharing {text!r} from {origin} gives two default modes", "",
                                  "give one bare mode at most; name the others' GPUs as INDEX=MODE")
            default, seen_default = mode, True
            continue
        key = key.strip()
        uuid = by_index.get(key) or (key if key in uuids else None)
        if uuid is None:
            raise ConfigError(COMPONENT, f"gpu_sharing {text!r} from {origin} names GPU {key!r}",
                              f"this dispatcher serves GPU(s) {', '.join(sorted(by_index)) or 'none'}",
                              "name a served GPU by its index or UUID")
        if uuid in named:
            raise ConfigError(COMPONENT, f"gpu_sharing {text!r} from {origin} names GPU {key!r} twice", "",
                              "give each GPU one mode")
        named[uuid] = mode
    return {g.uuid: named.get(g.uuid, default) for g in gpus}


def with_sharing(gpus: tuple[GpuInfo, ...], modes: dict[str, str]) -> tuple[GpuInfo, ...]:
    return tuple(replace(g, sharing=modes.get(g.uuid, "mps")) for g in gpus)


def enforcement(sharing: str, mps_running: bool) -> str:
    """How a session's compute share is enforced on a GPU of this mode (shown to clients and admins)."""
    if sharing == "exclusive":
        return "exclusive"
    if sharing == "isolated":
        return "isolated (rgpu limiter)"
    return "mps" if mps_running else "time-slicing"
