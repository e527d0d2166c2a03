"""What a module image's variables take on the device, read from the image (pure logic), against
images nvcc 13.0 made (tests/remoting/data/module_images, rebuilt by its build.sh) and hostile
ones built by hand."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from rgpu.remoting.datapath.worker.module_footprint import (FATBIN_MAGIC, FLAG_LZ4, FLAG_ZSTD, ImageFootprints,
                                                           ImageUnreadable, image_data_bytes, parse_capability,
                                                           ptx_data_bytes)

IMAGES = Path(__file__).parent / "data" / "module_images"
GiB, KiB = 1 << 30, 1 << 10
HOPPER, AMPERE_86 = (9, 0), (8, 6)
# globals.cu: a 1 GiB zero-initialised array, 4 KiB initialised, 16 KiB managed, a 1 KiB
# constant table (cubins add the kernel's small parameter bank and the driver's constant bank).
VARIABLES = GiB + 4 * KiB + 16 * KiB + KiB


@pytest.mark.parametrize("name", ["globals.sm_90.cubin", "globals.plain.fatbin", "globals.lz4.fatbin",
                                  "globals.zstd.fatbin", "globals.sm_80-sm_90.fatbin"])
def test_cubins_and_fatbins_count_every_variable(name: str) -> None:
    size = image_data_bytes((IMAGES / name).read_bytes(), HOPPER)
    assert VARIABLES <= size <= VARIABLES + 4 * KiB, (name, size)


@pytest.mark.parametrize("name", ["globals.ptx", "globals.ptx-only.fatbin"])
def test_ptx_counts_its_global_and_const_variables(name: str) -> None:
    assert image_data_bytes((IMAGES / name).read_bytes(), HOPPER) == VARIABLES


def test_only_entries_the_device_could_load_count() -> None:
    # sm_90 code cannot run on an 8.6 device, nor compute_90 PTX be compiled for it: the driver
    # refuses such a load, which then holds nothing. An sm_80 cubin runs on 8.6 and counts.
    assert image_data_bytes((IMAGES / "globals.plain.fatbin").read_bytes(), AMPERE_86) == 0
    assert image_data_bytes((IMAGES / "globals.ptx-only.fatbin").read_bytes(), AMPERE_86) == 0
    assert image_data_bytes((IMAGES / "globals.sm_80-sm_90.fatbin").read_bytes(), AMPERE_86) >= VARIABLES


def test_ptx_declarations_of_every_shape() -> None:
    ptx = """
    .version 8.8
    .target sm_90
    .address_size 64
    // .global .align 1 .b8 in_a_comment[999999];
    /* .global .b8 in_a_block_comment[999999]; */
    .extern .global .align 4 .b8 defined_elsewhere[4096];
    .global .texref old_texture;
    .visible .global .align 16 .v4 .f32 vectors[10];
    .global .u32 scalar;
    .global .align 4 .u32 listed[] = {1, 2, 3};
    .weak .global .align 8 .b64 grid[3][4];
    .const .align 2 .f16 halfs[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    .visible .entry k(.param .u64 p) { st.global.u32 [p], 1; ret; }
    """
    assert ptx_data_bytes(ptx) == 160 + 4 + 12 + 96 + 16


@pytest.mark.parametrize("ptx", [".global .align 4 .b8 unsized[];", ".global .align 4 .opaque thing;"])
def test_ptx_variables_that_cannot_be_sized_are_refused(ptx: str) -> None:
    with pytest.raises(ImageUnreadable):
        ptx_data_bytes(".version 8.8\n.target sm_90\n" + ptx + "\n")


def _cubin() -> bytes:
    return (IMAGES / "globals.sm_90.cubin").read_bytes()


def test_damaged_cubins_are_refused() -> None:
    cubin = _cubin()
    truncated = cubin[:len(cubin) // 2]   # the section headers sit at the end
    big_endian = cubin[:5] + b"\x02" + cubin[6:]
    headers_away = cubin[:0x28] + struct.pack("<Q", 1 << 40) + cubin[0x30:]
    for bad in (truncated, big_endian, headers_away, b"\x7fELF"):
        with pytest.raises(ImageUnreadable):
            image_data_bytes(bad, HOPPER)


def _fatbin(payload: bytes, flags: int, expanded: int, kind: int = 2, arch: int = 90) -> bytes:
    """One container with one entry, laid out as nvcc writes it (64-byte entry header)."""
    entry = bytearray(64)
    struct.pack_into("<HHIQ", entry, 0, kind, 0x101, 64, len(payload))
    struct.pack_into("<I", entry, 16, len(payload))
    struct.pack_into("<I", entry, 28, arch)
    struct.pack_into("<Q", entry, 40, flags | 0x11)
    struct.pack_into("<Q", entry, 56, expanded)
    body = bytes(entry) + payload
    return struct.pack("<IHHQ", FATBIN_MAGIC, 1, 16, len(body)) + body


def test_hostile_compressed_entries_are_refused() -> None:
    import lz4.block
    import zstandard
    cubin = _cubin()
    packed = zstandard.ZstdCompressor().compress(cubin)
    assert image_data_bytes(_fatbin(packed, FLAG_ZSTD, len(cubin)), HOPPER) >= VARIABLES
    bomb = zstandard.ZstdCompressor().compress(bytes(64 << 20))
    for bad in (_fatbin(packed, FLAG_ZSTD, 1 << 40),             # claims to expand past the bound
                _fatbin(packed, FLAG_ZSTD, len(cubin) - 1),      # expands to more than it says
                _fatbin(bomb, FLAG_ZSTD, 1 << 20),
                _fatbin(b"\x28\xb5\x2f\xfdnot a frame", FLAG_ZSTD, 1000),
                _fatbin(lz4.block.compress(cubin, store_size=False), FLAG_LZ4, 100),
                _fatbin(cubin, 0, 0)[:-100]):                    # entry longer than its container
        with pytest.raises(ImageUnreadable):
            image_data_bytes(bad, HOPPER)
    assert image_data_bytes(_fatbin(lz4.block.compress(cubin, store_size=False), FLAG_LZ4, len(cubin)),
                            HOPPER) >= VARIABLES


def _two_entries(first: bytes, second: bytes) -> bytes:
    """One container holding the entries of two one-entry fatbins."""
    bodies = first[16:] + second[16:]
    return struct.pack("<IHHQ", FATBIN_MAGIC, 1, 16, len(bodies)) + bodies


def test_ptx_beside_a_cubin_the_driver_runs_is_not_counted() -> None:
    # The driver JIT-compiles PTX only where no cubin of the fatbin runs on the device: PyTorch's
    # fatbins carry both, and reading their PTX was most of a module load's time.
    cubin = _fatbin(_cubin(), 0, 0)
    ptx = b".version 8.8\n.target sm_90\n.global .b8 big[3221225472];\n\0"
    both = _two_entries(cubin, _fatbin(ptx, 0, 0, kind=1, arch=90))
    assert VARIABLES <= image_data_bytes(both, HOPPER) < 2 * GiB
    # Where no cubin runs (sm_90 code on an sm_100 device), the PTX is what the driver compiles.
    assert image_data_bytes(both, (10, 0)) == 3 * GiB
    assert image_data_bytes(_fatbin(ptx, 0, 0, kind=1, arch=90), HOPPER) == 3 * GiB


def test_unchecked_digests_are_never_trusted() -> None:
    small = b".version 8.8\n.target sm_90\n.global .u32 x;\n"
    large = b".version 8.8\n.target sm_90\n.global .b8 x[1073741824];\n"
    footprints = ImageFootprints(HOPPER)
    digest = bytes(32)
    assert footprints.of(small, digest) == 4             # a checked digest: remembered
    assert footprints.of(large, None) == GiB             # an unchecked one: always measured
    assert footprints.of(small, digest) == 4


def test_capability_text() -> None:
    assert parse_capability("9.0") == (9, 0)
    assert parse_capability("12.1") == (12, 1)
    assert parse_capability("") == (99, 9)   # unknown: every entry counts
