"""The on-disk format of one cache entry. No pickle: bytes in, bytes out.

Layout (little-endian)::

    offset  size  field
    0       8     magic  b"ACLCACHE"
    8       2     format version (``keys.FORMAT_VERSION``)
    10      2     flags (0)
    12      4     length M of the metadata
    16      M     metadata, UTF-8 JSON (key, devices, options, include deps,
                  created time, binary sizes, build logs, ...)
    16+M    sum   the per-device binaries, back to back, sizes in the metadata
    end-32  32    BLAKE2b-256 of every byte before it

A checksum catches damage, not an attacker: see the store for ownership checks.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from typing import IO, Any

from .keys import FORMAT_VERSION

__all__ = [
    "KINDS",
    "MAGIC",
    "Entry",
    "EntryFormatError",
    "decode",
    "encode",
    "layout_problem",
    "meta_problem",
    "read_meta",
]

#: What an entry holds: per-device binaries, or pocl kernel-cache files (``meta["files"]``).
KINDS = ("binary", "kcache")

MAGIC = b"ACLCACHE"
_HEADER = struct.Struct("<8sHHI")
_DIGEST_SIZE = 32
_MAX_META = 64 << 20


class EntryFormatError(ValueError):
    """The bytes are not a valid entry; the message says why."""


@dataclass(frozen=True)
class Entry:
    """One program's binaries, one per device, with their metadata. Immutable."""

    key: str
    binaries: tuple[bytes, ...]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Size of the binaries."""
        return sum(len(b) for b in self.binaries)

    @property
    def kind(self) -> str:
        """``binary`` (one binary per device) or ``kcache`` (pocl's kernel-cache files)."""
        return str(self.meta.get("kind", "binary"))


def _str_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(i, str) for i in x)


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


#: The metadata fields readers use, and the type each must have when present.
_META_TYPES: dict[str, Any] = {
    "kind": lambda x: isinstance(x, str),
    "devices": lambda x: isinstance(x, list)
    and all(isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in x),
    "files": _str_list,
    "kernels": _str_list,
    "build_logs": _str_list,
    "options": lambda x: isinstance(x, str),
    "source_sha256": lambda x: isinstance(x, str),
    "includes": lambda x: isinstance(x, list)
    and all(isinstance(i, list) and len(i) == 2 and _str_list(i) for i in x),
    "created": _number,
    "compile_seconds": _number,
    "snapshot": lambda x: isinstance(x, str),
    "strategy": lambda x: isinstance(x, str),
    "asyncclcache": lambda x: isinstance(x, str),
}


def meta_problem(meta: dict[str, Any]) -> str | None:
    """Why the metadata does not have the types its readers rely on, or ``None``."""
    for name, ok in _META_TYPES.items():
        if name in meta and not ok(meta[name]):
            return f"bad metadata: {name!r} is {type(meta[name]).__name__}"
    return None


def layout_problem(entry: Entry) -> str | None:
    """Why the entry's blobs do not fit what its metadata says it holds, or ``None``."""
    devices = entry.meta.get("devices")
    if not isinstance(devices, list) or not devices:
        return "no devices"
    if entry.kind == "binary":
        if len(entry.binaries) != len(devices):
            return "binary count does not match its devices"
        return None
    if entry.kind == "kcache":
        from .drivers.kcache import valid_file

        files = entry.meta.get("files")
        if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
            return "kernel-cache file list is not a list of names"
        if len(files) != len(entry.binaries) or not files:
            return "kernel-cache file count does not match its contents"
        bad = next((f for f in files if not valid_file(f)), None)
        if bad is not None:
            return f"unsafe kernel-cache path {bad!r}"
        if len(set(files)) != len(files):
            return "kernel-cache file listed twice"
        return None
    return f"unknown kind {entry.kind!r}"


def _digest(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=_DIGEST_SIZE).digest()


def encode(entry: Entry) -> bytes:
    """Serialize ``entry``. Pure function, thread-safe."""
    meta = dict(entry.meta)
    meta["key"] = entry.key
    meta["format"] = FORMAT_VERSION
    meta["binary_sizes"] = [len(b) for b in entry.binaries]
    meta_bytes = json.dumps(meta, sort_keys=True).encode("utf-8")
    body = b"".join(
        [_HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(meta_bytes)), meta_bytes, *entry.binaries]
    )
    return body + _digest(body)


def decode(data: bytes) -> Entry:
    """Parse and verify an entry. Raises :class:`EntryFormatError` on anything wrong."""
    if len(data) < _HEADER.size + _DIGEST_SIZE:
        raise EntryFormatError(f"truncated ({len(data)} bytes)")
    magic, version, _flags, meta_len = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise EntryFormatError("not an asyncclcache entry (bad magic)")
    if version != FORMAT_VERSION:
        raise EntryFormatError(f"format version {version}, expected {FORMAT_VERSION}")
    view = memoryview(data)
    if _digest(view[:-_DIGEST_SIZE]) != data[-_DIGEST_SIZE:]:
        raise EntryFormatError("checksum mismatch")
    if meta_len > _MAX_META or _HEADER.size + meta_len > len(data) - _DIGEST_SIZE:
        raise EntryFormatError("metadata length out of range")
    try:
        meta = json.loads(bytes(view[_HEADER.size : _HEADER.size + meta_len]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EntryFormatError(f"bad metadata: {e}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("key"), str):
        raise EntryFormatError("bad metadata: no key")
    sizes = meta.get("binary_sizes")
    if not isinstance(sizes, list) or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in sizes
    ):
        raise EntryFormatError("bad metadata: binary sizes")
    problem = meta_problem(meta)
    if problem is not None:
        raise EntryFormatError(problem)
    start = _HEADER.size + meta_len
    if start + sum(sizes) != len(data) - _DIGEST_SIZE:
        raise EntryFormatError("binary sizes do not add up")
    binaries = []
    for s in sizes:
        binaries.append(bytes(view[start : start + s]))
        start += s
    return Entry(meta["key"], tuple(binaries), meta)


def read_meta(f: IO[bytes]) -> dict[str, Any]:
    """The metadata of the entry in ``f``, without reading the binaries or verifying the
    checksum (for listings; use :func:`decode` before trusting anything)."""
    header = f.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EntryFormatError("truncated")
    magic, version, _flags, meta_len = _HEADER.unpack(header)
    if magic != MAGIC or version != FORMAT_VERSION or meta_len > _MAX_META:
        raise EntryFormatError("not an asyncclcache entry of this version")
    try:
        meta = json.loads(f.read(meta_len).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EntryFormatError(f"bad metadata: {e}") from None
    if not isinstance(meta, dict):
        raise EntryFormatError("bad metadata")
    problem = meta_problem(meta)
    if problem is not None:
        raise EntryFormatError(problem)
    return meta
