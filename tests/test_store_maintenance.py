"""The on-disk store's upkeep: per-key locks and claims, killed writers, orphaned temp
and lock files, sweep.

Everything here is real: a writer is a separate process killed with SIGKILL in the
middle of its write. (Helpers shared by the ``test_store_*`` files: ``_store_helpers.py``.)
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import filelock
import pytest

# The fixtures `store` and `_not_under_mpi` (autouse: every test of this module).
from _store_helpers import (  # noqa: F401 (the fixtures: pytest finds them here)
    IDENT,
    _not_under_mpi,
    files_under,
    key_of,
    leftovers,
    make_entry,
    store_fixture,
)
from asyncclcache import maintenance
from asyncclcache.entry import encode
from asyncclcache.maintenance import TEMP_MAX_AGE
from asyncclcache.store import (
    ENTRY_SUFFIX,
    LOCK_SUFFIX,
    TEMP_PREFIX,
    TEMP_SUFFIX,
    PublishResult,
    Store,
)

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
    from asyncclcache.fileio import HOST as _HOST

    assert tmp.name.startswith(f"{TEMP_PREFIX}{_HOST}-")  # the host's digest, then the pid
    assert 0 < tmp.stat().st_size < len(encode(make_entry(key, b"killed writer " * 5000)))
    lock = tmp.parent / f"{key}{LOCK_SUFFIX}"
    assert lock.exists()  # the killed writer could not clean up its lock file
    temps, locks = maintenance.orphans(store)
    assert temps == [tmp]
    assert locks == [lock]
    assert maintenance.sweep(store) == 2
    assert not tmp.exists()
    assert not lock.exists()
    assert maintenance.orphans(store) == ([], [])
    assert maintenance.sweep(store) == 0


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
    assert maintenance.orphans(store) == ([tmp], [])
    assert maintenance.sweep(store) == 1
    assert leftovers(store.base) == []
    assert store.load(key, IDENT).binaries == (b"after the kill",)  # sweep kept the entry


def test_sweep_running_alongside_never_makes_a_claim_skip(store: Store) -> None:
    """A sweep takes each unheld lock file for a moment to probe it; a claim made at
    that moment must still succeed (it used to skip, and the entry was not written)."""
    stop = threading.Event()
    sweeps = []

    def sweeper() -> None:
        while not stop.is_set():
            sweeps.append(maintenance.sweep(store))

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
    assert maintenance.orphans(store) == ([], [])


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
        assert maintenance.orphans(store) == ([], [])  # a held lock is no orphan
        assert maintenance.sweep(store) == 0
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
        assert maintenance.orphans(store) == ([], [])
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
    from asyncclcache.fileio import HOST as _HOST

    # Issue 12: another host's write in progress on a shared directory, with a PID that is
    # dead here: it must not be swept (only once it is old).
    other_host = "0f0f0f0f" if _HOST != "0f0f0f0f" else "1e1e1e1e"
    remote = fanout / f"{TEMP_PREFIX}{other_host}-{int(dead.stdout)}-abc{TEMP_SUFFIX}"
    remote.write_bytes(b"x")
    local_dead = fanout / f"{TEMP_PREFIX}{_HOST}-{int(dead.stdout)}-abc{TEMP_SUFFIX}"
    local_dead.write_bytes(b"x")
    unrelated = fanout / "notes.txt"
    unrelated.write_bytes(b"x")
    temps, locks = maintenance.orphans(store)
    assert sorted(temps) == sorted([gone, old, local_dead])
    assert remote not in temps
    assert locks == []
    assert maintenance.sweep(store) == 3
    assert mine.exists() and remote.exists()
    assert unrelated.exists()
    assert store.path_for(key).exists()


# }}}


# {{{ issue 34: no scan of the shared directory on a job's way; the upkeep once an interval


def _plant_orphans(store: Store) -> list[Path]:
    """A killed writer's temp file (its PID gone) and a lock file nobody holds."""
    from asyncclcache.fileio import HOST

    key = key_of("orphans")
    store.publish(make_entry(key))
    fanout = store.path_for(key).parent
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    temp = fanout / f"{TEMP_PREFIX}{HOST}-{int(dead.stdout)}-abc{TEMP_SUFFIX}"
    temp.write_bytes(b"half an entry")
    lock = fanout / (key_of("another") + LOCK_SUFFIX)
    lock.write_bytes(b"")
    return [temp, lock]


def test_the_upkeep_is_due_once_an_interval_by_the_stamp(store: Store) -> None:
    assert maintenance.last_upkeep(store).due  # never kept in order
    planted = _plant_orphans(store)
    r = maintenance.upkeep(store)
    assert r.ran and not any(p.exists() for p in planted)
    seen = maintenance.last_upkeep(store, want_size=True)
    assert not seen.due and seen.bytes == store.total_bytes()
    stamp = store.root / "upkeep.json"
    now = stamp.stat().st_mtime
    for age, due in ((maintenance.UPKEEP_INTERVAL + 60, True), (60, False),
                     (-(maintenance.UPKEEP_INTERVAL + 60), True)):  # a clock far ahead: due, never stuck
        os.utime(stamp, (now - age, now - age))
        assert maintenance.last_upkeep(store).due is due, age


def test_an_upkeep_another_process_just_did_is_not_done_again(store: Store) -> None:
    seen = maintenance.last_upkeep(store)
    assert maintenance.upkeep(store).ran  # another process, meanwhile
    planted = _plant_orphans(store)
    assert not maintenance.upkeep(store, seen=seen).ran  # not listed again
    assert all(p.exists() for p in planted)
    # Unless what it measured plus what the caller wrote since crosses the bound.
    measured = maintenance.last_upkeep(store, want_size=True).bytes
    assert measured is not None
    assert maintenance.upkeep(store, seen=seen, max_size=measured, wrote=1).ran


def test_a_held_upkeep_is_skipped_not_waited_for(store: Store) -> None:
    from asyncclcache.locks import file_lock

    with file_lock(store.root / "prune.lock", 0):
        assert not maintenance.upkeep(store).ran
    assert maintenance.upkeep(store).ran


def test_the_upkeep_folds_the_lifetime_additions(store: Store) -> None:
    from asyncclcache.stats import add_lifetime, read_lifetime

    for _ in range(5):
        assert add_lifetime(store.root, {"hits": 2, "runs": 1})
    assert read_lifetime(store.root)["hits"] == 10
    assert len(list((store.root / "stats.d").iterdir())) == 5
    assert maintenance.upkeep(store).ran
    assert list((store.root / "stats.d").iterdir()) == []
    assert (read_lifetime(store.root)["hits"], read_lifetime(store.root)["runs"]) == (10, 5)


def _additions(store: Store) -> list[Path]:
    folder = store.root / "stats.d"
    return sorted(folder.iterdir()) if folder.exists() else []


def _age(path: Path, seconds: float) -> None:
    t = path.stat().st_mtime - seconds
    os.utime(path, (t, t))


def test_processes_that_only_hit_keep_the_lifetime_counters_bounded(store: Store) -> None:
    # Issue 40: the upkeep runs only after a write, so a directory that is only hit gained a
    # file a process for ever. A process that saves folds where the last fold is old.
    from asyncclcache.stats import FOLD_EVERY, Counters, read_lifetime

    for run in range(4):
        counters = Counters()
        counters.add("hits", 3)
        counters.save_lifetime(store.root)
        assert _additions(store) == [], run  # folded by the process that saved: it was due
        _age(store.root / "stats.json", 2 * FOLD_EVERY)
    assert (read_lifetime(store.root)["hits"], read_lifetime(store.root)["runs"]) == (12, 4)
    # Within FOLD_EVERY of a fold: a file of its own, folded by the next that finds it due.
    fresh = Counters()
    fresh.add("hits")
    (store.root / "stats.json").touch()
    fresh.save_lifetime(store.root)
    assert len(_additions(store)) == 1 and read_lifetime(store.root)["hits"] == 13
    _age(store.root / "stats.json", 2 * FOLD_EVERY)
    last = Counters()
    last.add("hits")
    last.save_lifetime(store.root)
    assert _additions(store) == [] and read_lifetime(store.root)["hits"] == 14


def test_a_fold_cut_short_anywhere_loses_nothing_and_counts_nothing_twice(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncclcache import stats

    for _ in range(3):
        assert stats.add_lifetime(store.root, {"hits": 2, "runs": 1})
    real_unlink = os.unlink
    # Cut after the total was written, before its additions were removed.
    monkeypatch.setattr(os, "unlink", lambda p, *a, **k: (_ for _ in ()).throw(OSError("killed")))
    assert stats.fold_lifetime(store.root) == 3
    assert len(_additions(store)) == 3 and stats.read_lifetime(store.root)["hits"] == 6
    monkeypatch.setattr(os, "unlink", real_unlink)
    assert stats.add_lifetime(store.root, {"hits": 1})
    assert stats.fold_lifetime(store.root) == 1  # the three, counted, only removed now
    assert _additions(store) == [] and stats.read_lifetime(store.root)["hits"] == 7
    # Cut before the total was written: the additions stay, counted once.
    assert stats.add_lifetime(store.root, {"hits": 5})
    monkeypatch.setattr(stats, "atomic_write", lambda *a, **k: (_ for _ in ()).throw(OSError("full")))
    assert stats.fold_lifetime(store.root) == 0
    assert len(_additions(store)) == 1 and stats.read_lifetime(store.root)["hits"] == 12
    monkeypatch.undo()
    assert stats.fold_lifetime(store.root) == 1 and stats.read_lifetime(store.root)["hits"] == 12


def test_a_total_of_the_former_format_is_read_and_folded_into(store: Store) -> None:
    from asyncclcache import stats

    (store.root / "stats.json").write_text('{"hits": 4, "runs": 2}')
    assert stats.add_lifetime(store.root, {"hits": 1})
    assert stats.read_lifetime(store.root)["hits"] == 5
    assert stats.fold_lifetime(store.root) == 1 and stats.read_lifetime(store.root)["runs"] == 2


def test_fifos_in_the_directorys_own_files_hang_nothing(store: Store) -> None:
    # Issue 40: upkeep.json and the counters' files were opened without O_NONBLOCK.
    from asyncclcache.stats import add_lifetime

    assert add_lifetime(store.root, {"hits": 1})
    os.mkfifo(store.root / "stats.d" / "planted-1-fifo.json", 0o600)
    os.mkfifo(store.root / "upkeep.json", 0o600)
    code = textwrap.dedent("""
        import sys
        from asyncclcache import maintenance
        from asyncclcache.stats import fold_lifetime, read_lifetime
        from asyncclcache.store import Store
        store = Store(sys.argv[1], rank_local=False)
        print(read_lifetime(store.root)["hits"], maintenance.last_upkeep(store, want_size=True).bytes)
        maintenance.upkeep(store)
        print(fold_lifetime(store.root), int(read_lifetime(store.root)["hits"]))
    """)
    r = subprocess.run([sys.executable, "-c", code, str(store.base)], capture_output=True, text=True, timeout=60,
                       check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "None", "0", "1"], r.stdout
    os.mkfifo(store.root / "stats.json.fifo", 0o600)
    os.replace(store.root / "stats.json.fifo", store.root / "stats.json")
    cli = subprocess.run([sys.executable, "-m", "asyncclcache", "stats", "--dir", str(store.base), "--json"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert cli.returncode == 0 and json.loads(cli.stdout)["hits"] == 0, cli.stdout + cli.stderr


def test_a_process_that_finds_the_tree_makes_none_of_it(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[str] = []
    real = os.mkdir
    monkeypatch.setattr(os, "mkdir", lambda p, *a, **k: (made.append(str(p)), real(p, *a, **k))[1])
    again = Store(store.base)
    key = key_of("written twice")
    again.publish(make_entry(key))  # a new fan-out directory: made, once
    again.publish(make_entry(key))
    Store(store.base).publish(make_entry(key))
    assert made == [str(again.path_for(key).parent)]


def test_a_directory_without_baked_binaries_is_not_searched_for_one(store: Store) -> None:
    from asyncclcache.keys import baked_key

    key = key_of("kcache")
    assert not store.may_have_baked()
    store.publish(make_entry(baked_key(key), baked_from=key, kind="binary"))
    assert store.may_have_baked()
    assert Store(store.base).may_have_baked()  # another process: from the mark

# }}}
