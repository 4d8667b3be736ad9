"""Strategy ``kcache`` on a device that uses several driver caches together, stored as one
entry: pocl's CUDA device, whose build writes the program's folder in pocl's kernel cache
(bitcode and PTX) and has NVIDIA's driver compile that PTX into its compute cache
(docs/design.md F27; the record: :mod:`asyncclcache.platforms.pocl_cuda`).

Each part is one of the drivers of one cache (:mod:`.kcache_folders`, :mod:`.kcache_files`),
which finds, snapshots, restores and checks its own files with its own trust rules; this
driver only joins them. A part's files are stored as ``<prefix>/<path in its cache>``.

* **Snapshot**: every part that is on snapshots the job; the entry is the union. A program's
  folder that is not identified means nothing is stored (when in doubt, miss); a cache of
  one file per item may have gained nothing (it held the files before: the program built on
  this node already), and a later hit on a new node completes the entry.
* **Hit**: each part that is on restores its files, all around one source build (the first
  part outermost: pocl's folder is restored, then NVIDIA's files, then the build, then each
  part's check). A part that did not use its files makes the whole a miss (the part warned
  once; the entry is kept). A part that is off here is not restored (logged), the others are.
* **Refresh**: whatever any part says is stale.

Thread-safe: the parts are; what this driver adds is per call.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import BinaryRejectedWarning
from ..platform import Layout
from .base import Build, Done, Driver, Hit, HitOutcome, Job, Lost, Purpose, Snapshot

if TYPE_CHECKING:
    from ..entry import Entry

__all__ = ["PartsDriver"]

logger = logging.getLogger(__name__)


class _Refused(Exception):
    """A part refused its files (a name of another cache): the entry is bad."""


@dataclasses.dataclass(frozen=True)
class _Part:
    prefix: str
    layout: Layout
    #: ``None``: this cache is off here (``why``).
    driver: Driver | None
    why: str

    @property
    def required(self) -> bool:
        # The program's own folder must be found; an item cache may have had the files before.
        return self.layout.per_program


class PartsDriver(Driver):
    """Joins one driver per cache (``parts``: ``(prefix, its layout, its driver or None
    where that cache is off, why it is off)``) into one entry, ``layout`` (the platform's:
    every name a part may store, under its prefix). Thread-safe."""

    kind = "kcache"
    needs_program = False
    refreshable = True
    watches_hits = True

    def __init__(self, layout: Layout, parts: Sequence[tuple[str, Layout, Driver | None, str]]) -> None:
        self.name = layout.strategy
        self.layout = layout
        self._parts = tuple(_Part(*p) for p in parts)
        self._on = tuple(p for p in self._parts if p.driver is not None)
        self._skipped_logged = False
        self._lock = threading.Lock()
        self._warned = False

    # {{{ the cache's hooks, forwarded to every part

    _on_cpu: Callable[[float], None] | None = None
    _on_count: Callable[[str, float], None] | None = None

    @property  # type: ignore[override]
    def on_cpu(self) -> Callable[[float], None] | None:
        return self._on_cpu

    @on_cpu.setter
    def on_cpu(self, f: Callable[[float], None] | None) -> None:
        self._on_cpu = f
        for p in self._on:
            p.driver.on_cpu = f  # type: ignore[union-attr]

    @property  # type: ignore[override]
    def on_count(self) -> Callable[[str, float], None] | None:
        return self._on_count

    @on_count.setter
    def on_count(self, f: Callable[[str, float], None] | None) -> None:
        self._on_count = f
        for p in self._on:
            p.driver.on_count = f  # type: ignore[union-attr]

    @property
    def unused(self) -> int:
        """Hits of which some part's files went unused (each part's own count)."""
        return sum(getattr(p.driver, "unused", 0) for p in self._on)

    def _warn_once(self, message: str) -> None:
        with self._lock:
            if self._warned:
                logger.info("asyncclcache: %s", message)
                return
            self._warned = True
        warnings.warn(f"asyncclcache: {message}", BinaryRejectedWarning, stacklevel=5)

    def part(self, prefix: str) -> Driver | None:
        """The driver of the part ``prefix`` (``None``: that cache is off here)."""
        return next((p.driver for p in self._parts if p.prefix == prefix), None)

    # }}}

    # {{{ files of the entry, per part

    def _split(self, files: Sequence[str], blobs: Sequence[bytes]) -> dict[str, tuple[list[str], list[bytes]]]:
        """``{prefix: (its paths, blobs)}``; raises :class:`_Refused` at a name of no part,
        or one its part's layout does not hold."""
        out: dict[str, tuple[list[str], list[bytes]]] = {p.prefix: ([], []) for p in self._parts}
        for rel, blob in zip(files, blobs, strict=True):
            prefix, _, inner = rel.partition("/")
            if prefix not in out or not self.layout.valid(rel):
                raise _Refused(f"the entry holds {rel!r}, not a file of {self.layout.what}")
            out[prefix][0].append(inner)
            out[prefix][1].append(blob)
        return out

    @staticmethod
    def _sub(entry: Entry, files: list[str], blobs: list[bytes]) -> Entry:
        from ..entry import Entry

        return Entry(entry.key, tuple(blobs), dataclasses.replace(entry.meta, files=files))

    # }}}

    # {{{ caller's threads

    def built(self, job: Job) -> None:
        for p in self._on:
            p.driver.built(job)  # type: ignore[union-attr]

    def hurry(self) -> None:
        for p in self._on:
            p.driver.hurry()  # type: ignore[union-attr]

    def stale(self, jobs: Sequence[Job]) -> list[Job]:
        out: dict[int, Job] = {}
        for p in self._on:
            out.update((id(j), j) for j in p.driver.stale(jobs))  # type: ignore[union-attr]
        return [j for j in jobs if id(j) in out]

    def build_from_entry(self, entry: Entry, build: Build) -> Hit:
        try:
            split = self._split(entry.meta.files or [], entry.binaries)
        except _Refused as e:
            return Hit(HitOutcome.REFUSED, None, str(e))
        off = [p for p in self._parts if p.driver is None and split[p.prefix][0]]
        if off and not self._skipped_logged:
            self._skipped_logged = True
            logger.info("asyncclcache: not restoring the entry's files of %s: %s",
                        ", ".join(p.prefix for p in off), "; ".join(p.why for p in off))
        if not any(split[p.prefix][0] for p in self._on):
            why = f"the entry holds files of no cache that is on here ({'; '.join(p.why for p in off)})"
            self._warn_once(f"{entry.key[:12]}: {why}; built from source. The entry is kept")
            return Hit(HitOutcome.UNUSED, build.from_source(), why)
        # An item cache joins without files of its own: what the build adds there completes
        # the entry (an entry stored where that cache was off).
        todo = [p for p in self._on if split[p.prefix][0] or not p.required]
        hits: dict[str, Hit] = {}

        def around(part: _Part, inner: Callable[[], Any]) -> Callable[[], Any]:
            # The part restores its files, calls ``inner`` as its source build, checks.
            def run() -> Any:
                sub = self._sub(entry, *split[part.prefix])
                hit = part.driver.build_from_entry(sub, dataclasses.replace(build, from_source=inner))  # type: ignore[union-attr]
                hits[part.prefix] = hit
                if hit.outcome is HitOutcome.REFUSED:
                    raise _Refused(hit.why)
                return hit.program
            return run

        call: Callable[[], Any] = build.from_source
        for part in reversed(todo):
            call = around(part, call)
        try:
            program = call()
        except _Refused as e:
            return Hit(HitOutcome.REFUSED, None, str(e))
        folders = next((h.folders for h in hits.values() if h.folders), ())
        for outcome in (HitOutcome.UNUSED, HitOutcome.NOT_RESTORED):
            bad = [h.why for h in hits.values() if h.outcome is outcome]
            if bad:
                # A miss: what the other parts restored is its build's, to be stored again.
                for p in todo:
                    if (h := hits.get(p.prefix)) is not None and h.outcome is HitOutcome.USED:
                        p.driver.unused_hit(entry.key, split[p.prefix][0])  # type: ignore[union-attr]
                return Hit(outcome, program, "; ".join(bad), folders)
        return Hit(HitOutcome.USED, program, "", folders)

    def watch(self, job: Job, entry: Entry, hit: Hit) -> None:
        try:
            split = self._split(entry.meta.files or [], entry.binaries)
        except _Refused:
            return
        for p in self._on:
            p.driver.watch(job, self._sub(entry, *split[p.prefix]), hit)  # type: ignore[union-attr]

    def written(self, job: Job, snap: Snapshot) -> None:
        try:
            split = self._split(snap.files or [], snap.blobs)
        except _Refused:
            return
        for p in self._on:
            files, blobs = split[p.prefix]
            p.driver.written(job, Snapshot(blobs, files))  # type: ignore[union-attr]

    def fetch(self, job: Job, purpose: Purpose, done: Done) -> None:
        """Every part that is on snapshots ``job``; ``done`` gets their union once all
        have answered (on the thread of the last)."""
        lock = threading.Lock()
        got: dict[str, tuple[Snapshot | None, BaseException | None]] = {}

        def one(prefix: str) -> Done:
            def report(snap: Snapshot | None, error: BaseException | None) -> None:
                with lock:
                    got[prefix] = (snap, error)
                    if len(got) < len(self._on):
                        return
                done(*self._join(got))
            return report

        for p in self._on:
            p.driver.fetch(job, purpose, one(p.prefix))  # type: ignore[union-attr]

    def _join(self, got: dict[str, tuple[Snapshot | None, BaseException | None]],
              ) -> tuple[Snapshot | None, BaseException | None]:
        files: list[str] = []
        blobs: list[bytes] = []
        lost: list[str] = []
        for p in self._on:
            snap, error = got[p.prefix]
            if isinstance(error, Lost) and not p.required:
                lost.append(str(error))
                continue
            if error is not None:
                return None, error
            if snap is None or snap.files is None:
                return None, Lost(f"{p.layout.what} gave no files")
            files += [f"{p.prefix}/{f}" for f in snap.files]
            blobs += snap.blobs
        if not files:
            return None, Lost("; ".join(lost) or "no part of the cache held a file of this build")
        return Snapshot(blobs, files), None

    def close(self, timeout: float | None = None) -> None:
        for p in self._on:
            p.driver.close(timeout)  # type: ignore[union-attr]

    # }}}
