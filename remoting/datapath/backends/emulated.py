"""The emulated backend: a device whose memory lives in the worker's host memory.

It exists so that CI, which has no GPU, tests the real client library, protocol, worker, limits
and error paths end to end: allocations, copies, memsets, memory info, device and context
queries (values from the dispatcher's GpuInfo), streams and events, PTX module loads with
parameter layouts parsed from the PTX, function attributes checked as the driver checks them,
tensor maps. Kernel launches are refused with a clear error, except the fake kernels below.

The device is one class made of parts, one module each (a mixin over EmulatedDevice's state):
emulated_device.py (state, current context, capture recording), emulated_contexts.py,
emulated_memory.py, emulated_arrays.py, emulated_streams.py, emulated_modules.py (modules and
launches), emulated_graphs.py; nccl_emulated.py is its NCCL, emulated_nvml.py its NVML.
"""

from __future__ import annotations

from rgpu.remoting.datapath.backends.emulated_contexts import EmulatedContexts
from rgpu.remoting.datapath.backends.emulated_device import EMULATED_DRIVER_VERSION
from rgpu.remoting.datapath.backends.emulated_graphs import EmulatedGraphs
from rgpu.remoting.datapath.backends.emulated_modules import EmulatedModules
from rgpu.remoting.datapath.backends.nccl_emulated import EmulatedNccl


class EmulatedBackend(EmulatedContexts, EmulatedModules, EmulatedGraphs, EmulatedNccl):
    """One emulated GPU for one session (device 0 of the worker); its NCCL is nccl_emulated.py."""

    emulated = True
    driver_version = EMULATED_DRIVER_VERSION
