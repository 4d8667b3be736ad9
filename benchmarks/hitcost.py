#!/usr/bin/env python
"""Where a warm hit's time goes on pocl: ``python benchmarks/hitcost.py [--programs 20]``.

Fills an asyncclcache directory for the ``multi`` workload (strategy ``kcache``), and bakes
a copy of it (``asyncclcache bake``), then, each in
a fresh process on a new node (empty ``POCL_CACHE_DIR``), builds and launches every
program from it, and from pocl's own cache on the same node. Prints per-phase seconds:
restore (kcache: writing pocl's files), build, first launch, and the files the launches
added to pocl's cache (a compiled variant each).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np, pyopencl as cl
from workloads import WORKLOADS, WORK_ITEMS
import asyncclcache as acc
from asyncclcache.drivers import kcache_folders as kcache
mode, acc_dir, n = sys.argv[2], sys.argv[3], int(sys.argv[4])
ctx = cl.create_some_context(interactive=False); q = cl.CommandQueue(ctx)
a = np.random.default_rng(0).random(WORK_ITEMS, dtype=np.float32)
mf = cl.mem_flags
ad = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=a)
cd = cl.Buffer(ctx, mf.WRITE_ONLY, a.nbytes)
restore_s = [0.0]
orig = kcache.restore
def timed(*args, **kw):
    t = time.perf_counter(); r = orig(*args, **kw); restore_s[0] += time.perf_counter() - t; return r
kcache.restore = timed
cache = acc.Cache(acc_dir, strategy="kcache" if mode == "baked" else mode) if mode != "plain" else None
root = os.environ["POCL_CACHE_DIR"]
files = lambda: sum(len(f) for _, _, f in os.walk(root))
build = launch = 0.0
added = 0
for p in WORKLOADS["multi"](programs=n):
    t0 = time.perf_counter()
    prg = acc.Program(ctx, p.source(), cache=cache).build() if cache else cl.Program(ctx, p.source()).build()
    t1 = time.perf_counter()
    before = files()
    t1b = time.perf_counter()
    for k in p.kernels:
        getattr(prg, k.name)(q, (WORK_ITEMS,), None, ad, ad, cd); q.finish()
    launch += time.perf_counter() - t1b
    added += files() - before
    build += t1 - t0
stats = cache.stats().as_dict() if cache else {}
if cache:
    cache.flush(600); cache.close()
print(json.dumps({"build_s": build, "launch_s": launch, "restore_s": restore_s[0], "launch_files": added,
                  "hits": stats.get("hits"), "baked_hits": stats.get("baked_hits"),
                  "misses": stats.get("misses")}))
"""


def run(mode: str, acc_dir: str, n: int, pocl: str) -> dict:
    env = dict(os.environ, POCL_CACHE_DIR=pocl, PYOPENCL_CTX=os.environ.get("PYOPENCL_CTX", "portable"))
    env["PYTHONPATH"] = str(HERE.parent / "src") + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", CHILD, str(HERE), mode, acc_dir, str(n)], env=env,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--programs", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="acc-hitcost-"))
    rows: dict[str, list[dict]] = {}
    run("kcache", str(work / "kcache"), args.programs, tempfile.mkdtemp(dir=work))  # cold: fills the directory
    shutil.copytree(work / "kcache", work / "baked")
    env = dict(os.environ, PYTHONPATH=str(HERE.parent / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    bake = [sys.executable, "-m", "asyncclcache", "bake", "--dir", str(work / "baked")]
    subprocess.run(bake, env=env, check=True)
    same = tempfile.mkdtemp(dir=work)
    run("plain", "-", args.programs, same)  # fills pocl's own cache on this node
    for _ in range(args.reps):
        for mode in ("kcache", "baked", "plain"):
            pocl = same if mode == "plain" else tempfile.mkdtemp(dir=work)
            rows.setdefault(mode, []).append(run(mode, str(work / mode), args.programs, pocl))
    print(f"{args.programs} programs (multi workload), median of {args.reps}, seconds:")
    print(f"{'':28s} {'restore':>8s} {'build':>8s} {'launch':>8s} {'total':>8s} {'launch files':>12s}")
    names = {"kcache": "acc kcache, new node", "baked": "acc kcache baked, new node",
             "plain": "pocl's own cache, same node"}
    for mode, rs in rows.items():
        med = {k: sorted(r[k] for r in rs)[len(rs) // 2]
               for k in ("restore_s", "build_s", "launch_s", "launch_files")}
        print(f"{names[mode]:28s} {med['restore_s']:8.3f} {med['build_s']:8.3f} {med['launch_s']:8.3f} "
              f"{med['build_s'] + med['launch_s']:8.3f} {med['launch_files']:12d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
