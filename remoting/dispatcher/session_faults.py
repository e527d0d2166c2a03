"""GPU faults seen by the session server: the workers' reports decided on (dispatcher/faults.py),
the affected sessions ended, and each GPU recovered once they let go of it."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from rgpu.remoting.datapath.backends.emulated_mps import EMULATED_MPS_FAULT, EMULATED_MPS_LOG
from rgpu.remoting.datapath.worker.faults import RELEASED, REPORTS, VERDICTS
from rgpu.remoting.dispatcher.faults import SETTLE_S, FaultEvent, FaultReport, GpuView, SessionView, decide
from rgpu.remoting.dispatcher.session_state import FAULT_EXIT_GRACE_S, SessionState, read_text_or_empty


class SessionFaults(SessionState):
    """Fault reports, verdicts and recoveries."""

    # ------------------------------------------------------------------ GPU faults

    def _check_faults(self) -> None:
        """Decide on the workers' fault reports (once the reports of one fault have settled), end
        the affected sessions, and recover each GPU once all of them let go of it."""
        reports_dir = self.faults_dir / REPORTS
        files = sorted(reports_dir.glob("*.json"))
        if files:
            newest = max(f.stat().st_mtime for f in files)
            if time.time() - newest >= SETTLE_S:
                self._decide_faults(files)
        if self._recovering:
            self._advance_recoveries()

    def _decide_faults(self, files: list[Path]) -> None:
        reports = []
        for path in files:
            try:
                reports.append(FaultReport.from_dict(json.loads(path.read_text())))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                self.log.warning("ignoring an unreadable GPU fault report %s: %s", path.name, exc)
            path.unlink(missing_ok=True)
        # A worker the dispatcher already ended for a fault may still report it (it met the error in a
        # call before the signal): its verdict is written; it is no new fault.
        # A worker the dispatcher stopped because its lease ended meets CUDA_ERROR_MPS_CLIENT_TERMINATED
        # (or a lost context) by our own doing: that is no fault of the GPU's, and others go on.
        reports = [r for r in reports if r.pid not in self._fault_handled and r.pid not in self._stopped]
        if not reports:
            return
        with self._lock:
            records = {r.pid: r for r in self._sessions.values() if r.mode == "cuda" and r.popen.poll() is None}
        sessions = [SessionView(r.pid, r.gpu_uuid, r.job_key, r.slice_number) for r in records.values()]
        gpus = {u: GpuView(u, g.index, g.name, g.sharing) for u, g in self.gpus.items()}
        if self.backend == "emulated":
            mps_log = "".join(read_text_or_empty(self._gpu_dir(u) / EMULATED_MPS_LOG) for u in self.gpus)
        else:
            mps_log = self.mps.server_log()
        events = decide(reports, sessions, gpus, self.advertised, mps_log)
        reporters = {r.pid for r in reports}
        for event in events:
            for pid, line in event.verdicts.items():
                tmp = self.faults_dir / VERDICTS / f".{pid}.tmp"
                tmp.write_text(line + "\n")
                os.replace(tmp, self.faults_dir / VERDICTS / str(pid))
            self._fault_handled.update(session.pid for session in event.affected)
            for session in event.affected:
                rec = records.get(session.pid)
                if rec is None:
                    continue
                with self._lock:
                    rec.ended_by = f"a GPU fault: {event.summary()}"
                    rec.kill_at = time.monotonic() + FAULT_EXIT_GRACE_S
                if session.pid not in reporters:
                    try:
                        os.kill(session.pid, signal.SIGUSR1)   # worker/session.py ends it with its verdict
                    except OSError:
                        pass
            scope = "cross_tenant" if event.cross_tenant else "own"
            with self._lock:
                counts = self._fault_counts.setdefault(event.gpu.uuid, {"cross_tenant": 0, "own": 0, "sessions": 0})
                counts[scope] += 1
                counts["sessions"] += len(event.affected)
                self.fault_events.append(event)
            self.log.warning("GPU fault: %s", event.summary())
            if event.gpu.sharing == "mps":
                self._recovering.append((event, {s.pid for s in event.affected}))
        self.recovering_gpus = frozenset(e.gpu.uuid for e, _ in self._recovering)

    def _released_pids(self) -> set[int]:
        try:
            return {int(p.name) for p in (self.faults_dir / RELEASED).iterdir() if p.name.isdigit()}
        except OSError:
            return set()

    def _advance_recoveries(self) -> None:
        released = self._released_pids()
        with self._lock:
            alive = {pid for pid, r in self._sessions.items() if r.popen.poll() is None}
        still: list[tuple[FaultEvent, set[int]]] = []
        for event, pids in self._recovering:
            holding = {pid for pid in pids if pid in alive and pid not in released}
            if holding:
                still.append((event, holding))
                continue
            self._recover_gpu(event)
            event.recovered_seconds = max(0.0, time.time() - event.unix)
            self.log.warning("GPU %d (%s) serves new sessions again, %.2f s after the fault", event.gpu.index,
                             event.gpu.uuid, event.recovered_seconds)
        self._recovering = still
        self.recovering_gpus = frozenset(e.gpu.uuid for e, _ in still)

    def _recover_gpu(self, event: FaultEvent) -> None:
        if self.backend == "emulated":
            # The emulated fault domain ends as a replaced MPS server would: clean for new clients.
            (self._gpu_dir(event.gpu.uuid) / EMULATED_MPS_FAULT).unlink(missing_ok=True)
            (self._gpu_dir(event.gpu.uuid) / EMULATED_MPS_LOG).unlink(missing_ok=True)
        else:
            self.mps.recover(f"a fault on GPU {event.gpu.index}")

    def faults(self) -> list[dict]:
        """Recent GPU faults, newest last, for the heartbeat (rgpu-admin health) and status()."""
        with self._lock:
            events = list(self.fault_events)
        return [{"gpu_uuid": e.gpu.uuid, "gpu_index": e.gpu.index, "unix": e.unix, "error": e.error_name,
                 "cross_tenant": e.cross_tenant, "sessions_ended": len(e.affected),
                 "faulting": (f"job {e.faulting.job_key} slice {e.faulting.slice_number}" if e.faulting else ""),
                 "recovered_seconds": e.recovered_seconds} for e in events]
