"""A cache directory's files as they are on disk: every name in it, and reading one entry
file with every check. The one module that names files in the cache directory;
:mod:`.store` publishes and looks entries up through it (where ranks share the directory,
through :mod:`.nodecopies` in front of it), :mod:`.maintenance` and :mod:`.stats` keep
their files by its names.

Layout::

    <directory>/v<FORMAT_VERSION>/[rank-<N>/]<key[:2]>/<key>.acl    entries
                                             <key[:2]>/<key>.lock   lock while writing
                                             <key[:2]>/.tmp-<pid>-*.partial
                                             stats.json, stats.lock, stats.d/
                                             upkeep.json, prune.lock, baked.mark

Thread- and process-safe: nothing here keeps state but the root's path.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from .entry import Entry, EntryFormatError, decode, layout_problem
from .fileio import CLOEXEC, NOFOLLOW, NONBLOCK, insecure
from .keys import FORMAT_VERSION

__all__ = [
    "BAKED_MARK", "ENTRY_SUFFIX", "PRUNE_LOCK", "RANK_PREFIX", "STATS_DIR", "STATS_FILE", "STATS_LOCK",
    "UPKEEP_FILE", "AnyStamp", "ReadResult", "SharedDir", "Stamp", "check_data", "default_directory", "ranks",
    "stamp_of", "version_dir",
]

# Every name a cache directory holds is spelled here (temp and lock names: fileio, locks).
ENTRY_SUFFIX = ".acl"
#: ``v<N>/rank-<rank>/``: a rank's own store under the version directory.
RANK_PREFIX = "rank-"
#: A store's lifetime counters (:mod:`.stats`) and the lock that serializes their writers.
STATS_FILE = "stats.json"
STATS_LOCK = "stats.lock"
#: Each process's additions to the lifetime counters, one file a save, folded into
#: :data:`STATS_FILE` by the upkeep (:mod:`.stats`): no process waits on another's lock.
STATS_DIR = "stats.d"
#: Held by the one process that keeps a store in order (:mod:`.maintenance`).
PRUNE_LOCK = "prune.lock"
#: When the store was last kept in order, and its size then (:mod:`.maintenance`).
UPKEEP_FILE = "upkeep.json"
#: There since a baked binary was first written here (:mod:`.bake`): without it, no hit
#: looks for one (a metadata request a hit saved).
BAKED_MARK = "baked.mark"


def version_dir(base: Path) -> Path:
    """Where this format's entries live under a base directory: ``base/v<FORMAT_VERSION>``."""
    return base / f"v{FORMAT_VERSION}"


def ranks(base: Path) -> list[int]:
    """The ranks that have a rank-local store under ``base``, in order."""
    out = []
    with contextlib.suppress(OSError):
        for d in version_dir(base).iterdir():
            suffix = d.name[len(RANK_PREFIX):] if d.name.startswith(RANK_PREFIX) else ""
            if suffix.isdigit() and d.is_dir():  # a link too: the Store refuses it, saying why
                out.append(int(suffix))
    return sorted(out)

#: Which file an entry path named: (device, inode, size, modification time in ns). Entries
#: are replaced by rename, so another write gives another inode; no clock is compared.
Stamp = tuple[int, int, int, int]


#: A stamp as callers keep it (``None``: no file).
AnyStamp = tuple[int, ...] | None


def stamp_of(st: os.stat_result) -> Stamp:
    """The :data:`Stamp` of a ``stat`` result."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def default_directory() -> Path:
    """``platformdirs.user_cache_dir("asyncclcache")``, absolute; ``ValueError`` where it
    is not known (no home directory: set ``ASYNCCLCACHE_DIR``)."""
    import platformdirs

    from .config import absolute_path

    return Path(absolute_path(platformdirs.user_cache_dir("asyncclcache"),
                              "the default cache directory (set ASYNCCLCACHE_DIR)"))


@dataclass(frozen=True)
class ReadResult:
    """What :meth:`SharedDir.read` found: an ``entry`` (and its bytes ``data``), nothing
    (both ``None``, no ``problem``: a miss), or a ``problem``. ``insecure``: the problem
    is a link or another user's file, not ours to delete."""

    path: Path
    entry: Entry | None = None
    problem: str | None = None
    insecure: bool = False
    stat: os.stat_result | None = None
    data: bytes | None = None
    #: The file's :func:`stamp_of` where ``stat`` is not known (a node's copy, served on
    #: what a process of the node saw of the file: :mod:`.nodecopies`).
    stamp: Stamp | None = None


def check_data(key: str, data: bytes) -> Entry:
    """Decode and check the bytes of the entry for ``key``: format, checksum, metadata,
    key, and that every stored path is a plain name. Raises :class:`EntryFormatError`."""
    entry = decode(data)
    if entry.key != key:
        raise EntryFormatError("holds another key")
    problem = layout_problem(entry)
    if problem is not None:
        raise EntryFormatError(problem)
    return entry


class SharedDir:
    """The entry files under ``root`` (a store's ``v<N>/`` or ``v<N>/rank-<N>/``): their
    names, their stamps, and reading one. Thread- and process-safe."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def fanout(self, key: str) -> Path:
        """The ``XX/`` directory of ``key``."""
        return self.root / key[:2]

    def path_for(self, key: str) -> Path:
        """Where the entry for ``key`` lives."""
        return self.fanout(key) / (key + ENTRY_SUFFIX)

    def stamp(self, key: str) -> Stamp | None:
        """The :func:`stamp_of` of the entry file for ``key`` now; ``None`` if there is none."""
        try:
            return stamp_of(os.lstat(self.path_for(key)))
        except OSError:
            return None

    def read(self, key: str) -> ReadResult:
        """Read and fully check the entry for ``key`` (format, checksum, key, paths,
        ownership, links), changing nothing. Never raises for the file's content. Thread-safe."""
        path = self.path_for(key)
        try:
            # Neither the fan-out directory nor the entry may be a link.
            dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | NOFOLLOW | CLOEXEC)
        except OSError as e:
            # O_DIRECTORY | O_NOFOLLOW on a link fails with ENOTDIR (or ELOOP): tell apart.
            if e.errno in (errno.ELOOP, errno.ENOTDIR) and path.parent.is_symlink():
                return ReadResult(path.parent, problem="is a symbolic link", insecure=True)
            # Otherwise missing or blocked by a file: the writer's problem, not a bad entry.
            return ReadResult(path)
        try:
            # The fan-out directory too: another user's, or one others may write, could
            # hold a planted entry (checked on read as well as on write).
            why = insecure(os.fstat(dfd))
            if why is not None:
                return ReadResult(path.parent, problem=why, insecure=True)
            fd = os.open(path.name, os.O_RDONLY | NOFOLLOW | CLOEXEC | NONBLOCK, dir_fd=dfd)
        except FileNotFoundError:
            return ReadResult(path)
        except OSError as e:
            if e.errno == errno.ELOOP:
                return ReadResult(path, problem="is a symbolic link", insecure=True)
            return ReadResult(path, problem=f"cannot be read ({e.strerror})")
        finally:
            os.close(dfd)
        st = None
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                return ReadResult(path, problem="is a directory", stat=st)
            if not stat.S_ISREG(st.st_mode):
                return ReadResult(path, problem="is not a regular file", stat=st)
            why = insecure(st)
            if why is not None:
                return ReadResult(path, problem=why, insecure=True)
            data = _read_all(fd, st.st_size)
        except OSError as e:
            return ReadResult(path, problem=f"cannot be read ({e.strerror})")
        finally:
            os.close(fd)
        try:
            return ReadResult(path, entry=check_data(key, data), stat=st, data=data)
        except EntryFormatError as e:
            return ReadResult(path, problem=str(e), stat=st)


def _read_all(fd: int, size: int) -> bytes:
    """The file's ``size`` bytes, in one ``read`` (no buffered file object: its ``fstat``,
    ``ioctl`` and ``lseek`` are requests on a shared file system too). An entry is never
    written in place (a new one is renamed over it), so its size is its ``fstat``'s; a
    short or a longer file fails its checksum."""
    chunks = []
    while size > 0:
        chunk = os.read(fd, size)
        if not chunk:
            break
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)
