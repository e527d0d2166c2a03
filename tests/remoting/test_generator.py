"""The API spec, the generator and the symbol table of the built client library."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from rgpu.remoting.native.generated import api_gen
from rgpu.remoting.datapath import protocol
from rgpu.remoting.native import apispec, build, generate

# Changing cuda.spec, nvml.spec or nccl.spec changes the wire protocol. When you change them on purpose,
# bump protocol_version in both specs and PROTOCOL_VERSION in protocol.py, regenerate, and
# record the new hashes here.
SPEC_HASHES = {
    1: ("54cb27df004bc9a3971636a36487bb0cdc90456185a5dddc8bc0e23d97c3d0c4",
        "63f26e1ce0b8249ae040fbb5d2cec6853052ea47229b6260fdf2e7d3a69b710f"),
    2: ("b0dbb45fa115f661e4134313ae6a344fc9b161ec2fa98d90545fe4672eb86ec8",
        "e94de67a1b19f27ce265ba4e5051be64b82cebe16836af2bfaaf06799760fa5a"),  # cuOccupancyMaxActiveClusters
    3: ("19d1b38741b054e9481290bb45b2682fbcde22c1079d3b490ff59973c1c1f4bd",
        "759a30eb7239284b8b662ed38472d43c564b008a049e626635b0651358710149"),  # capture, graphs and their nodes, VMM, stream attributes
    4: ("06960b73543e59c17e7053e617ed0217db947d09843e8c29884aee43e98d9420",
        "86e954ccf142cc0e3e5e1ed70d8a4996bec4f60cef66131818bb482ff6208d57"),  # private table 6e163fbe (cuFFT's module walk)
    5: ("17e4df07c51db25c7747a250a59cbc32f56ddc4a6822384336f9032ca2810029",
        "7ae156553f0c913a8e5edc41f22dfd65ec032cc88cfef75ccfd895a4c480a16e"),  # host nodes: HOST_CALL / HOST_DONE frames
    6: ("e81e07bdbd357988a8b22ae6bce7515ef5a2edce500f1dd4923e733c8d658217",
        "c48f9d345878824fa1002d6055eccdbcf2e821559763aa89c0d36eba18d3034f"),  # CUDA arrays, texture and surface objects
    7: ("c1b86c51a81dda4cbfe258ff8f6bc88ff498b62cd6bd995f39af207af54e3aef",
        "1d5c2a0e7408bce02644ce8c50b75c7d0e293907388c39e0427fbf6801cbb9c3"),  # module loads name large images by SHA-256 (the node's image cache)
    8: ("ab41f958eb2959fb582665da1db3b847627156573a54a2d61d8c757f102b1f1f",
        "d85a206af20eadd91fda2666bfcf286b25794219f2a42f160c16799e3e8c94f2"),  # client-made events and streams (rgpuEventCreate, rgpuStreamCreate; destruction async); module loads say whether they want the function table
    9: ("bf0c972afb92914750e29be12767bfc5ab093d59862cb2c011d869726b6c1d9a",
        "7c50e0959e8088c16c5a1ce7a974070a165c157c89f429bbf0ce248556f74ca0"),  # pipelined attribute sets (rgpuSetAttribute); tensor maps
    10: ("b513671ab8b509b201ef8fe75d6a1ed0f349c7b99b063169037ed3677b518b23",
         "85e4d033188ba47da28e530c2e80e060e445466e1597b66cb7a07ce0a9f9e798"),  # UCX underneath copies (rgpuMemcpyHtoDUcx/DtoHUcx; WELCOME's UCX address, HELLO info "ucx")
    11: ("31f59045d1145d450cc0b848b81006059afb9350ea2938fe3768289501a811b1",
         "ef39bd37b13941d28a745febdddaa99c007154e08ff247f5ad8937813defe306"),  # root nodes, child graphs, cuGraphAddNode(_v2), cuStreamBeginCaptureToGraph (JAX)
    12: ("628bfae87fb52fc3dd185cfa0559fcbf732af6641a105b8944b00f93aabfe137",
         "9bb836b0c606cfc59fd6a723fe65b491dade8627f4bb4aa856f0dfb0f81d55ed"),  # data lanes: striped copies (rgpuMemcpyHtoDLanes, rgpuMemcpyDtoHLanes; HELLO_LANE, LANE_DATA, WELCOME's lane count)
    13: ("5e521e6bbe895d8f509e7bc7b3507d509a3059d6f8c5a2c89c85e3e9337550d3",
         "6d0ac18533ae488d1c2096b1ca6142f62405fe3ff9423857abf0318013b89f8f"),  # graph edge data (rgpuGraphAddEdges: cuGraphAddDependencies(_v2), cuGraphAddNode_v2's ports), cuGraphDestroyNode; NCCL: nccl.spec's operations (libnccl.so.2)
    14: ("85b537b5f8b45ea96b88f5a7612a5703a6ea720953231fe6a13a19a97c1076b7",
         "b2cee1b1d97ece7a4f67441537def314add95297c927ea9cf0818cffac4a504d"),  # cuda.spec and nvml.spec unchanged; nccl.spec's split, finalize, PreMulSum, all-to-all
    15: ("fd8cfacd9425a4f64a2e90df7f5d1627e378d8d20a6f38e275a482b59f3b9501",
         "58f254eb65d77fcb308738b07266e7dd8fe5f5498c571869e60f3815f2351a27"),  # same-host page-locked memory read in place (rgpuHostShare/Unshare, rgpuMemcpyHtoDShared(Wait), rgpuMemcpyDtoHShared); UCX copies in 4 MiB chunks tagged seq | i << 32
    16: ("c0e017c5e70994bcffaa01d8ec4ae99326cbb9994e4f4b134ac250b911dfd07a",
         "4c81efe01935923a83a4f4740dbc02e3762f85b5f0a94112c3074f14be0495e8"),  # the version only (nccl.spec: scalable init, shrink)
}
# nccl.spec (from protocol 13): its wire operations share the protocol version of the other two.
NCCL_SPEC_HASHES = {
    13: "a09cf80cd3b3deb9908ff6c916ae17c4563ef8a09a0a1827b276aedea8baba71",   # communicators, groups, collectives, send/recv
    14: "aeba3eabe0f7d2acb562025ae2a0a9288d17893855bd45137f98c0a46a855aa8",   # rgpuNcclCommSplit, ncclCommFinalize, PreMulSum (rgpuNcclRedOpCreatePreMulSum, ncclRedOpDestroy), ncclAlltoAll; rgpuNcclCommReady answers rank and size
    15: "2cc3097b4cc9797511cdf1c134d6854db2f7fa606318f55e97a67c55f62faa80",   # the version only (protocol 15: shared page-locked memory, chunked UCX copies)
    16: "14acf16377d808117c06501d9d48903c8055143c25b91d4a78d7e5acb22de508",   # rgpuNcclCommShrink, rgpuNcclCommJoinScalable (ncclCommShrink, ncclCommInitRankScalable); input arrays (name[len])
}


@pytest.mark.integration   # runs the generator as a process
def test_generated_files_are_up_to_date() -> None:
    done = subprocess.run([sys.executable, "-m", "rgpu.remoting.native.generate", "--check"], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr + "\nrun `python -m rgpu.remoting.native.generate` and commit the result"


def test_spec_changes_bump_the_protocol_version() -> None:
    cuda = apispec.parse_spec(apispec.SPEC_DIR / "cuda.spec")
    nvml = apispec.parse_spec(apispec.SPEC_DIR / "nvml.spec", first_opcode=generate.NVML_FIRST_OPCODE)
    assert cuda.protocol_version == nvml.protocol_version == protocol.PROTOCOL_VERSION == api_gen.PROTOCOL_VERSION
    assert SPEC_HASHES.get(protocol.PROTOCOL_VERSION) == (cuda.sha256, nvml.sha256), (
        "the API spec changed: bump protocol_version (cuda.spec, nvml.spec, protocol.py) and record "
        f"({cuda.sha256!r}, {nvml.sha256!r}) in SPEC_HASHES")


def test_nccl_spec_changes_bump_the_protocol_version() -> None:
    nccl = apispec.parse_spec(apispec.SPEC_DIR / "nccl.spec", first_opcode=generate.NCCL_FIRST_OPCODE)
    assert nccl.protocol_version == protocol.PROTOCOL_VERSION
    assert NCCL_SPEC_HASHES.get(protocol.PROTOCOL_VERSION) == nccl.sha256, (
        "nccl.spec changed: bump protocol_version (cuda.spec, nvml.spec, nccl.spec, protocol.py) and record "
        f"{nccl.sha256!r} in NCCL_SPEC_HASHES")


def test_every_spec_entry_is_a_driver_export() -> None:
    exports = set(apispec.read_exports(apispec.SPEC_DIR / "cuda_exports.txt"))
    spec = apispec.parse_spec(apispec.SPEC_DIR / "cuda.spec")
    assert {f.name for f in spec.functions if not f.name.startswith("rgpu")} <= exports


def test_library_exports_every_driver_symbol(native_libs: build.Libraries) -> None:
    exports = set(apispec.read_exports(apispec.SPEC_DIR / "cuda_exports.txt"))
    nm = subprocess.run(["nm", "-D", "--defined-only", str(native_libs.libcuda)], capture_output=True, text=True, check=False)
    if nm.returncode != 0:
        pytest.skip("nm is not available")
    defined = {line.split()[-1] for line in nm.stdout.splitlines() if line.strip()}
    assert exports <= defined, sorted(exports - defined)[:20]
    assert {d for d in defined if not d.startswith("cu")} == set(), "the library must export driver symbols only"
    nvml = set(apispec.read_exports(apispec.SPEC_DIR / "nvml_exports.txt"))
    nm = subprocess.run(["nm", "-D", "--defined-only", str(native_libs.libnvml)], capture_output=True, text=True, check=False)
    defined = {line.split()[-1] for line in nm.stdout.splitlines() if line.strip()}
    assert nvml <= defined, sorted(nvml - defined)[:20]


def test_every_built_library_resolves_all_its_symbols(native_libs: build.Libraries) -> None:
    """libnvidia-ml.so.1 shares transport.c with libcuda.so.1 but not every file: a call there into a
    file only libcuda has left the NVML library unloadable ("NVML Shared Library Not Found" from
    nvidia-smi and rgpu's smi, on an H200, 2026-11-28). The dynamic loader checks every symbol
    without running the libraries (ldd -r)."""
    folder = native_libs.libcuda.parent
    for lib in sorted(folder.glob("*.so.*")) + sorted(folder.glob("librgpu-worker.so")):
        done = subprocess.run(["ldd", "-r", str(lib)], capture_output=True, text=True, check=False,
                              env={"LD_LIBRARY_PATH": str(folder), "PATH": "/usr/bin:/bin"})
        if done.returncode == 127:
            pytest.skip("ldd is not available")
        undefined = [line for line in (done.stdout + done.stderr).splitlines() if "undefined symbol" in line]
        assert not undefined, f"{lib.name}: {undefined[:5]}"


def test_proc_table_maps_versions_to_symbols() -> None:
    procs = apispec.read_procs(apispec.SPEC_DIR / "cuda_procs.txt")
    table = {(b, v): s for b, v, s in procs if not s.endswith(("_ptds", "_ptsz"))}
    assert table[("cuMemAlloc", 3020)] == "cuMemAlloc_v2"
    assert table[("cuMemAlloc", 2000)] == "cuMemAlloc"
    assert table[("cuCtxCreate", 12050)] == "cuCtxCreate_v4"
    assert table[("cuStreamGetCaptureInfo", 12030)] == "cuStreamGetCaptureInfo_v3"
    assert ("cuStreamGetCaptureInfo", 12030, "cuStreamGetCaptureInfo_v3_ptsz") in procs


def test_spec_errors_name_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.spec"
    bad.write_text("protocol_version 1\nsync cuFoo(out int x)\n")
    with pytest.raises(apispec.SpecError, match="bad.spec:2: output parameter x must be a pointer"):
        apispec.parse_spec(bad)
    bad.write_text("protocol_version 1\nasync cuFoo(out int *x)\n")
    with pytest.raises(apispec.SpecError, match="is async but has outputs"):
        apispec.parse_spec(bad)
    bad.write_text("protocol_version 1\nsync cuFoo(CUjit_option *options)\n")
    with pytest.raises(apispec.SpecError, match="mark the function manual or local"):
        apispec.parse_spec(bad)


def test_get_proc_address_honours_versions_and_flags(native_libs: build.Libraries) -> None:
    code = r'''
import ctypes
lib = ctypes.CDLL("libcuda.so.1")
def get(name, version, flags=0):
    pfn = ctypes.c_void_p(); status = ctypes.c_int(-1)
    r = lib.cuGetProcAddress_v2(name.encode(), ctypes.byref(pfn), version, ctypes.c_uint64(flags), ctypes.byref(status))
    return r, pfn.value, status.value
addr = lambda n: ctypes.cast(getattr(lib, n), ctypes.c_void_p).value
r, p, s = get("cuMemAlloc", 12000); print("V2", r, p == addr("cuMemAlloc_v2"), s)
r, p, s = get("cuMemAlloc", 2000); print("V1", r, p == addr("cuMemAlloc"), s)
r, p, s = get("cuCtxCreate", 11040); print("CTX3", p == addr("cuCtxCreate_v3"))
r, p, s = get("cuCtxCreate", 13000); print("CTX4", p == addr("cuCtxCreate_v4"))
r, p, s = get("cuMemcpyHtoD", 12000, 2); print("PTDS", p == addr("cuMemcpyHtoD_v2_ptds"))
r, p, s = get("cuLaunchKernel", 12000, 2); print("PTSZ", p == addr("cuLaunchKernel_ptsz"))
r, p, s = get("cuMemAllocAsync", 10000); print("TOO_OLD", r, p, s)
r, p, s = get("cuNotAThing", 13000); print("UNKNOWN", r, p is not None, s)
print("CALL", ctypes.CFUNCTYPE(ctypes.c_int)(p)())
'''
    done = subprocess.run([sys.executable, "-c", code], env={"LD_LIBRARY_PATH": str(native_libs.folder), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, check=False)
    out = done.stdout
    assert "V2 0 True 0" in out and "V1 0 True 0" in out, out + done.stderr
    assert "CTX3 True" in out and "CTX4 True" in out and "PTDS True" in out and "PTSZ True" in out
    assert "TOO_OLD 500 None 2" in out        # CUDA_ERROR_NOT_FOUND, VERSION_NOT_SUFFICIENT
    assert "UNKNOWN 0 True 0" in out and "CALL 801" in out
    assert "cuNotAThing is not remoted" in done.stderr


def test_string_parameters_travel_as_strings() -> None:
    # A `const char *` is a string, not a one-byte struct (cuLibraryGetKernel's name once went as 1 byte).
    text = (Path(__file__).resolve().parents[2] / "remoting/native/generated/cuda_gen.c").read_text()
    body = text[text.index("CUDAAPI cuLibraryGetKernel("):]
    body = body[:body.index("\n}\n")]
    assert "rgpu_put_str(&c, name);" in body
