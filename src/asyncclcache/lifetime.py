"""Counters that last: one small JSON file per cache directory, summed over runs and processes.

Each process adds what it counted since its last save, under a file lock taken with
a short timeout (so a stuck holder costs a skipped save, never a hang), by writing a
temp file and ``os.replace``. Readers take no lock.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

__all__ = ["FIELDS", "add", "read", "reset"]

logger = logging.getLogger(__name__)

STATS_FILE = "stats.json"
STATS_LOCK = "stats.lock"
#: Lifetime counters (the process counters of ``Stats`` that add up, plus a few more).
FIELDS = (
    "runs",
    "hits",
    "misses",
    "writes",
    "write_errors",
    "skipped",
    "bytes_written",
    "warmups",
    "refreshes",
    "rejected",
    "unidentified",
    "uncacheable",
    "errors",
    "evictions",
    "seconds_saved",
)


def read(root: str | os.PathLike[str]) -> dict[str, float]:
    """The lifetime counters of the cache at ``root`` (zeros if none yet)."""
    out: dict[str, float] = dict.fromkeys(FIELDS, 0)
    try:
        with open(Path(root) / STATS_FILE, "rb") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return out
    if isinstance(data, dict):
        for k in FIELDS:
            v = data.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = v
    return out


def add(root: str | os.PathLike[str], deltas: Mapping[str, float], *, timeout: float = 2.0) -> bool:
    """Add ``deltas`` to the counters at ``root``; False if the lock was busy or I/O failed."""
    deltas = {k: v for k, v in deltas.items() if k in FIELDS and v}
    if not deltas:
        return True
    root = Path(root)
    import filelock  # lazily, like store.py: off the import path of a warm start

    lock = filelock.FileLock(str(root / STATS_LOCK), timeout=timeout, mode=0o600)
    try:
        with lock:
            current = read(root)
            for k, v in deltas.items():
                current[k] = current.get(k, 0) + v
            _write(root, current)
    except (filelock.Timeout, OSError) as e:
        logger.info("could not save lifetime stats in %s: %s", root, e)
        return False
    return True


def reset(root: str | os.PathLike[str]) -> None:
    """Zero the counters at ``root``."""
    root = Path(root)
    import filelock

    with filelock.FileLock(str(root / STATS_LOCK), timeout=10, mode=0o600):
        _write(root, dict.fromkeys(FIELDS, 0))


def _write(root: Path, values: Mapping[str, float]) -> None:
    fd, tmp = tempfile.mkstemp(dir=root, prefix=".stats-", suffix=".partial")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({k: values.get(k, 0) for k in FIELDS}, f, sort_keys=True)
        os.replace(tmp, root / STATS_FILE)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
