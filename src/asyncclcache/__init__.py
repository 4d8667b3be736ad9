"""asyncclcache: PyOpenCL program builds that return at once, with binaries cached later.

::

    import asyncclcache as acc
    prg = acc.Program(ctx, source).build()     # drop-in for pyopencl.Program
    acc.install()                              # or: every pyopencl.Program in the process
    with acc.step():                           # snapshot binaries after a simulation step
        run_one_time_step()
"""

from __future__ import annotations

from ._version import __version__
from .cache import Cache, Stats, Step, default_cache, step
from .errors import (
    AsyncCLCacheError,
    AsyncCLCacheWarning,
    BackgroundError,
    BinaryRejectedWarning,
    CacheDirWarning,
    CacheDisabledWarning,
    ClosedError,
    CorruptEntryWarning,
    InsecureCacheWarning,
    WriteFailedWarning,
)
from .program import Program, install, installed, is_installed, uninstall

__all__ = [
    "AsyncCLCacheError",
    "AsyncCLCacheWarning",
    "BackgroundError",
    "BinaryRejectedWarning",
    "Cache",
    "CacheDirWarning",
    "CacheDisabledWarning",
    "ClosedError",
    "CorruptEntryWarning",
    "InsecureCacheWarning",
    "Program",
    "Stats",
    "Step",
    "WriteFailedWarning",
    "__version__",
    "default_cache",
    "install",
    "installed",
    "is_installed",
    "step",
    "uninstall",
]
