"""Regenerate rgpu_pb2.py, its type stub rgpu_pb2.pyi (for mypy) and rgpu_pb2_grpc.py from rgpu.proto.

Usage: python -m rgpu.proto.generate [OUTPUT_ROOT]
The generated files are committed; tests/test_proto_generated.py fails when they are stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
SOURCE_ROOT = PROTO_DIR.parent.parent  # the folder holding rgpu/


def generate(output_root: Path) -> None:
    from grpc_tools import protoc  # build-time dependency only

    output_root.mkdir(parents=True, exist_ok=True)
    (output_root / "rgpu" / "proto").mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{SOURCE_ROOT}",
        f"--python_out={output_root}",
        f"--pyi_out={output_root}",
        f"--grpc_python_out={output_root}",
        str(Path("rgpu") / "proto" / "rgpu.proto"),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("rgpu: proto: protoc failed (see its message above)")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else SOURCE_ROOT)
