"""First look at the GPU machine: platforms, what `auto` picks, a cold build and a warm hit."""
import json
import os
import subprocess
import sys
import tempfile

import pyopencl as cl

from asyncclcache.drivers import auto_strategy

for p in cl.get_platforms():
    for d in p.get_devices():
        print(f"{p.name} | {p.version} | {d.name} | driver {d.driver_version} | auto -> {auto_strategy([d])}")

CODE = r"""
import json, sys, time, numpy as np, pyopencl as cl, asyncclcache as acc
plat = [p for p in cl.get_platforms() if sys.argv[2] in p.name][0]
ctx = cl.Context(plat.get_devices()[:1]); q = cl.CommandQueue(ctx)
src = "__kernel void sum(__global const float *a, __global float *c){ int gid = get_global_id(0);" + "c[gid] += a[gid];" * 300 + "}"
cache = acc.Cache(sys.argv[1])
a = np.ones(4096, np.float32); mf = cl.mem_flags
ad = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=a); cd = cl.Buffer(ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=np.zeros_like(a))
t = time.perf_counter(); prg = cache.program(ctx, src).build(); tb = time.perf_counter() - t
prg.sum(q, a.shape, None, ad, cd); c = np.empty_like(a); cl.enqueue_copy(q, c, cd); q.finish()
tl = time.perf_counter() - t
ok = bool(np.allclose(c, 300)); fl = cache.flush(120)
print(json.dumps({"build": tb, "first_result": tl, "ok": ok, "flushed": fl, "drivers": sorted(cache._drivers), "stats": cache.stats().as_dict()}))
"""
d = tempfile.mkdtemp()
for plat in ("NVIDIA", "Portable"):
    if not any(plat in p.name for p in cl.get_platforms()):
        continue
    for run in ("cold", "warm"):
        env = dict(os.environ, POCL_CACHE_DIR=tempfile.mkdtemp(), CUDA_CACHE_DISABLE="1")
        r = subprocess.run([sys.executable, "-c", CODE, d, plat], capture_output=True, text=True, env=env)
        print(plat, run, r.stdout.strip() or r.stderr[-2000:])
