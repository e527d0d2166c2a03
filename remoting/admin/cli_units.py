"""`rgpu-admin install-units`: the systemd units of rgpu-poold and rgpu-dispatcher."""

from __future__ import annotations

from pathlib import Path

import click

from rgpu.remoting.admin.units import DEFAULT_UNIT_DIR, UnitOptions, default_executable, render_units, write_units


@click.command("install-units")
@click.option("--dest", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_UNIT_DIR, show_default=True,
              help="Folder to write the unit files to.")
@click.option("--config", "config_path", default="/etc/rgpu/rgpu.toml", show_default=True,
              help="Config file the daemons read (absolute path).")
@click.option("--poold-user", default="rgpu", show_default=True, help="User rgpu-poold runs as.")
@click.option("--dispatcher-user", default="root", show_default=True,
              help="User rgpu-dispatcher runs as (MPS needs root).")
@click.option("--dispatcher-arg", "dispatcher_args", multiple=True,
              help="Extra argument for rgpu-dispatcher (repeat: --dispatcher-arg=-p --dispatcher-arg=55001).")
@click.option("--poold-bin", help="rgpu-poold executable (default: beside this Python, else on PATH).")
@click.option("--dispatcher-bin", help="rgpu-dispatcher executable (default: beside this Python, else on PATH).")
@click.option("--print", "print_only", is_flag=True, help="Print the units instead of writing them.")
def install_units(dest: Path, config_path: str, poold_user: str, dispatcher_user: str,
                  dispatcher_args: tuple[str, ...], poold_bin: str | None, dispatcher_bin: str | None,
                  print_only: bool) -> None:
    """Write rgpu-poold.service and rgpu-dispatcher.service (KillMode=control-group: session
    workers end with their dispatcher). Then: systemctl daemon-reload; systemctl enable --now
    rgpu-poold (on the pool node) or rgpu-dispatcher (on GPU nodes)."""
    units = render_units(UnitOptions(
        poold=poold_bin or default_executable("rgpu-poold"),
        dispatcher=dispatcher_bin or default_executable("rgpu-dispatcher"),
        config=config_path, poold_user=poold_user, dispatcher_user=dispatcher_user,
        dispatcher_args=dispatcher_args))
    if print_only:
        for name, text in units.items():
            click.echo(f"# {name}\n{text}")
        return
    for path in write_units(units, dest):
        click.echo(f"wrote {path}")
    click.echo("next: systemctl daemon-reload, then `systemctl enable --now rgpu-poold` on the pool node "
               "and `systemctl enable --now rgpu-dispatcher` on each GPU node")
