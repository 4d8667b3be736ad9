"""pocl's own kernel cache as the thing to cache (docs/design.md F15-F17).

  python benchmarks/probe/kcache.py restore   cold run fills a kcache; its program directory is copied
                                               into an empty kcache (a new node); that run's build and
                                               first launch
  python benchmarks/probe/kcache.py ident     which kcache directory a build used: the one whose
                                               last_accessed pocl touched inside the build's time
                                               window (two processes)
  python benchmarks/probe/kcache.py spec0     POCL_WORK_GROUP_SPECIALIZATION=1 vs 0: variants compiled,
                                               and the cost of a BINARIES query after the first launch
The kernel repeats its statement N times: N=600 unless the environment variable N says otherwise
(``N=1000 python benchmarks/probe/kcache.py restore``).
Needs pocl; picks the platform whose name contains "Portable"."""
import os, shutil, subprocess, sys, tempfile, time

SRC = ("__kernel void sum(__global const float *a, __global const float *b, __global float *c)"
       "{ int gid = get_global_id(0);" + "c[gid] = a[gid] + b[gid];" * int(os.environ.get("N", "600")) + "}")


def child(query_binaries: bool) -> None:
    import numpy as np
    import pyopencl as cl
    dev = [p for p in cl.get_platforms() if "Portable" in p.name][0].get_devices()[:1]
    ctx = cl.Context(dev); q = cl.CommandQueue(ctx)
    a = np.random.rand(50000).astype(np.float32)
    mf = cl.mem_flags
    A = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=a)
    C = cl.Buffer(ctx, mf.WRITE_ONLY, a.nbytes)
    t0 = time.time(); prg = cl._cl._Program(ctx, SRC); prg.build(b"", ctx.devices); t1 = time.time()
    k = cl._cl.Kernel(prg, "sum"); k.set_args(A, A, C)
    cl.enqueue_nd_range_kernel(q, k, (50000,), None); q.finish(); t2 = time.time()
    if query_binaries:
        prg.get_info(cl.program_info.BINARIES)
    t3 = time.time()
    print(f"build {t1 - t0:.2f} s, first launch {t2 - t1:.2f} s, BINARIES after it {t3 - t2:.2f} s")


def run(kcache: str, query: bool = False, **env: str) -> None:
    subprocess.run([sys.executable, __file__, "child", "1" if query else "0"],
                   env=dict(os.environ, POCL_CACHE_DIR=kcache, **env), check=True)


def variants(kcache: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(r, f), kcache)
                  for r, _, fs in os.walk(kcache) for f in fs if f.endswith(".so"))


def program_dirs(kcache: str) -> dict[str, float]:
    out = {}
    for top in os.scandir(kcache):
        if top.is_dir():
            for p in os.scandir(top.path):
                la = os.path.join(p.path, "last_accessed")
                if os.path.exists(la):
                    out[os.path.relpath(p.path, kcache)] = os.stat(la).st_mtime
    return out


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "child":
        child(sys.argv[2] == "1")
    elif what == "restore":
        old, new, empty = tempfile.mkdtemp(), tempfile.mkdtemp(), tempfile.mkdtemp()
        print("cold, empty kcache:"); run(old)
        for top in os.listdir(old):
            if os.path.isdir(os.path.join(old, top)):
                shutil.copytree(os.path.join(old, top), os.path.join(new, top))
        print("new node, the program's kcache directory restored:"); run(new)
        print("   variants there now:", variants(new))
        print("new node, empty kcache:"); run(empty)
    elif what == "ident":
        kc = tempfile.mkdtemp()
        for i in range(2):
            t0 = time.time(); time.sleep(0.01); run(kc); t1 = time.time()
            for d, la in program_dirs(kc).items():
                print(f"process {i}: {d}: last_accessed touched in this process's window: {t0 <= la <= t1}")
    elif what == "spec0":
        for spec in ("1", "0"):
            kc = tempfile.mkdtemp()
            print(f"POCL_WORK_GROUP_SPECIALIZATION={spec}:"); run(kc, True, POCL_WORK_GROUP_SPECIALIZATION=spec)
            print("   variants:", variants(kc))
