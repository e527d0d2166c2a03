"""rgpu-admin: the operator's and user's command line for the pool.

Tables for people; `--json` on every listing prints a JSON array of objects, and on commands that
change things what they made, changed or released; a command without JSON output refuses --json.
Errors, usage errors too, are one line (`rgpu: <component>: <what> (<why>; <how to fix>)`) with a
non-zero exit status (2 for usage).
"""

from __future__ import annotations

import getpass
import json
import secrets
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import click
from tabulate import tabulate

from rgpu import __version__, plugins
from rgpu.adaptor import read_adaptor_conf, write_adaptor_conf
from rgpu.config import Settings, load_settings
from rgpu.errors import CapacityError, InvalidRequest, RgpuError, Unavailable, Unhealthy
from rgpu.proto import rgpu_pb2 as pb
from rgpu.remoting.admin.dashboard import dashboard_url
from rgpu.secret import create_secret
from rgpu.slice_size import from_options
from rgpu.units import format_bytes, parse_duration, parse_size
from rgpu.remoting.admin.cli_ops import net_perf, stats, usage
from rgpu.remoting.admin.cli_units import install_units


@dataclass
class Context:
    settings: Settings
    json_output: bool

    def client(self):  # type: ignore[no-untyped-def]
        from rgpu.remoting.pool.client import connect

        return connect(self.settings, user=True)   # without the secret: a user, by MUNGE


def _emit(ctx: Context, rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]],
          empty: str) -> None:
    """Print rows as JSON (all fields) or as a table of the given (key, header) columns."""
    if ctx.json_output:
        click.echo(json.dumps(list(rows), indent=2))
    elif not rows:
        click.echo(empty)
    else:
        click.echo(tabulate([[r[key] for key, _ in columns] for r in rows], headers=[h for _, h in columns]))


def _leaf_command(group: click.Group, ctx: click.Context, args: Sequence[str]) -> tuple[click.Command, str] | None:
    """The command `args` name below `group` (subgroups followed by their first word) and its
    words ("secret create"), or None."""
    command: click.Command = group
    path: list[str] = []
    words = [a for a in args if not a.startswith("-")]
    while isinstance(command, click.Group) and words:
        found = command.get_command(ctx, words.pop(0))
        if found is None:
            return None
        command = found
        path.append(found.name or "")
    return command, " ".join(path)


def _takes_json(command: click.Command) -> bool:
    return any("--json" in param.opts for param in command.params)


class _Group(click.Group):
    """Turns rgpu errors and usage errors into one line and an exit status, at the edge only."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,  # type: ignore[override]
             complete_var: str | None = None, standalone_mode: bool = True, **extra: Any) -> Any:
        from rgpu.remoting.client.cli import usage_error

        try:
            result = super().main(args=list(sys.argv[1:] if args is None else args), prog_name=prog_name,
                                  complete_var=complete_var, standalone_mode=False, **extra)
            code = result if isinstance(result, int) else 0    # --help and --version return their status
        except click.exceptions.NoArgsIsHelpError as exc:   # a bare group: its help, as click shows it
            exc.show()
            code = exc.exit_code
        except click.ClickException as exc:
            where = exc.ctx.command_path if getattr(exc, "ctx", None) is not None else "rgpu-admin"  # type: ignore[attr-defined]
            click.echo(str(usage_error("admin", exc, help_command=where)), err=True)
            code = InvalidRequest.exit_code
        except click.Abort:
            code = 130
        if standalone_mode:
            sys.exit(code)
        return code

    def invoke(self, ctx: click.Context) -> Any:
        try:
            if ctx.params.get("json_output") and ctx.parent is None:
                with warnings.catch_warnings():   # click < 9 keeps the subcommand's name apart from ctx.args
                    warnings.simplefilter("ignore", DeprecationWarning)
                    words = [*getattr(ctx, "protected_args", ()), *ctx.args]
                leaf = _leaf_command(self, ctx, words)
                if leaf is not None and not _takes_json(leaf[0]):
                    raise InvalidRequest("admin", f"`{leaf[1]}` has no JSON output", "--json is not one of its options",
                                         f"drop --json, or see `rgpu-admin {leaf[1]} --help`")
            return super().invoke(ctx)
        except RgpuError as exc:
            click.echo(str(exc), err=True)
            sys.exit(exc.exit_code)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--pool", envvar="RGPU_POOL", help="Pool daemon HOST:PORT (default from rgpu.toml, else localhost:50001).")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="Config file (default /etc/rgpu/rgpu.toml).")
@click.option("--secret-file", help="Cluster secret file.")
@click.option("--json", "json_output", is_flag=True,
              help="Print JSON: listings as an array of objects, commands that change things what they made, "
                   "changed or released. Refused by commands without JSON output.")
@click.version_option(__version__, prog_name="rgpu-admin")
@click.pass_context
def main(ctx: click.Context, pool: str | None, config_file: str | None, secret_file: str | None,
         json_output: bool) -> None:
    """Manage the rgpu GPU pool: GPUs, leases, servers, quotas, health."""
    try:
        settings = load_settings(config_file, flags={"pool": pool, "secret_file": secret_file})
    except RgpuError as exc:
        click.echo(str(exc), err=True)
        sys.exit(exc.exit_code)
    ctx.obj = Context(settings, json_output)


def _json_flag(f: Callable[..., Any] | None = None, *, text: str = "Print a JSON array of objects.") -> Any:
    """Accept --json after the subcommand too (`rgpu-admin list-gpus --json`)."""

    def set_json(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
        if value:
            ctx.find_object(Context).json_output = True  # type: ignore[union-attr]

    decorate = click.option("--json", "json_output_local", is_flag=True, expose_value=False, callback=set_json,
                            help=text)
    return decorate if f is None else decorate(f)


def _emit_done(ctx: Context, record: Any, lines: Sequence[str]) -> None:
    """What a command made, changed or released: `record` as JSON, else the lines for people."""
    if ctx.json_output:
        click.echo(json.dumps(record, indent=2))
    else:
        for line in lines:
            click.echo(line)


@main.command("list-gpus")
@_json_flag
@click.pass_obj
def list_gpus(ctx: Context) -> None:
    """Every GPU in the pool: server, model, memory, what is allocated, state."""
    with ctx.client() as client:
        gpus = client.list_gpus()
    rows = [{
        "server": g.server, "index": g.gpu.index, "uuid": g.gpu.uuid, "model": g.gpu.name,
        "memory_bytes": g.gpu.usable_memory_bytes, "memory": format_bytes(g.gpu.usable_memory_bytes),
        "allocated_percent": g.allocated_percent, "allocated_memory_bytes": g.allocated_memory_bytes,
        "allocated_memory": format_bytes(g.allocated_memory_bytes), "slices": g.slices, "state": g.server_state,
        "sharing": g.gpu.sharing or "mps",
    } for g in gpus]
    _emit(ctx, rows, [("server", "SERVER"), ("index", "GPU"), ("model", "MODEL"), ("memory", "MEMORY"),
                      ("sharing", "SHARING"),
                      ("allocated_percent", "ALLOC %"), ("allocated_memory", "ALLOC MEM"), ("slices", "SLICES"),
                      ("state", "STATE")], "no GPUs registered (is any rgpu-dispatcher running?)")


def _lease_row(lease: pb.Lease) -> dict[str, Any]:
    from rgpu.remoting.admin.usage_view import lease_usage

    return {
        "job_key": lease.job_key, "user": lease.user, "account": lease.account, "units": lease.units,
        "created_unix": lease.created_unix, "expires_unix": lease.expires_unix, "server_down": lease.server_down,
        "slices": [{"server": s.server, "gpu_uuid": s.gpu_uuid, "gpu_index": s.gpu_index,
                    "memory_limit_bytes": s.memory_limit_bytes, "compute_percent": s.compute_percent,
                    "sessions": s.usage.sessions, "busy_seconds": s.usage.busy_seconds, "calls": s.usage.calls,
                    "memory_high_water_bytes": s.usage.memory_high_water_bytes,
                    "memory_used_bytes": s.usage.memory_used_bytes, "last_active_unix": s.usage.last_active_unix}
                   for s in lease.slices],
        "placement": ", ".join(f"{s.server}/{s.gpu_index} {s.compute_percent}%" for s in lease.slices),
        "state": "SERVER DOWN" if lease.server_down else ("IDLE" if lease.idle else "ok"),
        **lease_usage(lease),
    }


@main.command()
@_json_flag
@click.pass_obj
def leases(ctx: Context) -> None:
    """Every lease: job key, user, GPU percent, where its slices are."""
    with ctx.client() as client:
        rows = [_lease_row(lease) for lease in client.list_leases()]
    _emit(ctx, rows, [("job_key", "JOB KEY"), ("user", "USER"), ("account", "ACCOUNT"), ("units", "GPU %"),
                      ("placement", "SLICES"), ("busy", "BUSY"), ("memory_high_water", "MEM PEAK"),
                      ("idle_for", "IDLE FOR"), ("state", "STATE")], "no leases")


@main.command("request-gpus")
@_json_flag(text="Print the lease made (key, adaptor.conf, slices) as a JSON object.")
@click.option("-n", "--num", "count", type=int, required=True, help="Number of slices (each on its own GPU).")
@click.option("-p", "--partial", "fraction", metavar="F",
              help="Fraction of a GPU per slice: whole hundredths from 0.01 to 1 (as Slurm's --comment=fraction=F).")
@click.option("-m", "--memory", help="Memory per slice, e.g. 8G (exclusive with -p).")
@click.option("--ttl", help="Release automatically after this long, e.g. 2h.")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="adaptor.conf to write.")
@click.option("--user", default=None, help="Owner of the lease (default: you).")
@click.option("--account", default="", help="Account charged (for account quotas); users: one they belong to, "
              "default their default account.")
@click.option("--job-key", default=None, help="Idempotency key (default: a new random one).")
@click.option("--model", "gpu_model", default="", help="Only GPUs whose model contains this text.")
@click.option("--server", default="", help="Only this server (address or hostname).")
@click.option("--min-memory", default=None, help="Only GPUs with at least this much usable memory.")
@click.option("--isolation", type=click.Choice(["strict"]), default=None,
              help="Only GPUs shared isolated or exclusive (no other job's GPU fault can end this one's work).")
@click.option("--same-node", is_flag=True,
              help="Every slice on one GPU server (NCCL stays on its NVLink or PCIe), else no capacity.")
@click.pass_obj
def request_gpus(ctx: Context, count: int, fraction: str | None, memory: str | None, ttl: str | None,
                 output: str, user: str | None, account: str, job_key: str | None, gpu_model: str,
                 server: str, min_memory: str | None, isolation: str | None, same_node: bool) -> None:
    """Lease GPU slices outside Slurm and write their adaptor.conf (mode 0600)."""
    from rgpu.remoting.pool.client import explain_capacity
    from rgpu.remoting.pool.convert import lease_to_adaptor

    # The one slice-size grammar (rgpu.slice_size): the sizes Slurm's gate takes, refused with its words.
    size = from_options(fraction, memory, component="admin", fraction_option="-p ", memory_option="-m ", default=None)
    user = user or getpass.getuser()
    key = job_key or f"manual-{user}-{secrets.token_hex(4)}"
    with ctx.client() as client:
        try:
            lease = client.allocate(
                key, user, count, percent=size.percent, memory_bytes=size.memory_bytes,
                account=account, ttl_seconds=parse_duration(ttl, "ttl") if ttl else 0.0, gpu_model=gpu_model,
                server=server, min_memory_bytes=parse_size(min_memory, "min memory") if min_memory else 0,
                isolation=isolation or "", same_node=same_node)
        except CapacityError as exc:
            raise explain_capacity(client, exc, isolation or "", "admin") from None
        try:
            path = write_adaptor_conf(output, lease_to_adaptor(lease))
        except (OSError, RgpuError) as exc:
            client.release(key)  # nothing lost, nothing leaked: no file, no lease
            raise RgpuError("admin", f"cannot write {output}", str(exc), "pick a writable path; the lease was released") from None
    lines = [f"leased {len(lease.slices)} slice(s) as {key}; adaptor.conf written to {path}"]
    lines += [f"  {s.server} GPU {s.gpu_index} ({s.gpu_name}): {format_bytes(s.memory_limit_bytes)}, "
              f"{s.compute_percent}% compute" for s in lease.slices]
    lines.append(f"release with: rgpu-admin release-gpus -f {path}")
    if ttl:
        lines.append(f"it expires in {ttl}; keep it with: rgpu-admin renew-gpus -f {path} --ttl {ttl}")
    record = {"job_key": key, "adaptor_conf": str(path), "user": lease.user, "account": lease.account,
              "units": lease.units, "expires_unix": lease.expires_unix,
              "slices": [{"server": s.server, "gpu_uuid": s.gpu_uuid, "gpu_index": s.gpu_index, "model": s.gpu_name,
                          "memory_limit_bytes": s.memory_limit_bytes, "compute_percent": s.compute_percent}
                         for s in lease.slices]}
    _emit_done(ctx, record, lines)


def slurm_job_keys(keys: list[str], job_id: str, cluster: str) -> list[str]:
    """Keys of Slurm job `job_id` (`slurm:<cluster>:<job>:<restart>:<node>`, see prolog/README.md),
    of one cluster, or of any when `cluster` is empty. Pure."""
    found = []
    for key in keys:
        parts = key.split(":")
        if len(parts) == 5 and parts[0] == "slurm" and parts[2] == job_id and (not cluster or parts[1] == cluster):
            found.append(key)
    return sorted(found)


@main.command("release-gpus")
@_json_flag(text="Print a JSON array with one object per lease: its key and whether this call released it.")
@click.option("-f", "--file", "conf_file", type=click.Path(dir_okay=False),
              help="adaptor.conf written by request-gpus (or by the Slurm prolog).")
@click.option("--job-key", "job_keys", multiple=True, metavar="KEY",
              help="Release this lease by its key, as `rgpu-admin leases` lists it (repeatable).")
@click.option("--slurm-job", metavar="ID", help="Release every lease of this Slurm job (all nodes, all restarts).")
@click.option("--cluster", default="", metavar="NAME", help="With --slurm-job: the Slurm ClusterName.")
@click.pass_obj
def release_gpus(ctx: Context, conf_file: str | None, job_keys: tuple[str, ...], slurm_job: str | None,
                 cluster: str) -> None:
    """Release leases by adaptor.conf, by key or by Slurm job id (safe to run twice)."""
    if sum((conf_file is not None, bool(job_keys), slurm_job is not None)) != 1:
        raise InvalidRequest("admin", "give one of -f FILE, --job-key KEY or --slurm-job ID", "",
                             "e.g. rgpu-admin release-gpus --slurm-job 1234")
    if cluster and slurm_job is None:
        raise InvalidRequest("admin", "--cluster goes with --slurm-job", "", "add --slurm-job ID")
    with ctx.client() as client:
        if conf_file is not None:
            keys = [read_adaptor_conf(conf_file).job_id]
        elif job_keys:
            keys = list(job_keys)
        else:
            if not (slurm_job or "").isdigit():
                raise InvalidRequest("admin", f"--slurm-job {slurm_job!r} is not a job id", "", "give the number squeue shows")
            keys = slurm_job_keys([lease.job_key for lease in client.list_leases()], slurm_job or "", cluster)
            clusters = sorted({k.split(":")[1] for k in keys})
            if len(clusters) > 1:
                raise InvalidRequest("admin", f"Slurm job {slurm_job} has leases in clusters {', '.join(clusters)}",
                                     "job ids repeat across clusters", "add --cluster NAME")
            if not keys:
                _emit_done(ctx, [], [f"Slurm job {slurm_job} holds no lease{f' in cluster {cluster}' if cluster else ''}"])
                return
        done = [(key, bool(client.release(key))) for key in keys]
    _emit_done(ctx, [{"job_key": key, "released": released} for key, released in done],
               [f"released {key}" if released else f"{key} was already released" for key, released in done])


@main.command("renew-gpus")
@_json_flag(text="Print the renewed lease's key and new expiry as a JSON object.")
@click.option("-f", "--file", "conf_file", type=click.Path(dir_okay=False),
              help="adaptor.conf written by request-gpus.")
@click.option("--job-key", default=None, metavar="KEY", help="Renew this lease by its key.")
@click.option("--ttl", required=True, help="New time to live from now, e.g. 2h.")
@click.pass_obj
def renew_gpus(ctx: Context, conf_file: str | None, job_key: str | None, ttl: str) -> None:
    """Extend a lease made with --ttl (run it from a loop or cron while you use the slices)."""
    if (conf_file is None) == (job_key is None):
        raise InvalidRequest("admin", "give one of -f FILE or --job-key KEY", "", "e.g. rgpu-admin renew-gpus -f a.conf --ttl 1h")
    key = read_adaptor_conf(conf_file).job_id if conf_file is not None else str(job_key)
    seconds = parse_duration(ttl, "ttl")
    with ctx.client() as client:
        lease = client.renew(key, seconds)
    _emit_done(ctx, {"job_key": key, "expires_unix": lease.expires_unix},
               [f"renewed {key} for {ttl} (until {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(lease.expires_unix))})"])


def _set_state(ctx: Context, server: str, drained: bool) -> None:
    with ctx.client() as client:
        result = client.set_server_state(server, drained)
    _emit_done(ctx, {"server": result.address, "hostname": result.hostname, "state": result.state},
               [f"{result.address}: {result.state}"])


@main.command()
@click.argument("server")
@_json_flag(text="Print what changed as a JSON object.")
@click.pass_obj
def drain(ctx: Context, server: str) -> None:
    """Stop placing new slices on SERVER (address or hostname); existing leases stay."""
    _set_state(ctx, server, True)


@main.command()
@click.argument("server")
@_json_flag(text="Print what changed as a JSON object.")
@click.pass_obj
def resume(ctx: Context, server: str) -> None:
    """Place slices on a drained SERVER again."""
    _set_state(ctx, server, False)


@main.command("remove-server")
@click.argument("server")
@_json_flag(text="Print what changed as a JSON object.")
@click.pass_obj
def remove_server(ctx: Context, server: str) -> None:
    """Forget SERVER (address or hostname) for good: it must be down and hold no lease. `health`
    stops reporting it; if its dispatcher ever starts again, it registers anew."""
    with ctx.client() as client:
        address = client.remove_server(server)
    _emit_done(ctx, {"server": address, "removed": True}, [f"{address}: removed"])


@main.group()
def quota() -> None:
    """Quotas per user or account, in GPU-percent (100 = one whole GPU)."""


@quota.command("set")
@click.argument("kind", type=click.Choice(["user", "account"]))
@click.argument("name")
@click.argument("units", type=click.IntRange(min=0))
@_json_flag(text="Print what changed as a JSON object.")
@click.pass_obj
def quota_set(ctx: Context, kind: str, name: str, units: int) -> None:
    """Limit KIND NAME to UNITS GPU-percent (100 = one GPU; 0 forbids rgpu use)."""
    with ctx.client() as client:
        q = client.set_quota(kind, name, units)
    _emit_done(ctx, {"kind": kind, "name": name, "limit_units": q.limit_units, "used_units": q.used_units},
               [f"quota of {kind} {name}: {q.used_units} / {q.limit_units} GPU-percent in use"])


@quota.command("remove")
@click.argument("kind", type=click.Choice(["user", "account"]))
@click.argument("name")
@_json_flag(text="Print what changed as a JSON object.")
@click.pass_obj
def quota_remove(ctx: Context, kind: str, name: str) -> None:
    """Remove the quota of KIND NAME (no limit)."""
    with ctx.client() as client:
        client.set_quota(kind, name, -1)
    _emit_done(ctx, {"kind": kind, "name": name, "removed": True}, [f"quota of {kind} {name} removed"])


@quota.command("show")
@_json_flag
@click.pass_obj
def quota_show(ctx: Context) -> None:
    """Every quota and how much of it is in use."""
    with ctx.client() as client:
        rows = [{"kind": q.kind, "name": q.name, "limit_units": q.limit_units, "used_units": q.used_units}
                for q in client.list_quotas()]
    _emit(ctx, rows, [("kind", "KIND"), ("name", "NAME"), ("used_units", "USED %"), ("limit_units", "LIMIT %")],
          "no quotas set")


def _pool_serving(settings: Settings) -> str | None:
    """None when the pool's standard gRPC health service says SERVING, else why not."""
    from rgpu.remoting.pool.client import connect

    with connect(settings, secret=b"") as client:   # the health service needs no credential
        return client.health()


def _fault_notes(server: pb.Server, now: float) -> list[str]:
    """One note per GPU with faults: how many crossed tenants, the latest one, its recovery."""
    notes = []
    by_gpu: dict[int, list[pb.GpuFault]] = {}
    for fault in server.faults:
        by_gpu.setdefault(fault.gpu_index, []).append(fault)
    for index, faults in sorted(by_gpu.items()):
        last = faults[-1]
        crossed = sum(f.cross_tenant for f in faults)
        what = (f"MPS fault ended {last.sessions_ended} sessions" if last.cross_tenant
                else "a session's own fault")
        who = f", faulting {last.faulting}" if last.faulting else (", faulting session not identified"
                                                                  if last.cross_tenant else "")
        back = (f"serving again after {last.recovered_seconds:.1f} s" if last.recovered_seconds >= 0
                else "NOT serving again yet")
        notes.append(f"GPU {index}: {len(faults)} fault(s), {crossed} across tenants; last "
                     f"{max(0.0, now - last.unix):.0f} s ago: {last.error}, {what}{who}; {back}")
    return notes


def _telemetry_notes(server: pb.Server) -> list[str]:
    """One note per GPU whose readings show trouble: uncorrected ECC errors, Xid events."""
    index = {g.uuid: g.index for g in server.gpus}
    notes = []
    for t in server.telemetry:
        trouble = []
        if t.ecc_uncorrected:
            trouble.append(f"{t.ecc_uncorrected} uncorrected ECC error(s)")
        if t.xid_errors:
            trouble.append(f"{t.xid_errors} Xid event(s), last Xid {t.last_xid}")
        if trouble:
            notes.append(f"GPU {index.get(t.gpu_uuid, '?')}: {', '.join(trouble)}"
                         + (" (emulated)" if t.source == "emulated" else ""))
    return notes


def _telemetry_row(t: pb.GpuTelemetry) -> dict[str, Any]:
    return {"gpu_uuid": t.gpu_uuid, "source": t.source, "utilization_percent": t.utilization_percent,
            "memory_used_bytes": t.memory_used_bytes, "temperature_celsius": t.temperature_celsius,
            "power_watts": t.power_watts, "power_limit_watts": t.power_limit_watts,
            "ecc_corrected": t.ecc_corrected, "ecc_uncorrected": t.ecc_uncorrected, "xid_errors": t.xid_errors,
            "last_xid": t.last_xid, "read_unix": t.read_unix}


def _sharing_summary(server: pb.Server) -> str:
    """GPU indexes per sharing mode: "mps" when all are, else e.g. "0,1 mps; 2 isolated"."""
    modes: dict[str, list[str]] = {}
    for gpu in server.gpus:
        modes.setdefault(gpu.sharing or "mps", []).append(str(gpu.index))
    if len(modes) <= 1:
        return next(iter(modes), "-")
    return "; ".join(f"{','.join(indexes)} {mode}" for mode, indexes in modes.items())   # in GPU order


@main.command()
@_json_flag(text="Print a JSON array with one object per server; with --deep one object, "
                 '{"servers": [...], "checks": [...]}.')
@click.option("--deep", is_flag=True, help="Also log in to every host over SSH: driver, MPS, clocks, ECC, Xid, "
                                            "disk, rgpu's libraries, clock skew, round trips to the dispatchers.")
@click.option("--host", "hosts", multiple=True, help="With --deep: only this host (repeat).")
@click.pass_obj
def health(ctx: Context, deep: bool, hosts: tuple[str, ...]) -> None:
    """Check the pool and every dispatcher; exit non-zero when anything is unhealthy.

    \b
    Exit status:
      0  the pool serves and every dispatcher is up (and, with --deep, every check passed)
      6  the pool does not answer (not running, or --pool / RGPU_POOL points elsewhere)
      7  the pool answers, but a dispatcher is down, none has registered, or a --deep check failed
    """
    problem = _pool_serving(ctx.settings)
    if problem:
        raise Unavailable("health", f"pool daemon at {ctx.settings.pool} is not serving", problem,
                          "start rgpu-poold or fix --pool / RGPU_POOL")
    with ctx.client() as client:
        reply = client.list_servers()
    rows = []
    for s in reply.servers:
        notes = []
        if s.static_inventory:
            notes.append("static inventory (no real GPUs)")
        sharing = _sharing_summary(s)
        if s.compute_enforcement == "time-slicing" and "mps" in sharing:
            notes.append("no MPS: compute shares not enforced")
        notes += _fault_notes(s, time.time())
        notes += _telemetry_notes(s)
        if s.launch_path.startswith("python"):
            notes.append("kernel launches run in Python (no C compiler on the node?): lower launch rate")
        rows.append({"server": s.address, "hostname": s.hostname, "state": s.state,
                     "heartbeat_age_seconds": round(s.heartbeat_age_seconds, 1), "gpus": len(s.gpus),
                     "driver_version": s.driver_version, "cuda_version": s.cuda_version, "version": s.version,
                     "compute_enforcement": s.compute_enforcement, "launch_path": s.launch_path,
                     "static_inventory": s.static_inventory, "sharing": sharing,
                     "gpu_faults": [{"gpu_index": f.gpu_index, "gpu_uuid": f.gpu_uuid, "unix": f.unix, "error": f.error,
                                     "cross_tenant": f.cross_tenant, "sessions_ended": f.sessions_ended,
                                     "faulting": f.faulting, "recovered_seconds": f.recovered_seconds}
                                    for f in s.faults],
                     # -1: a figure the GPU does not report; source "emulated": no real GPU behind it
                     "gpu_telemetry": [_telemetry_row(t) for t in s.telemetry],
                     "notes": "; ".join(notes), "healthy": s.state != "down"})
    unhealthy = [r["server"] for r in rows if not r["healthy"]]
    if ctx.json_output and not deep:
        click.echo(json.dumps(rows, indent=2))
    elif not ctx.json_output:
        click.echo(f"pool {ctx.settings.pool}: serving; {len(rows)} server(s); down after "
                   f"{reply.down_after_seconds:g} s without heartbeat")
        if rows:
            click.echo(tabulate([[r["server"], r["state"], f"{r['heartbeat_age_seconds']:.1f}s", r["gpus"],
                                  r["driver_version"], r["sharing"], r["compute_enforcement"] or "-", r["notes"]]
                                 for r in rows],
                                headers=["SERVER", "STATE", "HEARTBEAT", "GPUS", "DRIVER", "SHARING", "COMPUTE",
                                         "NOTES"]))
    failed_checks: list[str] = []
    if deep:   # over SSH: driver, MPS, clocks, ECC, Xid, disk, libraries, clock skew, round trips
        from rgpu.remoting.admin.cli_ops import deep_checks
        failed_checks = deep_checks(ctx.settings, reply, rows, hosts, json_output=ctx.json_output)
    if not rows:
        raise Unhealthy("health", "no dispatcher has registered", "the pool has no GPUs to serve",
                          "start rgpu-dispatcher on the GPU nodes with --pool pointing here")
    if unhealthy:
        raise Unhealthy("health", f"{len(unhealthy)} server(s) down: {', '.join(unhealthy)}",
                          "no heartbeat within the limit", "check rgpu-dispatcher on those hosts")
    if failed_checks:
        raise Unhealthy("health", f"{len(failed_checks)} deep check(s) failed: {', '.join(failed_checks)}",
                          "see the FIX column", "fix them, then run rgpu-admin health --deep again")


@main.group()
def secret() -> None:
    """The cluster secret that authenticates daemons and signs lease tokens."""


@secret.command("create")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--force", is_flag=True, help="Replace an existing secret (invalidates every lease token).")
def secret_create(path: str, force: bool) -> None:
    """Write a new random secret to PATH with mode 0600."""
    created = create_secret(path, force=force)
    click.echo(f"wrote {created} (mode 0600); copy it to every rgpu host, readable only by rgpu's user")


main.add_command(install_units)
main.add_command(net_perf)
main.add_command(stats)
main.add_command(usage)

main.add_command(dashboard_url)

# Commands other components contribute (slurm-config) join through entry points.
for _name, _command in plugins.load(plugins.ADMIN_COMMANDS):
    main.add_command(_command)


if __name__ == "__main__":
    main()
