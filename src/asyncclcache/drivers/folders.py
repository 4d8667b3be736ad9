"""A driver cache of one folder per program (pocl's kernel cache), the mechanisms: finding
a build's folder, snapshots, whether a restore was used. Its names and layout are pocl's
record's (:data:`asyncclcache.platforms.pocl.LAYOUT`).

pocl keeps each program it builds in a folder of its own, with its bitcode, a file that
every build of the program touches, and a folder per kernel and variant launched; the
generic variant comes from binary queries (docs/design.md F15). Here: which
names an entry may hold (:func:`valid_file`), which folder a build touched
(:func:`candidates`, :func:`choose`, :func:`mark`/:func:`moved`), whether its launches
are done (:func:`ready`) and what a folder holds (:func:`folder_files`, :func:`listing`).
Used by the folder driver (:mod:`.kcache_folders`) and ``asyncclcache bake``.

Windows are in the file system's own time base (:class:`~asyncclcache.fsclock.FsClock`),
never ``time.time()`` against a file's stamp. Only what we may trust is read
(:mod:`.cachefiles`). Functions of the file system, no state: thread- and process-safe.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..fileio import InsecurePathError
from ..fsclock import FsClock
from ..platforms import pocl
from .base import Lost, Snapshot
from .cachefiles import MAX_ENTRY_BYTES, MAX_FILES, TMP_PREFIX, read_trusted, trusted_dir, untrusted

if TYPE_CHECKING:
    from .base import Job

__all__ = [
    "LAST_ACCESSED",
    "at_launch",
    "candidates",
    "choose",
    "entry_folders",
    "folder_files",
    "folders_per_build",
    "generic",
    "lacks",
    "listing",
    "mark",
    "moved",
    "narrow",
    "ready",
    "valid_file",
    "window",
]

logger = logging.getLogger(__name__)

_LAYOUT = pocl.LAYOUT
#: The file every build of the program touches (never stored).
LAST_ACCESSED = pocl.TOUCHED_FILE
_PROGRAM = pocl.PROGRAM_FILE
_GENERIC = pocl.GENERIC_PREFIX
#: Touches this much (plus a tick) before the end of our build belong to other builds.
CLOSE = 0.05


def valid_file(rel: str) -> bool:
    """True for ``XX/<hash>/<name>`` and ``XX/<hash>/<kernel>/<variant>/<name>``-like
    paths of pocl's kernel cache (:meth:`~asyncclcache.platform.Layout.valid`): plain
    names, no ``..``, no absolute path, no temp file of ours."""
    return _LAYOUT.valid(rel) and not rel.rsplit("/", 1)[-1].startswith(TMP_PREFIX)


def generic(rel: str) -> bool:
    """A file of a generic variant (``<kernel>/0-0-0.../``): made by a binary query (a bake)
    or unpacked from a binary, never by a launch; no launch needs it where the specialized
    variant is there."""
    parts = rel.split("/")
    return len(parts) >= 5 and parts[3].startswith(_GENERIC)


def at_launch(rel: str) -> bool:
    """A file of a kernel's variant (``XX/<hash>/<kernel>/<variant>/<name>``), which pocl
    reads at the kernel's launch; the build reads only the program's own files (its bitcode)."""
    return rel.count("/") > _LAYOUT.depth


def missing(held: Iterable[str], files: Iterable[str]) -> Iterator[str]:
    """The files of ``files`` that a launch needs and ``held`` lacks (a generic variant is
    never needed: :func:`generic`)."""
    have = set(held)
    return (f for f in files if f not in have and not generic(f))


def lacks(held: Iterable[str], files: Iterable[str]) -> bool:
    """Some file of ``files`` that a launch needs is not in ``held``. A refresh, a baked
    binary's freshness and a bake ask it."""
    return next(missing(held, files), None) is not None


def entry_folders(files: Sequence[str]) -> list[str]:
    """The program folders (``XX/hash``) that ``files`` belong to, in order."""
    return list(dict.fromkeys("/".join(f.split("/")[:2]) for f in files))


# {{{ finding a build's folder


def _program_folders(root: Path, new_since: float | None = None) -> Iterator[tuple[str, float]]:
    """``(XX/hash, stamp of last_accessed)`` of every program folder: one walk of two levels.

    With ``new_since`` (a stamp), only folders created or changed since then, found
    without a stat per folder: a new folder changes its ``XX`` directory's stamp, a
    touch does not.
    """
    try:
        with os.scandir(root) as it:
            tops = list(it)
    except OSError:
        return
    for top in tops:
        try:
            if not (len(top.name) == 2 and top.is_dir(follow_symlinks=False)):
                continue
            if new_since is not None and top.stat(follow_symlinks=False).st_mtime < new_since:
                continue
            with os.scandir(top.path) as it:
                programs = list(it)
        except OSError:
            continue
        for p in programs:
            try:
                if new_since is not None and p.stat(follow_symlinks=False).st_mtime < new_since:
                    continue
                st = os.stat(os.path.join(p.path, LAST_ACCESSED), follow_symlinks=False)
            except OSError:
                continue
            yield f"{top.name}/{p.name}", st.st_mtime


def _kernel_dirs(root: Path, folder: str) -> set[str] | None:
    try:
        with os.scandir(root / folder) as it:
            return {e.name for e in it if e.is_dir(follow_symlinks=False)}
    except OSError:
        return None


def candidates(
    root: Path, windows: Sequence[tuple[float, float]], *, new_only: bool = False
) -> list[tuple[tuple[str, float], ...]]:
    """For each window ``(lo, hi)`` of stamps (:class:`FsClock`), the folders touched in
    it, with the stamp (one scan for all). None inside: those touched later (the same
    program built again since).

    ``new_only``: look at folders created or changed since the oldest window only (cheap
    on a large kernel cache); a build that pocl served from an older folder needs the
    full scan.
    """
    if not windows:
        return []
    oldest = min(w[0] for w in windows)
    seen = [(rel, m) for rel, m in _program_folders(root, oldest if new_only else None) if m >= oldest]
    out = []
    for lo, hi in windows:
        inside = [(rel, m) for rel, m in seen if lo <= m <= hi]
        out.append(tuple(inside or [(rel, m) for rel, m in seen if m >= lo]))
    return out


def choose(
    root: Path, found: Sequence[tuple[str, float]], kernels: Sequence[str], end: float,
    tick: float, *, most: int = 1,
) -> tuple[str, ...]:
    """The build's own folder(s) among its candidates ``found``; ``()`` when none, or more
    than ``most`` (one per kind of device) are left: then nothing is stored.

    * A folder of another user, or one whose ``XX`` parent is, is never ours.
    * A launch makes ``<kernel>/`` folders: a folder with kernels the program lacks is
      another program's.
    * pocl touches ``last_accessed`` as the build returns: a touch well before ``end``
      (the stamp of the build's end, :meth:`FsClock.until`) was a build that ran meanwhile.
      The touch closest to our build's end is never dropped.
    """
    pool = narrow(root, found, kernels, end, tick)
    return pool if 0 < len(pool) <= most else ()


def narrow(
    root: Path, found: Sequence[tuple[str, float]], kernels: Sequence[str], end: float, tick: float,
) -> tuple[str, ...]:
    """The candidates that :func:`choose` keeps, however many (sorted)."""
    names = set(kernels)
    pool = []
    for f, m in found:
        if not (trusted_dir(root / f.split("/")[0]) and trusted_dir(root / f)):
            continue
        dirs = _kernel_dirs(root, f)
        if dirs is not None and dirs <= names:
            pool.append((f, m))
    near = [(f, m) for f, m in pool if m >= end - 2 * tick - CLOSE]
    return tuple(sorted(f for f, _ in near or pool))


def folders_per_build(job: Job) -> int:
    """How many folders one build of ``job`` makes: one per kind of device."""
    # Devices of one kind share a folder; several kinds, one folder each.
    return max(1, len({tuple(sorted(d.items())) for d in job.info.devices}))


def window(clock: FsClock, job: Job) -> tuple[float, float]:
    """The stamps a touch inside ``job``'s build can carry."""
    return clock.since(job.built_from), clock.until(job.built_to)


def ready(root: Path, folders: Sequence[str], kernels: Sequence[str], since: float) -> bool:
    """Every kernel of the program has a variant compiled at or after stamp ``since`` in
    one of ``folders`` (the first launches are done; older variants were there before)."""
    if not kernels:
        return False
    for folder in folders:
        have = _kernel_dirs(root, folder) or set()
        if all(k in have and _new_variant(root / folder / k, k, since) for k in kernels):
            return True
    return False


def _new_variant(kdir: Path, kernel: str, since: float) -> bool:
    # The compiled file of a variant: its name depends on the release (the layout's record);
    # files written before it (pocl 7.1's parallel.bc) do not count.
    try:
        with os.scandir(kdir) as variants:
            for v in variants:
                with contextlib.suppress(OSError), os.scandir(v.path) as files:
                    for f in files:
                        if (f.name.startswith(f"{kernel}.") and not f.name.endswith(_LAYOUT.unfinished)
                                and f.stat(follow_symlinks=False).st_mtime >= since):
                            return True
    except OSError:
        pass
    return False


# }}}

# {{{ snapshot


def _walk(root: Path, folder: str) -> Iterator[tuple[str, str]]:
    """``(relative path, absolute path)`` of the folder's regular files, no links
    followed. Raises :class:`InsecurePathError` at a directory we must not trust."""
    stack = [folder]
    while stack:
        rel_dir = stack.pop()
        why = untrusted(os.lstat(root / rel_dir))
        if why is not None:
            raise InsecurePathError(f"{rel_dir} in pocl's kernel cache is {why}")
        with os.scandir(root / rel_dir) as it:
            for e in it:
                rel = f"{rel_dir}/{e.name}"
                if e.is_dir(follow_symlinks=False):
                    stack.append(rel)
                elif e.is_file(follow_symlinks=False) and e.name != LAST_ACCESSED and valid_file(rel):
                    yield rel, e.path


def listing(root: Path, folders: Sequence[str]) -> frozenset[str]:
    """The files of ``folders`` now (for a refresh: did a folder gain one?)."""
    out: set[str] = set()
    for folder in folders:
        with contextlib.suppress(OSError):
            out.update(rel for rel, _ in _walk(root, folder))
    return frozenset(out)


def folder_files(root: Path, folders: Sequence[str]) -> Snapshot:
    """Read every file of ``folders`` (pocl renames its files into place: never partial).

    Only what we may trust (:func:`untrusted`) and at most :data:`MAX_FILES` files and
    :data:`MAX_ENTRY_BYTES`; a folder that breaks a rule is left out, as is one removed
    under us. :class:`Lost` if none is left.
    """
    files: list[str] = []
    blobs: list[bytes] = []
    kept: list[str] = []
    why = "is gone"
    budget = MAX_ENTRY_BYTES
    for folder in folders:
        try:
            if not trusted_dir(root / folder.split("/")[0]):
                raise InsecurePathError(f"{folder.split('/')[0]} in pocl's kernel cache is not ours")
            data: list[tuple[str, bytes]] = []
            for rel, path in list(_walk(root, folder)):
                if len(files) + len(data) >= MAX_FILES:
                    raise Lost(f"more than {MAX_FILES} files")
                blob = read_trusted(path, budget)
                budget -= len(blob)
                data.append((rel, blob))
        except (InsecurePathError, Lost) as e:
            why = f"was refused: {e}"
            logger.warning("asyncclcache: not storing pocl's kernel-cache folder %s: %s", folder, e)
            continue
        except OSError:
            continue  # removed or replaced meanwhile
        if not any(rel.endswith(f"/{_PROGRAM}") for rel, _ in data):
            continue
        kept.append(folder)
        for rel, blob in data:
            files.append(rel)
            blobs.append(blob)
    if not kept:
        raise Lost(f"pocl's kernel-cache folder {', '.join(folders)} {why}")
    return Snapshot(blobs, files)


# }}}

# {{{ whether pocl used a restore


def mark(root: Path, folder: str) -> os.stat_result | None:
    """Before a build: the stamp of the folder's ``last_accessed``, set back by a few
    seconds first where it is ours, so that pocl's touch moves it even on a file system
    with 1-second stamps. ``None`` if there is none (a new node: pocl creates it)."""
    path = root / folder / LAST_ACCESSED
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if untrusted(st) is None:
        with contextlib.suppress(OSError):
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns - 4_000_000_000), follow_symlinks=False)
            st = os.lstat(path)
    return st


def moved(root: Path, folder: str, before: os.stat_result | None) -> bool:
    """After a build: did pocl touch the folder since :func:`mark` (no clock involved)?"""
    try:
        st = os.lstat(root / folder / LAST_ACCESSED)
    except OSError:
        return False
    return before is None or (st.st_ino, st.st_mtime_ns) != (before.st_ino, before.st_mtime_ns)


# }}}
