"""Which accounts a user may charge, from Slurm's associations (sacctmgr asks slurmdbd).

Build, run, parse: `accounts_command` builds the argument list (never a shell; the user name is
one argument), `parse_user_accounts` reads `sacctmgr -nP ... format=defaultaccount,account`, and
`user_accounts` runs it through the one subprocess helper. rgpu-poold reaches this through the
`rgpu.account_sources` entry point (`account_source`), not by import.

Captured output (Slurm 22.05, `show user withassoc where name=nobody format=defaultaccount,account`
for a user with associations to physics and chem, default chem):

    chem|physics
    chem|chem

A user with no association on the cluster asked for prints `|` or nothing at all.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from rgpu import validate
from rgpu.errors import InvalidRequest
from rgpu.slurm_plugin.proc import CommandError, run_command
from rgpu.slurm_plugin.scontrol import cluster_name

SACCTMGR_TIMEOUT_SECONDS = 10.0


def accounts_command(user: str, cluster: str = "") -> list[str]:
    """sacctmgr's argument list for the default account and associations of `user` (on `cluster`,
    or on every cluster slurmdbd knows when it is empty)."""
    validate.name("user", user)   # no `,` or `=`: one name, never a list or another option
    argv = ["sacctmgr", "--noheader", "--parsable2", "show", "user", "withassoc", "where", f"name={user}"]
    if cluster:
        validate.name("slurm_cluster", cluster)
        argv.append(f"cluster={cluster}")
    return [*argv, "format=defaultaccount,account"]


def parse_user_accounts(text: str) -> tuple[str, ...]:
    """The accounts of the user (default first, each once) from `accounts_command`'s output.
    The default comes first only when the user has an association to it; lines that are not two
    fields are ignored."""
    default, accounts = "", []
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 2:
            continue
        default = default or fields[0].strip()
        account = fields[1].strip()
        if account and account not in accounts:
            accounts.append(account)
    if default in accounts:
        accounts.remove(default)
        accounts.insert(0, default)
    return tuple(accounts)


def user_accounts(user: str, cluster: str = "", timeout: float = SACCTMGR_TIMEOUT_SECONDS,
                  env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The accounts `user` may charge according to slurmdbd, default first. Raises CommandError
    (sacctmgr missing, failing or silent) or InvalidRequest (a user name sacctmgr cannot take)."""
    done = run_command(accounts_command(user, cluster), component="sacctmgr", timeout=timeout, env=env)
    return parse_user_accounts(done.stdout)


def account_source(settings: Any) -> Callable[[str], tuple[str, ...]]:
    """Entry point `rgpu.account_sources:slurm`: a lookup of a user's accounts for rgpu-poold, on
    the cluster `slurm_cluster` names (empty: `scontrol show config`'s ClusterName, asked once;
    while that fails, so does every lookup: associations of other clusters never count)."""
    known = {"cluster": getattr(settings, "slurm_cluster", "")}

    def lookup(user: str) -> tuple[str, ...]:
        try:
            if not known["cluster"]:
                known["cluster"] = cluster_name()
            return user_accounts(user, known["cluster"])
        except CommandError as exc:
            raise CommandError("sacctmgr", exc.argv, exc.returncode, exc.stdout, exc.stderr,
                               why=exc.why[:300],
                               fix="check that slurmdbd runs and this host's slurm.conf reaches it (and set "
                                   "slurm_cluster); sites without slurmdbd set account_check = \"map\" and "
                                   "user_accounts in rgpu.toml") from None
        except InvalidRequest as exc:
            raise InvalidRequest("sacctmgr", f"cannot ask Slurm for the accounts of {exc.what}", exc.why,
                                 "use a user name Slurm accepts, or account_check = \"map\"") from None

    return lookup
