"""A module that uses CUDA dynamic parallelism on a GPU shared through MPS: the real driver answers
CUDA_ERROR_CDP_NOT_SUPPORTED (seen on an H200 with CuPy's test_dynamical_parallelism); the worker
passes that code on with a line that says why and what to ask for. The driver stands in as a stub
object: this checks the worker's handler alone (the GPU run is in the closing note)."""

from __future__ import annotations

import struct
from dataclasses import replace

import pytest

from rgpu.remoting.datapath.backends.base import CDP_NOT_SUPPORTED, CudaError, LoadResult
from rgpu.remoting.datapath.worker.handlers import Handlers
from rgpu.remoting.datapath.worker.image_cache import IMAGE_BYTES
from rgpu.remoting.datapath.worker.module_footprint import ImageFootprints
from rgpu.remoting.datapath.worker.spec import SessionSpec

PTX = b".version 8.8\n.target sm_90\n.address_size 64\n.visible .entry k() { ret; }\n\0"
SPEC = SessionSpec(mode="cuda", backend="cuda", gpu_uuid="GPU-1", gpu_index=0, gpu_name="NVIDIA H200",
                   gpu_total_memory=1 << 30, compute_capability="9.0", memory_limit=1 << 30, compute_percent=50,
                   job_key="j", slice_number=0, usage_dir="", server="gpu1:7100", compute_enforcement="mps",
                   client={})


class DriverRefusingCdp:
    """Stands in for the real driver's module load, which refuses dynamic parallelism under MPS."""

    def load(self, kind: str, image: bytes, options: object, lib_options: object, want_table: bool = True) -> LoadResult:
        return LoadResult(code=CDP_NOT_SUPPORTED)


def load_frame(image: bytes) -> memoryview:
    no_options = struct.pack("<I", 0)
    return memoryview(no_options + no_options + struct.pack("<Q", len(image)) + bytes([IMAGE_BYTES])
                      + b"\0" * 32 + image)


def handlers(spec: SessionSpec) -> Handlers:
    h = object.__new__(Handlers)
    h.backend, h.spec, h.memory = DriverRefusingCdp(), spec, None
    h.footprints = ImageFootprints((9, 0))
    return h


@pytest.mark.parametrize("kind", ["module", "library"])
def test_dynamic_parallelism_under_mps_names_the_cause_and_the_way_out(kind: str) -> None:
    with pytest.raises(CudaError) as refused:
        handlers(SPEC).h_load(kind)(load_frame(PTX), 0, 1)
    assert refused.value.code == CDP_NOT_SUPPORTED
    message = refused.value.message
    assert "\n" not in message and "dynamic parallelism" in message and "MPS" in message
    assert "isolation=strict" in message and "GPU 0 (NVIDIA H200) of gpu1:7100" in message


def test_on_an_isolated_gpu_the_refusal_does_not_blame_mps() -> None:
    with pytest.raises(CudaError) as refused:
        handlers(replace(SPEC, sharing="isolated")).h_load("module")(load_frame(PTX), 0, 1)
    assert refused.value.code == CDP_NOT_SUPPORTED and "MPS" not in refused.value.message
