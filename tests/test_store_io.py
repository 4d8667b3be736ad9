"""The on-disk store's reads and writes: layout, real round trips, concurrent writers,
failed writes, damaged entries, rank-local roots.

Everything here is real: pocl builds the programs, and the children are separate
processes with their own pocl cache. (Helpers shared by the ``test_store_*`` files:
``_store_helpers.py``.)
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import stat
import subprocess
import sys
import textwrap
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# The fixtures `store` and `_not_under_mpi` (autouse: every test of this module).
from _store_helpers import (  # noqa: F401 (the fixtures: pytest finds them here)
    IDENT,
    _not_under_mpi,
    files_under,
    key_of,
    leftovers,
    lib_warnings,
    make_entry,
    store_fixture,
)
from asyncclcache import maintenance
from asyncclcache.entry import Entry, encode
from asyncclcache.errors import CorruptEntryWarning
from asyncclcache.keys import FORMAT_VERSION, make_key
from asyncclcache.store import ENTRY_SUFFIX, PublishResult, Store
from conftest import ROOT, child_json, run_child, run_in_threads, small_source

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
    from _pocl import pocl_devices

    warnings.simplefilter("error", AsyncCLCacheWarning)
    directory, key, source = sys.argv[1:4]
    devs = pocl_devices()[:1]
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


def test_directory_removed_while_running_is_recreated(tmp_path):
    import shutil

    from asyncclcache.entry import Entry

    store = Store(tmp_path / "c")
    shutil.rmtree(tmp_path / "c")
    key = "cd" + "1" * 62
    assert store.publish(Entry(key, (b"y",), {"devices": [{}]})) is PublishResult.WRITTEN
    assert store.load(key).binaries == (b"y",)
    assert oct((tmp_path / "c").stat().st_mode & 0o777) == "0o700"


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
    assert maintenance.orphans(store) == ([], [])


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

# {{{ failed writes


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


# }}}

# {{{ ranks


CHILD_ROOT = """
    import json, sys
    from asyncclcache.store import Store
    s = Store(sys.argv[1])
    print(json.dumps({"root": str(s.root), "rank": s.rank, "rank_local": s.rank_local,
                      "node": s.node is not None}))
"""


@pytest.mark.parametrize(
    ("env", "expected_tail", "rank"),
    [
        # Ranks share the directory by default, read through their node's copies.
        ({"PMI_RANK": "3"}, f"v{FORMAT_VERSION}", 3),
        ({"OMPI_COMM_WORLD_RANK": "3"}, f"v{FORMAT_VERSION}", 3),
        ({"SLURM_PROCID": "11", "PMI_RANK": "2"}, f"v{FORMAT_VERSION}", 2),
        ({"PMI_RANK": "3", "ASYNCCLCACHE_RANK_LOCAL": "1"}, "rank-3", 3),
        ({"SLURM_PROCID": "11", "ASYNCCLCACHE_RANK_LOCAL": "1"}, "rank-11", 11),
        ({"PMI_RANK": "3", "ASYNCCLCACHE_RANK_LOCAL": "0"}, f"v{FORMAT_VERSION}", 3),
        ({"ASYNCCLCACHE_RANK_LOCAL": "1"}, f"v{FORMAT_VERSION}", None),
        ({}, f"v{FORMAT_VERSION}", None),
    ],
)
def test_rank_local_root(
    cache_dir: Path, env: dict[str, str], expected_tail: str, rank: int | None, tmp_path: Path
) -> None:
    env = dict(env, ASYNCCLCACHE_NODE_DIR=str(tmp_path / "node"))
    out = child_json(run_child(CHILD_ROOT, str(cache_dir), env=env))
    root = Path(out["root"])
    assert root.name == expected_tail
    assert out["rank"] == rank
    # Node-local copies: under a launcher, for a directory the ranks share.
    assert out["node"] is (rank is not None and not expected_tail.startswith("rank-"))
    assert out["rank_local"] is (expected_tail.startswith("rank-"))
    expected = cache_dir / f"v{FORMAT_VERSION}"
    if out["rank_local"]:
        expected = expected / expected_tail
    assert root == expected
    assert root.is_dir()
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


def test_ranks_share_one_entry_by_default(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = key_of("shared by ranks")
    monkeypatch.setenv("PMI_RANK", "3")
    three = Store(cache_dir)
    assert three.publish(make_entry(key, b"rank 3")) is PublishResult.WRITTEN
    monkeypatch.setenv("PMI_RANK", "4")
    four = Store(cache_dir)
    assert four.root == three.root == cache_dir / f"v{FORMAT_VERSION}"
    assert four.load(key, IDENT).binaries == (b"rank 3",)


def test_rank_local_ranks_do_not_see_each_other(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = key_of("ranked")
    monkeypatch.setenv("PMI_RANK", "3")
    three = Store(cache_dir, rank_local=True)
    assert three.publish(make_entry(key, b"rank 3")) is PublishResult.WRITTEN
    monkeypatch.setenv("PMI_RANK", "4")
    four = Store(cache_dir, rank_local=True)
    assert four.root != three.root
    assert four.load(key, IDENT) is None
    shared = Store(cache_dir, rank_local=False)
    assert shared.root == cache_dir / f"v{FORMAT_VERSION}"
    assert shared.load(key, IDENT) is None
    assert three.load(key, IDENT).binaries == (b"rank 3",)


# }}}
