"""The driver's own cache as the entry on content-addressed caches (issue 19): Mesa's shader
cache on real rusticl (``RUSTICL_ENABLE=llvmpipe``, where ``mesa-opencl-icd`` is installed),
and the rules of where NVIDIA's and Mesa's caches live.

Every scenario with rusticl runs in fresh processes: a new node is a child with an empty
``MESA_SHADER_CACHE_DIR``, as Mesa reads it once per process.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from asyncclcache.drivers.kcache_files import added_files
from asyncclcache.keys import UncertainIncludes, find_include_deps
from asyncclcache.platforms import mesa as mesa_platform
from asyncclcache.platforms import nvidia as nvidia_platform
from conftest import need

MESA, NVIDIA = mesa_platform.LAYOUT, nvidia_platform.LAYOUT

# {{{ where the caches live (pure rules; the values were measured on the drivers)

HOME = pwd.getpwuid(os.getuid()).pw_dir


@pytest.mark.parametrize(("env", "root"), [
    ({"HOME": "/h"}, "/h/.nv/ComputeCache"),
    ({"HOME": "/h", "XDG_CACHE_HOME": "/x"}, "/h/.nv/ComputeCache"),  # XDG is not read
    ({"CUDA_CACHE_PATH": "/c", "HOME": "/h"}, "/c"),
    ({"CUDA_CACHE_PATH": "/c", "CUDA_CACHE_DISABLE": "0"}, "/c"),
    ({"CUDA_CACHE_PATH": "/c", "CUDA_CACHE_DISABLE": "true"}, "/c"),  # only "1" turned it off
    ({"CUDA_CACHE_PATH": "/c", "CUDA_CACHE_DISABLE": ""}, "/c"),
    ({"CUDA_CACHE_PATH": "/c", "CUDA_CACHE_DISABLE": "1"}, None),
    ({"CUDA_CACHE_PATH": "/c", "CUDA_CACHE_DISABLE": "01"}, None),  # not measured: unknown
    ({"CUDA_CACHE_PATH": "rel/c"}, None),  # not where the driver put it
    ({"CUDA_CACHE_PATH": ""}, None),
    ({}, None),  # no HOME
    ({"HOME": ""}, None),
])
def test_cuda_cache_place_as_measured(env: dict[str, str], root: str | None) -> None:
    got, why = nvidia_platform.locate(env)
    assert got == (None if root is None else Path(root))
    assert bool(why) == (root is None)


@pytest.mark.parametrize(("env", "root"), [
    ({"MESA_SHADER_CACHE_DIR": "/m"}, "/m/mesa_shader_cache"),
    ({"MESA_GLSL_CACHE_DIR": "/g"}, "/g/mesa_shader_cache"),
    ({"MESA_SHADER_CACHE_DIR": "/m", "MESA_GLSL_CACHE_DIR": "/g"}, "/m/mesa_shader_cache"),
    ({"XDG_CACHE_HOME": "/x"}, "/x/mesa_shader_cache"),
    ({"HOME": HOME}, f"{HOME}/.cache/mesa_shader_cache"),
    ({"HOME": "/elsewhere"}, None),  # Mesa 22.3 reads the password database, 26.1 HOME
    ({}, None),
    ({"MESA_SHADER_CACHE_DIR": "rel"}, None),
    ({"MESA_SHADER_CACHE_DIR": ""}, None),
    ({"MESA_SHADER_CACHE_DIR": "/m", "MESA_SHADER_CACHE_DISABLE": "1"}, None),
    ({"MESA_SHADER_CACHE_DIR": "/m", "MESA_SHADER_CACHE_DISABLE": "TRUE"}, None),
    ({"MESA_SHADER_CACHE_DIR": "/m", "MESA_SHADER_CACHE_DISABLE": "no"}, "/m/mesa_shader_cache"),
    ({"MESA_SHADER_CACHE_DIR": "/m", "MESA_SHADER_CACHE_DISABLE": "maybe"}, "/m/mesa_shader_cache"),
    ({"MESA_SHADER_CACHE_DIR": "/m", "MESA_GLSL_CACHE_DISABLE": "y"}, None),
    # MESA_SHADER_CACHE_DISABLE set wins over the old name, as in Mesa.
    ({"MESA_SHADER_CACHE_DIR": "/m", "MESA_SHADER_CACHE_DISABLE": "0", "MESA_GLSL_CACHE_DISABLE": "1"},
     "/m/mesa_shader_cache"),
    ({"MESA_SHADER_CACHE_DIR": "/m", "MESA_DISK_CACHE_DATABASE": "1"}, None),  # Mesa-DB
    ({"MESA_SHADER_CACHE_DIR": "/m", "MESA_DISK_CACHE_SINGLE_FILE": "t"}, None),  # Fossilize
    ({"MESA_SHADER_CACHE_DIR": "/m", "MESA_DISK_CACHE_MULTI_FILE": "0"}, None),
    ({"MESA_SHADER_CACHE_DIR": "/m", "MESA_DISK_CACHE_MULTI_FILE": "1"}, "/m/mesa_shader_cache"),
])
def test_mesa_cache_place_as_mesa_finds_it(env: dict[str, str], root: str | None) -> None:
    got, why = mesa_platform.locate(env, release=(26, 1))
    assert got == (None if root is None else Path(root))
    assert bool(why) == (root is None)


def test_layout_names() -> None:
    assert NVIDIA.valid("a/3/14a594ddd6299d") and not NVIDIA.valid("index")
    assert not NVIDIA.valid("a/3/../x") and not NVIDIA.valid("a/3/14a594ddd6299d.tmp")
    assert MESA.valid("8c/0f9fa9ab0acc6df7c1239bf87d5c16317d7af4")  # Mesa 22.3
    assert MESA.valid("7f/7a1634cb16407e72c53de21ab611686a35c04e1679492d7fecbf6cf0e13b4e")  # 26.1
    assert not MESA.valid("7f/7a1634cb16407e72c53de21ab611686a35c04e1679492d7fecbf6cf0e13b4e.tmp")
    assert not MESA.valid("index") and not MESA.valid("7f/.acc-tmp-0011")


def test_added_files_takes_only_trusted_items_of_the_window(tmp_path: Path) -> None:
    root = tmp_path / "mesa_shader_cache"
    (root / "ab").mkdir(parents=True)
    old = root / "ab" / ("1" * 38)
    old.write_bytes(b"old")
    os.utime(root / "ab", (1, 1))
    lo = time.time() - 1  # the coarse stamps of some file systems: a second of leeway
    time.sleep(1.1)
    (root / "cd").mkdir()
    new = root / "cd" / ("2" * 38)
    new.write_bytes(b"new")
    (root / "cd" / ("3" * 38 + ".tmp")).write_bytes(b"partial")
    (root / "index").write_bytes(b"i")
    shared = root / "cd" / ("4" * 38)
    shared.write_bytes(b"x")
    shared.chmod(0o666)  # writable by others: never stored
    (root / "cd" / ("5" * 38)).symlink_to(new)
    os.link(new, root / "cd" / ("6" * 38))  # a second link: never stored
    got = added_files(root, MESA, lo + 1)
    assert set(got) == set(), "a file with two links, or writable by others, was taken"
    os.unlink(root / "cd" / ("6" * 38))
    got = added_files(root, MESA, lo + 1)
    # The old file was made before the window; the temp file, the index, the link and the
    # file writable by others are never items of ours.
    assert set(got) == {f"cd/{'2' * 38}"}


@pytest.mark.parametrize(("release", "env", "multi"), [
    ((22, 3), {}, True),
    ((26, 1), {}, True),
    ((25, 0), {}, False),  # Debian 13: Mesa-DB unless told
    ((25, 0), {"MESA_DISK_CACHE_DATABASE": "0"}, False),  # not enough there, as measured
    ((25, 0), {"MESA_DISK_CACHE_MULTI_FILE": "1"}, True),
    ((24, 1), {}, None),  # not measured: the binary, with the reason
    (None, {}, None),
    ((24, 1), {"MESA_DISK_CACHE_MULTI_FILE": "true"}, True),
    ((26, 1), {"MESA_DISK_CACHE_MULTI_FILE": "0"}, False),
    ((25, 0), {"MESA_DISK_CACHE_MULTI_FILE": "1", "MESA_DISK_CACHE_DATABASE": "1"}, False),
])
def test_mesa_layout_default_per_release(
    release: tuple[int, int] | None, env: dict[str, str], multi: bool | None,
) -> None:
    got, why = mesa_platform.locate({"MESA_SHADER_CACHE_DIR": "/m", **env}, release=release)
    assert (got is not None) == bool(multi), why
    if multi is None:
        assert "not measured" in why
    assert mesa_platform.mesa_release("25.0.7-2+deb13u1") == (25, 0)
    assert mesa_platform.mesa_release("22.3.6") == (22, 3) and mesa_platform.mesa_release("rusticl") is None


def test_a_file_written_after_its_directory_changed_is_in_every_scan(tmp_path: Path) -> None:
    # NVIDIA writes some items for a few ms after creating them: the file's ctime is later
    # than its directory's stamp. Whether it lies in a window must not depend on the lower
    # bound the scan was made for (a scan for an earlier window listed the directory).
    root = tmp_path / "cc"
    (root / "a" / "3").mkdir(parents=True)
    item = root / "a" / "3" / "14a594ddd6299d"
    item.write_bytes(b"x")
    time.sleep(0.3)
    with item.open("ab") as f:
        f.write(b"y")  # ctime moves; the directory's stamp does not
    lo = item.stat().st_ctime - 0.01
    assert max(os.stat(item.parent).st_mtime, os.stat(item.parent).st_ctime) < lo
    assert set(added_files(root, NVIDIA, lo)) == {"a/3/14a594ddd6299d"}
    assert set(added_files(root, NVIDIA, lo - 1)) == {"a/3/14a594ddd6299d"}


def test_files_beyond_an_entrys_bound_are_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncclcache.drivers import kcache_files
    from asyncclcache.drivers.background import Waiting

    root = tmp_path / "mesa_shader_cache"
    names = [f"{i:02x}/{'0' * 38}" for i in range(3)]
    t0 = time.time()
    for n in names:
        (root / n).parent.mkdir(parents=True, exist_ok=True)
        (root / n).write_bytes(n.encode())
    monkeypatch.setattr(kcache_files, "MAX_FILES", 2)
    driver = kcache_files.FileCacheDriver(root, MESA)
    counted: list[tuple[str, float]] = []
    driver.on_count = lambda name, n: counted.append((name, n))
    class FakeJob:  # hashed by identity and weakly referenced, as a Job is
        key, built_from, built_to, queried_at = "k" * 64, t0 - 1, t0 + 1, None

    job = FakeJob()
    added = added_files(root, MESA, t0 - 5)
    _, snap, error = driver._snapshot(Waiting(job, lambda *a: None, 0.0), driver._windows(), added)  # type: ignore[arg-type]
    assert error is None and snap is not None and snap.files == names[:2]
    assert driver.left_out == 1 and counted == [("left_out", 1)]


# }}}

# {{{ includes: what rusticl's own cache would not see is not cached


def test_header_beside_the_source_is_uncertain_where_in_doubt(tmp_path: Path) -> None:
    (tmp_path / "h.h").write_text("#define VAL 1\n")
    (tmp_path / "inc").mkdir()
    (tmp_path / "inc" / "h.h").write_text("#define VAL 2\n")
    src = b'#include "h.h"\n'
    with pytest.raises(UncertainIncludes, match="doubt"):
        find_include_deps(src, [], source_dir=str(tmp_path), source_dir_doubt="doubt")
    with pytest.raises(UncertainIncludes, match="doubt"):  # -I would find another file
        find_include_deps(src, [str(tmp_path / "inc")], source_dir=str(tmp_path), source_dir_doubt="doubt")
    # -I naming the same folder: the same file either way.
    deps = find_include_deps(src, [str(tmp_path)], source_dir=str(tmp_path), source_dir_doubt="doubt")
    assert [Path(d.path).name for d in deps] == ["h.h"]
    # No doubt (NVIDIA: its cache sees headers): the file beside the source is the one.
    deps = find_include_deps(src, [str(tmp_path / "inc")], source_dir=str(tmp_path))
    assert deps[0].path == str(tmp_path / "h.h")


# }}}

# {{{ real rusticl

_RUSTICL = r'''
import json, os, sys, time
import numpy as np, pyopencl as cl
import asyncclcache as acc
plats = [p for p in cl.get_platforms() if p.name == "rusticl"]
devs = plats[0].get_devices() if plats else []
print(json.dumps({"devices": [d.name for d in devs]}))
'''


def _rusticl_env(mesa: Path | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MESA_", "ASYNCCLCACHE_")) and k not in ("PYOPENCL_CTX",)}
    env["RUSTICL_ENABLE"] = "llvmpipe"
    # Mesa 25.0 (Debian 13) keeps a Mesa-DB database unless told: one file per item on every
    # release (22.3 does not read it, 26.1 has it on by default).
    env["MESA_DISK_CACHE_MULTI_FILE"] = "1"
    if mesa is not None:
        env["MESA_SHADER_CACHE_DIR"] = str(mesa)
    env["PYTHONPATH"] = str(Path(__file__).parent) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _have_rusticl() -> bool:
    if shutil.which("true") is None:  # pragma: no cover
        return False
    proc = subprocess.run([sys.executable, "-c", _RUSTICL], env=_rusticl_env(None), capture_output=True,
                          text=True, timeout=120, check=False)
    try:
        return bool(json.loads(proc.stdout.splitlines()[-1])["devices"])
    except (IndexError, ValueError, KeyError):
        return False


@pytest.fixture(scope="session")
def _rusticl_here() -> None:
    if not _have_rusticl():
        need("Mesa's rusticl", "Mesa's rusticl (mesa-opencl-icd) is not installed")


rusticl = pytest.mark.usefixtures("_rusticl_here")

NODE = r'''
import json, os, sys, threading, time
import numpy as np, pyopencl as cl
import asyncclcache as acc
args = json.loads(sys.argv[1])
plat = [p for p in cl.get_platforms() if p.name == "rusticl"][0]
ctx = cl.Context(plat.get_devices()); q = cl.CommandQueue(ctx)
cache = acc.Cache(args["dir"])
def source(c):
    return ("__kernel void k(__global float *a) { int i = get_global_id(0); float x = a[i];"
            " for (int j = 0; j < 32; ++j) x = x * 0.999f + sin(x + j); a[i] = x + %s; }" % c)
def build(src, opts=()):
    return acc.Program(ctx, src, cache=cache).build(options=list(opts))
def launch(prg):
    a = np.zeros(64, np.float32)
    buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=a)
    prg.k(q, (64,), None, buf); cl.enqueue_copy(q, a, buf); q.finish()
    return float(a[0])
def run(src, opts=()):
    return launch(build(src, opts))
t = time.perf_counter()
if args.get("threads"):
    # One thread per program. "at once": started together, each builds and launches;
    # "interleaved": 1st builds, 2nd builds, 1st launches, 2nd launches (events).
    n = len(args["consts"])
    vals = [None] * n
    start = threading.Barrier(n)
    built = [threading.Event() for _ in range(n)]
    launched = [threading.Event() for _ in range(n)]
    def one(i, c):
        if args["threads"] == "at once":
            start.wait()
            vals[i] = run(source(c))
            return
        if i:
            built[i - 1].wait()
        prg = build(source(c))
        built[i].set()
        (launched[i - 1] if i else built[n - 1]).wait()
        vals[i] = launch(prg)
        launched[i].set()
    ts = [threading.Thread(target=one, args=(i, c)) for i, c in enumerate(args["consts"])]
    [x.start() for x in ts]; [x.join() for x in ts]
elif "include" in args:
    vals = [run('#include "h.h"\n__kernel void k(__global float *a) { a[get_global_id(0)] = VAL; }',
                args["include"])]
else:
    vals = [run(source(c)) for c in args["consts"]]
first = time.perf_counter() - t
cache.flush()
d = cache.driver_for(ctx.devices)
st = cache.stats()
print(json.dumps({"vals": vals, "first": first, "strategy": d.name, "hits": st.hits, "misses": st.misses,
                  "writes": st.writes, "uncacheable": st.uncacheable, "rejected": st.rejected,
                  "errors": st.errors, "unused": getattr(d, "unused", None), "refreshes": st.refreshes,
                  "incomplete": st.incomplete_hits, "left_out": st.left_out,
                  "in_doubt": getattr(d, "in_doubt", None), "unidentified": st.unidentified}))
'''


def _node(cache: Path, mesa: Path, cwd: Path | None = None, **args: Any) -> dict[str, Any]:
    args["dir"] = str(cache)
    extra = args.pop("env", {})
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(NODE), json.dumps(args)],
                          env=_rusticl_env(mesa, **extra), capture_output=True, text=True,
                          timeout=300, check=False, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def _items(mesa: Path) -> set[str]:
    root = mesa / "mesa_shader_cache"
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and MESA.valid(str(p.relative_to(root)))}


_START = r'''
import sys, time, pyopencl as cl
from pathlib import Path
plat = [p for p in cl.get_platforms() if p.name == "rusticl"][0]
ctx = cl.Context(plat.get_devices()); q = cl.CommandQueue(ctx); q.finish()
# Mesa's writer thread stores what start-up compiled some time later (Mesa 26.1: 0.8 MB,
# 0.1 s after the platform), and an exit may drop what it has not written: wait until
# nothing more comes for a second.
root, last, since = Path(sys.argv[1]), None, time.monotonic()
for _ in range(100):
    now = sorted(str(p) for p in root.rglob("*")) if root.exists() else []
    if now != last:
        last, since = now, time.monotonic()
    elif time.monotonic() - since > 1.0:
        break
    time.sleep(0.1)
'''


def _startup_items(mesa: Path) -> set[str]:
    """What Mesa writes on a node for the device alone (no program): rusticl's own shaders
    (none on Mesa 22.3; 4 files on 25.0, 9 on 26.1, written as the platform starts and by
    Mesa's writer thread after it, at times in the window of a build or of a hit)."""
    subprocess.run([sys.executable, "-c", _START, str(mesa / "mesa_shader_cache")], env=_rusticl_env(mesa),
                   timeout=300, check=True)
    return _items(mesa) if (mesa / "mesa_shader_cache").exists() else set()


def _entries(cache: Path) -> list[Any]:
    from asyncclcache.store import Store

    store = Store(cache)
    out = []
    for path in sorted(store.root.rglob("*.acl")):
        entry, _ = store.lookup(path.stem, None)
        if entry is not None:
            out.append(entry)
    return out


def _as_predicted(node: dict[str, Any], held: set[str] | None, now: set[str], own: set[str],
                  startup: set[str]) -> None:
    """A new node's run of one program alone, whose entry held ``held`` (None: no entry)
    and holds ``now`` after it: a hit exactly when there was an entry; the files the hit's
    build added (counted ``unused``, the entry rewritten with them) are the program's files
    that the entry lacked, and start-up files of Mesa's that its writer thread stored
    inside the hit's window (Mesa 25.0, 26.1; a file that any program's node makes)."""
    assert node["hits"] == int(held is not None) and node["errors"] == 0, (node, held)
    if held is None:
        assert node["writes"] == 1 and own <= now <= own | startup, (node, now - own)
        return
    added = now - held
    assert held <= now and added - startup == own - held, (node, held, now)
    n = int(bool(added))
    assert node["unused"] == node["incomplete"] == node["writes"] == node["refreshes"] == n, (node, added)


@rusticl
def test_new_node_hit_adds_no_file_and_is_checked(tmp_path: Path) -> None:
    startup = _startup_items(tmp_path / "m0")
    cold = _node(tmp_path / "acc", tmp_path / "m1", consts=["1.0"])
    assert cold["strategy"] == "kcache-mesa" and cold["misses"] == 1 and cold["writes"] == 1, cold
    [entry] = _entries(tmp_path / "acc")
    own = _items(tmp_path / "m1") - startup
    assert entry.kind == "kcache" and own <= set(entry.meta.files) <= _items(tmp_path / "m1")
    assert own, "the entry holds Mesa's files of the build"

    warm = _node(tmp_path / "acc", tmp_path / "m2", consts=["1.0"])
    assert warm["misses"] == 0 and warm["vals"] == cold["vals"], warm
    # The new node's cache holds what was restored, and what Mesa writes for the device
    # alone: the driver compiled nothing for the program (a start-up file written inside the
    # hit's window is all that it may add).
    [after] = _entries(tmp_path / "acc")
    _as_predicted(warm, set(entry.meta.files), set(after.meta.files), own, startup)
    assert set(entry.meta.files) <= _items(tmp_path / "m2") <= set(entry.meta.files) | startup


@rusticl
def test_hits_in_a_row_are_not_taken_for_files_the_driver_added(tmp_path: Path) -> None:
    # Each hit's check window reaches back by the clock's margin: the files that the hit
    # before it restored are not files the driver added (no warning, no rewrite).
    startup = _startup_items(tmp_path / "m0")
    consts = ["1.5", "1.75", "1.25", "1.125"]
    cold = _node(tmp_path / "acc", tmp_path / "m1", consts=consts)
    assert cold["writes"] >= len(consts) and cold["misses"] == len(consts), cold
    entries = {e.key: set(e.meta.files) for e in _entries(tmp_path / "acc")}
    # Windows end where the next build begins (and the clock's margin: a neighbour's file
    # or two, on Mesa 22.3): no entry holds all the others' files.
    assert max(map(len, entries.values())) < sum(map(len, entries.values()))
    warm = _node(tmp_path / "acc", tmp_path / "m2", consts=consts)
    assert warm["hits"] == len(consts) and warm["vals"] == cold["vals"], warm
    # What a hit added is a start-up file of Mesa's written inside its window, if anything.
    after = {e.key: set(e.meta.files) for e in _entries(tmp_path / "acc")}
    grown = [k for k in entries if after[k] != entries[k]]
    assert all(entries[k] < after[k] <= entries[k] | startup for k in grown), (entries, after)
    assert warm["unused"] == warm["writes"] == warm["refreshes"] == len(grown), warm
    stored = set().union(*entries.values())
    assert stored <= _items(tmp_path / "m2") <= stored | startup


@rusticl
def test_a_hit_whose_files_were_not_enough_is_counted_and_completed(tmp_path: Path) -> None:
    from asyncclcache.entry import Entry
    from asyncclcache.store import Store

    startup = _startup_items(tmp_path / "m0")
    _node(tmp_path / "acc", tmp_path / "m1", consts=["2.0"])
    [entry] = _entries(tmp_path / "acc")
    own = _items(tmp_path / "m1") - startup
    assert len(own) >= 2 and own <= set(entry.meta.files), entry.meta.files
    # Leave one of the program's files out of the entry: the driver must make it again at
    # the hit.
    drop = next(i for i, f in enumerate(entry.meta.files) if f in own)
    kept = [f for i, f in enumerate(entry.meta.files) if i != drop]
    import dataclasses

    meta = dataclasses.replace(entry.meta, files=kept)
    store = Store(tmp_path / "acc")
    claim = store.claim(entry.key)
    assert claim is not None
    store.publish(Entry(entry.key, [b for i, b in enumerate(entry.binaries) if i != drop], meta), claim=claim)
    claim.release()

    warm = _node(tmp_path / "acc", tmp_path / "m2", consts=["2.0"])
    assert warm["unused"] == 1, warm
    [again] = _entries(tmp_path / "acc")
    _as_predicted(warm, set(kept), set(again.meta.files), own, startup)  # completed at flush
    third = _node(tmp_path / "acc", tmp_path / "m3", consts=["2.0"])
    [last] = _entries(tmp_path / "acc")
    _as_predicted(third, set(again.meta.files), set(last.meta.files), own, startup)
    assert set(again.meta.files) <= _items(tmp_path / "m3") <= set(again.meta.files) | startup


@rusticl
def test_driver_cache_off_stores_the_binary(tmp_path: Path) -> None:
    off = {"MESA_SHADER_CACHE_DISABLE": "1"}
    cold = _node(tmp_path / "acc", tmp_path / "m1", consts=["3.0"], env=off)
    assert cold["strategy"] == "thread" and cold["writes"] == 1, cold
    assert not (tmp_path / "m1" / "mesa_shader_cache").exists()
    [entry] = _entries(tmp_path / "acc")
    assert entry.kind == "binary"
    warm = _node(tmp_path / "acc", tmp_path / "m2", consts=["3.0"], env=off)
    assert warm["hits"] == 1 and warm["vals"] == cold["vals"]
    db = _node(tmp_path / "acc2", tmp_path / "m3", consts=["3.0"], env={"MESA_DISK_CACHE_DATABASE": "1"})
    assert db["strategy"] == "thread"
    info = subprocess.run([sys.executable, "-m", "asyncclcache", "info", "--json"],
                          env=_rusticl_env(tmp_path / "m4", MESA_DISK_CACHE_DATABASE="1"),
                          capture_output=True, text=True, timeout=120, check=True)
    [row] = [p for p in json.loads(info.stdout)["platforms"] if p["name"] == "rusticl"]
    assert row["strategy"] == "thread" and "Mesa-DB" in row["reason"]


@rusticl
@pytest.mark.parametrize("order", ["interleaved", "at once"])
def test_programs_built_in_two_threads_never_get_each_others_files(tmp_path: Path, order: str) -> None:
    # A build in one thread says nothing about when another thread launches what it built:
    # a file made while both programs' windows are open may be either's, and is in no entry.
    # "interleaved" is what a busy machine did to "at once" (issue 26): the 2nd thread built
    # before the 1st launched, so the 1st's launch files were stored in the 2nd's entry, and
    # the 1st's entry lacked them (a new node's hit compiled them: unused == 1).
    consts = ["4.0", "5.0"]
    # What Mesa writes for each program alone, and its key. A node's start-up files (Mesa
    # 25.0 and 26.1: rusticl's own shaders, 0.3 and 0.8 MB) are no program's: those the
    # device alone makes, and those both programs' nodes make. Any entry may hold them (one
    # written inside a window: its stamp is all we know of it), no entry another's files.
    startup = _startup_items(tmp_path / "m0")
    seen: list[set[str]] = []
    keys: list[str] = []
    want: list[float] = []
    for i, c in enumerate(consts):
        alone = _node(tmp_path / f"ref{i}", tmp_path / f"r{i}", consts=[c])
        [ref] = _entries(tmp_path / f"ref{i}")
        seen.append(_items(tmp_path / f"r{i}"))
        keys.append(ref.key)
        want += alone["vals"]
    startup |= set.intersection(*seen)
    own = {key: files - startup for key, files in zip(keys, seen, strict=True)}
    for i, key in enumerate(keys):
        [ref] = _entries(tmp_path / f"ref{i}")
        assert own[key] <= set(ref.meta.files) <= seen[i], "one program alone: its entry holds its files"
    assert len(own) == 2 and all(own.values())
    key_of = dict(zip(consts, keys, strict=True))

    cold = _node(tmp_path / "acc", tmp_path / "m1", consts=consts, threads=order)
    assert cold["misses"] == 2 and cold["vals"] == want and cold["errors"] == 0, cold
    entries = {e.key: set(e.meta.files) for e in _entries(tmp_path / "acc")}
    for key, files in entries.items():
        assert files and files <= own[key] | startup, f"an entry holds another program's files: {files - own[key]}"
    assert cold["writes"] == len(entries) and cold["unidentified"] == 2 - len(entries), cold
    if order == "interleaved":
        # Every file of the 2nd program was made while the 1st one's window was open.
        assert key_of[consts[1]] not in entries and cold["in_doubt"] >= len(own[key_of[consts[1]]]), cold
    # Each program alone on a new node: a hit on what its entry holds (one that lacks
    # files is counted and completed at flush), else a miss that writes it; then the
    # entry holds all the program's files, and the next node compiles nothing it lacks.
    for i, c in enumerate(consts):
        key = key_of[c]
        warm = _node(tmp_path / "acc", tmp_path / f"n{i}", consts=[c])
        assert warm["vals"] == [want[i]], warm
        [entry] = [e for e in _entries(tmp_path / "acc") if e.key == key]
        held = set(entry.meta.files)
        _as_predicted(warm, entries.get(key), held, own[key], startup)
        third = _node(tmp_path / "acc", tmp_path / f"t{i}", consts=[c])
        [entry] = [e for e in _entries(tmp_path / "acc") if e.key == key]
        _as_predicted(third, held, set(entry.meta.files), own[key], startup)
        assert third["vals"] == [want[i]] and _items(tmp_path / f"t{i}") <= held | startup


@rusticl
def test_foreign_or_damaged_files_are_refused(tmp_path: Path) -> None:
    from asyncclcache.entry import Entry
    from asyncclcache.store import Store

    mesa = tmp_path / "m1"
    [entry_val] = _node(tmp_path / "acc", mesa, consts=["6.0"])["vals"]
    [entry] = _entries(tmp_path / "acc")
    import dataclasses

    store = Store(tmp_path / "acc")

    def plant(first: str) -> None:
        bad = dataclasses.replace(entry.meta, files=[first, *entry.meta.files[1:]])
        claim = store.claim(entry.key)
        assert claim is not None
        store.publish(Entry(entry.key, entry.binaries, bad), claim=claim)
        claim.release()

    # A file of another driver's layout (NVIDIA's) is refused by Mesa's at the hit, before
    # anything is written, and rebuilt; the entry is replaced by this build's own.
    plant("0/0/" + "0" * 14)
    warm = _node(tmp_path / "acc", tmp_path / "m2", consts=["6.0"])
    assert warm["hits"] == 0 and warm["rejected"] == 1 and warm["vals"] == [entry_val], warm
    assert not (tmp_path / "m2" / "mesa_shader_cache" / "0").exists()
    # A path that is no plain relative path is a damaged entry: dropped at the lookup.
    plant("../" + "0" * 38)
    from asyncclcache.errors import CorruptEntryWarning

    with pytest.warns(CorruptEntryWarning, match="unsafe kernel-cache path"):
        assert store.lookup(entry.key, None) == (None, None)
    assert not store.path_for(entry.key).exists()
    # A plain name that Mesa's layout lacks is refused by the driver at the hit, before
    # anything is written, and rebuilt (the layout's names are known in its module alone).
    plant("zz/" + "0" * 38)
    warm = _node(tmp_path / "acc", tmp_path / "m5", consts=["6.0"])
    assert (warm["hits"], warm["misses"], warm["rejected"]) == (0, 1, 1) and warm["vals"] == [entry_val], warm
    assert not any(p.name.startswith("zz") for p in (tmp_path / "m5" / "mesa_shader_cache").iterdir())

    # Files writable by others in the driver's cache are never stored.
    shared = tmp_path / "m3"
    (shared / "mesa_shader_cache").mkdir(parents=True)
    os.chmod(shared / "mesa_shader_cache", 0o777)
    mode = os.umask(0)
    try:
        cold = _node(tmp_path / "acc3", shared, consts=["7.0"])
    finally:
        os.umask(mode)
    entries = _entries(tmp_path / "acc3")
    for e in entries:
        for rel in e.meta.files:
            assert not (os.stat(shared / "mesa_shader_cache" / rel).st_mode & 0o002)
    assert cold["vals"]


@rusticl
def test_header_rules_on_rusticl(tmp_path: Path) -> None:
    # pyopencl always passes -I (its own headers); with one, Mesa 22.3 keeps no front end
    # in its cache and Mesa 26.1 sees the header: the header beside the source (the working
    # directory, searched first) is in our key, and a change reaches the new node.
    work = tmp_path / "work"
    (work / "inc").mkdir(parents=True)
    (work / "h.h").write_text("#define VAL 1\n")
    (work / "inc" / "h.h").write_text("#define VAL 9\n")  # shadowed by ./h.h
    inc = ["-I", str(work / "inc")]
    r = _node(tmp_path / "acc", tmp_path / "m1", cwd=work, include=inc)
    assert r["uncacheable"] == 0 and r["writes"] == 1 and r["vals"] == [1.0], r
    (work / "h.h").write_text("#define VAL 2\n")
    r = _node(tmp_path / "acc", tmp_path / "m1", cwd=work, include=inc)  # the same node
    assert r["hits"] == 0 and r["vals"] == [2.0], r
    r = _node(tmp_path / "acc", tmp_path / "m2", cwd=work, include=inc)  # a new node
    assert r["hits"] == 1 and r["vals"] == [2.0], r
    (work / "h.h").write_text("#define VAL 1\n")
    r = _node(tmp_path / "acc", tmp_path / "m3", cwd=work, include=inc)
    assert r["hits"] == 1 and r["vals"] == [1.0], r
    (work / "h.h").unlink()
    r = _node(tmp_path / "acc", tmp_path / "m4", cwd=work, include=inc)
    assert r["hits"] == 0 and r["vals"] == [9.0], r


# }}}
