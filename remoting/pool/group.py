"""rgpu-poold --processes N: N pool processes serving one port on one SQLite file.

One Python process uses one core (the GIL), and gRPC's own work per call is most of what the pool
spends. N processes, each a whole pool (PoolCore over the SQLite store in shared mode, store.py),
take the connections of one port between them: the parent reserves the port with SO_REUSEPORT
(bound, never listening: it receives nothing) and each child listens on it with SO_REUSEPORT too,
so the kernel spreads new connections over the children. A daemon that does not set SO_REUSEPORT
(any rgpu-poold with one process) still cannot bind the port while the group holds it.

The parent starts the children with `spawn` (gRPC and fork do not mix), waits until all serve,
then reports the port; a child that dies is logged and started again; SIGTERM stops them all.
Components that must run once (the Slurm integration, the metrics endpoint, the dashboard) run in
child 0 only. The nonces of credentials seen (replays) and the host each dispatcher address is
bound to are shared through `<state>.calls` (call_guards.py). Per process stays, as with several
daemons on one PostgreSQL: the GPU faults of each dispatcher's last heartbeat (shown by health
from whichever process answers).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import queue
import signal
import socket
import threading
import time
from dataclasses import replace
from typing import Any, Callable

from rgpu.config import Settings
from rgpu.errors import ConfigError, InvalidRequest
from rgpu.netaddr import bound_address, split_host_port

log = logging.getLogger("rgpu-poold")

MAX_PROCESSES = 64
START_SECONDS = 60.0
RESTART_DELAY_SECONDS = 1.0


def checked_processes(value: object) -> int:
    """pool_processes as given: a whole number from 1 to MAX_PROCESSES, or a one-line error."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_PROCESSES:
        raise ConfigError("poold", f"pool_processes = {str(value)[:40]!r} is out of range",
                          f"it is the number of pool processes, 1 to {MAX_PROCESSES}",
                          "give one per core the pool host sets aside for rgpu-poold (--processes)")
    return value


def reserve_port(listen: str) -> tuple[socket.socket, str]:
    """Bind (not listen on) `listen` with SO_REUSEPORT; returns the socket and HOST:PORT bound."""
    try:
        host, port = split_host_port(listen, what="listen address", allow_empty_host=True, allow_port_zero=True)
    except InvalidRequest as exc:
        raise ConfigError("poold", f"cannot listen on {listen}", exc.why, "give --listen as HOST:PORT") from None
    bind_host = host.strip("[]") or "0.0.0.0"
    family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
    holder = socket.socket(family, socket.SOCK_STREAM)
    try:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind((bind_host, port))
    except OSError as exc:
        holder.close()
        raise ConfigError("poold", f"cannot listen on {listen}", exc.strerror or str(exc),
                          "pick another --listen address or stop the process holding the port") from None
    bound = holder.getsockname()[1]
    return holder, f"[{bind_host}]:{bound}" if family == socket.AF_INET6 else f"{host or '0.0.0.0'}:{bound}"


PR_SET_PDEATHSIG = 1   # prctl(2)


def die_with_parent() -> None:
    """In a child: SIGTERM when the parent dies (kill -9 included), so no child serves on without
    the parent that restarts its siblings while a new pool starts beside it."""
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):   # not Linux: the check below still catches a parent gone at start
        log.warning("rgpu-poold: this process cannot ask to end with its parent (no prctl)")
    if os.getppid() != parent or parent == 1:   # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def serve_group(settings: Settings, child: Callable[..., None], stop: threading.Event,
                on_ready: Callable[[int], None]) -> None:
    """Run settings.pool_processes children of `child(settings, index, ready_queue)` until `stop`."""
    count = checked_processes(settings.pool_processes)
    holder, listen = reserve_port(settings.listen)
    port = holder.getsockname()[1]
    shared = replace(settings, listen=listen)
    spawn = mp.get_context("spawn")
    ready: Any = spawn.Queue()
    children: dict[int, Any] = {}

    def start(index: int) -> None:
        process = spawn.Process(target=child, args=(shared, index, ready), name=f"rgpu-poold-{index}")
        process.start()
        children[index] = process

    try:
        for index in range(count):
            start(index)
        waiting, deadline = set(range(count)), time.monotonic() + START_SECONDS
        while waiting and not stop.is_set():
            try:
                waiting.discard(ready.get(timeout=0.25))
            except queue.Empty:
                pass
            failed = [i for i in waiting if not children[i].is_alive()]
            if failed or time.monotonic() > deadline:
                why = (f"process {failed[0]} exited with status {children[failed[0]].exitcode}" if failed
                       else f"{len(waiting)} of {count} processes did not start serving in {START_SECONDS:.0f} s")
                raise ConfigError("poold", "the pool's processes did not start", why, "see the lines above for why")
        if stop.is_set():
            return
        log.info("rgpu-poold: %d processes serving on %s, state %s", count, bound_address(listen, port), settings.state)
        on_ready(port)
        while not stop.wait(0.5):
            for index, process in list(children.items()):
                if not process.is_alive() and not stop.is_set():
                    log.error("rgpu-poold: process %d (pid %s) exited with status %s; starting it again",
                              index, process.pid, process.exitcode)
                    time.sleep(RESTART_DELAY_SECONDS)
                    start(index)
    finally:
        for process in children.values():
            if process.is_alive():
                process.terminate()
        for process in children.values():
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        holder.close()
