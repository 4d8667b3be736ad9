"""``asyncclcache export`` / ``import``: a cache travels as one tar archive.

The round trip is real (pocl builds, then a new node hits what was imported); the
refusals use hand-made archives, as a hostile or broken one would be.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from asyncclcache.entry import Entry, encode
from asyncclcache.store import Store
from conftest import child_json, run_child

BUILD = r"""
import json, sys
import asyncclcache as acc
from kernels import small_source, run_twice
from _pocl import pocl_context
cache = acc.Cache(sys.argv[1], rank_local=False)
ctx = pocl_context()
ok = all(run_twice(ctx, acc.Program(ctx, small_source(salt=f"ship-{i}"), cache=cache).build()) for i in range(3))
cache.flush(120)
print(json.dumps({"ok": ok, **cache.stats().as_dict()}))
cache.close()
"""


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "asyncclcache", *args], capture_output=True, text=True,
                          timeout=120, check=False)


def _key(i: int) -> str:
    return f"{i:02x}" + "c" * 62


def _entry(i: int, *, created: float = 1000.0, device: str = "pthread-cpu", payload: bytes = b"bin") -> Entry:
    return Entry(_key(i), (payload,), {"kind": "binary", "devices": [{"device_name": device}],
                                       "kernels": [f"k{i}"], "created": created})


def _files(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file()) if d.exists() else []


def _tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with tarfile.open(path, "w") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def _member(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o600
    return info, data


def test_export_import_new_node_hits_every_program(tmp_path, cache_dir):
    cold = child_json(run_child(BUILD, str(cache_dir)))
    assert cold["ok"] and cold["misses"] == 3 and cold["writes"] == 3
    archive = tmp_path / "cache.tar.gz"
    out = cli("export", "--dir", str(cache_dir), str(archive))
    assert out.returncode == 0 and "exported 3 entries" in out.stdout, out.stderr
    assert oct(archive.stat().st_mode & 0o777) == "0o600"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]

    other = tmp_path / "other-cluster"
    imp = cli("import", "--dir", str(other), str(archive))
    assert imp.returncode == 0, imp.stderr
    assert "imported 3 entries (3 added, 0 replaced, 0 kept)" in imp.stdout
    assert oct(other.stat().st_mode & 0o777) == "0o700"
    assert cli("verify", "--dir", str(other)).returncode == 0
    # A new node (fresh POCL_CACHE_DIR) on the imported directory: every program hits.
    warm = child_json(run_child(BUILD, str(other)))
    assert warm["ok"] and (warm["hits"], warm["misses"], warm["rejected"]) == (3, 0, 0)

    again = cli("import", "--dir", str(other), str(archive), "--json")
    assert again.returncode == 0
    assert '"kept": 3' in again.stdout and '"added": 0' in again.stdout


def test_export_filters_rank_shared_and_device(tmp_path):
    base = tmp_path / "acc"
    Store(base, rank_local=False).publish(_entry(1, device="pthread-cpu"))
    Store(base, rank_local=False).publish(_entry(2, device="NVIDIA H200"))
    Store(base, rank_local=True, rank=0).publish(_entry(3))
    Store(base, rank_local=True, rank=1).publish(_entry(4))

    def names(*args: str) -> list[str]:
        archive = tmp_path / f"x{len(args)}{'-'.join(args)}.tar"
        proc = cli("export", "--dir", str(base), *args, str(archive))
        assert proc.returncode == 0, proc.stderr
        with tarfile.open(archive) as tar:
            return sorted(tar.getnames())

    assert names() == sorted([f"v1/01/{_key(1)}.acl", f"v1/02/{_key(2)}.acl",
                              f"v1/rank-0/03/{_key(3)}.acl", f"v1/rank-1/04/{_key(4)}.acl"])
    assert names("--rank", "1") == [f"v1/rank-1/04/{_key(4)}.acl"]
    assert names("--shared") == [f"v1/01/{_key(1)}.acl", f"v1/02/{_key(2)}.acl"]
    assert names("--device", "h200") == [f"v1/02/{_key(2)}.acl"]
    assert cli("export", "--dir", str(base), "--rank", "7", str(tmp_path / "n.tar")).returncode == 2
    assert cli("export", "--dir", str(base), str(tmp_path / "n.zip")).returncode == 2

    # The rank layout survives the trip.
    target = tmp_path / "target"
    assert cli("import", "--dir", str(target), str(tmp_path / "x0.tar")).returncode == 0
    assert _files(target / "v1") == _files(base / "v1")


def test_export_leaves_out_damaged_entries(tmp_path):
    base = tmp_path / "acc"
    store = Store(base, rank_local=False)
    store.publish(_entry(1))
    store.publish(_entry(2))
    path = store.path_for(_key(2))
    data = bytearray(path.read_bytes())
    data[-40] ^= 1
    path.write_bytes(bytes(data))
    proc = cli("export", "--dir", str(base), str(tmp_path / "a.tar"))
    assert proc.returncode == 0
    assert "exported 1 entries" in proc.stdout and "left out 1 damaged" in proc.stdout
    with tarfile.open(tmp_path / "a.tar") as tar:
        assert tar.getnames() == [f"v1/01/{_key(1)}.acl"]


def test_import_keeps_newer_replaces_older_and_damaged(tmp_path):
    target = tmp_path / "acc"
    store = Store(target, rank_local=False)
    store.publish(_entry(1, created=5000.0, payload=b"local-newer"))
    store.publish(_entry(2, created=10.0, payload=b"local-older"))
    store.publish(_entry(3, created=9999.0, payload=b"local-damaged"))
    p3 = store.path_for(_key(3))
    p3.write_bytes(p3.read_bytes()[:-5])  # truncated: damaged, whatever its date
    archive = _tar(tmp_path / "in.tar", [
        _member(f"v1/{k[:2]}/{k}.acl", encode(e)) for e in
        (_entry(1, created=1000.0, payload=b"archive"), _entry(2, created=1000.0, payload=b"archive"),
         _entry(3, created=1000.0, payload=b"archive"), _entry(4, created=1000.0, payload=b"archive"))
        for k in [e.key]
    ])
    proc = cli("import", "--dir", str(target), str(archive))
    assert proc.returncode == 0, proc.stderr
    assert "imported 4 entries (1 added, 2 replaced, 1 kept)" in proc.stdout
    got = {i: store.read(_key(i)).entry.binaries[0] for i in (1, 2, 3, 4)}
    assert got == {1: b"local-newer", 2: b"archive", 3: b"archive", 4: b"archive"}


def test_import_ignores_lock_and_counter_files_of_a_hand_made_tar(tmp_path):
    # `tar -C dir -czf cache.tgz .` of a cache directory in use.
    src = tmp_path / "acc"
    Store(src, rank_local=False).publish(_entry(1))
    (src / "v1" / "stats.json").write_text("{}")
    (src / "v1" / "01" / f"{_key(1)}.lock").write_text("")
    archive = tmp_path / "hand.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(src, arcname=".")
    target = tmp_path / "target"
    proc = cli("import", "--dir", str(target), str(archive))
    assert proc.returncode == 0, proc.stderr
    assert "1 added" in proc.stdout and "ignored 2" in proc.stdout
    assert _files(target) == [f"v1/01/{_key(1)}.acl"]


def _good_members() -> list[tuple[tarfile.TarInfo, bytes | None]]:
    return [_member(f"v1/{_key(i)[:2]}/{_key(i)}.acl", encode(_entry(i))) for i in (1, 2)]


def _flipped(i: int) -> tuple[tarfile.TarInfo, bytes]:
    data = bytearray(encode(_entry(i)))
    data[len(data) // 2] ^= 0x10
    return _member(f"v1/{_key(i)[:2]}/{_key(i)}.acl", bytes(data))


def _link(name: str, target: str, hard: bool = False) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = tarfile.LNKTYPE if hard else tarfile.SYMTYPE
    info.linkname = target
    return info, None


def _fifo(name: str) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = tarfile.FIFOTYPE
    return info, None


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (_flipped(3), "damaged entry: checksum mismatch"),
        (_member(f"v1/../{_key(3)[:2]}/{_key(3)}.acl", encode(_entry(3))), "'..' in the path"),
        (_member(f"/tmp/v1/{_key(3)[:2]}/{_key(3)}.acl", encode(_entry(3))), "absolute path"),
        (_link(f"v1/{_key(3)[:2]}/{_key(3)}.acl", "/etc/passwd"), "a link (to '/etc/passwd')"),
        (_link(f"v1/{_key(3)[:2]}/{_key(3)}.acl", f"v1/01/{_key(1)}.acl", hard=True), "a link"),
        (_fifo(f"v1/{_key(3)[:2]}/{_key(3)}.acl"), "not a regular file"),
        (_member("v1/ab/payload.so", b"\x7fELF"), "not an entry of a v1 cache"),
        (_member(f"v1/ff/{_key(3)}.acl", encode(_entry(3))), "in the wrong directory for its key"),
        (_member(f"v1/{_key(3)[:2]}/{_key(3)}.acl", encode(_entry(4))), "holds another key"),
        (_member(f"v2/{_key(3)[:2]}/{_key(3)}.acl", encode(_entry(3))), "not an entry of a v1 cache"),
        (_member(f"v1/{_key(1)[:2]}/{_key(1)}.acl", encode(_entry(1))), "appears twice"),
    ],
    ids=["flipped-byte", "dotdot", "absolute", "symlink", "hardlink", "fifo", "foreign-file", "wrong-fanout",
         "other-key", "other-format", "duplicate"],
)
def test_import_refuses_a_tampered_archive_and_writes_nothing(tmp_path, bad, message):
    # The bad member comes last: everything before it was fine, and still nothing is written.
    archive = _tar(tmp_path / "bad.tar", [*_good_members(), bad])
    target = tmp_path / "target"
    existing = tmp_path / "existing"
    Store(existing, rank_local=False).publish(_entry(9))
    before = {p: p.read_bytes() for p in existing.rglob("*.acl")}
    for d in (target, existing):
        proc = cli("import", "--dir", str(d), str(archive))
        assert proc.returncode == 1, proc.stdout
        assert message in proc.stderr and "nothing was imported" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
    assert not target.exists()
    assert {p: p.read_bytes() for p in existing.rglob("*.acl")} == before
    assert _files(existing) == [f"v1/{_key(9)[:2]}/{_key(9)}.acl"]


def test_import_refuses_a_damaged_compressed_archive(tmp_path):
    good = _tar(tmp_path / "good.tar", _good_members())
    gz = tmp_path / "c.tar.gz"
    with tarfile.open(gz, "w:gz") as tar, tarfile.open(good) as src:
        for m in src:
            tar.addfile(m, src.extractfile(m))
    data = bytearray(gz.read_bytes())
    data[len(data) // 2] ^= 0xFF
    gz.write_bytes(bytes(data))
    target = tmp_path / "target"
    for archive in (gz, tmp_path / "missing.tar", tmp_path / "notatar.tar"):
        if archive.name == "notatar.tar":
            archive.write_bytes(b"plain text, not a tar\n" * 40)
        proc = cli("import", "--dir", str(target), str(archive))
        assert proc.returncode == 1 and "nothing was imported" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
    assert not target.exists()


def test_import_into_a_directory_that_is_not_a_cache_is_a_usage_error(tmp_path):
    archive = _tar(tmp_path / "a.tar", _good_members())
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("x")
    proc = cli("import", "--dir", str(home), str(archive))
    assert proc.returncode == 2 and "not an asyncclcache cache" in proc.stderr
    assert sorted(os.listdir(home)) == ["thesis.tex"]


def test_import_skips_a_key_another_process_is_writing(tmp_path):
    target = tmp_path / "acc"
    store = Store(target, rank_local=False)
    claim = store.claim(_key(1))  # held, as a writer in another process would
    assert claim is not None
    try:
        archive = _tar(tmp_path / "a.tar", _good_members())
        proc = cli("import", "--dir", str(target), str(archive))  # skips it, does not wait
        assert proc.returncode == 0, proc.stderr
        assert "1 added" in proc.stdout and "skipped 1 that another process was writing" in proc.stdout
    finally:
        claim.release()
    assert store.read(_key(1)).entry is None and store.read(_key(2)).entry is not None
