"""R ranks on one node: per-rank time to the first result, cold and warm, and CPU spent.

``python benchmarks/ranks.py [--ranks 1,2] [--n 1000] [--programs 1] [--out DIR]``

Each rank is a process with ``PMI_RANK`` set (what ``mpiexec`` does; asyncclcache reads
it), its own pocl kernel cache (pocl before 6.0 must not share one), started together.
Variants, side by side in one run:

* ``nocache``: pyopencl with ``PYOPENCL_NO_CACHE=1``
* ``pyopencl``: pyopencl's own binary cache forced on for pocl
* ``acc``: asyncclcache, rank-local directories (the default)
* ``acc-shared``: asyncclcache, one directory for all ranks (one warm-up per key)

Cold: fresh pocl caches and cache directories. Warm: fresh pocl caches (a new node),
the cold run's cache directory. CPU seconds are the user+system time of all ranks and
everything they started (asyncclcache's helper included), from ``RUSAGE_CHILDREN``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = ("nocache", "pyopencl", "acc", "acc-shared")

RANK = r"""
import json, os, sys, time
variant, n, programs, start_at, acc_dir, cl_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5], sys.argv[6]
sys.path.insert(0, os.environ["BENCH_DIR"])
import numpy as np, pyopencl as cl
from workloads import Kern, Prog, WORK_ITEMS
if variant == "pyopencl":
    import pyopencl.characterize
    pyopencl.characterize.has_src_build_cache = lambda dev: False
cache = None
if variant.startswith("acc"):
    import asyncclcache as acc
    cache = acc.Cache(acc_dir, rank_local=(variant == "acc"))
plat = [p for p in cl.get_platforms() if "Portable" in p.name][0]
ctx = cl.Context(plat.get_devices()[:1]); q = cl.CommandQueue(ctx)
rng = np.random.default_rng(0)
a = rng.random(WORK_ITEMS).astype(np.float32); b = rng.random(WORK_ITEMS).astype(np.float32)
mf = cl.mem_flags
ad = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=a)
bd = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=b)
cd = cl.Buffer(ctx, mf.WRITE_ONLY, a.nbytes)
progs = [Prog((Kern(f"r{i}_sum", "add", n),)) for i in range(programs)]
while time.time() < start_at:
    time.sleep(0.001)
t0 = time.perf_counter()
for p in progs:
    prg = cache.program(ctx, p.source()) if cache else cl.Program(ctx, p.source())
    prg.build(cache_dir=cl_dir) if variant == "pyopencl" else prg.build()
    k = p.kernels[0]
    cl.Kernel(prg, k.name)(q, a.shape, None, ad, bd, cd)
    c = np.empty_like(a); cl.enqueue_copy(q, c, cd); q.finish()
    assert np.allclose(c, a + b)
first = time.perf_counter() - t0
out = {"first": first}
if cache is not None:
    cache.flush(600)
    out["stats"] = cache.stats().as_dict()
print(json.dumps(out))
"""


def run_ranks(variant: str, R: int, n: int, programs: int, acc_dir: str, cl_dir: str,
              python: str) -> dict:
    scratch = tempfile.mkdtemp(prefix=f"ranks-{variant}-")
    start_at = time.time() + 2.0 + 0.2 * R
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    procs = []
    for r in range(R):
        env = dict(os.environ, PMI_RANK=str(r), PMI_SIZE=str(R), BENCH_DIR=str(HERE),
                   POCL_CACHE_DIR=os.path.join(scratch, f"pocl-rank{r}"),
                   XDG_CACHE_HOME=os.path.join(scratch, f"xdg-rank{r}"))
        env.pop("PYOPENCL_NO_CACHE", None)
        if variant == "nocache":
            env["PYOPENCL_NO_CACHE"] = "1"
        procs.append(subprocess.Popen(
            [python, "-c", RANK, variant, str(n), str(programs), str(start_at), acc_dir,
             os.path.join(cl_dir, f"rank{r}")],
            env=env, stdout=subprocess.PIPE, text=True))
    rows = []
    for p in procs:
        out, _ = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"{variant} rank failed with {p.returncode}")
        rows.append(json.loads(out.strip().splitlines()[-1]))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    firsts = [x["first"] for x in rows]
    res = {
        "median": statistics.median(firsts), "max": max(firsts),
        "cpu": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
    }
    if "stats" in rows[0]:
        for key in ("warmups", "writes", "hits", "misses", "skipped"):
            res[key] = sum(x["stats"][key] for x in rows)
    return res


def describe(python: str) -> dict:
    code = ("import pyopencl as cl, json; p=[p for p in cl.get_platforms() if 'Portable' in p.name][0];"
            "print(json.dumps({'pocl': p.version, 'device': p.get_devices()[0].name, 'pyopencl': cl.VERSION_TEXT}))")
    info = json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True,
                                     env=dict(os.environ, POCL_CACHE_DIR=tempfile.mkdtemp())).stdout)
    info.update(cores=os.cpu_count(), python=platform.python_version())
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ranks", default="1,2", help="comma-separated rank counts")
    ap.add_argument("--n", type=int, default=1000, help="statements per kernel (seed: 1000)")
    ap.add_argument("--programs", type=int, default=1, help="programs per rank")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=str(HERE / "out"))
    ap.add_argument("--python", default=sys.executable)
    args = ap.parse_args()
    ranks = [int(x) for x in args.ranks.split(",")]
    variants = args.variants.split(",")
    m = describe(args.python)
    print(f"# {m['device']}, {m['cores']} cores, {m['pocl']}, pyopencl {m['pyopencl']}", flush=True)
    results: dict = {"machine": m, "n": args.n, "programs": args.programs, "rows": {}}
    for R in ranks:
        for v in variants:
            acc_dir = tempfile.mkdtemp(prefix="ranks-acc-")
            cl_dir = tempfile.mkdtemp(prefix="ranks-cl-")
            cold = run_ranks(v, R, args.n, args.programs, acc_dir, cl_dir, args.python)
            warm = run_ranks(v, R, args.n, args.programs, acc_dir, cl_dir, args.python)
            results["rows"][f"{R}:{v}"] = {"cold": cold, "warm": warm}
            print(f"R={R:3d} {v:10s} cold median {cold['median']:6.2f}s max {cold['max']:6.2f}s "
                  f"cpu {cold['cpu']:7.1f}s | warm median {warm['median']:6.3f}s max {warm['max']:6.3f}s"
                  + (f" | warm-ups {cold['warmups']} writes {cold['writes']}" if "warmups" in cold else ""),
                  flush=True)
    lines = [f"## Ranks on one node: {m['device']}, {m['cores']} cores, {m['pocl']}, "
             f"pyopencl {m['pyopencl']}, Python {m['python']}", "",
             f"{args.programs} program(s) per rank, kernel of {args.n} statements. Per-rank time to the "
             "first correct result (median / max over ranks); CPU: all ranks and their helpers.", "",
             "| R | variant | cold median | cold max | cold / nocache | CPU s (cold) | warm median | warm max "
             "| warm-ups | writes |", "|---|---|---|---|---|---|---|---|---|---|"]
    for R in ranks:
        base = results["rows"].get(f"{R}:nocache", {}).get("cold", {}).get("median")
        for v in variants:
            row = results["rows"][f"{R}:{v}"]
            c, w = row["cold"], row["warm"]
            ratio = f"{c['median'] / base:.2f}" if base else "-"
            lines.append(f"| {R} | {v} | {c['median']:.2f} s | {c['max']:.2f} s | {ratio} | {c['cpu']:.1f} | "
                         f"{w['median']:.3f} s | {w['max']:.3f} s | {c.get('warmups', '-')} | {c.get('writes', '-')} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ranks.md").write_text("\n".join(lines) + "\n")
    (out / "ranks.json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
