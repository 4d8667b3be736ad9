"""The exit summary (``--stats``, ``ASYNCCLCACHE_STATS=1``): one line, as ``ccache -s``.

Each process prints one line to stderr at exit, after its caches are closed (so
``pending`` is what was dropped; Ctrl-C meanwhile prints none, see
:func:`~asyncclcache.cache.exit_interrupted`)::

    asyncclcache: 4 hits, 0 misses, 0 writes (0.0 MB), 1.9 s saved, 0 pending  [/dir]

Under MPI, when the program itself uses mpi4py (``mpi4py.MPI`` imported and
initialized; this module never initializes MPI), rank 0 prints one line for the job
with the counters of every rank summed and, where node-local copies are on, how many
entries each node read from the shared directory. The other ranks send theirs with a
non-blocking send; rank 0 waits at most :data:`GATHER_TIMEOUT` seconds for them and
says how many reported. Nothing here can hang an exit, or fail one.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time

TYPE_CHECKING = False  # registered at start-up: typing is not loaded yet
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, NoReturn

__all__ = ["GATHER_TIMEOUT", "attach", "register", "summary_line"]

#: Seconds rank 0 waits at exit for the other ranks' counters.
GATHER_TIMEOUT = 10.0
_TAG = 23_571  # below 32767, the smallest MPI_TAG_UB the standard allows
_lock = threading.Lock()
_registered = False
#: The cache module's ``close_all`` and ``exit_interrupted``, handed over at its import
#: (:func:`attach`); ``None``: no cache was ever made here, nothing to count.
_hooks: tuple[Callable[[], list[tuple[str, Any]]], Callable[[], NoReturn]] | None = None


def attach(close_all: Callable[[], list[tuple[str, Any]]], interrupted: Callable[[], NoReturn]) -> None:
    """How the summary closes this process's caches and ends on a Ctrl-C at exit: the
    cache module's own hooks, registered by it at import. Thread-safe."""
    global _hooks
    with _lock:
        _hooks = (close_all, interrupted)


def register() -> None:
    """Print the summary at interpreter exit (once per process, however often called).

    Whether it runs before or after the cache module's own exit hook, it closes the
    caches itself first (idempotent, bounded by their exit timeout), then counts.
    """
    global _registered
    with _lock:
        if _registered:
            return
        _registered = True
    atexit.register(_at_exit)


def _local() -> tuple[Any, list[str]]:
    """This process's counters over all its caches, and their directories."""
    if _hooks is None:  # no cache was ever made: nothing to count
        return None, []
    from .stats import Stats

    closed = _hooks[0]()
    total = Stats()
    dirs: list[str] = []
    for directory, stats in closed:
        total = total + stats
        if directory not in dirs:
            dirs.append(directory)
    return (total if closed else None), dirs


def summary_line(stats: Any, dirs: list[str], label: str = "asyncclcache", whose: str = "") -> str:
    """The summary line for ``stats`` (a :class:`~asyncclcache.Stats`) of ``dirs``
    (``whose``, e.g. ``"rank 0: "``, says whose directories they are)."""
    if not dirs:
        return stats.line(label)
    where = dirs[0] if len(dirs) == 1 else f"{len(dirs)} directories"
    return f"{stats.line(label)}  [{whose}{where}]"


def _at_exit() -> None:
    try:
        stats, dirs = _local()
        mpi = _mpi()
        if mpi is not None:
            _job_line(mpi, stats, dirs)
        elif stats is not None:
            _print(summary_line(stats, dirs, _label()))
    except KeyboardInterrupt:
        # Ctrl-C while the caches flushed (or ranks reported): no summary; end as Python
        # ends on Ctrl-C (the caches are closed by now: close_all drops what is pending).
        if _hooks is None:
            raise
        _hooks[1]()
    except Exception as e:  # noqa: BLE001 - never fail interpreter exit
        sys.stderr.write(f"asyncclcache: no exit summary: {type(e).__name__}: {e}\n")


def _label() -> str:
    from .ranks import detect_node, detect_rank

    rank = detect_rank()
    return "asyncclcache" if rank is None else f"asyncclcache [rank {rank} on {detect_node()}]"


#: Bytes of a node's name sent with a rank's counters (longer names are cut).
NODE_NAME_BYTES = 64


def _node_field() -> list[float]:
    from .ranks import detect_node

    name = detect_node().encode("utf-8", "replace")[:NODE_NAME_BYTES]
    return list(name.ljust(NODE_NAME_BYTES, b"\0"))


def per_node(reads: dict[str, int]) -> str:
    """What the job line adds: entries each node read from the shared directory."""
    if not reads:
        return ""
    shown = sorted(reads.items())
    text = ", ".join(f"{node} {n}" for node, n in shown[:8])
    more = f", ... ({len(shown)} nodes)" if len(shown) > 8 else ""
    return f"; read from the shared directory per node: {text}{more}"


def _mpi() -> Any:
    # A job of several ranks whose program uses mpi4py: its ranks can report to rank 0.
    from .ranks import initialized_mpi

    mpi = initialized_mpi()
    try:
        return mpi if mpi is not None and mpi.COMM_WORLD.Get_size() >= 2 else None
    except Exception:  # noqa: BLE001
        return None


def _job_line(mpi: Any, stats: Any, dirs: list[str]) -> None:
    import numpy as np

    from .stats import Stats

    names = list(Stats().as_dict())
    comm = mpi.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    # [had a cache, counters..., node name]: a rank that built nothing still reports, so
    # rank 0 need not wait for it.
    n = len(names)
    mine = np.zeros(n + 1 + NODE_NAME_BYTES, dtype=np.float64)
    mine[n + 1:] = _node_field()
    if stats is not None:
        mine[0] = 1
        mine[1:n + 1] = list(stats.as_dict().values())
    deadline = time.monotonic() + GATHER_TIMEOUT
    if rank != 0:
        req = comm.Isend(mine, dest=0, tag=_TAG)
        while not req.Test() and time.monotonic() < deadline:
            time.sleep(0.001)
        return
    bufs = [np.empty_like(mine) for _ in range(size - 1)]
    reqs = [comm.Irecv(b, source=src, tag=_TAG) for src, b in enumerate(bufs, start=1)]
    arrived = [False] * len(reqs)
    while not all(arrived) and time.monotonic() < deadline:
        for i, r in enumerate(reqs):
            if not arrived[i] and r.Test():
                arrived[i] = True
        if not all(arrived):
            time.sleep(0.001)
    for i, r in enumerate(reqs):
        if not arrived[i]:
            r.Cancel()
            r.Wait()
    total = mine[:n + 1].copy()
    reads: dict[str, int] = {}
    copies = False
    for row in [mine] + [b for i, b in enumerate(bufs) if arrived[i]]:
        if row is not mine:
            total += row[:n + 1]
        one = dict(zip(names, row[1:n + 1].tolist(), strict=True))
        if one["shared_reads"] or one["node_reads"]:
            copies = True
            node = bytes(int(x) for x in row[n + 1:]).rstrip(b"\0").decode("utf-8", "replace")
            reads[node] = reads.get(node, 0) + round(one["shared_reads"])
    if total[0] == 0:
        return  # no rank made a cache
    job = Stats.from_values(dict(zip(names, total[1:].tolist(), strict=True)))
    reported = 1 + sum(arrived)
    label = f"asyncclcache ({size} ranks)" if reported == size else (
        f"asyncclcache ({reported} of {size} ranks reported)"
    )
    _print(summary_line(job, dirs, label, whose="rank 0: ") + (per_node(reads) if copies else ""))


def _print(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
