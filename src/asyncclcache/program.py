"""The drop-in ``Program``, and ``install()`` for every ``pyopencl.Program`` in the process.

A thin adapter: ``build()`` makes the key, hands the build over whole to
:meth:`Cache.build` (a :class:`~.drivers.Build`) and leaves the result in the
``pyopencl.Program`` as pyopencl's own build does. A miss is a plain source build
(never with pyopencl's cache-defeating uuid, docs/design.md F6) that returns at once.
pyopencl's private names are in :mod:`._pyopencl`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pyopencl as cl

from . import _pyopencl, buildlock, platforms
from ._pyopencl import PYOPENCL_BUILD
from .cache import Cache, default_cache
from .drivers import Build, Job
from .errors import SettingWarning
from .keys import make_key

__all__ = ["Program", "install", "installed", "is_installed", "uninstall"]

logger = logging.getLogger(__name__)

def _bypass_reason(prg: cl.Program, cache: Cache) -> str | None:
    if not cache.active:
        return "cache disabled" if cache.disabled else "cache closed"
    if not cache.store.enabled:
        return "cache directory unusable"
    if _pyopencl.unbuilt_source(prg) is None:
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
        return PYOPENCL_BUILD(prg, options, devices, cache_dir)
    t0 = time.perf_counter()
    source = _pyopencl.unbuilt_source(prg)
    assert source is not None  # a source program: _bypass_reason
    source_bytes = source.encode("utf-8") if isinstance(source, str) else bytes(source)
    context = _pyopencl.context_of(prg)
    devs = list(devices) if devices is not None else list(context.devices)
    seconds = time.perf_counter() - t0
    # pocl before 6.0 fails a build of a program that another process builds in the same
    # kernel cache (pocl#1480): one at a time (buildlock.py); the next finds pocl's files.
    with buildlock.one_at_a_time(devs, source_bytes, options):
        t0 = time.perf_counter()
        build = _build_of(prg, cache, options, devices, context=context, devs=devs, source=source,
                          source_bytes=source_bytes)
        if build is None:  # not cached (counted)
            return PYOPENCL_BUILD(prg, options, devices, cache_dir)
        prg.cache_key = build.info.key  # type: ignore[attr-defined]
        cache.record_overhead(seconds + time.perf_counter() - t0)
        return _built(prg, cache, build)


def _built(prg: cl.Program, cache: Cache, build: Build) -> cl.Program:
    """``build`` through ``cache``, made ``prg``'s as pyopencl's ``build()`` leaves it."""
    built = cache.build(build)
    if built.replay:
        _replay_logs(built.replay, build.devices)
    _pyopencl.set_built(prg, built.program, built.description, built.hit, built.seconds)
    return prg


def _build_of(
    prg: cl.Program, cache: Cache, options: str | Sequence[str] | None, devices: Sequence[cl.Device] | None,
    *, context: cl.Context, devs: list[cl.Device], source: str | bytes, source_bytes: bytes,
) -> Build | None:
    """The hand-off of one build to the cache (``devs``: ``devices`` or the context's;
    ``source`` as given, and its bytes); ``None`` (counted): nothing is cached for its
    devices, or its key is uncertain."""
    driver = cache.driver_for(devs)
    if not driver.stores:
        cache.record_cache_off(driver)
        return None
    options_bytes, include_path = _pyopencl.process_options(prg, options)
    folder, doubt = platforms.source_folder(devs, options_bytes, Job.caller_cwd())
    if doubt is not None and include_path[:1] == ["."]:
        # pyopencl's "." stands for the folder beside the source: the doubt is about it.
        include_path = include_path[1:]
    info = make_key(source_bytes, options_bytes, devs, include_path, kind=driver.kind,
                    source_dir=folder, source_dir_doubt=doubt)
    if info.uncertain is not None:
        # A header we cannot track for certain could change without changing the key.
        logger.info("asyncclcache: not caching a program: %s", info.uncertain)
        cache.record_uncacheable()
        return None
    return Build(
        info, source_bytes, context, devs, driver,
        # Same error path and message as pyopencl's uncached build.
        from_source=lambda: _pyopencl.built_from_source(prg, context, source, options_bytes, devices),
        from_binaries=lambda binaries: _pyopencl.built_from_binaries(context, devs, binaries, options_bytes),
        describe=lambda program: (_pyopencl.build_logs(program), _pyopencl.kernel_names(program)),
    )


def _replay_logs(logs: Sequence[str], devices: Sequence[cl.Device]) -> None:
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
        cache = self._acc_cache or _default_cache()
        if cache is None:  # a bad setting, warned about: built as pyopencl builds
            PYOPENCL_BUILD(self, options, devices, cache_dir)
        else:
            cached_build(self, cache, options, devices, cache_dir)
        return self


_said_bad_setting = False


def _default_cache() -> Cache | None:
    """:func:`default_cache`, or ``None`` where a setting is bad (``ASYNCCLCACHE_DIR=~nobody``,
    no home directory for the default, ...): one :class:`SettingWarning` a process, naming
    it, and the program builds uncached instead of failing."""
    global _said_bad_setting
    try:
        return default_cache()
    except ValueError as e:
        if not _said_bad_setting:
            _said_bad_setting = True
            warnings.warn(f"asyncclcache: {e}; building without the cache", SettingWarning, stacklevel=3)
        return None


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
        return PYOPENCL_BUILD(self, options, devices, cache_dir)
    return cached_build(self, cache, options, devices, cache_dir)


_installed_build._asyncclcache_original = PYOPENCL_BUILD  # type: ignore[attr-defined]
_installed_build.__doc__ = PYOPENCL_BUILD.__doc__


def _stand_aside() -> str | None:
    from .config import get_config

    try:
        disable = get_config().disable
    except ValueError:
        return None  # a bad setting: said by _default_cache, as a warning
    if disable:
        return "ASYNCCLCACHE_DISABLE is set"
    if _pyopencl.no_cache_requested():
        return "PYOPENCL_NO_CACHE is set"
    return None


_said_aside = False


def install(cache: Cache | None = None) -> bool:
    """Route every ``pyopencl.Program(...).build()`` in the process through ``cache``.

    Covers ``pyopencl.array``, elementwise, reduction and scan kernels, loopy and
    user code. Idempotent and thread-safe; a second call switches the cache.
    Steps aside (returns False, says so once in the log) when
    ``PYOPENCL_NO_CACHE`` or ``ASYNCCLCACHE_DISABLE`` is set; where a setting is bad
    (the message names it), returns False with one :class:`~.errors.SettingWarning`.
    """
    global _installed_cache, _said_aside
    reason = _stand_aside()
    if reason is not None:
        with _install_lock:
            first = not _said_aside
            _said_aside = True
        if first:
            logger.info("asyncclcache.install(): not installing: %s", reason)
        return False
    chosen = cache or _default_cache()
    if chosen is None:
        return False
    with _install_lock:
        _installed_cache = chosen
        cl.Program.build = _installed_build  # type: ignore[method-assign]
    return True


def uninstall() -> None:
    """Restore pyopencl's own ``Program.build`` exactly. Idempotent and thread-safe."""
    global _installed_cache
    with _install_lock:
        cl.Program.build = PYOPENCL_BUILD  # type: ignore[method-assign]
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
