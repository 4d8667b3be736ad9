"""The binary query through ctypes (GIL released) and its fallbacks, on real pocl."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyopencl as cl
import pytest

from asyncclcache import binaries
from asyncclcache.errors import BinaryQueryError

SRC = "__kernel void f(__global int *a) { a[0] = 1; }"


@pytest.fixture
def fresh_lib(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(binaries, "_lib", None)


def test_the_query_uses_the_loader_pyopencl_loaded(cl_ctx: Any, fresh_lib: None) -> None:
    prg = cl.Program(cl_ctx, SRC).build()
    assert binaries._opencl() is not None
    assert binaries.program_binaries(prg, cl_ctx.devices) == prg.get_info(cl.program_info.BINARIES)


def test_without_proc_the_loader_bundled_with_pyopencl(cl_ctx: Any, fresh_lib: None,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # What macOS gives: no /proc. The wheel's own loader, found beside its extension.
    monkeypatch.setenv("ASYNCCLCACHE_TEST_NO_OS_FACILITIES", "1")
    lib = binaries._opencl()
    bundled = binaries.glob.glob(str(Path(cl._cl.__file__).parent / ".libs" / "libOpenCL*"))
    if not bundled:
        pytest.skip("this pyopencl bundles no OpenCL loader")
    assert lib is not None and lib._name == bundled[0]
    prg = cl.Program(cl_ctx, SRC).build()
    assert binaries.program_binaries(prg, cl_ctx.devices) == prg.get_info(cl.program_info.BINARIES)


def test_without_proc_nor_a_loader_found_the_query_fails_cleanly(cl_ctx: Any, fresh_lib: None,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # No probe names the loader: never one guessed by name (another ICD loader than
    # pyopencl's crashed pocl 7.1's helpers with SIGSEGV), nor pyopencl's query (the GIL, F2).
    monkeypatch.setenv("ASYNCCLCACHE_TEST_NO_OS_FACILITIES", "1")
    monkeypatch.setattr(binaries.glob, "glob", lambda pattern: [])
    prg = cl.Program(cl_ctx, SRC).build()
    assert binaries._opencl() is None
    with pytest.raises(BinaryQueryError, match="cannot be found"):
        binaries.program_binaries(prg, cl_ctx.devices)
