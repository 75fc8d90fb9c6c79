"""The gRPC code is generated from the .proto by grpcio-tools, regenerated when the proto changes, never committed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ember.grpc import codegen
from ember.grpc.api import SERVICE_NAME, pb

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]


def _redirect(monkeypatch: pytest.MonkeyPatch, generated: Path, proto_root: Path | None = None) -> None:
    monkeypatch.setattr(codegen, "GENERATED_DIR", generated)
    monkeypatch.setattr(codegen, "STAMP", generated / ".proto-digest")
    if proto_root is not None:
        monkeypatch.setattr(codegen, "PROTO_ROOT", proto_root)


def test_generate_writes_messages_stubs_and_type_stubs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _redirect(monkeypatch, tmp_path / "_generated")
    assert not codegen.is_current()
    written = {p.relative_to(tmp_path / "_generated").as_posix() for p in codegen.generate()}
    assert written == {"ember/v1/generation_pb2.py", "ember/v1/generation_pb2.pyi", "ember/v1/generation_pb2_grpc.py"}
    stubs = (tmp_path / "_generated/ember/v1/generation_pb2_grpc.py").read_text()
    assert "DO NOT EDIT" in stubs and "from ember.grpc._generated.ember.v1 import generation_pb2" in stubs
    assert codegen.is_current()


def test_a_changed_proto_makes_the_code_stale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    protos = tmp_path / "proto"
    shutil.copytree(codegen.PROTO_ROOT, protos)
    _redirect(monkeypatch, tmp_path / "_generated", protos)
    codegen.generate()
    assert codegen.is_current()
    proto = protos / codegen.PROTO_FILES[0]
    proto.write_text(proto.read_text() + "\n// a comment changes the digest\n")
    assert not codegen.is_current()


def test_generated_code_is_ignored_and_nowhere_else_in_the_package() -> None:
    assert "src/ember/grpc/_generated/" in (REPO / ".gitignore").read_text().splitlines()
    package = REPO / "src/ember"
    strays = [p for p in package.rglob("*_pb2*.py") if "_generated" not in p.relative_to(package).parts]
    assert strays == []


def test_the_api_is_versioned() -> None:
    assert SERVICE_NAME == "ember.v1.Generation"
    methods = {m.name: (m.client_streaming, m.server_streaming) for m in pb.DESCRIPTOR.services_by_name["Generation"].methods}
    assert methods == {"Chat": (False, True), "Complete": (False, False)}
