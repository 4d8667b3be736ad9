"""Processes that share pocl's kernel cache build a program one at a time (issue 41): pocl
before 6.0 fails a build that another process makes of the same program in the same
``POCL_CACHE_DIR`` (pocl#1480, F32). On real pocl, with real MPICH where ranks are named.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncclcache import buildlock
from conftest import ROOT, child_json, run_child

pytestmark = pytest.mark.slow

SOURCE_A = "__kernel void f(__global float *a) { a[get_global_id(0)] += 1.0f; } // buildlock A"
SOURCE_B = "__kernel void f(__global float *a) { a[get_global_id(0)] += 2.0f; } // buildlock B"

# Builds B (another program), says so, then A; each through the installed cache.
BUILD = r"""
import json, sys, time
import pyopencl as cl, asyncclcache as acc
from asyncclcache import buildlock
from _pocl import pocl_context
buildlock.WAIT = float(sys.argv[2])
acc.install(acc.Cache(sys.argv[1]))
ctx = pocl_context()
cl.Program(ctx, sys.argv[4]).build()
print("B", flush=True)
t = time.monotonic()
cl.Program(ctx, sys.argv[3]).build()
print("A", round(time.monotonic() - t, 3), flush=True)
"""

HOLD = r"""
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(600)
"""


def _holder(lock: Path) -> subprocess.Popen[str]:
    lock.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _builder(cache_dir: Path, pocl: Path, wait: float) -> subprocess.Popen[str]:
    env = dict(os.environ, POCL_CACHE_DIR=str(pocl), PYTHONPATH=str(ROOT / "tests"))
    return subprocess.Popen([sys.executable, "-c", BUILD, str(cache_dir), str(wait), SOURCE_A, SOURCE_B],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _lock_of(pocl: Path, source: str) -> Path:
    return buildlock.lock_path(pocl, source.encode(), None)


def test_two_programs_take_two_locks() -> None:
    assert _lock_of(Path("/p"), SOURCE_A) != _lock_of(Path("/p"), SOURCE_B)
    assert _lock_of(Path("/p"), SOURCE_A) == _lock_of(Path("/p"), SOURCE_A)
    assert _lock_of(Path("/p"), SOURCE_A) != buildlock.lock_path(Path("/p"), SOURCE_A.encode(), ["-DX"])


def test_a_build_waits_for_a_killed_holder_and_never_for_another_program(cache_dir: Path, tmp_path: Path) -> None:
    pocl = tmp_path / "pocl"
    holder = _holder(_lock_of(pocl, SOURCE_A))
    builder = _builder(cache_dir, pocl, 600.0)
    try:
        assert builder.stdout is not None
        assert builder.stdout.readline().strip() == "B"  # another program: no wait
        time.sleep(1.0)
        assert builder.poll() is None  # A waits while the lock is held (for up to 600 s)
        holder.kill()  # a killed holder's lock goes with it
        out, err = builder.communicate(timeout=120)
        assert builder.returncode == 0, err
        assert out.split()[0] == "A" and float(out.split()[1]) >= 1.0, out
        assert "build lock" not in err
    finally:
        for p in (holder, builder):
            with contextlib.suppress(OSError):
                p.kill()
            p.wait(30)


def test_a_stopped_holder_is_waited_for_a_bounded_time(cache_dir: Path, tmp_path: Path) -> None:
    pocl = tmp_path / "pocl"
    holder = _holder(_lock_of(pocl, SOURCE_A))
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        builder = _builder(cache_dir, pocl, 1.0)
        out, err = builder.communicate(timeout=120)
        assert builder.returncode == 0, err
        assert out.split()[:2] == ["B", "A"] and float(out.split()[2]) >= 1.0, out
        assert "held the build lock" in err and "building without it" in err, err
    finally:
        holder.kill()
        holder.wait(30)


def test_a_pocl_cache_that_is_not_ours_is_left_alone(cache_dir: Path, tmp_path: Path) -> None:
    pocl = tmp_path / "pocl"
    folder = buildlock.lock_folder(pocl)
    folder.mkdir(parents=True)
    folder.chmod(0o777)  # writable by others: no lock file of ours in it
    out = run_child(BUILD, str(cache_dir), "600", SOURCE_A, SOURCE_B, pocl_cache=pocl)
    assert out.stdout.split()[:2] == ["B", "A"]
    assert list(folder.iterdir()) == []


# A job's ranks, all sharing one POCL_CACHE_DIR (pocl's default is shared by every rank of
# a user on a node). "barrier": between each build and its launch, an MPI barrier, rank 0
# building first (the others reach their build while it sits in the barrier).
SHARED = r"""
import json, os, sys
from mpi4py import MPI
import numpy as np, pyopencl as cl, asyncclcache as acc
from _pocl import pocl_context
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
acc.install(acc.Cache(sys.argv[1]))
ctx = pocl_context(); q = cl.CommandQueue(ctx)
a = np.ones(64, np.float32)
buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=a)
failed, barrier = [], sys.argv[3] == "barrier"
comm.Barrier()
for i in range(int(sys.argv[2])):
    src = ("__kernel void f(__global float *a) { int g = get_global_id(0); "
           + f"a[g] = a[g] * 1.5f + {i}.0f;" * 8 + "} // shared pocl")
    try:
        if barrier and rank == 0:
            prg = cl.Program(ctx, src).build()
            comm.Barrier()
        elif barrier:
            comm.Barrier()
            prg = cl.Program(ctx, src).build()
        else:
            prg = cl.Program(ctx, src).build()
        prg.f(q, a.shape, (16,), buf)
        q.finish()
    except cl.Error as e:
        failed.append(f"{i}: {str(e)[:80]}")
rows = comm.gather(failed, root=0)
if rank == 0:
    print(json.dumps({"failed": rows}))
"""


def _mpi_job(n: int, tmp: Path, cache_dir: Path, programs: int, how: str) -> dict:
    from conftest import need
    from test_mpi import _mpiexec

    exe = _mpiexec()
    if exe is None:
        need("MPI", "MPI cannot start here (no mpiexec, or mpi4py missing: pip install '.[mpi]')")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tests"), POCL_CACHE_DIR=str(tmp / "pocl"))
    proc = subprocess.run([exe, "-n", str(n), sys.executable, "-c", SHARED, str(cache_dir), str(programs), how],
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return child_json(proc)


def test_ranks_sharing_one_pocl_cache_never_fail_a_build(cache_dir: Path, tmp_path: Path) -> None:
    # F32: 16 ranks, 24 programs, one pocl cache: pocl 3.1 failed builds in every run.
    out = _mpi_job(16, tmp_path, cache_dir, 24, "together")
    assert out["failed"] == [[]] * 16, out


def test_a_rank_in_a_barrier_between_its_build_and_its_launch_blocks_no_other(
        cache_dir: Path, tmp_path: Path) -> None:
    out = _mpi_job(4, tmp_path, cache_dir, 4, "barrier")
    assert out["failed"] == [[]] * 4, out
