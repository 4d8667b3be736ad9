"""The helper process, started by :class:`~.pocl.HelperDriver` through
:func:`asyncclcache.system.start_helper`, which calls :func:`main` with the fds of its
two pipes in argv.

For each request it builds the given source and options on the given devices, in
a fresh program object, in the caller's working directory (the request's ``cwd``),
and returns ``clGetProgramInfo(BINARIES)``. On pocl the first such query compiles
the generic variant into pocl's kernel cache (the warm-up, docs/design.md F4); a
later one packs every variant the main process has compiled since (the snapshot,
F11, F14). Its environment holds the ``POCL_*`` settings of the jobs it serves
(the driver starts another helper for other settings). It runs at the lowest CPU
priority, in a session of its own with SIGINT ignored, and exits at EOF on its
request pipe or when its parent is gone (:mod:`asyncclcache.system`). One request at a
time, one thread.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any


class Devices:
    """This process's OpenCL devices, found by identity (:func:`~asyncclcache.keys.device_identity`),
    with one context per set of them (the helper, and ``asyncclcache bake``'s workers). Not
    thread-safe: one per process."""

    def __init__(self) -> None:
        import pyopencl as cl

        from asyncclcache.keys import device_identity

        self._cl = cl
        self._all = [
            (device_identity(d), d) for p in cl.get_platforms() for d in p.get_devices()
        ]
        self._contexts: dict[tuple[int, ...], Any] = {}

    def find(self, identities: Sequence[dict[str, str]]) -> tuple[Any, list[Any]]:
        """``(context, devices)`` for ``identities``; ``LookupError`` where one is not here."""
        devices = []
        for ident in identities:
            match = [d for i, d in self._all if i == ident]
            if not match:
                raise LookupError(f"no device matches {ident.get('device_name')!r}")
            devices.append(match[0])
        ids = tuple(d.int_ptr for d in devices)
        ctx = self._contexts.get(ids)
        if ctx is None:
            ctx = self._contexts[ids] = self._cl.Context(devices)
        return ctx, devices


def _enter(cwd: object) -> None:
    """Work in the caller's folder, where its relative ``-I`` folders and quoted includes
    resolve as the key resolved them; a request without one fails (nothing is stored)."""
    if not isinstance(cwd, str) or not cwd:
        raise LookupError("the request names no working directory")
    try:
        os.chdir(cwd)
    except OSError as e:
        raise OSError(f"cannot enter the caller's working directory: {e}") from None


def main() -> int:
    from asyncclcache.drivers import _wire

    # The protocol has private pipes (their fds in argv), so nothing printed by anyone, a
    # sitecustomize at start-up included, can reach it; stray prints go to stderr.
    inp = os.fdopen(int(sys.argv[1]), "rb")
    out = os.fdopen(int(sys.argv[2]), "wb")
    os.dup2(2, 1)
    # Its start-up (system.start_helper) lowered its priority, set its death with the
    # parent (the request pipe's EOF is a clean exit) and left no relative import path:
    # requests move the working directory, and the caller's folder is never imported from.
    from asyncclcache import system

    if system.started is None:
        raise SystemExit("start the helper with asyncclcache.system.start_helper")
    priority = system.started.priority
    # The main process already showed the user its build's warnings.
    warnings.simplefilter("ignore")

    from asyncclcache import _pyopencl
    from asyncclcache.binaries import program_binaries

    devices = Devices()
    _wire.send(out, {"op": "hello", "pid": os.getpid(), "priority": priority})
    while True:
        try:
            header, payloads = _wire.recv(inp)
        except _wire.WireError:
            return 0
        if header.get("op") == "exit":
            return 0
        t0 = time.perf_counter()
        try:
            source, options = payloads
            ctx, devs = devices.find(header["devices"])
            _enter(header.get("cwd"))
            prg = _pyopencl.source_program(ctx, source)
            prg.build(options, devs)
            binaries = program_binaries(prg, devs)
            del prg
        except Exception as e:  # noqa: BLE001 - reported to the parent
            _wire.send(out, {"id": header.get("id"), "ok": False, "error": f"{type(e).__name__}: {e}"})
            continue
        finally:
            # Between requests the helper pins no folder of the caller's.
            with contextlib.suppress(OSError):
                os.chdir("/")
        _wire.send(
            out,
            {"id": header.get("id"), "ok": True, "seconds": time.perf_counter() - t0},
            binaries,
        )


if __name__ == "__main__":
    sys.exit(main())
