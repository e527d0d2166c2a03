"""PoolCore's part for dispatchers: registration, heartbeats, drain and removal, down servers,
their GPUs as placement sees them, and the views of GPUs and capacity (rules_types.py says how
PoolCore is put together)."""

from __future__ import annotations

from rgpu import validate
from rgpu.errors import InvalidRequest, NotFound
from rgpu.live_leases import LiveLeases
from rgpu.model import GpuInfo, LeaseRecord, ServerInfo
from rgpu.remoting.pool.placement import GpuSlot
from rgpu.remoting.pool.reservations import reservation_prefix
from rgpu.remoting.pool.rules_types import (MAX_SERVERS, Capacity, CoreParts, GpuStatusRecord, GpuUsage, ServerEntry,
                                            log)


class ServerRules(CoreParts):
    """Dispatchers and their GPUs (mixed into PoolCore)."""

    # -- servers ------------------------------------------------------------------------------
    def state_of(self, entry: ServerEntry, now: float | None = None) -> str:
        if entry.drained:
            return "drained"
        if (self.clock() if now is None else now) - entry.last_heartbeat > self.down_after_seconds:
            return "down"
        return "up"

    def register(self, info: ServerInfo) -> None:
        validate.server_info(info)
        if len({g.uuid for g in info.gpus}) != len(info.gpus):
            raise InvalidRequest("pool", f"server {info.address} reports a GPU UUID twice", "",
                                 "check the dispatcher's inventory")
        with self._change():
            now = self.clock()
            uuids = {g.uuid for g in info.gpus}
            for other in self.servers.values():
                clash = uuids & {g.uuid for g in other.info.gpus}
                if other.info.address != info.address and clash and self.state_of(other, now) != "down":
                    raise InvalidRequest(
                        "pool", f"server {info.address} reports GPU {sorted(clash)[0]}",
                        f"{other.info.address} already serves it",
                        "give the dispatchers disjoint GPU sets (RGPU_VISIBLE_DEVICES)")
            previous = self.servers.get(info.address)
            if previous is None and len(self.servers) >= MAX_SERVERS:
                raise InvalidRequest("pool", f"cannot register server {info.address}",
                                     f"the pool already has {MAX_SERVERS} servers",
                                     "remove gone ones with `rgpu-admin remove-server`")
            held = {s.gpu_uuid for key in self._leases_on.get(info.address, ()) for s in self.leases[key].slices
                    if s.server == info.address}
            missing = held - {g.uuid for g in info.gpus}
            if missing:
                # A registration must not take back GPU shares that leases hold (their jobs run there).
                raise InvalidRequest("pool", f"server {info.address} re-registers without GPU(s) "
                                     f"{', '.join(sorted(missing)[:4])} that live leases hold",
                                     "dropping them would strand those jobs",
                                     "release those leases first (rgpu-admin leases), then restart the dispatcher")
            was_up = previous is not None and self.state_of(previous, now) == "up"
            self.store.upsert_server(info, now)
            drained = previous.drained if previous else False
            self.servers[info.address] = ServerEntry(info, drained, now)
            self._refresh(info.address)
        log.info("rgpu-poold: server %s registered with %d GPU(s)%s", info.address, len(info.gpus),
                 " (static inventory)" if info.static_inventory else "")
        if not was_up:
            self._capacity_changed()

    def heartbeat(self, address: str) -> bool:
        if address not in self.servers:
            self.catch_up()   # registered through another daemon
        with self._lock:
            entry = self.servers.get(address)
            if entry is None:
                return False
            now = self.clock()
            came_back = self.state_of(entry, now) == "down"
            entry.last_heartbeat = now
        self.store.heartbeat(address, now)
        if came_back:
            log.info("rgpu-poold: server %s is back", address)
            self._capacity_changed()
        return True

    def live_slices(self, address: str) -> LiveLeases:
        """The live (unreleased, unexpired) leases' slices on one server, as of now by the pool's
        clock: the dispatcher honours no other token issued before now (rgpu/live_leases.py)."""
        self.catch_up()
        with self._lock:
            now = self.clock()
            leases = [self.leases[key] for key in self._leases_on.get(address, ())]
            return LiveLeases.of(now, ((lease.job_key, number, lease.created_unix)
                                       for lease in leases if not lease.expired(now)
                                       for number, s in enumerate(lease.slices) if s.server == address))

    def find_server(self, name: str) -> ServerEntry:
        with self._lock:
            if name in self.servers:
                return self.servers[name]
            matches = [e for e in self.servers.values() if e.info.hostname == name]
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise NotFound("pool", f"no server {name!r}", "", "see `rgpu-admin health` for the servers")
        raise InvalidRequest("pool", f"{name!r} names {len(matches)} servers", "several dispatchers on that host",
                             "give the address host:port")

    def set_drained(self, name: str, drained: bool) -> ServerEntry:
        with self._change():
            entry = self.find_server(name)
            self.store.set_drained(entry.info.address, drained)
            entry.drained = drained
            self._refresh(entry.info.address)
        log.info("rgpu-poold: server %s %s", entry.info.address, "drained" if drained else "resumed")
        self._capacity_changed()
        return entry

    def remove_server(self, name: str) -> str:
        """Forget a server that is gone for good: it must be down and hold no lease. Returns its address."""
        with self._change():
            entry = self.find_server(name)
            address = entry.info.address
            if self.state_of(entry) != "down":
                raise InvalidRequest("pool", f"server {address} is not down", "it still sends heartbeats",
                                     "stop its rgpu-dispatcher first (or drain it to keep it out of placement)")
            holders = sorted(lease.job_key for lease in self.leases.values()
                             if any(s.server == address for s in lease.slices))
            if holders:
                shown = ", ".join(holders[:5]) + (f" and {len(holders) - 5} more" if len(holders) > 5 else "")
                raise InvalidRequest("pool", f"server {address} still holds slices of {len(holders)} lease(s): {shown}",
                                     "their jobs may still be running",
                                     "release them first (rgpu-admin release-gpus --job-key KEY)")
            self.store.delete_server(address)
            del self.servers[address]
            for key in [k for k in self._usage if k[0] == address]:
                del self._usage[key]
            self._refresh(address)
        log.info("rgpu-poold: server %s removed", address)
        self._capacity_changed()
        return address

    def check_down_servers(self) -> list[str]:
        """Log servers that went down since the last check; return their addresses."""
        now = self.clock()
        went_down = []
        stored = self.store.load_heartbeats()   # heartbeats other daemons took (shared store)
        with self._lock:
            for address, beat in stored.items():
                if address in self.servers:
                    self.servers[address].last_heartbeat = max(self.servers[address].last_heartbeat, beat)
            for entry in self.servers.values():
                down = self.state_of(entry, now) == "down"
                if down and not entry.reported_down:
                    went_down.append(entry.info.address)
                entry.reported_down = down
        for address in went_down:
            log.warning("rgpu-poold: server %s missed heartbeats for %.0f s: marked down",
                        address, self.down_after_seconds)
        if went_down:
            self._capacity_changed()
        return went_down

    # -- leases -------------------------------------------------------------------------------
    def _index_lease(self, lease: LeaseRecord, sign: int) -> None:
        for s in lease.slices:
            usage = self._usage.setdefault((s.server, s.gpu_uuid), GpuUsage())
            usage.percent += sign * s.compute_percent
            usage.memory_bytes += sign * s.memory_limit_bytes
            usage.slices += sign
        for kind, name in (("user", lease.user), ("account", lease.account)):
            if name:
                self._used_units[(kind, name)] = self._used_units.get((kind, name), 0) + sign * lease.units
        for server in {s.server for s in lease.slices}:
            self._refresh(server, {s.gpu_uuid for s in lease.slices if s.server == server})
            holders = self._leases_on.setdefault(server, set())
            if sign > 0:
                holders.add(lease.job_key)
            else:
                holders.discard(lease.job_key)
                if not holders:
                    del self._leases_on[server]
        prefix = reservation_prefix(lease.job_key)
        if prefix is not None:
            keys = self._reserved.setdefault(prefix, set())
            (keys.add if sign > 0 else keys.discard)(lease.job_key)
            if not keys:
                del self._reserved[prefix]
        if sign > 0:
            self.leases[lease.job_key] = lease
        else:
            self.leases.pop(lease.job_key, None)
            for number in range(len(lease.slices)):
                self._tokens.pop((lease.job_key, number), None)

    def _refresh(self, address: str, gpus: set[str] | None = None) -> None:
        """After a server's GPUs, usage or drained state changed: rebuild its slots and index entry
        (given `gpus`, UUIDs whose usage alone changed: only their slots)."""
        cached = self._slot_cache.pop(address, None)
        if gpus is not None and cached is not None:
            self._slot_cache[address] = [self._slot(address, slot.hostname, slot) if slot.uuid in gpus else slot
                                         for slot in cached]
        self._versions[address] = self._versions.get(address, 0) + 1
        entry = self.servers.get(address)
        self._index.set_server(address, None if entry is None or entry.drained else self._server_slots(address))

    def _server_slots(self, address: str) -> list[GpuSlot]:
        slots = self._slot_cache.get(address)
        if slots is None:
            entry = self.servers[address]
            slots = [self._slot(address, entry.info.hostname, gpu) for gpu in entry.info.gpus]
            self._slot_cache[address] = slots
        return slots

    def _slot(self, address: str, hostname: str, gpu: GpuInfo | GpuSlot) -> GpuSlot:
        usage = self._usage.get((address, gpu.uuid)) or GpuUsage()
        return GpuSlot(server=address, hostname=hostname, uuid=gpu.uuid, index=gpu.index, name=gpu.name,
                       usable_memory_bytes=gpu.usable_memory_bytes, allocated_percent=usage.percent,
                       allocated_memory_bytes=usage.memory_bytes, sharing=gpu.sharing)

    def _slots(self, now: float) -> list[GpuSlot]:
        """Placement candidates: the GPUs of servers that are up (drained and down ones excluded)."""
        slots: list[GpuSlot] = []
        for address, entry in self.servers.items():
            if self.state_of(entry, now) == "up":
                slots.extend(self._server_slots(address))
        return slots

    # -- views --------------------------------------------------------------------------------
    def gpu_statuses(self) -> list[GpuStatusRecord]:
        now = self.clock()
        self.catch_up()
        with self._lock:
            out = []
            for address in sorted(self.servers):
                entry = self.servers[address]
                state = self.state_of(entry, now)
                for gpu in sorted(entry.info.gpus, key=lambda g: g.index):
                    usage = self._usage.get((address, gpu.uuid), GpuUsage())
                    out.append(GpuStatusRecord(address, state, gpu, usage.percent, usage.memory_bytes, usage.slices))
            return out

    def gpu_statuses_changed(self, known: dict[str, tuple[str, int]]
                             ) -> list[tuple[str, tuple[str, int], list[GpuStatusRecord] | None]]:
        """Per server (sorted): its (state, version) and its GPUs' statuses, or None where `known`
        already holds that (state, version), so a large listing rebuilds only what changed."""
        now = self.clock()
        out: list[tuple[str, tuple[str, int], list[GpuStatusRecord] | None]] = []
        self.catch_up()
        with self._lock:
            for address in sorted(self.servers):
                entry = self.servers[address]
                key = (self.state_of(entry, now), self._versions.get(address, 0))
                if known.get(address) == key:
                    out.append((address, key, None))
                    continue
                records = []
                for gpu in sorted(entry.info.gpus, key=lambda g: g.index):
                    usage = self._usage.get((address, gpu.uuid), GpuUsage())
                    records.append(GpuStatusRecord(address, key[0], gpu, usage.percent, usage.memory_bytes,
                                                   usage.slices))
                out.append((address, key, records))
        return out

    def capacity(self) -> Capacity:
        now = self.clock()
        self.catch_up()
        with self._lock:
            up_gpus = [(entry.info.address, g.uuid) for entry in self.servers.values()
                       if self.state_of(entry, now) == "up" for g in entry.info.gpus]
            allocated = sum(self._usage.get(key, GpuUsage()).percent for key in up_gpus)
            return Capacity(total_units=100 * len(up_gpus), allocated_units=allocated, gpus=len(up_gpus))
