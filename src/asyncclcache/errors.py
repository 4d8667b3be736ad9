"""Errors and warnings of asyncclcache.

Every error derives from :class:`AsyncCLCacheError`, every warning from
:class:`AsyncCLCacheWarning`, so callers can filter the whole library at once. An
error that refines a built-in derives from it too, so ``except OSError`` (say) still
catches an :class:`InsecurePathError`. The modules that raise them import them from
here (``fileio.InsecurePathError`` is this module's). The package's control-flow
exceptions (a driver's ``Dropped`` and ``Lost``, the include scan's ``UncertainIncludes``)
are caught inside it, never reach a user, and are not here.
"""

from __future__ import annotations

__all__ = [
    "ArchiveError",
    "AsyncCLCacheError",
    "AsyncCLCacheWarning",
    "BackgroundError",
    "BinaryQueryError",
    "BinaryRejectedWarning",
    "CacheDirWarning",
    "CorruptEntryWarning",
    "EntryFormatError",
    "InsecureCacheWarning",
    "InsecurePathError",
    "NodeDirWarning",
    "RemovedStrategyWarning",
    "SettingWarning",
    "UsageError",
    "WriteFailedWarning",
]


class AsyncCLCacheError(Exception):
    """Base class of every error raised by asyncclcache."""


class BackgroundError(AsyncCLCacheError, RuntimeError):
    """Raised by ``flush()`` for a background failure when ``ASYNCCLCACHE_FAILURE_FATAL=1``."""


class BinaryQueryError(AsyncCLCacheError, RuntimeError):
    """``clGetProgramInfo`` failed while reading a program's binaries; ``code`` is the OpenCL status."""

    def __init__(self, what: str, code: int, *, why: str | None = None) -> None:
        super().__init__(f"clGetProgramInfo({what}) failed with status {code}" if why is None
                         else f"clGetProgramInfo({what}) not called: {why}")
        self.code = code


class InsecurePathError(AsyncCLCacheError, PermissionError):
    """A directory or file another user could have written (or a link) was refused."""


class EntryFormatError(AsyncCLCacheError, ValueError):
    """The bytes read are not a valid entry (damaged, truncated, foreign); the message says why."""


class ArchiveError(AsyncCLCacheError):
    """``export`` or ``import`` cannot use an archive (or a directory); the message names the member."""


class UsageError(AsyncCLCacheError):
    """The ``asyncclcache`` command cannot act on its command line or directory; it exits with status 2."""


class AsyncCLCacheWarning(UserWarning):
    """Base class of every warning issued by asyncclcache."""


class CacheDirWarning(AsyncCLCacheWarning):
    """The cache directory cannot be used (not a directory, not writable); caching is off."""


class NodeDirWarning(AsyncCLCacheWarning):
    """The node-local directory cannot be used (not writable, full, another user's): this
    process reads entries from the shared directory itself. Once per process."""


class InsecureCacheWarning(AsyncCLCacheWarning):
    """A cache directory or entry is owned by another user or writable by others; refused."""


class CorruptEntryWarning(AsyncCLCacheWarning):
    """An entry failed validation (damaged, truncated, foreign); it was removed, a miss follows."""


class BinaryRejectedWarning(AsyncCLCacheWarning):
    """The driver rejected a stored binary; the program was rebuilt from source."""


class SettingWarning(AsyncCLCacheWarning):
    """An ``ASYNCCLCACHE_*`` setting is bad (the message names it), or the default cache
    directory is not known: ``install()`` and ``Program`` without ``cache=`` build plainly,
    uncached. Once per process."""


class RemovedStrategyWarning(AsyncCLCacheWarning):
    """A strategy that is gone was asked for (``process``, ``sync``); ``auto`` serves instead.
    Once per strategy and process."""


class WriteFailedWarning(AsyncCLCacheWarning):
    """An entry could not be written (disk full, permissions); nothing partial was left."""
