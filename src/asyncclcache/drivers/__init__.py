"""What differs per OpenCL implementation, behind one small interface (:class:`Driver`).

* ``kcache``: the driver's own disk cache is the entry; nothing is compiled for the
  cache. What ``auto`` picks wherever that cache is on and its layout is known:
  pocl's kernel-cache folder (:mod:`.kcache`, driver ``kcache``), NVIDIA's compute
  cache and Mesa's shader cache for rusticl (:mod:`.filecache`, drivers
  ``kcache-nvidia`` and ``kcache-mesa``).
* ``process`` (:mod:`.pocl`): a helper process does the warm-up and the snapshot
  (binary query). What ``auto`` picks for pocl's CPU devices with ``POCL_KERNEL_CACHE=0``;
  asked for where no device is a pocl CPU device, ``auto``'s pick instead.
* ``thread`` (:mod:`.inprocess`): a worker thread queries through ctypes. What
  ``auto`` picks for everything else.
* ``sync`` (:mod:`.inprocess`): inline, for comparison.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .. import cuda_env, mesa_env, pocl_env
from ..cuda_env import NVIDIA_PLATFORM_NAME
from ..keys import POCL_PLATFORM_NAME
from ..mesa_env import RUSTICL_PLATFORM_NAME
from .base import Build, Done, Driver, Dropped, Hit, HitOutcome, Job, Lost, PerJob, Purpose, Snapshot

if TYPE_CHECKING:
    import pyopencl as cl

    from ..workers import Workers

__all__ = [
    "Build",
    "Done",
    "Driver",
    "Dropped",
    "Hit",
    "HitOutcome",
    "Job",
    "Lost",
    "PerJob",
    "Purpose",
    "Snapshot",
    "auto_reason",
    "auto_strategy",
    "driver_cache",
    "is_pocl_cpu",
    "make_driver",
    "resolve_strategy",
]



def is_pocl_cpu(device: cl.Device) -> bool:
    """True for pocl's CPU devices, whose binary query compiles (docs/design.md F1)."""
    import pyopencl as cl

    return device.platform.name == POCL_PLATFORM_NAME and bool(device.type & cl.device_type.CPU)


def driver_cache(devices: Sequence[cl.Device]) -> tuple[str | None, Path | None, str]:
    """``(driver name, its cache directory, why)`` of the driver cache that ``kcache``
    would store for ``devices``; ``(None, None, why not)`` where there is none we know."""
    platforms = {d.platform.name for d in devices}
    if not devices or len(platforms) != 1:
        return None, None, "the devices are not of one platform"
    platform = platforms.pop()
    if platform == POCL_PLATFORM_NAME:
        if not all(is_pocl_cpu(d) for d in devices):
            return None, None, "pocl's kernel cache is stored only for its CPU devices"
        root = pocl_env.kernel_cache_dir()
        if root is None:
            flag = os.environ.get("POCL_KERNEL_CACHE")
            return None, None, (f"pocl's kernel cache is off (POCL_KERNEL_CACHE={flag!r}: pocl reads only "
                                "a value starting with 1 as on)")
        return "kcache", root, (
            f"pocl's CPU device keeps each program's compiled variants in its kernel cache ({root}), "
            "and that folder, restored on a new node, compiles nothing (docs/design.md F15, F16)")
    if platform == NVIDIA_PLATFORM_NAME:
        root, why = cuda_env.locate()
        if root is None:
            return None, None, why
        return "kcache-nvidia", root, (
            f"NVIDIA's compute cache ({root}) holds each build's machine code in content-addressed "
            "files that a new node uses as they are, where the binary (PTX) still runs the JIT "
            "(docs/design.md F19)")
    if platform == RUSTICL_PLATFORM_NAME:
        root, why = mesa_env.locate(release=_mesa_release(devices))
        if root is None:
            return None, None, why
        return "kcache-mesa", root, (
            f"Mesa's shader cache ({root}) holds rusticl's front end and code generation in "
            "content-addressed files that a new node uses as they are, where the binary (SPIR-V) "
            "still compiles (docs/design.md F20)")
    return None, None, f"{platform} has no disk cache whose layout asyncclcache knows"


def _mesa_release(devices: Sequence[cl.Device]) -> tuple[int, int] | None:
    releases = {mesa_env.mesa_release(d.driver_version) for d in devices}
    return releases.pop() if len(releases) == 1 else None


def auto_strategy(devices: Sequence[cl.Device]) -> str:
    """The driver's own cache (``kcache``, ``kcache-nvidia``, ``kcache-mesa``) where it is on
    and known (:func:`driver_cache`); else ``process`` when some device is a pocl CPU
    device; else ``thread``."""
    name, _, _ = driver_cache(devices)
    if name is not None:
        return name
    return "process" if any(is_pocl_cpu(d) for d in devices) else "thread"


def resolve_strategy(requested: str, devices: Sequence[cl.Device]) -> str:
    """The driver to use: ``requested``, except that ``auto`` is resolved, ``kcache``
    becomes the driver cache of these devices, or ``auto``'s pick where there is none, and
    ``process`` becomes ``auto``'s pick where no device is a pocl CPU device (only there
    does the binary query compile: elsewhere the helper would repeat the whole build).
    Thread-safe."""
    if requested in ("auto", "kcache"):
        return auto_strategy(devices)
    if requested == "process" and not any(is_pocl_cpu(d) for d in devices):
        return auto_strategy(devices)
    return requested


def make_driver(name: str, workers: Workers, devices: Sequence[cl.Device] = ()) -> Driver:
    """A new driver ``name`` (as :func:`resolve_strategy` gives it); in-process strategies
    run on the cache's ``workers``. A driver cache's directory is fixed now, for the
    driver's life, as the OpenCL driver fixes it when it starts."""
    if name == "kcache":
        from .kcache import KcacheDriver

        root = pocl_env.kernel_cache_dir()
        if root is None:
            raise ValueError("strategy kcache needs pocl's kernel cache, which is off (POCL_KERNEL_CACHE)")
        return KcacheDriver(root)
    if name in ("kcache-nvidia", "kcache-mesa"):
        from .filecache import MESA, NVIDIA, FileCacheDriver

        nvidia = name == "kcache-nvidia"
        root, why = cuda_env.locate() if nvidia else mesa_env.locate(release=_mesa_release(devices))
        if root is None:
            raise ValueError(f"strategy kcache: {why}")
        return FileCacheDriver(root, NVIDIA if nvidia else MESA)
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
    name, _, why = driver_cache(devices)
    if name is not None:
        return f"{why}: the entry stores those files, so the cache itself compiles nothing"
    if any(is_pocl_cpu(d) for d in devices):
        return (
            f"{why}, and pocl's CPU device compiles a second, generic variant when asked for its "
            "binary under a process-wide lock that stalls every launch (docs/design.md F1, F3), "
            "so a lowest-priority helper process does the query"
        )
    return (
        f"{why}; its binary query returns what the build made without compiling again, so a "
        "background thread takes it (ctypes, GIL released)"
    )
