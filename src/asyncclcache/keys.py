"""What makes a cache key.

A key is the SHA-256 hex digest of a canonical JSON document holding:

* the asyncclcache entry format version and the pyopencl version,
* the identity of every target device, in order (platform name, vendor and
  version; device name, vendor, version and driver version),
* the processed build options, exactly the bytes pyopencl passes to the driver,
* the SHA-256 of the source,
* the settings outside the source that change the generated code, per driver
  (:func:`code_settings`: pocl's, Intel's CPU runtime's with its ``cl.cfg``, Mesa's,
  NVIDIA's) and, on CPU devices, the host CPU's features,
* the real path and SHA-256 of the *content* of every file ``#include``-d from the
  source, recursively, each found where the compiler finds it (and the version of that
  lookup rule).

Includes are resolved by one rule, clang's, or the program is uncacheable:

* what counts as a directive is what the preprocessor sees: line ends ``\r\n`` and
  ``\r`` are ``\n``; line splices (backslash, optional spaces or tabs, line end; also
  the trigraph ``??/``) are removed; comments are whitespace (``/* */ #include`` is an
  include), a commented-out or quoted include is none; ``%:`` and ``??=`` are ``#``.
  ``#if`` is not evaluated: an include in a skipped branch has to be found too, but for
  a branch only C++ compiles (``#ifdef __cplusplus``, ``#if defined(__cplusplus)``, the
  ``#else`` of ``#ifndef __cplusplus``): OpenCL C leaves ``__cplusplus`` undefined, so
  where the options cannot make it C++ (:func:`may_be_cxx`) and the code does not
  ``#define`` it, such a branch's includes are none (pyopencl's random123 headers include
  C++'s ``<stdexcept>`` there).
* ``#include "x"``: the including file's own folder first (for the source itself, the
  folder of the file the compiler compiles: pocl's cache directory, where pocl writes
  its copy of the source), then the include path in order (``.`` and every ``-I``
  folder, as pyopencl gives it: pocl adds ``-I.`` before the user's). ``#include <x>``:
  the include path only. The first regular file found is the one in the key, by path
  and content, whatever later folders hold.
* Uncacheable (``KeyInfo.uncertain``; built plainly, never cached): an include that is
  not found on that path (the compiler may find it on its own search path, where we
  could not see it change), a macro include or an odd name, ``#include_next``,
  ``#import``, ``__has_include``/``__has_include_next`` anywhere in the code (the code
  depends on which files exist), ``__DATE__``/``__TIME__``/``__TIMESTAMP__``, and a
  header reached through links whose includes resolve differently in its folders, and
  build options (or the flags a driver adds to them) that add files or move the search
  (``-include``, ``-imacros``, ``-isystem``, ``-iquote``, ``-idirafter``, ``-nostdinc``...).
  When unsure, uncacheable: never stale.

Guarantees: the key is stable across runs and machines with the same inputs (no
``hash()``, no ``PYTHONHASHSEED``, no timestamps), and any change to a listed
input changes it. A header's modification time alone does not: content counts.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import fsclock, platforms, system
from .platform import Settings

if TYPE_CHECKING:
    import pyopencl as cl

__all__ = [
    "FORMAT_VERSION",
    "INCLUDE_RULE",
    "IncludeDep",
    "KeyInfo",
    "UncertainIncludes",
    "baked_key",
    "code_settings",
    "device_identity",
    "find_include_deps",
    "host_cpu_features",
    "include_deps",
    "key_of",
    "make_key",
    "may_be_cxx",
    "scan_includes",
    "settings_of",
]

#: Version of the entry format; part of every key and of the directory name.
FORMAT_VERSION = 1

# {{{ scanning: what the preprocessor sees as an include

# Trigraphs (phase 1). clang replaces them in OpenCL C (not a GNU mode); another compiler
# may not, so a text that has one is scanned both ways (the union of what both see).
_TRIGRAPH_RE = re.compile(rb"\?\?([=/'()!<>\-])")
_TRIGRAPHS = {b"=": b"#", b"/": b"\\", b"'": b"^", b"(": b"[", b")": b"]", b"!": b"|",
              b"<": b"{", b">": b"}", b"-": b"~"}
# Line splices (phase 2), as clang's lexer takes them: a backslash, optional horizontal
# whitespace, one line end (\r\n and \n\r count as one).
_SPLICE_RE = re.compile(rb"\\[ \t\f\v]*(?:\r\n|\n\r|\r|\n)")
_EOL_RE = re.compile(rb"\r\n?")
# Comments, string and character literals (phase 3), scanned left to right as clang
# lexes them: an unterminated literal ends at the line end, and hides what follows on
# its line (clang makes it one token); an unterminated comment runs to the end.
_LEX_RE = re.compile(
    rb"""//[^\n]*|/\*.*?(?:\*/|\Z)"""
    rb"""|"(?:\\[^\n]|[^"\\\n])*(?:"|(?=\n)|\Z)|'(?:\\[^\n]|[^'\\\n])*(?:'|(?=\n)|\Z)""",
    re.DOTALL,
)
# A comment becomes one marker byte, as clang makes it one space: \x02 where it spanned
# line ends (a directive goes on across it), \x01 where not.
_ONE_LINE, _MULTI_LINE = b"\x01", b"\x02"
# What may stand before and inside a directive: whitespace, comments, and (leniently, so
# as to see too many directives rather than too few) control and non-ASCII bytes (a BOM).
_SPACE = rb"[^\n!-~]*"
# A directive: `#` or the digraph `%:` first on its line; group 1 its name, 2 the rest.
# (Matched after a "\n" rather than at "^": a literal first byte is searched fast.)
_DIRECTIVE_RE = re.compile(
    rb"\n" + _SPACE + rb"(?:\#|%:)" + _SPACE + rb"([A-Za-z_][A-Za-z0-9_]*)?([^\n]*)"
)
_HEADER_RE = re.compile(_SPACE + rb'(?:"([^"\n]*)"|<([^>\n]*)>)')
# Not a plain file name: a control byte (a comment's marker among them: an angled name
# lexed as tokens where skipped by #if), a quote, a backslash.
_ODD_NAME_RE = re.compile(rb"""[\x00-\x1f\x7f\\"']""")
# Depend on which files exist, or on the clock: no key can hold that.
_UNKEYABLE_RE = re.compile(rb"__(?:has_include|has_embed|DATE__|TIME__|TIMESTAMP__)")
_UNSUPPORTED = frozenset({b"include_next", b"import", b"embed"})


# A condition that holds exactly where __cplusplus is defined (`__cplusplus`, `defined
# __cplusplus`, `defined(__cplusplus)`), or, with "!", where it is not. OpenCL C leaves it
# undefined: such a branch is C++ only, and never compiled (pyopencl's random123 headers
# include C++'s <stdexcept> there).
_CXX_COND_RE = re.compile(
    rb"^" + _SPACE + rb"(!?)" + _SPACE + rb"(?:defined" + _SPACE + rb"(?:\(" + _SPACE + rb"__cplusplus" + _SPACE
    + rb"\)|(?<![A-Za-z0-9_])__cplusplus)|__cplusplus)" + _SPACE + rb"$"
)
_CXX_NAME_RE = re.compile(rb"^" + _SPACE + rb"__cplusplus" + _SPACE + rb"$")
_CXX_DEFINE_RE = re.compile(rb"^" + _SPACE + rb"__cplusplus(?![A-Za-z0-9_])")
_CONDITIONALS = frozenset({b"if", b"ifdef", b"ifndef"})
_ELSE_IFS = frozenset({b"elif", b"elifdef", b"elifndef"})


@dataclass(frozen=True)
class _Scan:
    #: ``(quoted, name)`` of every ``#include``, in order: quoted for ``"name"``.
    names: tuple[tuple[bool, bytes], ...]
    #: Why the includes cannot be known for certain, or ``None``.
    uncertain: str | None
    #: ``names`` less those in a branch that only C++ compiles (``#ifdef __cplusplus``), or
    #: ``None`` where that cannot be told for certain (then every name counts).
    c_names: tuple[tuple[bool, bytes], ...] | None = None
    #: The text ``#define``s or ``#undef``s ``__cplusplus``: for every file compiled after it
    #: too, so then no branch of any file counts as C++ only.
    defines_cxx: bool = False


def _comment_to_marker(m: re.Match[bytes]) -> bytes:
    t = m.group(0)
    if t[:1] in (b'"', b"'"):
        return t
    unclosed = t[:2] == b"/*" and (len(t) < 4 or not t.endswith(b"*/"))
    return _MULTI_LINE if unclosed or b"\n" in t else _ONE_LINE


def _scan_one(text: bytes) -> _Scan:
    text = _EOL_RE.sub(b"\n", _SPLICE_RE.sub(b"", text))
    code = b"\n" + _LEX_RE.sub(_comment_to_marker, text)
    odd = _UNKEYABLE_RE.search(code)
    if odd is not None:
        return _Scan((), f"{odd.group(0).decode()} (the code depends on more than file contents)")
    names: list[tuple[bool, bytes]] = []
    c_names: list[tuple[bool, bytes]] | None = []
    # The open conditionals: whether the branch now read is C++ only (True), and whether the
    # one after an #else would be ("other": a condition not told, every branch counts).
    stack: list[tuple[bool, bool | None]] = []
    defines_cxx = False
    for m in _DIRECTIVE_RE.finditer(code):
        directive, rest = m.group(1), m.group(2)
        if directive in _UNSUPPORTED:
            return _Scan((), f"#{directive.decode()} (its lookup is not tracked)")
        if directive in (b"error", b"warning") and _MULTI_LINE in rest:
            # clang reads this line raw: a "/*" on it starts no comment, unless #if skips it.
            return _Scan((), f"#{directive.decode()} with an unclosed /* comment")
        if directive in _CONDITIONALS:
            if directive == b"if":
                cond = _CXX_COND_RE.match(rest)
                only_cxx = cond is not None and not cond.group(1)
            else:
                cond = _CXX_NAME_RE.match(rest)
                only_cxx = directive == b"ifdef"
            stack.append((False, None) if cond is None else (only_cxx, not only_cxx))
        elif directive in _ELSE_IFS and stack:
            stack[-1] = (False, None)  # the rest of this conditional counts
        elif directive == b"else" and stack:
            stack[-1] = (bool(stack[-1][1]), None)
        elif directive == b"endif":
            if not stack:
                c_names = None  # unbalanced: clang refuses it; nothing is skipped
            else:
                stack.pop()
        elif directive in (b"define", b"undef") and _CXX_DEFINE_RE.match(rest):
            defines_cxx = True  # no branch is known skipped (find_include_deps)
        if directive != b"include":
            continue
        h = _HEADER_RE.match(rest)
        quoted = h is not None and h.group(1) is not None
        name = None if h is None else h.group(1) if quoted else h.group(2)
        if not name or _ODD_NAME_RE.search(name):
            what = rest.strip(b" \t\x01\x02")[:60].decode("utf-8", "replace")
            return _Scan((), f"an #include that is not a plain literal file name ({what!r})")
        names.append((quoted, name))
        if c_names is not None and not any(skipped for skipped, _ in stack):
            c_names.append((quoted, name))
    if stack:
        c_names = None  # unbalanced
    return _Scan(tuple(names), None, None if c_names is None else tuple(c_names), defines_cxx)


def _scan(text: bytes) -> _Scan:
    """The includes of ``text`` as a C preprocessor finds them (not evaluating ``#if``: an
    include in a skipped branch counts too), or why they cannot be known for certain."""
    plain = _scan_one(text)
    if plain.uncertain is not None or _TRIGRAPH_RE.search(text) is None:
        return plain
    replaced = _scan_one(_TRIGRAPH_RE.sub(lambda m: _TRIGRAPHS[m.group(1)], text))
    if replaced.uncertain is not None:
        return replaced
    c_names = None
    if plain.c_names is not None and replaced.c_names is not None:
        c_names = tuple(dict.fromkeys(plain.c_names + replaced.c_names))
    return _Scan(tuple(dict.fromkeys(plain.names + replaced.names)), None, c_names,
                 plain.defines_cxx or replaced.defines_cxx)


def scan_includes(text: bytes) -> tuple[tuple[bytes, ...], bool]:
    """The names ``text`` includes, and whether its includes cannot be known for certain
    (a macro include, ``#include_next``, ``__has_include``, ...). Comments do not count."""
    scanned = _scan(text)
    return tuple(name for _quoted, name in scanned.names), scanned.uncertain is not None


# }}}


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


# {{{ each driver's settings that change its code (docs/design.md "Settings in the key, per driver")

_started_lock = threading.Lock()
_started: dict[str, tuple[dict[str, str], str | None]] = {}


def _platform_settings(platform: str, table: Settings) -> tuple[dict[str, str], str | None]:
    if table.at_start:
        with _started_lock:
            kept = _started.get(platform)
        if kept is not None:
            return kept
    out = table.select(system.process_environ())
    doubt = None
    if table.files is not None:
        digests, doubt = table.files()
        out.update(digests)
    if table.at_start:
        with _started_lock:
            return _started.setdefault(platform, (out, doubt))
    return out, doubt


def settings_of(devices: Sequence[cl.Device]) -> tuple[dict[str, str], str | None]:
    """:func:`code_settings` of ``devices``, and why they cannot be known for certain (a
    ``cl.cfg`` that cannot be read: then nothing is cached), or ``None``. Thread-safe."""
    import pyopencl as cl

    out: dict[str, str] = {}
    doubt = None
    for name in dict.fromkeys(d.platform.name for d in devices):
        platform = platforms.find(name)
        if platform is not None and platform.settings is not None:
            got, why = _platform_settings(name, platform.settings)
            out.update(got)
            doubt = doubt or why
    for d in devices:
        platform = platforms.of_devices([d])  # pocl's CUDA device has a record of its own
        if platform is not None and platform.settings is not None and platform.settings.per_device is not None:
            out.update(platform.settings.per_device(d, system.process_environ()))
    if any(d.type & cl.device_type.CPU for d in devices):
        out["host_cpu"] = host_cpu_features()
    return out, doubt


def code_settings(devices: Sequence[cl.Device]) -> dict[str, str]:
    """Settings outside the source and options that change the generated code.

    Per platform (:attr:`.platform.Platform.settings`, in :mod:`.platforms`): the
    variables with its prefixes but those known not to change code, and the files it
    reads as settings (Intel's ``cl.cfg``). pocl's are read at every call, as pocl reads
    them at every build; the others once per process, at the first call, as the drivers
    read them once when they start. Settings only some devices read (pocl's CUDA device).
    CPU devices: the host CPU's features, since two hosts can report the same LLVM CPU
    name with different features (a VM masks some). Thread-safe.
    """
    return settings_of(devices)[0]


# }}}


@functools.lru_cache(maxsize=1)
def host_cpu_features() -> str:
    """A digest of the host CPU's model and feature flags (:func:`.system.cpu_description`),
    or ``unknown`` where the system does not say. Read once per process."""
    text = system.cpu_description()
    if text is None:
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


@dataclass(frozen=True)
class _Scanned:
    """A file as read: its content digest, identity (device, inode) and includes."""

    sha256: str
    ident: tuple[int, int]
    scan: _Scan


class _DigestMemo:
    """(path, device, inode, size, mtime, ctime) -> what :class:`_Scanned` holds: a cheap
    stat before any re-read.

    Like git's "racily clean" rule, a result is only remembered for a file whose last
    change is older than any stamp a change after the read could carry, in the file
    system's own time base (:func:`~asyncclcache.fsclock.clock_for`: whole seconds on
    Lustre, a skewed NFS server); otherwise a second edit within one tick (same size)
    would return the stale digest. Where that clock cannot be measured, nothing is
    remembered: the file is read at every build.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._memo: dict[str, tuple[tuple[int, int, int, int, int], _Scanned]] = {}

    def scan(self, path: str) -> _Scanned | None:
        """The file at ``path`` as read now; ``None`` if it is not a readable regular file."""
        try:
            st = os.stat(path)
        except (OSError, ValueError):
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        stamp = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        with self._lock:
            hit = self._memo.get(path)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        read_at = time.time()
        try:
            with open(path, "rb") as f:
                text = f.read()
        except OSError:
            return None
        scanned = _Scanned(hashlib.sha256(text).hexdigest(), (st.st_dev, st.st_ino), _scan(text))
        clock = fsclock.clock_for(path, st.st_dev)
        if clock is not None and max(st.st_mtime_ns, st.st_ctime_ns) / 1e9 < clock.since(read_at):
            with self._lock:
                self._memo[path] = (stamp, scanned)
        return scanned

    def digest(self, path: str) -> str | None:
        scanned = self.scan(path)
        return None if scanned is None else scanned.sha256


_MEMO = _DigestMemo()


class UncertainIncludes(Exception):
    """An ``#include`` that cannot be resolved for certain: nothing is cached for it."""


def find_include_deps(
    source: bytes | _Scan, include_path: Sequence[str], *, source_dir: str | None = None,
    source_dir_doubt: str | None = None, cxx: bool = True,
) -> tuple[IncludeDep, ...]:
    """Every file ``source`` includes, recursively, resolved as clang resolves it.

    ``#include "name"``: the including file's own folder first (for the source itself,
    ``source_dir``, where the compiler keeps the file it compiles; ``None``: none), then
    ``include_path`` in order. ``#include <name>``: ``include_path`` only. The first
    regular file found is the one hashed, whatever a later folder holds.

    ``cxx``: whether the compile may define ``__cplusplus`` (C++ for OpenCL, or an option
    that defines it); where not, an include in a branch only C++ compiles (``#ifdef
    __cplusplus``) is none.

    ``source_dir_doubt``: where it is not certain that the compiler, or the driver's own
    cache, takes a header from ``source_dir`` (rusticl, a driver not measured), an
    ``#include`` of the source found there that ``include_path`` alone would not find as
    the same file is uncertain, with this reason.

    Raises :class:`UncertainIncludes` where the scan cannot be sure (see :func:`scan_includes`)
    or a file is not found on that path (the compiler may find it elsewhere, and a stale
    header is a silently wrong result). Thread-safe.
    """
    found: dict[str, str] = {}
    seen: set[tuple[str, str]] = set()
    # Per file (device, inode): what it includes, and every folder it may count as in.
    files: dict[tuple[int, int], tuple[_Scan, set[str]]] = {}

    def resolve(quoted: bool, name: str, folder: str | None, where: str) -> tuple[str, str, _Scanned]:
        """(the path clang opens, its real path, the file) for one include."""
        first = (folder,) if quoted and folder is not None else ()
        for directory in (*first, *include_path):
            # The path as clang opens it (the OS resolves ".." after symbolic links, which
            # a realpath of a missing folder would not): a folder of that name is skipped.
            opened = os.path.join(directory, name)
            try:
                if stat.S_ISDIR(os.stat(opened).st_mode):
                    continue
            except OSError:
                continue
            real = os.path.realpath(opened)
            scanned = _MEMO.scan(real)
            if scanned is None:
                raise UncertainIncludes(f"#include {name!r} ({where}): {opened} is not a readable file")
            if first and directory == folder and where == "the source" and source_dir_doubt is not None:
                try:
                    alone = resolve(quoted, name, None, where)[1]
                except UncertainIncludes:
                    alone = None
                if alone != real:
                    raise UncertainIncludes(
                        f'#include "{name}" of the source is found in {folder}: {source_dir_doubt}')
            return opened, real, scanned
        raise UncertainIncludes(f"#include {name!r} ({where}) is not on the include path")

    todo: list[tuple[_Scan, str, str | None]] = [
        (source if isinstance(source, _Scan) else _scan(source), "the source", source_dir)]
    while todo:
        scan, where, folder = todo.pop()
        if scan.uncertain is not None:
            raise UncertainIncludes(f"{scan.uncertain} in {where}")
        if scan.defines_cxx and not cxx:  # a macro reaches every file after it: all count
            return find_include_deps(source, include_path, source_dir=source_dir,
                                     source_dir_doubt=source_dir_doubt, cxx=True)
        for quoted, raw in _names(scan, cxx):
            opened, real, scanned = resolve(quoted, raw.decode("utf-8", "surrogateescape"), folder, where)
            found[real] = scanned.sha256
            # Its own includes are looked up in the folder it was opened in, which for a
            # symbolic link is not the target's: both are tried (below).
            within = os.path.realpath(os.path.dirname(opened))
            folders = files.setdefault(scanned.ident, (scanned.scan, set()))[1]
            folders.update((within, os.path.dirname(real)))
            if (real, within) not in seen:
                seen.add((real, within))
                todo.append((scanned.scan, real, within))

    # A file reached under several names (symbolic or hard links): clang may take its
    # folder from any of them (clang 15 keeps the first name it met). Each must agree.
    for scan, folders in files.values():
        for quoted, raw in _names(scan, cxx):
            if quoted and len(folders) > 1:
                name = raw.decode("utf-8", "surrogateescape")
                if len({resolve(True, name, f, "a linked header")[1] for f in folders}) > 1:
                    raise UncertainIncludes(
                        f'#include "{name}" in a header reached through links resolves '
                        f"differently in its folders {sorted(folders)}"
                    )
    return tuple(IncludeDep(p, d) for p, d in sorted(found.items()))


def may_be_cxx(*option_strings: bytes) -> bool:
    """Whether a compile with these options (the user's, and those a driver adds) may define
    ``__cplusplus``: C++ for OpenCL (``-cl-std=CLC++``), or an option naming it."""
    return any(b"++" in t or b"__cplusplus" in t for t in option_strings)


def _names(scan: _Scan, cxx: bool) -> tuple[tuple[bool, bytes], ...]:
    return scan.names if cxx or scan.c_names is None else scan.c_names


#: Version of the include lookup rule: keys made under an older rule (which could hash a
#: file the compiler did not take) never match a key made now.
INCLUDE_RULE = 3


# Options that put files into the compile or move the search path where the scan cannot
# follow (pocl refuses most of them; another driver might not).
_SEARCH_OPTION_RE = re.compile(
    rb"(?:^|\s)(-{1,2}(?:include|imacros|isystem|iquote|idirafter|iprefix|iwithprefix\w*|isysroot|nostdinc\w*))"
)


def _check_search_options(*option_strings: bytes) -> None:
    for text in option_strings:
        m = _SEARCH_OPTION_RE.search(text)
        if m is not None:
            raise UncertainIncludes(f"the build option {m.group(1).decode(errors='replace')} changes "
                                    "which files are compiled")


class _Made:
    """The keys this process made, by everything a key is made of but what is read from
    files (includes), so that a repeated build (the same program in a new context: a test
    suite, a solver's next mesh) hashes nothing again. Only where the environment alone
    decides the settings (:attr:`.platform.Settings.from_environment`); the whole memo is
    dropped when the process's environment (:func:`.system.process_environ`, what the
    driver's ``getenv`` reads) changes in any way. A program that includes files has
    them looked up again (stats; contents by :data:`_MEMO`) and its key made again where
    any changed. Bounded; thread-safe."""

    MAX_KEYS = 4096
    #: Bytes of sources held (the keys of a code generator's thousands of programs).
    MAX_BYTES = 64 << 20

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._environ: object = None
        self._keys: OrderedDict[tuple[object, ...], tuple[KeyInfo, _Scan]] = OrderedDict()
        self._bytes = 0
        self._env_only: dict[int, bool] = {}  # device pointer -> its settings from_environment
        self._identities: dict[int, dict[str, str]] = {}  # device pointer -> device_identity
        #: device pointers -> settings_of, while the environment is the same (reset with it)
        self._settings: dict[tuple[int, ...], tuple[dict[str, str], str | None]] = {}

    @staticmethod
    def environ() -> object:
        # The environment the driver reads, not os.environ's copy (os.putenv and a C
        # setenv change only the former): one read of the C array's pointers.
        return system.environ_stamp()

    def env_only(self, devices: Sequence[cl.Device], pointers: tuple[int, ...]) -> bool:
        known = [self._env_only.get(p) for p in pointers]
        if None not in known:
            return all(known)
        ok = True
        for d, p in zip(devices, pointers, strict=True):
            platform = platforms.of_devices([d])
            record = None if platform is None else platform.settings
            here = record is None or record.from_environment
            self._env_only[p] = here
            ok = ok and here
        return ok

    def identities(self, devices: Sequence[cl.Device], pointers: tuple[int, ...]) -> tuple[dict[str, str], ...]:
        """:func:`device_identity` of each device, asked once a process (a device's fields
        are fixed while it exists)."""
        out = []
        for d, p in zip(devices, pointers, strict=True):
            known = self._identities.get(p)
            if known is None:
                known = self._identities[p] = device_identity(d)
            out.append(known)
        return tuple(out)

    def settings(self, devices: Sequence[cl.Device], pointers: tuple[int, ...],
                 environ: object) -> tuple[dict[str, str], str | None]:
        """:func:`settings_of` ``devices``, made again only when the environment changed
        (only for devices whose settings it alone decides: :meth:`env_only`)."""
        with self._lock:
            self._reset_if(environ)
            known = self._settings.get(pointers)
        if known is None:
            known = settings_of(devices)
            if environ == self.environ():
                with self._lock:
                    if environ == self._environ:
                        self._settings[pointers] = known
        return dict(known[0]), known[1]

    def _reset_if(self, environ: object) -> bool:
        # Under the lock: a new environment drops every key and setting made in the old one.
        if environ == self._environ:
            return False
        self._environ = environ
        self._keys.clear()
        self._settings.clear()
        self._bytes = 0
        return True

    def get(self, fingerprint: tuple[object, ...], environ: object) -> tuple[KeyInfo, _Scan] | None:
        with self._lock:
            if self._reset_if(environ):
                return None
            got = self._keys.get(fingerprint)
            if got is not None:
                self._keys.move_to_end(fingerprint)
            return got

    def put(self, fingerprint: tuple[object, ...], environ: object, info: KeyInfo, scan: _Scan,
            nbytes: int) -> None:
        if environ != self.environ():
            return  # the environment changed while the key was made: it may hold either
        with self._lock:
            if environ != self._environ:
                return
            if fingerprint not in self._keys:
                self._bytes += nbytes
            self._keys[fingerprint] = (info, scan)  # made again (a header changed): the new one
            self._keys.move_to_end(fingerprint)
            while self._keys and (len(self._keys) > self.MAX_KEYS or self._bytes > self.MAX_BYTES):
                old, _ = self._keys.popitem(last=False)
                self._bytes -= len(old[0])  # type: ignore[arg-type]

    def clear(self) -> None:
        with self._lock:
            self._keys.clear()
            self._settings.clear()
            self._bytes = 0
            self._env_only.clear()
            self._identities.clear()


_MADE = _Made()


def make_key(
    source: bytes,
    options: bytes,
    devices: Sequence[cl.Device],
    include_path: Sequence[str],
    *,
    kind: str = "binary",
    source_dir: str | None = None,
    source_dir_doubt: str | None = None,
) -> KeyInfo:
    """Compute the key of building ``source`` with ``options`` for ``devices``. Thread-safe.

    ``kind`` is what the entry holds (``binary``, or ``kcache``: pocl's kernel-cache files);
    entries of different kinds never share a key. ``source_dir`` is the folder of the file
    the compiler compiles (pocl's cache directory), searched first for the source's own
    ``#include "..."``, with ``source_dir_doubt`` (see :func:`find_include_deps`).

    A repeat (the same inputs in this process, the environment unchanged) takes the key
    made before, its includes looked up again (:class:`_Made`)."""
    # Absolute, not normalised: the OS resolves ".." after symbolic links, as for the compiler.
    try:
        cwd = os.getcwd()
    except OSError:
        cwd = ""  # gone: relative folders find nothing either way
    pointers = tuple(d.int_ptr for d in devices)
    environ = _MADE.environ()
    fingerprint = None
    env_only = _MADE.env_only(devices, pointers)
    if env_only:
        fingerprint = (source, kind, options, pointers, tuple(include_path), cwd, source_dir, source_dir_doubt,
                       FORMAT_VERSION, INCLUDE_RULE)
        made = _MADE.get(fingerprint, environ)
        if made is not None:
            info, scan = made
            if not scan.names:  # nothing read from a file: the same inputs, the same key
                return info
            again = include_deps(scan, options, include_path, cwd, source_dir=source_dir,
                                 source_dir_doubt=source_dir_doubt)
            if again == (info.deps, info.uncertain):
                return info
    scan = _scan(source)
    identities = _MADE.identities(devices, pointers)
    settings, uncertain = _MADE.settings(devices, pointers, environ) if env_only else settings_of(devices)
    deps: tuple[IncludeDep, ...] = ()
    if uncertain is None:
        deps, uncertain = include_deps(scan, options, include_path, cwd, source_dir=source_dir,
                                       source_dir_doubt=source_dir_doubt)
    source_sha = hashlib.sha256(source).hexdigest()
    key = key_of(devices, options, source_sha, [[d.path, d.sha256] for d in deps], kind=kind,
                 environment=settings, identities=identities)
    info = KeyInfo(key, identities, options, source_sha, deps, uncertain)
    if fingerprint is not None:
        _MADE.put(fingerprint, environ, info, scan, len(source))
    return info


def include_deps(
    source: bytes | _Scan, options: bytes, include_path: Sequence[str], cwd: str, *, source_dir: str | None,
    source_dir_doubt: str | None = None,
) -> tuple[tuple[IncludeDep, ...], str | None]:
    """(the includes, why they cannot be known for certain or ``None``) of building
    ``source`` (or its scan) with ``options`` in ``cwd``, under this process's driver
    settings: the key's rule, which a bake checks an entry against. Thread-safe."""
    path = tuple(os.path.join(cwd, d) for d in include_path)
    # A source that includes nothing (or whose includes are uncertain: raised below) looks in
    # no folder: no realpath (an lstat a component, on every build, in pocl's cache
    # directory, often on a network home directory).
    includes_none = isinstance(source, _Scan) and not source.names
    folder = None if source_dir is None or includes_none else os.path.realpath(source_dir)
    try:
        extra = platforms.extra_options(system.process_environ())
        _check_search_options(options, *extra)
        return find_include_deps(source, path, source_dir=folder, source_dir_doubt=source_dir_doubt,
                                 cxx=may_be_cxx(options, *extra)), None
    except UncertainIncludes as e:
        return (), str(e)


def key_of(
    devices: Sequence[cl.Device], options: bytes, source_sha256: str, includes: Sequence[Sequence[str]],
    *, kind: str = "binary", environment: Mapping[str, str] | None = None,
    identities: Sequence[Mapping[str, str]] | None = None,
) -> str:
    """The key of what :func:`make_key` found: with this process's pyopencl and settings
    (``environment``: :func:`code_settings` of ``devices`` unless given; ``asyncclcache
    bake`` asks whether it would build an entry's program the same)."""
    import pyopencl

    doc = {
        "format": FORMAT_VERSION,
        "pyopencl": pyopencl.VERSION_TEXT,
        "devices": tuple(device_identity(d) for d in devices) if identities is None else tuple(identities),
        "options": options.decode("utf-8", "surrogateescape"),
        "source_sha256": source_sha256,
        "includes": [list(i) for i in includes],
        "include_rule": INCLUDE_RULE,
        "environment": dict(code_settings(devices) if environment is None else environment),
    }
    if kind != "binary":
        doc["kind"] = kind
    blob = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("utf-8", "surrogateescape")
    return hashlib.sha256(blob).hexdigest()


def baked_key(key: str) -> str:
    """The key of the baked binary of the ``kcache`` entry ``key`` (``asyncclcache bake``)."""
    return hashlib.sha256(b"baked:" + key.encode()).hexdigest()
