"""Generate the Python gRPC code for proto/ into sidecar/gen, or check that it is current.

    python scripts/gen_proto.py          # regenerate
    python scripts/gen_proto.py --check  # exit 1 if sidecar/gen differs from what protoc writes

The include path maps proto/voxrecall/v1 onto sidecar/gen, so the generated stubs import each
other as ``sidecar.gen.retrieval_pb2`` and work from the installed package.
"""

from __future__ import annotations

import filecmp
import os
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "proto" / "voxrecall" / "v1"
GEN = ROOT / "sidecar" / "gen"
OUTPUTS = ("retrieval_pb2.py", "retrieval_pb2.pyi", "retrieval_pb2_grpc.py")


def generate(out_root: Path) -> None:
    os.chdir(ROOT)
    args = [
        "grpc_tools.protoc",
        f"-Isidecar/gen={PROTO_DIR.relative_to(ROOT)}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        "sidecar/gen/retrieval.proto",
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def main() -> int:
    check = "--check" in sys.argv[1:]
    if not check:
        generate(ROOT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = [
            name
            for name in OUTPUTS
            if not (GEN / name).exists()
            or not filecmp.cmp(Path(tmp) / "sidecar" / "gen" / name, GEN / name, shallow=False)
        ]
    if stale:
        print(f"sidecar/gen is stale ({', '.join(stale)}): run python scripts/gen_proto.py")
        return 1
    print("sidecar/gen is current")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
