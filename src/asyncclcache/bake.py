"""``asyncclcache bake``: pocl's kernel-cache entries made into binaries that load at a
binary's speed.

A ``kcache`` hit is pocl's cached-source build: it still preprocesses the source and
loads the bitcode (docs/design.md F21). Only a poclbinary skips that, and making one
costs a generic compile per program (F1), which must never run in a job's way (F18).
So it runs here, where a core is idle: after the job, on a login node, in an image's
build step, before an export (``export --bake``), or during the run on idle cores
(``ASYNCCLCACHE_BAKE=idle``, :class:`IdleBaker`).

For each ``kcache`` entry of a device present here, in a worker process with a private
``POCL_CACHE_DIR``: restore the entry's folder, build the program from its source (a pocl
hit, checked without a clock: pocl touched the restored folder), take the BINARIES
answer, which packs the folder's specialized variants and the generic one, and publish
it under :func:`~.keys.baked_key` with the same claim, checksum and atomic publish as
every write. An entry is baked only where this process computes the same key for it
(the same pyopencl, ``POCL_*`` settings and header contents): when in doubt, skip.
A hit prefers the baked binary while it holds every file of its entry
(:meth:`.drivers.kcache.KcacheDriver.build_from_baked`).

Thread- and process-safe: any number of bakes and jobs may share a directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import _version
from .entry import Entry, EntryMeta
from .keys import baked_key
from .store import Store

if TYPE_CHECKING:
    from concurrent.futures import Future, ProcessPoolExecutor

__all__ = ["BakeResult", "IdleBaker", "bake", "to_bake"]

logger = logging.getLogger(__name__)


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
        if meta is None or meta.kind != "kcache" or meta.strategy.startswith("kcache-"):
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
            leave("already baked")
        else:
            keys.append(e.key)
    return keys, left


def _pocl_devices() -> list[dict[str, str]] | str:
    """The identities of the pocl CPU devices here, or why OpenCL has none (a login node
    without a driver: the ICD loader finds no platform)."""
    import pyopencl as cl

    from .drivers import is_pocl_cpu
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
        here += [device_identity(d) for d in devices if is_pocl_cpu(d)]
    return here


def _baked_fresh(store: Store, key: str, meta: EntryMeta) -> bool:
    from .drivers.poclcache import lacks

    baked = store.read_meta(store.path_for(baked_key(key)))
    return baked is not None and baked.baked_from == key and not lacks(baked.baked_files or (), meta.files or ())


# }}}

# {{{ one entry, in a worker process


class _Worker:
    """Bakes entries in this process: a private pocl kernel cache, emptied before each
    entry, and one context per set of devices. Not thread-safe (one per process)."""

    def __init__(self, pocl_dir: Path) -> None:
        from .drivers.pocl_helper import Devices

        self.pocl_dir = pocl_dir
        self._devices = Devices()
        # Each build runs in its entry's folder: a relative import path ("" of a parent
        # run as ``python -c``) must keep naming this process's own, never that one.
        sys.path[:] = _pinned(sys.path)

    def bake(self, store: Store, key: str) -> tuple[str, str]:
        """``(status, why)``: ``baked``, ``skipped`` or ``failed``."""
        entry = store.load(key)
        if entry is None or entry.kind != "kcache" or entry.meta.source is None:
            return "skipped", "gone or not bakeable"
        if _baked_fresh(store, key, entry.meta):
            return "skipped", "already baked"
        try:
            ctx, devices = self._devices.find(entry.meta.devices)
        except LookupError:
            return "skipped", "its device is not here"
        try:
            with _built_in(entry.meta.cwd):  # the store's paths are used outside only
                why = self._same_key(entry, devices)
                if why is not None:
                    return "skipped", why
                binaries = self._build(entry, ctx, devices)
        except _Skipped as e:
            return "skipped", str(e)
        except Exception as e:  # noqa: BLE001 - a bad entry is one failure, not the bake's
            return "failed", f"{type(e).__name__}: {e}"
        return self._publish(store, entry, binaries)

    def _same_key(self, entry: Entry, devices: Sequence[Any]) -> str | None:
        """Why this process, in the folder it builds in, would not compute ``entry``'s key
        (a header changed or resolves to another file, another pyopencl or ``POCL_*``
        setting), or ``None``."""
        from . import _pyopencl, pocl_env
        from .keys import UncertainIncludes, find_include_deps, key_of

        source = entry.meta.source.encode("utf-8", "surrogateescape")  # type: ignore[union-attr]
        if hashlib.sha256(source).hexdigest() != entry.meta.source_sha256:
            return "its source does not match its checksum"
        for path, digest in entry.meta.includes:
            try:
                with open(path, "rb") as f:
                    now = hashlib.sha256(f.read()).hexdigest()
            except OSError:
                return "a header it includes is gone"
            if now != digest:
                return "a header it includes changed"
        options = entry.meta.options.encode("utf-8", "surrogateescape")
        # The key holds real paths: the files this build's compiler finds, looking where the
        # job's did (this pocl's source folder, then "." and the -I folders), must be those.
        folder = pocl_env.source_dir()
        try:
            deps = find_include_deps(source, _pyopencl.include_path(options),
                                     source_dir=None if folder is None else os.path.realpath(folder))
        except UncertainIncludes:
            return "built in its folder, a header it includes is not found for certain"
        if [[d.path, d.sha256] for d in deps] != entry.meta.includes:
            return "built in its folder, a header it includes is another file"
        if key_of(devices, options, entry.meta.source_sha256, entry.meta.includes, kind="kcache") != entry.key:
            return "built here it would have another key (pyopencl version or POCL_* settings)"
        return None

    def _build(self, entry: Entry, ctx: Any, devices: list[Any]) -> list[bytes]:
        from . import _pyopencl
        from .binaries import program_binaries
        from .drivers.cachefiles import restore
        from .drivers.poclcache import entry_folders, mark, moved, valid_file

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
def _built_in(folder: str | None) -> Iterator[None]:
    """In ``folder``, the working directory of the entry's build (absolute: the entry's
    check), and back: its relative ``-I`` folders and quoted includes name files there.
    ``None`` (unknown, an earlier release's entry): here, where the key check allows it."""
    if folder is None:
        yield
        return
    try:
        back: str | None = os.getcwd()
    except OSError:
        back = None  # this one is gone: the entries that name theirs are still baked
    try:
        os.chdir(folder)
    except FileNotFoundError:
        raise _Skipped("the folder it was built in is gone") from None
    except NotADirectoryError:
        raise _Skipped("the folder it was built in is not a folder") from None
    except OSError as e:
        raise _Skipped(f"the folder it was built in cannot be entered: {e.strerror or e}") from None
    try:
        yield
    finally:
        if back is not None:
            os.chdir(back)


_worker: _Worker | None = None


def _init_worker(priority: str) -> None:
    """In a new worker process, before pyopencl loads pocl: a private kernel cache (pocl
    reads ``POCL_CACHE_DIR`` once), the priority asked for, and Ctrl-C left to the parent."""
    import tempfile

    global _worker
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _lower(priority)
    pocl_dir = Path(tempfile.mkdtemp(prefix="acc-bake-"))
    os.environ["POCL_CACHE_DIR"] = str(pocl_dir)
    os.environ["POCL_KERNEL_CACHE"] = "1"
    import atexit

    atexit.register(shutil.rmtree, pocl_dir, True)
    _worker = _Worker(pocl_dir)


def _lower(priority: str) -> None:
    with contextlib.suppress(AttributeError, OSError):
        if priority == "idle":
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        elif priority == "nice":
            os.nice(10)


def _bake_one(where: tuple[str, bool, int | None], key: str) -> tuple[str, str, str]:
    """``(key, status, why)`` of baking ``key`` of the store at ``where`` (in a worker)."""
    assert _worker is not None
    base, rank_local, rank = where
    store = Store(base, rank_local=rank_local, rank=rank, create=False)
    if not store.writable:
        return key, "failed", f"cannot write {store.root}: {store.problem or 'read-only'}"
    status, why = _worker.bake(store, key)
    return key, status, why


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
        for why, n in left.items():
            result.skipped[why] = result.skipped.get(why, 0) + n
        # Absolute: a worker enters each entry's folder for its build.
        todo += [((os.path.abspath(s.base), s.rank_local, s.rank), k) for k in keys]
    total = len(todo) + result.done
    if todo:
        _run(todo, max(1, min(jobs, len(todo))), result, progress=lambda r: progress and progress(r, total),
             priority=priority)
    result.seconds = time.monotonic() - t0
    return result


def _run(
    todo: list[tuple[tuple[str, bool, int | None], str]], jobs: int, result: BakeResult, *,
    progress: Callable[[BakeResult], object], priority: str,
) -> None:
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_init_worker, initargs=(priority,))
    try:
        pending: set[Future[tuple[str, str, str]]] = {pool.submit(_bake_one, w, k) for w, k in todo}
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in finished:
                try:
                    _, status, why = f.result()
                except Exception as e:  # noqa: BLE001 - a worker that died: one failure
                    status, why = "failed", f"worker: {type(e).__name__}: {e}"
                result.count(status, why)
                progress(result)
    except BaseException:
        result.interrupted = True
        _kill(pool)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _kill(pool: ProcessPoolExecutor) -> None:
    # Workers mid-compile hold nothing we need: a publish is a rename, never half a file.
    for p in list(getattr(pool, "_processes", {}).values()):
        with contextlib.suppress(Exception):
            p.kill()


# }}}

# {{{ during a run, on idle cores


_IDLE_BOOT = """
import os, sys
os.environ.pop("ASYNCCLCACHE_INSTALL", None)
from asyncclcache.bake import _idle_main
sys.exit(_idle_main())
"""


#: The idle baker runs only while at least this much of a core is idle, its own CPU counted
#: as idle: measured on this VM, ``SCHED_IDLE`` alone let two bakers take 30% of a core each
#: from two busy processes (their wall time 1.5x). Between checks it is stopped (SIGSTOP).
IDLE_CORES = 0.9
GATE_SECONDS = 0.1


class IdleBaker:
    """Bakes entries this process writes, in one helper process at the lowest priority
    (``SCHED_IDLE``), which runs only while a core is idle: a thread of this process stops
    and continues it (SIGSTOP, SIGCONT) by the idle CPU time the system reports. Never waited
    for: :meth:`close` kills it, and what it has not baked stays ``kcache`` for a later
    bake; it dies with this process. Started on the first key. Thread-safe."""

    def __init__(self, store: Store) -> None:
        self._where = [str(store.base), str(int(store.rank_local)), "" if store.rank is None else str(store.rank)]
        self._lock = threading.Lock()
        self._proc: Any = None
        self._closed = False
        self.sent = 0
        self.stops = 0  # times the gate stopped the helper (a core was not idle)

    def add(self, key: str) -> None:
        """Queue ``key`` (a ``kcache`` entry just written) for baking. Cheap: one pipe write."""
        import subprocess

        with self._lock:
            if self._closed:
                return
            try:
                if self._proc is None:
                    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCCLCACHE_")}
                    self._proc = subprocess.Popen(
                        [sys.executable, "-c", _IDLE_BOOT, *self._where], stdin=subprocess.PIPE,
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                        start_new_session=True,  # its own group: stopped and killed whole (its linker too)
                    )
                    # Stopped from the start: even its start-up (Python, pyopencl, pocl) waits for
                    # an idle core.
                    with contextlib.suppress(OSError):
                        os.killpg(self._proc.pid, signal.SIGSTOP)
                    threading.Thread(target=self._gate, args=(self._proc,), name="asyncclcache-bake-gate",
                                     daemon=True).start()
                self._proc.stdin.write(key.encode() + b"\n")
                self._proc.stdin.flush()
                self.sent += 1
            except (OSError, ValueError) as e:
                logger.info("asyncclcache: idle baking stopped: %s", e)
                self._closed = True

    def _gate(self, proc: Any) -> None:
        """Runs the helper only while the system has a core idle (its own use counted idle)."""
        ncpu = os.cpu_count() or 1
        before = _cpu_sample(proc.pid)
        running = False
        while not self._closed and proc.poll() is None and before is not None:
            time.sleep(GATE_SECONDS)
            now = _cpu_sample(proc.pid)
            if now is None:
                return
            elapsed = (now[0] - before[0]) / ncpu  # ticks of one core
            idle = (now[1] - before[1]) + (now[2] - before[2])
            before = now
            want = elapsed > 0 and idle / elapsed >= IDLE_CORES
            if want != running:
                with self._lock:
                    if self._closed:
                        return
                    with contextlib.suppress(OSError):
                        os.killpg(proc.pid, signal.SIGCONT if want else signal.SIGSTOP)
                running = want
                self.stops += not want

    def close(self) -> None:
        """Kill the helper and its children, whatever they are doing (its publishes are
        atomic). Idempotent."""
        with self._lock:
            self._closed = True
            proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)  # stopped or not
            # Reaped if it is gone at once; the teardown of a compiler's memory is not
            # waited for at exit (init reaps it after this process).
            with contextlib.suppress(Exception):
                proc.wait(0.02)


def _cpu_sample(pid: int) -> tuple[int, int, int] | None:
    """``(all CPU ticks, idle ticks, ticks of pid and its children)`` now (``/proc``)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
        own = _ticks(pid)
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{pid}/children") as f:
            own += sum(_ticks(int(c)) for c in f.read().split())
    except (OSError, ValueError, IndexError):
        return None
    return sum(fields), fields[3] + fields[4], own


def _ticks(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return sum(int(x) for x in rest[11:15])  # utime, stime, cutime, cstime


def _idle_main() -> int:
    """The idle baker's loop: one key a line on stdin, until EOF or the parent goes."""
    parent = os.getppid()
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: never outlive the job
    if os.getppid() != parent:
        return 0
    base, rank_local, rank = sys.argv[1:4]
    _init_worker("idle")
    store = Store(base, rank_local=rank_local == "1", rank=int(rank) if rank else None, create=False)
    for line in _lines(sys.stdin.buffer, parent):
        key = line.decode(errors="replace").strip()
        if len(key) == 64 and store.writable and _worker is not None:
            try:
                status, why = _worker.bake(store, key)
            except Exception as e:  # noqa: BLE001 - the next key
                status, why = "failed", str(e)
            logger.debug("asyncclcache idle bake %s: %s %s", key[:12], status, why)
    return 0


def _lines(stream: Any, parent: int) -> Iterator[bytes]:
    while os.getppid() == parent:
        line = stream.readline()
        if not line:
            return
        yield line


# }}}
