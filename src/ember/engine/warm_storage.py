"""Warm KV state: compact packing in RAM and self-checking session files on disk.

Packing formats (``SessionConfig.warm_format``):

* ``int8``: one scale per (layer, k/v, token, head) over the head dimension;
  ~3.8x smaller than float32. Lossy: continuations may differ slightly from a
  hot or cold run (agreement measured in tests and README).
* ``bf16``: 2x smaller, near-lossless.
* ``exact``: the cache dtype as is; restored state is bit-identical.

A session file is a safetensors file (safe to load: no pickle) whose metadata
carry the model fingerprint, the session key's hash, the token ids and block
hashes, and a SHA-256 checksum over all of it and the tensor bytes (OpenSSL's,
with the CPU's SHA instructions: 1.75 GB/s here against 0.65 for blake2b). A file
whose fingerprint, checksum or structure does not match is rejected with
``CorruptSessionFile`` and never restored: the turn recomputes instead.

The files are read and written here rather than by the ``safetensors``
package, in its documented layout (8-byte header length, JSON header, raw
tensor bytes; tested to load both ways): the storage thread shares the
process with the engine, and the package holds the GIL while it copies tens
of megabytes, which stalled every decode step for as long (measured: 200 ms
gaps). ``readinto``, ``write`` and the hash release the GIL on big buffers, and
the bytes go straight between the file and the tensors, with no extra copy.
Both go in chunks of ``CHUNK_BYTES``, calling ``between_chunks`` after each,
so the storage thread can pace itself while the engine is busy. The chunks are
small because a read or write system call is not preempted while it copies:
with 4 MB chunks, the other stream's median step during a restore was 3-7x
its undisturbed value in two runs of five; with 256 KB, 1.1-1.5x in five of five.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, get_args

import torch

from ember.config import WarmFormat

WARM_FORMATS: tuple[str, ...] = get_args(WarmFormat)
FILE_VERSION = "2"  # 2: SHA-256 checksum (1 was blake2b)
CHUNK_BYTES = 256 * 1024
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


def unpack_layers(packed: PackedKV, device: torch.device) -> Iterator[tuple[int, torch.Tensor]]:
    """``unpack``, one layer at a time: (layer index, its KV (2, n, block, heads, dim)) pairs."""
    for layer in range(packed.data.shape[0]):
        scales = packed.scales[layer : layer + 1] if packed.scales is not None else None
        yield layer, unpack(PackedKV(packed.format, packed.data[layer : layer + 1], scales, packed.dtype), device)[0]


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


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (``t`` must be contiguous and on the CPU)."""
    return t.reshape(-1).view(torch.uint8).numpy().data


def _chunks(buffer: memoryview) -> list[memoryview]:
    return [buffer[i : i + CHUNK_BYTES] for i in range(0, len(buffer), CHUNK_BYTES)]


def _nothing() -> None:
    pass


def _new_checksum(meta: dict[str, str]) -> hashlib._Hash:
    h = hashlib.sha256()
    h.update(json.dumps(meta, sort_keys=True).encode())
    return h


def _checksum(meta: dict[str, str], tensors: dict[str, torch.Tensor], between_chunks: Callable[[], None] = _nothing) -> str:
    """SHA-256 over the metadata, then each tensor's name and bytes in name order."""
    h = _new_checksum(meta)
    for name in sorted(tensors):
        h.update(name.encode())
        if tensors[name].numel():
            for chunk in _chunks(_bytes_of(tensors[name])):
                h.update(chunk)
                between_chunks()
    return h.hexdigest()[:32]


# safetensors' dtype names for the dtypes session files hold.
_DTYPE_NAMES = {torch.int8: "I8", torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32"}
_DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


def _save_safetensors(
    path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str], between_chunks: Callable[[], None] = _nothing
) -> None:
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the byte buffer starts 8-aligned, as the format recommends
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in sorted(tensors):
            if tensors[name].numel():
                for chunk in _chunks(_bytes_of(tensors[name])):
                    f.write(chunk)
                    between_chunks()


def _read_safetensors_header(f: BinaryIO) -> tuple[dict[str, Any], int]:
    (length,) = struct.unpack("<Q", f.read(8))
    if length > 100 * 1024 * 1024:
        raise ValueError("header too large")
    return json.loads(f.read(length)), 8 + length


def _load_safetensors(path: str, between_chunks: Callable[[], None] = _nothing) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    with open(path, "rb") as f:
        header, start = _read_safetensors_header(f)
        metadata = header.pop("__metadata__", {}) or {}
        tensors: dict[str, torch.Tensor] = {}
        for name, spec in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
            begin, end = spec["data_offsets"]
            t = torch.empty(spec["shape"], dtype=_DTYPES[spec["dtype"]])
            if t.numel() * t.element_size() != end - begin:
                raise ValueError(f"tensor {name}: size does not match its offsets")
            f.seek(start + begin)
            for chunk in _chunks(_bytes_of(t)) if t.numel() else []:
                if f.readinto(chunk) != len(chunk):
                    raise ValueError(f"tensor {name}: truncated")
                between_chunks()
            tensors[name] = t
    return metadata, tensors


def write_session_file(
    directory: str,
    session_key: str,
    fingerprint: str,
    token_ids: list[int],
    block_hashes: list[bytes],
    packed: PackedKV,
    last_used_wall: float,
    between_chunks: Callable[[], None] = _nothing,
) -> tuple[str, int]:
    """Write atomically (temp file + rename); returns (path, bytes on disk)."""
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
    meta["checksum"] = _checksum(meta, tensors, between_chunks)
    Path(directory).mkdir(parents=True, exist_ok=True)
    path = os.path.join(directory, session_file_name(session_key))
    tmp = f"{path}.{os.getpid()}.tmp"
    _save_safetensors(tmp, tensors, meta, between_chunks)
    os.replace(tmp, path)
    return path, os.path.getsize(path)


def read_header(path: str, fingerprint: str) -> SessionFileHeader:
    """Read and check a file's metadata (cheap: no tensor data is read)."""
    try:
        with open(path, "rb") as f:
            meta = _read_safetensors_header(f)[0].get("__metadata__") or {}
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


def read_payload(
    path: str, fingerprint: str, session_key: str | None = None, between_chunks: Callable[[], None] = _nothing
) -> tuple[SessionFileHeader, PackedKV]:
    """Read a whole session file and verify its checksum, model and owner."""
    header = read_header(path, fingerprint)
    if session_key is not None and header.key_hash != hashlib.sha256(session_key.encode()).hexdigest():
        raise CorruptSessionFile(f"{path}: belongs to another session")
    try:
        meta, tensors = _load_safetensors(path, between_chunks)
    except Exception as exc:
        raise CorruptSessionFile(f"{path}: unreadable payload ({exc})") from exc
    expected = meta.pop("checksum", None)
    if expected is None or _checksum(meta, tensors, between_chunks) != expected:
        raise CorruptSessionFile(f"{path}: checksum mismatch")
    dtype = getattr(torch, meta.get("dtype", "float32"), torch.float32)
    data = tensors.get("data")
    if data is None or data.dim() != 6 or data.shape[2] != len(header.block_hashes):
        raise CorruptSessionFile(f"{path}: tensor shape does not match its block list")
    return header, PackedKV(header.format, data, tensors.get("scales"), dtype)
