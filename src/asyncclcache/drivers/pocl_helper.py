"""The helper process: ``python -m asyncclcache.drivers.pocl_helper``.

For each request it builds the given source and options on the given devices, in
a fresh program object, and returns ``clGetProgramInfo(BINARIES)``. On pocl the
first such query compiles the generic variant into pocl's kernel cache (the
warm-up, docs/design.md F4); a later one packs every variant the main process has
compiled since (the snapshot, F11, F14). It runs at the lowest CPU priority and
exits when its parent does.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from typing import Any


def _lower_priority() -> str:
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        pass
    else:
        return "SCHED_IDLE"
    try:
        os.nice(19)
    except OSError:
        return "normal"
    return "nice 19"


def _watch_parent(parent: int) -> None:
    # stdin EOF covers a clean exit; this covers a parent killed while we compile.
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(0)


class _Devices:
    def __init__(self) -> None:
        import pyopencl as cl

        from asyncclcache.keys import device_identity

        self._cl = cl
        self._all = [
            (device_identity(d), d) for p in cl.get_platforms() for d in p.get_devices()
        ]
        self._contexts: dict[tuple[int, ...], Any] = {}

    def find(self, identities: list[dict[str, str]]) -> tuple[Any, list[Any]]:
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


def main() -> int:
    from asyncclcache.drivers import _wire

    # The protocol has private pipes (their fds in argv), so nothing printed by anyone, a
    # sitecustomize at start-up included, can reach it; stray prints go to stderr.
    inp = os.fdopen(int(sys.argv[1]), "rb")
    out = os.fdopen(int(sys.argv[2]), "wb")
    os.dup2(2, 1)
    priority = _lower_priority()
    # The main process already showed the user its build's warnings.
    warnings.simplefilter("ignore")
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()

    import pyopencl as cl

    from asyncclcache.binaries import program_binaries

    devices = _Devices()
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
            prg = cl._cl._Program(ctx, source)
            prg.build(options, devs)
            binaries = program_binaries(prg, devs)
            del prg
        except Exception as e:  # noqa: BLE001 - reported to the parent
            _wire.send(out, {"id": header.get("id"), "ok": False, "error": f"{type(e).__name__}: {e}"})
            continue
        _wire.send(
            out,
            {"id": header.get("id"), "ok": True, "seconds": time.perf_counter() - t0},
            binaries,
        )


if __name__ == "__main__":
    sys.exit(main())
