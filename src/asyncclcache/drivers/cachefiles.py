"""The files of a driver's own disk cache, as entries hold them: which may be stored or
written into (the trust rules), reading one within an entry's bounds, and writing an
entry's files back (never half a file, never over an existing one, never through a link).
Shared by :mod:`.kcache_folders` (pocl's folders) and :mod:`.kcache_files` (NVIDIA's and
Mesa's items); each checks its own layout's names. Functions of the file system: thread- and
process-safe as stated on each.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..fileio import CLOEXEC, NOFOLLOW, NONBLOCK, InsecurePathError, insecure, write_all
from .base import Lost

__all__ = [
    "MAX_ENTRY_BYTES", "MAX_FILES", "MAX_FILE_BYTES", "TMP_PREFIX", "Placed", "read_trusted", "restore",
    "trusted_dir", "unrestore", "untrusted",
]

#: Our temp files inside a driver's cache while a restore writes (never part of an entry:
#: a name that starts with a dot is no name of an entry, :func:`asyncclcache.entry.safe_file`).
TMP_PREFIX = ".acc-tmp-"

#: What one entry may hold: a driver's files of one program are far below these.
MAX_FILE_BYTES = 256 << 20
MAX_ENTRY_BYTES = 1 << 30
MAX_FILES = 4096

_O_DIR = os.O_RDONLY | os.O_DIRECTORY | NOFOLLOW | CLOEXEC


def untrusted(st: os.stat_result) -> str | None:
    """Why a file or directory of a driver's cache with this ``lstat``/``fstat`` must not
    be stored or written into, or ``None``: the store's own rule (:func:`~asyncclcache.fileio.insecure`:
    another owner, writable by others, a hard link), except that the driver's files may be
    writable by the user's private group (umask 002); and a file or directory, no link."""
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        return "not a regular file or directory"
    return insecure(st, private_group_ok=True)


def trusted_dir(path: Path) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and untrusted(st) is None


def read_trusted(path: str, budget: int) -> bytes:
    """The content of a driver's cache file that passes :func:`untrusted`, without
    following a link, at most ``min(MAX_FILE_BYTES, budget)`` bytes (else :class:`Lost`)."""
    fd = os.open(path, os.O_RDONLY | NOFOLLOW | NONBLOCK | CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        why = untrusted(st)
        if why is not None or not stat.S_ISREG(st.st_mode):
            raise InsecurePathError(f"{path} is {why or 'not a regular file'}")
        if st.st_size > min(MAX_FILE_BYTES, budget):
            raise Lost(f"{path} is too large for an entry ({st.st_size} bytes)")
        data = f.read(st.st_size + 1)
    if len(data) != st.st_size:
        raise OSError(errno.EAGAIN, f"{path} changed while it was read")
    return data


@dataclass(frozen=True)
class Placed:
    """What :func:`restore` wrote, so that an unused restore can be taken back."""

    files: tuple[tuple[str, int], ...] = ()  # (relative path, inode)
    dirs: tuple[str, ...] = ()  # directories it made, deepest last

    @property
    def count(self) -> int:
        return len(self.files)

    def plus(self, other: Placed) -> Placed:
        """Both restores, to be taken back together (``other``'s directories made after ours)."""
        return Placed(self.files + other.files, self.dirs + other.dirs)


def _open_dir(parent: int, name: str, made: list[str], rel: str) -> int:
    try:
        fd = os.open(name, _O_DIR, dir_fd=parent)
    except FileNotFoundError:
        try:
            os.mkdir(name, 0o700, dir_fd=parent)
            made.append(rel)
        except FileExistsError:
            pass
        fd = os.open(name, _O_DIR, dir_fd=parent)
    why = untrusted(os.fstat(fd))
    if why is not None:
        os.close(fd)
        raise InsecurePathError(f"{rel} in the driver's cache is {why}")
    return fd


def restore(
    root: Path, files: Sequence[str], blobs: Sequence[bytes], valid: Callable[[str], bool],
) -> Placed:
    """Write the ``files`` missing under ``root``; returns what was written. Every path
    must pass ``valid`` (the layout's names), or nothing is written.

    Each file is a temp file hard-linked into place, so the driver never reads half a
    file and an existing file (the driver's own, or a racing writer's) is never replaced. No link
    below ``root`` is followed, nothing is written into a directory of another user
    (:class:`~asyncclcache.fileio.InsecurePathError`). Raises ``OSError`` (the caller
    builds from source); what was written before the error is taken back.
    """
    try:
        rootfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | CLOEXEC)
    except FileNotFoundError:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        rootfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | CLOEXEC)
    dirs: dict[str, int] = {"": rootfd}
    made: list[str] = []
    placed: list[tuple[str, int]] = []
    try:
        bad = next((rel for rel in files if not valid(rel)), None)
        if bad is not None:
            raise OSError(errno.EINVAL, f"unsafe path in entry: {bad!r}")
        for rel, blob in zip(files, blobs, strict=True):
            *parents, name = rel.split("/")
            path = ""
            for part in parents:
                child = f"{path}/{part}" if path else part
                if child not in dirs:
                    dirs[child] = _open_dir(dirs[path], part, made, child)
                path = child
            dfd = dirs[path]
            if path not in made:  # a folder made just now holds nothing (a racer's: the link says)
                try:
                    os.stat(name, dir_fd=dfd, follow_symlinks=False)
                    continue  # there already: never overwrite what the driver wrote
                except FileNotFoundError:
                    pass
            ino = _place(dfd, name, blob)
            if ino is not None:
                placed.append((rel, ino))
    except BaseException:
        unrestore(root, Placed(tuple(placed), tuple(made)))
        raise
    finally:
        for fd in dirs.values():
            os.close(fd)
    return Placed(tuple(placed), tuple(made))


def _place(dfd: int, name: str, blob: bytes) -> int | None:
    tmp = TMP_PREFIX + secrets.token_hex(8)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC
    fd = os.open(tmp, flags, 0o600, dir_fd=dfd)
    try:
        try:
            write_all(fd, blob)
            ino = os.fstat(fd).st_ino
        finally:
            os.close(fd)
        try:
            os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
        except FileExistsError:
            return None  # written meanwhile (the driver or another process): keep theirs
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK):
                raise
            # No hard links here: a rename, after one more look (a tiny race, same content).
            try:
                os.stat(name, dir_fd=dfd, follow_symlinks=False)
                return None
            except FileNotFoundError:
                os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        return ino
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dfd)


def unrestore(root: Path, placed: Placed) -> None:
    """Remove what :func:`restore` wrote (the same files: same inode) and the directories
    it made, where they are empty. Never raises."""
    for rel, ino in placed.files:
        path = root / rel
        with contextlib.suppress(OSError):
            if os.lstat(path).st_ino == ino:
                os.unlink(path)
    for rel in reversed(placed.dirs):
        with contextlib.suppress(OSError):
            os.rmdir(root / rel)  # only if empty: the driver may have written there meanwhile
