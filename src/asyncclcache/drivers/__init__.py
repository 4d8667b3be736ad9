"""What differs per OpenCL implementation, behind one small interface (:class:`Driver`).

* ``kcache`` (:mod:`.kcache`): pocl's own kernel-cache folder of the program is the
  entry; nothing is compiled for the cache. What ``auto`` picks for pocl's CPU
  devices while pocl's kernel cache is on.
* ``process`` (:mod:`.pocl`): a helper process does the warm-up and the snapshot
  (binary query). What ``auto`` picks for pocl's CPU devices with ``POCL_KERNEL_CACHE=0``.
* ``thread`` (:mod:`.inprocess`): a worker thread queries through ctypes. What
  ``auto`` picks for everything else.
* ``sync`` (:mod:`.inprocess`): inline, for comparison.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..keys import POCL_PLATFORM_NAME
from .base import Done, Driver, Dropped, Hit, Job, Lost, Purpose, Snapshot, SourceBuild
from .kcache import kernel_cache_dir

if TYPE_CHECKING:
    import pyopencl as cl

    from ..workers import Workers

__all__ = [
    "Done",
    "Driver",
    "Dropped",
    "Hit",
    "Job",
    "Lost",
    "Purpose",
    "Snapshot",
    "SourceBuild",
    "auto_reason",
    "auto_strategy",
    "is_pocl_cpu",
    "make_driver",
    "resolve_strategy",
]



def is_pocl_cpu(device: cl.Device) -> bool:
    """True for pocl's CPU devices, whose binary query compiles (docs/design.md F1)."""
    import pyopencl as cl

    return device.platform.name == POCL_PLATFORM_NAME and bool(device.type & cl.device_type.CPU)


def auto_strategy(devices: Sequence[cl.Device]) -> str:
    """``kcache`` when every device is a pocl CPU device and pocl's kernel cache is on;
    ``process`` when some device is a pocl CPU device; else ``thread``."""
    if devices and all(is_pocl_cpu(d) for d in devices) and kernel_cache_dir() is not None:
        return "kcache"
    return "process" if any(is_pocl_cpu(d) for d in devices) else "thread"


def resolve_strategy(requested: str, devices: Sequence[cl.Device]) -> str:
    """The strategy to use: ``requested``, except that ``auto`` is resolved and
    ``kcache`` falls back to ``auto``'s pick where it cannot work (not pocl's CPU
    device, or pocl's kernel cache off)."""
    if requested == "auto":
        return auto_strategy(devices)
    if requested == "kcache" and auto_strategy(devices) != "kcache":
        return auto_strategy(devices)
    return requested


def make_driver(name: str, workers: Workers) -> Driver:
    """A new driver for strategy ``name`` (as :func:`resolve_strategy` gives it); in-process
    strategies run on the cache's ``workers``."""
    if name == "kcache":
        from .kcache import KcacheDriver

        root = kernel_cache_dir()
        if root is None:
            raise ValueError("strategy kcache needs pocl's kernel cache, which is off (POCL_KERNEL_CACHE)")
        return KcacheDriver(root)
    if name == "process":
        from .pocl import HelperDriver

        return HelperDriver()
    from .inprocess import SyncDriver, ThreadDriver

    if name == "thread":
        return ThreadDriver(workers)
    if name == "sync":
        return SyncDriver()
    raise ValueError(f"unknown strategy {name!r}")


def auto_reason(devices: Sequence[cl.Device]) -> str:
    """One sentence: why :func:`auto_strategy` picks what it picks for *devices*."""
    strategy = auto_strategy(devices)
    if strategy == "kcache":
        return (
            f"pocl's CPU device keeps each program's compiled variants in its kernel cache "
            f"({kernel_cache_dir()}), and that folder, restored on a new node, compiles nothing "
            "(docs/design.md F15, F16): the entry stores those files, so the cache itself compiles nothing"
        )
    if strategy == "process":
        flag = os.environ.get("POCL_KERNEL_CACHE")
        return (
            f"pocl's kernel cache is off (POCL_KERNEL_CACHE={flag!r}: pocl reads only a value "
            "starting with 1 as on), and pocl's CPU device compiles a "
            "second, generic variant when asked for its binary under a process-wide lock that "
            "stalls every launch (docs/design.md F1, F3), so a lowest-priority helper process does the query"
        )
    names = ", ".join(sorted({d.platform.name for d in devices}))
    return (
        f"{names} is not pocl: its binary query returns what the build made without "
        "compiling again, so a background thread takes it (ctypes, GIL released)"
    )
