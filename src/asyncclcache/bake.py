"""``asyncclcache bake``: pocl's kernel-cache entries made into binaries that load at a
binary's speed.

A ``kcache`` hit is pocl's cached-source build: it still preprocesses the source and
loads the bitcode (docs/design.md F21). Only a poclbinary skips that, and making one
costs a generic compile per program (F1), which must never run in a job's way (F18).
So it runs here, where a core is idle: after the job, on a login node, in an image's
build step, before an export (``export --bake``), or during the run on idle cores
(``ASYNCCLCACHE_BAKE=idle``, :class:`IdleBaker`).

For each ``kcache`` entry of a device present here, in a worker process with a private
kernel cache (:func:`.platforms.pocl.cache_environ`): restore the entry's folder, build
the program from its source (a pocl hit, checked without a clock: pocl touched the
restored folder), take the BINARIES answer, which packs the folder's specialized
variants and the generic one, and publish it under :func:`~.keys.baked_key` with the
same claim, checksum and atomic publish as every write. An entry is baked only where
this process computes the same key for it (the same pyopencl, pocl settings and header
contents): when in doubt, skip.
A hit prefers the baked binary; the variants its entry gained after the bake are written
beside what it unpacks (:meth:`.drivers.kcache_folders.KcacheDriver.build_from_baked`), and
a later bake folds them in.

Thread- and process-safe: any number of bakes and jobs may share a directory.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import os
import queue
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import _version, platforms
from .entry import Entry, EntryMeta
from .fileio import NONBLOCK
from .keys import baked_key
from .platforms import pocl
from .store import Store

__all__ = ["BakeResult", "IdleBaker", "bake", "to_bake"]

logger = logging.getLogger(__name__)

#: Why an entry is not baked again.
ALREADY = "already baked"


@dataclass
class BakeResult:
    """What a bake did. ``skipped`` and ``failed`` map a reason to how many entries."""

    baked: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    interrupted: bool = False

    def count(self, status: str, why: str) -> None:
        if status == "baked":
            self.baked += 1
        else:
            box = self.skipped if status == "skipped" else self.failed
            box[why] = box.get(why, 0) + 1

    @property
    def done(self) -> int:
        return self.baked + sum(self.skipped.values()) + sum(self.failed.values())

    def line(self) -> str:
        skipped, failed = sum(self.skipped.values()), sum(self.failed.values())
        text = f"baked {self.baked}, skipped {skipped}, failed {failed}, {self.seconds:.1f} s"
        return text + (" (interrupted: every entry is whole)" if self.interrupted else "")


# {{{ which entries


def to_bake(store: Store, device: str | None = None) -> tuple[list[str], dict[str, int]]:
    """The keys of ``store``'s ``kcache`` entries that a bake here would make a binary of,
    and why the others are left (reason -> count). Reads metadata only; asks OpenCL for
    its devices only where an entry could be baked. Thread-safe."""
    here: list[dict[str, str]] | str | None = None  # str: why there are none
    keys: list[str] = []
    left: dict[str, int] = {}

    def leave(why: str) -> None:
        left[why] = left.get(why, 0) + 1

    for e in sorted(store.entries(), key=lambda e: e.key):
        meta = store.read_meta(e.path)
        if meta is None or meta.kind != "kcache" or platforms.by_strategy(meta.strategy) is not pocl.PLATFORM:
            continue  # damaged (verify says), or not pocl's folder (NVIDIA's, Mesa's items)
        if meta.source is None:
            leave("no source (written by an earlier release)")
            continue
        if here is None:
            here = _pocl_devices()
        if isinstance(here, str):
            leave(here)
        elif not meta.devices or not all(d in here for d in meta.devices):
            leave("its device is not here")
        elif device is not None and not meta.for_device(device):
            leave("another device than --device")
        elif _baked_fresh(store, e.key, meta):
            leave(ALREADY)
        else:
            keys.append(e.key)
    return keys, left


def _pocl_devices() -> list[dict[str, str]] | str:
    """The identities of the pocl CPU devices here, or why OpenCL has none (a login node
    without a driver: the ICD loader finds no platform)."""
    import pyopencl as cl

    from .keys import device_identity

    try:
        platforms = cl.get_platforms()
    except cl.Error as e:
        return f"no OpenCL platform here: {e}"
    here = []
    for p in platforms:
        try:
            devices = p.get_devices()
        except cl.Error:
            continue  # a platform without devices (Clover, rusticl not enabled)
        here += [device_identity(d) for d in devices if pocl.is_cpu_device(d)]
    return here


def _baked_meta(store: Store, key: str) -> EntryMeta | None:
    # The head of key's baked binary, where there is one: a stat or a read, no scan.
    return store.read_meta(store.path_for(baked_key(key)))


def _baked_fresh(store: Store, key: str, meta: EntryMeta) -> bool:
    from .drivers.folders import lacks

    baked = _baked_meta(store, key)
    return baked is not None and baked.baked_from == key and not lacks(baked.baked_files or (), meta.files or ())


# }}}

# {{{ one entry, in a worker process


class _Devices:
    """This process's OpenCL devices, found by identity (:func:`~asyncclcache.keys.device_identity`),
    with one context per set of them. Not thread-safe: one per process."""

    def __init__(self) -> None:
        import pyopencl as cl

        from .keys import device_identity

        self._cl = cl
        self._all = [(device_identity(d), d) for p in cl.get_platforms() for d in p.get_devices()]
        self._contexts: dict[tuple[int, ...], Any] = {}

    def find(self, identities: Sequence[dict[str, str]]) -> tuple[Any, list[Any]]:
        """``(context, devices)`` for ``identities``; ``LookupError`` where one is not here."""
        devices = []
        for ident in identities:
            match = [d for i, d in self._all if i == ident]
            if not match:
                raise LookupError(f"no device matches {ident.get('device_name')!r}")
            devices.append(match[0])
        ids = tuple(d.int_ptr for d in devices)
        ctx = self._contexts.get(ids)
        if ctx is None:
            ctx = self._contexts[ids] = self._cl.Context(devices)
        return ctx, devices


class _Worker:
    """Bakes entries in this process: a private pocl kernel cache, emptied before each
    entry, and one context per set of devices. Not thread-safe (one per process)."""

    def __init__(self, pocl_dir: Path) -> None:
        self.pocl_dir = pocl_dir
        #: An empty folder of ours (removed with the parent's folder): where an entry whose
        #: build folder is gone is built, relative paths finding nothing there either.
        self.nowhere = Path(tempfile.mkdtemp(prefix="nowhere-", dir=pocl_dir.parent))
        self._devices = _Devices()
        # Each build runs in its entry's folder: a relative import path ("" of a parent
        # run as ``python -c``) must keep naming this process's own, never that one.
        sys.path[:] = _pinned(sys.path)

    def bake(self, store: Store, key: str) -> tuple[str, str]:
        """``(status, why)``: ``baked``, ``skipped`` or ``failed``."""
        entry = store.load(key)
        if entry is None or entry.kind != "kcache" or entry.meta.source is None:
            return "skipped", "gone or not bakeable"
        if _baked_fresh(store, key, entry.meta):
            return "skipped", ALREADY
        try:
            ctx, devices = self._devices.find(entry.meta.devices)
        except LookupError:
            return "skipped", "its device is not here"
        try:
            with _built_in(entry.meta.cwd, self.nowhere) as elsewhere:  # the store's paths: absolute
                why = self._same_key(entry, devices, "built in its folder" if elsewhere is None
                                     else "built in an empty folder")
                if why is not None:
                    return "skipped", why if elsewhere is None else f"{elsewhere}; {why}"
                binaries = self._build(entry, ctx, devices)
        except _Skipped as e:
            return "skipped", str(e)
        except Exception as e:  # noqa: BLE001 - a bad entry is one failure, not the bake's
            return "failed", f"{type(e).__name__}: {e}"
        return self._publish(store, entry, binaries)

    def _same_key(self, entry: Entry, devices: Sequence[Any], where: str) -> str | None:
        """Why this process, in the folder it builds in (``where`` says which), would not
        compute ``entry``'s key (a header changed or resolves to another file, another
        pyopencl or pocl setting), or ``None``."""
        from . import _pyopencl
        from .keys import include_deps, key_of

        source = entry.meta.source.encode("utf-8", "surrogateescape")  # type: ignore[union-attr]
        if hashlib.sha256(source).hexdigest() != entry.meta.source_sha256:
            return "its source does not match its checksum"
        for path, digest in entry.meta.includes:
            try:
                # A FIFO in a header's place must not hang the baker (links are followed, as
                # the compiler follows them).
                with open(path, "rb", opener=lambda p, flags: os.open(p, flags | NONBLOCK)) as f:
                    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                        return "a header it includes is not a regular file"
                    now = hashlib.sha256(f.read()).hexdigest()
            except OSError:
                return "a header it includes is gone"
            if now != digest:
                return "a header it includes changed"
        options = entry.meta.options.encode("utf-8", "surrogateescape")
        # The key holds real paths: the files this build's compiler finds, looking where the
        # job's did (this pocl's source folder, then "." and the -I folders), must be those.
        folder = pocl.source_dir()
        deps, uncertain = include_deps(source, options, _pyopencl.include_path(options), os.getcwd(),
                                       source_dir=None if folder is None else str(folder))
        if uncertain is not None:
            return f"{where}, a header it includes is not found for certain"
        if [[d.path, d.sha256] for d in deps] != entry.meta.includes:
            return f"{where}, a header it includes is another file"
        if key_of(devices, options, entry.meta.source_sha256, entry.meta.includes, kind="kcache") != entry.key:
            return ("built here it would have another key "
                    f"(pyopencl version or {pocl.SETTINGS.prefixes[0]}* settings)")
        return None

    def _build(self, entry: Entry, ctx: Any, devices: list[Any]) -> list[bytes]:
        from . import _pyopencl
        from .binaries import program_binaries
        from .drivers.cachefiles import restore
        from .drivers.folders import entry_folders, mark, moved, valid_file

        for child in list(self.pocl_dir.iterdir()):  # a fresh kernel cache for each entry
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
        files = list(entry.meta.files or ())
        restore(self.pocl_dir, files, entry.binaries, valid_file)
        folders = entry_folders(files)
        marks = {f: mark(self.pocl_dir, f) for f in folders}
        prg = _pyopencl.source_program(ctx, entry.meta.source.encode("utf-8", "surrogateescape"))  # type: ignore[union-attr]
        prg.build(entry.meta.options.encode("utf-8", "surrogateescape"), devices)
        if not any(moved(self.pocl_dir, f, marks[f]) for f in folders):
            raise _NotUsed("pocl here did not use its folder (another pocl, or other settings)")
        return program_binaries(prg, devices)

    def _publish(self, store: Store, entry: Entry, binaries: list[bytes]) -> tuple[str, str]:
        m = entry.meta
        meta = EntryMeta(
            kind="binary", devices=m.devices, kernels=m.kernels, build_logs=m.build_logs, options=m.options,
            source_sha256=m.source_sha256, includes=m.includes, created=time.time(),
            compile_seconds=m.compile_seconds, snapshot="bake", strategy="bake",
            asyncclcache=_version.__version__, baked_from=entry.key, baked_files=list(m.files or ()),
        )
        key = baked_key(entry.key)
        claim = store.claim(key)
        if claim is None:
            return "skipped", "another process bakes it"
        try:
            store.publish(Entry(key, tuple(binaries), meta), claim=claim)
        except OSError as e:
            return "failed", f"could not write: {e.strerror or e}"
        finally:
            claim.release()
        return "baked", ""


def _pinned(path: list[Any]) -> list[Any]:
    """``path`` with its relative folders made absolute from here (dropped where this
    folder is gone: they name nothing now, and must not name another one later)."""
    try:
        here = os.getcwd()
    except OSError:
        return [p for p in path if not isinstance(p, str) or os.path.isabs(p)]
    return [p if not isinstance(p, str) or os.path.isabs(p) else os.path.join(here, p) for p in path]


class _Skipped(Exception):
    """An entry left unbaked; the message says why."""


class _NotUsed(_Skipped):
    """The rebuild was not the entry's program (pocl did not use its folder)."""


@contextlib.contextmanager
def _built_in(folder: str | None, nowhere: Path) -> Iterator[str | None]:
    """In ``folder``, the working directory of the entry's build (absolute: the entry's
    check), and back: its relative ``-I`` folders and quoted includes name files there.
    ``None`` (unknown, an earlier release's entry): here, where the key check allows it.
    Where ``folder`` cannot be entered (gone with a CI checkout or a node's scratch, say),
    in ``nowhere``, an empty folder: the key check then passes only for a program that
    finds no header relative to its folder (none at all, or only by absolute paths), which
    builds the same anywhere. Yields ``None``, or why it builds in ``nowhere``."""
    if folder is None:
        yield None
        return
    try:
        back: str | None = os.getcwd()
    except OSError:
        back = None  # this one is gone: the entries that name theirs are still baked
    elsewhere = None
    try:
        os.chdir(folder)
    except FileNotFoundError:
        elsewhere = "the folder it was built in is gone"
    except NotADirectoryError:
        elsewhere = "the folder it was built in is not a folder"
    except OSError as e:
        elsewhere = f"the folder it was built in cannot be entered: {e.strerror or e}"
    if elsewhere is not None:
        os.chdir(nowhere)
    try:
        yield elsewhere
    finally:
        if back is not None:
            os.chdir(back)


_worker: _Worker | None = None


def _init_worker() -> None:
    """In a worker process (:func:`.system.start_helper` set its priority, its death with
    its parent and SIGINT ignored): bake with the private kernel cache that its parent made
    and named in its environment (:func:`.platforms.pocl.cache_environ`; pocl reads it once)."""
    global _worker
    folder = pocl.kernel_cache_dir()
    if folder is None:
        raise RuntimeError("a bake worker needs the private kernel cache its parent names")
    _worker = _Worker(folder)


def _bake_one(where: tuple[str, bool, int | None], key: str) -> tuple[str, str, str]:
    """``(key, status, why)`` of baking ``key`` of the store at ``where`` (in a worker)."""
    assert _worker is not None
    base, rank_local, rank = where
    store = Store(base, rank_local=rank_local, rank=rank, create=False)
    if not store.writable:
        return key, "failed", f"cannot write {store.root}: {store.problem or 'read-only'}"
    status, why = _worker.bake(store, key)
    return key, status, why


def _worker_main() -> int:
    """A worker of :func:`bake`: a JSON line ``[base, rank_local, rank, key]`` on stdin,
    a JSON line ``[key, status, why]`` back on stdout, until EOF."""
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # whatever else prints goes to stderr, never among the answers
    _init_worker()
    for line in sys.stdin.buffer:
        try:
            base, rank_local, rank, key = json.loads(line)
            answer = _bake_one((base, rank_local, rank), key)
        except Exception as e:  # noqa: BLE001 - one failure, not the worker's
            answer = ("", "failed", f"{type(e).__name__}: {e}")
        out.write(json.dumps(answer).encode() + b"\n")
    return 0

# }}}

# {{{ the bake


def bake(
    stores: Sequence[Store], *, jobs: int = 1, device: str | None = None,
    progress: Callable[[BakeResult, int], None] | None = None, priority: str = "nice",
) -> BakeResult:
    """Bake the ``kcache`` entries of ``stores`` that have none yet, in ``jobs`` worker
    processes at a lower ``priority`` (``nice``, ``idle`` or ``normal``). ``progress(result,
    total)`` is called after each entry. Ctrl-C stops the workers at once and raises
    ``KeyboardInterrupt``; every entry stays whole (each is published atomically).
    Process-safe: bakes and jobs on one directory share claims."""
    t0 = time.monotonic()
    result = BakeResult()
    todo: list[tuple[tuple[str, bool, int | None], str]] = []
    for s in stores:
        keys, left = to_bake(s, device)
        if left.get(ALREADY) and s.writable:
            s.mark_baked()  # baked by an earlier release, which wrote no mark: hits look for them
        for why, n in left.items():
            result.skipped[why] = result.skipped.get(why, 0) + n
        todo += [(_where(s), k) for k in keys]
    total = len(todo) + result.done
    if todo:
        _run(todo, max(1, min(jobs, len(todo))), result, progress=lambda r: progress and progress(r, total),
             priority=priority)
    from . import maintenance
    from .config import get_config

    for s in stores:  # after the job: its processes leave the directory alone for an interval
        if s.writable:
            maintenance.upkeep(s, max_size=get_config().max_size)
    result.seconds = time.monotonic() - t0
    return result


def _where(store: Store) -> tuple[str, bool, int | None]:
    # What a worker opens the store by; absolute: a worker enters each entry's folder.
    return os.path.abspath(store.base), store.rank_local, store.rank


def _run(
    todo: list[tuple[tuple[str, bool, int | None], str]], jobs: int, result: BakeResult, *,
    progress: Callable[[BakeResult], object], priority: str, deadline: float | None = None,
) -> None:
    from . import system

    items = collections.deque(todo)
    answers: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
    # The workers' pocl caches: removed below, or by the next bake or idle baker if we are killed.
    pool = _Pool(system.private_folder("acc-bake"), priority)
    threads = [threading.Thread(target=pool.feed, args=(i, items, answers), name=f"asyncclcache-bake-{i}",
                                daemon=True) for i in range(jobs)]
    try:
        for t in threads:
            t.start()
        for _ in todo:  # each item gets one answer
            while True:
                if deadline is not None and time.monotonic() >= deadline:
                    result.interrupted = True  # what is left stays unbaked
                    return
                try:
                    status, why = answers.get(timeout=0.5)  # a Ctrl-C interrupts between waits
                    break
                except queue.Empty:
                    continue
            result.count(status, why)
            progress(result)
    except BaseException:
        result.interrupted = True
        raise
    finally:
        # Workers mid-compile hold nothing we need: a publish is a rename, never half a file.
        pool.stop()
        for t in threads:
            t.join(5.0)
        shutil.rmtree(pool.folder, ignore_errors=True)


class _Died(Exception):
    """A worker process ended without answering."""


class _Pool:
    """:func:`bake`'s worker processes, one per feeding thread (its worker dies with it).
    Thread-safe."""

    def __init__(self, folder: Path, priority: str) -> None:
        self.folder = folder
        self._priority = priority
        self._lock = threading.Lock()
        self._procs: set[subprocess.Popen[bytes]] = set()
        self._stopped = False

    def feed(self, n: int, items: collections.deque[tuple[tuple[str, bool, int | None], str]],
             answers: queue.SimpleQueue[tuple[str, str]]) -> None:
        """Thread ``n``: its worker bakes items until none is left; one answer per item."""
        proc = None
        try:
            while True:
                with self._lock:
                    if self._stopped or not items:
                        return
                    where, key = items.popleft()
                try:
                    if proc is None:
                        proc = self._start(n)
                    answers.put(self._ask(proc, where, key))
                except _Died as e:
                    answers.put(("failed", str(e)))
                    if proc is not None:
                        self._end(proc)
                    proc = None  # a fresh one for the next entry
                except Exception as e:  # noqa: BLE001 - one failure (a worker that cannot start)
                    answers.put(("failed", f"worker: {type(e).__name__}: {e}"))
        finally:
            if proc is not None:
                self._end(proc)

    def _start(self, n: int) -> subprocess.Popen[bytes]:
        from . import system

        pocl_dir = self.folder / f"w{n}"
        pocl_dir.mkdir(exist_ok=True)
        env = dict(system.process_environ(), **pocl.cache_environ(pocl_dir))
        with self._lock:
            if self._stopped:
                raise _Died("stopped")
            proc = system.start_helper("asyncclcache.bake:_worker_main", env=env, priority=self._priority,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            self._procs.add(proc)
        return proc

    @staticmethod
    def _ask(proc: subprocess.Popen[bytes], where: tuple[str, bool, int | None], key: str) -> tuple[str, str]:
        assert proc.stdin is not None
        assert proc.stdout is not None
        try:
            proc.stdin.write(json.dumps([*where, key]).encode() + b"\n")
            proc.stdin.flush()
            while line := proc.stdout.readline():
                with contextlib.suppress(ValueError, TypeError):
                    _, status, why = json.loads(line)  # else a print of its start-up (a sitecustomize)
                    return str(status), str(why)
        except OSError:
            pass
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(1.0)
        raise _Died(f"worker died (exit status {proc.returncode})")

    def _end(self, proc: subprocess.Popen[bytes]) -> None:
        from . import system

        system.kill_helper(proc, 1.0, (proc.stdin, proc.stdout))
        with self._lock:
            self._procs.discard(proc)

    def stop(self) -> None:
        """Kill every worker, wherever it is; none starts after. Idempotent."""
        from . import system

        with self._lock:
            self._stopped = True
            procs = list(self._procs)
        for proc in procs:
            system.kill_helper(proc)

# }}}

# {{{ during a run, on idle cores


#: The idle baker runs only while at least this much of a core is idle, its own CPU counted
#: as idle: measured on this VM, ``SCHED_IDLE`` alone let two bakers take 30% of a core each
#: from two busy processes (their wall time 1.5x). Between checks it is stopped (SIGSTOP).
IDLE_CORES = 0.9
GATE_SECONDS = 0.1
#: Keys held while the baker starts; beyond these they are not queued (counted).
EARLY_KEYS = 1024
#: Keys a process remembers handing over (once each), and the longest line it reads back.
MAX_SENT = 1 << 17
MAX_LINE = 256


class IdleBaker:
    """Bakes entries this process writes or hits, in one helper process at the lowest priority
    (``SCHED_IDLE``), which runs only while a core is idle: a thread of this process starts
    it, then stops and continues it (SIGSTOP, SIGCONT) by the idle CPU time the system
    reports. Never waited for: :meth:`close` kills it, and what it has not baked stays
    ``kcache`` for a later bake. Where the system cannot say how idle it is, or cannot kill
    a stopped helper when this process dies, it is not started at all. ``count(name, n)``
    receives ``bakes_not_queued``; ``on_baked(key)`` hears, on the gate's thread, each key
    whose baked binary the helper published, so that this process's next build of it
    loads it. Started on the first key. Thread-safe."""

    def __init__(self, store: Store, count: Callable[[str, int], object] | None = None,
                 on_baked: Callable[[str], object] | None = None, *, idle: bool = True) -> None:
        self._store = store
        self._where = [str(store.base), str(int(store.rank_local)), "" if store.rank is None else str(store.rank)]
        #: Whether a helper bakes during the run; else keys are only kept for :meth:`bake_rest`.
        self._idle = idle
        self._count = count
        self._on_baked = on_baked
        self._lock = threading.Lock()
        self._state = "new"  # starting, running, off (not here, or its helper ended), closed
        self._early: list[str] = []  # keys that came while it started
        self._proc: subprocess.Popen[bytes] | None = None
        self._fd: int | None = None  # the key pipe's write end, non-blocking
        self._baked_fd: int | None = None  # the read end of the keys it baked, non-blocking
        self._sent: set[str] = set()  # keys handed over (a key is baked once a process)
        self._baked: set[str] = set()  # of those, the keys the helper says it baked
        self._pending = b""  # a line of the helper's not read whole yet
        self._dir: Path | None = None  # its pocl cache, made and removed here
        self.sent = 0
        self.not_queued = 0  # keys it could not take (pipe full, off, closed while starting)
        self.stops = 0  # times the gate stopped the helper (a core was not idle)

    def add(self, key: str) -> None:
        """Hand ``key`` (a ``kcache`` entry written or hit here) to the baker, once. Never
        blocks: a key it cannot take now (its pipe is full: it is stopped or behind; or idle
        baking is off here) is counted as not queued, for a later ``asyncclcache bake``."""
        with self._lock:
            if self._state == "closed" or key in self._sent:
                return
            if len(self._sent) >= MAX_SENT:  # a code generator's thousands: a key again is skipped there
                self._sent.clear()
                self._baked.clear()
            self._sent.add(key)
            if not self._idle:
                return  # kept for bake_rest
            if self._state == "new":
                self._state = "starting"
                threading.Thread(target=self._gate, name="asyncclcache-bake-gate", daemon=True).start()
            if self._state == "starting" and len(self._early) < EARLY_KEYS:
                self._early.append(key)
            elif self._state != "running" or not self._send(key):
                self._drop(1)

    def _send(self, key: str) -> bool:
        # Under the lock; a write of 65 bytes (< PIPE_BUF) is whole or does not happen.
        try:
            os.write(self._fd, key.encode() + b"\n")  # type: ignore[arg-type]
        except OSError:  # full (BlockingIOError), or the helper is gone
            return False
        self.sent += 1
        return True

    def _drop(self, n: int) -> None:
        if n:
            self.not_queued += n
            if self._count is not None:
                self._count("bakes_not_queued", n)

    def _gate(self) -> None:
        """The baker's thread: starts the helper (which dies with this thread) the first
        time the system has a core idle, then runs it only while it has (its own use
        counted idle). A job whose processes keep every core busy (one rank a core) starts
        none."""
        from . import system

        if system.cpu_sample(os.getpid()) is None:
            why = "this system does not say how idle its CPUs are"
        elif not system.death_signal_available():
            why = "a stopped helper could outlive this process here"
        else:
            why = None
        if why is not None:
            logger.info("asyncclcache: no idle baking (%s); `asyncclcache bake` after the job bakes", why)
            self._end("off")
            return
        started = self._start() if self._until_idle() else None
        if started is None:
            return
        proc, ready = started
        try:
            if self._wait_ready(proc, ready):
                self._run_gate(proc)
        finally:
            os.close(ready)
            self._end("off")  # whatever ends the gate ends the baker (as its death signal would)
            with self._lock:  # this thread's alone: closed where no read can be under way
                fd, self._baked_fd = self._baked_fd, None
            if fd is not None:
                os.close(fd)

    def _until_idle(self) -> bool:
        """Whether a core was idle before :meth:`close` (sampled every :data:`GATE_SECONDS`)."""
        from . import system

        before = system.cpu_sample(os.getpid())
        while before is not None and self._state == "starting":
            time.sleep(GATE_SECONDS)
            now = system.cpu_sample(os.getpid())
            if now is None:
                break
            if system.idle_cores(before, now, own_idle=False) >= IDLE_CORES:  # this job's CPU is busy
                return self._state == "starting"
            before = now
        if self._state == "starting":
            self._end("off")
        return False

    def _start(self) -> tuple[subprocess.Popen[bytes], int] | None:
        from . import system

        folder = None
        try:
            folder = system.private_folder("acc-bake")  # and what killed jobs left
            with self._lock:
                # Whoever ends the baker from now on removes it: a process that exits while
                # this (daemon) thread starts the helper leaves no folder behind.
                closed = self._state != "starting"
                if not closed:
                    self._dir = folder
            if closed:
                shutil.rmtree(folder, ignore_errors=True)
                return None
            (folder / "w0").mkdir()
            keys_r, keys_w = os.pipe()
            ready_r, ready_w = os.pipe()
            baked_r, baked_w = os.pipe()
        except OSError as e:
            logger.info("asyncclcache: no idle baking: %s", e)
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
            self._end("off")
            return None
        try:
            proc = system.start_helper(
                "asyncclcache.bake:_idle_main", self._where, priority="idle", stopped=True, ready=ready_w,
                # A subfolder, as a pool's worker has: its worker's other folder ("nowhere")
                # goes beside it, in ours, not into the temp folder.
                env=dict(system.process_environ(), **pocl.cache_environ(folder / "w0")),
                stdin=keys_r, stdout=baked_w, stderr=subprocess.DEVNULL,
            )
        except OSError as e:
            logger.info("asyncclcache: no idle baking: %s", e)
            for fd in (keys_w, ready_r, baked_r):
                os.close(fd)
            shutil.rmtree(folder, ignore_errors=True)
            self._end("off")
            return None
        finally:
            os.close(keys_r)
            os.close(baked_w)
        os.set_blocking(keys_w, False)
        os.set_blocking(baked_r, False)
        with self._lock:
            ok = self._state == "starting"
            if ok:
                self._proc, self._fd, self._dir, self._state = proc, keys_w, folder, "running"
                self._baked_fd = baked_r
                early, self._early = self._early, []
                for key in early:
                    if not self._send(key):
                        self._drop(1)
        if not ok:  # closed while it started
            _release(proc, keys_w, folder)
            os.close(ready_r)
            os.close(baked_r)
            return None
        return proc, ready_r

    def _wait_ready(self, proc: subprocess.Popen[bytes], ready: int) -> bool:
        # No signal before the helper has set its death with this thread: a SIGSTOP before
        # that would let it outlive a killed job.
        while self._state == "running" and proc.poll() is None:
            if select.select([ready], [], [], GATE_SECONDS)[0]:
                return os.read(ready, 1) == b"R"
        return False

    def _run_gate(self, proc: subprocess.Popen[bytes]) -> None:
        from . import system

        before = system.cpu_sample(proc.pid)
        running = False
        while before is not None and proc.poll() is None:
            self._hear_baked(time.monotonic() + GATE_SECONDS)
            now = system.cpu_sample(proc.pid)
            if now is None:
                return
            want = system.idle_cores(before, now, own_idle=True) >= IDLE_CORES  # the helper's use: idle
            before = now
            with self._lock:
                if self._state != "running":
                    return
                # Every tick, not on a change only: the helper stops itself at its start, and
                # a continue that came before that is mended at the next tick.
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGCONT if want else signal.SIGSTOP)
            self.stops += running and not want
            running = want

    def _hear_baked(self, until: float) -> None:
        """Until ``until`` (monotonic): tell ``on_baked`` each key the helper says it baked.
        Only keys handed to it count (its output holds nothing else, but trusts nothing)."""
        fd = self._baked_fd
        while (left := until - time.monotonic()) > 0:
            if fd is None or not select.select([fd], [], [], left)[0]:
                time.sleep(max(0.0, until - time.monotonic()))
                return
            try:
                chunk = os.read(fd, 4096)
            except BlockingIOError:
                continue
            except OSError:
                return
            if not chunk:  # the helper is gone
                fd = None
                continue
            *lines, self._pending = (self._pending + chunk).split(b"\n")
            self._pending = self._pending[-MAX_LINE:]  # a key is 64 bytes: the rest is not ours
            for line in lines:
                key = line.decode(errors="replace").strip()
                with self._lock:
                    sent = key in self._sent
                    if sent:
                        self._baked.add(key)
                if sent and self._on_baked is not None:
                    self._on_baked(key)

    def _end(self, state: str) -> None:
        with self._lock:
            if self._state == "closed":
                return  # released by close()
            self._state = state
            proc, fd, folder = self._proc, self._fd, self._dir
            self._proc = self._fd = self._dir = None
            early, self._early = self._early, []
            self._drop(len(early))
        _release(proc, fd, folder)

    def close(self) -> None:
        """Kill the helper and its children, whatever they are doing (its publishes are
        atomic), and remove its pocl cache. Never waits on the helper. Idempotent."""
        self._end("closed")

    def bake_rest(self, seconds: float, jobs: int) -> BakeResult | None:
        """At exit (the cache closes): kill the helper, then bake here, in ``jobs`` worker
        processes for up to ``seconds``, the keys handed over that have no baked binary yet
        (one baked before its entry gained variants still serves: not baked again). What is
        left stays unbaked; every entry stays whole. Ctrl-C stops the workers at once and
        raises. ``None`` where nothing was left. Called once, by the closing thread."""
        deadline = time.monotonic() + seconds
        self.close()
        with self._lock:
            keys = [k for k in self._sent if k not in self._baked]
        store = self._store
        if not keys or not store.writable:
            return None
        keys = [k for k in keys if _baked_meta(store, k) is None]
        if not keys:
            return None
        result = BakeResult()
        t0 = time.monotonic()
        _run([(_where(store), k) for k in keys], max(1, min(jobs, len(keys))), result, progress=lambda r: None,
             priority="nice", deadline=deadline)
        result.seconds = time.monotonic() - t0
        return result

    def forget_after_fork(self) -> None:
        """In a forked child: close this process's copies of the parent's pipes (the helper
        then sees its keys end with the parent's alone), and leave the helper, its folder
        and the lock, which a thread of the parent may have held at the fork, alone."""
        self._state = "closed"
        for fd in (self._fd, self._baked_fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._proc = self._fd = self._baked_fd = self._dir = None


def _release(proc: subprocess.Popen[bytes] | None, fd: int | None, folder: Path | None) -> None:
    from . import system

    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
    if proc is not None:
        # Reaped if it is gone at once; the teardown of a compiler's memory is not waited for
        # (init reaps it after this process).
        system.kill_helper(proc, 0.02)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)  # a file it still writes: the next sweep's


def _idle_main() -> int:
    """The idle baker (started by :class:`IdleBaker`): one key a line on stdin, until EOF
    or the parent goes. The newest key first: a test suite or a solver builds again what it
    built last, and an older key baked late still serves the next run."""
    base, rank_local, rank = sys.argv[1:4]
    _init_worker()
    store = Store(base, rank_local=rank_local == "1", rank=int(rank) if rank else None, create=False)
    for key in _newest_first(sys.stdin.fileno(), os.getppid()):
        if store.writable and _worker is not None:
            try:
                status, why = _worker.bake(store, key)
            except Exception as e:  # noqa: BLE001 - the next key
                status, why = "failed", str(e)
            logger.debug("asyncclcache idle bake %s: %s %s", key[:12], status, why)
            if status == "baked" or why == ALREADY:
                with contextlib.suppress(OSError):  # the parent reads these (IdleBaker._hear_baked)
                    os.write(1, key.encode() + b"\n")
    return 0


def _newest_first(fd: int, parent: int) -> Iterator[str]:
    """The keys written to ``fd``, each time the newest of those read (every line written
    so far is read first), until EOF and none is left, or ``parent`` is gone."""
    pending: list[str] = []
    partial = b""
    open_ = True
    while os.getppid() == parent and (open_ or pending):
        if open_ and select.select([fd], [], [], 0.0 if pending else 1.0)[0]:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                open_ = False
                continue
            *lines, partial = (partial + chunk).split(b"\n")
            pending += [k for k in (line.decode(errors="replace").strip() for line in lines) if len(k) == 64]
            continue
        if pending:
            yield pending.pop()


# }}}
