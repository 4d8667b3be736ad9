"""The operating system's facilities that the helper processes need, in one place.

Each sits behind a probe of what is there (never ``sys.platform``) and has a fallback:

- the lowest CPU priority: ``SCHED_IDLE``, else nice 19, else none (:func:`lower_priority`);
- death with the parent: ``prctl(PR_SET_PDEATHSIG)``, else a thread that polls
  ``getppid`` (:func:`die_with_parent`, :func:`death_signal_available`);
- idle-time sampling: ``/proc/stat`` and a process's own ticks, else ``None``
  (:func:`cpu_sample`);
- the shared libraries loaded here: ``/proc/self/maps``, else ``None`` (:func:`loaded_library`,
  :func:`mapped_files`);
- the host CPU's model and features: ``/proc/cpuinfo``, else ``None`` (:func:`cpu_description`);
- the environment the C library's ``getenv`` reads, which ``os.putenv`` and a C ``setenv``
  change and ``os.environ`` does not see: ``environ`` (or macOS's ``_NSGetEnviron``), else
  ``os.environ`` (:func:`process_environ`);
- starting a helper process (:func:`start_helper`), and the private temporary folders
  of helpers, removed by their owner or, once the owner is gone, by the next one
  (:func:`private_folder`).

Linux has them all; macOS has none of ``/proc``, ``SCHED_IDLE`` and ``prctl``. For tests
only: ``ASYNCCLCACHE_TEST_NO_OS_FACILITIES=1`` makes every probe answer "not here" (nice
stays: macOS has it; so do the two reads a key holds), in this process and in every
helper it starts.

Thread-safe; :func:`die_with_parent` is for a helper's own start-up.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

__all__ = [
    "NOT_HERE_ENV",
    "cpu_description",
    "cpu_sample",
    "death_signal_available",
    "die_with_parent",
    "environ_stamp",
    "kill_helper",
    "loaded_library",
    "lower_priority",
    "mapped_files",
    "pid_alive",
    "private_folder",
    "process_environ",
    "start_helper",
]

logger = logging.getLogger(__name__)

#: Test-only switch: "1" makes every probe answer "not here" (what macOS gives).
NOT_HERE_ENV = "ASYNCCLCACHE_TEST_NO_OS_FACILITIES"

PR_SET_PDEATHSIG = 1
PR_GET_PDEATHSIG = 2
#: How often the fallback parent watch looks.
WATCH_SECONDS = 0.5


def _not_here() -> bool:
    return os.environ.get(NOT_HERE_ENV, "") == "1"


# {{{ priority


def lower_priority(level: str = "idle") -> str:
    """Lower this process's CPU priority: ``idle``, the lowest there is (``SCHED_IDLE``,
    else nice 19); ``nice``, nice 10 more; ``normal``, none. Returns what it got:
    ``"SCHED_IDLE"``, ``"nice <n>"`` or ``"normal"``."""
    if level == "idle" and not _not_here() and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # type: ignore[attr-defined]
        except OSError:
            pass
        else:
            return "SCHED_IDLE"
    if level not in ("idle", "nice"):
        return "normal"
    try:
        now = os.nice(19 if level == "idle" else 10)
    except OSError:
        return "normal"
    return f"nice {now}"


# }}}

# {{{ death with the parent


def _prctl() -> Any:
    if _not_here():
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # no such libc function (macOS)
        return None


def death_signal_available() -> bool:
    """Whether a helper started here can be killed by the system when its parent goes
    (``PR_SET_PDEATHSIG``): a stopped helper cannot watch for that itself."""
    import ctypes

    fn = _prctl()
    if fn is None:
        return False
    sig = ctypes.c_int()
    return fn(PR_GET_PDEATHSIG, ctypes.byref(sig), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)) == 0


def die_with_parent(parent: int) -> str:
    """End this process when ``parent`` ends; exit now if it already has. Returns how:
    ``"signal"`` (SIGKILL from the system, even while stopped; with ``prctl`` the parent
    is the *thread* that started this process) or ``"watch"`` (a daemon thread polls
    ``getppid``: it cannot act while this process is stopped)."""
    import ctypes

    how = "watch"
    fn = _prctl()
    if fn is not None:
        zero = ctypes.c_ulong(0)
        if fn(PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL), zero, zero, zero) == 0:
            how = "signal"
    if os.getppid() != parent:  # gone before the signal was set
        os._exit(0)
    if how == "watch":
        threading.Thread(target=_watch, args=(parent,), name="asyncclcache-parent-watch", daemon=True).start()
    return how


def _watch(parent: int) -> None:
    while True:
        time.sleep(WATCH_SECONDS)
        if os.getppid() != parent:
            os._exit(0)


# }}}

# {{{ /proc


def usable_cores() -> int:
    """The CPUs this process may run on (at least 1): its affinity, else every CPU (macOS
    has no affinity)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def idle_cores(before: tuple[int, int, int], now: tuple[int, int, int], *, own_idle: bool) -> float:
    """Cores' worth of idle time between two :func:`cpu_sample` of the same ``pid``, that
    process's CPU counted as idle where ``own_idle`` (``-inf`` where no time passed: not
    known to be idle, whatever the threshold)."""
    elapsed = (now[0] - before[0]) / (os.cpu_count() or 1)  # ticks of one core
    if elapsed <= 0:
        return float("-inf")
    return ((now[1] - before[1]) + (now[2] - before[2] if own_idle else 0)) / elapsed


def cpu_sample(pid: int) -> tuple[int, int, int] | None:
    """``(all CPU ticks, idle ticks, ticks of pid and its children)`` now, or ``None``
    where the system does not say (no ``/proc``)."""
    if _not_here():
        return None
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


def loaded_library(prefix: str) -> str | None:
    """The path of a shared library loaded in this process whose file name starts with
    ``prefix``, or ``None`` (none, or the system does not say: no ``/proc``)."""
    if _not_here():
        return None
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                name = path.rsplit("/", 1)[-1]
                if name.startswith(prefix) and ".so" in name:
                    return path
    except OSError:
        pass
    return None


def mapped_files(maps: str = "/proc/self/maps") -> list[str] | None:
    """The paths of the files mapped into this process (``maps``), or ``None`` where the
    system does not say (no ``/proc``). A key's input (:mod:`.platforms.intel`): the test
    switch leaves it, as :func:`cpu_description`."""
    try:
        with open(maps, encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    return [fields[5] for fields in (line.split(maxsplit=5) for line in lines) if len(fields) == 6]


def cpu_description() -> bytes | None:
    """What the system says of the host CPU (``/proc/cpuinfo``: model, features, per
    core), or ``None`` where it does not say. A key's input: the test switch leaves it
    (a job and a bake of its entries, one run with the switch and one without, must
    compute the same keys); the fallback is tested with the probe replaced."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return f.read()
    except OSError:
        return None


# }}}

# {{{ the environment the driver reads


class _CEnviron:
    """The C library's ``environ`` array, read in place: what a driver's ``getenv`` sees.
    ``os.environ`` is a copy made at start-up that ``os.putenv``, a C library's ``setenv``
    (embedded interpreters, wrapped C codes) and ``unsetenv`` leave as it was."""

    def __init__(self) -> None:
        import ctypes

        self._ctypes = ctypes
        self._lock = threading.Lock()
        self._cell: Any = None  # a ctypes view of the variable ``environ`` (char **)
        self._count = 0  # entries of the array at the last full read
        self._stamp = b""
        self._decoded: dict[str, str] = {}
        try:
            libc = ctypes.CDLL(None)
        except (OSError, TypeError):
            return
        ns = getattr(libc, "_NSGetEnviron", None)  # macOS: a library's way to the variable
        if ns is not None:
            ns.restype = ctypes.POINTER(ctypes.c_void_p)
            with contextlib.suppress(ValueError, OSError):
                self._cell = ns().contents
                return
        with contextlib.suppress(ValueError, OSError):
            self._cell = ctypes.c_void_p.in_dll(libc, "environ")

    @property
    def available(self) -> bool:
        return self._cell is not None

    def stamp(self) -> bytes:
        """The array's address and its pointers, one read (no string decoded): equal
        stamps, the same environment (``setenv`` and ``putenv`` put a new pointer in a
        slot; ``unsetenv`` moves the end). Under the GIL, as Python's own ``putenv``. Not
        seen: a C program that writes into a string it gave ``putenv`` (no call at all)."""
        ctypes = self._ctypes
        base = self._cell.value
        if not base:
            return b"0"
        with self._lock:
            n = self._count
            if n and base == int.from_bytes(self._stamp[:8], sys.byteorder):
                # The array read last time, one slot longer: its end (NULL) is in the stamp.
                size = (n + 1) * ctypes.sizeof(ctypes.c_void_p)
                now = base.to_bytes(8, sys.byteorder) + ctypes.string_at(base, size)
                if now == self._stamp:
                    return now
        return self._read(base)[0]

    def _read(self, base: int) -> tuple[bytes, dict[str, str]]:
        # A full read: every pointer to the NULL, every string decoded as os.environ does.
        ctypes = self._ctypes
        array = ctypes.cast(base, ctypes.POINTER(ctypes.c_char_p))
        items: list[bytes] = []
        while (item := array[len(items)]) is not None:
            items.append(item)
        size = ctypes.sizeof(ctypes.c_void_p)
        stamp = base.to_bytes(8, sys.byteorder) + ctypes.string_at(base, (len(items) + 1) * size)
        decoded: dict[str, str] = {}
        # os.fsdecode's codec, without its per-call overhead (a first build reads them all).
        enc, errors = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()
        for item in items:
            name, eq, value = item.partition(b"=")
            if eq and name:  # getenv: the first
                decoded.setdefault(name.decode(enc, errors), value.decode(enc, errors))
        with self._lock:
            self._count, self._stamp, self._decoded = len(items), stamp, decoded
        return stamp, decoded

    def environ(self) -> dict[str, str]:
        stamp = self.stamp()
        with self._lock:
            if stamp == self._stamp:
                return self._decoded
        base = self._cell.value
        return self._read(base)[1] if base else {}


_c_environ: _CEnviron | None = None


def _environ_lock_in_child() -> None:
    if _c_environ is not None:  # held by another thread at the fork: the child's would never open
        _c_environ._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_environ_lock_in_child)


def _environ_reader() -> _CEnviron | None:
    global _c_environ
    if _c_environ is None:
        reader = _CEnviron()
        _c_environ = reader
        if not reader.available:
            logger.debug("asyncclcache: the C library's environ cannot be read here; os.environ serves")
    return _c_environ if _c_environ.available else None


def environ_stamp() -> object:
    """A value that changes whenever the process's environment changes (one read of the
    C library's array of pointers where it can be read, else a copy of ``os.environ``'s
    items): cheap enough for every build. Thread-safe."""
    reader = _environ_reader()
    if reader is None:
        data = getattr(os.environ, "_data", None)
        return tuple(data.items()) if isinstance(data, dict) else tuple(os.environ.items())
    return reader.stamp()


def process_environ() -> Mapping[str, str]:
    """The process's environment as the C library's ``getenv`` sees it, which is what a
    driver reads: ``os.environ`` plus what ``os.putenv`` and a C ``setenv`` changed since
    start-up. Read again only when :func:`environ_stamp` changed; do not modify it.
    Falls back to ``os.environ`` where the C array cannot be read. Thread-safe."""
    reader = _environ_reader()
    return os.environ if reader is None else reader.environ()


# }}}

# {{{ helper processes


# ``python -c`` puts "" (the working folder, maybe a shared 1777 one) first on sys.path,
# and Python 3.10 has no -P: drop it before importing anything not yet imported (sys is
# built in, os came with site, which ran before "" was added).
_BOOT = """\
import sys
sys.path[:] = [p for p in sys.path if p]
import os
sys.path[:] = [p for p in sys.path if os.path.isabs(p)]
from asyncclcache.system import _boot
sys.exit(_boot())
"""


@dataclass(frozen=True)
class Started:
    """What a helper's start-up got: its priority and how it dies with its parent."""

    priority: str
    parent_death: str


#: In a helper started by :func:`start_helper`: what its start-up got (else ``None``).
started: Started | None = None


def start_helper(
    target: str, args: Sequence[str] = (), *, env: Mapping[str, str] | None = None, priority: str = "idle",
    stopped: bool = False, ready: int | None = None, stdin: Any = subprocess.DEVNULL,
    stdout: Any = None, stderr: Any = None, pass_fds: Sequence[int] = (),
) -> subprocess.Popen[bytes]:
    """Start a helper process running ``target`` (``"module:function"``; its return value
    is the exit status) with ``args`` as its ``sys.argv[1:]``. Thread-safe.

    It never imports from a working folder: its ``sys.path`` holds no relative entry and
    it runs in ``/``. It starts in a session of its own (a terminal's Ctrl-C is not its;
    stop and kill its group), with SIGINT ignored, ``env`` (default: ours) without
    ``ASYNCCLCACHE_*``, and the ``priority`` of :func:`lower_priority`. First of all it
    dies with the thread that calls this (:func:`die_with_parent`); then it writes one
    byte to the pipe ``ready`` (its write end; closed here) and, if ``stopped``, stops
    itself, so that no SIGSTOP can come before its death is set. A ``stopped`` helper
    that can only watch for its parent's death exits instead of stopping.
    """
    base = process_environ() if env is None else env
    child_env = {k: v for k, v in base.items() if not k.startswith("ASYNCCLCACHE_")}
    if _not_here():
        child_env[NOT_HERE_ENV] = "1"
    if child_env.get("PYTHONPATH"):
        # Relative entries named folders from our working folder: keep what they named.
        child_env["PYTHONPATH"] = os.pathsep.join(
            os.path.abspath(p) for p in child_env["PYTHONPATH"].split(os.pathsep) if p
        )
    fds = tuple(pass_fds) + ((ready,) if ready is not None else ())
    argv = [sys.executable, "-c", _BOOT, str(os.getpid()), priority, "1" if stopped else "0",
            "-" if ready is None else str(ready), target, *args]
    try:
        return subprocess.Popen(argv, stdin=stdin, stdout=stdout, stderr=stderr, env=child_env, cwd=os.sep,
                                close_fds=True, pass_fds=fds, start_new_session=True)
    finally:
        if ready is not None:
            os.close(ready)


def _boot() -> int:
    import importlib

    global started
    parent, priority, stopped, ready, target = sys.argv[1:6]
    del sys.argv[1:6]
    got = lower_priority(priority)  # first: the rest of the start-up is CPU work too
    how = die_with_parent(int(parent))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when a helper goes
    started = Started(got, how)
    if ready != "-":
        with contextlib.suppress(OSError):
            os.write(int(ready), b"R")
        os.close(int(ready))
    if stopped == "1":
        if how != "signal":
            return 0  # stopped, it would outlive its parent
        os.kill(os.getpid(), signal.SIGSTOP)
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)()  # type: ignore[no-any-return]


def kill_helper(proc: subprocess.Popen[Any], wait: float = 0.0, streams: Sequence[IO[Any] | None] = ()) -> None:
    """Kill a helper of :func:`start_helper` and its children (its process group), stopped
    or not; close ``streams``; reap it if it is gone within ``wait`` seconds (a killed
    compiler's teardown is not waited for: init reaps it after us). Idempotent."""
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            with contextlib.suppress(OSError):
                proc.kill()
    for s in streams:
        if s is not None:
            with contextlib.suppress(OSError):
                s.close()
    with contextlib.suppress(subprocess.TimeoutExpired, OSError):
        proc.wait(wait)


# }}}

# {{{ private temporary folders


def private_folder(kind: str) -> Path:
    """A new folder ``<kind>-<pid>-<host>-XXXXXXXX`` in the temporary directory, for the
    helpers of this process; the caller removes it. First removes the folders of ``kind``
    that this user's processes on this host left when they were killed (whose pid is gone);
    never another user's. Thread-safe."""
    host = _host()
    sweep(kind, host)
    return Path(tempfile.mkdtemp(prefix=f"{kind}-{os.getpid()}-{host}-"))


def sweep(kind: str, host: str | None = None) -> int:
    """Remove the folders :func:`private_folder` made whose owner is gone; how many."""
    host = host or _host()
    uid = os.getuid() if hasattr(os, "getuid") else None
    removed = 0
    try:
        with os.scandir(tempfile.gettempdir()) as it:
            entries = [e for e in it if e.name.startswith(f"{kind}-")]
    except OSError:
        return 0
    for e in entries:
        pid, _, rest = e.name[len(kind) + 1:].partition("-")
        if not pid.isdigit() or not rest.startswith(f"{host}-") or pid_alive(int(pid)):
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or (uid is not None and st.st_uid != uid):
            continue  # a link, a file, or someone else's
        shutil.rmtree(e.path, ignore_errors=True)
        removed += not os.path.lexists(e.path)
    return removed


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # someone else's
    return True


def _host() -> str:
    import socket

    try:
        name = socket.gethostname()
    except OSError:
        name = ""
    # A shared temporary directory (NFS) holds other hosts' pids too: theirs are left.
    return "".join(c if c.isalnum() or c == "." else "_" for c in name)[:64] or "host"


# }}}
