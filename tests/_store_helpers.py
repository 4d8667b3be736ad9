"""What the ``test_store_*`` files share: made-up entries, file listings, the ``store``
fixture, and the ``_not_under_mpi`` fixture those files use for every test.

A test file imports the fixtures by name (``from _store_helpers import _not_under_mpi,
store_fixture``); pytest then finds them in its namespace, and ``_not_under_mpi`` is
autouse there (only there). ``tmpfs`` mounts small real file systems (full, read-only).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from asyncclcache.entry import Entry
from asyncclcache.errors import AsyncCLCacheWarning
from asyncclcache.ranks import RANK_ENV_VARS
from asyncclcache.store import LOCK_SUFFIX, TEMP_PREFIX, TEMP_SUFFIX, Store

IDENT = ({"platform_name": "test platform", "device_name": "test device", "driver_version": "1"},)
NOBODY = 65534


@pytest.fixture(autouse=True)
def _not_under_mpi(monkeypatch: pytest.MonkeyPatch) -> None:
    """The store tests assume no rank, unless a test sets one (children inherit this)."""
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


@pytest.fixture(name="store")
def store_fixture(cache_dir: Path) -> Store:
    """A store on an empty directory (the fixture ``store``)."""
    s = Store(cache_dir)
    assert s.enabled, s.problem
    return s


@pytest.fixture(name="tmpfs")
def tmpfs_fixture(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
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
