"""pyopencl's private names, in one place.

The drop-in build (:mod:`.program`), the binary check of a stored entry, kcache's probe
build and ``asyncclcache bake`` need a few things of ``pyopencl`` beyond its public
API: a program object that pyopencl's own cache does not touch (``_cl._Program``), the
build options as pyopencl processes them, its error path with the build log. A
pyopencl release that renames one of them breaks here, in one file, and nowhere else.
Thread-safe as pyopencl is: each call works on the objects it is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyopencl as cl
from pyopencl import _cl

__all__ = [
    "PYOPENCL_BUILD",
    "build_logs",
    "built_from_binaries",
    "built_from_source",
    "context_of",
    "include_path",
    "kernel_names",
    "no_cache_requested",
    "process_options",
    "set_built",
    "source_program",
    "unbuilt_source",
]

#: pyopencl's own ``Program.build``, whatever ``install()`` does later.
PYOPENCL_BUILD = getattr(cl.Program.build, "_asyncclcache_original", cl.Program.build)


def no_cache_requested() -> bool:
    """``PYOPENCL_NO_CACHE`` is set (pyopencl reads it once, at import)."""
    return bool(cl._PYOPENCL_NO_CACHE)


def unbuilt_source(prg: cl.Program) -> str | bytes | None:
    """The source of a source program not created yet; ``None`` for binaries, IL, or a
    program already built."""
    if getattr(prg, "_prg", None) is not None or not hasattr(prg, "_source"):
        return None
    return prg._source  # type: ignore[no-any-return]


def context_of(prg: cl.Program) -> cl.Context:
    return prg._context  # type: ignore[no-any-return]


def include_path(options: bytes) -> list[str]:
    """pyopencl's include path (``.``, then each ``-I`` folder) of options as
    :func:`process_options` gave them to the driver: split at spaces, so an option that
    held one (a folder name) reads otherwise, and a check that compares it finds no match."""
    return list(cl._find_include_path(options.decode("utf-8", "surrogateescape").split()))


def process_options(prg: cl.Program, options: str | Sequence[str] | None) -> tuple[bytes, list[str]]:
    """The options as pyopencl's own build passes them to the driver, and its include path."""
    options_bytes, include_path = prg._process_build_options(prg._context, options)
    return options_bytes, list(include_path)


def built_from_source(
    prg: cl.Program, context: cl.Context, source: str | bytes, options: bytes,
    devices: Sequence[cl.Device] | None,
) -> Any:
    """A new program built from ``source``: raises what pyopencl's uncached build raises
    (``pyopencl.RuntimeError`` with the build log)."""
    new = _cl._Program(context, source)
    prg._build_and_catch_errors(lambda: new.build(options, devices), options)
    return new


def built_from_binaries(
    context: cl.Context, devices: Sequence[cl.Device], binaries: Sequence[bytes], options: bytes,
) -> Any:
    """A new program built from ``binaries``, one per device; raises ``pyopencl.Error``."""
    built = _cl._Program(context, list(devices), list(binaries))
    built.build(options, list(devices))
    return built


def source_program(context: cl.Context, source: str | bytes) -> Any:
    """A source program that no cache of pyopencl's (nor an installed asyncclcache) sees."""
    return _cl._Program(context, source)


def set_built(prg: cl.Program, built: Any, description: str, hit: bool, seconds: float) -> None:
    """Make ``prg`` the built program ``built``, as pyopencl's ``build()`` leaves it."""
    prg._prg = built
    prg._build_duration_info = (description, hit, seconds)


def build_logs(program: Any) -> list[str]:
    """The per-device build logs, or ``[]`` when all are empty (the usual case)."""
    try:
        logs = [log or "" for _dev, log in program._get_build_logs()]
    except cl.Error:
        return []
    return logs if any(log.strip() for log in logs) else []


def kernel_names(program: Any) -> list[str]:
    """The program's kernel names, sorted (``[]`` where the driver does not say)."""
    try:
        names = program.get_info(cl.program_info.KERNEL_NAMES)
    except cl.Error:
        return []
    return sorted(n for n in names.split(";") if n)
