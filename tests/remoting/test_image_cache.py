"""The GPU node's module image cache: a large image crosses the wire once per node and user
(the client names it by SHA-256 first), never served across users, verified before use, bounded,
and never the reason a load fails. Pure parts (naming, eviction) and the cache's I/O on a real
folder; the whole path through real client processes and a session server with the emulated GPU."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import socket
import struct
import subprocess
from dataclasses import replace
from unittest.mock import ANY
from pathlib import Path

import pytest
from rgpu.config import Settings
from rgpu.errors import ConfigError
from rgpu.remoting.datapath import protocol
from rgpu.remoting.datapath.worker import image_cache
from rgpu.remoting.datapath.worker.image_cache import Entry, ImageCache, evictions, user_folder
from rgpu.remoting.datapath.worker.module_footprint import ImageFootprints
from rgpu.remoting.dispatcher.daemon import start_data_path
from rgpu.remoting.native import build, client_stats
from rgpu.remoting.native.generated import api_gen

from tests.remoting.conftest import EMULATED_GPU, EXAMPLES, Server
from tests.remoting.client_helpers import py_client, vecadd_container_for

SRC = Path(build.__file__).resolve().parent / "src"
HASH_MIN = 64 * 1024   # cuda_module.c's IMAGE_HASH_MIN


# ------------------------------------------------------------------ SHA-256 in C

@pytest.fixture(scope="module", params=["auto", "portable"])
def sha256_c(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """sha256.c as its own library: "auto" uses the SHA extensions where the CPU has them,
    "portable" (RGPU_SHA256_PORTABLE, read at the first call of this copy) the plain C rounds."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip("no C compiler")
    out = tmp_path_factory.mktemp("sha") / f"libsha-{request.param}.so"
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(out), str(SRC / "sha256.c")], check=True)
    lib = ctypes.CDLL(str(out))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RGPU_SHA256_PORTABLE", "1" if request.param == "portable" else "")
        lib.rgpu_sha256(b"", ctypes.c_size_t(0), ctypes.create_string_buffer(32))   # picks the rounds now
    return lib


# sha256_c compiles C: the tests that use it are of the integration tier, not the unit tier.
@pytest.mark.integration
@pytest.mark.parametrize("size", [0, 1, 3, 55, 56, 57, 63, 64, 65, 119, 120, 128, 1000, HASH_MIN + 7, 1 << 20])
def test_the_clients_sha256_is_hashlibs(sha256_c: ctypes.CDLL, size: int) -> None:
    data = hashlib.shake_256(str(size).encode()).digest(size) if size else b""
    out = ctypes.create_string_buffer(32)
    sha256_c.rgpu_sha256(data, ctypes.c_size_t(size), out)
    assert out.raw == hashlib.sha256(data).digest()


@pytest.mark.integration
def test_the_standard_vectors(sha256_c: ctypes.CDLL) -> None:
    for text, hexdigest in [(b"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"),
                            (b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
                             "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1")]:
        out = ctypes.create_string_buffer(32)
        sha256_c.rgpu_sha256(text, ctypes.c_size_t(len(text)), out)
        assert out.raw.hex() == hexdigest


# ------------------------------------------------------------------ pure: naming and eviction

def test_images_are_scoped_by_uid_and_named_by_hash() -> None:
    assert user_folder(1000) == "uid-1000" and user_folder(1001) == "uid-1001"
    for bad in (None, True, -1, 2**32, "1000", 1.0):
        assert user_folder(bad) is None   # no plain uid: no cache at all
    digest = hashlib.sha256(b"x").digest()
    assert image_cache.image_name(digest) == digest.hex() and image_cache.is_image_name(digest.hex())
    assert not image_cache.is_image_name("." + digest.hex()[1:]) and not image_cache.is_image_name("../x")
    with pytest.raises(ValueError, match="32 bytes"):
        image_cache.image_name(b"short")


def test_eviction_drops_the_least_recently_used_until_the_cache_fits() -> None:
    entries = [Entry("a", 40, 1.0), Entry("b", 40, 3.0), Entry("c", 40, 2.0), Entry("new", 40, 0.5)]
    assert evictions(entries, 200) == []
    assert evictions(entries, 100, keep="new") == ["a", "c"]     # the one just stored stays
    assert evictions(entries, 30, keep="new") == ["a", "c", "b", "new"]   # alone too large: it goes too


# ------------------------------------------------------------------ the cache's I/O on a real folder

def read(cache: ImageCache, digest: bytes) -> bytes | None:
    """The cached image's bytes (get() hands out a mapping of the file)."""
    image = cache.get(digest)
    return None if image is None else bytes(image)


def test_one_users_images_are_never_served_to_another(tmp_path: Path) -> None:
    data = os.urandom(1000)
    digest = hashlib.sha256(data).digest()
    assert ImageCache(str(tmp_path), 1000, 1 << 20).put(digest, data)
    assert read(ImageCache(str(tmp_path), 1000, 1 << 20), digest) == data
    assert ImageCache(str(tmp_path), 1001, 1 << 20).get(digest) is None
    assert ImageCache(str(tmp_path), None, 1 << 20).get(digest) is None   # a client that sent no uid


def test_bytes_that_do_not_match_their_hash_are_not_stored(tmp_path: Path) -> None:
    cache = ImageCache(str(tmp_path), 7, 1 << 20)
    assert not cache.put(hashlib.sha256(b"other").digest(), b"these")
    assert not list(tmp_path.rglob("*"))


def test_a_corrupt_or_planted_file_is_removed_not_served(tmp_path: Path) -> None:
    data = os.urandom(5000)
    digest = hashlib.sha256(data).digest()
    cache = ImageCache(str(tmp_path), 7, 1 << 20)
    assert cache.put(digest, data)
    path = tmp_path / "uid-7" / digest.hex()
    path.write_bytes(data[:-1] + b"\0")
    os.utime(path, ns=(1, 1))   # changed later (mtime's granularity is a kernel tick)
    assert cache.get(digest) is None and not path.exists()
    assert cache.put(digest, data) and read(cache, digest) == data


def test_a_checked_file_is_not_hashed_again_until_it_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = os.urandom(5000)
    digest = hashlib.sha256(data).digest()
    cache = ImageCache(str(tmp_path), 7, 1 << 20)
    assert cache.put(digest, data)
    hashed: list[int] = []
    real_sha256 = hashlib.sha256
    monkeypatch.setattr(image_cache.hashlib, "sha256", lambda b=b"": hashed.append(len(b)) or real_sha256(b))
    assert read(cache, digest) == data and read(cache, digest) == data
    assert hashed == []   # stored and hashed by put: its facts vouch for it
    path = tmp_path / "uid-7" / digest.hex()
    path.write_bytes(data)   # rewritten in place (same bytes, new mtime): hashed once, then trusted
    os.utime(path, ns=(1, 1))
    assert read(cache, digest) == data and read(cache, digest) == data
    assert hashed == [len(data)]
    (tmp_path / "uid-7" / (digest.hex() + ".facts")).write_text("{not json")   # damaged facts: hashed again
    assert read(cache, digest) == data and hashed == [len(data)] * 2


def test_footprints_are_kept_with_the_checked_image_for_later_workers(tmp_path: Path) -> None:
    image = (EXAMPLES / "vecadd.sm_90.cubin").read_bytes()
    digest = hashlib.sha256(image).digest()
    first = ImageCache(str(tmp_path), 7, 1 << 20)
    assert first.put(digest, image)
    counted = ImageFootprints((9, 0), store=first).of(image, digest)
    later = ImageCache(str(tmp_path), 7, 1 << 20)   # another worker of the node
    assert later.known_footprint(digest, ImageFootprints((9, 0)).key) == counted
    assert later.known_footprint(digest, ImageFootprints((8, 0)).key) is None   # another capability counts anew
    assert ImageFootprints((9, 0), store=later).of(b"not the image: never read", digest) == counted
    # Facts of a file that was replaced describe nothing: the count is not reused.
    (tmp_path / "uid-7" / digest.hex()).write_bytes(image)
    os.utime(tmp_path / "uid-7" / digest.hex(), ns=(1, 1))
    assert read(later, digest) == image
    assert later.known_footprint(digest, ImageFootprints((9, 0)).key) is None
    # An image nobody stored or checked gets no facts.
    other = hashlib.sha256(b"other").digest()
    later.remember_footprint(other, "k", 5)
    assert later.known_footprint(other, "k") is None


def test_a_cache_too_small_for_what_its_users_load_says_so_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    size = 10_000
    cache = ImageCache(str(tmp_path), 7, 2 * size)
    with caplog.at_level(logging.WARNING, logger="rgpu.worker"):
        for _ in range(5):   # each store evicts an image stored moments ago
            data = os.urandom(size)
            assert cache.put(hashlib.sha256(data).digest(), data)
    lines = [r.getMessage() for r in caplog.records if "raise image_cache_bytes" in r.getMessage()]
    assert len(lines) == 1 and "image_cache_bytes = 20000" in lines[0], lines


def test_an_unusable_cache_folder_logs_once_and_serves_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocked = tmp_path / "images"
    blocked.write_text("a file where the folder should be")   # mkdir fails even for root
    cache = ImageCache(str(blocked), 7, 1 << 20)
    data = os.urandom(100)
    digest = hashlib.sha256(data).digest()
    with caplog.at_level(logging.WARNING, logger="rgpu.worker"):
        assert not cache.put(digest, data)
        assert not cache.put(digest, data)
        assert cache.get(digest) is None
    lines = [r.getMessage() for r in caplog.records if "image cache" in r.getMessage()]
    assert len(lines) == 1 and "images are sent whole" in lines[0], lines


def test_the_cache_stays_within_its_bound_and_keeps_what_is_used(tmp_path: Path) -> None:
    size = 10_000
    images = [os.urandom(size) for _ in range(6)]
    digests = [hashlib.sha256(d).digest() for d in images]
    a, b = ImageCache(str(tmp_path), 1, 3 * size), ImageCache(str(tmp_path), 2, 3 * size)
    for i, (data, digest) in enumerate(zip(images, digests)):
        cache = a if i % 2 else b          # the bound covers all users together
        assert cache.put(digest, data)
        past = 1_000_000 + i * 10
        for stored in (cache.folder / digest.hex(), cache.folder / (digest.hex() + ".facts")):
            os.utime(stored, (past, past))   # stored in this order (mtime granularity)
        if i == 3:
            assert read(b, digests[2]) == images[2]   # used now: the most recent
    files = [p for p in tmp_path.glob("uid-*/*") if image_cache.is_image_name(p.name)]
    assert {p.name + ".facts" for p in files} == {p.name for p in tmp_path.glob("uid-*/*.facts")}   # none left behind
    assert sum(p.stat().st_size for p in files) <= 3 * size
    names = {p.name for p in files}
    assert digests[5].hex() in names and digests[4].hex() in names
    assert digests[0].hex() not in names and digests[1].hex() not in names
    assert not ImageCache(str(tmp_path), 1, size - 1).put(hashlib.sha256(images[0]).digest(), images[0])  # larger than the bound



def test_a_worker_scans_the_cache_only_when_its_count_nears_the_bound(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Storing N images used to scan the whole cache N times (quadratic: a PyTorch process stores about
    6,000 on its first start). Now a worker scans at its first store, when its count passes the bound,
    and after each 1/16 of the bound it stores; two workers storing together stay within the bound
    but for what each stored since its last scan."""
    size = 1000
    bound = 64 * size
    scans = []
    real_entries = ImageCache.entries
    monkeypatch.setattr(ImageCache, "entries", lambda self: scans.append(self) or real_entries(self))
    a, b = ImageCache(str(tmp_path), 1, bound), ImageCache(str(tmp_path), 2, bound)
    for i in range(60):
        data = i.to_bytes(4, "little") + os.urandom(size - 4)
        assert (a if i % 2 else b).put(hashlib.sha256(data).digest(), data)
    assert len(scans) <= 2 + 60 * size // (bound // image_cache.RESCAN_FRACTION), len(scans)   # 17: each 4 stores
    for i in range(60, 120):
        data = i.to_bytes(4, "little") + os.urandom(size - 4)
        assert (a if i % 2 else b).put(hashlib.sha256(data).digest(), data)
    files = [p for p in tmp_path.glob("uid-*/*") if image_cache.is_image_name(p.name)]
    assert sum(p.stat().st_size for p in files) <= bound + 2 * (bound // image_cache.RESCAN_FRACTION)
    a.evict()
    assert sum(p.stat().st_size for p in tmp_path.glob("uid-*/*") if image_cache.is_image_name(p.name)) <= bound

# ------------------------------------------------------------------ through client processes and a session server

def large_ptx(tmp_path: Path) -> Path:
    """vecadd.ptx padded past the hash threshold with a comment (the emulated GPU parses PTX)."""
    ptx = (EXAMPLES / "vecadd.ptx").read_bytes()
    padding = b"".join(b"// padding line %06d ..............................................\n" % i
                       for i in range(HASH_MIN // 64 + 200))
    path = tmp_path / "large.ptx"
    path.write_bytes(ptx + b"\n" + padding)
    return path


LOAD_AND_CHECK = """
    setup()
    ptx = open({path!r}, "rb").read() + b"\\0"
    mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
    check("{load}", ctypes.byref(mod), ptx{extra})
    check("{get}", ctypes.byref(fn), mod, b"mixed")
    off, size = ctypes.c_size_t(), ctypes.c_size_t()
    layout = []
    i = 0
    while lib.cuFuncGetParamInfo(fn, ctypes.c_size_t(i), ctypes.byref(off), ctypes.byref(size)) == 0:
        layout.append((off.value, size.value)); i += 1
    print("LAYOUT", layout)
    print("MISSING", lib.{get}(ctypes.byref(fn), mod, b"no_such_kernel"))
    """


def load_in_a_process(libs: build.Libraries, server: Server, path: Path, stats: Path, library: bool = False) -> dict[str, int]:
    if library:
        code = LOAD_AND_CHECK.format(path=str(path), load="cuLibraryLoadData", get="cuLibraryGetKernel",
                                     extra=", None, None, 0, None, None, 0")
        code = code.replace('print("LAYOUT"', 'kfn = ctypes.c_void_p(); check("cuKernelGetFunction", ctypes.byref(kfn), fn); fn = kfn\n    print("LAYOUT"')
    else:
        code = LOAD_AND_CHECK.format(path=str(path), load="cuModuleLoadData", get="cuModuleGetFunction", extra="")
    done = py_client(libs, server.slices(server.token()), code, RGPU_CLIENT_STATS=str(stats))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "LAYOUT [(0, 1), (8, 16), (24, 2), (32, 8)]" in done.stdout, done.stdout + done.stderr
    assert "MISSING 500" in done.stdout, done.stdout   # CUDA_ERROR_NOT_FOUND: the table is the image's
    files = list(stats.parent.glob(stats.name + ".*"))
    assert len(files) == 1, files
    text = files[0].read_text()
    ops = {p.name: p for p in client_stats.parse(text)[0].values()}
    load_op = "cuLibraryLoadData" if library else "cuModuleLoadDataEx"
    traffic = {k: v for k, v in client_stats.images(text).items() if k in ("loads", "cache_hits", "bytes_sent")}
    return {**traffic, "round_trips": ops[load_op].sync_calls}


@pytest.mark.parametrize("library", [False, True], ids=["module", "library"])
def test_a_second_process_of_the_user_sends_no_image_bytes(native_libs: build.Libraries, emulated: Server,
                                                           tmp_path: Path, library: bool) -> None:
    path = large_ptx(tmp_path)
    size = path.stat().st_size + 1
    first = load_in_a_process(native_libs, emulated, path, tmp_path / "first", library)
    assert first == {"loads": 1, "cache_hits": 0, "bytes_sent": size, "round_trips": 2}
    cached = emulated.server.image_cache_dir / f"uid-{os.getuid()}" / hashlib.sha256(path.read_bytes() + b"\0").hexdigest()
    assert cached.read_bytes() == path.read_bytes() + b"\0"
    second = load_in_a_process(native_libs, emulated, path, tmp_path / "second", library)
    assert second == {"loads": 1, "cache_hits": 1, "bytes_sent": 0, "round_trips": 1}

    # A corrupted cache file is detected: the image is sent again and the file replaced.
    cached.write_bytes(b"planted" + cached.read_bytes()[7:])
    third = load_in_a_process(native_libs, emulated, path, tmp_path / "third", library)
    assert third == {"loads": 1, "cache_hits": 0, "bytes_sent": size, "round_trips": 2}
    assert cached.read_bytes() == path.read_bytes() + b"\0"


MAP_A_FILE_READ_ONLY = """
    import os
    setup()
    libc = ctypes.CDLL(None)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    fd = os.open({path!r}, os.O_RDONLY)
    image = libc.mmap(None, os.fstat(fd).st_size, 1, 2, fd, 0)   # PROT_READ, MAP_PRIVATE: as a library's code
"""

LOAD_FROM_A_FILE_MAPPING = MAP_A_FILE_READ_ONLY + """
    mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
    check("cuModuleLoadData", ctypes.byref(mod), ctypes.c_void_p(image))
    check("cuModuleGetFunction", ctypes.byref(fn), mod, b"mixed")
    print("LOADED")
    """


def test_digests_of_images_in_library_files_are_remembered_across_processes(native_libs: build.Libraries,
                                                                           emulated: Server, tmp_path: Path) -> None:
    # cudart names every fatbin of PyTorch's libraries (about 5 GB) by its SHA-256 at start-up:
    # an image in a read-only mapping of a file is hashed once, then known by the file's identity.
    path = tmp_path / "in-a-library.ptx"
    path.write_bytes(large_ptx(tmp_path).read_bytes() + b"\0")
    memo = tmp_path / "digests"

    def run(name: str, code: str) -> dict[str, int]:
        done = py_client(native_libs, emulated.slices(emulated.token()), code,
                         RGPU_CLIENT_STATS=str(tmp_path / name), RGPU_DIGEST_MEMO=str(memo))
        assert done.returncode == 0 and ("LOADED" in done.stdout or "LAYOUT" in done.stdout), done.stdout + done.stderr
        (stats,) = tmp_path.glob(name + ".*")
        return client_stats.images(stats.read_text())

    from_file = LOAD_FROM_A_FILE_MAPPING.format(path=str(path))
    size = path.stat().st_size
    first = run("first", from_file)
    assert first["bytes_hashed"] == size and first["bytes_sent"] == size
    assert memo.stat().st_size == 88 and memo.stat().st_mode & 0o777 == 0o600
    second = run("second", from_file)
    assert second["bytes_hashed"] == 0 and second["cache_hits"] == 1 and second["bytes_sent"] == 0

    # The same bytes in the application's own memory are always hashed (they may change).
    anonymous = LOAD_AND_CHECK.format(path=str(path), load="cuModuleLoadData", get="cuModuleGetFunction", extra="")
    assert run("anonymous", anonymous.replace(' + b"\\0"', ""))["bytes_hashed"] == size

    # A file rewritten since (another mtime) is hashed again; a damaged record is skipped.
    os.utime(path, ns=(1, 1))
    with memo.open("ab") as f:
        f.write(b"torn record")
    assert run("third", from_file)["bytes_hashed"] == size
    assert run("fourth", from_file)["bytes_hashed"] == 0


def test_small_images_are_sent_whole_without_a_hash(native_libs: build.Libraries, emulated: Server, tmp_path: Path) -> None:
    path = EXAMPLES / "vecadd.ptx"
    got = load_in_a_process(native_libs, emulated, path, tmp_path / "small")
    assert got == {"loads": 1, "cache_hits": 0, "bytes_sent": path.stat().st_size + 1, "round_trips": 1}
    assert not emulated.server.image_cache_dir.exists() or not any(emulated.server.image_cache_dir.rglob("*"))


def test_an_unwritable_cache_still_loads(native_libs: build.Libraries, emulated: Server, tmp_path: Path) -> None:
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("x")
    emulated.server.image_cache_dir = blocked    # the workers spawned from now on get this folder
    path = large_ptx(tmp_path)
    size = path.stat().st_size + 1
    for name in ("one", "two"):
        got = load_in_a_process(native_libs, emulated, path, tmp_path / name)
        assert got == {"loads": 1, "cache_hits": 0, "bytes_sent": size, "round_trips": 2}


def test_a_cache_of_size_zero_is_off(native_libs: build.Libraries, emulated: Server, tmp_path: Path) -> None:
    emulated.server.image_cache_bytes = 0
    path = large_ptx(tmp_path)
    for name in ("one", "two"):
        got = load_in_a_process(native_libs, emulated, path, tmp_path / name)
        assert got["cache_hits"] == 0 and got["bytes_sent"] == path.stat().st_size + 1


def test_a_library_mirrored_to_a_second_slice_of_the_node_is_not_sent_again(native_libs: build.Libraries,
                                                                             emulated: Server, tmp_path: Path) -> None:
    # library_mirror.c loads a library on every slice; two slices on one GPU node share its cache.
    path = large_ptx(tmp_path)
    size = path.stat().st_size + 1
    t0, t1 = emulated.token(gpu=emulated.gpus[0]), emulated.token(gpu=emulated.gpus[1])
    done = py_client(native_libs, emulated.slices(t0, t1), f"""
        check("cuInit", 0)
        ctxs = []
        for d in range(2):
            ctx = ctypes.c_void_p()
            check("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), d)
            ctxs.append(ctx)
        check("cuCtxSetCurrent", ctxs[0])
        ptx = open({str(path)!r}, "rb").read() + b"\\0"
        lib_, k, f = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        check("cuLibraryLoadData", ctypes.byref(lib_), ptx, None, None, 0, None, None, 0)
        check("cuLibraryGetKernel", ctypes.byref(k), lib_, b"mixed")
        check("cuCtxSetCurrent", ctxs[1])
        check("cuKernelGetFunction", ctypes.byref(f), k)
        print("ON SLICE 1 OK")
        """, RGPU_CLIENT_STATS=str(tmp_path / "two"))
    assert "ON SLICE 1 OK" in done.stdout, done.stdout + done.stderr
    files = list(tmp_path.glob("two.*"))
    assert len(files) == 1, files
    assert client_stats.images(files[0].read_text()) == {"loads": 2, "cache_hits": 1, "bytes_sent": size,
                                                         "bytes_hashed": ANY, "hash_ns": ANY}


def test_the_profile_reader_shows_image_traffic(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert client_stats.images("# header (sends 1)\n") == {"loads": 0, "cache_hits": 0, "bytes_sent": 0}   # older profiles
    profile = tmp_path / "p.1"
    profile.write_text("# rgpu client call profile: op sync_calls sync_wait_ns async_calls (sends 3)\n"
                       "# module images: loads 2 cache_hits 1 bytes_sent 70000\n")
    assert client_stats.main([str(profile)]) == 0
    assert "module images: 2 loaded, 1 from the GPU node's cache, 70000 bytes sent" in capsys.readouterr().out



def test_a_load_naming_its_image_in_an_unknown_way_is_one_error(emulated: Server) -> None:
    # A hand-made frame (a hostile or mismatched client): no options, size 8, "how" 9, a short digest.
    sock, _ = protocol.handshake(emulated.address, emulated.token())
    with sock:
        payload = struct.pack("<IIQB", 0, 0, 8, 9) + b"\0" * 5
        sock.sendall(protocol.pack_frame(api_gen.OPCODES["cuModuleLoadDataEx"], payload))
        header, body = protocol.recv_frame(sock)
    assert header[1] == protocol.OP_REPLY and struct.unpack_from("<i", body)[0] == 1   # CUDA_ERROR_INVALID_VALUE
    assert b"names its image in no way this worker knows" in body, body


def test_the_dispatcher_refuses_a_negative_bound() -> None:
    with socket.socket() as sock:
        with pytest.raises(ConfigError, match="image_cache_bytes = -1 .* is negative"):
            start_data_path(sock, "127.0.0.1:1", (EMULATED_GPU,), b"s" * 32, (45201, 45300), "emulated",
                            replace(Settings(), image_cache_bytes=-1))
    assert Settings().image_cache_bytes == 16 << 30


# ------------------------------------------------------------------ fatbin containers as cudart registers them

LOAD_FROM_A_SECTION = MAP_A_FILE_READ_ONLY + """
    lib_ = ctypes.c_void_p()   # the image: the first container of a library's .nv_fatbin
    print("LOAD", lib.cuLibraryLoadData(ctypes.byref(lib_), ctypes.c_void_p(image), None, None, 0, None, None, 0))
    """


def _load_first_container(libs: build.Libraries, server: Server, tmp_path: Path, name: str,
                          containers: list[bytes]) -> tuple[str, dict[str, int]]:
    path = tmp_path / f"{name}.nv_fatbin"
    path.write_bytes(b"".join(c + b"\0" * (-len(c) % 8) for c in containers))
    done = py_client(libs, server.slices(server.token()), LOAD_FROM_A_SECTION.format(path=str(path)),
                     RGPU_CLIENT_STATS=str(tmp_path / f"stats-{name}"), RGPU_DIGEST_MEMO="")
    assert done.returncode == 0, done.stdout + done.stderr
    (stats,) = tmp_path.glob(f"stats-{name}.*")
    return done.stdout, client_stats.images(stats.read_text())


def test_a_fatbin_load_sends_its_own_container_not_the_units_after_it(native_libs: build.Libraries,
                                                                     emulated: Server, tmp_path: Path) -> None:
    # A library's .nv_fatbin holds one container per translation unit, back to back (PyTorch's:
    # thousands, about a gigabyte); cudart registers each. Sending every container after the one
    # registered cost a PyTorch process's first start gigabytes (quadratic in the section).
    sm90 = vecadd_container_for(90)
    out, sent = _load_first_container(native_libs, emulated, tmp_path, "section",
                                      [sm90, vecadd_container_for(80), sm90, vecadd_container_for(70)])
    assert "LOAD 0" in out, out
    assert sent["loads"] == 1 and sent["bytes_sent"] == len(sm90)
    # A container with no code for the GPU is refused as the driver refuses it
    # (CUDA_ERROR_NO_BINARY_FOR_GPU), not loaded with the next unit's code.
    out, sent = _load_first_container(native_libs, emulated, tmp_path, "foreign", [vecadd_container_for(100), sm90])
    assert "LOAD 209" in out and sent["bytes_sent"] == len(sm90), out


def test_an_image_whose_header_sizes_it_past_its_memory_is_refused_in_one_line(native_libs: build.Libraries,
                                                                             emulated: Server) -> None:
    # The size of a fatbin or cubin comes from its own header: a damaged one must not have the
    # client hash and send (read) memory past the mapping the image is in, which ends the
    # application with SIGSEGV.
    done = py_client(native_libs, emulated.slices(emulated.token()), f"""
        import mmap, struct
        setup()
        page = mmap.PAGESIZE
        libc = ctypes.CDLL(None)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        good = open({str(EXAMPLES / "vecadd.fatbin")!r}, "rb").read()
        cubin = open({str(EXAMPLES / "vecadd.sm_90.cubin")!r}, "rb").read()

        def last_page(data):   # `data` ending where its mapping ends
            pages = -(-len(data) // page)
            base = libc.mmap(None, (pages + 1) * page, 3, 0x22, -1, 0)   # PROT_READ|WRITE, MAP_PRIVATE|ANONYMOUS
            libc.munmap(base + pages * page, page)
            at = base + pages * page - len(data)
            ctypes.memmove(at, data, len(data))
            return at

        mod = ctypes.c_void_p()
        long_body = bytearray(good[:64]); struct.pack_into("<Q", long_body, 8, 1 << 20)
        huge_body = bytearray(good[:64]); struct.pack_into("<Q", huge_body, 8, 1 << 39)
        far_sections = bytearray(cubin[:64]); struct.pack_into("<Q", far_sections, 0x28, 1 << 30)
        for name, data in (("long", long_body), ("huge", huge_body), ("far", far_sections)):
            print(name.upper(), lib.cuModuleLoadData(ctypes.byref(mod), ctypes.c_void_p(last_page(bytes(data)))), flush=True)
        print("WHOLE", lib.cuModuleLoadData(ctypes.byref(mod), ctypes.c_void_p(last_page(good))))
        """)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "LONG 200" in done.stdout and "HUGE 200" in done.stdout and "FAR 200" in done.stdout, done.stdout
    assert "WHOLE 0" in done.stdout, done.stdout + done.stderr
    assert done.stderr.count("past the memory it lies in") == 2, done.stderr
    assert done.stderr.count("header does not give its size") == 1, done.stderr   # the cubin's tables are elsewhere
