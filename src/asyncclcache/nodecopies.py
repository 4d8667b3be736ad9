"""Node-local copies of a shared directory's entries: a node reads an entry from the
shared directory once, whatever number of its ranks hit it (docs/mpi.md).

Layout, in node-local storage (``ASYNCCLCACHE_NODE_DIR``, else ``$TMPDIR``, else
``/tmp``; one folder per user, and per simulated node in tests: ``ASYNCCLCACHE_TEST_NODE``)::

    <node dir>/asyncclcache-<uid>/[node-<name>/]
        prune.lock                          held by the one process that prunes the node
        <digest of a shared root>/
            <key[:2]>/<key>-<stamp>.copy    the shared entry whose file had <stamp>
            <key[:2]>/<key>.seen            <stamp>, as a process of the node last saw it
            <key[:2]>/<key>.lock            held by the rank that copies it now
            <key[:2]>/<key>-write.lock      held by the rank of the node that writes it

A lookup reads the copy named by the shared entry's stamp (device, inode, size,
modification time). The node asks the shared directory for that stamp once a
:data:`SEEN_FOR` window, not each rank at each lookup: a process that ``lstat``\\ s the
shared entry (a metadata call, no open) leaves what it saw in ``<key>.seen``, and the
node's processes take it from there while it is younger than the window (this host's
clock against this host's file). So a replaced entry (a refresh: the same key, the same
program, with more variants) or a removed one may still be served from the node's copy
within the window, never after it; a copy is always of its key's program (it is checked as
an entry is). Thousands of ranks then make one metadata request a node and entry a window,
not one each. Without a copy, the rank that takes the key's claim (an ``flock``, taken without
waiting) reads the shared entry, checks it as :class:`~.store.Store` does, and leaves the
copy; a rank that finds the claim held waits for that copy no longer than its own reads of
the shared directory take (:data:`WAIT_BOUNDS`), then reads the shared entry itself: a
stopped or slow rank never holds up another for more than the read it would save.

Copies are scratch, written without ``fsync`` (a torn one fails its checksum and is
dropped); they outlive the job, so the next job on the node reads nothing from the shared
directory, and are kept in order at exit as the shared directory is (:mod:`.maintenance`
on :class:`NodeStorage`: every copy of the user's on the node, of any shared directory,
removed ones too, pruned to ``ASYNCCLCACHE_NODE_MAX_SIZE``, least recently used first, by
one process at a time; the temp and lock files of killed copiers swept). A node-local
directory that cannot be used (not writable, full, another user's) warns once
(:class:`~.errors.NodeDirWarning`) and the process reads the shared directory itself from
then on, at once: nothing is waited for.

Thread- and process-safe: ranks of one job, and jobs of one user on one node, share it.
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
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .config import DEFAULT_NODE_MAX_BYTES
from .entry import EntryFormatError
from .errors import NodeDirWarning
from .fileio import (
    StoredEntry,
    atomic_write,
    fanout_files,
    hex_dirs,
    insecure,
    listed,
    make_private_dir,
    read_own,
)
from .locks import LOCK_SUFFIX, Claim, take
from .shared import ReadResult, SharedDir, Stamp, check_data, stamp_of

__all__ = ["NodeCopies", "NodePlace", "NodeStorage", "node_base"]

logger = logging.getLogger(__name__)

#: A rank that finds another copying an entry waits for that copy at most twice as long as its
#: own reads of the shared directory took (the first: :data:`FIRST_WAIT`), within these bounds
#: (seconds), then reads the shared entry itself: never longer than the read it saves, so a
#: stopped or slow rank costs another little, and ranks that reach an entry together (SPMD
#: after a barrier) still read it once a node.
WAIT_BOUNDS = (0.002, 0.25)
FIRST_WAIT = 0.02
WAIT_POLL = 0.0005
#: Seconds between two marks of a shared entry as used by a node whose ranks read its copy.
MARK_EVERY = 3600.0
MAX_SERVED = 100_000
#: The name of a copy in the node-local directory (its locks, temp files and prune lock are
#: named as in the shared directory).
COPY_SUFFIX = ".copy"
#: Hex digits of a shared directory's digest, its copies' folder name.
ROOT_DIGITS = 16
#: The name of what a process of the node last saw of a shared entry (its stamp), and for
#: how long (seconds) the node's processes take it from there instead of asking the shared
#: directory; older records are swept at exit.
SEEN_SUFFIX = ".seen"
SEEN_FOR = 60.0
#: The folder of :mod:`.nodecompile`'s records in the node's storage, their suffix, and how
#: long they are kept (seconds; the pocl caches they name may be gone after that).
COMPILES = "compiles"
RECORD_SUFFIX = ".compiled"
RECORD_FOR = 3600.0
#: Between a key and the lock suffix: the node's claim to write the key (:meth:`NodeCopies.write_claim`).
WRITE_CLAIM = "-write"


@dataclass(frozen=True)
class NodePlace:
    """Where this user's node-local copies live on this node (:func:`node_base`)."""

    #: ``ASYNCCLCACHE_NODE_DIR`` (made if missing; a link to it is followed, as the user named
    #: it), else ``$TMPDIR`` or ``/tmp``: a folder others may share.
    parent: Path
    #: ``<parent>/asyncclcache-<uid>``: made private, never a link (others can write the parent).
    top: Path
    #: ``top``, or its ``node-<digest>`` folder for a simulated node (tests): what
    #: :class:`NodeStorage` keeps in order.
    base: Path
    given: bool


def node_base(given: str | None = None, simulated: str | None = None) -> NodePlace:
    """Where this user's copies live on this node: ``asyncclcache-<uid>/`` in ``given``
    (``ASYNCCLCACHE_NODE_DIR``, an absolute path: :func:`.config.absolute_path`), else in
    ``$TMPDIR`` (where absolute), else in ``/tmp``; per simulated node (``simulated``, tests)
    a folder of its own in that."""
    if given:
        parent = Path(given)
    else:
        tmp = os.environ.get("TMPDIR", "")
        # Not tempfile.gettempdir(): where no temp folder is writable it picks the working one.
        parent = Path(tmp if os.path.isabs(tmp) else "/tmp")  # noqa: S108 - a parent; ours is made in it
    uid = os.getuid() if hasattr(os, "getuid") else 0
    top = parent / f"asyncclcache-{uid}"
    base = top / f"node-{hashlib.sha256(simulated.encode()).hexdigest()[:12]}" if simulated else top
    return NodePlace(parent, top, base, bool(given))


class NodeStorage:
    """Every copy this user keeps on this node (:attr:`NodePlace.base`): of every shared
    directory, removed ones included. What :mod:`.maintenance` keeps in order at exit (its
    sweep, and the prune to ``ASYNCCLCACHE_NODE_MAX_SIZE``), so that the bound bounds the
    node, not one directory's share of it. Thread- and process-safe."""

    #: Maintenance writes here (removes orphans) whenever it is usable.
    read_only = False

    def __init__(self, base: Path) -> None:
        self.root = base

    @property
    def enabled(self) -> bool:
        return self.root.is_dir() and not self.root.is_symlink()

    def roots(self) -> Iterator[Path]:
        """The folders of each shared directory's copies (named by its digest; not links)."""
        return hex_dirs(self.root, ROOT_DIGITS)

    def files(self) -> Iterator[tuple[Path, str]]:
        """``(path, name)`` of every file in every fan-out directory (copies, locks, temps;
        and the records of :mod:`.nodecompile`)."""
        for r in self.roots():
            yield from fanout_files(r)
        yield from fanout_files(self.root / COMPILES)

    def entries(self) -> Iterator[StoredEntry]:
        """Every copy, unvalidated (``key``: its name less the suffix)."""
        for r in self.roots():
            yield from listed(r, COPY_SUFFIX)

    @staticmethod
    def expired(path: Path, name: str) -> bool:
        """Whether the file ``name`` at ``path`` is a record of what the node saw that no
        process takes any more (older than :data:`SEEN_FOR`), or a record of a compile on
        the node older than :data:`.nodecompile.RECORD_FOR`: the sweep removes it."""
        keep = SEEN_FOR if name.endswith(SEEN_SUFFIX) else RECORD_FOR if name.endswith(RECORD_SUFFIX) else None
        if keep is None:
            return False
        try:
            return time.time() - os.lstat(path).st_mtime >= keep
        except OSError:
            return False


def _stamp_name(stamp: Stamp) -> str:
    return hashlib.sha256(repr(tuple(stamp)).encode()).hexdigest()[:16]


class NodeCopies:
    """This node's copies of the entry files of ``shared`` (a shared store's), kept in
    ``where`` (:func:`node_base`): a tier in front of them. :meth:`.store.Store.lookup`
    reads through :meth:`read`, which reads ``shared`` itself where this node has no copy.
    ``count`` is the counters' ``add``. Thread- and process-safe."""

    def __init__(self, shared: SharedDir, where: NodePlace, count: Callable[[str], None] | None = None,
                 max_bytes: int | None = DEFAULT_NODE_MAX_BYTES) -> None:
        self.shared = shared
        self.root = where.base / hashlib.sha256(str(shared.root).encode()).hexdigest()[:ROOT_DIGITS]
        self.count = count if count is not None else (lambda name: None)
        #: Every copy on the node, this directory's and others': kept in order at exit.
        self.storage = NodeStorage(where.base)
        #: The bound of all of this user's copies on the node (``None``: none), kept by
        #: :func:`.maintenance.prune` of :attr:`storage` at exit.
        self.max_bytes = max_bytes
        self.problem: str | None = None
        self._lock = threading.Lock()
        self._budget = FIRST_WAIT
        #: Keys this process read from a copy, and the copy's path.
        self._served: dict[str, Path] = {}
        try:
            if where.given:
                where.parent.mkdir(parents=True, exist_ok=True)
            for d in dict.fromkeys((where.top, where.base, self.root)):
                make_private_dir(d)
        except OSError as e:
            self._give_up(e)

    @property
    def enabled(self) -> bool:
        """False once the node-local directory failed: the shared directory serves."""
        return self.problem is None

    def _give_up(self, e: OSError | str) -> None:
        why = e if isinstance(e, str) else (str(e) if e.strerror is None else f"{e.strerror} ({e.filename})")
        with self._lock:
            if self.problem is not None:
                return
            self.problem = why
        warnings.warn(
            f"asyncclcache: node-local directory {self.root} cannot be used: {why}; reading "
            "entries from the shared directory instead",
            NodeDirWarning,
            stacklevel=5,
        )

    def _copy_path(self, key: str, stamp: Stamp) -> Path:
        return self.root / key[:2] / f"{key}-{_stamp_name(stamp)}{COPY_SUFFIX}"

    # {{{ read

    def read(self, key: str) -> ReadResult:
        """:meth:`.shared.SharedDir.read` of ``key``, from this node's copy of the shared
        file as it is now where there is one: as a process of the node saw it within
        :data:`SEEN_FOR` (nothing asked of the shared directory; the result's ``stamp`` then
        stands for its ``stat``), else after one ``lstat`` of the shared file (no open);
        else the shared file, copied for the node's other ranks by the one that holds the
        node's claim (the others wait for that copy no longer than a read of their own
        takes, :meth:`wait_for`). Once this folder failed: the shared file, at once."""
        shared = self.shared
        if not self.enabled:  # nothing to copy to, nor to wait for
            return self._read_shared(key, None)
        path = shared.path_for(key)
        seen = self._seen(key)
        if seen is not None:
            near = self._from_copy(key, path, seen, None, self.copy(key, seen))
            if near is not None:
                return near
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return ReadResult(path)  # a miss, and nothing opened
        except OSError:
            st = None
        # The shared file's identity names its copy (a link, another user's file: no copy).
        usable = st is not None and stat.S_ISREG(st.st_mode) and insecure(st) is None
        stamp = stamp_of(st) if st is not None and usable else None
        if stamp is not None:
            self._saw(key, stamp)
        near = None if stamp is None else self._from_copy(key, path, stamp, st, self.copy(key, stamp))
        if near is not None:
            return near
        claim = self.claim(key)
        if claim is None and stamp is not None:
            # Another rank of the node is copying it: its copy, if it comes within the time
            # a read of our own would take.
            data, claim = self.wait_for(key, stamp)
            near = self._from_copy(key, path, stamp, st, data)
            if near is not None:
                return near
        return self._read_shared(key, claim)

    def _from_copy(self, key: str, path: Path, stamp: Stamp, st: os.stat_result | None,
                   data: bytes | None) -> ReadResult | None:
        """``data``, the copy of the shared file ``stamp``, checked as the shared entry is;
        ``None`` where there is none, or it failed (dropped)."""
        if data is None:
            return None
        try:
            entry = check_data(key, data)
        except EntryFormatError as e:
            self.drop(key, stamp, str(e))
            return None
        self.count("node_reads")
        return ReadResult(path, entry=entry, stat=st, data=data, stamp=stamp)

    def _seen_path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}{SEEN_SUFFIX}"

    def _seen(self, key: str) -> Stamp | None:
        """The stamp a process of the node saw of the shared entry within :data:`SEEN_FOR`."""
        data = read_own(self._seen_path(key), fresh_for=SEEN_FOR)
        fields = [] if data is None else data.split()
        if len(fields) != 4 or not all(f.isdigit() for f in fields):
            return None
        return tuple(int(f) for f in fields)  # type: ignore[return-value]

    def _saw(self, key: str, stamp: Stamp) -> None:
        """Leave what this process saw of the shared entry for the node's others (scratch:
        no fsync; a torn record does not parse and is asked again)."""
        target = self._seen_path(key)
        try:
            make_private_dir(target.parent)
            atomic_write(target.parent, target, " ".join(map(str, stamp)).encode(), durable=False)
        except OSError as e:
            logger.debug("asyncclcache: no record of %s on the node: %s", key[:12], e)

    def forget(self, key: str) -> None:
        """Drop what the node saw of ``key``'s shared entry (it was removed or refused here):
        the node's next lookup asks the shared directory."""
        with contextlib.suppress(OSError):
            os.unlink(self._seen_path(key))

    def _read_shared(self, key: str, claim: Claim | None) -> ReadResult:
        """The shared file, read and counted; under the node's ``claim``, left as the
        node's copy. Releases ``claim``."""
        try:
            t0 = time.monotonic()
            r = self.shared.read(key)  # and what is wrong with the file, as without copies
            if r.data is not None:
                self.read_took(time.monotonic() - t0)
                self.count("shared_reads")
            if claim is not None and r.entry is not None and r.data is not None and r.stat is not None:
                self.write(key, stamp_of(r.stat), r.data)
        finally:
            if claim is not None:
                claim.release()
        return r

    def copy(self, key: str, stamp: Stamp) -> bytes | None:
        """The bytes of this node's copy of the shared file ``stamp`` of ``key`` (unchecked:
        the caller checks them as an entry), or ``None``."""
        if not self.enabled:
            return None
        path = self._copy_path(key, stamp)
        data = read_own(path)
        if data is not None:
            # Its atime: the node's LRU (prune). Its mtime stays when the node last marked the
            # shared entry used (:meth:`shared_use_due`).
            with contextlib.suppress(OSError):
                st = os.lstat(path)
                os.utime(path, ns=(time.time_ns(), st.st_mtime_ns), follow_symlinks=False)
            with self._lock:
                if len(self._served) >= MAX_SERVED:
                    self._served.clear()
                self._served[key] = path
        return data

    def shared_use_due(self, key: str) -> bool:
        """Whether a use of ``key`` should mark the shared entry used (its atime, for the
        shared directory's LRU): yes unless this process read it from a copy whose node
        marked it within :data:`MARK_EVERY` (this host's clock against this host's file),
        so a node's ranks mark an entry about once an hour, not once a hit each."""
        with self._lock:
            path = self._served.get(key)
        if path is None:
            return True
        try:
            st = os.lstat(path)
            if time.time() - st.st_mtime < MARK_EVERY:
                return False
            os.utime(path, follow_symlinks=False)  # marked now
        except OSError:
            pass
        return True

    def wait_for(self, key: str, stamp: Stamp) -> tuple[bytes | None, Claim | None]:
        """While another process of the node holds ``key``'s claim (copying it): its copy,
        waited for no longer than this process's own reads of the shared directory take
        (:meth:`read_took`); or the claim, if its holder let go without a copy (killed, or
        its read failed). ``(None, None)``: read the shared entry yourself."""
        deadline = time.monotonic() + self._budget
        while self.enabled:  # a folder that failed meanwhile has no copy to wait for
            data = self.copy(key, stamp)
            if data is not None:
                return data, None
            claim = self.claim(key)
            if claim is not None or time.monotonic() >= deadline:
                return None, claim
            time.sleep(WAIT_POLL)
        return None, None

    def read_took(self, seconds: float) -> None:
        """A read of the shared directory took ``seconds``: the wait for another's copy is
        bounded by twice the slowest (:data:`WAIT_BOUNDS`)."""
        lo, hi = WAIT_BOUNDS
        with self._lock:
            self._budget = min(hi, max(self._budget, lo, 2 * seconds))

    def drop(self, key: str, stamp: Stamp, why: str) -> None:
        """Remove a copy that failed its check (torn, damaged): the next reader copies again."""
        logger.info("dropping damaged node-local copy of %s: %s", key[:12], why)
        with contextlib.suppress(OSError):
            os.unlink(self._copy_path(key, stamp))

    # }}}

    # {{{ write

    def claim(self, key: str) -> Claim | None:
        """The node's claim to copy ``key`` (an ``flock``, never waited for); ``None``
        while another process holds it, or where the node-local directory failed."""
        if not self.enabled:
            return None
        fanout = self.root / key[:2]
        try:
            make_private_dir(fanout)
            return take(key, fanout / (key + LOCK_SUFFIX))
        except OSError as e:
            self._give_up(e)
            return None

    def write_claim(self, key: str) -> Claim | bool:
        """The node's claim to write ``key`` to the shared directory (an ``flock``, never
        waited for), taken before the shared directory's: the node's other processes then
        skip the key without asking the shared directory. ``False`` while another process
        of the node holds it; ``True`` where the node-local directory failed (no node claim:
        the shared directory's alone decides)."""
        if not self.enabled:
            return True
        fanout = self.root / key[:2]
        try:
            make_private_dir(fanout)
            claim = take(key, fanout / f"{key}{WRITE_CLAIM}{LOCK_SUFFIX}")
        except OSError as e:
            self._give_up(e)
            return True
        return False if claim is None else claim

    def put(self, key: str, stamp: Stamp, data: bytes) -> None:
        """Keep ``data`` (checked) as the copy of the shared file ``stamp`` of ``key``: what
        this process just wrote there. Skipped while another process copies ``key``."""
        claim = self.claim(key)
        if claim is None:
            return
        try:
            self.write(key, stamp, data)
        finally:
            claim.release()

    def write(self, key: str, stamp: Stamp, data: bytes) -> None:
        """Under ``key``'s :meth:`claim`: keep ``data`` as the copy of the shared file ``stamp``."""
        target = self._copy_path(key, stamp)
        try:
            atomic_write(target.parent, target, data, durable=False)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG):
                self._give_up(e)
            else:
                logger.info("asyncclcache: no node-local copy of %s: %s", key[:12], e)
            return
        self._saw(key, stamp)  # the node's others take this copy without asking the shared directory
        # Older copies of this key: their shared file was replaced.
        with contextlib.suppress(OSError):
            for name in os.listdir(target.parent):
                if name.startswith(key + "-") and name.endswith(COPY_SUFFIX) and name != target.name:
                    with contextlib.suppress(OSError):
                        os.unlink(target.parent / name)

    # }}}
