"""Regenerate (or check) the checked-in protobuf/gRPC code from ``proto/``.

``python -m mselastic.v1.generate`` writes the files; ``--check`` exits 1 when
the checked-in files differ from what the pinned grpcio-tools produces.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

from grpc_tools import protoc
import grpc_tools

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto"
SOURCES = ["mselastic/v1/elastic.proto"]
OUTPUTS = ["elastic_pb2.py", "elastic_pb2_grpc.py", "elastic_pb2.pyi"]


def generate(out_dir: pathlib.Path) -> None:
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(PROTO_DIR / s) for s in SOURCES),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the message above")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        generate(pathlib.Path(tmp))
        stale = []
        for name in OUTPUTS:
            fresh = (pathlib.Path(tmp) / "mselastic" / "v1" / name).read_bytes()
            target = ROOT / "mselastic" / "v1" / name
            if args.check:
                if not target.exists() or target.read_bytes() != fresh:
                    stale.append(str(target.relative_to(ROOT)))
            else:
                target.write_bytes(fresh)
    if stale:
        print(f"generated code is stale: {', '.join(stale)}; run `make proto` and commit", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
