"""Errors and warnings of asyncclcache.

Every error derives from :class:`AsyncCLCacheError`, every warning from
:class:`AsyncCLCacheWarning`, so callers can filter the whole library at once.
"""

from __future__ import annotations

__all__ = [
    "AsyncCLCacheError",
    "AsyncCLCacheWarning",
    "BackgroundError",
    "BinaryRejectedWarning",
    "CacheDirWarning",
    "CorruptEntryWarning",
    "InsecureCacheWarning",
    "WriteFailedWarning",
]


class AsyncCLCacheError(Exception):
    """Base class of every error raised by asyncclcache."""


class BackgroundError(AsyncCLCacheError, RuntimeError):
    """Raised by ``flush()`` for a background failure when ``ASYNCCLCACHE_FAILURE_FATAL=1``."""


class AsyncCLCacheWarning(UserWarning):
    """Base class of every warning issued by asyncclcache."""


class CacheDirWarning(AsyncCLCacheWarning):
    """The cache directory cannot be used (not a directory, not writable); caching is off."""


class InsecureCacheWarning(AsyncCLCacheWarning):
    """A cache directory or entry is owned by another user or writable by others; refused."""


class CorruptEntryWarning(AsyncCLCacheWarning):
    """An entry failed validation (damaged, truncated, foreign); it was removed, a miss follows."""


class BinaryRejectedWarning(AsyncCLCacheWarning):
    """The driver rejected a stored binary; the program was rebuilt from source."""


class WriteFailedWarning(AsyncCLCacheWarning):
    """An entry could not be written (disk full, permissions); nothing partial was left."""
