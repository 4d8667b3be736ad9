"""The on-disk store: real round trips, concurrent writers, killed writers, damage, bad places.

Everything here is real: pocl builds the programs, the children are separate
processes with their own pocl cache, a writer is killed with SIGKILL, read-only
and full file systems are real tmpfs mounts (where this machine lets us mount),
and another user is a real uid (where we may switch to it).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import filelock
import pytest

import asyncclcache as acc
from asyncclcache.entry import Entry, encode
from asyncclcache.errors import (
    AsyncCLCacheWarning,
    CacheDirWarning,
    CorruptEntryWarning,
    InsecureCacheWarning,
)
from asyncclcache.keys import FORMAT_VERSION, make_key
from asyncclcache.ranks import RANK_ENV_VARS
from asyncclcache.store import (
    ENTRY_SUFFIX,
    LOCK_SUFFIX,
    TEMP_MAX_AGE,
    TEMP_PREFIX,
    TEMP_SUFFIX,
    PublishResult,
    Store,
)
from conftest import ROOT, child_json, run_child, run_in_threads, run_twice, small_source

IDENT = ({"platform_name": "test platform", "device_name": "test device", "driver_version": "1"},)
NOBODY = 65534


@pytest.fixture(autouse=True)
def _not_under_mpi(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layout below assumes no rank, unless a test sets one (children inherit this)."""
    for var in RANK_ENV_VARS:
        monkeypatch.delenv(var, raising=False)


def key_of(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def make_entry(key: str, payload: bytes = b"binary", devices: Any = IDENT, **meta: Any) -> Entry:
    return Entry(key, tuple(payload for _ in devices), {"devices": list(devices), **meta})


def files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if not p.is_dir())


def leftovers(path: Path) -> list[Path]:
    """Temp and lock files anywhere below ``path``."""
    return [
        p
        for p in files_under(path)
        if p.name.endswith((LOCK_SUFFIX, TEMP_SUFFIX)) or p.name.startswith(TEMP_PREFIX)
    ]


def lib_warnings(record: Any) -> list[Any]:
    return [w for w in record if issubclass(w.category, AsyncCLCacheWarning)]


@pytest.fixture
def store(cache_dir: Path) -> Store:
    s = Store(cache_dir)
    assert s.enabled, s.problem
    return s


# {{{ layout and round trips


def test_layout(store: Store, cache_dir: Path) -> None:
    key = key_of("layout")
    assert store.root == cache_dir / f"v{FORMAT_VERSION}"
    assert store.rank is None
    assert not store.rank_local
    assert store.path_for(key) == store.root / key[:2] / f"{key}{ENTRY_SUFFIX}"
    assert store.load(key) is None
    assert store.publish(make_entry(key)) is PublishResult.WRITTEN
    assert store.path_for(key).is_file()
    listed = list(store.entries())
    assert [e.key for e in listed] == [key]
    assert listed[0].path == store.path_for(key)
    assert listed[0].size == store.path_for(key).stat().st_size
    assert files_under(cache_dir) == [store.path_for(key)]


def test_round_trip_in_process(store: Store) -> None:
    key = key_of("rt")
    entry = make_entry(key, b"\x00\x01binary\xff" * 100, created=1.5, build_logs=["x"])
    assert store.publish(entry) is PublishResult.WRITTEN
    back = store.load(key, IDENT)
    assert back is not None
    assert back.binaries == entry.binaries
    assert back.meta["created"] == 1.5
    assert back.meta["build_logs"] == ["x"]
    # Without devices to compare, the entry is returned too.
    assert store.load(key) == back
    # A second store on the same directory (another process, later) sees it.
    assert Store(store.base).load(key, IDENT) == back


def test_publish_replaces(store: Store) -> None:
    key = key_of("replace")
    assert store.publish(make_entry(key, b"old")) is PublishResult.WRITTEN
    assert store.publish(make_entry(key, b"new")) is PublishResult.WRITTEN
    assert store.load(key, IDENT).binaries == (b"new",)
    assert len(list(store.entries())) == 1


def test_remove(store: Store) -> None:
    key = key_of("remove")
    store.publish(make_entry(key))
    assert store.remove(key)
    assert store.load(key) is None
    assert not store.remove(key)


CHILD_RUN = """
    import json, sys, warnings
    import pyopencl as cl
    from asyncclcache.errors import AsyncCLCacheWarning
    from asyncclcache.keys import device_identity, make_key
    from asyncclcache.store import Store
    from kernels import run_twice

    warnings.simplefilter("error", AsyncCLCacheWarning)
    directory, key, source = sys.argv[1:4]
    plat = next(p for p in cl.get_platforms() if p.name == "Portable Computing Language")
    devs = plat.get_devices()[:1]
    ctx = cl.Context(devs)
    ids = [device_identity(d) for d in devs]
    entry = Store(directory).load(key, ids)
    out = {"loaded": entry is not None,
           "same_key": make_key(source.encode(), b"", devs, []).key == key}
    if entry is not None:
        # Only the stored binaries: the child never builds the source.
        prg = cl._cl._Program(ctx, devs, list(entry.binaries))
        prg.build(b"", devs)
        out["binary_type"] = int(prg.get_build_info(devs[0], cl.program_build_info.BINARY_TYPE))
        out["correct"] = run_twice(ctx, prg)
    print(json.dumps(out))
"""


def test_real_program_round_trip_in_a_new_process(cl_ctx: Any, cache_dir: Path) -> None:
    import pyopencl as cl

    from asyncclcache.binaries import program_binaries

    source = small_source("twice")
    devs = list(cl_ctx.devices)
    prg = cl._cl._Program(cl_ctx, source)
    prg.build(b"", devs)
    binaries = program_binaries(prg, devs)
    assert binaries
    assert all(isinstance(b, bytes) and b for b in binaries)
    info = make_key(source.encode(), b"", devs, [])
    entry = Entry(info.key, tuple(binaries), {"devices": list(info.devices), "options": ""})
    store = Store(cache_dir)
    assert store.publish(entry) is PublishResult.WRITTEN
    assert store.load(info.key, info.devices).binaries == tuple(binaries)

    out = child_json(run_child(CHILD_RUN, str(cache_dir), info.key, source))
    assert out["loaded"]
    assert out["same_key"]
    assert out["correct"]
    assert out["binary_type"] == int(cl.program_binary_type.EXECUTABLE)


def test_round_trip_control_wrong_key_is_a_miss(cache_dir: Path) -> None:
    """The child above can fail: asked for a key that is not there, it loads nothing."""
    Store(cache_dir).publish(make_entry(key_of("present")))
    out = child_json(run_child(CHILD_RUN, str(cache_dir), key_of("absent"), small_source()))
    assert out == {"loaded": False, "same_key": False}


# }}}

# {{{ concurrent writers

CHILD_WRITER = """
    import hashlib, json, sys, warnings
    from asyncclcache.entry import Entry
    from asyncclcache.errors import AsyncCLCacheWarning
    from asyncclcache.store import Store

    warnings.simplefilter("error", AsyncCLCacheWarning)
    directory = sys.argv[1]
    writer, nkeys, rounds = (int(a) for a in sys.argv[2:5])
    ids = [{"device_name": "test device"}]
    keys = [hashlib.sha256(b"concurrent %d" % i).hexdigest() for i in range(nkeys)]

    def payload(w, i):
        return (b"writer %d key %d;" % (w, i)) * 3000

    store = Store(directory)
    print("ready", flush=True)
    assert sys.stdin.readline() == "go\\n"  # the start barrier
    results, seen = [], 0
    for _ in range(rounds):
        for i, key in enumerate(keys):
            entry = Entry(key, (payload(writer, i),), {"devices": ids, "writer": writer})
            results.append(store.publish(entry).value)
            # Read while the others write: nothing or a complete entry, never a warning.
            j = (i + 1 + writer) % nkeys
            got = store.load(keys[j], ids)
            if got is not None:
                assert got.key == keys[j]
                assert got.binaries == (payload(got.meta["writer"], j),), "mixed entry"
                seen += 1
    print(json.dumps({"results": results, "seen": seen}))
"""


def test_eight_processes_publish_the_same_keys(cache_dir: Path) -> None:
    nproc, nkeys, rounds = 8, 12, 2
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "tests") + os.pathsep + env.get("PYTHONPATH", "")
    code = textwrap.dedent(CHILD_WRITER)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(cache_dir), str(w), str(nkeys), str(rounds)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for w in range(nproc)
    ]
    try:
        for p in procs:
            line = p.stdout.readline()
            assert line == "ready\n", p.stderr.read()
        for p in procs:  # all are waiting on stdin now: release them together
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=120)
            assert p.returncode == 0, stderr
            assert "Traceback" not in stderr, stderr
            assert "Warning" not in stderr, stderr
            outs.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    results = [r for o in outs for r in o["results"]]
    assert len(results) == nproc * nkeys * rounds
    assert set(results) <= {PublishResult.WRITTEN.value, PublishResult.SKIPPED.value}
    assert PublishResult.WRITTEN.value in results
    assert PublishResult.SKIPPED.value in results  # they did collide, and the lock said so

    store = Store(cache_dir)
    ids = [{"device_name": "test device"}]
    keys = [hashlib.sha256(b"concurrent %d" % i).hexdigest() for i in range(nkeys)]
    assert sorted(e.key for e in store.entries()) == sorted(keys)  # none lost
    for i, key in enumerate(keys):
        entry = store.load(key, ids)  # no warning: warnings are errors here
        assert entry is not None
        w = entry.meta["writer"]
        assert 0 <= w < nproc
        assert entry.binaries == ((b"writer %d key %d;" % (w, i)) * 3000,)
    assert leftovers(cache_dir) == []
    assert store.orphans() == ([], [])


def test_threads_publish_the_same_keys(store: Store, cache_dir: Path) -> None:
    keys = [key_of(f"threads {i}") for i in range(10)]
    results: list[PublishResult] = []

    def work(t: int) -> None:
        for k in keys:
            result = store.publish(make_entry(k, b"thread %d" % t))
            results.append(result)
            got = store.load(k, IDENT)  # a skip may come before the other's write ends
            assert got is not None or result is PublishResult.SKIPPED
            assert got is None or got.binaries[0].startswith(b"thread ")

    assert run_in_threads(8, work) == []
    assert set(results) <= {PublishResult.WRITTEN, PublishResult.SKIPPED}
    assert len(results) == 80
    assert sorted(e.key for e in store.entries()) == sorted(keys)
    assert leftovers(cache_dir) == []


# }}}

# {{{ locks, killed writers, sweep

CHILD_KILLED = """
    import signal, sys
    from asyncclcache.entry import Entry, encode
    from asyncclcache.store import Store

    directory, key = sys.argv[1:3]
    entry = Entry(key, (b"killed writer " * 5000,), {"devices": [{"device_name": "test device"}]})
    data = encode(entry)

    def hook(tmp):
        with open(tmp, "r+b") as f:  # half of the entry, as a write cut short leaves it
            f.write(data[: len(data) // 2])
        print(tmp, flush=True)  # tell the parent, then wait to be killed
        while True:
            signal.pause()

    Store(directory).publish(entry, write_hook=hook)
    print("not killed", flush=True)
"""


@pytest.fixture
def killed_writer(cache_dir: Path) -> tuple[str, Path]:
    """A writer SIGKILLed in the middle of writing ``key``; returns (key, its temp file)."""
    key = key_of("killed")
    env = dict(os.environ)
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(CHILD_KILLED), str(cache_dir), key],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline().strip()
        assert line, proc.stderr.read()
        tmp = Path(line)
        assert tmp.exists()
        proc.send_signal(signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()  # reaped: its pid is gone, not a zombie
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    return key, tmp


def test_killed_writer_leaves_no_visible_entry(killed_writer: tuple[str, Path]) -> None:
    key, tmp = killed_writer
    store = Store(tmp.parent.parent.parent)
    assert store.root == tmp.parent.parent
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert store.load(key) is None
        assert list(store.entries()) == []
    assert record == []
    assert tmp.exists()
    assert tmp.name.startswith(TEMP_PREFIX)
    assert tmp.name.endswith(TEMP_SUFFIX)
    from asyncclcache.store import _HOST

    assert tmp.name.startswith(f"{TEMP_PREFIX}{_HOST}-")  # the host's digest, then the pid
    assert 0 < tmp.stat().st_size < len(encode(make_entry(key, b"killed writer " * 5000)))
    lock = tmp.parent / f"{key}{LOCK_SUFFIX}"
    assert lock.exists()  # the killed writer could not clean up its lock file
    temps, locks = store.orphans()
    assert temps == [tmp]
    assert locks == [lock]
    assert store.sweep() == 2
    assert not tmp.exists()
    assert not lock.exists()
    assert store.orphans() == ([], [])
    assert store.sweep() == 0


def test_lock_of_killed_writer_does_not_block(killed_writer: tuple[str, Path]) -> None:
    key, tmp = killed_writer
    store = Store(tmp.parent.parent.parent)
    lock = tmp.parent / f"{key}{LOCK_SUFFIX}"
    assert lock.exists()
    entry = make_entry(key, b"after the kill")
    assert store.publish(entry) is PublishResult.WRITTEN  # flock died with the writer
    assert store.load(key, IDENT).binaries == (b"after the kill",)
    assert not lock.exists()  # the next writer removed it
    assert tmp.exists()  # only sweep removes another writer's temp file
    assert store.orphans() == ([tmp], [])
    assert store.sweep() == 1
    assert leftovers(store.base) == []
    assert store.load(key, IDENT).binaries == (b"after the kill",)  # sweep kept the entry


def test_sweep_running_alongside_never_makes_a_claim_skip(store: Store) -> None:
    """A sweep takes each unheld lock file for a moment to probe it; a claim made at
    that moment must still succeed (it used to skip, and the entry was not written)."""
    stop = threading.Event()
    sweeps = []

    def sweeper() -> None:
        while not stop.is_set():
            sweeps.append(store.sweep())

    t = threading.Thread(target=sweeper)
    t.start()
    skipped = 0
    try:
        for i in range(2000):
            claim = store.claim(key_of(f"sweep race {i % 16}"))
            if claim is None:
                skipped += 1
            else:
                claim.release()
    finally:
        stop.set()
        t.join()
    assert len(sweeps) > 10  # the sweep really ran alongside
    assert skipped == 0
    assert store.orphans() == ([], [])


def test_held_lock_means_skip(store: Store, cache_dir: Path) -> None:
    key = key_of("held")
    fanout = store.path_for(key).parent
    fanout.mkdir(mode=0o700)
    lock_path = fanout / f"{key}{LOCK_SUFFIX}"
    other = filelock.FileLock(str(lock_path), timeout=0)  # another writer
    other.acquire()
    try:
        assert store.publish(make_entry(key)) is PublishResult.SKIPPED
        assert store.load(key) is None
        assert store.orphans() == ([], [])  # a held lock is no orphan
        assert store.sweep() == 0
        assert lock_path.exists()
    finally:
        other.release()
    assert store.publish(make_entry(key)) is PublishResult.WRITTEN
    assert not lock_path.exists()


def test_claim_holds_the_key_across_publish(store: Store) -> None:
    """The per-key claim: one holder, others skip, publish under it keeps it held."""
    key = key_of("claim")
    claim = store.claim(key)
    assert claim is not None
    lock_path = store.path_for(key).parent / f"{key}{LOCK_SUFFIX}"
    try:
        assert lock_path.exists()
        assert stat.S_IMODE(lock_path.stat().st_mode) == 0o600
        assert store.claim(key) is None  # held
        assert store.publish(make_entry(key, b"other")) is PublishResult.SKIPPED
        assert store.publish(make_entry(key, b"mine"), claim=claim) is PublishResult.WRITTEN
        assert store.claim(key) is None  # still held after the write
        assert store.orphans() == ([], [])
    finally:
        claim.release()
    claim.release()  # idempotent
    assert not lock_path.exists()
    assert store.load(key, IDENT).binaries == (b"mine",)
    again = store.claim(key)
    assert again is not None
    again.release()


def test_lock_files_do_not_pile_up(store: Store, cache_dir: Path) -> None:
    keys = [key_of(f"pile {i}") for i in range(30)]
    for k in keys:
        assert store.publish(make_entry(k)) is PublishResult.WRITTEN
        assert store.publish(make_entry(k, b"again")) is PublishResult.WRITTEN
    names = [p.name for p in files_under(cache_dir)]
    assert sorted(names) == sorted(f"{k}{ENTRY_SUFFIX}" for k in keys)


def test_failing_write_leaves_nothing(store: Store, cache_dir: Path) -> None:
    key = key_of("hook raises")
    seen: list[str] = []

    def hook(tmp: str) -> None:
        seen.append(tmp)
        raise OSError(errno.EIO, "simulated I/O error")

    with pytest.raises(OSError, match="simulated"):
        store.publish(make_entry(key), write_hook=hook)
    assert seen
    assert not os.path.exists(seen[0])
    assert store.load(key) is None
    assert leftovers(cache_dir) == []
    # The temp file's descriptor was closed too.
    assert not [t for t in _open_files() if t.startswith(seen[0])]
    assert store.publish(make_entry(key)) is PublishResult.WRITTEN


def _open_files() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile (the listing's own fd)
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
    return out


def test_orphan_rules_for_temp_files(store: Store) -> None:
    key = key_of("temps")
    store.publish(make_entry(key))
    fanout = store.path_for(key).parent
    mine = fanout / f"{TEMP_PREFIX}{os.getpid()}-abc{TEMP_SUFFIX}"  # a live writer's
    mine.write_bytes(b"x")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    gone = fanout / f"{TEMP_PREFIX}{int(dead.stdout)}-abc{TEMP_SUFFIX}"
    gone.write_bytes(b"x")
    old = fanout / f"{TEMP_PREFIX}{os.getpid()}-old{TEMP_SUFFIX}"
    old.write_bytes(b"x")
    t = old.stat().st_mtime - TEMP_MAX_AGE - 60
    os.utime(old, (t, t))
    from asyncclcache.store import _HOST

    # Issue 12: another host's write in progress on a shared directory, with a PID that is
    # dead here: it must not be swept (only once it is old).
    other_host = "0f0f0f0f" if _HOST != "0f0f0f0f" else "1e1e1e1e"
    remote = fanout / f"{TEMP_PREFIX}{other_host}-{int(dead.stdout)}-abc{TEMP_SUFFIX}"
    remote.write_bytes(b"x")
    local_dead = fanout / f"{TEMP_PREFIX}{_HOST}-{int(dead.stdout)}-abc{TEMP_SUFFIX}"
    local_dead.write_bytes(b"x")
    unrelated = fanout / "notes.txt"
    unrelated.write_bytes(b"x")
    temps, locks = store.orphans()
    assert sorted(temps) == sorted([gone, old, local_dead])
    assert remote not in temps
    assert locks == []
    assert store.sweep() == 3
    assert mine.exists() and remote.exists()
    assert unrelated.exists()
    assert store.path_for(key).exists()


# }}}

# {{{ damaged entries


def _write_over(path: Path, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.truncate(0)
        f.write(data)


def _damage_truncate(store: Store, key: str, path: Path) -> None:
    data = path.read_bytes()
    _write_over(path, data[: len(data) // 2])


def _damage_flip(store: Store, key: str, path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    _write_over(path, bytes(data))


def _damage_magic(store: Store, key: str, path: Path) -> None:
    data = path.read_bytes()
    _write_over(path, b"NOTCACHE" + data[8:])


def _damage_empty(store: Store, key: str, path: Path) -> None:
    _write_over(path, b"")


def _damage_foreign_device(store: Store, key: str, path: Path) -> None:
    other = [dict(IDENT[0], device_name="some other device")]
    _write_over(path, encode(make_entry(key, b"valid, elsewhere", other)))


def _damage_other_key(store: Store, key: str, path: Path) -> None:
    _write_over(path, encode(make_entry(key_of("another key"))))


def _damage_binary_count(store: Store, key: str, path: Path) -> None:
    _write_over(path, encode(Entry(key, (b"a", b"b"), {"devices": list(IDENT)})))


def _damage_directory(store: Store, key: str, path: Path) -> None:
    path.unlink()
    path.mkdir()
    (path / "inside").write_bytes(b"x")


DAMAGE: dict[str, Callable[[Store, str, Path], None]] = {
    "truncated": _damage_truncate,
    "flipped-byte": _damage_flip,
    "wrong-magic": _damage_magic,
    "empty": _damage_empty,
    "foreign-device": _damage_foreign_device,
    "other-key": _damage_other_key,
    "binary-count": _damage_binary_count,
    "directory": _damage_directory,
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_damaged_entry_is_a_miss_and_removed(store: Store, kind: str) -> None:
    key = key_of(f"damage {kind}")
    assert store.publish(make_entry(key)) is PublishResult.WRITTEN
    path = store.path_for(key)
    DAMAGE[kind](store, key, path)
    with pytest.warns(CorruptEntryWarning) as record:
        assert store.load(key, IDENT) is None
    assert len(lib_warnings(record)) == 1
    assert str(path) in str(record[0].message)
    assert not os.path.lexists(path)
    assert store.load(key, IDENT) is None  # a clean miss now: no second warning
    # Rebuilt and rewritten, it is a hit again.
    assert store.publish(make_entry(key, b"rebuilt")) is PublishResult.WRITTEN
    assert store.load(key, IDENT).binaries == (b"rebuilt",)


def test_fifo_in_place_of_an_entry_does_not_block(store: Store) -> None:
    key = key_of("fifo")
    path = store.path_for(key)
    path.parent.mkdir(mode=0o700)
    os.mkfifo(path, 0o600)
    result: list[Any] = []

    def load() -> None:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            result.append((store.load(key, IDENT), [w.category for w in record]))

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(20)
    if t.is_alive():  # unblock the reader, then fail
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(5)
        pytest.fail("Store.load blocked on a FIFO")
    assert result == [(None, [CorruptEntryWarning])]
    assert not os.path.lexists(path)


def test_symlink_in_place_of_an_entry(store: Store, tmp_path: Path) -> None:
    key = key_of("symlink")
    target = tmp_path / "elsewhere.acl"
    good = encode(make_entry(key, b"planted"))  # even a valid entry is not followed
    target.write_bytes(good)
    target.chmod(0o600)
    path = store.path_for(key)
    path.parent.mkdir(mode=0o700)
    path.symlink_to(target)
    with pytest.warns(InsecureCacheWarning) as record:
        assert store.load(key, IDENT) is None
    assert len(lib_warnings(record)) == 1
    assert target.read_bytes() == good  # the link's target is untouched
    # The next write replaces the link itself, never writing through it.
    assert store.publish(make_entry(key, b"ours")) is PublishResult.WRITTEN
    assert not path.is_symlink()
    assert path.is_file()
    assert target.read_bytes() == good
    assert store.load(key, IDENT).binaries == (b"ours",)


def test_entry_writable_by_others_is_refused_not_deleted(store: Store) -> None:
    key = key_of("mode")
    store.publish(make_entry(key))
    path = store.path_for(key)
    data = path.read_bytes()
    path.chmod(0o666)
    with pytest.warns(InsecureCacheWarning) as record:
        assert store.load(key, IDENT) is None
    assert len(lib_warnings(record)) == 1
    assert path.read_bytes() == data


def _need_root_for_chown() -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root (CAP_CHOWN)")


def test_entry_owned_by_another_user_is_refused_not_deleted(store: Store) -> None:
    _need_root_for_chown()
    key = key_of("owner")
    store.publish(make_entry(key))
    path = store.path_for(key)
    os.chown(path, NOBODY, NOBODY)
    with pytest.warns(InsecureCacheWarning, match=f"uid {NOBODY}") as record:
        assert store.load(key, IDENT) is None
    assert len(lib_warnings(record)) == 1
    assert path.exists()


# }}}

# {{{ unusable locations


def _assert_disabled(store: Store) -> None:
    assert not store.enabled
    assert store.problem
    key = key_of("disabled")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert store.load(key) is None
        assert store.publish(make_entry(key)) is PublishResult.DISABLED
        assert list(store.entries()) == []
        assert store.orphans() == ([], [])
        assert store.sweep() == 0
    assert record == []  # warned once, at open


def test_directory_is_a_regular_file(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_bytes(b"not a directory")
    with pytest.warns(CacheDirWarning, match="caching is off") as record:
        store = Store(f)
    assert len(lib_warnings(record)) == 1
    _assert_disabled(store)
    assert f.read_bytes() == b"not a directory"


def test_directory_under_a_regular_file(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_bytes(b"not a directory")
    with pytest.warns(CacheDirWarning) as record:
        store = Store(f / "sub" / "cache")
    assert len(lib_warnings(record)) == 1
    _assert_disabled(store)
    assert f.read_bytes() == b"not a directory"


def test_missing_parents_are_created(tmp_path: Path) -> None:
    """Like a fresh account's ~/.cache: the parents do not exist yet."""
    base = tmp_path / "home" / ".cache" / "asyncclcache"
    store = Store(base)
    assert store.enabled, store.problem
    assert stat.S_IMODE(base.stat().st_mode) == 0o700
    assert store.publish(make_entry(key_of("fresh"))) is PublishResult.WRITTEN


def test_uncached_build_still_works_in_a_bad_directory(
    cl_ctx: Any, tmp_path: Path
) -> None:
    f = tmp_path / "file"
    f.write_bytes(b"not a directory")
    with pytest.warns(CacheDirWarning):
        cache = acc.Cache(directory=f / "cache")
    try:
        prg = cache.program(cl_ctx, small_source("twice")).build()
        assert run_twice(cl_ctx, prg)
        assert cache.flush(30)
        stats = cache.stats()
        assert (stats.writes, stats.hits, stats.pending) == (0, 0, 0)
    finally:
        cache.close()
    assert f.read_bytes() == b"not a directory"


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """Mount a small tmpfs (read-only or tiny); skipped where mounting is not allowed."""
    mounted: list[Path] = []
    mount = shutil.which("mount")

    def make(options: str) -> Path:
        path = tmp_path / f"mnt{len(mounted)}"
        path.mkdir()
        if mount is None:
            pytest.skip("no mount command to make a read-only or full file system")
        r = subprocess.run(
            [mount, "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
            capture_output=True,
            text=True,
            check=False,
        )
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs CAP_SYS_ADMIN): {r.stderr.strip()}")
        mounted.append(path)
        return path

    yield make
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], check=False)


def _remount_ro(path: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)


def test_read_only_file_system(tmpfs: Callable[[str], Path]) -> None:
    mnt = tmpfs("ro,mode=0700,size=1m")
    with pytest.warns(CacheDirWarning, match="Read-only") as record:
        store = Store(mnt)
    assert len(lib_warnings(record)) == 1
    _assert_disabled(store)
    assert os.listdir(mnt) == []


def test_populated_cache_made_read_only(tmpfs: Callable[[str], Path]) -> None:
    mnt = tmpfs("mode=0700,size=1m")
    Store(mnt).publish(make_entry(key_of("ro")))
    _remount_ro(mnt)
    with pytest.warns(CacheDirWarning, match="read-only: reading its entries, writing none") as record:
        store = Store(mnt)
    assert len(lib_warnings(record)) == 1
    # Issue 12: hits from a read-only cache (a container image), nothing written.
    assert store.enabled and store.read_only and not store.writable
    assert store.load(key_of("ro"), IDENT) is not None
    assert store.claim(key_of("other")) is None
    assert store.publish(make_entry(key_of("other"))) is PublishResult.DISABLED
    assert store.sweep() == 0


def test_full_file_system(tmpfs: Callable[[str], Path]) -> None:
    mnt = tmpfs("mode=0700,size=64k")
    store = Store(mnt)
    assert store.enabled, store.problem
    key = key_of("full")
    with pytest.raises(OSError) as info:
        store.publish(make_entry(key, b"\x00" * (1 << 20)))
    assert info.value.errno == errno.ENOSPC
    assert store.load(key) is None
    assert leftovers(mnt) == []  # the temp file went with the failure
    # The space is free again: a small entry fits.
    assert store.publish(make_entry(key, b"small")) is PublishResult.WRITTEN
    assert store.load(key, IDENT).binaries == (b"small",)


def _store_as_seen_by_nobody(directory: str) -> dict[str, Any]:
    """Runs in a forked child after it dropped to uid 65534 (see :func:`_as_nobody`)."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        store = Store(directory)
    key = key_of("as nobody")
    return {
        "uid": os.geteuid(),
        "warnings": [w.category.__name__ for w in record],
        "enabled": store.enabled,
        "load": store.load(key),
        "publish": store.publish(make_entry(key)).value,
    }


def _as_nobody(fn: Callable[[str], dict[str, Any]], arg: str) -> dict[str, Any]:
    """``fn(arg)`` in a real process of uid 65534.

    A fork, not a new interpreter: the interpreter may live where that uid cannot
    read it (a pyenv under /root), while the forked child already has every module
    it needs. Skips where the uid cannot be switched.
    """
    if os.geteuid() != 0:
        pytest.skip("switching to another uid needs root")
    rfd, wfd = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: we exec nothing
        pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.close(rfd)
            try:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            except OSError as e:
                out: dict[str, Any] = {"skip": f"cannot switch to uid {NOBODY}: {e}"}
            else:
                out = {"result": fn(arg)}
            os.write(wfd, json.dumps(out).encode())
        except BaseException as e:
            with contextlib.suppress(BaseException):
                os.write(wfd, json.dumps({"error": repr(e)}).encode())
            code = 1
        finally:
            os._exit(code)
    os.close(wfd)
    chunks = []
    with os.fdopen(rfd, "rb") as r:
        while chunk := r.read(65536):
            chunks.append(chunk)
    os.waitpid(pid, 0)
    out = json.loads(b"".join(chunks) or b'{"error": "child died without a word"}')
    if "skip" in out:
        pytest.skip(out["skip"])
    assert "error" not in out, out["error"]
    return out["result"]


@pytest.fixture
def public_tmp() -> Iterator[Path]:
    """A directory another uid can reach (pytest's tmp_path is root-only)."""
    d = Path(tempfile.mkdtemp(prefix="acc-test-other-"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_unwritable_directory(public_tmp: Path) -> None:
    """Its own directory, but read-only to it: a real unprivileged process is refused."""
    d = public_tmp / "cache"
    d.mkdir(mode=0o700)
    os.chown(d, NOBODY, NOBODY)
    d.chmod(0o500)
    out = _as_nobody(_store_as_seen_by_nobody, str(d))
    assert out == {
        "uid": NOBODY,
        "warnings": ["CacheDirWarning"],
        "enabled": False,
        "load": None,
        "publish": "disabled",
    }
    assert os.listdir(d) == []


def test_writable_directory_as_other_user_control(public_tmp: Path) -> None:
    """The same child can succeed: with write permission, the store works."""
    d = public_tmp / "cache"
    d.mkdir(mode=0o700)
    os.chown(d, NOBODY, NOBODY)
    out = _as_nobody(_store_as_seen_by_nobody, str(d))
    assert out == {
        "uid": NOBODY,
        "warnings": [],
        "enabled": True,
        "load": None,
        "publish": "written",
    }
    entry = d / f"v{FORMAT_VERSION}" / key_of("as nobody")[:2] / f"{key_of('as nobody')}.acl"
    assert entry.stat().st_uid == NOBODY


def test_directory_owned_by_another_user(public_tmp: Path) -> None:
    _need_root_for_chown()
    d = public_tmp / "cache"
    d.mkdir(mode=0o700)
    os.chown(d, NOBODY, NOBODY)
    with pytest.warns(InsecureCacheWarning, match=f"uid {NOBODY}") as record:
        store = Store(d)
    assert len(lib_warnings(record)) == 1
    _assert_disabled(store)


# }}}

# {{{ security


def test_modes_even_with_a_permissive_umask(cache_dir: Path) -> None:
    old = os.umask(0)
    try:
        store = Store(cache_dir)
        key = key_of("modes")
        assert store.publish(make_entry(key)) is PublishResult.WRITTEN
    finally:
        os.umask(old)
    for d in (cache_dir, store.root, store.path_for(key).parent):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    assert stat.S_IMODE(store.path_for(key).stat().st_mode) == 0o600
    assert store.path_for(key).stat().st_uid == os.geteuid()


@pytest.mark.parametrize("mode", [0o770, 0o777, 0o720, 0o702, 0o1777])
def test_group_or_other_writable_directory_is_refused(cache_dir: Path, mode: int) -> None:
    cache_dir.mkdir()
    cache_dir.chmod(mode)
    with pytest.warns(InsecureCacheWarning, match="writable by group or others") as record:
        store = Store(cache_dir)
    assert len(lib_warnings(record)) == 1
    _assert_disabled(store)
    assert os.listdir(cache_dir) == []  # nothing created in it


def test_insecure_version_directory_is_refused(cache_dir: Path) -> None:
    Store(cache_dir)
    (cache_dir / f"v{FORMAT_VERSION}").chmod(0o777)
    with pytest.warns(InsecureCacheWarning):
        store = Store(cache_dir)
    _assert_disabled(store)


@pytest.mark.parametrize("mode", [0o700, 0o750, 0o755])
def test_private_or_read_only_for_others_is_accepted(cache_dir: Path, mode: int) -> None:
    cache_dir.mkdir()
    cache_dir.chmod(mode)
    store = Store(cache_dir)
    assert store.enabled, store.problem
    assert store.publish(make_entry(key_of("ok"))) is PublishResult.WRITTEN
    assert stat.S_IMODE(cache_dir.stat().st_mode) == mode  # an existing base is left alone


def test_entry_in_an_insecure_fanout_directory_is_not_loaded(store: Store) -> None:
    # Checked on read too: others could have planted the entry there.
    key = key_of("fanout-read")
    store.publish(make_entry(key, b"first"))
    store.path_for(key).parent.chmod(0o777)
    try:
        with pytest.warns(InsecureCacheWarning, match="writable by group or others"):
            assert store.load(key, IDENT) is None
        assert store.path_for(key).exists()  # not ours to delete
    finally:
        store.path_for(key).parent.chmod(0o700)
    assert store.load(key, IDENT) is not None


def test_entry_with_two_hard_links_is_not_loaded(store: Store, tmp_path: Path) -> None:
    key = key_of("hardlink")
    store.publish(make_entry(key, b"first"))
    os.link(store.path_for(key), tmp_path / "elsewhere")
    with pytest.warns(InsecureCacheWarning, match="hard links"):
        assert store.load(key, IDENT) is None
    assert [b for _, b in store.verify()] and "hard links" in store.verify()[0][1]
    (tmp_path / "elsewhere").unlink()
    assert store.load(key, IDENT) is not None


def test_insecure_fanout_directory_is_not_written(store: Store) -> None:
    key = key_of("fanout")
    store.publish(make_entry(key, b"first"))
    store.path_for(key).parent.chmod(0o777)
    with pytest.raises(PermissionError, match="writable by group or others"):
        store.publish(make_entry(key, b"second"))
    store.path_for(key).parent.chmod(0o700)
    assert store.load(key, IDENT).binaries == (b"first",)


# }}}

# {{{ ranks

CHILD_ROOT = """
    import json, sys
    from asyncclcache.store import Store
    s = Store(sys.argv[1])
    print(json.dumps({"root": str(s.root), "rank": s.rank, "rank_local": s.rank_local}))
"""


@pytest.mark.parametrize(
    ("env", "expected_tail", "rank"),
    [
        ({"PMI_RANK": "3"}, "rank-3", 3),
        ({"OMPI_COMM_WORLD_RANK": "3"}, "rank-3", 3),
        ({"SLURM_PROCID": "11", "PMI_RANK": "2"}, "rank-2", 2),
        ({"PMI_RANK": "3", "ASYNCCLCACHE_RANK_LOCAL": "0"}, f"v{FORMAT_VERSION}", 3),
        ({"ASYNCCLCACHE_RANK_LOCAL": "1"}, f"v{FORMAT_VERSION}", None),
        ({}, f"v{FORMAT_VERSION}", None),
    ],
)
def test_rank_local_root(
    cache_dir: Path, env: dict[str, str], expected_tail: str, rank: int | None
) -> None:
    out = child_json(run_child(CHILD_ROOT, str(cache_dir), env=env))
    root = Path(out["root"])
    assert root.name == expected_tail
    assert out["rank"] == rank
    assert out["rank_local"] is (expected_tail.startswith("rank-"))
    expected = cache_dir / f"v{FORMAT_VERSION}"
    if out["rank_local"]:
        expected = expected / expected_tail
    assert root == expected
    assert root.is_dir()
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


def test_ranks_do_not_see_each_other(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = key_of("ranked")
    monkeypatch.setenv("PMI_RANK", "3")
    three = Store(cache_dir)
    assert three.publish(make_entry(key, b"rank 3")) is PublishResult.WRITTEN
    monkeypatch.setenv("PMI_RANK", "4")
    four = Store(cache_dir)
    assert four.root != three.root
    assert four.load(key, IDENT) is None
    shared = Store(cache_dir, rank_local=False)
    assert shared.root == cache_dir / f"v{FORMAT_VERSION}"
    assert shared.load(key, IDENT) is None
    assert three.load(key, IDENT).binaries == (b"rank 3",)


# }}}


def test_symlinked_fanout_directory_is_refused(tmp_path):
    from asyncclcache.entry import Entry
    from asyncclcache.errors import InsecureCacheWarning

    store = Store(tmp_path / "c")
    key = "ab" + "0" * 62
    entry = Entry(key, (b"x",), {"devices": [{"device_name": "d"}]})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (store.root / "ab").symlink_to(elsewhere)
    with pytest.raises(PermissionError):
        store.publish(entry)
    assert list(elsewhere.iterdir()) == []
    # An entry planted behind the link is not read.
    (elsewhere / (key + ".acl")).write_bytes(b"planted")
    with pytest.warns(InsecureCacheWarning, match="symbolic link"):
        assert store.load(key) is None
    assert (elsewhere / (key + ".acl")).exists()


def test_directory_removed_while_running_is_recreated(tmp_path):
    import shutil

    from asyncclcache.entry import Entry

    store = Store(tmp_path / "c")
    shutil.rmtree(tmp_path / "c")
    key = "cd" + "1" * 62
    assert store.publish(Entry(key, (b"y",), {"devices": [{}]})) is PublishResult.WRITTEN
    assert store.load(key).binaries == (b"y",)
    assert oct((tmp_path / "c").stat().st_mode & 0o777) == "0o700"


def test_read_only_directory_serves_hits_and_writes_nothing(tmp_path: Path) -> None:
    # A pre-populated cache on a read-only mount (a container image, say). Root ignores
    # permission bits, so the test mounts the directory read-only for real.
    from conftest import child_json, run_child

    src_dir, ro = tmp_path / "filled", tmp_path / "ro"
    code = r"""
import json, sys, warnings
warnings.simplefilter("always")
import pyopencl as cl, asyncclcache as acc
from kernels import small_source, run_twice
with warnings.catch_warnings(record=True) as said:
    cache = acc.Cache(sys.argv[1])
    ctx = cl.Context([cl.get_platforms()[0].get_devices()[0]])
    prgs = [cache.program(ctx, small_source(name=n, salt=n)).build() for n in ("ro_a", "ro_b")]
    ok = all(run_twice(ctx, p, name=n) for p, n in zip(prgs, ("ro_a", "ro_b")))
    flushed = cache.flush(60)
    cache.close()
print(json.dumps({"ok": ok, "flushed": flushed, "stats": cache.stats().as_dict(),
                  "read_only": cache.store.read_only,
                  "said": [str(w.message) for w in said if "read-only" in str(w.message)]}))
"""
    first = child_json(run_child(code, str(src_dir)))
    assert first["stats"]["writes"] == 2 and not first["read_only"]
    ro.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(src_dir), str(ro)], capture_output=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {mounted.stderr.decode().strip()}")
    try:
        r = subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)], capture_output=True, check=False)
        if r.returncode != 0:
            pytest.skip(f"cannot remount read-only here: {r.stderr.decode().strip()}")
        before = sorted(p.name for p in ro.rglob("*"))
        out = child_json(run_child(code, str(ro)))
        assert out["ok"] and out["flushed"] and out["read_only"]
        s = out["stats"]
        assert (s["hits"], s["misses"], s["writes"], s["errors"], s["write_errors"]) == (2, 0, 0, 0, 0)
        assert len(out["said"]) == 1
        assert sorted(p.name for p in ro.rglob("*")) == before
    finally:
        subprocess.run(["umount", str(ro)], check=False)
