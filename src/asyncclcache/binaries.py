"""``clGetProgramInfo(CL_PROGRAM_BINARIES)`` through ctypes, with the GIL released.

pyopencl's ``get_info(BINARIES)`` holds the GIL for the whole call, and on pocl
that call compiles (docs/design.md F1, F2). A ctypes call releases the GIL and returns
the same bytes. The OpenCL library used is the one pyopencl itself loaded: where the
system says which (:func:`.system.loaded_library`), else the loader bundled in pyopencl's
wheel, else the one of its environment's prefix (conda). Never one guessed by name: it
may be another ICD loader than pyopencl's (macOS has Apple's beside conda's), and calling
it with pyopencl's objects crashed (SIGSEGV, pocl 7.1). Where none is found the query
fails (:class:`BinaryQueryError`, counted as a background error): pyopencl's own query
would hold the GIL (F2).
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .errors import BinaryQueryError

if TYPE_CHECKING:
    import pyopencl as cl

__all__ = ["BinaryQueryError", "program_binaries"]

CL_SUCCESS = 0
CL_PROGRAM_NUM_DEVICES = 0x1162
CL_PROGRAM_DEVICES = 0x1163
CL_PROGRAM_BINARY_SIZES = 0x1165
CL_PROGRAM_BINARIES = 0x1166

_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()


def _find_loaded_opencl() -> str | None:
    import pyopencl._cl  # make sure pyopencl's loader is mapped

    from .system import loaded_library

    path = loaded_library("libOpenCL")
    if path is None:
        # Not said (no /proc): the loader auditwheel or delocate bundled beside pyopencl's
        # extension, which is the one it loaded; else a conda build's, in its prefix.
        here = os.path.dirname(pyopencl._cl.__file__)
        for pattern in (os.path.join(here, ".libs", "libOpenCL*"), os.path.join(here, ".dylibs", "libOpenCL*"),
                        os.path.join(os.path.dirname(here), "pyopencl.libs", "libOpenCL*"),
                        os.path.join(sys.prefix, "lib", "libOpenCL*")):
            found = {os.path.realpath(f) for f in glob.glob(pattern)}
            if found:
                path = found.pop() if len(found) == 1 else None  # several: which is unknown
                break
    return path


_NOT_FOUND = object()


def _opencl() -> ctypes.CDLL | None:
    global _lib
    with _lib_lock:
        if _lib is None:
            path = _find_loaded_opencl()
            if path is None:
                _lib = _NOT_FOUND  # type: ignore[assignment]
                return None
            lib = ctypes.CDLL(path)
            fn = lib.clGetProgramInfo
            fn.restype = ctypes.c_int32
            fn.argtypes = [
                ctypes.c_void_p,
                ctypes.c_uint32,
                ctypes.c_size_t,
                ctypes.c_void_p,
                ctypes.POINTER(ctypes.c_size_t),
            ]
            _lib = lib
        return None if _lib is _NOT_FOUND else _lib


def _info(prg: int, param: int, size: int, value: Any, what: str) -> None:  # value: a ctypes object
    # ctypes.CDLL functions release the GIL for the duration of the call.
    status = _opencl().clGetProgramInfo(  # type: ignore[union-attr]
        ctypes.c_void_p(prg), param, size, ctypes.cast(value, ctypes.c_void_p), None
    )
    if status != CL_SUCCESS:
        raise BinaryQueryError(what, status)


def program_binaries(program: cl.Program | cl._cl._Program, devices: Sequence[cl.Device]) -> list[bytes]:
    """The program's binaries for ``devices``, in that order, without holding the GIL.

    Thread-safe as far as the driver is: do not call it on pocl in a process that
    launches kernels (docs/design.md F3, F13); only ``asyncclcache bake``'s workers query pocl.
    Raises :class:`BinaryQueryError`, or ``ValueError`` if a device has no binary.
    """
    if _opencl() is None:
        raise BinaryQueryError("BINARIES", 0, why="the OpenCL loader pyopencl uses cannot be found here "
                               "(no /proc, none bundled with pyopencl or in its prefix)")
    ptr = program.int_ptr
    n = ctypes.c_uint32()
    _info(ptr, CL_PROGRAM_NUM_DEVICES, ctypes.sizeof(n), ctypes.pointer(n), "NUM_DEVICES")
    count = n.value
    dev_ids = (ctypes.c_void_p * count)()
    _info(ptr, CL_PROGRAM_DEVICES, ctypes.sizeof(dev_ids), dev_ids, "DEVICES")
    sizes = (ctypes.c_size_t * count)()
    _info(ptr, CL_PROGRAM_BINARY_SIZES, ctypes.sizeof(sizes), sizes, "BINARY_SIZES")
    buffers = [ctypes.create_string_buffer(max(int(s), 1)) for s in sizes]
    ptrs = (ctypes.c_void_p * count)(*[ctypes.cast(b, ctypes.c_void_p) for b in buffers])
    _info(ptr, CL_PROGRAM_BINARIES, ctypes.sizeof(ptrs), ptrs, "BINARIES")
    by_device = {int(dev_ids[i] or 0): buffers[i].raw[: sizes[i]] for i in range(count)}
    out = []
    for dev in devices:
        blob = by_device.get(dev.int_ptr)
        if not blob:
            raise ValueError(f"no binary for device {dev.name!r}")
        out.append(blob)
    return out

