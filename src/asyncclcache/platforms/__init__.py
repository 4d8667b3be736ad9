"""One module per OpenCL implementation, and the table the rest of the package asks.

Each module holds the facts of one implementation in one record
(:class:`~asyncclcache.platform.Platform`): its platform names and how to recognise its
devices, where its own cache lives and whether it is on, that cache's layout, its include
rule, the settings that change its code, and what ``auto`` picks there and why:

* :mod:`.pocl`: pocl (its kernel cache, strategy ``kcache``; ``off`` on its CPU devices
  where that cache is off); :mod:`.pocl_cuda`: its CUDA device (pocl's kernel cache and
  NVIDIA's compute cache together, ``kcache-pocl-cuda``);
* :mod:`.intel`: Intel's CPU runtime (settings and ``cl.cfg`` only);
* :mod:`.nvidia`: NVIDIA's OpenCL (its compute cache, ``kcache-nvidia``);
* :mod:`.mesa`: Mesa's rusticl (its shader cache, ``kcache-mesa``) and Clover (settings only).

No platform name and no driver setting's name is spelled outside this folder (a test
holds it). An implementation not in the table has its identity (driver version) in every
key, no settings in it, no cache of its own stored, and a doubt about its include rule.

**Adding a platform**: write one module here that defines ``PLATFORM`` (a
:class:`~asyncclcache.platform.Platform`: what is not known, leave at its default), and add
it to :data:`PLATFORMS` below. A cache layout of a new shape (neither one file per item
nor pocl's folder per program) needs a driver too.

Frozen records and pure look-ups: thread- and process-safe.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ..platform import Layout, Platform, Settings
from . import intel, mesa, nvidia, pocl, pocl_cuda

if TYPE_CHECKING:
    import pyopencl as cl

__all__ = [
    "DEVICE_RECORDS",
    "PLATFORMS",
    "Layout",
    "Platform",
    "Settings",
    "by_strategy",
    "extra_options",
    "find",
    "of_devices",
    "per_build",
    "source_folder",
]

#: The table: every implementation the package knows.
PLATFORMS: tuple[Platform, ...] = (pocl.PLATFORM, intel.PLATFORM, nvidia.PLATFORM, mesa.PLATFORM, mesa.CLOVER)

#: Records of some devices of an implementation in :data:`PLATFORMS` (their own caches), found
#: by :func:`of_devices`; for everything else (settings, includes) the implementation's record.
DEVICE_RECORDS: tuple[Platform, ...] = (pocl_cuda.PLATFORM,)

_BY_NAME = {name: p for p in PLATFORMS for name in p.names}
_BY_STRATEGY = {p.layout.strategy: p for p in PLATFORMS + DEVICE_RECORDS if p.layout is not None}


def find(name: str) -> Platform | None:
    """The record of the OpenCL platform called ``name`` (``platform.name``), or ``None``."""
    return _BY_NAME.get(name)


def of_devices(devices: Sequence[cl.Device]) -> Platform | None:
    """The record whose cache serves ``devices`` (of one platform): one of
    :data:`DEVICE_RECORDS` that takes them all, else their implementation's; ``None`` where
    they are of several platforms, or of one not in the table."""
    names = {d.platform.name for d in devices}
    if len(names) != 1:
        return None
    name = names.pop()
    for p in DEVICE_RECORDS:
        if name in p.names and p.devices is not None and all(p.devices(d) for d in devices):
            return p
    return find(name)


def by_strategy(strategy: str) -> Platform | None:
    """The implementation whose own cache the driver ``strategy`` stores (an entry's
    ``strategy``: ``kcache`` is pocl's folder), or ``None``."""
    return _BY_STRATEGY.get(strategy)


def source_folder(
    devices: Sequence[cl.Device], options: bytes, cwd: str | None,
) -> tuple[str | None, str | None]:
    """Where the compiler looks first for the source's own ``#include "..."``
    (:func:`asyncclcache.keys.find_include_deps`), and a doubt about it, or ``None``; ``cwd``
    is the caller's working directory. (Then pyopencl's include path: ``.`` and the ``-I``
    folders, the order pocl, NVIDIA and rusticl were measured to search.)"""
    names = {d.platform.name for d in devices}
    platform = find(next(iter(names))) if len(names) == 1 else None
    if platform is not None and platform.include_rule is not None:
        return platform.include_rule(options, cwd)
    return cwd, (f"whether {' and '.join(sorted(names))} looks for it in the working directory "
                 "was not measured")


def extra_options(env: Mapping[str, str]) -> list[bytes]:
    """The values in ``env`` of every variable that some driver adds to a build's options."""
    return [env[var].encode() for p in PLATFORMS if p.settings is not None
            for var in p.settings.extra_options if var in env]


def per_build(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``env`` that a driver reads at every build, not once at its start
    (pocl's, code or not: where its cache is too): a rebuild in another process or thread
    must see them as the caller did."""
    out: dict[str, str] = {}
    for p in PLATFORMS:
        if p.settings is not None and not p.settings.at_start:
            out.update(p.settings.own(env))
    return out
