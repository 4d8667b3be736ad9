"""Counters: :class:`Stats` of one cache in one process, and the directory's lifetime totals.

:class:`Counters` is what a :class:`~asyncclcache.Cache` counts into (thread-safe);
``stats()`` snapshots it as an immutable :class:`Stats`. :data:`COUNTERS` is the one
table of counters: each :class:`Stats` field says what it counts, whether it is a
lifetime total and how the exit line shows it. The lifetime counters are one
small JSON file per cache directory, summed over runs and processes: each process adds
what it counted since its last save, under a file lock taken with a short timeout (a
stuck holder costs a skipped save, never a hang), written atomically and durably
(:func:`.fileio.atomic_write`). Readers take no lock.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .fileio import atomic_write
from .locks import file_lock
from .store import STATS_FILE, STATS_LOCK

__all__ = [
    "COUNTERS", "LIFETIME_FIELDS", "Counter", "Counters", "Stats",
    "add_lifetime", "read_lifetime", "reset_lifetime",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Counter:
    """One counter: a :class:`Stats` field (or ``runs``), what it counts, whether the
    directory's lifetime totals sum it (``asyncclcache stats`` shows those), and where the
    exit line shows it: ``"head"`` always, ``"nonzero"`` after the head when not zero,
    ``"never"``. ``unit``: ``""``, ``"bytes"`` or ``"s"`` (a float)."""

    name: str
    meaning: str
    lifetime: bool
    line: str
    unit: str = ""


def _counter(meaning: str, *, lifetime: bool = True, line: str = "nonzero", unit: str = "") -> Any:
    """A :class:`Stats` field: its row of :data:`COUNTERS` is its metadata."""
    return field(default=0.0 if unit == "s" else 0,
                 metadata={"meaning": meaning, "lifetime": lifetime, "line": line, "unit": unit})


@dataclass(frozen=True)
class Stats:
    """Counters of one :class:`Cache` in this process (a snapshot; immutable).

    Every counter is one field here, with its meaning, whether it is a lifetime total and
    how the exit line shows it (:data:`COUNTERS`). Every counter of events is a lifetime
    total; ``pending`` is a level, and the two CPU-time fields measure this process.
    """

    hits: int = _counter("builds served from an entry", line="head")
    misses: int = _counter("builds from source that were then scheduled to be stored", line="head")
    writes: int = _counter("entries written", line="head")
    bytes_written: int = _counter("blob bytes of the entries written", line="head", unit="bytes")
    seconds_saved: float = _counter("estimated compile time that hits avoided", line="head", unit="s")
    pending: int = _counter("background retrievals and writes not finished yet (a level, not events)",
                            lifetime=False, line="head")
    shared_reads: int = _counter("node-local copies on: entries read from the shared directory (a node's "
                                 "first read, or a rank that did not wait for the one reading it)")
    node_reads: int = _counter("node-local copies on: entries read from this node's copies", line="never")
    baked_hits: int = _counter("hits served by a baked binary (asyncclcache bake)")
    bakes_dropped: int = _counter("baked binaries not used at a hit (stale or refused), dropped")
    bakes_not_queued: int = _counter("entries the idle baker could not take (busy, or off here): bake later")
    refreshes: int = _counter("entries rewritten because the program gained variants")
    skipped: int = _counter("writes left to another process that held the key, or dropped at shutdown")
    rejected: int = _counter("stored binaries the driver refused (rebuilt from source)")
    uncacheable: int = _counter("builds not cached: an #include that cannot be resolved for certain")
    cache_off: int = _counter("builds not cached: the driver's own cache is off where asyncclcache "
                              "needs it (pocl's kernel cache; asyncclcache info says what to do)")
    unidentified: int = _counter("kcache: pocl's folder of a build not found, or removed under us")
    incomplete_hits: int = _counter("driver caches: hits after which the driver wrote files anyway")
    left_out: int = _counter("driver caches: files of a build not stored (bounds, trust rules, gone)")
    evictions: int = _counter("entries removed to keep the directory under max_size")
    write_errors: int = _counter("writes that failed (disk full, permissions)")
    errors: int = _counter("other background failures (logged)")
    # This process's costs, for profiling a run: summed over runs on other nodes and loads
    # they would say nothing about the directory.
    main_thread_seconds: float = _counter("time the cache spent in callers' threads",
                                          lifetime=False, line="never", unit="s")
    background_cpu_seconds: float = _counter("CPU time of the cache's own threads (not the baker's)",
                                             lifetime=False, line="never", unit="s")

    def line(self, label: str = "asyncclcache") -> str:
        """One line, as ``ccache -s`` would say it: for a log, or the job's exit summary.

        The head always; after it, each ``"nonzero"`` counter (errors, skipped, ...) that is not zero.
        """
        text = (
            f"{label}: {self.hits} hits, {self.misses} misses, {self.writes} writes "
            f"({self.bytes_written / 1e6:.1f} MB), {self.seconds_saved:.1f} s saved, "
            f"{self.pending} pending"
        )
        extra = [
            f"{getattr(self, c.name)} {c.name.replace('_', ' ')}"
            for c in COUNTERS
            if c.line == "nonzero" and getattr(self, c.name)
        ]
        return text + (f" ({', '.join(extra)})" if extra else "")

    @classmethod
    def from_values(cls, values: dict[str, float]) -> Stats:
        """From field name -> number (counts rounded to int), e.g. summed over ranks."""
        ints = {f.name for f in fields(cls) if f.type in ("int", int)}
        kwargs: dict[str, Any] = {k: (round(v) if k in ints else float(v)) for k, v in values.items()}
        return cls(**kwargs)

    def __add__(self, other: Stats) -> Stats:
        """Counters summed (over caches, processes or ranks)."""
        if not isinstance(other, Stats):
            return NotImplemented
        return Stats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def as_dict(self) -> dict[str, float]:
        """The counters as a plain dict (stable field names, for JSON)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


class Counters:
    """The running counters behind :class:`Stats`. Thread-safe; cheap to add to."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = {f.name: 0 for f in fields(Stats)}
        self._saved: dict[str, float] = {}  # what the lifetime file already holds

    def add(self, name: str, n: float = 1) -> None:
        """Add ``n`` to the counter ``name`` (a :class:`Stats` field)."""
        with self._lock:
            self._values[name] += n

    def snapshot(self, pending: int = 0) -> Stats:
        """The counters now, as :class:`Stats`."""
        with self._lock:
            return Stats.from_values(dict(self._values, pending=pending))

    def save_lifetime(self, root: str | os.PathLike[str]) -> None:
        """Add what was counted since the last save to ``root``'s lifetime counters
        (bounded lock wait; a busy lock means: next time)."""
        with self._lock:
            now = {k: v for k, v in self._values.items() if k in LIFETIME_FIELDS}
            deltas = {k: v - self._saved.get(k, 0) for k, v in now.items()}
            first = not self._saved
        if not any(deltas.values()):
            return
        if first:
            deltas["runs"] = 1
        if add_lifetime(root, deltas, timeout=1.0):
            with self._lock:
                self._saved = now


#: Every counter: ``runs`` (lifetime only: the processes that saved counters here), then
#: the fields of :class:`Stats`, in the order the exit line and ``asyncclcache stats`` show them.
COUNTERS: tuple[Counter, ...] = (
    Counter("runs", "processes that added their counters to the directory's", lifetime=True, line="never"),
    *(Counter(f.name, **f.metadata) for f in fields(Stats)),
)

#: The lifetime counters: summed over runs, processes and ranks in the directory.
LIFETIME_FIELDS: tuple[str, ...] = tuple(c.name for c in COUNTERS if c.lifetime)


def read_lifetime(root: str | os.PathLike[str]) -> dict[str, float]:
    """The lifetime counters of the cache at ``root`` (zeros if none yet)."""
    out: dict[str, float] = dict.fromkeys(LIFETIME_FIELDS, 0)
    try:
        with open(Path(root) / STATS_FILE, "rb") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return out
    if isinstance(data, dict):
        for k in LIFETIME_FIELDS:
            v = data.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = v
    return out


def add_lifetime(root: str | os.PathLike[str], deltas: Mapping[str, float], *, timeout: float = 2.0) -> bool:
    """Add ``deltas`` to the counters at ``root``; False if the lock was busy or I/O failed."""
    deltas = {k: v for k, v in deltas.items() if k in LIFETIME_FIELDS and v}
    if not deltas:
        return True
    root = Path(root)
    import filelock  # lazily: off the import path of a warm start

    lock = file_lock(root / STATS_LOCK, timeout)
    try:
        with lock:
            current = read_lifetime(root)
            for k, v in deltas.items():
                current[k] = current.get(k, 0) + v
            _write(root, current)
    except (filelock.Timeout, OSError) as e:
        logger.info("could not save lifetime stats in %s: %s", root, e)
        return False
    return True


def reset_lifetime(root: str | os.PathLike[str]) -> None:
    """Zero the counters at ``root``."""
    root = Path(root)
    with file_lock(root / STATS_LOCK, 10):
        _write(root, dict.fromkeys(LIFETIME_FIELDS, 0))


def _write(root: Path, values: Mapping[str, float]) -> None:
    data = json.dumps({k: values.get(k, 0) for k in LIFETIME_FIELDS}, sort_keys=True).encode()
    atomic_write(root, root / STATS_FILE, data)
