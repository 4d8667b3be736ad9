"""The ``sharedpocl`` section of ``asyncclcache bench``: the ranks of one node sharing one
pocl kernel cache (``POCL_CACHE_DIR``; pocl's default, ``~/.cache/pocl/kcache``, is shared
by every rank of a user on a node), issue 41.

* ``failures``: R processes started together (as ``mpiexec`` starts a node's ranks), each
  building the same P small programs and launching each once, in one pocl cache, every
  cache empty; failed builds counted (pocl before 6.0 fails some: pocl#1480, F32), with
  plain pyopencl (``nocache``) and with asyncclcache installed (``acc``, which builds a
  program one at a time in a shared pocl cache: ``buildlock.py``), wall and CPU of the job.
  Defaults: 16 ranks, 24 programs, 5 runs.
* ``heavy``: 4 ranks building the same 6 heavy programs (160 statements a kernel) and
  launching each, every cache empty (F31), each program compiled once a node where
  asyncclcache is installed (``nodecompile.py``): without a cache, each rank its own pocl
  cache (as docs/mpi.md advised before) (``nocache-own``), and asyncclcache so
  (``acc-own``); the same with a barrier between every build and its launch
  (``*-barrier``: every rank waits until all have built, as an MPI barrier would; a file
  barrier, since the bench starts the ranks itself; the tests use MPICH's); one shared pocl
  cache (``nocache-shared``: pocl#1480 on pocl before 6.0; ``acc-shared``); one rank alone
  (``nocache-1``, ``acc-1``). Each rank's slowest program time, the job's wall and CPU, as
  ratios to the same job without the cache within each repetition.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RANK = r"""
import json, os, sys, time
t0 = time.perf_counter()
import numpy as np, pyopencl as cl
if sys.argv[1] == "acc":
    import asyncclcache as acc
    acc.install()
plat = [p for p in cl.get_platforms() if "Portable" in p.name][0]
ctx = cl.Context(plat.get_devices()[:1]); q = cl.CommandQueue(ctx)
a = np.ones(256, np.float32)
buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=a)
programs, statements = int(sys.argv[2]), int(sys.argv[3])
start = float(sys.argv[4])
while time.time() < start:  # the ranks build together, as after a simulation's set-up
    time.sleep(0.002)
t1 = time.perf_counter()
failed = []
def barrier(i):  # every rank waits until all have built program i (as an MPI barrier)
    d = os.environ.get("BENCH_BARRIER")
    if not d:
        return
    open(os.path.join(d, f"{i}-{os.environ['PMI_RANK']}"), "w").close()
    n = int(os.environ["PMI_SIZE"])
    while sum(1 for f in os.listdir(d) if f.startswith(f"{i}-")) < n:
        time.sleep(0.005)
for i in range(programs):
    body = "".join(f"x = x * {1 + (i + j) % 7}.5f + a[(g + {j}) % 256];" for j in range(statements))
    src = ("__kernel void f(__global float *a) { int g = get_global_id(0); float x = a[g]; "
           + body + " a[g] = x; } // sharedpocl " + str(i))
    try:
        prg = cl.Program(ctx, src).build()
        barrier(i)
        prg.f(q, a.shape, (16,), buf)
        q.finish()
    except cl.Error as e:
        failed.append(f"{i}: {str(e)[:120]}")
print(json.dumps({"failed": failed, "work_s": time.perf_counter() - t1, "start_s": t1 - t0}))
"""

#: Statements a heavy kernel (F31).
HEAVY = 160

LEGEND = {
    "nocache": "plain pyopencl, one pocl cache for every rank",
    "acc": "asyncclcache installed, one pocl cache for every rank",
    "nocache-own": "plain pyopencl, each rank its own pocl cache (the advice before)",
    "acc-own": "asyncclcache installed, each rank its own pocl cache",
    "nocache-own-barrier": "plain pyopencl, own pocl caches, a barrier between build and launch",
    "acc-own-barrier": "asyncclcache installed, own pocl caches, a barrier between build and launch",
    "nocache-shared": "plain pyopencl, one pocl cache for every rank",
    "acc-shared": "asyncclcache installed, one pocl cache for every rank",
    "nocache-1": "one rank alone, plain pyopencl",
    "acc-1": "one rank alone, asyncclcache",
}
#: What each variant of the heavy jobs is compared with: the same job without the cache.
BASE = {"acc-own": "nocache-own", "nocache-own-barrier": "nocache-own", "acc-own-barrier": "nocache-own-barrier",
        "nocache-shared": "nocache-own", "acc-shared": "nocache-own", "acc-1": "nocache-1"}


def _job(runner: Any, variant: str, ranks: int, programs: int, statements: int, shared: bool,
         timeout: float = 900, *, barrier: bool = False) -> dict[str, Any]:
    """One job of ``ranks`` processes on a new node; its wall and CPU, each rank's JSON."""
    node = runner.node()
    # PMI_RANK puts node-local copies on: in a folder of the run's, as a new node's.
    env0 = runner.env("nocache" if variant.startswith("nocache") else "acc", node,
                      ASYNCCLCACHE_DIR=runner.fresh("acc"), ASYNCCLCACHE_NODE_DIR=runner.fresh("nodelocal"))
    mode = "acc" if variant.startswith("acc") else "plain"
    if barrier:
        env0["BENCH_BARRIER"] = runner.fresh("barrier")
    start = time.time() + 1.5 + 0.15 * ranks  # every rank imported by then
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    procs = []
    for r in range(ranks):
        env = dict(env0, PMI_RANK=str(r), PMI_SIZE=str(ranks))
        if not shared:
            env["POCL_CACHE_DIR"] = f"{node['POCL_CACHE_DIR']}-rank{r}"
        argv = [runner.python, "-c", RANK, mode, str(programs), str(statements), str(start)]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    rows = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        try:
            rows.append(json.loads(out.strip().splitlines()[-1]))
        except (ValueError, IndexError):
            rows.append({"failed": [f"rank died: rc {p.returncode}: {err.strip()[-200:]}"], "work_s": None})
    wall = time.time() - start  # from the ranks' common start to the last exit
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
    works = [r["work_s"] for r in rows if r.get("work_s") is not None]
    return {"variant": variant, "ranks": ranks, "programs": programs,
            "failed": sum(len(r["failed"]) for r in rows), "failures": [f for r in rows for f in r["failed"]][:5],
            "slowest_s": max(works) if works else None, "wall_s": wall, "cpu_s": cpu}


def measure_sharedpocl(runner: Any, reps: int, log: Callable[[str], None], save: Callable[[Any], None],
                       *, quick: bool = False) -> dict[str, Any]:
    """Both parts; ``quick`` (about a minute on 2 cores): 8 ranks x 12 programs, 1 run each;
    one heavy repetition of 3 programs of half the statements, without the single ranks."""
    ranks, programs, runs = (8, 12, 1) if quick else (16, 24, max(5, reps))
    heavy_programs, statements = (3, HEAVY // 2) if quick else (6, HEAVY)
    res: dict[str, Any] = {"failures": {"ranks": ranks, "programs": programs, "runs": []},
                           "heavy": {"ranks": 4, "programs": heavy_programs, "statements": statements, "reps": []}}
    for run in range(runs):
        for v in ("nocache", "acc"):
            one = _job(runner, v, ranks, programs, 8, shared=True)
            res["failures"]["runs"].append(one)
            log(f"sharedpocl failures run {run + 1}/{runs} {v:8s}: {one['failed']} failed builds, "
                f"wall {one['wall_s']:.1f} s, cpu {one['cpu_s']:.1f} s")
            save(res)
    for rep in range(1 if quick else reps):
        row = {}
        jobs = [("nocache-own", 4, False), ("acc-own", 4, False), ("nocache-own-barrier", 4, False),
                ("acc-own-barrier", 4, False)]
        if not quick:
            jobs += [("nocache-shared", 4, True), ("acc-shared", 4, True), ("nocache-1", 1, False),
                     ("acc-1", 1, False)]
        for v, n, shared in jobs:
            row[v] = one = _job(runner, v, n, heavy_programs, statements, shared=shared,
                                barrier=v.endswith("-barrier"))
            log(f"sharedpocl heavy rep {rep + 1} {v:14s}: slowest rank {one['slowest_s'] or 0:.1f} s, "
                f"wall {one['wall_s']:.1f} s, cpu {one['cpu_s']:.1f} s, {one['failed']} failed")
        res["heavy"]["reps"].append(row)
        save(res)
    return res


def _median(xs: list[float]) -> str:
    xs = [x for x in xs if x is not None]
    return f"{statistics.median(xs):.3f}" if xs else "n/a"


def table_md(res: dict[str, Any]) -> str:
    """The section's tables (markdown)."""
    f = res["failures"]
    lines = [f"{f['ranks']} ranks, {f['programs']} programs, one pocl cache; each run: every cache empty.", "",
             "| variant | runs | runs with a failed build | failed builds (total) | wall s (median) "
             "| cpu s (median) |",
             "|---|--:|--:|--:|--:|--:|"]
    for v in ("nocache", "acc"):
        rows = [r for r in f["runs"] if r["variant"] == v]
        if rows:
            lines.append(f"| {v}: {LEGEND[v]} | {len(rows)} | {sum(1 for r in rows if r['failed'])} | "
                         f"{sum(r['failed'] for r in rows)} | {_median([r['wall_s'] for r in rows])} | "
                         f"{_median([r['cpu_s'] for r in rows])} |")
    h = res["heavy"]["reps"]
    if h:
        hv = res["heavy"]
        heavy = f"{hv['programs']} heavy programs ({hv.get('statements', HEAVY)} statements)"
        lines += ["", f"4 ranks (or 1), {heavy}, every cache empty; ratios to the same job without "
                  f"the cache in the same repetition, medians of {len(h)}:", "",
                  "| variant | against | slowest rank | wall | cpu | failed builds |",
                  "|---|---|--:|--:|--:|--:|"]
        for v in [x for x in BASE if x in h[0] and BASE[x] in h[0]]:
            def ratio(field: str, v: str = v) -> str:
                b = BASE[v]
                return _median([r[v][field] / r[b][field] for r in h if r[v][field] and r[b][field]])
            lines.append(f"| {v}: {LEGEND[v]} | {BASE[v]} | {ratio('slowest_s')} | {ratio('wall_s')} | "
                         f"{ratio('cpu_s')} | {sum(r[v]['failed'] for r in h)} |")
        base = [r["nocache-own"] for r in h]
        lines += ["", f"`nocache-own` itself: slowest rank {_median([b['slowest_s'] for b in base])} s, wall "
                  f"{_median([b['wall_s'] for b in base])} s, cpu {_median([b['cpu_s'] for b in base])} s."]
    return "\n".join(lines)


if __name__ == "__main__":  # a quick look without the bench: python benchmarks/sharedpocl.py OUT
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import run as bench

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "sharedpocl-out")
    out.mkdir(parents=True, exist_ok=True)
    import tempfile

    runner = bench.Runner(Path(tempfile.mkdtemp(prefix="acc-bench-")), out, sys.executable)
    result = measure_sharedpocl(runner, 3, print, lambda r: None, quick=os.environ.get("QUICK") == "1")
    (out / "sharedpocl.json").write_text(json.dumps(result, indent=1))
    print(table_md(result))
