"""Each program compiled once a node (issue 41, :mod:`asyncclcache.nodecompile`): the ranks
of a node, each with its own pocl cache (or one shared), hand each other pocl's folders: the
build's and each kernel's first launch's. On real pocl (its own debug output says whether it
compiled a variant or used one), with real MPICH where ranks are named.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from asyncclcache import nodecompile, nodecopies
from conftest import ROOT, child_json, run_child

pytestmark = pytest.mark.slow

SOURCE = ("__kernel void f(__global float *a) { int g = get_global_id(0); "
          "a[g] = a[g] * 2.0f + 1.0f; } // nodecompile")

# A process that does what its stdin says, one line at a time, and answers each.
STEPS = r"""
import json, sys
import numpy as np, pyopencl as cl, asyncclcache as acc
from asyncclcache import nodecompile
from _pocl import pocl_context
nodecompile.WAIT = float(sys.argv[3])
if sys.argv[4] == "one-stripe":
    nodecompile._stripe = lambda *parts: "abc"  # the test holds this lock file
if sys.argv[4] == "no-release":  # as while the main thread holds the GIL (an mpi4py collective)
    nodecompile._Releaser.add = lambda self, held: None
cache = acc.Cache(sys.argv[1]); acc.install(cache)
ctx = pocl_context(); q = cl.CommandQueue(ctx)
a = np.ones(64, np.float32)
buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=a)
prg = knl = None
for line in sys.stdin:
    if line.strip() == "build":
        prg = cl.Program(ctx, sys.argv[2]).build()
        knl = prg.f
        print(json.dumps({"built": True}), flush=True)
    elif line.strip() == "launch":
        knl(q, a.shape, (16,), buf); q.finish()
        out = np.empty_like(a); cl.enqueue_copy(q, out, buf)
        print(json.dumps({"values": sorted(set(out.tolist()))}), flush=True)
    elif line.strip() == "stats":
        print(json.dumps(cache.stats().as_dict()), flush=True)
"""


class _Steps:
    """A child process of :data:`STEPS`: one rank of a simulated node."""

    def __init__(self, cache_dir: Path, tmp: Path, name: str, *, wait: float = 600.0, stripe: str = "") -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT / "tests"), POCL_CACHE_DIR=str(tmp / f"pocl-{name}"),
                   ASYNCCLCACHE_NODE_COMPILE="1", ASYNCCLCACHE_NODE_DIR=str(tmp / "node"),
                   POCL_DEBUG="general")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", STEPS, str(cache_dir), SOURCE, str(wait), stripe or "-"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    def __call__(self, step: str) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(step + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, self.finish()
        return json.loads(line)

    def finish(self) -> str:
        """Its stderr, once it has ended."""
        _, err = self.proc.communicate(timeout=120)
        return err


def test_a_rank_takes_the_build_and_the_first_launch_of_another(cache_dir: Path, tmp_path: Path) -> None:
    a, b = _Steps(cache_dir, tmp_path, "a"), _Steps(cache_dir, tmp_path, "b")
    try:
        a("build")
        b("build")  # a's folder copied in: pocl's front end skipped
        assert a("launch") == {"values": [3.0]}  # a compiles the variant
        assert b("launch") == {"values": [3.0]}  # b takes it
        sa, sb = a("stats"), b("stats")
    finally:
        err_a, err_b = a.finish(), b.finish()
    assert (sa["node_builds"], sa["node_launches"]) == (0, 0)
    assert (sb["node_builds"], sb["node_launches"]) == (1, 1)
    # pocl's own word: a built the variant; b loaded a's, compiling nothing.
    assert "Built a specialized WG function" in err_a, err_a[-2000:]
    assert "Using a cached WG function" in err_b and "Built a specialized WG function" not in err_b, err_b[-2000:]


def test_a_rank_launching_first_compiles_and_the_other_takes_it(cache_dir: Path, tmp_path: Path) -> None:
    a, b = _Steps(cache_dir, tmp_path, "a"), _Steps(cache_dir, tmp_path, "b")
    try:
        a("build")
        b("build")
        assert b("launch") == {"values": [3.0]}  # b launches first: b compiles
        assert a("launch") == {"values": [3.0]}
        sa = a("stats")
    finally:
        err_a, err_b = a.finish(), b.finish()
    assert sa["node_launches"] == 1
    assert "Built a specialized WG function" in err_b
    assert "Built a specialized WG function" not in err_a, err_a[-2000:]


def test_a_holder_that_cannot_release_its_lock_blocks_no_one_once_pocl_is_done(
        cache_dir: Path, tmp_path: Path) -> None:
    # The first launch's lock goes with a thread of the holder's, which cannot run while its
    # main thread holds the GIL in a pickle-based mpi4py collective that waits for the others.
    a = _Steps(cache_dir, tmp_path, "a", stripe="no-release")
    b = _Steps(cache_dir, tmp_path, "b")
    try:
        a("build")
        b("build")
        assert a("launch") == {"values": [3.0]}  # compiled; its lock is never released
        t = time.monotonic()
        assert b("launch") == {"values": [3.0]}  # pocl's file says a is done: copied
        assert time.monotonic() - t < nodecompile.WAIT / 2
        sb = b("stats")
    finally:
        err_a, err_b = a.finish(), b.finish()
    assert sb["node_launches"] == 1 and sb["node_waits_cut"] == 0
    assert "Built a specialized WG function" in err_a
    assert "Built a specialized WG function" not in err_b, err_b[-2000:]


def _hold(lock: Path) -> subprocess.Popen[str]:
    lock.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    code = ("import fcntl, os, sys, time\nfd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(lock)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _stripe_lock(tmp: Path) -> Path:
    node = tmp / "node" / f"asyncclcache-{os.getuid()}" / nodecopies.COMPILES
    return node / "locks" / "abc.lock"


def test_a_killed_compiler_lets_the_others_go_on_at_once(cache_dir: Path, tmp_path: Path) -> None:
    holder = _hold(_stripe_lock(tmp_path))  # a rank of the node, mid-compile
    b = _Steps(cache_dir, tmp_path, "b", stripe="one-stripe")
    try:
        assert b.proc.stdin is not None
        b.proc.stdin.write("build\n")
        b.proc.stdin.flush()
        time.sleep(1.0)
        assert b.proc.poll() is None
        holder.kill()  # its lock goes with it
        holder.wait(30)
        t = time.monotonic()
        assert b.proc.stdout is not None and json.loads(b.proc.stdout.readline()) == {"built": True}
        assert time.monotonic() - t < 60
        assert b("launch") == {"values": [3.0]}
        stats = b("stats")
    finally:
        with contextlib.suppress(OSError):
            holder.kill()
        err = b.finish()
    assert stats["node_waits_cut"] == 0
    assert "held a compile" not in err


def test_a_stopped_compiler_is_waited_for_a_bounded_time(cache_dir: Path, tmp_path: Path) -> None:
    holder = _hold(_stripe_lock(tmp_path))
    os.kill(holder.pid, signal.SIGSTOP)
    b = _Steps(cache_dir, tmp_path, "b", wait=1.0, stripe="one-stripe")
    try:
        assert b("build") == {"built": True}
        assert b("launch") == {"values": [3.0]}
        stats = b("stats")
    finally:
        holder.kill()
        holder.wait(30)
        err = b.finish()
    assert stats["node_waits_cut"] == 1  # the build; its program is then not handed on at launch
    assert "compiling without it" in err


RECORD = r"""
import json, sys
import numpy as np, pyopencl as cl, asyncclcache as acc
from _pocl import pocl_context
cache = acc.Cache(sys.argv[1]); acc.install(cache)
ctx = pocl_context(); q = cl.CommandQueue(ctx)
a = np.ones(64, np.float32)
buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=a)
prg = cl.Program(ctx, sys.argv[2]).build()
prg.f(q, a.shape, (16,), buf); q.finish()
out = np.empty_like(a); cl.enqueue_copy(q, out, buf)
print(json.dumps({"values": sorted(set(out.tolist())), "key": prg.cache_key, **cache.stats().as_dict()}))
"""


def test_a_record_of_another_program_never_changes_what_runs(cache_dir: Path, tmp_path: Path) -> None:
    env = {"ASYNCCLCACHE_NODE_COMPILE": "1", "ASYNCCLCACHE_NODE_DIR": str(tmp_path / "node")}
    other = SOURCE.replace("* 2.0f + 1.0f", "* 5.0f")
    first = child_json(run_child(RECORD, str(tmp_path / "acc-other"), other, pocl_cache=tmp_path / "pocl-a",
                                 env=env))
    assert first["values"] == [5.0]
    # A record for our program's key that names the other program's folder (a damaged or
    # planted record): its files go where pocl looks for that other program only.
    node = tmp_path / "node" / f"asyncclcache-{os.getuid()}" / nodecopies.COMPILES
    probe = child_json(run_child(RECORD, str(tmp_path / "acc-probe"), SOURCE, pocl_cache=tmp_path / "pocl-p",
                                 env={"ASYNCCLCACHE_NODE_COMPILE": "0"}))
    key = probe["key"]
    theirs = json.loads((node / first["key"][:2] / f"{first['key']}{nodecopies.RECORD_SUFFIX}").read_text())
    (node / key[:2]).mkdir(mode=0o700, exist_ok=True)
    (node / key[:2] / f"{key}{nodecopies.RECORD_SUFFIX}").write_text(json.dumps(theirs))
    ours = child_json(run_child(RECORD, str(cache_dir), SOURCE, pocl_cache=tmp_path / "pocl-b", env=env))
    assert ours["values"] == [3.0]
    assert ours["node_builds"] == 0  # pocl did not use the copy: taken back
    assert not (tmp_path / "pocl-b" / theirs["folders"][0]).exists()


@pytest.mark.parametrize("junk", [b"", b"{", b'{"root": "relative", "folders": []}',
                                  b'{"root": "/x", "folders": ["../../etc"]}'])
def test_a_damaged_record_is_ignored(cache_dir: Path, tmp_path: Path, junk: bytes) -> None:
    from asyncclcache.nodecopies import node_base

    compiles = nodecompile.NodeCompiles(node_base(str(tmp_path)))
    path = compiles._record_path("ab" + "0" * 62)
    path.parent.mkdir(mode=0o700)
    path.write_bytes(junk)
    assert compiles._read_record("ab" + "0" * 62) is None


# The child only sleeps and exits: the pytest process's threads cannot deadlock it.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_keeps_no_lock_of_its_parent(tmp_path: Path) -> None:
    import fcntl

    from asyncclcache.nodecopies import node_base

    compiles = nodecompile.NodeCompiles(node_base(str(tmp_path)))
    fd = compiles._take("abc")
    assert fd is not None
    pid = os.fork()
    if pid == 0:  # a multiprocessing worker, say, forked while a first launch held the lock
        time.sleep(30)
        os._exit(0)
    try:
        compiles._release("abc", fd)
        probe = os.open(compiles.base / "locks" / "abc.lock", os.O_RDWR)
        try:
            # Free once the child has run its at-fork handler (at once); else not for 30 s.
            deadline = time.monotonic() + 10
            while True:
                try:
                    fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    assert time.monotonic() < deadline, "the forked child still holds the lock"
                    time.sleep(0.01)
        finally:
            os.close(probe)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_a_cold_rank_lets_a_warm_one_compile_but_copies_at_once(tmp_path: Path, monkeypatch) -> None:
    import fcntl

    from asyncclcache.nodecopies import node_base

    compiles = nodecompile.NodeCompiles(node_base(str(tmp_path)))
    warm = os.open(compiles.base / "locks" / "warm.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(warm, fcntl.LOCK_SH)  # another process of the node has compiled (paid pocl's start-up)
    slept: list[float] = []
    # nodecompile's own clock only (other threads of this process sleep too)
    monkeypatch.setattr(nodecompile, "time", types.SimpleNamespace(
        sleep=slept.append, monotonic=time.monotonic, time=time.time))
    try:
        fd = compiles._take("abc")  # nothing recorded: this one would compile, so the warm one goes first
        assert fd is not None and slept == [nodecompile.COLD_DEFER]
        compiles._release("abc", fd)
        slept.clear()
        fd = compiles._take("abc", recorded=lambda: True)  # compiled elsewhere already: a copy, no deferring
        assert fd is not None and slept == []
        compiles._release("abc", fd)
    finally:
        os.close(warm)


def test_one_process_outside_a_launcher_hands_nothing_on(cache_dir: Path, tmp_path: Path) -> None:
    code = RECORD + "from asyncclcache import nodecompile\nprint(cache._node_compiles is None, nodecompile._real is None)\n"
    env = {k: "" for k in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")}
    out = run_child(code, str(cache_dir), SOURCE, env={**env, "ASYNCCLCACHE_NODE_DIR": str(tmp_path / "node")})
    assert out.stdout.split()[-2:] == ["True", "True"]
    assert not (tmp_path / "node").exists()


# A job's ranks, each its own pocl cache (as docs/mpi.md advised before). "barrier": an MPI
# barrier between every build and its launch. "event": rank 0's launch waits for a user
# event that it sets after a barrier, so a rank that waited for rank 0's compile while rank
# 0 sits in the barrier would never get there.
RANKS = r"""
import json, os, sys
from mpi4py import MPI
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
os.environ["POCL_CACHE_DIR"] = os.path.join(sys.argv[1], f"pocl-{rank}")
import numpy as np, pyopencl as cl, asyncclcache as acc
from asyncclcache import nodecompile
from _pocl import pocl_context
nodecompile.WAIT = 3600.0  # a rank that waited on rank 0's user event would time the job out
cache = acc.Cache(os.path.join(sys.argv[1], "acc")); acc.install(cache)
ctx = pocl_context(); q = cl.CommandQueue(ctx)
how, programs = sys.argv[2], int(sys.argv[3])
bad = []
comm.Barrier()
for i in range(programs):
    a = np.full(64, float(rank), np.float32)
    buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=a)
    src = ("__kernel void f(__global float *a) { int g = get_global_id(0); "
           + f"a[g] = a[g] * 2.0f + {i}.0f;" + "} // nodecompile ranks")
    prg = cl.Program(ctx, src).build()
    if how == "barrier":
        comm.Barrier()
        prg.f(q, a.shape, (16,), buf)
    elif rank == 0:
        gate = cl.UserEvent(ctx)
        prg.f(q, a.shape, (16,), buf, wait_for=[gate])
        q.flush()
        comm.Barrier()
        gate.set_status(cl.command_execution_status.COMPLETE)
    else:
        prg.f(q, a.shape, (16,), buf)
        q.finish()
        comm.Barrier()
    q.finish()
    out = np.empty_like(a); cl.enqueue_copy(q, out, buf)
    if not np.all(out == a * 2 + i):
        bad.append(i)
s = cache.stats()
rows = comm.gather({"bad": bad, "node_builds": s.node_builds, "node_launches": s.node_launches}, root=0)
if rank == 0:
    print(json.dumps(rows))
"""


def _ranks(n: int, tmp: Path, how: str, programs: int) -> list[dict]:
    from conftest import need
    from test_mpi import _mpiexec

    exe = _mpiexec()
    if exe is None:
        need("MPI", "MPI cannot start here (no mpiexec, or mpi4py missing: pip install '.[mpi]')")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tests"), ASYNCCLCACHE_NODE_DIR=str(tmp / "node"))
    proc = subprocess.run([exe, "-n", str(n), sys.executable, "-c", RANKS, str(tmp), how, str(programs)],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return child_json(proc)


def test_ranks_in_a_barrier_between_build_and_launch_compile_each_program_once(tmp_path: Path) -> None:
    rows = _ranks(4, tmp_path, "barrier", 3)
    assert [r["bad"] for r in rows] == [[]] * 4
    # The builds wait for each other (no user code under the lock): one compiles, the
    # other three take its folder, for every program.
    assert sum(r["node_builds"] for r in rows) == 3 * 3, rows


def test_a_rank_waiting_for_a_user_event_after_a_barrier_blocks_no_other(tmp_path: Path) -> None:
    rows = _ranks(4, tmp_path, "event", 2)
    assert [r["bad"] for r in rows] == [[]] * 4, rows
