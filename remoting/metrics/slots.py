"""Slot numbers: a slice's label in metrics, in place of its job key.

Job keys are chosen by whoever leases (users too), so as labels they made one series per job ever
run (836 series from one user on 4 GPUs: issue 26). A slice is labelled instead with its slot,
its position among the slices on its GPU (0, 1, ...): the series are bounded by the slices a GPU
can hold. Which job holds a slot is in `rgpu-admin leases` and the dashboard, which need a
credential."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


def slots(slices: Iterable[tuple[str, K]]) -> dict[tuple[str, K], str]:
    """Each (gpu, key) its slot on that GPU, in the order given."""
    taken: Counter[str] = Counter()
    out: dict[tuple[str, K], str] = {}
    for gpu, key in slices:
        if (gpu, key) not in out:
            out[(gpu, key)] = str(taken[gpu])
            taken[gpu] += 1
    return out
