"""The strategies that bring a build's code into an entry, behind one small interface
(:class:`Driver`), one module per strategy or mechanism. What each OpenCL implementation is
(its cache, its layout, what ``auto`` picks there and why) is not here: the drivers ask
:mod:`asyncclcache.platforms`.

* ``kcache``: the driver's own disk cache is the entry; nothing is compiled for the
  cache. What ``auto`` picks wherever that cache is on and its layout is known. Two
  mechanisms, one per shape of cache:

  - :mod:`.kcache_folders`: one folder per program (pocl's kernel cache; driver
    ``kcache``), found and read by :mod:`.folders`;
  - :mod:`.kcache_files`: one file per item, named by its content's hash (NVIDIA's
    compute cache, Mesa's shader cache; drivers ``kcache-nvidia``, ``kcache-mesa``);
  - :mod:`.kcache_parts`: several of those caches that one device uses together, as one
    entry (pocl's CUDA device: pocl's folder and NVIDIA's files; ``kcache-pocl-cuda``).

  Both share :mod:`.background` (their thread) and :mod:`.cachefiles` (the trust rules,
  reading and restoring files).
* ``thread`` (:mod:`.thread`): a worker thread queries the binaries through ctypes. What
  ``auto`` picks where the binary query is a copy and no driver cache is known.
* ``off`` (:mod:`.off`): nothing is cached. What ``auto`` picks where the binary query
  compiles (pocl's CPU devices) and the driver's own cache is off; the platform's record
  says what to do instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .. import platforms
from .base import Build, Done, Driver, Dropped, Hit, HitOutcome, Job, Lost, PerJob, Purpose, Snapshot

# pocl's, with the package: a new process's first build (a hit, 20 ms) pays no import (~1 ms).
from .kcache_folders import KcacheDriver

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
    "make_driver",
    "resolve_strategy",
]


def _query_compiles(device: cl.Device) -> bool:
    """The device's binary query compiles (pocl's CPU devices, docs/design.md F1)."""
    platform = platforms.find(device.platform.name)
    return platform is not None and platform.query_compiles is not None and platform.query_compiles(device)


def driver_cache(devices: Sequence[cl.Device]) -> tuple[str | None, Path | None, str]:
    """``(driver name, its cache directory, why)`` of the driver cache that ``kcache``
    would store for ``devices``; ``(None, None, why not)`` where there is none we know."""
    names = {d.platform.name for d in devices}
    if not devices or len(names) != 1:
        return None, None, "the devices are not of one platform"
    platform = platforms.of_devices(devices)
    if platform is None or platform.layout is None or platform.locate is None:
        return None, None, f"{names.pop()} has no disk cache whose layout asyncclcache knows"
    root, why = platform.locate(devices)
    if root is None:
        return None, None, why
    # A cache of parts: ``why`` says which are on.
    return platform.layout.strategy, root, platform.why_cache.format(root=root, note=why)


def auto_strategy(devices: Sequence[cl.Device]) -> str:
    """The driver's own cache (``kcache``, ``kcache-nvidia``, ``kcache-mesa``) where it is on
    and known (:func:`driver_cache`); else ``off`` when some device's binary query
    compiles (pocl's CPU devices: no binary is taken in the job's process); else ``thread``."""
    name, _, _ = driver_cache(devices)
    if name is not None:
        return name
    return "off" if any(_query_compiles(d) for d in devices) else "thread"


def resolve_strategy(requested: str, devices: Sequence[cl.Device]) -> str:
    """The driver to use: ``requested``, except that ``auto`` is resolved and ``kcache``
    becomes the driver cache of these devices, or ``auto``'s pick where there is none.
    Thread-safe."""
    if requested in ("auto", "kcache"):
        return auto_strategy(devices)
    return requested


def make_driver(name: str, workers: Workers, devices: Sequence[cl.Device] = ()) -> Driver:
    """A new driver ``name`` (as :func:`resolve_strategy` gives it); ``thread`` runs on the
    cache's ``workers``. A driver cache's directory is fixed now, for the driver's life,
    as the OpenCL driver fixes it when it starts."""
    platform = platforms.by_strategy(name)
    if platform is not None and platform.layout is not None and platform.locate is not None:
        root, why = platform.locate(devices)
        if root is None:
            raise ValueError(f"strategy kcache: {why}")
        if platform.parts:
            from .kcache_parts import PartsDriver

            located = [(part, *part.locate(devices)) for part in platform.parts]
            return PartsDriver(platform.layout, [
                (part.prefix, part.layout, None if r is None else _cache_driver(part.layout, r, workers), w)
                for part, r, w in located])
        return _cache_driver(platform.layout, root, workers)
    if name == "thread":
        from .thread import ThreadDriver

        return ThreadDriver(workers)
    if name == "off":
        from .off import OffDriver

        return OffDriver(auto_reason(devices))
    raise ValueError(f"unknown strategy {name!r}")


def _cache_driver(layout: platforms.Layout, root: Path, workers: Workers) -> Driver:
    """The driver of one cache: one folder per program, or one file per item."""
    if layout.per_program:
        return KcacheDriver(root, layout, workers)
    from .kcache_files import FileCacheDriver

    return FileCacheDriver(root, layout)


def auto_reason(devices: Sequence[cl.Device]) -> str:
    """One sentence: why :func:`auto_strategy` picks what it picks for *devices*."""
    name, _, why = driver_cache(devices)
    if name is not None:
        return f"{why}: the entry stores those files, so the cache itself compiles nothing"
    for d in devices:
        if _query_compiles(d):
            return why + platforms.find(d.platform.name).why_off  # type: ignore[union-attr]
    return (
        f"{why}; its binary query returns what the build made without compiling again, so a "
        "background thread takes it (ctypes, GIL released)"
    )
