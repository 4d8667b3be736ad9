"""pocl, picked by its platform name: for the tests and for the child scripts they run.

Never ``cl.get_platforms()[0]``: on a machine with another OpenCL driver installed the
first platform need not be pocl, and every test here is about pocl. Children import
this module like :mod:`kernels` (``tests/`` is on their ``PYTHONPATH``: see
``conftest.run_child``). No side effects on import; pyopencl is imported on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PoclMissingError", "pocl_context", "pocl_devices", "pocl_platform"]


class PoclMissingError(RuntimeError):
    """pocl is not among this machine's OpenCL platforms."""


def pocl_platform() -> Any:
    """The pocl platform ("Portable Computing Language"); :class:`PoclMissingError` if absent."""
    import pyopencl as cl

    from asyncclcache.platforms.pocl import NAME as POCL_PLATFORM_NAME

    try:
        platforms = cl.get_platforms()
    except cl.Error as e:  # no ICD at all: clGetPlatformIDs fails
        platforms, why = [], f" ({e})"
    else:
        why = ""
    for p in platforms:
        if p.name == POCL_PLATFORM_NAME:
            return p
    raise PoclMissingError(
        f"pocl (OpenCL platform {POCL_PLATFORM_NAME!r}) is not installed; found "
        f"{[p.name for p in platforms]}{why}. Install it: apt-get install pocl-opencl-icd"
    )


def pocl_devices() -> list[Any]:
    """All devices of the pocl platform."""
    return pocl_platform().get_devices()


def pocl_context(ndevices: int | None = 1) -> Any:
    """A context on pocl's first ``ndevices`` devices (all of them for ``None``)."""
    import pyopencl as cl

    devices = pocl_devices()
    return cl.Context(devices if ndevices is None else devices[:ndevices])
