"""Why entries of kcache-nvidia are rewritten at exit (issue 19: 20 of 200 in the throughput
run): builds short programs in one process as the throughput benchmark does, then, at flush,
prints for every entry whose window gained files since its snapshot which files, and when they
appeared against the build, its snapshot and the next build (seconds, local clock).
Usage: PYOPENCL_CTX=NVIDIA python nvrefresh.py WORKDIR [PROGRAMS]   (CUDA_CACHE_PATH is set here)"""
import os, sys, time, json
W = sys.argv[1]; os.makedirs(W, exist_ok=True)
os.environ["CUDA_CACHE_PATH"] = os.path.join(W, "cc")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import numpy as np, pyopencl as cl
import asyncclcache as acc
from asyncclcache.drivers import filecache
from workloads import throughput
n = int(sys.argv[2]) if len(sys.argv) > 2 else 60
ctx = cl.create_some_context(interactive=False); q = cl.CommandQueue(ctx)
cache = acc.Cache(os.path.join(W, "acc"))
a = np.ones(50000, np.float32); mf = cl.mem_flags
ad = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=a); cd = cl.Buffer(ctx, mf.WRITE_ONLY, a.nbytes)
snap_at = {}
orig = filecache.FileCacheDriver._snapshot
def _snapshot(self, w, added):
    r = orig(self, w, added); snap_at[w.job.key] = (time.time(), sorted(r[1].files if r[1] else []))
    return r
filecache.FileCacheDriver._snapshot = _snapshot
t0 = time.time(); keys = []
for p in throughput(n):
    prg = acc.Program(ctx, p.source(), cache=cache).build(); keys.append(prg.cache_key)
    for k in p.kernels:
        getattr(prg, k.name)(q, (50000,), None, ad, ad, cd)
    q.finish(); del prg
d = cache.driver_for(ctx.devices)
orig_stale = d.stale
def stale(jobs):
    out = orig_stale(jobs)
    root = d.root
    for j in out:
        names = set(d._window(filecache.added_files(root, d.layout, d._lo(j.built_from)), j.built_from, d._end(j.built_to)))
        new = sorted(names - d._written.get(j, frozenset()))
        st, files = snap_at.get(j.key, (None, []))
        nxt = d._end(j.built_to)
        print(json.dumps({"i": keys.index(j.key) if j.key in keys else None, "built": [round(j.built_from - t0, 3), round(j.built_to - t0, 3)],
                          "snapshot": round(st - t0, 3) if st else None, "next": round(nxt - t0, 3) if nxt else None,
                          "stored": len(files), "new": [(f, round(os.stat(root / f).st_ctime - t0, 3), os.stat(root / f).st_size) for f in new]}))
    return out
d.stale = stale
cache.flush()
s = cache.stats(); print("RESULT", n, "programs:", s.writes, "writes,", s.refreshes, "refreshes; clock", d.clock.tick, d.clock.skew)
