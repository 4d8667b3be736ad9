"""asyncclcache's kcache on NVIDIA's compute cache, end to end (issue 19): a cold node writes
the entry, new nodes (fresh CUDA_CACHE_PATH, the same cache directory) hit it. Prints, per
node: the strategy, hits, the driver's check (unused), the value computed, the time to the
first result, and whether the node's compute cache holds only the files restored. Then the
header question through asyncclcache: the header beside the source changes between nodes.
Usage: python nvkcache.py WORKDIR   (on a machine with NVIDIA's OpenCL)"""
import json, os, subprocess, sys, textwrap

NODE = r'''
import json, os, sys, time
import numpy as np, pyopencl as cl
import asyncclcache as acc
args = json.loads(sys.argv[1])
t = time.perf_counter()
plat = [p for p in cl.get_platforms() if "NVIDIA" in p.name][0]
ctx = cl.Context(plat.get_devices()[:1]); q = cl.CommandQueue(ctx)
cache = acc.Cache(args["dir"])
body = "".join(f"x = x * {1.0001 + j * 1e-6:.7f}f + {j}.0f;" for j in range(300))
src = args.get("src") or ("__kernel void k(__global float *a) { int g = get_global_id(0); float x = a[g]; %s a[g] = x + %s; }"
                          % (body, args["c"]))
prg = acc.Program(ctx, src, cache=cache).build(options=args.get("opts", []))
a = np.zeros(256, np.float32); buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=a)
prg.k(q, (256,), None, buf); cl.enqueue_copy(q, a, buf); q.finish()
first = time.perf_counter() - t
cache.flush(); d = cache.driver_for(ctx.devices); st = cache.stats()
files = sorted(os.path.relpath(os.path.join(p, f), os.environ["CUDA_CACHE_PATH"]) for p, _, fs in os.walk(os.environ["CUDA_CACHE_PATH"]) for f in fs)
print(json.dumps({"strategy": d.name, "hits": st.hits, "misses": st.misses, "writes": st.writes, "unused": getattr(d, "unused", None),
                  "val": float(a[0]), "first": round(first, 3), "files": files}))
'''
W = sys.argv[1]; os.makedirs(W, exist_ok=True)
def node(name, **args):
    args.setdefault("dir", f"{W}/acc")
    env = dict(os.environ, CUDA_CACHE_PATH=f"{W}/{name}")
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(NODE), json.dumps(args)], env=env, capture_output=True,
                       text=True, cwd=args.pop("cwd", W), timeout=300)
    if p.returncode:
        print(name, "FAILED", p.stderr[-800:]); return {}
    r = json.loads(p.stdout.splitlines()[-1]); print(name, json.dumps(r)); return r
cold = node("n1", c="1.0")
warm = node("n2", c="1.0")
print("RESULT new node: files equal to the cold node's:", set(warm.get("files", [])) - {"index"} == set(cold.get("files", [])) - {"index"},
      "first", cold.get("first"), "->", warm.get("first"))
os.makedirs(f"{W}/work", exist_ok=True)
src = '#include "h.h"\n__kernel void k(__global float *a) { a[get_global_id(0)] = VAL; }'
vals = []
for i, v in enumerate((1, 2, 1, 7)):
    open(f"{W}/work/h.h", "w").write(f"#define VAL {v}\n")
    r = node(f"h{i}", src=src, dir=f"{W}/acc-h", cwd=f"{W}/work")
    vals.append((v, r.get("val"), r.get("hits")))
print("RESULT header beside the source, one node each (wrote, got, hit):", vals)
