"""step(): snapshots after the block, so the next run (a new node) compiles nothing."""

from __future__ import annotations

import pytest

import asyncclcache as acc
from asyncclcache.store import Store
from conftest import child_json, run_child
from kernels import run_twice, small_source

# Launch with a non-default local size; report timings and pocl's variants on disk.
STEP_RUN = r"""
import json, os, pathlib, sys, time
import numpy as np, pyopencl as cl, asyncclcache as acc
from kernels import seed_source
from _pocl import pocl_context
pocl = pathlib.Path(os.environ["POCL_CACHE_DIR"])
def variants(ls):
    return sorted(p.name for p in pocl.rglob(f"{ls}-1-1*") if p.is_dir())
ctx = pocl_context(); q = cl.CommandQueue(ctx)
n = 4096
a = np.random.default_rng(1).random(n).astype(np.float32)
mf = cl.mem_flags
ad = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=a)
cd = cl.Buffer(ctx, mf.WRITE_ONLY, a.nbytes)
cache = acc.Cache(sys.argv[1])
src = seed_source(300, salt="step-test")
with cache.step() as step:
    prg = acc.Program(ctx, src, cache=cache).build()
    before = variants(16)
    t = time.perf_counter()
    prg.sum(q, (n,), (16,), ad, ad, cd); q.finish()
    launch = time.perf_counter() - t
c = np.empty_like(a); cl.enqueue_copy(q, c, cd); q.finish()
flushed = cache.flush(300)
print(json.dumps({"launch": launch, "variants_before_launch": before, "ok": bool(np.allclose(c, 2 * a)),
                  "step": [step.built, step.hits, step.misses], "flushed": flushed,
                  "stats": cache.stats().as_dict()}))
"""


@pytest.mark.slow
def test_step_snapshot_packs_the_launched_variant(cache_dir):
    cold = child_json(run_child(STEP_RUN, str(cache_dir)))
    assert cold["ok"] and cold["flushed"]
    assert cold["step"] == [1, 0, 1]
    assert cold["variants_before_launch"] == []
    # auto picks kcache on pocl: the entry is pocl's own folder, nothing compiled for it.
    assert cold["stats"]["writes"] == 1

    warm = child_json(run_child(STEP_RUN, str(cache_dir)))  # empty POCL_CACHE_DIR: new node
    assert warm["ok"]
    assert warm["step"] == [1, 1, 0]
    # pocl already holds the local-size-16 variant before the launch: it compiles nothing.
    assert warm["variants_before_launch"], "the entry did not pack the launched variant"
    assert warm["launch"] * 10 < cold["launch"], (warm["launch"], cold["launch"])


@pytest.mark.slow
def test_variants_after_the_snapshot_are_refreshed_at_flush(cache_dir):
    code = r"""
import json, os, pathlib, sys
import pyopencl as cl, asyncclcache as acc
from kernels import small_source, run_twice
from _pocl import pocl_context
pocl = pathlib.Path(os.environ["POCL_CACHE_DIR"])
ctx = pocl_context()
cache = acc.Cache(sys.argv[1])
prg = acc.Program(ctx, small_source(salt="refresh-test"), cache=cache).build()
if sys.argv[2] == "first":
    assert cache.flush(120)                       # snapshot right after the warm-up
    first = cache.stats().as_dict()
    ok = run_twice(ctx, prg, local_size=(8,))     # a variant pocl compiles now
    assert cache.flush(120)                       # ... is packed by the refresh
    print(json.dumps({"ok": ok, "first": first, "second": cache.stats().as_dict()}))
else:
    before = sorted(p.name for p in pocl.rglob("8-1-1*") if p.is_dir())
    print(json.dumps({"ok": run_twice(ctx, prg, local_size=(8,)), "before": before,
                      "stats": cache.stats().as_dict()}))
"""
    first = child_json(run_child(code, str(cache_dir), "first"))
    assert first["ok"]
    assert first["first"]["writes"] == 1 and first["first"]["refreshes"] == 0
    assert first["second"]["writes"] == 2 and first["second"]["refreshes"] == 1
    second = child_json(run_child(code, str(cache_dir), "second"))
    assert second["ok"] and second["stats"]["hits"] == 1
    assert second["before"], "the refreshed entry should hold the local-size-8 variant"


def test_unchanged_program_is_not_rewritten_at_flush(cl_ctx, cache_dir, open_cache):
    cache = open_cache(cache_dir)
    prg = acc.Program(cl_ctx, small_source(), cache=cache).build()
    assert run_twice(cl_ctx, prg)
    assert cache.flush(120)
    # The snapshot came after the launch: the entry has its variant, and later flushes
    # find nothing new in pocl's folder.
    assert cache.flush(120) and cache.flush(120)
    assert cache.stats().writes == 1 and cache.stats().refreshes == 0
    cache.close()


def test_wait_true_flushes_at_exit_and_counts(cl_ctx, cache_dir, open_cache):
    cache = open_cache(cache_dir)
    src = small_source()
    with cache.step(wait=True) as step:
        a = acc.Program(cl_ctx, src, cache=cache).build()
        b = acc.Program(cl_ctx, small_source(), cache=cache).build()
        assert run_twice(cl_ctx, a) and run_twice(cl_ctx, b)
        assert cache.stats().writes == 0  # nothing is written before the block's exit
    assert (step.built, step.hits, step.misses) == (2, 0, 2)
    stats = cache.stats()
    assert stats.pending == 0 and stats.writes == 2
    with cache.step() as again:
        acc.Program(cl_ctx, src, cache=cache).build()
    assert (again.built, again.hits, again.misses) == (1, 1, 0)
    cache.close()


def test_nested_steps(cl_ctx, cache_dir, open_cache):
    cache = open_cache(cache_dir)
    with cache.step() as outer:
        acc.Program(cl_ctx, small_source(), cache=cache).build()
        with cache.step(wait=True) as inner:
            acc.Program(cl_ctx, small_source(), cache=cache).build()
        assert (inner.built, inner.misses) == (1, 1)
        assert cache.stats().writes == 1  # the inner block's program, at its exit
    assert (outer.built, outer.misses) == (2, 2)
    assert cache.flush(120) and cache.stats().writes == 2
    cache.close()


def test_exception_in_step_propagates_and_still_schedules(cl_ctx, cache_dir, open_cache):
    cache = open_cache(cache_dir)

    class Boom(Exception):
        pass

    with pytest.raises(Boom), cache.step() as step:
        prg = acc.Program(cl_ctx, small_source(), cache=cache).build()
        raise Boom
    assert step.misses == 1
    assert cache.flush(120)
    assert Store(cache_dir).load(prg.cache_key) is not None
    cache.close()


def test_default_cache_step_shortcut(cl_ctx):
    try:
        with acc.step(wait=True) as step:
            prg = acc.Program(cl_ctx, small_source()).build()
        assert step.cache is acc.default_cache()
        assert step.misses == 1 and run_twice(cl_ctx, prg)
    finally:
        acc.default_cache().close()  # the next user of the default cache gets a fresh one
