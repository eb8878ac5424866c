"""Generate the Python modules for proto/ into dockd/_proto (the one codegen step).

Run `make proto` (or `python proto/gen.py`) after editing a .proto file; the
generated files are committed and tests/unit/test_proto_fresh.py fails when
they are stale.
"""

from __future__ import annotations

import pathlib
import re
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "dockd" / "_proto"
SOURCES = ["dockd/v1/dockd.proto"]


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Run protoc into out_dir and rewrite imports to live under dockd._proto."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={tmp}", f"--grpc_python_out={tmp}", *SOURCES]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        written = []
        for src in sorted(pathlib.Path(tmp).rglob("*.py")):
            text = src.read_text()
            text = re.sub(r"^from dockd\.v1 import", "from dockd._proto import", text, flags=re.M)
            # Drop the version stamp so the output does not depend on the grpcio-tools release.
            text = re.sub(r"^# Protobuf Python Version: .*\n", "", text, flags=re.M)
            dst = out_dir / src.name
            dst.write_text(text)
            written.append(dst)
    return written


if __name__ == "__main__":
    out = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else OUT_DIR
    for path in generate(out):
        print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
