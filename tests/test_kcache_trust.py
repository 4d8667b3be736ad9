"""Strategy kcache on real machines (issue 18, cases 5-9, 13, 14): pocl's own rules for its
cache directory, file systems with 1-second stamps, a pocl cache shared with other processes
and other users, and exits that do not wait.

Every scenario runs on real pocl; a "new node" is a child with an empty POCL_CACHE_DIR. The
1-second file system is a loop-mounted ext4 made with ``mkfs.ext4 -I 128`` (root only: CI
runs as root); the other user is made with ``useradd`` and removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncclcache import fsclock
from asyncclcache.drivers import Lost, cachefiles, folders, kcache_folders
from asyncclcache.platforms import pocl as pocl_platform
from asyncclcache.store import Store
from conftest import ROOT, child_json, need, run_child

# Builds N programs (kernels k0..k{N-1}, or all named "k" with constants), launches each,
# flushes; reports the stats and each program's value and key.
MANY = r"""
import json, os, sys, time
import numpy as np, pyopencl as cl, asyncclcache as acc
from _pocl import pocl_context
ctx = pocl_context(); q = cl.CommandQueue(ctx)
cache = acc.Cache(sys.argv[1])
n, salt, same_name = int(sys.argv[2]), sys.argv[3], sys.argv[4] == "same"
out = []
for i in range(n):
    name = "k" if same_name else f"k{i}"
    src = f"// {salt}\n__kernel void {name}(__global float *c) {{ c[get_global_id(0)] = {i + 1}.0f; }}"
    prg = acc.Program(ctx, src, cache=cache).build()
    c = np.zeros(4, np.float32); cd = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, c.nbytes)
    getattr(prg, name)(q, c.shape, None, cd); cl.enqueue_copy(q, c, cd); q.finish()
    out.append({"value": float(c[0]), "key": prg.cache_key})
flushed = cache.flush(120)
print(json.dumps({"programs": out, "flushed": flushed, "stats": cache.stats().as_dict(),
                  "drivers": sorted(cache.drivers)}))
"""


def _values_ok(out: dict) -> bool:
    return [p["value"] for p in out["programs"]] == [float(i + 1) for i in range(len(out["programs"]))]


def _bare_env(**changes: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "tests") + os.pathsep + env.get("PYTHONPATH", "")
    for k, v in changes.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def _child(code: str, *args: str, env: dict[str, str], timeout: float = 300) -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True,
                          text=True, env=env, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stderr
    return child_json(proc)


# {{{ pocl's own rules (cases 5, 6)


@pytest.mark.parametrize(
    ("env", "expect"),
    [
        ({"HOME": "/h"}, "/h/.cache/pocl/kcache"),
        ({}, "/tmp/pocl/kcache"),  # HOME unset: pocl's fallback, not the passwd home
        ({"HOME": ""}, "/.cache/pocl/kcache"),  # pocl's snprintf("%s/.cache/%s")
        ({"HOME": "/h", "XDG_CACHE_HOME": ""}, "/h/.cache/pocl/kcache"),
        ({"HOME": "/h", "XDG_CACHE_HOME": "/x"}, "/x/pocl/kcache"),
        ({"HOME": "/h", "POCL_KERNEL_CACHE": "0"}, None),
        ({"POCL_CACHE_DIR": "/p", "POCL_KERNEL_CACHE": "true"}, None),
        ({"POCL_CACHE_DIR": "/p", "POCL_KERNEL_CACHE": "1abc"}, "/p"),
    ],
)
def test_kernel_cache_dir_follows_pocls_code(env, expect):
    got = pocl_platform.kernel_cache_dir(env)
    assert got == (Path(expect) if expect else None)
    assert pocl_platform.cache_topdir({"HOME": "/h", "POCL_KERNEL_CACHE": "no"}) == Path("/h/.cache/pocl/uncached")


def test_home_unset_a_shipped_cache_hits_and_is_kept(cache_dir):
    # Case 5: pocl's cache is /tmp/pocl/kcache without HOME; the library looked in the
    # passwd home, rejected every hit and deleted the entries.
    salt = uuid.uuid4().hex
    first = child_json(run_child(MANY, str(cache_dir), "3", salt, "distinct"))
    assert first["stats"]["writes"] == 3
    env = _bare_env(HOME=None, XDG_CACHE_HOME=None, POCL_CACHE_DIR=None)
    store = Store(cache_dir)
    ours = {f for p in first["programs"] for f in folders.entry_folders(store.load(p["key"]).meta.files)}
    try:
        warm = _child(MANY, str(cache_dir), "3", salt, "distinct", env=env)
        assert _values_ok(warm)
        s = warm["stats"]
        assert (s["hits"], s["misses"], s["rejected"]) == (3, 0, 0)
        assert all(store.load(p["key"]) is not None for p in first["programs"])
        assert all((Path("/tmp/pocl/kcache") / f / "last_accessed").exists() for f in ours)
    finally:
        for f in ours:
            shutil.rmtree(Path("/tmp/pocl/kcache") / f, ignore_errors=True)


@pytest.mark.slow
def test_kernel_cache_true_is_off_as_pocl_reads_it(cache_dir):
    # Case 6: POCL_KERNEL_CACHE=true is off for pocl (only a leading 1 is on): kcache must not
    # be picked, and the kcache entries of other runs are not touched.
    salt = uuid.uuid4().hex
    first = child_json(run_child(MANY, str(cache_dir), "1", salt, "distinct"))
    key = first["programs"][0]["key"]
    out = child_json(run_child(MANY, str(cache_dir), "1", salt, "distinct", env={"POCL_KERNEL_CACHE": "true"}))
    assert out["drivers"] == ["off"] and _values_ok(out)
    assert (out["stats"]["rejected"], out["stats"]["cache_off"]) == (0, 1)
    assert Store(cache_dir).load(key) is not None


def test_pocl_cache_elsewhere_is_a_miss_with_one_warning_and_keeps_the_entry(cache_dir, tmp_path):
    # The cause of an unused restore may be a setting: pocl started with one POCL_CACHE_DIR,
    # and the variable was changed before the first build. Nothing is deleted, and what the
    # restore wrote is taken back.
    salt = uuid.uuid4().hex
    first = child_json(run_child(MANY, str(cache_dir), "2", salt, "distinct"))
    moved_to = tmp_path / "not-pocls"
    code = MANY.replace("cache = acc.Cache(sys.argv[1])",
                        f"os.environ['POCL_CACHE_DIR'] = {str(moved_to)!r}\ncache = acc.Cache(sys.argv[1])")
    proc = run_child(code, str(cache_dir), "2", salt, "distinct", env={"PYTHONWARNINGS": "always"})
    out = child_json(proc)
    assert _values_ok(out)
    s = out["stats"]
    assert (s["hits"], s["misses"], s["rejected"], s["writes"]) == (0, 2, 2, 0)
    assert proc.stderr.count("pocl did not use the stored kernel-cache files") == 1
    assert all(Store(cache_dir).load(p["key"]) is not None for p in first["programs"])
    assert not [p for p in moved_to.rglob("*") if p.is_file()]


# }}}

# {{{ 1-second stamps (case 7)


@contextlib.contextmanager
def _coarse_fs(tmp: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting an ext4 with 1-second stamps needs root (CI runs as root)")
    if shutil.which("mkfs.ext4") is None:
        need("mkfs.ext4", "mkfs.ext4 is missing (apt-get install e2fsprogs; make test installs it as root)")
    image, mnt = tmp / "coarse.img", tmp / "coarse"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", "-I", "128", str(image)], capture_output=True, text=True,
                          check=False)
    if made.returncode != 0:
        pytest.skip(f"mkfs.ext4 -I 128 failed: {made.stderr.strip()}")
    mounted = subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], capture_output=True, text=True,
                             check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot loop-mount here: {mounted.stderr.strip()}")
    try:
        probe = mnt / "probe"
        probe.touch()
        assert probe.stat().st_mtime_ns % 1_000_000_000 == 0, "expected 1-second stamps"
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.slow
def test_one_second_stamps_every_program_is_identified_and_hits(tmp_path):
    with _coarse_fs(tmp_path) as fs:
        acc_dir = fs / "acc"
        salt = uuid.uuid4().hex
        cold = child_json(run_child(MANY, str(acc_dir), "10", salt, "distinct", pocl_cache=fs / "pocl-a"))
        assert _values_ok(cold) and cold["flushed"]
        s = cold["stats"]
        assert (s["misses"], s["writes"], s["unidentified"]) == (10, 10, 0)
        clock = fsclock.FsClock(fs)
        assert clock.measure() and clock.tick >= 1.0
        # A new node, its pocl cache on the same kind of file system.
        warm = child_json(run_child(MANY, str(acc_dir), "10", salt, "distinct", pocl_cache=fs / "pocl-b"))
        assert _values_ok(warm)
        assert (warm["stats"]["hits"], warm["stats"]["rejected"]) == (10, 0)
        # The same node again: pocl has the folders; a touch within the same second is seen.
        again = child_json(run_child(MANY, str(acc_dir), "10", salt, "distinct", pocl_cache=fs / "pocl-b"))
        assert (again["stats"]["hits"], again["stats"]["rejected"]) == (10, 0)
        # Kernels of one name, built within a second or two: the stamps cannot tell the
        # folders apart, a probe build does; each entry is its own program's.
        same = child_json(run_child(MANY, str(acc_dir), "4", salt, "same", pocl_cache=fs / "pocl-c"))
        assert _values_ok(same) and (same["stats"]["writes"], same["stats"]["unidentified"]) == (4, 0)
        new_node = child_json(run_child(MANY, str(acc_dir), "4", salt, "same", pocl_cache=fs / "pocl-d"))
        assert _values_ok(new_node)
        assert (new_node["stats"]["hits"], new_node["stats"]["rejected"]) == (4, 0)


@pytest.mark.slow
def test_header_edited_twice_within_one_second_is_hashed_again(tmp_path):
    # The key's digest memo may only trust a stamp that a later edit must change: on
    # 1-second stamps, an edit of the same size within the same second keeps the stamp.
    from asyncclcache import keys

    with _coarse_fs(tmp_path) as fs:
        h = fs / "h.h"
        for _ in range(20):
            h.write_bytes(b"#define VAL 1\n")
            first = keys._MEMO.digest(str(h))
            st = h.stat()
            h.write_bytes(b"#define VAL 2\n")
            if h.stat().st_mtime_ns == st.st_mtime_ns:
                break  # both edits in one second: the case that matters
        else:
            pytest.skip("could not make two edits within one second")
        assert keys._MEMO.digest(str(h)) != first
        clock = fsclock.clock_for(str(h), h.stat().st_dev)
        assert clock is not None and clock.tick >= 1.0  # measured there, not assumed


def test_header_digests_are_remembered_once_old_enough(tmp_path):
    from asyncclcache import keys

    h = tmp_path / "old.h"
    h.write_bytes(b"#define VAL 1\n")
    time.sleep(0.3)  # older than any stamp a change now could carry (fine clock: ~75 ms)
    assert keys._MEMO.digest(str(h)) is not None
    assert str(h) in keys._MEMO._memo
    h.write_bytes(b"#define VAL 2\n")  # a new stamp: read again
    assert keys._MEMO.digest(str(h)) == keys.hashlib.sha256(b"#define VAL 2\n").hexdigest()


def test_fs_clock_bounds_hold_on_a_fine_file_system(tmp_path):
    clock = fsclock.FsClock(tmp_path)
    assert clock.due()
    assert clock.measure() and not clock.due()
    assert clock.tick == fsclock.FINE_TICK
    t0 = time.time()
    (tmp_path / "f").touch()
    t1 = time.time()
    m = (tmp_path / "f").stat().st_mtime
    assert clock.since(t0) <= m <= clock.until(t1)
    assert not list(tmp_path.glob(".acc-tmp-*"))  # its probe files are gone


def test_fs_clock_unmeasured_assumes_the_worst(tmp_path):
    clock = fsclock.FsClock(tmp_path / "missing")
    assert not clock.measure()
    assert clock.tick == 2.0 and clock.since(100.0) <= 96.0 and clock.until(100.0) >= 102.0


# }}}

# {{{ a shared pocl cache (case 8)


def _folder(root: Path, name: str, stamp: float, kernels: dict[str, float]) -> str:
    rel = f"{name[:2]}/{name}"
    d = root / rel
    d.mkdir(parents=True)
    (d / "program.bc").write_bytes(b"bc")
    (d / "last_accessed").touch()
    os.utime(d / "last_accessed", (stamp, stamp))
    for k, t in kernels.items():
        v = d / k / "16-1-1-goffs0-smallgrid"
        v.mkdir(parents=True)
        (v / f"{k}.so").write_bytes(b"so")
        os.utime(v / f"{k}.so", (t, t))
    return rel


def test_choose_keeps_the_folder_closest_to_the_build_over_anothers_fresh_launch(tmp_path):
    # Case 8 as measured: another process's same-named kernel was touched 188 ms before our
    # build's end and launched since; ours 4 ms before it. Only ours may be stored.
    end = time.time()
    theirs = _folder(tmp_path, "AA" + "T" * 38, end - 0.188, {"k": end + 0.5})
    ours = _folder(tmp_path, "BB" + "O" * 38, end - 0.004, {})
    clock = fsclock.FsClock(tmp_path)
    assert clock.measure()
    found = [(theirs, end - 0.188), (ours, end - 0.004)]
    assert folders.choose(tmp_path, found, ["k"], clock.until(end), clock.tick) == (ours,)
    # Two that cannot be told apart: nothing, never both.
    assert folders.choose(tmp_path, [(theirs, end), (ours, end)], ["k"], clock.until(end), clock.tick) == ()


SHARED = r"""
import json, os, sys, time
import numpy as np, pyopencl as cl, asyncclcache as acc
from _pocl import pocl_context
ctx = pocl_context(); q = cl.CommandQueue(ctx)
cache = acc.Cache(sys.argv[1])
value, salt, start = int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
src = f"// {salt}\n__kernel void k(__global float *c) {{ c[get_global_id(0)] = {value}.0f; }}"
while time.time() < start:
    time.sleep(0.001)
prg = acc.Program(ctx, src, cache=cache).build()
c = np.zeros(4, np.float32); cd = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, c.nbytes)
prg.k(q, c.shape, None, cd); cl.enqueue_copy(q, c, cd); q.finish()
cache.flush(120)
print(json.dumps({"value": float(c[0]), "key": prg.cache_key, "stats": cache.stats().as_dict()}))
"""


@pytest.mark.slow
def test_shared_pocl_cache_same_named_kernels_built_at_once(tmp_path):
    shared = tmp_path / "pocl-shared"
    salt = uuid.uuid4().hex
    env = _bare_env(POCL_CACHE_DIR=str(shared))
    for rnd in range(3):
        start = time.time() + 3.0
        procs = [subprocess.Popen([sys.executable, "-c", SHARED, str(tmp_path / f"acc{v}"), str(v),
                                   f"{salt}-{rnd}", str(start)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                 for v in (1, 2)]
        outs = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=300)
            assert p.returncode == 0, stderr
            outs.append(json.loads(stdout.splitlines()[-1]))
        for v, out in zip((1, 2), outs, strict=True):
            assert out["value"] == v
            entry = Store(tmp_path / f"acc{v}").load(out["key"])
            # Told apart (a probe build where the stamps could not), never mixed up.
            assert entry is not None and out["stats"]["unidentified"] == 0, out["stats"]
            assert len(folders.entry_folders(entry.meta.files)) == 1  # never more than its own
            # A new node hits it and gets its own value: the stored folder is this program's.
            warm = child_json(run_child(SHARED, str(tmp_path / f"acc{v}"), str(v), f"{salt}-{rnd}", "0"))
            assert warm["value"] == v and (warm["stats"]["hits"], warm["stats"]["rejected"]) == (1, 0)


# }}}

# {{{ another user's files (case 9)


@pytest.fixture
def other_user() -> Iterator[pwd.struct_passwd]:
    if os.geteuid() != 0:
        pytest.skip("making another user needs root (CI runs as root)")
    name = f"acct{uuid.uuid4().hex[:8]}"
    made = subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                          capture_output=True, text=True, check=False)
    if made.returncode != 0:
        pytest.skip(f"useradd failed: {made.stderr.strip()}")
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], capture_output=True, check=False)


PLANT = r"""
import os, sys, time
root, uid, gid, name, until = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
os.setgid(gid); os.setuid(uid)
folder = os.path.join(root, name[:2], name)
os.makedirs(os.path.join(folder, "k", "16-1-1-goffs0-smallgrid"), exist_ok=True)
open(os.path.join(folder, "program.bc"), "wb").write(b"planted")
open(os.path.join(folder, "k", "16-1-1-goffs0-smallgrid", "k.so"), "wb").write(b"planted")
print("ready", flush=True)
so = os.path.join(folder, "k", "16-1-1-goffs0-smallgrid", "k.so")
while time.time() < until:  # looks like a build and a launch, all the time
    open(os.path.join(folder, "last_accessed"), "w").close()
    os.utime(so)
    os.utime(folder)
    os.utime(os.path.dirname(folder))  # as if a new folder had appeared
    time.sleep(0.002)
"""


@pytest.mark.slow
def test_another_users_planted_folder_is_never_stored(tmp_path, other_user):
    # Case 9: in a POCL_CACHE_DIR of mode 1777 another user keeps touching a planted folder
    # with kernels of the names we build. Not one of his files may go into an entry.
    top = Path(tempfile.mkdtemp(prefix="acc-shared-"))  # the other user must reach it
    os.chmod(top, 0o755)
    root = top / "pocl-1777"
    root.mkdir()
    os.chmod(root, 0o1777)
    planter = subprocess.Popen(
        [sys.executable, "-c", PLANT, str(root), str(other_user.pw_uid), str(other_user.pw_gid),
         "ZZ" + "P" * 38, str(time.time() + 60)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert planter.stdout is not None and planter.stdout.readline().strip() == "ready"
        salt = uuid.uuid4().hex
        out = child_json(run_child(MANY, str(tmp_path / "acc"), "3", salt, "same", pocl_cache=root))
    finally:
        planter.kill()
        planter.wait()
        shutil.rmtree(top, ignore_errors=True)
    assert _values_ok(out)
    assert out["stats"]["writes"] == 3, out["stats"]  # ours are still found
    store = Store(tmp_path / "acc")
    for p in out["programs"]:
        entry = store.load(p["key"])
        assert not any(f.startswith("ZZ/") for f in entry.meta.files)
        assert b"planted" not in entry.binaries


def test_snapshot_refuses_files_of_others_and_bounds_what_it_reads(tmp_path):
    end = time.time()
    rel = _folder(tmp_path, "AB" + "C" * 38, end, {"k": end})
    snap = folders.folder_files(tmp_path, [rel])
    assert sorted(snap.files or []) == [f"{rel}/k/16-1-1-goffs0-smallgrid/k.so", f"{rel}/program.bc"]
    so = tmp_path / rel / "k" / "16-1-1-goffs0-smallgrid" / "k.so"
    os.chmod(so, 0o666)  # writable by anyone: anyone's code
    with pytest.raises(Lost, match="refused"):
        folders.folder_files(tmp_path, [rel])
    os.chmod(so, 0o644)
    with open(tmp_path / rel / "huge.bin", "wb") as f:  # a sparse file far over the bound
        f.truncate(cachefiles.MAX_FILE_BYTES + 1)
    t0 = time.perf_counter()
    with pytest.raises(Lost, match="too large"):
        folders.folder_files(tmp_path, [rel])
    assert time.perf_counter() - t0 < 1.0  # refused by its size, not read
    (tmp_path / rel / "huge.bin").unlink()
    (tmp_path / rel / "program.bc").unlink()
    os.link(so, tmp_path / rel / "program.bc")  # a hard link: made by whoever could write
    with pytest.raises(Lost, match="hard links"):
        folders.folder_files(tmp_path, [rel])


def test_snapshot_and_restore_refuse_another_users_folder(tmp_path, other_user):
    end = time.time()
    rel = _folder(tmp_path, "AB" + "C" * 38, end, {"k": end})
    for p in [tmp_path / rel, *(tmp_path / rel).rglob("*")]:
        os.chown(p, other_user.pw_uid, other_user.pw_gid, follow_symlinks=False)
    with pytest.raises(Lost, match="owned by uid"):
        folders.folder_files(tmp_path, [rel])
    with pytest.raises(OSError, match="owned by uid"):
        cachefiles.restore(tmp_path, [f"{rel}/k/32-1-1/k.so"], [b"ours"], folders.valid_file)
    assert not (tmp_path / rel / "k" / "32-1-1").exists()


def test_an_unused_restore_is_taken_back(tmp_path):
    rel = "AB/" + "C" * 38
    placed = cachefiles.restore(tmp_path, [f"{rel}/program.bc", f"{rel}/k/v/k.so"], [b"bc", b"so"], folders.valid_file)
    assert placed.count == 2
    (tmp_path / "AB" / "pocls").mkdir()  # pocl's own, meanwhile
    cachefiles.unrestore(tmp_path, placed)
    assert not (tmp_path / rel).exists() and (tmp_path / "AB" / "pocls").exists()


def test_a_hit_check_needs_no_clock(tmp_path):
    rel = _folder(tmp_path, "AB" + "C" * 38, time.time(), {})
    before = folders.mark(tmp_path, rel)
    assert not folders.moved(tmp_path, rel, before)
    open(tmp_path / rel / "last_accessed", "w").close()  # what pocl does, within the same second
    assert folders.moved(tmp_path, rel, before)
    (tmp_path / rel / "last_accessed").unlink()
    assert not folders.moved(tmp_path, rel, None)
    (tmp_path / rel / "last_accessed").touch()
    assert folders.moved(tmp_path, rel, None)  # a new node: pocl made it


# }}}

# {{{ exit, names, warnings (cases 13, 14; pocl's JIT)


EXIT = r"""
import sys, time
import pyopencl as cl, asyncclcache as acc
from kernels import small_source, run_twice
from _pocl import pocl_context
ctx = pocl_context()
src = small_source(salt=sys.argv[2])
assert run_twice(ctx, cl.Program(ctx, src).build())  # pocl has it; our cache does not
cache = acc.Cache(sys.argv[1])
prg = acc.Program(ctx, src, cache=cache).build()
assert run_twice(ctx, prg)
print(time.time(), flush=True)
"""


def test_exit_does_not_wait_out_the_settle_time(cache_dir, tmp_path):
    # Case 13: with the program already in pocl's cache and ours empty, the exit waited
    # for the snapshot's settle time (3 s) in 3 of 6 runs (pocl 7.1).
    pocl = tmp_path / "pocl"
    for i in range(3):
        proc = run_child(EXIT, str(cache_dir), f"exit-{uuid.uuid4().hex}-{i}", pocl_cache=pocl,
                         env={"ASYNCCLCACHE_STATS": "1", "PYTHONWARNINGS": "error::ResourceWarning"})
        waited = time.time() - float(proc.stdout.split()[-1])
        assert waited < kcache_folders.SETTLE_SECONDS - 1.0, f"exit waited {waited:.2f} s"
        assert "1 writes" in proc.stderr, proc.stderr
        assert "ResourceWarning" not in proc.stderr


def test_variants_are_seen_whatever_pocl_names_the_compiled_file(tmp_path):
    # pocl's JIT (7.2) writes <kernel>.so.o; nothing may assume <kernel>.so.
    now = time.time()
    rel = f"AB/{'C' * 38}"
    v = tmp_path / rel / "k" / "64-1-1-goffs0-smallgrid"
    v.mkdir(parents=True)
    (tmp_path / rel / "program.bc").write_bytes(b"bc")
    (v / "parallel.bc").write_bytes(b"bc")  # written first (pocl 7.1): not compiled yet
    assert not folders.ready(tmp_path, [rel], ["k"], now - 1)
    (v / "k.so.o").write_bytes(b"o")
    assert folders.ready(tmp_path, [rel], ["k"], now - 1)
    assert not folders.ready(tmp_path, [rel], ["k"], now + 10)
    assert folders.valid_file(f"{rel}/k/64-1-1-goffs0-smallgrid/k.so.o")
    snap = folders.folder_files(tmp_path, [rel])
    assert f"{rel}/k/64-1-1-goffs0-smallgrid/k.so.o" in (snap.files or [])


# }}}
