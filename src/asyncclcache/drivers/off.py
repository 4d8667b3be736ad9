"""Strategy ``off``: what ``auto`` picks where no way of caching is right for the devices.

pocl's CPU devices with pocl's kernel cache off: their binary query compiles a second,
generic variant under a lock that stalls every launch (docs/design.md F1, F3), and
pocl's own cache, which ``kcache`` stores, is not there. Builds are plain pyopencl
builds, counted ``cache_off``; :attr:`why` (the platform's record,
:mod:`asyncclcache.platforms`) says what to do instead, once per process in the log and
in ``asyncclcache info``.
"""

from __future__ import annotations

from .base import Done, Driver, Dropped, Job, Purpose

__all__ = ["OffDriver"]


class OffDriver(Driver):
    """Caches nothing (:attr:`stores` is ``False``: the cache never makes a job for it).
    Immutable: thread-safe."""

    name = "off"
    stores = False

    def __init__(self, why: str) -> None:
        self.why = why

    def fetch(self, job: Job, purpose: Purpose, done: Done) -> None:
        done(None, Dropped("strategy off stores nothing"))
