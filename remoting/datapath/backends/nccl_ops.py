"""NCCL's data types, reduction operators and result codes, and the element-wise reductions the
emulated GPU's collectives apply to host bytes. Pure: no I/O."""

from __future__ import annotations

import struct
from array import array

# ncclResult_t
SUCCESS, UNHANDLED_CUDA_ERROR, SYSTEM_ERROR, INTERNAL_ERROR, INVALID_ARGUMENT, INVALID_USAGE, REMOTE_ERROR = range(7)
# ncclRedOp_t
SUM, PROD, MAX, MIN, AVG = range(5)
NUM_OPS = 5   # ncclNumOps: operators from ncclRedOpCreatePreMulSum are numbered from here
OP_NAMES = {SUM: "sum", PROD: "prod", MAX: "max", MIN: "min", AVG: "avg"}

# ncclDataType_t -> (struct format, size, is an integer type)
DTYPES: dict[int, tuple[str, int, bool]] = {
    0: ("b", 1, True), 1: ("B", 1, True), 2: ("i", 4, True), 3: ("I", 4, True), 4: ("q", 8, True),
    5: ("Q", 8, True), 6: ("e", 2, False), 7: ("f", 4, False), 8: ("d", 8, False),
}
DTYPE_NAMES = {0: "int8", 1: "uint8", 2: "int32", 3: "uint32", 4: "int64", 5: "uint64", 6: "float16", 7: "float32",
               8: "float64", 9: "bfloat16"}
_UNSIGNED = {1: "B", 2: "H", 4: "I", 8: "Q"}
_ARRAY_CODES = {"b": "b", "B": "B", "i": "i", "I": "I", "q": "q", "Q": "Q", "f": "f", "d": "d"}


class Unsupported(ValueError):
    """A data type or operator this implementation does not handle; the text says which."""


def element_size(dtype: int) -> int:
    if dtype not in DTYPES:
        raise Unsupported(f"data type {DTYPE_NAMES.get(dtype, dtype)} is not supported by the emulated GPU's NCCL")
    return DTYPES[dtype][1]


def _values(data: bytes, fmt: str) -> list:
    if fmt in _ARRAY_CODES:
        return array(_ARRAY_CODES[fmt], data).tolist()
    return list(struct.unpack(f"<{len(data) // 2}{fmt}", data))


def _pack(values: list, fmt: str, size: int, integer: bool) -> bytes:
    if integer:   # two's complement wrap-around, as the GPU's integer arithmetic
        mask = (1 << (8 * size)) - 1
        return array(_UNSIGNED[size], [v & mask for v in values]).tobytes()
    if fmt in _ARRAY_CODES:
        return array(_ARRAY_CODES[fmt], values).tobytes()
    return struct.pack(f"<{len(values)}{fmt}", *values)


def scalar(raw: bytes, dtype: int) -> int | float:
    """One element of `dtype` from its bytes (a PreMulSum operator's scalar)."""
    fmt, size, _ = DTYPES[dtype]
    return struct.unpack(f"<{fmt}", raw[:size])[0]


def reduce(parts: list[bytes], dtype: int, op: int, scale: int | float | None = None) -> bytes:
    """Element-wise `op` over the ranks' buffers, in rank order (so every rank computes the same bytes).
    `scale` (with SUM): each rank's element is multiplied by it first, as ncclRedOpCreatePreMulSum's
    operator does."""
    fmt, size, integer = DTYPES[dtype] if dtype in DTYPES else ("", 0, False)
    if not fmt:
        raise Unsupported(f"data type {DTYPE_NAMES.get(dtype, dtype)} is not supported by the emulated GPU's NCCL")
    if op not in OP_NAMES:
        raise Unsupported(f"reduction operator {op} is not supported by the emulated GPU's NCCL (sum, prod, max, min, avg)")
    if scale is not None:
        parts = [_pack([v * scale for v in _values(p, fmt)], fmt, size, integer) for p in parts]
    acc = _values(parts[0], fmt)
    for part in parts[1:]:
        other = _values(part, fmt)
        if op in (SUM, AVG):
            acc = [a + b for a, b in zip(acc, other)]
        elif op == PROD:
            acc = [a * b for a, b in zip(acc, other)]
        elif op == MAX:
            acc = [max(a, b) for a, b in zip(acc, other)]
        else:
            acc = [min(a, b) for a, b in zip(acc, other)]
    if op == AVG:
        n = len(parts)
        acc = [int(a / n) for a in acc] if integer else [a / n for a in acc]
    return _pack(acc, fmt, size, integer)


def shrink_members(nranks: int, rank: int, exclude: list[int]) -> list[int]:
    """The parent ranks that stay in ncclCommShrink's new communicator, in the parent's order (their new
    ranks are their places here); ValueError with the reason when `exclude` is not a list of other
    ranks of the parent."""
    gone = set(exclude)
    if len(gone) != len(exclude):
        raise ValueError(f"excludeRanksList names a rank twice ({sorted(exclude)})")
    if any(not 0 <= r < nranks for r in gone):
        raise ValueError(f"excludeRanksList {sorted(exclude)} names a rank outside 0..{nranks - 1}")
    if rank in gone:
        raise ValueError(f"rank {rank} excludes itself (an excluded rank does not call ncclCommShrink)")
    return [r for r in range(nranks) if r not in gone]
