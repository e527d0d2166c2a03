"""What the worker's handler mixins read of the Worker (loop.py), which owns these attributes."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

from rgpu.remoting.datapath.backends.base import SliceMemory
from rgpu.remoting.datapath.worker.client_handles import ClientEvents, ClientStreams
from rgpu.remoting.datapath.worker.hostcalls import HostCalls
from rgpu.remoting.datapath.worker.image_cache import ImageCache
from rgpu.remoting.datapath.worker.local_memory import ContextReserves
from rgpu.remoting.datapath.worker.module_footprint import ImageFootprints
from rgpu.remoting.datapath.worker.native_loop import NativeLaunches
from rgpu.remoting.datapath.worker.spec import SessionSpec


class HandlerState:
    """Mixed into the Worker (through Handlers), which owns these attributes."""

    sock: socket.socket
    send_lock: threading.Lock
    hostcalls: HostCalls
    backend: Any
    spec: SessionSpec
    memory: SliceMemory | None
    current_ctx: int | None
    vmm_refs: dict[int, int]
    graph_allocs: dict[int, int]
    native_launches: NativeLaunches | None
    image_cache: ImageCache
    footprints: ImageFootprints
    pool_allocs: dict[int, int]
    pool_live: int
    reserves: ContextReserves | None
    admitted: set[int]
    load_steps: dict[str, list[int]] | None = None   # RGPU_WORKER_PROFILE: time per module-load step
    client_events: ClientEvents
    client_streams: ClientStreams
    sent: int                                          # bytes this session sent (loop.py counts them)
    _reply: Callable[[int, int, bytes, str], None]     # the Worker's (loop.py)
    _defer: Callable[[int, str], None]                 # the Worker's: an error for the next synchronising call
    lane_receive_live: bool = False                    # a striped copy is received in the background

