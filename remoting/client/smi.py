"""`nvidia-smi` for remote slices, built on NVML (rgpu's libnvidia-ml.so.1 under flexrun).

NVIDIA's nvidia-smi runs on rgpu's NVML where it is installed, but CPU nodes usually have no
NVIDIA driver tools. There `flexrun -- nvidia-smi ...` runs this module instead (RGPU_SMI=rgpu
forces it, RGPU_SMI=nvidia forces NVIDIA's binary). It prints the familiar table, `-L`, and
`--query-gpu=... --format=csv[,noheader][,nounits]`, from the public NVML calls that every NVML
application uses; memory is the slice's.

    python -m rgpu.remoting.client.smi [-L] [--query-gpu=FIELDS --format=csv[,noheader][,nounits]] [-i N]
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import click

from rgpu.errors import InvalidRequest, RgpuError
from rgpu.remoting.client.cli import tool_command

TOOL = "smi"
MiB = 1 << 20
NVML_EXIT = 9      # NVML did not start: not under flexrun
FIELDS = ("index", "name", "uuid", "pci.bus_id", "driver_version", "count", "memory.total", "memory.used",
          "memory.free", "utilization.gpu", "utilization.memory", "temperature.gpu", "power.draw", "power.limit",
          "pstate", "clocks.sm", "clocks.mem", "compute_mode")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _try(fn: Callable[[], Any], default: Any = None) -> Any:
    import pynvml
    try:
        return fn()
    except pynvml.NVMLError:
        return default


class Gpu:
    def __init__(self, index: int) -> None:
        import pynvml
        self.nvml = pynvml
        self.index = index
        self.h = pynvml.nvmlDeviceGetHandleByIndex(index)

    def field(self, name: str, units: bool) -> str:
        n, h = self.nvml, self.h
        mem = _try(lambda: n.nvmlDeviceGetMemoryInfo(h))
        util = _try(lambda: n.nvmlDeviceGetUtilizationRates(h))

        def mib(v: int | None) -> str:
            return "[N/A]" if v is None else f"{v // MiB}{' MiB' if units else ''}"

        def pct(v: int | None) -> str:
            return "[N/A]" if v is None else f"{v}{' %' if units else ''}"

        def watts(mw: int | None) -> str:
            return "[N/A]" if mw is None else f"{mw / 1000:.2f}{' W' if units else ''}"

        def mhz(v: int | None) -> str:
            return "[N/A]" if v is None else f"{v}{' MHz' if units else ''}"

        table: dict[str, Callable[[], str]] = {
            "index": lambda: str(self.index),
            "name": lambda: _text(n.nvmlDeviceGetName(h)),
            "uuid": lambda: _text(n.nvmlDeviceGetUUID(h)),
            "pci.bus_id": lambda: _text(_try(lambda: n.nvmlDeviceGetPciInfo(h).busId, b"[N/A]")),
            "driver_version": lambda: _text(n.nvmlSystemGetDriverVersion()),
            "count": lambda: str(n.nvmlDeviceGetCount()),
            "memory.total": lambda: mib(mem.total if mem else None),
            "memory.used": lambda: mib(mem.used if mem else None),
            "memory.free": lambda: mib(mem.free if mem else None),
            "utilization.gpu": lambda: pct(util.gpu if util else None),
            "utilization.memory": lambda: pct(util.memory if util else None),
            "temperature.gpu": lambda: str(_try(lambda: n.nvmlDeviceGetTemperature(h, 0), "[N/A]")),
            "power.draw": lambda: watts(_try(lambda: n.nvmlDeviceGetPowerUsage(h))),
            "power.limit": lambda: watts(_try(lambda: n.nvmlDeviceGetEnforcedPowerLimit(h))),
            "pstate": lambda: f"P{_try(lambda: n.nvmlDeviceGetPerformanceState(h), '?')}",
            "clocks.sm": lambda: mhz(_try(lambda: n.nvmlDeviceGetClockInfo(h, 1))),
            "clocks.mem": lambda: mhz(_try(lambda: n.nvmlDeviceGetClockInfo(h, 2))),
            "compute_mode": lambda: {0: "Default", 1: "Exclusive_Thread", 2: "Prohibited", 3: "Exclusive_Process"}
                .get(_try(lambda: n.nvmlDeviceGetComputeMode(h), -1), "[N/A]"),
        }
        if name not in table:   # FIELDS lists the keys of this table
            raise KeyError(name)
        return table[name]()


def query(gpus: list[Gpu], fields: list[str], fmt: str) -> str:
    opts = {o.strip() for o in fmt.split(",")}
    if "csv" not in opts:
        raise InvalidRequest(TOOL, f"--format={fmt} is not supported", "only csv is, with noheader and nounits",
                             "use --format=csv[,noheader][,nounits]")
    units = "nounits" not in opts
    lines = []
    if "noheader" not in opts:
        unit_names = {"memory.total": " [MiB]", "memory.used": " [MiB]", "memory.free": " [MiB]",
                      "utilization.gpu": " [%]", "utilization.memory": " [%]", "power.draw": " [W]",
                      "power.limit": " [W]", "clocks.sm": " [MHz]", "clocks.mem": " [MHz]"}
        lines.append(", ".join(f + (unit_names.get(f, "") if units else "") for f in fields))
    for gpu in gpus:
        try:
            lines.append(", ".join(gpu.field(f, units) for f in fields))
        except KeyError as exc:
            raise InvalidRequest(TOOL, f"field {exc} is not supported", f"supported: {', '.join(FIELDS)}",
                                 "query those fields") from None
    return "\n".join(lines)


def table(gpus: list[Gpu]) -> str:
    import pynvml as n
    driver = _text(n.nvmlSystemGetDriverVersion())
    cuda = n.nvmlSystemGetCudaDriverVersion()
    out = [time.strftime("%a %b %d %H:%M:%S %Y"),
           "+-----------------------------------------------------------------------------------------+",
           f"| RGPU-SMI (remote slices)          Driver Version: {driver:<15} CUDA Version: {cuda // 1000}.{cuda % 1000 // 10:<5}|",
           "+-----------------------------------------+------------------------+----------------------+",
           "| GPU  Name                               |          Bus-Id        |  Memory-Usage (slice)|",
           "| Temp  Perf          Pwr:Usage/Cap        |                        | GPU-Util  Compute M. |",
           "|=========================================+========================+======================|"]
    for g in gpus:
        name = g.field("name", True)[:34]
        bus = g.field("pci.bus_id", True)
        used, total = g.field("memory.used", False), g.field("memory.total", False)
        temp = g.field("temperature.gpu", False)
        power = f"{g.field('power.draw', False).split('.')[0]}W / {g.field('power.limit', False).split('.')[0]}W"
        out.append(f"| {g.index:>3}  {name:<34} | {bus:>22} | {used + 'MiB / ' + total + 'MiB':>20} |")
        out.append(f"| {temp + 'C':>4}  {g.field('pstate', True):<4} {power:>25}     |                        |"
                   f" {g.field('utilization.gpu', True):>8}  {g.field('compute_mode', True):>10} |")
        out.append("+-----------------------------------------+------------------------+----------------------+")
    out += ["", "+-----------------------------------------------------------------------------------------+",
            "| Processes: the application's GPU work runs on the GPU server; none are local here.     |",
            "+-----------------------------------------------------------------------------------------+"]
    return "\n".join(out)


_CONTEXT = {"help_option_names": ["-h", "--help"],
            # nvidia-smi has many more options: those are ignored with a warning, not refused.
            "ignore_unknown_options": True, "allow_extra_args": True}


@tool_command(TOOL, context_settings=_CONTEXT, help=__doc__)
@click.option("-L", "--list-gpus", is_flag=True, help="One line per GPU: index, name, UUID.")
@click.option("--query-gpu", metavar="FIELDS", help="Comma-separated fields, e.g. index,name,memory.total.")
@click.option("--format", "fmt", default="csv", show_default=True, help="csv[,noheader][,nounits]")
@click.option("-i", "--id", "gpu_id", type=int, help="Only this GPU index.")
@click.pass_context
def cli(ctx: click.Context, list_gpus: bool, query_gpu: str | None, fmt: str, gpu_id: int | None) -> int:
    if ctx.args:
        click.echo(f"rgpu: smi: ignoring options not supported for remote slices: {' '.join(ctx.args)}", err=True)
    import pynvml
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        click.echo(f"rgpu: smi: NVML did not start ({exc}; run it under flexrun, which connects the slices)", err=True)
        return NVML_EXIT
    try:
        count = pynvml.nvmlDeviceGetCount()
        gpus = [Gpu(i) for i in range(count) if gpu_id is None or i == gpu_id]
        if list_gpus:
            click.echo("\n".join(f"GPU {g.index}: {g.field('name', True)} (UUID: {g.field('uuid', True)})" for g in gpus))
        elif query_gpu:
            click.echo(query(gpus, [f.strip() for f in query_gpu.split(",") if f.strip()], fmt))
        else:
            click.echo(table(gpus))
    except RgpuError as exc:
        click.echo(str(exc), err=True)
        return exc.exit_code
    finally:
        pynvml.nvmlShutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.main(args=argv, standalone_mode=False)


if __name__ == "__main__":
    raise SystemExit(main())
