"""pocl's CUDA device (issue 29): what a build writes into pocl's kernel cache and NVIDIA's
compute cache, what the BINARIES query costs there, and what a new node compiles with each
kind of entry. Uses pyopencl directly, no asyncclcache.

Each node is a fresh process with its own POCL_CACHE_DIR and CUDA_CACHE_PATH. ``cold``
builds the seed kernel (benchmarks/workloads.py) and the 20-program workload from empty
caches, queries BINARIES after its timed first result, and lists the files each cache
gained. New nodes then start with: nothing; pocl's folders only; the compute cache's files
only; both; the program binary only (pocl's BINARIES). For each: time to the first result and the files the node's caches gained (what
it compiled).
Usage: python poclcuda.py WORKDIR [programs]   (pocl with its CUDA device the first platform)"""
import json, os, shutil, subprocess, sys, textwrap, time

NODE = r'''
import json, os, sys, time, pickle
t0 = time.perf_counter()
import numpy as np, pyopencl as cl
sys.path.insert(0, os.environ["PROBE_BENCH"])
import workloads as W
mode, nprog = sys.argv[1], int(sys.argv[2])
def walk(root):
    out = {}
    for p, _, fs in os.walk(root):
        for f in fs:
            q = os.path.join(p, f); st = os.lstat(q)
            out[os.path.relpath(q, root)] = (st.st_size, st.st_mtime)
    return out
roots = {"pocl": os.environ["POCL_CACHE_DIR"], "cuda": os.environ["CUDA_CACHE_PATH"]}
before = {k: walk(v) for k, v in roots.items()}
plat = [p for p in cl.get_platforms() if "Portable" in p.name][0]
dev = plat.get_devices()[0]
ctx = cl.Context([dev]); q = cl.CommandQueue(ctx)
t_ctx = time.perf_counter() - t0
out = {"mode": mode, "ctx": round(t_ctx, 3), "device": dev.name, "driver": dev.driver_version,
       "platform": plat.version}
progs = W.seed() if nprog == 0 else W.multi(nprog)
a = np.random.default_rng(0).random(W.WORK_ITEMS, dtype=np.float32); b = a[::-1].copy()
mf = cl.mem_flags
ab = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=a); bb = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=b)
cb = cl.Buffer(ctx, mf.WRITE_ONLY, a.nbytes); c = np.empty_like(a)
binfile = os.path.join(os.environ["PROBE_WORK"], f"bins-{nprog}.pkl")
built, bins, tb, tl, ok = [], [], 0.0, 0.0, True
for i, p in enumerate(progs):
    t = time.perf_counter()
    if mode == "binary":
        prg = cl.Program(ctx, [dev], [pickle.load(open(binfile, "rb"))[i]]).build()
    else:
        prg = cl.Program(ctx, p.source()).build()
    tb += time.perf_counter() - t
    if i == 0:  # what the first build wrote, before any launch
        out["after_build0"] = {k: len(walk(v)) - len(before[k]) for k, v in roots.items()}
    t = time.perf_counter()
    for k in p.kernels:
        getattr(prg, k.name)(q, (W.WORK_ITEMS,), None, ab, bb, cb); cl.enqueue_copy(q, c, cb); q.finish()
        ok = ok and bool(np.allclose(c, k.expected(a, b), rtol=1e-5))
    tl += time.perf_counter() - t
    built.append(prg)
out.update(first=round(time.perf_counter() - t0, 3), build=round(tb, 3), launch=round(tl, 3), ok=ok)
if mode == "cold":
    t = time.perf_counter()
    for prg in built:
        bins.append(prg.get_info(cl.program_info.BINARIES)[0])
    out["binaries_query"] = round(time.perf_counter() - t, 4)
    out["binary_bytes"] = [len(x) for x in bins][:3]
    out["binary_has_ptx"] = any(b".version" in x and b".target" in x for x in bins)
    pickle.dump(bins, open(binfile, "wb"))
after_q = {k: walk(v) for k, v in roots.items()}
for k in roots:
    new = {f: v for f, v in after_q[k].items() if f not in before[k] or before[k][f] != v}
    out[f"{k}_gained"] = len(new)
    out[f"{k}_gained_bytes"] = sum(v[0] for v in new.values())
    out[f"{k}_files"] = sorted(new)[:12]
print(json.dumps(out))
'''
WORK = sys.argv[1]
NPROG = int(sys.argv[2]) if len(sys.argv) > 2 else 20
os.makedirs(WORK, exist_ok=True)
BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def node(name, mode, nprog, seed_from=None, parts=("pocl", "cuda")):
    d = f"{WORK}/{name}"
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    for part in ("pocl", "cuda"):
        if seed_from and part in parts:
            shutil.copytree(f"{seed_from}/{part}", f"{d}/{part}")
        else:
            os.makedirs(f"{d}/{part}", exist_ok=True)
    env = dict(os.environ, POCL_CACHE_DIR=f"{d}/pocl", CUDA_CACHE_PATH=f"{d}/cuda", PROBE_BENCH=BENCH, PROBE_WORK=WORK)
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(NODE), mode, str(nprog)], env=env,
                       capture_output=True, text=True, timeout=400)
    if p.returncode:
        print(name, "FAILED", p.returncode, p.stderr[-1500:], flush=True)
        return {}
    r = json.loads(p.stdout.splitlines()[-1])
    print(name, json.dumps(r), flush=True)
    return r


for nprog in (0, NPROG):
    tag = "seed" if nprog == 0 else f"multi{nprog}"
    cold = node(f"{tag}-cold", "cold", nprog)
    if not cold:
        continue
    src = f"{WORK}/{tag}-cold"
    # The cold node's caches, as a new node would receive them.
    shutil.copytree(src, f"{WORK}/{tag}-entry")
    src = f"{WORK}/{tag}-entry"
    rows = {"cold": cold, "cold2": node(f"{tag}-cold2", "cold", nprog)}
    rows["pocl_only"] = node(f"{tag}-pocl", "src", nprog, src, ("pocl",))
    rows["cuda_only"] = node(f"{tag}-cuda", "src", nprog, src, ("cuda",))
    rows["both"] = node(f"{tag}-both", "src", nprog, src)
    rows["binary"] = node(f"{tag}-bin", "binary", nprog)
    print("SUMMARY", tag, json.dumps({k: (v.get("first"), v.get("build"), v.get("pocl_gained"), v.get("cuda_gained"))
                                      for k, v in rows.items()}), flush=True)
