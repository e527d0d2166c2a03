"""The graph calls JAX/XLA make (issue 24, item 7) through rgpu's libcuda.so.1: root nodes, child
graph nodes and their executable-graph updates, the generic cuGraphAddNode(_v2), and capture into
an existing graph; against the emulated worker and the real-GPU backend's code chained to it
(the `chained` fixture in conftest.py). The programs and what CUDA documents for them are in
graph_programs.py; test_gpu_graph_api.py runs the same on a GPU."""

from __future__ import annotations

import pytest
from rgpu.remoting.native import build

from tests.remoting import graph_programs as programs
from tests.remoting.conftest import Server
from tests.remoting.client_helpers import py_client


@pytest.fixture(params=["emulated", "chained"])
def worker(request: pytest.FixtureRequest) -> Server:
    return request.getfixturevalue(request.param)


def test_root_nodes_child_graphs_and_their_executable_updates(native_libs: build.Libraries, worker: Server) -> None:
    done = py_client(native_libs, worker.slices(worker.token()), programs.ROOTS_AND_CHILDREN)
    programs.expect_roots_and_children(done.stdout + done.stderr)


def test_generic_node_api_builds_each_type_as_its_own_call_does(native_libs: build.Libraries, worker: Server) -> None:
    done = py_client(native_libs, worker.slices(worker.token()), programs.GENERIC_NODES)
    programs.expect_generic_nodes(done.stdout, done.stderr)
    programs.expect_generic_refusals_said_why(done.stderr)


def test_capture_into_an_existing_graph_appends_after_the_given_nodes(native_libs: build.Libraries,
                                                                       worker: Server) -> None:
    done = py_client(native_libs, worker.slices(worker.token()), programs.CAPTURE_TO_GRAPH)
    programs.expect_capture_to_graph(done.stdout + done.stderr)
    programs.expect_capture_refusal_said_why(done.stdout, done.stderr)
