"""The cache: looks entries up, schedules the binary work, owns ``step()`` and ``flush()``.

Where a binary goes after ``build()``: :mod:`.program` builds and calls
:meth:`Cache._schedule`; a driver from :mod:`.drivers` retrieves the binaries off
the caller's thread; :meth:`Cache._publish` hands them to :class:`.store.Store`
on a worker thread, which writes them atomically under a per-key lock.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import math
import os
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from . import _version, lifetime
from .config import STRATEGIES, get_config, parse_size
from .drivers import Driver, Dropped, Job, Lost, Purpose, Snapshot, make_driver, resolve_strategy
from .entry import Entry
from .errors import BackgroundError, WriteFailedWarning
from .store import PublishResult, Store
from .workers import Workers

if TYPE_CHECKING:
    import os

    import pyopencl as cl

    from .keys import KeyInfo
    from .program import Program

__all__ = ["Cache", "Stats", "Step", "close_all", "default_cache", "step"]

logger = logging.getLogger(__name__)

#: Bytes of entries kept in memory for repeated builds in one process.
MEMORY_BUDGET = 64 << 20
#: Programs whose jobs are kept (for refreshes) per cache; the oldest go first.
MAX_JOBS = 4096


@dataclass(frozen=True)
class Stats:
    """Counters of one :class:`Cache` in this process (a snapshot; immutable)."""

    hits: int = 0
    misses: int = 0
    writes: int = 0
    write_errors: int = 0
    skipped: int = 0  # writes skipped: another process held the key, or shut down first
    pending: int = 0  # background retrievals and writes not finished yet
    bytes_written: int = 0
    warmups: int = 0  # first binary queries in the helper (pocl's generic compile)
    refreshes: int = 0  # entries rewritten because the program gained variants
    rejected: int = 0  # stored binaries the driver refused (rebuilt from source)
    unidentified: int = 0  # kcache: pocl's folder of a build not found, or removed under us
    uncacheable: int = 0  # builds not cached: an #include that cannot be resolved for certain
    errors: int = 0  # background failures (logged)
    evictions: int = 0  # entries removed to keep the directory under max_size
    seconds_saved: float = 0.0  # estimated compile time that hits avoided
    main_thread_seconds: float = 0.0  # time the cache spent in callers' threads
    background_cpu_seconds: float = 0.0  # CPU time of the cache's own threads (not a helper's)

    def line(self, label: str = "asyncclcache") -> str:
        """One line, as ``ccache -s`` would say it: for a log, or the job's exit summary.

        Counters that are usually zero (errors, skipped, rejected, ...) appear when not.
        """
        text = (
            f"{label}: {self.hits} hits, {self.misses} misses, {self.writes} writes "
            f"({self.bytes_written / 1e6:.1f} MB), {self.seconds_saved:.1f} s saved, "
            f"{self.pending} pending"
        )
        extra = [
            f"{getattr(self, name)} {name.replace('_', ' ')}"
            for name in ("warmups", "refreshes", "skipped", "rejected", "uncacheable",
                         "unidentified", "write_errors", "errors")
            if getattr(self, name)
        ]
        return text + (f" ({', '.join(extra)})" if extra else "")

    @classmethod
    def from_values(cls, values: dict[str, float]) -> Stats:
        """From field name -> number (counts rounded to int), e.g. summed over ranks."""
        ints = {f.name for f in fields(cls) if f.type in ("int", int)}
        return cls(**{k: (round(v) if k in ints else float(v)) for k, v in values.items()})

    def __add__(self, other: Stats) -> Stats:
        """Counters summed (over caches, processes or ranks)."""
        if not isinstance(other, Stats):
            return NotImplemented
        return Stats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def as_dict(self) -> dict[str, float]:
        """The counters as a plain dict (stable field names, for JSON)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


class Step:
    """What happened inside one ``with cache.step():`` block. Read it after the block."""

    def __init__(self, cache: Cache, wait: bool, parent: Step | None) -> None:
        self.cache = cache
        self.wait = wait
        self.parent = parent
        self.built = 0
        self.hits = 0
        self.misses = 0
        self.jobs: list[Job] = []

    def _count(self, hit: bool) -> None:
        s: Step | None = self
        while s is not None:
            s.built += 1
            if hit:
                s.hits += 1
            else:
                s.misses += 1
            s = s.parent

    def __repr__(self) -> str:
        return f"Step(built={self.built}, hits={self.hits}, misses={self.misses})"


_CACHES: weakref.WeakSet[Cache] = weakref.WeakSet()
#: (directory, final counters) of every cache this process closed.
_CLOSED: list[tuple[str, Stats]] = []


class Cache:
    """A non-blocking binary cache for PyOpenCL programs.

    ``build()`` through this cache returns as fast as an uncached build; binaries
    are retrieved and written in the background. All methods are thread-safe.
    Several processes (and MPI ranks) may share one directory: entries are
    published atomically under a per-key file lock, and readers never see a
    partial entry.

    :arg directory: root directory (default ``ASYNCCLCACHE_DIR`` or the user cache dir).
    :arg rank_local: one subdirectory per MPI rank (default: yes, under MPI).
    :arg strategy: ``auto``, ``kcache`` (pocl's kernel-cache folder), ``process`` (pocl
        helper and binary query), ``thread`` or ``sync``.
    :arg workers: background writer threads.
    :arg max_size: bound of the directory in bytes (or ``"500M"``); least recently used
        entries are evicted by the background writer. Default ``ASYNCCLCACHE_MAX_SIZE``.
    :arg exit_timeout: seconds :meth:`close` (and interpreter exit) waits for pending work.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        rank_local: bool | None = None,
        strategy: str = "auto",
        workers: int = 1,
        max_size: int | str | None = None,
        exit_timeout: float | None = None,
    ) -> None:
        cfg = get_config()
        if strategy == "auto" and cfg.strategy != "auto":
            strategy = cfg.strategy
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if workers == 1 and cfg.workers != 1:
            workers = cfg.workers
        self.strategy = strategy
        self.disabled = cfg.disable
        self.failure_fatal = cfg.failure_fatal
        self.exit_timeout = cfg.exit_timeout if exit_timeout is None else float(exit_timeout)
        if not (math.isfinite(self.exit_timeout) and self.exit_timeout >= 0):
            raise ValueError(f"exit_timeout must be a finite number of seconds >= 0, got {exit_timeout!r}")
        self.max_size = parse_size(max_size) if max_size is not None else cfg.max_size
        self.store = Store(directory, rank_local=rank_local)
        self._size_estimate: int | None = None  # bytes on disk, scanned once, then tracked
        self._saved_counts: dict[str, float] = {}  # what lifetime stats already hold
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        self._counts: dict[str, float] = {f.name: 0 for f in fields(Stats)}
        self._pending = 0
        self._memory: OrderedDict[str, Entry] = OrderedDict()
        self._memory_bytes = 0
        # key -> job, for programs built by this process (the newest MAX_JOBS: refreshable)
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._inflight: set[str] = set()
        self._refreshable: set[str] = set()
        self._errors: list[BaseException] = []
        self._steps: list[Step] = []
        self._drivers: dict[str, Driver] = {}
        self._driver_by_devices: dict[tuple[int, ...], Driver] = {}
        self._nworkers = max(1, workers)
        self._workers = self._new_workers()
        self._closed = False
        self._swept = False
        _CACHES.add(self)
        if cfg.stats:
            from . import summary

            summary.register()

    def __repr__(self) -> str:
        return f"Cache({str(self.store.root)!r}, strategy={self.strategy!r})"

    def _new_workers(self) -> Workers:
        return Workers(
            self._nworkers, "asyncclcache-writer", self._background_error,
            lambda s: self._count("background_cpu_seconds", s),
        )

    def _after_fork_in_child(self) -> None:
        # The parent's threads, helper and pending work did not come along: start clean.
        # Its claims (flocks) are shared with the parent, so they are left alone, not released.
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        self._counts = {f.name: 0 for f in fields(Stats)}
        self._saved_counts = {}
        self._pending = 0
        self._jobs = OrderedDict()
        self._inflight = set()
        self._refreshable = set()
        self._errors = []
        self._steps = []
        self._drivers = {}
        self._driver_by_devices = {}
        self._workers = self._new_workers()

    # {{{ public API

    @property
    def directory(self) -> str:
        """The directory entries are written to (rank-local where that applies)."""
        return str(self.store.root)

    def program(self, context: cl.Context, source: str | bytes) -> Program:
        """A :class:`asyncclcache.Program` that builds through this cache."""
        from .program import Program

        return Program(context, source, cache=self)

    def stats(self, comm: Any = None) -> Stats:
        """This process's counters for this cache. Thread-safe.

        With an mpi4py communicator ``comm``, the counters summed over its ranks
        (a collective call: every rank of ``comm`` must make it).
        """
        with self._lock:
            counts = dict(self._counts, pending=self._pending)
        if comm is not None:
            import numpy as np
            from mpi4py import MPI

            names = [f.name for f in fields(Stats)]
            mine = np.array([counts[n] for n in names], dtype=np.float64)
            total = np.empty_like(mine)
            comm.Allreduce(mine, total, op=MPI.SUM)
            counts = dict(zip(names, total.tolist(), strict=True))
        return Stats.from_values(counts)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until background work is done; True when nothing is pending any more.

        First re-snapshots entries whose programs may have gained variants since
        they were written (pocl: launches with new local sizes). Programs built in
        a still-open ``step()`` are scheduled only at its exit. With
        ``ASYNCCLCACHE_FAILURE_FATAL=1``, a background failure raises
        :class:`BackgroundError` here. Thread-safe; does not block other builds.
        """
        with self._lock:
            drivers = list(self._drivers.values())
        for d in drivers:
            d.hurry()
        self._refresh()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._pending:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._idle.wait(remaining)
            done = self._pending == 0
            errors, self._errors = self._errors, []
        self._save_lifetime()
        if errors and self.failure_fatal:
            raise BackgroundError(f"{len(errors)} background failure(s): {errors[0]!r}") from errors[0]
        return done

    def close(self, timeout: float | None = None) -> bool:
        """Flush for up to ``timeout`` seconds (default: the exit timeout), then stop.

        Work still pending is dropped, never half-written; the helper process is
        reaped. Idempotent. Builds after close are plain, uncached builds.
        Returns what :meth:`flush` returned.
        """
        if self._closed:
            return True
        timeout = self.exit_timeout if timeout is None else timeout
        try:
            done = self.flush(timeout)
        except BackgroundError:
            done = False
        with self._lock:
            self._closed = True
            drivers = list(self._drivers.values())
        for d in drivers:
            d.close(1.0)
        self._workers.stop(1.0)
        self._save_lifetime()
        _CLOSED.append((self.directory, self.stats()))
        if not done:
            logger.info("asyncclcache: exit with %d jobs pending: dropped", self._pending)
        return done

    @contextmanager
    def step(self, *, wait: bool = False) -> Iterator[Step]:
        """Mark one simulation step. Programs built inside are snapshotted at its exit.

        By then the step has launched its kernels, so the entry packs the
        specialized variants (pocl) and the next run's first step compiles
        nothing. Warm-ups may start at once. ``wait=True`` flushes at exit.
        Nests; an exception inside propagates unchanged and what was built is
        still scheduled. Steps are per cache, shared by all threads.
        """
        with self._lock:
            s = Step(self, wait, self._steps[-1] if self._steps else None)
            self._steps.append(s)
        try:
            yield s
        finally:
            with self._lock:
                self._steps.remove(s)
                jobs, s.jobs = s.jobs, []
            for job in jobs:
                self._fetch(job, Purpose.SNAPSHOT_NOW)
            if wait:
                self.flush()

    # }}}

    # {{{ used by Program.build

    def _count(self, name: str, n: float = 1) -> None:
        with self._lock:
            self._counts[name] += n

    @property
    def active(self) -> bool:
        return not (self.disabled or self._closed)

    def _lookup(self, info: KeyInfo) -> Entry | None:
        with self._lock:
            entry = self._memory.get(info.key)
            if entry is not None:
                self._memory.move_to_end(info.key)
                return entry
        entry = self.store.load(info.key, info.devices)
        if entry is not None:
            self._remember(entry)
        return entry

    def _remember(self, entry: Entry) -> None:
        with self._lock:
            if entry.key in self._memory:
                return
            self._memory[entry.key] = entry
            self._memory_bytes += entry.nbytes
            while self._memory_bytes > MEMORY_BUDGET and len(self._memory) > 1:
                _, old = self._memory.popitem(last=False)
                self._memory_bytes -= old.nbytes

    def _forget(self, key: str) -> None:
        with self._lock:
            old = self._memory.pop(key, None)
            if old is not None:
                self._memory_bytes -= old.nbytes
        self.store.remove(key)

    def _record_build(self, hit: bool, entry: Entry | None = None, seconds: float = 0.0) -> None:
        with self._lock:
            self._counts["hits" if hit else "misses"] += 1
            if entry is not None:
                compile_seconds = entry.meta.get("compile_seconds")
                if isinstance(compile_seconds, (int, float)):
                    self._counts["seconds_saved"] += max(0.0, compile_seconds - seconds)
            if self._steps:
                self._steps[-1]._count(hit)
        if entry is not None and self.store.writable:
            # LRU bookkeeping: a cheap utime, off the caller's thread.
            self._workers.submit(lambda: self.store.touch(entry.key))

    def driver_for(self, devices: Sequence[cl.Device]) -> Driver:
        """The driver that handles builds for ``devices`` (created on first use). Thread-safe."""
        # Every build asks: the strategy is resolved once per device set (pocl, too, reads
        # its environment once per process).
        ids = tuple(d.int_ptr for d in devices)
        with self._lock:
            d = self._driver_by_devices.get(ids)
        if d is not None:
            return d
        name = resolve_strategy(self.strategy, devices)
        with self._lock:
            d = self._drivers.get(name)
            if d is None:
                d = make_driver(name, self._workers)
                d.on_cpu = lambda s: self._count("background_cpu_seconds", s)
                self._drivers[name] = d
            self._driver_by_devices[ids] = d
            return d

    def _schedule(
        self,
        program: cl._cl._Program,
        info: KeyInfo,
        source: bytes,
        devices: Sequence[cl.Device],
        logs: list[str],
        looked_up_at: float,
        *,
        kernels: Sequence[str] = (),
        build_seconds: float = 0.0,
        built_from: float = 0.0,
        built_to: float = 0.0,
    ) -> None:
        """A miss was built: retrieve and write its binaries later. Caller's thread; cheap.

        ``looked_up_at`` (``time.time()`` before the lookup) lets a process skip a key
        that another process wrote after this one missed it; ``built_from``/``built_to``
        (``time.time()``) bracket the source build.
        """
        if not self.active or not self.store.writable:
            return
        driver = self.driver_for(devices)
        job = Job(
            info, source, info.options, devices, logs, driver,
            kernels=tuple(kernels), created=looked_up_at, built_from=built_from,
            built_to=built_to, build_seconds=build_seconds,
        )
        if driver.needs_program:
            job.program = program  # keep it alive until its binaries are taken
        with self._lock:
            if info.key in self._jobs and info.key in self._inflight:
                return  # the same program is already on its way
            self._keep_job(job)
            step = self._steps[-1] if self._steps else None
            if step is not None:
                step.jobs.append(job)
        if not self._swept:
            self._swept = True
            self._workers.submit(self.store.sweep)
        driver.built(job)
        if step is None:
            self._fetch(job, Purpose.SNAPSHOT)
        elif driver.warms_up:
            # The warm-up may run now, in the other process; the snapshot waits for the step.
            self._fetch(job, Purpose.WARMUP)

    def _keep_job(self, job: Job) -> None:
        # Under self._lock. Bounded: a process that builds thousands of programs keeps the
        # newest; an older one only loses its refresh (a later run compiles that variant).
        self._jobs[job.key] = job
        self._jobs.move_to_end(job.key)
        if len(self._jobs) > MAX_JOBS:
            for key in list(self._jobs):
                if len(self._jobs) <= MAX_JOBS:
                    break
                if key not in self._inflight:
                    del self._jobs[key]
                    self._refreshable.discard(key)

    def _watch(self, info: KeyInfo, source: bytes, devices: Sequence[cl.Device], entry: Entry,
               folders: Sequence[str]) -> None:
        """A hit whose driver can tell cheaply when it gained variants: refresh it at flush."""
        if not self.active or not self.store.writable:
            return
        driver = self.driver_for(devices)
        meta = entry.meta
        job = Job(
            info, source, info.options, devices, list(meta.get("build_logs") or []), driver,
            kernels=tuple(meta.get("kernels") or ()), created=time.time(),
            build_seconds=float(meta.get("compile_seconds") or 0.0), folders=tuple(folders),
            written_files=frozenset(meta.get("files") or ()),
        )
        with self._lock:
            if info.key in self._inflight:
                return
            self._keep_job(job)
            self._refreshable.add(info.key)

    # }}}

    # {{{ background

    def _fetch(self, job: Job, purpose: Purpose) -> None:
        with self._lock:
            if self._closed or job.yielded:
                return
            self._pending += 1
            self._inflight.add(job.key)
        if job.driver.inline:
            self._start(job, purpose)
        else:
            # Claiming touches the disk: not on the caller's thread.
            self._workers.submit(lambda: self._start(job, purpose))

    def _start(self, job: Job, purpose: Purpose) -> None:
        if job.claim is None:
            try:
                claim = self.store.claim(job.key)
            except OSError as e:
                try:
                    self._write_failed(job, e)
                finally:
                    self._done(job)
                return
            if claim is None or (purpose is not Purpose.REFRESH and self._written_since(job)):
                # Another process (rank) works on this key, or already wrote it: skip.
                if claim is not None:
                    claim.release()
                with self._lock:
                    job.yielded = True
                    self._counts["skipped"] += 1
                self._done(job)
                return
            job.claim = claim
        job.driver.fetch(job, purpose, lambda snap, error: self._fetched(job, purpose, snap, error))

    def _written_since(self, job: Job) -> bool:
        try:
            return self.store.path_for(job.key).stat().st_mtime >= job.created
        except OSError:
            return False

    def _release_claim(self, job: Job) -> None:
        claim, job.claim = job.claim, None
        if claim is not None:
            claim.release()

    def _fetched(
        self, job: Job, purpose: Purpose, snap: Snapshot | None, error: BaseException | None
    ) -> None:
        # Runs in a driver's thread: hand disk I/O to the writers.
        with self._lock:
            first = job.fetches == 0
            job.fetches += 1
            if first and job.driver.warms_up and error is None:
                self._counts["warmups"] += 1
        if error is not None:
            self._release_claim(job)
            if isinstance(error, Dropped):
                self._count("skipped")  # shut down first: not a failure
            elif isinstance(error, Lost):
                self._count("unidentified")  # nothing to store: counted, not a failure
                logger.info("asyncclcache: %s (%s)", error, job.key[:12])
            else:
                self._background_error(error)
            self._done(job)
            return
        assert snap is not None
        if purpose is Purpose.WARMUP:
            self._done(job)
            return
        self._workers.submit(lambda: self._publish(job, purpose, snap))

    def _publish(self, job: Job, purpose: Purpose, snap: Snapshot) -> None:
        try:
            h = hashlib.blake2b(digest_size=16)
            for name in snap.files or ():
                h.update(name.encode() + b"\0")
            for blob in snap.blobs:
                h.update(len(blob).to_bytes(8, "little") + blob)
            digest = h.hexdigest()
            if purpose is Purpose.REFRESH and digest == job.written_digest:
                return
            with self._lock:
                closed = self._closed
            if closed:
                self._count("skipped")
                return
            meta: dict[str, Any] = {"kind": job.driver.kind}
            if snap.files is not None:
                meta["files"] = list(snap.files)
            entry = Entry(
                job.key,
                tuple(snap.blobs),
                {
                    **meta,
                    "devices": list(job.info.devices),
                    "options": job.options.decode("utf-8", "surrogateescape"),
                    "source_sha256": job.info.source_sha256,
                    "includes": [[d.path, d.sha256] for d in job.info.deps],
                    "build_logs": job.logs,
                    "created": time.time(),
                    "snapshot": purpose.value,
                    "strategy": job.driver.name,
                    "asyncclcache": _version.__version__,
                    "kernels": list(job.kernels),
                    # What a hit saves: the source build plus one code generation (the
                    # helper's warm-up measures one; the launch's costs about the same).
                    "compile_seconds": job.build_seconds + (job.warmup_seconds or 0.0),
                },
            )
            try:
                result = self.store.publish(entry, claim=job.claim)
            except OSError as e:
                self._write_failed(job, e)
                return
            if result is PublishResult.WRITTEN:
                with self._lock:
                    self._counts["writes"] += 1
                    self._counts["bytes_written"] += entry.nbytes
                    if purpose is Purpose.REFRESH:
                        self._counts["refreshes"] += 1
                    job.written_digest = digest
                    if snap.files is not None:
                        job.written_files = frozenset(snap.files)
                        job.folders = tuple(snap.folders or job.folders or ())
                    if job.driver.refreshable:
                        self._refreshable.add(job.key)
                    # The in-process program is no longer needed.
                    job.program = None
                self._remember(entry)
                self._keep_under_max_size(entry.nbytes)
            elif result is PublishResult.SKIPPED:
                self._count("skipped")
        finally:
            self._release_claim(job)
            self._done(job)

    def _keep_under_max_size(self, added: int) -> None:
        # Writer thread only. A full scan once, then a running estimate; prune (a scan) only
        # when the estimate says the bound is crossed.
        if not self.max_size:
            return
        if self._size_estimate is None:
            self._size_estimate = self.store.total_bytes()
        else:
            self._size_estimate += added
        if self._size_estimate <= self.max_size:
            return
        result = self.store.prune(max_size=self.max_size)
        if result.ran:
            self._size_estimate = result.remaining
            self._count("evictions", result.removed)

    def _save_lifetime(self) -> None:
        """Add what this process counted since the last save to the directory's lifetime
        counters (bounded lock wait; a busy lock means: next time)."""
        if not self.store.writable:
            return
        with self._lock:
            now = {k: v for k, v in self._counts.items() if k in lifetime.FIELDS}
            deltas = {k: v - self._saved_counts.get(k, 0) for k, v in now.items()}
            first = not self._saved_counts
        if not any(deltas.values()):
            return
        if first:
            deltas["runs"] = 1
        if lifetime.add(self.store.root, deltas, timeout=1.0):
            with self._lock:
                self._saved_counts = now

    def _write_failed(self, job: Job, e: OSError) -> None:
        self._count("write_errors")
        self._background_error(e, count=False)
        _warn(
            f"asyncclcache: could not write entry {job.key[:12]} to {self.store.root}: "
            f"{e.strerror or e}",
            WriteFailedWarning,
        )

    def _done(self, job: Job) -> None:
        with self._idle:
            self._pending -= 1
            self._inflight.discard(job.key)
            if self._pending == 0:
                self._idle.notify_all()

    def _refresh(self) -> None:
        """Re-snapshot entries whose programs gained variants since (the driver tells which)."""
        with self._lock:
            if self._closed:
                return
            keys = [k for k in self._refreshable if k not in self._inflight]
            jobs = [self._jobs[k] for k in keys if k in self._jobs]
        by_driver: dict[int, list[Job]] = {}
        for job in jobs:
            by_driver.setdefault(id(job.driver), []).append(job)
        for group in by_driver.values():
            for job in group[0].driver.stale(group):
                self._fetch(job, Purpose.REFRESH)

    def _background_error(self, error: BaseException, *, count: bool = True) -> None:
        logger.warning("asyncclcache background failure: %s", error)
        with self._lock:
            if count:
                self._counts["errors"] += 1
            self._errors.append(error)

    # }}}


def _warn(message: str, category: type[Warning]) -> None:
    # From a background thread: a warnings filter set to "error" must not break bookkeeping.
    try:
        warnings.warn(message, category, stacklevel=3)
    except Exception:  # noqa: BLE001
        logger.warning("%s", message)


_default: Cache | None = None
_default_lock = threading.Lock()


def default_cache() -> Cache:
    """The process-wide cache used by ``asyncclcache.Program`` without ``cache=``, created
    on first use from the environment. Thread-safe."""
    global _default
    with _default_lock:
        if _default is None or _default._closed:
            _default = Cache()
        return _default


def step(*, wait: bool = False) -> Any:
    """``default_cache().step(wait=wait)``."""
    return default_cache().step(wait=wait)


def _after_fork_in_child() -> None:
    global _default_lock
    _default_lock = threading.Lock()
    _CLOSED.clear()  # the parent's, reported by the parent
    for cache in list(_CACHES):
        cache._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def close_all() -> list[tuple[str, Stats]]:
    """Close every cache of this process (each waits at most its exit timeout, then drops
    what is left); returns ``(directory, counters)`` of every cache it ever closed.
    Runs at interpreter exit. Thread-safe; never raises."""
    for cache in list(_CACHES):
        try:
            cache.close()
        except Exception:  # never fail interpreter exit
            logger.exception("asyncclcache: error at exit")
    return list(_CLOSED)


atexit.register(close_all)
