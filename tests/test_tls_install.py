"""TLS as a production install sets it up (issue 26, MED 7's rest): `rgpu-admin install-units`
makes the cluster's CA and the pool's certificate and sets rgpu.toml to refuse plaintext gRPC.
Real rgpu-poold, rgpu-dispatcher and rgpu-admin on loopback."""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from rgpu.config import load_settings
from rgpu.errors import ConfigError, Unavailable
from rgpu.remoting.admin.cli import main as admin_main
from rgpu.remoting.admin.config_edit import with_keys
from rgpu.remoting.admin.tls_setup import certificate_names, set_up_tls
from rgpu.remoting.pool.client import PoolClient, connect
from tests.daemons import EXAMPLES, RgpuCluster, wait_for

pytestmark = pytest.mark.integration
ME = pwd.getpwuid(os.getuid()).pw_name   # the pool's user here: its key is chowned to it


def install(config: Path, tls_dir: Path, *args: str) -> str:
    """`rgpu-admin install-units` as an admin runs it, units written to a scratch folder."""
    result = CliRunner().invoke(admin_main, ["install-units", "--dest", str(config.parent / "units"),
                                             "--config", str(config), "--tls-dir", str(tls_dir),
                                             "--poold-bin", "/x/rgpu-poold", "--dispatcher-bin", "/x/rgpu-dispatcher",
                                             "--poold-user", ME, *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def admin(cluster: RgpuCluster, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rgpu.remoting.admin.cli", *args], env=cluster.env(**env),
                          capture_output=True, text=True, timeout=60, check=False)


def test_a_tls_install_serves_the_pool_its_dispatchers_and_admins_end_to_end(cluster: RgpuCluster) -> None:
    config = cluster.root / "rgpu.toml"
    output = install(config, cluster.root / "tls")
    written = tomllib.loads(config.read_text())
    assert written["grpc_tls"] == "required"
    assert written["heartbeat_interval_seconds"] == 0.5          # the admin's settings stay
    assert oct((cluster.root / "tls" / "pool.key").stat().st_mode & 0o777) == "0o600"
    assert oct((cluster.root / "tls" / "ca.key").stat().st_mode & 0o777) == "0o600"
    assert "127.0.0.1" in certificate_names((cluster.root / "tls" / "pool.crt").read_bytes())
    assert "copy" in output and "ca.crt" in output

    cluster.start_pool()
    cluster.start_dispatcher(EXAMPLES / "inventory-a.toml")
    settings = load_settings(config, env=cluster.env())
    with connect(settings) as client:             # the secret holder's client, over TLS from the config
        wait_for(lambda: len(client.list_servers().servers) == 1, what="the dispatcher to register over TLS")
        lease = client.allocate("tls-job", user="alice", count=1, percent=50)
        assert len(lease.slices) == 1
        client.release("tls-job")
    listing = admin(cluster, "list-gpus")
    assert listing.returncode == 0, listing.stderr
    assert "H100" in listing.stdout
    assert "PLAINTEXT" not in cluster.pool.log()


def test_a_tls_pool_refuses_plaintext_clients_and_clients_refuse_plaintext(cluster: RgpuCluster) -> None:
    install(cluster.root / "rgpu.toml", cluster.root / "tls")
    cluster.start_pool()
    with PoolClient(cluster.pool_address, cluster.secret, timeout=2) as plain:   # no CA: plaintext
        with pytest.raises(Unavailable):
            plain.capacity()
    # A host told to require TLS but given no CA does not fall back to plaintext: one line.
    (cluster.root / "bare.toml").write_text('grpc_tls = "required"\n')
    refused = admin(cluster, "list-gpus", RGPU_CONFIG=str(cluster.root / "bare.toml"))
    assert refused.returncode != 0
    assert refused.stderr.strip().splitlines() == [refused.stderr.strip()]
    assert "plaintext gRPC is refused" in refused.stderr and "tls_ca_file is not set" in refused.stderr


def test_a_client_refuses_a_pool_whose_certificate_another_ca_signed(cluster: RgpuCluster, tmp_path: Path) -> None:
    install(cluster.root / "rgpu.toml", cluster.root / "tls")
    other = RgpuCluster(tmp_path / "other")
    try:
        other.write_config(heartbeat_interval_seconds=0.5)
        install(other.root / "rgpu.toml", other.root / "tls")      # its own CA
        other.start_pool()
        ours = load_settings(cluster.root / "rgpu.toml", env={"RGPU_POOL": other.pool_address,
                                                              "RGPU_SECRET_FILE": str(cluster.secret_file)})
        with connect(ours, timeout=3) as client:
            with pytest.raises(Unavailable):
                client.capacity()
        assert "refused /rgpu.v1.Pool" not in other.pool.log()   # nothing reached the pool's calls
    finally:
        other.stop_all()


def test_a_production_pool_without_its_certificate_does_not_serve(cluster: RgpuCluster, tmp_path: Path) -> None:
    (cluster.root / "rgpu.toml").write_text('grpc_tls = "required"\n')
    run = subprocess.run([sys.executable, "-m", "rgpu.remoting.pool.daemon", "--listen", "127.0.0.1:0",
                          "--state", str(tmp_path / "x.db")], env=cluster.env(), capture_output=True, text=True,
                         timeout=60)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert "Traceback" not in run.stderr
    assert last.startswith("rgpu: poold: plaintext gRPC is refused") and "install-units" in last


def test_the_plaintext_opt_out_is_written_and_logged(cluster: RgpuCluster) -> None:
    result = CliRunner().invoke(admin_main, ["install-units", "--dest", str(cluster.root / "units"),
                                             "--config", str(cluster.root / "rgpu.toml"), "--plaintext",
                                             "--poold-bin", "/x/p", "--dispatcher-bin", "/x/d", "--poold-user", ME])
    assert result.exit_code == 0 and "PLAINTEXT" in result.output
    assert tomllib.loads((cluster.root / "rgpu.toml").read_text())["grpc_tls"] == "off"
    cluster.start_pool()
    wait_for(lambda: "gRPC to the pool is PLAINTEXT" in cluster.pool.log(), what="the pool's warning")
    dispatcher, _port = cluster.start_dispatcher(EXAMPLES / "inventory-a.toml")
    wait_for(lambda: "rgpu: dispatcher: gRPC to the pool is PLAINTEXT" in dispatcher.log(),
             what="the dispatcher's warning")
    with cluster.client() as client:
        wait_for(lambda: client.capacity().total_units == 200, what="the dispatcher registered in plaintext")


def test_a_node_with_the_pools_config_but_not_its_ca_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "node" / "rgpu.toml"
    config.parent.mkdir()
    config.write_text(f'grpc_tls = "required"\ntls_ca_file = "{tmp_path}/missing/ca.crt"\n')
    result = CliRunner().invoke(admin_main, ["install-units", "--dest", str(tmp_path / "units"), "--config", str(config),
                                             "--tls-dir", str(tmp_path / "tls"), "--poold-bin", "/x/p",
                                             "--dispatcher-bin", "/x/d", "--poold-user", ME])
    assert result.exit_code != 0
    assert "the CA certificate" in result.output and "is missing" in result.output
    assert not (tmp_path / "tls" / "ca.crt").exists()      # no second CA made


def test_a_node_with_the_ca_certificate_only_trusts_it_and_makes_no_pool_certificate(tmp_path: Path) -> None:
    pool_tls = tmp_path / "pool-tls"
    set_up_tls(pool_tls, configured_ca="", names=["pool1"])
    node_tls = tmp_path / "node-tls"
    node_tls.mkdir()
    (node_tls / "ca.crt").write_bytes((pool_tls / "ca.crt").read_bytes())
    files = set_up_tls(node_tls, configured_ca=str(node_tls / "ca.crt"), names=["node1"])
    assert files.cert_file == "" and files.made == ()
    assert not (node_tls / "pool.key").exists()


def test_config_edits_keep_the_admins_lines() -> None:
    text = '# site config\npool = "p1:50001"\ngrpc_tls = "off"\n\n[user_accounts]\nalice = ["x"]\n'
    edited = with_keys(text, {"grpc_tls": "required", "tls_ca_file": "/etc/rgpu/tls/ca.crt"})
    parsed = tomllib.loads(edited)
    assert parsed["grpc_tls"] == "required" and parsed["tls_ca_file"] == "/etc/rgpu/tls/ca.crt"
    assert parsed["user_accounts"] == {"alice": ["x"]} and "# site config" in edited
    with pytest.raises(ConfigError, match="not valid TOML"):
        with_keys("pool = ", {"grpc_tls": "required"})
