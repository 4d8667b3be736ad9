"""Per-key claims: the non-blocking file lock that lets one process (rank) per key do the
work, and the probe that tells a stale lock file from a held one.

A claim is an ``flock`` (filelock), taken with ``timeout=0``: a process that finds it
held skips the key, never waits. The kernel releases it when its holder dies, so a
killed writer's claim expires with it. A claim removes its lock file while still
holding it, so lock files do not pile up. Thread- and process-safe.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from .fileio import NOFOLLOW, NONBLOCK

if TYPE_CHECKING:
    import filelock

# filelock is imported where a lock is taken (background threads, the command line), not
# at import: it pulls in asyncio and costs 7 ms here, 80 ms on a cold bytecode cache,
# which a warm start (about 40 ms in all) should not pay.

__all__ = ["LOCK_SUFFIX", "Claim", "take", "unheld"]

logger = logging.getLogger(__name__)

LOCK_SUFFIX = ".lock"

#: Serializes this process's claims with its sweep's probes: a probe takes each unheld
#: lock file for a moment, and must not do so between a claimer's creating the file and
#: locking it (the claimer would skip; observed with a sweep thread). Across processes
#: that window is microseconds; a probe landing in it costs one skipped write.
_probing = threading.Lock()
if hasattr(os, "register_at_fork"):  # a fork while another thread probed must not deadlock

    def _new_probing_lock() -> None:
        global _probing
        _probing = threading.Lock()

    os.register_at_fork(after_in_child=_new_probing_lock)


def take(key: str, lock_path: Path) -> Claim | None:
    """Claim ``key`` by locking ``lock_path`` without blocking; ``None`` if it is held."""
    import filelock

    lock = filelock.FileLock(str(lock_path), timeout=0, mode=0o600, thread_local=False)
    try:
        with _probing:
            lock.acquire()
    except filelock.Timeout:
        logger.debug("entry %s is claimed by another process: skip", key)
        return None
    return Claim(key, lock_path, lock)


def unheld(path: Path, *, remove: bool) -> bool:
    """True if nobody holds the lock file at ``path``; with ``remove``, unlink it too.

    Probes with its own ``flock`` on the existing file (a filelock would create a
    missing one) and unlinks while holding it, as :meth:`Claim.release` does.
    """
    try:
        fd = os.open(path, os.O_RDONLY | NOFOLLOW | NONBLOCK)
    except OSError:
        return False
    try:
        with _probing:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return False  # held
            try:
                if not os.path.samestat(os.lstat(path), os.fstat(fd)):
                    return False  # replaced meanwhile: that one is somebody's
                if remove:
                    os.unlink(path)
            except OSError:
                return False
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
            return True
    finally:
        os.close(fd)


class Claim:
    """A held per-key lock (see :meth:`Store.claim`). ``release()`` is idempotent."""

    def __init__(self, key: str, path: Path, lock: filelock.BaseFileLock) -> None:
        self.key = key
        self.path = path
        self._lock = lock
        self._released = False

    def release(self) -> None:
        """Remove the lock file (while still holding it, so none piles up) and unlock."""
        if self._released:
            return
        self._released = True
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        with contextlib.suppress(OSError, RuntimeError):
            self._lock.release()
