"""The worker's pure array logic: descriptors, mipmap levels, footprints, and the checks on the copy
requests a client sends (a host side that is not exactly the packed data is refused: the driver
would read or write the worker's own memory past it)."""

from __future__ import annotations

import struct

import pytest

from rgpu.remoting.datapath.backends.arrays import (DEVICE, HOST, ARRAY, LAYERED, MEMCPY3D, ArrayDesc, footprint,
                                                    parse_copy, parse_desc)
from rgpu.remoting.datapath.backends.base import INVALID_VALUE, CudaError
from rgpu.remoting.datapath.worker.handlers import Handlers


def test_descriptors_parse_and_pack_as_cuda_h_lays_them_out() -> None:
    d = parse_desc(struct.pack("<QQQiII4x", 37, 19, 5, 0x20, 4, LAYERED), three_d=True)
    assert (d.width, d.height, d.depth, d.format, d.channels, d.flags) == (37, 19, 5, 0x20, 4, LAYERED)
    assert d.element_bytes == 16 and d.row_bytes == 592
    assert parse_desc(d.pack2d(), three_d=False) == ArrayDesc(37, 19, 0, 0x20, 4)
    assert ArrayDesc(8, 8, 0, 0xC2, 4).element_bytes == 4           # UNORM_INT8X4
    assert ArrayDesc(8, 8, 0, 0x01, 3).element_bytes == 0           # three channels: no such array
    assert ArrayDesc(8, 8, 0, 0x91, 4).element_bytes == 0           # BC1: no per-texel layout


def test_mipmap_levels_halve_and_layers_stay() -> None:
    d = ArrayDesc(64, 32, 6, 0x20, 1, LAYERED)
    assert [(lv.width, lv.height, lv.depth) for lv in map(d.level, range(4))] == [(64, 32, 6), (32, 16, 6), (16, 8, 6), (8, 4, 6)]
    assert d.max_levels() == 7
    assert ArrayDesc(5, 0, 0, 0x20, 1).level(3).width == 1


def test_footprint_pads_rows_and_row_groups() -> None:
    assert footprint(ArrayDesc(37, 19, 0, 0x20, 1)) == 192 * 24               # 148 -> 192 bytes, 19 -> 24 rows
    assert footprint(ArrayDesc(4096, 4096, 0, 0x20, 4)) == 256 << 20
    assert footprint(ArrayDesc(64, 64, 0, 0x20, 1), levels=2) == 256 * 64 + 128 * 32
    assert footprint(ArrayDesc(100, 0, 0, 0x01, 1)) == 128                     # 1D: one row


def _request(kind: int, *, src: tuple[int, ...], dst: tuple[int, ...], extent: tuple[int, int, int]) -> memoryview:
    """An rgpuMemcpyArray(ToHost) payload: sides are (x, y, z, lod, type, device, array, pitch, height)."""
    def side(x: int, y: int, z: int, lod: int, kind_: int, dev: int, arr: int, pitch: int, height: int) -> tuple:
        return (x, y, z, lod, kind_, 0, dev, arr, 0, pitch, height)
    desc = MEMCPY3D.pack(*side(*src), *side(*dst), *extent)
    return memoryview(struct.pack("<IIQ", kind, 0, 0) + desc + struct.pack("<Q", 0))


def test_copy_requests_whose_host_side_is_the_packed_data_are_accepted() -> None:
    p = _request(2, src=(0, 0, 0, 0, HOST, 0, 0, 24, 6), dst=(4, 1, 2, 0, ARRAY, 0, 0x500, 0, 0), extent=(24, 6, 3))
    kind, _stream, desc, packed = Handlers._array_copy(p, to_host=False)
    assert kind == 2 and packed == 24 * 6 * 3 and parse_copy(desc).dst.z == 2
    p = _request(0, src=(8, 2, 0, 0, ARRAY, 0, 0x500, 0, 0), dst=(0, 0, 0, 0, HOST, 0, 0, 24, 0), extent=(24, 6, 1))
    assert Handlers._array_copy(p, to_host=True)[3] == 24 * 6
    p = _request(0, src=(8, 2, 0, 0, DEVICE, 0x7000, 0, 512, 0), dst=(0, 0, 0, 0, ARRAY, 0, 0x500, 0, 0), extent=(24, 6, 1))
    assert Handlers._array_copy(p, to_host=False)[3] == 0                      # no host side: no data


@pytest.mark.parametrize("case", ["pitch past the data", "offset into the data", "height past the data",
                                  "host destination in a request with data", "no host side to read into", "kind"])
def test_copy_requests_that_would_reach_past_the_worker_buffer_are_refused(case: str) -> None:
    host_src = (0, 0, 0, 0, HOST, 0, 0, 24, 6)
    arr = (0, 0, 0, 0, ARRAY, 0, 0x500, 0, 0)
    to_host, kind, src, dst = {
        "pitch past the data": (False, 2, (0, 0, 0, 0, HOST, 0, 0, 4096, 6), arr),
        "offset into the data": (False, 0, (0, 3, 0, 0, HOST, 0, 0, 24, 0), arr),
        "height past the data": (False, 2, (0, 0, 0, 0, HOST, 0, 0, 24, 600), arr),
        "host destination in a request with data": (False, 2, host_src, (0, 0, 0, 0, HOST, 0, 0, 24, 6)),
        "no host side to read into": (True, 2, arr, arr),
        "kind": (False, 7, host_src, arr),
    }[case]
    with pytest.raises(CudaError) as err:
        Handlers._array_copy(_request(kind, src=src, dst=dst, extent=(24, 6, 3)), to_host=to_host)
    assert err.value.code == INVALID_VALUE and err.value.message.startswith("rgpu: worker: ")
