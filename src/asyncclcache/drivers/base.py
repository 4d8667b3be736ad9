"""The interface between the cache and a way of retrieving what a build produced."""

from __future__ import annotations

import enum
import os
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from .. import platforms

if TYPE_CHECKING:
    import pyopencl as cl

    from ..entry import Entry
    from ..keys import KeyInfo

__all__ = [
    "Build", "Done", "Driver", "Dropped", "Hit", "HitOutcome", "Job", "Lost", "PerJob", "Purpose", "Snapshot",
]

T = TypeVar("T")


class Dropped(Exception):
    """A fetch abandoned because the cache is shutting down (counted as skipped)."""


class Lost(Exception):
    """What the job needs is gone or cannot be found (pocl's kernel-cache folder:
    not identified, or removed under us). Counted, not an error."""


class Purpose(enum.Enum):
    """Why the cache asks a driver for a job's binaries."""

    #: The entry, once the program's first launches are likely done (outside a step).
    SNAPSHOT = "snapshot"
    #: The entry, now: a step ended, so its launches are done.
    SNAPSHOT_NOW = "snapshot-now"
    #: Rewrite an entry whose program gained variants since.
    REFRESH = "refresh"


@dataclass
class Snapshot:
    """What a driver retrieved: per-device binaries (``files is None``), or the files of
    a driver's own cache, ``blobs[i]`` being the content of ``files[i]``."""

    blobs: list[bytes]
    files: list[str] | None = None


@dataclass(eq=False)
class Job:
    """One built program whose binaries are wanted: the cache's facts about its build.

    The cache sets every field when it creates the job, before anyone else sees it, and
    nothing changes them after, but for ``program``, which the pipeline drops once an
    entry is written. What the pipeline and each driver learn about a job they keep
    themselves, keyed by the job (hashed by identity, so it can key a weak mapping).
    """

    info: KeyInfo
    source: bytes
    devices: Sequence[cl.Device]
    logs: list[str]
    driver: Driver
    kernels: tuple[str, ...] = ()
    #: ``time.time()`` before the key lookup (bookkeeping only: no decision compares it).
    created: float = 0.0
    #: The entry file the lookup saw (the store's stamp; ``None``: none): a file there
    #: that is not this one was written since, by someone else.
    seen: tuple[int, ...] | None = None
    #: ``time.time()`` around the source build (a driver's cache is written in it).
    built_from: float = 0.0
    built_to: float = 0.0
    build_seconds: float = 0.0
    #: The built program, kept alive for a driver that ``needs_program``; ``None`` once written.
    program: Any = None
    #: The caller's working directory at the build, where relative ``-I`` folders and a
    #: quoted ``#include`` resolve (``None``: unknown, so no other process may rebuild it).
    cwd: str | None = None
    #: The caller's variables read at every build (:meth:`caller_environ`): the settings its key holds
    #: (``None``: not taken; the driver reads the environment when it needs them).
    environ: dict[str, str] | None = None

    @property
    def key(self) -> str:
        return self.info.key

    @property
    def options(self) -> bytes:
        """The build options as the driver got them (the key holds them)."""
        return self.info.options

    @staticmethod
    def caller_cwd() -> str | None:
        """``os.getcwd()``, or ``None`` where the folder is gone. Cheap: one system call."""
        try:
            return os.getcwd()
        except OSError:
            return None

    @staticmethod
    def caller_environ() -> dict[str, str]:
        """A copy of the environment variables that a driver reads at every build (pocl's:
        :func:`.platforms.per_build`), which a rebuild elsewhere must see as the caller did.
        As the driver sees them (:func:`.system.process_environ`: ``os.putenv`` included).
        Cheap: one pass over the environment."""
        from .. import system

        return platforms.per_build(system.process_environ())


class PerJob(Generic[T]):
    """One owner's own state of each job (the pipeline's, a driver's): made by ``factory``
    on first use, gone with the job (a weak mapping: the job is hashed by identity).
    Thread-safe to look up; the state's docstring says who writes which field."""

    def __init__(self, factory: Callable[[], T]) -> None:
        self._factory = factory
        self._lock = threading.Lock()
        self._states: weakref.WeakKeyDictionary[Job, T] = weakref.WeakKeyDictionary()

    def __call__(self, job: Job) -> T:
        with self._lock:
            state = self._states.get(job)
            if state is None:
                state = self._states[job] = self._factory()
            return state


@dataclass(frozen=True, eq=False)
class Build:
    """One ``build()`` through the cache, as the pyopencl adapter (:mod:`asyncclcache.program`)
    hands it over: made once per build, read-only, passed whole to the cache and to the
    driver that builds from an entry. The callables raise as pyopencl does."""

    info: KeyInfo
    source: bytes
    context: cl.Context
    devices: Sequence[cl.Device]
    #: The cache's driver for ``devices`` (:meth:`asyncclcache.Cache.driver_for`), whose kind
    #: the key holds: it builds from an entry, and serves the miss.
    driver: Driver
    #: Build a new program from the source (the fallback, and every miss).
    from_source: Callable[[], Any]
    #: Build a new program from per-device binaries (``pyopencl.Error`` if refused).
    from_binaries: Callable[[Sequence[bytes]], Any]
    #: ``(build logs, kernel names)`` of a program built from source.
    describe: Callable[[Any], tuple[list[str], list[str]]]

    @property
    def options(self) -> bytes:
        return self.info.options


#: Called from a background thread with the snapshot or the error.
Done = Callable[[Snapshot | None, BaseException | None], None]


class HitOutcome(enum.Enum):
    """What became of a stored entry that a build found. The cache's policy per outcome
    (:meth:`asyncclcache.Cache.build`) is in brackets."""

    #: The program was built from the entry [a hit].
    USED = "used"
    #: The driver refused the entry before building: it is bad [warned, removed, and the
    #: program built from source: a miss, whose entry replaces it].
    REFUSED = "refused"
    #: Built from source: the driver did not use the entry, for a cause that may be a
    #: setting (pocl's cache elsewhere or off) [the driver warned once; counted as
    #: rejected, kept on disk: a miss].
    UNUSED = "unused"
    #: Built from source: our own I/O could not put the entry in place [kept: a miss].
    NOT_RESTORED = "not restored"


@dataclass(frozen=True)
class Hit:
    """The outcome of building from a stored entry: ``program`` is ``None`` only for
    :attr:`HitOutcome.REFUSED`; ``why`` says why it was not used. ``folders``: which of
    the entry's folders the driver used (kcache), for :meth:`Driver.watch`."""

    outcome: HitOutcome
    program: Any = None
    why: str = ""
    folders: tuple[str, ...] = ()


class Driver(ABC):
    """Retrieves a job's binaries off the caller's thread and reports through ``done``.

    The cache decides hit or miss; the pipeline (:mod:`asyncclcache.pipeline`) alone calls
    the per-job hooks (:meth:`built`, :meth:`fetch`, :meth:`watch`, :meth:`written`).
    ``fetch`` is called on a writer thread of the cache and must return at once; the
    pipeline has at most one fetch of a job in flight. What a driver learns about a job
    (its folders, what it wrote) it keeps itself, and says which thread or lock guards it.
    The attributes say what the cache must do differently; it never checks a name.
    Thread-safe.
    """

    name: str = ""
    #: What its entries hold: ``binary`` (clGetProgramInfo) or ``kcache`` (a driver's own cache's files).
    kind: str = "binary"
    #: ``False``: nothing is cached for these devices; builds are plain, counted ``cache_off``,
    #: and :attr:`why` says what to do instead (strategy ``off``).
    stores: bool = True
    why: str = ""
    #: Whether the driver needs the main process's program object.
    needs_program: bool = False
    #: Written entries may gain variants later (pocl launches): :meth:`stale` tells which.
    refreshable: bool = False
    #: A hit is worth watching for variants compiled after it (cheap to check).
    watches_hits: bool = False
    #: Its entries can be baked into binaries (``asyncclcache bake``): a hit prefers those.
    bakes: bool = False
    #: A driver cache of one folder per program that the ranks of a node may hand each
    #: other (:mod:`asyncclcache.nodecompile`): its root (pocl's kernel cache), else ``None``.
    node_root: Path | None = None
    #: Launches compile (and add to a program's folder): first launches are handed on too.
    launches_add: bool = False
    #: Set by the cache: receives the CPU seconds the driver's own threads spent.
    on_cpu: Callable[[float], None] | None = None
    #: Set by the cache: adds to one of its counters (a :class:`~asyncclcache.stats.Stats` field).
    on_count: Callable[[str, float], None] | None = None

    def count(self, name: str, n: float = 1) -> None:
        """Add ``n`` to the cache's counter ``name``, where a cache listens."""
        if self.on_count is not None:
            self.on_count(name, n)

    def built(self, job: Job) -> None:  # noqa: B027 - optional hook
        """A miss was just built (the caller's thread, through the pipeline; must be cheap):
        start early work."""

    @abstractmethod
    def fetch(self, job: Job, purpose: Purpose, done: Done) -> None:
        """Queue a retrieval of ``job``'s binaries; ``done`` runs later in a background thread."""

    def stale(self, jobs: Sequence[Job]) -> list[Job]:
        """The written jobs that may have gained variants since their snapshot."""
        return list(jobs) if self.refreshable else []

    def hurry(self) -> None:  # noqa: B027 - optional hook
        """``flush()`` or exit: stop waiting for launches, snapshot what is there now."""

    def build_from_entry(self, entry: Entry, build: Build) -> Hit:
        """Build the program from ``entry`` (caller's thread). Binary entries: create the
        program from the stored binaries; a driver that refuses them: ``REFUSED``."""
        import pyopencl as cl

        try:
            program = build.from_binaries(entry.binaries)
        except cl.Error as e:
            return Hit(HitOutcome.REFUSED, None, f"{e.code}: {e.what if hasattr(e, 'what') else e}")
        return Hit(HitOutcome.USED, program)

    def build_from_baked(self, baked: Entry, entry: Entry, build: Build) -> Hit:
        """Build the program from ``baked``, the baked binary of ``entry`` (``bakes``
        drivers; caller's thread): ``REFUSED`` where it is not of ``entry`` or the driver
        refuses it; what ``entry`` gained since the bake is added beside it."""
        return Hit(HitOutcome.REFUSED, None, f"{self.name} does not load baked binaries")

    def watch(self, job: Job, entry: Entry, hit: Hit) -> None:  # noqa: B027 - optional hook
        """``job`` stands for a hit that the pipeline keeps for a refresh (``watches_hits``):
        note what ``entry`` holds (the caller's thread, through the pipeline; cheap)."""

    def unused_hit(self, key: str, files: Sequence[str]) -> None:  # noqa: B027 - optional hook
        """A hit of this driver that the cache counts as a miss all the same (another part
        of the entry went unused, :mod:`.kcache_parts`): the ``files`` it restored belong to
        that build's own snapshot (the caller's thread; cheap)."""

    def written(self, job: Job, snap: Snapshot) -> None:  # noqa: B027 - optional hook
        """An entry of ``job`` was written from ``snap`` (a writer thread; one at a time per job)."""

    def close(self, timeout: float | None = None) -> None:  # noqa: B027 - optional hook
        """Release threads and processes; pending fetches may be dropped."""
