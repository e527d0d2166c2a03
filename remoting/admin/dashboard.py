"""`rgpu-admin dashboard-url`: a one-time login link to the pool's web dashboard."""

from __future__ import annotations

import time
from typing import Any

import click

from rgpu import weblogin
from rgpu.errors import ConfigError
from rgpu.secret import load_secret


@click.command("dashboard-url")
@click.pass_obj
def dashboard_url(ctx: Any) -> None:   # rgpu-admin's Context (cli.py imports this module)
    """Print a one-time login link to the web dashboard (valid 5 minutes, signed with the cluster secret)."""
    settings = ctx.settings
    if not settings.dashboard_url and not settings.dashboard_listen:
        raise ConfigError("admin", "the dashboard's address is unknown",
                          "neither dashboard_url nor dashboard_listen is set in this host's rgpu.toml",
                          "set dashboard_listen (as rgpu-poold has it) or dashboard_url")
    click.echo(weblogin.login_url(settings, load_secret(settings.secret_file), time.time()))
