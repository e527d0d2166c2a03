"""flexrun: run an unmodified CUDA application on remote GPU slices.

    flexrun [-f adaptor.conf | -l "host:port;host:port" | -n N [-p F]] [--] app [args...]

Which slices:
  -f FILE     the slices of an adaptor.conf (what the Slurm prolog writes for a job)
  -n N        ask the pool for N slices of fraction F (-p, default 1.0), release them at exit
  -l LIST     ask the pool for one slice (fraction -p) on each listed dispatcher, release at exit
  (none)      $RGPU_ADAPTOR_CONF, then ~/.rgpu/adaptor.conf, then /etc/rgpu/adaptor.conf

Slice i appears to the application as CUDA device i; slices on different servers form one
multi-GPU machine. flexrun checks every slice with its server before the application starts, so
a refused token, an unreachable server, or the node prolog's recorded error is one clear line on
stderr and a non-zero exit, not a CUDA error deep inside the application. Then it puts rgpu's
libcuda.so.1 and libnvidia-ml.so.1 first on LD_LIBRARY_PATH, passes the slices in RGPU_SLICES
("host:port,token;..."), and runs the application: stdin, stdout, stderr, signals and the exit
status pass through (with an adaptor.conf flexrun replaces itself with the application).
`flexrun -- nvidia-smi ...` runs NVIDIA's nvidia-smi on rgpu's NVML where it is installed, and
rgpu's NVML-based view of the slices (remoting/client/smi.py) on nodes without it (CPU nodes usually have
no NVIDIA driver tools). RGPU_SMI=nvidia or RGPU_SMI=rgpu picks one.

Exit codes of flexrun's own failures: 2 configuration, 3 no capacity, 4 token or permission,
6 a server unreachable, 1 the node prolog's recorded error or anything else.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import getpass
import os
import secrets as pysecrets
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rgpu.errors import ConfigError, InvalidRequest, RgpuError

DEFAULT_RUN_DIR = "/run/rgpu"
CONF_SEARCH = ("~/.rgpu/adaptor.conf", "/etc/rgpu/adaptor.conf")
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                     signal.SIGUSR2, signal.SIGCONT, signal.SIGWINCH)


@dataclass(frozen=True)
class Slice:
    server: str
    token: str


def prolog_error_files(env: dict[str, str] | os._Environ = os.environ) -> list[Path]:
    """Where the node prolog records why it could not set up this job's slices (prolog/README.md):
    `<run dir>/<job id>/error`, beside the adaptor.conf that the TaskProlog points to."""
    out = []
    conf = env.get("RGPU_ADAPTOR_CONF")
    if conf and not Path(conf).exists():
        out.append(Path(conf).parent / "error")
    job = env.get("SLURM_JOB_ID")
    if job and job.isdigit():
        out.append(Path(env.get("RGPU_RUN_DIR") or DEFAULT_RUN_DIR) / job / "error")
    return out


def check_prolog_error(env: dict[str, str] | os._Environ = os.environ) -> None:
    path = next((p for p in prolog_error_files(env) if p.exists()), None)
    if path is None:
        return
    try:
        text = " ".join(path.read_text(encoding="utf-8", errors="replace").split())
    except OSError as exc:
        text = f"(unreadable: {exc.strerror})"
    if not text.startswith("rgpu:"):
        text = f"rgpu: prolog: {text or 'the node prolog failed without a message'}"
    err = RgpuError("prolog", text)
    err.args = (f"{text} [recorded in {path}]",)
    raise err


def find_adaptor_conf(env: dict[str, str] | os._Environ = os.environ) -> Path:
    candidates = []
    if env.get("RGPU_ADAPTOR_CONF"):
        candidates.append(Path(env["RGPU_ADAPTOR_CONF"]))
    candidates += [Path(os.path.expanduser(p)) for p in CONF_SEARCH]
    for path in candidates:
        if path.exists():
            return path
    raise ConfigError("flexrun", "no GPU slices for this run",
                      f"no -f/-l/-n given and none of {', '.join(str(c) for c in candidates)} exists",
                      "run inside a job that asked for rgpu GPUs (sbatch --gres=rgpu:N), "
                      "or use `flexrun -n 1 -- app` to ask the pool")


def slices_from_conf(path: Path) -> list[Slice]:
    from rgpu.adaptor import read_adaptor_conf
    conf = read_adaptor_conf(path)
    return [Slice(s.server, s.token) for s in conf.slices]


class Lease:
    """Slices requested from the pool for this run only; released when the run ends."""

    def __init__(self, count: int, fraction: float, servers: list[str]) -> None:
        from rgpu.remoting.pool.client import PoolClient

        from rgpu.config import load_settings
        from rgpu.secret import load_secret
        settings = load_settings()
        self.client = PoolClient(settings.pool, load_secret(settings.secret_file),
                                 tls_ca_file=settings.tls_ca_file or None,
                                 tls_server_name=settings.tls_server_name or None)
        self.user = getpass.getuser()
        base = f"flexrun-{socket.gethostname().split('.')[0]}-{os.getpid()}-{pysecrets.token_hex(3)}"
        self.keys: list[str] = []
        self.slices: list[Slice] = []
        try:
            requests = [(f"{base}-{i}", 1, s) for i, s in enumerate(servers)] if servers else [(base, count, "")]
            for key, n, server in requests:
                lease = self.client.allocate(key, self.user, n, fraction=fraction, server=server)
                self.keys.append(key)
                self.slices += [Slice(s.server, s.token) for s in lease.slices]
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        for key in self.keys:
            try:
                self.client.release(key)
            except RgpuError as exc:
                print(f"{exc} (lease {key} will be reclaimed when it expires)", file=sys.stderr)
        self.keys = []
        self.client.close()


def probe_all(slices: list[Slice], timeout: float) -> None:
    """Open (and close) a probe session to every slice; raise the first failure."""
    from rgpu.remoting.datapath.protocol import probe
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(slices))) as pool:
        futures = [pool.submit(probe, s.server, s.token, timeout) for s in slices]
        for fut in futures:
            fut.result()


def build_env(slices: list[Slice], libdir: Path, env: dict[str, str] | os._Environ = os.environ) -> dict[str, str]:
    out = dict(env)
    old = out.get("LD_LIBRARY_PATH", "")
    out["LD_LIBRARY_PATH"] = str(libdir) + (os.pathsep + old if old else "")
    out["RGPU_SLICES"] = ";".join(f"{s.server},{s.token}" for s in slices)
    return out


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="flexrun", description=__doc__.split("\n\n")[0],
                                     epilog="Everything after the options (or after --) is the application.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("-f", "--adaptor-conf", metavar="FILE", help="use the slices of this adaptor.conf")
    source.add_argument("-l", "--server-list", metavar="LIST",
                        help='one slice on each of these dispatchers, "host:port;host:port" (asks the pool)')
    source.add_argument("-n", "--num-gpus", type=int, metavar="N", help="ask the pool for N slices")
    parser.add_argument("-p", "--partial", type=float, default=1.0, metavar="F",
                        help="fraction of a GPU per slice with -n/-l (default 1.0)")
    parser.add_argument("--probe-timeout", type=float, default=15.0, help=argparse.SUPPRESS)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the application and its arguments")
    args = parser.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        parser.error("no application given (flexrun [options] -- app [args...])")
    if args.num_gpus is not None and args.num_gpus < 1:
        parser.error("-n must be at least 1")
    if not 0 < args.partial <= 1:
        parser.error("-p must be in (0, 1]")
    return args


def _run_child(command: list[str], env: dict[str, str]) -> int:
    """Run the application as a child, forwarding signals; return its exit status (shell style)."""
    try:
        child = subprocess.Popen(command, env=env)
    except OSError as exc:
        raise ConfigError("flexrun", f"cannot run {command[0]}", exc.strerror or str(exc),
                          "check the command and its PATH") from None
    previous = {}
    for sig in FORWARDED_SIGNALS:
        previous[sig] = signal.signal(sig, lambda s, _f: child.send_signal(s))
    try:
        while True:
            try:
                code = child.wait()
                break
            except InterruptedError:
                continue
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code


def use_rgpu_smi(env: dict[str, str]) -> bool:
    """rgpu's smi where NVIDIA's binary is missing (or RGPU_SMI=rgpu); NVIDIA's runs on rgpu's NVML."""
    choice = env.get("RGPU_SMI", "auto")
    if choice not in ("auto", "nvidia", "rgpu"):
        raise ConfigError("flexrun", f"RGPU_SMI={choice!r} is not known", "", "use auto, nvidia or rgpu")
    if choice == "auto":
        return shutil.which("nvidia-smi", path=env.get("PATH")) is None
    return choice == "rgpu"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    lease: Lease | None = None
    try:
        check_prolog_error()
        if args.adaptor_conf:
            slices = slices_from_conf(Path(args.adaptor_conf))
        elif args.num_gpus or args.server_list:
            servers = [s.strip() for s in (args.server_list or "").split(";") if s.strip()]
            if args.server_list and not servers:
                raise InvalidRequest("flexrun", "empty server list", "", 'use -l "host:port;host:port"')
            lease = Lease(args.num_gpus or len(servers), args.partial, servers)
            slices = lease.slices
        else:
            slices = slices_from_conf(find_adaptor_conf())
        if not slices:
            raise ConfigError("flexrun", "no GPU slices for this run", "the slice list is empty",
                              "ask for GPUs (sbatch --gres=rgpu:N, or flexrun -n N)")
        probe_all(slices, args.probe_timeout)
        from rgpu.remoting.native.build import ensure_built
        libs = ensure_built()
        env = build_env(slices, libs.folder)
        if os.path.basename(args.command[0]) == "nvidia-smi" and use_rgpu_smi(env):
            args.command = [sys.executable, "-m", "rgpu.remoting.client.smi", *args.command[1:]]
        if shutil.which(args.command[0], path=env.get("PATH")) is None and os.sep not in args.command[0]:
            raise ConfigError("flexrun", f"command not found: {args.command[0]}", "", "check the command and PATH")
        if lease is None:
            sys.stdout.flush()
            sys.stderr.flush()
            try:
                os.execvpe(args.command[0], args.command, env)
            except OSError as exc:
                raise ConfigError("flexrun", f"cannot run {args.command[0]}", exc.strerror or str(exc),
                                  "check the command and its PATH") from None
        code = _run_child(args.command, env)
    except RgpuError as exc:
        print(str(exc), file=sys.stderr)
        if lease is not None:
            lease.release()
        return exc.exit_code
    except KeyboardInterrupt:
        if lease is not None:
            lease.release()
        return 130
    lease.release()
    if code < 0:
        # Die of the same signal, so the caller (a shell, srun) sees what the application saw.
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code
    return code


if __name__ == "__main__":
    raise SystemExit(main())
