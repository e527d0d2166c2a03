"""A session's life: open the backend, answer WELCOME or REFUSE, serve, clean up."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from rgpu.remoting.datapath.worker.lifeline import tie_to_parent
from rgpu.remoting.datapath import protocol
from rgpu.remoting.datapath.counters import Publisher, counters_path
from rgpu.remoting.datapath.transport import fallback_line, worker_choice
from rgpu.remoting.datapath.backends.base import NOT_SUPPORTED, CudaError, SliceMemory, context_reserve
from rgpu.remoting.datapath.usage import STATS_SUFFIX, SessionStats
from rgpu.remoting.datapath.worker.faults import SessionFaulted, become_tombstone, default_message, read_verdict
from rgpu.remoting.datapath.worker.loop import Worker
from rgpu.remoting.datapath.worker.spec import SessionSpec
from rgpu.remoting.datapath.worker.lanes import Lanes, LanesUnavailable, size_socket_buffers, socket_buffer_bytes
from rgpu.remoting.datapath.worker.ucx import UcxLink, UcxUnavailable
from rgpu.errors import InvalidRequest
from rgpu.units import format_bytes

log = logging.getLogger("rgpu.worker")


def _make_backend(spec: SessionSpec) -> Any:
    if spec.backend == "emulated":
        from rgpu.remoting.datapath.backends.emulated import EmulatedBackend
        from rgpu.remoting.datapath.backends.emulated_nvml import EmulatedNvml
        if spec.mode == "nvml":
            return EmulatedNvml(spec)
        return EmulatedBackend(spec)
    if spec.backend == "cuda":
        if spec.mode == "nvml":
            from rgpu.remoting.datapath.backends.nvml import RealNvml
            return RealNvml(spec)
        from rgpu.remoting.datapath.backends.cuda import CudaBackend
        return CudaBackend(spec)
    raise CudaError(NOT_SUPPORTED, f"rgpu: worker: unknown backend {spec.backend!r}")


def run_session(sock: socket.socket, spec: SessionSpec, lanes: list[socket.socket] | None = None) -> int:
    started = time.monotonic()
    memory: SliceMemory | None = None
    stats: SessionStats | None = None
    try:
        backend = _make_backend(spec)
        if spec.mode == "cuda":
            memory = SliceMemory(spec.memory_limit, Path(spec.usage_dir) / f"{os.getpid()}.used",
                                 reserve_bytes=context_reserve(spec.backend))
            stats = SessionStats(Path(spec.usage_dir) / f"{os.getpid()}{STATS_SUFFIX}")
    except CudaError as exc:
        log.error("session for job %s slice %d refused: %s", spec.job_key, spec.slice_number, exc.message)
        sock.sendall(protocol.encode_refuse(exc.message))
        return 1
    except Exception as exc:  # noqa: BLE001 - any failure to open the GPU is reported to the client
        message = (f"rgpu: worker: cannot open {spec.gpu_name} ({spec.gpu_uuid}) for the session "
                   f"({exc}; check the GPU node with `nvidia-smi` and the dispatcher's log)")
        log.error("%s\n%s", message, traceback.format_exc())
        sock.sendall(protocol.encode_refuse(message))
        return 1
    ucx, transport_why = _open_ucx(spec)
    lane_link, lanes_why = _open_lanes(spec, lanes or [])
    description = (f"{spec.gpu_name} slice of {format_bytes(spec.memory_limit)}, {spec.compute_percent}% compute "
                   f"({spec.compute_enforcement}{', emulated' if getattr(backend, 'emulated', False) else ''})")
    sock.sendall(protocol.encode_welcome(
        driver_version=getattr(backend, "driver_version", 13000), memory_limit_bytes=spec.memory_limit,
        compute_percent=spec.compute_percent, flags=protocol.WELCOME_EMULATED if getattr(backend, "emulated", False) else 0,
        description=description, ucx_address=ucx.address if ucx is not None else b"",
        lanes=lane_link.count if lane_link is not None else 0))
    log.info("session open: job %s slice %d, %s mode, client %s, transport %s%s", spec.job_key, spec.slice_number,
             spec.mode, spec.client, _transport_words(ucx),
             f", {lane_link.count} data lanes" if lane_link is not None else "")
    if transport_why:
        log.info("%s", fallback_line(transport_why))
    if lanes_why:
        log.warning("%s", lanes_why)
    worker = Worker(sock, backend, spec, memory, stats)
    worker.ucx = ucx
    worker.lanes = lane_link
    if spec.faults_dir:
        _end_on_dispatcher_signal(worker, spec)
    publisher = None
    if spec.counters_dir:
        try:
            publisher = Publisher(counters_path(spec.counters_dir, os.getpid()), worker.counters)
        except OSError as exc:   # the session runs on; only the dispatcher's metrics miss it
            log.warning("cannot publish traffic counters in %s: %s", spec.counters_dir, exc)
    faulted: SessionFaulted | None = None
    try:
        why = worker.serve()
    except SessionFaulted as exc:
        faulted, why = exc, "its GPU context died (see the message above)"
    finally:
        if publisher is not None:
            publisher.stop()
        if worker.lane_receive_live and worker.lanes is not None:
            # A striped copy still received in the background: the client is gone, its lanes end.
            for lane in worker.lanes.socks:
                try:
                    lane.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        try:
            worker.settle_lane_receive(wait=True)
        except Exception as exc:  # noqa: BLE001 - the session is over either way
            log.warning("ending a striped copy received in the background failed: %s", exc)
        if worker.limiter is not None:
            try:
                worker.limiter.close() if faulted is None else worker.limiter.turns.give_back()
            except Exception as exc:  # noqa: BLE001 - the session is over either way
                log.warning("closing the compute limiter failed: %s", exc)
            log.info("compute limiter: %.2f s of GPU turns, held back %.2f s", worker.limiter.busy_s,
                     worker.limiter.held_back_s)
        shared = getattr(worker, "shared_regions", None)
        if shared is not None and faulted is None:   # unregistered while the context lives; unmapped
            shared.close()
        try:
            if faulted is None:   # a dead MPS context is let go by exec below, not torn down call by call
                backend.close()
        except Exception as exc:  # noqa: BLE001 - the session is over either way
            log.warning("closing the backend failed: %s", exc)
        if stats is not None:
            stats.close(memory.high_water if memory is not None else 0)
        if memory is not None:
            memory.close()
        if ucx is not None:
            ucx.close()
        if worker.lanes is not None:
            worker.lanes.close()
    log.info("session closed after %.1f s: %s", time.monotonic() - started, why)
    if faulted is not None:
        become_tombstone(sock.fileno(), faulted.code, faulted.message, spec.faults_dir)
    if worker.hostcalls.active and not getattr(backend, "emulated", False):
        # The driver may still run a host node of a graph the client left queued: its thread would
        # call into an interpreter that is shutting down and hang there (and the driver's exit with
        # it). Everything is closed: end the process now; the driver's resources go with it.
        logging.shutdown()
        os._exit(0)
    return 0


def _transport_words(ucx: UcxLink | None) -> str:
    """How the session's large copies travel, for its `session open` line: "tcp", "ucx", or "ucx
    (posix/memory, cma/memory)" with the UCX transports its endpoint's lanes use."""
    if ucx is None:
        return "tcp"
    carriers = ucx.carriers()
    return f"ucx ({carriers})" if carriers else "ucx"


def _open_ucx(spec: SessionSpec) -> tuple[UcxLink | None, str]:
    """The session's UCX link when the client offered UCX and this end can take it, else None and
    why not ("" where nothing needs saying: an NVML session)."""
    choice = worker_choice(spec.transport, bool(spec.ucx_peer), spec.mode, spec.backend)
    if not choice.try_ucx:
        return None, choice.why if spec.mode == "cuda" else ""
    try:
        link = UcxLink(spec.ucx_library)
    except UcxUnavailable as exc:
        return None, f"this GPU node cannot use UCX: {exc}"
    try:
        link.connect(bytes.fromhex(spec.ucx_peer))
    except (UcxUnavailable, ValueError) as exc:
        link.close()
        return None, f"cannot reach the client's UCX worker: {exc}"
    return link, ""


def _open_lanes(spec: SessionSpec, lanes: list[socket.socket]) -> tuple[Lanes | None, str]:
    """The session's data lanes (protocol 12) when the dispatcher handed it some and the worker's C
    library can drive them, else None and why not ("" when none were asked for)."""
    if not lanes:
        return None, ""
    try:
        return Lanes(spec.ucx_library or spec.launch_library, lanes, spec.frame_stall_s), ""
    except LanesUnavailable as exc:
        for lane in lanes:
            lane.close()
        return None, f"copies of this session stay on its one connection, not on {len(lanes)} data lanes ({exc})"


def _end_on_dispatcher_signal(worker: Worker, spec: SessionSpec) -> None:
    """SIGUSR1 from the dispatcher: another session's fault ended this one's context (faults.py).
    The verdict file says why; an idle worker ends at once, a busy one after its current call."""
    def on_signal(_signum: int, _frame: object) -> None:
        if worker.fault is None:
            gpu = f"GPU {spec.gpu_index} ({spec.gpu_name}, {spec.gpu_uuid}) of {spec.server}"
            worker.fault = SessionFaulted(700, read_verdict(spec.faults_dir, os.getpid()) or default_message(700, gpu))
        if worker.idle:
            raise worker.fault

    signal.signal(signal.SIGUSR1, on_signal)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="rgpu session worker (started by the dispatcher)")
    parser.add_argument("--fd", type=int, required=True, help="the accepted session socket, inherited")
    parser.add_argument("--lanes", default="", help="the session's data lanes (protocol 12): inherited sockets, "
                        "comma-separated")
    args = parser.parse_args(argv)
    try:
        spec = SessionSpec.from_json(os.environ["RGPU_WORKER_SESSION"])
    except InvalidRequest as exc:    # the session server wrote it from a verified token: a bug there
        print(exc.format(), file=sys.stderr)
        return 2
    logging.basicConfig(level=os.environ.get("RGPU_WORKER_LOG_LEVEL", "INFO").upper(),
                        format=f"%(asctime)s rgpu-worker[{os.getpid()}] job={spec.job_key} slice={spec.slice_number} "
                               "%(levelname)s %(message)s")
    tie_to_parent(int(os.environ.get("RGPU_WORKER_PARENT_PID", "0") or 0))
    # A worker that dies of a fatal signal (a fault in the driver or in librgpu-worker.so) leaves the
    # Python stack of each of its threads in the dispatcher's log, beside the dispatcher's line
    # saying which signal ended it: otherwise nothing would say what it was doing.
    faulthandler.enable(all_threads=True)
    sock = socket.socket(fileno=args.fd)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    lanes = [socket.socket(fileno=int(fd)) for fd in args.lanes.split(",") if fd]
    buffer_bytes = socket_buffer_bytes()
    for s in [sock, *lanes]:
        size_socket_buffers(s, buffer_bytes)
    return run_session(sock, spec, lanes)


