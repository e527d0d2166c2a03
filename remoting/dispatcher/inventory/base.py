"""The inventory a dispatcher serves and the interface its sources share."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

from rgpu.model import GpuInfo

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
