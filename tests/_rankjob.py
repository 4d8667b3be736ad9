"""One rank of a test job (tests/test_nodes.py), under ``mpiexec`` or Slurm's ``srun``:
``python _rankjob.py OUT JOB PROGRAMS [mpi]``.

The rank is the launcher's (MPICH's ``PMI_RANK``, Slurm's ``SLURM_PROCID``); with
``ACC_TEST_NODES=N`` the ranks are spread over N simulated nodes in blocks (the test
setting ``ASYNCCLCACHE_TEST_NODE``), each with node-local storage of its own. Each rank
builds PROGRAMS small programs (the same on every rank), runs them, flushes, and writes
``OUT/JOB-rank<R>.json``. Every rank has its own pocl kernel cache (a new node for pocl:
a hit is the entry's doing). ``mpi``: mpi4py is imported (the job's exit line, per node).
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    out, job, programs = sys.argv[1], sys.argv[2], int(sys.argv[3])
    use_mpi = "mpi" in sys.argv[4:]
    rank = int(os.environ.get("PMI_RANK") or os.environ.get("SLURM_PROCID") or 0)
    size = int(os.environ.get("PMI_SIZE") or os.environ.get("SLURM_NTASKS") or 1)
    nodes = int(os.environ.get("ACC_TEST_NODES") or 0)
    if nodes:
        os.environ["ASYNCCLCACHE_TEST_NODE"] = f"sim{rank * nodes // size}"
    os.environ["POCL_CACHE_DIR"] = os.path.join(out, f"pocl-{job}-rank{rank}")
    if use_mpi:
        from mpi4py import MPI  # noqa: F401 - initializes MPI: the exit line gathers

    import asyncclcache as acc
    from _pocl import pocl_context
    from asyncclcache.ranks import detect_node, detect_rank
    from kernels import run_twice, small_source

    start_at = float(os.environ.get("ACC_TEST_START_AT") or 0)
    ctx = pocl_context()
    cache = acc.default_cache()
    while time.time() < start_at:  # the ranks build together, as after a simulation's set-up
        time.sleep(0.002)
    ok = True
    for i in range(programs):
        prg = acc.Program(ctx, small_source(salt=f"job-{i}"), cache=cache).build()
        ok = run_twice(ctx, prg) and ok
    flushed = cache.flush(120)
    s = cache.stats()
    row = {"rank": detect_rank(), "node": detect_node(), "ok": ok, "flushed": flushed,
           "directory": cache.directory, "stats": s.as_dict(),
           "node_dir": None if cache.store.node is None else str(cache.store.node.root)}
    with open(os.path.join(out, f"{job}-rank{rank}.json"), "w") as f:
        json.dump(row, f)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
