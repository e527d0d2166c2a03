"""Which accounts a user may charge: sacctmgr's command and output (captured from a real slurmdbd,
Slurm 22.05.8: tests/test_munge_auth.py's slurm test runs the real one), the pool's policy (map,
Slurm lookup, cache, fail closed) and the config that sets it. Pure logic, no daemons."""

from __future__ import annotations

from pathlib import Path

import pytest

from rgpu.config import load_settings
from rgpu.errors import ConfigError, InvalidRequest, PermissionDenied, RgpuError
from rgpu.remoting.pool.accounts import AccountPolicy
from rgpu.slurm_plugin.sacctmgr import accounts_command, parse_user_accounts

DATA = Path(__file__).parent / "data"
HOSTILE = ["x" * 100_000, "phys\nics", "a;touch /tmp/rgpu-pwned", "$(id)", "`id`", "a b", "physics,chem",
           "name=root", "-physics", "phys\x00ics", "ph|ysics"]


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text and len(text) < 700, text
    return text


def test_sacctmgr_command_is_one_argument_per_item_and_refuses_odd_user_names() -> None:
    assert accounts_command("alice") == ["sacctmgr", "--noheader", "--parsable2", "show", "user", "withassoc",
                                         "where", "name=alice", "format=defaultaccount,account"]
    assert accounts_command("alice", "rgputest")[-2:] == ["cluster=rgputest", "format=defaultaccount,account"]
    for user in ("", "alice,root", "a=b", "a b", "a;id", "x" * 65, "-alice"):
        with pytest.raises(InvalidRequest) as info:
            accounts_command(user)
        one_line(info.value)


def test_sacctmgr_output_is_read_default_first() -> None:
    captured = (DATA / "sacctmgr-user-withassoc-22.05.8-captured.txt").read_text()
    assert parse_user_accounts(captured) == ("chem", "physics")
    assert parse_user_accounts("") == ()
    assert parse_user_accounts("|\n") == ()                                # no association on this cluster
    assert parse_user_accounts("bio|physics\nbio|chem\nbio|physics\n") == ("physics", "chem")   # default not here
    assert parse_user_accounts("sacctmgr: warning\na|b|c\nb|b\n") == ("b",)  # lines of other shapes ignored


def test_a_map_lets_users_charge_their_own_accounts_only() -> None:
    policy = AccountPolicy("map", {"alice": ["physics", "chem"], "bob": ["bio"]})
    assert policy.account_for("alice", "chem") == "chem"
    assert policy.account_for("alice", "") == "physics"          # none named: the default
    denied = one_line(pytest.raises(PermissionDenied, policy.account_for, "alice", "bio").value)
    assert denied == ("rgpu: pool: alice may not charge account bio (user_accounts in rgpu.toml give alice only: "
                      "physics, chem; name one of those with --account, or leave it out for your default)")
    unknown_user = pytest.raises(PermissionDenied, policy.account_for, "eve", "").value
    assert "may not charge any account" in one_line(unknown_user)


@pytest.mark.parametrize("account", HOSTILE)
def test_hostile_account_names_are_one_line_refusals(account: str) -> None:
    for policy in (AccountPolicy("map", {"alice": ["physics"]}), AccountPolicy("off"),
                   AccountPolicy("slurm", lookup=lambda user: pytest.fail("looked up a hostile request"))):
        with pytest.raises(InvalidRequest) as info:
            policy.account_for("alice", account)
        assert one_line(info.value).startswith("rgpu: request: invalid account ")


def test_off_charges_what_is_asked() -> None:
    assert AccountPolicy("off").account_for("alice", "anything") == "anything"
    assert AccountPolicy("off").account_for("alice", "") == ""


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_slurm_answers_are_kept_for_the_cache_time_and_failures_fail_closed() -> None:
    clock, asked, answer = Clock(), [], {"value": ("chem", "physics")}

    def lookup(user: str) -> tuple[str, ...]:
        asked.append(user)
        if isinstance(answer["value"], Exception):
            raise answer["value"]
        return answer["value"]   # type: ignore[return-value]

    policy = AccountPolicy("slurm", lookup=lookup, cache_seconds=60, clock=clock)
    assert policy.account_for("alice", "") == "chem" and policy.account_for("alice", "physics") == "physics"
    assert asked == ["alice"]
    clock.now += 61
    answer["value"] = RgpuError("sacctmgr", "`sacctmgr ...` exited 1", "Connection refused", "check slurmdbd")
    error = one_line(pytest.raises(RgpuError, policy.account_for, "alice", "").value)
    assert error.startswith("rgpu: pool: cannot check which accounts alice may charge (`sacctmgr ...` exited 1: "
                            "Connection refused; check slurmdbd)")
    pytest.raises(RgpuError, policy.account_for, "bob", "")    # a failure is kept 5 s for everyone
    assert asked == ["alice", "alice"]
    clock.now += 6
    answer["value"] = ()
    no_association = pytest.raises(PermissionDenied, policy.account_for, "bob", "").value
    assert "may not charge any account" in one_line(no_association)
    assert asked == ["alice", "alice", "bob"]


def test_slurm_without_the_account_source_fails_closed() -> None:
    text = one_line(pytest.raises(RgpuError, AccountPolicy("slurm").account_for, "alice", "").value)
    assert "rgpu.account_sources entry point) is not installed" in text


def test_config_reads_the_map_from_toml_and_the_environment(tmp_path: Path) -> None:
    conf = tmp_path / "rgpu.toml"
    conf.write_text('account_check = "map"\nuser_accounts = { alice = ["physics", "chem"], bob = "bio" }\n')
    settings = load_settings(conf, env={})
    assert settings.account_check == "map"
    assert settings.user_accounts == {"alice": ["physics", "chem"], "bob": ["bio"]}
    env = {"RGPU_USER_ACCOUNTS": '{ carol = ["x"] }'}
    assert load_settings(conf, env=env).user_accounts == {"carol": ["x"]}
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    assert load_settings(empty, env={}).account_check == "slurm"    # checked against Slurm unless told otherwise


@pytest.mark.parametrize("text", [
    'account_check = "maybe"',
    'user_accounts = { alice = ["phys;ics"] }',
    'user_accounts = { "al ice" = ["physics"] }',
    'user_accounts = { alice = 3 }',
    'user_accounts = "alice"',
    'account_cache_seconds = -1',
])
def test_bad_account_settings_are_one_line(tmp_path: Path, text: str) -> None:
    conf = tmp_path / "rgpu.toml"
    conf.write_text(text + "\n")
    with pytest.raises(ConfigError) as info:
        load_settings(conf, env={})
    one_line(info.value)


def test_one_sacctmgr_at_a_time_and_a_second_user_is_not_held_behind_a_hung_one() -> None:
    import threading
    from rgpu.errors import Unavailable

    release = threading.Event()
    started = threading.Event()
    calls: list[str] = []

    def lookup(user: str) -> list[str]:
        calls.append(user)
        if user == "slow":
            started.set()
            release.wait(10)
        return ["physics"]

    policy = AccountPolicy("slurm", lookup=lookup, lookup_wait_seconds=0.2)
    first = threading.Thread(target=policy.account_for, args=("slow", ""))
    first.start()
    assert started.wait(5)
    with pytest.raises(Unavailable, match="another user's account lookup"):
        policy.account_for("bob", "")            # refused after the short wait, not after the hang
    release.set()
    first.join(5)
    assert policy.account_for("bob", "") == "physics"
    assert calls == ["slow", "bob"]             # never two sacctmgr at once
