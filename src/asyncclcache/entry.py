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
The metadata is an :class:`EntryMeta`, decoded and type-checked in one place
(:meth:`EntryMeta.from_json`); readers use its attributes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import IO, Any

from .errors import EntryFormatError
from .keys import FORMAT_VERSION

__all__ = [
    "KINDS",
    "MAGIC",
    "Entry",
    "EntryFormatError",
    "EntryMeta",
    "decode",
    "encode",
    "layout_problem",
    "read_meta",
    "safe_file",
]

#: What an entry holds: per-device binaries, or pocl kernel-cache files (``meta["files"]``).
KINDS = ("binary", "kcache")

MAGIC = b"ACLCACHE"
_HEADER = struct.Struct("<8sHHI")
_DIGEST_SIZE = 32
_MAX_META = 64 << 20


def _str_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(i, str) for i in x)


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _str(x: Any) -> bool:
    return isinstance(x, str)


#: Latest plausible time stamp: 9999-12-31 23:59:59 UTC (``time.localtime`` and
#: ``datetime`` take up to year 9999; a larger one is damage, not a date).
_MAX_TIME = 253402300799.0
#: Longest plausible compile time (a year): larger is damage, and would swamp ``seconds_saved``.
_MAX_SECONDS = 365 * 86400.0
#: Inclusive bounds of each number field, and what they mean. Comparisons reject NaN and
#: infinities, and work for JSON integers of any size (``math.isfinite`` overflows on those).
_RANGES: dict[str, tuple[float, float, str]] = {
    "created": (0.0, _MAX_TIME, "a time from 1970 to 9999"),
    "compile_seconds": (0.0, _MAX_SECONDS, "seconds from 0 to a year"),
}
#: The type each known field must have (checked whenever an :class:`EntryMeta` is made).
_CHECKS: dict[str, Any] = {
    "kind": _str,
    "devices": lambda x: isinstance(x, list)
    and all(isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in x),
    "files": lambda x: x is None or _str_list(x),
    "kernels": _str_list,
    "build_logs": _str_list,
    "options": _str,
    "source_sha256": _str,
    "includes": lambda x: isinstance(x, list)
    and all(isinstance(i, list) and len(i) == 2 and _str_list(i) for i in x),
    "created": _number,
    "compile_seconds": _number,
    "snapshot": _str,
    "strategy": _str,
    "asyncclcache": _str,
    "source": lambda x: x is None or _str(x),
    "baked_from": lambda x: x is None or _str(x),
    "baked_files": lambda x: x is None or _str_list(x),
    "cwd": lambda x: x is None or _str(x),
}
# A name in a driver's cache: never ``.``/``..`` nor hidden (our temp files start with a dot).
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}")


def safe_file(rel: str) -> bool:
    """What a ``kcache`` entry may hold (checked before anything is written): a relative
    path of 2 to 6 plain names. Each driver's layout checks its own names again before a
    restore (``platforms/``: each implementation's ``Layout``)."""
    parts = rel.split("/")
    return 2 <= len(parts) <= 6 and all(_NAME_RE.fullmatch(p) for p in parts)


#: Framing fields that :func:`encode` adds and :func:`decode` checks; not metadata.
_FRAMING = ("key", "format", "binary_sizes")


@dataclass(frozen=True, eq=False)
class EntryMeta(Mapping[str, Any]):
    """What an entry says about itself. Immutable.

    Also a read-only mapping of its fields (``meta["files"]``), so tools and tests can
    treat it as the JSON it is stored as. Unknown fields (a newer writer's) are kept
    in ``extra`` and written back unchanged.
    """

    #: ``binary`` (one binary per device) or ``kcache`` (pocl's kernel-cache files).
    kind: str = "binary"
    #: Per device: the identity fields of :func:`asyncclcache.keys.device_identity`.
    devices: list[dict[str, str]] = field(default_factory=list)
    #: ``kcache``: the relative path of each blob in pocl's kernel cache.
    files: list[str] | None = None
    kernels: list[str] = field(default_factory=list)
    #: Per device, when any build said something (replayed at a hit, as pyopencl does).
    build_logs: list[str] = field(default_factory=list)
    options: str = ""
    source_sha256: str = ""
    #: ``[path, sha256]`` of every header the source includes.
    includes: list[list[str]] = field(default_factory=list)
    #: ``time.time()`` of the snapshot (``0``: unknown).
    created: float = 0.0
    #: What a hit saves: the source build plus one code generation.
    compile_seconds: float = 0.0
    snapshot: str = ""
    strategy: str = ""
    asyncclcache: str = ""
    #: ``kcache``: the program's source (UTF-8, undecodable bytes escaped), which a bake
    #: builds again (``None``: an entry of an earlier release; not bakeable).
    source: str | None = None
    #: A baked binary (``asyncclcache bake``): the key of the ``kcache`` entry it was
    #: baked from, and that entry's files it packs (a hit checks they are all there).
    baked_from: str | None = None
    baked_files: list[str] | None = None
    #: ``kcache``: the working directory of the build (absolute), where its relative ``-I``
    #: folders and quoted includes resolved; a bake builds there (``None``: unknown, or an
    #: entry of an earlier release). Optional: readers of this format without it keep it
    #: in ``extra``, so no new format version.
    cwd: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # The one rule of what valid metadata is, for every reader (load, verify, import,
        # list) and every writer (a bad value never reaches the disk).
        for name, check in _CHECKS.items():
            value = getattr(self, name)
            if not check(value):
                raise EntryFormatError(f"bad metadata: {name!r} is {type(value).__name__}")
            bounds = _RANGES.get(name)
            if bounds is not None and not bounds[0] <= value <= bounds[1]:
                raise EntryFormatError(f"bad metadata: {name!r} is {value!r:.30}, not {bounds[2]}")
        # A bake enters it: never a folder relative to wherever the bake runs.
        if self.cwd is not None and not (os.path.isabs(self.cwd) and "\0" not in self.cwd):
            raise EntryFormatError("bad metadata: 'cwd' is not an absolute path")

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> EntryMeta:
        """Check every known field's type and range; raises :class:`EntryFormatError`
        naming the first bad one. Framing fields (key, format, binary sizes) are left out."""
        known: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for name, value in data.items():
            if name in _FRAMING:
                continue
            if name in _CHECKS:
                known[name] = value
            else:
                extra[name] = value
        return cls(**known, extra=extra)

    def for_device(self, text: str) -> bool:
        """True when a device's name contains ``text``, ignoring case (``--device``)."""
        return any(text.lower() in d.get("device_name", "").lower() for d in self.devices)

    def to_json(self) -> dict[str, Any]:
        """The JSON object stored (``files`` only where there are files)."""
        out = dict(self.extra)
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "extra" and value is not None:
                out[f.name] = value
        return out

    # The read-only mapping of the stored JSON.
    def __getitem__(self, name: str) -> Any:
        return self.to_json()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_json())

    def __len__(self) -> int:
        return len(self.to_json())


@dataclass(frozen=True)
class Entry:
    """One program's binaries, one per device, with their metadata. Immutable.

    ``meta`` may be given as a plain mapping; it is checked and becomes an :class:`EntryMeta`.
    """

    key: str
    binaries: tuple[bytes, ...]
    meta: EntryMeta = field(default_factory=EntryMeta)

    def __post_init__(self) -> None:
        if not isinstance(self.meta, EntryMeta):
            object.__setattr__(self, "meta", EntryMeta.from_json(self.meta))

    @property
    def nbytes(self) -> int:
        """Size of the binaries."""
        return sum(len(b) for b in self.binaries)

    @property
    def kind(self) -> str:
        """``binary`` (one binary per device) or ``kcache`` (pocl's kernel-cache files)."""
        return self.meta.kind


def layout_problem(entry: Entry) -> str | None:
    """Why the entry's blobs do not fit what its metadata says it holds, or ``None``."""
    devices = entry.meta.devices
    if not devices:
        return "no devices"
    if entry.kind == "binary":
        if len(entry.binaries) != len(devices):
            return "binary count does not match its devices"
        return None
    if entry.kind == "kcache":
        files = entry.meta.files
        if files is None:
            return "kernel-cache file list is missing"
        if len(files) != len(entry.binaries) or not files:
            return "kernel-cache file count does not match its contents"
        bad = next((f for f in files if not safe_file(f)), None)
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
    meta = entry.meta.to_json()
    meta["key"] = entry.key
    meta["format"] = FORMAT_VERSION
    meta["binary_sizes"] = [len(b) for b in entry.binaries]
    meta_bytes = json.dumps(meta, sort_keys=True).encode("utf-8")
    body = b"".join(
        [_HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(meta_bytes)), meta_bytes, *entry.binaries]
    )
    return body + _digest(body)


def _parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw.decode("utf-8"))
    # ValueError: also an integer of more than 4300 digits; RecursionError: deep nesting.
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise EntryFormatError(f"bad metadata: {str(e)[:100]}") from None


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
    meta = _parse_json(bytes(view[_HEADER.size : _HEADER.size + meta_len]))
    if not isinstance(meta, dict) or not isinstance(meta.get("key"), str):
        raise EntryFormatError("bad metadata: no key")
    sizes = meta.get("binary_sizes")
    if not isinstance(sizes, list) or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in sizes
    ):
        raise EntryFormatError("bad metadata: binary sizes")
    checked = EntryMeta.from_json(meta)
    start = _HEADER.size + meta_len
    if start + sum(sizes) != len(data) - _DIGEST_SIZE:
        raise EntryFormatError("binary sizes do not add up")
    binaries = []
    for s in sizes:
        binaries.append(bytes(view[start : start + s]))
        start += s
    return Entry(meta["key"], tuple(binaries), checked)


def read_meta(f: IO[bytes]) -> EntryMeta:
    """The metadata of the entry in ``f``, without reading the binaries or verifying the
    checksum (for listings; use :func:`decode` before trusting anything)."""
    header = f.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EntryFormatError("truncated")
    magic, version, _flags, meta_len = _HEADER.unpack(header)
    if magic != MAGIC or version != FORMAT_VERSION or meta_len > _MAX_META:
        raise EntryFormatError("not an asyncclcache entry of this version")
    meta = _parse_json(f.read(meta_len))
    if not isinstance(meta, dict):
        raise EntryFormatError("bad metadata")
    return EntryMeta.from_json(meta)
