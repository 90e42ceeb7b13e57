"""Generate the sits.v1 Python stubs from protos/ with grpcio-tools.

The stubs are build output (ignored by git): `make stubs` runs this, and every
other make target depends on it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def main() -> int:
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "sits" / "v1").glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    plugins = Path(sys.executable).parent
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--plugin=protoc-gen-mypy={plugins / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={plugins / 'protoc-gen-mypy_grpc'}",
        f"--python_out={ROOT}",
        f"--grpc_python_out={ROOT}",
        # Typed stubs for messages and for the generated gRPC stubs/servicers (mypy-protobuf).
        f"--mypy_out={ROOT}",
        f"--mypy_grpc_out={ROOT}",
        *protos,
    ]
    rc = int(protoc.main(args))
    if rc != 0:
        print(f"protoc failed with exit code {rc}", file=sys.stderr)
        return rc
    (ROOT / "sits" / "v1" / "__init__.py").touch()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
