"""Managed memory emulated by the client (remoting/native/src/managed.c) against the emulated
worker: one address for host and GPU, the host's writes reach the GPU before its next call, the
GPU's reach the host at synchronisation, and the device says it has managed memory without
concurrent access."""

from __future__ import annotations

from rgpu.remoting.native import build

from tests.remoting.conftest import Server
from tests.remoting.client_helpers import py_client


def test_managed_memory_is_one_address_kept_coherent_at_synchronisation(native_libs: build.Libraries,
                                                                        emulated: Server) -> None:
    done = py_client(native_libs, emulated.slices(emulated.token()), """
        setup()
        v = ctypes.c_int()
        check("cuDeviceGetAttribute", ctypes.byref(v), 83, 0); managed = v.value        # MANAGED_MEMORY
        check("cuDeviceGetAttribute", ctypes.byref(v), 89, 0); concurrent = v.value     # CONCURRENT_MANAGED_ACCESS
        print("ATTRS", managed, concurrent)
        n = 3 * 4096 + 100
        m, d = ctypes.c_uint64(), ctypes.c_uint64()
        check("cuMemAllocManaged", ctypes.byref(m), ctypes.c_size_t(n), 1)
        check("cuMemAlloc_v2", ctypes.byref(d), ctypes.c_size_t(n))
        host = (ctypes.c_ubyte * n).from_address(m.value)      # the same address, on the host
        print("ZERO", bytes(host[:16]) == bytes(16))
        for i in range(n):
            host[i] = i % 251
        # The host's writes reach the GPU before its next call: copy device to device, read back.
        check("cuMemcpyDtoD_v2", d, m, ctypes.c_size_t(n))
        out = (ctypes.c_ubyte * n)()
        check("cuMemcpyDtoH_v2", out, d, ctypes.c_size_t(n))
        print("TO_GPU", bytes(out) == bytes(host))
        # The GPU's writes reach the host at synchronisation.
        check("cuMemsetD8_v2", m, 0x5A, ctypes.c_size_t(n))
        check("cuCtxSynchronize")
        print("TO_HOST", bytes(host) == b"\\x5a" * n)
        # Through a stream, with prefetch and advice (checked, nothing to do) and a stream query.
        s = ctypes.c_void_p()
        check("cuStreamCreate", ctypes.byref(s), 0)
        check("cuStreamAttachMemAsync", s, m, ctypes.c_size_t(0), 4)
        check("cuMemAdvise", m, ctypes.c_size_t(n), 1, 0)
        host[0] = 7
        check("cuMemsetD8Async", ctypes.c_uint64(m.value + 1), 9, ctypes.c_size_t(1), s)
        check("cuStreamSynchronize", s)
        print("MIXED", host[0], host[1], host[2])
        print("BAD_ADVICE", lib.cuMemAdvise(d, ctypes.c_size_t(n), 1, 0))   # not managed: INVALID_VALUE
        check("cuMemFree_v2", m)
        check("cuMemFree_v2", d)
        print("FREED")
        """)
    out = done.stdout
    assert "ATTRS 1 0" in out, out + done.stderr
    assert "ZERO True" in out
    assert "TO_GPU True" in out
    assert "TO_HOST True" in out
    assert "MIXED 7 9 90" in out
    assert "BAD_ADVICE 1" in out
    assert "FREED" in out


def test_a_host_access_while_the_gpu_owns_managed_memory_stops_the_program_with_one_line(
        native_libs: build.Libraries, emulated: Server) -> None:
    # As on a GPU without concurrent managed access: never stale data, a signal and a reason.
    done = py_client(native_libs, emulated.slices(emulated.token()), """
        setup()
        m = ctypes.c_uint64()
        check("cuMemAllocManaged", ctypes.byref(m), ctypes.c_size_t(4096), 1)
        host = (ctypes.c_ubyte * 4096).from_address(m.value)
        host[0] = 1
        check("cuMemsetD8Async", m, 3, ctypes.c_size_t(4096), None)   # the GPU owns it now
        print("BEFORE", flush=True)
        print("READ", host[0], flush=True)                            # no synchronisation first
        """)
    assert "BEFORE" in done.stdout and "READ" not in done.stdout, done.stdout + done.stderr
    assert done.returncode == -11, done.returncode
    assert "the host touched managed memory while the GPU may be using it" in done.stderr


def test_pinned_host_memory_is_mapped_for_the_gpu_only_where_rgpu_can_back_it(native_libs: build.Libraries,
                                                                               emulated: Server) -> None:
    # The GPU is on another machine: page-locked memory here is mapped for it only where the worker
    # can back it at the same address (zero_copy.c). Saying it was mapped otherwise made the runtime
    # hand a kernel this host address (NVIDIA's UnifiedMemoryPerf, zero-copy mode).
    program = """
        setup()
        p = ctypes.c_void_p()
        check("cuMemHostAlloc", ctypes.byref(p), ctypes.c_size_t(4096), 2)      # CU_MEMHOSTALLOC_DEVICEMAP
        mapped = ctypes.c_ubyte(9)
        check("cuPointerGetAttribute", ctypes.byref(mapped), 13, ctypes.c_uint64(p.value))   # MAPPED
        d = ctypes.c_uint64()
        print("MAPPED", mapped.value, "DEVPTR", lib.cuMemHostGetDevicePointer_v2(ctypes.byref(d), p, 0),
              "SAME", d.value == p.value, flush=True)
        """
    done = py_client(native_libs, emulated.slices(emulated.token()), program)   # zero-copy is on by default
    assert "DEVPTR 0 SAME True" in done.stdout, done.stdout + done.stderr
    done = py_client(native_libs, emulated.slices(emulated.token()), program, RGPU_ZERO_COPY="0")
    assert "MAPPED 0 DEVPTR 801" in done.stdout, done.stdout + done.stderr
    # PyTorch asks on every run and does without it: quiet unless RGPU_LOG=debug (a launch that
    # hands a kernel such a pointer gets the clear line, test_zero_copy_emulated.py).
    assert "cuMemHostGetDevicePointer_v2" not in done.stderr, done.stderr
    done = py_client(native_libs, emulated.slices(emulated.token()), program, RGPU_LOG="debug", RGPU_ZERO_COPY="0")
    assert "cuMemHostGetDevicePointer_v2 is not remoted (a remote GPU cannot map this host's memory" in done.stderr


def test_pointer_attributes_call_managed_memory_managed(native_libs: build.Libraries, emulated: Server) -> None:
    # CuPy 14.2's test_pointer_get_memory_type: the runtime calls memory managed when the driver
    # says IS_MANAGED, an int. The worker's driver sees device memory (and the allocation behind the
    # program's address), so the client answers these attributes of managed memory itself; and it
    # wrote one byte of the int for page-locked memory, so the runtime read the caller's stack.
    done = py_client(native_libs, emulated.slices(emulated.token()), """
        setup()
        n = 3 * 4096 + 100
        m, d, h = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_void_p()
        check("cuMemAllocManaged", ctypes.byref(m), ctypes.c_size_t(n), 1)
        check("cuMemAlloc_v2", ctypes.byref(d), ctypes.c_size_t(n))
        check("cuMemAllocHost_v2", ctypes.byref(h), ctypes.c_size_t(n))
        def one(attr, ptr, kind):
            v = kind(0xA5A5A5A5A5A5A5A5 & ((1 << (8 * ctypes.sizeof(kind))) - 1))   # what a caller's stack holds
            check("cuPointerGetAttribute", ctypes.byref(v), attr, ctypes.c_uint64(ptr))
            return v.value
        inside = m.value + 4096
        print("MANAGED", one(8, inside, ctypes.c_uint), one(2, inside, ctypes.c_uint), one(11, inside, ctypes.c_uint64) == m.value,
              one(12, inside, ctypes.c_size_t) == n, one(4, inside, ctypes.c_uint64) == inside)
        print("DEVICE", one(8, d.value, ctypes.c_uint), one(2, d.value, ctypes.c_uint), one(11, d.value + 8, ctypes.c_uint64) == d.value)
        print("PINNED", one(8, h.value, ctypes.c_uint), one(13, h.value, ctypes.c_uint), one(2, h.value, ctypes.c_uint))
        for name, ptr in (("PLURAL", inside), ("PLURAL_DEVICE", d.value), ("PLURAL_PINNED", h.value)):
            is_managed, mtype, start = ctypes.c_uint(0xA5A5A5A5), ctypes.c_uint(0xA5A5A5A5), ctypes.c_uint64()
            attrs = (ctypes.c_int * 3)(8, 2, 11)
            data = (ctypes.c_void_p * 3)(*[ctypes.cast(ctypes.byref(x), ctypes.c_void_p) for x in (is_managed, mtype, start)])
            check("cuPointerGetAttributes", 3, attrs, data, ctypes.c_uint64(ptr))
            print(name, is_managed.value, mtype.value)
        """)
    assert done.returncode == 0, done.stdout + done.stderr
    # IS_MANAGED 1, memory type DEVICE (2) as NVIDIA's driver answers for managed memory, the
    # program's range, the host pointer its own address; page-locked memory neither managed nor
    # mapped for the GPU, its memory type HOST (1).
    assert "MANAGED 1 2 True True True" in done.stdout, done.stdout
    assert "DEVICE 0 2 True" in done.stdout and "PINNED 0 0 1" in done.stdout, done.stdout
    assert "PLURAL 1 2" in done.stdout and "PLURAL_DEVICE 0 2" in done.stdout and "PLURAL_PINNED 0 1" in done.stdout, done.stdout


def test_advice_and_prefetches_are_checked_as_the_driver_checks_them(native_libs: build.Libraries,
                                                                      emulated: Server) -> None:
    # CuPy's test_managed_memory_madvise_basic expects an unknown advice to fail; a processor that
    # is neither the host (CU_DEVICE_CPU, -1) nor a slice is refused where the advice names one.
    done = py_client(native_libs, emulated.slices(emulated.token()), """
        setup()
        n = 4096
        m = ctypes.c_uint64()
        check("cuMemAllocManaged", ctypes.byref(m), ctypes.c_size_t(n), 1)
        size = ctypes.c_size_t(n)
        advise = lambda advice, device: lib.cuMemAdvise(m, size, advice, device)
        print("READ_MOSTLY", advise(1, 0), advise(2, 10**8))            # the device is ignored
        print("PREFERRED", advise(3, 0), advise(3, -1), advise(3, 10**8), advise(3, 1))
        print("ACCESSED_BY", advise(5, 0), advise(6, -1), advise(5, -2))
        print("UNKNOWN", advise(-1, 0), advise(0, 0), advise(7, 0))

        class Location(ctypes.Structure):
            _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]
        v2 = lambda advice, kind, ident: lib.cuMemAdvise_v2(m, size, advice, Location(kind, ident))
        print("V2", v2(3, 1, 0), v2(3, 2, 0), v2(3, 1, 5), v2(3, 0, 0), v2(9, 1, 0))
        prefetch = lambda device: lib.cuMemPrefetchAsync(m, size, device, None)
        print("PREFETCH", prefetch(0), prefetch(-1), prefetch(10**8))
        print("PREFETCH_V2", lib.cuMemPrefetchAsync_v2(m, size, Location(1, 0), 0, None),
              lib.cuMemPrefetchAsync_v2(m, size, Location(1, 7), 0, None))
        check("cuCtxSynchronize")
        check("cuMemFree_v2", m)
        print("FREED")
        """)
    out = done.stdout
    assert "READ_MOSTLY 0 0" in out, out + done.stderr
    assert "PREFERRED 0 0 101 101" in out        # CUDA_ERROR_INVALID_DEVICE: one slice, ordinal 0
    assert "ACCESSED_BY 0 0 101" in out
    assert "UNKNOWN 1 1 1" in out                # CUDA_ERROR_INVALID_VALUE
    assert "V2 0 0 101 101 1" in out
    assert "PREFETCH 0 0 101" in out
    assert "PREFETCH_V2 0 101" in out
    assert "FREED" in out
