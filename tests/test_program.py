"""The drop-in Program on real pocl: same behaviour as pyopencl, cached in the background."""

from __future__ import annotations

import warnings
from pathlib import Path

import pyopencl as cl
import pytest

import asyncclcache as acc
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
    # ("0-0-0" in pocl's cache): a build or a snapshot that queried BINARIES would have
    # made it; kcache stores pocl's folder and queries nothing.
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
cache = acc.Cache(sys.argv[1])
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
    assert out["generic_after"] == [], "nothing may compile the generic variant for the cache"
    assert out["main_calls"] == 0
    assert out["stats"]["writes"] == 1


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
    cache = open_cache(cache_dir, strategy="thread")  # binary entries
    prg = acc.Program(cl_ctx, src, cache=cache).build()
    assert cache.flush(120)
    store = Store(cache_dir)
    good = store.load(prg.cache_key)
    assert good is not None
    # A well-formed entry whose binary the driver cannot load (a driver upgrade, say).
    junk = Entry(good.key, (b"not a pocl binary" * 64,), dict(good.meta))
    store.publish(junk)
    cache.close()

    again = open_cache(cache_dir, strategy="thread")
    with pytest.warns(acc.BinaryRejectedWarning):
        prg2 = acc.Program(cl_ctx, src, cache=again).build()
    assert again.flush(120)  # the query before the launches: never beside one on pocl (F13)
    assert run_twice(cl_ctx, prg2)
    assert again.stats().rejected == 1
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


def test_the_thread_strategy_writes_valid_entries(cache_dir):
    strategy = "thread"
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
    assert first["stats"]["writes"] == 1
    second = child_json(run_child(code, str(cache_dir), strategy))
    assert second["ok"] and second["stats"]["hits"] == 1


def test_strategy_from_environment(cache_dir):
    code = r"""
import json, sys
import asyncclcache as acc
print(json.dumps(acc.Cache(sys.argv[1]).strategy))
"""
    assert child_json(run_child(code, str(cache_dir), env={"ASYNCCLCACHE_STRATEGY": "thread"})) == "thread"
    bad = run_child(code, str(cache_dir), env={"ASYNCCLCACHE_STRATEGY": "fast"}, check=False)
    assert bad.returncode != 0 and "ASYNCCLCACHE_STRATEGY" in bad.stderr


# A child: three caches, each with the strategy of argv[2] or from the environment (argv[2]
# "-"), and a build through each; prints the strategies, the warnings and what was cached.
RETIRED_CHILD = r"""
import json, sys, warnings
import pyopencl as cl, asyncclcache as acc
from kernels import small_source, run_twice
from _pocl import pocl_context
ctx = pocl_context()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    caches = [acc.Cache(sys.argv[1]) if sys.argv[2] == "-" else acc.Cache(sys.argv[1], strategy=sys.argv[2])
              for _ in range(3)]
    ok = [run_twice(ctx, acc.Program(ctx, small_source(salt=f"retired-{i}"), cache=c).build()) for i, c in enumerate(caches)]
    flushed = all(c.flush(60) for c in caches)
print(json.dumps({"strategies": [c.strategy for c in caches], "ok": ok, "flushed": flushed,
                  "warnings": [(w.category.__name__, str(w.message)) for w in caught],
                  "drivers": sorted({d for c in caches for d in c.drivers}),
                  "stats": [c.stats().as_dict() for c in caches]}))
"""


@pytest.mark.parametrize("retired", ["process", "sync"])
@pytest.mark.parametrize("how", ["environment", "argument"])
def test_a_strategy_that_is_gone_warns_once_and_auto_serves(cache_dir, retired, how):
    env = {"ASYNCCLCACHE_STRATEGY": retired} if how == "environment" else {}
    proc = run_child(RETIRED_CHILD, str(cache_dir), "-" if how == "environment" else retired, env=env)
    out = child_json(proc)
    assert out["strategies"] == ["auto"] * 3 and out["ok"] == [True] * 3 and out["flushed"], out
    assert [c for c, _ in out["warnings"]] == ["RemovedStrategyWarning"], out["warnings"]  # one per process
    assert f"strategy '{retired}' is gone" in out["warnings"][0][1] and "auto" in out["warnings"][0][1]
    assert out["drivers"] == ["kcache"] and [s["writes"] for s in out["stats"]] == [1, 1, 1]


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
    for strategy in ("kcache", "thread"):
        env = {"POCL_DEVICES": "pthread pthread", "ASYNCCLCACHE_STRATEGY": strategy}
        d = str(cache_dir / strategy)
        first = child_json(run_child(code, d, env=env))
        if first["ndev"] < 2:
            pytest.skip("this pocl does not expose two devices with POCL_DEVICES")
        assert first["ok"] and first["flushed"] and first["devices"] == 2 and first["kind"] == (
            "kcache" if strategy == "kcache" else "binary")
        if strategy == "thread":
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
    # A child forked while the parent's snapshot waits for the program's launches must not
    # wait for the parent's work (at flush or at exit), and the parent must finish its own. (No OpenCL in the child:
    # pocl itself does not survive a fork of a process that used it.)
    code = r"""
import json, os, sys, time
import pyopencl as cl, asyncclcache as acc
from kernels import seed_source
from _pocl import pocl_context
cache = acc.Cache(sys.argv[1], exit_timeout=60)
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
