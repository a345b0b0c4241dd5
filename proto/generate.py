"""Regenerate the Python stubs from proto/tierstore.proto (`make proto`).

The stubs import each other as `tierstore.proto.*`, so protoc must see the
file at tierstore/proto/tierstore.proto: we stage it in a temp tree.
Output is deterministic; tests/test_proto.py fails when the stubs are stale.
"""
from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

__all__ = ["generate", "OUTPUTS"]

HERE = Path(__file__).resolve().parent
OUTPUTS = ("tierstore_pb2.py", "tierstore_pb2_grpc.py", "tierstore_pb2.pyi")


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / "tierstore" / "proto"
        staged.mkdir(parents=True)
        shutil.copy(HERE / "tierstore.proto", staged / "tierstore.proto")
        gen = Path(tmp) / "gen"
        gen.mkdir()
        rc = protoc.main([
            "protoc", f"-I{tmp}", f"--python_out={gen}", f"--pyi_out={gen}", f"--grpc_python_out={gen}",
            "tierstore/proto/tierstore.proto",
        ])
        if rc != 0:
            raise SystemExit(f"protoc failed with exit code {rc}")
        out = []
        for name in OUTPUTS:
            dst = out_dir / name
            shutil.copy(gen / "tierstore" / "proto" / name, dst)
            out.append(dst)
        return out


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE
    for p in generate(target):
        print(f"wrote {p}")
