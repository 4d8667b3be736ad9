"""Strategy ``kcache``: store pocl's own kernel-cache folder of a program, not a binary.

pocl keeps each program it builds at ``<POCL_CACHE_DIR>/<XX>/<hash>/``: ``program.bc``,
``last_accessed`` and ``<kernel>/<variant>/<kernel>.so`` for every variant launched.
Every build of the program touches ``last_accessed`` (docs/design.md F15). That folder,
put into an empty kernel cache on a new node, is used as it is: the build skips the
front end and the first launch compiles nothing (F16). So nothing is compiled for
the cache at all: no binary query, no generic variant, no helper.

* **Identify** (background thread, right after the build): the folders whose
  ``last_accessed`` moved inside the build's time window. Other builds (threads, ranks
  sharing pocl's cache) move theirs too. At the snapshot the kernel folders that the
  launches made, and how close each touch was to the end of our build, narrow the set
  (:func:`choose`); a few candidates may stay. A folder that is not ours is harmless:
  pocl only uses a folder under the name it computes, and the hit checks which it used.
* **Snapshot**: the folder's files, once every kernel has a variant compiled since the
  build (the first launches), else after :data:`SETTLE_SECONDS`, at a step's end or at
  ``flush()``.
* **Hit**: write the missing files into pocl's cache (temp file + link, never over
  an existing file, never through a link), do the plain source build, and check
  that pocl touched the folder. If it did not, the caller rejects the entry.
* **Refresh**: compare file names; rewrite only when a folder gained a file.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..entry import KCACHE_TMP_PREFIX as TMP_PREFIX
from ..entry import valid_kcache_file as valid_file
from ..fileio import CLOEXEC, NOFOLLOW
from .base import Done, Driver, Dropped, Hit, Job, Lost, Purpose, Snapshot, SourceBuild

if TYPE_CHECKING:

    from ..entry import Entry

__all__ = [
    "KcacheDriver",
    "candidates",
    "choose",
    "find_folders",
    "folder_files",
    "kernel_cache_dir",
    "restore",
    "touched",
    "valid_file",
]

logger = logging.getLogger(__name__)

LAST_ACCESSED = "last_accessed"
#: File timestamps come from a coarse clock that lags ``time.time()`` by up to a tick.
SLACK = 0.05
#: More candidate folders than this for one build: give up on it (counted).
MAX_CANDIDATES = 4
#: Touches this much further from the end of our build than the closest one are others'.
CLOSE = 0.05
#: Outside a step, snapshot at the latest this long after the build.
SETTLE_SECONDS = 3.0
POLL_SECONDS = 0.2
#: At most one walk of every folder of pocl's cache this often (a large cache: many stats).
FULL_SCAN_SECONDS = 1.0

_O_DIR = os.O_RDONLY | os.O_DIRECTORY | NOFOLLOW | CLOEXEC


def kernel_cache_dir() -> Path | None:
    """pocl's kernel cache directory, as pocl finds it (``POCL_CACHE_DIR``, else the
    XDG cache home's ``pocl/kcache``); ``None`` when pocl's cache is off.

    Parsed as pocl parses it: ``POCL_KERNEL_CACHE`` unset means on, and only ``1``,
    ``yes``, ``true`` or ``on`` mean on when set. When in doubt, off (strategy
    ``process`` then, which does not depend on pocl's cache)."""
    flag = os.environ.get("POCL_KERNEL_CACHE")
    if flag is not None and flag.strip().lower() not in ("1", "yes", "true", "on"):
        return None
    if "POCL_CACHE_DIR" in os.environ:
        given = os.environ["POCL_CACHE_DIR"]
        return Path(given) if given.strip() else None
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "pocl" / "kcache"


def _program_folders(root: Path, new_since: float | None = None) -> Iterator[tuple[str, float]]:
    """``(XX/hash, mtime of last_accessed)`` of every program folder: one walk of two levels.

    With ``new_since``, only folders created or changed since then, found without a stat
    per folder: a new folder changes its ``XX`` directory's mtime, a touch does not.
    """
    try:
        tops = list(os.scandir(root))
    except OSError:
        return
    for top in tops:
        try:
            if not (len(top.name) == 2 and top.is_dir(follow_symlinks=False)):
                continue
            if new_since is not None and top.stat(follow_symlinks=False).st_mtime < new_since:
                continue
            programs = list(os.scandir(top.path))
        except OSError:
            continue
        for p in programs:
            try:
                if new_since is not None and p.stat(follow_symlinks=False).st_mtime < new_since:
                    continue
                st = os.stat(os.path.join(p.path, LAST_ACCESSED), follow_symlinks=False)
            except OSError:
                continue
            yield f"{top.name}/{p.name}", st.st_mtime


def _kernel_dirs(root: Path, folder: str) -> set[str] | None:
    try:
        return {e.name for e in os.scandir(root / folder) if e.is_dir(follow_symlinks=False)}
    except OSError:
        return None


def candidates(
    root: Path, windows: Sequence[tuple[float, float]], *, new_only: bool = False
) -> list[tuple[tuple[str, float], ...]]:
    """For each build window ``(t0, t1)``, the folders touched in it, with the touch time
    (one scan for all). Touched later only (the same program built again since): those.

    ``new_only``: look at folders created or changed since the oldest window only (cheap
    on a large kernel cache); a build that pocl served from an older folder needs the
    full scan.
    """
    if not windows:
        return []
    oldest = min(w[0] for w in windows) - SLACK
    folders = _program_folders(root, oldest if new_only else None)
    seen = [(rel, m) for rel, m in folders if m >= oldest]
    out = []
    for t0, t1 in windows:
        inside = [(rel, m) for rel, m in seen if t0 - SLACK <= m <= t1 + SLACK]
        out.append(tuple(inside or [(rel, m) for rel, m in seen if m >= t0 - SLACK]))
    return out


def choose(
    root: Path,
    found: Sequence[tuple[str, float]],
    built_to: float,
    kernels: Sequence[str],
    built_from: float | None = None,
) -> tuple[str, ...]:
    """Narrow a build's candidate folders to the few that can be its own; ``()`` if none or
    too many are left (then nothing is stored).

    * A launch makes ``<kernel>/`` folders: a folder with kernels the program lacks is
      another program's. Where some folders gained a variant since ``built_from`` (our
      launches did that), the others are not ours. (Same names: timing decides.)
    * pocl touches ``last_accessed`` as the build returns: touches much earlier than the
      end of our build belong to builds that ran meanwhile.
    """
    names = set(kernels)
    pool = []
    launched = []
    for f, m in found:
        dirs = _kernel_dirs(root, f)
        if dirs is not None and dirs <= names:
            pool.append((f, m))
            if built_from is not None and any(_new_variant(root / f / k, k, built_from) for k in dirs):
                launched.append((f, m))
    pool = launched or pool
    if not pool:
        return ()
    if all(m <= built_to + SLACK for _, m in pool):
        best = min(built_to - m for _, m in pool)
        pool = [(f, m) for f, m in pool if built_to - m <= best + CLOSE]
    return tuple(sorted(f for f, _ in pool)) if len(pool) <= MAX_CANDIDATES else ()


def find_folders(root: Path, jobs: Sequence[Job]) -> None:
    """Set ``job.folders`` for the jobs that lack one, now, in this thread: new folders
    first, a walk of every folder only if some job found none; then :func:`choose`.
    ``()``: not found. (The kcache driver does the same in its thread, batched and with the
    full walks throttled; the helper driver needs it before the helper touches a folder.)"""
    todo = [j for j in jobs if j.folders is None and j.built_to]
    if not todo:
        return
    windows = [(j.built_from, j.built_to) for j in todo]
    found = candidates(root, windows, new_only=True)
    if not all(found):
        found = candidates(root, windows)
    for job, cands in zip(todo, found, strict=True):
        job.folders = choose(root, cands, job.built_to, job.kernels, job.built_from)


def _walk(root: Path, folder: str) -> Iterator[tuple[str, str]]:
    """``(relative path, absolute path)`` of the folder's regular files, no links followed."""
    stack = [folder]
    while stack:
        rel_dir = stack.pop()
        with os.scandir(root / rel_dir) as it:
            for e in it:
                rel = f"{rel_dir}/{e.name}"
                if e.is_dir(follow_symlinks=False):
                    stack.append(rel)
                elif e.is_file(follow_symlinks=False) and e.name != LAST_ACCESSED and valid_file(rel):
                    yield rel, e.path


def listing(root: Path, folders: Sequence[str]) -> frozenset[str]:
    """The files of ``folders`` now (for a refresh: did a folder gain one?)."""
    out: set[str] = set()
    for folder in folders:
        with contextlib.suppress(OSError):
            out.update(rel for rel, _ in _walk(root, folder))
    return frozenset(out)


def ready(root: Path, folders: Sequence[str], kernels: Sequence[str], since: float) -> bool:
    """Every kernel of the program has a variant compiled at or after ``since`` in one of
    ``folders`` (the first launches are done; older variants were there before)."""
    if not kernels:
        return False
    for folder in folders:
        have = _kernel_dirs(root, folder) or set()
        if all(k in have and _new_variant(root / folder / k, k, since) for k in kernels):
            return True
    return False


def _new_variant(kdir: Path, kernel: str, since: float) -> bool:
    try:
        for v in os.scandir(kdir):
            with contextlib.suppress(OSError):
                if os.stat(os.path.join(v.path, f"{kernel}.so")).st_mtime >= since - SLACK:
                    return True
    except OSError:
        pass
    return False


def folder_files(root: Path, folders: Sequence[str]) -> Snapshot:
    """Read every file of ``folders`` (pocl renames its files into place: never partial).

    A folder removed under us is left out; :class:`Lost` if none is left.
    """
    files: list[str] = []
    blobs: list[bytes] = []
    kept: list[str] = []
    for folder in folders:
        try:
            data = []
            for rel, path in list(_walk(root, folder)):
                fd = os.open(path, os.O_RDONLY | NOFOLLOW | CLOEXEC)
                with os.fdopen(fd, "rb") as f:
                    data.append((rel, f.read()))
        except OSError:
            continue  # removed or replaced meanwhile
        if not any(rel.endswith("/program.bc") for rel, _ in data):
            continue
        kept.append(folder)
        for rel, blob in data:
            files.append(rel)
            blobs.append(blob)
    if not kept:
        raise Lost(f"pocl's kernel-cache folder {', '.join(folders)} is gone")
    return Snapshot(blobs, files, kept)


def _open_dir(parent: int, name: str) -> int:
    try:
        return os.open(name, _O_DIR, dir_fd=parent)
    except FileNotFoundError:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=parent)
        return os.open(name, _O_DIR, dir_fd=parent)


def restore(root: Path, files: Sequence[str], blobs: Sequence[bytes]) -> int:
    """Write the ``files`` missing under ``root``; returns how many were written.

    Each file is a temp file hard-linked into place, so pocl never reads half a file
    and an existing file (pocl's own, or a racing writer's) is never replaced. No link
    below ``root`` is followed. Raises ``OSError`` (the caller builds from source).
    """
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    rootfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | CLOEXEC)
    dirs: dict[str, int] = {"": rootfd}
    written = 0
    try:
        for rel, blob in zip(files, blobs, strict=True):
            if not valid_file(rel):
                raise OSError(errno.EINVAL, f"unsafe path in entry: {rel!r}")
            *parents, name = rel.split("/")
            path = ""
            for part in parents:
                child = f"{path}/{part}" if path else part
                if child not in dirs:
                    dirs[child] = _open_dir(dirs[path], part)
                path = child
            dfd = dirs[path]
            try:
                os.stat(name, dir_fd=dfd, follow_symlinks=False)
                continue  # there already: never overwrite what pocl wrote
            except FileNotFoundError:
                pass
            written += _place(dfd, name, blob)
    finally:
        for fd in dirs.values():
            os.close(fd)
    return written


def _place(dfd: int, name: str, blob: bytes) -> int:
    tmp = TMP_PREFIX + secrets.token_hex(8)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC
    fd = os.open(tmp, flags, 0o600, dir_fd=dfd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        try:
            os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
        except FileExistsError:
            return 0  # written meanwhile (pocl or another process): keep theirs
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK):
                raise
            # No hard links here: a rename, after one more look (a tiny race, same content).
            try:
                os.stat(name, dir_fd=dfd, follow_symlinks=False)
                return 0
            except FileNotFoundError:
                os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                return 1
        return 1
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dfd)


def touched(root: Path, folders: Sequence[str], since: float) -> tuple[str, ...]:
    """The ``folders`` whose ``last_accessed`` pocl touched at or after ``since``."""
    out = []
    for folder in folders:
        try:
            m = os.stat(root / folder / LAST_ACCESSED, follow_symlinks=False).st_mtime
        except OSError:
            continue
        if m >= since - SLACK:
            out.append(folder)
    return tuple(out)


def entry_folders(files: Sequence[str]) -> list[str]:
    """The program folders (``XX/hash``) that ``files`` belong to, in order."""
    return list(dict.fromkeys("/".join(f.split("/")[:2]) for f in files))


class KcacheDriver(Driver):
    """Snapshots pocl's kernel-cache folders on one background thread. Thread-safe."""

    name = "kcache"
    kind = "kcache"
    needs_program = False
    refreshable = True
    watches_hits = True

    def __init__(self, root: Path) -> None:
        self.root = root
        self._cond = threading.Condition()
        self._identify: list[Job] = []
        # snapshots waiting for the program's first launches
        self._waiting: list[_Wait] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        self._need_full: dict[int, Job] = {}  # jobs whose folder is not a new one
        self._last_full = -FULL_SCAN_SECONDS
        self.scans = 0  # cheap walks of pocl's cache (new folders)
        self.full_scans = 0  # walks of every folder

    # {{{ caller's threads

    def built(self, job: Job) -> None:
        with self._cond:
            if self._closed:
                return
            self._identify.append(job)
            self._start()
            self._cond.notify()

    def fetch(self, job: Job, purpose: Purpose, done: Done) -> None:
        now = time.time()
        due = max(job.built_to, now) + SETTLE_SECONDS if purpose is Purpose.SNAPSHOT else now
        with self._cond:
            if self._closed:
                done(None, Dropped("kcache driver closed"))
                return
            self._waiting.append(_Wait(job, done, due))
            self._start()
            self._cond.notify()

    def hurry(self) -> None:
        now = time.time()
        with self._cond:
            self._last_full = -FULL_SCAN_SECONDS
            for w in self._waiting:
                w.due = min(w.due, now)
            self._cond.notify()

    def stale(self, jobs: Sequence[Job]) -> list[Job]:
        # A refresh is a comparison of file names: rewrite only what gained a file.
        return [
            j
            for j in jobs
            if j.folders and not listing(self.root, j.folders) <= j.written_files
        ]

    def build_from_entry(self, entry: Entry, source: SourceBuild) -> Hit:
        files = list(entry.meta.files or [])
        folders = entry_folders(files)
        since = time.time()
        try:
            restore(self.root, files, entry.binaries)
        except (OSError, ValueError) as e:
            # Our I/O failed, not the entry: build from source without restoring.
            logger.warning("asyncclcache: could not restore pocl's kernel cache: %s", e)
            return Hit(source.build(), False, f"restore failed: {e}", (), blame_entry=False)
        program = source.build()
        # Devices of one kind share a folder, so one touched folder may serve them all.
        used = touched(self.root, folders, since)
        if not used:
            return Hit(program, False, "pocl computed another kernel-cache folder", ())
        return Hit(program, True, "", used)

    def close(self, timeout: float | None = None) -> None:
        with self._cond:
            self._closed = True
            waiting, self._waiting = self._waiting, []
            self._identify = []
            thread = self._thread
            self._cond.notify()
        for w in waiting:
            w.done(None, Dropped("dropped at close"))
        if thread is not None:
            thread.join(timeout if timeout is not None else 5.0)

    # }}}

    # {{{ background thread

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="asyncclcache-kcache", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not (self._closed or self._identify or self._due()):
                    # Waiting snapshots: poll for the launches' variants.
                    self._cond.wait(POLL_SECONDS if self._waiting else None)
                if self._closed:
                    return
                todo, self._identify = self._identify, []
                todo += [w.job for w in self._waiting]
            t0 = time.thread_time()
            self._scan(todo)
            ready = self._take_ready()
            snaps: list[tuple[Done, Snapshot | None, BaseException | None]] = []
            for job, done in ready:
                try:
                    if job.candidates is not None:
                        # Again at every snapshot: launches since narrow the choice.
                        job.folders = choose(
                            self.root, job.candidates, job.built_to, job.kernels, job.built_from
                        )
                        if not job.folders and not job.scanned_all:
                            # Only others' new folders: ours is an older one. Look at all.
                            job.candidates = None
                            self._need_full[id(job)] = job
                            with self._cond:
                                self._waiting.append(_Wait(job, done, time.time()))
                            continue
                    if not job.folders:
                        raise Lost("pocl's kernel-cache folder of this build could not be identified")
                    snap = folder_files(self.root, job.folders)
                except BaseException as e:  # noqa: BLE001 - reported through done
                    snaps.append((done, None, e))
                    continue
                job.queried_at = time.time()
                snaps.append((done, snap, None))
            if self.on_cpu is not None:
                self.on_cpu(time.thread_time() - t0)
            for report, result, error in snaps:
                report(result, error)

    def _due(self) -> bool:
        now = time.time()
        return any(w.due <= now for w in self._waiting)

    def _scan(self, jobs: list[Job]) -> None:
        # New folders first: cheap however large pocl's cache is. A build that pocl served
        # from an older folder (the same program built before on this node) needs a walk
        # of every folder; those are batched, at most one per FULL_SCAN_SECONDS.
        todo = list({id(j): j for j in jobs if j.candidates is None and j.folders is None}.values())
        fresh = [j for j in todo if id(j) not in self._need_full]
        if fresh:
            self.scans += 1
            found = candidates(self.root, [(j.built_from, j.built_to) for j in fresh], new_only=True)
            for job, cands in zip(fresh, found, strict=True):
                if cands:
                    job.candidates = cands
                else:
                    self._need_full[id(job)] = job
        now = time.monotonic()
        if self._need_full and now - self._last_full >= FULL_SCAN_SECONDS:
            full = list(self._need_full.values())
            self._need_full.clear()
            self._last_full = now
            self.full_scans += 1
            found = candidates(self.root, [(j.built_from, j.built_to) for j in full])
            for job, cands in zip(full, found, strict=True):
                job.candidates = cands
                job.scanned_all = True

    def _take_ready(self) -> list[tuple[Job, Done]]:
        # Disk checks outside the lock: fetch() on a caller's thread must never wait on them.
        now = time.time()
        with self._cond:
            waiting = list(self._waiting)
        take = [w for w in waiting if self._ready(w, now)]
        with self._cond:
            current = {id(w) for w in self._waiting}  # close() may have dropped some meanwhile
            take = [w for w in take if id(w) in current]
            taken = {id(w) for w in take}
            self._waiting = [w for w in self._waiting if id(w) not in taken]
        return [(w.job, w.done) for w in take]

    def _ready(self, w: _Wait, now: float) -> bool:
        job = w.job
        if job.candidates is None and job.folders is None:
            return False  # not scanned yet
        if w.due <= now:
            return True
        folders = [f for f, _ in job.candidates] if job.candidates is not None else list(job.folders or ())
        return not folders or ready(self.root, folders, job.kernels, job.built_from)

    # }}}



class _Wait:
    __slots__ = ("done", "due", "job")

    def __init__(self, job: Job, done: Done, due: float) -> None:
        self.job = job
        self.done = done
        self.due = due
