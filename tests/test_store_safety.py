"""The on-disk store where it must not trust what it finds: modes, owners, symbolic and
hard links, foreign, unusable, read-only and full locations.

Everything here is real: read-only and full file systems are real tmpfs mounts (where
this machine lets us mount), and another user is a real uid (where we may switch to it).
(Helpers shared by the ``test_store_*`` files: ``_store_helpers.py``.)
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
import subprocess
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import asyncclcache as acc

# The fixtures `store` and `_not_under_mpi` (autouse: every test of this module).
from _store_helpers import (  # noqa: F401 (the fixtures: pytest finds them here)
    IDENT,
    NOBODY,
    _not_under_mpi,
    key_of,
    leftovers,
    lib_warnings,
    make_entry,
    store_fixture,
    tmpfs_fixture,
)
from asyncclcache import maintenance
from asyncclcache.entry import encode
from asyncclcache.errors import CacheDirWarning, InsecureCacheWarning
from asyncclcache.keys import FORMAT_VERSION
from asyncclcache.store import PublishResult, Store
from conftest import run_twice, small_source

# {{{ entries others could have planted or changed


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
        assert maintenance.orphans(store) == ([], [])
        assert maintenance.sweep(store) == 0
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
        prg = acc.Program(cl_ctx, small_source("twice"), cache=cache).build()
        assert run_twice(cl_ctx, prg)
        assert cache.flush(30)
        stats = cache.stats()
        assert (stats.writes, stats.hits, stats.pending) == (0, 0, 0)
    finally:
        cache.close()
    assert f.read_bytes() == b"not a directory"


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
    assert maintenance.sweep(store) == 0


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
from _pocl import pocl_context
with warnings.catch_warnings(record=True) as said:
    cache = acc.Cache(sys.argv[1])
    ctx = pocl_context()
    prgs = [acc.Program(ctx, small_source(name=n, salt=n), cache=cache).build() for n in ("ro_a", "ro_b")]
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
    assert [b for _, b in maintenance.verify(store)] and "hard links" in maintenance.verify(store)[0][1]
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


# }}}


# {{{ what stands where an entry file belongs is replaced by the next write


@contextlib.contextmanager
def _unremovable(directory: Path) -> Iterator[None]:
    """``directory`` (holding a file) made one that no ``rmtree`` by us can empty: its file
    immutable for root (which permissions do not stop), the directory read-only for anyone
    else. Undone at the end, wherever the directory was moved to meanwhile."""
    inner = directory / "inner"
    inner.write_bytes(b"x")
    if os.geteuid() == 0:
        chattr = shutil.which("chattr")
        if chattr is None or subprocess.run([chattr, "+i", str(inner)], capture_output=True, check=False).returncode:
            pytest.skip("no chattr +i here (root ignores permissions)")
        undo = [chattr, "-i"]
    else:
        directory.chmod(0o500)
    try:
        yield
    finally:
        for d in [directory, *directory.parent.glob(".tmp-*")]:
            if d.is_dir() and not d.is_symlink():
                if os.geteuid() == 0:
                    subprocess.run([*undo, str(d / "inner")], capture_output=True, check=False)
                d.chmod(0o700)


@pytest.mark.parametrize("what", ["directory", "symlink", "writable by others"])
def test_what_stands_in_place_of_an_entry_is_replaced_by_the_next_write(cl_ctx, cache_dir, open_cache,
                                                                         tmp_path, what):
    # Issue 26: the lookup refuses it, and the write of the rebuilt program must not take it
    # for another process's entry written meanwhile (the claim skipped it: a miss for good).
    src = small_source()
    cache = open_cache(cache_dir)
    key = acc.Program(cl_ctx, src, cache=cache).build().cache_key
    assert cache.close()
    path = Store(cache_dir).path_for(key)
    target = tmp_path / "target"
    target.write_bytes(b"not ours to touch")
    with contextlib.ExitStack() as stack:
        if what == "directory":
            path.unlink()
            path.mkdir()
            stack.enter_context(_unremovable(path))
        elif what == "symlink":
            path.unlink()
            path.symlink_to(target)
        else:
            path.chmod(0o666)
        again = open_cache(cache_dir)
        with pytest.warns((acc.CorruptEntryWarning, InsecureCacheWarning)):
            prg = acc.Program(cl_ctx, src, cache=again).build()
        assert run_twice(cl_ctx, prg)
        assert again.flush(120)
        s = again.stats()
        assert (s.misses, s.writes, s.skipped, s.write_errors) == (1, 1, 0, 0), s
        assert again.close()
        assert path.is_file() and not path.is_symlink()
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert target.read_bytes() == b"not ours to touch"
        third = open_cache(cache_dir)
        assert run_twice(cl_ctx, acc.Program(cl_ctx, src, cache=third).build())
        assert third.stats().hits == 1
    # A directory moved aside goes with the sweep, once its file can go.
    maintenance.sweep(Store(cache_dir))
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


# }}}
