"""The cache: the public API (:class:`Cache`, ``step()``, ``flush()``) and its wiring.

Where a binary goes after ``build()``: :mod:`.program` makes the key and hands the
build over whole (a :class:`~.drivers.Build`) to :meth:`Cache.build`, which looks the
key up and builds from the entry (the driver) or from source. A miss becomes a job of
the :class:`~.pipeline.Pipeline`, which a driver from :mod:`.drivers` serves off the
caller's thread and :class:`~.store.Store` writes under a per-key lock.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import sys
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from . import summary
from .config import STRATEGIES, get_config, parse_size, strategy_in_use
from .drivers import Build, Driver, Hit, HitOutcome, Job, Purpose, make_driver, resolve_strategy
from .entry import Entry
from .errors import BackgroundError, BinaryRejectedWarning
from .keys import baked_key
from .pipeline import MAX_JOBS, Pipeline
from .stats import Counters, Stats
from .store import BAKED_RECHECK, Stamp, Store
from .workers import Workers

if TYPE_CHECKING:
    import pyopencl as cl

    from .bake import IdleBaker
    from .keys import KeyInfo
    from .nodecompile import NodeCompiles

__all__ = ["Built", "Cache", "Stats", "Step", "close_all", "default_cache", "exit_interrupted", "step"]

logger = logging.getLogger(__name__)
#: ``flush()`` saves the lifetime counters at most this often (seconds); ``close()`` always.
SAVE_EVERY = 60.0

#: Bytes of entries kept in memory for repeated builds in one process.
MEMORY_BUDGET = 64 << 20
#: A hit marks its entry used (for the size bound's and prune's order) at most this often
#: a process: a test suite builds the same program hundreds of times.
MARK_USED_EVERY = 600.0


@dataclass(frozen=True)
class Built:
    """What :meth:`Cache.build` gives back: the built program, whether it came from an
    entry, how (pyopencl's ``_build_duration_info`` wording) and in what time; on a hit,
    the original build's logs, to be shown as pyopencl shows its own cache hits'."""

    program: Any
    hit: bool
    description: str
    seconds: float
    replay: tuple[str, ...] = ()


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


class _Memory:
    """What a cache keeps in memory: the entries this process read or wrote (the least
    recently used go past :data:`MEMORY_BUDGET` bytes), and which entry file each key's
    last disk lookup saw (taken by the miss: see :attr:`Job.seen`). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._bytes = 0
        self._seen: dict[str, Stamp | None] = {}
        self._marked: dict[tuple[str, str | None], float] = {}  # (key, baked key): when marked used
        self._no_baked: dict[str, float] = {}  # key -> when to look for its baked binary again

    def get(self, key: str) -> Entry | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def remember(self, entry: Entry) -> None:
        with self._lock:
            if entry.key in self._entries:
                return
            self._entries[entry.key] = entry
            self._bytes += entry.nbytes
            while self._bytes > MEMORY_BUDGET and len(self._entries) > 1:
                _, old = self._entries.popitem(last=False)
                self._bytes -= old.nbytes

    def forget(self, key: str) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes

    def saw(self, key: str, stamp: Stamp | None) -> None:
        with self._lock:
            self._seen[key] = stamp
            while len(self._seen) > 2 * MAX_JOBS:
                del self._seen[next(iter(self._seen))]

    def seen(self, key: str) -> Stamp | None:
        """What the last disk lookup of ``key`` saw, once (``None``: none, or no lookup)."""
        with self._lock:
            return self._seen.pop(key, None)

    def mark_due(self, key: str, baked: str | None) -> bool:
        """Whether a hit on ``key`` (through its baked binary ``baked``) should mark the
        entries used: not where this process did within :data:`MARK_USED_EVERY`."""
        now = time.monotonic()
        with self._lock:
            if now - self._marked.get((key, baked), -math.inf) < MARK_USED_EVERY:
                return False
            self._marked[(key, baked)] = now
            if len(self._marked) > 2 * MAX_BUILT_KEYS:
                del self._marked[next(iter(self._marked))]
            return True

    def look_for_baked(self, key: str) -> bool:
        """Whether to look on disk for ``key``'s baked binary: not again within
        :data:`~.store.BAKED_RECHECK` of a look that found none (:meth:`no_baked`)."""
        with self._lock:
            return time.monotonic() >= self._no_baked.get(key, 0.0)

    def no_baked(self, key: str) -> None:
        with self._lock:
            self._no_baked[key] = time.monotonic() + BAKED_RECHECK
            if len(self._no_baked) > 2 * MAX_BUILT_KEYS:
                del self._no_baked[next(iter(self._no_baked))]

    def baked_now(self, key: str) -> None:
        """``key``'s baked binary was just published (by this process's idle baker)."""
        with self._lock:
            self._no_baked.pop(key, None)


_CACHES: weakref.WeakSet[Cache] = weakref.WeakSet()
#: (directory, final counters) of every cache this process closed.
_CLOSED: list[tuple[str, Stats]] = []
#: Keys this process built (hit or miss), through any cache: a later build of one finds
#: the driver's own cache (pocl's, pyopencl's) holding it already, so a hit saves nothing
#: then. The newest MAX_BUILT_KEYS; a forked child keeps its parent's (and their caches).
_BUILT: dict[str, None] = {}
MAX_BUILT_KEYS = 1 << 16
#: Why nothing is cached, as this process said it once (:meth:`Cache.record_cache_off`).
_TOLD: set[str] = set()
#: Guards _BUILT and _TOLD.
_process_lock = threading.Lock()


def _first_build(key: str) -> bool:
    """Whether this process builds ``key`` for the first time; remembers it. Thread-safe."""
    with _process_lock:
        if key in _BUILT:
            return False
        _BUILT[key] = None
        if len(_BUILT) > MAX_BUILT_KEYS:
            del _BUILT[next(iter(_BUILT))]
        return True


class Cache:
    """A non-blocking binary cache for PyOpenCL programs.

    ``build()`` through this cache returns as fast as an uncached build; binaries
    are retrieved and written in the background. All methods are thread-safe.
    Several processes (and MPI ranks) may share one directory: entries are
    published atomically under a per-key file lock, and readers never see a
    partial entry.

    :arg directory: root directory (default ``ASYNCCLCACHE_DIR`` or the user cache dir).
    :arg rank_local: one subdirectory per MPI rank. Default (``None``):
        ``ASYNCCLCACHE_RANK_LOCAL``, else no: ranks share the directory, one entry per
        program whatever the rank count, read once per node (docs/mpi.md).
    :arg strategy: ``auto``, ``kcache`` (the driver's own cache: pocl's kernel-cache folder,
        NVIDIA's compute cache, Mesa's shader cache) or ``thread`` (the binary query on a
        writer thread). Default (``None``): ``ASYNCCLCACHE_STRATEGY``, else ``auto``.
        ``process`` and ``sync`` are gone: ``auto`` serves instead, with one
        :class:`~asyncclcache.errors.RemovedStrategyWarning`.
    :arg workers: background writer threads. Default (``None``): ``ASYNCCLCACHE_WORKERS``,
        else 1. An explicit argument always wins over the environment.
    :arg max_size: bound of the directory in bytes (or ``"500M"``); least recently used
        entries are evicted by the background writer. Default ``ASYNCCLCACHE_MAX_SIZE``.
    :arg exit_timeout: seconds :meth:`close` (and interpreter exit) waits for pending work.

    Programs build through it with ``asyncclcache.Program(ctx, source, cache=cache)``
    or :func:`asyncclcache.install`.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        rank_local: bool | None = None,
        strategy: str | None = None,
        workers: int | None = None,
        max_size: int | str | None = None,
        exit_timeout: float | None = None,
    ) -> None:
        cfg = get_config()
        # An explicit argument wins; None takes the environment's (or the default).
        strategy = strategy_in_use(cfg.strategy if strategy is None else strategy)
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        workers = cfg.workers if workers is None else workers
        self.strategy = strategy
        self.disabled = cfg.disable
        self.failure_fatal = cfg.failure_fatal
        self.exit_timeout = cfg.exit_timeout if exit_timeout is None else float(exit_timeout)
        if not (math.isfinite(self.exit_timeout) and self.exit_timeout >= 0):
            raise ValueError(f"exit_timeout must be a finite number of seconds >= 0, got {exit_timeout!r}")
        self.max_size = parse_size(max_size) if max_size is not None else cfg.max_size
        self.store = Store(directory, rank_local=rank_local, count=self._count)
        self._bake_idle = cfg.bakes_idle(self.store.rank)
        #: Seconds a bake at close may take (0: none here; ``ASYNCCLCACHE_BAKE``).
        self._exit_bake = cfg.exit_bake_timeout if cfg.bakes_at_exit(self.store.rank) else 0.0
        self._nworkers = max(1, workers)
        self._start_fresh()
        #: The node's ranks compile each program once (:mod:`.nodecompile`), or ``None``.
        self._node_compiles: NodeCompiles | None = None
        on = cfg.node_compile if cfg.node_compile is not None else self.store.rank is not None
        if on and not self.disabled:
            from .nodecompile import NodeCompiles  # a job's ranks only: off a lone process's import
            from .nodecopies import node_base

            self._node_compiles = NodeCompiles(node_base(cfg.node_dir, cfg.test_node), self._count_node)
        self._closed = False
        _CACHES.add(self)
        if cfg.stats:
            summary.register()

    def _start_fresh(self) -> None:
        # At creation, and in a forked child: the parent's threads, baker and pending work
        # did not come along. Its claims (flocks) are shared with the parent: left alone.
        self._lock = threading.RLock()
        self._counters = Counters()
        self._memory = _Memory()
        self._steps: list[Step] = []
        self._drivers: dict[str, Driver] = {}
        self._driver_by_devices: dict[tuple[int, ...], Driver] = {}
        self._workers = Workers(
            self._nworkers, "asyncclcache-writer", self._background_error,
            lambda s: self._counters.add("background_cpu_seconds", s),
        )
        #: Bakes the entries written or hit here on idle cores, and what is left at close
        #: (``ASYNCCLCACHE_BAKE``). Not in a pool's worker (:func:`_pool_worker`): one a core,
        #: like a job's ranks, and ended with ``os._exit`` or a kill, which would leave a
        #: helper's folder behind.
        old = getattr(self, "_baker", None)
        if old is not None:
            old.forget_after_fork()  # the parent's: its pipes closed here, its helper left alone
        self._baker: IdleBaker | None = None
        if (self._bake_idle or self._exit_bake) and self.store.writable and not _pool_worker():
            from .bake import IdleBaker  # off the import path of a warm start

            self._baker = IdleBaker(self.store, self._counters.add, on_baked=self._baked_now,
                                    idle=self._bake_idle)
        self._pipeline = Pipeline(self.store, self._workers, self._counters, max_size=self.max_size,
                                  on_written=self._written)

    def __repr__(self) -> str:
        return f"Cache({str(self.store.root)!r}, strategy={self.strategy!r})"

    # {{{ public API

    @property
    def directory(self) -> str:
        """The directory entries are written to (rank-local where that applies)."""
        return str(self.store.root)

    @property
    def active(self) -> bool:
        """False when disabled (``ASYNCCLCACHE_DISABLE``) or closed: builds are plain."""
        return not (self.disabled or self._closed)

    def stats(self, comm: Any = None) -> Stats:
        """This process's counters for this cache. Thread-safe.

        With an mpi4py communicator ``comm``, the counters summed over its ranks
        (a collective call: every rank of ``comm`` must make it).
        """
        mine = self._counters.snapshot(pending=self._pipeline.pending)
        if comm is None:
            return mine
        import numpy as np
        from mpi4py import MPI

        values = mine.as_dict()
        local = np.array(list(values.values()), dtype=np.float64)
        total = np.empty_like(local)
        comm.Allreduce(local, total, op=MPI.SUM)
        return Stats.from_values(dict(zip(values, total.tolist(), strict=True)))

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
        self._pipeline.refresh()
        done = self._pipeline.wait(timeout)
        errors = self._pipeline.take_errors()
        self._save_lifetime(not_within=SAVE_EVERY)
        if errors and self.failure_fatal:
            raise BackgroundError(f"{len(errors)} background failure(s): {errors[0]!r}") from errors[0]
        return done

    def close(self, timeout: float | None = None) -> bool:
        """Flush for up to ``timeout`` seconds (default: the exit timeout), then stop.

        Work still pending is dropped, never half-written; the idle baker is
        killed. Where this process bakes at exit (``ASYNCCLCACHE_BAKE=exit``; ``auto`` in a
        CI job), what it wrote or hit that no idle core baked is baked first, for up to
        ``ASYNCCLCACHE_EXIT_BAKE_TIMEOUT`` seconds (Ctrl-C stops it at once). Idempotent:
        only the first call flushes, even if it was interrupted. Ctrl-C during the flush
        stops the wait at once, drops what is pending and re-raises the ``KeyboardInterrupt``.
        Builds after close are plain, uncached builds. Returns what :meth:`flush` returned.
        """
        with self._lock:
            if self._closed:
                return True
            self._closed = True  # first: a second close (or close_all) never waits again
        timeout = self.exit_timeout if timeout is None else timeout
        try:
            done = self.flush(timeout)
        except BackgroundError:
            done = False
        except BaseException:
            # Ctrl-C (or a failure) in the wait: stop at once; no later close retries.
            self._stop(grace=0.0)
            raise
        try:
            self._bake_rest()
        except BaseException:
            self._stop(grace=0.0)
            raise
        self._stop(grace=1.0)
        return done

    def _bake_rest(self) -> None:
        # At close, where this process bakes at exit (a CI job saves the directory next):
        # what it wrote or hit that no idle core baked, now, bounded. Entries are whole.
        baker = self._baker
        if baker is None or not self._exit_bake:
            return
        from . import system

        # pytest-xdist's workers each bake their own at once: the cores shared among them.
        workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
        jobs = max(1, system.usable_cores() // max(1, int(workers) if workers.isdigit() else 1))
        result = baker.bake_rest(self._exit_bake, jobs)
        if result is None:
            return
        self._counters.add("baked_at_exit", result.baked)
        logger.info("asyncclcache: at exit, %s%s", result.line(),
                    "" if not result.interrupted else f" (ASYNCCLCACHE_EXIT_BAKE_TIMEOUT={self._exit_bake:g} s)")

    def _stop(self, grace: float) -> None:
        # Drop what is pending (jobs end as no-ops; entries are written atomically, so
        # none is half-written), stop the threads and the baker, record the counters.
        with self._lock:
            drivers = list(self._drivers.values())
        self._pipeline.close()
        for d in drivers:
            d.close(grace)
        self._workers.stop(grace)
        if self._baker is not None:
            self._baker.close()  # never waited for: what it has not baked stays kcache
        node = self.store.node
        if node is not None and node.enabled:  # every copy on the node; one process prunes
            from . import maintenance

            maintenance.sweep(node.storage)
            if node.max_bytes is not None:
                maintenance.prune(node.storage, max_size=node.max_bytes)
        pending = self._pipeline.pending
        if pending:
            logger.info("asyncclcache: exit with %d jobs pending: dropped", pending)
        _CLOSED.append((self.directory, self.stats()))
        self._save_lifetime()

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
                self._pipeline.fetch(job, Purpose.SNAPSHOT_NOW)
            if wait:
                self.flush()

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
                d = make_driver(name, self._workers, devices)
                d.on_cpu = lambda s: self._counters.add("background_cpu_seconds", s)
                d.on_count = self._counters.add
                self._drivers[name] = d
            self._driver_by_devices[ids] = d
            return d

    def job(self, key: str) -> Job | None:
        """What this process keeps of the program it built (or hit) under ``key``: its
        build window, kernels, pocl folders, ... (``None`` if none, or no longer kept)."""
        return self._pipeline.job(key)

    @property
    def drivers(self) -> dict[str, Driver]:
        """The drivers created so far, by strategy name (a copy)."""
        with self._lock:
            return dict(self._drivers)

    # }}}

    # {{{ the build interface (asyncclcache.program): on the caller's thread

    def build(self, b: Build) -> Built:
        """Build ``b``'s program: from its entry where one is stored (memory, then disk),
        else from source, leaving the entry to the background. Raises what the source
        build raises (pyopencl's errors, with the build log). Thread-safe; the caller
        waits for no lock of the disk, no write and no compile but its own build's.

        A stored entry the driver refuses is warned about (:class:`BinaryRejectedWarning`)
        and removed; one it could not use for a cause that may be a setting is kept and
        counted as rejected; both builds count as misses.
        """
        t0 = time.perf_counter()
        looked_up_at = time.time()
        entry = self._lookup(b.info)
        self.record_overhead(time.perf_counter() - t0)
        if entry is not None:
            built = self._from_entry(b, entry, looked_up_at)
            if built is not None:
                return built
        t0 = time.perf_counter()
        built_from = time.time()
        program = self._compile(b)
        built_to = time.time()
        seconds = time.perf_counter() - t0
        self._missed(b, program, looked_up_at, seconds=seconds, built=(built_from, built_to))
        return Built(program, False, "source build (binary retrieved in the background)", seconds)

    def _count_node(self, name: str) -> None:
        self._counters.add(name)  # the counters of now: a forked child's are new

    def _compile(self, b: Build) -> Any:
        """A miss's source build: once a node where the node's ranks share their compiles."""
        nc, root = self._node_compiles, b.driver.node_root
        if nc is None or root is None or not nc.enabled:
            return b.from_source()
        from . import nodecompile

        program, folders = nc.build(b.info.key, root, b.from_source, lambda p: b.describe(p)[1])
        nodecompile.register(nc, program, b.info.key, root, folders, launches_add=b.driver.launches_add)
        return program

    def _from_entry(self, b: Build, entry: Entry, looked_up_at: float) -> Built | None:
        """The hit policy, per :class:`HitOutcome`; ``None``: build from source."""
        driver = b.driver
        if driver.bakes and entry.kind == "kcache":
            baked = self._from_baked(b, entry, driver)
            if baked is not None:
                return baked
        t0 = time.perf_counter()
        built_from = time.time()
        hit = driver.build_from_entry(entry, b)
        seconds = time.perf_counter() - t0
        if hit.outcome is HitOutcome.USED:
            self._hit(b, entry, hit, seconds)
            return Built(hit.program, True, "cache retrieval", seconds, replay=tuple(entry.meta.build_logs))
        if hit.outcome is HitOutcome.REFUSED:
            what = "binary" if entry.kind == "binary" else "kernel-cache files"
            warnings.warn(
                f"asyncclcache: the driver rejected the stored {what} {b.info.key[:12]} "
                f"({hit.why}); rebuilding from source",
                BinaryRejectedWarning,
                stacklevel=5,  # the caller's build()
            )
            self._forget(b.info.key)
            self.store.remove(b.info.key)  # the rebuilt program's entry replaces it
            return None
        if hit.outcome is HitOutcome.UNUSED:
            self._forget(b.info.key)  # kept on disk: the cause may be a setting
        # Built from source, the entry kept: a plain miss, whose entry replaces it where
        # the driver makes one.
        self._missed(b, hit.program, looked_up_at, seconds=seconds, built=(built_from, time.time()))
        return Built(hit.program, False, "source build (stored entry could not be used here)", seconds)

    def _from_baked(self, b: Build, entry: Entry, driver: Driver) -> Built | None:
        """A hit on the baked binary of ``entry``, where there is one (``asyncclcache bake``):
        it loads at a binary's speed. One the driver refuses is dropped (counted), and the
        entry's own files serve."""
        key = baked_key(entry.key)
        baked = self._memory.get(key)
        # None baked here (no mark): no lookup on the shared dir; none for this key lately:
        # none again (a repeat in a new context) until the idle baker says it made one.
        if baked is None and self._memory.look_for_baked(entry.key) and self.store.may_have_baked():
            baked, _ = self.store.lookup(key, b.info.devices)
            if baked is not None:
                self._memory.remember(baked)
        if baked is None:
            self._memory.no_baked(entry.key)
            if self._baker is not None and entry.meta.source is not None:
                self._baker.add(entry.key)  # once a process: its next builds load the binary
            return None
        t0 = time.perf_counter()
        hit = driver.build_from_baked(baked, entry, b)
        seconds = time.perf_counter() - t0
        if hit.outcome is HitOutcome.USED:
            self._counters.add("baked_hits")
            self._hit(b, entry, hit, seconds, baked=key)
            return Built(hit.program, True, "cache retrieval (baked binary)", seconds,
                         replay=tuple(entry.meta.build_logs))
        logger.info("asyncclcache: baked binary of %s not used (%s): dropped", entry.key[:12], hit.why)
        self._counters.add("bakes_dropped")
        self._memory.forget(key)
        if self.active and self.store.writable:
            self._pipeline.drop(key)  # a later bake makes it again
        return None

    def _lookup(self, info: KeyInfo) -> Entry | None:
        """The entry for ``info``'s key: from memory, else read and checked from disk."""
        entry = self._memory.get(info.key)
        if entry is not None:
            return entry
        entry, stamp = self.store.lookup(info.key, info.devices)
        self._memory.saw(info.key, stamp)
        if entry is not None:
            self._memory.remember(entry)
        return entry

    def _hit(self, b: Build, entry: Entry, hit: Hit, seconds: float, *, baked: str | None = None) -> None:
        """A program was built from ``entry`` (from its baked binary, of key ``baked``, where
        given). A driver that can tell cheaply when the program gains variants (kcache)
        gets it watched, for a refresh at flush."""
        self._counters.add("hits")
        nc = self._node_compiles
        if nc is not None and b.driver.node_root is not None and hit.folders:
            from . import nodecompile

            # The entry may lack a variant a launch here needs: compiled once a node too.
            nodecompile.register(nc, hit.program, b.info.key, b.driver.node_root, hit.folders,
                                 launches_add=b.driver.launches_add)
        if _first_build(b.info.key):
            self._counters.add("seconds_saved", max(0.0, entry.meta.compile_seconds - seconds))
        self._count_in_step(hit=True)
        if not (self.active and self.store.writable and self._memory.mark_due(entry.key, baked)):
            return  # a repeat: marked used, and watched (where its driver watches), already
        job = None
        if b.driver.watches_hits:
            meta = entry.meta
            job = Job(b.info, b.source, b.devices, list(meta.build_logs), b.driver,
                      kernels=tuple(meta.kernels), created=time.time(), build_seconds=meta.compile_seconds,
                      cwd=Job.caller_cwd())  # a refresh rewrites the entry: where it builds (bake)
        # A baked hit used both entries: the size bound and prune evict by last use.
        self._pipeline.used(entry, hit, job, baked=baked)

    def _missed(
        self, b: Build, program: Any, looked_up_at: float, *, seconds: float, built: tuple[float, float],
    ) -> None:
        """``program`` was built from source: its entry is written later, in the background.

        ``looked_up_at`` is ``time.time()`` before the lookup; ``built`` (``time.time()``)
        brackets the source build, which took ``seconds``. A key that another process writes
        after this one's lookup is skipped: the lookup saw another file, or none.
        """
        t0 = time.perf_counter()
        self._counters.add("misses")
        _first_build(b.info.key)
        self._count_in_step(hit=False)
        seen = self._memory.seen(b.info.key)
        if not (self.active and self.store.writable):
            return
        driver = b.driver
        logs, kernels = b.describe(program)
        job = Job(
            b.info, b.source, b.devices, logs, driver, seen=seen,
            kernels=tuple(kernels), created=looked_up_at, built_from=built[0],
            built_to=built[1], build_seconds=seconds,
            # What the key saw: a rebuild elsewhere (kcache's probe, a bake) needs the same.
            cwd=Job.caller_cwd(), environ=Job.caller_environ(),
            program=program if driver.needs_program else None,  # kept alive until taken
        )
        if self._pipeline.add(job):  # else: the same program is already on its way
            with self._lock:
                step = self._steps[-1] if self._steps else None
                if step is not None:
                    step.jobs.append(job)  # its snapshot waits for the step's end
            if step is None:
                self._pipeline.fetch(job, Purpose.SNAPSHOT)
        self.record_overhead(time.perf_counter() - t0)

    def _forget(self, key: str) -> None:
        """The driver did not use the entry of ``key``: counted as rejected, and forgotten
        in memory."""
        self._counters.add("rejected")
        self._memory.forget(key)

    def record_uncacheable(self) -> None:
        """A program built plainly because its key could not be known for certain."""
        self._counters.add("uncacheable")

    def record_cache_off(self, driver: Driver) -> None:
        """A program built plainly because nothing is cached for its devices (``driver``
        does not store: strategy ``off``); the first time in this process, one log line
        says why and what to do."""
        self._counters.add("cache_off")
        with _process_lock:
            if driver.why in _TOLD:
                return
            _TOLD.add(driver.why)
        logger.info("asyncclcache: not caching builds here: %s", driver.why)

    def record_overhead(self, seconds: float) -> None:
        """Time the cache spent in a caller's thread (keys, lookups, scheduling)."""
        self._counters.add("main_thread_seconds", seconds)

    # }}}

    # {{{ wiring

    def _count_in_step(self, hit: bool) -> None:
        with self._lock:
            if self._steps:
                self._steps[-1]._count(hit)

    def _written(self, entry: Entry) -> None:
        # A writer thread: the pipeline wrote ``entry``.
        self._memory.remember(entry)
        if self._baker is not None and entry.meta.source is not None:
            self._baker.add(entry.key)

    def _count(self, name: str) -> None:
        # The store's counts; the counters are made anew in a forked child.
        self._counters.add(name)

    def _baked_now(self, key: str) -> None:
        # The idle baker's thread: it published the baked binary of ``key``.
        self._memory.baked_now(key)
        self.store.heard_baked()

    def _save_lifetime(self, not_within: float = 0.0) -> None:
        if self.store.writable:
            self._counters.save_lifetime(self.store.root, not_within=not_within)

    def _background_error(self, error: BaseException) -> None:
        self._pipeline.error(error)

    # }}}


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


#: Whether this process was forked from one that had imported asyncclcache.
_forked = False


def _pool_worker() -> bool:
    """Whether this process is a forked child or a ``multiprocessing`` worker (any start
    method): it starts no idle baker of its own. The parent's, if it has one, is the
    machine's; what the workers wrote is baked by a later run's hits or ``asyncclcache bake``."""
    if _forked:
        return True
    mp = sys.modules.get("multiprocessing.process")
    return mp is not None and mp.parent_process() is not None


def _after_fork_in_child() -> None:
    global _default_lock, _process_lock, _forked
    _forked = True
    _default_lock = threading.Lock()
    _process_lock = threading.Lock()  # _BUILT stays: the parent's builds are in the driver's caches
    _CLOSED.clear()  # the parent's, reported by the parent
    for cache in list(_CACHES):
        cache._start_fresh()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def close_all() -> list[tuple[str, Stats]]:
    """Close every cache of this process (each waits at most its exit timeout, then drops
    what is left); returns ``(directory, counters)`` of every cache it ever closed.
    Runs at interpreter exit. Thread-safe; raises nothing but ``KeyboardInterrupt``:
    Ctrl-C while it waits closes the remaining caches at once, dropping what is pending,
    and is then re-raised."""
    interrupted: KeyboardInterrupt | None = None
    for cache in list(_CACHES):
        try:
            cache.close(0.0 if interrupted is not None else None)
        except KeyboardInterrupt as e:
            interrupted = e
        except Exception:  # never fail interpreter exit
            logger.exception("asyncclcache: error at exit")
    if interrupted is not None:
        raise interrupted
    return list(_CLOSED)


def exit_interrupted() -> NoReturn:
    """End the process as Python ends on an unhandled Ctrl-C, from an exit hook that was
    interrupted: one line on stderr (no traceback), stdio flushed, logging shut down,
    then SIGINT with its default action (status 130 in a shell, -2 to a parent).

    An exception out of an ``atexit`` callback would print "Exception ignored" and exit
    0, so the signal is re-raised here, as CPython does after an unhandled
    ``KeyboardInterrupt`` in ``__main__``; exit callbacks not yet run are skipped."""
    import signal
    import sys

    dropped = sum(stats.pending for _, stats in _CLOSED)
    what = "entry" if dropped == 1 else "entries"
    with suppress(Exception):
        sys.stderr.write(f"asyncclcache: interrupted at exit: {dropped} pending {what} dropped\n")
    for stream in (sys.stdout, sys.stderr):
        with suppress(Exception):
            stream.flush()
    with suppress(Exception):
        logging.shutdown()
    with suppress(Exception):
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(130)  # SIGINT blocked or not deliverable: the status a shell would show


def _close_all_at_exit() -> None:
    try:
        close_all()
    except KeyboardInterrupt:
        exit_interrupted()


atexit.register(_close_all_at_exit)
summary.attach(close_all, exit_interrupted)
