"""The ``asyncclcache`` command, run as a user runs it (``python -m asyncclcache``)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncclcache import __version__
from asyncclcache.entry import Entry
from asyncclcache.keys import FORMAT_VERSION
from asyncclcache.ranks import RANK_ENV_VARS
from asyncclcache.store import PublishResult, Store


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if k not in RANK_ENV_VARS}
    if env:
        e.update(env)
    return subprocess.run(
        [sys.executable, "-m", "asyncclcache", *args],
        capture_output=True,
        text=True,
        env=e,
        timeout=120,
        check=False,
    )


@pytest.fixture(autouse=True)
def _not_under_mpi(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in RANK_ENV_VARS:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def populated(cache_dir: Path) -> tuple[Path, int]:
    store = Store(cache_dir)
    total = 0
    for i in range(3):
        key = hashlib.sha256(b"cli %d" % i).hexdigest()
        entry = Entry(key, (b"x" * (1000 * (i + 1)),), {"devices": [{"device_name": "d"}]})
        assert store.publish(entry) is PublishResult.WRITTEN
        total += store.path_for(key).stat().st_size
    return cache_dir, total


def test_version() -> None:
    r = cli("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"asyncclcache {__version__}"


def test_help() -> None:
    r = cli("--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: asyncclcache")
    assert "info" in r.stdout
    assert "Exit codes" in r.stdout
    assert r.stderr == ""


def test_info_help() -> None:
    r = cli("info", "--help")
    assert r.returncode == 0, r.stderr
    assert "--dir" in r.stdout
    assert "--json" in r.stdout


def test_no_command_is_a_usage_error() -> None:
    r = cli()
    assert r.returncode == 2
    assert "usage: asyncclcache" in r.stdout + r.stderr
    assert "Traceback" not in r.stderr


def test_unknown_command_is_a_usage_error() -> None:
    r = cli("frobnicate")
    assert r.returncode == 2
    assert "invalid choice" in r.stderr
    assert "Traceback" not in r.stderr


def test_info_json_empty(cache_dir: Path) -> None:
    r = cli("info", "--dir", str(cache_dir), "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["directory"] == str(cache_dir / f"v{FORMAT_VERSION}")
    assert info["entries"] == 0
    assert info["bytes"] == 0
    assert info["format_version"] == FORMAT_VERSION
    assert info["asyncclcache"] == __version__
    assert info["rank"] is None
    assert info["rank_local"] is False
    assert info["strategy"] == "auto"
    assert info["max_size"] is None
    assert any(p["name"] == "Portable Computing Language" for p in info["platforms"])
    assert r.stderr == ""


def test_info_json_populated(populated: tuple[Path, int]) -> None:
    cache_dir, total = populated
    r = cli("info", "--dir", str(cache_dir), "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["entries"] == 3
    assert info["bytes"] == total


def test_info_json_reads_the_environment(populated: tuple[Path, int]) -> None:
    cache_dir, _ = populated
    r = cli(
        "info",
        "--json",
        env={"ASYNCCLCACHE_DIR": str(cache_dir), "ASYNCCLCACHE_MAX_SIZE": "2M"},
    )
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["directory"] == str(cache_dir / f"v{FORMAT_VERSION}")
    assert info["entries"] == 3
    assert info["max_size"] == 2 << 20


def test_info_json_rank_local(cache_dir: Path) -> None:
    r = cli("info", "--dir", str(cache_dir), "--json", env={"PMI_RANK": "3"})
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["rank"] == 3
    assert info["rank_local"] is True
    assert info["directory"] == str(cache_dir / f"v{FORMAT_VERSION}" / "rank-3")


def _field(text: str, name: str) -> str:
    for line in text.splitlines():
        if line.strip().startswith(name):
            return line.strip()[len(name) :].strip()
    raise AssertionError(f"no {name!r} line in:\n{text}")


def test_info_human_empty(cache_dir: Path) -> None:
    r = cli("info", "--dir", str(cache_dir))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == f"asyncclcache {__version__}"
    assert _field(r.stdout, "directory") == str(cache_dir / f"v{FORMAT_VERSION}")
    assert _field(r.stdout, "entries") == "0  (0B)"
    assert _field(r.stdout, "format") == f"v{FORMAT_VERSION}"
    assert _field(r.stdout, "max size") == "unlimited"
    assert "Portable Computing Language" in _field(r.stdout, "platform")


def test_info_human_populated(populated: tuple[Path, int]) -> None:
    cache_dir, total = populated
    r = cli("info", "--dir", str(cache_dir))
    assert r.returncode == 0, r.stderr
    entries = _field(r.stdout, "entries")
    assert entries.startswith("3  (")
    assert entries == f"3  ({total / 1024:.1f}K)"


@pytest.mark.parametrize("as_json", [False, True])
def test_info_on_a_regular_file(tmp_path: Path, as_json: bool) -> None:
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    r = cli("info", "--dir", str(f), *(["--json"] if as_json else []))
    assert r.returncode == 2
    assert r.stdout == ""
    assert "Traceback" not in r.stderr
    assert "cannot use cache directory" in r.stderr
    assert str(f) in r.stderr
    assert "not a directory" in r.stderr.lower()
    assert f.read_text() == "x"


def test_info_on_an_insecure_directory(cache_dir: Path) -> None:
    cache_dir.mkdir()
    cache_dir.chmod(0o777)
    r = cli("info", "--dir", str(cache_dir))
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "writable by group or others" in r.stderr
    assert os.listdir(cache_dir) == []
