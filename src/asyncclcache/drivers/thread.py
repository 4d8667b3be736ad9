"""Strategy ``thread``: a writer thread queries the program's binaries in this process.

Right for drivers whose binary query is a copy (NVIDIA: 0.1 ms, docs/design.md F7).
On pocl's CPU devices the query compiles and blocks every launch in the process (F3)
and can abort pocl 3.1 (F13): ``auto`` never picks it there.
"""

from __future__ import annotations

from ..binaries import program_binaries
from ..workers import Workers
from .base import Done, Driver, Job, Purpose, Snapshot

__all__ = ["ThreadDriver"]


class ThreadDriver(Driver):
    """Queries ``clGetProgramInfo`` through ctypes (GIL released) on a worker thread of the
    cache, on the program object the caller built (kept alive until then). Thread-safe."""

    name = "thread"
    needs_program = True

    def __init__(self, workers: Workers) -> None:
        self._workers = workers

    def fetch(self, job: Job, purpose: Purpose, done: Done) -> None:
        self._workers.submit(_query, job, done)


def _query(job: Job, done: Done) -> None:
    try:
        result = program_binaries(job.program, job.devices)
    except Exception as e:  # noqa: BLE001 - reported through done
        done(None, e)
        return
    done(Snapshot(result), None)
