"""cuGetExportTable: the CUDA runtime's private tables, answered by rgpu's libcuda.so.1 in the
client process, before cuInit and without any session (loaded through ctypes, no server)."""

from __future__ import annotations

import ctypes
import shutil
import os
import struct
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

from rgpu.remoting.native import build

from tests.remoting.conftest import EXAMPLES

CUDART_INTERFACE = "6bd5fb6c-5bf4-e74a-8987-d93912fd9df9"
TOOLS_TLS = "42d85a81-23f6-cb47-8298-f6e78a3aecdc"
TOOLS_CALLBACKS = "a094798c-2e74-2e74-93f2-0800200c0a66"
CONTEXT_STORAGE = "c693336e-1121-df11-a8c3-68f355d89593"
INTEGRITY_CHECK = "d4082055-bde6-704b-8d34-ba123c66e1f2"
CONTEXT_CHECKS = "263e8860-7cd2-6143-92f6-bbd5006dfa7e"
SKIP_INIT_PROBE = "f8cff951-2146-8b4e-b9e2-fb469e7c0dd9"
RGPU_INTERNAL = b"rgpu-internal-v1"  # rgpu's own table: its tests reach internals through it

NOT_FOUND = 500


def run_isolated(libs: build.Libraries, code: str) -> subprocess.CompletedProcess[str]:
    """Each check in a fresh process: the library keeps process-wide state."""
    program = textwrap.dedent(f"""
        import ctypes, struct, sys, uuid
        lib = ctypes.CDLL({str(libs.libcuda)!r})
        lib.cuGetExportTable.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p]
        def table(text):
            out = ctypes.c_void_p()
            r = lib.cuGetExportTable(ctypes.byref(out), uuid.UUID(text).bytes)
            return r, out.value
        def slots(addr, n):
            return list((ctypes.c_void_p * n).from_address(addr))
        """) + textwrap.dedent(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RGPU_")}
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60, env=env,
                          check=False)


def test_every_runtime_table_is_answered_before_cuinit_with_its_size(native_libs: build.Libraries) -> None:
    done = run_isolated(native_libs, f"""
        for name, text, n in [("CUDART", {CUDART_INTERFACE!r}, 13), ("TLS", {TOOLS_TLS!r}, 4),
                              ("CALLBACKS", {TOOLS_CALLBACKS!r}, 7), ("INTEGRITY", {INTEGRITY_CHECK!r}, 3),
                              ("CHECKS", {CONTEXT_CHECKS!r}, 4)]:
            r, addr = table(text)
            s = slots(addr, n)
            print(name, r, s[0], all(x for x in s[1:n - (1 if name == "INTEGRITY" else 0)]))
        r, addr = table({CONTEXT_STORAGE!r})
        s = slots(addr, 4)
        print("STORAGE", r, all(s[:3]), s[3])
        for name, text, n in [("T1734", "1734dc26-800d-4745-8726-c0f1e7dd8bca", 17),
                              ("T69A2", "69a28e9f-2449-8b47-b030-c5da330ea4e9", 34)]:
            r, addr = table(text)
            s = slots(addr, n)
            print(name, r, s[0], all(s[1:]), ctypes.CFUNCTYPE(ctypes.c_int)(s[1])())
        # The tools-context table goes to the math libraries' runtime only (this caller is not one).
        r, addr = table("21318c60-9714-3248-8ca6-41ff7324c8f2")
        print("TOOLSCTX", r, addr)
        r, addr = table({SKIP_INIT_PROBE!r})
        print("PROBE", r, addr)
        r, addr = table("00000000-0000-0000-0000-000000000000")
        print("UNKNOWN", r, addr)
        """)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:5] == ["CUDART 0 104 True", "TLS 0 32 True", "CALLBACKS 0 56 True", "INTEGRITY 0 24 True",
                         "CHECKS 0 32 True"]
    # Context-local storage has no size slot: three functions and a NULL end.
    assert lines[5] == "STORAGE 0 True None"
    # Unknown tables (cudart's skip-init probe among them) are CUDA_ERROR_NOT_FOUND, never NOT_SUPPORTED.
    # Tables whose slots are unknown: the driver's size, every slot callable (NOT_SUPPORTED, 801).
    assert lines[6] == "T1734 0 136 True 801"
    assert lines[7] == "T69A2 0 272 True 801"
    assert lines[8] == f"TOOLSCTX {NOT_FOUND} None"
    assert lines[9] == f"PROBE {NOT_FOUND} None"
    assert lines[10] == f"UNKNOWN {NOT_FOUND} None"


def test_slots_pytorch_probes_are_quiet_and_other_unknown_slots_say_so_once(native_libs: build.Libraries) -> None:
    # cuBLASLt inside PyTorch calls slot 4 of 1734dc26 on every run and carries on: the user can do
    # nothing about it, so it is a debug line. A slot nobody was seen calling still gets its line.
    done = run_isolated(native_libs, """
        r, addr = table("1734dc26-800d-4745-8726-c0f1e7dd8bca")
        s = slots(addr, 17)
        fn = ctypes.CFUNCTYPE(ctypes.c_int)
        print("CALLS", fn(s[4])(), fn(s[4])(), fn(s[1])(), fn(s[1])())
        """)
    assert "CALLS 801 801 801 801" in done.stdout, done.stdout + done.stderr
    assert "slot 4 of the driver's private table UNKNOWN_1734DC26" not in done.stderr, done.stderr
    assert done.stderr.count("slot 1 of the driver's private table UNKNOWN_1734DC26") == 1, done.stderr


def test_tools_hooks_are_callable_and_hand_out_static_buffers(native_libs: build.Libraries) -> None:
    done = run_isolated(native_libs, f"""
        r, addr = table({TOOLS_CALLBACKS!r})
        s = slots(addr, 7)
        getbuf = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t))
        for i in (2, 6):
            p, n = ctypes.c_void_p(), ctypes.c_size_t()
            getbuf(s[i])(ctypes.byref(p), ctypes.byref(n))
            ctypes.memset(p, 0x5a, n.value)  # writable
            print("BUF", i, n.value, bool(p.value))
        noop = ctypes.CFUNCTYPE(ctypes.c_int)
        print("NOOPS", [noop(s[i])() for i in (1, 3, 4, 5)])
        r, addr = table({TOOLS_TLS!r})
        print("TLS", [noop(x)() for x in slots(addr, 4)[1:]])
        r, addr = table({CONTEXT_CHECKS!r})
        s = slots(addr, 4)
        out = ctypes.c_uint32(7)
        check = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32), ctypes.c_void_p)
        print("CHECK", check(s[2])(None, ctypes.byref(out), None), out.value, ctypes.CFUNCTYPE(ctypes.c_uint32)(s[3])())
        """)
    assert done.returncode == 0, done.stderr
    assert "BUF 2 1024 True" in done.stdout and "BUF 6 14 True" in done.stdout
    assert "NOOPS [0, 0, 0, 0]" in done.stdout
    assert "TLS [0, 0, 0]" in done.stdout
    assert "CHECK 0 0 0" in done.stdout


def test_context_local_storage_keeps_values_per_context_and_key(native_libs: build.Libraries) -> None:
    done = run_isolated(native_libs, f"""
        r, addr = table({CONTEXT_STORAGE!r})
        put_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
        del_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
        get_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_void_p)
        s = slots(addr, 3)
        put, delete, get = put_t(s[0]), del_t(s[1]), get_t(s[2])
        v = ctypes.c_void_p()
        print("MISS", get(ctypes.byref(v), 0x1000, 0x10))
        print("PUT", put(0x1000, 0x10, 0xAAA, None), put(0x2000, 0x10, 0xBBB, None), put(0x1000, 0x10, 0xCCC, None))
        print("GET", get(ctypes.byref(v), 0x1000, 0x10), hex(v.value))
        print("GET2", get(ctypes.byref(v), 0x2000, 0x10), hex(v.value))
        print("DEL", delete(0x1000, 0x10), get(ctypes.byref(v), 0x1000, 0x10))
        # NULL means the current context: none is current before cuInit.
        print("NOCTX", put(None, 0x10, 0x1, None), get(ctypes.byref(v), None, 0x10))
        """)
    assert done.returncode == 0, done.stderr
    assert "MISS 400" in done.stdout  # CUDA_ERROR_INVALID_HANDLE: not stored
    assert "PUT 0 0 0" in done.stdout
    assert "GET 0 0xccc" in done.stdout and "GET2 0 0xbbb" in done.stdout
    assert "DEL 0 400" in done.stdout
    assert "NOCTX 201 201" in done.stdout  # CUDA_ERROR_INVALID_CONTEXT


# ---------------------------------------------------------------------------- integrity check
# An independent Python port of the digest (keyed MD2, as documented by ZLUDA's dark_api), checked
# against ZLUDA's published intermediate vectors, then compared with the C library's result.

MD2_S = bytes.fromhex(
    "292e43c9a2d87c013d3654a1ecf0061362a705f3c0c7738c98932bd9bc4c82ca1e9b573cfdd4e01667426f188a17e512"
    "be4ec4d6da9ede49a0fbf58ebb2fee7aa968799115b2073f94c210890b225f21807f5d9a5a903227353ecce7bff79703"
    "ff1930b348a5b5d1d75e922aac56aac64fb838d296a47db676fc6be29c7404f1459d705964718720865bcf65e62da802"
    "1b6025adaeb0b9f61c46616934407e0f5547a323dd51af3ac35cf9cebac5ea262c530d6e85288409d3dfcdf441814d52"
    "6adc37c86cc1abfa24e17b080cbdb14a7888958be363e86de9cbd5fe3b001d39f2efb70e6658d0e4a67772f8eb754b0a"
    "314450b48fed1f1adb998d339f118314")


def _md2_byte(a: bytearray, x: int) -> None:
    n = a[64]
    a[16 + n] = x
    a[32 + n] = a[n] ^ x
    c = MD2_S[x ^ a[65]] ^ a[48 + n]
    a[48 + n] = c
    a[65] = c
    a[64] = (n + 1) & 15
    if a[64]:
        return
    t = 0
    for rnd in range(18):
        for k in range(48):
            a[k] ^= MD2_S[t]
            t = a[k]
        t = (t + rnd) & 0xFF


def _md2_final(a: bytearray) -> bytes:
    pad = 16 - a[64]
    for _ in range(pad):
        _md2_byte(a, pad)
    for i in range(48, 64):
        _md2_byte(a, a[i])
    return bytes(a[:16])


KEY = bytes.fromhex("146addae53a9a752aa0841360bf55a9f")


def py_digest(input48: bytes, devices: bytes) -> bytes:
    a = bytearray(66)
    for b in KEY:
        _md2_byte(a, b ^ 0x36)
    for b in input48 + devices:
        _md2_byte(a, b)
    inner = _md2_final(a)
    a[0:16] = bytes(16)
    a[48:66] = bytes(18)
    for b in KEY:
        _md2_byte(a, b ^ 0x5C)
    for b in inner:
        _md2_byte(a, b)
    return _md2_final(a)


def test_python_port_matches_zludas_published_vectors() -> None:
    assert len(MD2_S) == 256 and sorted(MD2_S) == list(range(256))
    a = bytearray(66)
    for b in KEY:
        _md2_byte(a, b ^ 0x36)
    assert bytes(a) == bytes.fromhex(
        "8b219a49e86d1aeef237f9b54a8c3c75c71eee21cf298ae51383f4ec3304e2fdb02f09014ff7686d6946437eb62b21ed"
        "57a110860e60441e705f67d1eb67a13d003d")
    inp = struct.pack("<IIIIQQQQ", 0x2F30, 12082, 0x002FA423, 0xF79C1000, 0x00007FFFF6958240, 0x00007FFFF6958220,
                      0x00007FFFF2AAF4A0, 0x682B9CEE)
    for b in inp:
        _md2_byte(a, b)
    assert bytes(a) == bytes.fromhex(
        "0afdabc9ff9ba0be4d303282744fa7489d2382a387fa6cdb9249d9b54b2b5e516ef7f94d288a640619b3e6bea4ec7e54"
        "6428d9e1d434c0a94988c96158dd66740074")
    a = bytearray.fromhex(
        "3e4bf29571f56b5107bf4bf1040e8e0b5f4d300c0f0caefb48af23b5ea4cc2dbd7df88743958163a1f7c9b207e7e94c8"
        "8bc6b2380d077dbd90d53963eb1d4f400040")
    assert _md2_final(a).hex() == "002353065e96f69c61aa962d2ecda858"


def _internal(libs: build.Libraries) -> tuple[ctypes.CFUNCTYPE, ctypes.CFUNCTYPE]:
    lib = ctypes.CDLL(str(libs.libcuda))
    out = ctypes.c_void_p()
    assert lib.cuGetExportTable(ctypes.byref(out), RGPU_INTERNAL) == 0
    slots = (ctypes.c_void_p * 3).from_address(out.value)
    digest = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint, ctypes.c_void_p)(slots[1])
    fatbin_size = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_void_p)(slots[2])
    return digest, fatbin_size


def test_integrity_digest_in_c_matches_the_reference(native_libs: build.Libraries) -> None:
    digest, _ = _internal(native_libs)
    inp = struct.pack("<IIIIQQQQ", 13000, 13002, 4242, 0xDEADBEEF, 0x7F0000001000, 0x7F0000002000, 0x7F0000003000,
                      1_700_000_000)
    dev = uuid.UUID("12345678-1234-1234-1234-123456789abc").bytes + struct.pack("<iii", 0, 0x17, 0)
    out = (ctypes.c_uint64 * 2)()
    digest(inp, dev * 2, 2, out)
    assert bytes(out) == py_digest(inp, dev * 2)
    digest(inp, None, 0, out)
    assert bytes(out) == py_digest(inp, b"")


def test_integrity_check_fixed_answers_for_old_versions(native_libs: build.Libraries) -> None:
    done = run_isolated(native_libs, f"""
        r, addr = table({INTEGRITY_CHECK!r})
        fn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint32, ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64))(slots(addr, 2)[1])
        out = (ctypes.c_uint64 * 2)()
        print("V0", fn(12000, 0, out), hex(out[0]), hex(out[1]))
        print("V1", fn(12001, 0, out), hex(out[0]))
        print("NOINIT", fn(13002, 0, out))
        """)
    assert done.returncode == 0, done.stderr
    assert "V0 0 0x3341181c03cb675c 0x8ed383aa1f4cd1e8" in done.stdout
    assert "V1 0 0x1841181c03cb675c" in done.stdout
    assert "NOINIT 3" in done.stdout  # the hash covers the devices: CUDA_ERROR_NOT_INITIALIZED before cuInit


# ---------------------------------------------------------------------------- fatbin sizes

def test_a_fatbin_is_the_one_container_its_header_sizes(native_libs: build.Libraries) -> None:
    _, fatbin_size = _internal(native_libs)
    one = (EXAMPLES / "vecadd.fatbin").read_bytes()
    magic, _version, header, body = struct.unpack_from("<IHHQ", one)
    assert magic == 0xBA55ED50
    size = header + body
    buf = ctypes.create_string_buffer(one, len(one))
    assert fatbin_size(ctypes.addressof(buf)) == size
    # Containers back to back (a library's .nv_fatbin: one per translation unit), then other
    # bytes: the one cudart registered, never the units after it.
    chain = one[:size] * 3 + b"\x00" * 64
    buf = ctypes.create_string_buffer(chain, len(chain))
    assert fatbin_size(ctypes.addressof(buf)) == size
    # A header whose sizes make no sense is no image.
    bad = bytearray(one[:size])
    struct.pack_into("<H", bad, 6, 8)
    buf = ctypes.create_string_buffer(bytes(bad), len(bad))
    assert fatbin_size(ctypes.addressof(buf)) == 0


def test_tools_context_is_answered_to_the_math_libraries_runtime(native_libs: build.Libraries,
                                                                 tmp_path: Path) -> None:
    # A library whose file name starts like cuBLAS's stands for the runtime inside it.
    src = tmp_path / "probe.c"
    src.write_text(textwrap.dedent("""
        #include <stdint.h>
        #include <string.h>
        typedef int (*get_table_t)(const void **, const unsigned char *);
        typedef int (*slot4_t)(uint64_t, uint64_t *);
        typedef int (*slot39_t)(uint64_t, uint64_t, uint64_t *);
        int probe(get_table_t get, uint64_t out[6]) {
            static const unsigned char id[16] = {0x21, 0x31, 0x8c, 0x60, 0x97, 0x14, 0x32, 0x48,
                                                 0x8c, 0xa6, 0x41, 0xff, 0x73, 0x24, 0xc8, 0xf2};
            const void *const *t = 0;
            int r = get((const void **)&t, id);
            if (r) return r;
            out[0] = (uint64_t)(uintptr_t)t[0];
            out[5] = 0;
            r = ((slot4_t)t[4])(7, &out[1]);
            r |= ((slot4_t)t[4])(0, &out[2]);
            r |= ((slot39_t)t[39])(1, 1, &out[3]);
            r |= ((slot39_t)t[51])(1, 2, &out[4]);
            out[5] = ((slot39_t)t[51])(1, UINT64_MAX, &out[5]);
            return r;
        }
        """))
    lib = tmp_path / "libcublasProbe.so.13"
    cc = shutil.which("gcc") or shutil.which("cc")
    done = subprocess.run([cc, "-shared", "-fPIC", "-O1", str(src), "-o", str(lib)], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr
    code = f"""
        import ctypes
        cuda = ctypes.CDLL({str(native_libs.libcuda)!r})
        probe = ctypes.CDLL({str(lib)!r})
        out = (ctypes.c_uint64 * 6)()
        r = probe.probe(ctypes.cast(cuda.cuGetExportTable, ctypes.c_void_p), out)
        print("R", r, list(out))
        """
    env = {k: v for k, v in os.environ.items() if not k.startswith("RGPU_")}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60,
                          env=env, check=False)
    assert done.returncode == 0, done.stderr
    words = done.stdout.split()
    assert words[:2] == ["R", "0"], done.stdout
    values = [int(w.strip("[],")) for w in words[2:]]
    assert values[0] == 93 * 8          # the driver's 93 slots
    assert values[1:4] == [1, 0, 0]     # slot 4: non-zero argument -> 1; slot 39 writes 0
    assert values[4] != 0               # slot 51 hands out an object
    assert values[5] == 400             # ... but not for an invalid handle
