"""Keeping a cache directory in order: orphaned temp and lock files, full checks, the size
bound, clearing. Used by the cache's writer thread (:func:`upkeep`, at most once an interval
a directory), the command line (``verify``, ``prune``, ``clear``), and at exit for a node's
copies of the entries (:class:`~.nodecopies.NodeStorage`: ``sweep`` and ``prune``, fan-out
trees as the store's).

The upkeep of a shared directory lists it whole: on a parallel file system every file is a
metadata request. So no process lists it on its way, as thousands of ranks would at once.
The first write of a process stats one stamp file (:data:`~.shared.UPKEEP_FILE`):
only where it is older than :data:`UPKEEP_INTERVAL` (or missing), or where the size it
measured plus what this process wrote since crosses the bound, does a process take the
non-blocking prune lock and keep the directory in order (sweep, fold the lifetime counters,
prune to the bound), then write the stamp with the size it measured. Others go on.

Everything here is safe while other processes read and write the directory: entries
disappear atomically (readers see the whole entry or none), a held lock file is never
removed, a temp file is removed only when its writer is gone or it is too old, and two
evictors do not race (the second finds the prune lock held and returns).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .fileio import (
    HOST,
    TEMP_PREFIX,
    TEMP_SUFFIX,
    atomic_write,
    read_small,
    temp_writer,
    unlink_if_same,
)
from .locks import LOCK_SUFFIX, file_lock, unheld
from .shared import PRUNE_LOCK, UPKEEP_FILE
from .system import pid_alive

if TYPE_CHECKING:
    from typing import TypeAlias

    from .fileio import StoredEntry
    from .nodecopies import NodeStorage
    from .store import Store

    #: What is kept in order here: a cache directory's store, or the node's copies of
    #: entries (fan-out trees of the same temp, lock and prune-lock names).
    Tree: TypeAlias = Store | NodeStorage

__all__ = [
    "TEMP_MAX_AGE", "UPKEEP_INTERVAL", "PruneResult", "Upkept", "clear", "last_upkeep", "orphans", "prune",
    "sweep", "upkeep", "verify",
]

logger = logging.getLogger(__name__)

#: A temp file whose writer is gone, or older than this, is swept.
TEMP_MAX_AGE = 3600.0
#: A directory is kept in order at most this often by the processes that write to it
#: (seconds; ``asyncclcache prune`` any time).
UPKEEP_INTERVAL = 3600.0


@dataclass
class PruneResult:
    """What :func:`prune` did."""

    ran: bool = False  # False: another process was pruning, or the store is unusable
    removed: int = 0
    freed: int = 0
    remaining: int = 0


def orphans(store: Tree, *, remove_locks: bool = False) -> tuple[list[Path], list[Path]]:
    """Temp files whose writer is gone (or too old), directories under a temp name (moved
    aside from an entry's place: no writer's), and lock files nobody holds; with
    ``remove_locks``, those lock files are removed as they are found."""
    temps: list[Path] = []
    locks: list[Path] = []
    now = time.time()
    expired = getattr(store, "expired", None)  # a node's records of what it saw, once stale
    for p, name in store.files():
        if name.startswith(TEMP_PREFIX) and name.endswith(TEMP_SUFFIX):
            host, pid = temp_writer(name)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                temps.append(p)
                continue
            age = now - st.st_mtime
            # Another host's writer (a shared directory): our PIDs say nothing of it.
            alive = (pid is not None and pid_alive(pid)) if host == HOST else True
            if not alive or age > TEMP_MAX_AGE:
                temps.append(p)
        elif name.endswith(LOCK_SUFFIX) and unheld(p, remove=remove_locks):
            locks.append(p)
        elif expired is not None and expired(p, name):
            temps.append(p)
    return temps, locks


def verify(store: Store, *, fix: bool = False) -> list[tuple[StoredEntry, str]]:
    """Fully check every entry (format, checksum, key); returns ``(entry, problem)`` for
    the bad ones, removed when ``fix``. Safe while others read and write."""
    bad: list[tuple[StoredEntry, str]] = []
    for e in store.entries():
        r = store.read(e.key)
        if r.problem is None:
            continue
        bad.append((e, r.problem))
        if fix:  # links and planted files included: our directory, our names
            unlink_if_same(e.path, r.stat)
    return bad


def prune(store: Tree, *, max_size: int | None = None, older_than: float | None = None) -> PruneResult:
    """Evict least recently used entries until the total is at most ``max_size`` bytes,
    and every entry unused for ``older_than`` seconds.

    Safe while other processes read and write: an entry disappears atomically, and a
    second evictor that finds the prune lock held returns at once (``ran=False``).
    """
    result = PruneResult()
    with _held(store) as held:
        if held:
            _prune(store, result, max_size, older_than)
    return result


@contextlib.contextmanager
def _held(store: Tree) -> Iterator[bool]:
    """The prune lock of ``store``, taken without waiting: True while held."""
    if not store.enabled:
        yield False
        return
    import filelock

    lock = file_lock(store.root / PRUNE_LOCK, 0)
    try:
        lock.acquire()
    except (filelock.Timeout, OSError):
        yield False
        return
    try:
        yield True
    finally:
        lock.release()


def _prune(store: Tree, result: PruneResult, max_size: int | None, older_than: float | None) -> None:
    """:func:`prune`, under the prune lock."""
    result.ran = True
    entries = sorted(store.entries(), key=lambda e: max(e.atime, e.mtime))
    total = sum(e.size for e in entries)
    cutoff = None if older_than is None else time.time() - older_than
    for e in entries:
        too_old = cutoff is not None and max(e.atime, e.mtime) < cutoff
        too_big = max_size is not None and total > max_size
        if not (too_old or too_big):
            continue
        try:
            os.unlink(e.path)
        except FileNotFoundError:
            pass
        except OSError:
            continue
        total -= e.size
        result.removed += 1
        result.freed += e.size
    result.remaining = total
    if result.removed:
        logger.info("pruned %d entries (%d bytes) in %s", result.removed, result.freed, store.root)


@dataclass(frozen=True)
class Upkept:
    """What the stamp of a directory's last upkeep says: whether another is due now (older
    than the interval by this host's clock, far in its future, or none), and the bytes of
    its entries then (``None``: not known)."""

    due: bool
    bytes: int | None
    mtime_ns: int | None = None


def last_upkeep(store: Store, *, want_size: bool = False) -> Upkept:
    """The stamp of ``store``'s last :func:`upkeep`: one ``lstat`` (and one read of a few
    bytes where ``want_size``). A clock that is off makes an upkeep early or late, never
    wrong: every step of it is safe at any time."""
    path = store.root / UPKEEP_FILE
    try:
        st = os.lstat(path)
    except OSError:
        return Upkept(True, None)
    age = time.time() - st.st_mtime
    due = not (-UPKEEP_INTERVAL < age < UPKEEP_INTERVAL)
    size = None
    if want_size:
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            value = json.loads(read_small(path, 4096) or b"").get("bytes")
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                size = value
    return Upkept(due, size, st.st_mtime_ns)


def upkeep(store: Store, *, max_size: int | None = None, older_than: float | None = None,
           seen: Upkept | None = None, wrote: int = 0) -> PruneResult:
    """Keep ``store`` in order, by one process at a time (the prune lock, not waited for):
    sweep orphans, fold the lifetime counters' additions, prune to ``max_size`` (and what
    is unused for ``older_than`` seconds: :func:`prune`), and stamp it with the size
    measured. Skipped (``ran=False``) where another process holds the lock, or kept the
    directory in order since the caller looked (``seen``) and left it under the bound with
    the ``wrote`` bytes the caller wrote since. Safe at any time, and while others read
    and write."""
    from .stats import fold_lifetime

    result = PruneResult()
    if store.read_only:
        return result
    with _held(store) as held:
        if not held:
            return result
        now = last_upkeep(store, want_size=True)
        if seen is not None and now.mtime_ns != seen.mtime_ns and not now.due and (
                max_size is None or (now.bytes is not None and now.bytes + wrote <= max_size)):
            return result  # another process just did it
        sweep(store)
        fold_lifetime(store.root)
        _prune(store, result, max_size, older_than)
        with contextlib.suppress(OSError):
            data = json.dumps({"bytes": result.remaining, "at": time.time()}).encode()
            atomic_write(store.root, store.root / UPKEEP_FILE, data, durable=False)
    return result


def clear(store: Store) -> int:
    """Remove every entry (and orphaned temp and lock files); returns the entry count."""
    n = 0
    for e in store.entries():
        with contextlib.suppress(OSError):
            os.unlink(e.path)
            n += 1
    sweep(store)
    return n


def sweep(store: Tree) -> int:
    """Remove orphaned temp and lock files; returns how many. Safe to run anytime."""
    if store.read_only:
        return 0
    temps, locks = orphans(store, remove_locks=True)
    n = len(locks)
    for p in temps:
        try:
            if stat.S_ISDIR(os.lstat(p).st_mode):
                shutil.rmtree(p)  # follows no link
            else:
                os.unlink(p)
            n += 1
        except OSError:
            pass
    if n:
        logger.info("swept %d orphaned temp/lock files in %s", n, store.root)
    return n
