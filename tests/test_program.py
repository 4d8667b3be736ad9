"""The drop-in Program on real pocl: same behaviour as pyopencl, cached in the background."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pyopencl as cl
import pytest

import asyncclcache as acc
from asyncclcache import maintenance
from asyncclcache.store import Store
from conftest import child_json, run_child, run_in_threads
from kernels import VALUE_CHILD, run_twice, small_source


def test_behaves_like_pyopencl_program(cl_ctx, cache_dir, open_cache):
    cache = open_cache(cache_dir)
    src = small_source("twice") + "__kernel void other(__global float *x) { x[0] = 1.0f; }\n"
    prg = acc.Program(cl_ctx, src, cache=cache)
    assert isinstance(prg, cl.Program)
    assert prg.build() is prg
    assert run_twice(cl_ctx, prg)
    assert sorted(k.function_name for k in prg.all_kernels()) == ["other", "twice"]
    assert set(prg.get_info(cl.program_info.KERNEL_NAMES).split(";")) == {"other", "twice"}
    assert prg.twice.num_args == 2
    assert prg.cache_key is not None and len(prg.cache_key) == 64
    assert cache.flush(120)
    cache.close()


def test_bad_source_raises_like_pyopencl_and_writes_nothing(cl_ctx, cache_dir, open_cache):
    bad = "__kernel void broken(__global float *a) { a[0] = undefined_name; }"
    with pytest.raises(cl.RuntimeError) as theirs:
        cl.Program(cl_ctx, bad).build()
    cache = open_cache(cache_dir)
    with pytest.raises(cl.RuntimeError) as ours:
        acc.Program(cl_ctx, bad, cache=cache).build()
    assert type(ours.value) is type(theirs.value)
    assert ours.value.code == theirs.value.code == cl.status_code.BUILD_PROGRAM_FAILURE
    assert "undefined_name" in str(ours.value)  # the build log is in the message
    assert cache.flush(30)
    assert list(Store(cache_dir).entries()) == []
    stats = cache.stats()
    assert (stats.writes, stats.pending, stats.hits) == (0, 0, 0)
    cache.close()


def test_bad_options_raise_like_pyopencl(cl_ctx, cache_dir, open_cache):
    src = small_source()
    with pytest.raises(cl.Error) as theirs:
        cl.Program(cl_ctx, src).build(options=["-Dbroken=(", "-cl-no-such-option"])
    with pytest.raises(cl.Error) as ours:
        acc.Program(cl_ctx, src, cache=open_cache(cache_dir)).build(options=["-Dbroken=(", "-cl-no-such-option"])
    assert type(ours.value) is type(theirs.value)
    assert ours.value.code == theirs.value.code


@pytest.mark.slow
def test_cold_build_queries_no_binaries_in_main_process(cache_dir, tmp_path):
    # The seed kernel at n=300 takes seconds to generate its generic variant
    # ("0-0-0" in pocl's cache): a build that queried BINARIES would have made it.
    code = r"""
import json, os, sys, time, pathlib
import asyncclcache as acc, asyncclcache.binaries as b, pyopencl as cl
from kernels import seed_source
from _pocl import pocl_context
calls = []
orig = b.program_binaries
b.program_binaries = lambda *a, **k: calls.append(1) or orig(*a, **k)
pocl = pathlib.Path(os.environ["POCL_CACHE_DIR"])
generic = lambda: sorted(str(p) for p in pocl.rglob("0-0-0"))
ctx = pocl_context()
cache = acc.Cache(sys.argv[1], strategy="process")
t = time.perf_counter()
prg = acc.Program(ctx, seed_source(300), cache=cache).build()
after_build = {"generic": generic(), "pending": cache.stats().pending, "writes": cache.stats().writes}
ok = cache.flush(300)
print(json.dumps({"after_build": after_build, "flushed": ok, "generic_after": generic(),
                  "main_calls": len(calls), "stats": cache.stats().as_dict()}))
"""
    out = child_json(run_child(code, str(cache_dir)))
    assert out["after_build"] == {"generic": [], "pending": 1, "writes": 0}
    assert out["flushed"]
    assert out["generic_after"], "the helper's warm-up should have compiled the generic variant"
    assert out["main_calls"] == 0
    assert out["stats"]["warmups"] == 1 and out["stats"]["writes"] == 1


def test_entry_gives_new_node_a_hit(cache_dir):
    code = r"""
import json, sys
import asyncclcache as acc, pyopencl as cl
from kernels import small_source, run_twice
from _pocl import pocl_context
ctx = pocl_context()
cache = acc.Cache(sys.argv[1])
prg = acc.Program(ctx, small_source(salt="fixed-for-two-runs"), cache=cache).build()
ok = run_twice(ctx, prg, local_size=(64,))
flushed = cache.flush(120)
print(json.dumps({"ok": ok, "flushed": flushed, "stats": cache.stats().as_dict()}))
"""
    first = child_json(run_child(code, str(cache_dir)))
    assert first["ok"] and first["flushed"]
    assert first["stats"]["misses"] == 1 and first["stats"]["writes"] >= 1
    second = child_json(run_child(code, str(cache_dir)))  # fresh POCL_CACHE_DIR: a new node
    assert second["ok"]
    assert second["stats"]["hits"] == 1 and second["stats"]["misses"] == 0
    assert second["stats"]["writes"] == 0


def test_helper_started_once_idle_priority_and_reaped(cl_ctx, cache_dir, open_cache):
    cache = open_cache(cache_dir, strategy="process")
    prgs = [acc.Program(cl_ctx, small_source(), cache=cache).build() for _ in range(3)]
    driver = cache.drivers["process"]
    assert cache.flush(120)
    assert driver.starts == 1
    pid = driver.helper_pid
    assert pid is not None and Path(f"/proc/{pid}").exists()
    assert os.sched_getscheduler(pid) == os.SCHED_IDLE
    assert all(run_twice(cl_ctx, p) for p in prgs)
    assert cache.stats().writes == 3
    cache.close()
    assert not Path(f"/proc/{pid}").exists()  # exited and reaped (no zombie either)


@pytest.mark.slow
def test_helper_exits_when_parent_is_killed(cache_dir):
    code = r"""
import os, sys, signal, time
import asyncclcache as acc, pyopencl as cl
from kernels import seed_source
from _pocl import pocl_context
ctx = pocl_context()
cache = acc.Cache(sys.argv[1], strategy="process")
acc.Program(ctx, seed_source(1000), cache=cache).build()   # the helper will compile for seconds
driver = cache.drivers["process"]
while driver.helper_pid is None:
    time.sleep(0.05)
print(driver.helper_pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    proc = run_child(code, str(cache_dir), check=False)
    assert proc.returncode == -9
    pid = int(proc.stdout.split()[0])
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    assert not _alive(pid), "helper outlived its parent"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_damaged_entry_rebuilds_warns_and_is_replaced(cl_ctx, cache_dir, open_cache):
    src = small_source()
    cache = open_cache(cache_dir)
    prg = acc.Program(cl_ctx, src, cache=cache).build()
    assert cache.flush(120)
    path = Store(cache_dir).path_for(prg.cache_key)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    cache.close()

    again = open_cache(cache_dir)  # no memory of the good entry
    with pytest.warns(acc.CorruptEntryWarning):
        prg2 = acc.Program(cl_ctx, src, cache=again).build()
    assert run_twice(cl_ctx, prg2)
    assert again.stats().misses == 1
    assert again.flush(120)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Store(cache_dir).load(prg.cache_key) is not None
    again.close()


def test_rejected_binary_falls_back_and_replaces_entry(cl_ctx, cache_dir, open_cache):
    from asyncclcache.entry import Entry

    src = small_source()
    cache = open_cache(cache_dir, strategy="process")
    prg = acc.Program(cl_ctx, src, cache=cache).build()
    assert cache.flush(120)
    store = Store(cache_dir)
    good = store.load(prg.cache_key)
    assert good is not None
    # A well-formed entry whose binary the driver cannot load (a driver upgrade, say).
    junk = Entry(good.key, (b"not a pocl binary" * 64,), dict(good.meta))
    store.publish(junk)
    cache.close()

    again = open_cache(cache_dir, strategy="process")
    with pytest.warns(acc.BinaryRejectedWarning):
        prg2 = acc.Program(cl_ctx, src, cache=again).build()
    assert run_twice(cl_ctx, prg2)
    assert again.stats().rejected == 1
    assert again.flush(120)
    replaced = store.load(prg.cache_key)
    assert replaced is not None and replaced.binaries != junk.binaries
    again.close()


def test_concurrent_builds_from_four_threads(cl_ctx, cache_dir, open_cache):
    cache = open_cache(cache_dir)
    shared = small_source()
    sources = [small_source() for _ in range(4)]
    results: list[bool] = []

    def work(i: int) -> None:
        for src in (sources[i], shared):
            prg = acc.Program(cl_ctx, src, cache=cache).build()
            results.append(run_twice(cl_ctx, prg))

    assert not run_in_threads(4, work)
    assert results == [True] * 8
    assert cache.flush(180)
    keys = {e.key for e in Store(cache_dir).entries()}
    assert len(keys) == 5
    cache.close()


def test_background_write_error_counted_not_raised(cl_ctx, cache_dir, open_cache):
    cache = open_cache(cache_dir)
    prg = acc.Program(cl_ctx, small_source(), cache=cache)
    # Block the entry's fan-out directory with a regular file: the write must fail.
    from asyncclcache.keys import make_key

    opts, inc = prg._process_build_options(cl_ctx, None)
    kind = cache.driver_for(cl_ctx.devices).kind
    key = make_key(prg._source.encode(), opts, cl_ctx.devices, inc, kind=kind).key
    (Path(cache.directory) / key[:2]).write_bytes(b"in the way")
    with pytest.warns(acc.WriteFailedWarning):  # issued by the background writer
        prg.build()
        assert prg.cache_key == key
        assert run_twice(cl_ctx, prg)
        assert cache.flush(120)
    stats = cache.stats()
    assert stats.write_errors == 1 and stats.writes == 0 and stats.pending == 0
    cache.close()


def test_failure_fatal_raises_in_flush(cache_dir):
    code = r"""
import json, sys, pathlib, warnings
import asyncclcache as acc, pyopencl as cl
from asyncclcache.keys import make_key
from kernels import small_source
from _pocl import pocl_context
warnings.simplefilter("ignore")
ctx = pocl_context()
cache = acc.Cache(sys.argv[1])
prg = acc.Program(ctx, small_source(), cache=cache)
opts, inc = prg._process_build_options(ctx, None)
key = make_key(prg._source.encode(), opts, ctx.devices, inc, kind=cache.driver_for(ctx.devices).kind).key
(pathlib.Path(cache.directory) / key[:2]).write_bytes(b"in the way")
prg.build()
try:
    cache.flush(120)
except acc.BackgroundError as e:
    print(json.dumps({"raised": type(e).__name__}))
else:
    print(json.dumps({"raised": None}))
"""
    out = child_json(run_child(code, str(cache_dir), env={"ASYNCCLCACHE_FAILURE_FATAL": "1"}))
    assert out == {"raised": "BackgroundError"}


@pytest.mark.slow
def test_exit_with_pending_work_is_bounded_and_clean(cache_dir):
    code = r"""
import sys, time
import asyncclcache as acc, pyopencl as cl
from kernels import seed_source
from _pocl import pocl_context
ctx = pocl_context()
cache = acc.Cache(sys.argv[1], strategy="process")
acc.Program(ctx, seed_source(1000), cache=cache).build()
driver = cache.drivers["process"]
while driver.helper_pid is None:
    time.sleep(0.05)
print(driver.helper_pid, time.time(), flush=True)
"""
    import time

    t0 = time.monotonic()
    proc = run_child(code, str(cache_dir), env={"ASYNCCLCACHE_EXIT_TIMEOUT": "0.5"})
    elapsed = time.monotonic() - t0
    pid_text, printed_at = proc.stdout.split()
    exit_took = time.time() - float(printed_at)
    # The generic compile takes about 5 s; exit waited 0.5 s plus the helper's reaping.
    assert exit_took < 4.0, f"exit took {exit_took:.1f}s (total {elapsed:.1f}s)"
    assert not _alive(int(pid_text))
    assert "background failure" not in proc.stderr  # dropping at exit is not a failure
    store = Store(cache_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for e in store.entries():  # whatever is there is complete
            assert store.load(e.key) is not None
    temps, _locks = maintenance.orphans(store)
    assert temps == []


@pytest.mark.parametrize("strategy", ["thread", "sync"])
def test_in_process_strategies_write_valid_entries(strategy, cache_dir):
    code = r"""
import json, sys
import asyncclcache as acc, pyopencl as cl
from kernels import small_source, run_twice
from _pocl import pocl_context
ctx = pocl_context()
cache = acc.Cache(sys.argv[1], strategy=sys.argv[2])
prg = acc.Program(ctx, small_source(salt="strategy-" + sys.argv[2]), cache=cache).build()
flushed = cache.flush(120)   # before launching: no query races a launch (F13)
ok = run_twice(ctx, prg)
print(json.dumps({"ok": ok, "flushed": flushed, "stats": cache.stats().as_dict(),
                  "drivers": sorted(cache.drivers)}))
"""
    first = child_json(run_child(code, str(cache_dir), strategy))
    assert first["ok"] and first["flushed"] and first["drivers"] == [strategy]
    assert first["stats"]["writes"] == 1 and first["stats"]["warmups"] == 0
    second = child_json(run_child(code, str(cache_dir), strategy))
    assert second["ok"] and second["stats"]["hits"] == 1


def test_strategy_from_environment(cache_dir):
    code = r"""
import json, sys
import asyncclcache as acc
print(json.dumps(acc.Cache(sys.argv[1]).strategy))
"""
    assert child_json(run_child(code, str(cache_dir), env={"ASYNCCLCACHE_STRATEGY": "sync"})) == "sync"
    bad = run_child(code, str(cache_dir), env={"ASYNCCLCACHE_STRATEGY": "fast"}, check=False)
    assert bad.returncode != 0 and "ASYNCCLCACHE_STRATEGY" in bad.stderr


@pytest.mark.slow
def test_two_devices_in_one_context(cache_dir):
    code = r"""
import json, sys
import asyncclcache as acc, pyopencl as cl
from kernels import small_source, run_twice
from _pocl import pocl_devices
devs = pocl_devices()
ctx = cl.Context(devs)
cache = acc.Cache(sys.argv[1])
prg = acc.Program(ctx, small_source(salt="two-devices"), cache=cache).build()
flushed = cache.flush(120)
entry = cache.store.load(prg.cache_key)
print(json.dumps({"ndev": len(devs), "ok": run_twice(ctx, prg), "flushed": flushed,
                  "kind": entry.kind if entry else None, "devices": len(entry.meta["devices"]) if entry else 0,
                  "binaries": len(entry.binaries) if entry else 0, "stats": cache.stats().as_dict()}))
"""
    for strategy in ("kcache", "process"):
        env = {"POCL_DEVICES": "pthread pthread", "ASYNCCLCACHE_STRATEGY": strategy}
        d = str(cache_dir / strategy)
        first = child_json(run_child(code, d, env=env))
        if first["ndev"] < 2:
            pytest.skip("this pocl does not expose two devices with POCL_DEVICES")
        assert first["ok"] and first["flushed"] and first["devices"] == 2 and first["kind"] == (
            "kcache" if strategy == "kcache" else "binary")
        if strategy == "process":
            assert first["binaries"] == 2
        second = child_json(run_child(code, d, env=env))
        assert second["ok"] and second["stats"]["hits"] == 1 and second["stats"]["rejected"] == 0


def test_pyopencl_build_options_are_part_of_the_key(cache_dir):
    src = "__kernel void f(__global float *c) { c[get_global_id(0)] = FACTOR; }"
    three = child_json(run_child(VALUE_CHILD, str(cache_dir), src, env={"PYOPENCL_BUILD_OPTIONS": "-DFACTOR=3"}))
    five = child_json(run_child(VALUE_CHILD, str(cache_dir), src, env={"PYOPENCL_BUILD_OPTIONS": "-DFACTOR=5"}))
    assert (three["value"], five["value"]) == (3.0, 5.0)
    assert three["key"] != five["key"] and five["hits"] == 0
    again = child_json(run_child(VALUE_CHILD, str(cache_dir), src, env={"PYOPENCL_BUILD_OPTIONS": "-DFACTOR=3"}))
    assert again == {"value": 3.0, "key": three["key"], "hits": 1}


def test_disabled_by_environment_builds_plainly(cache_dir):
    code = r"""
import json, sys
import asyncclcache as acc, pyopencl as cl
from kernels import small_source, run_twice
from _pocl import pocl_context
ctx = pocl_context()
cache = acc.Cache(sys.argv[1])
prg = acc.Program(ctx, small_source(), cache=cache).build()
print(json.dumps({"ok": run_twice(ctx, prg), "flushed": cache.flush(10), "stats": cache.stats().as_dict()}))
"""
    out = child_json(run_child(code, str(cache_dir), env={"ASYNCCLCACHE_DISABLE": "1"}))
    assert out["ok"] and out["flushed"]
    assert out["stats"]["misses"] == 0 and out["stats"]["hits"] == 0 and out["stats"]["writes"] == 0


@pytest.mark.slow
def test_fork_with_pending_work_gives_the_child_a_clean_cache(cache_dir):
    # A child forked while the parent's helper compiles must not wait for the parent's work
    # (at flush or at exit), and the parent must finish its own. (No OpenCL in the child:
    # pocl itself does not survive a fork of a process that used it.)
    code = r"""
import json, os, sys, time
import pyopencl as cl, asyncclcache as acc
from kernels import seed_source
from _pocl import pocl_context
cache = acc.Cache(sys.argv[1], strategy="process", exit_timeout=60)
ctx = pocl_context()
acc.Program(ctx, seed_source(600, salt="fork-parent"), cache=cache).build()
assert cache.stats().pending == 1
r, w = os.pipe()
t0 = time.monotonic()
pid = os.fork()
if pid == 0:
    os.close(r)
    t = time.monotonic()
    flushed = cache.flush(30)
    s = cache.stats()
    os.write(w, json.dumps({"flushed": flushed, "pending": s.pending, "misses": s.misses,
                            "flush_took": time.monotonic() - t}).encode())
    sys.exit(0)   # interpreter exit: the atexit close must not wait for the parent's work
os.close(w)
child = json.loads(os.read(r, 65536).decode())
os.waitpid(pid, 0)
child["lived"] = time.monotonic() - t0
print(json.dumps({"child": child, "parent_flushed": cache.flush(120), "parent": cache.stats().as_dict()}))
"""
    out = child_json(run_child(code, str(cache_dir)))
    c = out["child"]
    assert c["flushed"] and c["pending"] == 0 and c["misses"] == 0  # a clean state
    assert c["flush_took"] < 5 and c["lived"] < 20, c  # neither the compile nor the exit timeout
    assert out["parent_flushed"] and out["parent"]["writes"] == 1 and out["parent"]["misses"] == 1
    assert len(list(Store(cache_dir).entries())) == 1


def test_helper_protocol_survives_a_printing_sitecustomize(cache_dir, tmp_path):
    # Issue 12: any output on the helper's stdout before it spoke the protocol made every
    # later request fail; the protocol now has pipes of its own.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\nprint('hello from sitecustomize', flush=True)\nsys.stdout.write('\\x00\\x00\\x00\\x05garbage\\n')\n"
    )
    code = r"""
import json, sys
import pyopencl as cl, asyncclcache as acc
from kernels import small_source, run_twice
from _pocl import pocl_context
ctx = pocl_context()
cache = acc.Cache(sys.argv[1], strategy="process")
prg = acc.Program(ctx, small_source(salt="sitecustomize"), cache=cache).build()
ok = run_twice(ctx, prg)
print(json.dumps({"ok": ok, "flushed": cache.flush(120), "stats": cache.stats().as_dict(),
                  "crashes": cache.drivers["process"].crashes}))
"""
    from conftest import ROOT

    env = {"PYTHONPATH": os.pathsep.join([str(site), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    out = child_json(run_child(code, str(cache_dir), env=env))
    assert out["ok"] and out["flushed"] and out["crashes"] == 0
    assert out["stats"]["writes"] == 1 and out["stats"]["errors"] == 0


def test_wire_rejects_garbage_and_times_out():
    import io

    from asyncclcache.drivers import _wire

    for junk in (b"\x00\x00\x00\x05garbage", b"\x00\x00\x00\x02[]", b'\x00\x00\x00\x0f{"payload": -1}'):
        with pytest.raises(_wire.WireError):
            _wire.recv(io.BytesIO(junk))
    r, w = os.pipe()
    try:
        with open(r, "rb", buffering=0) as f, pytest.raises(_wire.WireTimeout):
            _wire.recv(f, timeout=0.2)
    finally:
        os.close(w)
