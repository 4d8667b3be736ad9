"""Strategy ``kcache`` on a driver cache of one folder per program (pocl's kernel cache):
store the program's own folder, not a binary.

That folder (found and read by :mod:`.folders`), put into an empty kernel cache on a new
node, is used as it is: the build skips the front end and the first launch compiles
nothing (docs/design.md F16). So nothing is compiled for the cache at all: no binary
query, no generic variant, no other process.

* **Identify** (background thread): the folder whose ``last_accessed`` moved inside the
  build's window. Other builds move theirs too (threads, ranks sharing pocl's cache): a
  folder with kernels the program lacks, or owned by another user, is not ours; a touch
  long before our build's end was another build's (:func:`~.folders.choose`). Folders
  still not told apart (the same kernel names at the same moment, or within a coarse
  tick) are settled by a probe: one more cached build of the program, and the folder
  pocl touches. Exactly one folder per kind of device, or nothing is stored (counted
  ``unidentified``): when in doubt, miss.
* **Snapshot**: the folder's files, once every kernel has a variant compiled since the
  build (the first launches), else after :data:`SETTLE_SECONDS`, at a step's end or at
  ``flush()``. Only files of ours, bounded in size (:func:`~.folders.folder_files`).
* **Hit**: write the missing files into pocl's cache (:func:`~.cachefiles.restore`): the
  program's bitcode before the build, the kernels' variants on a writer thread during it
  (read at the first launch; waited for before ``build()`` returns). Do the plain source
  build, and check that pocl touched the folder: ``last_accessed``
  appeared or changed (no clock involved; :func:`~.folders.mark` first sets an
  existing one back). If it did not, what we wrote is removed and the build is a plain
  miss. The entry is kept, since the cause may be a setting (pocl's cache elsewhere or
  off); this run's own snapshot replaces it where pocl did write a folder for it.
* **Refresh**: compare file names; rewrite only when the folder gained a file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import _pyopencl
from ..fsclock import EPS, FsClock, clock_for
from ..platform import Layout
from ..platforms import pocl
from .background import BackgroundDriver, Waiting
from .base import Build, Done, Hit, HitOutcome, Job, Lost, PerJob, Snapshot
from .cachefiles import restore, unrestore
from .folders import (
    LAST_ACCESSED,
    at_launch,
    candidates,
    choose,
    entry_folders,
    folder_files,
    folders_per_build,
    lacks,
    listing,
    mark,
    missing,
    moved,
    narrow,
    ready,
    valid_file,
    window,
)

if TYPE_CHECKING:
    from ..entry import Entry
    from ..workers import Workers

__all__ = ["KcacheDriver"]

logger = logging.getLogger(__name__)

#: Outside a step, snapshot at the latest this long after the build.
SETTLE_SECONDS = pocl.LAYOUT.settle
POLL_SECONDS = 0.2
#: Entries whose folders a process remembers as restored and used (:meth:`KcacheDriver.build_from_entry`).
MAX_PLACED = 1 << 16
PROGRAM_FILE = pocl.PROGRAM_FILE
#: At most one walk of every folder of pocl's cache this often (a large cache: many stats).
FULL_SCAN_SECONDS = 1.0
#: At most this many candidates are told apart by a probe build; more: nothing stored.
MAX_PROBE = 8
PROBE_ATTEMPTS = 4
PROBE_JITTER = 0.5


@dataclass
class _Found:
    """What the driver learnt about one job. Each field has one writer: ``candidates``,
    ``scanned_all`` and ``folders`` the driver's thread; ``written`` the pipeline's
    writer thread (:meth:`KcacheDriver.written`, one at a time per job). A hit's are set
    before the job is shared (:meth:`KcacheDriver.watch`). Others read whole values."""

    #: Folders touched in the build's window, with the touch time (``None``: not scanned).
    candidates: tuple[tuple[str, float], ...] | None = None
    #: The candidates came from a walk of every folder, not only the new ones.
    scanned_all: bool = False
    #: pocl's folders for this program, as last chosen (``None``: not yet).
    folders: tuple[str, ...] | None = None
    #: The files the last written entry holds.
    written: frozenset[str] = frozenset()


class KcacheDriver(BackgroundDriver):
    """Snapshots pocl's kernel-cache folders on one background thread. Thread-safe.

    ``root`` is pocl's kernel cache directory as pocl found it when it started
    (:func:`asyncclcache.platforms.pocl.kernel_cache_dir`), fixed for the driver's life;
    ``layout``, pocl's (its CPU devices) or its CUDA device's (no launch adds a file);
    ``workers``, the cache's writer threads, where a hit writes its kernels' variants while
    pocl builds (``None``: on the caller's thread, before the build).
    """

    name = "kcache"
    kind = "kcache"
    needs_program = False
    refreshable = True
    watches_hits = True
    bakes = True
    settle_seconds = SETTLE_SECONDS

    def __init__(self, root: Path, layout: Layout = pocl.LAYOUT, workers: Workers | None = None) -> None:
        self.root = self.node_root = root
        self._workers = workers
        #: Whether launches add variants to a folder (a snapshot waits for them): pocl's
        #: CPU devices; its CUDA device's build writes every file (F27).
        self.launches_add = layout.launches_add
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
        self._of: PerJob[_Found] = PerJob(_Found)
        #: Entries a hit here restored and pocl used, with their folders: a repeat (a new
        #: context) finds them in pocl's cache still, and restores and checks nothing.
        self._placed: dict[str, tuple[str, ...]] = {}
        self._placed_lock = threading.Lock()

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
        # A refresh is a comparison of file names: rewrite only what gained a file. A
        # generic variant is no gain: a baked binary unpacks one, no launch needs it.
        out = []
        for job in jobs:
            found = self._of(job)
            folders, written = found.folders, found.written
            if folders and lacks(written, listing(self.root, folders)):
                out.append(job)
        return out

    def build_from_baked(self, baked: Entry, entry: Entry, build: Build) -> Hit:
        import pyopencl as cl

        files = entry.meta.files or []
        if baked.meta.baked_from != entry.key:
            return Hit(HitOutcome.REFUSED, None, "baked from another entry")
        try:
            program = build.from_binaries(baked.binaries)
        except cl.Error as e:
            return Hit(HitOutcome.REFUSED, None, f"{e.code}: {e.what if hasattr(e, 'what') else e}")
        # pocl unpacks the binary into the program's own folder, where launches add variants.
        folders = tuple(entry_folders(files))
        self._add_later_variants(entry, baked.meta.baked_files or (), folders)
        return Hit(HitOutcome.USED, program, "", folders)

    def _add_later_variants(self, entry: Entry, held: Sequence[str], folders: Sequence[str]) -> None:
        """The variants ``entry`` gained after its bake (launches with other local sizes, at
        a refresh of the run that baked it), written beside what the binary unpacked, so that
        those launches compile nothing either. Only into a folder pocl did unpack into; a
        failure costs those launches their compile, never the hit."""
        files = entry.meta.files or ()
        need = set(missing(held, files))
        later = [(f, blob) for f, blob in zip(files, entry.binaries, strict=False) if f in need]
        if not later or not all(self._holds(f) for f in folders):
            return
        try:
            restore(self.root, [f for f, _ in later], [blob for _, blob in later], valid_file)
        except (OSError, ValueError) as e:
            self._warn_once("restore", f"could not restore pocl's kernel cache ({e}); launches compile")

    def watch(self, job: Job, entry: Entry, hit: Hit) -> None:
        self._of(job).folders = hit.folders
        self._of(job).written = frozenset(entry.meta.files or ())

    def written(self, job: Job, snap: Snapshot) -> None:
        self._of(job).written = frozenset(snap.files or ())

    def build_from_entry(self, entry: Entry, build: Build) -> Hit:
        with self._placed_lock:
            placed = self._placed.get(entry.key)
        if placed is not None and all(self._holds(f) for f in placed):
            return Hit(HitOutcome.USED, build.from_source(), "", placed)
        hit = self._restore_and_build(entry, build)
        if hit.outcome is HitOutcome.USED:
            with self._placed_lock:
                if len(self._placed) >= MAX_PLACED:
                    del self._placed[next(iter(self._placed))]
                self._placed[entry.key] = hit.folders
        return hit

    def _holds(self, folder: str) -> bool:
        # One stat: pocl's cache still holds the program (a removed folder is restored again).
        try:
            os.lstat(os.path.join(self.root, folder, PROGRAM_FILE))
        except OSError:
            return False
        return True

    def _restore_and_build(self, entry: Entry, build: Build) -> Hit:
        files = list(entry.meta.files or [])
        bad = next((f for f in files if not valid_file(f)), None)
        if bad is not None:
            return Hit(HitOutcome.REFUSED, None, f"the entry holds {bad!r}, not a file of pocl's kernel cache")
        folders = entry_folders(files)
        marks = {f: mark(self.root, f) for f in folders}
        # What the build reads (the bitcode) is written before it; the variants, read at
        # the first launch, on a writer thread while pocl builds (the GIL released), and
        # waited for before the build returns: a launch finds them whichever thread wrote them.
        workers = self._workers
        now: list[tuple[str, bytes]] = []
        later: list[tuple[str, bytes]] = []
        try:
            for f, blob in zip(files, entry.binaries, strict=True):
                (later if workers is not None and at_launch(f) else now).append((f, blob))
            placed = restore(self.root, [f for f, _ in now], [blob for _, blob in now], valid_file)
        except (OSError, ValueError) as e:
            # Our I/O failed, or pocl's cache holds what we must not write into: not the
            # entry's fault. Build from source without restoring.
            self._warn_once("restore", f"could not restore pocl's kernel cache ({e}); built from source")
            return Hit(HitOutcome.NOT_RESTORED, build.from_source(), f"restore failed: {e}")
        variants = None
        if later and workers is not None:
            variants = workers.handoff(
                lambda: restore(self.root, [f for f, _ in later], [blob for _, blob in later], valid_file))
        try:
            program = build.from_source()
        except BaseException:
            unrestore(self.root, placed)
            if variants is not None:
                with contextlib.suppress(OSError, ValueError):
                    unrestore(self.root, variants.result())
            raise
        if variants is not None:
            try:
                placed = placed.plus(variants.result())
            except (OSError, ValueError) as e:  # taken back by restore: those launches compile
                self._warn_once("restore", f"could not restore pocl's kernel cache ({e}); launches compile")
        used = tuple(f for f in folders if moved(self.root, f, marks[f]))
        if used:
            return Hit(HitOutcome.USED, program, "", used)
        unrestore(self.root, placed)
        self.unused += 1
        self._warn_once(
            "unused",
            f"pocl did not use the stored kernel-cache files of {entry.key[:12]} (pocl's kernel "
            f"cache is not {self.root}, or is off, or pocl computed another folder); built from "
            "source. The entry is kept; this run's snapshot replaces it where pocl wrote one",
        )
        return Hit(HitOutcome.UNUSED, program, "pocl did not use the restored kernel-cache folder")

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
        found = self._of(job)
        try:
            if found.candidates is not None:
                # Again at every snapshot: launches since narrow the choice.
                pool = narrow(self.root, found.candidates, job.kernels, self.clock.until(job.built_to),
                              self.clock.tick)
                if not pool and not found.scanned_all:
                    # Only others' new folders: ours is an older one. Look at all.
                    found.candidates = None
                    self._need_full[id(job)] = job
                    with self._cond:
                        self._waiting.append(Waiting(job, done, time.time()))
                    return None
                most = folders_per_build(job)
                if len(pool) > most:
                    pool = self._probe(job, pool, most)
                found.folders = pool if 0 < len(pool) <= most else ()
            if not found.folders:
                raise Lost("pocl's kernel-cache folder of this build could not be identified")
            snap = folder_files(self.root, found.folders)
            # A folder left out (refused, or without its program.bc) is not the program's.
            found.folders = tuple(entry_folders(snap.files or ()))
        except BaseException as e:  # noqa: BLE001 - reported through done
            return done, None, e
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
        prg = _pyopencl.source_program(ctx, job.source.decode("utf-8"))  # as cached_build encoded it
        prg.build(job.options, list(job.devices))

    def _due(self) -> bool:
        now = time.time()
        return any(w.due <= now for w in self._waiting)

    def _scan(self, jobs: list[Job]) -> None:
        # New folders first: cheap however large pocl's cache is. A build that pocl served
        # from an older folder (the same program built before on this node) needs a walk
        # of every folder; those are batched, at most one per FULL_SCAN_SECONDS.
        todo = [j for j in dict.fromkeys(jobs) if self._of(j).candidates is None and self._of(j).folders is None]
        fresh = [j for j in todo if id(j) not in self._need_full]
        if fresh:
            self.scans += 1
            found = candidates(self.root, [window(self.clock, j) for j in fresh], new_only=True)
            for job, cands in zip(fresh, found, strict=True):
                if cands:
                    self._of(job).candidates = cands
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
                self._of(job).candidates = cands
                self._of(job).scanned_all = True

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
        job, found = w.job, self._of(w.job)
        if found.candidates is None and found.folders is None:
            return False  # not scanned yet
        if w.due <= now or not (found.candidates or found.folders):
            return True
        if found.candidates is not None:
            # Only a folder that can be ours tells that our launches are done; an
            # ambiguous choice may narrow once the launches made their kernel folders.
            folders = choose(self.root, found.candidates, job.kernels, self.clock.until(job.built_to),
                             self.clock.tick, most=folders_per_build(job))
        else:
            folders = found.folders or ()
        if not self.launches_add:
            return bool(folders)
        return bool(folders) and ready(self.root, folders, job.kernels, self.clock.since(job.built_from))

    # }}}
