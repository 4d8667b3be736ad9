"""What the drivers that snapshot a driver's own disk cache share (:mod:`.kcache` for
pocl's, :mod:`.filecache` for NVIDIA's and Mesa's): one background thread of their own,
fed under a condition variable with the fetches that wait for their time, a warning of
each kind once per process, and a close that drops what still waits. Thread-safe.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import warnings
from abc import abstractmethod

from ..errors import BinaryRejectedWarning
from .base import Done, Driver, Dropped, Job, Purpose

__all__ = ["BackgroundDriver", "Waiting"]

logger = logging.getLogger(__name__)


class Waiting:
    """A fetch that waits on the driver's thread until ``due`` (``time.time()``)."""

    __slots__ = ("done", "due", "job")

    def __init__(self, job: Job, done: Done, due: float) -> None:
        self.job = job
        self.done = done
        self.due = due


class BackgroundDriver(Driver):
    """A driver whose work runs on one thread of its own (started on first need, a daemon).
    Subclasses write :meth:`_run` and keep their state under ``self._cond``."""

    #: Seconds after a build that a first snapshot waits for what the driver writes later.
    settle_seconds: float = 0.0
    #: Settled snapshots are due on multiples of this (0: any time): a batch shares one scan.
    batch_seconds: float = 0.0

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting: list[Waiting] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        self._warned: set[str] = set()
        #: ``flush()``/exit asked at this time: jobs built before it are due at once.
        self._hurried_at = float("-inf")

    def fetch(self, job: Job, purpose: Purpose, done: Done) -> None:
        """Queue ``job`` for the thread: a first snapshot ``settle_seconds`` after its build
        (unless ``flush()`` or exit came since), anything else at once."""
        now = time.time()
        with self._cond:
            if self._closed:
                done(None, Dropped(f"{self.name} driver closed"))
                return
            settle = purpose is Purpose.SNAPSHOT and job.built_to > self._hurried_at
            due = max(job.built_to, now) + self.settle_seconds if settle else now
            if settle and self.batch_seconds:
                due = math.ceil(due / self.batch_seconds) * self.batch_seconds
            self._waiting.append(Waiting(job, done, due))
            self._start()
            self._cond.notify()

    def close(self, timeout: float | None = None) -> None:
        """Stop the thread; fetches still waiting are dropped (their ``done`` says so)."""
        with self._cond:
            self._closed = True
            waiting, self._waiting = self._waiting, []
            self._closing()
            thread = self._thread
            self._cond.notify()
        for w in waiting:
            w.done(None, Dropped("dropped at close"))
        if thread is not None:
            thread.join(timeout if timeout is not None else 5.0)

    def _closing(self) -> None:
        """Under ``self._cond``, at close: drop other queued work."""

    def _warn_once(self, what: str, message: str) -> None:
        # One BinaryRejectedWarning per kind and process; the rest to the log.
        with self._cond:
            if what in self._warned:
                logger.info("asyncclcache: %s", message)
                return
            self._warned.add(what)
        warnings.warn(f"asyncclcache: {message}", BinaryRejectedWarning, stacklevel=5)

    def _start(self) -> None:
        # Under self._cond.
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"asyncclcache-{self.name}", daemon=True)
            self._thread.start()

    @abstractmethod
    def _run(self) -> None:
        """The thread's loop; returns once ``self._closed`` is set."""
