"""Regenerate the Python stubs for proto/kvmesh.proto.

    python -m kvmesh.proto.generate            # rewrite proto/kvmesh_pb2*.py(i) in place
    python -m kvmesh.proto.generate --out DIR  # write them elsewhere (the test compares)

protoc writes `import kvmesh_pb2 as kvmesh__pb2` into the gRPC stub, which only works with
proto/ itself on sys.path. The stubs are imported as `kvmesh.proto.kvmesh_pb2`, so the one
import line is rewritten to the package form. Needs grpcio-tools (a test/dev dependency).
"""

from __future__ import annotations

import argparse
import importlib.resources
import logging
import sys
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

PROTO_DIR = Path(__file__).resolve().parent
PROTO_FILE = "kvmesh.proto"
GENERATED_FILES = ("kvmesh_pb2.py", "kvmesh_pb2.pyi", "kvmesh_pb2_grpc.py")
_BARE_IMPORT = "import kvmesh_pb2 as kvmesh__pb2"
_PACKAGE_IMPORT = "from kvmesh.proto import kvmesh_pb2 as kvmesh__pb2"


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on kvmesh.proto into `out_dir`; return the written files."""
    from grpc_tools import protoc  # dev-only dependency, imported lazily

    well_known = importlib.resources.files("grpc_tools") / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    # protoc writes into a scratch folder first so a failed run leaves `out_dir` untouched.
    with tempfile.TemporaryDirectory() as scratch:
        args = ["grpc_tools.protoc", f"-I{PROTO_DIR}", f"-I{well_known}",
                f"--python_out={scratch}", f"--pyi_out={scratch}", f"--grpc_python_out={scratch}",
                PROTO_FILE]
        rc = protoc.main(args)
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}")
        written = []
        for name in GENERATED_FILES:
            text = (Path(scratch) / name).read_text()
            if name == "kvmesh_pb2_grpc.py":
                text = _fix_stub_import(text)
            target = out_dir / name
            target.write_text(text)
            written.append(target)
    return written


def _fix_stub_import(text: str) -> str:
    count = text.count(_BARE_IMPORT)
    if count != 1:
        raise RuntimeError(f"expected one {_BARE_IMPORT!r} line in the gRPC stub, found {count}")
    return text.replace(_BARE_IMPORT, _PACKAGE_IMPORT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_DIR, help="output folder (default: proto/)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
