"""The edge of the client tools (flexrun, smi): click parses, and every failure leaves as one line
in rgpu's format, `rgpu: <tool>: <what> (<why>; <how to fix>)`, with rgpu's exit codes."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import click

from rgpu.errors import InvalidRequest

USAGE_EXIT = InvalidRequest.exit_code   # 2, as click and argparse use for usage errors


def usage_error(tool: str, exc: click.ClickException, help_command: str = "") -> InvalidRequest:
    message = " ".join(exc.format_message().split()).rstrip(".")
    return InvalidRequest(tool, "invalid command line", message, f"see `{help_command or tool} --help`")


class ToolCommand(click.Command):
    """A command whose callback returns its exit status (having printed its own RgpuErrors as one
    line), and whose usage errors are one rgpu line too, exit status 2. Standalone (the console
    script, CliRunner) it exits with the status; otherwise main() returns it."""

    tool = "rgpu"

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,  # type: ignore[override]
             complete_var: str | None = None, standalone_mode: bool = True, **extra: Any) -> int:
        try:
            result = super().main(args=list(sys.argv[1:] if args is None else args), prog_name=prog_name or self.tool,
                                  complete_var=complete_var, standalone_mode=False, **extra)
            code = int(result or 0)    # also --help: click returns Exit's status here
        except click.ClickException as exc:
            click.echo(str(usage_error(self.tool, exc)), err=True)
            code = USAGE_EXIT
        except click.Abort:
            code = 130
        if standalone_mode:
            sys.exit(code)
        return code


def tool_command(tool: str, **kwargs: Any) -> Any:
    """`@tool_command("flexrun", ...)`: click.command with ToolCommand's error edge."""
    cls = type(f"{tool.title()}Command", (ToolCommand,), {"tool": tool})
    return click.command(tool, cls=cls, **kwargs)
