"""The time base of a file system, measured, never assumed.

Stamps on files come from the file system's clock, not ``time.time()``: Lustre, ext4 with
128-byte inodes and FAT keep whole seconds (FAT: 2 s), and an NFS server's clock may be
skewed against the client's. :class:`FsClock` measures, on files it creates in a
directory of that file system, the stamp's tick and bounds of the skew, and answers the
two questions the package asks: what stamp can a touch at or after a local time carry at
the least (:meth:`FsClock.since`), and at the most (:meth:`FsClock.until`).

Users: the identification of pocl's folders (``drivers/folders.py``) and the racily
clean rule of the key's header digests (``keys.py``, :func:`clock_for`). Thread-safe.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import threading
import time
from pathlib import Path

from .fileio import CLOEXEC, NOFOLLOW

__all__ = ["CLOCK_PREFIX", "CLOCK_SECONDS", "EPS", "FINE_TICK", "FsClock", "clock_for"]

#: A fine-grained file system's stamps come from the kernel's coarse clock (a jiffy).
FINE_TICK = 0.05
#: Margin on every bound: the clock may drift between two measurements.
EPS = 0.02
#: Measured again this often (NFS servers drift).
CLOCK_SECONDS = 60.0
#: The probe files' names (the same prefix as every temp file of ours in pocl's cache).
CLOCK_PREFIX = ".acc-tmp-clock-"

_O_DIR = os.O_RDONLY | os.O_DIRECTORY | NOFOLLOW | CLOEXEC


class FsClock:
    """The time base of the file system under ``root`` against ``time.time()``.

    Measured on a file we create there (as pocl creates and truncates
    ``last_accessed``): the stamp's tick (whole seconds on Lustre, ext4 with 128-byte
    inodes, FAT; a jiffy elsewhere) and bounds of the skew (an NFS server's clock).
    Until measured, and where it cannot be, it assumes the worst (2 s ticks, 2 s skew):
    windows are wider, never wrong. Thread-safe.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tick = 2.0
        self.skew = (-2.0, 2.0)
        self.measured_at: float | None = None  # time.monotonic()
        self._lock = threading.Lock()

    def measure(self, samples: int = 3) -> bool:
        """Measure now (disk I/O: background threads only); False if it could not."""
        got: list[tuple[float, float, int]] = []
        try:
            rootfd = os.open(self.root, _O_DIR)
        except OSError:
            return False
        try:
            for _ in range(samples):
                name = f"{CLOCK_PREFIX}{secrets.token_hex(6)}"
                t0 = time.time()
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC, 0o600,
                             dir_fd=rootfd)
                os.close(fd)
                t1 = time.time()
                try:
                    st = os.stat(name, dir_fd=rootfd, follow_symlinks=False)
                finally:
                    with contextlib.suppress(OSError):
                        os.unlink(name, dir_fd=rootfd)
                got.append((t0, t1, st.st_mtime_ns))
        except OSError:
            return False
        finally:
            os.close(rootfd)
        whole = all(m % 1_000_000_000 == 0 for _, _, m in got)
        tick = (2.0 if all(m % 2_000_000_000 == 0 for _, _, m in got) else 1.0) if whole else FINE_TICK
        # stamp m = T_fs rounded down to a tick, T_fs = T_local + skew, t0 <= T_local <= t1
        lo = max(m / 1e9 - t1 for t0, t1, m in got)
        hi = min(m / 1e9 + tick - t0 for t0, t1, m in got)
        with self._lock:
            self.tick = tick
            self.skew = (min(lo, hi), max(lo, hi))
            self.measured_at = time.monotonic()
        return True

    def due(self) -> bool:
        """Not measured yet, or not for :data:`CLOCK_SECONDS`."""
        return self.measured_at is None or time.monotonic() - self.measured_at > CLOCK_SECONDS

    def since(self, t: float) -> float:
        """The smallest stamp a touch at or after local time ``t`` can have."""
        with self._lock:
            return t + self.skew[0] - self.tick - EPS

    def until(self, t: float) -> float:
        """The largest stamp a touch at or before local time ``t`` can have."""
        with self._lock:
            return t + self.skew[1] + EPS


_by_device: dict[int, FsClock | None] = {}
_by_device_lock = threading.Lock()


def clock_for(path: str, device: int | None = None) -> FsClock | None:
    """The measured clock of the file system that holds ``path`` (a file, or a directory;
    ``device``: its ``st_dev``, if known), one per file system and process; ``None`` where
    no directory on it can be written (then nothing may rest on its stamps). The first
    call per file system measures (three files created and removed: in ``path`` if it is
    a directory, else in the temp, cache or current directory where one is on that file
    system, else in ``path``'s folder); then again every :data:`CLOCK_SECONDS`."""
    if device is None:
        try:
            device = os.stat(path).st_dev
        except OSError:
            return None
    with _by_device_lock:
        known = device in _by_device
        clock = _by_device.get(device)
    if known and (clock is None or not clock.due()):
        return clock
    if clock is None:
        for d in _places(path):
            try:
                st = os.stat(d)
            except OSError:
                continue
            if st.st_dev == device and stat.S_ISDIR(st.st_mode) and os.access(d, os.W_OK):
                clock = FsClock(Path(d))
                break
    if clock is not None and not clock.measure():
        clock = None
    with _by_device_lock:
        _by_device[device] = clock
    return clock


def _places(path: str) -> list[str]:
    import tempfile  # only here: a key's first header on a device

    out = [tempfile.gettempdir(), os.path.expanduser("~/.cache")]
    with contextlib.suppress(OSError):
        out.append(os.getcwd())
    if os.path.isdir(path):
        return [path, *out]  # pocl's cache directory, say: the place of the stamps read
    return [*out, os.path.dirname(os.path.abspath(path))]
