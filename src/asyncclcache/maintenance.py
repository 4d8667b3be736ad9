"""Keeping a cache directory in order: orphaned temp and lock files, full checks, the size
bound, clearing. Used by the cache's writer thread (size bound, sweep), the command line
(``verify``, ``prune``, ``clear``), and at exit for a node's copies of the entries
(:class:`~.nodecopies.NodeStorage`: ``sweep`` and ``prune``, fan-out trees as the store's).

Everything here is safe while other processes read and write the directory: entries
disappear atomically (readers see the whole entry or none), a held lock file is never
removed, a temp file is removed only when its writer is gone or it is too old, and two
evictors do not race (the second finds the prune lock held and returns).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .fileio import HOST, TEMP_PREFIX, TEMP_SUFFIX, temp_writer, unlink_if_same
from .locks import LOCK_SUFFIX, file_lock, unheld
from .store import PRUNE_LOCK
from .system import pid_alive

if TYPE_CHECKING:
    from .fileio import StoredEntry
    from .nodecopies import NodeStorage
    from .store import Store

    #: What is kept in order here: a cache directory's store, or the node's copies of
    #: entries (fan-out trees of the same temp, lock and prune-lock names).
    Tree = Store | NodeStorage

__all__ = ["TEMP_MAX_AGE", "PruneResult", "clear", "orphans", "prune", "sweep", "verify"]

logger = logging.getLogger(__name__)

#: A temp file whose writer is gone, or older than this, is swept.
TEMP_MAX_AGE = 3600.0


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
    if not store.enabled:
        return result
    import filelock

    lock = file_lock(store.root / PRUNE_LOCK, 0)
    try:
        lock.acquire()
    except (filelock.Timeout, OSError):
        return result
    try:
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
    finally:
        lock.release()
    if result.removed:
        logger.info("pruned %d entries (%d bytes) in %s", result.removed, result.freed, store.root)
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
