"""Private table 6e163fbe (cuFFT's module walk, remoting/native/src/module_nodes.c) against the
emulated worker: slot 7 hands the module's function nodes to a callback; each node is an object in
the client whose known fields come from the worker's node, and it works as a CUfunction."""

from __future__ import annotations

from rgpu.remoting.native import build

from tests.remoting.conftest import EXAMPLES, Server
from tests.remoting.client_helpers import py_client


def test_the_module_walk_hands_out_nodes_that_work_as_functions(native_libs: build.Libraries, emulated: Server) -> None:
    done = py_client(native_libs, emulated.slices(emulated.token()), f"""
        setup()
        class Uuid(ctypes.Structure):
            _fields_ = [("b", ctypes.c_ubyte * 16)]
        uuid = Uuid((ctypes.c_ubyte * 16)(*bytes.fromhex("6e163fbeb958444d835ce182aff1991e")))
        table = ctypes.c_void_p()
        check("cuGetExportTable", ctypes.byref(table), ctypes.byref(uuid))
        words = ctypes.cast(table, ctypes.POINTER(ctypes.c_uint64))
        print("SIZE", words[0])
        ptx = open({str(EXAMPLES / "vecadd.ptx")!r}, "rb").read() + b"\\0"
        mod = ctypes.c_void_p()
        check("cuModuleLoadData", ctypes.byref(mod), ptx)
        seen = []
        CB = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64)
        cb = CB(lambda opaque, node, owner: seen.append((node, owner)))
        walk = ctypes.CFUNCTYPE(ctypes.c_uint64, *[ctypes.c_uint64] * 6)(words[7])
        ctx = ctypes.c_void_p()
        check("cuCtxGetCurrent", ctypes.byref(ctx))
        n = walk(ctx.value, mod.value, ctypes.cast(cb, ctypes.c_void_p).value, 0, mod.value, 0)
        print("NODES", n, len(seen), all(owner == mod.value for _, owner in seen))
        node = seen[0][0]
        field = lambda off: ctypes.c_uint64.from_address(node + off).value
        print("FIELDS", field(0x0), field(0x8) == mod.value, field(0x10), field(0x18), field(0x28),
              ctypes.c_uint32.from_address(node + 0x370).value)
        names = []
        for node, _ in seen:
            name = ctypes.c_char_p()
            check("cuFuncGetName", ctypes.byref(name), ctypes.c_void_p(node))
            names.append(name.value.decode())
        print("NAMES", sorted(names))
        # cuFuncGetAttribute goes through the generated path, a launch through the hand-written one:
        # both send the worker's node (an untranslated client node is INVALID_HANDLE there).
        v = ctypes.c_int()
        print("ATTR", lib.cuFuncGetAttribute(ctypes.byref(v), 0, ctypes.c_void_p(seen[names.index("empty")][0])), v.value)
        print("LAUNCH", lib.cuLaunchKernel(ctypes.c_void_p(seen[names.index("empty")][0]), 1, 1, 1, 1, 1, 1, 0, None, None, None))
        print("SYNC", lib.cuCtxSynchronize())
        """)
    out = done.stdout
    assert "SIZE 96" in out, out + done.stderr
    assert "NODES 4 4 True" in out
    assert "FIELDS 1 True 2 3 4 5" in out
    assert "NAMES ['empty', 'mixed', 'spin', 'vecadd']" in out
    assert "ATTR 0 1024" in out
    assert "LAUNCH 0" in out
    assert "SYNC 801" in out        # the emulated device refuses launches: the worker got a real function


def test_the_table_is_not_found_before_cuinit(native_libs: build.Libraries, emulated: Server) -> None:
    done = py_client(native_libs, emulated.slices(emulated.token()), """
        class Uuid(ctypes.Structure):
            _fields_ = [("b", ctypes.c_ubyte * 16)]
        uuid = Uuid((ctypes.c_ubyte * 16)(*bytes.fromhex("6e163fbeb958444d835ce182aff1991e")))
        table = ctypes.c_void_p()
        print("BEFORE", lib.cuGetExportTable(ctypes.byref(table), ctypes.byref(uuid)))
        """)
    assert "BEFORE 500" in done.stdout, done.stdout + done.stderr   # CUDA_ERROR_NOT_FOUND
