"""Strategy ``process``: pocl's binary work in a long-lived helper process.

On pocl's CPU devices the binary query compiles a generic variant of every
kernel (docs/design.md F1), under a process-wide lock that every launch needs (F3),
and racing a launch it can abort pocl 3.1 (F13). So the main process never
queries. A helper process, sharing ``POCL_CACHE_DIR`` through the inherited
environment, builds the same source in a fresh program object and queries there
(F4, F14). One client thread per helper feeds it one request at a time.

Its binary is stored under the key the main process computed, so the helper builds
as the caller did: in the caller's working directory at the build (relative ``-I``
folders, quoted includes) and with the ``POCL_*`` settings the key holds. pocl keeps
the first value it reads of a setting, so a helper whose settings differ from a job's
is replaced by a fresh one started with the job's.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import stat
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO

from .. import fsclock, system
from ..errors import HelperError
from ..fileio import CLOEXEC, NONBLOCK
from ..keys import IncludeDep
from ..platforms import pocl as pocl_platform
from . import _wire
from .base import Done, Driver, Dropped, Job, Lost, PerJob, Purpose, Snapshot
from .poclcache import (
    build_candidates,
    find_folders,
    folders_per_build,
    kernel_cache_dir,
    mark,
    moved,
    newest_variant,
    newest_variants,
)

__all__ = ["HelperDriver", "HelperError"]

logger = logging.getLogger(__name__)
#: Restarts after a helper crash before the driver gives up for this process.
MAX_RESTARTS = 3
#: Every wait on the helper is bounded. Start-up: Python and pyopencl at SCHED_IDLE, which
#: on a machine with no idle core can take long. A request: one program's generic compile.
HELLO_TIMEOUT = 300.0
REQUEST_TIMEOUT = 1800.0


#: The helper's entry point (:func:`.system.start_helper` lowers its priority before
#: anything is imported: starting Python and pyopencl is CPU work too).
_HELPER_MAIN = "asyncclcache.drivers.pocl_helper:main"


@dataclass
class _Asked:
    """What the driver learnt about one job: written by the client thread only."""

    #: pocl's folders of the program (``None``: not looked up yet; ``()``: not found).
    folders: tuple[str, ...] | None = None
    #: When the last answer came (variants older than that are in it).
    queried_at: float = 0.0
    #: The first request's time: the helper's generic compile, about one code generation.
    warmup_seconds: float | None = None


def _helper_env(pocl: Mapping[str, str]) -> dict[str, str]:
    """The helper's environment: ours, with the job's pocl settings instead of ours, and
    without ``ASYNCCLCACHE_*`` (else it would install a cache in itself and print a summary)."""
    drop = ("ASYNCCLCACHE_", *pocl_platform.SETTINGS.prefixes)
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(pocl)
    return env


class HelperDriver(Driver):
    """Sends jobs to the helper process. Thread-safe (one client thread talks to the
    helper); one helper per driver, started on first need, replaced when a job's pocl
    settings differ from its own, and gone with this process."""

    name = "process"
    needs_program = False
    warms_up = True
    refreshable = True

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Job, Purpose, Done] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._req: IO[bytes] | None = None  # requests to the helper
        self._ans: IO[bytes] | None = None  # its answers (unbuffered: waits use select)
        self._closed = False
        self.starts = 0  # helpers that said hello
        self.attempts = 0  # spawns tried (bounded by MAX_RESTARTS + 1)
        self.crashes = 0
        self.replaced = 0  # helpers replaced for a job with other pocl settings
        self.requests = 0  # requests the helper answered
        self.helper_pid: int | None = None
        self.priority: str | None = None
        self._code: dict[str, str] | None = None  # the running helper's code settings
        self._of: PerJob[_Asked] = PerJob(_Asked)

    def fetch(self, job: Job, purpose: Purpose, done: Done) -> None:
        with self._lock:
            if self._closed:
                done(None, Dropped("helper driver closed"))
                return
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="asyncclcache-helper-client", daemon=True
                )
                self._thread.start()
        self._queue.put((job, purpose, done))

    # {{{ client thread

    def _spawn(self, pocl: Mapping[str, str]) -> subprocess.Popen[bytes]:
        # Requests and answers travel on pipes of their own, not stdin/stdout: output of
        # anything else in the helper (a sitecustomize that prints) cannot desynchronise it.
        req_r, req_w = os.pipe()
        ans_r, ans_w = os.pipe()
        try:
            # The job's pocl settings: pocl computes the same hash, compiles the same code.
            # A session of its own: a Ctrl-C is for the program only; it still dies with us.
            proc = system.start_helper(_HELPER_MAIN, [str(req_r), str(ans_w)], env=_helper_env(pocl),
                                       pass_fds=(req_r, ans_w))
        finally:
            os.close(req_r)
            os.close(ans_w)
        self._req = os.fdopen(req_w, "wb")
        self._ans = os.fdopen(ans_r, "rb", buffering=0)
        try:
            hello, _ = _wire.recv(self._ans, HELLO_TIMEOUT)
            pid = int(hello["pid"])
        except (_wire.WireError, KeyError, TypeError, ValueError) as e:
            self._kill(proc)
            raise HelperError(f"helper process failed to start ({e}; exit status {proc.returncode})") from None
        self.starts += 1
        self.helper_pid = pid
        self.priority = str(hello.get("priority"))
        logger.debug("helper process %s started (%s)", self.helper_pid, self.priority)
        return proc

    def _kill(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for f in (self._req, self._ans):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()
        self._req = self._ans = None

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:  # stop
                break
            job, purpose, done = item
            try:
                binaries = self._request(job, purpose)
            except BaseException as e:  # noqa: BLE001 - reported through done
                done(None, e)
            else:
                done(Snapshot(binaries, compile_seconds=self._of(job).warmup_seconds or 0.0), None)
        self._stop_proc()

    def _helper_for(self, job: Job) -> subprocess.Popen[bytes]:
        """A running helper with the job's code settings (client thread)."""
        pocl = job.environ if job.environ is not None else Job.caller_environ()
        code = pocl_platform.SETTINGS.select(pocl)
        proc = self._proc
        if proc is not None and proc.poll() is None:
            if code == self._code:
                return proc
            # pocl keeps the first value it reads of a setting: no change of the running
            # helper's environment would reach its compiler. It is idle: kill, start afresh.
            self._kill(proc)
            self._proc = None
            self.replaced += 1
        else:
            if self.attempts > MAX_RESTARTS:
                raise HelperError("helper process keeps failing; giving up for this process")
            self.attempts += 1
        self._code = None
        proc = self._proc = self._spawn(pocl)
        self._code = code
        return proc

    def _request(self, job: Job, purpose: Purpose) -> list[bytes]:
        if job.cwd is None:
            # Relative include folders resolve there: no other folder builds the same code.
            raise HelperError(f"the caller's working directory is unknown (gone?); "
                              f"{job.key[:12]} is not rebuilt elsewhere")
        # The helper compiles the source again, reading the headers as they are then: what it
        # makes is stored under the key only if each header holds the key's content all along
        # (a warm-up stores nothing).
        inputs = None if purpose is Purpose.WARMUP else _inputs_as_keyed(job)
        proc = self._helper_for(job)
        asked = self._of(job)
        root = kernel_cache_dir()
        if root is not None and asked.folders is None:
            # Before the helper builds it too (and touches its folder again): which folder
            # is this program's, so that refreshes look at its variants alone.
            asked.folders = find_folders(root, job)
        # Not told apart (programs built within one tick of each other): the helper's own
        # build of it touches exactly its folder, which a mark shows without a clock.
        marks = ({f: mark(root, f) for f in build_candidates(root, job)}
                 if root is not None and asked.folders == () else {})
        req: IO[bytes] = self._req  # type: ignore[assignment]
        ans: IO[bytes] = self._ans  # type: ignore[assignment]
        try:
            _wire.send(
                req,
                {"op": "binaries", "id": job.key, "devices": list(job.info.devices), "cwd": job.cwd},
                [job.source, job.options],
            )
            header, payloads = _wire.recv(ans, REQUEST_TIMEOUT)
            if not isinstance(header, dict):
                raise _wire.WireError("bad header: not an object")
        except (OSError, _wire.WireError) as e:
            # Dead, silent too long, or talking garbage: a fresh helper for the next job.
            self._kill(proc)
            rc = proc.returncode
            self._proc = None
            if self._closed:
                raise Dropped("helper stopped at close") from None
            self.crashes += 1
            raise HelperError(f"helper process died (exit status {rc}): {e}") from None
        if not header.get("ok"):
            raise HelperError(f"helper could not build {job.key[:12]}: {header.get('error')}")
        self.requests += 1
        if inputs is not None:
            _still_as_keyed(job, inputs)
        if marks and root is not None:
            touched = tuple(f for f, before in marks.items() if moved(root, f, before))
            asked.folders = touched if 0 < len(touched) <= folders_per_build(job) else ()
        # pocl packs the blob at the end of the query: variants on disk before the answer
        # came are in it (a variant finishing in those last microseconds may be missed:
        # it costs the next run one compile, nothing else).
        asked.queried_at = time.time()
        # The first request's time is the warm-up: about one code generation.
        if asked.warmup_seconds is None:
            asked.warmup_seconds = float(header.get("seconds", 0.0))
        return payloads

    def _stop_proc(self, timeout: float = 2.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if self._req is not None:
                self._req.close()  # EOF: the helper exits
            proc.wait(timeout)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        if self._ans is not None:
            with contextlib.suppress(OSError):
                self._ans.close()
        self._req = self._ans = None

    # }}}

    def stale(self, jobs: Sequence[Job]) -> list[Job]:
        root = kernel_cache_dir()
        if root is None:
            # pocl's cache off: the helper's binary holds the generic variant only, and a
            # new query could not add the parent's variants: nothing to refresh, ever.
            return []
        # Each job's folder was looked up before its first request (``_request``); a lookup
        # now would see the helper's own touches, so none is made here.
        newest = None
        out = []
        for job in jobs:
            asked = self._of(job)
            if asked.folders:
                # Per program: only its own folder's variants count.
                latest = newest_variant(root, asked.folders)
            elif job.kernels:
                if newest is None:
                    newest = newest_variants() or {}
                latest = max(newest.get(k, 0.0) for k in job.kernels) if newest else float("inf")
            else:
                latest = float("inf")
            # The driver stamps when its last query answered (pocl packs at the end):
            # variants older than that are in the entry already.
            if latest >= asked.queried_at:
                out.append(job)
        return out

    def close(self, timeout: float | None = None) -> None:
        """Stop the client thread and reap the helper (killed if it is mid-compile)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is None:
            return
        # Drop queued jobs: the cache already decided how long to wait for them.
        dropped = []
        while True:
            try:
                dropped.append(self._queue.get_nowait())
            except queue.Empty:
                break
        for item in dropped:
            if item is not None:
                item[2](None, Dropped("dropped at close"))
        proc = self._proc
        if proc is not None and proc.poll() is None:
            # Mid-compile: the helper holds nothing we need; kill it.
            proc.kill()
        self._queue.put(None)
        thread.join(timeout if timeout is not None else 5.0)
        if proc is not None:
            try:
                proc.wait(1.0)
            except subprocess.TimeoutExpired:
                proc.kill()


# {{{ the key's headers, around a rebuild in the helper

#: A header changed this recently may change again within one tick of its file system's
#: clock, leaving its stamp as it was: a request waits (once) at most this long for its
#: headers' stamps to age past that.
SETTLE_SECONDS = 5.0

#: What tells one state of a file from another: (device, inode, size, mtime, ctime), in ns.
_Stamp = tuple[int, int, int, int, int]


def _read_as_keyed(dep: IncludeDep) -> _Stamp:
    """The stamp of ``dep``'s file, read through (as the compiler opens it) and found to
    hold the content the key names; raises :class:`Lost` if it does not."""
    try:
        # Non-blocking: a FIFO planted there must not hang the client thread.
        fd = os.open(dep.path, os.O_RDONLY | NONBLOCK | CLOEXEC)
    except OSError as e:
        raise Lost(f"{dep.path}, an include of the key, cannot be read ({e.strerror}): not rebuilt") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Lost(f"{dep.path}, an include of the key, is no longer a regular file: not rebuilt")
        h = hashlib.sha256()
        while chunk := os.read(fd, 1 << 20):
            h.update(chunk)
    except OSError as e:
        raise Lost(f"{dep.path}, an include of the key, cannot be read ({e.strerror}): not rebuilt") from None
    finally:
        os.close(fd)
    if h.hexdigest() != dep.sha256:
        raise Lost(f"{dep.path} changed since the build: the helper would compile another program "
                   "than the key names; not stored")
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _inputs_as_keyed(job: Job) -> dict[str, _Stamp]:
    """Before a rebuild: every include of ``job``'s key holds the key's content, with a
    stamp older than any that a change from now on can carry in its file system's own
    time base (:func:`~asyncclcache.fsclock.clock_for`): then an unchanged stamp after the
    rebuild means an unchanged file. Waits (client thread, at most
    :data:`SETTLE_SECONDS`, once) for a header written just now; raises :class:`Lost`
    where a header differs, or may change unseen (its clock cannot be measured)."""
    for attempt in range(2):
        t0 = time.time()
        stamps: dict[str, _Stamp] = {}
        wait = -1.0
        for dep in job.info.deps:
            st = stamps[dep.path] = _read_as_keyed(dep)
            clock = fsclock.clock_for(dep.path, st[0])
            if clock is None:
                raise Lost(f"{dep.path}: its file system's clock cannot be measured, so a change "
                           "during the rebuild could go unseen; not stored")
            # A change at or after t0 has a stamp of at least clock.since(t0).
            wait = max(wait, max(st[3], st[4]) / 1e9 - clock.since(t0))
        if wait < 0:
            _found_as_keyed(job)
            return stamps
        if attempt == 0 and wait <= SETTLE_SECONDS:
            time.sleep(wait + 0.01)
    raise Lost(f"an include of {job.key[:12]} was changed too recently to tell a change during "
               "the rebuild (its stamp is not older than the file system's clock allows); not stored")


def _still_as_keyed(job: Job, before: dict[str, _Stamp]) -> None:
    """After a rebuild: every include of ``job``'s key is the file :func:`_inputs_as_keyed`
    read (same stamp) and holds the key's content; raises :class:`Lost` if not."""
    for dep in job.info.deps:
        if _read_as_keyed(dep) != before.get(dep.path):
            raise Lost(f"{dep.path} changed during the helper's rebuild: not stored")
    _found_as_keyed(job)


def _found_as_keyed(job: Job) -> None:
    """The includes, looked up again, are the key's files: a header that appeared earlier
    on the include path would be what the helper compiles. Raises :class:`Lost` if not."""
    if not job.info.includes_now(job.source):
        raise Lost(f"the includes of {job.key[:12]} are found elsewhere now than at its build; not stored")

# }}}
