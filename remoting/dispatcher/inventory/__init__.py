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
  port range for data-path connections (an unset end defaults to 45201 or 46225); when set, the
  dispatcher's session port must lie in it (`-p 0` takes a free one there).

Parsing is pure and separate from NVML I/O, so all of it is tested without a GPU.
"""

from rgpu.remoting.dispatcher.inventory.base import (
    DEFAULT_PORT_RANGE,
    Inventory,
    InventorySource,
)
from rgpu.remoting.dispatcher.inventory.node_env import (
    EnvValue,
    MemoryLimit,
    NodeSettings,
    apply_memory_limit,
    parse_memory_limit,
    parse_port_range,
    parse_visible_devices,
    read_node_settings,
    select_gpus,
    served_gpus,
)
from rgpu.remoting.dispatcher.inventory.nvml import NvmlInventory, cuda_version_string
from rgpu.remoting.dispatcher.inventory.static import StaticInventory, parse_inventory

__all__ = ["DEFAULT_PORT_RANGE", "EnvValue", "Inventory", "InventorySource", "MemoryLimit", "NodeSettings", "NvmlInventory",
           "StaticInventory", "apply_memory_limit", "cuda_version_string", "open_inventory", "parse_inventory",
           "parse_memory_limit", "parse_port_range", "parse_visible_devices", "read_node_settings", "select_gpus",
           "served_gpus"]


def open_inventory(path: str | None) -> InventorySource:
    """The static file when one is named, else the driver's view through NVML."""
    return StaticInventory(path) if path else NvmlInventory()
