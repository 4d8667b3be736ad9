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
A header that cannot be found on the include path (only on the compiler's own
search path, say) or a macro include makes the key uncertain: such a program is
built plainly and never cached (``KeyInfo.uncertain``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyopencl as cl

__all__ = [
    "FORMAT_VERSION",
    "POCL_PLATFORM_NAME",
    "IncludeDep",
    "KeyInfo",
    "UncertainIncludes",
    "code_settings",
    "device_identity",
    "find_include_deps",
    "host_cpu_features",
    "make_key",
    "scan_includes",
]

#: pocl's platform name (its settings and the host CPU go into the key).
POCL_PLATFORM_NAME = "Portable Computing Language"

#: Version of the entry format; part of every key and of the directory name.
FORMAT_VERSION = 1

# Comments and string literals, so that a commented-out include is not one and an include
# followed by a comment is. Strings are kept (a "//" inside one is no comment).
_COMMENT_RE = re.compile(
    rb"""//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'""", re.DOTALL
)
# Every include directive; group 2 is the name when it is a literal <name> or "name".
_DIRECTIVE_RE = re.compile(rb'^[ \t]*\#[ \t]*include\b[ \t]*(([<"])([^<>"\n]+)[>"])?', re.MULTILINE)


def scan_includes(text: bytes) -> tuple[tuple[bytes, ...], bool]:
    """The names ``text`` includes, and whether some include is not a literal name (a
    macro, say), which no scan can resolve for certain. Comments do not count."""
    def blank(m: re.Match[bytes]) -> bytes:
        t = m.group(0)
        return t if t[:1] in (b'"', b"'") else b" " + b"\n" * t.count(b"\n")

    code = _COMMENT_RE.sub(blank, text.replace(b"\\\n", b""))
    names = []
    unresolvable = False
    for m in _DIRECTIVE_RE.finditer(code):
        if m.group(3) is None:
            unresolvable = True
        else:
            names.append(m.group(3).strip())
    return tuple(names), unresolvable


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
    #: Why the includes cannot be known for certain (then nothing is cached), or ``None``.
    uncertain: str | None = None


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


#: pocl's settings that cannot change generated code (where files go, logging, threads,
#: memory). Every other ``POCL_*`` variable is part of the key: when in doubt, miss.
POCL_NOT_CODE = frozenset({
    "POCL_CACHE_DIR", "POCL_KERNEL_CACHE", "POCL_DEBUG", "POCL_DEBUG_LLVM_PASSES",
    "POCL_LEAVE_KERNEL_COMPILER_TEMP_FILES", "POCL_MAX_PTHREAD_COUNT", "POCL_PTHREAD_MIN_THREADS",
    "POCL_AFFINITY", "POCL_MEMORY_LIMIT", "POCL_TRACING", "POCL_TRACING_OPT", "POCL_TRACING_FILTER",
    "POCL_DUMP_TASK_GRAPHS", "POCL_STARTUP_DELAY", "POCL_BUILDING", "POCL_IMPLICIT_FINISH",
})


def code_settings(devices: Sequence[cl.Device]) -> dict[str, str]:
    """Settings outside the source and options that change the generated code.

    pocl devices: every ``POCL_*`` environment variable not in :data:`POCL_NOT_CODE`
    (``POCL_EXTRA_BUILD_FLAGS``, ``POCL_LLVM_CPU_NAME``, ``POCL_WORK_GROUP_METHOD``,
    ``POCL_WORK_GROUP_SPECIALIZATION``, ``POCL_MAX_WORK_GROUP_SIZE``, the vectorizer's...).
    CPU devices: the host CPU's features, since two hosts can report the same LLVM CPU
    name with different features (a VM masks some). Other drivers: their identity
    (driver version) is in the key already; their environment does not change a binary
    that the driver accepts back.
    """
    import pyopencl as cl

    out: dict[str, str] = {}
    if any(d.platform.name == POCL_PLATFORM_NAME for d in devices):
        out.update({k: v for k, v in os.environ.items()
                    if k.startswith("POCL_") and k not in POCL_NOT_CODE})
    if any(d.type & cl.device_type.CPU for d in devices):
        out["host_cpu"] = host_cpu_features()
    return out


@functools.lru_cache(maxsize=1)
def host_cpu_features() -> str:
    """A digest of the host CPU's model and feature flags (``/proc/cpuinfo``), or
    ``unknown``. Read once per process."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            text = f.read()
    except OSError:
        return "unknown"
    # The same for every core: one core's lines (the first time each key is seen).
    seen: dict[bytes, bytes] = {}
    for line in text.splitlines():
        key = line.split(b":", 1)[0].strip()
        if key in (b"flags", b"Features", b"model name", b"vendor_id", b"CPU implementer",
                   b"CPU part", b"isa"):
            seen.setdefault(key, line.strip())
    blob = b"\n".join(sorted(seen.values()))
    return hashlib.sha256(blob).hexdigest()[:32] if blob else "unknown"


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
        self._memo: dict[str, tuple[tuple[int, int, int, int], str, tuple[bytes, ...], bool]] = {}

    def scan(self, path: str) -> tuple[str, tuple[bytes, ...], bool] | None:
        """The file's SHA-256, its ``#include`` names and whether some include is not a
        literal name; ``None`` if it is not a readable file."""
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
            return hit[1], hit[2], hit[3]
        read_at = time.time_ns()
        try:
            with open(path, "rb") as f:
                text = f.read()
        except OSError:
            return None
        digest = hashlib.sha256(text).hexdigest()
        names, unresolvable = scan_includes(text)
        if read_at - max(st.st_mtime_ns, st.st_ctime_ns) > _RACY_NS:
            with self._lock:
                self._memo[path] = (stamp, digest, names, unresolvable)
        return digest, names, unresolvable

    def digest(self, path: str) -> str | None:
        scanned = self.scan(path)
        return None if scanned is None else scanned[0]


_MEMO = _DigestMemo()


class UncertainIncludes(Exception):
    """An ``#include`` that cannot be resolved for certain: nothing is cached for it."""


def find_include_deps(source: bytes, include_path: Sequence[str]) -> tuple[IncludeDep, ...]:
    """Every file ``source`` includes, recursively, resolved on ``include_path``.

    Raises :class:`UncertainIncludes` for an include that is not a literal name (a
    macro) or that is not found on ``include_path`` (the compiler may find it elsewhere,
    and a stale header is a silently wrong result). Thread-safe.
    """
    found: dict[str, str] = {}

    def visit(names: Iterable[bytes], unresolvable: bool, where: str) -> None:
        if unresolvable:
            raise UncertainIncludes(f"an #include in {where} is not a literal file name")
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
                visit(scanned[1], scanned[2], path)
                break
            else:
                raise UncertainIncludes(f"#include {name!r} ({where}) is not on the include path")

    visit(*scan_includes(source), "the source")
    return tuple(IncludeDep(p, d) for p, d in sorted(found.items()))


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
    uncertain = None
    try:
        deps = find_include_deps(source, include_path)
    except UncertainIncludes as e:
        deps, uncertain = (), str(e)
    source_sha = hashlib.sha256(source).hexdigest()
    doc = {
        "format": FORMAT_VERSION,
        "pyopencl": pyopencl.VERSION_TEXT,
        "devices": identities,
        "options": options.decode("utf-8", "surrogateescape"),
        "source_sha256": source_sha,
        "includes": [[d.path, d.sha256] for d in deps],
        "environment": code_settings(devices),
    }
    if kind != "binary":
        doc["kind"] = kind
    blob = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("utf-8", "surrogateescape")
    return KeyInfo(hashlib.sha256(blob).hexdigest(), identities, options, source_sha, deps, uncertain)
