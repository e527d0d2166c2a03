"""The graph calls JAX/XLA make (issue 24, item 7) on a real GPU: the programs of
graph_programs.py through flexrun, rgpu's libcuda and a worker on NVIDIA's driver, checked against
what CUDA documents (the same expectations as test_graph_api_emulated.py), plus a kernel node built
with cuGraphAddNode_v2 inside a child graph, which only a GPU runs.

Run on a GPU machine:  python -m pytest -m gpu tests/remoting/test_gpu_graph_api.py -v -s
"""

from __future__ import annotations

from pathlib import Path

import pytest
from rgpu.remoting.native import build

from tests.remoting import graph_programs as programs
from tests.remoting.conftest import EXAMPLES, Server
from tests.remoting.gpu_helpers import flexrun, py

pytestmark = pytest.mark.gpu


def run(libs: build.Libraries, server: Server, tmp: Path, program: str, name: str):  # type: ignore[no-untyped-def]
    return flexrun(libs, server, tmp, py("from ctcuda import *\n" + program), name=name)


def test_root_nodes_child_graphs_and_their_executable_updates_on_a_gpu(native_libs: build.Libraries,
                                                                        gpu_server: Server,  # noqa: F811
                                                                        tmp_path: Path) -> None:
    done = run(native_libs, gpu_server, tmp_path, programs.ROOTS_AND_CHILDREN, "graph-roots-children")
    programs.expect_roots_and_children(done.stdout + done.stderr)


def test_generic_node_api_on_a_gpu(native_libs: build.Libraries, gpu_server: Server,  # noqa: F811
                                   tmp_path: Path) -> None:
    done = run(native_libs, gpu_server, tmp_path, programs.GENERIC_NODES, "graph-generic")
    programs.expect_generic_nodes(done.stdout, done.stderr)
    programs.expect_generic_refusals_said_why(done.stderr)


def test_capture_into_an_existing_graph_on_a_gpu(native_libs: build.Libraries, gpu_server: Server,  # noqa: F811
                                                 tmp_path: Path) -> None:
    done = run(native_libs, gpu_server, tmp_path, programs.CAPTURE_TO_GRAPH, "graph-capture-to-graph")
    programs.expect_capture_to_graph(done.stdout + done.stderr)
    programs.expect_capture_refusal_said_why(done.stdout, done.stderr)


KERNEL_IN_CHILD = programs.PRELUDE + f"""
mod, fn = V(), V()
check("cuModuleLoad", byref(mod), {str(EXAMPLES / "vecadd.ptx")!r}.encode())
check("cuModuleGetFunction", byref(fn), mod, b"vecadd")
n = 256
r2, b = alloc(4 * n)
r3, c = alloc(4 * n)
src = (ctypes.c_float * n)(*[float(i) for i in range(n)])
check("cuMemcpyHtoD_v2", c_uint64(a), src, 4 * n)
check("cuMemcpyHtoD_v2", c_uint64(b), src, 4 * n)
args = [c_uint64(a), c_uint64(b), c_uint64(c), ctypes.c_int(n)]
argv = (V * 4)(*[ctypes.cast(byref(x), V) for x in args])
p = ctypes.create_string_buffer(256)
struct.pack_into("<i", p, 0, 0)   # CU_GRAPH_NODE_TYPE_KERNEL; CUDA_KERNEL_NODE_PARAMS_v3 at 16
struct.pack_into("<Q7I4xQQQQ", p, 16, fn.value, 1, 1, 1, n, 1, 1, 0, ctypes.addressof(argv), 0, 0, 0)
child = new_graph()
k = V()
check("cuGraphAddNode_v2", byref(k), child, None, None, c_size_t(0), p)
parent = new_graph()
node = V()
check("cuGraphAddChildGraphNode", byref(node), parent, None, c_size_t(0), child)
launch(parent)
out = (ctypes.c_float * n)()
check("cuMemcpyDtoH_v2", out, c_uint64(c), 4 * n)
print("SUM", out[0], out[1], out[255])
"""


def test_a_kernel_node_built_with_cuGraphAddNode_v2_runs_inside_a_child_graph(native_libs: build.Libraries,
                                                                                gpu_server: Server,  # noqa: F811
                                                                                tmp_path: Path) -> None:
    done = run(native_libs, gpu_server, tmp_path, KERNEL_IN_CHILD, "graph-kernel-in-child")
    assert "SUM 0.0 2.0 510.0" in done.stdout, done.stdout + done.stderr
