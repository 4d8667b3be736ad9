"""asyncclcache: PyOpenCL program builds that return at once, with binaries cached later.

::

    import asyncclcache as acc
    prg = acc.Program(ctx, source).build()     # drop-in for pyopencl.Program
    acc.install()                              # or: every pyopencl.Program in the process
    with acc.step():                           # snapshot binaries after a simulation step
        run_one_time_step()

No code change: ``python -m asyncclcache run driver.py`` or ``ASYNCCLCACHE_INSTALL=1``.

The names below are imported on first use (PEP 562), so ``import asyncclcache`` (which
the start-up hook does in every process that sets ``ASYNCCLCACHE_INSTALL=1``) loads
neither pyopencl nor the cache machinery until a program needs them.
"""

from __future__ import annotations

from ._version import __version__
from .errors import (
    AsyncCLCacheError,
    AsyncCLCacheWarning,
    BackgroundError,
    BinaryRejectedWarning,
    CacheDirWarning,
    CorruptEntryWarning,
    InsecureCacheWarning,
    NodeDirWarning,
    RemovedStrategyWarning,
    SettingWarning,
    WriteFailedWarning,
)

TYPE_CHECKING = False  # typing's costs 5-15 ms at start-up (see _startup.py)
if TYPE_CHECKING:
    from .cache import Cache, Step, default_cache, step
    from .program import Program, install, installed, is_installed, uninstall
    from .stats import Stats

_LAZY = {
    "Cache": "cache",
    "Stats": "stats",
    "Step": "cache",
    "default_cache": "cache",
    "step": "cache",
    "Program": "program",
    "install": "program",
    "installed": "program",
    "is_installed": "program",
    "uninstall": "program",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncclcache' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "AsyncCLCacheError",
    "AsyncCLCacheWarning",
    "BackgroundError",
    "BinaryRejectedWarning",
    "Cache",
    "CacheDirWarning",
    "CorruptEntryWarning",
    "InsecureCacheWarning",
    "NodeDirWarning",
    "Program",
    "RemovedStrategyWarning",
    "SettingWarning",
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
