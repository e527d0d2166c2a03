"""Accepting sessions: the front door's limits, the HELLO read by a deadline, the checks (protocol
version, token, live lease, recovering GPU, caps), data lanes, and the handoff to a worker."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time

from rgpu.remoting.datapath import protocol
from rgpu.remoting.datapath.perf import PERF_SESSION_LIMIT_S, UCX_NOT_TAKEN, serve_perf
from rgpu.remoting.datapath.perf_ucx import read_outcome, transport_words
from rgpu.remoting.datapath.transport import parse_peer_address, worker_choice
from rgpu.remoting.dispatcher.admission import Admission
from rgpu.remoting.dispatcher.front_door import _Pending, door_refusal, door_victim
from rgpu.remoting.dispatcher.lanes import parse_lane_offer, parse_lane_request
from rgpu.remoting.dispatcher.session_state import SessionState, worker_environment

from rgpu import tokens
from rgpu.errors import AuthError
from rgpu.log_limit import held_note


class SessionAccepting(SessionState):
    """The accept loop and each connection's handshake."""

    # ------------------------------------------------------------------ accepting

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, addr = self.listen_socket.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stopping.is_set():
                    return
                self.log.warning("accept failed: %s", exc)
                time.sleep(0.2)
                continue
            pending = self._admit(conn, addr)
            if pending is None:
                continue
            t = threading.Thread(target=self._handshake, args=(pending, addr), name="rgpu-session-hello",
                                 daemon=True)
            t.start()

    def _admit(self, conn: socket.socket, addr: tuple) -> _Pending | None:
        """Take a new connection into the handshakes in progress, or drop it. One source address
        holds at most per_address of them; when all max_handshakes are taken, one gives way as
        _victim_locked says (a client that means it sends HELLO at once, so only connections that
        trickle or idle are ever old). At the per-address cap the address's own idle or stuck
        handshake makes way (door_victim); a handshake whose HELLO has arrived never does.
        A connection closed here, or made to give way, is told it may retry (door_refusal): one
        whose HELLO is merely late (a client descheduled for a few milliseconds) looks idle, and a
        neighbour reconnecting as fast as it is closed can push it out. Nothing here blocks the
        accept loop."""
        host = str(addr[0]) if isinstance(addr, tuple) and addr else str(addr)
        now = time.monotonic()
        per_address = self.front_door.per_address
        victim: _Pending | None = None
        victim_cap: int | None = None    # the cap it made way at: its address's, or None: all sources'
        dropped_cap: int | None = None
        admitted: _Pending | None = None
        with self._door_lock:
            if self._per_host.get(host, 0) >= per_address:
                # The address's slots are full: its oldest idle (or stuck) handshake makes way, so
                # idle connections from a shared node cannot lock its other users out.
                victim = self._evict_locked(door_victim((p for p in self._pending.values() if p.host == host),
                                                        now, 0.0))
                victim_cap = per_address
            if self._per_host.get(host, 0) >= per_address:
                self._dropped["per_address"] += 1
                dropped_cap = per_address
            else:
                if len(self._pending) >= self.max_handshakes and victim is None:
                    victim = self._evict_locked(self._victim_locked(host, now))
                if len(self._pending) < self.max_handshakes:
                    admitted = _Pending(conn, host, now)
                    self._pending[id(conn)] = admitted
                    self._per_host[host] = self._per_host.get(host, 0) + 1
                else:
                    self._dropped["full"] += 1
        if victim is not None:
            # Its thread, woken by the shutdown, closes it.
            self._turn_away(victim.conn, victim.host, victim_cap, close=False)
        if admitted is None:
            self._refused += 1
            self.log.debug("connection from %s dropped: too many handshakes in progress", host)
            self._turn_away(conn, host, dropped_cap)
        return admitted

    def _evict_locked(self, victim: _Pending | None) -> _Pending | None:
        if victim is not None:
            victim.evicted = True
            self._forget_locked(victim)
            self._dropped["evicted"] += 1
        return victim

    def _turn_away(self, conn: socket.socket, host: str, per_address: int | None, *, close: bool = True) -> None:
        """Ends a connection the front door closes unread, saying it may retry (door_refusal; one
        frame into a send buffer nothing was written to, so it does not block the accept loop)."""
        try:
            conn.send(door_refusal(host, per_address, self.max_handshakes), socket.MSG_DONTWAIT)
        except OSError:
            pass
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if close:
            conn.close()

    def _victim_locked(self, host: str, now: float) -> _Pending | None:
        """Whom a new connection from `host` replaces when every slot is taken: first one of the
        source holding the most slots (door_victim's choice), if that is more than the newcomer's
        source would hold with it (so an attacker's many connections give way to another
        address's first); else door_victim's choice of all, at least evict_after_s old; else
        nobody (the newcomer is dropped)."""
        busiest = max(self._per_host, key=self._per_host.__getitem__)
        if self._per_host.get(host, 0) + 1 < self._per_host[busiest]:
            victim = door_victim((p for p in self._pending.values() if p.host == busiest), now, 0.0)
            if victim is not None:
                return victim
        return door_victim(self._pending.values(), now, self.front_door.evict_after_s)

    def _forget_locked(self, pending: _Pending) -> None:
        if self._pending.pop(id(pending.conn), None) is None:
            return
        left = self._per_host.get(pending.host, 1) - 1
        if left > 0:
            self._per_host[pending.host] = left
        else:
            self._per_host.pop(pending.host, None)

    def _read_hello(self, pending: _Pending) -> tuple[int, bytes]:
        """The HELLO frame, read by a deadline counted from the accept: a peer sending a byte
        at a time gains nothing. Raises TimeoutError, ConnectionError or ValueError."""
        deadline = pending.accepted + self.front_door.hello_deadline_s
        first_byte = pending.accepted + self.front_door.first_byte_deadline_s()
        conn = pending.conn

        def exact(n: int) -> bytes:
            buf = bytearray()
            while len(buf) < n:
                left = (deadline if pending.got else first_byte) - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                conn.settimeout(left)
                chunk = conn.recv(n - len(buf))
                if not chunk:
                    raise ConnectionError("connection closed by peer")
                buf += chunk
                pending.got += len(chunk)
            return bytes(buf)

        try:
            length, op, _flags, _seq, _aux, _ctx = protocol.HEADER.unpack(exact(protocol.HEADER_SIZE))
        except struct.error as exc:   # cannot happen with exact(); kept so no struct.error escapes
            raise ValueError(str(exc)) from None
        if length > 64 << 10:
            raise ValueError(f"a HELLO of {length} bytes is larger than allowed (65536)")
        pending.need = protocol.HEADER_SIZE + length
        return op, exact(length) if length else b""

    def _refuse(self, conn: socket.socket, peer: str, message: str) -> None:
        self._refused += 1
        # Anyone who reaches the port decides how often this runs: one line a minute per kind.
        held = self._refusal_log.allow(message.split("(", 1)[0])
        if held is not None:
            self.log.warning("session from %s refused: %s%s", peer, message, held_note(held))
        try:
            conn.sendall(protocol.encode_refuse(message))
        except OSError:
            pass
        conn.close()

    def _handshake(self, pending: _Pending, addr: tuple) -> None:
        conn = pending.conn
        peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) and len(addr) >= 2 else str(addr)
        try:
            op, payload = self._read_hello(pending)
        except TimeoutError:
            with self._door_lock:
                self._dropped["deadline"] += 1
                self._forget_locked(pending)
            conn.settimeout(1.0)
            limit = self.front_door.hello_deadline_s if pending.got else self.front_door.first_byte_deadline_s()
            self._refuse(conn, peer, f"rgpu: session: no HELLO within {limit:g} s of "
                         "connecting (the connection was too slow or idle; check the network, and that the "
                         "client is rgpu's)")
            return
        except (ConnectionError, OSError) as exc:
            with self._door_lock:
                self._forget_locked(pending)
            if pending.evicted:
                self.log.debug("handshake from %s dropped for a newer connection (all slots taken)", peer)
            else:
                # Closed before a whole HELLO: port checks (rgpu-admin health --deep, monitoring) do this.
                self.log.debug("connection from %s closed before its HELLO (%s)", peer, exc)
            conn.close()
            return
        except ValueError as exc:
            with self._door_lock:
                self._forget_locked(pending)
            conn.settimeout(1.0)
            self._refuse(conn, peer, f"rgpu: session: malformed HELLO ({str(exc)[:120]}; "
                         "install the same rgpu version on both sides)")
            return
        with self._door_lock:
            evicted = pending.evicted
            self._forget_locked(pending)
        if evicted:
            # The rest of its HELLO came after the door chose it to make way, and told it to retry:
            # serving it as well could start its session twice.
            self.log.debug("handshake from %s dropped for a newer connection as its HELLO arrived", peer)
            conn.close()
            return
        conn.settimeout(protocol.HELLO_TIMEOUT_S)
        try:
            if op != protocol.OP_HELLO:
                raise ValueError(f"expected HELLO, got frame {op}")
            version = protocol.decode_hello_version(payload)
        except (ValueError, struct.error) as exc:
            self._refuse(conn, peer, f"rgpu: session: malformed HELLO ({str(exc)[:120]}; "
                         "install the same rgpu version on both sides)")
            return
        if version != protocol.PROTOCOL_VERSION:
            self._refuse(conn, peer, protocol.version_mismatch_error(version, protocol.PROTOCOL_VERSION).format())
            return
        try:
            hello = protocol.decode_hello(payload)
        except (ValueError, UnicodeDecodeError, struct.error) as exc:
            self._refuse(conn, peer, f"rgpu: session: malformed HELLO ({str(exc)[:120]}; "
                         "install the same rgpu version on both sides)")
            return
        try:
            claims = tokens.verify(self.secret, hello.token, server=self.advertised, gpu_uuids=set(self.gpus))
        except AuthError as exc:
            self._refuse(conn, peer, str(exc))
            return
        with self._lock:
            heard = self._live is not None
        if not heard:
            # Fail closed: without the pool's list of live leases a released lease's token cannot be
            # told from a live one (a dispatcher restarted while the pool is down).
            self._refuse(conn, peer, "rgpu: session: this dispatcher has not heard from the pool since it started, "
                         "so it cannot tell a released lease's token from a live one (retry in a few seconds; "
                         "check that rgpu-poold runs and that this GPU node reaches it)")
            return
        if self._revoked(claims):
            self._refuse(conn, peer, f"rgpu: session: the lease of job {claims.job_key} (slice {claims.slice_number}) "
                         "was released or reclaimed by the pool, so its token is no longer valid (request new "
                         "slices: rerun the job, or `flexrun -n N -p F`)")
            return
        if hello.flags & protocol.HELLO_LANE:
            self._take_lane(conn, peer, hello)
            return
        gpu = self.gpus[claims.gpu_uuid]
        if gpu.uuid in self.recovering_gpus and not hello.flags & (protocol.HELLO_PERF | protocol.HELLO_NVML):
            self._refuse(conn, peer, f"rgpu: session: GPU {gpu.index} ({gpu.uuid}) of {self.advertised} is recovering "
                         "from a GPU fault that ended the sessions sharing it under MPS (retry in a few seconds)")
            return
        kind = "perf" if hello.flags & protocol.HELLO_PERF else "nvml" if hello.flags & protocol.HELLO_NVML else "cuda"
        key = (claims.job_key, claims.slice_number, claims.gpu_uuid)
        probe = bool(hello.flags & protocol.HELLO_PROBE) and kind != "perf"
        with self._lock:
            admitted = self._ledger.take_open(key, time.monotonic()) if probe else \
                self._ledger.admit(key, kind, time.monotonic())
        if isinstance(admitted, str) and admitted:
            self._refuse(conn, peer, admitted)
            return
        if kind == "perf":
            assert isinstance(admitted, Admission)
            try:
                self._serve_perf(conn, peer, claims, hello)
            finally:
                with self._lock:
                    self._ledger.release(admitted)
            return
        mode = kind
        if probe:
            conn.sendall(protocol.encode_welcome(
                driver_version=0, memory_limit_bytes=claims.memory_limit_bytes,
                compute_percent=claims.compute_percent, flags=0,
                description=f"{gpu.name} slice ready ({self.backend} backend, {self.gpu_enforcement(gpu)})"))
            conn.close()
            return
        assert isinstance(admitted, Admission)
        lanes = self._collect_lanes(peer, hello) if mode == "cuda" else []
        try:
            self._spawn(conn, peer, hello, claims, gpu, mode, admitted, lanes)
        except OSError as exc:
            with self._lock:
                self._ledger.release(admitted)
            self._refuse(conn, peer, f"rgpu: session: cannot start a worker ({exc}; check the dispatcher host)")
            return
        finally:
            for lane in lanes:
                lane.close()   # the worker holds its own copies now
        conn.close()  # the worker holds its own copy now

    def _take_lane(self, conn: socket.socket, peer: str, hello: protocol.Hello) -> None:
        """A data lane (protocol 12), its token verified: handed to the session it names, which
        closes it once its worker holds it; refused when it proves no session's."""
        offer = parse_lane_offer(hello.info)
        conn.settimeout(None)   # blocking, as the worker's C receive expects it
        if offer is None or not self._lanes.offer(offer[0], hello.token, offer[1], conn):
            self._refuse(conn, peer, "rgpu: session: a data lane that belongs to no session being opened (its lane "
                         "key and token match none, or it came too late; the session's copies stay on its own "
                         "connection)")

    def _collect_lanes(self, peer: str, hello: protocol.Hello) -> list[socket.socket]:
        """The session's data lanes when its HELLO asked for some and all of them came in time."""
        request = parse_lane_request(hello.info)
        if request is None:
            return []
        count, key = request
        lanes, late = self._lanes.collect(key, hello.token, count)
        if not lanes:
            self.log.warning("session from %s asked for %d data lanes and %d came within %g s: its copies stay on "
                             "its one connection", peer, count, len(late), self._lanes.wait_s)
            for lane in late:
                lane.close()
        return lanes

    def _serve_perf(self, conn: socket.socket, peer: str, claims: tokens.SliceClaims, hello: protocol.Hello) -> None:
        """rgpu-admin net-perf: this acceptor thread echoes and streams; no worker, no GPU. A client
        that offers UCX gets a helper process that measures UCX too (perf_ucx.py), when this end
        may use it; the thread waits for it, so the session counts against session_perf_max."""
        ucx_peer = parse_peer_address(hello.info)
        why = self._perf_ucx_refusal() if ucx_peer else ""
        if ucx_peer and not why:
            self._serve_perf_ucx(conn, peer, claims, ucx_peer)
            return
        conn.sendall(protocol.encode_welcome(
            driver_version=0, memory_limit_bytes=claims.memory_limit_bytes, compute_percent=claims.compute_percent,
            flags=protocol.WELCOME_PERF, description="perf session" + (UCX_NOT_TAKEN + why if why else "")))
        moved = serve_perf(conn, idle_s=self.caps.perf_idle_s)
        self.log.info("perf session from %s (job %s) moved %d bytes", peer, claims.job_key, moved)

    def _perf_ucx_refusal(self) -> str:
        """Why a perf session here takes no UCX ("": it may)."""
        if self.transport == "tcp":
            return "the dispatcher's transport setting is tcp (rgpu.toml's transport or RGPU_TRANSPORT)"
        if not self.ucx_library:
            return "the dispatcher has no librgpu-worker.so to drive UCX with (see its log)"
        return ""

    def _serve_perf_ucx(self, conn: socket.socket, peer: str, claims: tokens.SliceClaims, ucx_peer: bytes) -> None:
        spec = {"ucx_library": self.ucx_library, "ucx_peer": ucx_peer.hex(), "parent_pid": os.getpid(),
                "memory_limit": claims.memory_limit_bytes, "compute_percent": claims.compute_percent,
                "idle_s": self.caps.perf_idle_s, "limit_s": PERF_SESSION_LIMIT_S,
                "sessions_keep_tcp": worker_choice(self.transport, True, "cuda", self.backend).why}
        env = worker_environment(os.environ)
        env["RGPU_PERF_SESSION"] = json.dumps(spec)
        conn.settimeout(None)
        fd = conn.fileno()
        try:
            # From the spawner thread, as workers are: the helper's parent-death signal (lifeline.py).
            helper = self._spawner.submit(
                subprocess.Popen, [sys.executable, "-m", "rgpu.remoting.datapath.perf_ucx", "--fd", str(fd)],
                pass_fds=[fd], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, close_fds=True).result()
        except OSError as exc:
            self._refuse(conn, peer, f"rgpu: session: cannot start the net-perf UCX helper ({exc}; check the "
                         "dispatcher host)")
            return
        conn.close()   # the helper holds its own copy
        try:
            out, _ = helper.communicate(timeout=PERF_SESSION_LIMIT_S + 30)
        except subprocess.TimeoutExpired:
            helper.kill()
            out, _ = helper.communicate()
        said = read_outcome(out, helper.returncode)
        self.log.info("perf session from %s (job %s) moved %d bytes; transport %s", peer, claims.job_key,
                      int(said.get("moved") or 0), transport_words(said))
