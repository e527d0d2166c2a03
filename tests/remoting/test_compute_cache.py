"""The driver's compute-cache table, answered by rgpu's libcuda.so.1 (src/compute_cache.c): NVRTC's
compilation cache, kept on the CPU node's disk per user.

Each scenario runs in a child process that loads rgpu's libcuda.so.1, takes the table from
cuGetExportTable and calls its slots with the signatures NVRTC uses (no GPU and no server: the
table is answered in the application's process)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from rgpu.remoting.native import build

NOT_FOUND = 500

CHILD = textwrap.dedent("""
    import ctypes, json, sys
    from ctypes import CFUNCTYPE, POINTER, c_char_p, c_int, c_uint32, c_void_p
    lib = ctypes.CDLL(sys.argv[1])
    table = c_void_p()
    uuid = (ctypes.c_ubyte * 16)(*bytes.fromhex("da9151d33ae6cc41a5c04f26d533e328"))
    assert lib.cuGetExportTable(ctypes.byref(table), uuid) == 0
    slots = (c_void_p * 7).from_address(table.value)
    GEN = CFUNCTYPE(c_int, POINTER(c_void_p), c_int, c_void_p, c_uint32, c_char_p, c_char_p, c_char_p, c_int, c_int)
    FREE = CFUNCTYPE(c_int, c_void_p)
    LOAD = CFUNCTYPE(c_int, c_void_p, c_int, POINTER(c_void_p), POINTER(c_uint32))
    STORE = CFUNCTYPE(c_int, c_void_p, c_int, c_void_p, c_uint32)
    gen, free_key, load, store, delete = GEN(slots[1]), FREE(slots[2]), LOAD(slots[3]), STORE(slots[4]), FREE(slots[6])
    out = {"size": slots[0]}

    def key(source=b"__global__ void k() {}", options=b"-arch=sm_90", build=b"Oct 12 202619:36:54", kind=1):
        k = c_void_p()
        assert gen(ctypes.byref(k), kind, source, len(source), options, b"HOST64", build, 9, 0) == 0
        return k

    def get(k):
        data, n = c_void_p(), c_uint32()
        code = load(k, 0, ctypes.byref(data), ctypes.byref(n))
        if code:
            return code, None
        value = ctypes.string_at(data, n.value)
        delete(data)
        return 0, value.hex()

    for step in sys.argv[2].split(","):
        name, _, arg = step.partition("=")
        k = key(**({"options": arg.encode()} if name.endswith("_opts") else
                   {"build": arg.encode()} if name.endswith("_build") else
                   {"kind": int(arg)} if name.endswith("_kind") else {}))
        if name.startswith("store"):
            out[step] = store(k, 0, b"CUBIN" * 1000, 5000)
        else:
            out[step] = get(k)
        free_key(k)
    print(json.dumps(out))
    """)


def run(libs: build.Libraries, steps: str, env: dict[str, str]) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(libs.folder / "libcuda.so.1"), steps],
                          env={**{k: v for k, v in os.environ.items() if not k.startswith(("RGPU_", "CUDA_CACHE", "XDG_"))},
                               **env}, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def home(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "home").mkdir()
    return {"HOME": str(tmp_path / "home"), "TMPDIR": str(tmp_path)}


def entries(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if not p.name.endswith(".tmp")) if folder.exists() else []


HIT = [0, ("CUBIN" * 1000).encode().hex()]


def test_an_entry_stored_by_one_process_is_found_by_the_next(native_libs: build.Libraries, home: dict[str, str]) -> None:
    first = run(native_libs, "get,store", home)
    assert first["size"] == 7 * 8   # past 0x30: NVRTC frees what Load gave through slot 6
    assert first["get"] == [NOT_FOUND, None] and first["store"] == 0
    second = run(native_libs, "get", home)
    assert second["get"] == HIT
    folder = Path(home["HOME"]) / ".cache" / "rgpu" / "compute-cache"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert [stat.S_IMODE(p.stat().st_mode) for p in entries(folder)] == [0o600]


def test_another_option_build_of_nvrtc_or_kind_is_another_entry(native_libs: build.Libraries, home: dict[str, str]) -> None:
    run(native_libs, "store", home)
    out = run(native_libs, "get,get_opts=-arch=sm_80,get_build=Jan 01 202700:00:00,get_kind=2", home)
    assert out["get"] == HIT
    assert all(out[k][0] == NOT_FOUND for k in ("get_opts=-arch=sm_80", "get_build=Jan 01 202700:00:00", "get_kind=2"))


def test_a_damaged_entry_is_a_miss_and_is_removed(native_libs: build.Libraries, home: dict[str, str]) -> None:
    run(native_libs, "store", home)
    folder = Path(home["HOME"]) / ".cache" / "rgpu" / "compute-cache"
    (entry,) = entries(folder)
    data = bytearray(entry.read_bytes())
    data[-1] ^= 0xFF
    entry.write_bytes(bytes(data))
    assert run(native_libs, "get", home)["get"][0] == NOT_FOUND
    assert entries(folder) == []
    entry.write_bytes(b"not an entry")
    assert run(native_libs, "get", home)["get"][0] == NOT_FOUND


def test_cuda_cache_disable_turns_it_off(native_libs: build.Libraries, home: dict[str, str]) -> None:
    out = run(native_libs, "store,get", dict(home, CUDA_CACHE_DISABLE="1"))
    assert out["store"] != 0 and out["get"][0] == NOT_FOUND
    assert entries(Path(home["HOME"]) / ".cache" / "rgpu" / "compute-cache") == []


def test_cuda_cache_path_is_honoured(native_libs: build.Libraries, home: dict[str, str], tmp_path: Path) -> None:
    out = run(native_libs, "store,get", dict(home, CUDA_CACHE_PATH=str(tmp_path / "cc")))
    assert out["get"] == HIT and len(entries(tmp_path / "cc" / "rgpu-nvrtc")) == 1


@pytest.mark.parametrize("how", ["open to everyone", "a link elsewhere", "home not writable"])
def test_a_folder_that_is_not_the_users_own_is_not_used(native_libs: build.Libraries, home: dict[str, str],
                                                        tmp_path: Path, how: str) -> None:
    cache = Path(home["HOME"]) / ".cache" / "rgpu"
    cache.mkdir(parents=True)
    if how == "open to everyone":
        (cache / "compute-cache").mkdir(mode=0o777)
        os.chmod(cache / "compute-cache", 0o777)
    elif how == "a link elsewhere":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        (cache / "compute-cache").symlink_to(tmp_path / "elsewhere")
    else:
        (tmp_path / "a-file").write_text("")
        home = dict(home, HOME=str(tmp_path / "a-file"))   # nothing can be made under it, even by root
    out = run(native_libs, "store,get", home)
    assert out["get"] == HIT   # in TMPDIR's own folder instead
    fallback = tmp_path / f"rgpu-compute-cache-{os.getuid()}"
    assert len(entries(fallback)) == 1 and stat.S_IMODE(fallback.stat().st_mode) == 0o700
    if how == "a link elsewhere":
        assert entries(tmp_path / "elsewhere") == []


def test_the_oldest_entries_go_first_past_cuda_cache_maxsize(native_libs: build.Libraries, home: dict[str, str]) -> None:
    env = dict(home, CUDA_CACHE_MAXSIZE=str(2 * 5048 + 100))   # room for two 5000-byte entries
    run(native_libs, "store_opts=a", env)
    folder = Path(home["HOME"]) / ".cache" / "rgpu" / "compute-cache"
    os.utime(entries(folder)[0], (1, 1))   # the oldest
    run(native_libs, "store_opts=b", env)
    run(native_libs, "store_opts=c", env)
    out = run(native_libs, "get_opts=a,get_opts=b,get_opts=c", env)
    assert out["get_opts=a"][0] == NOT_FOUND and out["get_opts=b"] == HIT and out["get_opts=c"] == HIT
