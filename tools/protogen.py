"""Generates tollgate/v1/*_pb2.py, *_pb2_grpc.py and *_pb2.pyi from protos/."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "tollgate" / "v1").glob("*.proto"))


def generate(out_dir: Path) -> None:
    """Writes the generated modules for every proto under `out_dir`/tollgate/v1."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    (out_dir / "tollgate" / "v1").mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--pyi_out={out_dir}",
        *(str(p.relative_to(PROTO_ROOT)) for p in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def main() -> int:
    generate(ROOT)
    print(f"generated {len(proto_files())} protos into tollgate/v1/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
