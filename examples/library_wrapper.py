"""``asyncclcache.install()``: cache every PyOpenCL program without touching the code that
builds them. The function below is ordinary pyopencl code (arrays, elementwise, reduction,
scan and a hand-written Program); install() routes all its builds through the cache.

Run it twice: the second run loads every program from the cache.
"""

from __future__ import annotations

import sys
import time

import numpy as np


def unchanged_pyopencl_code(ctx, queue) -> float:
    """Plain pyopencl, unaware of asyncclcache."""
    import pyopencl as cl
    import pyopencl.array as cla
    from pyopencl.elementwise import ElementwiseKernel
    from pyopencl.reduction import ReductionKernel
    from pyopencl.scan import InclusiveScanKernel

    rng = np.random.default_rng(42)
    a = cla.to_device(queue, rng.random(10_000, dtype=np.float32))
    b = cla.to_device(queue, rng.random(10_000, dtype=np.float32))
    lin = ElementwiseKernel(ctx, "float *z, float *x, float *y", "z[i] = 2 * x[i] + y[i]", "lin")
    z = cla.empty_like(a)
    lin(z, a, b)
    dot = ReductionKernel(ctx, np.float32, neutral="0", reduce_expr="a+b",
                          map_expr="x[i]*y[i]", arguments="float *x, float *y")
    cumsum = InclusiveScanKernel(ctx, np.int32, "a+b", neutral="0")
    counts = cla.to_device(queue, np.arange(1000, dtype=np.int32))
    prg = cl.Program(ctx, """
        __kernel void scale(__global float *x, const float s) { x[get_global_id(0)] *= s; }
    """).build()
    prg.scale(queue, z.shape, None, z.data, np.float32(0.5))
    return float(dot(z, b).get()) + float(cumsum(counts).get()[-1]) + float((a + b).get().sum())


def main() -> int:
    import pyopencl as cl

    import asyncclcache as acc

    ctx = cl.create_some_context(interactive=False)
    queue = cl.CommandQueue(ctx)
    cache = acc.default_cache()
    with acc.installed(cache):
        t0 = time.perf_counter()
        result = unchanged_pyopencl_code(ctx, queue)
        elapsed = time.perf_counter() - t0
    cache.flush(timeout=60)
    s = cache.stats()
    print(f"result {result:.6f} in {elapsed:.3f} s")
    print(f"programs: {s.hits} hits, {s.misses} misses; {s.writes} entries written "
          f"({s.bytes_written} bytes) to {cache.directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
