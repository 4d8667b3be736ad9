"""Cache-level bookkeeping on real pocl: the size bound, last-used times, lifetime stats."""

from __future__ import annotations

import os
import time

import pytest

import asyncclcache as acc
from asyncclcache.stats import read_lifetime
from asyncclcache.store import Store
from kernels import run_twice, small_source


@pytest.mark.slow
def test_max_size_evicts_least_recently_used_in_background(cl_ctx, cache_dir, open_cache):
    probe = open_cache(cache_dir / "probe")
    acc.Program(cl_ctx, small_source(), cache=probe).build()
    assert probe.flush(120)
    one = Store(cache_dir / "probe").total_bytes()
    probe.close()

    cache = open_cache(cache_dir, max_size=int(2.5 * one))
    prgs = []
    for _ in range(5):
        prgs.append(acc.Program(cl_ctx, small_source(), cache=cache).build())
        assert cache.flush(120)  # one at a time, so "least recently used" is well defined
    store = Store(cache_dir)
    assert store.total_bytes() <= 2.5 * one
    assert cache.stats().evictions == 3
    left = {e.key for e in store.entries()}
    assert left == {prgs[3].cache_key, prgs[4].cache_key}
    assert all(run_twice(cl_ctx, p) for p in prgs)  # evicting never touches live programs
    cache.close()


def test_max_size_accepts_suffixes_and_environment(cache_dir, open_cache, monkeypatch):
    from asyncclcache.config import get_config

    assert open_cache(cache_dir, max_size="2M").max_size == 2 << 20
    assert open_cache(cache_dir).max_size is None  # conftest unset ASYNCCLCACHE_MAX_SIZE
    # The environment is read once per process (get_config): forget it to read it again.
    monkeypatch.setenv("ASYNCCLCACHE_MAX_SIZE", "3M")
    get_config.cache_clear()
    try:
        assert open_cache(cache_dir).max_size == 3 << 20
        assert open_cache(cache_dir, max_size="1K").max_size == 1 << 10  # the argument wins
    finally:
        monkeypatch.undo()
        get_config.cache_clear()  # the next reader sees the environment without it
    assert open_cache(cache_dir).max_size is None


def test_hit_updates_last_used_without_rewriting(cl_ctx, cache_dir, open_cache):
    src = small_source()
    cache = open_cache(cache_dir)
    prg = acc.Program(cl_ctx, src, cache=cache).build()
    assert cache.flush(120)
    cache.close()
    path = Store(cache_dir).path_for(prg.cache_key)
    old = time.time() - 3600
    os.utime(path, (old, old))
    before = path.stat()

    again = open_cache(cache_dir)
    acc.Program(cl_ctx, src, cache=again).build()
    assert again.flush(60)
    after = path.stat()
    assert after.st_ino == before.st_ino and after.st_mtime == before.st_mtime  # not rewritten
    assert after.st_atime > before.st_atime + 3000
    again.close()


@pytest.mark.slow
def test_lifetime_stats_saved_at_flush_and_close(cl_ctx, cache_dir, open_cache):
    cache = open_cache(cache_dir)
    acc.Program(cl_ctx, small_source(), cache=cache).build()
    assert cache.flush(120)
    saved = read_lifetime(cache.directory)
    assert (saved["runs"], saved["misses"], saved["writes"]) == (1, 1, 1)
    assert cache.flush(10)  # nothing new: nothing added twice
    assert read_lifetime(cache.directory)["misses"] == 1
    acc.Program(cl_ctx, small_source(), cache=cache).build()
    cache.close()
    saved = read_lifetime(cache.directory)
    assert (saved["runs"], saved["misses"]) == (1, 2)


def test_import_and_a_warm_hit_leave_filelock_unloaded(cl_ctx, cache_dir, open_cache):
    """Locks are only taken in the background (and at flush): a warm start does not pay
    for importing filelock (which pulls in asyncio)."""
    import subprocess
    import sys
    import textwrap

    from conftest import ROOT

    src = small_source("lazy", salt="filelock-stays-unloaded")
    cache = open_cache(cache_dir, rank_local=False)
    prg = acc.Program(cl_ctx, src, cache=cache).build()
    assert run_twice(cl_ctx, prg, "lazy")
    assert cache.close(120) and cache.stats().writes == 1
    code = textwrap.dedent(f"""
        import sys
        import asyncclcache as acc
        assert "filelock" not in sys.modules, "imported by: import asyncclcache"
        import pyopencl as cl
        from _pocl import pocl_context
        ctx = pocl_context()
        cache = acc.Cache({str(cache_dir)!r}, rank_local=False)
        acc.Program(ctx, {src!r}, cache=cache).build()
        assert cache.stats().hits == 1, cache.stats()
        print("filelock" in sys.modules)
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tests") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=env, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_job_table_is_bounded(cl_ctx, cache_dir, monkeypatch, open_cache):
    import asyncclcache.pipeline as pipeline_mod
    from kernels import run_twice, small_source

    monkeypatch.setattr(pipeline_mod, "MAX_JOBS", 3)
    cache = open_cache(cache_dir)
    keys = []
    for i in range(6):
        prg = acc.Program(cl_ctx, small_source(name=f"bounded{i}"), cache=cache).build()
        assert run_twice(cl_ctx, prg, name=f"bounded{i}")
        keys.append(prg.cache_key)
    assert cache.flush(120)
    assert cache.stats().writes == 6
    kept = [k for k in keys if cache.job(k) is not None]
    assert kept == keys[-3:]  # the newest
    cache.close()


# A child: builds small_source("twice", salt=argv[2]) through a cache in argv[1] and launches
# it; prints its key and the stats.
TWICE_CHILD = r"""
import json, sys
import asyncclcache as acc
from _pocl import pocl_context
from kernels import run_twice, small_source
ctx = pocl_context()
cache = acc.Cache(sys.argv[1])
prg = acc.Program(ctx, small_source("twice", salt=sys.argv[2]), cache=cache).build()
ok = run_twice(ctx, prg)
cache.flush(120)
print(json.dumps({"ok": ok, "key": prg.cache_key, **cache.stats().as_dict()}))
"""


def _cli(*args: str) -> str:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "asyncclcache", *args], capture_output=True, text=True,
                       timeout=600, check=False)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_a_baked_hit_is_a_use_of_the_baked_binary(cache_dir, tmp_path):
    # Issue 26, case 2: the size bound and prune evict by last use; a baked hit uses the baked
    # binary. A read alone does not say so: relatime renews an atime once a day at most.
    import json
    import uuid

    from asyncclcache.keys import baked_key
    from conftest import child_json, run_child

    salt = uuid.uuid4().hex
    cold = child_json(run_child(TWICE_CHILD, str(cache_dir), salt))
    assert cold["ok"] and cold["writes"] == 1, cold
    assert json.loads(_cli("bake", "--dir", str(cache_dir), "--json"))["baked"] == 1
    store = Store(cache_dir)
    used = {cold["key"], baked_key(cold["key"])}
    first = child_json(run_child(TWICE_CHILD, str(cache_dir), salt))
    assert first["ok"] and (first["hits"], first["baked_hits"]) == (1, 1), first
    # Another program is written after that hit, and the baked one is used again after it.
    other = child_json(run_child(TWICE_CHILD, str(cache_dir), uuid.uuid4().hex))
    assert other["writes"] == 1 and other["key"] not in used
    since = time.time()
    again = child_json(run_child(TWICE_CHILD, str(cache_dir), salt))
    assert again["ok"] and (again["hits"], again["baked_hits"]) == (1, 1), again
    last_used = {e.key: max(e.atime, e.mtime) for e in store.entries()}
    assert all(last_used[k] >= since - 0.05 for k in used), (last_used, since)
    # Room for two: the least recently used goes, the other program.
    size = sum(store.path_for(k).stat().st_size for k in used)
    out = json.loads(_cli("prune", "--dir", str(cache_dir), "--max-size", str(size), "--json"))
    assert {e.key for e in store.entries()} == used, out


def test_seconds_saved_count_each_program_once_per_process(cl_ctx, cache_dir, open_cache):
    # Issue 26: a program built again in this process (a new context) finds pocl's and
    # pyopencl's own caches holding it: a hit then saves nothing over a plain build.
    import uuid

    import pyopencl as cl

    from conftest import child_json, run_child

    salt = uuid.uuid4().hex
    assert child_json(run_child(TWICE_CHILD, str(cache_dir), salt))["writes"] == 1  # another process's
    cache = open_cache(cache_dir)

    def build_in_a_new_context(source: str) -> float:
        ctx = cl.Context(cl_ctx.devices)
        prg = acc.Program(ctx, source, cache=cache).build()
        assert run_twice(ctx, prg)
        return cache.stats().seconds_saved

    saved = [build_in_a_new_context(small_source("twice", salt=salt)) for _ in range(4)]
    assert cache.stats().hits == 4
    assert saved[0] > 0 and saved == [saved[0]] * 4, saved
    # Built here from source first (a miss), then hits of its entry: nothing saved.
    fresh = small_source("twice")
    build_in_a_new_context(fresh)
    assert cache.flush(120) and cache.stats().writes == 1
    after = [build_in_a_new_context(fresh) for _ in range(3)]
    assert cache.stats().hits == 7 and after == [saved[0]] * 3, after
