"""The size of one GPU slice: whole percent of a GPU, or bytes of its memory. Pure: no I/O.

Every edge that reads a size from a person (job_submit's comment on the Python side, `rgpu-admin
request-gpus`, `flexrun`, the pool's Allocate) parses it here, once, and carries the integer after
that. The smallest slice, the rounding and the error wording live here and nowhere else;
job_submit.lua keeps its own copy of the grammar, and tests/data/slice_size_cases.json holds the
cases every one of them is tested against.

A granted slice (SliceLimits) holds both: the bytes and the percent the pool placed it with. The
token, adaptor.conf and a worker's session spec carry those two integers and check them here.

A fraction is written as text with at most two meaningful decimals ("0.5", "0.25", ".5", "1"):
slices are whole hundredths of a GPU, so "0.333" is refused with the nearest one named, and
anything below 0.005 (which would round to 0) is refused as below the smallest slice, 0.01.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from rgpu.errors import InvalidRequest
from rgpu.units import MAX_BYTES, format_bytes, parse_size

PERCENT_PER_GPU = 100
# The grammar job_submit.lua accepts too: "1", "0.5", ".5", "1." (no sign, no exponent).
_NUMBER_RE = re.compile(r"^(?:\d+|\d+\.\d*|\.\d+)$", re.ASCII)


def _shown(text: object) -> str:
    shown = repr(text)
    return shown if len(shown) <= 42 else shown[:39] + "..."


def _check_percent(component: str, name: str, value: object) -> None:
    if not (type(value) is int and 1 <= value <= PERCENT_PER_GPU):
        raise InvalidRequest(component, f"invalid {name} {_shown(value)}", "a whole number from 1 to 100", "")


def _check_memory(component: str, name: str, value: object) -> None:
    if not (type(value) is int and 0 < value <= MAX_BYTES):
        raise InvalidRequest(component, f"invalid {name} {_shown(value)}", "more than 0 and at most 1 EiB", "")


@dataclass(frozen=True)
class SliceSize:
    """One slice's size: `percent` of a GPU (1-100), or `memory_bytes` of its memory; never both."""

    percent: int = 0
    memory_bytes: int = 0

    def __post_init__(self) -> None:
        by_percent, by_memory = self.percent != 0, self.memory_bytes != 0
        if by_percent == by_memory:
            raise InvalidRequest("slice size", "give either a fraction or a memory size per slice",
                                 "a slice is sized by exactly one of them", "")
        if by_percent:
            _check_percent("slice size", "percent", self.percent)
        if by_memory:
            _check_memory("slice size", "memory size", self.memory_bytes)

    @property
    def fraction(self) -> float:
        """The percent as a fraction of a GPU (0.0 for a memory-sized slice): for display only."""
        return self.percent / PERCENT_PER_GPU

    def describe(self) -> str:
        """'fraction 0.5' or 'memory 8.0 GiB', as errors and logs show a request."""
        if self.percent:
            return f"fraction {format_hundredths(self.percent)}"
        return f"memory {format_bytes(self.memory_bytes)}"


WHOLE_GPU = SliceSize(percent=PERCENT_PER_GPU)


@dataclass(frozen=True)
class SliceLimits:
    """What a granted slice holds: `memory_limit_bytes` of its GPU's memory and `compute_percent` of
    its compute, both set (the pool's placement turns a SliceSize into these). Checked where they
    are read back from text (the token's claims, adaptor.conf, a worker's session spec), with the
    reader named as `component`, so a bad value is one line saying where it came from."""

    memory_limit_bytes: int
    compute_percent: int
    component: str = field(default="slice limits", compare=False)

    def __post_init__(self) -> None:
        _check_memory(self.component, "memory_limit_bytes", self.memory_limit_bytes)
        _check_percent(self.component, "compute_percent", self.compute_percent)

    @property
    def share(self) -> float:
        """The compute percent as a share of the GPU (0.01-1.0), as the limiter meters it."""
        return self.compute_percent / PERCENT_PER_GPU


def format_hundredths(percent: int) -> str:
    """33 -> '0.33', 50 -> '0.5', 100 -> '1' (job_submit.lua's rgpu.format_hundredths)."""
    if percent >= PERCENT_PER_GPU:
        return "1"
    return f"0.{percent:02d}".rstrip("0")


def parse_fraction(text: str, *, component: str, option: str = "fraction=", example: str = "") -> int:
    """Percent of a GPU from a fraction written as text ('0.5' -> 50). `option` is how the caller's
    users write it ('fraction=' in a Slurm comment, '-p ' on a command line): the fix names it, and
    `example` (default: the option with 0.5) is the one offered for a value that is no fraction."""
    example = f"write e.g. {example or option + '0.5'}"
    if not isinstance(text, str) or not _NUMBER_RE.match(text):
        raise InvalidRequest(component, f"invalid fraction {_shown(text)}", "not a number", example)
    value = float(text)
    if not 0 < value <= 1:
        raise InvalidRequest(component, f"invalid fraction {_shown(text)}", "it must be more than 0 and at most 1",
                             example)
    if value < 0.005:
        raise InvalidRequest(component, f"invalid fraction {_shown(text)}", "the smallest slice is 0.01 of a GPU",
                             f"ask for {option}0.01 or more")
    hundredths = math.floor(PERCENT_PER_GPU * value + 0.5)
    # Read from the text, not the float: a float would hide 0.3333333's tail.
    if text.partition(".")[2][2:].strip("0"):
        raise InvalidRequest(component, f"invalid fraction {_shown(text)}", "slices are whole hundredths of a GPU",
                             f"write {option}{format_hundredths(max(1, hundredths))}")
    return hundredths


def percent_of_fraction_value(value: float, *, component: str) -> int:
    """Percent of a GPU from a fraction sent as a number (AllocateRequest.fraction of clients before
    the percent field): the bounds of parse_fraction, rounded to the nearest hundredth as those
    clients' pools did."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
            or not 0 < value <= 1:
        raise InvalidRequest(component, f"invalid fraction {_shown(value)}", "it must be more than 0 and at most 1",
                             "ask for e.g. 0.5 of a GPU")
    if value < 0.005:
        raise InvalidRequest(component, f"invalid fraction {value:g}", "the smallest slice is 0.01 of a GPU",
                             "ask for 0.01 of a GPU or more")
    return math.floor(PERCENT_PER_GPU * value + 0.5)


def parse_memory(text: str | int, *, component: str, field: str = "memory") -> int:
    """Bytes per slice from '8G', '512M', ... (rgpu.units: the project's one size grammar)."""
    return parse_size(text, field, component=component)


def from_options(fraction: str | None, memory: str | None, *, component: str, fraction_option: str,
                 memory_option: str, default: SliceSize | None = WHOLE_GPU) -> SliceSize:
    """The size a command line asks for: a fraction, a memory size or (neither given) `default`;
    both, or neither without a default, is a usage error naming the options."""
    if fraction is not None and memory is not None:
        raise InvalidRequest(component, f"{fraction_option.strip()} and {memory_option.strip()} cannot be used together",
                             "a slice is sized by a fraction or by memory", f"give one of them, e.g. "
                             f"{fraction_option}0.5 or {memory_option}8G")
    if fraction is not None:
        return SliceSize(percent=parse_fraction(fraction, component=component, option=fraction_option))
    if memory is not None:
        return SliceSize(memory_bytes=parse_memory(memory, component=component))
    if default is None:
        raise InvalidRequest(component, "no slice size given", f"give {fraction_option.strip()} or {memory_option.strip()}",
                             f"e.g. {fraction_option}0.5 or {memory_option}8G")
    return default


def percent_of_memory(memory_bytes: int, usable_memory_bytes: int) -> int:
    """Percent of a GPU a memory-sized slice counts for on a GPU of this usable memory (1-100)."""
    if usable_memory_bytes <= 0:
        return PERCENT_PER_GPU
    return max(1, min(PERCENT_PER_GPU, math.ceil(PERCENT_PER_GPU * memory_bytes / usable_memory_bytes)))


def memory_of_percent(percent: int, usable_memory_bytes: int) -> int:
    """Bytes of a GPU's usable memory a percent-sized slice gets (rounded down)."""
    return usable_memory_bytes * percent // PERCENT_PER_GPU
