"""The NCCL result checks shared by the NCCL tests (emulated and real GPU)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


COUNT = 1000


def _inputs(rank: int, nranks: int) -> dict[str, np.ndarray]:
    i = np.arange(COUNT)
    return {"f": ((rank + 1) * (i % 7 + 1)).astype(np.float32), "i32": (rank * 1000 + i).astype(np.int32),
            "i64": (rank * 1000 + i).astype(np.int64), "d": ((rank + 1) * (i % 5 + 1)).astype(np.float64),
            "scatter": ((rank + 1) * (np.arange(COUNT * nranks) % 11 + 1)).astype(np.float32)}


def _expected(rank: int, nranks: int) -> list[tuple[str, np.ndarray]]:
    """What nccl_ranks.c's rank `rank` writes, computed with numpy (its comment gives the order)."""
    ins = [_inputs(r, nranks) for r in range(nranks)]
    out = [("all-reduce sum", sum(x["f"] for x in ins).astype(np.float32)),
           ("all-reduce max", np.max([x["i32"] for x in ins], axis=0)),
           ("broadcast", ins[-1]["f"])]
    if rank == 0:
        out.append(("reduce", sum(x["i64"] for x in ins)))
    out += [("all-gather", np.concatenate([x["f"] for x in ins])),
            ("reduce-scatter", sum(x["scatter"] for x in ins)[rank * COUNT:(rank + 1) * COUNT].astype(np.float32)),
            ("send/recv", ins[(rank - 1) % nranks]["i32"]),
            ("all-reduce avg", sum(x["d"] for x in ins) / nranks)]
    return out


def _check(path: Path, rank: int, nranks: int, split_halves: bool = False) -> None:
    data = path.read_bytes()
    at = 0
    expected = _expected(rank, nranks)
    if split_halves:   # nccl_ranks all: a split by rank % 2, then all-reduce sum on each half
        half = sum(_inputs(r, nranks)["f"] for r in range(nranks) if r % 2 == rank % 2).astype(np.float32)
        expected.append(("split all-reduce", half))
    for name, want in expected:
        got = np.frombuffer(data, dtype=want.dtype, count=want.size, offset=at)
        at += want.nbytes
        assert np.array_equal(got, want), f"rank {rank} of {nranks}: {name} differs from numpy's"
    assert at == len(data)


def _expected_more(rank: int, nranks: int) -> list[tuple[str, np.ndarray]]:
    """What nccl_ranks.c's `more` writes for rank `rank` (its comment gives the order)."""
    ins = [_inputs(r, nranks) for r in range(nranks)]
    mine = slice(rank * COUNT, (rank + 1) * COUNT)
    out = [("premul sum, host scalar 0.5", sum(np.float32(0.5) * x["f"] for x in ins).astype(np.float32)),
           ("premul sum, device scalar 0.25", sum(0.25 * x["d"] for x in ins)),
           ("all-to-all", np.concatenate([x["scatter"][mine] for x in ins])),
           ("split by rank % 2", sum(ins[r]["f"] for r in range(nranks) if r % 2 == rank % 2).astype(np.float32))]
    if rank != 0:
        out.append(("split without rank 0", np.max([ins[r]["i32"] for r in range(1, nranks)], axis=0)))
    return out


def _expected_scale(rank: int, nranks: int) -> list[tuple[str, np.ndarray]]:
    """What nccl_ranks.c's `scale` writes for rank `rank` (its comment gives the order)."""
    ins = [_inputs(r, nranks) for r in range(nranks)]
    out = [("all-reduce sum over the scalable init", sum(x["f"] for x in ins).astype(np.float32))]
    if rank >= 1:
        out.append(("all-reduce max after shrinking rank 0 away", np.max([x["i32"] for x in ins[1:]], axis=0)))
    if rank >= 2:
        out.append(("all-reduce sum after shrinking again", sum(x["f"] for x in ins[2:]).astype(np.float32)))
    return out


def _scale_lines(rank: int, nranks: int) -> list[str]:
    """What nccl_ranks.c's `scale` prints for rank `rank`."""
    lines = [f"shrink {rank - 1} of {nranks - 1}"] if rank >= 1 else []
    lines += [f"again {rank - 2} of {nranks - 2}"] if rank >= 2 else []
    return lines + ["OK"]


def _check_outputs(path: Path, expected: list[tuple[str, np.ndarray]], who: str) -> None:
    """`path` holds exactly `expected`'s arrays, one after the other (nccl_ranks.c's OUT)."""
    data, at = path.read_bytes(), 0
    for name, want in expected:
        got = np.frombuffer(data, dtype=want.dtype, count=want.size, offset=at)
        at += want.nbytes
        assert np.array_equal(got, want), f"{who}: {name} differs from numpy's"
    assert at == len(data), f"{who}: {len(data) - at} bytes more than expected"
