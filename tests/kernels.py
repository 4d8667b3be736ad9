"""Test kernels, importable by child processes (no side effects on import)."""

from __future__ import annotations

import uuid


def small_source(name: str = "twice", salt: str | None = None, repeat: int = 1) -> str:
    """A small kernel ``name``: c[i] = 2 * a[i]. A fresh salt makes a fresh program."""
    salt = salt or uuid.uuid4().hex
    body = "float v = a[gid]; float s = 0.0f; " + "s += v + v;" * repeat + f" c[gid] = s / {repeat}.0f;"
    return (
        f"// {salt}\n"
        f"__kernel void {name}(__global const float *a, __global float *c)"
        f"{{ int gid = get_global_id(0); {body} }}\n"
    )


def seed_source(n: int = 1000, salt: str | None = None) -> str:
    """docs/design.md's seed: ``c = a + b`` repeated ``n`` times. Slow to compile on purpose:
    use it only where a test needs a wide window (n=1000 is about 5 s per variant)."""
    salt = salt or uuid.uuid4().hex
    return (
        f"// {salt}\n"
        "__kernel void sum(__global const float *a, __global const float *b, __global float *c)"
        "{ int gid = get_global_id(0);" + "c[gid] = a[gid] + b[gid];" * n + "}\n"
    )


def run_twice(ctx, prg, name: str = "twice", n: int = 1024, local_size=None) -> bool:
    """Launch ``name`` from ``prg`` on fresh data; True if c == 2 * a."""
    import numpy as np
    import pyopencl as cl

    q = cl.CommandQueue(ctx)
    a = np.random.default_rng(0).random(n).astype(np.float32)
    mf = cl.mem_flags
    ad = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=a)
    cd = cl.Buffer(ctx, mf.WRITE_ONLY, a.nbytes)
    cl.Kernel(prg, name)(q, a.shape, local_size, ad, cd)
    c = np.empty_like(a)
    cl.enqueue_copy(q, c, cd)
    q.finish()
    return bool(np.allclose(c, 2 * a))


#: A child script (``run_child(VALUE_CHILD, cache_dir, source)``): builds ``source``, one
#: kernel ``f(__global float *c)``, through ``acc.Cache(cache_dir)``, launches it once and
#: prints ``{"value": c[0], "key": the cache key, "hits": ...}``.
VALUE_CHILD = r"""
import json, sys
import numpy as np, pyopencl as cl, asyncclcache as acc
from _pocl import pocl_context
ctx = pocl_context(); q = cl.CommandQueue(ctx)
cache = acc.Cache(sys.argv[1])
prg = acc.Program(ctx, sys.argv[2], cache=cache).build()
c = np.zeros(8, np.float32); cd = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, c.nbytes)
prg.f(q, c.shape, None, cd); cl.enqueue_copy(q, c, cd); q.finish()
cache.flush(60)
print(json.dumps({"value": float(c[0]), "key": prg.cache_key, "hits": cache.stats().hits}))
"""
