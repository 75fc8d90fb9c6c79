"""A throwaway self-signed TLS certificate for local servers, made with the ``openssl`` CLI."""

from __future__ import annotations

import subprocess
from pathlib import Path

from ember.bench.sender import BenchError


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """A one-day certificate for ``localhost`` and ``127.0.0.1`` (P-256 key) in ``directory``.

    Returns (certificate, key). Clients trust the certificate itself as their CA
    (``verify=cert`` for httpx and the SDK, root certificates for gRPC).
    """
    cert, key = directory / "cert.pem", directory / "key.pem"
    command = [
        "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
        "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
    ]  # fmt: skip
    try:
        subprocess.run(command, check=True, capture_output=True)
    except FileNotFoundError:
        raise BenchError("TLS needs the openssl command to make a self-signed certificate") from None
    except subprocess.CalledProcessError as exc:
        raise BenchError(f"openssl failed: {exc.stderr.decode(errors='replace')[-500:]}") from None
    return cert, key
