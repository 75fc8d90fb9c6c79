"""The generated ``ember.v1`` messages (``pb``) and stubs (``pb_grpc``), generated first if needed."""

from __future__ import annotations

from ember.grpc.codegen import ensure_generated

ensure_generated()

from ember.grpc._generated.ember.v1 import generation_pb2 as pb  # noqa: E402
from ember.grpc._generated.ember.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

# "ember.v1.Generation": the name health checks and reflection use.
SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["Generation"].full_name

__all__ = ["SERVICE_NAME", "pb", "pb_grpc"]
