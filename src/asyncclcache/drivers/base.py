"""The interface between the cache and a way of retrieving what a build produced."""

from __future__ import annotations

import enum
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyopencl as cl

    from ..entry import Entry
    from ..keys import KeyInfo

__all__ = ["Done", "Driver", "Dropped", "Hit", "Job", "Lost", "Purpose", "Snapshot", "SourceBuild"]


class Dropped(Exception):
    """A fetch abandoned because the cache is shutting down (counted as skipped)."""


class Lost(Exception):
    """What the job needs is gone or cannot be found (pocl's kernel-cache folder:
    not identified, or removed under us). Counted, not an error."""


class Purpose(enum.Enum):
    """Why the cache asks a driver for a job's binaries."""

    #: Compile what a later snapshot needs (the helper's generic variant); nothing is written.
    WARMUP = "warmup"
    #: The entry, once the program's first launches are likely done (outside a step).
    SNAPSHOT = "snapshot"
    #: The entry, now: a step ended, so its launches are done.
    SNAPSHOT_NOW = "snapshot-now"
    #: Rewrite an entry whose program gained variants since.
    REFRESH = "refresh"


@dataclass
class Snapshot:
    """What a driver retrieved: per-device binaries (``files is None``), or pocl
    kernel-cache files, ``blobs[i]`` being the content of ``files[i]``."""

    blobs: list[bytes]
    files: list[str] | None = None
    folders: list[str] | None = None


@dataclass
class Job:
    """One built program whose binaries are wanted. Created by the cache, then written by
    two owners, each to its own fields, and never by both at once (the pipeline has at most
    one fetch of a key in flight): the pipeline (``claim``, ``yielded``, ``fetches``,
    ``written_*``, on its writer threads; ``yielded`` under its lock) and the job's driver
    (``queried_at``, ``warmup_seconds``, ``folders``, ``candidates``, on the driver's own
    thread, before it calls ``done``)."""

    info: KeyInfo
    source: bytes
    options: bytes
    devices: Sequence[cl.Device]
    logs: list[str]
    driver: Driver
    kernels: tuple[str, ...] = ()
    #: ``time.time()`` before the key lookup (bookkeeping only: no decision compares it).
    created: float = 0.0
    #: The entry file the lookup saw (the store's stamp; ``None``: none): a file there
    #: that is not this one was written since, by someone else.
    seen: tuple[int, ...] | None = None
    #: ``time.time()`` around the source build (pocl's kernel-cache folder is touched in it).
    built_from: float = 0.0
    built_to: float = 0.0
    build_seconds: float = 0.0
    #: The built program, kept alive for in-process strategies; ``None`` once done.
    program: Any = None
    #: Digest of the binaries last written, so a refresh writes only what changed.
    written_digest: str | None = None
    fetches: int = 0
    #: The per-key claim (store lock) while this process works on the key.
    claim: Any = None
    #: Another process claimed the key: this one leaves it alone.
    yielded: bool = False
    #: The helper's first request (its generic compile); about one code generation.
    warmup_seconds: float | None = None
    #: When the driver's last snapshot was taken (variants older than that are in it).
    queried_at: float = 0.0
    #: kcache: folders touched in the build's window, with the touch time (``None``: not scanned).
    candidates: tuple[tuple[str, float], ...] | None = None
    #: kcache: the candidates came from a walk of every folder, not only the new ones.
    scanned_all: bool = False
    #: kcache: pocl's folders for this program, as last chosen (``None``: not yet).
    folders: tuple[str, ...] | None = None
    #: kcache: the files the last written entry holds.
    written_files: frozenset[str] = frozenset()
    #: The caller's working directory at the build, where relative ``-I`` folders and a
    #: quoted ``#include`` resolve (``None``: unknown, so no other process may rebuild it).
    cwd: str | None = None
    #: The caller's ``POCL_*`` variables at the build: the settings its key holds
    #: (``None``: not taken; the driver reads the environment when it needs them).
    environ: dict[str, str] | None = None

    @property
    def key(self) -> str:
        return self.info.key

    @staticmethod
    def caller_cwd() -> str | None:
        """``os.getcwd()``, or ``None`` where the folder is gone. Cheap: one system call."""
        try:
            return os.getcwd()
        except OSError:
            return None

    @staticmethod
    def caller_environ() -> dict[str, str]:
        """A copy of the ``POCL_*`` environment variables (what :func:`~asyncclcache.keys.code_settings`
        reads). Cheap: one pass over ``os.environ``."""
        return {k: v for k, v in os.environ.items() if k.startswith("POCL_")}


@dataclass(frozen=True)
class SourceBuild:
    """The program a hit stands for: where it is built, and how to build it from source
    (the fallback, raising as pyopencl does)."""

    context: cl.Context
    devices: Sequence[cl.Device]
    options: bytes
    build: Callable[[], Any]


#: Called from a background thread with the snapshot or the error.
Done = Callable[[Snapshot | None, BaseException | None], None]


@dataclass
class Hit:
    """The outcome of building from a stored entry.

    ``program`` is the built program, or ``None`` when the driver rejected the entry
    before building (then the caller builds from source). ``used`` is False when a
    program was built but the entry's content was not what the driver used (kcache: pocl
    computed another folder); ``why`` says why not. ``blame_entry`` is False when our own
    I/O failed, not the entry (kcache: pocl's cache could not be written), or the cause
    may be a setting (kcache: pocl did not use the restored folder): then the entry is
    kept and the build counts as a plain miss; ``rejected`` counts the latter.
    """

    program: Any
    used: bool
    why: str = ""
    folders: tuple[str, ...] = ()
    blame_entry: bool = True
    rejected: bool = False


class Driver(ABC):
    """Retrieves a job's binaries off the caller's thread and reports through ``done``.

    ``fetch`` is called on a writer thread of the cache (on the caller's thread only for an
    ``inline`` driver) and must return at once. The attributes say what the cache must do
    differently; it never checks a name.
    """

    name: str = ""
    #: What its entries hold: ``binary`` (clGetProgramInfo) or ``kcache`` (pocl's files).
    kind: str = "binary"
    #: Whether the driver needs the main process's program object.
    needs_program: bool = False
    #: ``fetch`` runs in the caller's thread (for comparison only).
    inline: bool = False
    #: Its first fetch compiles (a warm-up, counted); worth starting inside a step.
    warms_up: bool = False
    #: Written entries may gain variants later (pocl launches): :meth:`stale` tells which.
    refreshable: bool = False
    #: A hit is worth watching for variants compiled after it (cheap to check).
    watches_hits: bool = False
    #: Set by the cache: receives the CPU seconds the driver's own threads spent.
    on_cpu: Callable[[float], None] | None = None
    #: Set by the cache: adds to one of its counters (a :class:`~asyncclcache.stats.Stats` field).
    on_count: Callable[[str, float], None] | None = None

    def count(self, name: str, n: float = 1) -> None:
        """Add ``n`` to the cache's counter ``name``, where a cache listens."""
        if self.on_count is not None:
            self.on_count(name, n)

    def built(self, job: Job) -> None:  # noqa: B027 - optional hook
        """A miss was just built (caller's thread, must be cheap): start early work."""

    @abstractmethod
    def fetch(self, job: Job, purpose: Purpose, done: Done) -> None:
        """Queue a retrieval of ``job``'s binaries; ``done`` runs later in a background thread."""

    def stale(self, jobs: Sequence[Job]) -> list[Job]:
        """The written jobs that may have gained variants since their snapshot."""
        return list(jobs) if self.refreshable else []

    def hurry(self) -> None:  # noqa: B027 - optional hook
        """``flush()`` or exit: stop waiting for launches, snapshot what is there now."""

    def build_from_entry(self, entry: Entry, source: SourceBuild) -> Hit:
        """Build the program from ``entry`` (caller's thread). Binary entries: create the
        program from the stored binaries; a driver that refuses them gives ``Hit(None, ...)``."""
        import pyopencl as cl
        from pyopencl import _cl

        try:
            built = _cl._Program(source.context, list(source.devices), list(entry.binaries))
            built.build(source.options, list(source.devices))
        except cl.Error as e:
            return Hit(None, False, f"{e.code}: {e.what if hasattr(e, 'what') else e}")
        return Hit(built, True)

    def close(self, timeout: float | None = None) -> None:  # noqa: B027 - optional hook
        """Release threads and processes; pending fetches may be dropped."""
