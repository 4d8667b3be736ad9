"""Where a warm start's time goes with kcache-nvidia (issue 19): the multi workload (20
programs) built cold into a cache, then warm on a new node (fresh CUDA_CACHE_PATH) with a
profile of the timed part, against plain pyopencl on the same (warm) node.
Usage: PYOPENCL_CTX=NVIDIA python nvwarm.py WORKDIR"""
import cProfile, io, json, os, pstats, subprocess, sys, textwrap

CHILD = r'''
import json, os, sys, time, cProfile, pstats, io
sys.path.insert(0, os.path.join(os.environ["ROOT"], "benchmarks"))
import numpy as np, pyopencl as cl
from workloads import WORKLOADS
mode = sys.argv[1]
ctx = cl.create_some_context(interactive=False); q = cl.CommandQueue(ctx)
progs = WORKLOADS["multi"]()
a = np.ones(1 << 16, np.float32); mf = cl.mem_flags
ad = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=a); cd = cl.Buffer(ctx, mf.WRITE_ONLY, a.nbytes)
prof = cProfile.Profile() if mode == "acc-prof" else None
t0 = time.perf_counter()
if prof: prof.enable()
if mode.startswith("acc"):
    import asyncclcache as acc
    cache = acc.Cache(os.environ["ACC_DIR"])
    build = lambda s: acc.Program(ctx, s, cache=cache).build()
else:
    build = lambda s: cl.Program(ctx, s).build()
t1 = time.perf_counter(); tb = tl = 0.0
for p in progs:
    s = time.perf_counter(); prg = build(p.source()); m = time.perf_counter(); tb += m - s
    for k in p.kernels:
        getattr(prg, k.name)(q, (1 << 16,), None, ad, ad, cd)
    q.finish(); tl += time.perf_counter() - m
t2 = time.perf_counter()
if prof:
    prof.disable(); out = io.StringIO(); pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(25)
    print(out.getvalue()[-6000:])
res = {"mode": mode, "setup": round(t1 - t0, 4), "build": round(tb, 4), "launch": round(tl, 4), "total": round(t2 - t0, 4)}
if mode.startswith("acc"):
    cache.flush(); res["stats"] = {k: v for k, v in cache.stats().as_dict().items() if v}
print(json.dumps(res))
'''
W = sys.argv[1]; os.makedirs(W, exist_ok=True)
def run(mode, node, accdir="acc"):
    env = dict(os.environ, CUDA_CACHE_PATH=f"{W}/{node}", ACC_DIR=f"{W}/{accdir}", XDG_CACHE_HOME=f"{W}/xdg-{node}",
               ROOT=os.getcwd())
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD), mode], env=env, capture_output=True, text=True, timeout=300)
    print(p.stdout[-7000:] if p.returncode == 0 else p.stderr[-2000:], flush=True)
run("plain", "same")          # cold, fills the node's cache
run("plain", "same")          # warm, same node
run("acc", "cold")            # cold, writes the entries
for i in range(3):
    run("acc", f"new{i}")     # warm, new node
run("acc-prof", "newp")
