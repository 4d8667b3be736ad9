"""Per-key claims (:mod:`asyncclcache.locks`): never two holders of one key.

A claim's lock file is removed by its holder on release, so a claimer may lock a file
that was just released and unlinked while another claimer locks the new file at the
path (filelock 3.12-3.20 let both hold the key). The claims are our own ``flock`` and
never import filelock (checked below), so the filelock version that pyproject allows
plays no part: the tests run without it.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import asyncclcache
from asyncclcache import locks

KEY = "k" * 64


def _held_by_someone(path: Path) -> bool:
    """True if the file ``path`` names is locked (by anyone but this probe)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _before_next_flock(monkeypatch: pytest.MonkeyPatch, action: Callable[[], None]) -> None:
    """Run ``action`` once, just before the next exclusive ``flock``: between a claimer's
    ``open`` of the lock file and its ``flock``, where another process may act."""
    real = fcntl.flock
    armed = [True]

    def flock(fd: int, op: int) -> None:
        if armed[0] and op & fcntl.LOCK_EX:
            armed[0] = False
            action()
        real(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)


def test_a_released_and_removed_file_is_not_a_claim_while_its_replacement_is_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A holds; B opens the lock file; A releases (unlinks, unlocks); C creates a new
    lock file and locks it; then B's flock runs and succeeds, on the unlinked file. B
    must not hold the key: C does."""
    path = tmp_path / f"{KEY}.lock"
    a = locks.take(KEY, path)
    assert a is not None
    c_fd: list[int] = []

    def a_releases_c_claims() -> None:
        a.release()
        assert not path.exists()
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)  # C, another process
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        c_fd.append(fd)

    _before_next_flock(monkeypatch, a_releases_c_claims)
    try:
        b = locks.take(KEY, path)
        assert c_fd, "the race was not staged"
        assert b is None, "B holds the key on the unlinked lock file while C holds the new one"
    finally:
        for fd in c_fd:
            os.close(fd)


def test_a_claimer_that_locked_a_removed_file_claims_the_path_instead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above without C: B ends up holding the file the path names, not the unlinked
    one, so that the next claimer finds the key held."""
    path = tmp_path / f"{KEY}.lock"
    a = locks.take(KEY, path)
    assert a is not None
    _before_next_flock(monkeypatch, a.release)
    b = locks.take(KEY, path)
    assert b is not None
    monkeypatch.undo()
    assert path.exists() and _held_by_someone(path)
    assert locks.take(KEY, path) is None
    b.release()
    assert not path.exists()
    assert locks.take(KEY, path) is not None


def test_a_probe_never_removes_a_replacement(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep's probe opens a stale lock file; meanwhile it is removed and a new one is
    created and held. The probe then locks the stale file: it must leave the new one."""
    path = tmp_path / f"{KEY}.lock"
    path.touch(mode=0o600)
    new_fd: list[int] = []

    def replaced_and_held() -> None:
        path.unlink()
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        new_fd.append(fd)

    _before_next_flock(monkeypatch, replaced_and_held)
    try:
        assert locks.unheld(path, remove=True) is False
        assert new_fd and path.exists()
        assert os.path.samestat(os.fstat(new_fd[0]), os.lstat(path))
    finally:
        for fd in new_fd:
            os.close(fd)
    assert locks.unheld(path, remove=True) is True
    assert not path.exists()


def test_claims_in_one_process_exclude_each_other_and_leave_no_file(tmp_path: Path) -> None:
    path = tmp_path / f"{KEY}.lock"
    a = locks.take(KEY, path)
    assert a is not None
    assert locks.take(KEY, path) is None  # a second claim in one process is refused too
    assert locks.unheld(path, remove=True) is False and path.exists()
    a.release()
    a.release()  # idempotent
    assert not path.exists()
    b = locks.take(KEY, path)
    assert b is not None
    del b  # dropped unreleased: freed when collected
    assert not path.exists()
    assert locks.take(KEY, path) is not None


def test_claim_follows_no_link(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    path = tmp_path / f"{KEY}.lock"
    path.symlink_to(target)
    with pytest.raises(OSError):
        locks.take(KEY, path)
    assert not target.exists()


HAMMER = r"""
import json, os, sys, time
from pathlib import Path
from asyncclcache.locks import take, unheld
path, log, start, seconds, role = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
fd = os.open(log, os.O_WRONLY | os.O_APPEND)
enter, leave = f"+ {os.getpid()}\n".encode(), f"- {os.getpid()}\n".encode()
while time.time() < start:
    time.sleep(0.001)
held = tries = 0
while time.time() < start + seconds:
    tries += 1
    if role == "sweep":
        unheld(path, remove=True)
        continue
    claim = take("k" * 64, path)
    if claim is None:
        continue
    os.write(fd, enter)   # one write each, O_APPEND: the log's order is the order of events
    held += 1
    if held % 4 == 0:
        time.sleep(0.0002)   # a holder descheduled while it holds
    os.write(fd, leave)
    claim.release()
print(json.dumps({"held": held, "tries": tries, "filelock": "filelock" in sys.modules}))
"""


def test_processes_hammering_one_key_are_never_two_holders(tmp_path: Path) -> None:
    """Four claimers and a sweeper on one key for 2 s, logging each hold's start and end
    to one O_APPEND file: never two holders at once, no lock file left, no filelock."""
    path = tmp_path / f"{KEY}.lock"
    log = tmp_path / "holds.log"
    log.touch()
    src = str(Path(asyncclcache.__file__).resolve().parent.parent)  # the package under test
    env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.time() + 1.0  # all started (imports done) before the first claim
    roles = ["claim"] * 4 + ["sweep"]
    procs = [
        subprocess.Popen([sys.executable, "-c", HAMMER, str(path), str(log), str(start), "2.0", role],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for role in roles
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out))
    holders: set[str] = set()
    overlaps = []
    lines = log.read_text().splitlines()
    for i, line in enumerate(lines):
        op, pid = line.split()
        if op == "+":
            if holders:
                overlaps.append((i, sorted(holders), pid))
            holders.add(pid)
        else:
            holders.discard(pid)
    assert not overlaps, f"{len(overlaps)} holds began while another was held (line, holders, newcomer): {overlaps[:5]}"
    claimers = results[:4]
    assert sum(r["held"] for r in claimers) > 100, results
    assert sum(r["held"] > 0 for r in claimers) >= 2, results  # the key really changed hands
    assert results[4]["tries"] > 100, results  # the sweeper really probed alongside
    assert not any(r["filelock"] for r in results), "claims imported filelock: its version would matter"
    assert not path.exists()  # each holder removed its file
