"""`python -m rgpu.remoting.datapath.perf_ucx --fd N`: a net-perf session over UCX (issue 25).

The dispatcher verified the client's token and hands this process the connection; UCX is never
loaded into the long-lived dispatcher (its memory hooks and progress state stay in a process that
lives for one probe). This process opens UCX with the workers' librgpu-worker.so, connects to the
client's UCX address from HELLO, answers WELCOME with its own address and the transports UCX chose
(or with why it took none), serves the perf frames (perf.serve_perf) and exits. Its one line on
stdout (JSON: bytes moved, transports, why not) is the dispatcher's log line for the session.

RGPU_PERF_SESSION (JSON) says: ucx_library, ucx_peer (hex), memory_limit, compute_percent,
idle_s, limit_s, parent_pid, sessions_keep_tcp (why the dispatcher's CUDA sessions would not take
UCX under its setting, "" when they would).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

from rgpu.remoting.datapath import protocol
from rgpu.remoting.datapath.perf import (PERF_IDLE_S, PERF_SESSION_LIMIT_S, UCX_NOT_TAKEN, UCX_SESSIONS_KEEP_TCP,
                                         UCX_TAKEN, serve_perf)
from rgpu.remoting.datapath.worker.lifeline import tie_to_parent
from rgpu.remoting.datapath.worker.ucx import UcxBroken, UcxLink, UcxUnavailable


def open_link(library: str, peer_hex: str) -> tuple[UcxLink | None, str]:
    """This end's UCX link, connected to the client's worker; or None and why not."""
    try:
        peer = bytes.fromhex(peer_hex)
    except ValueError:
        return None, "the client's UCX address is not hex"
    try:
        link = UcxLink(library)
    except UcxUnavailable as exc:
        return None, f"this GPU node cannot use UCX: {exc}"
    try:
        link.connect(peer)
    except UcxUnavailable as exc:
        link.close()
        return None, f"cannot reach the client's UCX worker: {exc}"
    return link, ""


def description(transports: str, why_not: str, sessions_keep_tcp: str) -> str:
    """WELCOME's description: the UCX transports taken (and why the dispatcher's sessions keep TCP
    all the same, if they do), or why none were."""
    if not transports:
        return "perf session" + UCX_NOT_TAKEN + why_not
    return "perf session" + UCX_TAKEN + transports + (UCX_SESSIONS_KEEP_TCP + sessions_keep_tcp if sessions_keep_tcp else "")


def serve(conn: socket.socket, spec: dict) -> dict:
    """WELCOME, then the perf frames; what the dispatcher logs."""
    link, why = open_link(str(spec.get("ucx_library") or ""), str(spec.get("ucx_peer") or ""))
    transports = (link.carriers() or "ucx") if link is not None else ""
    idle_s = float(spec.get("idle_s") or PERF_IDLE_S)
    if link is not None:
        link.idle_s = min(link.idle_s, idle_s)   # a probe stalled on UCX ends as one stalled on TCP does
    try:
        conn.sendall(protocol.encode_welcome(
            driver_version=0, memory_limit_bytes=int(spec.get("memory_limit", 0)),
            compute_percent=int(spec.get("compute_percent", 0)), flags=protocol.WELCOME_PERF,
            description=description(transports, why, str(spec.get("sessions_keep_tcp") or "")),
            ucx_address=link.address if link is not None else b""))
        moved = serve_perf(conn, float(spec.get("limit_s") or PERF_SESSION_LIMIT_S), idle_s, ucx=link)
    except UcxBroken as exc:
        return {"moved": 0, "transports": transports, "why_not": f"a transfer over UCX failed: {exc}"}
    except OSError as exc:
        return {"moved": 0, "transports": transports, "why_not": f"the client left before WELCOME ({exc})"}
    finally:
        conn.close()
        if link is not None:
            link.close()
    return {"moved": moved, "transports": transports, "why_not": why}


def read_outcome(out: bytes, returncode: int) -> dict:
    """What a helper's stdout says of its session (serve's dict), or what its end says where it wrote
    none: UCX aborts on an address it cannot unpack (an assertion in ucp_address_unpack), so a
    client's garbage ends the helper, never the dispatcher."""
    try:
        return dict(json.loads(out.decode(errors="replace").strip().splitlines()[-1]))
    except (ValueError, IndexError, TypeError):
        how = f"was killed by signal {-returncode}" if returncode < 0 else f"ended with exit code {returncode}"
        return {"moved": 0, "transports": "", "why_not": f"the UCX helper {how} before it finished (a client's "
                                                         "malformed UCX address aborts UCX; its output is above)"}


def transport_words(outcome: dict) -> str:
    """The dispatcher's words for what carried a helper's session: "ucx (tcp/lo)", "tcp; why"."""
    words = f"ucx ({outcome.get('transports')})" if outcome.get("transports") else "tcp"
    return f"{words}; {outcome['why_not']}" if outcome.get("why_not") else words


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rgpu.remoting.datapath.perf_ucx")
    parser.add_argument("--fd", type=int, required=True, help="the token-checked connection")
    args = parser.parse_args(argv)
    spec = json.loads(os.environ.get("RGPU_PERF_SESSION") or "{}")
    tie_to_parent(int(spec.get("parent_pid") or 0))
    outcome = serve(socket.socket(fileno=args.fd), spec)
    sys.stdout.write(json.dumps(outcome) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
