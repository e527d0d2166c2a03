"""Progress on long admin commands (health over many hosts, net-perf): a bar on stderr, shown
only when stderr is a terminal, so pipes, logs and --json output stay clean."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from typing import TextIO, TypeVar

import click

T = TypeVar("T")


def shown(stream: TextIO | None = None) -> bool:
    stream = stream or sys.stderr
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def progress(items: Iterable[T], label: str, *, length: int | None = None, stream: TextIO | None = None,
             describe: Callable[[T], str] | None = None) -> Iterator[T]:
    """Yield `items`, drawing a bar labelled `label` on stderr (a TTY only); `describe(item)`
    names the item in progress."""
    stream = stream or sys.stderr
    if not shown(stream):
        yield from items
        return
    if length is None:    # an iterator of results as they complete gives its length instead
        items = list(items)
        length = len(items)
    show: Callable[[T | None], str] | None = None
    if describe is not None:
        def show(item: T | None) -> str:
            return describe(item) if item is not None else ""
    with click.progressbar(items, length=length, label=label, file=stream, item_show_func=show,
                           show_pos=True) as bar:
        yield from bar
