"""Fixtures for the data-path tests: the client libraries built from source, real session servers
on free loopback ports (emulated GPUs in CI, the real GPU with `-m gpu`), signed lease tokens, and a
helper that runs a program through the client library as flexrun would."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from rgpu.live_leases import LiveLeases
from rgpu.remoting.native import build, client_stats
from rgpu.remoting.dispatcher.admission import SessionCaps
from rgpu.remoting.dispatcher.sessions import SessionServer

from rgpu import tokens
from rgpu.model import GpuInfo


REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).parent
EXAMPLES = REPO / "examples" / "cuda"
def _cuda_include() -> Path:
    """NVIDIA's headers: $CUDA_HOME, /usr/local/cuda, or beside nvcc."""
    candidates = [Path(os.environ["CUDA_HOME"]) / "include"] if os.environ.get("CUDA_HOME") else []
    candidates.append(Path("/usr/local/cuda/include"))
    nvcc = shutil.which("nvcc")
    if nvcc:
        root = Path(nvcc).resolve().parent.parent
        candidates += [root / "include", root / "targets" / "x86_64-linux" / "include"]
    return next((c for c in candidates if (c / "cuda.h").exists()), candidates[0])


CUDA_INCLUDE = _cuda_include()
SECRET = b"test-secret-0123456789abcdef-0123456789"

EMULATED_GPU = GpuInfo(uuid="GPU-12345678-1234-1234-1234-123456789abc", index=0, name="NVIDIA H200",
                       total_memory_bytes=140 << 30, usable_memory_bytes=140 << 30, compute_capability="9.0")
EMULATED_GPU_2 = GpuInfo(uuid="GPU-22345678-1234-1234-1234-123456789abc", index=1, name="NVIDIA H200",
                         total_memory_bytes=140 << 30, usable_memory_bytes=140 << 30, compute_capability="9.0")


def have_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=30, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if have_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU and driver")
    here = Path(__file__).parent
    for item in items:
        if "gpu" in item.keywords and here in Path(str(item.fspath)).parents:
            item.add_marker(skip)


def run_nvcc(args: list[str], prebuilt_env: str) -> None:
    """nvcc with these arguments on a GPU machine's test (skipped without nvcc: point `prebuilt_env` at
    what was built elsewhere)."""
    nvcc = shutil.which("nvcc")
    if not nvcc:
        pytest.skip(f"no nvcc on this GPU machine and no {prebuilt_env}")
    done = subprocess.run([nvcc, *args], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="session")
def native_libs(tmp_path_factory: pytest.TempPathFactory) -> build.Libraries:
    """libcuda.so.1 and libnvidia-ml.so.1 built from this checkout's sources."""
    return build.build(tmp_path_factory.mktemp("native") / "lib")


@pytest.fixture(scope="session")
def worker_library(native_libs: build.Libraries) -> str:
    """librgpu-worker.so of this checkout: the worker's C loop and data lanes, for tests that drive them alone."""
    return str(native_libs.libworker)


@dataclass
class Server:
    server: SessionServer
    address: str
    gpus: list[GpuInfo]
    secret: bytes = SECRET
    _counter: list[int] = field(default_factory=lambda: [0])

    def token(self, memory_limit: int = 1 << 30, compute_percent: int = 50, gpu: GpuInfo | None = None,
              job_key: str | None = None, server: str | None = None, expires: float = 0.0,
              secret: bytes | None = None) -> str:
        self._counter[0] += 1
        gpu = gpu or self.gpus[0]
        claims = tokens.SliceClaims(job_key=job_key or f"job-{self._counter[0]}", slice_number=0,
                                    server=server or self.address, gpu_uuid=gpu.uuid, gpu_index=gpu.index,
                                    memory_limit_bytes=memory_limit, compute_percent=compute_percent,
                                    expires_unix=expires, issued_unix=time.time())
        return tokens.sign(secret or self.secret, claims)

    def slices(self, *toks: str) -> str:
        return ";".join(f"{self.address},{t}" for t in toks)

    def wait_sessions(self, n: int, timeout: float = 10.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            sessions = self.server.status()["sessions"]
            if len(sessions) >= n:
                return sessions
            time.sleep(0.05)
        raise AssertionError(f"expected {n} sessions, have {self.server.status()['sessions']}")


def start_server(backend: str, gpus: list[GpuInfo], caps: SessionCaps | None = None,
                 **options: Any) -> tuple[SessionServer, str]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    address = f"127.0.0.1:{sock.getsockname()[1]}"
    server = SessionServer(listen_socket=sock, advertised=address, gpus=gpus, secret=SECRET,
                           port_range=(45201, 46225), backend=backend, log=logging.getLogger("rgpu.test.sessions"),
                           caps=caps, **options)
    server.start()
    server.update_live(LiveLeases.of(0.0, []))   # no pool here: a view in which no token is revoked
    return server, address


@contextmanager
def serving(backend: str, gpus: list[GpuInfo], caps: SessionCaps | None = None) -> Iterator[Server]:
    """A session server of these GPUs for the length of the block."""
    server, address = start_server(backend, gpus, caps)
    try:
        yield Server(server, address, gpus)
    finally:
        server.stop()


@pytest.fixture
def emulated() -> Iterator[Server]:
    with serving("emulated", [EMULATED_GPU, EMULATED_GPU_2]) as server:
        yield server


def client_env(libs: build.Libraries, slices: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RGPU_")}
    env["LD_LIBRARY_PATH"] = str(libs.folder) + (os.pathsep + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    env["RGPU_SLICES"] = slices
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run_client(libs: build.Libraries, slices: str, argv: list[str], timeout: float = 120, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=client_env(libs, slices, **extra), capture_output=True, text=True, timeout=timeout, check=False)


def driver_api_program(libs: build.Libraries, source: Path, out: Path) -> Path:
    """A C driver-API program compiled against NVIDIA's cuda.h and linked to rgpu's libcuda."""
    if not (CUDA_INCLUDE / "cuda.h").exists():
        pytest.skip(f"no cuda.h under {CUDA_INCLUDE} (install the CUDA toolkit headers)")
    cc = shutil.which("gcc") or shutil.which("cc")
    done = subprocess.run([cc, "-O1", "-Wall", f"-I{CUDA_INCLUDE}", str(source), "-o", str(out),
                           f"-L{libs.folder}", "-lcuda"], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="session")
def demo_binary(native_libs: build.Libraries, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """examples/cuda/driver_api_demo.c, built against NVIDIA's cuda.h and rgpu's libcuda."""
    return driver_api_program(native_libs, EXAMPLES / "driver_api_demo.c",
                              tmp_path_factory.mktemp("demo") / "driver_api_demo")


PY = sys.executable


def local_gpu() -> GpuInfo:
    import pynvml
    pynvml.nvmlInit()
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(h)
        name = name.decode() if isinstance(name, bytes) else name
        uuid = pynvml.nvmlDeviceGetUUID(h)
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        total = pynvml.nvmlDeviceGetMemoryInfo(h).total
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
    finally:
        pynvml.nvmlShutdown()
    return GpuInfo(uuid=uuid, index=0, name=name, total_memory_bytes=total, usable_memory_bytes=total,
                   compute_capability=f"{major}.{minor}")


@pytest.fixture(scope="module")
def gpu_server() -> Iterator[Server]:
    """A CUDA session server of this host's GPU 0 (the gpu tier's tests)."""
    gpu = local_gpu()
    server, address = start_server("cuda", [gpu])
    try:
        yield Server(server, address, [gpu])
    finally:
        server.stop()


def calls_between(folder: Path, first: str, last: str) -> dict[str, client_stats.OpProfile]:
    """The client's calls between two of its snapshots (ctcuda.snapshot) in `folder`, by name."""
    (a,) = folder.glob(f"*.{first}")
    (b,) = folder.glob(f"*.{last}")
    between = client_stats.subtract(client_stats.parse(b.read_text())[0], client_stats.parse(a.read_text())[0])
    return {p.name: p for p in between.values()}


def chain_to(native_libs: build.Libraries, emulated: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment in which a CUDA-backend session server started next drives `emulated`
    through rgpu's own client library."""
    inner = emulated.slices(emulated.token(memory_limit=4 << 30, job_key="inner"))
    monkeypatch.setenv("LD_LIBRARY_PATH", str(native_libs.folder))
    monkeypatch.setenv("RGPU_SLICES", inner)
    monkeypatch.setenv("RGPU_WORKER_ALLOW_RGPU_LIBCUDA", "1")
    monkeypatch.setenv("RGPU_LOG", "error")
    # The GPU behind the chain is emulated: its contexts take no memory, so no reservation.
    monkeypatch.setenv("RGPU_SESSION_CONTEXT_RESERVE", "0")


@pytest.fixture
def chained(native_libs: build.Libraries, emulated: Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    chain_to(native_libs, emulated, monkeypatch)
    server, address = start_server("cuda", [EMULATED_GPU])
    try:
        yield Server(server, address, [EMULATED_GPU])
    finally:
        server.stop()


@pytest.fixture(scope="module")
def lane_copies(native_libs: build.Libraries, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return driver_api_program(native_libs, HERE / "lane_copies.c", tmp_path_factory.mktemp("lanes") / "lane_copies")


@pytest.fixture(scope="module")
def lane_cut(native_libs: build.Libraries, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return preload_shim(HERE / "lane_cut.c", tmp_path_factory.mktemp("cut") / "lane_cut.so")


def preload_shim(source: Path, out: Path) -> Path:
    """A test's LD_PRELOAD shim (a C file wrapping libc calls through dlsym), built to `out`."""
    done = subprocess.run([build.compiler(), "-O1", "-shared", "-fPIC", str(source), "-o", str(out), "-ldl"],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def copies(native_libs: build.Libraries, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return driver_api_program(native_libs, HERE / "ucx_copies.c", tmp_path_factory.mktemp("ucx") / "ucx_copies")


@pytest.fixture(scope="module")
def loop_binary(native_libs: build.Libraries, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/remoting/clientside_loop.c, built against NVIDIA's cuda.h and rgpu's libcuda."""
    return driver_api_program(native_libs, HERE / "clientside_loop.c",
                              tmp_path_factory.mktemp("clientside") / "clientside_loop")


@pytest.fixture(scope="module")
def attr_loop(native_libs: build.Libraries, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return driver_api_program(native_libs, HERE / "attr_loop.c", tmp_path_factory.mktemp("attrs") / "attr_loop")


@pytest.fixture(scope="module")
def tensor_map(native_libs: build.Libraries, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return driver_api_program(native_libs, HERE / "tensor_map.c", tmp_path_factory.mktemp("tmap") / "tensor_map")


def _cudart_dir() -> Path | None:
    nvcc = shutil.which("nvcc")
    candidates = [Path("/usr/local/cuda/lib64")]
    if nvcc:
        root = Path(nvcc).resolve().parent.parent
        candidates += [root / "lib64", root / "targets" / "x86_64-linux" / "lib"]
    return next((c for c in candidates if (c / "libcudart.so.13").exists() or any(c.glob("libcudart.so.*"))), None)


def build_runtime_program(tmp_path_factory: pytest.TempPathFactory, source: str, cudart: str) -> Path:
    """examples/cuda/<source> built with nvcc for sm_90, linking cudart `static` or `shared`."""
    nvcc = shutil.which("nvcc")
    if not nvcc:
        pytest.skip("nvcc not found (install the CUDA toolkit to build CUDA-runtime test programs)")
    out = tmp_path_factory.mktemp("runtime") / f"{Path(source).stem}_{cudart}"
    argv = [nvcc, "-O2", "-gencode", "arch=compute_90,code=[sm_90,compute_90]", "-cudart", cudart,
            str(EXAMPLES / source), "-o", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module", params=["static", "shared"])
def runtime_demo(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    return request.param, build_runtime_program(tmp_path_factory, "runtime_demo.cu", request.param)


@pytest.fixture(scope="module")
def nccl_ranks(native_libs: build.Libraries, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/remoting/nccl_ranks.c, built with cc against cuda.h and rgpu's own rgpu_nccl.h."""
    if not (CUDA_INCLUDE / "cuda.h").exists():
        pytest.skip(f"no cuda.h under {CUDA_INCLUDE} (install the CUDA toolkit headers)")
    out = tmp_path_factory.mktemp("nccl") / "nccl_ranks"
    cc = shutil.which("gcc") or shutil.which("cc")
    done = subprocess.run([cc, "-O1", "-Wall", f"-I{CUDA_INCLUDE}", f"-I{build.SRC}", str(HERE / "nccl_ranks.c"),
                           "-o", str(out), f"-L{native_libs.folder}", "-lcuda", "-lnccl"],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return out
