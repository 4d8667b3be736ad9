"""Strategies that query binaries in this process: ``thread`` and ``sync``.

Right for drivers whose binary query is a copy (NVIDIA: 0.1 ms, docs/design.md F7).
On pocl the query compiles and blocks every launch in the process (F3) and can
abort pocl 3.1 (F13): use the helper process there.
"""

from __future__ import annotations

from ..binaries import program_binaries
from ..workers import Workers
from .base import Done, Driver, Job, Purpose, Snapshot

__all__ = ["SyncDriver", "ThreadDriver"]


def _query(job: Job, done: Done) -> None:
    try:
        result = program_binaries(job.program, job.devices)
    except Exception as e:  # noqa: BLE001 - reported through done
        done(None, e)
        return
    done(Snapshot(result), None)


class ThreadDriver(Driver):
    """Queries ``clGetProgramInfo`` through ctypes (GIL released) on a worker thread."""

    name = "thread"
    needs_program = True

    def __init__(self, workers: Workers) -> None:
        self._workers = workers

    def fetch(self, job: Job, purpose: Purpose, done: Done) -> None:
        self._workers.submit(lambda: _query(job, done))


class SyncDriver(Driver):
    """Queries inline, in the caller's thread, as pyopencl's own cache does. For comparison."""

    name = "sync"
    needs_program = True
    inline = True

    def fetch(self, job: Job, purpose: Purpose, done: Done) -> None:
        _query(job, done)
