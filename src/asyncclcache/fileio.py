"""File safety: what every module that touches the cache directory uses.

Entries are native code that pocl ``dlopen``\\ s, so nothing is read from, or written
into, a place another user could have prepared: directories are made 0700 and checked
(owner, no group/other write, not a link), files are opened without following links
(and without blocking on a planted FIFO), and writes are atomic and durable (temp file
in the same directory, ``fsync``, ``os.replace``, ``fsync`` of the directory).

Pure functions; thread- and process-safe.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from .errors import InsecurePathError

__all__ = [
    "CLOEXEC",
    "HOST",
    "NOFOLLOW",
    "NONBLOCK",
    "TEMP_PREFIX",
    "TEMP_SUFFIX",
    "InsecurePathError",
    "StoredEntry",
    "atomic_write",
    "atomic_writer",
    "fanout_dirs",
    "fanout_files",
    "hex_dirs",
    "insecure",
    "listed",
    "make_private_dir",
    "nofollow_opener",
    "read_small",
    "temp_prefix",
    "temp_writer",
    "unlink_if_same",
]

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# A FIFO planted where an entry should be would block open() for reading forever.
NONBLOCK = getattr(os, "O_NONBLOCK", 0)
TEMP_PREFIX = ".tmp-"
TEMP_SUFFIX = ".partial"
#: This host in temp names (a digest: host names may hold any character), so that a sweep
#: judges by PID only the temp files written on this host.
HOST = hashlib.sha256(socket.gethostname().encode("utf-8", "surrogateescape")).hexdigest()[:8]


def insecure(st: os.stat_result, *, private_group_ok: bool = False) -> str | None:
    """Why a file or directory with this ``lstat``/``fstat`` must not be trusted, or ``None``.

    ``private_group_ok``: the write bit of the user's private group (only the user in
    it, as umask 002 set-ups make pocl's files) is the user's own."""
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not {os.geteuid()}"
    # The group's name looked up only where its write bit is set (not on a umask-022 system).
    if st.st_mode & stat.S_IWOTH or (st.st_mode & stat.S_IWGRP
                                     and not (private_group_ok and _private_group(st.st_gid))):
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
        # A hard link made elsewhere (by whoever could write there) into our directory.
        return f"has {st.st_nlink} hard links"
    return None


_private_groups: dict[int, bool] = {}


def _private_group(gid: int) -> bool:
    if gid not in _private_groups:
        import grp
        import pwd

        try:
            g = grp.getgrgid(gid)
            me = pwd.getpwuid(os.geteuid()).pw_name
            _private_groups[gid] = gid == os.getegid() and set(g.gr_mem) <= {me} and g.gr_name == me
        except (KeyError, OSError):
            _private_groups[gid] = False
    return _private_groups[gid]


def make_private_dir(path: Path, *, follow: bool = False) -> None:
    """``mkdir`` 0700 if missing, then check it: ours, not group/other-writable, and (unless
    ``follow``) not a link. Raises :class:`InsecurePathError` or ``OSError``. One ``stat``
    where it is there (no ``mkdir``: each is a metadata request on a shared file system)."""
    try:
        st = os.stat(path) if follow else os.lstat(path)
    except FileNotFoundError:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        st = os.stat(path) if follow else os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise InsecurePathError(f"{path} is a symbolic link")
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(path))
    why = insecure(st)
    if why is not None:
        raise InsecurePathError(f"{path} is {why}")


def unlink_if_same(path: Path, st: os.stat_result | None) -> None:
    """Remove ``path`` (a directory too) if it is still the file ``st`` describes (any file
    for ``None``): a writer may have replaced a bad file with a good one meanwhile."""
    try:
        now = os.lstat(path)
        if st is not None and (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev):
            return
        if stat.S_ISDIR(now.st_mode):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except OSError:
        pass


def nofollow_opener(path: str, flags: int) -> int:
    """An ``opener`` for :func:`open` that follows no link and never blocks on a FIFO."""
    return os.open(path, flags | NOFOLLOW | CLOEXEC | NONBLOCK)


def temp_prefix() -> str:
    """Prefix of this process's temp files: host digest and PID, for the sweep."""
    return f"{TEMP_PREFIX}{HOST}-{os.getpid()}-"


def temp_writer(name: str) -> tuple[str | None, int | None]:
    """(host digest, pid) of a temp file's writer; host ``None`` for an unknown layout."""
    parts = name[len(TEMP_PREFIX) :].split("-")
    if len(parts) >= 3 and len(parts[0]) == 8 and parts[1].isdigit():
        return parts[0], int(parts[1])
    if parts and parts[0].isdigit():  # written before host digests: treat as this host's
        return HOST, int(parts[0])
    return None, None


@contextlib.contextmanager
def atomic_writer(
    directory: Path, target: Path, *, prefix: str | None = None, on_open: Callable[[str], None] | None = None,
    durable: bool = True,
) -> Iterator[BinaryIO]:
    """A file to write ``target`` through: readers see the old file or the whole new one,
    mode 0600, durable once the block ends (``durable=False``: not synced, for scratch
    copies whose damage a checksum catches). On an error in the block the temp file is
    removed and nothing changes. ``directory`` holds ``target`` (same filesystem).
    ``on_open(temp_path)`` runs first (tests widen the window with it)."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=prefix or temp_prefix(), suffix=TEMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:  # owns fd from here: closed on any error
            if on_open is not None:
                on_open(tmp)
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        _commit(directory, tmp, target, durable)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_all(fd: int, data: bytes) -> None:
    """``data`` written to ``fd`` with plain ``write`` calls (no buffered file object: its
    ``fstat``, ``ioctl`` and ``lseek`` are requests on a shared file system too)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def atomic_write(
    directory: Path, target: Path, data: bytes, write_hook: Callable[[str], None] | None = None,
    *, durable: bool = True,
) -> None:
    """:func:`atomic_writer` for ``data``, written with plain ``write`` calls (a buffered
    file object adds an ``fstat``, ``ioctl`` and ``lseek``: requests on a shared file
    system). Raises ``OSError`` after removing its temp file. ``write_hook(temp_path)``
    runs before the data is written (tests widen the window)."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=temp_prefix(), suffix=TEMP_SUFFIX)
    try:
        try:
            if write_hook is not None:
                write_hook(tmp)
            write_all(fd, data)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        _commit(directory, tmp, target, durable)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _commit(directory: Path, tmp: str, target: Path, durable: bool) -> None:
    # The temp file, written and closed, becomes ``target``; durable: the rename too.
    os.chmod(tmp, 0o600)
    os.replace(tmp, target)
    if not durable:
        return
    with contextlib.suppress(OSError):
        dfd = os.open(directory, os.O_RDONLY | CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


# {{{ listing a fan-out tree (a cache directory's entries, a node's copies of them)


@dataclass(frozen=True)
class StoredEntry:
    """A file as listed in a fan-out tree: an entry, or a node's copy of one (no validation);
    ``key`` is its name less the suffix."""

    key: str
    path: Path
    size: int
    mtime: float
    atime: float


def hex_dirs(root: Path, digits: int) -> Iterator[Path]:
    """The directories (not links) under ``root`` named by ``digits`` hex digits, in order."""
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return
    for name in names:
        if len(name) == digits and all(c in "0123456789abcdef" for c in name):
            p = root / name
            if p.is_dir() and not p.is_symlink():
                yield p


def fanout_dirs(root: Path) -> Iterator[Path]:
    """The ``XX/`` directories (two hex digits; not links) under ``root``."""
    return hex_dirs(root, 2)


def read_small(path: Path, limit: int) -> bytes | None:
    """At most ``limit`` bytes of the regular file at ``path`` (no link followed, no
    buffered file object; a FIFO, device or socket in its place is not read, and never
    blocks); ``None`` where it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | NOFOLLOW | CLOEXEC | NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def read_own(path: Path, *, limit: int | None = None, fresh_for: float | None = None) -> bytes | None:
    """The bytes of our own regular file at ``path`` (no link followed, never blocking on a
    FIFO; another user's or a group-writable file is not read); with ``limit``, only a file
    of at most that many bytes; with ``fresh_for``, only one written less than that many
    seconds ago (this host's clock against this host's file). ``None`` otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | NOFOLLOW | CLOEXEC | NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or insecure(st) is not None:
            return None
        if limit is not None and st.st_size > limit:
            return None
        if fresh_for is not None and not 0 <= time.time() - st.st_mtime < fresh_for:
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read() if limit is None else f.read(limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def fanout_files(root: Path) -> Iterator[tuple[Path, str]]:
    """``(path, name)`` of every file in the fan-out directories under ``root``."""
    for d in fanout_dirs(root):
        try:
            names = os.listdir(d)
        except OSError:
            continue  # removed meanwhile
        for name in names:
            yield d / name, name


def listed(root: Path, suffix: str) -> Iterator[StoredEntry]:
    """Every file named ``*<suffix>`` (not hidden) in the fan-out directories under
    ``root``, unvalidated. Safe while others write (files may vanish)."""
    for p, name in fanout_files(root):
        if not name.endswith(suffix) or name.startswith("."):
            continue
        try:
            st = os.lstat(p)
        except OSError:
            continue
        yield StoredEntry(name[: -len(suffix)], p, st.st_size, st.st_mtime, st.st_atime)

# }}}
