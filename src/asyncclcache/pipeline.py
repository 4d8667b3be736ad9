"""The way from a built program to a written entry, off the caller's thread.

:class:`Pipeline` holds each program's :class:`~.drivers.Job` and moves it along::

    fetch ─▶ claim the key (store lock) ─▶ driver.fetch ─▶ publish (writer thread)
                 └ held or written by another process: skipped

* **add**: the cache hands over a miss (:meth:`Pipeline.add`) or a hit (:meth:`Pipeline.used`:
  the entries touched, the job kept for a refresh); the pipeline alone calls the driver's
  per-job hooks.
* **fetch**: a job is pending from here until done; claiming touches the disk, so it
  runs on a writer thread.
* **claim**: one process per key does the work; the others skip and count it.
* **publish**: the snapshot becomes an :class:`~.entry.Entry` written atomically
  under the claim; then the size bound is kept (least recently used entries go).
* **refresh**: at ``flush()``, the driver says which written jobs gained variants
  (pocl launches with new local sizes); those are fetched again and rewritten only
  if their content changed.

Thread-safe: every method may be called from any thread. The pipeline never blocks
the caller's thread on the disk, a lock or a compile.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import _version
from .drivers import Dropped, Job, Lost, PerJob, Purpose, Snapshot
from .entry import Entry, EntryMeta
from .errors import WriteFailedWarning
from .locks import Claim
from .stats import Counters
from .store import PublishResult, Store
from .workers import Workers

if TYPE_CHECKING:
    from . import maintenance
    from .drivers import Hit

__all__ = ["MAX_JOBS", "Pipeline"]

logger = logging.getLogger(__name__)

#: Programs whose jobs are kept (for refreshes) per cache; the oldest go first.
MAX_JOBS = 4096


class Pipeline:
    """Pending and in-flight jobs, claims, publishing, refreshes and the size bound of
    one cache. ``on_written(entry)`` is told of every entry written (the cache's memory)."""

    def __init__(
        self,
        store: Store,
        workers: Workers,
        counters: Counters,
        *,
        max_size: int | None,
        on_written: Callable[[Entry], None],
    ) -> None:
        self.store = store
        self.workers = workers
        self.counters = counters
        self.max_size = max_size
        self._on_written = on_written
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        # key -> job, for programs built by this process (the newest MAX_JOBS: refreshable)
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._inflight: set[str] = set()
        self._refreshable: set[str] = set()
        # Keys in flight at a refresh: checked again where their fetch ends (_end).
        self._recheck: set[str] = set()
        # key -> the entry file this process wrote last (the newest MAX_JOBS keys).
        self._wrote: OrderedDict[str, tuple[int, ...] | None] = OrderedDict()
        self._errors: list[BaseException] = []
        self._closed = False
        #: The directory's last upkeep as this process last read it (``None``: not yet), and
        #: the bytes it wrote since (writer threads only).
        self._upkept: maintenance.Upkept | None = None
        self._wrote_bytes = 0
        self._track: PerJob[_Track] = PerJob(_Track)

    # {{{ state

    @property
    def pending(self) -> int:
        """Jobs fetched and not done yet."""
        with self._lock:
            return self._pending

    def job(self, key: str) -> Job | None:
        """The job this process keeps for ``key`` (``None`` if none, or dropped)."""
        with self._lock:
            return self._jobs.get(key)

    def holds_claim(self, job: Job) -> bool:
        """Whether this process holds ``job``'s key claim now (a fetch in flight)."""
        return self._track(job).claim is not None

    def add(self, job: Job) -> bool:
        """Keep ``job`` (a program just built, the caller's thread) and tell its driver
        (:meth:`~.drivers.Driver.built`); False if the same key is already on its way."""
        with self._lock:
            if job.key in self._jobs and job.key in self._inflight:
                return False
            self._keep(job)
        job.driver.built(job)
        return True

    def used(self, entry: Entry, hit: Hit, job: Job | None = None, *, baked: str | None = None) -> None:
        """A build used ``entry`` (and its baked binary, of key ``baked``; the caller's thread):
        each is touched off this thread, so that the size bound and prune evict by last use.
        ``job`` stands for the hit, kept so that :meth:`refresh` may rewrite its entry, where
        its driver watches hits (told through :meth:`~.drivers.Driver.watch`)."""
        for key in (entry.key,) if baked is None else (entry.key, baked):
            self.workers.submit(self.store.touch, key)  # a cheap utime
        if job is None or not job.driver.watches_hits:
            return
        job.driver.watch(job, entry, hit)
        with self._lock:
            if job.key in self._inflight:
                return
            self._keep(job)
            self._refreshable.add(job.key)

    def drop(self, key: str) -> None:
        """Remove the entry ``key`` off the caller's thread (a baked binary that a hit could
        not use)."""
        self.workers.submit(self.store.remove, key)

    def _keep(self, job: Job) -> None:
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

    def close(self) -> None:
        """Take no more work; what is pending is dropped (counted as skipped) as it ends."""
        with self._lock:
            self._closed = True

    def wait(self, timeout: float | None) -> bool:
        """Until nothing is pending, or ``timeout`` seconds; True when nothing is."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._pending:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._idle.wait(remaining)
            return self._pending == 0

    def take_errors(self) -> list[BaseException]:
        """The background failures since the last call."""
        with self._lock:
            errors, self._errors = self._errors, []
        return errors

    def error(self, error: BaseException, *, count: bool = True) -> None:
        """A background failure: logged, counted, kept for ``flush()`` to raise."""
        logger.warning("asyncclcache background failure: %s", error)
        if count:
            self.counters.add("errors")
        with self._lock:
            self._errors.append(error)

    # }}}

    # {{{ the way of a job: fetch, claim, driver, publish, and one end

    def fetch(self, job: Job, purpose: Purpose) -> None:
        """Start retrieving ``job``'s snapshot for ``purpose``. Cheap; any thread."""
        with self._lock:
            if self._closed or self._track(job).yielded:
                return
            self._pending += 1
            self._inflight.add(job.key)
        # Claiming touches the disk: not on the caller's thread.
        self.workers.submit(self._start, job, purpose)

    def refresh(self) -> None:
        """Fetch again the written jobs whose programs gained variants (the driver tells)."""
        with self._lock:
            if self._closed:
                return
            jobs = [self._jobs[k] for k in self._refreshable if k not in self._inflight and k in self._jobs]
            # A snapshot on its way may predate a launch: checked again where it ends,
            # before a flush's wait can see nothing pending.
            self._recheck.update(k for k in self._inflight if k in self._jobs)
        by_driver: dict[int, list[Job]] = {}
        for job in jobs:
            by_driver.setdefault(id(job.driver), []).append(job)
        for group in by_driver.values():
            for job in group[0].driver.stale(group):
                self.fetch(job, Purpose.REFRESH)

    def _start(self, job: Job, purpose: Purpose) -> None:
        try:
            end = self._claim(job, purpose)
        except BaseException as e:  # noqa: BLE001 - every fetch ends in _end
            self._end(job, _End.FAILED, e)
            return
        if end is not None:
            self._end(job, end)
            return
        try:
            job.driver.fetch(job, purpose, lambda snap, error: self._fetched(job, purpose, snap, error))
        except BaseException as e:  # noqa: BLE001 - a driver that raises instead of reporting
            self._end(job, _End.FAILED, e)

    def _claim(self, job: Job, purpose: Purpose) -> _End | None:
        """Take the key's claim for ``job`` (a writer thread); how the fetch ends if not."""
        track = self._track(job)
        with self._lock:
            # A refresh rewrites this process's own entry; anything else skips a key that
            # another process (or this one, for another job of it) wrote since the lookup.
            since = None if purpose is Purpose.REFRESH else (job.seen, self._wrote.get(job.key))
        try:
            claim = self.store.claim(job.key, unless_written_since=since)
        except OSError as e:
            raise _WriteFailed(e) from None
        if claim is None:
            # Another process (rank) works on this key, or already wrote it: skip.
            with self._lock:
                track.yielded = True
            return _End.SKIPPED
        track.claim = claim
        return None

    def _fetched(
        self, job: Job, purpose: Purpose, snap: Snapshot | None, error: BaseException | None
    ) -> None:
        # Runs in a driver's thread: hand disk I/O to the writers.
        if error is not None:
            self._end(job, _End.FAILED, error)
        elif snap is None:
            self._end(job, _End.DONE)
        else:
            self.workers.submit(self._publish, job, purpose, snap)

    def _publish(self, job: Job, purpose: Purpose, snap: Snapshot) -> None:
        # Writer thread.
        try:
            end = self._write(job, purpose, snap)
        except BaseException as e:  # noqa: BLE001 - every fetch ends in _end
            self._end(job, _End.FAILED, e)
        else:
            self._end(job, end)

    def _write(self, job: Job, purpose: Purpose, snap: Snapshot) -> _End:
        track = self._track(job)
        digest = _digest(snap)
        if purpose is Purpose.REFRESH and digest == track.written_digest:
            return _End.DONE  # unchanged
        with self._lock:
            if self._closed:
                return _End.SKIPPED
        entry = Entry(job.key, tuple(snap.blobs), _meta(job, purpose, snap))
        try:
            result = self.store.publish(entry, claim=track.claim)
        except OSError as e:
            raise _WriteFailed(e) from None
        if result is PublishResult.SKIPPED:
            return _End.SKIPPED
        if result is PublishResult.WRITTEN:
            # Which file this process wrote: a later claim of the key skips it (_claim).
            stamp = track.claim.written if track.claim else None
            self._written(job, purpose, snap, entry, digest=digest, stamp=stamp)
        return _End.DONE

    def _written(
        self, job: Job, purpose: Purpose, snap: Snapshot, entry: Entry, *, digest: str,
        stamp: tuple[int, ...] | None,
    ) -> None:
        self.counters.add("writes")
        self.counters.add("bytes_written", entry.nbytes)
        if purpose is Purpose.REFRESH:
            self.counters.add("refreshes")
        job.driver.written(job, snap)
        with self._lock:
            self._track(job).written_digest = digest
            if job.driver.refreshable:
                self._refreshable.add(job.key)
            job.program = None  # the in-process program is no longer needed
            self._wrote[job.key] = stamp
            self._wrote.move_to_end(job.key)
            while len(self._wrote) > MAX_JOBS:
                self._wrote.popitem(last=False)
        self._on_written(entry)
        self._tend(entry.nbytes)

    def _tend(self, added: int) -> None:
        # Writer thread, after a write: no scan of the directory on a job's way. The stamp of
        # its last upkeep is read once (a stat; its size too where a bound is set); an upkeep
        # (one process, non-blocking) only where that is an interval old, or where the size
        # it measured plus what this process wrote since crosses the bound.
        from . import maintenance  # a writer thread's, at its first write: off the import path

        with self._lock:
            self._wrote_bytes += added
            seen, wrote = self._upkept, self._wrote_bytes
        if seen is None:
            seen = maintenance.last_upkeep(self.store, want_size=bool(self.max_size))
            with self._lock:
                self._upkept = seen
            due = seen.due
        else:
            due = False  # read once a process: a long run is kept by the next process's read
        over = bool(self.max_size) and (seen.bytes is None or seen.bytes + wrote > (self.max_size or 0))
        if not (due or over):
            return
        result = maintenance.upkeep(self.store, max_size=self.max_size, seen=seen, wrote=wrote)
        if result.ran or over:  # ours, or another's since: what it measured
            now = maintenance.last_upkeep(self.store, want_size=True)
            with self._lock:
                self._upkept = now
                self._wrote_bytes = 0 if now.bytes is not None else wrote
        if result.removed:
            self.counters.add("evictions", result.removed)

    def _end(self, job: Job, end: _End, error: BaseException | None = None) -> None:
        """Where every fetch ends, whatever its way: the claim released, the outcome
        counted, the job no longer pending. Called once per :meth:`fetch` that counted."""
        again = False
        try:
            track = self._track(job)
            claim, track.claim = track.claim, None
            if claim is not None:
                claim.release()
            if isinstance(error, Dropped) or end is _End.SKIPPED:
                self.counters.add("skipped")  # another process's key, or shut down first
            elif isinstance(error, Lost):
                self.counters.add("unidentified")  # nothing to store: counted, not a failure
                logger.info("asyncclcache: %s (%s)", error, job.key[:12])
            elif isinstance(error, _WriteFailed):
                self._write_failed(job, error.error)
            elif error is not None:
                self.error(error)
            again = end is _End.DONE and error is None and self._stale_since_refresh(job)
        finally:
            with self._idle:
                self._recheck.discard(job.key)
                if again and not self._closed:
                    # The refresh takes this fetch's place: still pending, still in flight
                    # (queued under the lock: close() comes first, then the workers stop).
                    self.workers.submit(self._start, job, Purpose.REFRESH)
                else:
                    self._pending -= 1
                    self._inflight.discard(job.key)
                    if self._pending == 0:
                        self._idle.notify_all()

    def _stale_since_refresh(self, job: Job) -> bool:
        # A refresh skipped this job while its fetch was in flight: has it gained variants?
        with self._lock:
            if job.key not in self._recheck or self._closed or job.key not in self._refreshable:
                return False
        try:
            return bool(job.driver.stale([job]))
        except Exception:  # a listing that failed: the next flush asks again
            logger.info("asyncclcache: could not check %s for new variants", job.key[:12], exc_info=True)
            return False

    def _write_failed(self, job: Job, e: OSError) -> None:
        self.counters.add("write_errors")
        self.error(e, count=False)
        warn(
            f"asyncclcache: could not write entry {job.key[:12]} to {self.store.root}: {e.strerror or e}",
            WriteFailedWarning,
        )

    # }}}


class _End(enum.Enum):
    """How one fetch of a job ended (what :meth:`Pipeline._end` counts)."""

    #: Written or found unchanged; or failed (with the error).
    DONE = "done"
    FAILED = "failed"
    #: Another process claimed or wrote the key, or the cache closed first.
    SKIPPED = "skipped"


class _WriteFailed(Exception):
    """Our write (the claim or the entry) failed: warned and counted as a write error."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass(eq=False)
class _Track:
    """The pipeline's own state of one job, under its lock; ``claim`` is touched only by
    the fetch in flight (at most one per job)."""

    claim: Claim | None = None
    #: Another process claimed the key: this one leaves it alone.
    yielded: bool = False
    #: Digest of the snapshot last written, so a refresh writes only what changed.
    written_digest: str | None = None


def _digest(snap: Snapshot) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in snap.files or ():
        h.update(name.encode() + b"\0")
    for blob in snap.blobs:
        h.update(len(blob).to_bytes(8, "little") + blob)
    return h.hexdigest()


def _meta(job: Job, purpose: Purpose, snap: Snapshot) -> EntryMeta:
    return EntryMeta(
        kind=job.driver.kind,
        devices=[dict(d) for d in job.info.devices],
        files=list(snap.files) if snap.files is not None else None,
        options=job.options.decode("utf-8", "surrogateescape"),
        source_sha256=job.info.source_sha256,
        includes=[[d.path, d.sha256] for d in job.info.deps],
        build_logs=list(job.logs),
        created=time.time(),
        snapshot=purpose.value,
        strategy=job.driver.name,
        asyncclcache=_version.__version__,
        kernels=list(job.kernels),
        # What a bake builds again (asyncclcache bake): only the driver's own cache needs it.
        source=job.source.decode("utf-8", "surrogateescape") if job.driver.bakes else None,
        # Where it builds again: the folder its relative -I folders and quoted includes named.
        cwd=job.cwd if job.driver.bakes else None,
        # What a hit saves: the source build.
        compile_seconds=job.build_seconds,
    )


def warn(message: str, category: type[Warning]) -> None:
    """Warn from a background thread: a warnings filter set to "error" must not break
    bookkeeping (logged instead)."""
    try:
        warnings.warn(message, category, stacklevel=3)
    except Exception:  # noqa: BLE001
        logger.warning("%s", message)
