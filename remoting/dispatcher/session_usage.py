"""What the session server reports of its sessions: metrics, traffic, per-slice usage, and
forgetting the usage folders of ended leases."""

from __future__ import annotations

import shutil

from rgpu.remoting.datapath.backends.base import slice_usage
from rgpu.remoting.datapath.counters import FIELDS as TRAFFIC_FIELDS
from rgpu.remoting.datapath.counters import counters_path, read_counters
from rgpu.remoting.datapath.usage import read_slice_stats
from rgpu.remoting.dispatcher.session_state import SessionRecord, SessionState

from rgpu.live_leases import LiveLeases


class SessionUsage(SessionState):
    """Observations for the metrics and the heartbeat."""

    def observe(self) -> dict:
        """What the metrics need: live sessions with the memory their slice holds, traffic per GPU
        (ended sessions' totals plus live ones' latest counts), session outcomes."""
        with self._lock:
            live = [(r.pid, r.public()) for r in self._sessions.values()]
            traffic = {gpu: dict(counts) for gpu, counts in self._traffic_ended.items()}
            outcomes = dict(self._ended_outcomes)
            accepted, refused = self._accepted, self._refused
        sessions = []
        for pid, rec in live:
            used = slice_usage(self._slice_path(rec["job_key"], rec["slice_number"], rec["gpu_uuid"]))
            sessions.append({**rec, "memory_used_bytes": used})
            counts = read_counters(counters_path(self.counters_dir, pid))
            if counts is not None:
                total = traffic.setdefault(rec["gpu_uuid"], dict.fromkeys(TRAFFIC_FIELDS, 0))
                for name in TRAFFIC_FIELDS:
                    total[name] += counts[name]
        return {"sessions": sessions, "traffic": traffic, "ended": outcomes, "accepted": accepted,
                "refused": refused, "mps": {"running": self.mps.running, "restarts": self.mps.restarts,
                                            "reason": self.mps.reason},
                "faults": {gpu: dict(c) for gpu, c in self._fault_counts.items()},
                "compute_enforcement": self.enforcement, "launch_path": self.launch_path,
                "backend": self.backend}

    def _collect_traffic(self, rec: SessionRecord) -> None:
        """Add an ended worker's final counts to the totals; its counters file goes. Called with
        the lock held, in the same step that drops the session, so no scrape sees the counts
        neither live nor in the totals (a counter must never go down)."""
        path = counters_path(self.counters_dir, rec.pid)
        counts = read_counters(path)
        outcome = ("fault" if rec.ended_by.startswith("a GPU fault") else "revoked" if rec.ended_by
                   else "ok" if rec.popen.returncode == 0 else "failed")
        self._ended_outcomes[outcome] += 1
        if counts is not None:
            total = self._traffic_ended.setdefault(rec.gpu_uuid, dict.fromkeys(TRAFFIC_FIELDS, 0))
            for name in TRAFFIC_FIELDS:
                total[name] += counts[name]
        path.unlink(missing_ok=True)
    def usage(self) -> list[dict]:
        """Per slice that had a CUDA session since this dispatcher started: open sessions, busy
        time, calls, memory high-water mark and in use, last activity (this host's clock)."""
        with self._lock:
            dirs = dict(self._slice_dirs)
            live: dict[tuple[str, int], int] = {}
            for rec in self._sessions.values():
                if rec.mode == "cuda" and not rec.ended_by:
                    live[(rec.job_key, rec.slice_number)] = live.get((rec.job_key, rec.slice_number), 0) + 1
        out = []
        for path, (job_key, number, _issued) in dirs.items():
            stats = read_slice_stats(path)
            sessions = live.get((job_key, number), 0)
            if not stats.sessions_seen and not sessions:
                continue
            out.append({"job_key": job_key, "slice_number": number, "sessions": sessions,
                        "busy_seconds": stats.busy_seconds, "calls": stats.calls,
                        "memory_high_water_bytes": stats.memory_high_water_bytes,
                        "memory_used_bytes": slice_usage(path), "last_active_unix": stats.last_active_unix})
        return out

    def forget_slices(self, live: LiveLeases) -> None:
        """Drop the usage folders of slices whose lease the pool no longer lists (and that run no
        session), so a long-running dispatcher does not report ended leases for ever."""
        with self._lock:
            running = {(r.job_key, r.slice_number) for r in self._sessions.values()}
            gone = [p for p, (job_key, number, issued) in self._slice_dirs.items()
                    if (job_key, number) not in running and live.revoked(job_key, number, issued)]
            for path in gone:
                del self._slice_dirs[path]
        for path in gone:
            shutil.rmtree(path, ignore_errors=True)
