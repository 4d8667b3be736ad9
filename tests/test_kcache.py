"""Strategy kcache: pocl's own kernel-cache folder is the entry (docs/design.md F15, F16).

Every scenario runs on real pocl, a "new node" being a child with an empty POCL_CACHE_DIR.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest

import asyncclcache as acc
from asyncclcache import fsclock
from asyncclcache.drivers import cachefiles, folders, kcache_folders
from asyncclcache.entry import Entry
from asyncclcache.platforms import pocl
from asyncclcache.store import Store
from conftest import child_json, run_child, run_in_threads
from kernels import run_twice, small_source

# Builds one program, launches it with local size 16, flushes; reports pocl's files.
RUN = r"""
import json, os, pathlib, sys, time
import pyopencl as cl, asyncclcache as acc
from kernels import small_source, run_twice
from _pocl import pocl_context
pocl = pathlib.Path(os.environ["POCL_CACHE_DIR"])
def files():
    return sorted(str(p.relative_to(pocl)) for p in pocl.rglob("*")
                  if p.is_file() and p.parent != pocl and p.name != "last_accessed")
ctx = pocl_context()
cache = acc.Cache(sys.argv[1], strategy=sys.argv[3] if len(sys.argv) > 3 else "auto")
prg = acc.Program(ctx, small_source(salt=sys.argv[2], repeat=20), cache=cache).build()
after_build = files()
ok = run_twice(ctx, prg, local_size=(16,))
after_launch = files()
flushed = cache.flush(120)
drivers = sorted(cache.drivers)
print(json.dumps({"ok": ok, "flushed": flushed, "after_build": after_build, "after_launch": after_launch,
                  "key": prg.cache_key, "drivers": drivers, "stats": cache.stats().as_dict()}))
"""


def test_cold_run_compiles_nothing_extra_and_new_node_compiles_nothing(cache_dir):
    cold = child_json(run_child(RUN, str(cache_dir), "new-node"))
    assert cold["ok"] and cold["flushed"] and cold["drivers"] == ["kcache"]
    s = cold["stats"]
    assert (s["misses"], s["writes"], s["unidentified"]) == (1, 1, 0)
    # Only the launched variant: no generic (0-0-0) variant was compiled for the cache.
    assert not [f for f in cold["after_launch"] if "/0-0-0" in f]
    assert any("/16-1-1" in f and f.endswith(".so") for f in cold["after_launch"])

    entry = Store(cache_dir).load(cold["key"])
    assert entry is not None and entry.kind == "kcache"
    stored = sorted(entry.meta["files"])
    assert stored == cold["after_launch"]

    warm = child_json(run_child(RUN, str(cache_dir), "new-node"))  # empty POCL_CACHE_DIR
    assert warm["ok"] and warm["stats"]["hits"] == 1 and warm["stats"]["misses"] == 0
    assert warm["after_build"] == stored  # restored before the build
    assert warm["after_launch"] == stored  # and the launch compiled nothing new
    assert warm["stats"]["writes"] == 0 and warm["stats"]["rejected"] == 0


# Builds two programs through a cache of strategy argv[2], flushes (a binary query never
# beside a launch on pocl, F13), then launches them, with the package's log on stderr;
# prints what was cached.
OFF = r"""
import json, logging, sys
import pyopencl as cl, asyncclcache as acc
from kernels import small_source, run_twice
from _pocl import pocl_context
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
ctx = pocl_context()
cache = acc.Cache(sys.argv[1], strategy=sys.argv[2])
prgs = [acc.Program(ctx, small_source(salt=f"off-{i}"), cache=cache).build() for i in range(2)]
flushed = cache.flush(60)
ok = [run_twice(ctx, p) for p in prgs]
print(json.dumps({"ok": ok, "flushed": flushed, "drivers": sorted(cache.drivers),
                  "stats": cache.stats().as_dict()}))
"""


@pytest.mark.parametrize("strategy", ["auto", "kcache"])
def test_kernel_cache_off_caches_nothing_and_says_what_to_do(cache_dir, strategy):
    # pocl's CPU device with its kernel cache off: its binary query compiles under a lock
    # that stalls every launch, and there is no folder to store: built plainly, counted,
    # and one log line (and asyncclcache info) says to turn the cache on.
    env = {"POCL_KERNEL_CACHE": "0"}
    proc = run_child(OFF, str(cache_dir), strategy, env=env)
    out = child_json(proc)
    assert out["ok"] == [True, True] and out["flushed"] and out["drivers"] == ["off"], out
    s = out["stats"]
    assert (s["cache_off"], s["misses"], s["writes"], s["hits"], s["uncacheable"]) == (2, 0, 0, 0, 0), s
    said = [line for line in proc.stderr.splitlines() if "not caching builds here" in line]
    assert len(said) == 1 and "POCL_KERNEL_CACHE=1" in said[0] and "POCL_CACHE_DIR" in said[0], proc.stderr
    assert not list(Store(cache_dir).entries())
    info = run_child("import runpy, sys; sys.argv = ['asyncclcache', 'info', '--json', '--dir', sys.argv[1]]; "
                     "runpy.run_module('asyncclcache', run_name='__main__')", str(cache_dir), env=env, check=False)
    rows = [p for p in json.loads(info.stdout)["platforms"] if p.get("strategy")]
    assert [p["strategy"] for p in rows] == ["off"] and "POCL_KERNEL_CACHE=1" in rows[0]["reason"], info.stdout


def test_binary_entries_serve_thread_and_are_left_alone_where_the_kernel_cache_is_off(cache_dir):
    # Entries of kind binary (what the strategy process wrote, and thread writes) keep
    # serving the thread strategy; with pocl's kernel cache off nothing looks them up.
    first = child_json(run_child(OFF, str(cache_dir), "thread"))
    assert first["drivers"] == ["thread"] and first["stats"]["writes"] == 2, first
    before = sorted((e.key, e.path.read_bytes()) for e in Store(cache_dir).entries())
    off = child_json(run_child(OFF, str(cache_dir), "auto", env={"POCL_KERNEL_CACHE": "0"}))
    assert off["ok"] == [True, True] and (off["stats"]["hits"], off["stats"]["cache_off"]) == (0, 2), off
    assert sorted((e.key, e.path.read_bytes()) for e in Store(cache_dir).entries()) == before
    again = child_json(run_child(OFF, str(cache_dir), "thread", env={"POCL_KERNEL_CACHE": "0"}))
    assert again["ok"] == [True, True] and (again["stats"]["hits"], again["stats"]["writes"]) == (2, 0), again


def test_threads_building_at_once_each_find_their_own_folder(cl_ctx, cache_dir, open_cache):
    cache = open_cache(cache_dir)
    sources = [small_source(name=f"k{i}", repeat=10) for i in range(4)]
    prgs: dict[int, object] = {}

    def work(i: int) -> None:
        prgs[i] = acc.Program(cl_ctx, sources[i], cache=cache).build()
        assert run_twice(cl_ctx, prgs[i], name=f"k{i}")

    assert not run_in_threads(4, work)
    assert cache.flush(120)
    s = cache.stats()
    assert (s.writes, s.unidentified) == (4, 0)
    store = Store(cache_dir)
    for i, prg in prgs.items():
        entry = store.load(prg.cache_key)
        assert entry is not None
        # Its own kernel's folder is in it; another program's kernel never is.
        kernels = {f.split("/")[2] for f in entry.meta["files"] if f.count("/") >= 4}
        assert kernels == {f"k{i}"}
    cache.close()


def test_entry_with_a_folder_pocl_does_not_compute_is_rejected_and_replaced(cache_dir):
    first = child_json(run_child(RUN, str(cache_dir), "foreign"))
    store = Store(cache_dir)
    good = store.load(first["key"])
    assert good is not None
    # The same files under a folder name pocl will never compute (another pocl build, say).
    moved = ["ZZ/" + "Q" * 38 + "/" + f.split("/", 2)[2] for f in good.meta["files"]]
    store.publish(Entry(good.key, good.binaries, dict(good.meta, files=moved)))

    code = RUN.replace("flushed = cache.flush(120)", "import warnings\nflushed = cache.flush(120)")
    proc = run_child(code, str(cache_dir), "foreign", env={"PYTHONWARNINGS": "always"})
    out = child_json(proc)
    assert "pocl did not use the stored kernel-cache files" in proc.stderr
    assert out["ok"] and out["flushed"]
    s = out["stats"]
    assert (s["hits"], s["misses"], s["rejected"], s["writes"]) == (0, 1, 1, 1)
    replaced = store.load(first["key"])
    assert replaced is not None and replaced.meta["files"] == good.meta["files"]
    again = child_json(run_child(RUN, str(cache_dir), "foreign"))
    assert again["stats"]["hits"] == 1 and again["stats"]["rejected"] == 0


def test_partial_folder_is_completed_not_overwritten(cache_dir, tmp_path):
    first = child_json(run_child(RUN, str(cache_dir), "partial"))
    entry = Store(cache_dir).load(first["key"])
    assert entry is not None
    node = tmp_path / "node"
    files = dict(zip(entry.meta["files"], entry.binaries, strict=True))
    bc = next(f for f in files if f.endswith("/program.bc"))
    # This node already has the program's bitcode (pocl wrote it), not its variant.
    (node / bc).parent.mkdir(parents=True)
    (node / bc).write_bytes(files[bc])
    before = os.stat(node / bc)
    warm = child_json(run_child(RUN, str(cache_dir), "partial", pocl_cache=node))
    assert warm["ok"] and warm["stats"]["hits"] == 1
    after = os.stat(node / bc)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert sorted(warm["after_build"]) == sorted(files)  # the variant was added


def test_restore_never_follows_a_link_nor_replaces_a_file(tmp_path):
    root = tmp_path / "kc"
    outside = tmp_path / "outside"
    outside.mkdir()
    folder = "AB/" + "C" * 38
    (root / "AB").mkdir(parents=True)
    (root / folder).symlink_to(outside)  # a planted link where the program folder goes
    with pytest.raises(OSError):
        cachefiles.restore(root, [f"{folder}/program.bc"], [b"bitcode"], folders.valid_file)
    assert list(outside.iterdir()) == []

    (root / folder).unlink()
    (root / folder / "k" / "v").mkdir(parents=True)
    (root / folder / "program.bc").write_bytes(b"pocl's own")
    placed = cachefiles.restore(root, [f"{folder}/program.bc", f"{folder}/k/v/k.so"], [b"ours", b"so"], folders.valid_file)
    assert placed.count == 1
    assert (root / folder / "program.bc").read_bytes() == b"pocl's own"
    assert (root / folder / "k/v/k.so").read_bytes() == b"so"
    assert not [p for p in (root / folder).rglob(".acc-tmp-*")]

    for bad in ("../x/y/program.bc", "/etc/passwd", "AB/../../x", f"{folder}/../../../evil", "AB"):
        with pytest.raises(OSError):
            cachefiles.restore(root, [bad], [b"x"], folders.valid_file)


def test_entry_with_an_unsafe_path_is_damaged_not_restored(cl_ctx, cache_dir, open_cache):
    cache = open_cache(cache_dir)
    prg = acc.Program(cl_ctx, small_source(), cache=cache).build()
    assert cache.flush(120)
    store = Store(cache_dir)
    good = store.load(prg.cache_key)
    assert good is not None
    files = list(good.meta["files"])
    files[0] = "../../escape/program.bc"
    store.publish(Entry(good.key, good.binaries, dict(good.meta, files=files)))
    cache.close()
    with pytest.warns(acc.CorruptEntryWarning, match="unsafe kernel-cache path"):
        assert store.load(prg.cache_key) is None


def test_folder_removed_before_the_snapshot_is_skipped_and_counted(cl_ctx, cache_dir, open_cache):
    import shutil

    root = pocl.kernel_cache_dir()
    assert root is not None
    cache = open_cache(cache_dir)
    with cache.step() as _:
        prg = acc.Program(cl_ctx, small_source(), cache=cache).build()
        assert run_twice(cl_ctx, prg)
        # Find pocl's folder for this build the way the driver does, then remove it.
        job = cache.job(prg.cache_key)
        clock = fsclock.FsClock(root)
        assert clock.measure()
        (found,) = folders.candidates(root, [(clock.since(job.built_from), clock.until(job.built_to))])
        (folder,) = folders.choose(root, found, job.kernels, clock.until(job.built_to), clock.tick)
        shutil.rmtree(root / folder)
    assert cache.flush(60)
    s = cache.stats()
    assert (s.writes, s.unidentified, s.errors) == (0, 1, 0)
    assert Store(cache_dir).load(prg.cache_key) is None
    cache.close()


def test_refresh_rewrites_only_when_a_folder_gained_a_variant(cl_ctx, cache_dir, open_cache):
    cache = open_cache(cache_dir)
    prg = acc.Program(cl_ctx, small_source(), cache=cache).build()
    assert run_twice(cl_ctx, prg, local_size=(4,))
    assert cache.flush(60)
    assert cache.flush(60) and cache.flush(60)  # nothing new: nothing rewritten
    assert (cache.stats().writes, cache.stats().refreshes) == (1, 0)
    assert run_twice(cl_ctx, prg, local_size=(8,))  # a new variant
    assert cache.flush(60)
    assert (cache.stats().writes, cache.stats().refreshes) == (2, 1)
    entry = Store(cache_dir).load(prg.cache_key)
    assert entry is not None and any("/8-1-1" in f for f in entry.meta["files"])
    cache.close()


def _until(cond, timeout: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_variant_launched_while_the_snapshot_is_being_written_reaches_the_entry(
    cl_ctx, cache_dir, open_cache
):
    # Under load, a snapshot taken before a launch may still be on its way when flush()
    # asks for refreshes: its job is rechecked where its write ends, before the wait ends.
    import threading

    cache = open_cache(cache_dir)
    # A kernel of its own: pocl's folder is new (a comment is no new program for pocl).
    prg = acc.Program(cl_ctx, small_source("on_its_way"), cache=cache).build()
    driver, workers = cache.drivers["kcache"], cache._workers
    _until(lambda: driver._waiting)  # claimed; the snapshot waits for the first launch
    gate = threading.Event()
    for _ in workers._threads:  # every writer held
        workers.submit(gate.wait)
    _until(lambda: workers._queue.qsize() == 0)
    driver.hurry()  # the snapshot now, before any launch: its write queued behind the gate
    _until(lambda: not driver._waiting and workers._queue.qsize() == 1)
    assert run_twice(cl_ctx, prg, "on_its_way", local_size=(4,))  # a variant the snapshot lacks
    assert not cache.flush(0.05)  # asks for refreshes while the snapshot is in flight
    gate.set()
    assert cache._pipeline.wait(60)  # the rest of that flush's wait
    s = cache.stats()
    assert (s.writes, s.refreshes) == (2, 1), s
    entry = Store(cache_dir).load(prg.cache_key)
    assert entry is not None and any("/4-1-1" in f for f in entry.meta["files"]), entry.meta["files"]
    assert cache.flush(60) and cache.stats().writes == 2  # nothing more to rewrite


def test_a_hit_that_compiles_a_new_variant_refreshes_its_entry(cache_dir):
    first = child_json(run_child(RUN, str(cache_dir), "hit-refresh"))
    built_in = Store(cache_dir).load(first["key"]).meta.cwd
    assert built_in is not None
    code = RUN.replace("ok = run_twice(ctx, prg, local_size=(16,))",
                       "ok = run_twice(ctx, prg, local_size=(16,)) and run_twice(ctx, prg, local_size=(32,))")
    warm = child_json(run_child(code, str(cache_dir), "hit-refresh"))
    assert warm["ok"] and warm["stats"]["hits"] == 1
    assert (warm["stats"]["writes"], warm["stats"]["refreshes"]) == (1, 1)
    entry = Store(cache_dir).load(first["key"])
    assert entry is not None and any("/32-1-1" in f for f in entry.meta["files"])
    assert entry.meta.cwd == built_in  # where a bake builds it (issue 26, case 8)


# Issue 35: a program built again in new contexts (a test suite) on a new node.
REPEATS = r"""
import json, os, pathlib, shutil, sys, time
import asyncclcache as acc
from asyncclcache.store import Store
from kernels import small_source, run_twice
from _pocl import pocl_context
root = pathlib.Path(os.environ["POCL_CACHE_DIR"])
cache = acc.Cache(sys.argv[1])
build = lambda ctx: acc.Program(ctx, small_source(salt="repeats", repeat=20), cache=cache).build()
prg = build(pocl_context())
cache.flush(60)
entry = Store(sys.argv[1]).path_for(prg.cache_key)
os.utime(entry, (time.time() - 7200, time.time() - 7200))
old = entry.stat().st_mtime
folder = next(p.parent for p in root.rglob("program.bc"))
variant = next(folder.rglob("*.so"))
variant.unlink()  # a restore puts it back; a build does not make it (a launch would)
how = [build(pocl_context())._build_duration_info[0] for _ in range(3)]
restored_again = variant.exists()
cache.flush(60)
marked = entry.stat().st_mtime != old
shutil.rmtree(folder)  # pocl's folder gone (a user's cleanup): the next build restores it
ctx = pocl_context()
prg = build(ctx)
back = variant.exists()
ok = run_twice(ctx, prg, local_size=(32,))  # a variant the entry lacks: a refresh at flush
cache.flush(60)
print(json.dumps({"how": how, "marked": marked, "back": back, "ok": ok, "last": prg._build_duration_info[0],
                  "restored_again": restored_again, **cache.stats().as_dict()}))
"""


def test_a_program_built_again_in_new_contexts_is_restored_and_marked_once(cache_dir, tmp_path):
    first = child_json(run_child(RUN, str(cache_dir), "repeats"))
    assert first["stats"]["writes"] == 1
    out = child_json(run_child(REPEATS, str(cache_dir), pocl_cache=tmp_path / "new"))
    assert out["how"] == ["cache retrieval"] * 3 and (out["hits"], out["misses"]) == (5, 0), out
    # The repeats marked the entry used no more (the first hit did), and pocl served them
    # from the folder the first hit restored: nothing restored again.
    assert not out["marked"] and not out["restored_again"], out
    # A folder gone from pocl's cache is restored again, and what its launches add is kept.
    assert out["back"] and out["ok"] and out["last"] == "cache retrieval", out
    assert out["refreshes"] == 1, out


def test_snapshot_waits_for_the_first_launch(cl_ctx, cache_dir, open_cache):
    # Outside a step the entry is taken once every kernel has a variant (or after a while).
    cache = open_cache(cache_dir)
    prg = acc.Program(cl_ctx, small_source(), cache=cache).build()
    assert run_twice(cl_ctx, prg, local_size=(2,))
    import time

    deadline = time.monotonic() + kcache_folders.SETTLE_SECONDS - 0.5
    while cache.stats().writes == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cache.stats().writes == 1, "not written as soon as the launch compiled its variant"
    entry = Store(cache_dir).load(prg.cache_key)
    assert entry is not None and any("/2-1-1" in f for f in entry.meta["files"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache.close()


def test_stored_files_are_what_pocl_wrote(cache_dir):
    out = child_json(run_child(RUN, str(cache_dir), "content"))
    entry = Store(cache_dir).load(out["key"])
    assert entry is not None
    assert all(folders.valid_file(f) for f in entry.meta["files"])
    assert not any(Path(f).name == "last_accessed" for f in entry.meta["files"])


@pytest.mark.parametrize(
    ("rel", "ok"),
    [
        ("AB/CDEFGHIJKL/program.bc", True),
        ("AB/CDEFGHIJKL/k/64-1-1-goffs0-smallgrid/k.so", True),
        ("AB/CDEFGHIJKL/program.bc\n", False),
        ("AB/CDEFGHIJKL/..", False),
        ("AB/CDEFGHIJKL/k/./k.so", False),
        ("AB/CDEFGHIJKL/.acc-tmp-0123", False),
        ("../CDEFGHIJKL/program.bc", False),
        ("/AB/CDEFGHIJKL/program.bc", False),
        ("AB/CDEFGHIJKL", False),
        ("AB/CDEF/program.bc", False),
    ],
)
def test_valid_file_names(rel, ok):
    assert folders.valid_file(rel) is ok


@pytest.mark.parametrize(
    ("env", "expect"),
    [
        ({}, "xdg"),
        ({"POCL_KERNEL_CACHE": "1"}, "xdg"),
        ({"POCL_KERNEL_CACHE": "0"}, None),
        ({"POCL_KERNEL_CACHE": "10"}, "xdg"),  # pocl: strncmp(value, "1", 1)
        ({"POCL_KERNEL_CACHE": "maybe"}, None),
        ({"POCL_KERNEL_CACHE": "true"}, None),  # issue 18 case 6: pocl reads these as off
        ({"POCL_KERNEL_CACHE": "yes"}, None),
        ({"POCL_KERNEL_CACHE": "on"}, None),
        ({"POCL_KERNEL_CACHE": " 1"}, None),
        ({"POCL_KERNEL_CACHE": ""}, None),
        ({"POCL_CACHE_DIR": "/x/kc"}, "/x/kc"),
        ({"POCL_CACHE_DIR": ""}, None),
    ],
)
def test_kernel_cache_dir_as_pocl_finds_it(monkeypatch, tmp_path, env, expect):
    for var in ("POCL_KERNEL_CACHE", "POCL_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    got = pocl.kernel_cache_dir()
    if expect == "xdg":
        assert got == tmp_path / "pocl" / "kcache"
    else:
        assert got == (Path(expect) if expect else None)


def test_a_new_folder_is_found_without_walking_old_ones(cl_ctx, cache_dir, open_cache):
    # A large, old kernel cache (a user's ~/.cache/pocl): identifying a new program's folder
    # must not stat every old folder; a program pocl serves from an old folder still is found.
    import pyopencl as cl

    root = pocl.kernel_cache_dir()
    assert root is not None
    import time

    old = time_ago = 3600.0

    for i in range(300):
        d = root / f"Z{i % 10}" / (f"OLD{i:05d}" + "A" * 30)
        d.mkdir(parents=True, exist_ok=True)
        (d / "last_accessed").touch()
        os.utime(d / "last_accessed", (time.time() - old, time.time() - old))
        os.utime(d, (time.time() - time_ago, time.time() - time_ago))
    for i in range(10):
        os.utime(root / f"Z{i}", (time.time() - time_ago, time.time() - time_ago))

    cache = open_cache(cache_dir)
    prg = acc.Program(cl_ctx, small_source(name="fresh_kernel_name_xyz"), cache=cache).build()
    assert run_twice(cl_ctx, prg, name="fresh_kernel_name_xyz")
    assert cache.flush(60)
    driver = cache.drivers["kcache"]
    assert cache.stats().writes == 1 and driver.full_scans == 0

    # Built before without the cache: pocl serves it from its existing folder.
    src = small_source(name="seen_before_abc")
    assert run_twice(cl_ctx, cl.Program(cl_ctx, src).build(), name="seen_before_abc")
    time.sleep(0.2)
    prg2 = acc.Program(cl_ctx, src, cache=cache).build()
    assert run_twice(cl_ctx, prg2, name="seen_before_abc")
    assert cache.flush(60)
    assert cache.stats().writes == 2 and cache.stats().unidentified == 0 and driver.full_scans == 1
    entry = Store(cache_dir).load(prg2.cache_key)
    assert entry is not None and any("/seen_before_abc/" in f for f in entry.meta["files"])
    cache.close()
    import shutil

    for i in range(10):
        shutil.rmtree(root / f"Z{i}")


def test_restore_failure_keeps_the_entry(cache_dir, tmp_path):
    # Our I/O failing at a hit (here: a link planted in pocl's cache, which restore refuses)
    # is a plain miss; the good entry is not blamed, dropped or counted as rejected.
    first = child_json(run_child(RUN, str(cache_dir), "restore-fails"))
    entry = Store(cache_dir).load(first["key"])
    assert entry is not None
    top = entry.meta["files"][0].split("/")[0]
    node, elsewhere = tmp_path / "node", tmp_path / "elsewhere"
    node.mkdir()
    elsewhere.mkdir()
    (node / top).symlink_to(elsewhere)
    out = child_json(run_child(RUN, str(cache_dir), "restore-fails", pocl_cache=node))
    assert out["ok"]
    s = out["stats"]
    assert (s["hits"], s["misses"], s["rejected"]) == (0, 1, 0)
    assert Store(cache_dir).load(first["key"]) is not None


def test_a_variant_that_cannot_be_restored_costs_its_launch_a_compile_not_the_hit(cache_dir, tmp_path):
    # The variants are written while pocl builds (a writer thread); failing there (a link
    # planted where the kernel's folder goes: never followed) leaves the hit a hit, says so
    # once, and the launch compiles the variant as pocl does without a cache.
    first = child_json(run_child(RUN, str(cache_dir), "variant-fails"))
    files = Store(cache_dir).load(first["key"]).meta["files"]
    kernel_dir = next(f for f in files if f.count("/") > 2).rsplit("/", 2)[0]
    node, elsewhere = tmp_path / "node", tmp_path / "elsewhere"
    (node / kernel_dir).parent.mkdir(parents=True)
    elsewhere.mkdir()
    (node / kernel_dir).symlink_to(elsewhere)
    proc = run_child(RUN, str(cache_dir), "variant-fails", pocl_cache=node)
    out = child_json(proc)
    assert out["ok"]
    assert (out["stats"]["hits"], out["stats"]["misses"], out["stats"]["rejected"]) == (1, 0, 0)
    assert "could not restore pocl's kernel cache" in proc.stderr and "launches compile" in proc.stderr
    assert (node / kernel_dir.rsplit("/", 1)[0] / pocl.PROGRAM_FILE).is_file()  # the build's file was
    assert not [p for p in elsewhere.rglob("*") if p.name.startswith(cachefiles.TMP_PREFIX)]
