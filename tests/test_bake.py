"""``asyncclcache bake`` on real pocl: kernel-cache entries made into binaries, preferred at
a hit while they hold every file of their entry; never partial, never twice.

Every run is a child process with its own ``POCL_CACHE_DIR`` (a new node), as on a cluster.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _procs import SAFE_PATH, children, gone, plant, with_args
from asyncclcache.keys import baked_key
from asyncclcache.store import Store
from conftest import child_json, run_child

# Builds programs twice<i> (distinct pocl folders), launches each with a local size, and
# reports what the build and the launches added to its fresh pocl cache.
RUN = r"""
import json, os, pathlib, sys
import pyopencl as cl, asyncclcache as acc
from kernels import small_source, run_twice
from _pocl import pocl_context
root = pathlib.Path(os.environ["POCL_CACHE_DIR"])
files = lambda: sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and "tempfile" not in p.name)
ctx = pocl_context()
cache = acc.Cache(sys.argv[1], rank_local=False)
n, local = int(sys.argv[2]), int(sys.argv[3])
prgs = [acc.Program(ctx, small_source(f"twice{i}", salt="bake"), cache=cache).build() for i in range(n)]
built = files()
ok = all(run_twice(ctx, p, f"twice{i}", local_size=(local,)) for i, p in enumerate(prgs))
launched = files()
cache.flush(60)
print(json.dumps({"ok": ok, "built": built, "launched": launched, "keys": [p.cache_key for p in prgs],
                  **cache.stats().as_dict()}))
"""


def _idle(tmp: Path, **env: str) -> dict[str, str]:
    """A child's environment with idle baking on and a temp folder of the test's own: what a
    killed baker leaves (its pocl cache) stays there, not in the session's temp folder."""
    (tmp / "tmp").mkdir(exist_ok=True)
    return {"ASYNCCLCACHE_BAKE": "idle", "TMPDIR": str(tmp / "tmp"), **env}


def _run(cache_dir: Path, tmp: Path, n: int = 2, local: int = 64, env: dict[str, str] | None = None) -> dict:
    return child_json(run_child(RUN, str(cache_dir), str(n), str(local), pocl_cache=tmp, env=env))


def _bake(cache_dir: Path, *args: str, check: bool = True) -> dict:
    proc = subprocess.run([sys.executable, "-m", "asyncclcache", "bake", "--dir", str(cache_dir), "--json", *args],
                          capture_output=True, text=True, timeout=600, check=False)
    if check:
        assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _baked(cache_dir: Path) -> dict[str, bytes]:
    store = Store(cache_dir, rank_local=False, create=False)
    out = {}
    for e in store.entries():
        entry = store.load(e.key)
        assert entry is not None, f"{e.key} does not load"
        if entry.meta.baked_from is not None:
            out[entry.meta.baked_from] = b"".join(entry.binaries)
    return out


def test_a_baked_hit_launches_without_compiling(cache_dir: Path, tmp_path: Path) -> None:
    cold = _run(cache_dir, tmp_path / "cold")
    assert cold["ok"] and (cold["misses"], cold["writes"]) == (2, 2), cold
    result = _bake(cache_dir, "--jobs", "1")
    assert result["baked"] == 2 and not result["failed"], result
    assert set(_baked(cache_dir)) == set(cold["keys"])
    warm = _run(cache_dir, tmp_path / "warm")
    assert warm["ok"] and (warm["hits"], warm["baked_hits"], warm["misses"]) == (2, 2, 0), warm
    # The binaries unpacked everything at the build; the launches compiled nothing.
    assert warm["built"] == warm["launched"], set(warm["launched"]) - set(warm["built"])
    assert any("/64-1-1" in f for f in warm["built"])
    # Nothing to refresh: the generic variant the binary unpacks is no gain.
    assert (warm["writes"], warm["refreshes"], warm["bakes_dropped"]) == (0, 0, 0), warm


def test_a_bake_that_lacks_a_variant_of_its_entry_serves_with_the_variant_beside_it(
        cache_dir: Path, tmp_path: Path) -> None:
    _run(cache_dir, tmp_path / "cold", n=1, local=64)
    assert _bake(cache_dir)["baked"] == 1
    baked_before = _baked(cache_dir)
    # Another local size: the baked hit launches a new variant, and the entry gains it.
    grown = _run(cache_dir, tmp_path / "grown", n=1, local=32)
    assert (grown["baked_hits"], grown["refreshes"]) == (1, 1), grown
    # The bake lacks the new variant: it still serves, the entry's variant is written beside
    # what it unpacked, and neither launch compiles.
    after = _run(cache_dir, tmp_path / "after", n=1, local=32)
    assert (after["hits"], after["baked_hits"], after["bakes_dropped"]) == (1, 1, 0), after
    assert any("/32-1-1" in f for f in after["built"]), after["built"]
    assert after["built"] == after["launched"], set(after["launched"]) - set(after["built"])
    other = _run(cache_dir, tmp_path / "other", n=1, local=64)
    assert other["baked_hits"] == 1 and other["built"] == other["launched"], other
    assert _baked(cache_dir) == baked_before  # kept; a bake folds the variant in
    assert _bake(cache_dir)["baked"] == 1
    rebaked = _run(cache_dir, tmp_path / "rebaked", n=1, local=32)
    assert (rebaked["baked_hits"], rebaked["bakes_dropped"]) == (1, 0), rebaked
    assert rebaked["built"] == rebaked["launched"]
    assert _baked(cache_dir) != baked_before


def test_bake_twice_is_a_no_op(cache_dir: Path, tmp_path: Path) -> None:
    _run(cache_dir, tmp_path / "cold")
    assert _bake(cache_dir)["baked"] == 2
    store = Store(cache_dir, rank_local=False, create=False)
    stamps = {k: store.stamp(k) for k in (e.key for e in store.entries())}
    again = _bake(cache_dir)
    assert again["baked"] == 0 and again["skipped"] == {"already baked": 2}, again
    assert {k: store.stamp(k) for k in (e.key for e in store.entries())} == stamps


def test_jobs_2_gives_the_same_entries_as_jobs_1(cache_dir: Path, tmp_path: Path) -> None:
    _run(cache_dir, tmp_path / "cold", n=3)
    other = tmp_path / "copy"
    shutil.copytree(cache_dir, other)
    assert _bake(cache_dir, "--jobs", "1")["baked"] == 3
    assert _bake(other, "--jobs", "2")["baked"] == 3
    assert _baked(cache_dir) == _baked(other)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["kill", "ctrl-c"])
def test_a_killed_bake_leaves_no_partial_entry(
        cache_dir: Path, tmp_path: Path, sig: int, monkeypatch: pytest.MonkeyPatch) -> None:
    _run(cache_dir, tmp_path / "cold", n=4)
    # Its workers' pocl caches: what a kill leaves (the next bake removes those of processes
    # gone) stays in the test's own temp folder.
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    proc = subprocess.Popen([sys.executable, "-m", "asyncclcache", "bake", "--dir", str(cache_dir), "--jobs", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    store = Store(cache_dir, rank_local=False, create=False)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if any(store.read_meta(e.path) and store.read_meta(e.path).baked_from for e in store.entries()):
            break
        time.sleep(0.02)
    os.killpg(proc.pid, sig)  # the bake and its workers, wherever they are (a terminal's Ctrl-C)
    _, err = proc.communicate(timeout=60)
    if sig == signal.SIGINT and proc.returncode != 0:  # not already done: stopped at once, and said so
        assert proc.returncode == 130 and b"interrupted; every entry is whole" in err, (proc.returncode, err)
        assert b"Traceback" not in err, err
    verify = subprocess.run([sys.executable, "-m", "asyncclcache", "verify", "--dir", str(cache_dir)],
                            capture_output=True, text=True, timeout=120, check=False)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    baked = _baked(cache_dir)  # each loads whole, or is not there
    assert 1 <= len(baked) <= 4
    rest = _bake(cache_dir)
    assert rest["baked"] == 4 - len(baked) and rest["skipped"].get("already baked") == len(baked), rest


def test_entries_a_bake_here_would_key_otherwise_are_left(cache_dir: Path, tmp_path: Path) -> None:
    # Built with a code setting of pocl's: this bake's environment would key it otherwise.
    _run(cache_dir, tmp_path / "cold", n=1, env={"POCL_WORK_GROUP_SPECIALIZATION": "1"})
    result = _bake(cache_dir)
    assert result["baked"] == 0 and not result["failed"], result
    assert list(result["skipped"]) == ["built here it would have another key (pyopencl version or POCL_* settings)"]
    env = dict(os.environ, POCL_WORK_GROUP_SPECIALIZATION="1")
    proc = subprocess.run([sys.executable, "-m", "asyncclcache", "bake", "--dir", str(cache_dir), "--json"],
                          capture_output=True, text=True, timeout=600, check=True, env=env)
    assert json.loads(proc.stdout)["baked"] == 1


#: A first line for IDLE: the gate lets the baker run whenever it is asked (at SCHED_IDLE
#: still), so that a test of what it does is not a test of how busy the machine is.
EAGER = "import asyncclcache.bake; asyncclcache.bake.IDLE_CORES = 0.0\n"


IDLE = r"""
import json, os, sys, time
import pyopencl as cl, asyncclcache as acc
from kernels import small_source, run_twice
from _pocl import pocl_context
from asyncclcache.store import Store
from _procs import gone as ended
ctx = pocl_context()
cache = acc.Cache(sys.argv[1], rank_local=False)
n, wait = int(sys.argv[2]), sys.argv[3] == "wait"
for i in range(n):
    assert run_twice(ctx, acc.Program(ctx, small_source(f"twice{i}", salt="bake"), cache=cache).build(), f"twice{i}")
cache.flush(60)
store = Store(sys.argv[1], rank_local=False, create=False)
baked = lambda: sum(1 for e in store.entries() if (m := store.read_meta(e.path)) and m.baked_from)
deadline = time.monotonic() + 90
while wait and baked() < n and time.monotonic() < deadline:
    time.sleep(0.05)  # a core is idle: the baker's
proc = cache._baker._proc  # the helper, to see that close() leaves none behind
t = time.perf_counter(); cache.close(); close_s = time.perf_counter() - t
# Killed: gone once its teardown is done (close does not wait for that).
gone = proc is None or ended([proc.pid], 10)
print(json.dumps({"baked": baked(), "close_s": close_s, "gone": gone, "sent": cache._baker.sent,
                  "not_queued": cache._baker.not_queued}))
"""


def test_idle_baking_bakes_what_the_run_wrote(cache_dir: Path, tmp_path: Path) -> None:
    # The gate opened whatever the machine's load (a busy machine kept it shut past the wait).
    out = child_json(run_child(EAGER + IDLE, str(cache_dir), "3", "wait", pocl_cache=tmp_path / "p",
                               env=_idle(tmp_path)))
    assert (out["sent"], out["baked"]) == (3, 3) and out["gone"], out
    warm = _run(cache_dir, tmp_path / "warm", n=3)  # the same programs, on a new node
    assert (warm["hits"], warm["baked_hits"]) == (3, 3), warm
    # Its launches used another local size: the entries gained those variants, the bakes
    # lack them, so a bake makes them again.
    assert warm["refreshes"] == 3 and _bake(cache_dir)["baked"] == 3


# Issue 40: a pocl setting changed with os.putenv (as a C library's setenv changes it) after
# the program was baked. pocl reads the process's environment at every build, not os.environ.
PUTENV = r"""
import json, os, sys
import numpy as np, pyopencl as cl, asyncclcache as acc
from _pocl import pocl_context
SRC = "#ifndef VAL\n#define VAL 1\n#endif\n__kernel void f(__global float *c) { c[get_global_id(0)] = VAL; } // putenv"
cache = acc.Cache(sys.argv[1], rank_local=False)
def value(program):
    ctx = pocl_context(); q = cl.CommandQueue(ctx)
    prg = program(ctx).build()
    how = (prg._build_duration_info or [None])[0]  # before a launch resets it
    c = np.zeros(8, np.float32); cd = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, c.nbytes)
    prg.f(q, c.shape, None, cd); cl.enqueue_copy(q, c, cd); q.finish()
    return float(c[0]), how
out = {"before": value(lambda ctx: acc.Program(ctx, SRC, cache=cache))}
if sys.argv[2:]:
    os.putenv("POCL_EXTRA_BUILD_FLAGS", "-DVAL=7")
    out["after"] = value(lambda ctx: acc.Program(ctx, SRC, cache=cache))
    out["plain"] = value(lambda ctx: cl.Program(ctx, SRC))
cache.flush(60)
print(json.dumps(out))
"""


def test_a_setting_changed_with_putenv_after_a_bake_builds_as_pyopencl_does(cache_dir: Path, tmp_path: Path) -> None:
    cold = child_json(run_child(PUTENV, str(cache_dir), pocl_cache=tmp_path / "cold"))
    assert cold["before"][0] == 1.0, cold
    assert _bake(cache_dir)["baked"] == 1
    out = child_json(run_child(PUTENV, str(cache_dir), "putenv", pocl_cache=tmp_path / "warm"))
    assert out["before"] == [1.0, "cache retrieval (baked binary)"], out
    assert out["plain"][0] == 7.0, out  # what pocl makes of the setting
    assert out["after"][0] == 7.0, out


# A new machine (issue 35): the programs hit their kcache entries in one context; then each
# is built again, in a new context a round, until it comes baked, within less than the
# minute a process takes "not baked" for an answer: only the idle baker's word can do that.
REPEATS = r"""
import json, sys, time
import asyncclcache as acc
from kernels import small_source, run_twice
from _pocl import pocl_context
cache = acc.Cache(sys.argv[1], rank_local=False)
n = int(sys.argv[2])
how = lambda ctx, i: acc.Program(ctx, small_source(f"twice{i}", salt="bake"), cache=cache).build()
first = [how(pocl_context(), i)._build_duration_info[0] for i in range(n)]
deadline = time.monotonic() + 40
while time.monotonic() < deadline:
    ctx = pocl_context()
    prgs = [how(ctx, i) for i in range(n)]
    last = [p._build_duration_info[0] for p in prgs]
    if all("baked" in d for d in last):
        break
    time.sleep(0.2)  # a core is idle: the baker's
ok = all(run_twice(ctx, p, f"twice{i}") for i, p in enumerate(prgs))
print(json.dumps({"first": first, "last": last, "ok": ok, "sent": cache._baker.sent, **cache.stats().as_dict()}))
"""


# Builds and launches programs twice<i>, closes the cache (as at exit), reports its counters.
# ONE_CORE=1: on one core, where ``auto`` bakes nothing on idle cores.
CLOSING = r"""
import json, os, sys, time
if os.environ.get("ONE_CORE") == "1":
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
import pyopencl as cl, asyncclcache as acc
from kernels import small_source, run_twice
from _pocl import pocl_context
ctx = pocl_context()
cache = acc.Cache(sys.argv[1], rank_local=False)
prgs = [acc.Program(ctx, small_source(f"twice{i}", salt="bake"), cache=cache).build() for i in range(int(sys.argv[2]))]
ok = all(run_twice(ctx, p, f"twice{i}", local_size=(64,)) for i, p in enumerate(prgs))
cache.close()
print(json.dumps({"ok": ok, "keys": [p.cache_key for p in prgs], **cache.stats().as_dict()}))
"""


@pytest.mark.parametrize(("bake", "ci", "baked"), [("auto", "true", True), ("auto", "", False),
                                                   ("exit", "", True), ("idle", "true", False)])
def test_what_no_idle_core_baked_is_baked_as_the_cache_closes_in_a_ci_job(
        cache_dir: Path, tmp_path: Path, bake: str, ci: str, baked: bool) -> None:
    # One core: no idle baking under auto. In a CI job (CI set) or with ``exit``, the entries
    # are baked before the process ends, and the next run on a new machine loads binaries.
    (tmp_path / "tmp").mkdir()
    env = {"ASYNCCLCACHE_BAKE": bake, "CI": ci, "ONE_CORE": "1", "TMPDIR": str(tmp_path / "tmp")}
    cold = child_json(run_child(CLOSING, str(cache_dir), "2", pocl_cache=tmp_path / "cold", env=env))
    assert cold["ok"] and (cold["misses"], cold["writes"]) == (2, 2), cold
    assert cold["baked_at_exit"] == (2 if baked else 0), cold
    assert set(_baked(cache_dir)) == (set(cold["keys"]) if baked else set())
    assert list((tmp_path / "tmp").glob("acc-bake-*")) == []  # the workers' pocl caches
    if baked:
        warm = _run(cache_dir, tmp_path / "warm")
        assert (warm["hits"], warm["baked_hits"]) == (2, 2), warm
        assert warm["built"] == warm["launched"], set(warm["launched"]) - set(warm["built"])


def test_a_bake_at_close_that_runs_out_of_time_leaves_the_rest_unbaked_and_whole(
        cache_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tmp").mkdir()
    env = {"ASYNCCLCACHE_BAKE": "exit", "ASYNCCLCACHE_EXIT_BAKE_TIMEOUT": "0.000001",
           "TMPDIR": str(tmp_path / "tmp")}
    cold = child_json(run_child(CLOSING, str(cache_dir), "2", pocl_cache=tmp_path / "cold", env=env))
    assert cold["ok"] and cold["writes"] == 2 and cold["baked_at_exit"] == 0, cold
    assert _baked(cache_dir) == {}  # every entry loads (_baked checks): none half-written
    assert list((tmp_path / "tmp").glob("acc-bake-*")) == []
    # What was left is baked by the next bake.
    assert _bake(cache_dir)["baked"] == 2


def test_a_program_built_again_loads_what_the_idle_baker_baked_from_its_hit(
        cache_dir: Path, tmp_path: Path) -> None:
    cold = _run(cache_dir, tmp_path / "cold", n=3)
    assert (cold["writes"], cold["baked_hits"]) == (3, 0), cold
    assert not _baked(cache_dir)
    out = child_json(run_child(EAGER + REPEATS, str(cache_dir), "3", pocl_cache=tmp_path / "new",
                               env=_idle(tmp_path)))
    # Hits handed to the baker (nothing was written here), then loaded from its binaries.
    assert out["first"] == ["cache retrieval"] * 3 and out["sent"] == 3, out
    assert out["last"] == ["cache retrieval (baked binary)"] * 3 and out["ok"], out
    assert out["baked_hits"] >= 3 and out["misses"] == 0, out
    assert set(_baked(cache_dir)) == set(cold["keys"])


def test_idle_baking_is_never_waited_for(cache_dir: Path, tmp_path: Path) -> None:
    started = time.monotonic()
    out = child_json(run_child(IDLE, str(cache_dir), "3", "now", pocl_cache=tmp_path / "p",
                               env=_idle(tmp_path)))
    # close() killed the helper wherever it was (or before it started: those keys were not
    # queued); what it baked is whole, the rest stays kcache.
    assert out["sent"] + out["not_queued"] == 3 and out["gone"] and out["close_s"] < 2.0, out
    assert time.monotonic() - started < 120
    assert 0 <= out["baked"] <= 3
    assert _baked(cache_dir).keys() <= {e for e in _kcache_keys(cache_dir)}
    assert _bake(cache_dir)["baked"] == 3 - out["baked"]


def _kcache_keys(cache_dir: Path) -> set[str]:
    store = Store(cache_dir, rank_local=False, create=False)
    return {e.key for e in store.entries() if (m := store.read_meta(e.path)) and m.kind == "kcache"}


def test_info_list_and_export_show_what_is_baked(cache_dir: Path, tmp_path: Path) -> None:
    import tarfile

    _run(cache_dir, tmp_path / "cold", n=2)
    archive = tmp_path / "a.tar"
    out = subprocess.run([sys.executable, "-m", "asyncclcache", "export", "--dir", str(cache_dir), "--bake",
                          str(archive)], capture_output=True, text=True, timeout=600, check=True)
    assert "exported 4 entries" in out.stdout, out.stdout
    with tarfile.open(archive) as tar:
        names = {Path(n).name.split(".")[0] for n in tar.getnames()}
    assert all(baked_key(k) in names for k in _baked(cache_dir))
    info = subprocess.run([sys.executable, "-m", "asyncclcache", "info", "--dir", str(cache_dir), "--json"],
                          capture_output=True, text=True, timeout=120, check=True)
    data = json.loads(info.stdout)
    assert (data["baked"], data["kcache_entries"]) == (2, 2)
    rows = json.loads(subprocess.run([sys.executable, "-m", "asyncclcache", "list", "--dir", str(cache_dir),
                                      "--json"], capture_output=True, text=True, timeout=120,
                                     check=True).stdout)["entries"]
    assert sorted(r["kind"] for r in rows) == ["baked", "baked", "kcache", "kcache"]


@pytest.mark.parametrize("what", ["no source", "device"])
def test_what_cannot_be_baked_here_is_said(cache_dir: Path, tmp_path: Path, what: str) -> None:
    import dataclasses

    from asyncclcache.entry import Entry

    _run(cache_dir, tmp_path / "cold", n=1)
    store = Store(cache_dir, rank_local=False, create=False)
    [e] = list(store.entries())
    entry = store.load(e.key)
    assert entry is not None and entry.meta.source is not None
    if what == "no source":  # an entry of an earlier release
        meta = dataclasses.replace(entry.meta, source=None)
        expected = "no source (written by an earlier release)"
    else:
        meta = dataclasses.replace(entry.meta, devices=[dict(entry.meta.devices[0], device_name="elsewhere")])
        expected = "its device is not here"
    claim = store.claim(e.key)
    assert claim is not None
    store.publish(Entry(e.key, entry.binaries, meta), claim=claim)
    claim.release()
    result = _bake(cache_dir)
    assert result["baked"] == 0 and result["skipped"] == {expected: 1}, result


# {{{ issue 26: bake builds where the job built

# Builds one program whose params.h is found in the working folder (or -I inc), launches it,
# and reports its value: the child's working folder is the test's.
HEADER_RUN = r"""
import json, sys
import numpy as np, pyopencl as cl, asyncclcache as acc
from _pocl import pocl_context
ctx = pocl_context(); q = cl.CommandQueue(ctx)
cache = acc.Cache(sys.argv[1], rank_local=False)
src = '#include "params.h"\n__kernel void f(__global int *c) { c[0] = V; }\n'
prg = acc.Program(ctx, src, cache=cache).build(options=sys.argv[2:])
c = np.zeros(1, np.int32); cd = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, c.nbytes)
prg.f(q, (1,), None, cd); cl.enqueue_copy(q, c, cd); q.finish()
assert cache.flush(60)
print(json.dumps({"value": int(c[0]), "key": prg.cache_key, **cache.stats().as_dict()}))
"""


def _bake_in(cache_dir: Path, cwd: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "asyncclcache", "bake", "--dir", str(cache_dir), "--json"],
                          capture_output=True, text=True, timeout=600, check=False, cwd=cwd)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("options", [(), ("-I", "inc")], ids=["quoted", "relative-I"])
def test_bake_from_another_folder_builds_where_the_job_built(
    cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, options: tuple[str, ...],
) -> None:
    prog, elsewhere = tmp_path / "prog", tmp_path / "elsewhere"
    (prog / "inc").mkdir(parents=True)
    elsewhere.mkdir()
    (prog / ("inc" if options else ".") / "params.h").write_text("#define V 7\n")
    (elsewhere / "params.h").write_text("#define V 99\n")  # what the bake's own folder would give
    monkeypatch.chdir(prog)
    cold = child_json(run_child(HEADER_RUN, str(cache_dir), *options, pocl_cache=tmp_path / "cold"))
    assert (cold["value"], cold["writes"]) == (7, 1), cold
    store = Store(cache_dir, rank_local=False, create=False)
    [entry] = [store.load(e.key) for e in store.entries()]
    assert entry is not None and entry.meta.cwd == str(prog.resolve()), entry.meta.cwd
    result = _bake_in(cache_dir, elsewhere)
    assert result["baked"] == 1 and not result["skipped"] and not result["failed"], result
    warm = child_json(run_child(HEADER_RUN, str(cache_dir), *options, pocl_cache=tmp_path / "warm"))
    assert (warm["value"], warm["key"], warm["baked_hits"]) == (7, cold["key"], 1), warm


def test_bake_skips_an_entry_whose_headers_resolve_otherwise_in_its_folder(
    cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Keyed with inc/params.h; then ./params.h appears, which "." finds first: not that key.
    (tmp_path / "inc").mkdir()
    (tmp_path / "inc" / "params.h").write_text("#define V 7\n")
    monkeypatch.chdir(tmp_path)
    cold = child_json(run_child(HEADER_RUN, str(cache_dir), "-I", "inc", pocl_cache=tmp_path / "cold"))
    assert cold["value"] == 7
    (tmp_path / "params.h").write_text("#define V 99\n")
    result = _bake_in(cache_dir, tmp_path)
    assert result["baked"] == 0 and result["skipped"] == {
        "built in its folder, a header it includes is another file": 1}, result


@pytest.mark.parametrize("what", ["gone", "a file"])
def test_bake_of_an_entry_whose_folder_is_gone_bakes_what_finds_no_header_there(
    cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, what: str,
) -> None:
    # Issue 33, case 6: a CI checkout or a node's scratch removed after the job. A program
    # with no include builds the same anywhere: baked. One whose header was in that folder
    # is skipped, saying why.
    prog = tmp_path / "prog"
    prog.mkdir()
    monkeypatch.chdir(prog)
    _run(cache_dir, tmp_path / "cold", n=1)
    (prog / "params.h").write_text("#define V 7\n")
    header = child_json(run_child(HEADER_RUN, str(cache_dir), pocl_cache=tmp_path / "cold-h"))
    assert (header["value"], header["writes"]) == (7, 1), header
    monkeypatch.chdir(tmp_path)
    shutil.rmtree(prog)
    if what == "a file":
        prog.write_text("")
    result = _bake_in(cache_dir, tmp_path)
    why = "the folder it was built in is gone" if what == "gone" else "the folder it was built in is not a folder"
    assert result["baked"] == 1 and result["skipped"] == {f"{why}; a header it includes is gone": 1}, result
    warm = _run(cache_dir, tmp_path / "warm", n=1)  # on a new node, in another folder
    assert (warm["ok"], warm["hits"], warm["baked_hits"]) == (True, 1, 1), warm


@pytest.mark.parametrize("cwd", ["relative/folder", ""])
def test_an_entry_whose_folder_is_not_an_absolute_path_is_damaged(cwd: str) -> None:
    from asyncclcache.entry import EntryFormatError, EntryMeta

    assert EntryMeta.from_json({"cwd": "/abs"}).cwd == "/abs"
    assert EntryMeta.from_json({}).cwd is None  # an entry of an earlier release
    with pytest.raises(EntryFormatError, match="'cwd' is not an absolute path"):
        EntryMeta.from_json({"cwd": cwd})

# }}}


# {{{ issue 26: the idle baker and bake's workers are helpers that never block, never outlive
# their job, never leak a folder, and never import from the working folder (cases 3-6)

# A child: an IdleBaker fed 5000 keys from a thread, whose helper never runs: the gate
# started it but never finds a core idle enough, or (probes "not here") it never starts.
# Both waits are bounded.
FEED = r"""
import json, os, sys, threading, time
import asyncclcache.bake as bake
from asyncclcache.store import Store
bake.IDLE_CORES = float("inf")  # never idle enough: it stays stopped
bake.IdleBaker._until_idle = lambda self: self._state == "starting"  # but started at once
baker = bake.IdleBaker(Store(sys.argv[1], rank_local=False))
def feed():
    for i in range(5000):
        baker.add(f"{i:064x}")
t0 = time.perf_counter()
t = threading.Thread(target=feed, daemon=True); t.start(); t.join(30)
fed_s = time.perf_counter() - t0
c = threading.Thread(target=baker.close, daemon=True); c.start(); c.join(30)
print(json.dumps({"fed": not t.is_alive(), "fed_s": fed_s, "closed": not c.is_alive(), "sent": baker.sent,
                  "not_queued": getattr(baker, "not_queued", None)}), flush=True)
os._exit(0)  # a hung thread must not hang the test
"""


def _kill_left(*texts: str) -> None:
    for pid in with_args(*texts):  # what a failing run leaves (a stopped baker)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("os_facilities", ["stopped", "not here"])
def test_feeding_a_baker_that_does_not_run_never_blocks(cache_dir: Path, os_facilities: str) -> None:
    # Case 5: a blocking write under the lock hung the writer after 1008 keys, and close() too.
    env = {"ASYNCCLCACHE_TEST_NO_OS_FACILITIES": "1"} if os_facilities == "not here" else None
    try:
        out = child_json(run_child(FEED, str(cache_dir), env=env, timeout=120))
        assert gone(with_args(str(cache_dir)), 5.0), "its helper is left"
    finally:
        _kill_left(str(cache_dir))
    assert out["fed"] and out["closed"] and out["fed_s"] < 10, out
    assert out["sent"] + out["not_queued"] == 5000, out
    # Never read from: at most a pipe's worth went (64 KiB of 65-byte lines), the rest is counted.
    assert out["sent"] <= 65536 // 65 and (os_facilities == "stopped" or out["sent"] == 0), out


# A child: idle baking that never finds a core idle; once its baker holds a key and is
# stopped, prints the baker's pid and kills itself (a job killed on a busy node).
KILLED_JOB = r"""
import os, signal, sys, time
import pyopencl as cl, asyncclcache as acc, asyncclcache.bake as bake
from kernels import small_source
from _pocl import pocl_context
from _procs import state
bake.IDLE_CORES = float("inf")  # a busy node: stopped, once started (a core was idle at its start)
bake.IdleBaker._until_idle = lambda self: self._state == "starting"
ctx = pocl_context()
cache = acc.Cache(sys.argv[1], rank_local=False)
acc.Program(ctx, small_source("twice0", salt="killed"), cache=cache).build()
cache.flush(60)
deadline = time.monotonic() + 60
while time.monotonic() < deadline and (cache._baker._proc is None or state(cache._baker._proc.pid) != "T"):
    time.sleep(0.01)
print("BAKER", cache._baker.sent, cache._baker._proc.pid, state(cache._baker._proc.pid), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_stopped_idle_baker_dies_with_its_killed_job(cache_dir: Path, tmp_path: Path) -> None:
    # Case 4: it was stopped before it could set its death signal, and stayed stopped for good.
    proc = run_child(KILLED_JOB, str(cache_dir), env=_idle(tmp_path), check=False)
    assert proc.returncode == -signal.SIGKILL and "BAKER" in proc.stdout, proc.stderr
    _, sent, pid, st = proc.stdout.split()
    try:
        assert (sent, st) == ("1", "T")
        assert gone([int(pid)], 5.0), f"the idle baker {pid} outlived its job"
    finally:
        _kill_left(str(cache_dir))


def test_no_bake_folder_of_ours_stays(cache_dir: Path, tmp_path: Path) -> None:
    # Case 6: the helpers' pocl caches ($TMPDIR/acc-bake-*) leaked, as they are killed.
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = child_json(run_child(EAGER + IDLE, str(cache_dir), "2", "wait", pocl_cache=tmp_path / "p",
                               env={"ASYNCCLCACHE_BAKE": "idle", "TMPDIR": str(tmp)}))
    assert out["baked"] == 2 and out["gone"], out
    assert list(tmp.glob("acc-bake-*")) == []  # its parent removed it
    # A bake killed mid-entry: its workers die with it; the next bake removes their folder.
    other = tmp_path / "acc2"
    _run(other, tmp_path / "cold", n=4)
    env = dict(os.environ, TMPDIR=str(tmp))
    proc = subprocess.Popen([sys.executable, "-m", "asyncclcache", "bake", "--dir", str(other), "--jobs", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not any(p.is_file() for p in tmp.glob("acc-bake-*/**/*")) and time.monotonic() < deadline:
            time.sleep(0.01)
        workers = children(proc.pid)
        assert workers, "no worker ran"
        proc.kill()
        proc.communicate(timeout=60)
        assert gone(workers, 10.0), "a worker outlived the killed bake"
    finally:
        for pid in workers:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    assert list(tmp.glob("acc-bake-*"))  # left by the killed bake
    again = subprocess.run([sys.executable, "-m", "asyncclcache", "bake", "--dir", str(other), "--json"],
                           capture_output=True, text=True, timeout=600, check=True, env=env)
    assert json.loads(again.stdout)["baked"] >= 1
    assert list(tmp.glob("acc-bake-*")) == []


def test_the_idle_baker_and_bakes_workers_never_import_from_the_working_folder(
    cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Case 3: ``python -c`` puts the working folder (a shared 1777 one, say) first on sys.path.
    folder, marks = tmp_path / "shared", tmp_path / "marks"
    plant(folder, marks)
    monkeypatch.chdir(folder)
    try:
        out = child_json(run_child(SAFE_PATH + EAGER + IDLE, str(cache_dir), "1", "wait", pocl_cache=tmp_path / "p",
                                   env=_idle(tmp_path)))
    finally:
        _kill_left(str(cache_dir))
    assert sorted(p.name for p in marks.iterdir()) == []
    assert out["baked"] == 1, out
    monkeypatch.chdir(tmp_path)
    _run(cache_dir, tmp_path / "cold", n=3)
    # The installed command, as a user runs it there (``python -m`` would import from there itself).
    command = Path(sys.executable).parent / "asyncclcache"
    result = subprocess.run([str(command), "bake", "--dir", str(cache_dir), "--json", "--jobs", "2"],
                            capture_output=True, text=True, timeout=600, check=False, cwd=folder)
    assert sorted(p.name for p in marks.iterdir()) == []
    data = json.loads(result.stdout)
    assert data["baked"] >= 2 and not data["failed"], (data, result.stderr)

# }}}


# {{{ issue 33, cases 7 and 8: a relative cache directory, and a program that changes folder

RELATIVE = r"""
import json, os, sys, time
import asyncclcache as acc
from kernels import small_source, run_twice
from _pocl import pocl_context
from asyncclcache.store import Store
ctx = pocl_context()
cache = acc.Cache()  # ASYNCCLCACHE_DIR, relative to the folder it started in
ok = all(run_twice(ctx, acc.Program(ctx, small_source(f"twice{i}", salt="relative"), cache=cache).build(),
                   f"twice{i}") for i in range(2))
os.makedirs("out"); os.chdir("out")  # its output folder, after the first launches
flushed = cache.flush(60)
store = Store(sys.argv[1], rank_local=False, create=False)
baked = lambda: sum(1 for e in store.entries() if (m := store.read_meta(e.path)) and m.baked_from)
deadline = time.monotonic() + 90
while baked() < 2 and time.monotonic() < deadline:
    time.sleep(0.05)
cache.close()
print(json.dumps({"ok": ok, "flushed": flushed, "baked": baked(), "directory": cache.directory,
                  **cache.stats().as_dict()}))
"""


def test_a_relative_cache_directory_survives_a_chdir_and_the_idle_baker_finds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    try:
        out = child_json(run_child(EAGER + RELATIVE, str(tmp_path / "acc"), pocl_cache=tmp_path / "p",
                                   env=_idle(tmp_path, ASYNCCLCACHE_DIR="acc")))
    finally:
        _kill_left(str(tmp_path / "acc"))
    assert out["ok"] and out["flushed"] and out["directory"].startswith(str(tmp_path / "acc")), out
    assert (out["writes"], out["write_errors"]) == (2, 0), out
    assert out["baked"] == 2, out  # the baker starts in "/": it was given the absolute folder
    assert not (tmp_path / "out" / "acc").exists()

# }}}


# Issue 35: a job whose processes keep every core busy starts no helper at all.
BUSY = r"""
import json, sys, time
import asyncclcache.bake as bake
from asyncclcache.store import Store
bake.IDLE_CORES = float("inf")  # never a core idle
baker = bake.IdleBaker(Store(sys.argv[1], rank_local=False))
baker.add(64 * "a")
time.sleep(1.0)  # ten samples of the gate
started = baker._proc is not None
baker.close()
print(json.dumps({"started": started, "sent": baker.sent, "not_queued": baker.not_queued}))
"""


def test_an_idle_baker_starts_no_helper_while_no_core_is_idle(cache_dir: Path) -> None:
    out = child_json(run_child(BUSY, str(cache_dir)))
    assert out == {"started": False, "sent": 0, "not_queued": 1}, out
    assert not with_args(str(cache_dir))


# A child: its process ends (as an interpreter exit ends a daemon thread) while the gate
# thread is starting the helper, slowly: the folder the gate made must go with close().
ENDS_WHILE_STARTING = r"""
import os, sys, time
import asyncclcache.bake as bake, asyncclcache.system as system
from asyncclcache.store import Store
bake.IdleBaker._until_idle = lambda self: self._state == "starting"
start_helper = system.start_helper
system.start_helper = lambda *a, **k: (time.sleep(3.0), start_helper(*a, **k))[1]
baker = bake.IdleBaker(Store(sys.argv[1], rank_local=False))
baker.add(64 * "a")
time.sleep(0.5)  # the gate is in start_helper
baker.close()
print("closed", flush=True)
os._exit(0)
"""


# Issue 40: fork-pool workers end with os._exit (never closing their caches) or are killed;
# each started an idle baker of its own, whose folder stayed in TMPDIR.
FORK_POOL = r"""
import json, multiprocessing as mp, os, signal, sys
import asyncclcache as acc
from kernels import small_source, run_twice
from _pocl import pocl_context
inherited = acc.Cache(sys.argv[1], rank_local=False)  # made before the fork, as install() does
def work(i, kill=False):
    ctx = pocl_context()
    own = acc.Cache(sys.argv[1], rank_local=False)  # made in the worker
    ok = run_twice(ctx, acc.Program(ctx, small_source(f"twice{i}", salt="fork"), cache=inherited).build(), f"twice{i}")
    ok = ok and run_twice(ctx, acc.Program(ctx, small_source(f"own{i}", salt="fork"), cache=own).build(), f"own{i}")
    inherited.flush(60)
    own.flush(60)
    if kill:
        os.kill(os.getpid(), signal.SIGKILL)
    return ok, inherited._baker is None and own._baker is None
fork = mp.get_context("fork")
with fork.Pool(2) as pool:
    results = pool.map(work, range(2))
    pool.close()
    pool.join()
killed = fork.Process(target=work, args=(2, True))
killed.start()
killed.join(120)
print(json.dumps({"results": results, "killed": killed.exitcode,
                  "left": sorted(os.listdir(os.environ["TMPDIR"])), "written": len(list(inherited.store.entries()))}))
"""


def test_forked_workers_start_no_baker_and_leave_nothing(cache_dir: Path, tmp_path: Path) -> None:
    out = child_json(run_child(EAGER + FORK_POOL, str(cache_dir), pocl_cache=tmp_path / "p", env=_idle(tmp_path)))
    assert out["results"] == [[True, True]] * 2 and out["killed"] == -signal.SIGKILL, out
    assert out["written"] == 6, out  # the workers' entries, for a later bake
    assert [n for n in out["left"] if n.startswith("acc-bake")] == [], out
    assert list((tmp_path / "tmp").glob("acc-bake-*")) == []


def test_a_process_that_ends_while_its_baker_starts_leaves_no_folder(cache_dir: Path, tmp_path: Path) -> None:
    env = _idle(tmp_path)
    proc = run_child(ENDS_WHILE_STARTING, str(cache_dir), env=env)
    assert "closed" in proc.stdout
    assert list(Path(env["TMPDIR"]).iterdir()) == []
