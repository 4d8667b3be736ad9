"""Ranks sharing one cache directory: ``mpiexec -n 4 python examples/mpi_ranks.py``.

Each rank builds the same programs. The ranks share the cache directory (one entry per
program, one rank writes each), and each node reads an entry from it once, through
node-local copies: run it with 2 ranks, then with 4, and every rank of the second job
hits. ``--rank-local`` gives each rank its own directory (``<dir>/v1/rank-<N>``) instead.
Rank 0 prints one line for the job, with each node's reads of the shared directory.

Needs mpi4py (``pip install 'asyncclcache[mpi]'``, which brings mpi4py and an MPICH).
"""

from __future__ import annotations

import argparse
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description="asyncclcache under MPI: one directory for all ranks")
    parser.add_argument("--rank-local", action="store_true", help="a directory per rank instead")
    parser.add_argument("--programs", type=int, default=4)
    args = parser.parse_args()
    try:
        from mpi4py import MPI
    except ImportError:
        print("mpi_ranks.py needs mpi4py: pip install 'asyncclcache[mpi]' (mpi4py + mpich),\n"
              "then run: mpiexec -n 2 python examples/mpi_ranks.py", file=sys.stderr)
        return 2
    import numpy as np
    import pyopencl as cl

    import asyncclcache as acc

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    ctx = cl.create_some_context(interactive=False)
    queue = cl.CommandQueue(ctx)
    cache = acc.Cache(rank_local=args.rank_local or None)
    comm.Barrier()  # one start for all ranks, so "first result" compares like with like
    t0 = time.perf_counter()
    a = np.arange(4096, dtype=np.float32)
    buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=a)
    for i in range(args.programs):
        src = f"__kernel void k{i}(__global float *x) {{ x[get_global_id(0)] += {i + 1}.0f; }}"
        prg = acc.Program(ctx, src, cache=cache).build()
        getattr(prg, f"k{i}")(queue, a.shape, None, buf)
    queue.finish()
    first = time.perf_counter() - t0
    cache.flush(timeout=60)
    s = cache.stats()
    node = MPI.Get_processor_name()
    rows = comm.gather((rank, first, s.hits, s.misses, s.writes, s.skipped, cache.directory, node,
                        s.shared_reads), root=0)
    if rank == 0:
        assert rows is not None
        times = sorted(r[1] for r in rows)
        print(f"{len(rows)} ranks, {'rank-local caches' if args.rank_local else 'one shared cache'}: "
              f"first result median {times[len(times) // 2]:.3f} s, max {times[-1]:.3f} s; "
              f"hits {sum(r[2] for r in rows)}, misses {sum(r[3] for r in rows)}, "
              f"writes {sum(r[4] for r in rows)}, skipped {sum(r[5] for r in rows)}")
        per_node: dict[str, int] = {}
        for r in rows:
            per_node[r[7]] = per_node.get(r[7], 0) + r[8]
            print(f"  rank {r[0]} on {r[7]}: {r[6]}")
        if not args.rank_local:
            print("  read from the shared directory per node: "
                  + ", ".join(f"{n} {k}" for n, k in sorted(per_node.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
