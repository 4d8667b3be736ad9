"""Jobs of many ranks: one entry per program in the shared directory, read once per node
through node-local copies (:mod:`asyncclcache.nodecopies`), any rank count.

The first part drives :class:`~asyncclcache.store.Store` in this process and in killed
children, with real files (and real small file systems where mounting is allowed). The
second runs real jobs: ``mpiexec`` (MPICH from PyPI, the ``mpi`` extra) and a private Slurm
(Debian's ``slurm-wlm``, :mod:`_slurm`; root only), on pocl, with simulated nodes
(``ASYNCCLCACHE_TEST_NODE``). Each is skipped, saying why, where it cannot run here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import _slurm
from _store_helpers import key_of, make_entry, tmpfs_fixture  # noqa: F401 (the fixture)
from asyncclcache import maintenance
from asyncclcache.config import get_config
from asyncclcache.errors import NodeDirWarning
from asyncclcache.nodecopies import COPY_SUFFIX, NodeCopies, node_base
from asyncclcache.ranks import detect_node
from asyncclcache.shared import SharedDir
from asyncclcache.store import ENTRY_SUFFIX, PublishResult, Store
from conftest import ROOT, need
from test_mpi import _mpiexec  # mpiexec, where MPI (with mpi4py) starts here

IDENT = make_entry(key_of("x")).meta.devices

# {{{ in this process: a Store per "rank", node by node


class Counts(dict[str, int]):
    def __call__(self, name: str) -> None:
        self[name] = self.get(name, 0) + 1


@pytest.fixture
def rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., tuple[Store, Counts]]]:
    """``rank(r, node)``: a Store of the shared directory as rank ``r`` on simulated ``node``
    sees it, and what its node-local copies counted."""
    monkeypatch.setenv("ASYNCCLCACHE_NODE_DIR", str(tmp_path / "node-local"))

    def make(r: int, node: str, **kw: Any) -> tuple[Store, Counts]:
        monkeypatch.setenv("ASYNCCLCACHE_TEST_NODE", node)
        get_config.cache_clear()
        counts = Counts()
        return Store(tmp_path / "shared", rank=r, count=counts, **kw), counts

    yield make
    monkeypatch.undo()
    get_config.cache_clear()


def _opens_under(monkeypatch: pytest.MonkeyPatch, folder: Path) -> list[str]:
    """Every ``os.open`` of an entry file under ``folder`` from now on (this process)."""
    seen: list[str] = []
    real = os.open

    def counting(path: Any, flags: int, *args: Any, **kw: Any) -> int:
        d = kw.get("dir_fd")
        full = os.fspath(path) if d is None else os.path.join(os.readlink(f"/proc/self/fd/{d}"), os.fspath(path))
        if full.startswith(str(folder)) and full.endswith(ENTRY_SUFFIX):
            seen.append(full)
        return real(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", counting)
    return seen


def test_ranks_share_one_entry_and_each_node_reads_it_once(rank, tmp_path, monkeypatch) -> None:
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("counting opens by folder needs /proc/self/fd")
    key = key_of("one per program")
    writer, _ = rank(0, "a")
    assert writer.publish(make_entry(key, b"code")) is PublishResult.WRITTEN
    stores = [rank(r, node) for r, node in [(1, "a"), (2, "a"), (3, "b"), (4, "b"), (5, "b")]]
    opens = _opens_under(monkeypatch, tmp_path / "shared")
    for s, _ in stores:
        entry, stamp = s.lookup(key, IDENT)
        assert entry is not None and entry.binaries == (b"code",)
        assert stamp == writer.stamp(key)
    # One entry file for the whole job; node a's copy was left by the writer, node b read
    # the shared file once, its other ranks its copy.
    assert len(list(writer.entries())) == 1
    assert len(opens) == 1
    assert [c.get("shared_reads", 0) for _, c in stores] == [0, 0, 1, 0, 0]
    assert [c.get("node_reads", 0) for _, c in stores] == [1, 1, 0, 1, 1]
    # A node's copies are the node's: another simulated node has its own folder.
    assert stores[0][0].node.root != stores[2][0].node.root


def _age_records(store: Store) -> None:
    """What the node saw of the shared entries, SEEN_FOR ago: its next lookups ask again."""
    from asyncclcache.nodecopies import SEEN_FOR, SEEN_SUFFIX

    for p in store.node.root.rglob(f"*{SEEN_SUFFIX}"):
        os.utime(p, (time.time() - SEEN_FOR - 1,) * 2)


def test_a_replaced_or_removed_shared_entry_is_served_from_an_old_copy_within_the_window_alone(rank) -> None:
    # Issue 41: a node asks the shared directory about an entry once a window, not each rank
    # each lookup; within it the node's copy of the same key (the same program) serves.
    key = key_of("refreshed")
    a0, _ = rank(0, "a")
    b0, _ = rank(1, "b")
    a0.publish(make_entry(key, b"first"))
    first = a0.stamp(key)
    a1, c1 = rank(2, "a")
    assert a1.load(key, IDENT).binaries == (b"first",)
    assert c1 == {"node_reads": 1}
    b0.publish(make_entry(key, b"second, with more variants"))  # another node's refresh
    entry, stamp = a1.lookup(key, IDENT)
    # The copy's own file's stamp: a write that follows sees the entry written since.
    assert entry.binaries == (b"first",) and stamp == first != a1.stamp(key)
    _age_records(a1)
    assert a1.load(key, IDENT).binaries == (b"second, with more variants",)
    assert c1 == {"node_reads": 2, "shared_reads": 1}
    copies = list(a1.node.root.rglob(f"*{COPY_SUFFIX}"))
    assert len(copies) == 1, copies  # the old copy went with the new one
    b0.remove(key)
    _age_records(a1)
    assert a1.load(key, IDENT) is None  # the copy of a removed entry is not a hit after it
    # A removal here (a refused entry) is looked at again at once by the node's next lookup.
    a0.publish(make_entry(key, b"third"))
    a2, _ = rank(3, "a")
    assert a2.load(key, IDENT).binaries == (b"third",)
    a2.remove(key)
    assert a2.load(key, IDENT) is None


def test_a_node_asks_the_shared_directory_about_an_entry_once_a_window(rank, monkeypatch) -> None:
    key = key_of("asked once")
    w, _ = rank(0, "w")
    w.publish(make_entry(key, b"payload"))
    shared = str(w.path_for(key))
    asked: list[str] = []
    real = os.lstat
    monkeypatch.setattr(os, "lstat", lambda p, *a, **k: (asked.append(os.fspath(p)), real(p, *a, **k))[1])
    for r in range(1, 6):
        s, _ = rank(r, "a")
        assert s.load(key, IDENT).binaries == (b"payload",)
    assert asked.count(shared) == 1  # the node's first lookup; the others took what it saw
    # A record that does not parse, or is not the user's own file: asked again, never trusted.
    (record,) = s.node.root.rglob("*.seen")
    record.write_bytes(b"1 2 x 4")
    assert s.load(key, IDENT).binaries == (b"payload",) and asked.count(shared) == 2


def test_ranks_reading_a_copy_mark_the_shared_entry_used_about_once_an_hour_a_node(rank) -> None:
    key = key_of("marks")
    w, _ = rank(0, "w")
    w.publish(make_entry(key, b"payload"))
    shared = w.path_for(key)
    os.utime(shared, (1000, 2000))
    a1, _ = rank(1, "a")
    assert a1.load(key, IDENT) is not None
    a1.touch(key)  # the rank that read the shared file marks it
    assert os.stat(shared).st_atime > 1000
    os.utime(shared, (1000, 2000))
    a2, c2 = rank(2, "a")
    assert a2.load(key, IDENT) is not None and c2 == {"node_reads": 1}
    a2.touch(key)  # its node marked it just now (the copy is new): no metadata call there
    assert os.stat(shared).st_atime == 1000
    (copy,) = a2.node.root.rglob(f"*{COPY_SUFFIX}")
    os.utime(copy, (time.time(), time.time() - 2 * 3600))
    a2.touch(key)  # an hour later: marked again, once
    assert os.stat(shared).st_atime > 1000 and time.time() - copy.stat().st_mtime < 600


def test_a_damaged_copy_is_dropped_and_copied_again(rank) -> None:
    key = key_of("torn copy")
    a0, _ = rank(0, "a")
    a0.publish(make_entry(key, b"payload"))
    (copy,) = a0.node.root.rglob(f"*{COPY_SUFFIX}")
    copy.write_bytes(copy.read_bytes()[:-7])
    a1, c1 = rank(1, "a")
    assert a1.load(key, IDENT).binaries == (b"payload",)
    assert c1 == {"shared_reads": 1}
    a2, c2 = rank(2, "a")
    assert a2.load(key, IDENT).binaries == (b"payload",)
    assert c2 == {"node_reads": 1}


HOLD = r"""
import sys, time
from pathlib import Path
from asyncclcache.locks import take
c = take(sys.argv[1], Path(sys.argv[2]))
print("held" if c else "not held", flush=True)
time.sleep(120)
"""


def test_a_rank_never_waits_for_the_one_copying(rank) -> None:
    key = key_of("busy copier")
    a0, _ = rank(0, "a")
    a0.publish(make_entry(key, b"payload"))
    for copy in a0.node.root.rglob(f"*{COPY_SUFFIX}"):
        copy.unlink()
    # Another process of the node holds the key's claim (copying, stopped, stuck).
    lock = a0.node.root / key[:2] / f"{key}.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, key, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        a1, c1 = rank(1, "a")
        t0 = time.monotonic()
        assert a1.load(key, IDENT).binaries == (b"payload",)
        # It waited no longer than a read of its own takes (at most WAIT_BOUNDS[1]), then read
        # the shared file itself: the holder holds it for 120 s.
        assert time.monotonic() - t0 < 30
        assert c1 == {"shared_reads": 1}
        assert not list(a0.node.root.rglob(f"*{COPY_SUFFIX}"))  # the holder's to make
    finally:
        holder.kill()
        holder.wait()
    a2, c2 = rank(2, "a")
    a2.load(key, IDENT)
    assert c2 == {"shared_reads": 1} and len(list(a0.node.root.rglob(f"*{COPY_SUFFIX}"))) == 1


def test_ranks_that_reach_an_entry_together_read_it_once_a_node(rank, monkeypatch) -> None:
    """SPMD ranks after a barrier: the rank that finds another copying waits for that copy
    (no longer than a read of its own takes) instead of reading the shared entry too."""
    from asyncclcache import nodecopies

    key = key_of("together")
    w, _ = rank(0, "w")
    w.publish(make_entry(key, b"payload"))
    holder, _ = rank(1, "a")
    # The bound of the wait is a time; here it cannot be what decides (10 s).
    monkeypatch.setattr(nodecopies, "FIRST_WAIT", 10.0)
    waiter, wc = rank(2, "a")
    claim = holder.node.claim(key)  # the holder is copying ...
    assert claim is not None
    polls = []

    def holder_finishes(seconds: float) -> None:  # ... and finishes while the waiter polls
        polls.append(seconds)
        if len(polls) == 1:
            r = holder.read(key)
            holder.node.write(key, holder.stamp(key), r.data)
            claim.release()

    monkeypatch.setattr(nodecopies.time, "sleep", holder_finishes)
    assert waiter.load(key, IDENT).binaries == (b"payload",)
    assert wc == {"node_reads": 1} and len(polls) == 1


KILLED_WHILE_COPYING = r"""
import os, signal, sys
from pathlib import Path
os.environ["ASYNCCLCACHE_TEST_NODE"] = "a"
from asyncclcache import fileio, nodecopies
from asyncclcache.store import Store
real = fileio.atomic_write
def half_then_die(directory, target, data, *a, **kw):
    def die(tmp):
        with open(tmp, "wb") as f:
            f.write(data[: len(data) // 2])
        os.kill(os.getpid(), signal.SIGKILL)
    return real(directory, target, data, die, **kw)
nodecopies.atomic_write = half_then_die
s = Store(sys.argv[1], rank=int(sys.argv[2]))
s.load(sys.argv[3])
"""


def test_a_rank_killed_while_copying_leaves_no_copy_and_no_claim(rank, tmp_path) -> None:
    key = key_of("killed copier")
    b0, _ = rank(0, "b")
    b0.publish(make_entry(key, b"payload" * 1000))
    env = dict(os.environ, ASYNCCLCACHE_NODE_DIR=str(tmp_path / "node-local"),
               PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", KILLED_WHILE_COPYING, str(tmp_path / "shared"), "1", key],
                       env=env, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == -signal.SIGKILL, r.stderr
    a1, c1 = rank(2, "a")
    assert not list(a1.node.root.rglob(f"*{COPY_SUFFIX}"))  # only a temp file: no torn copy
    left = [p for p in a1.node.root.rglob("*") if p.is_file()]
    assert left and all(p.name.endswith((".partial", ".lock")) for p in left), left
    assert a1.load(key, IDENT).binaries == (b"payload" * 1000,)
    assert c1 == {"shared_reads": 1}  # the dead rank's claim went with it
    # The dead copier's temp (and lock) file go with the next sweep, as in the shared directory.
    assert maintenance.sweep(a1.node.storage) >= 1
    assert not [p for p in a1.node.root.rglob("*") if p.is_file() and p.name.endswith(".partial")]
    a2, c2 = rank(3, "a")
    assert a2.load(key, IDENT) is not None and c2 == {"node_reads": 1}


def test_an_unusable_node_dir_warns_once_and_the_shared_copy_serves(rank, tmp_path, monkeypatch) -> None:
    key = key_of("no node dir")
    a0, _ = rank(0, "a")
    a0.publish(make_entry(key, b"payload"))
    blocker = tmp_path / "a file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("ASYNCCLCACHE_NODE_DIR", str(blocker / "node"))
    with pytest.warns(NodeDirWarning, match="reading entries from the shared directory") as record:
        a1, c1 = rank(1, "a")
    assert len(record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            assert a1.load(key, IDENT).binaries == (b"payload",)
    assert c1 == {"shared_reads": 3}  # each a read of the shared directory, counted
    assert blocker.read_text() == "not a directory"


def test_a_full_node_dir_warns_once_and_the_shared_copy_serves(rank, tmpfs, monkeypatch) -> None:
    mnt = tmpfs("mode=0700,size=64k")
    monkeypatch.setenv("ASYNCCLCACHE_NODE_DIR", str(mnt))
    keys = [key_of(f"big {i}") for i in range(3)]
    writer, _ = rank(0, "w", node_copies=False)
    for k in keys:
        writer.publish(make_entry(k, os.urandom(40_000)))
    a1, c1 = rank(1, "a")
    with pytest.warns(NodeDirWarning, match="No space left") as record:
        got = [a1.load(k, IDENT) for k in keys]
    assert all(e is not None for e in got) and len(record) == 1
    assert c1 == {"shared_reads": 3}
    # Nothing half-written is left to be read as a copy.
    assert not [p for p in mnt.rglob("*") if p.is_file() and p.suffix not in (COPY_SUFFIX, ".lock", ".seen")]


def test_a_read_only_node_dir_warns_once(rank, tmpfs, monkeypatch) -> None:
    mnt = tmpfs("ro,mode=0755,size=1m")
    monkeypatch.setenv("ASYNCCLCACHE_NODE_DIR", str(mnt / "node"))
    key = key_of("read-only node")
    writer, _ = rank(0, "w", node_copies=False)
    writer.publish(make_entry(key))
    with pytest.warns(NodeDirWarning, match="Read-only"):
        a1, _ = rank(1, "a")
    assert a1.load(key, IDENT) is not None


def test_copies_are_pruned_to_their_bound_least_recently_used_first(tmp_path) -> None:
    node = NodeCopies(SharedDir(tmp_path / "shared"), node_base(str(tmp_path / "node")), max_bytes=25_000)
    for i in range(4):
        node.put(key_of(f"c{i}"), (1, i, 10_000, i), b"x" * 10_000)
        os.utime(node._copy_path(key_of(f"c{i}"), (1, i, 10_000, i)), (1000 + i, 1000 + i))
    node.copy(key_of("c0"), (1, 0, 10_000, 0))  # used now: kept
    assert maintenance.prune(node.storage, max_size=node.max_bytes).removed == 2
    left = sorted(p.name.split("-")[0] for p in node.root.rglob(f"*{COPY_SUFFIX}"))
    assert left == sorted([key_of("c0"), key_of("c3")])


# {{{ issue 33, cases 1-4: node copies that cannot be used, the node's bound, import, a parent folder


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every wait of a lookup for another rank's copy (:meth:`NodeCopies.wait_for`)."""
    seen: list[str] = []
    real = NodeCopies.wait_for

    def counted(self: NodeCopies, key: str, stamp: Any) -> Any:
        seen.append(key)
        return real(self, key, stamp)

    monkeypatch.setattr(NodeCopies, "wait_for", counted)
    return seen


@pytest.mark.parametrize("how", ["a file", "another user's link", "another user's folder", "full"])
def test_a_process_that_cannot_use_its_node_folder_never_waits_for_copies(
    rank, tmp_path, tmpfs, monkeypatch, waits, how,
) -> None:
    keys = [key_of(f"unusable {how} {i}") for i in range(3)]
    writer, _ = rank(0, "w", node_copies=False)
    for k in keys:
        writer.publish(make_entry(k, os.urandom(40_000)))
    parent = tmp_path / "scratch"
    parent.mkdir()
    os.chmod(parent, 0o1777)  # as /tmp: others may make things in it
    top = parent / f"asyncclcache-{os.getuid()}"
    if how == "a file":
        parent = tmp_path / "a file"
        parent.write_text("not a directory")
    elif how == "another user's link":
        (tmp_path / "theirs").mkdir(mode=0o700)
        top.symlink_to(tmp_path / "theirs")
    elif how == "another user's folder":
        if os.getuid() != 0:
            pytest.skip("making a folder of another user needs root")
        top.mkdir(mode=0o700)
        os.chown(top, 65534, 65534)
    else:  # full: the first copy fails, the folder is given up then
        parent = tmpfs("mode=1777,size=64k")
    monkeypatch.setenv("ASYNCCLCACHE_NODE_DIR", str(parent))
    with pytest.warns(NodeDirWarning) as record:
        a1, c1 = rank(1, "a")
        got = [a1.load(k, IDENT) for _ in range(3) for k in keys]
    assert all(e is not None for e in got) and len(record) == 1, record
    assert c1.get("shared_reads") == 9
    # The first lookup of the full folder found no copy and nobody copying (its own claim):
    # nothing else waited; no lookup waits for a copy that cannot come.
    assert waits == [], waits
    if how == "another user's link":
        assert not list((tmp_path / "theirs").iterdir())  # nothing written through it


def test_the_node_bound_covers_every_copy_on_the_node(tmp_path, monkeypatch) -> None:
    import asyncclcache as acc

    node_dir = tmp_path / "node"
    # Copies of a cache directory that was removed since, and of another one still there.
    for gone in ("removed", "other"):
        old = NodeCopies(SharedDir(tmp_path / gone), node_base(str(node_dir)))
        for i in range(5):
            old.put(key_of(f"{gone} {i}"), (1, i, 30_000, i), os.urandom(30_000))
    monkeypatch.setenv("ASYNCCLCACHE_NODE_DIR", str(node_dir))
    monkeypatch.setenv("ASYNCCLCACHE_NODE_COPIES", "1")
    monkeypatch.setenv("ASYNCCLCACHE_NODE_MAX_SIZE", "1K")
    get_config.cache_clear()
    try:
        cache = acc.Cache(tmp_path / "current")
        assert cache.store.node is not None and cache.store.node.enabled
        cache.close()
    finally:
        monkeypatch.undo()
        get_config.cache_clear()
    left = [p for p in node_dir.rglob("*") if p.is_file() and p.name.endswith(COPY_SUFFIX)]
    assert sum(p.stat().st_size for p in left) <= 1024, left


def test_import_makes_no_node_copies(tmp_path) -> None:
    src = Store(tmp_path / "src", rank_local=False, node_copies=False)
    for i in range(4):
        src.publish(make_entry(key_of(f"imported {i}"), os.urandom(30_000)))
    archive = tmp_path / "cache.tar"
    env = dict(os.environ, ASYNCCLCACHE_NODE_DIR=str(tmp_path / "node"), SLURM_PROCID="0", SLURM_NTASKS="1",
               ASYNCCLCACHE_NODE_COPIES="1", ASYNCCLCACHE_NODE_MAX_SIZE="1K")
    for args in (["export", "--dir", str(tmp_path / "src"), str(archive)],
                 ["import", "--dir", str(tmp_path / "dst"), str(archive)]):
        r = subprocess.run([sys.executable, "-m", "asyncclcache", *args], capture_output=True, text=True,
                           env=env, timeout=120, check=False)
        assert r.returncode == 0, r.stderr
    assert len(list(Store(tmp_path / "dst", rank_local=False, node_copies=False).entries())) == 4
    assert not [p for p in (tmp_path / "node").rglob("*") if p.is_file()]


def test_a_parent_folder_such_as_tmp_gets_a_folder_of_ours(rank, tmp_path, monkeypatch) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    os.chmod(scratch, 0o1777)  # as /tmp or /local/scratch
    monkeypatch.setenv("ASYNCCLCACHE_NODE_DIR", str(scratch))
    key = key_of("in /tmp")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        writer, _ = rank(0, "a")
        writer.publish(make_entry(key, b"payload"))
        a1, c1 = rank(1, "a")
        assert a1.load(key, IDENT).binaries == (b"payload",)
    assert c1 == {"node_reads": 1}
    top = scratch / f"asyncclcache-{os.getuid()}"
    assert a1.node.root.is_relative_to(top) and oct(top.stat().st_mode & 0o777) == "0o700"
    assert node_base(str(scratch)).top == top and node_base().top.name == top.name
    # A folder given that does not exist yet is made, with ours in it.
    monkeypatch.setenv("ASYNCCLCACHE_NODE_DIR", str(tmp_path / "new" / "place"))
    b, _ = rank(2, "b")
    assert b.node.enabled and b.node.root.is_relative_to(tmp_path / "new" / "place" / top.name)

# }}}


def test_node_identity_order(monkeypatch) -> None:
    assert detect_node({"ASYNCCLCACHE_TEST_NODE": "sim1", "SLURMD_NODENAME": "n7"}) == "sim1"
    assert detect_node({"SLURMD_NODENAME": "n7"}) == "n7"
    assert detect_node({}) == socket.gethostname()


# }}}

# {{{ real jobs


@pytest.fixture(scope="session")
def strace() -> None:
    if shutil.which("strace") is None:
        need("strace", "counting file operations needs strace (apt-get install strace)")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_slurm.Slurm]:
    if os.geteuid() == 0 and (missing := _slurm.missing()):  # without root it skips below, for that
        need("Slurm", missing)
    got = _slurm.start(tmp_path_factory.mktemp("slurm"))
    if isinstance(got, str):
        pytest.skip(got)
    yield got
    got.stop()


def _job_env(tmp_path: Path, nodes: int, **extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tests") + os.pathsep + os.environ.get("PYTHONPATH", ""),
               ASYNCCLCACHE_DIR=str(tmp_path / "shared"), ASYNCCLCACHE_NODE_DIR=str(tmp_path / "node-local"),
               ACC_TEST_NODES=str(nodes), ACC_TEST_START_AT=str(time.time() + 2))
    env.update(extra)
    return env


def _rows(out: Path, job: str) -> list[dict[str, Any]]:
    rows = [json.loads(p.read_text()) for p in sorted(out.glob(f"{job}-rank*.json"))]
    assert all(r["ok"] and r["flushed"] for r in rows), rows
    return rows


def _sum(rows: list[dict[str, Any]], name: str) -> int:
    return sum(int(r["stats"][name]) for r in rows)


def _mpijob(tmp_path: Path, n: int, job: str, programs: int, nodes: int = 1, *, mpi: bool = False,
            strace: Path | None = None, strace_calls: str = "open,openat",
            **env: str) -> tuple[list[dict[str, Any]], str]:
    exe = _mpiexec()
    if exe is None:
        need("MPI", "MPI cannot start here (no mpiexec: pip install '.[mpi]')")
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    argv = [exe, "-n", str(n), sys.executable, str(ROOT / "tests" / "_rankjob.py"), str(out), job,
            str(programs), *(["mpi"] if mpi else [])]
    if strace is not None:
        argv = ["strace", "-f", "-y", "-qq", "-e", f"trace={strace_calls}", "-o", str(strace), *argv]
    r = subprocess.run(argv, capture_output=True, text=True, env=_job_env(tmp_path, nodes, **env),
                       timeout=600, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    return _rows(out, job), r.stderr


def _entries(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "shared").rglob(f"*{ENTRY_SUFFIX}"))


def test_mpi_a_job_of_more_ranks_hits_every_program_one_entry_each(tmp_path) -> None:
    cold, _ = _mpijob(tmp_path, 2, "cold", 3)
    # One entry per program, whatever the rank count; one first write each (the claims). A
    # refresh is a rewrite of the same entry (a snapshot taken before a slow launch's
    # variant, under load), counted apart: not a second rank writing the key.
    assert len(_entries(tmp_path)) == 3
    assert _sum(cold, "writes") - _sum(cold, "refreshes") == 3, [r["stats"] for r in cold]
    assert {r["directory"] for r in cold} == {str(tmp_path / "shared" / "v1")}
    warm, _ = _mpijob(tmp_path, 4, "warm", 3)
    # The cold job's entries hold every variant its launches made: nothing to refresh.
    assert [r["stats"]["hits"] for r in warm] == [3, 3, 3, 3], [r["stats"] for r in warm]
    assert _sum(warm, "misses") == 0 and _sum(warm, "writes") == 0, [r["stats"] for r in warm]
    assert len(_entries(tmp_path)) == 3


@pytest.mark.usefixtures("strace")
def test_mpi_each_node_reads_the_shared_directory_and_the_next_job_reads_nothing_there(tmp_path) -> None:
    _mpijob(tmp_path, 2, "cold", 3, ASYNCCLCACHE_NODE_COPIES="0")  # the warm job's nodes start bare
    trace = tmp_path / "strace"
    warm, line = _mpijob(tmp_path, 4, "warm", 3, nodes=2, mpi=True, strace=trace,
                         ASYNCCLCACHE_STATS="1")
    shared = str(tmp_path / "shared")
    opened = [ln for ln in trace.read_text().splitlines()
              if shared in ln and ENTRY_SUFFIX + '"' in ln and "ENOENT" not in ln]
    # The counter is the opens: every read of an entry file in the shared directory.
    assert len(opened) == _sum(warm, "shared_reads")
    by_node: dict[str, int] = {}
    for r in warm:
        by_node[r["node"]] = by_node.get(r["node"], 0) + int(r["stats"]["shared_reads"])
        assert r["stats"]["hits"] == 3
    # Each node read each entry at least once, and at most once a rank (a rank that came
    # while another copied did not wait); the job's line says how many, node by node.
    assert sorted(by_node) == ["sim0", "sim1"]
    assert all(3 <= n <= 6 for n in by_node.values()), by_node
    m = re.search(r"read from the shared directory per node: sim0 (\d+), sim1 (\d+)", line)
    assert m is not None, line
    assert [int(m.group(1)), int(m.group(2))] == [by_node["sim0"], by_node["sim1"]]
    # The next job on these nodes reads nothing from the shared directory.
    trace2 = tmp_path / "strace2"
    again, _ = _mpijob(tmp_path, 4, "again", 3, nodes=2, strace=trace2)
    assert _sum(again, "shared_reads") == 0 and _sum(again, "node_reads") == 12
    assert not [ln for ln in trace2.read_text().splitlines()
                if shared in ln and ENTRY_SUFFIX + '"' in ln and "ENOENT" not in ln]


def test_mpi_two_jobs_at_once_on_one_node(tmp_path) -> None:
    exe = _mpiexec()
    if exe is None:
        need("MPI", "MPI cannot start here (no mpiexec: pip install '.[mpi]')")
    out = tmp_path / "out"
    out.mkdir()
    env = _job_env(tmp_path, 1)
    jobs = [subprocess.Popen([exe, "-n", "2", sys.executable, str(ROOT / "tests" / "_rankjob.py"), str(out),
                              f"job{j}", "3"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for j in range(2)]
    for p in jobs:
        assert p.wait(timeout=600) == 0, p.stdout.read() if p.stdout else ""
    rows = _rows(out, "job0") + _rows(out, "job1")
    assert len(rows) == 4
    assert _sum(rows, "hits") + _sum(rows, "misses") == 12
    assert len(_entries(tmp_path)) == 3
    assert maintenance.verify(Store(tmp_path / "shared", create=False)) == []
    warm, _ = _mpijob(tmp_path, 2, "warm", 3)
    assert _sum(warm, "hits") == 6


def test_slurm_rank_and_node_from_srun_and_a_rank_count_change(slurm, tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    job = [sys.executable, str(ROOT / "tests" / "_rankjob.py"), str(out)]
    env = _job_env(tmp_path, 0)
    env.pop("ASYNCCLCACHE_TEST_NODE", None)
    r = slurm.srun(2, *job, "cold", "3", env=env)
    assert r.returncode == 0, r.stdout + r.stderr + slurm.logs()
    cold = _rows(out, "cold")
    # Rank and node from Slurm alone (no MPI here): SLURM_PROCID, SLURMD_NODENAME.
    assert sorted(row["rank"] for row in cold) == [0, 1]
    assert {row["node"] for row in cold} == {socket.gethostname().split(".")[0]}
    assert len(_entries(tmp_path)) == 3
    env["ACC_TEST_START_AT"] = str(time.time() + 2)
    r = slurm.srun(4, *job, "warm", "3", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    warm = _rows(out, "warm")
    assert [row["stats"]["hits"] for row in warm] == [3, 3, 3, 3]
    assert _sum(warm, "misses") == 0 and len(_entries(tmp_path)) == 3
    # The same node: the cold job's writers left their entries' copies here, so the warm
    # job read nothing from the shared directory.
    assert (_sum(warm, "shared_reads"), _sum(warm, "node_reads")) == (0, 12)


def test_slurm_an_unwritable_node_dir_each_rank_warns_once_and_hits(slurm, tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    job = [sys.executable, str(ROOT / "tests" / "_rankjob.py"), str(out)]
    assert slurm.srun(2, *job, "cold", "3", env=_job_env(tmp_path, 0)).returncode == 0
    blocker = tmp_path / "not a folder"
    blocker.write_text("x")
    env = _job_env(tmp_path, 0, ASYNCCLCACHE_NODE_DIR=str(blocker / "node"), PYTHONWARNINGS="always")
    r = slurm.srun(2, *job, "warm", "3", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    warm = _rows(out, "warm")
    assert [row["stats"]["hits"] for row in warm] == [3, 3]
    assert _sum(warm, "shared_reads") == 6  # each rank read the shared directory itself
    assert r.stderr.count("NodeDirWarning") == 2, r.stderr  # once a rank
    assert blocker.read_text() == "x"


KILL_RANK_1 = r"""
import os, runpy, signal, sys
if os.environ.get("SLURM_PROCID") == "1":
    import asyncclcache.cache as c
    real = c.Cache._missed
    def die(self, *a, **kw):
        real(self, *a, **kw)
        os.kill(os.getpid(), signal.SIGKILL)  # in the middle: a build done, its entry on its way
    c.Cache._missed = die
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_slurm_a_rank_killed_in_the_middle(slurm, tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    env = _job_env(tmp_path, 2)
    wrapper = tmp_path / "kill_rank_1.py"
    wrapper.write_text(KILL_RANK_1)
    r = slurm.srun(4, "--kill-on-bad-exit=0", sys.executable, str(wrapper), str(ROOT / "tests" / "_rankjob.py"),
                   str(out), "killed", "3", env=env)
    assert r.returncode != 0  # srun says a task died
    rows = _rows(out, "killed")
    assert sorted(row["rank"] for row in rows) == [0, 2, 3]
    store = Store(tmp_path / "shared", create=False)
    assert maintenance.verify(store) == []
    env["ACC_TEST_START_AT"] = str(time.time() + 2)
    r = slurm.srun(4, sys.executable, str(ROOT / "tests" / "_rankjob.py"), str(out), "after", "3", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    after = _rows(out, "after")
    assert _sum(after, "hits") + _sum(after, "misses") == 12
    assert len(_entries(tmp_path)) == 3


# }}}


# {{{ issue 34: O(1) operations a rank on the shared directory, whatever it holds


def _shared_ops(trace: Path, shared: str) -> dict[str, list[str]]:
    """Each system call on the shared directory in a job's trace (strace -f -y), by name."""
    out: dict[str, list[str]] = {}
    for line in trace.read_text(errors="replace").splitlines():
        if shared not in line or "resumed>" in line or " execve(" in line:
            continue
        m = re.match(r"\s*\d*\s*(\w+)\(", line)
        out.setdefault(m.group(1) if m else "?", []).append(line)
    return out


def _fill(shared: Path, n: int) -> None:
    """``n`` entries of another program in the shared directory, kept in order within the
    hour, as a cache in use is."""
    from asyncclcache.stats import add_lifetime

    store = Store(shared, rank_local=False, node_copies=False)
    for i in range(n):
        store.publish(make_entry(key_of(f"filler {i}"), b"x" * 500))
    add_lifetime(store.root, {"runs": 1, "hits": n})  # its processes counted
    maintenance.upkeep(store)


@pytest.mark.usefixtures("strace")
def test_mpi_a_job_neither_lists_nor_makes_the_shared_directory_and_counts_every_rank(tmp_path) -> None:
    from asyncclcache.stats import read_lifetime

    shared = tmp_path / "shared"
    _fill(shared, 300)
    root = str(shared / "v1")
    for job in ("cold", "warm"):
        trace = tmp_path / f"strace-{job}"
        rows, _ = _mpijob(tmp_path, 6, job, 3, nodes=2, strace=trace, strace_calls="%file,%desc")
        ops = _shared_ops(trace, str(shared))
        # No listing, no tree made again (a new fan-out folder for a new entry only), no lock
        # on the lifetime counters, no fsync but a written entry's: what its programs need.
        assert "getdents64" not in ops, {k: len(v) for k, v in ops.items()}
        made = [ln for ln in ops.get("mkdir", []) if "EEXIST" in ln or not re.search(r'/v1/[0-9a-f]{2}"', ln)]
        assert made == [] and (job == "cold" or "mkdir" not in ops), ops.get("mkdir")
        assert not any("stats.lock" in ln for v in ops.values() for ln in v)
        if job == "warm":
            assert [r["stats"]["hits"] for r in rows] == [3] * 6
            assert "fsync" not in ops and "flock" not in ops and "unlink" not in ops, ops.keys()
            # A rank: its lookups (one stat a program) and a few more; a node reads each entry once.
            shared_reads = _sum(rows, "shared_reads")
            assert sum(map(len, ops.values())) <= 6 * (3 + 8) + shared_reads * 12, {k: len(v) for k, v in ops.items()}
    assert read_lifetime(root)["runs"] == 1 + 12  # every rank of both jobs, none waited for another


def test_a_killed_writers_files_go_within_the_interval_not_at_every_job(tmp_path) -> None:
    from asyncclcache.fileio import HOST

    shared = tmp_path / "shared"
    _fill(shared, 20)
    store = Store(shared, rank_local=False, node_copies=False)
    fanout = store.path_for(key_of("filler 0")).parent
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    planted = [fanout / f".tmp-{HOST}-{int(dead.stdout)}-killed.partial", fanout / (key_of("gone") + ".lock")]
    for p in planted:
        p.write_bytes(b"")
    _mpijob(tmp_path, 2, "fresh", 2)  # kept in order within the hour: left for the upkeep
    assert all(p.exists() for p in planted)
    stamp = shared / "v1" / "upkeep.json"
    old = time.time() - maintenance.UPKEEP_INTERVAL - 60
    os.utime(stamp, (old, old))
    _mpijob(tmp_path, 2, "later", 3)  # the first to write, an interval later, keeps it
    assert not any(p.exists() for p in planted)
    assert not maintenance.last_upkeep(Store(shared, rank_local=False, node_copies=False)).due

# }}}
