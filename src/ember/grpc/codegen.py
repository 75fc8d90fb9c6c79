"""Generate the Python code of Ember's .proto files with grpcio-tools (``python -m ember.grpc.codegen``).

The generated modules are build output, never committed nor edited: ``make
setup`` runs this module, and ``ember.grpc.api`` runs it on first import when
the output is missing or older than the .proto files (so a plain
``pip install -e '.[grpc]'`` works too).

Where the code goes, and why the odd proto path: the protos live under
``proto/`` with their canonical names (``ember/v1/generation.proto``, what any
other language compiles). A generated ``_pb2_grpc`` module imports its
``_pb2`` by the proto's path, and ``ember.v1`` would collide with this very
package, so protoc is told to see ``proto/`` as ``ember/grpc/_generated/``
(``-Iember/grpc/_generated=proto``). The modules then land in
``src/ember/grpc/_generated/ember/v1/`` and import each other as
``ember.grpc._generated.ember.v1``. The only visible trace is the descriptor's
file name in server reflection; service and message names are ``ember.v1.*``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
PROTO_ROOT = PACKAGE_DIR / "proto"
PROTO_FILES = ("ember/v1/generation.proto",)
# Where protoc "sees" PROTO_ROOT, relative to the directory that holds the `ember` package.
VIRTUAL_ROOT = "ember/grpc/_generated"
GENERATED_DIR = PACKAGE_DIR / "_generated"
# Holds the digest of the protos the generated code was made from.
STAMP = GENERATED_DIR / ".proto-digest"


def proto_digest() -> str:
    """SHA-256 over the .proto files (names and contents): changes whenever they do."""
    digest = hashlib.sha256()
    for name in PROTO_FILES:
        digest.update(name.encode() + b"\0" + (PROTO_ROOT / name).read_bytes())
    return digest.hexdigest()


def is_current() -> bool:
    """True when the generated code exists and was made from the current protos."""
    return STAMP.is_file() and STAMP.read_text().strip() == proto_digest()


def generate() -> list[Path]:
    """Run protoc (``grpc_tools.protoc``) and install its output atomically; returns the files written.

    Output is generated into a temporary directory and moved into place file by
    file with ``os.replace``, so a process importing concurrently never reads
    a half-written module.
    """
    try:
        from grpc_tools import protoc
    except ImportError as exc:
        raise ImportError("generating Ember's gRPC code needs grpcio-tools: pip install 'ember[grpc]'") from exc
    well_known = resources.files("grpc_tools") / "_proto"  # google/protobuf/*.proto
    with tempfile.TemporaryDirectory(prefix="ember-protoc-") as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{well_known}",
            f"-I{VIRTUAL_ROOT}={PROTO_ROOT}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(str(PROTO_ROOT / name) for name in PROTO_FILES),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {', '.join(PROTO_FILES)} (see the messages above)")
        written: list[Path] = []
        produced = Path(tmp) / VIRTUAL_ROOT
        for source in sorted(produced.rglob("*")):
            if source.is_file():
                target = GENERATED_DIR / source.relative_to(produced)
                target.parent.mkdir(parents=True, exist_ok=True)
                staged = target.with_name(f".{target.name}.{os.getpid()}.tmp")
                shutil.copyfile(source, staged)
                os.replace(staged, target)
                written.append(target)
    staged_stamp = STAMP.with_name(f"{STAMP.name}.{os.getpid()}.tmp")
    staged_stamp.write_text(proto_digest() + "\n")
    os.replace(staged_stamp, STAMP)
    return written


def ensure_generated() -> None:
    """Generate the code unless it is current (cheap when it is: one hash of a small file)."""
    if not is_current():
        generate()


def main() -> int:
    for path in generate():
        print(path.relative_to(PACKAGE_DIR.parent.parent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
