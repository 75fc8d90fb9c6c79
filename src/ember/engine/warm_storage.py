"""Warm KV state: compact packing in RAM and self-checking session files on disk.

Packing formats (``SessionConfig.warm_format``):

* ``int8``: one scale per (layer, k/v, token, head) over the head dimension;
  ~3.8x smaller than float32. Lossy: continuations may differ slightly from a
  hot or cold run (agreement measured in tests and README).
* ``bf16``: 2x smaller, near-lossless.
* ``exact``: the cache dtype as is; restored state is bit-identical.

A session file is a safetensors file (safe to load: no pickle) whose metadata
carry the model fingerprint, the session key's hash, the token ids and block
hashes, and a blake2b checksum over all of it and the tensor bytes. A file
whose fingerprint, checksum or structure does not match is rejected with
``CorruptSessionFile`` and never restored: the turn recomputes instead.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

WARM_FORMATS = ("int8", "bf16", "exact")
FILE_VERSION = "1"
SUFFIX = ".ekv"


class CorruptSessionFile(Exception):
    """A session file that must not be restored (truncated, altered, foreign model)."""


@dataclass
class PackedKV:
    """KV of ``n`` blocks, shape (layers, 2, n, block_size, kv_heads, head_dim) once unpacked."""

    format: str
    data: torch.Tensor
    scales: torch.Tensor | None
    dtype: torch.dtype  # the pool's dtype, to unpack into

    @property
    def nbytes(self) -> int:
        extra = self.scales.numel() * self.scales.element_size() if self.scales is not None else 0
        return self.data.numel() * self.data.element_size() + extra

    @property
    def num_blocks(self) -> int:
        return int(self.data.shape[2])


def pack(kv: torch.Tensor, fmt: str) -> PackedKV:
    """Compact copy of ``kv`` (layers, 2, n, block, heads, dim) on the CPU."""
    kv = kv.detach().to("cpu")
    if fmt == "exact":
        return PackedKV(fmt, kv.clone(), None, kv.dtype)
    if fmt == "bf16":
        return PackedKV(fmt, kv.to(torch.bfloat16), None, kv.dtype)
    if fmt != "int8":
        raise ValueError(f"unknown warm format {fmt!r}; expected one of {WARM_FORMATS}")
    x = kv.float()
    scales = (x.abs().amax(dim=-1, keepdim=True) / 127.0).clamp_min(1e-8)
    data = torch.round(x / scales).clamp_(-127, 127).to(torch.int8)
    return PackedKV(fmt, data, scales.to(torch.float16), kv.dtype)


def unpack(packed: PackedKV, device: torch.device) -> torch.Tensor:
    data = packed.data.to(device)
    if packed.format == "int8":
        assert packed.scales is not None
        return (data.float() * packed.scales.to(device).float()).to(packed.dtype)
    return data.to(packed.dtype)


def slice_blocks(packed: PackedKV, start: int, end: int) -> PackedKV:
    """Blocks ``[start, end)`` of a packed range (views, no copy)."""
    scales = packed.scales[:, :, start:end] if packed.scales is not None else None
    return PackedKV(packed.format, packed.data[:, :, start:end], scales, packed.dtype)


# ---------------------------------------------------------------------------
# Session files
# ---------------------------------------------------------------------------


def session_file_name(session_key: str) -> str:
    """File name for a session: a hash, so ids never reach the file system as text."""
    return hashlib.sha256(session_key.encode()).hexdigest()[:40] + SUFFIX


@dataclass
class SessionFileHeader:
    path: str
    fingerprint: str
    session_key: str
    key_hash: str
    token_ids: list[int]
    block_hashes: list[bytes]
    last_used_wall: float
    format: str


def _checksum(meta: dict[str, str], tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(meta, sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(name.encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def write_session_file(directory: str, session_key: str, fingerprint: str, token_ids: list[int], block_hashes: list[bytes], packed: PackedKV, last_used_wall: float) -> tuple[str, int]:
    """Write atomically (temp file + rename); returns (path, bytes on disk)."""
    from safetensors.torch import save_file

    tensors = {"data": packed.data.contiguous()}
    if packed.scales is not None:
        tensors["scales"] = packed.scales.contiguous()
    meta = {
        "ember_session_version": FILE_VERSION,
        "model_fingerprint": fingerprint,
        "session_key": session_key,
        "key_hash": hashlib.sha256(session_key.encode()).hexdigest(),
        "format": packed.format,
        "dtype": str(packed.dtype).removeprefix("torch."),
        "token_ids": json.dumps(token_ids),
        "block_hashes": json.dumps([h.hex() for h in block_hashes]),
        "last_used_wall": repr(last_used_wall),
    }
    meta["checksum"] = _checksum(meta, tensors)
    Path(directory).mkdir(parents=True, exist_ok=True)
    path = os.path.join(directory, session_file_name(session_key))
    tmp = f"{path}.{os.getpid()}.tmp"
    save_file(tensors, tmp, metadata=meta)
    os.replace(tmp, path)
    return path, os.path.getsize(path)


def read_header(path: str, fingerprint: str) -> SessionFileHeader:
    """Read and check a file's metadata (cheap: no tensor data is read)."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as exc:  # truncated or not a safetensors file
        raise CorruptSessionFile(f"{path}: unreadable ({exc})") from exc
    if meta.get("ember_session_version") != FILE_VERSION:
        raise CorruptSessionFile(f"{path}: not an Ember session file of version {FILE_VERSION}")
    if meta.get("model_fingerprint") != fingerprint:
        raise CorruptSessionFile(f"{path}: written for another model")
    if hashlib.sha256(meta.get("session_key", "").encode()).hexdigest() != meta.get("key_hash"):
        raise CorruptSessionFile(f"{path}: session key does not match its hash")
    try:
        return SessionFileHeader(
            path=path,
            fingerprint=meta["model_fingerprint"],
            session_key=meta["session_key"],
            key_hash=meta["key_hash"],
            token_ids=[int(t) for t in json.loads(meta["token_ids"])],
            block_hashes=[bytes.fromhex(h) for h in json.loads(meta["block_hashes"])],
            last_used_wall=float(meta["last_used_wall"]),
            format=meta["format"],
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise CorruptSessionFile(f"{path}: malformed metadata ({exc})") from exc


def read_payload(path: str, fingerprint: str, session_key: str | None = None) -> tuple[SessionFileHeader, PackedKV]:
    """Read a whole session file and verify its checksum, model and owner."""
    from safetensors import safe_open

    header = read_header(path, fingerprint)
    if session_key is not None and header.key_hash != hashlib.sha256(session_key.encode()).hexdigest():
        raise CorruptSessionFile(f"{path}: belongs to another session")
    try:
        with safe_open(path, framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as exc:
        raise CorruptSessionFile(f"{path}: unreadable payload ({exc})") from exc
    expected = meta.pop("checksum", None)
    if expected is None or _checksum(meta, tensors) != expected:
        raise CorruptSessionFile(f"{path}: checksum mismatch")
    dtype = getattr(torch, meta.get("dtype", "float32"), torch.float32)
    data = tensors.get("data")
    if data is None or data.dim() != 6 or data.shape[2] != len(header.block_hashes):
        raise CorruptSessionFile(f"{path}: tensor shape does not match its block list")
    return header, PackedKV(header.format, data, tensors.get("scales"), dtype)
