"""The drop-in ``Program``, and ``install()`` for every ``pyopencl.Program`` in the process.

``build()`` looks the key up (memory, then disk). On a hit the driver builds the
program from the entry; on a miss it does a plain source build (never with
pyopencl's cache-defeating uuid, docs/design.md F6), returns at once and leaves the
entry to the cache's background work (:meth:`Cache.record_miss`). Only the cache's
public build interface is used.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pyopencl as cl
from pyopencl import _cl

from . import pocl_env
from .cache import Cache, default_cache
from .cuda_env import NVIDIA_PLATFORM_NAME
from .drivers import Job, SourceBuild
from .errors import BinaryRejectedWarning
from .keys import POCL_PLATFORM_NAME, make_key
from .mesa_env import RUSTICL_PLATFORM_NAME

__all__ = ["Program", "install", "installed", "is_installed", "uninstall"]

logger = logging.getLogger(__name__)

#: pyopencl's own ``Program.build``, whatever install() does later.
_PYOPENCL_BUILD = getattr(cl.Program.build, "_asyncclcache_original", cl.Program.build)


def _bypass_reason(prg: cl.Program, cache: Cache) -> str | None:
    if not cache.active:
        return "cache disabled" if cache.disabled else "cache closed"
    if not cache.store.enabled:
        return "cache directory unusable"
    if getattr(prg, "_prg", None) is not None or not hasattr(prg, "_source"):
        return "not a source program"  # binaries, IL, or already created
    return None


def cached_build(
    prg: cl.Program,
    cache: Cache,
    options: str | Sequence[str] | None = None,
    devices: Sequence[cl.Device] | None = None,
    cache_dir: str | None = None,
) -> cl.Program:
    """Build ``prg`` (a source ``pyopencl.Program``) through ``cache``; returns ``prg``.

    Raises what pyopencl raises: ``pyopencl.RuntimeError`` with the build log on a
    bad source. Thread-safe.
    """
    if _bypass_reason(prg, cache) is not None:
        return _PYOPENCL_BUILD(prg, options, devices, cache_dir)

    t_start = time.perf_counter()
    looked_up_at = time.time()
    context: cl.Context = prg._context
    options_bytes, include_path = prg._process_build_options(context, options)
    devs = list(devices) if devices is not None else list(context.devices)
    source = prg._source
    source_bytes = source.encode("utf-8") if isinstance(source, str) else bytes(source)
    driver = cache.driver_for(devs)
    folder, doubt = _source_folder(devs, options_bytes)
    if doubt is not None and include_path[:1] == ["."]:
        # pyopencl's "." stands for the folder beside the source: the doubt is about it.
        include_path = include_path[1:]
    info = make_key(source_bytes, options_bytes, devs, include_path, kind=driver.kind,
                    source_dir=folder, source_dir_doubt=doubt)
    if info.uncertain is not None:
        # A header we cannot track for certain could change without changing the key.
        logger.info("asyncclcache: not caching a program: %s", info.uncertain)
        cache.record_uncacheable()
        return _PYOPENCL_BUILD(prg, options, devices, cache_dir)
    prg.cache_key = info.key  # type: ignore[attr-defined]
    entry = cache.lookup(info)
    overhead = time.perf_counter() - t_start

    def build_source() -> Any:
        new = _cl._Program(context, source)
        # Same error path and message as pyopencl's uncached build.
        prg._build_and_catch_errors(lambda: new.build(options_bytes, devices), options_bytes)
        return new

    built, hit, descr, duration = None, False, "", 0.0
    if entry is not None:
        built, hit, descr, duration = _from_entry(
            cache, driver, entry, info, context, source_bytes, devs, options_bytes,
            looked_up_at, build_source,
        )

    if built is None:
        t0 = time.perf_counter()
        built_from = time.time()
        built = build_source()
        built_to = time.time()
        duration = time.perf_counter() - t0
        t1 = time.perf_counter()
        _after_miss(cache, built, info, source_bytes, devs, looked_up_at, duration, built_from, built_to)
        overhead += time.perf_counter() - t1
        descr = "source build (binary retrieved in the background)"

    prg._prg = built
    cache.record_overhead(overhead)
    prg._build_duration_info = (descr, hit, duration)
    return prg


def _source_folder(devices: Sequence[cl.Device], options: bytes) -> tuple[str | None, str | None]:
    """Where the compiler looks first for the source's own ``#include "..."`` (keys.py),
    and a doubt about it, or ``None``. (Then pyopencl's include path: ``.`` and the ``-I``
    folders, the order pocl, NVIDIA and rusticl were measured to search.)"""
    platforms = {d.platform.name for d in devices}
    if platforms == {POCL_PLATFORM_NAME}:
        # pocl compiles its copy of the source in its cache directory.
        folder = pocl_env.source_dir()
        return (None if folder is None else str(folder)), None
    cwd = Job.caller_cwd()
    if platforms == {NVIDIA_PLATFORM_NAME}:
        # Its compute cache sees a header's content (docs/design.md F19; benchmarks/probe/nvrules.py).
        return cwd, None
    if platforms == {RUSTICL_PLATFORM_NAME}:
        if re.search(rb"(?:^|\s)-I", options):
            return cwd, None  # pyopencl always adds one: then Mesa 22.3 and 26.1 see headers
        return cwd, ("with no -I option, Mesa's shader cache keys rusticl's front end on the source and "
                     "options, not the header (docs/design.md F20)")
    return cwd, (f"whether {' and '.join(sorted(platforms))} looks for it in the working directory "
                 "was not measured")


def _from_entry(
    cache: Cache, driver: Any, entry: Any, info: Any, context: cl.Context, source: bytes,
    devs: list[cl.Device], options: bytes, looked_up_at: float, build_source: Any,
) -> tuple[Any, bool, str, float]:
    """A hit: (program or None, hit, description, seconds). A stored entry the driver
    refuses warns and is dropped; if the driver built from source anyway, that is a miss."""
    t0 = time.perf_counter()
    built_from = time.time()
    result = driver.build_from_entry(entry, SourceBuild(context, devs, options, build_source))
    duration = time.perf_counter() - t0
    if result.program is not None and result.used:
        cache.record_hit(info, entry, duration, source=source, devices=devs, folders=result.folders)
        _replay_logs(entry.meta.build_logs, devs)
        return result.program, True, "cache retrieval", duration
    if result.program is not None and not result.blame_entry:
        # Our I/O failed, or the cause may be a setting (the driver warned): keep the
        # entry; a plain miss, whose own entry replaces it where the driver makes one.
        if result.rejected:
            cache.record_unused(info)
        _after_miss(cache, result.program, info, source, devs, looked_up_at, duration, built_from, time.time())
        return result.program, False, "source build (stored entry could not be used here)", duration
    what = "binary" if entry.kind == "binary" else "kernel-cache files"
    warnings.warn(
        f"asyncclcache: the driver rejected the stored {what} {info.key[:12]} "
        f"({result.why}); rebuilding from source",
        BinaryRejectedWarning,
        stacklevel=4,
    )
    cache.reject(info)
    if result.program is None:
        return None, False, "", duration
    # Built from source already (pocl did not use the stored folder): a miss.
    _after_miss(cache, result.program, info, source, devs, looked_up_at, duration, built_from, time.time())
    return result.program, False, "source build (stored kernel-cache files unused)", duration


def _after_miss(
    cache: Cache, built: Any, info: Any, source: bytes, devices: list[cl.Device],
    looked_up_at: float, seconds: float, built_from: float, built_to: float,
) -> None:
    cache.record_miss(
        built, info, source=source, devices=devices, logs=_build_logs(built),
        kernels=_kernel_names(built), looked_up_at=looked_up_at, build_seconds=seconds,
        built_from=built_from, built_to=built_to,
    )


def _kernel_names(prg: Any) -> list[str]:
    try:
        names = prg.get_info(cl.program_info.KERNEL_NAMES)
    except cl.Error:
        return []
    return sorted(n for n in names.split(";") if n)


def _build_logs(prg: Any) -> list[str]:
    """The per-device build logs, or ``[]`` when all are empty (the usual case)."""
    try:
        logs = [log or "" for _dev, log in prg._get_build_logs()]
    except cl.Error:
        return []
    return logs if any(log.strip() for log in logs) else []


def _replay_logs(logs: list[str], devices: Sequence[cl.Device]) -> None:
    # As pyopencl does for its own cache hits: the warnings of the original build.
    message = (75 * "=" + "\n").join(
        f"Build on {dev} succeeded, but said:\n\n{log}"
        for dev, log in zip(devices, logs, strict=False)
        if log and log.strip()
    )
    if message:
        cl.compiler_output(
            "Built kernel retrieved from cache. Original from-source build had warnings:\n" + message
        )


class Program(cl.Program):
    """A ``pyopencl.Program`` whose ``build()`` goes through an asyncclcache :class:`Cache`.

    Same constructor forms as pyopencl (``Program(ctx, source)``,
    ``Program(ctx, devices, binaries)``, ``Program(_Program)``), plus ``cache=``
    (default: :func:`default_cache`). Only source programs are cached. Kernels,
    ``get_info`` and ``all_kernels()`` are pyopencl's. Building one object from
    several threads at once is as unsafe as with pyopencl; building different
    objects concurrently is safe.
    """

    def __init__(
        self, arg1: Any, arg2: Any = None, arg3: Any = None, *, cache: Cache | None = None
    ) -> None:
        super().__init__(arg1, arg2, arg3)
        self._acc_cache = cache
        #: The key of the last cached build (``None`` before ``build()`` or when bypassed).
        self.cache_key: str | None = None

    def build(
        self,
        options: str | Sequence[str] | None = None,
        devices: Sequence[cl.Device] | None = None,
        cache_dir: str | None = None,
    ) -> Program:
        """Build like ``pyopencl.Program.build``; returns ``self`` at once on a miss."""
        cache = self._acc_cache or default_cache()
        cached_build(self, cache, options, devices, cache_dir)
        return self


# {{{ install

_install_lock = threading.Lock()


def _new_install_lock() -> None:
    global _install_lock
    _install_lock = threading.Lock()


if hasattr(os, "register_at_fork"):  # held by another thread at fork: the child's would never open
    os.register_at_fork(after_in_child=_new_install_lock)
_installed_cache: Cache | None = None
_install_depth = 0


def _installed_build(
    self: cl.Program,
    options: str | Sequence[str] | None = None,
    devices: Sequence[cl.Device] | None = None,
    cache_dir: str | None = None,
) -> cl.Program:
    cache = _installed_cache
    if cache is None:  # uninstalled meanwhile
        return _PYOPENCL_BUILD(self, options, devices, cache_dir)
    return cached_build(self, cache, options, devices, cache_dir)


_installed_build._asyncclcache_original = _PYOPENCL_BUILD  # type: ignore[attr-defined]
_installed_build.__doc__ = _PYOPENCL_BUILD.__doc__


def _stand_aside() -> str | None:
    from .config import get_config

    if get_config().disable:
        return "ASYNCCLCACHE_DISABLE is set"
    if cl._PYOPENCL_NO_CACHE:
        return "PYOPENCL_NO_CACHE is set"
    return None


_said_aside = False


def install(cache: Cache | None = None) -> bool:
    """Route every ``pyopencl.Program(...).build()`` in the process through ``cache``.

    Covers ``pyopencl.array``, elementwise, reduction and scan kernels, loopy and
    user code. Idempotent and thread-safe; a second call switches the cache.
    Steps aside (returns False, says so once in the log) when
    ``PYOPENCL_NO_CACHE`` or ``ASYNCCLCACHE_DISABLE`` is set.
    """
    global _installed_cache, _said_aside
    reason = _stand_aside()
    with _install_lock:
        if reason is not None:
            if not _said_aside:
                logger.info("asyncclcache.install(): not installing: %s", reason)
                _said_aside = True
            return False
        _installed_cache = cache or default_cache()
        cl.Program.build = _installed_build  # type: ignore[method-assign]
    return True


def uninstall() -> None:
    """Restore pyopencl's own ``Program.build`` exactly. Idempotent and thread-safe."""
    global _installed_cache
    with _install_lock:
        cl.Program.build = _PYOPENCL_BUILD  # type: ignore[method-assign]
        _installed_cache = None


def is_installed() -> bool:
    """True while :func:`install` is in effect."""
    return cl.Program.build is _installed_build


@contextmanager
def installed(cache: Cache | None = None) -> Iterator[Cache | None]:
    """``install(cache)`` for the block; restores the previous state after it."""
    with _install_lock:
        previous = _installed_cache if is_installed() else None
    install(cache)
    try:
        yield _installed_cache
    finally:
        if previous is not None:
            install(previous)
        else:
            uninstall()
# }}}
