"""Ember's gRPC API: ``ember.v1.Generation`` (streaming ``Chat``, unary ``Complete``).

- ``proto/ember/v1/generation.proto``: the versioned contract (the only source).
- ``codegen``: generates the Python modules with grpcio-tools (``make setup``).
- ``api``: imports the generated modules (generating them first when needed).
- ``convert``: between protobuf messages and the OpenAI JSON shapes both sides share.
- ``status``: between Ember's HTTP errors and gRPC status codes, both directions.
- ``server``, ``health``: the servicer on the server's engine, health and reflection.

Needs the ``grpc`` extra: ``pip install 'ember[grpc]'``.
"""
