"""Per-key claims: the non-blocking file lock that lets one process (rank) per key do the
work, and the probe that tells a stale lock file from a held one.

A claim is our own ``flock`` on ``<key>.lock``, taken with ``LOCK_NB``: a process that
finds it held skips the key, never waits. The kernel releases it when its holder dies,
so a killed writer's claim expires with it. Thread- and process-safe.

Guarantee: at most one :class:`Claim` for a key is held at a time, across threads and
processes (on any filesystem where ``flock`` locks are shared between those processes).
Lock files do not pile up: a claim removes its file while still holding it, and a sweep
removes an unheld one while holding it. So a lock file is unlinked only by the holder of
the inode its path names, and whoever locks a file then checks that the path still names
that inode (if not, the file was released and removed between its ``open`` and its
``flock``; it is dropped and the path opened again). Without that check two processes
could both hold a key: one on the unlinked file, one on its replacement.

Claims do not use filelock, whose behaviour here changed between versions (3.12 to 3.20
lock an unlinked file; 3.21 added a link-count check).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .fileio import CLOEXEC, NOFOLLOW, NONBLOCK

__all__ = ["LOCK_SUFFIX", "Claim", "file_lock", "take", "unheld"]

logger = logging.getLogger(__name__)

LOCK_SUFFIX = ".lock"

#: How often :func:`take` opens the path again after locking a file that was removed
#: meanwhile. Each retry means another holder released the key just then; past this
#: many the key is busy, and is reported held.
ATTEMPTS = 8

#: ``flock`` errors that mean: another open file holds the lock.
_HELD = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)

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


def _lock(fd: int, path: Path) -> bool | None:
    """``flock`` ``fd`` without blocking; True if it is now held and ``path`` still names
    it, False if held by another, None if it was unlinked or replaced (released meanwhile)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in _HELD:
            return False
        raise
    try:
        st = os.fstat(fd)
        current = st.st_nlink > 0 and os.path.samestat(st, os.lstat(path))
    except FileNotFoundError:
        current = False
    return True if current else None


def wait_flock(fd: int, deadline: float, give_up: Callable[[float], bool] | None = None,
               max_pause: float = 0.05) -> bool | None:
    """``flock`` ``fd`` exclusively, polling with backoff (never a blocking ``flock``: a
    stopped holder would hold the caller forever) until ``deadline`` (``time.monotonic``).
    True: held; False: not by then (or ``flock`` failed); None: ``give_up(seconds waited)``
    said to stop waiting. For lock files that are never removed (no inode check)."""
    pause = 0.002
    start = time.monotonic()
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as e:
            if e.errno not in _HELD:
                return False
        now = time.monotonic()
        if give_up is not None and give_up(now - start):
            return None
        left = deadline - now
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, max_pause)


def take(key: str, lock_path: Path) -> Claim | None:
    """Claim ``key`` by locking ``lock_path`` without blocking; ``None`` if it is held.

    Raises ``OSError`` if the lock file cannot be opened or locked (not for a held lock).
    """
    for _ in range(ATTEMPTS):
        with _probing:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | NOFOLLOW | CLOEXEC | NONBLOCK, 0o600)
            try:
                got = _lock(fd, lock_path)
            except BaseException:
                os.close(fd)
                raise
            if got:
                return Claim(key, lock_path, fd)
            os.close(fd)  # held by another, or a removed file: ours was never the lock
            if got is False:
                break
    logger.debug("entry %s is claimed by another process: skip", key)
    return None


def unheld(path: Path, *, remove: bool) -> bool:
    """True if nobody holds the lock file at ``path``; with ``remove``, unlink it too.

    Probes with its own ``flock`` on the existing file (never creates one) and, like
    :meth:`Claim.release`, unlinks only while holding the file the path names.
    """
    try:
        fd = os.open(path, os.O_RDONLY | NOFOLLOW | CLOEXEC | NONBLOCK)
    except OSError:
        return False
    try:
        with _probing:
            try:
                if not _lock(fd, path):
                    return False  # held, or replaced meanwhile: that one is somebody's
                if remove:
                    os.unlink(path)
            except OSError:
                return False
            return True
    finally:
        os.close(fd)  # unlocks


class Claim:
    """A held per-key lock (see :meth:`Store.claim`). ``release()`` is idempotent and
    thread-safe; a claim dropped unreleased is released when collected."""

    def __init__(self, key: str, path: Path, fd: int) -> None:
        self.key = key
        self.path = path
        self._fds = [fd]  # popped once: a release racing another closes the fd only once
        self._pid = os.getpid()
        #: The store's stamp of the entry file last published under this claim (``None``:
        #: none); written by the store, read by the holder.
        self.written: tuple[int, ...] | None = None
        #: A claim released with this one (the node's, taken first: :meth:`.store.Store.claim`).
        self.also: Claim | None = None

    def release(self) -> None:
        """Remove the lock file (while still holding it, so none piles up) and unlock."""
        also, self.also = self.also, None
        if also is not None:
            also.release()
        try:
            fd = self._fds.pop()
        except IndexError:
            return
        try:
            # A forked child shares the parent's lock: it only closes its copy of the fd.
            if os.getpid() == self._pid:
                with contextlib.suppress(OSError):
                    if os.path.samestat(os.fstat(fd), os.lstat(self.path)):
                        os.unlink(self.path)
        finally:
            os.close(fd)  # unlocks (the last fd of the open file)

    def __del__(self) -> None:
        if self._fds:  # dropped unreleased: free the key, as filelock's own finalizer did
            with contextlib.suppress(Exception):
                self.release()


def file_lock(path: str | os.PathLike[str], timeout: float) -> Any:
    """A lock file that stays (``filelock.FileLock``, mode 0600): one writer at a time of a
    file shared by processes (the lifetime counters, a prune), never a per-key claim.
    Raises ``filelock.Timeout`` when busy past ``timeout`` seconds. Thread- and
    process-safe."""
    import filelock  # lazily: off the import path of a warm start

    return filelock.FileLock(str(path), timeout=timeout, mode=0o600)
