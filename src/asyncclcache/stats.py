"""Counters: :class:`Stats` of one cache in one process, and the directory's lifetime totals.

:class:`Counters` is what a :class:`~asyncclcache.Cache` counts into (thread-safe);
``stats()`` snapshots it as an immutable :class:`Stats`. :data:`COUNTERS` is the one
table of counters: each :class:`Stats` field says what it counts, whether it is a
lifetime total and how the exit line shows it. The lifetime counters of a cache
directory, summed over runs and processes, are a small JSON file plus what processes
added since it was last folded: each save is a new file of its own in ``stats.d/`` (one
``open`` that creates it, one ``write``; no lock, no read, no ``fsync``), so a thousand
ranks that exit together never wait for one another. The directory's upkeep
(:func:`.maintenance.upkeep`) and a process that saved where the last fold is
:data:`FOLD_EVERY` old (one ``lstat``; the lock not waited for) fold those files into the
total: a directory that is only hit keeps no more files than processes saved since. The
total names what it holds, so a crash anywhere loses nothing and counts nothing twice.
Readers take no lock and sum both.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .fileio import CLOEXEC, HOST, NOFOLLOW, atomic_write, read_small
from .locks import file_lock
from .shared import STATS_DIR, STATS_FILE, STATS_LOCK

__all__ = [
    "COUNTERS",
    "FOLD_EVERY",
    "LIFETIME_FIELDS",
    "Counter",
    "Counters",
    "Stats",
    "add_lifetime",
    "fold_due",
    "fold_lifetime",
    "read_lifetime",
    "reset_lifetime",
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
    node_builds: int = _counter("ranks of a node: builds that took another rank's compiled program "
                                "(pocl's front end skipped)")
    node_launches: int = _counter("ranks of a node: first launches that took another rank's compiled "
                                  "variant (pocl's code generation skipped)")
    node_waits_cut: int = _counter("ranks of a node: waits for another rank's compile cut at the bound "
                                   "(a stopped rank?)")
    baked_hits: int = _counter("hits served by a baked binary (asyncclcache bake)")
    bakes_dropped: int = _counter("baked binaries refused at a hit, dropped")
    bakes_not_queued: int = _counter("entries the idle baker could not take (busy, or off here): bake later")
    baked_at_exit: int = _counter("entries baked as the cache closed (ASYNCCLCACHE_BAKE=exit; auto in CI)")
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
        self._saved_at: float | None = None  # time.monotonic() of the last save

    def add(self, name: str, n: float = 1) -> None:
        """Add ``n`` to the counter ``name`` (a :class:`Stats` field)."""
        with self._lock:
            self._values[name] += n

    def snapshot(self, pending: int = 0) -> Stats:
        """The counters now, as :class:`Stats`."""
        with self._lock:
            return Stats.from_values(dict(self._values, pending=pending))

    def save_lifetime(self, root: str | os.PathLike[str], *, not_within: float = 0.0) -> None:
        """Add what was counted since the last save to ``root``'s lifetime counters (a
        file of its own: no lock, nothing waited for; a failed write means: next time).
        Not again within ``not_within`` seconds of the last save (a program that flushes
        every step makes one file a minute, not one a step)."""
        with self._lock:
            if not_within and self._saved_at is not None and time.monotonic() - self._saved_at < not_within:
                return
            now = {k: v for k, v in self._values.items() if k in LIFETIME_FIELDS}
            deltas = {k: v - self._saved.get(k, 0) for k, v in now.items()}
            first = not self._saved
        if not any(deltas.values()):
            return
        if first:
            deltas["runs"] = 1
        if add_lifetime(root, deltas):
            with self._lock:
                self._saved = now
                self._saved_at = time.monotonic()
            if fold_due(root):
                fold_lifetime(root, timeout=0)  # another process folds: nothing waited for


#: Every counter: ``runs`` (lifetime only: the processes that saved counters here), then
#: the fields of :class:`Stats`, in the order the exit line and ``asyncclcache stats`` show them.
COUNTERS: tuple[Counter, ...] = (
    Counter("runs", "processes that added their counters to the directory's", lifetime=True, line="never"),
    *(Counter(f.name, **f.metadata) for f in fields(Stats)),
)

#: The lifetime counters: summed over runs, processes and ranks in the directory.
LIFETIME_FIELDS: tuple[str, ...] = tuple(c.name for c in COUNTERS if c.lifetime)


#: An addition's file: ``<host>-<pid>-<random>.json`` in ``stats.d/``.
_ADDITION_SUFFIX = ".json"
#: An addition that does not parse yet (being written) is left this long, then removed.
_UNREADABLE_AGE = 3600.0
#: A process that saved its counters folds the additions itself where the total is older
#: than this (one ``lstat``): a directory that is only hit (every CI run after the first,
#: every production job) keeps at most what was added since, not a file a process for ever.
FOLD_EVERY = 600.0
#: Additions folded at most in one fold (a fold at exit stays short; the next takes the rest).
MAX_FOLD = 4096


def _counters(data: dict[str, Any]) -> dict[str, float]:
    """The lifetime counters in ``data`` (other keys, and values that are not numbers, left out)."""
    return {k: v for k in LIFETIME_FIELDS
            if isinstance(v := data.get(k), (int, float)) and not isinstance(v, bool)}


def _parse(raw: bytes) -> dict[str, float] | None:
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    return _counters(data) if isinstance(data, dict) else None


def _read_file(path: Path) -> dict[str, float] | None:
    raw = read_small(path, 1 << 16)
    return None if raw is None else _parse(raw)


def _read_total(root: Path) -> tuple[dict[str, float], frozenset[str]]:
    """The folded total and the additions it already holds (their files may still be there:
    a fold that ended between its write and their removal)."""
    raw = read_small(root / STATS_FILE, 1 << 22)
    try:
        data = json.loads(raw) if raw else {}
    except ValueError:
        data = {}
    if not isinstance(data, dict):
        return {}, frozenset()
    folded = data.get("folded")
    names = frozenset(n for n in folded if isinstance(n, str)) if isinstance(folded, list) else frozenset()
    counters = data.get("counters", data)  # before the fold kept names: the counters alone
    return (_counters(counters) if isinstance(counters, dict) else {}), names


def _names(root: Path) -> list[str]:
    """The names of the additions in ``stats.d/``, sorted."""
    try:
        names = os.listdir(root / STATS_DIR)
    except OSError:
        return []
    return sorted(n for n in names if n.endswith(_ADDITION_SUFFIX) and not n.startswith("."))


def _additions(root: Path, names: list[str]) -> list[tuple[Path, dict[str, float] | None]]:
    """The additions ``names`` of ``stats.d/``, parsed (``None``: not readable, or being written)."""
    folder = root / STATS_DIR
    return [(folder / n, _read_file(folder / n)) for n in names]


def read_lifetime(root: str | os.PathLike[str]) -> dict[str, float]:
    """The lifetime counters of the cache at ``root`` (zeros if none yet): the folded
    total plus the additions it does not hold yet. Takes no lock."""
    root = Path(root)
    out: dict[str, float] = dict.fromkeys(LIFETIME_FIELDS, 0)
    total, folded = _read_total(root)
    for values in [total, *(v for _, v in _additions(root, [n for n in _names(root) if n not in folded]))]:
        for k, v in (values or {}).items():
            out[k] += v
    return out


def add_lifetime(root: str | os.PathLike[str], deltas: Mapping[str, float]) -> bool:
    """Add ``deltas`` to the counters at ``root``: a new file in ``stats.d/``, never
    waited for (no lock). False if it could not be written (logged)."""
    values = {k: v for k, v in deltas.items() if k in LIFETIME_FIELDS and v}
    if not values:
        return True
    folder = Path(root) / STATS_DIR
    name = f"{HOST}-{os.getpid()}-{secrets.token_hex(8)}{_ADDITION_SUFFIX}"
    data = json.dumps(values, sort_keys=True).encode()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC
    try:
        try:
            fd = os.open(folder / name, flags, 0o600)
        except FileNotFoundError:  # the first addition here
            with contextlib.suppress(FileExistsError):
                os.mkdir(folder, 0o700)
            fd = os.open(folder / name, flags, 0o600)
        try:
            # One write of a few hundred bytes: a reader sees all of it, or an empty file
            # (skipped until it is whole).
            os.write(fd, data)
        finally:
            os.close(fd)
    except OSError as e:
        logger.info("could not save lifetime stats in %s: %s", root, e)
        return False
    return True


def fold_due(root: str | os.PathLike[str]) -> bool:
    """Whether the total at ``root`` was last folded :data:`FOLD_EVERY` ago or more (by
    this host's clock; a stamp far in its future counts as due), or never: one ``lstat``."""
    try:
        age = time.time() - os.lstat(Path(root) / STATS_FILE).st_mtime
    except OSError:
        return True
    return not (-FOLD_EVERY < age < FOLD_EVERY)


def fold_lifetime(root: str | os.PathLike[str], *, timeout: float = 2.0) -> int:
    """Fold the additions in ``stats.d/`` into the total (under the stats lock, waited for
    at most ``timeout``); returns how many. By the directory's upkeep, and by a process that
    saved its counters where the last fold is :func:`fold_due`. Safe against a crash at any
    point: the total names the additions it holds, and only then are they removed (a reader
    skips those still there), so none is lost or counted twice. An addition that does not
    parse is left until it is an hour old (its writer may be writing it), then removed."""
    root = Path(root)
    import filelock  # lazily: off the import path of a warm start

    try:
        with file_lock(root / STATS_LOCK, timeout):
            total, held = _read_total(root)
            names = _names(root)
            if not names and not held:
                return 0
            now = time.time()
            total = dict.fromkeys(LIFETIME_FIELDS, 0.0) | total
            done = [root / STATS_DIR / n for n in names if n in held]  # counted by an earlier fold
            folded = []
            for path, values in _additions(root, [n for n in names if n not in held][:MAX_FOLD]):
                if values is None:
                    with contextlib.suppress(OSError):
                        if now - os.lstat(path).st_mtime > _UNREADABLE_AGE:
                            os.unlink(path)
                    continue
                for k, v in values.items():
                    total[k] += v
                folded.append(path)
            keep = sorted(held.intersection(names))
            if folded or len(keep) != len(held):
                _write(root, total, [*keep, *(p.name for p in folded)])
            for path in [*done, *folded]:
                with contextlib.suppress(OSError):
                    os.unlink(path)
    except (filelock.Timeout, OSError) as e:
        logger.info("could not fold lifetime stats in %s: %s", root, e)
        return 0
    return len(folded)


def reset_lifetime(root: str | os.PathLike[str]) -> None:
    """Zero the counters at ``root`` (the additions not folded yet too)."""
    root = Path(root)
    with file_lock(root / STATS_LOCK, 10):
        names = _names(root)
        _write(root, dict.fromkeys(LIFETIME_FIELDS, 0), names)
        for path in (root / STATS_DIR / n for n in names):
            with contextlib.suppress(OSError):
                os.unlink(path)


def _write(root: Path, values: Mapping[str, float], folded: list[str]) -> None:
    data = json.dumps({"counters": {k: values.get(k, 0) for k in LIFETIME_FIELDS}, "folded": folded},
                      sort_keys=True).encode()
    atomic_write(root, root / STATS_FILE, data)
