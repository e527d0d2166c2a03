"""The committed gRPC code must match rgpu.proto (regenerate: python -m rgpu.proto.generate)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rgpu.proto import generate

pytest.importorskip("grpc_tools")


def test_generated_code_is_current(tmp_path: Path) -> None:
    generate.generate(tmp_path)
    for name in ("rgpu_pb2.py", "rgpu_pb2.pyi", "rgpu_pb2_grpc.py"):
        fresh = (tmp_path / "rgpu" / "proto" / name).read_text()
        committed = (generate.PROTO_DIR / name).read_text()
        assert fresh == committed, (f"rgpu/proto/{name} is stale: run `python -m rgpu.proto.generate` "
                                    "and commit the result")
