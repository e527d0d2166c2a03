"""flexrun end to end: adaptor.conf lookup, pre-flight checks with one clear line, pass-through."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from rgpu.errors import InvalidRequest
from rgpu.remoting.client import flexrun
from rgpu.remoting.native import build

from tests.remoting.conftest import EXAMPLES, PY, Server
from tests.remoting.flexrun_helpers import conf_for, run_flexrun

HERE = Path(__file__).parent


def test_runs_a_driver_api_program_from_an_adaptor_conf(native_libs: build.Libraries, demo_binary: Path,
                                                        emulated: Server, tmp_path: Path) -> None:
    conf = conf_for(emulated, tmp_path / "adaptor.conf", emulated.token(memory_limit=1 << 30))
    done = run_flexrun(["-f", str(conf), "--", str(demo_binary), str(EXAMPLES / "vecadd.ptx"), "expect-refused",
                        str(1 << 30)], native_libs)
    assert "DONE 0 failure(s)" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 0


def test_adaptor_conf_from_the_environment(native_libs: build.Libraries, emulated: Server, tmp_path: Path) -> None:
    conf = conf_for(emulated, tmp_path / "adaptor.conf", emulated.token(), emulated.token(gpu=emulated.gpus[1]))
    done = run_flexrun(["--", PY, "-c", textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(HERE)!r})
        from ctcuda import *
        check("cuInit", 0)
        n = ctypes.c_int(); check("cuDeviceGetCount", ctypes.byref(n)); print("DEVICES", n.value)
        """)], native_libs, {"RGPU_ADAPTOR_CONF": str(conf)})
    assert "DEVICES 2" in done.stdout, done.stdout + done.stderr


def test_exit_status_stdin_and_stdout_pass_through(native_libs: build.Libraries, emulated: Server, tmp_path: Path) -> None:
    conf = conf_for(emulated, tmp_path / "adaptor.conf", emulated.token())
    done = run_flexrun(["-f", str(conf), "--", "sh", "-c", "read x; echo got $x; echo err >&2; exit 7"], native_libs,
                       input="hello\n")
    assert done.returncode == 7
    assert done.stdout == "got hello\n"
    assert done.stderr == "err\n"


def test_signals_reach_the_application(native_libs: build.Libraries, emulated: Server, tmp_path: Path) -> None:
    conf = conf_for(emulated, tmp_path / "adaptor.conf", emulated.token())
    env = {k: v for k, v in os.environ.items() if not k.startswith("RGPU_")}
    env["RGPU_NATIVE_DIR"] = str(native_libs.folder)
    proc = subprocess.Popen([PY, "-m", "rgpu.remoting.client.flexrun", "-f", str(conf), "--", "sh", "-c",
                             "trap 'echo term; exit 5' TERM; echo up; while :; do sleep 0.05; done"],
                            env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "up"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)
    assert "term" in out and proc.returncode == 5


def test_refused_token_is_one_line_before_the_app_starts(native_libs: build.Libraries, emulated: Server,
                                                         tmp_path: Path) -> None:
    bad = emulated.token(secret=b"another-cluster-secret-0123456789")
    conf = conf_for(emulated, tmp_path / "adaptor.conf", bad)
    marker = tmp_path / "ran"
    done = run_flexrun(["-f", str(conf), "--", "touch", str(marker)], native_libs)
    assert done.returncode == 4
    assert not marker.exists()
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rgpu: token: lease token refused (bad signature"), done.stderr
    assert f"[server {emulated.address}]" in lines[0]


def test_expired_token(native_libs: build.Libraries, emulated: Server, tmp_path: Path) -> None:
    conf = conf_for(emulated, tmp_path / "adaptor.conf", emulated.token(expires=time.time() - 100))
    done = run_flexrun(["-f", str(conf), "--", "true"], native_libs)
    assert done.returncode == 4 and "expired" in done.stderr



@pytest.mark.parametrize("edit", [("memory_limit_bytes = 1073741824", "memory_limit_bytes = 8589934592"),
                                  ("compute_percent = 50", "compute_percent = 100")])
def test_an_adaptor_conf_whose_limits_are_not_its_tokens_is_refused_in_one_line(
        native_libs: build.Libraries, emulated: Server, tmp_path: Path, edit: tuple[str, str]) -> None:
    """The token is what the GPU server enforces (1 GiB, 50% here): a file edited to say more is
    refused before the application starts, not run on limits other than those it states."""
    conf = conf_for(emulated, tmp_path / "adaptor.conf", emulated.token(memory_limit=1 << 30, compute_percent=50))
    text = conf.read_text()
    assert edit[0] in text
    conf.write_text(text.replace(*edit))
    marker = tmp_path / "ran"
    done = run_flexrun(["-f", str(conf), "--", "touch", str(marker)], native_libs)
    assert done.returncode == 2 and not marker.exists(), done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"rgpu: adaptor.conf: cannot use {conf} (slice 0 says "), done.stderr
    assert "but its token grants 1.0 GiB and 50%" in lines[0]


def test_unreachable_server_is_one_line(native_libs: build.Libraries, emulated: Server, tmp_path: Path) -> None:
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    conf = tmp_path / "adaptor.conf"
    conf.write_text(conf_for(emulated, tmp_path / "x.conf", emulated.token()).read_text()
                    .replace(emulated.address, f"127.0.0.1:{port}"))
    done = run_flexrun(["-f", str(conf), "--", "true"], native_libs)
    assert done.returncode == 7   # a GPU server, not the pool (6): the README's exit status table
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"cannot reach the GPU server 127.0.0.1:{port}" in lines[0]


def test_prolog_error_is_reported(native_libs: build.Libraries, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "4242").mkdir(parents=True)
    (run_dir / "4242" / "error").write_text("rgpu: prolog: no lease for job 4242 (pool unreachable;\n retry later)\n")
    done = run_flexrun(["--", "true"], native_libs, {"SLURM_JOB_ID": "4242", "RGPU_RUN_DIR": str(run_dir),
                                                     "RGPU_ADAPTOR_CONF": str(run_dir / "4242" / "adaptor.conf")})
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("rgpu: prolog: no lease for job 4242 (pool unreachable; retry later)")


def test_no_slices_anywhere(native_libs: build.Libraries) -> None:
    done = run_flexrun(["--", "true"], native_libs)
    assert done.returncode == 2
    assert done.stderr.startswith("rgpu: flexrun: no GPU slices for this run")


def test_usage_errors() -> None:
    with pytest.raises(InvalidRequest, match="no application given"):
        flexrun.parse_args([])
    args = flexrun.parse_args(["-f", "x.conf", "--", "app", "-n", "3"])
    assert args.command == ["app", "-n", "3"] and args.adaptor_conf == "x.conf"
    args = flexrun.parse_args(["-n", "2", "-p", "0.5", "python", "train.py"])
    assert args.num_gpus == 2 and args.size == flexrun.SliceSize(percent=50) and args.command == ["python", "train.py"]


def test_memory_per_slice() -> None:
    args = flexrun.parse_args(["-n", "2", "-m", "8G", "--", "app"])
    assert args.size == flexrun.SliceSize(percent=0, memory_bytes=8 << 30) and args.command == ["app"]
    assert flexrun.parse_args(["-l", "h:1;h:2", "-m", "512MiB", "app"]).size.memory_bytes == 512 << 20


def test_the_application_argv_is_untouched() -> None:
    # After the first word that is not an option (or after --), nothing is parsed: not -n, not --.
    argv = ["python", "train.py", "-n", "3", "--", "-p", "x", "--help"]
    assert flexrun.parse_args(["-n", "1", *argv]).command == argv
    assert flexrun.parse_args(["-n", "1", "--", *argv]).command == argv
    assert flexrun.parse_args(["--", "-weird", "--"]).command == ["-weird", "--"]


@pytest.mark.parametrize("argv, message", [
    ([], "rgpu: flexrun: no application given"),
    (["-x", "app"], "rgpu: flexrun: invalid command line (No such option '-x'"),
    (["-n", "two", "app"], "rgpu: flexrun: invalid command line (Invalid value for '-n'"),
    (["-n", "0", "app"], "rgpu: flexrun: -n 0 asks for no GPU"),
    (["-n", "1", "-p", "1.5", "app"], "rgpu: flexrun: invalid fraction '1.5' (it must be more than 0 and at most 1"),
    (["-n", "1", "-p", "0.5", "-m", "8G", "app"], "rgpu: flexrun: -p and -m cannot be used together"),
    (["-n", "1", "-m", "lots", "app"], "rgpu: flexrun: invalid memory 'lots'"),
    (["-n", "1", "-m", "99999999999999999999999T", "app"], "rgpu: flexrun: invalid memory '999"),
    (["-f", "a.conf", "-n", "1", "app"], "rgpu: flexrun: -f and -n cannot be used together"),
    (["-f", "a.conf", "-m", "8G", "app"], "rgpu: flexrun: -m cannot be used with -f"),
])
def test_usage_errors_are_one_line_with_exit_2(argv: list[str], message: str) -> None:
    result = CliRunner().invoke(flexrun.cli, argv)   # in-process: no process boundary under test
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(message), result.stderr


def test_usage_errors_through_main(capsys: pytest.CaptureFixture[str]) -> None:
    assert flexrun.main(["--no-such-flag"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rgpu: flexrun: invalid command line (No such option '--no-such-flag'") and err.count("\n") == 1
    assert flexrun.main(["--help"]) == 0
    assert "-m, --memory SIZE" in capsys.readouterr().out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from rgpu import __version__

    assert flexrun.main(["--version"]) == 0
    assert capsys.readouterr().out == f"flexrun, version {__version__}\n"
    assert flexrun.parse_args(["-n", "1", "app", "--version"]).command == ["app", "--version"]   # the app's own


def test_environment_puts_rgpu_libraries_first(tmp_path: Path) -> None:
    env = flexrun.build_env([flexrun.Slice("h:1", "t1"), flexrun.Slice("h:2", "t2")], tmp_path,
                            {"LD_LIBRARY_PATH": "/usr/lib/x"})
    assert env["LD_LIBRARY_PATH"] == f"{tmp_path}:/usr/lib/x"
    assert env["RGPU_SLICES"] == "h:1,t1;h:2,t2"


@pytest.mark.integration   # runs the C compiler
def test_a_first_build_says_so_on_stderr_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("RGPU_NATIVE_DIR", raising=False)
    monkeypatch.setattr(build, "PACKAGE_LIB", tmp_path / "none")
    monkeypatch.setattr(build, "temp_cache_root", lambda: tmp_path / "tmp-cache")
    assert flexrun.client_libraries().libcuda.exists()
    assert capsys.readouterr() == ("", "rgpu: flexrun: building the client libraries for this node (once, about 15 s)...\n")
    assert flexrun.client_libraries().libcuda.exists()
    assert capsys.readouterr() == ("", "")          # cached: nothing


@pytest.mark.integration   # runs the C compiler
def test_native_build_is_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("RGPU_NATIVE_DIR", raising=False)
    monkeypatch.setattr(build, "PACKAGE_LIB", tmp_path / "none")
    first = build.ensure_built()
    assert first.libcuda.exists() and first.libnvml.exists() and (first.folder / "libcuda.so").is_symlink()
    mtime = first.libcuda.stat().st_mtime_ns
    assert build.ensure_built().libcuda.stat().st_mtime_ns == mtime


@pytest.mark.integration
@pytest.mark.parametrize("size, total", [(["-p", "0.5"], 40 << 30), (["-m", "20G"], 20 << 30)], ids=["fraction", "memory"])
def test_flexrun_asks_the_pool_and_releases(native_libs: build.Libraries, tmp_path: Path, size: list[str],
                                            total: int) -> None:
    pytest.importorskip("rgpu.remoting.pool.daemon")
    from tests.daemons import RgpuCluster, wait_for
    inventory = EXAMPLES.parent / "inventory-a.toml"
    if not inventory.exists():
        pytest.skip("examples/inventory-a.toml is missing")
    cluster = RgpuCluster(tmp_path / "cluster")
    try:
        cluster.start_pool()
        cluster.start_dispatcher(inventory)
        with cluster.client() as client:
            wait_for(lambda: len(client.list_gpus()) > 0, what="the dispatcher to register")
        env = cluster.env(RGPU_NATIVE_DIR=str(native_libs.folder))
        done = subprocess.run([PY, "-m", "rgpu.remoting.client.flexrun", "-n", "1", *size, "--", PY, "-c", textwrap.dedent(f"""
            import sys; sys.path.insert(0, {str(HERE)!r})
            from ctcuda import *
            setup()
            print("TOTAL", mem_info()[1])
            """)], env=env, capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"TOTAL {total}" in done.stdout, done.stdout   # the slice's memory, as leased
        with cluster.client() as client:
            assert client.list_leases() == []
    finally:
        cluster.stop_all()


def test_nvidia_smi_shows_the_slice(native_libs: build.Libraries, emulated: Server, tmp_path: Path) -> None:
    ours = {"RGPU_SMI": "rgpu"}  # rgpu's view, also where NVIDIA's binary is installed
    conf = conf_for(emulated, tmp_path / "adaptor.conf", emulated.token(memory_limit=6 << 30))
    done = run_flexrun(["-f", str(conf), "--", "nvidia-smi", "--query-gpu=index,name,memory.total,memory.used",
                        "--format=csv,noheader,nounits"], native_libs, ours)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0, NVIDIA H200, 6144, 0"
    table = run_flexrun(["-f", str(conf), "--", "nvidia-smi"], native_libs, ours)
    assert table.returncode == 0, table.stderr
    assert "NVIDIA H200" in table.stdout and "0MiB / 6144MiB" in table.stdout
    listing = run_flexrun(["-f", str(conf), "--", "nvidia-smi", "-L"], native_libs, ours)
    assert listing.stdout.strip() == f"GPU 0: NVIDIA H200 (UUID: {emulated.gpus[0].uuid})"


def test_which_smi_runs(tmp_path: Path) -> None:
    from rgpu.errors import ConfigError
    from rgpu.remoting.client.flexrun import use_rgpu_smi

    tool = tmp_path / "nvidia-smi"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    assert use_rgpu_smi({"PATH": "/nonexistent"}) is True           # no NVIDIA tools: rgpu's view
    assert use_rgpu_smi({"PATH": str(tmp_path)}) is False            # NVIDIA's binary on rgpu's NVML
    assert use_rgpu_smi({"PATH": str(tmp_path), "RGPU_SMI": "rgpu"}) is True
    assert use_rgpu_smi({"PATH": "/nonexistent", "RGPU_SMI": "nvidia"}) is False
    with pytest.raises(ConfigError, match="RGPU_SMI='both' is not known"):
        use_rgpu_smi({"RGPU_SMI": "both"})


def test_same_node_and_per_task_refuse_the_ways_of_naming_slices_they_do_not_fit() -> None:
    assert flexrun.parse_args(["-n", "2", "--same-node", "app"]).same_node
    assert flexrun.parse_args(["--per-task", "app"]).per_task
    with pytest.raises(InvalidRequest, match="--same-node goes with -n N"):
        flexrun.parse_args(["--same-node", "app"])
    with pytest.raises(InvalidRequest, match="--per-task takes the task's slice"):
        flexrun.parse_args(["--per-task", "-n", "2", "app"])
