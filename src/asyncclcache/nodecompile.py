"""Each program compiled once a node: its build, and each kernel's first launch (issue 41).

pocl does a program's work in two places: the build (its front end, ``program.bc``) and
the first launch of each kernel (the code generation of a variant, in pocl's worker
thread; docs/design.md F31). A cold job's ranks all do both, for every program, however
many ranks a node has. Here the ranks of a node hand it to each other through the folders
pocl keeps per program (its kernel cache, per rank or shared): a folder's path below the
cache's root is pocl's hash of the program and the device, so a folder of one rank's
cache, put at the same path in another's, is the same program for that rank's pocl, and
is used by nothing else (the design's rule of folders, docs/design.md).

* **Build** (a miss, on the caller's thread): the node's lock of the key is held for the
  build alone, so no user code runs under it and a rank that waits never waits on one in
  an MPI collective. The first rank builds and leaves a record (``<key>.compiled``: its
  pocl cache and the program's folder, found as a new folder of its cache that the build
  touched, with the program's kernels; else no record). The next finds the record, lets
  the lock go (the node's ranks copy at once, not one after another), copies the folder's
  missing files into its own cache (:func:`~.drivers.cachefiles.restore`) and builds: pocl
  finds ``program.bc`` and skips its front end. If pocl did not use the copy, the copy is
  taken back (as a hit's restore is).
* **First launch** (pyopencl's ``enqueue_nd_range_kernel``, wrapped while this is on):
  the first launch of each kernel object of a program built here takes the node's lock of
  the program's kernel, copies that kernel's variants compiled by the rank named in its
  record (``<key>-<kernel digest>.compiled``) into its own folder (then lets the lock go),
  or records itself as the one that compiles, launches, and gives the lock to a thread
  that releases it once pocl has compiled the variant (the launch's event is running or
  done: pocl sets it running after the code generation). A rank that
  launches the kernel meanwhile waits for that (or for pocl's files to show the variant
  done, when the holder's thread cannot run), then copies instead of compiling. A
  launch that waits for other commands (its event stays queued) is not waited for: the
  lock is released after :data:`QUEUED_GRACE`, so a rank never waits on another rank's
  user event or MPI exchange for long.

Bounds: a lock held longer than :data:`WAIT` (a stopped rank) is given up and the work is
done alone; a killed holder releases its lock with its death. A lock striped with one
this process holds already is not waited for. Nothing here can change what runs: files
are only ever put at the path pocl computes for them, and never over an existing file.

Layout, in node-local storage (:class:`~.nodecopies.NodePlace`)::

    <node base>/compiles/
        locks/XXX.lock                        one of STRIPES, never removed
        <key[:2]>/<key>.compiled              {"root": a pocl cache, "folders": [...]}
        <key[:2]>/<key>-<kernel>.compiled     {"root": the cache that compiled a variant}

Records are scratch (the sweep removes those older than :data:`.nodecopies.RECORD_FOR`). Thread- and
process-safe: ranks of one job, and jobs of one user on one node, share it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import stat
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .drivers.cachefiles import restore, unrestore
from .drivers.folders import candidates, folder_files, mark, moved, narrow, valid_file
from .fileio import CLOEXEC, NOFOLLOW, NONBLOCK, atomic_write, make_private_dir, read_own
from .fsclock import clock_for
from .locks import LOCK_SUFFIX, wait_flock
from .nodecopies import COMPILES, RECORD_SUFFIX, NodePlace
from .platforms import pocl
from .platforms.pocl import PROGRAM_FILE

__all__ = ["STRIPES", "WAIT", "NodeCompiles"]

logger = logging.getLogger(__name__)

#: Lock files at most (keys and kernels whose digests share three hex digits wait for each
#: other: a wait, never a wrong result).
STRIPES = 4096
#: Seconds a rank waits at most for another rank's build or first launch (a stopped one).
WAIT = 60.0
#: A first launch whose event is still queued (waiting for other commands) this long is
#: not compiling: its lock is released.
QUEUED_GRACE = 0.1
#: Seconds a first launch waits for another rank's compile of its kernel with no sign of it
#: in that rank's pocl cache (a launch that waits for other commands compiles nothing).
SILENT_WAIT = 2.0
#: Seconds a process that never compiled lets a warm one of the node go first (pocl's
#: start-up, about 0.75 s a process on pocl 3.1, is then paid once a node, not once a rank).
COLD_DEFER = 0.05
_POLL = 0.005
_MAX_RECORD = 4096

#: pyopencl's ``command_execution_status`` values (OpenCL's).
_RUNNING, _QUEUED = 1, 3


def _stripe(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:3]


def _kernel_digest(kernel: str) -> str:
    return hashlib.sha256(kernel.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class _Program:
    """A program built here whose kernels' first launches are shared on the node."""

    compiles: NodeCompiles
    key: str
    root: Path  # this process's pocl cache
    folders: tuple[str, ...]  # the program's folders in it


class NodeCompiles:
    """The node's compiles of one process's cache: in ``where`` (``<node base>/compiles``).
    ``count`` is the counters' ``add``. Thread- and process-safe."""

    def __init__(self, where: NodePlace, count: Callable[[str], None] | None = None) -> None:
        self.base = where.base / COMPILES
        self.count = count if count is not None else (lambda name: None)
        self.problem: str | None = None
        self._held: dict[str, int] = {}  # stripes this process holds (-1: being taken) -> their fd
        self._warm_fd = 0  # the warm file, held shared once this process compiled
        self._told = False
        self._lock = threading.Lock()
        _instances.add(self)
        try:
            if where.given:
                where.parent.mkdir(parents=True, exist_ok=True)
            for d in dict.fromkeys((where.top, where.base, self.base, self.base / "locks")):
                make_private_dir(d)
        except OSError as e:
            self.problem = str(e)
            logger.warning("asyncclcache: each rank compiles alone: %s cannot be used: %s", self.base, e)

    @property
    def enabled(self) -> bool:
        return self.problem is None

    # {{{ locks

    def _take(self, stripe: str, done_elsewhere: Callable[[float], bool] | None = None,
              recorded: Callable[[], bool] | None = None) -> int | None:
        """The stripe's lock, waited for up to :data:`WAIT`; ``None``: not held (this
        process holds it already, it cannot be made, the wait was cut, or
        ``done_elsewhere(seconds waited)`` said to go on without it). ``recorded()``: another
        rank compiled it already (this one copies: no warm rank need go first)."""
        with self._lock:
            if stripe in self._held:
                return None
            self._held[stripe] = -1
        fd = None
        try:
            fd = _open_lock(self.base / "locks" / f"{stripe}{LOCK_SUFFIX}")
            if not self._warm_fd and not (recorded is not None and recorded()) and self._warm_elsewhere():
                # A process's first compile pays pocl's start-up (its compiler and kernel
                # library, docs/design.md F33): a rank that paid it goes first; it is on its way if it
                # builds this program too (ranks in step), else this one goes on after it.
                time.sleep(COLD_DEFER)
            got = wait_flock(fd, time.monotonic() + WAIT, done_elsewhere, max_pause=0.02)
            if got:
                with self._lock:
                    self._held[stripe] = fd
                return fd
            if got is None:
                os.close(fd)
                with self._lock:
                    self._held.pop(stripe, None)
                return None
            self.count("node_waits_cut")
            if not self._told:
                self._told = True
                logger.warning("asyncclcache: another rank of this node held a compile for %.0f s "
                               "(stopped?); compiling without it", WAIT)
        except OSError as e:
            logger.debug("asyncclcache: no node compile lock: %s", e)
        if fd is not None:
            os.close(fd)
        with self._lock:
            self._held.pop(stripe, None)
        return None

    def _warm_elsewhere(self) -> bool:
        # Warm processes hold the warm file shared: an exclusive try fails while one lives.
        try:
            fd = _open_lock(self.base / "locks" / f"warm{LOCK_SUFFIX}")
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        finally:
            os.close(fd)
        return False

    def _warmed(self) -> None:
        """This process compiled (pocl's start-up is paid): say so to the node, for its life."""
        if self._warm_fd:
            return
        try:
            fd = _open_lock(self.base / "locks" / f"warm{LOCK_SUFFIX}")
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return
        with self._lock:
            if self._warm_fd:
                os.close(fd)
            else:
                self._warm_fd = fd

    def _release(self, stripe: str, fd: int) -> None:
        with self._lock:
            if self._held.get(stripe) != fd:
                return  # closed in a forked child already (_forked)
            del self._held[stripe]
        os.close(fd)

    def _forked(self) -> None:
        # A forked child shares the parent's locks (one open file each): closed here, so
        # that they go when the parent releases them, not when the child ends.
        for fd in [*(f for f in self._held.values() if f >= 0), self._warm_fd]:
            if fd:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._held = {}
        self._warm_fd = 0
        self._lock = threading.Lock()

    # }}}

    # {{{ records

    def _record_path(self, key: str, kernel: str | None = None) -> Path:
        name = key if kernel is None else f"{key}-{_kernel_digest(kernel)}"
        return self.base / key[:2] / f"{name}{RECORD_SUFFIX}"

    def _read_record(self, key: str, kernel: str | None = None) -> dict[str, Any] | None:
        raw = read_own(self._record_path(key, kernel), limit=_MAX_RECORD)
        try:
            rec = json.loads(raw) if raw is not None else None
        except ValueError:
            return None
        if not (isinstance(rec, dict) and isinstance(rec.get("root"), str) and os.path.isabs(rec["root"])):
            return None
        folders = rec.get("folders", [])
        if not (isinstance(folders, list) and all(isinstance(f, str) and _valid_folder(f) for f in folders)):
            return None
        return rec

    def _write_record(self, key: str, record: dict[str, Any], kernel: str | None = None) -> None:
        path = self._record_path(key, kernel)
        try:
            make_private_dir(path.parent)
            atomic_write(path.parent, path, json.dumps(record).encode(), durable=False)
        except OSError as e:
            logger.debug("asyncclcache: no node compile record for %s: %s", key[:12], e)

    # }}}

    # {{{ build

    def build(self, key: str, root: Path, from_source: Callable[[], Any],
              kernels: Callable[[Any], Sequence[str]]) -> tuple[Any, tuple[str, ...]]:
        """Build (``from_source``) the program of ``key`` (a miss) in pocl's cache ``root``,
        once a node: from another rank's folder where one has built it. Returns the
        program and its folders in ``root`` (``()``: not known). Raises what the build raises."""
        stripe = _stripe(key)
        fd = self._take(stripe, recorded=lambda: self._read_record(key) is not None)
        if fd is None:
            return from_source(), ()
        try:
            rec = self._read_record(key)
            if rec is None:
                t0 = time.time()
                program = from_source()
                t1 = time.time()
                self._warmed()
                folders = self._identify(root, t0, t1, kernels(program))
                if folders:
                    self._write_record(key, {"root": str(root), "folders": list(folders)})
                return program, folders
        finally:
            # Built elsewhere (the record names a finished folder): the lock is not held for
            # this rank's cached build, so the node's ranks take it one after another no longer.
            self._release(stripe, fd)
        if Path(rec["root"]) == root:
            # One pocl cache for the node's ranks: pocl finds the folder itself.
            program = from_source()
            return program, tuple(f for f in rec["folders"] if os.path.isfile(root / f / PROGRAM_FILE))
        program, folders = self._build_from(rec, root, from_source)
        if folders:
            self.count("node_builds")
            return program, folders
        return program, ()  # pocl did not use the copy (another pocl?): no record

    @staticmethod
    def _build_from(rec: dict[str, Any], root: Path,
                    from_source: Callable[[], Any]) -> tuple[Any, tuple[str, ...]]:
        folders = tuple(rec["folders"])
        try:
            snap = folder_files(Path(rec["root"]), folders)
            marks = {f: mark(root, f) for f in folders}
            placed = restore(root, snap.files or [], snap.blobs, valid_file)
        except Exception as e:  # noqa: BLE001 - the other rank's folder is gone or refused
            logger.debug("asyncclcache: another rank's folder not copied: %s", e)
            return from_source(), ()
        try:
            program = from_source()
        except BaseException:
            unrestore(root, placed)
            raise
        used = tuple(f for f in folders if moved(root, f, marks[f]))
        if not used:
            unrestore(root, placed)
        return program, used

    @staticmethod
    def _identify(root: Path, t0: float, t1: float, kernels: Sequence[str]) -> tuple[str, ...]:
        # A cold build makes a new folder: the new ones the build touched, less those with
        # kernels the program lacks; exactly one, or none is named (another thread built too).
        clock = clock_for(str(root))
        if clock is None:
            return ()
        found = candidates(root, [(clock.since(t0), clock.until(t1))], new_only=True)[0]
        pool = narrow(root, found, kernels, clock.until(t1), clock.tick)
        return pool if len(pool) == 1 else ()

    # }}}

    # {{{ first launch

    def first_launch(self, program: _Program, kernel: str, launch: Callable[[], Any]) -> Any:
        """``launch()`` (the first of ``kernel``), once a node: with the variants another
        rank compiled for it copied in first, and other ranks' first launches of it waiting
        until pocl has compiled this one's. Returns what ``launch`` returns."""
        stripe = _stripe(program.key, kernel)
        fd = self._take(stripe, lambda waited: self._done_elsewhere(program, kernel, waited),
                        lambda: self._copyable(program, kernel))
        copied = self._copy_variants(program, kernel)
        if fd is not None and copied:
            # Another rank's variants are here: the node's next rank need not wait for this launch.
            self._release(stripe, fd)
            fd = None
        if fd is None:
            return launch()
        try:
            if not copied:
                # This rank compiles the variant: the next rank copies it from here (the
                # record is written first, so that a rank that cannot wait for the lock
                # still finds where the variant comes, _done_elsewhere).
                self._write_record(program.key, {"root": str(program.root)}, kernel)
            event = launch()
        except BaseException:
            self._release(stripe, fd)
            raise
        now = time.monotonic()
        _Releaser.get().add(_Held(self, stripe, fd, event, program, kernel, copied, now, now))
        return event

    def _copyable(self, program: _Program, kernel: str) -> bool:
        rec = self._read_record(program.key, kernel)
        return rec is not None and Path(rec["root"]) != program.root

    def _done_elsewhere(self, program: _Program, kernel: str, waited: float) -> bool:
        """While waiting for a first launch's lock: whether to go on without it. Its holder's
        thread releases it, and cannot while the holder's main thread holds the GIL (a
        pickle-based mpi4py collective does, for as long as it waits for this rank): pocl's
        own files, written without the GIL, say when the holder's variant is done (go on
        and copy it), and whether it is being compiled at all (nothing after
        :data:`SILENT_WAIT`: go on alone)."""
        rec = self._read_record(program.key, kernel)
        mine = _variants(program.root, program.folders, kernel)
        theirs = mine  # no record, or one pocl cache for the node's ranks
        if rec is not None and Path(rec["root"]) != program.root:
            theirs = _variants(Path(rec["root"]), program.folders, kernel)
            if any(done and not mine.get(v) for v, done in theirs.items()):
                return True  # finished there: copy it
        return waited > SILENT_WAIT and all(theirs.values())

    def _copy_variants(self, program: _Program, kernel: str) -> frozenset[str]:
        rec = self._read_record(program.key, kernel)
        if rec is None or Path(rec["root"]) == program.root:
            return frozenset()
        src = Path(rec["root"])
        kept: list[str] = []
        blobs: list[bytes] = []
        for folder in program.folders:
            if not os.path.isdir(program.root / folder):
                continue
            try:
                snap = folder_files(src, (folder,))
            except Exception as e:  # noqa: BLE001 - gone, or refused
                logger.debug("asyncclcache: another rank's variants of %s not copied: %s", kernel, e)
                continue
            for rel, blob in zip(snap.files or [], snap.blobs, strict=True):
                if rel.startswith(f"{folder}/{kernel}/"):
                    kept.append(rel)
                    blobs.append(blob)
        if not kept:
            return frozenset()
        try:
            placed = restore(program.root, kept, blobs, valid_file)
        except (OSError, ValueError) as e:
            logger.debug("asyncclcache: variants of %s not copied: %s", kernel, e)
            return frozenset()
        if placed.count:
            self.count("node_launches")
        return frozenset(kept)

    # }}}


def _valid_folder(folder: str) -> bool:
    parts = folder.split("/")
    return len(parts) == 2 and all(p and p not in (".", "..") for p in parts) and valid_file(f"{folder}/x.bc")


def _open_lock(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | NOFOLLOW | CLOEXEC | NONBLOCK, 0o600)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{path} is not a regular file")
    return fd


def _variants(root: Path, folders: Sequence[str], kernel: str) -> dict[str, bool]:
    """The variant folders of ``kernel`` in ``folders`` of pocl's cache ``root``: whether
    each holds its compiled file yet (pocl makes the folder during the code generation
    and renames the file in at its end)."""
    out: dict[str, bool] = {}
    for folder in folders:
        with contextlib.suppress(OSError), os.scandir(root / folder / kernel) as it:
            for v in it:
                done = False
                with contextlib.suppress(OSError), os.scandir(v.path) as files:
                    done = any(f.name.startswith(f"{kernel}.") and not f.name.endswith(pocl.LAYOUT.unfinished)
                               for f in files)
                out[v.name] = out.get(v.name, False) or done
    return out


@dataclass
class _Held:
    """A first launch's lock, until pocl has compiled its variant."""

    compiles: NodeCompiles
    stripe: str
    fd: int
    event: Any
    program: _Program
    kernel: str
    copied: frozenset[str]
    since: float
    #: When the event was last seen other than queued.
    moving: float


_instances: weakref.WeakSet[NodeCompiles] = weakref.WeakSet()


def _after_fork() -> None:
    global _hook_lock
    for nc in list(_instances):
        nc._forked()
    _Releaser._instance = None
    _Releaser._make = threading.Lock()  # another thread may have held them at the fork
    _hook_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


class _Releaser:
    """One daemon thread of the process: releases first launches' locks once pocl has
    compiled their variants (or they wait for other commands, or :data:`WAIT` passed)."""

    _instance: _Releaser | None = None
    _make = threading.Lock()

    @classmethod
    def get(cls) -> _Releaser:
        with cls._make:
            if cls._instance is None or not cls._instance._thread.is_alive():
                cls._instance = cls()  # the first, or a forked child's (threads do not fork)
            return cls._instance

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held: list[_Held] = []
        self._thread = threading.Thread(target=self._run, name="asyncclcache-first-launch", daemon=True)
        self._thread.start()

    def add(self, held: _Held) -> None:
        with self._cond:
            self._held.append(held)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._held:
                    self._cond.wait()
                held = list(self._held)
            now = time.monotonic()
            done = [h for h in held if self._settled(h, now)]
            for h in done:
                h.compiles._release(h.stripe, h.fd)
            with self._cond:
                self._held = [h for h in self._held if all(h is not d for d in done)]
            time.sleep(_POLL)

    @staticmethod
    def _settled(h: _Held, now: float) -> bool:
        try:
            status = h.event.command_execution_status
        except Exception:  # noqa: BLE001 - not an event, or released: stop waiting
            status = -1
        if status != _QUEUED:
            h.moving = now
        if status <= _RUNNING:
            if not h.copied:
                h.compiles._warmed()  # it compiled: pocl's start-up is paid here
            return True
        return now - h.since > WAIT or now - h.moving > QUEUED_GRACE


# {{{ the launch hook: pyopencl's enqueue_nd_range_kernel, wrapped while this is on

_TAG = "_asyncclcache_first"
_UNSEEN = object()
_programs: dict[int, _Program] = {}  # cl_program pointer -> its program (a bounded, recent set)
_MAX_PROGRAMS = 1 << 14
_hook_lock = threading.Lock()
_real: Callable[..., Any] | None = None


def register(compiles: NodeCompiles, program: Any, key: str, root: Path, folders: Sequence[str], *,
             launches_add: bool) -> None:
    """``program`` (built here, of ``key``, its folders in pocl's cache ``root``): its
    kernels' first launches are shared on the node from now on (where launches compile)."""
    if not (folders and launches_add and compiles.enabled):
        return
    try:
        ptr = int(program.int_ptr)
    except Exception:  # noqa: BLE001
        return
    with _hook_lock:
        if len(_programs) >= _MAX_PROGRAMS:
            del _programs[next(iter(_programs))]
        # A stale pointer (a freed program's, reused) costs a useless copy, never a wrong
        # kernel: files go only to the folder pocl computes for the program that has them.
        _programs[ptr] = _Program(compiles, key, root, tuple(folders))
        _install()


def _install() -> None:
    global _real
    if _real is not None:
        return
    import pyopencl as cl
    from pyopencl import _cl

    real = _cl.enqueue_nd_range_kernel

    def enqueue_nd_range_kernel(queue: Any, kernel: Any, *args: Any, **kwargs: Any) -> Any:
        share = getattr(kernel, _TAG, _UNSEEN)
        if share is None:
            return real(queue, kernel, *args, **kwargs)
        return _first(real, queue, kernel, args, kwargs)

    enqueue_nd_range_kernel.__doc__ = real.__doc__
    enqueue_nd_range_kernel.__wrapped__ = real  # type: ignore[attr-defined]
    _real = real
    # The invoker pyopencl generates calls _cl's at each launch; user code, pyopencl's.
    _cl.enqueue_nd_range_kernel = enqueue_nd_range_kernel
    cl.enqueue_nd_range_kernel = enqueue_nd_range_kernel


def _first(real: Callable[..., Any], queue: Any, kernel: Any, args: tuple[Any, ...],
           kwargs: dict[str, Any]) -> Any:
    try:
        setattr(kernel, _TAG, None)  # one first launch a kernel object
    except (AttributeError, TypeError):  # a pyopencl whose kernels take no attributes
        uninstall()  # never shared here; no cost a launch
        return real(queue, kernel, *args, **kwargs)
    try:
        program = _programs.get(int(kernel.program.int_ptr))
        name = kernel.function_name if program is not None else ""
    except Exception:  # noqa: BLE001
        program = None
    if program is None:
        return real(queue, kernel, *args, **kwargs)
    return program.compiles.first_launch(program, name, lambda: real(queue, kernel, *args, **kwargs))


def uninstall() -> None:
    """Put pyopencl's own ``enqueue_nd_range_kernel`` back (tests)."""
    global _real
    with _hook_lock:
        if _real is None:
            return
        import pyopencl as cl
        from pyopencl import _cl

        _cl.enqueue_nd_range_kernel = _real
        cl.enqueue_nd_range_kernel = _real
        _real = None
        _programs.clear()

# }}}
