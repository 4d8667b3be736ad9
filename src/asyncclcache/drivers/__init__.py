"""What differs per OpenCL implementation, behind one small interface (:class:`Driver`).

* ``process`` (:mod:`.pocl`): a helper process does the warm-up and the snapshot.
  What ``auto`` picks for pocl's CPU devices.
* ``thread`` (:mod:`.inprocess`): a worker thread queries through ctypes. What
  ``auto`` picks for everything else.
* ``sync`` (:mod:`.inprocess`): inline, for comparison.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .base import Done, Driver, Dropped, Job

if TYPE_CHECKING:
    import pyopencl as cl

__all__ = ["Done", "Driver", "Dropped", "Job", "auto_reason", "auto_strategy", "is_pocl_cpu"]

POCL_PLATFORM_NAME = "Portable Computing Language"


def is_pocl_cpu(device: cl.Device) -> bool:
    """True for pocl's CPU devices, whose binary query compiles (DESIGN.md F1)."""
    import pyopencl as cl

    return device.platform.name == POCL_PLATFORM_NAME and bool(device.type & cl.device_type.CPU)


def auto_strategy(devices: Sequence[cl.Device]) -> str:
    """``process`` when any device is a pocl CPU device, else ``thread``."""
    return "process" if any(is_pocl_cpu(d) for d in devices) else "thread"


def auto_reason(devices: Sequence[cl.Device]) -> str:
    """One sentence: why :func:`auto_strategy` picks what it picks for *devices*."""
    if auto_strategy(devices) == "process":
        return (
            "pocl's CPU device compiles a second, generic variant when asked for its binary, "
            "and holds a process-wide lock while compiling that stalls every launch "
            "(DESIGN.md F1, F3), so a lowest-priority helper process does the query"
        )
    names = ", ".join(sorted({d.platform.name for d in devices}))
    return (
        f"{names} is not pocl: its binary query returns what the build made without "
        "compiling again, so a background thread takes it (ctypes, GIL released)"
    )
