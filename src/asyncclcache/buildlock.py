"""One build of a program at a time among the processes that share pocl's kernel cache.

pocl before 6.0 removes a program's cached files before it writes them again
(``pocl_write_file``; pocl#1480, fixed in 6.0), so a process that builds a program while
another builds the same one in the same ``POCL_CACHE_DIR`` fails ``clBuildProgram``
(docs/design.md F32). pocl's default, ``~/.cache/pocl/kcache``, is shared by every process
of a user on a node: every MPI rank, every pytest-xdist worker.

So every pocl build that goes through asyncclcache first takes an exclusive ``flock`` on
one of :data:`STRIPES` lock files beside that directory (``<it>.asyncclcache-builds/XXX.lock``:
pocl's own folder holds pocl's files only; chosen by a digest of the source and options),
and holds it for the build alone: no user
code runs under it, so a rank that waits can never wait on one that sits in an MPI
collective. The ranks of a node then build a program one after the other, and all but the
first find pocl's ``program.bc``: pocl's front end runs once a node. Processes with pocl
caches of their own lock files of their own and never wait for each other. A holder that
is killed releases the lock with its death (the kernel's); one that is stopped is waited
for :data:`WAIT` seconds at most, then the build goes ahead. Where the folder cannot be
made or is not the user's own, nothing is locked (pocl's build as before).

The lock files are never removed (at most :data:`STRIPES`, empty): a file that never goes
away needs none of the inode checks of :mod:`.locks`. Thread- and process-safe.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import stat
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .fileio import CLOEXEC, NOFOLLOW, NONBLOCK, insecure
from .locks import LOCK_SUFFIX, wait_flock
from .platforms import pocl

if TYPE_CHECKING:
    import pyopencl as cl

__all__ = ["FOLDER_SUFFIX", "STRIPES", "WAIT", "lock_folder", "lock_path", "one_at_a_time"]

logger = logging.getLogger(__name__)

#: The folder of the lock files: pocl's kernel cache directory's name and this, beside it.
FOLDER_SUFFIX = ".asyncclcache-builds"
#: Lock files at most: programs whose digests share the first three hex digits are built
#: one at a time too (a wait, never a wrong result).
STRIPES = 4096
#: Seconds a build waits at most for another process's build of the same program.
WAIT = 60.0

_lock = threading.Lock()
_pocl: dict[tuple[int, ...], bool] = {}  # device pointers -> all of pocl's
_folders: dict[Path, Path | None] = {}  # pocl's cache directory -> its lock folder (None: none)
_told = False


def _all_pocl(devices: Sequence[cl.Device]) -> bool:
    ids = tuple(d.int_ptr for d in devices)
    known = _pocl.get(ids)
    if known is None:
        known = _pocl[ids] = all(d.platform.name == pocl.NAME for d in devices)
    return known


def _folder(pocl_dir: Path) -> Path | None:
    with _lock:
        if pocl_dir in _folders:
            return _folders[pocl_dir]
    folder = lock_folder(pocl_dir)
    try:
        try:
            st = os.lstat(folder)  # there already, mostly: one call
        except FileNotFoundError:
            with contextlib.suppress(FileExistsError):
                os.mkdir(folder, 0o700)
            st = os.lstat(folder)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return None  # pocl has not made its directory yet: again at the next build
        st = None
    why = "not a folder" if st is not None and not stat.S_ISDIR(st.st_mode) else None
    why = why or (insecure(st) if st is not None else "it cannot be made")
    if why is not None:
        logger.info("asyncclcache: builds in pocl's cache %s are not serialized: %s is %s",
                    pocl_dir, folder, why)
    with _lock:
        return _folders.setdefault(pocl_dir, None if why else folder)


def lock_folder(pocl_dir: Path) -> Path:
    """The folder of the lock files of pocl's kernel cache directory ``pocl_dir``."""
    return pocl_dir.with_name(pocl_dir.name + FOLDER_SUFFIX)


def lock_path(pocl_dir: Path, source: bytes, options: object) -> Path:
    """The lock file of ``source`` built with ``options`` (as ``build()`` was given them)
    for pocl's kernel cache directory ``pocl_dir``."""
    stripe = hashlib.sha256(source + b"\0" + repr(options).encode()).hexdigest()[:3]
    return lock_folder(pocl_dir) / f"{stripe}{LOCK_SUFFIX}"


@contextlib.contextmanager
def one_at_a_time(devices: Sequence[cl.Device], source: bytes, options: object) -> Iterator[None]:
    """Hold the build lock of ``source`` built with ``options`` for ``devices`` (pocl's,
    with its kernel cache on; else nothing is held) for the block. Never raises for the
    lock: one that cannot be taken within :data:`WAIT` seconds, or at all, is built without."""
    global _told
    pocl_dir = pocl.kernel_cache_dir() if _all_pocl(devices) else None
    folder = None if pocl_dir is None else _folder(pocl_dir)
    if pocl_dir is None or folder is None:
        yield
        return
    fd = None
    try:
        flags = os.O_RDWR | os.O_CREAT | NOFOLLOW | CLOEXEC | NONBLOCK
        fd = os.open(lock_path(pocl_dir, source, options), flags, 0o600)
        if not stat.S_ISREG(os.fstat(fd).st_mode) or not wait_flock(fd, time.monotonic() + WAIT):
            if not _told:
                _told = True
                logger.warning("asyncclcache: another process held the build lock of a program in %s "
                               "for %.0f s (stopped?); building without it", pocl_dir, WAIT)
            os.close(fd)
            fd = None
    except OSError as e:
        logger.debug("asyncclcache: no build lock in %s: %s", folder, e)
        if fd is not None:
            os.close(fd)
            fd = None
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock
