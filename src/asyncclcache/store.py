"""The cache directory as the cache uses it: looking entries up, atomic publish under a
per-key claim. Names and reading one entry file are :mod:`.shared`; keeping the directory in
order (sweep, verify, prune, clear) is :mod:`.maintenance`; claims are :mod:`.locks`; file
safety is :mod:`.fileio`.

Ranks of a job share the directory (``rank-<N>/`` only with ``rank_local``), and read it
through their node's copies (:mod:`.nodecopies`, a tier in front of the shared files)
where those are on.

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
* A process that finds the directory tree there makes none of it again: one ``lstat``
  of its root, and of a fan-out directory before a write there.
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
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from .entry import Entry, EntryFormatError, EntryMeta, encode, read_meta
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
from .locks import LOCK_SUFFIX, Claim, take
from .nodecopies import NodeCopies, node_base
from .ranks import detect_rank
from .shared import (
    BAKED_MARK,
    ENTRY_SUFFIX,
    PRUNE_LOCK,
    RANK_PREFIX,
    STATS_FILE,
    STATS_LOCK,
    AnyStamp,
    ReadResult,
    SharedDir,
    Stamp,
    check_data,
    default_directory,
    ranks,
    stamp_of,
    version_dir,
)

__all__ = [
    "ENTRY_SUFFIX", "LOCK_SUFFIX", "PRUNE_LOCK", "RANK_PREFIX", "STATS_FILE", "STATS_LOCK", "TEMP_PREFIX",
    "TEMP_SUFFIX", "Claim", "PublishResult", "ReadResult", "Stamp", "Store", "StoredEntry", "check_data",
    "default_directory", "ranks", "stamp_of", "version_dir",
]

logger = logging.getLogger(__name__)

#: Seconds between two looks for :data:`~.shared.BAKED_MARK` while a process has not seen it.
BAKED_RECHECK = 60.0


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
        #: The entry files under ``root``: names, stamps, reading one.
        self.shared = SharedDir(root)
        self.problem: str | None = None
        self._dirs_lock = threading.Lock()
        #: Whether the directory holds baked binaries (:meth:`may_have_baked`), and when to
        #: look again while it seemed not to.
        self._baked_seen = False
        self._baked_next = 0.0
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
                self.node = NodeCopies(self.shared, node_base(cfg.node_dir, cfg.test_node), count,
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
            if not self._there():
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

    def _there(self) -> bool:
        """Whether the tree is there already, ours and private: then nothing is made (one
        ``lstat``, where thousands of ranks start against one metadata server). Its
        parents were checked when it was made; a process with a fresh tree checks them."""
        try:
            st = os.lstat(self.root)
        except OSError:
            return False
        if not stat.S_ISDIR(st.st_mode):
            return False  # a link, a file: _make_dirs says what
        return insecure(st) is None

    def _make_dirs(self) -> None:
        make_private_dir(self.base, follow=True)
        for d in dict.fromkeys([version_dir(self.base), self.root]):
            make_private_dir(d)

    def _fanout_ready(self, fanout: Path) -> None:
        """``fanout`` checked before each write (one ``lstat``: writes are one a program), made
        where missing; the whole tree again where another process removed it meanwhile."""
        try:
            make_private_dir(fanout)
        except FileNotFoundError:
            self._make_dirs()
            make_private_dir(fanout)

    def path_for(self, key: str) -> Path:
        """Where the entry for ``key`` lives."""
        return self.shared.path_for(key)

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
        # One way down: this node's copies in front of the shared files, where they serve.
        r = self.node.read(key) if self.node is not None else self.read(key)
        if r.problem is not None:
            self._reject(r.path, r.problem, r.stat, insecure=r.insecure)
            return None, self.stamp(key)
        if r.entry is not None and devices is not None and r.entry.meta.devices != list(devices):
            if r.stat is None and self.node is not None:  # the node's copy, served on its record
                self.node.forget(key)  # the shared file itself is looked at next time
                return None, self.stamp(key)
            self._reject(r.path, "was built for another device", r.stat)
            return None, self.stamp(key)
        if r.entry is None:
            return None, None
        return r.entry, (stamp_of(r.stat) if r.stat is not None else r.stamp)

    def stamp(self, key: str) -> Stamp | None:
        """The :func:`stamp_of` of the entry file for ``key`` now; ``None`` if there is none."""
        return self.shared.stamp(key)

    def read(self, key: str) -> ReadResult:
        """Read and fully check the entry for ``key`` in the shared directory (format,
        checksum, key, paths, ownership, links), changing nothing: what :meth:`load`,
        :meth:`verify` and ``import`` act on. Never raises for the file's content.
        Thread-safe."""
        return self.shared.read(key) if self.enabled else ReadResult(self.path_for(key))

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
        # The node's claim first: its other ranks skip the key without a request to the
        # shared directory (a cold job's ranks each claimed every program there).
        node_claim = self.node.write_claim(key) if self.node is not None else True
        if node_claim is False:
            return None
        try:
            claim = self._claim_shared(key, unless_written_since)
        except BaseException:
            if not isinstance(node_claim, bool):
                node_claim.release()
            raise
        if not isinstance(node_claim, bool):
            if claim is None:
                node_claim.release()
            else:
                claim.also = node_claim
        return claim

    def _claim_shared(
        self, key: str, unless_written_since: tuple[AnyStamp, AnyStamp] | None,
    ) -> Claim | None:
        """:meth:`claim` in the shared directory alone."""

        def written() -> bool:
            if unless_written_since is None:
                return False
            seen, ours = unless_written_since
            now = self.stamp(key)
            return now is not None and (now != seen or now == ours)

        # Before the lock too: where ranks build the same programs, most find the entry
        # written by then (one lstat, instead of taking and giving back a lock).
        if written():
            return None
        directory = self.shared.fanout(key)
        self._fanout_ready(directory)
        claim = take(key, directory / (key + LOCK_SUFFIX))
        if claim is not None and written():
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
        baked = entry.meta.baked_from is not None
        return self._publish(entry.key, encode(entry), claim, write_hook, baked=baked)

    def publish_encoded(self, key: str, data: bytes, *, claim: Claim | None = None) -> PublishResult:
        """As :meth:`publish`, for an entry's bytes as stored (``import``): checked with
        :func:`check_data` first, so a damaged one raises ``EntryFormatError`` and is
        never written."""
        entry = check_data(key, data)
        return self._publish(key, data, claim, None, baked=entry.meta.baked_from is not None)

    def _publish(
        self, key: str, data: bytes, claim: Claim | None, write_hook: Any, *, baked: bool,
    ) -> PublishResult:
        if not self.writable:
            return PublishResult.DISABLED
        own = claim is None
        if claim is None:
            claim = self.claim(key)
            if claim is None:
                return PublishResult.SKIPPED
        try:
            self._clear_way(key)
            atomic_write(self.shared.fanout(key), self.path_for(key), data, write_hook)
            claim.written = self.stamp(key)
            if self.node is not None and claim.written is not None:
                self.node.put(key, claim.written, data)  # this node's ranks read it from here
        finally:
            if own:
                claim.release()
        if baked:
            self.mark_baked()
        return PublishResult.WRITTEN

    def mark_baked(self) -> None:
        """Say that this directory holds baked binaries (:data:`~.shared.BAKED_MARK`), so
        that hits look for them. Never raises."""
        with self._dirs_lock:
            if self._baked_seen:
                return
        path = self.root / BAKED_MARK
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | NOFOLLOW | CLOEXEC | NONBLOCK, 0o600))
            with self._dirs_lock:
                self._baked_seen = True

    def heard_baked(self) -> None:
        """A helper of this process published a baked binary here: hits look for them."""
        with self._dirs_lock:
            self._baked_seen = True

    def may_have_baked(self) -> bool:
        """Whether this directory may hold baked binaries: without :data:`~.shared.BAKED_MARK`
        no hit looks for one (one ``lstat`` a process, again every :data:`BAKED_RECHECK`
        seconds while it is missing: a bake during the run). Thread-safe."""
        now = time.monotonic()
        with self._dirs_lock:
            if self._baked_seen:
                return True
            if now < self._baked_next:
                return False
            self._baked_next = now + BAKED_RECHECK
        try:
            there = stat.S_ISREG(os.lstat(self.root / BAKED_MARK).st_mode)
        except OSError:
            there = False
        if there:
            with self._dirs_lock:
                self._baked_seen = True
        return there

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
        if self.node is not None:
            self.node.forget(key)  # the node's processes look at the shared directory again
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
