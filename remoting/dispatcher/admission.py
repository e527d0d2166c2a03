"""How many sessions a token may hold and how fast it may open them (pure: no sockets, no clock).

A lease token names one slice (job key, slice number, GPU). Before the session server starts a
worker (or serves a perf session) it asks the ledger: live sessions of that kind for the slice
below its cap, live sessions of the whole dispatcher below theirs, and a token left in the
slice's bucket of session opens. The answer is either an admission (to be given back when the
session ends) or a refusal: one line naming the cap and what to do. Callers pass the time in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rgpu.rate import TokenBucket

KINDS = ("cuda", "nvml", "perf")
LABELS = {"cuda": "CUDA", "nvml": "NVML", "perf": "net-perf"}


@dataclass(frozen=True)
class SessionCaps:
    """Config keys session_*_per_slice, sessions_max, session_opens_* (rgpu.toml)."""
    cuda_per_slice: int = 32      # CUDA sessions of one slice at once (device memory bounds them further)
    nvml_per_slice: int = 16      # NVML (management) sessions of one slice at once
    perf_per_slice: int = 2       # rgpu-admin net-perf sessions of one slice at once
    perf_max: int = 8             # perf sessions of the whole dispatcher (each holds a thread)
    sessions_max: int = 512       # live sessions of every kind on this dispatcher
    opens_burst: int = 40         # session opens of one slice in a burst ...
    opens_per_second: float = 5.0  # ... then this many a second
    # Not caps, but the same settings' family: a frame whose bytes stop coming for this long ends its
    # session (the worker's FrameReader); a perf session idle this long between frames ends.
    frame_stall_s: float = 30.0
    perf_idle_s: float = 10.0

    def per_slice(self, kind: str) -> int:
        return {"cuda": self.cuda_per_slice, "nvml": self.nvml_per_slice, "perf": self.perf_per_slice}[kind]

    def invalid(self) -> str:
        """The first setting that is not a positive number, as 'key = value', else ''."""
        for key, value in (("session_cuda_per_slice", self.cuda_per_slice),
                           ("session_nvml_per_slice", self.nvml_per_slice),
                           ("session_perf_per_slice", self.perf_per_slice), ("session_perf_max", self.perf_max),
                           ("sessions_max", self.sessions_max), ("session_opens_burst", self.opens_burst),
                           ("session_opens_per_second", self.opens_per_second),
                           ("session_frame_stall_seconds", self.frame_stall_s),
                           ("session_perf_idle_seconds", self.perf_idle_s)):
            if not value > 0 or value != value or value == float("inf"):
                return f"{key} = {value!r}"
        return ""


SliceKey = tuple[str, int, str]    # job key, slice number, GPU UUID


@dataclass(frozen=True)
class Admission:
    slice: SliceKey
    kind: str


@dataclass
class SessionLedger:
    """Live sessions per slice and kind, and each slice's bucket of opens. Not thread-safe: the
    session server calls it under its lock."""
    caps: SessionCaps = field(default_factory=SessionCaps)
    live: dict[tuple[SliceKey, str], int] = field(default_factory=dict)
    total: int = 0
    perf: int = 0
    buckets: dict[SliceKey, TokenBucket] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=lambda: {"slice": 0, "dispatcher": 0, "perf": 0, "rate": 0})

    def admit(self, key: SliceKey, kind: str, now: float) -> Admission | str:
        """An Admission (give it back with release()), or the refusal's line."""
        caps = self.caps
        job, number, _gpu = key
        if self.total >= caps.sessions_max:
            self.refused["dispatcher"] += 1
            return (f"rgpu: session: this GPU server runs {self.total} sessions, its limit (sessions_max = "
                    f"{caps.sessions_max}) (retry when sessions end; an admin may raise sessions_max in the "
                    "dispatcher's rgpu.toml)")
        if kind == "perf" and self.perf >= caps.perf_max:
            self.refused["perf"] += 1
            return (f"rgpu: session: this GPU server already runs {self.perf} net-perf sessions, its limit "
                    f"(session_perf_max = {caps.perf_max}) (retry in a minute)")
        cap = caps.per_slice(kind)
        held = self.live.get((key, kind), 0)
        if held >= cap:
            self.refused["slice"] += 1
            return (f"rgpu: session: job {job} slice {number} already holds {held} {LABELS[kind]} "
                    f"sessions on this GPU server, the most one slice may (session_{kind}_per_slice = {cap}) "
                    "(end some of the job's processes or sessions first, or ask an admin to raise the limit)")
        refusal = self.take_open(key, now)
        if refusal:
            return refusal
        self.live[(key, kind)] = held + 1
        self.total += 1
        if kind == "perf":
            self.perf += 1
        return Admission(key, kind)

    def take_open(self, key: SliceKey, now: float) -> str:
        """Charge one open to the slice's bucket (probes too): '' when allowed, else the refusal's line."""
        caps = self.caps
        bucket = self.buckets.get(key)
        if bucket is None:
            self._prune(now)
            bucket = self.buckets[key] = TokenBucket(float(caps.opens_burst), caps.opens_per_second)
        wait = bucket.take(now)
        if wait <= 0:
            return ""
        self.refused["rate"] += 1
        return (f"rgpu: session: job {key[0]} slice {key[1]} opens sessions faster than this GPU server allows "
                f"({caps.opens_burst} at once, then {caps.opens_per_second:g} a second: session_opens_burst, "
                f"session_opens_per_second) (retry in {wait:.1f} s; keep sessions open rather than "
                "reopening them in a loop)")

    def release(self, admission: Admission) -> None:
        slot = (admission.slice, admission.kind)
        left = self.live.get(slot, 0) - 1
        if left > 0:
            self.live[slot] = left
        else:
            self.live.pop(slot, None)
        self.total = max(0, self.total - 1)
        if admission.kind == "perf":
            self.perf = max(0, self.perf - 1)

    def _prune(self, now: float) -> None:
        """Forget full buckets of slices without live sessions (they hold nothing a new one would not)."""
        if len(self.buckets) < 1024:
            return
        busy = {key for key, _kind in self.live}
        for key in [k for k, b in self.buckets.items() if k not in busy and b.full(now)]:
            del self.buckets[key]
