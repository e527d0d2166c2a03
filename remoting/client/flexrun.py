"""flexrun: run an unmodified CUDA application on remote GPU slices.

    flexrun [-f adaptor.conf | -l "host:port;host:port" | -n N] [-p F | -m SIZE] [--] app [args...]
    flexrun local [-n N] [-p F | -m SIZE] [--] app [args...]

Which slices:
  -f FILE     the slices of an adaptor.conf (what the Slurm prolog writes for a job); a file whose
              limits are not its tokens' (edited, or another lease's token) is refused
  -n N        ask the pool for N slices, release them at exit
  -l LIST     ask the pool for one slice on each listed dispatcher, release them at exit
  (none)      $RGPU_ADAPTOR_CONF, then ~/.rgpu/adaptor.conf, then /etc/rgpu/adaptor.conf
  local       ask the pool for N slices (default 1) of this node's own GPUs, release them at exit:
              the application runs under a slice of a GPU beside it, its copies through the same-host
              path (UCX shared memory where the GPU server takes UCX; one line on stderr where it does
              not). An application named `local` runs as `flexrun -- local`.
How big, with -n or -l (one of them; default a whole GPU):
  -p F        fraction of a GPU per slice, whole hundredths from 0.01 to 1 (as --comment=fraction=F)
  -m SIZE     GPU memory per slice, e.g. 8G or 512M (binary units)
  --isolation strict   only GPUs shared isolated or exclusive, where another job's GPU fault
              cannot end this one's work (with -n or -l)
  --same-node with -n: every slice on one GPU server (NCCL's collectives between them stay on the
              node's NVLink or PCIe), else refused as no capacity
  --per-task  this task gets only its own slice of the job's slices on this node, number SLURM_LOCALID
              (its index on the node), as CUDA device 0: `srun -n N flexrun --per-task -- app` for
              programs that each use device 0. Without it every task sees every slice, which is what
              `flexrun -- torchrun --nproc_per_node N` and programs that pick device LOCAL_RANK need.
Everything after `--`, or from the first word that is not an option, is the application's
command line, passed on untouched.

Slice i appears to the application as CUDA device i; slices on different servers form one
multi-GPU machine. flexrun checks every slice with its server before the application starts, so
a refused token, an unreachable server, or the node prolog's recorded error is one clear line on
stderr and a non-zero exit, not a CUDA error deep inside the application. The data lanes' keys of
rgpu.toml (lanes, lane_min_bytes, lane_chunk_bytes, socket_buffer_bytes) reach the application as
RGPU_LANES, ... unless its environment sets them. Then it puts rgpu's
libcuda.so.1, libnvidia-ml.so.1 and libnccl.so.2 first on LD_LIBRARY_PATH, preloads its libnccl.so.2
(LD_PRELOAD: PyTorch finds NCCL through an RPATH, which LD_LIBRARY_PATH does not override), passes the slices in RGPU_SLICES
("host:port,token;..."), and runs the application: stdin, stdout, stderr, signals and the exit
status pass through (with an adaptor.conf flexrun replaces itself with the application).
`flexrun -- nvidia-smi ...` runs NVIDIA's nvidia-smi on rgpu's NVML where it is installed, and
rgpu's NVML-based view of the slices (remoting/client/smi.py) on nodes without it (CPU nodes usually have
no NVIDIA driver tools). RGPU_SMI=nvidia or RGPU_SMI=rgpu picks one.

Exit codes of flexrun's own failures (the README's "Exit status" table): 2 usage or configuration,
3 no capacity, 4 token or permission, 5 no such lease, 6 the pool unreachable, 7 a GPU server
(dispatcher) unreachable, 1 the node prolog's recorded error or anything else; each is one line,
`rgpu: <component>: <what> (<why>; <how to fix>)`.
"""

from __future__ import annotations

import concurrent.futures
import getpass
import os
import secrets as pysecrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import click

from rgpu import __version__, paths
from rgpu.errors import ConfigError, InvalidRequest, RgpuError
from rgpu.remoting.client.cli import tool_command
from rgpu.slice_size import WHOLE_GPU, SliceSize, from_options

TOOL = "flexrun"
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
        out.append(Path(conf).parent / paths.ERROR_NAME)
    job = env.get("SLURM_JOB_ID")
    if job and job.isascii() and job.isdigit():
        out.append(paths.job_dir(job, env) / paths.ERROR_NAME)
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
    """The file's slices (server and token: the token carries the limits the GPU server enforces),
    once the limits the file states are found to be the token's (adaptor.check_limits_match_tokens)."""
    from rgpu.adaptor import check_limits_match_tokens, read_adaptor_conf
    conf = read_adaptor_conf(path)
    check_limits_match_tokens(conf, str(path))
    return [Slice(s.server, s.token) for s in conf.slices]


class Lease:
    """Slices requested from the pool for this run only, with a TTL (flexrun_lease_ttl_seconds)
    renewed from a thread while the run goes on; released when it ends. A flexrun killed with
    SIGKILL stops renewing, and the pool reclaims its lease within one TTL."""

    def __init__(self, count: int, size: SliceSize, servers: list[str], isolation: str = "",
                 local: bool = False, same_node: bool = False) -> None:
        from rgpu.config import load_settings
        from rgpu.remoting.pool.client import connect

        settings = load_settings()
        self.ttl = settings.flexrun_lease_ttl_seconds
        if not (self.ttl == self.ttl and 1.0 <= self.ttl <= 366 * 86400):
            raise ConfigError("flexrun", f"flexrun_lease_ttl_seconds = {self.ttl!r} from "
                              f"{settings.origin('flexrun_lease_ttl_seconds')} is out of range",
                              "it must be 1 second to a year", "set it to e.g. 60")
        self.client = connect(settings, user=True)
        self.user = getpass.getuser()
        self.isolation = isolation
        self.same_node = same_node
        base = f"flexrun-{socket.gethostname().split('.')[0]}-{os.getpid()}-{pysecrets.token_hex(3)}"
        self.keys: list[str] = []
        self.slices: list[Slice] = []
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        try:
            if local:
                self._allocate_here(base, count, size)
            else:
                requests = [(f"{base}-{i}", 1, s) for i, s in enumerate(servers)] if servers else [(base, count, "")]
                for key, n, server in requests:
                    self._allocate(key, n, size, server)
        except BaseException:
            self.release()
            raise
        self._renewer = threading.Thread(target=self._renew_loop, name="rgpu-flexrun-renew", daemon=True)
        self._renewer.start()

    def _allocate(self, key: str, count: int, size: SliceSize, server: str) -> None:
        from rgpu.errors import CapacityError
        from rgpu.remoting.pool.client import explain_capacity
        try:
            lease = self.client.allocate(key, self.user, count, percent=size.percent, memory_bytes=size.memory_bytes,
                                         server=server, ttl_seconds=self.ttl, isolation=self.isolation,
                                         same_node=self.same_node)
        except CapacityError as exc:
            raise explain_capacity(self.client, exc, self.isolation, TOOL) from None
        self.keys.append(key)
        self.slices += [Slice(s.server, s.token) for s in lease.slices]

    def _allocate_here(self, key: str, count: int, size: SliceSize) -> None:
        """`count` slices on a GPU server of this node: the first of them with room."""
        from rgpu.errors import CapacityError
        from rgpu.remoting.client.local import local_servers

        known = list(self.client.list_servers().servers)
        here = local_servers([s.address for s in known], [s.state for s in known])
        if not here:
            listed = ", ".join(f"{s.address} ({s.state})" for s in known[:8]) or "none"
            raise ConfigError(TOOL, f"no GPU server of the pool is up on this node ({socket.gethostname()})",
                              f"the pool's servers: {listed}",
                              "run flexrun local on a GPU node whose rgpu-dispatcher is up, or use flexrun -n N")
        refused: CapacityError | None = None
        for server in here:
            try:
                return self._allocate(key, count, size, server)
            except CapacityError as exc:   # this node's next dispatcher may have room
                refused = exc
        assert refused is not None
        raise refused

    def _renew_loop(self) -> None:
        from rgpu.errors import NotFound
        warned = False
        while not self._stop.wait(self.ttl / 3):
            for key in list(self.keys):
                try:
                    self.client.renew(key, self.ttl)
                except NotFound as exc:
                    print(f"{exc} [lease {key}; the application's GPU sessions end]", file=sys.stderr)
                    self.keys.remove(key)
                except RgpuError as exc:
                    if not warned:   # the pool may be restarting: keep trying until the TTL runs out
                        print(f"{exc} (renewing lease {key}; retrying)", file=sys.stderr)
                        warned = True

    def release(self) -> None:
        self._stop.set()
        if self._renewer is not None and self._renewer is not threading.current_thread():
            self._renewer.join(timeout=15)
        for key in self.keys:
            try:
                self.client.release(key)
            except RgpuError as exc:
                print(f"{exc} (lease {key} will be reclaimed within {self.ttl:g} s, its TTL)", file=sys.stderr)
        self.keys = []
        self.client.close()


def probe_all(slices: list[Slice], timeout: float) -> None:
    """Open (and close) a probe session to every slice; raise the first failure."""
    from rgpu.remoting.datapath.protocol import probe
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(slices))) as pool:
        futures = [pool.submit(probe, s.server, s.token, timeout) for s in slices]
        for fut in futures:
            fut.result()


def library_env(libdir: Path, env: dict[str, str] | os._Environ = os.environ) -> dict[str, str]:
    """LD_LIBRARY_PATH and LD_PRELOAD that make an application load rgpu's libraries from `libdir`.

    rgpu's folder goes first on LD_LIBRARY_PATH (libcuda.so.1, libnvidia-ml.so.1, libnccl.so.2). That
    is not enough for NCCL: PyTorch's libtorch_cuda.so finds libnccl.so.2 through a DT_RPATH
    ($ORIGIN/../../nvidia/nccl/lib), and the loader searches an RPATH before LD_LIBRARY_PATH, so PyTorch
    would load NVIDIA's NCCL, which cannot run on rgpu's driver. So rgpu's libnccl.so.2 is also preloaded
    (in front of any LD_PRELOAD already set): a soname already loaded satisfies every later NEEDED entry
    for it, whatever the RPATH says. It is cheap to preload into every process of a job: it has no
    constructor and needs nothing beyond libc (it finds libcuda only when an NCCL call comes)."""
    old = env.get("LD_LIBRARY_PATH", "")
    nccl = str(Path(libdir) / "libnccl.so.2")
    # LD_PRELOAD takes spaces or colons between entries; a nested flexrun keeps one copy.
    preload = [p for p in env.get("LD_PRELOAD", "").replace(":", " ").split() if p != nccl]
    return {"LD_LIBRARY_PATH": str(libdir) + (os.pathsep + old if old else ""),
            "LD_PRELOAD": " ".join([nccl, *preload])}


def task_slice(slices: list[Slice], env: dict[str, str] | os._Environ = os.environ) -> list[Slice]:
    """--per-task: the one slice of this task, number SLURM_LOCALID (the task's index on this node; the
    node's adaptor.conf lists this node's slices). Pure; raises InvalidRequest."""
    local_id = env.get("SLURM_LOCALID", "")
    if not local_id.isdigit():
        raise InvalidRequest(TOOL, "--per-task needs SLURM_LOCALID", "it picks this task's slice by the task's index "
                             "on its node, which srun sets", "run it as `srun -n N flexrun --per-task -- app`")
    index = int(local_id)
    if index >= len(slices):
        raise InvalidRequest(TOOL, f"task {index} on this node has no slice of its own (--per-task)",
                             f"the job has {len(slices)} slice{'s' if len(slices) != 1 else ''} on this node",
                             "ask for as many slices as tasks per node (--gres=rgpu:N with --ntasks-per-node=N), or "
                             "run without --per-task so every task sees every slice and picks one (LOCAL_RANK)")
    return [slices[index]]


def build_env(slices: list[Slice], libdir: Path, env: dict[str, str] | os._Environ = os.environ,
              settings_env: dict[str, str] | None = None, same_host: bool = False) -> dict[str, str]:
    """The application's environment: rgpu's libraries first, its slices, `settings_env` (rgpu.toml's
    keys for applications, config.lane_environment) where `env` does not set them, and RGPU_SAME_HOST=1
    for `flexrun local` (the client library then says at the default log level when a copy path is
    not the same-host one)."""
    out = dict(env)
    out.update(library_env(libdir, env))
    out["RGPU_SLICES"] = ";".join(f"{s.server},{s.token}" for s in slices)
    for name, value in (settings_env or {}).items():
        out.setdefault(name, value)
    if same_host:
        out.setdefault("RGPU_SAME_HOST", "1")
    return out


@dataclass(frozen=True)
class Options:
    command: list[str]                 # the application's argv, untouched
    adaptor_conf: str | None = None
    server_list: str | None = None
    num_gpus: int | None = None
    size: SliceSize = WHOLE_GPU
    isolation: str = ""                # "strict": only GPUs shared isolated or exclusive (--isolation strict)
    probe_timeout: float = 15.0
    local: bool = False                # `flexrun local`: slices of this node's own GPUs
    per_task: bool = False             # --per-task: only slice SLURM_LOCALID of the job's slices
    same_node: bool = False            # --same-node: every slice of -n N on one GPU server


def _bad_usage(what: str, why: str = "") -> InvalidRequest:
    return InvalidRequest(TOOL, what, why, f"see `{TOOL} --help`")


def make_options(command: Sequence[str], adaptor_conf: str | None = None, server_list: str | None = None,
                 num_gpus: int | None = None, partial: str | None = None, memory: str | None = None,
                 probe_timeout: float = 15.0, isolation: str | None = None, local: bool = False,
                 per_task: bool = False, same_node: bool = False) -> Options:
    """Options from the command line's values, checked together (pure; raises InvalidRequest)."""
    if local and (adaptor_conf is not None or server_list is not None):
        raise _bad_usage(f"flexrun local cannot be used with {'-f' if adaptor_conf is not None else '-l'}",
                         "it asks the pool for slices of this node's own GPUs")
    given = [flag for flag, value in (("-f", adaptor_conf), ("-l", server_list), ("-n", num_gpus)) if value is not None]
    if len(given) > 1:
        raise _bad_usage(f"{' and '.join(given)} cannot be used together", "they name the slices in different ways")
    if (partial is not None or memory is not None) and adaptor_conf is not None:
        raise _bad_usage(f"{'-p' if partial is not None else '-m'} cannot be used with -f",
                         "the adaptor.conf's slices are already sized")
    if isolation is not None and adaptor_conf is not None:
        raise _bad_usage("--isolation cannot be used with -f", "the adaptor.conf's slices are already placed")
    if isolation is not None and isolation != "strict":
        raise _bad_usage(f"--isolation {isolation[:40]!r} is unknown", "the one level is strict")
    if per_task and (local or num_gpus is not None or server_list is not None):
        raise _bad_usage("--per-task takes the task's slice of the job's slices (an adaptor.conf)",
                         "with -n, -l or local each task asks the pool for its own slices already")
    if same_node and num_gpus is None:
        raise _bad_usage("--same-node goes with -n N", "it asks the pool to put the N slices on one GPU server")
    if num_gpus is not None and num_gpus < 1:
        raise _bad_usage(f"-n {num_gpus} asks for no GPU", "-n must be at least 1")
    # The one slice-size grammar (rgpu.slice_size): the sizes Slurm's gate takes, refused with its words.
    size = from_options(partial, memory, component=TOOL, fraction_option="-p ", memory_option="-m ")
    if not command:
        raise _bad_usage("no application given", f"write {TOOL} [options] -- app [args...]")
    return Options(command=list(command), adaptor_conf=adaptor_conf, server_list=server_list,
                   num_gpus=num_gpus if num_gpus is not None or not local else 1, size=size,
                   isolation=isolation or "", probe_timeout=probe_timeout, local=local, per_task=per_task,
                   same_node=same_node)


_CONTEXT = {"help_option_names": ["-h", "--help"],
            # The first word that is not an option starts the application's command line.
            "allow_interspersed_args": False}


@tool_command(TOOL, context_settings=_CONTEXT, epilog="Everything after the options (or after --) is the application.",
               help=(__doc__ or "").split("\n\n")[0])
@click.option("-f", "--adaptor-conf", metavar="FILE", help="Use the slices of this adaptor.conf.")
@click.option("-l", "--server-list", metavar="LIST",
              help='One slice on each of these dispatchers, "host:port;host:port" (asks the pool).')
@click.option("-n", "--num-gpus", type=int, metavar="N", help="Ask the pool for N slices.")
@click.option("-p", "--partial", metavar="F", help="Fraction of a GPU per slice with -n/-l (default 1.0).")
@click.option("-m", "--memory", metavar="SIZE", help="GPU memory per slice with -n/-l, e.g. 8G (instead of -p).")
@click.option("--isolation", metavar="strict",
              help="With -n/-l: only GPUs where no other job's GPU fault can end this one's work "
                   "(shared isolated or exclusive).")
@click.option("--same-node", is_flag=True,
              help="With -n N: every slice on one GPU server (NCCL stays on its NVLink or PCIe), else no capacity.")
@click.option("--per-task", is_flag=True,
              help="Only this task's own slice, number SLURM_LOCALID of the job's slices on this node, as "
                   "device 0 (srun -n N flexrun --per-task -- app). Default: every slice.")
@click.option("--probe-timeout", type=float, default=15.0, hidden=True)
@click.option("--local", "local", is_flag=True, hidden=True)   # `flexrun local ...` (main() spells it so)
@click.version_option(__version__, prog_name=TOOL)
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def cli(command: tuple[str, ...], adaptor_conf: str | None, server_list: str | None, num_gpus: int | None,
        partial: str | None, memory: str | None, isolation: str | None, probe_timeout: float,
        local: bool, per_task: bool, same_node: bool) -> int:
    """The command line, parsed by click; `run` does the work."""
    try:
        options = make_options(command, adaptor_conf, server_list, num_gpus, partial, memory, probe_timeout,
                               isolation, local, per_task, same_node)
    except RgpuError as exc:
        click.echo(str(exc), err=True)
        return exc.exit_code
    return run(options)


def parse_args(argv: Sequence[str]) -> Options:
    """Options from a command line (for tests and callers); usage errors raise InvalidRequest."""
    try:
        with cli.make_context(TOOL, local_argv(argv)) as ctx:
            return make_options(**{k: v for k, v in ctx.params.items()})
    except click.ClickException as exc:
        from rgpu.remoting.client.cli import usage_error
        raise usage_error(TOOL, exc) from None


def local_argv(argv: Sequence[str]) -> list[str]:
    """`flexrun local ...` as click parses it (`--local ...`); any other command line as it is."""
    argv = list(argv)
    return ["--local", *argv[1:]] if argv[:1] == ["local"] else argv


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


BUILD_NOTE = f"rgpu: {TOOL}: building the client libraries for this node (once, about 15 s)..."


def client_libraries():  # type: ignore[no-untyped-def]  # -> rgpu.remoting.native.build.Libraries
    """rgpu's libcuda/libnvidia-ml for this node; a first build (about 15 s) says so on stderr."""
    from rgpu.remoting.native.build import ensure_built

    return ensure_built(on_build=lambda: print(BUILD_NOTE, file=sys.stderr, flush=True))


def use_rgpu_smi(env: dict[str, str]) -> bool:
    """rgpu's smi where NVIDIA's binary is missing (or RGPU_SMI=rgpu); NVIDIA's runs on rgpu's NVML."""
    choice = env.get("RGPU_SMI", "auto")
    if choice not in ("auto", "nvidia", "rgpu"):
        raise ConfigError("flexrun", f"RGPU_SMI={choice!r} is not known", "", "use auto, nvidia or rgpu")
    if choice == "auto":
        return shutil.which("nvidia-smi", path=env.get("PATH")) is None
    return choice == "rgpu"


def run(args: Options) -> int:
    """Find or lease the slices, check them, and run the application; return its exit status."""
    lease: Lease | None = None
    try:
        check_prolog_error()
        from rgpu.config import lane_environment, load_settings
        settings_env = lane_environment(load_settings())
        if args.local:
            lease = Lease(args.num_gpus or 1, args.size, [], args.isolation, local=True)
            slices = lease.slices
        elif args.adaptor_conf:
            slices = slices_from_conf(Path(args.adaptor_conf))
        elif args.num_gpus or args.server_list:
            servers = [s.strip() for s in (args.server_list or "").split(";") if s.strip()]
            if args.server_list and not servers:
                raise InvalidRequest("flexrun", "empty server list", "", 'use -l "host:port;host:port"')
            lease = Lease(args.num_gpus or len(servers), args.size, servers, args.isolation, same_node=args.same_node)
            slices = lease.slices
        else:
            slices = slices_from_conf(find_adaptor_conf())
        if not slices:
            raise ConfigError("flexrun", "no GPU slices for this run", "the slice list is empty",
                              "ask for GPUs (sbatch --gres=rgpu:N, or flexrun -n N)")
        if args.per_task:
            slices = task_slice(slices)
        probe_all(slices, args.probe_timeout)
        libs = client_libraries()
        env = build_env(slices, libs.folder, settings_env=settings_env, same_host=args.local)
        command = args.command
        if os.path.basename(command[0]) == "nvidia-smi" and use_rgpu_smi(env):
            command = [sys.executable, "-m", "rgpu.remoting.client.smi", *command[1:]]
        if shutil.which(command[0], path=env.get("PATH")) is None and os.sep not in command[0]:
            raise ConfigError("flexrun", f"command not found: {command[0]}", "", "check the command and PATH")
        if lease is None:
            sys.stdout.flush()
            sys.stderr.flush()
            try:
                os.execvpe(command[0], command, env)
            except OSError as exc:
                raise ConfigError("flexrun", f"cannot run {command[0]}", exc.strerror or str(exc),
                                  "check the command and its PATH") from None
        code = _run_child(command, env)
    except RgpuError as exc:
        click.echo(str(exc), err=True)
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


def main(argv: Sequence[str] | None = None) -> int:
    return cli.main(args=local_argv(sys.argv[1:] if argv is None else argv), standalone_mode=False)


if __name__ == "__main__":
    raise SystemExit(main())
