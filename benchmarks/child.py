"""One measurement, in a fresh process: ``python benchmarks/child.py SPEC.json``.

Started by run.py with a fresh ``POCL_CACHE_DIR`` and ``XDG_CACHE_HOME`` in its
environment (and ``PYOPENCL_NO_CACHE=1`` for the no-cache variant). Writes its
numbers as JSON to ``spec["out"]``. Tasks:

* ``describe``: platform, device and versions.
* ``first_result``: build + launch + check every program of a workload; the time
  from before the first build (cache creation included) to the last check. Then,
  untimed, ``flush()`` and ``close()`` the asyncclcache cache.
* ``stall``: a probe (``tick``: a Python loop's longest gap; ``launch``: the longest
  launch of an already compiled small kernel) while binary work runs.
* ``throughput``: build + launch + check a workload once and exit; run.py times the
  whole process, interpreter exit (asyncclcache's atexit flush) included.
* ``suite``: a test suite as CI runs it (suite.py): test t, in a new context, builds the
  ``suite`` programs t-C+1..t (each program in C consecutive tests), launches and checks
  each kernel; the CPU of the caller's thread in ``build()`` outside the driver's own build
  call, per build (the cache's own, on top of pyopencl's). Exits as a test run does.

Variants: ``nocache`` (pyopencl, ``PYOPENCL_NO_CACHE=1``), ``default`` (pyopencl as
installed: on pocl and NVIDIA it leaves caching to the driver's kernel cache),
``pyopencl`` (pyopencl's binary cache forced on), ``pyopencl-spec0`` (the same with
``POCL_WORK_GROUP_SPECIALIZATION=0``, set by run.py: generic variants only), ``acc`` /
``acc-thread`` (asyncclcache with strategy auto (kcache on pocl) / thread), ``acc-shared``
(auto, one directory for all ranks; ``acc`` is rank-local), ``acc-baked`` (auto; run.py
bakes its directory between the cold and the warm run), ``acc-idle`` (auto with
``ASYNCCLCACHE_BAKE=idle``, set by run.py).

``first_result`` also times steps 2..N (``steps``, default 5): every kernel launched again,
so the kernel time shows what work-group specialization is worth.

A spec with ``start_at`` (a ``time.time()`` value) waits until then before its timed
part: run.py starts the ranks of one measurement together that way.
"""

from __future__ import annotations

import atexit
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

pc = time.perf_counter
T_START = pc()

SPEC: dict[str, Any] = json.loads(Path(sys.argv[1]).read_text())
RESULT: dict[str, Any] = {"task": SPEC["task"], "variant": SPEC.get("variant"), "pid": os.getpid()}
CACHE: Any = None  # the asyncclcache.Cache, when the variant has one


def _write(path: str, data: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    Path(tmp).write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def _count_entries(directory: str | None) -> int | None:
    # Not where the parent counts operations on the directory (nodes): a listing is its own.
    if not directory or SPEC.get("count_entries") is False or not os.path.isdir(directory):
        return None
    return sum(1 for _ in Path(directory).rglob("*.acl"))


def _final_hook() -> None:
    # Registered before asyncclcache is imported, so it runs *after* its atexit close.
    if SPEC["task"] not in ("throughput", "suite"):
        return
    final = {
        "exit_hook_s": pc() - T_START,
        "entries": _count_entries(SPEC.get("acc_dir")),
    }
    if CACHE is not None:
        final["stats"] = CACHE.stats().as_dict()
    _write(SPEC["out"] + ".final", final)


atexit.register(_final_hook)

import numpy as np  # noqa: E402
import pyopencl as cl  # noqa: E402
from workloads import WORK_ITEMS, WORKLOADS, Prog, small  # noqa: E402

RESULT["import_s"] = pc() - T_START
VARIANT: str = SPEC.get("variant") or "nocache"
ACC_STRATEGY = {"acc": "auto", "acc-shared": "auto", "acc-ranklocal": "auto", "acc-thread": "thread",
                "acc-baked": "auto", "acc-idle": "auto"}


def _acc_cache() -> Any:
    global CACHE
    t = pc()
    import asyncclcache as acc

    RESULT["acc_import_s"] = pc() - t  # once per process, inside the timed part

    # Ranks share the directory by default (run.py's environment turns node-local copies off
    # for acc-shared); a directory per rank is the option.
    CACHE = acc.Cache(SPEC["acc_dir"], strategy=ACC_STRATEGY[VARIANT],
                      rank_local=True if VARIANT == "acc-ranklocal" else None)
    return CACHE


def make_builder(ctx: cl.Context) -> Callable[[str], Any]:
    """A function source -> built program, for this variant. Creates the cache (timed)."""
    if VARIANT in ("nocache", "default"):
        # run.py sets PYOPENCL_NO_CACHE=1 for nocache only.
        assert (VARIANT == "nocache") == cl._PYOPENCL_NO_CACHE
        return lambda src: cl.Program(ctx, src).build()
    if VARIANT.startswith("pyopencl"):
        import pyopencl.characterize

        # pyopencl >= 2024.2.3 switches its binary cache off for pocl; force it on.
        pyopencl.characterize.has_src_build_cache = lambda dev: False
        d = SPEC["pyopencl_dir"]
        return lambda src: cl.Program(ctx, src).build(cache_dir=d)
    cache = _acc_cache()
    from asyncclcache import Program

    return lambda src: Program(ctx, src, cache=cache).build()


class Bench:
    def __init__(self, keep: bool = False) -> None:
        self.ctx = cl.create_some_context(interactive=False)
        self.queue = cl.CommandQueue(self.ctx)
        self.dev = self.ctx.devices[0]
        rng = np.random.default_rng(0)
        self.a = rng.random(WORK_ITEMS, dtype=np.float32)
        self.b = rng.random(WORK_ITEMS, dtype=np.float32)
        self.c = np.empty_like(self.a)
        mf = cl.mem_flags
        self.ad = cl.Buffer(self.ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=self.a)
        self.bd = cl.Buffer(self.ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=self.b)
        self.cd = cl.Buffer(self.ctx, mf.WRITE_ONLY, self.a.nbytes)
        self.build_descr: dict[str, int] = {}
        # Programs kept for steps 2..N (first_result only: a short-lived program is dropped).
        self.keep = keep
        self.built: list[tuple[Any, Prog]] = []

    def launch_check(self, prg: Any, prog: Prog) -> None:
        for k in prog.kernels:
            knl = getattr(prg, k.name)
            knl(self.queue, (WORK_ITEMS,), None, self.ad, self.bd, self.cd)
            cl.enqueue_copy(self.queue, self.c, self.cd)  # blocking
            if not np.allclose(self.c, k.expected(self.a, self.b), rtol=1e-5, atol=1e-6):
                raise AssertionError(f"wrong result from kernel {k.name}")

    def run(self, progs: list[Prog], build: Callable[[str], Any]) -> dict[str, float]:
        t_build = t_launch = 0.0
        for p in progs:
            t0 = pc()
            prg = build(p.source())
            t1 = pc()
            self.launch_check(prg, p)
            t2 = pc()
            if self.keep:
                self.built.append((prg, p))
            t_build += t1 - t0
            t_launch += t2 - t1
            descr = getattr(prg, "_build_duration_info", None)
            if descr:
                self.build_descr[descr[0]] = self.build_descr.get(descr[0], 0) + 1
        return {"build_s": t_build, "launch_s": t_launch}


def _stats() -> dict[str, Any] | None:
    return CACHE.stats().as_dict() if CACHE is not None else None


# {{{ tasks


def task_describe() -> None:
    ctx = cl.create_some_context(interactive=False)
    dev = ctx.devices[0]
    import pyopencl.characterize as ch

    import asyncclcache
    from asyncclcache.drivers import auto_reason, auto_strategy

    RESULT.update(
        platform_name=dev.platform.name,
        platform_version=dev.platform.version,
        device_name=dev.name,
        device_type="+".join(t for t in ("CPU", "GPU", "ACCELERATOR")
                             if dev.type & getattr(cl.device_type, t)) or str(dev.type),
        auto_strategy=auto_strategy(ctx.devices),
        auto_reason=auto_reason(ctx.devices),
        pyopencl_default_binary_cache=not ch.has_src_build_cache(dev),
        device_version=dev.version,
        driver_version=dev.driver_version,
        compute_units=dev.max_compute_units,
        pyopencl=cl.VERSION_TEXT,
        numpy=np.__version__,
        python=sys.version.split()[0],
        asyncclcache=asyncclcache.__version__,
        asyncclcache_path=os.path.dirname(asyncclcache.__file__),
    )


def task_first_result() -> None:
    bench = Bench(keep=True)
    progs = WORKLOADS[SPEC["workload"]](**SPEC.get("workload_args", {}))
    start_at = SPEC.get("start_at")
    if start_at:  # ranks: released together, like after MPI_Init
        while time.time() < start_at:
            time.sleep(0.001)
    t0 = pc()
    build = make_builder(bench.ctx)
    parts = bench.run(progs, build)
    t1 = pc()
    RESULT.update(first_result_s=t1 - t0, programs=len(progs), **parts)
    # Steps 2..N of a simulation: the same kernels again (compiled now, whatever the variant).
    steps = int(SPEC.get("steps", 5))
    ts = pc()
    for _ in range(steps - 1):
        for prg, p in bench.built:
            bench.launch_check(prg, p)
    RESULT["steps_s"] = pc() - ts
    RESULT["steps"] = steps
    if CACHE is not None:
        RESULT["strategies_used"] = sorted(CACHE.drivers)
    RESULT["build_descr"] = bench.build_descr
    RESULT["stats_timed"] = _stats()
    if CACHE is not None:
        t2 = pc()
        RESULT["flush_done"] = CACHE.flush(SPEC.get("flush_timeout", 600))
        t3 = pc()
        RESULT["stats_flushed"] = _stats()
        RESULT["close_done"] = CACHE.close(SPEC.get("close_timeout", 120))
        t4 = pc()
        RESULT.update(flush_s=t3 - t2, close_s=t4 - t3, stats_final=_stats())
        RESULT["entries"] = _count_entries(SPEC["acc_dir"])


def _tick_probe(stop: Callable[[], bool]) -> dict[str, Any]:
    """A Python loop on the main thread; its longest gap between two iterations."""
    start = prev = pc()
    n = 0
    big: list[tuple[float, float]] = []  # (at, gap) for gaps > 1 ms
    mx = 0.0
    while not stop():
        now = pc()
        g = now - prev
        prev = now
        n += 1
        if g > mx:
            mx = g
        if g > 1e-3:
            big.append((now - start, g))
    end = pc()
    return {
        "window_s": end - start,
        "iterations": n,
        "max_ms": mx * 1e3,
        "over_1ms": len(big),
        "over_5ms": sum(1 for _, g in big if g > 5e-3),
        "over_20ms": sum(1 for _, g in big if g > 20e-3),
        "worst": sorted(big, key=lambda x: -x[1])[:5],
    }


class SmallKernel:
    """An already compiled tiny kernel, launched and finished repeatedly."""

    def __init__(self, bench: Bench) -> None:
        prog = small()
        self.prg = cl._cl._Program(bench.ctx, prog.source())
        self.prg.build(b"")
        self.knl = cl.Kernel(self.prg, prog.kernels[0].name)
        self.q = bench.queue
        self.args = (bench.ad, bench.bd, bench.cd)
        for _ in range(3):
            self.launch()

    def launch(self) -> None:
        self.knl(self.q, (1024,), None, *self.args)
        self.q.finish()

    def probe(self, stop: Callable[[], bool]) -> dict[str, Any]:
        start = pc()
        times = []
        worst_at = 0.0
        mx = 0.0
        while not stop():
            t = pc()
            self.launch()
            dt = pc() - t
            times.append(dt)
            if dt > mx:
                mx, worst_at = dt, t - start
        end = pc()
        times.sort()
        return {
            "window_s": end - start,
            "launches": len(times),
            "max_ms": (times[-1] if times else 0.0) * 1e3,
            "worst_at_s": worst_at,
            "median_ms": (statistics.median(times) if times else 0.0) * 1e3,
            "p99_ms": (times[int(0.99 * (len(times) - 1))] if times else 0.0) * 1e3,
            "over_5ms": sum(1 for t in times if t > 5e-3),
        }


def task_stall() -> None:
    """Probe the main thread while the seed program's binary work runs.

    window ``after_launch``: asyncclcache; from after the cold build + first launch
    until ``flush()`` returns. ``after_build``: from ``build()``'s return until
    ``flush()`` returns (the whole background work; the seed is launched after).
    ``thread_build``: pyopencl's forced-cache build (source build +
    ``get_info(BINARIES)`` + write) runs in a thread. ``idle``: no background
    work, a fixed time (reference).
    """
    bench = Bench()
    sk = SmallKernel(bench)
    probe_name = SPEC["probe"]
    window = SPEC["window"]
    seed = WORKLOADS["seed"](**SPEC.get("workload_args", {}))[0]

    def probe(stop: Callable[[], bool]) -> dict[str, Any]:
        return _tick_probe(stop) if probe_name == "tick" else sk.probe(stop)

    # Reference on this process before anything runs in the background.
    until = pc() + 0.5
    RESULT["baseline"] = probe(lambda: pc() > until)

    t0 = pc()
    flushed: dict[str, Any] = {}
    if window == "idle":
        prg = make_builder(bench.ctx)(seed.source())
        bench.launch_check(prg, seed)
        RESULT["first_result_s"] = pc() - t0
        until = pc() + SPEC.get("idle_s", 10.0)
        RESULT["window"] = probe(lambda: pc() > until)
    elif window == "thread_build":
        build = make_builder(bench.ctx)
        box: dict[str, Any] = {}
        th = threading.Thread(target=lambda: box.update(prg=build(seed.source())))
        th.start()
        RESULT["window"] = probe(lambda: not th.is_alive())
        th.join()
        bench.launch_check(box["prg"], seed)
        RESULT["first_result_s"] = pc() - t0
    else:
        build = make_builder(bench.ctx)
        prg = build(seed.source())
        RESULT["build_s"] = pc() - t0
        if window == "after_launch":
            bench.launch_check(prg, seed)
            RESULT["first_result_s"] = pc() - t0

        def _flush() -> None:
            flushed["done"] = CACHE.flush(SPEC.get("flush_timeout", 300))
            flushed["at_s"] = pc() - t0

        th = threading.Thread(target=_flush)
        th.start()
        RESULT["window"] = probe(lambda: not th.is_alive())
        th.join()
        if window == "after_build":
            t1 = pc()
            bench.launch_check(prg, seed)
            RESULT["first_launch_after_s"] = pc() - t1
        RESULT["flush"] = flushed
        RESULT["stats"] = _stats()
        CACHE.close(60)
        RESULT["entries"] = _count_entries(SPEC["acc_dir"])


def task_throughput() -> None:
    bench = Bench()
    progs = WORKLOADS["throughput"](**SPEC.get("workload_args", {}))
    t0 = pc()
    build = make_builder(bench.ctx)
    parts = bench.run(progs, build)
    RESULT.update(work_s=pc() - t0, programs=len(progs), **parts)
    RESULT["stats_at_end_of_work"] = _stats()
    RESULT["end_of_work_s"] = pc() - T_START
    # No close(): the process exits and asyncclcache's atexit handler flushes (bounded).


def task_suite() -> None:
    progs = WORKLOADS["suite"](**SPEC.get("workload_args", {}))
    contexts = int(SPEC.get("contexts", 4))
    options = ["-I", SPEC["include_dir"]]
    dev = cl.create_some_context(interactive=False).devices[0]
    thread_time = time.thread_time
    in_driver = [0.0]
    driver_build = cl._cl._Program.build

    def timed_build(self: Any, *a: Any, **k: Any) -> Any:  # the driver's build, source or binary
        t = thread_time()
        try:
            return driver_build(self, *a, **k)
        finally:
            in_driver[0] += thread_time() - t

    cl._cl._Program.build = timed_build
    rng = np.random.default_rng(0)
    n = 4096
    a, b = rng.random(n, dtype=np.float32), rng.random(n, dtype=np.float32)
    c = np.empty_like(a)
    t0 = pc()
    if VARIANT.startswith("acc"):
        cache = _acc_cache()
        from asyncclcache import Program

        def build(ctx: cl.Context, src: str) -> Any:
            return Program(ctx, src, cache=cache).build(options)
    else:
        def build(ctx: cl.Context, src: str) -> Any:
            return cl.Program(ctx, src).build(options)
    in_build = 0.0
    builds = 0
    descr: dict[str, int] = {}
    for t in range(len(progs) + contexts - 1):
        ctx = cl.Context([dev])
        queue = cl.CommandQueue(ctx)
        mf = cl.mem_flags
        ad = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=a)
        bd = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=b)
        cd = cl.Buffer(ctx, mf.WRITE_ONLY, a.nbytes)
        for p in progs[max(0, t - contexts + 1):t + 1]:
            c0 = thread_time()
            prg = build(ctx, p.source())
            in_build += thread_time() - c0
            builds += 1
            what = getattr(prg, "_build_duration_info", None)
            if what:
                descr[what[0]] = descr.get(what[0], 0) + 1
            for k in p.kernels:
                getattr(prg, k.name)(queue, (n,), None, ad, bd, cd)
                cl.enqueue_copy(queue, c, cd)
                if not np.allclose(c, p.check(k.name, a, b), rtol=1e-5, atol=1e-5):  # type: ignore[attr-defined]
                    raise AssertionError(f"wrong result from kernel {k.name}")
    RESULT.update(work_s=pc() - t0, builds=builds, programs=len(progs), contexts=contexts,
                  build_descr=descr, own_cpu_ms=1e3 * (in_build - in_driver[0]) / max(1, builds),
                  driver_cpu_ms=1e3 * in_driver[0] / max(1, builds))
    RESULT["stats_at_end_of_work"] = _stats()
    # No close(): the process exits as a test run does (asyncclcache's atexit flush).


# }}}


def main() -> None:
    task = SPEC["task"]
    {
        "describe": task_describe,
        "first_result": task_first_result,
        "stall": task_stall,
        "throughput": task_throughput,
        "suite": task_suite,
    }[task]()
    RESULT["child_s"] = pc() - T_START
    _write(SPEC["out"], RESULT)


if __name__ == "__main__":
    main()
