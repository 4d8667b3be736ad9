"""Activation without a code change: ``install()`` as soon as the program imports pyopencl.

``asyncclcache-startup.pth`` (installed next to the package in site-packages) is one
line that Python's ``site`` module runs at every interpreter start. With
``ASYNCCLCACHE_INSTALL`` unset or ``0`` it is one environment lookup and imports
nothing. With ``1`` it calls :func:`on_startup`, which puts a finder at the front of
``sys.meta_path``: when ``pyopencl`` is first imported, :func:`asyncclcache.install`
runs right after pyopencl's own ``__init__``, before the program can build anything (where
a module of ours, half imported, imported pyopencl: at the first ``Program.build``).
A process that never imports pyopencl never loads it (nor asyncclcache's cache).
``asyncclcache run`` uses the same hook in its own process.

Process-safe by construction (per process); :func:`activate` is idempotent and
thread-safe (the import system's lock serializes the finder).
"""

from __future__ import annotations

# Only what `site` already loaded, and threading: this runs in every interpreter that sets
# the variable, OpenCL or not (benchmarks/startup.py measures it).
import os
import sys
import threading

from ._flags import parse_bool

TYPE_CHECKING = False
if TYPE_CHECKING:
    import importlib.machinery
    from collections.abc import Sequence
    from types import ModuleType
    from typing import Any

__all__ = ["activate", "on_startup"]

_lock = threading.Lock()
_done = False


def on_startup() -> None:
    """Called by the ``.pth`` line when ``ASYNCCLCACHE_INSTALL`` looks set. Never raises:
    a bad setting or a broken installation is one line on stderr, and Python starts."""
    try:
        if parse_bool(os.environ.get("ASYNCCLCACHE_INSTALL"), name="ASYNCCLCACHE_INSTALL"):
            activate()
    except Exception as e:  # noqa: BLE001 - never break the interpreter's start-up
        sys.stderr.write(f"asyncclcache: ASYNCCLCACHE_INSTALL: not activated: {e}\n")


def activate() -> None:
    """Install the cache now if pyopencl is imported, else right after it is.

    Also arranges the exit summary when ``ASYNCCLCACHE_STATS=1``.
    """
    global _done
    with _lock:
        if _done:
            return
        _done = True
    if parse_bool(os.environ.get("ASYNCCLCACHE_STATS"), name="ASYNCCLCACHE_STATS"):
        from . import summary

        summary.register()
    if "pyopencl" in sys.modules:
        _install()
    else:
        sys.meta_path.insert(0, _PyopenclFinder())


def _install(*, at_once: bool = False) -> None:
    if not at_once and _ours_importing():
        # pyopencl came with a module of ours that is still being imported (``import
        # asyncclcache.cache`` before pyopencl): ours cannot be imported from here. Every
        # build goes through Program.build, so install at the first one.
        _install_at_first_build()
        return
    try:
        from .program import install

        install()
    except Exception as e:  # noqa: BLE001 - the program runs on, uncached
        sys.stderr.write(f"asyncclcache: install() failed, running uncached: {type(e).__name__}: {e}\n")


def _ours_importing() -> bool:
    # importlib marks a module's spec while its code runs (CPython's ``_initializing``).
    return any(getattr(getattr(m, "__spec__", None), "_initializing", False)
               for name, m in list(sys.modules.items())
               if name == "asyncclcache" or name.startswith("asyncclcache."))


def _install_at_first_build() -> None:
    import pyopencl as cl

    plain = cl.Program.build

    def build(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _lock:
            first = cl.Program.build is build
            if first:
                cl.Program.build = plain  # type: ignore[method-assign]
        if first:
            # At once: another thread's import of ours, if any, is waited for by the import
            # system (the half-imported module is only this thread's own cycle).
            _install(at_once=True)
        now = cl.Program.build
        return (plain if now is build else now)(self, *args, **kwargs)

    build._asyncclcache_original = plain  # type: ignore[attr-defined]  # _pyopencl.PYOPENCL_BUILD
    cl.Program.build = build  # type: ignore[method-assign]


class _PyopenclFinder:  # a meta path finder (importlib.abc would cost 20 ms to import)
    """Finds nothing itself: asks the other finders for ``pyopencl`` and makes its
    loader call :func:`_install` once the module has run. Removes itself then."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "pyopencl":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):  # type: ignore[comparison-overlap]
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        self._remove()
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if loader is None or exec_module is None:
            return spec
        # The real loader stays the spec's loader (importlib.resources asks it for pyopencl's
        # headers); only this instance's exec_module gains a step after it.

        def exec_then_install(module: ModuleType) -> None:
            exec_module(module)
            _install()

        loader.exec_module = exec_then_install  # type: ignore[method-assign]
        return spec

    def _remove(self) -> None:
        if self in sys.meta_path:  # another thread's import may have got there first
            sys.meta_path.remove(self)  # type: ignore[arg-type]
