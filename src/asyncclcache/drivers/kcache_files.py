"""Strategy ``kcache`` on drivers whose disk cache is content-addressed: NVIDIA's compute
cache and Mesa's shader cache (rusticl). The files a build added to it are the entry.

Both keep one file per cache item, named by a hash of what the driver compiled
(``<x>/<y>/<hex>`` for NVIDIA, ``<xx>/<hex>`` for Mesa), so a file copied to a new node
is used there exactly when the driver would have made the same file (docs/design.md
F19, F20). The binary query's answer is not what a new node needs: PTX still runs the
JIT, rusticl's SPIR-V still compiles at the first launch.

* **Identify** (background thread): the files that appeared while the program was built
  and first launched, by their ``ctime`` in the file system's own time base
  (:class:`~asyncclcache.fsclock.FsClock`). The window ends where the next build of the
  same thread begins (sequential code launches what it built before it builds again), so
  consecutive programs do not share files. A build in another thread says nothing about
  this one's launches: a file in the windows of builds of two threads may be either's,
  and is in no entry (``in_doubt``, counted ``left_out``; a later hit where the program
  is built alone adds it, see *Hit*). Nor is a file that a hit of this process restored.
  There is no probe; only bounds (files, bytes) and the trust rules of pocl's cache:
  ours, writable by no one else, regular, one link.
* **Snapshot**: :attr:`Layout.settle` seconds after the build (NVIDIA writes at the
  build; Mesa writes later, from its own thread, and at the first launches), batched on
  half-seconds, or at a step's end or ``flush()`` (after :attr:`Layout.grace`). At
  ``flush()`` and exit an entry whose window gained files since (a first launch that
  compiled for longer) is rewritten with them. Files beyond the bounds are counted
  (``left_out``).
* **Hit**: write the missing files (temp file + link, never over an existing one, never
  through a link), then the plain source build. The check runs in the background: a
  file that the build added anyway, and that no entry this process hit holds, means the
  driver did not use (all of) ours; it is counted (``incomplete_hits``), warned once, and
  at ``flush()``/exit the entry is rewritten with what the driver added (files every
  program needs once per node, say).
* **Left out**: the driver's bookkeeping (NVIDIA's and Mesa's ``index``; both make it
  again), temp files (Mesa's ``*.tmp``), anything not named like an item.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import logging
import math
import os
import stat
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..fileio import InsecurePathError
from ..fsclock import FsClock, clock_for
from ..platform import Layout
from .background import BackgroundDriver, Waiting
from .base import Build, Done, Hit, HitOutcome, Job, Lost, Snapshot
from .cachefiles import MAX_ENTRY_BYTES, MAX_FILES, read_trusted, restore, trusted_dir, untrusted

if TYPE_CHECKING:
    from ..entry import Entry

__all__ = ["FileCacheDriver", "added_files"]

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.2
#: Settled snapshots are due on multiples of this: a scan costs a stat of every directory
#: of the driver's cache (NVIDIA: 256), whether it serves one snapshot or ten.
BATCH_SECONDS = 0.5
#: A file's ``ctime`` is its last write, its directory's stamp its creation: a driver that
#: writes a file for a while after creating it (NVIDIA: the ``ctime`` of some items was a few
#: ms after their directory's) leaves the directory older than the file. Directories are
#: listed back this far, so that whether a file lies in a window never depends on which
#: window the scan was made for (measured: 10 of 200 entries rewritten at exit without it).
DIR_SLACK = 2.0


def added_files(root: Path, layout: Layout, lo: float) -> dict[str, float]:
    """``{relative path: ctime}`` of the item files created or renamed into
    place (or written last) at stamp ``lo`` or later. Only directories changed since
    ``lo - DIR_SLACK`` are listed (a new file changes its directory's stamp), so a large
    cache costs one stat per directory. What we may not trust
    (:func:`~.cachefiles.untrusted`: another owner, writable by others, a second link)
    and symbolic links are left out."""
    out: dict[str, float] = {}
    level = [("", str(root))]
    for _ in range(layout.depth):
        below = []
        for rel, path in level:
            with contextlib.suppress(OSError), os.scandir(path) as it:
                for e in it:
                    if e.is_dir(follow_symlinks=False):
                        below.append((f"{rel}{e.name}/", e.path))
        level = below
    for rel, path in level:
        try:
            st = os.lstat(path)
            if max(st.st_mtime, st.st_ctime) < lo - DIR_SLACK or not trusted_dir(Path(path)):
                continue
            with os.scandir(path) as it:
                files = list(it)
        except OSError:
            continue
        for e in files:
            name = rel + e.name
            if not layout.valid(name):
                continue
            try:
                fst = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(fst.st_mode) and fst.st_ctime >= lo and untrusted(fst) is None:
                out[name] = fst.st_ctime
    return out


def read_files(root: Path, names: Sequence[str]) -> Snapshot:
    """The content of ``names`` that we may trust, within :data:`MAX_FILES` and
    :data:`MAX_ENTRY_BYTES`; one that breaks a rule or is gone is left out (and logged).
    :class:`Lost` if none is left."""
    files: list[str] = []
    blobs: list[bytes] = []
    budget = MAX_ENTRY_BYTES
    refused = 0
    for rel in sorted(names)[:MAX_FILES]:
        try:
            blob = read_trusted(str(root / rel), budget)
        except (InsecurePathError, Lost) as e:
            refused += 1
            logger.warning("asyncclcache: not storing %s: %s", rel, e)
            continue
        except OSError:
            continue  # evicted or replaced meanwhile
        budget -= len(blob)
        files.append(rel)
        blobs.append(blob)
    if not files:
        raise Lost(f"no file of this build could be stored ({refused} refused)")
    return Snapshot(blobs, files)


_local = threading.local()
_thread_numbers = itertools.count(1)


def _thread() -> int:
    """The calling thread's number: unlike ``threading.get_ident()``, never reused by a
    later thread (whose builds must not close the windows of this one's)."""
    n = getattr(_local, "n", None)
    if n is None:
        n = _local.n = next(_thread_numbers)
    return n


@dataclass(eq=False)
class _Span:
    """One build of this process through the driver (a miss's, or a hit's), in
    ``time.time()``: what the driver writes for its program appears from ``start`` on."""

    start: float
    thread: int  # :func:`_thread`; 0: unknown (every other build is another thread's)
    end: float | None = None  # None while a hit's build runs


@dataclass
class _Watch:
    """A hit, checked in the background: did its build add files anyway?"""

    key: str
    span: _Span  # from before the restore to after the build
    files: frozenset[str]  # what the entry holds
    due: float
    added: frozenset[str] | None = None  # the answer


class _Windows:
    """Every build's window in the file system's time, as known at one scan: from the
    build's start to the start of the next build of its thread (none yet: open)."""

    def __init__(self, spans: list[_Span], since: float, until: float) -> None:
        # since/until: FsClock.since(0), .until(0); both are local time plus a constant.
        self._since = since
        self._until = until
        by_thread: dict[int, list[float]] = {}
        for sp in spans:
            by_thread.setdefault(sp.thread, []).append(sp.start)
        for starts in by_thread.values():
            starts.sort()
        self._closes: dict[_Span, float] = {}
        for sp in spans:
            starts = by_thread[sp.thread]
            i = len(starts) if sp.end is None or not sp.thread else bisect.bisect_right(starts, sp.end)
            self._closes[sp] = starts[i] if i < len(starts) else math.inf
        self._all = [(sp, *self.bounds(sp)) for sp in spans]

    def bounds(self, span: _Span) -> tuple[float, float]:
        """``span``'s window: the stamps a touch in it can carry."""
        close = self._closes.get(span, math.inf)
        return span.start + self._since, close + self._until

    def others(self, span: _Span, lo: float, hi: float) -> list[tuple[float, float]]:
        """The windows of other threads' builds that meet ``[lo, hi]`` (of a build of no
        known thread: every other build's)."""
        return [(a, b) for sp, a, b in self._all
                if sp is not span and (sp.thread != span.thread or not span.thread) and a <= hi and lo <= b]


class FileCacheDriver(BackgroundDriver):
    """Snapshots a content-addressed driver cache on one background thread. Thread-safe.

    ``root`` is the cache's directory as the driver found it when it started
    (:attr:`.platform.Platform.locate`), and ``layout`` how it names its files (the
    platform's, :mod:`asyncclcache.platforms`); ``root`` is fixed for the driver's life,
    as the driver keeps it.
    """

    kind = "kcache"
    needs_program = False
    refreshable = True
    watches_hits = True
    batch_seconds = BATCH_SECONDS

    def __init__(self, root: Path, layout: Layout) -> None:
        self.root = root
        self.layout = layout
        self.name = layout.strategy
        self.settle_seconds = layout.settle
        self.clock = FsClock(root)  # unmeasured (the worst case) until the thread measures
        super().__init__()
        self._watches: dict[str, _Watch] = {}
        #: Every build this process ran through us (bounded): a window ends where the next
        #: build of its thread begins, and a file in the windows of two threads' is in doubt.
        self._spans: list[_Span] = []
        #: The build of each job (a miss), set by :meth:`built` on the caller's thread.
        self._span_of: weakref.WeakKeyDictionary[Job, _Span] = weakref.WeakKeyDictionary()
        #: Every name of an entry this process hit (placed by its restore or found there): a
        #: window must not take a file that a hit restored, or that an entry holds and the
        #: driver made at start-up, for a file the driver added for its build (bounded).
        self._known: dict[str, None] = {}
        #: The files each job's last written entry holds (written by the pipeline's writer
        #: thread, :meth:`written`; a hit's by :meth:`watch` before the job is shared).
        self._written: weakref.WeakKeyDictionary[Job, frozenset[str]] = weakref.WeakKeyDictionary()
        self.scans = 0
        self.unused = 0  # hits whose build added files to the driver's cache anyway
        self.left_out = 0  # files of a window not stored: bounds, trust rules, gone meanwhile, in doubt
        self.in_doubt = 0  # of those: also in the window of a build of another thread

    # {{{ caller's threads

    def built(self, job: Job) -> None:
        span = _Span(job.built_from, _thread(), job.built_to)
        with self._cond:
            self._span_of[job] = span
            self._add(span)
            self._start()  # measures the file system's clock before the first snapshot

    def _add(self, span: _Span) -> None:
        # Under self._cond.
        self._spans.append(span)
        del self._spans[:-4096]

    def hurry(self) -> None:
        now = time.time()
        with self._cond:
            self._hurried_at = now
            soon = now + self.layout.grace
            for w in self._waiting:
                w.due = min(w.due, soon)
            for h in self._watches.values():
                h.due = min(h.due, soon)
            self._cond.notify()

    def watch(self, job: Job, entry: Entry, hit: Hit) -> None:
        with self._cond:
            self._written[job] = frozenset(entry.meta.files or ())

    def written(self, job: Job, snap: Snapshot) -> None:
        with self._cond:
            self._written[job] = frozenset(snap.files or ())

    def unused_hit(self, key: str, files: Sequence[str]) -> None:
        # The miss's window then takes what the restore placed (the build used it).
        with self._cond:
            self._watches.pop(key, None)
            for rel in files:
                self._known.pop(rel, None)

    def stale(self, jobs: Sequence[Job]) -> list[Job]:
        """Hits whose build added files, and builds whose window gained files since their
        snapshot (Mesa compiles at the first launch, which may end long after it): their
        entries are rewritten with them. One scan (flush, exit)."""
        keys = {j.key for j in jobs}
        with self._cond:
            checks = [h for k, h in self._watches.items() if k in keys and h.added is None]
            written = {j: self._written.get(j, frozenset()) for j in jobs}
        built = [j for j in jobs if j.key not in self._watches and j.built_to and written[j]]
        added: dict[str, float] = {}
        if checks or built:
            # One scan for the hits not checked yet (flush and exit do not wait for the
            # thread) and the builds whose window may have grown.
            time.sleep(max(0.0, min(self._hurried_at + self.layout.grace - time.time(), self.layout.grace)))
            self.clock = clock_for(str(self.root)) or self.clock
            lo = min([self._lo(h.span.start) for h in checks] + [self._lo(j.built_from) for j in built])
            added = added_files(self.root, self.layout, lo)
            windows = self._windows()
            for h in checks:
                self._check(h, windows, added)
        with self._cond:
            grown = {k: h.added for k, h in self._watches.items() if h.added is not None}
        out = [j for j in jobs if grown.get(j.key) and not grown[j.key] <= written[j]]
        windows = self._windows()
        for j in built:
            # Gained files, or holds one now in doubt (a build of another thread that ended
            # after the snapshot): rewritten with its own files.
            own, doubt = self._split(windows, added, self._span(j))
            if not set(own) <= written[j] or not written[j].isdisjoint(doubt):
                out.append(j)
        return out

    def build_from_entry(self, entry: Entry, build: Build) -> Hit:
        files = list(entry.meta.files or [])
        bad = next((f for f in files if not self.layout.valid(f)), None)
        if bad is not None:
            return Hit(HitOutcome.REFUSED, None, f"the entry holds {bad!r}, not a file of {self.layout.what}")
        span = _Span(time.time(), _thread())
        with self._cond:
            self._add(span)  # from before the restore: another thread's window is in doubt now
        try:
            try:
                restore(self.root, files, entry.binaries, self.layout.valid)
            except (OSError, ValueError) as e:
                self._warn_once("restore", f"could not restore {self.layout.what} ({e}); built from source")
                return Hit(HitOutcome.NOT_RESTORED, build.from_source(), f"restore failed: {e}")
            program = build.from_source()
        finally:
            with self._cond:
                span.end = time.time()
        until = span.end
        with self._cond:
            self._known.update(dict.fromkeys(files))
            while len(self._known) > 65536:
                del self._known[next(iter(self._known))]
            if not self._closed:
                self._watches[entry.key] = _Watch(
                    entry.key, span, frozenset(files), due=until + self.layout.settle,
                )
                while len(self._watches) > 4096:
                    del self._watches[next(iter(self._watches))]
                self._start()
                self._cond.notify()
        return Hit(HitOutcome.USED, program)

    # }}}

    # {{{ background thread

    def _run(self) -> None:
        self.clock = clock_for(str(self.root)) or self.clock
        while True:
            with self._cond:
                now = time.time()
                due = [w for w in self._waiting if w.due <= now]
                checks = [h for h in self._watches.values() if h.added is None and h.due <= now]
                if not (self._closed or due or checks):
                    pending = [w.due for w in self._waiting] + [
                        h.due for h in self._watches.values() if h.added is None]
                    self._cond.wait(min(POLL_SECONDS, max(0.0, min(pending) - now)) if pending else None)
                    continue
                if self._closed:
                    return
                taken = {id(w) for w in due}
                self._waiting = [w for w in self._waiting if id(w) not in taken]
            t0 = time.thread_time()
            self.clock = clock_for(str(self.root)) or self.clock
            lo = min([self._lo(w.job.built_from) for w in due] + [self._lo(h.span.start) for h in checks])
            self.scans += 1
            added = added_files(self.root, self.layout, lo)
            windows = self._windows()
            reports = [self._snapshot(w, windows, added) for w in due]
            for h in checks:
                self._check(h, windows, added)
            if self.on_cpu is not None:
                self.on_cpu(time.thread_time() - t0)
            for done, snap, error in reports:
                done(snap, error)

    def _lo(self, t: float) -> float:
        return self.clock.since(t)

    def _span(self, job: Job) -> _Span:
        """The build of ``job`` (a miss); one not registered (yet) is of no known thread."""
        with self._cond:
            span = self._span_of.get(job)
        return span if span is not None else _Span(job.built_from, 0, job.built_to)

    def _windows(self) -> _Windows:
        """Every build's window as known now (once per scan)."""
        with self._cond:
            spans = list(self._spans)
        return _Windows(spans, self.clock.since(0.0), self.clock.until(0.0))

    def _split(self, windows: _Windows, added: dict[str, float], span: _Span) -> tuple[list[str], list[str]]:
        """The files of ``added`` in ``span``'s window: its own, and those in doubt (also in
        the window of a build of another thread, whose launches come in any order). What a
        hit of this process restored is no build's own."""
        lo, hi = windows.bounds(span)
        mine = {rel: ctime for rel, ctime in added.items() if lo <= ctime <= hi}
        if not mine:
            return [], []
        others = windows.others(span, lo, hi)
        with self._cond:
            known = {rel for rel in mine if rel in self._known}
        own: list[str] = []
        doubt: list[str] = []
        for rel, ctime in sorted(mine.items()):
            if rel not in known:
                (doubt if any(a <= ctime <= b for a, b in others) else own).append(rel)
        return own, doubt

    def _snapshot(
        self, w: Waiting, windows: _Windows, added: dict[str, float],
    ) -> tuple[Done, Snapshot | None, BaseException | None]:
        job = w.job
        try:
            watch = self._watches.get(job.key)
            if watch is not None and watch.added:
                names = sorted(watch.files | watch.added)  # a hit's entry, with what the build added
            else:
                names, doubt = self._split(windows, added, self._span(job))
                if doubt:
                    self.in_doubt += len(doubt)
                    self.left_out += len(doubt)
                    self.count("left_out", len(doubt))
                if not names:
                    raise Lost(
                        f"no file appeared in {self.layout.what} ({self.root}) during this build"
                        + (f" but {len(doubt)} that a build of another thread may have made" if doubt else ""))
            snap = read_files(self.root, names)
            left = len(names) - len(snap.files or ())  # beyond the bounds, refused, or gone
            if left:
                self.left_out += left
                self.count("left_out", left)
        except BaseException as e:  # noqa: BLE001 - reported through done
            return w.done, None, e
        return w.done, snap, None

    def _check(self, h: _Watch, windows: _Windows, added: dict[str, float]) -> None:
        # What the restore placed is in the entry: a name of it, or of another hit's (left
        # out by _split); what a build of another thread may have made is in doubt.
        own, _doubt = self._split(windows, added, h.span)
        with self._cond:
            new = frozenset(rel for rel in own if rel not in h.files)
            if h.added is not None:
                return  # checked meanwhile (the thread, or stale())
            h.added = new
        if new:
            self.unused += 1
            self.count("incomplete_hits")
            self._warn_once(
                "unused",
                f"a build from the stored files of {h.key[:12]} added {len(new)} file(s) to "
                f"{self.layout.what} ({self.root}): the driver did not use all of ours (another driver "
                "version, or files it needs once per node). The entry is rewritten with them at flush",
            )

    # }}}

