"""Ranks: rank-local directories, one warm-up per key in a shared directory, killed holders.

MPI tests launch ``mpiexec -n R`` (mpich from PyPI with mpi4py: the ``mpi`` extra) and
are skipped, with the reason, only where MPI cannot start here.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from asyncclcache import maintenance
from asyncclcache.store import Store
from conftest import ROOT, child_json, need, run_child

pytestmark = pytest.mark.slow  # mpiexec, or the seed kernel at n=1000 held for seconds

RANK_RUN = r"""
import json, os, sys
rank = int(os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or 0)
# argv[5] "own": one POCL_CACHE_DIR per rank (a node each); "shared": one for all ranks
# (distinct programs then: pocl before 6.0 must not compile one program twice at once there).
pocl_mode, distinct = (sys.argv[5], sys.argv[5] == "shared") if len(sys.argv) > 5 else ("own", False)
os.environ["POCL_CACHE_DIR"] = os.path.join(sys.argv[2], f"pocl-rank{rank}" if pocl_mode == "own" else "pocl")
from mpi4py import MPI
import pyopencl as cl, asyncclcache as acc
from kernels import small_source, run_twice
from _pocl import pocl_context
comm = MPI.COMM_WORLD
if os.environ.get("ACC_TEST_CLAIM_LOG"):
    # Each claim's start and end, and each write under it, in one O_APPEND file (one
    # write() a line): the file's order is the order of events across ranks.
    from asyncclcache import store as st
    log_fd = os.open(os.environ["ACC_TEST_CLAIM_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    note = lambda *words: os.write(log_fd, (" ".join(map(str, words)) + "\n").encode())
    claim, release, publish = st.Store.claim, st.Claim.release, st.Store.publish
    def logged_claim(self, key, **kw):
        c = claim(self, key, **kw)
        if c is not None:
            note("+", key, rank)
        return c
    def logged_release(self):
        note("-", self.key, rank)  # before the unlock: the next holder's "+" comes after
        release(self)
    def logged_publish(self, entry, **kw):
        result = publish(self, entry, **kw)
        if result is st.PublishResult.WRITTEN:
            note("w", entry.key, rank, entry.meta.snapshot)  # "snapshot", or "refresh"
        return result
    st.Store.claim, st.Claim.release, st.Store.publish = logged_claim, logged_release, logged_publish
cache = acc.Cache(sys.argv[1], rank_local=(sys.argv[3] == "local"))
ctx = pocl_context()
ok = True
# The ranks start their builds together, as after a simulation's set-up: a rank still
# importing while another has written its first entry would hit it (9 misses expected).
comm.Barrier()
for i in range(int(sys.argv[4])):
    prg = acc.Program(ctx, small_source(salt=f"mpi-{rank}-{i}" if distinct else f"mpi-{i}"), cache=cache).build()
    ok = run_twice(ctx, prg) and ok
flushed = cache.flush(180)
total = cache.stats(comm=comm)
rows = comm.gather({"rank": rank, "dir": cache.directory, "ok": ok, "flushed": flushed,
                    "stats": cache.stats().as_dict()}, root=0)
if rank == 0:
    print(json.dumps({"size": comm.Get_size(), "total": total.as_dict(), "rows": rows,
                      "line": total.line()}))
"""


@functools.cache
def _mpiexec() -> str | None:
    bindir = os.path.dirname(sys.executable)
    exe = shutil.which("mpiexec", path=bindir + os.pathsep + os.environ.get("PATH", ""))
    if exe is None:
        return None
    try:
        probe = subprocess.run(
            [exe, "-n", "2", sys.executable, "-c",
             "from mpi4py import MPI; c = MPI.COMM_WORLD; c.Get_rank() or print(c.Get_size())"],
            capture_output=True, text=True, timeout=120, check=False,
        )
    except subprocess.TimeoutExpired:
        return None
    return exe if probe.returncode == 0 and probe.stdout.split() == ["2"] else None


def _mpirun(n: int, *args: str, tmp: Path, strategy: str = "auto", claim_log: Path | None = None) -> dict:
    exe = _mpiexec()
    if exe is None:
        need("MPI", "MPI cannot start here (no mpiexec, or mpi4py missing: pip install '.[mpi]')")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tests") + os.pathsep + os.environ.get("PYTHONPATH", ""),
               ASYNCCLCACHE_STRATEGY=strategy)
    env.pop("POCL_CACHE_DIR", None)
    if claim_log is not None:
        env["ACC_TEST_CLAIM_LOG"] = str(claim_log)
    proc = subprocess.run([exe, "-n", str(n), sys.executable, "-c", RANK_RUN, *args],
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    return child_json(proc)


def test_rank_local_directories(cache_dir, tmp_path):
    out = _mpirun(2, str(cache_dir), str(tmp_path / "pocl1"), "local", "2", tmp=tmp_path)
    assert out["size"] == 2
    dirs = sorted(r["dir"] for r in out["rows"])
    assert [Path(d).name for d in dirs] == ["rank-0", "rank-1"]
    assert all(r["ok"] and r["flushed"] for r in out["rows"])
    for d in dirs:  # each rank wrote its own entries
        assert len(list(Store(cache_dir, rank_local=False).entries())) == 0
        assert len([p for p in Path(d).rglob("*.acl")]) == 2
    # auto is kcache on pocl: pocl's own folders are stored, nothing compiled for the cache.
    assert out["total"]["writes"] == 4


def _claims_and_writes(log: str) -> tuple[list[str], dict[str, list[str]], int]:
    """From RANK_RUN's claim log: the claims taken while another rank held the key, each
    key's first writes (the ranks that wrote a snapshot) and the number of refresh rewrites."""
    holders: dict[str, set[str]] = {}
    overlaps: list[str] = []
    first: dict[str, list[str]] = {}
    refreshes = 0
    for i, line in enumerate(log.splitlines()):
        op, key, rank, *purpose = line.split()
        held = holders.setdefault(key, set())
        if op == "+":
            if held:
                overlaps.append(f"line {i}: rank {rank} claimed {key[:12]} held by rank(s) {sorted(held)}")
            held.add(rank)
        elif op == "-":
            held.discard(rank)
        elif purpose == ["refresh"]:
            refreshes += 1
        else:
            first.setdefault(key, []).append(rank)
    return overlaps, first, refreshes


def test_kcache_shared_directory_one_entry_per_key_then_all_hits(cache_dir, tmp_path):
    # kcache writes within moments of the first launch, so a slower rank may already hit.
    # A "write" counts refresh rewrites too (the program gained variants: legitimate, and
    # counted in "refreshes"); the claim log tells those from a key claimed twice at once.
    programs = 3
    log = tmp_path / "claims.log"
    cold = _mpirun(3, str(cache_dir), str(tmp_path / "pocl-cold"), "shared", str(programs), tmp=tmp_path,
                   claim_log=log)
    assert all(r["ok"] and r["flushed"] for r in cold["rows"])
    t = cold["total"]
    overlaps, first, refreshes = _claims_and_writes(log.read_text())
    assert not overlaps, f"a key's claim was held by two ranks at once: {overlaps}"
    assert t["unidentified"] == 0, cold["rows"]
    assert (sum(map(len, first.values())), refreshes) == (t["writes"] - t["refreshes"], t["refreshes"]), (
        "the claim log and the counters disagree", log.read_text(), cold["rows"])
    assert len(first) == programs, first
    assert t["hits"] + t["misses"] == 3 * programs
    assert t["misses"] == t["writes"] - t["refreshes"] + t["skipped"]  # every miss wrote, or left the key
    assert len(list(Store(cache_dir, rank_local=False).entries())) == programs
    warm = _mpirun(3, str(cache_dir), str(tmp_path / "pocl-warm"), "shared", str(programs), tmp=tmp_path)
    w = warm["total"]
    assert (w["hits"], w["misses"], w["writes"], w["rejected"]) == (3 * programs, 0, 0, 0)
    assert all(r["ok"] for r in warm["rows"])
    rewritten = {k[:12]: ranks for k, ranks in first.items() if len(ranks) > 1}
    # One claim after another, not at once: a rank that missed the key while another was
    # publishing it must see, at its claim, that the file is not the one its lookup saw.
    assert not rewritten, f"keys written again by a later claim after a miss: {rewritten}"


@pytest.mark.parametrize("mode", ["local", "shared"])
def test_kcache_ranks_sharing_one_pocl_cache(cache_dir, tmp_path, mode):
    # Two ranks, one POCL_CACHE_DIR, different programs built at the same time: each build
    # must find its own folder among the other rank's, and every program hits next time.
    programs = 3
    cold = _mpirun(2, str(cache_dir), str(tmp_path / "cold"), mode, str(programs), "shared", tmp=tmp_path)
    assert all(r["ok"] and r["flushed"] for r in cold["rows"])
    t = cold["total"]
    assert (t["misses"], t["writes"], t["unidentified"]) == (2 * programs, 2 * programs, 0), cold["rows"]
    warm = _mpirun(2, str(cache_dir), str(tmp_path / "warm"), mode, str(programs), "shared", tmp=tmp_path)
    w = warm["total"]
    assert (w["hits"], w["misses"], w["rejected"]) == (2 * programs, 0, 0), warm["rows"]
    assert all(r["ok"] for r in warm["rows"])


# Without MPI: the claim is a per-key flock; a live holder makes others skip, a dead one expires.
# Holds the key's claim as a writer does while it works (the store's per-key flock), until
# told to go (or killed); the key comes from a build through a cache elsewhere.
HOLDER = r"""
import json, os, sys, signal
import pyopencl as cl, asyncclcache as acc
from asyncclcache.store import Store
from kernels import small_source
from _pocl import pocl_context
ctx = pocl_context()
elsewhere = acc.Cache(sys.argv[1] + "-key", rank_local=False)
prg = acc.Program(ctx, small_source(salt="claim-test"), cache=elsewhere).build()
claim = Store(sys.argv[1], rank_local=False).claim(prg.cache_key)
assert claim is not None
print("claimed", flush=True)
if sys.argv[2] == "die":
    os.kill(os.getpid(), signal.SIGKILL)
sys.stdin.readline()          # hold the claim until the test says go
claim.release()
print(json.dumps({"released": True}), flush=True)
"""

CONTENDER = r"""
import json, sys
import pyopencl as cl, asyncclcache as acc
from kernels import small_source, run_twice
from _pocl import pocl_context
ctx = pocl_context()
cache = acc.Cache(sys.argv[1], rank_local=False)
prg = acc.Program(ctx, small_source(salt="claim-test"), cache=cache).build()
ok = run_twice(ctx, prg)
print(json.dumps({"ok": ok, "flushed": cache.flush(300), "stats": cache.stats().as_dict()}))
"""


def _start_holder(cache_dir: Path, mode: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tests") + os.pathsep + os.environ.get("PYTHONPATH", ""),
               POCL_CACHE_DIR=str(cache_dir.parent / f"pocl-holder-{mode}"))
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(cache_dir), mode], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "claimed"
    return proc


def test_live_claim_makes_others_skip(cache_dir):
    holder = _start_holder(cache_dir, "hold")
    try:
        other = child_json(run_child(CONTENDER, str(cache_dir)))
        assert other["ok"] and other["flushed"]
        s = other["stats"]
        assert (s["misses"], s["skipped"], s["writes"]) == (1, 1, 0)
        out, _ = holder.communicate("go\n", timeout=300)
    finally:
        holder.kill()
    assert child_json(subprocess.CompletedProcess([], 0, out, "")) == {"released": True}
    after = child_json(run_child(CONTENDER, str(cache_dir)))  # the claim is free again
    assert (after["stats"]["misses"], after["stats"]["writes"]) == (1, 1)


def test_claim_of_a_killed_process_expires(cache_dir):
    holder = _start_holder(cache_dir, "die")
    holder.wait(30)
    assert holder.returncode == -signal.SIGKILL
    after = child_json(run_child(CONTENDER, str(cache_dir)))
    s = after["stats"]
    assert (s["misses"], s["skipped"], s["writes"]) == (1, 0, 1)
    store = Store(cache_dir, rank_local=False)
    temps, _locks = maintenance.orphans(store)
    assert temps == []
    assert [e.key for e in store.entries()]
    again = child_json(run_child(CONTENDER, str(cache_dir)))
    assert again["stats"]["hits"] == 1 and again["stats"]["writes"] == 0
