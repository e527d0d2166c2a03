"""rgpu's libnvidia-ml.so.1 through nvidia-ml-py (pynvml): the slice's memory, not the GPU's."""

from __future__ import annotations

import textwrap
from pathlib import Path

from rgpu.remoting.native import build

from tests.remoting.conftest import PY, Server, run_client

HERE = Path(__file__).parent


def test_pynvml_sees_the_slice_and_what_its_sessions_hold(native_libs: build.Libraries, emulated: Server) -> None:
    limit = 256 << 20
    token = emulated.token(memory_limit=limit, job_key="nvml")
    done = run_client(native_libs, emulated.slices(token), [PY, "-c", textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(HERE)!r})
        from ctcuda import *
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        print("COUNT", pynvml.nvmlDeviceGetCount())
        print("NAME", pynvml.nvmlDeviceGetName(h))
        print("UUID", pynvml.nvmlDeviceGetUUID(h))
        m = pynvml.nvmlDeviceGetMemoryInfo(h)
        print("BEFORE", m.total, m.used, m.free)
        setup()
        r, p = alloc(100 << 20)
        m = pynvml.nvmlDeviceGetMemoryInfo(h)
        print("AFTER", m.total, m.used, m.free)
        print("CC", pynvml.nvmlDeviceGetCudaComputeCapability(h))
        print("PROCS", pynvml.nvmlDeviceGetComputeRunningProcesses(h))
        print("DRIVER", pynvml.nvmlSystemGetDriverVersion())
        print("CUDA", pynvml.nvmlSystemGetCudaDriverVersion())
        try:
            pynvml.nvmlDeviceGetFanSpeed(h)
        except pynvml.NVMLError_NotSupported:
            print("FAN not supported")
        try:
            pynvml.nvmlDeviceGetEncoderSessions(h)
        except pynvml.NVMLError_NotSupported:
            print("UNREMOTED not supported")
        pynvml.nvmlShutdown()
        """)])
    out = done.stdout
    assert "COUNT 1" in out, out + done.stderr
    assert "NAME NVIDIA H200" in out
    assert f"UUID {emulated.gpus[0].uuid}" in out
    assert f"BEFORE {limit} 0 {limit}" in out
    assert f"AFTER {limit} {100 << 20} {limit - (100 << 20)}" in out
    assert "CC (9, 0)" in out
    assert "PROCS []" in out
    assert "FAN not supported" in out and "UNREMOTED not supported" in out
    assert "CUDA 13000" in out


def test_internal_export_table_answers_what_nvidia_smi_calls(native_libs: build.Libraries,
                                                             emulated: Server) -> None:
    """nvidia-smi stops without nvmlInternalGetExportTable and an event set; both must be safe."""
    token = emulated.token(memory_limit=256 << 20, job_key="nvml-internal")
    done = run_client(native_libs, emulated.slices(token), [PY, "-c", textwrap.dedent("""
        import ctypes
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        assert nvml.nvmlInit_v2() == 0
        table = ctypes.POINTER(ctypes.c_void_p)()
        table_id = (ctypes.c_ubyte * 16)(*range(16))
        assert nvml.nvmlInternalGetExportTable(ctypes.byref(table), table_id) == 0
        print("SIZE", table[0])
        slot = lambda n: ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                          ctypes.c_void_p)(table[n])
        public = ctypes.c_void_p()
        assert nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(public)) == 0
        found = ctypes.c_void_p()
        print("LOOKUP", slot(81)(0, ctypes.addressof(found), 0x22, None), found.value == public.value)
        print("MISSING", slot(81)(7, ctypes.addressof(found), 0x22, None))
        count = ctypes.c_uint(250)
        entries = ctypes.create_string_buffer(4128 * 4)
        print("PROCS", slot(213)(public, ctypes.addressof(count), ctypes.addressof(entries), None), count.value)
        print("OTHER", slot(17)(None, None, None, None))
        value = ctypes.c_uint(7)
        print("PER-DEVICE", slot(230)(public, ctypes.addressof(value), None, None), value.value)
        print("NULL", nvml.nvmlInternalGetExportTable(None, table_id))
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        events = pynvml.nvmlEventSetCreate()
        pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, events)
        print("EVENT TYPES", pynvml.nvmlDeviceGetSupportedEventTypes(h))
        try:
            pynvml.nvmlEventSetWait(events, 50)
        except pynvml.NVMLError_Timeout:
            print("WAIT timeout")
        pynvml.nvmlEventSetFree(events)
        is_mig = pynvml.nvmlDeviceIsMigDeviceHandle(h)
        print("MIG", getattr(is_mig, "value", is_mig), pynvml.nvmlDeviceGetMaxMigDeviceCount(h))
        print("VIRT", pynvml.nvmlDeviceGetVirtualizationMode(h))
        import ctypes   # pynvml passes the index as given: a ctypes value (0: NVML_P2P_CAPS_INDEX_READ)
        print("P2P", pynvml.nvmlDeviceGetP2PStatus(h, h, ctypes.c_uint(0)))
        """)])
    out = done.stdout
    assert "SIZE 2048" in out, out + done.stderr
    assert "LOOKUP 0 True" in out
    assert "MISSING 2" in out  # NVML_ERROR_INVALID_ARGUMENT for an index past the slices
    assert "PROCS 0 0" in out
    assert "OTHER 0" in out and "NULL 2" in out
    assert "PER-DEVICE 3 7" in out  # NVML_ERROR_NOT_SUPPORTED, output untouched: nvidia-smi -q shows N/A
    assert "MIG 0 0" in out and "VIRT 0" in out
    assert "P2P 5" in out, done.stderr   # NVML_P2P_STATUS_NOT_SUPPORTED, as cuDeviceCanAccessPeer answers 0
    assert "EVENT TYPES 0" in out and "WAIT timeout" in out  # a slice's event set never fires


def test_field_values_answer_every_entry(native_libs: build.Libraries, emulated: Server) -> None:
    """nvidia-smi -q reads power readings through nvmlDeviceGetFieldValues and trusts each
    entry's own result: every entry must be answered, never left as the caller's memory."""
    token = emulated.token(memory_limit=256 << 20, job_key="nvml-fields")
    done = run_client(native_libs, emulated.slices(token), [PY, "-c", textwrap.dedent("""
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        fields = [pynvml.NVML_FI_DEV_POWER_CURRENT_LIMIT, pynvml.NVML_FI_DEV_POWER_DEFAULT_LIMIT,
                  pynvml.NVML_FI_DEV_POWER_MIN_LIMIT, pynvml.NVML_FI_DEV_POWER_MAX_LIMIT,
                  pynvml.NVML_FI_DEV_POWER_INSTANT, (pynvml.NVML_FI_DEV_POWER_CURRENT_LIMIT, 1), 99999]
        values = (pynvml.c_nvmlFieldValue_t * len(fields))()
        for v, f in zip(values, fields):
            v.fieldId, v.scopeId = f if isinstance(f, tuple) else (f, 0)
            v.nvmlReturn, v.value.uiVal = 12345, 4242   # stale memory must not survive
        fn = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetFieldValues")
        print("RET", fn(h, len(fields), values))
        for v in values:
            print("FIELD", v.fieldId, v.scopeId, v.nvmlReturn, v.valueType, v.value.uiVal, v.timestamp > 0)
        """)])
    out = done.stdout
    assert "RET 0" in out, out + done.stderr
    fields = [line.split()[1:] for line in out.splitlines() if line.startswith("FIELD")]
    assert fields == [["190", "0", "0", "1", "700000", "True"], ["189", "0", "0", "1", "700000", "True"],
                      ["187", "0", "0", "1", "200000", "True"], ["188", "0", "0", "1", "700000", "True"],
                      ["186", "0", "3", "1", "0", "True"], ["190", "1", "3", "1", "0", "True"],
                      ["99999", "0", "3", "1", "0", "True"]]
