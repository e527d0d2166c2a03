"""CUDA's error log management (cuLogs*, CUDA 12.9) answered by rgpu's client: a registered callback
and the log's dumps get rgpu's warnings and errors, the worker's explanation of a refusal included,
in the driver's line format; iterators advance; a buffer too small for any line is refused as the
driver refuses it. Callbacks run on a thread of rgpu's (a line is often written under a session's
lock), so they may call CUDA. PyTorch 2.14 registers a callback at start-up (it got CUDA_ERROR_NOT_SUPPORTED
and a warning line on every run)."""

from __future__ import annotations

from pathlib import Path

from rgpu.remoting.native import build

from tests.remoting.client_helpers import py_client
from tests.remoting.conftest import Server

GiB = 1 << 30


def test_a_refusal_reaches_the_log_callback_and_the_dumps(native_libs: build.Libraries, emulated: Server,
                                                          tmp_path: Path) -> None:
    dump_file = tmp_path / "cuda.log"
    log_file = tmp_path / "CUDA_LOG_FILE"
    done = py_client(native_libs, emulated.slices(emulated.token(memory_limit=GiB)), f"""
        got = []
        CB = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
        cb = CB(lambda data, level, msg, n: got.append((data, level, msg[:n].decode())))
        handle = ctypes.c_void_p()
        print("REGISTER", lib.cuLogsRegisterCallback(cb, ctypes.c_void_p(42), ctypes.byref(handle)))
        start = ctypes.c_uint()
        print("CURRENT", lib.cuLogsCurrent(ctypes.byref(start), 0), lib.cuLogsCurrent(ctypes.byref(start), 1))
        setup()
        r, ptr = alloc(2 * {GiB})
        print("ALLOC", r)
        import time
        deadline = time.monotonic() + 10   # callbacks run on a thread of their own
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        print("CALLBACK", got[-1][0], got[-1][1], "refused" in got[-1][2] and "1.0 GiB" in got[-1][2],
              got[-1][2].startswith("rgpu: "))
        it = ctypes.c_uint(start.value)
        size = ctypes.c_size_t(4096)
        buf = ctypes.create_string_buffer(4096)
        print("DUMP", lib.cuLogsDumpToMemory(ctypes.byref(it), buf, ctypes.byref(size), 0), size.value == len(buf.value))
        lines = buf.value.decode().splitlines()
        print("LINE", lines[-1].split("]")[2:4], "refused" in lines[-1], it.value > start.value)
        again = ctypes.c_size_t(4096)
        print("EMPTY", lib.cuLogsDumpToMemory(ctypes.byref(it), buf, ctypes.byref(again), 0), again.value)
        it2 = ctypes.c_uint(start.value)
        tiny = ctypes.c_size_t(8)
        print("TINY", lib.cuLogsDumpToMemory(ctypes.byref(it2), buf, ctypes.byref(tiny), 0), tiny.value, it2.value == start.value)
        print("NULL", lib.cuLogsDumpToMemory(None, None, ctypes.byref(tiny), 0))
        print("FILE", lib.cuLogsDumpToFile(None, {str(dump_file)!r}.encode(), 0))
        print("UNREGISTER", lib.cuLogsUnregisterCallback(handle), lib.cuLogsUnregisterCallback(handle))
        n = len(got)
        alloc(2 * {GiB})
        time.sleep(0.5)
        print("AFTER", len(got) == n)
        """, CUDA_LOG_FILE=str(log_file))
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "REGISTER 0" in out and "CURRENT 0 1" in out and "ALLOC 2" in out, out   # CUDA_ERROR_OUT_OF_MEMORY
    assert "CALLBACK 42 0 True True" in out, out             # userData, CU_LOG_LEVEL_ERROR, the worker's words
    assert "DUMP 0 True" in out and "LINE ['[rgpu', '[E'] True True" in out, out
    assert "EMPTY 0 0" in out and "TINY 1 0 True" in out and "NULL 1" in out, out
    assert "FILE 0" in out and "refused" in dump_file.read_text(), out
    assert "UNREGISTER 0 1" in out and "AFTER True" in out, out
    assert "cuLogs" not in done.stderr, done.stderr        # answered, never "not remoted"
    lines = log_file.read_text().splitlines()               # as NVIDIA's driver writes it, a line per message
    assert len(lines) == 2 and all("][rgpu][E] " in line and "refused" in line for line in lines), lines


def test_a_callback_may_call_cuda(native_libs: build.Libraries, emulated: Server) -> None:
    # The worker's explanation arrives while the client holds the session: a callback run there
    # that called CUDA would wait for itself.
    done = py_client(native_libs, emulated.slices(emulated.token(memory_limit=GiB)), f"""
        import time
        ctx = setup()
        results = []
        def on_log(data, level, msg, n):
            lib.cuCtxSetCurrent(ctx)
            results.append(alloc(1 << 20)[0])
        CB = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
        cb = CB(on_log)
        handle = ctypes.c_void_p()
        check("cuLogsRegisterCallback", cb, None, ctypes.byref(handle))
        print("ALLOC", alloc(2 * {GiB})[0])
        deadline = time.monotonic() + 10
        while not results and time.monotonic() < deadline:
            time.sleep(0.01)
        print("FROM THE CALLBACK", results)
        """, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ALLOC 2" in done.stdout and "FROM THE CALLBACK [0]" in done.stdout, done.stdout + done.stderr


def test_unregistering_waits_for_a_running_callback_and_a_callback_may_unregister_itself(
        native_libs: build.Libraries, emulated: Server) -> None:
    done = py_client(native_libs, emulated.slices(emulated.token(memory_limit=GiB)), f"""
        import threading, time
        setup()
        CB = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
        started, events = threading.Event(), []
        def slow(data, level, msg, n):
            started.set(); time.sleep(0.5); events.append("callback done")
        slow_cb = CB(slow)
        slow_handle = ctypes.c_void_p()
        check("cuLogsRegisterCallback", slow_cb, None, ctypes.byref(slow_handle))
        alloc(2 * {GiB})
        started.wait(10)
        print("UNREGISTER", lib.cuLogsUnregisterCallback(slow_handle))
        events.append("unregistered")
        print("ORDER", events)
        self_handle = ctypes.c_void_p()
        def once(data, level, msg, n):
            events.append(lib.cuLogsUnregisterCallback(self_handle))
        once_cb = CB(once)
        check("cuLogsRegisterCallback", once_cb, None, ctypes.byref(self_handle))
        alloc(2 * {GiB}); alloc(2 * {GiB})
        deadline = time.monotonic() + 10
        while len(events) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)   # time for a wrong second call to show
        print("SELF", events[2:])
        """)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "UNREGISTER 0" in done.stdout and "ORDER ['callback done', 'unregistered']" in done.stdout, done.stdout
    assert "SELF [0]" in done.stdout, done.stdout   # unregistered in its first call, never called again
