"""`rgpu-admin install-units`: the systemd units of rgpu-poold and rgpu-dispatcher, and TLS for
gRPC (the cluster's CA, the pool's certificate, rgpu.toml set to refuse plaintext)."""

from __future__ import annotations

from pathlib import Path

import click

from rgpu.config import Settings, load_settings, pool_addresses
from rgpu.errors import InvalidRequest
from rgpu.grpc_tls import PLAINTEXT_WARNING
from rgpu.netaddr import split_host_port
from rgpu.remoting.admin.config_edit import set_keys
from rgpu.remoting.admin.units import DEFAULT_UNIT_DIR, UnitOptions, default_executable, render_units, write_units

DEFAULT_TLS_DIR = Path("/etc/rgpu/tls")


def _configured(config: Path) -> Settings:
    """What the config file says already (the environment of this shell is not the daemons')."""
    return load_settings(config, env={}) if config.exists() else Settings()


def _pool_hosts(settings: Settings) -> list[str]:
    hosts = []
    for address in pool_addresses(settings.pool):
        try:
            hosts.append(split_host_port(address, what="pool")[0])
        except InvalidRequest:
            continue
    return hosts


def _install_tls(config: Path, tls_dir: Path, names: tuple[str, ...], ca_cert: Path | None, ca_key: Path | None,
                 poold_user: str, plaintext: bool) -> None:
    settings = _configured(config)
    if plaintext:
        set_keys(config, {"grpc_tls": "off"})
        click.echo("warning: " + PLAINTEXT_WARNING.format(component="install-units", origin=config), err=True)
        return
    # cryptography is loaded for this command only: every other rgpu-admin command starts without it.
    from rgpu.remoting.admin.tls_setup import default_names, set_up_tls

    files = set_up_tls(tls_dir, configured_ca=settings.tls_ca_file, names=list(names) or default_names(_pool_hosts(settings)),
                       ca_cert=ca_cert, ca_key=ca_key, poold_user=poold_user)
    values = {"grpc_tls": "required", "tls_ca_file": files.ca_file}
    if files.cert_file:
        values.update(tls_cert_file=files.cert_file, tls_key_file=files.key_file)
    set_keys(config, values)
    for path in files.made:
        click.echo(f"wrote {path}")
    click.echo(f"set {', '.join(sorted(values))} in {config}")
    if files.cert_file:
        click.echo(f"next: copy {config} and {files.ca_file} (not ca.key, not pool.key) to every GPU node, CPU node "
                   "and Slurm controller, then run `rgpu-admin install-units` there")
    else:
        click.echo("this host trusts the pool's CA; it makes no pool certificate (the CA's key is not here)")


@click.command("install-units")
@click.option("--dest", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_UNIT_DIR, show_default=True,
              help="Folder to write the unit files to.")
@click.option("--config", "config_path", default="/etc/rgpu/rgpu.toml", show_default=True,
              help="Config file the daemons read (absolute path); the TLS settings are written there.")
@click.option("--poold-user", default="rgpu", show_default=True, help="User rgpu-poold runs as.")
@click.option("--dispatcher-user", default="root", show_default=True,
              help="User rgpu-dispatcher runs as (MPS needs root).")
@click.option("--dispatcher-arg", "dispatcher_args", multiple=True,
              help="Extra argument for rgpu-dispatcher (repeat: --dispatcher-arg=-p --dispatcher-arg=55001).")
@click.option("--poold-bin", help="rgpu-poold executable (default: beside this Python, else on PATH).")
@click.option("--dispatcher-bin", help="rgpu-dispatcher executable (default: beside this Python, else on PATH).")
@click.option("--tls-dir", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_TLS_DIR, show_default=True,
              help="Folder of the CA certificate and the pool's certificate and key.")
@click.option("--tls-name", "tls_names", multiple=True,
              help="A name (or IP) clients dial the pool by, for its certificate (repeat; default: the hosts of "
                   "`pool` in the config, this host's names, localhost).")
@click.option("--ca-cert", type=click.Path(dir_okay=False, path_type=Path),
              help="The admin's CA certificate (with --ca-key); default: make one, or reuse the one in --tls-dir.")
@click.option("--ca-key", type=click.Path(dir_okay=False, path_type=Path), help="The admin's CA key.")
@click.option("--plaintext", is_flag=True,
              help="Serve and dial gRPC without TLS (grpc_tls = \"off\"; the daemons log a warning). Not for production.")
@click.option("--print", "print_only", is_flag=True, help="Print the units instead of writing them (no TLS set-up).")
def install_units(dest: Path, config_path: str, poold_user: str, dispatcher_user: str,
                  dispatcher_args: tuple[str, ...], poold_bin: str | None, dispatcher_bin: str | None,
                  tls_dir: Path, tls_names: tuple[str, ...], ca_cert: Path | None, ca_key: Path | None,
                  plaintext: bool, print_only: bool) -> None:
    """Write rgpu-poold.service and rgpu-dispatcher.service (KillMode=control-group: session
    workers end with their dispatcher), and set up TLS for gRPC: make (or take, --ca-cert/--ca-key)
    the cluster's CA, make the pool's certificate where the CA's key is, and set grpc_tls =
    "required" with the TLS files in the config, so nothing speaks plaintext gRPC. Then:
    systemctl daemon-reload; systemctl enable --now rgpu-poold (on the pool node) or
    rgpu-dispatcher (on GPU nodes)."""
    units = render_units(UnitOptions(
        poold=poold_bin or default_executable("rgpu-poold"),
        dispatcher=dispatcher_bin or default_executable("rgpu-dispatcher"),
        config=config_path, poold_user=poold_user, dispatcher_user=dispatcher_user,
        dispatcher_args=dispatcher_args))
    if print_only:
        for name, text in units.items():
            click.echo(f"# {name}\n{text}")
        return
    _install_tls(Path(config_path), tls_dir, tls_names, ca_cert, ca_key, poold_user, plaintext)
    for path in write_units(units, dest):
        click.echo(f"wrote {path}")
    click.echo("next: systemctl daemon-reload, then `systemctl enable --now rgpu-poold` on the pool node "
               "and `systemctl enable --now rgpu-dispatcher` on each GPU node")
