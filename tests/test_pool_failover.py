"""Clients fail over: with several pool addresses, a call that finds its pool unavailable or hung
goes to the next one, within the caller's time budget (connect() is what prologs, flexrun,
rgpu-admin and dispatchers use). Two real pools here, one killed or stopped (SIGSTOP)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from rgpu.config import load_settings, pool_addresses
from rgpu.errors import Unavailable
from rgpu.remoting.pool.client import connect
from tests.daemons import register_servers, stop_process, two_clusters, wait_for

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_pool_setting_takes_a_toml_list_or_commas(tmp_path: Path) -> None:
    config = tmp_path / "rgpu.toml"
    config.write_text('pool = ["a.example:50001", "b.example:50001"]\n')
    assert pool_addresses(load_settings(config, env={}).pool) == ["a.example:50001", "b.example:50001"]
    settings = load_settings(config, env={"RGPU_POOL": "a:1, b:2,"})
    assert pool_addresses(settings.pool) == ["a:1", "b:2"]
    assert pool_addresses(load_settings(config, env={}, flags={"pool": "only:3"}).pool) == ["only:3"]


@pytest.fixture
def two_pools(tmp_path: Path):  # type: ignore[no-untyped-def]
    first, second = two_clusters(tmp_path)   # one cluster secret
    for cluster in (first, second):
        cluster.start_pool()
    yield first, second
    for cluster in (first, second):
        cluster.stop_all()


@pytest.mark.integration
def test_calls_go_to_the_next_pool_when_one_is_killed(two_pools, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    first, second = two_pools
    for cluster in (first, second):
        with cluster.client() as client:
            register_servers(client)
    settings = load_settings(env=first.env(RGPU_POOL=f"{first.pool_address},{second.pool_address}"))
    with connect(settings, timeout=5.0) as client:
        assert client.allocate("job-1", "alice", 1, percent=50).slices
        assert client.address == first.pool_address
        first.pool.kill()                                    # kill -9
        lease = client.allocate("job-2", "alice", 1, percent=50)
        assert lease.slices and client.address == second.pool_address
        assert [lease.job_key for lease in client.list_leases()] == ["job-2"]
    # A client whose first address is already dead starts on the next one.
    with connect(settings, timeout=5.0) as client:
        assert client.get_lease("job-2").job_key == "job-2"


@pytest.mark.integration
def test_a_hung_pool_is_skipped_within_the_callers_timeout(two_pools) -> None:  # type: ignore[no-untyped-def]
    """A stopped pool accepts connections (the kernel does) but never answers: the call times out
    on it (DEADLINE_EXCEEDED) and goes to the next pool, inside the caller's own timeout."""
    first, second = two_pools
    for cluster in (first, second):
        with cluster.client() as client:
            register_servers(client)
    settings = load_settings(env=first.env(RGPU_POOL=f"{first.pool_address},{second.pool_address}"))
    with connect(settings, timeout=4.0) as client:
        assert client.allocate("job-1", "alice", 1, percent=50).slices
        assert client.address == first.pool_address
        stop_process(first.pool.proc.pid)                  # hung: its connection stays open, silent
        try:
            lease = client.allocate("job-2", "alice", 1, percent=50)
            assert lease.slices and client.address == second.pool_address
            # A new client whose first address is the hung pool (connect succeeds, nothing answers).
            with connect(settings, timeout=4.0) as fresh:
                assert fresh.get_lease("job-2").job_key == "job-2"
                assert fresh.address == second.pool_address
            # Both hung or gone: one error within the budget, saying the pool did not answer in time.
            second.pool.kill()
            with connect(settings, timeout=1.0) as fresh, pytest.raises(Unavailable) as caught:
                fresh.capacity()
            assert "no pool daemon answered Capacity within 1 s" in str(caught.value)
            assert first.pool_address in str(caught.value)
        finally:
            os.kill(first.pool.proc.pid, signal.SIGCONT)
        with first.client() as client:                      # the stopped pool resumes where it was
            assert [lease.job_key for lease in client.list_leases()] == ["job-1"]


@pytest.mark.integration
def test_no_pool_answering_is_one_error_naming_every_address(two_pools) -> None:  # type: ignore[no-untyped-def]
    first, second = two_pools
    first.pool.kill()
    second.pool.kill()
    settings = load_settings(env=first.env(RGPU_POOL=f"{first.pool_address},{second.pool_address}"))
    with connect(settings, timeout=1.0) as client, pytest.raises(Unavailable) as caught:
        client.capacity()
    message = str(caught.value)
    assert message.startswith("rgpu: pool: no pool daemon answered Capacity within 1 s")
    assert first.pool_address in message and second.pool_address in message and "\n" not in message


@pytest.mark.integration
def test_a_dispatcher_registers_with_the_next_pool_when_its_pool_dies(two_pools) -> None:  # type: ignore[no-untyped-def]
    first, second = two_pools
    both = f"{first.pool_address},{second.pool_address}"
    first.start_dispatcher(EXAMPLES / "inventory-a.toml", None, "--pool", both)   # the last --pool wins
    with first.client() as client:
        wait_for(lambda: len(client.list_servers().servers) == 1, what="registration with the first pool")
    first.pool.kill()
    with second.client() as client:
        wait_for(lambda: len(client.list_servers().servers) == 1, what="registration with the second pool")
        assert client.allocate("job-1", "alice", 1, percent=50).slices
