"""What makes a cache key.

A key is the SHA-256 hex digest of a canonical JSON document holding:

* the asyncclcache entry format version and the pyopencl version,
* the identity of every target device, in order (platform name, vendor and
  version; device name, vendor, version and driver version),
* the processed build options, exactly the bytes pyopencl passes to the driver,
* the SHA-256 of the source,
* the path and SHA-256 of the *content* of every file ``#include``-d from the
  source, found the way pyopencl finds them (``.`` and every ``-I`` directory,
  recursively).

Guarantees: the key is stable across runs and machines with the same inputs (no
``hash()``, no ``PYTHONHASHSEED``, no timestamps), and any change to a listed
input changes it. A header's modification time alone does not: content counts.
Headers found only on the compiler's own search path are not covered (as in
pyopencl).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyopencl as cl

__all__ = [
    "FORMAT_VERSION",
    "IncludeDep",
    "KeyInfo",
    "device_identity",
    "find_include_deps",
    "make_key",
]

#: Version of the entry format; part of every key and of the directory name.
FORMAT_VERSION = 1

# Same pattern pyopencl's cache uses, so we see the same includes.
_INCLUDE_RE = re.compile(rb'^\s*\#\s*include\s+[<"](.+)[">]\s*$', re.MULTILINE)


@dataclass(frozen=True)
class IncludeDep:
    """One included file: resolved path and SHA-256 of its content."""

    path: str
    sha256: str


@dataclass(frozen=True)
class KeyInfo:
    """A computed key and what it was made of (stored in the entry's metadata)."""

    key: str
    devices: tuple[dict[str, str], ...]
    options: bytes
    source_sha256: str
    deps: tuple[IncludeDep, ...]


def device_identity(device: cl.Device) -> dict[str, str]:
    """The fields that decide whether a binary fits a device. Thread-safe."""
    platform = device.platform
    return {
        "platform_name": platform.name,
        "platform_vendor": platform.vendor,
        "platform_version": platform.version,
        "device_name": device.name,
        "device_vendor": device.vendor,
        "device_version": device.version,
        "driver_version": device.driver_version,
    }


#: A file changed less than this before it was hashed may change again without a
#: visible new timestamp (coarse or lagging file system clocks): never memoized.
_RACY_NS = 2_000_000_000


class _DigestMemo:
    """(path, inode, size, mtime, ctime) -> content digest and the names the file includes:
    a cheap stat before any re-read.

    Like git's "racily clean" rule, a result is only remembered for a file whose
    last change is clearly older than the moment it was read; otherwise a second
    edit within one timestamp tick (same size) would return the stale digest.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._memo: dict[str, tuple[tuple[int, int, int, int], str, tuple[bytes, ...]]] = {}

    def scan(self, path: str) -> tuple[str, tuple[bytes, ...]] | None:
        """The file's SHA-256 and its ``#include`` names; ``None`` if it is not a readable file."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        if not os.path.isfile(path):
            return None
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        with self._lock:
            hit = self._memo.get(path)
        if hit is not None and hit[0] == stamp:
            return hit[1], hit[2]
        read_at = time.time_ns()
        try:
            with open(path, "rb") as f:
                text = f.read()
        except OSError:
            return None
        digest = hashlib.sha256(text).hexdigest()
        names = tuple(m.group(1) for m in _INCLUDE_RE.finditer(text))
        if read_at - max(st.st_mtime_ns, st.st_ctime_ns) > _RACY_NS:
            with self._lock:
                self._memo[path] = (stamp, digest, names)
        return digest, names

    def digest(self, path: str) -> str | None:
        scanned = self.scan(path)
        return None if scanned is None else scanned[0]


_MEMO = _DigestMemo()


def find_include_deps(source: bytes, include_path: Sequence[str]) -> tuple[IncludeDep, ...]:
    """Every file ``source`` includes, recursively, resolved on ``include_path``.

    Missing headers are skipped (the compiler will report them). Thread-safe.
    """
    found: dict[str, str] = {}

    def visit(names: Iterable[bytes]) -> None:
        for raw in names:
            name = raw.decode("utf-8", "surrogateescape")
            for directory in include_path:
                path = os.path.realpath(os.path.join(directory, name))
                if path in found:
                    break
                scanned = _MEMO.scan(path)
                if scanned is None:
                    continue
                found[path] = scanned[0]
                visit(scanned[1])
                break

    visit(m.group(1) for m in _INCLUDE_RE.finditer(source))
    return tuple(IncludeDep(p, d) for p, d in sorted(found.items()))


def deps_unchanged(deps: Sequence[dict[str, Any]]) -> bool:
    """True if every recorded include still has the recorded content (stat first)."""
    return all(_MEMO.digest(d["path"]) == d["sha256"] for d in deps)


def make_key(
    source: bytes,
    options: bytes,
    devices: Sequence[cl.Device],
    include_path: Sequence[str],
    *,
    kind: str = "binary",
) -> KeyInfo:
    """Compute the key of building ``source`` with ``options`` for ``devices``. Thread-safe.

    ``kind`` is what the entry holds (``binary``, or ``kcache``: pocl's kernel-cache files);
    entries of different kinds never share a key."""
    import pyopencl

    identities = tuple(device_identity(d) for d in devices)
    deps = find_include_deps(source, include_path)
    source_sha = hashlib.sha256(source).hexdigest()
    doc = {
        "format": FORMAT_VERSION,
        "pyopencl": pyopencl.VERSION_TEXT,
        "devices": identities,
        "options": options.decode("utf-8", "surrogateescape"),
        "source_sha256": source_sha,
        "includes": [[d.path, d.sha256] for d in deps],
    }
    if kind != "binary":
        doc["kind"] = kind
    blob = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("utf-8", "surrogateescape")
    return KeyInfo(hashlib.sha256(blob).hexdigest(), identities, options, source_sha, deps)
