#!/usr/bin/env python3
"""docs/design.md F22: what a binary baked from a restored pocl folder holds, and how it loads.

Driver:  python probe.py drive OUTDIR [REPEATS]
Worker:  python probe.py step {A,B,C,Copt,D,E} ROOT   (run by the driver, one fresh process per step)
Each worker gets its own POCL_CACHE_DIR (set by the driver) and prints one JSON line.
"""
import json, os, shutil, subprocess, sys, time, statistics, glob

NPROG = 20
GLOBAL, LOCAL = 1024, 64


def src(i):
    k = f"""
__kernel void k{i}a(__global float *x) {{
    int g = get_global_id(0);
    x[g] = x[g] * 0.5f + {i}.25f;
}}
"""
    if i % 2:
        k += f"""
__kernel void k{i}b(__global float *x, float s) {{
    int g = get_global_id(0);
    x[g] = x[g] * 0.25f - s * {i}.75f;
}}
"""
    return k


def snapshot(d):
    out = {}
    for root, _, files in os.walk(d):
        for f in files:
            p = os.path.join(root, f)
            st = os.stat(p)
            out[os.path.relpath(p, d)] = (st.st_size, st.st_mtime_ns)
    return out


def diff(before, after):
    new = sorted(k for k in after if k not in before)
    changed = sorted(k for k in after if k in before and after[k] != before[k])
    gone = sorted(k for k in before if k not in after)
    return {"new": new, "changed": changed, "gone": gone}


def strip_hash(p):
    # "XX/<hash>/rest" -> "<prog>/rest" is done by the caller; here just drop the two hash levels
    parts = p.split(os.sep)
    return os.sep.join(parts[2:]) if len(parts) > 2 else p


def summarize(paths):
    """Path patterns (hash folders dropped, kernel names -> K) with counts."""
    import re, collections
    c = collections.Counter(re.sub(r"k\d+[ab]", "K", strip_hash(p)) for p in paths)
    return dict(sorted(c.items()))


def worker(step, root):
    os.environ.setdefault("PYOPENCL_NO_CACHE", "1")
    import numpy as np
    import pyopencl as cl
    cache = os.environ["POCL_CACHE_DIR"]
    t0 = time.perf_counter()
    plat = [p for p in cl.get_platforms() if "Portable" in p.name][0]
    dev = plat.get_devices(device_type=cl.device_type.CPU)[0]
    ctx = cl.Context([dev])
    q = cl.CommandQueue(ctx)
    t_ctx = time.perf_counter() - t0
    buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR,
                    hostbuf=np.arange(GLOBAL, dtype=np.float32))
    res = {"step": step, "t_ctx": t_ctx, "pocl": plat.version, "dev": dev.name}
    opts = ["-DFOO=1"] if step == "Copt" else []
    local = 128 if step == "Cl128" else LOCAL
    bindir = os.path.join(root, "bins")

    def launch_all(prgs):
        t = time.perf_counter()
        for i, p in enumerate(prgs):
            for kn in [f"k{i}a"] + ([f"k{i}b"] if i % 2 else []):
                k = getattr(p, kn)
                if kn.endswith("b"):
                    k(q, (GLOBAL,), (local,), buf, np.float32(0.5))
                else:
                    k(q, (GLOBAL,), (local,), buf)
            q.finish()
        return time.perf_counter() - t

    s0 = snapshot(cache)
    prgs = []
    t = time.perf_counter()
    if step in ("C", "Copt", "Cl128"):
        for i in range(NPROG):
            with open(os.path.join(bindir, f"p{i}.bin"), "rb") as f:
                b = f.read()
            prgs.append(cl.Program(ctx, [dev], [b]).build(options=opts))
    else:
        for i in range(NPROG):
            prgs.append(cl.Program(ctx, src(i)).build())
    res["t_build"] = time.perf_counter() - t
    s1 = snapshot(cache)
    res["files_at_start"] = len(s0)
    res["after_build"] = diff(s0, s1)

    if step == "B":
        t = time.perf_counter()
        bins = [p.get_info(cl.program_info.BINARIES)[0] for p in prgs]
        res["t_binaries"] = time.perf_counter() - t
        res["bin_sizes"] = [len(b) for b in bins]
        os.makedirs(bindir, exist_ok=True)
        for i, b in enumerate(bins):
            with open(os.path.join(bindir, f"p{i}.bin"), "wb") as f:
                f.write(b)
        s2 = snapshot(cache)
        res["after_binaries"] = diff(s1, s2)
        s1 = s2
        # a second BINARIES query: is it cheaper?
        t = time.perf_counter()
        [p.get_info(cl.program_info.BINARIES)[0] for p in prgs]
        res["t_binaries_2nd"] = time.perf_counter() - t
    if step != "B":
        res["t_launch"] = launch_all(prgs)
        s2 = snapshot(cache)
        res["after_launch"] = diff(s1, s2)
        # second launch round: warm in-process
        res["t_launch_2nd"] = launch_all(prgs)
        out = np.empty(GLOBAL, np.float32)
        cl.enqueue_copy(q, out, buf)
        res["checksum"] = float(out.astype(np.float64).sum())
    res["final_files"] = sorted(snapshot(cache))
    res["prog_dirs"] = sorted(set("/".join(p.split(os.sep)[:2]) for p in res["final_files"] if p.count(os.sep) >= 2))
    print("JSON " + json.dumps(res))


def run_step(step, root, cache, env_extra=None):
    env = dict(os.environ)
    env.update(PYOPENCL_CTX="Portable", PYOPENCL_NO_CACHE="1", POCL_CACHE_DIR=cache,
               POCL_KERNEL_CACHE="1")
    env.update(env_extra or {})
    t = time.perf_counter()
    p = subprocess.run([sys.executable, __file__, "step", step, root], env=env,
                       capture_output=True, text=True)
    wall = time.perf_counter() - t
    if p.returncode:
        print(p.stdout, p.stderr, file=sys.stderr)
        return {"step": step, "error": p.returncode, "stderr": p.stderr[-3000:], "wall": wall}
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("JSON ")][-1]
    r = json.loads(line[5:])
    r["wall"] = wall
    r["stderr_tail"] = p.stderr[-1500:]
    return r


def copy_prog_folders(src_dir, dst_dir):
    os.makedirs(dst_dir, exist_ok=True)
    # every <XX>/<hash> program folder (and anything else at top level, e.g. none)
    for xx in os.listdir(src_dir):
        if not os.path.isdir(os.path.join(src_dir, xx)):
            continue  # e.g. a stray tempfile_* left at top level by pocl
        shutil.copytree(os.path.join(src_dir, xx), os.path.join(dst_dir, xx), dirs_exist_ok=True)


def drive(out, reps):
    os.makedirs(out, exist_ok=True)
    allres = []
    for r in range(reps):
        root = os.path.join(out, f"rep{r}")
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        def c(n, root=root): return os.path.join(root, n)
        rep = {}
        os.makedirs(c("A"))
        rep["A"] = run_step("A", root, c("A"))
        copy_prog_folders(c("A"), c("B"))
        rep["B"] = run_step("B", root, c("B"))
        os.makedirs(c("C"))
        rep["C"] = run_step("C", root, c("C"))
        os.makedirs(c("Copt"))
        rep["Copt"] = run_step("Copt", root, c("Copt"))
        os.makedirs(c("Cl128"))
        rep["Cl128"] = run_step("Cl128", root, c("Cl128"))
        copy_prog_folders(c("A"), c("D"))
        rep["D"] = run_step("D", root, c("D"))
        os.makedirs(c("E"))
        rep["E"] = run_step("E", root, c("E"))
        allres.append(rep)
        print(f"rep {r}: " + ", ".join(
            f"{s}: build {v.get('t_build', float('nan')):.3f} launch {v.get('t_launch', float('nan')):.3f}"
            + (f" bins {v['t_binaries']:.3f}" if 't_binaries' in v else "")
            for s, v in rep.items()), flush=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(allres, f, indent=1)
    def med(s, k): return statistics.median(r[s][k] for r in allres if k in r[s])
    print("\nMEDIANS over", reps)
    print(f"{'step':6} {'ctx':>7} {'build':>8} {'launch':>8} {'launch2':>8} {'BINARIES':>9}")
    for s in ["A", "B", "C", "Copt", "Cl128", "D", "E"]:
        if any("error" in r[s] for r in allres):
            print(s, "ERROR", allres[0][s].get("stderr", "")[-500:]); continue
        b = f"{med(s, 't_binaries'):9.3f}" if s == "B" else ""
        la = f"{med(s, 't_launch'):8.3f} {med(s, 't_launch_2nd'):8.3f}" if s != "B" else f"{'-':>8} {'-':>8}"
        print(f"{s:6} {med(s, 't_ctx'):7.3f} {med(s, 't_build'):8.3f} {la} {b}")
    r0 = allres[0]
    print("pocl:", r0["A"].get("pocl"))
    print("B bin sizes:", r0["B"].get("bin_sizes"))
    print("B 2nd BINARIES query:", r0["B"].get("t_binaries_2nd"))
    for s, keys in [("A", ["after_build", "after_launch"]), ("B", ["after_build", "after_binaries"]),
                    ("C", ["after_build", "after_launch"]), ("Copt", ["after_build", "after_launch"]), ("Cl128", ["after_launch"]),
                    ("D", ["after_build", "after_launch"]), ("E", ["after_build", "after_launch"])]:
        for k in keys:
            d = r0[s].get(k)
            if d is None:
                continue
            print(f"\n[{s} {k}] new={len(d['new'])} changed={len(d['changed'])} gone={len(d['gone'])}")
            for kind in ("new", "changed", "gone"):
                if d[kind]:
                    print(f"  {kind} (hash dirs stripped):", summarize(d[kind]))
    print("\nchecksums (rep0):", {s: r0[s].get("checksum") for s in r0})
    print("same program hash folders as A:", {s: r0[s]["prog_dirs"] == r0["A"]["prog_dirs"] for s in r0})
    print("top-level non-folder files:", {s: [p for p in r0[s]["final_files"] if os.sep not in p] for s in r0})
    import hashlib
    def h(p): return hashlib.md5(open(p, "rb").read()).hexdigest()
    root0 = os.path.join(out, "rep0")
    for s in ("C", "Copt"):
        same = diff_ = 0
        for p in r0["B"]["final_files"]:
            if os.sep not in p or "last_accessed" in p:
                continue
            q = os.path.join(root0, s, p)
            if os.path.exists(q):
                if h(q) == h(os.path.join(root0, "B", p)):
                    same += 1
                else:
                    diff_ += 1
        print(f"{s} vs B file contents (program.bc + .so): identical={same} differ={diff_}")
    la = [p for p in r0["C"]["final_files"] if p.endswith("last_accessed")][0]
    print("C last_accessed size:", os.path.getsize(os.path.join(root0, "C", la)))
    # one program folder in C fully, and in B
    for s in ("B", "C"):
        ff = r0[s]["final_files"]
        first = sorted(set(os.sep.join(p.split(os.sep)[:2]) for p in ff))
        print(f"\n[{s} final] {len(ff)} files (incl. top-level tempfile); first program folder:")
        for p in ff:
            if p.startswith(first[0]):
                print("   ", p)


if __name__ == "__main__":
    if sys.argv[1] == "step":
        worker(sys.argv[2], sys.argv[3])
    else:
        drive(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 3)
