"""Strategy ``kcache``: store pocl's own kernel-cache folder of a program, not a binary.

pocl keeps each program it builds at ``<POCL_CACHE_DIR>/<XX>/<hash>/``: ``program.bc``,
``last_accessed`` and ``<kernel>/<variant>/<kernel>.so`` (``.so.o`` on pocl's JIT) for
every variant launched. Every build of the program touches ``last_accessed``
(docs/design.md F15). That folder, put into an empty kernel cache on a new node, is used
as it is: the build skips the front end and the first launch compiles nothing (F16). So
nothing is compiled for the cache at all: no binary query, no generic variant, no helper.

* **Identify** (background thread): the folder whose ``last_accessed`` moved inside the
  build's window. Windows are in the file system's own time base (:class:`FsClock`,
  measured on a file we touch there), never ``time.time()`` against a file's stamp:
  caches live on NFS and Lustre, with coarse stamps and skewed clocks. Other builds
  move theirs too (threads, ranks sharing pocl's cache): a folder with kernels the
  program lacks, or owned by another user, is not ours; a touch long before our
  build's end was another build's (:func:`choose`). Folders still not told apart (the
  same kernel names at the same moment, or within a coarse tick) are settled by a probe:
  one more cached build of the program, and the folder pocl touches. Exactly one folder
  per kind of device, or nothing is stored (counted ``unidentified``): when in doubt, miss.
* **Snapshot**: the folder's files, once every kernel has a variant compiled since the
  build (the first launches), else after :data:`SETTLE_SECONDS`, at a step's end or at
  ``flush()``. Only files of ours, bounded in size (:func:`folder_files`).
* **Hit**: write the missing files into pocl's cache (temp file + link, never over
  an existing file, never through a link, never into a folder of another user), do
  the plain source build, and check that pocl touched the folder: ``last_accessed``
  appeared or changed (no clock involved; :func:`mark` first sets an existing one
  back). If it did not, what we wrote is removed and the build is a plain miss. The
  entry is kept, since the cause may be a setting (pocl's cache elsewhere or off);
  this run's own snapshot replaces it where pocl did write a folder for it.
* **Refresh**: compare file names; rewrite only when the folder gained a file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import pocl_env
from ..entry import valid_pocl_file as valid_file
from ..fileio import CLOEXEC, NOFOLLOW, InsecurePathError
from ..fsclock import EPS, FsClock, clock_for
from .background import BackgroundDriver, Waiting
from .base import Done, Hit, Job, Lost, Snapshot, SourceBuild
from .cachefiles import MAX_ENTRY_BYTES, MAX_FILES, read_trusted, restore, trusted_dir, unrestore, untrusted

if TYPE_CHECKING:

    from ..entry import Entry

__all__ = [
    "FsClock",
    "KcacheDriver",
    "build_candidates",
    "candidates",
    "choose",
    "find_folders",
    "folder_files",
    "folders_per_build",
    "kernel_cache_dir",
    "mark",
    "moved",
    "narrow",
    "valid_file",
    "window",
]

logger = logging.getLogger(__name__)

LAST_ACCESSED = "last_accessed"
#: Touches this much (plus a tick) before the end of our build belong to other builds.
CLOSE = 0.05
#: Outside a step, snapshot at the latest this long after the build.
SETTLE_SECONDS = 3.0
POLL_SECONDS = 0.2
#: At most one walk of every folder of pocl's cache this often (a large cache: many stats).
FULL_SCAN_SECONDS = 1.0
#: At most this many candidates are told apart by a probe build; more: nothing stored.
MAX_PROBE = 8
PROBE_ATTEMPTS = 4
PROBE_JITTER = 0.5

_O_DIR = os.O_RDONLY | os.O_DIRECTORY | NOFOLLOW | CLOEXEC


def kernel_cache_dir() -> Path | None:
    """pocl's kernel cache directory, as pocl finds it; ``None`` when pocl's cache is off
    (:func:`asyncclcache.pocl_env.kernel_cache_dir`)."""
    return pocl_env.kernel_cache_dir()


# {{{ finding a build's folder


def _program_folders(root: Path, new_since: float | None = None) -> Iterator[tuple[str, float]]:
    """``(XX/hash, stamp of last_accessed)`` of every program folder: one walk of two levels.

    With ``new_since`` (a stamp), only folders created or changed since then, found
    without a stat per folder: a new folder changes its ``XX`` directory's stamp, a
    touch does not.
    """
    try:
        with os.scandir(root) as it:
            tops = list(it)
    except OSError:
        return
    for top in tops:
        try:
            if not (len(top.name) == 2 and top.is_dir(follow_symlinks=False)):
                continue
            if new_since is not None and top.stat(follow_symlinks=False).st_mtime < new_since:
                continue
            with os.scandir(top.path) as it:
                programs = list(it)
        except OSError:
            continue
        for p in programs:
            try:
                if new_since is not None and p.stat(follow_symlinks=False).st_mtime < new_since:
                    continue
                st = os.stat(os.path.join(p.path, LAST_ACCESSED), follow_symlinks=False)
            except OSError:
                continue
            yield f"{top.name}/{p.name}", st.st_mtime


def _kernel_dirs(root: Path, folder: str) -> set[str] | None:
    try:
        with os.scandir(root / folder) as it:
            return {e.name for e in it if e.is_dir(follow_symlinks=False)}
    except OSError:
        return None


def candidates(
    root: Path, windows: Sequence[tuple[float, float]], *, new_only: bool = False
) -> list[tuple[tuple[str, float], ...]]:
    """For each window ``(lo, hi)`` of stamps (:class:`FsClock`), the folders touched in
    it, with the stamp (one scan for all). None inside: those touched later (the same
    program built again since).

    ``new_only``: look at folders created or changed since the oldest window only (cheap
    on a large kernel cache); a build that pocl served from an older folder needs the
    full scan.
    """
    if not windows:
        return []
    oldest = min(w[0] for w in windows)
    seen = [(rel, m) for rel, m in _program_folders(root, oldest if new_only else None) if m >= oldest]
    out = []
    for lo, hi in windows:
        inside = [(rel, m) for rel, m in seen if lo <= m <= hi]
        out.append(tuple(inside or [(rel, m) for rel, m in seen if m >= lo]))
    return out


def choose(
    root: Path, found: Sequence[tuple[str, float]], kernels: Sequence[str], end: float,
    tick: float, most: int = 1,
) -> tuple[str, ...]:
    """The build's own folder(s) among its candidates ``found``; ``()`` when none, or more
    than ``most`` (one per kind of device) are left: then nothing is stored.

    * A folder of another user, or one whose ``XX`` parent is, is never ours.
    * A launch makes ``<kernel>/`` folders: a folder with kernels the program lacks is
      another program's.
    * pocl touches ``last_accessed`` as the build returns: a touch well before ``end``
      (the stamp of the build's end, :meth:`FsClock.until`) was a build that ran meanwhile.
      The touch closest to our build's end is never dropped.
    """
    pool = narrow(root, found, kernels, end, tick)
    return pool if 0 < len(pool) <= most else ()


def narrow(
    root: Path, found: Sequence[tuple[str, float]], kernels: Sequence[str], end: float, tick: float,
) -> tuple[str, ...]:
    """The candidates that :func:`choose` keeps, however many (sorted)."""
    names = set(kernels)
    pool = []
    for f, m in found:
        if not (trusted_dir(root / f.split("/")[0]) and trusted_dir(root / f)):
            continue
        dirs = _kernel_dirs(root, f)
        if dirs is not None and dirs <= names:
            pool.append((f, m))
    near = [(f, m) for f, m in pool if m >= end - 2 * tick - CLOSE]
    return tuple(sorted(f for f, _ in near or pool))


def folders_per_build(job: Job) -> int:
    """How many folders one build of ``job`` makes: one per kind of device."""
    # Devices of one kind share a folder; several kinds, one folder each.
    return max(1, len({tuple(sorted(d.items())) for d in job.info.devices}))


def find_folders(root: Path, jobs: Sequence[Job], clock: FsClock | None = None) -> None:
    """Set ``job.folders`` for the jobs that lack one, now, in this thread: new folders
    first, a walk of every folder only if some job found none; then :func:`choose`.
    ``()``: not found. (The kcache driver does the same in its thread, batched and with the
    full walks throttled; the helper driver needs it before the helper touches a folder.)"""
    todo = [j for j in jobs if j.folders is None and j.built_to]
    if not todo:
        return
    if clock is None:
        clock = clock_for(str(root)) or FsClock(root)  # unmeasurable: the worst case
    windows = [window(clock, j) for j in todo]
    found = candidates(root, windows, new_only=True)
    if not all(found):
        found = candidates(root, windows)
    for job, cands in zip(todo, found, strict=True):
        job.folders = choose(root, cands, job.kernels, clock.until(job.built_to), clock.tick,
                             folders_per_build(job))


def build_candidates(root: Path, job: Job) -> list[str]:
    """The folders whose ``last_accessed`` lies in ``job``'s build window (the ones
    :func:`find_folders` could not tell apart). Disk I/O: background threads."""
    clock = clock_for(str(root)) or FsClock(root)
    [found] = candidates(root, [window(clock, job)])
    return [f for f, _ in found]


def window(clock: FsClock, job: Job) -> tuple[float, float]:
    """The stamps a touch inside ``job``'s build can carry."""
    return clock.since(job.built_from), clock.until(job.built_to)


def ready(root: Path, folders: Sequence[str], kernels: Sequence[str], since: float) -> bool:
    """Every kernel of the program has a variant compiled at or after stamp ``since`` in
    one of ``folders`` (the first launches are done; older variants were there before)."""
    if not kernels:
        return False
    for folder in folders:
        have = _kernel_dirs(root, folder) or set()
        if all(k in have and _new_variant(root / folder / k, k, since) for k in kernels):
            return True
    return False


def _new_variant(kdir: Path, kernel: str, since: float) -> bool:
    # The compiled file of a variant: pocl names it <kernel>.so, and on its JIT (pocl 7.2)
    # <kernel>.so.o; the work-group function's parallel.bc comes before it (pocl 7.1).
    try:
        with os.scandir(kdir) as variants:
            for v in variants:
                with contextlib.suppress(OSError), os.scandir(v.path) as files:
                    for f in files:
                        if (f.name.startswith(f"{kernel}.") and not f.name.endswith(".bc")
                                and f.stat(follow_symlinks=False).st_mtime >= since):
                            return True
    except OSError:
        pass
    return False


# }}}

# {{{ snapshot


def _walk(root: Path, folder: str) -> Iterator[tuple[str, str]]:
    """``(relative path, absolute path)`` of the folder's regular files, no links
    followed. Raises :class:`InsecurePathError` at a directory we must not trust."""
    stack = [folder]
    while stack:
        rel_dir = stack.pop()
        why = untrusted(os.lstat(root / rel_dir))
        if why is not None:
            raise InsecurePathError(f"{rel_dir} in pocl's kernel cache is {why}")
        with os.scandir(root / rel_dir) as it:
            for e in it:
                rel = f"{rel_dir}/{e.name}"
                if e.is_dir(follow_symlinks=False):
                    stack.append(rel)
                elif e.is_file(follow_symlinks=False) and e.name != LAST_ACCESSED and valid_file(rel):
                    yield rel, e.path


def listing(root: Path, folders: Sequence[str]) -> frozenset[str]:
    """The files of ``folders`` now (for a refresh: did a folder gain one?)."""
    out: set[str] = set()
    for folder in folders:
        with contextlib.suppress(OSError):
            out.update(rel for rel, _ in _walk(root, folder))
    return frozenset(out)


def folder_files(root: Path, folders: Sequence[str]) -> Snapshot:
    """Read every file of ``folders`` (pocl renames its files into place: never partial).

    Only what we may trust (:func:`untrusted`) and at most :data:`MAX_FILES` files and
    :data:`MAX_ENTRY_BYTES`; a folder that breaks a rule is left out, as is one removed
    under us. :class:`Lost` if none is left.
    """
    files: list[str] = []
    blobs: list[bytes] = []
    kept: list[str] = []
    why = "is gone"
    budget = MAX_ENTRY_BYTES
    for folder in folders:
        try:
            if not trusted_dir(root / folder.split("/")[0]):
                raise InsecurePathError(f"{folder.split('/')[0]} in pocl's kernel cache is not ours")
            data: list[tuple[str, bytes]] = []
            for rel, path in list(_walk(root, folder)):
                if len(files) + len(data) >= MAX_FILES:
                    raise Lost(f"more than {MAX_FILES} files")
                blob = read_trusted(path, budget)
                budget -= len(blob)
                data.append((rel, blob))
        except (InsecurePathError, Lost) as e:
            why = f"was refused: {e}"
            logger.warning("asyncclcache: not storing pocl's kernel-cache folder %s: %s", folder, e)
            continue
        except OSError:
            continue  # removed or replaced meanwhile
        if not any(rel.endswith("/program.bc") for rel, _ in data):
            continue
        kept.append(folder)
        for rel, blob in data:
            files.append(rel)
            blobs.append(blob)
    if not kept:
        raise Lost(f"pocl's kernel-cache folder {', '.join(folders)} {why}")
    return Snapshot(blobs, files, kept)


# }}}

# {{{ whether pocl used a restore


def mark(root: Path, folder: str) -> os.stat_result | None:
    """Before a build: the stamp of the folder's ``last_accessed``, set back by a few
    seconds first where it is ours, so that pocl's touch moves it even on a file system
    with 1-second stamps. ``None`` if there is none (a new node: pocl creates it)."""
    path = root / folder / LAST_ACCESSED
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if untrusted(st) is None:
        with contextlib.suppress(OSError):
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns - 4_000_000_000), follow_symlinks=False)
            st = os.lstat(path)
    return st


def moved(root: Path, folder: str, before: os.stat_result | None) -> bool:
    """After a build: did pocl touch the folder since :func:`mark` (no clock involved)?"""
    try:
        st = os.lstat(root / folder / LAST_ACCESSED)
    except OSError:
        return False
    return before is None or (st.st_ino, st.st_mtime_ns) != (before.st_ino, before.st_mtime_ns)


# }}}


class KcacheDriver(BackgroundDriver):
    """Snapshots pocl's kernel-cache folders on one background thread. Thread-safe.

    ``root`` is pocl's kernel cache directory as pocl found it when it started
    (:func:`asyncclcache.pocl_env.kernel_cache_dir`), fixed for the driver's life.
    """

    name = "kcache"
    kind = "kcache"
    needs_program = False
    refreshable = True
    watches_hits = True
    settle_seconds = SETTLE_SECONDS

    def __init__(self, root: Path) -> None:
        self.root = root
        self.clock = FsClock(root)  # unmeasured (the worst case) until the thread measures
        super().__init__()  # _waiting: snapshots waiting for the program's first launches
        self._identify: list[Job] = []
        self._need_full: dict[int, Job] = {}  # jobs whose folder is not a new one
        self._last_full = -FULL_SCAN_SECONDS
        self.scans = 0  # cheap walks of pocl's cache (new folders)
        self.full_scans = 0  # walks of every folder
        self.unused = 0  # hits whose restored folder pocl did not use
        self.probes = 0  # cached rebuilds that told candidates apart (:meth:`_probe`)
        self._contexts: dict[tuple[int, ...], Any] = {}  # the probe's, on this thread only

    # {{{ caller's threads

    def built(self, job: Job) -> None:
        with self._cond:
            if self._closed:
                return
            self._identify.append(job)
            self._start()
            self._cond.notify()

    def hurry(self) -> None:
        now = time.time()
        with self._cond:
            # Also for fetches still on their way (a claim on a writer thread): at exit a
            # settle wait would hold the process for SETTLE_SECONDS.
            self._hurried_at = now
            self._last_full = -FULL_SCAN_SECONDS
            for w in self._waiting:
                w.due = min(w.due, now)
            self._cond.notify()

    def stale(self, jobs: Sequence[Job]) -> list[Job]:
        # A refresh is a comparison of file names: rewrite only what gained a file.
        return [
            j
            for j in jobs
            if j.folders and not listing(self.root, j.folders) <= j.written_files
        ]

    def build_from_entry(self, entry: Entry, source: SourceBuild) -> Hit:
        files = list(entry.meta.files or [])
        folders = entry_folders(files)
        marks = {f: mark(self.root, f) for f in folders}
        try:
            placed = restore(self.root, files, entry.binaries, valid_file)
        except (OSError, ValueError) as e:
            # Our I/O failed, or pocl's cache holds what we must not write into: not the
            # entry's fault. Build from source without restoring.
            self._warn_once("restore", f"could not restore pocl's kernel cache ({e}); built from source")
            return Hit(source.build(), False, f"restore failed: {e}", (), blame_entry=False)
        try:
            program = source.build()
        except BaseException:
            unrestore(self.root, placed)
            raise
        used = tuple(f for f in folders if moved(self.root, f, marks[f]))
        if used:
            return Hit(program, True, "", used)
        unrestore(self.root, placed)
        self.unused += 1
        self._warn_once(
            "unused",
            f"pocl did not use the stored kernel-cache files of {entry.key[:12]} (pocl's kernel "
            f"cache is not {self.root}, or is off, or pocl computed another folder); built from "
            "source. The entry is kept; this run's snapshot replaces it where pocl wrote one",
        )
        return Hit(program, False, "pocl did not use the restored kernel-cache folder", (),
                   blame_entry=False, rejected=True)

    def _closing(self) -> None:
        self._identify = []

    # }}}

    # {{{ background thread

    def _run(self) -> None:
        while True:
            with self._cond:
                if not (self._closed or self._identify or self._due()):
                    # Waiting snapshots: poll for the launches' variants.
                    self._cond.wait(POLL_SECONDS if self._waiting else None)
                if self._closed:
                    return
                todo, self._identify = self._identify, []
                todo += [w.job for w in self._waiting]
            t0 = time.thread_time()
            # The process's one clock of this file system (shared with the key's headers).
            self.clock = clock_for(str(self.root)) or self.clock
            self._scan(todo)
            snaps = [self._snapshot(job, done) for job, done in self._take_ready()]
            if self.on_cpu is not None:
                self.on_cpu(time.thread_time() - t0)
            for report, result, error in (s for s in snaps if s is not None):
                report(result, error)

    def _snapshot(self, job: Job, done: Done) -> tuple[Done, Snapshot | None, BaseException | None] | None:
        try:
            if job.candidates is not None:
                # Again at every snapshot: launches since narrow the choice.
                pool = narrow(self.root, job.candidates, job.kernels, self.clock.until(job.built_to),
                              self.clock.tick)
                if not pool and not job.scanned_all:
                    # Only others' new folders: ours is an older one. Look at all.
                    job.candidates = None
                    self._need_full[id(job)] = job
                    with self._cond:
                        self._waiting.append(Waiting(job, done, time.time()))
                    return None
                most = folders_per_build(job)
                if len(pool) > most:
                    pool = self._probe(job, pool, most)
                job.folders = pool if 0 < len(pool) <= most else ()
            if not job.folders:
                raise Lost("pocl's kernel-cache folder of this build could not be identified")
            snap = folder_files(self.root, job.folders)
        except BaseException as e:  # noqa: BLE001 - reported through done
            return done, None, e
        job.queried_at = time.time()
        return done, snap, None

    def _probe(self, job: Job, pool: Sequence[str], most: int) -> tuple[str, ...]:
        """Folders that cannot be told apart (programs with the same kernel names built at
        the same moment, or within one tick of a coarse clock): build the program once
        more, from pocl's cache (a cheap cached build), and see which of them pocl
        touches. No clock is compared but the measured one, to wait until a touch must
        carry a later stamp. ``()`` when that cannot settle it (another process probing
        or building the others during each attempt)."""
        if len(pool) > MAX_PROBE or job.cwd != Job.caller_cwd() or (
                job.environ is not None and job.environ != Job.caller_environ()):
            return ()  # the same build is not possible here any more: never guess
        for _ in range(PROBE_ATTEMPTS):
            # Ranks that built at the same moment probe at the same moment too: a random
            # delay before each attempt puts them out of step (a collision: both moved).
            time.sleep(random.uniform(0.0, PROBE_JITTER))
            moved_now = self._probe_once(job, pool)
            if moved_now is None:
                return ()
            if 0 < len(moved_now) <= most:
                return moved_now
        return ()

    def _probe_once(self, job: Job, pool: Sequence[str]) -> tuple[str, ...] | None:
        before = {}
        for f in pool:
            try:
                before[f] = os.lstat(self.root / f / LAST_ACCESSED)
            except OSError:
                return None
        newest = max(st.st_mtime_ns for st in before.values()) / 1e9
        deadline = time.monotonic() + 3 * self.clock.tick + 2 * EPS
        while self.clock.since(time.time()) <= newest:
            if self._closed or time.monotonic() > deadline:
                return None
            time.sleep(min(0.05, self.clock.tick / 4))
        try:
            self._rebuild(job)
        except Exception as e:  # noqa: BLE001 - a failed probe is a miss, never an error
            logger.debug("asyncclcache: probe build failed: %s", e)
            return None
        self.probes += 1
        return tuple(f for f in pool if moved(self.root, f, before[f]))

    def _rebuild(self, job: Job) -> None:
        import pyopencl as cl

        ids = tuple(d.int_ptr for d in job.devices)
        ctx = self._contexts.get(ids)
        if ctx is None:
            ctx = self._contexts[ids] = cl.Context(list(job.devices))
        prg = cl._cl._Program(ctx, job.source.decode("utf-8"))  # as cached_build encoded it
        prg.build(job.options, list(job.devices))

    def _due(self) -> bool:
        now = time.time()
        return any(w.due <= now for w in self._waiting)

    def _scan(self, jobs: list[Job]) -> None:
        # New folders first: cheap however large pocl's cache is. A build that pocl served
        # from an older folder (the same program built before on this node) needs a walk
        # of every folder; those are batched, at most one per FULL_SCAN_SECONDS.
        todo = list({id(j): j for j in jobs if j.candidates is None and j.folders is None}.values())
        fresh = [j for j in todo if id(j) not in self._need_full]
        if fresh:
            self.scans += 1
            found = candidates(self.root, [window(self.clock, j) for j in fresh], new_only=True)
            for job, cands in zip(fresh, found, strict=True):
                if cands:
                    job.candidates = cands
                else:
                    self._need_full[id(job)] = job
        now = time.monotonic()
        hurried = any(j.built_to <= self._hurried_at for j in self._need_full.values())
        if self._need_full and (hurried or now - self._last_full >= FULL_SCAN_SECONDS):
            full = list(self._need_full.values())
            self._need_full.clear()
            self._last_full = now
            self.full_scans += 1
            found = candidates(self.root, [window(self.clock, j) for j in full])
            for job, cands in zip(full, found, strict=True):
                job.candidates = cands
                job.scanned_all = True

    def _take_ready(self) -> list[tuple[Job, Done]]:
        # Disk checks outside the lock: fetch() on a caller's thread must never wait on them.
        now = time.time()
        with self._cond:
            waiting = list(self._waiting)
        take = [w for w in waiting if self._ready(w, now)]
        with self._cond:
            current = {id(w) for w in self._waiting}  # close() may have dropped some meanwhile
            take = [w for w in take if id(w) in current]
            taken = {id(w) for w in take}
            self._waiting = [w for w in self._waiting if id(w) not in taken]
        return [(w.job, w.done) for w in take]

    def _ready(self, w: Waiting, now: float) -> bool:
        job = w.job
        if job.candidates is None and job.folders is None:
            return False  # not scanned yet
        if w.due <= now or not (job.candidates or job.folders):
            return True
        if job.candidates is not None:
            # Only a folder that can be ours tells that our launches are done; an
            # ambiguous choice may narrow once the launches made their kernel folders.
            folders = choose(self.root, job.candidates, job.kernels, self.clock.until(job.built_to),
                             self.clock.tick, folders_per_build(job))
        else:
            folders = job.folders or ()
        return bool(folders) and ready(self.root, folders, job.kernels, self.clock.since(job.built_from))

    # }}}


def entry_folders(files: Sequence[str]) -> list[str]:
    """The program folders (``XX/hash``) that ``files`` belong to, in order."""
    return list(dict.fromkeys("/".join(f.split("/")[:2]) for f in files))


