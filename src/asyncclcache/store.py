"""Entry files on disk: where entries live, reading and checking them, atomic publish
under a per-key claim. Keeping the directory in order (sweep, verify, prune, clear) is
:mod:`.maintenance`; claims are :mod:`.locks`; file safety is :mod:`.fileio`.

Layout::

    <directory>/v<FORMAT_VERSION>/[rank-<N>/]<key[:2]>/<key>.acl    entries
                                             <key[:2]>/<key>.lock   lock while writing
                                             <key[:2]>/.tmp-<pid>-*.partial

Ranks of a job share the directory (``rank-<N>/`` only with ``rank_local``), and read it
through their node's copies (:mod:`.nodecopies`) where those are on.

Guarantees (thread- and process-safe):

* A reader sees either no entry or a complete one: writers write a temp file in
  the same directory, fsync it and ``os.replace`` it into place. Readers take no
  lock.
* One writer per key at a time: the per-key ``filelock`` is taken without
  blocking; a process that finds it held skips (someone else writes that entry).
  The lock file is removed before release, so lock files do not pile up.
* Temp and lock files of killed writers are swept (:func:`.maintenance.sweep`); a lock
  file is removed while the sweep holds it, like a release does.
* Entries are native code that pocl ``dlopen``\\ s: directories are 0700, entries
  0600, nothing owned by another user or writable by others is read, symlinks are
  not followed.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import logging
import os
import secrets
import shutil
import stat
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .entry import Entry, EntryFormatError, EntryMeta, decode, encode, layout_problem, read_meta
from .errors import CacheDirWarning, CorruptEntryWarning, InsecureCacheWarning
from .fileio import (
    CLOEXEC,
    NOFOLLOW,
    NONBLOCK,
    TEMP_PREFIX,
    TEMP_SUFFIX,
    InsecurePathError,
    StoredEntry,
    atomic_write,
    fanout_dirs,
    fanout_files,
    insecure,
    listed,
    make_private_dir,
    nofollow_opener,
    temp_prefix,
    unlink_if_same,
)
from .keys import FORMAT_VERSION
from .locks import LOCK_SUFFIX, Claim, take
from .nodecopies import NodeCopies, node_base
from .ranks import detect_rank

__all__ = [
    "ENTRY_SUFFIX", "LOCK_SUFFIX", "PRUNE_LOCK", "RANK_PREFIX", "STATS_FILE", "STATS_LOCK", "TEMP_PREFIX",
    "TEMP_SUFFIX", "Claim", "PublishResult", "ReadResult", "Stamp", "Store", "StoredEntry", "check_data",
    "default_directory", "ranks", "stamp_of", "version_dir",
]

logger = logging.getLogger(__name__)

# Every name a cache directory holds is spelled here (temp and lock names: fileio, locks).
ENTRY_SUFFIX = ".acl"
#: ``v<N>/rank-<rank>/``: a rank's own store under the version directory.
RANK_PREFIX = "rank-"
#: A store's lifetime counters (:mod:`.stats`) and the lock that serializes their writers.
STATS_FILE = "stats.json"
STATS_LOCK = "stats.lock"
#: Held by the one process that prunes a store (:mod:`.maintenance`).
PRUNE_LOCK = "prune.lock"


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
    """What :meth:`Store.read` found: an ``entry`` (and its bytes ``data``), nothing
    (both ``None``, no ``problem``: a miss), or a ``problem``. ``insecure``: the problem
    is a link or another user's file, not ours to delete."""

    path: Path
    entry: Entry | None = None
    problem: str | None = None
    insecure: bool = False
    stat: os.stat_result | None = None
    data: bytes | None = None


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


class PublishResult(enum.Enum):
    """What :meth:`Store.publish` did."""

    WRITTEN = "written"
    SKIPPED = "skipped"  # another writer holds the key's lock
    DISABLED = "disabled"  # the store is not usable


class Store:
    """The on-disk cache: one file per entry, fanned out by the key's first two hex digits.

    All methods are thread-safe and process-safe. If the directory cannot be used
    (not a directory, not writable, insecure), the store warns once and every
    operation becomes a no-op miss: callers keep working uncached.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        rank_local: bool | None = None,
        rank: int | None = None,
        create: bool = True,
        node_copies: bool | None = None,
        count: Callable[[str], None] | None = None,
    ) -> None:
        """``directory`` is made absolute now (``ValueError`` where it cannot be: ``~user``
        of no user, say). ``rank`` overrides MPI detection; ``create=False`` (the command line) never makes
        directories: a missing cache is reported in ``problem`` without a warning.
        ``node_copies``: read through this node's copies (:mod:`.nodecopies`); default
        (``None``): ``ASYNCCLCACHE_NODE_COPIES``, else on under a launcher (a rank), for a
        directory the ranks share. ``count(name)`` is told what the copies count."""
        from .config import absolute_path, get_config

        cfg = get_config()
        # Absolute once: the program may chdir, and helpers start in "/".
        base = Path(absolute_path(directory, "cache directory") if directory else cfg.directory
                    or default_directory())
        if rank_local is None:
            rank_local = bool(cfg.rank_local)
        self.rank = detect_rank() if rank is None else rank
        self.rank_local = bool(rank_local and self.rank is not None)
        root = version_dir(base)
        if self.rank_local:
            root = root / f"{RANK_PREFIX}{self.rank}"
        self.base = base
        self.root = root
        self.problem: str | None = None
        self.missing = False
        #: Entries are read but never written (the directory is not writable).
        self.read_only = False
        #: This node's copies of the entries, or ``None``.
        self.node: NodeCopies | None = None
        if create:
            self._open()
            if node_copies is None:
                node_copies = cfg.node_copies if cfg.node_copies is not None else self.rank is not None
            if node_copies and not self.rank_local and self.enabled:
                self.node = NodeCopies(self.root, node_base(cfg.node_dir, cfg.test_node), count,
                                       cfg.node_max_size)
        elif not self.root.is_dir():
            self.missing = True
            self.problem = "no asyncclcache cache here"
        else:
            try:
                self._make_dirs()
            except OSError as e:
                self.problem = str(e) if isinstance(e, InsecurePathError) else f"{e.strerror or e}"

    # {{{ directories

    def _open(self) -> None:
        try:
            # Missing parents (a fresh account's ~/.cache) are made like ``mkdir -p``.
            self.base.parent.mkdir(parents=True, exist_ok=True)
            self._make_dirs()
            if not os.access(self.root, os.W_OK | os.X_OK):
                if not os.access(self.root, os.R_OK | os.X_OK):
                    raise PermissionError(errno.EACCES, "not readable", str(self.root))
                # A pre-populated cache on a read-only mount or image: hits, no writes.
                self.read_only = True
                warnings.warn(
                    f"asyncclcache: cache directory {self.root} is read-only: reading its "
                    "entries, writing none",
                    CacheDirWarning,
                    stacklevel=4,
                )
        except InsecurePathError as e:
            self.problem = str(e)
            warnings.warn(
                f"asyncclcache: refusing cache directory {self.root}: {e}; caching is off",
                InsecureCacheWarning,
                stacklevel=4,
            )
        except OSError as e:
            self.problem = f"{e.strerror or e}"
            warnings.warn(
                f"asyncclcache: cannot use cache directory {self.root}: {self.problem}; "
                "caching is off",
                CacheDirWarning,
                stacklevel=4,
            )

    @property
    def enabled(self) -> bool:
        """True when the directory is usable."""
        return self.problem is None

    @property
    def writable(self) -> bool:
        """True when entries can be written (usable and not read-only)."""
        return self.problem is None and not self.read_only

    def _make_dirs(self, fanout: Path | None = None) -> None:
        # Again before each write: another process may have removed the directory.
        make_private_dir(self.base, follow=True)
        dirs = [version_dir(self.base), self.root]
        if fanout is not None:
            dirs.append(fanout)
        for d in dict.fromkeys(dirs):
            make_private_dir(d)

    def _fanout(self, key: str) -> Path:
        return self.root / key[:2]

    def path_for(self, key: str) -> Path:
        """Where the entry for ``key`` lives."""
        return self._fanout(key) / (key + ENTRY_SUFFIX)

    # }}}

    # {{{ read

    def load(self, key: str, devices: Sequence[dict[str, str]] | None = None) -> Entry | None:
        """Read and verify the entry for ``key``; ``None`` on a miss.

        A damaged, truncated or foreign entry warns once (:class:`CorruptEntryWarning`),
        is removed, and is a miss. Never raises for the file's content.
        """
        return self.lookup(key, devices)[0]

    def lookup(
        self, key: str, devices: Sequence[dict[str, str]] | None = None
    ) -> tuple[Entry | None, Stamp | None]:
        """:meth:`load`, and the :func:`stamp_of` of the file it found (``None``: none),
        so that a writer can tell later, without a clock, whether the file was replaced.
        What it refused counts as found, as its removal left it (nothing, or a link, a
        directory, another user's file): the write that follows replaces it."""
        r = self.read(key) if self.node is None else self._read_near(key, self.node)
        if r.problem is not None:
            self._reject(r.path, r.problem, r.stat, insecure=r.insecure)
            return None, self.stamp(key)
        if r.entry is not None and devices is not None and r.entry.meta.devices != list(devices):
            self._reject(r.path, "was built for another device", r.stat)
            return None, self.stamp(key)
        return r.entry, (stamp_of(r.stat) if r.entry is not None and r.stat is not None else None)

    def stamp(self, key: str) -> Stamp | None:
        """The :func:`stamp_of` of the entry file for ``key`` now; ``None`` if there is none."""
        try:
            return stamp_of(os.lstat(self.path_for(key)))
        except OSError:
            return None

    def read(self, key: str) -> ReadResult:
        """Read and fully check the entry for ``key`` (format, checksum, key, paths,
        ownership, links), changing nothing: what :meth:`load`, :meth:`verify` and
        ``import`` act on. Never raises for the file's content. Thread-safe."""
        path = self.path_for(key)
        if not self.enabled:
            return ReadResult(path)
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
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = f.read()
        except OSError as e:
            return ReadResult(path, problem=f"cannot be read ({e.strerror})")
        finally:
            os.close(fd)
        try:
            return ReadResult(path, entry=check_data(key, data), stat=st, data=data)
        except EntryFormatError as e:
            return ReadResult(path, problem=str(e), stat=st)

    def _read_near(self, key: str, node: NodeCopies) -> ReadResult:
        """:meth:`read`, from this node's copy of the shared file as it is now where there is
        one (no open in the shared directory); else the shared file, copied for the node's
        other ranks by the one that holds the node's claim (the others wait for that copy no
        longer than a read of their own takes, :meth:`.NodeCopies.wait_for`)."""
        path = self.path_for(key)
        if not node.enabled:  # its folder failed: nothing to copy to, nor to wait for
            return self._read_shared(key, node, None)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return ReadResult(path)  # a miss, and nothing opened
        except OSError:
            st = None
        # The shared file's identity names its copy (a link, another user's file: no copy).
        usable = st is not None and stat.S_ISREG(st.st_mode) and insecure(st) is None
        stamp = stamp_of(st) if st is not None and usable else None

        def from_copy(data: bytes | None) -> ReadResult | None:
            # The copy, checked as the shared entry is.
            if data is None or stamp is None:
                return None
            try:
                entry = check_data(key, data)
            except EntryFormatError as e:
                node.drop(key, stamp, str(e))
                return None
            node.count("node_reads")
            return ReadResult(path, entry=entry, stat=st, data=data)

        near = None if stamp is None else from_copy(node.copy(key, stamp))
        if near is not None:
            return near
        claim = node.claim(key)
        if claim is None and stamp is not None:
            # Another rank of the node is copying it: its copy, if it comes within the time
            # a read of our own would take.
            data, claim = node.wait_for(key, stamp)
            near = from_copy(data)
            if near is not None:
                return near
        return self._read_shared(key, node, claim)

    def _read_shared(self, key: str, node: NodeCopies, claim: Claim | None) -> ReadResult:
        """:meth:`read` of the shared file, counted; under the node's ``claim``, left as the
        node's copy. Releases ``claim``."""
        try:
            t0 = time.monotonic()
            r = self.read(key)  # and what is wrong with the file, as without copies
            if r.data is not None:
                node.read_took(time.monotonic() - t0)
                node.count("shared_reads")
            if claim is not None and r.entry is not None and r.data is not None and r.stat is not None:
                node.write(key, stamp_of(r.stat), r.data)
        finally:
            if claim is not None:
                claim.release()
        return r

    def _reject(
        self, path: Path, why: str, st: os.stat_result | None, *, insecure: bool = False
    ) -> None:
        if insecure:
            # Not ours to delete: another user's file, or a link.
            warnings.warn(
                f"asyncclcache: ignoring cache entry {path}: {why}", InsecureCacheWarning, stacklevel=4
            )
            return
        # Remove first: a warnings filter set to "error" must not leave the bad file (what
        # cannot be removed here, the write that replaces it moves aside: _clear_way).
        unlink_if_same(path, st)
        logger.warning("dropping damaged cache entry %s: %s", path, why)
        warnings.warn(
            f"asyncclcache: dropping damaged cache entry {path}: {why}; rebuilding",
            CorruptEntryWarning,
            stacklevel=4,
        )

    # }}}

    # {{{ write

    def claim(
        self, key: str, *, unless_written_since: tuple[AnyStamp, AnyStamp] | None = None,
    ) -> Claim | None:
        """Take the per-key lock without blocking; ``None`` if another process holds it.

        The holder retrieves and writes ``key``'s entry; everyone else skips.
        The lock is an ``flock``: a killed holder's claim expires with it. Pass the
        claim to :meth:`publish` and release it when done. Thread-safe.

        ``unless_written_since=(seen, ours)``: also ``None`` (the lock given back) when
        the key was written since the caller looked: an entry file is there that is not
        ``seen`` (the :meth:`stamp` its lookup saw; ``None``: none), or that is ``ours``
        (the caller's own last write). Which file, not when: an entry's mtime is set
        before its fsync and rename, and clocks of other hosts (NFS) differ; a rename
        gives every write a new inode.
        """
        if not self.writable:
            return None
        directory = self._fanout(key)
        self._make_dirs(directory)
        claim = take(key, directory / (key + LOCK_SUFFIX))
        if claim is not None and unless_written_since is not None:
            seen, ours = unless_written_since
            now = self.stamp(key)
            if now is not None and (now != seen or now == ours):
                claim.release()
                return None
        return claim

    def publish(
        self, entry: Entry, *, claim: Claim | None = None, write_hook: Any = None
    ) -> PublishResult:
        """Atomically write ``entry``, unless another writer holds its key.

        With ``claim`` (from :meth:`claim`) the lock is already held and stays held;
        ``claim.written`` is then the new file's :meth:`stamp`.
        Raises ``OSError`` for I/O failures (disk full, permissions) after removing
        its temp file: nothing partial is ever visible. ``write_hook``, if given, is
        called with the temp path before the data is written (tests widen the
        window with it).
        """
        return self._publish(entry.key, encode(entry), claim, write_hook)

    def publish_encoded(self, key: str, data: bytes, *, claim: Claim | None = None) -> PublishResult:
        """As :meth:`publish`, for an entry's bytes as stored (``import``): checked with
        :func:`check_data` first, so a damaged one raises ``EntryFormatError`` and is
        never written."""
        check_data(key, data)
        return self._publish(key, data, claim, None)

    def _publish(self, key: str, data: bytes, claim: Claim | None, write_hook: Any) -> PublishResult:
        if not self.writable:
            return PublishResult.DISABLED
        own = claim is None
        if claim is None:
            claim = self.claim(key)
            if claim is None:
                return PublishResult.SKIPPED
        try:
            self._clear_way(key)
            atomic_write(self._fanout(key), self.path_for(key), data, write_hook)
            claim.written = self.stamp(key)
            if self.node is not None and claim.written is not None:
                self.node.put(key, claim.written, data)  # this node's ranks read it from here
        finally:
            if own:
                claim.release()
        return PublishResult.WRITTEN

    def _clear_way(self, key: str) -> None:
        """Under ``key``'s claim: a directory where its entry file belongs (a rename cannot
        replace one) is moved aside, under a temp name, and removed as far as it can be
        (the rest goes with a later :func:`~.maintenance.sweep`). A link or a file is left: the rename replaces
        the name, never writing through it."""
        path = self.path_for(key)
        try:
            st = os.lstat(path)
        except OSError:
            return
        if not stat.S_ISDIR(st.st_mode):
            return
        aside = path.parent / f"{temp_prefix()}{secrets.token_hex(6)}{TEMP_SUFFIX}"
        os.rename(path, aside)  # in our own fan-out directory (checked by the claim)
        logger.info("moved aside a directory in place of cache entry %s", path)
        shutil.rmtree(aside, ignore_errors=True)  # follows no link

    def remove(self, key: str) -> bool:
        """Delete the entry for ``key``; True if there was one."""
        try:
            os.unlink(self.path_for(key))
        except OSError:
            return False
        return True

    # }}}

    # {{{ listing and upkeep

    def fanout_dirs(self) -> Iterator[Path]:
        """The ``XX/`` directories (not links) of the entries."""
        return fanout_dirs(self.root) if self.enabled else iter(())

    def files(self) -> Iterator[tuple[Path, str]]:
        """``(path, name)`` of every file in the fan-out directories (entries, locks, temps)."""
        return fanout_files(self.root) if self.enabled else iter(())

    def entries(self) -> Iterator[StoredEntry]:
        """Every entry file, unvalidated. Safe while others write (files may vanish)."""
        return listed(self.root, ENTRY_SUFFIX) if self.enabled else iter(())

    def touch(self, key: str) -> None:
        """Mark ``key`` as just used (its atime), without rewriting it; for an entry read
        from this node's copy, about once an hour a node (:meth:`.NodeCopies.shared_use_due`).
        Never raises."""
        if self.node is not None and not self.node.shared_use_due(key):
            return
        path = self.path_for(key)
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                os.utime(path, ns=(time.time_ns(), st.st_mtime_ns), follow_symlinks=False)

    def total_bytes(self) -> int:
        """Bytes of all entry files."""
        return sum(e.size for e in self.entries())

    def read_meta(self, path: Path) -> EntryMeta | None:
        """An entry's metadata, read without the binaries and not verified (for listings)."""
        try:
            with open(path, "rb", opener=nofollow_opener) as f:
                return read_meta(f)
        except (OSError, EntryFormatError):
            return None

    # }}}
