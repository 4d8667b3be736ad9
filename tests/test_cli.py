"""The ``asyncclcache`` command, run as a user runs it (``python -m asyncclcache``)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from asyncclcache import __version__
from asyncclcache.entry import Entry
from asyncclcache.keys import FORMAT_VERSION
from asyncclcache.ranks import RANK_ENV_VARS
from asyncclcache.stats import add_lifetime, fold_lifetime, read_lifetime
from asyncclcache.store import PublishResult, Store
from conftest import need, run_child


def cli(*args: str, env: dict[str, str] | None = None, stdin: str | None = None,
        preexec_fn: Callable[[], None] | None = None, cwd: Path | None = None
        ) -> subprocess.CompletedProcess[str]:
    # Not a terminal: 80 columns, unless a test sets COLUMNS (a wide shell's is not ours).
    e = {k: v for k, v in os.environ.items() if k not in RANK_ENV_VARS and k not in ("COLUMNS", "LINES")}
    if env:
        e.update(env)
    return subprocess.run(
        [sys.executable, "-m", "asyncclcache", *args],
        capture_output=True, text=True, env=e, timeout=120, check=False, input=stdin,
        preexec_fn=preexec_fn, cwd=cwd,
    )


def _json(r: subprocess.CompletedProcess[str]) -> dict:
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _publish(store: Store, i: int, size: int, device: str = "pthread-test") -> Entry:
    key = hashlib.sha256(b"cli %d" % i).hexdigest()
    entry = Entry(key, (b"x" * size,), {"devices": [{"device_name": device}], "kernels": [f"k{i}"],
                                        "created": time.time()})
    assert store.publish(entry) is PublishResult.WRITTEN
    return entry


@pytest.fixture
def populated(cache_dir: Path) -> tuple[Path, int]:
    store = Store(cache_dir)
    for i in range(3):
        _publish(store, i, 1000 * (i + 1))
    return cache_dir, sum(e.size for e in store.entries())


def test_version_and_help() -> None:
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"asyncclcache {__version__}"
    r = cli("--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: asyncclcache")
    for command in ("info", "list", "verify", "prune", "clear", "stats", "bench"):
        assert command in r.stdout
    assert "Exit codes" in r.stdout
    assert all(len(line) <= 80 for line in r.stdout.splitlines())


def test_python_dash_m_and_console_script_agree() -> None:
    script = Path(sys.executable).with_name("asyncclcache")
    if not script.exists():
        need("the console script", "the console script is not installed in this environment")
    r = subprocess.run([str(script), "--version"], capture_output=True, text=True, check=False)
    assert r.stdout == cli("--version").stdout


@pytest.mark.parametrize(
    "args",
    [[], ["bogus"], ["prune", "--max-size", "lots"], ["prune", "--older-than", "soon"],
     ["list", "--no-such-flag"]],
)
def test_bad_arguments_exit_2(args: list[str], cache_dir: Path) -> None:
    r = cli(*args, *(["--dir", str(cache_dir)] if args and args[0] != "bogus" else []))
    assert r.returncode == 2
    assert "Traceback" not in r.stderr


def test_prune_without_a_bound_is_a_usage_error(populated: tuple[Path, int]) -> None:
    r = cli("prune", "--dir", str(populated[0]))
    assert r.returncode == 2 and "--max-size" in r.stderr


def test_info_on_empty_and_populated(cache_dir: Path, populated: tuple[Path, int]) -> None:
    empty = _json(cli("info", "--dir", str(cache_dir.parent / "nothing-yet"), "--json"))
    assert empty["exists"] is False and empty["entries"] == 0
    assert not (cache_dir.parent / "nothing-yet").exists()  # the command creates nothing
    info = _json(cli("info", "--dir", str(cache_dir), "--json"))
    assert info["directory"] == str(cache_dir / f"v{FORMAT_VERSION}")
    assert (info["entries"], info["bytes"]) == (3, populated[1])
    assert info["devices_seen"] == {"pthread-test": 3}
    assert info["format_version"] == FORMAT_VERSION
    assert any(p["name"] == "Portable Computing Language" for p in info["platforms"])
    human = cli("info", "--dir", str(cache_dir))
    assert human.returncode == 0
    assert f"3  ({populated[1] / 1024:.1f}K)" in human.stdout
    assert all(len(line) <= 80 for line in human.stdout.splitlines())


def test_info_reads_the_environment(populated: tuple[Path, int]) -> None:
    info = _json(cli("info", "--json", env={"ASYNCCLCACHE_DIR": str(populated[0]),
                                            "ASYNCCLCACHE_MAX_SIZE": "2M"}))
    assert info["entries"] == 3 and info["max_size"] == 2 << 20


def test_info_says_where_ranks_keep_node_copies(populated: tuple[Path, int], tmp_path: Path) -> None:
    env = {"ASYNCCLCACHE_DIR": str(populated[0]), "ASYNCCLCACHE_NODE_DIR": str(tmp_path / "local")}
    info = _json(cli("info", "--json", env=env))
    # The folder given is a parent, as /tmp is: ours is made in it.
    assert info["node_copies"] == {"when": "for ranks", "max_size": 2 << 30,
                                   "directory": str(tmp_path / "local" / f"asyncclcache-{os.getuid()}")}
    off = cli("info", env=dict(env, ASYNCCLCACHE_NODE_COPIES="0", ASYNCCLCACHE_NODE_MAX_SIZE="1G"))
    assert off.returncode == 0 and "node copies off: " in " ".join(off.stdout.split())  # a long path: wrapped


_LONG_DEVICE = "pthread-AMD EPYC 7B13 64-Core Processor"


@pytest.mark.parametrize("columns", [60, 80, 200])
def test_info_and_list_fit_the_width_and_cut_no_word(cache_dir: Path, columns: int) -> None:
    store = Store(cache_dir)
    kernels = {i: [f"kern_wide_radix_pass_{i}_{j}" for j in range(i)] for i in (1, 2, 9)}
    for i, names in kernels.items():
        key = hashlib.sha256(b"width %d" % i).hexdigest()
        store.publish(Entry(key, (b"x" * 100,), {"devices": [{"device_name": _LONG_DEVICE}],
                                                 "kernels": names, "created": time.time()}))
    assert add_lifetime(store.root, {"hits": 12345, "seconds_saved": 6.6, "baked_hits": 3})
    fold_lifetime(store.root)
    env = {"COLUMNS": str(columns)}
    every_name = {n for names in kernels.values() for n in names}

    info = cli("info", "--dir", str(cache_dir), env=env)
    wide = cli("info", "--dir", str(cache_dir), env={"COLUMNS": "1000"})
    assert info.returncode == 0 and wide.returncode == 0, info.stderr + wide.stderr
    lines = info.stdout.splitlines()
    # Only a word that no line could hold (a long path) passes the width, alone on its line.
    assert all(len(ln) <= columns or len(ln.split()) == 1 for ln in lines), info.stdout
    # Wrapped between words: the same words, in order, as on a terminal wide enough.
    assert info.stdout.split() == wide.stdout.split(), info.stdout
    assert "6.6 s saved" in " ".join(info.stdout.split())
    assert columns > 80 or len(lines) > len(wide.stdout.splitlines())  # wrapped, not cut

    listed = cli("list", "--dir", str(cache_dir), env=env)
    assert listed.returncode == 0, listed.stderr
    assert all(len(ln) <= columns for ln in listed.stdout.splitlines()), listed.stdout
    shown = re.findall(r"kern_\w*", listed.stdout)
    assert shown and set(shown) <= every_name, listed.stdout  # whole names only
    left_out = sum(int(n) for n in re.findall(r"(?:…|\.\.\.)\(\+(\d+)\)", listed.stdout))
    assert len(shown) + left_out == len(every_name), listed.stdout  # the rest counted
    assert left_out > 0 if columns < 200 else left_out == 0 or len(kernels[9]) * 25 > columns
    device_words = _LONG_DEVICE.split()
    for ln in listed.stdout.splitlines():
        if " @ " in ln and "KERNELS" not in ln:
            words = ln.split(" @ ", 1)[1].split()
            assert words == device_words[:len(words)] or (
                words[:-1] == device_words[:len(words) - 1] and words[-1] in {w + "…" for w in device_words}), ln
    assert "CREATED" in listed.stdout.splitlines()[0] if columns >= 92 else "CREATED" not in listed.stdout


@pytest.mark.parametrize("command", ["info", "list", "verify", "stats"])
def test_regular_file_foreign_and_insecure_directories(command: str, tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    insecure = tmp_path / "insecure"
    insecure.mkdir()
    insecure.chmod(0o777)
    for path, message in ((f, "not a directory"), (foreign, "not an asyncclcache cache"),
                          (insecure, "writable by group or others")):
        r = cli(command, "--dir", str(path))
        assert r.returncode == 2, (path, r.stdout)
        assert message in r.stderr and str(path) in r.stderr
        assert "Traceback" not in r.stderr
    assert os.listdir(insecure) == [] and os.listdir(foreign) == ["notes.txt"]


def test_list_filters_and_json(cache_dir: Path) -> None:
    store = Store(cache_dir)
    a = _publish(store, 1, 100, device="pthread-cpu")
    _publish(store, 2, 100, device="NVIDIA H200")
    rows = _json(cli("list", "--dir", str(cache_dir), "--json"))["entries"]
    assert sorted(r["devices"][0] for r in rows) == ["NVIDIA H200", "pthread-cpu"]
    assert set(rows[0]) == {"key", "kind", "kernels", "devices", "size", "created", "last_used", "rank", "path",
                            "damaged", "baked_from"}
    assert not any(r["damaged"] for r in rows)
    assert {r["kind"] for r in rows} == {"binary"}
    only = _json(cli("list", "--dir", str(cache_dir), "--json", "--device", "pthread"))["entries"]
    assert [r["key"] for r in only] == [a.key] and only[0]["kernels"] == ["k1"]
    human = cli("list", "--dir", str(cache_dir))
    assert human.returncode == 0 and a.key[:12] in human.stdout and "2 entries" in human.stdout
    assert all(len(line) <= 80 for line in human.stdout.splitlines())


def test_verify_finds_and_fixes_a_corrupted_entry(populated: tuple[Path, int]) -> None:
    cache_dir = populated[0]
    store = Store(cache_dir)
    assert _json(cli("verify", "--dir", str(cache_dir), "--json"))["bad"] == []
    victim = next(iter(store.entries()))
    data = bytearray(victim.path.read_bytes())
    data[40] ^= 0x01
    victim.path.write_bytes(bytes(data))
    orphan = victim.path.parent / ".tmp-999999999-x.partial"  # a writer that is long gone
    orphan.write_bytes(b"half")
    r = cli("verify", "--dir", str(cache_dir), "--json")
    assert r.returncode == 1
    report = json.loads(r.stdout)
    assert [b["key"] for b in report["bad"]] == [victim.key] and "checksum" in report["bad"][0]["problem"]
    assert report["orphaned_temp_files"] == [str(orphan)]
    assert victim.path.exists()  # reporting is not fixing
    fixed = cli("verify", "--dir", str(cache_dir), "--fix")
    assert fixed.returncode == 1 and "removed" in fixed.stdout
    assert not victim.path.exists() and not orphan.exists()
    assert len(list(store.entries())) == 2
    assert cli("verify", "--dir", str(cache_dir)).returncode == 0


def test_prune_evicts_least_recently_used_first(cache_dir: Path) -> None:
    store = Store(cache_dir)
    entries = [_publish(store, i, 10_000) for i in range(4)]
    now = time.time()
    for age, e in zip((400, 300, 200, 100), entries, strict=True):  # entries[0] is the least recently used
        os.utime(store.path_for(e.key), (now - age, now - age))
    store.touch(entries[0].key)  # ... until a hit uses it again
    size = store.path_for(entries[0].key).stat().st_size
    out = _json(cli("prune", "--dir", str(cache_dir), "--max-size", str(2 * size + 10), "--json"))
    assert out["removed"] == 2 and out["remaining"] <= 2 * size + 10
    left = {e.key for e in store.entries()}
    assert left == {entries[0].key, entries[3].key}
    out = _json(cli("prune", "--dir", str(cache_dir), "--older-than", "150s", "--json"))
    assert out["removed"] == 0  # entries[0] was just used, entries[3] is 100 s old
    out = _json(cli("prune", "--dir", str(cache_dir), "--older-than", "50", "--json"))
    assert out["removed"] == 1 and {e.key for e in store.entries()} == {entries[0].key}


def test_prune_under_the_cap_while_another_process_writes(cache_dir: Path) -> None:
    writer = r"""
import hashlib, sys, time
from asyncclcache.entry import Entry
from asyncclcache.store import Store
store = Store(sys.argv[1])
for i in range(300):
    key = hashlib.sha256(b"w%d" % i).hexdigest()
    store.publish(Entry(key, (b"w" * 20_000,), {"devices": [{}]}))
print("done")
"""
    proc = subprocess.Popen([sys.executable, "-c", writer, str(cache_dir)], stdout=subprocess.PIPE,
                            text=True)
    cap = 200_000
    try:
        while proc.poll() is None:
            r = cli("prune", "--dir", str(cache_dir), "--max-size", str(cap), "--json")
            assert r.returncode == 0, r.stderr
        assert proc.stdout.read().strip() == "done"
    finally:
        proc.kill()
    out = _json(cli("prune", "--dir", str(cache_dir), "--max-size", str(cap), "--json"))
    assert out["remaining"] <= cap
    report = _json(cli("verify", "--dir", str(cache_dir), "--json"))
    assert report["bad"] == [] and report["checked"] >= 1


def test_clear_asks_for_yes(populated: tuple[Path, int]) -> None:
    cache_dir = populated[0]
    r = cli("clear", "--dir", str(cache_dir), stdin="")
    assert r.returncode == 2 and "--yes" in r.stderr
    assert len(list(Store(cache_dir).entries())) == 3
    assert _json(cli("clear", "--dir", str(cache_dir), "--yes", "--json")) == {"removed": 3}
    assert list(Store(cache_dir).entries()) == []


@pytest.mark.slow
def test_stats_from_two_processes_add_up_and_reset(cache_dir: Path) -> None:
    code = r"""
import json, sys
import asyncclcache as acc, pyopencl as cl
from kernels import small_source
from _pocl import pocl_context
ctx = pocl_context()
cache = acc.Cache(sys.argv[1])
for i in range(int(sys.argv[2])):
    acc.Program(ctx, small_source(salt=f"stats-{i}"), cache=cache).build()
cache.flush(120)
print(json.dumps(cache.stats().as_dict()))
"""
    a = json.loads(run_child(code, str(cache_dir), "2").stdout.splitlines()[-1])
    b = json.loads(run_child(code, str(cache_dir), "3").stdout.splitlines()[-1])
    assert (a["misses"], a["writes"]) == (2, 2)
    assert (b["hits"], b["misses"], b["writes"]) == (2, 1, 1)
    life = _json(cli("stats", "--dir", str(cache_dir), "--json"))
    assert life["runs"] == 2
    assert (life["hits"], life["misses"], life["writes"]) == (2, 3, 3)
    assert life["bytes_written"] == a["bytes_written"] + b["bytes_written"]
    assert life["seconds_saved"] > 0
    info = _json(cli("info", "--dir", str(cache_dir), "--json"))
    assert info["lifetime"]["hits"] == 2
    reset = _json(cli("stats", "--dir", str(cache_dir), "--reset", "--json"))
    assert all(v == 0 for v in reset.values())


def test_concurrent_lifetime_updates_are_not_lost(tmp_path: Path) -> None:
    code = r"""
import sys
from asyncclcache.stats import add_lifetime
for _ in range(50):
    assert add_lifetime(sys.argv[1], {"hits": 1, "writes": 2})
"""
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)]) for _ in range(4)]
    # Folded meanwhile, as the directory's upkeep does: nothing lost, nothing counted twice.
    folded = 0
    while any(p.poll() is None for p in procs):
        folded += fold_lifetime(tmp_path)
    assert [p.wait(120) for p in procs] == [0] * 4
    values = read_lifetime(tmp_path)
    assert (values["hits"], values["writes"]) == (200, 400)
    folded += fold_lifetime(tmp_path)
    assert folded == 200 and read_lifetime(tmp_path)["hits"] == 200
    assert not list((tmp_path / "stats.d").iterdir())


def test_rank_directories_are_included(cache_dir: Path) -> None:
    for rank in (0, 1):
        _publish(Store(cache_dir, rank_local=True, rank=rank), rank, 100)
    info = _json(cli("info", "--dir", str(cache_dir), "--json"))
    assert info["entries"] == 2 and len(info["rank_directories"]) == 2
    rows = _json(cli("list", "--dir", str(cache_dir), "--json"))["entries"]
    assert sorted(r["rank"] for r in rows) == [0, 1]


def test_prune_max_size_zero_means_no_bound_as_in_the_environment(populated: tuple[Path, int]) -> None:
    cache_dir = populated[0]
    r = cli("prune", "--dir", str(cache_dir), "--max-size", "0")
    assert r.returncode == 2 and "0 means no bound" in r.stderr
    r = cli("prune", "--dir", str(cache_dir), env={"ASYNCCLCACHE_MAX_SIZE": "0"})
    assert r.returncode == 2 and "0 means no bound" in r.stderr
    assert len(list(Store(cache_dir).entries())) == 3  # nothing evicted


def _plant(store: Store, name: str, **meta: object) -> str:
    """Write an entry with a valid checksum around ``meta`` as given (no checks); its key."""
    import struct

    from asyncclcache.entry import MAGIC

    key = hashlib.sha256(name.encode()).hexdigest()
    raw = json.dumps({"key": key, "binary_sizes": [3], **meta}).encode()
    body = struct.pack("<8sHHI", MAGIC, FORMAT_VERSION, 0, len(raw)) + raw + b"bin"
    path = store.path_for(key)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    path.write_bytes(body + hashlib.blake2b(body, digest_size=32).digest())
    path.chmod(0o600)
    return key


def test_entry_with_wrong_metadata_types_is_reported_not_a_traceback(cache_dir: Path) -> None:
    store = Store(cache_dir)
    good = _publish(store, 1, 10)
    key = _plant(store, "bad types", devices=5, kernels=[1, 2], created="yesterday")
    for command in ("list", "info"):
        r = cli(command, "--dir", str(cache_dir))
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    v = cli("verify", "--dir", str(cache_dir), "--json")
    assert v.returncode == 1 and "Traceback" not in v.stderr
    r = json.loads(v.stdout)
    assert [b["key"] for b in r["bad"]] == [key] and "bad metadata" in r["bad"][0]["problem"]
    from asyncclcache.errors import CorruptEntryWarning

    with pytest.warns(CorruptEntryWarning, match="bad metadata"):
        assert store.load(key) is None
    assert store.load(good.key) is not None


# {{{ issue 18: implausible numbers, terminal escapes, read-only directories

@pytest.mark.parametrize(
    "meta",
    [
        {"created": float("nan")},
        {"created": 1e300},
        {"created": float("-inf")},
        {"created": -5.0},
        {"created": 10**30},
        {"created": True},
        {"compile_seconds": float("inf")},
        {"compile_seconds": -1},
    ],
    ids=lambda m: f"{next(iter(m))}={next(iter(m.values()))!r}",
)
def test_implausible_numbers_are_damage_to_verify_import_and_list(cache_dir: Path, tmp_path: Path,
                                                                   meta: dict) -> None:
    import tarfile

    store = Store(cache_dir)
    good = _publish(store, 1, 10)
    key = _plant(store, "implausible", devices=[{"device_name": "d"}], kernels=["k"], **meta)
    field = next(iter(meta))
    v = cli("verify", "--dir", str(cache_dir), "--json")
    assert v.returncode == 1 and "Traceback" not in v.stderr, v.stderr
    bad = json.loads(v.stdout)["bad"]
    assert [b["key"] for b in bad] == [key] and f"bad metadata: {field!r}" in bad[0]["problem"]
    # list, human and JSON: no traceback, the entry shown as damaged (the good one as usual).
    human = cli("list", "--dir", str(cache_dir))
    assert human.returncode == 0 and "Traceback" not in human.stderr, human.stderr
    line = next(ln for ln in human.stdout.splitlines() if ln.startswith(key[:12]))
    assert " bad " in line and "damaged" in line
    assert "1 damaged" in human.stdout
    rows = {r["key"]: r for r in _json(cli("list", "--dir", str(cache_dir), "--json"))["entries"]}
    assert rows[key]["damaged"] and rows[key]["kind"] is None and rows[key]["created"] is None
    assert not rows[good.key]["damaged"] and rows[good.key]["kind"] == "binary"
    assert cli("info", "--dir", str(cache_dir)).returncode == 0
    # import refuses an archive holding it, and writes nothing.
    archive = tmp_path / "bad.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(store.path_for(key), arcname=f"v{FORMAT_VERSION}/{key[:2]}/{key}.acl")
    target = tmp_path / "target"
    r = cli("import", "--dir", str(target), str(archive))
    assert r.returncode == 1 and "damaged entry" in r.stderr and field in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not target.exists()


def test_control_characters_in_names_are_escaped_in_human_output(cache_dir: Path) -> None:
    store = Store(cache_dir)
    evil = "pthread\x1b]0;owned\x07\x1b[31m-cpu"
    key = hashlib.sha256(b"escapes").hexdigest()
    store.publish(Entry(key, (b"x",), {"devices": [{"device_name": evil}], "kernels": ["k\x1b[2J"],
                                        "created": time.time()}))
    for command in ("list", "info"):
        r = cli(command, "--dir", str(cache_dir))
        assert r.returncode == 0, r.stderr
        assert "\x1b" not in r.stdout and "\x07" not in r.stdout, repr(r.stdout)
    listed = cli("list", "--dir", str(cache_dir)).stdout
    assert "k\\x1b[2J @ pthread" in listed, listed  # the rest is past column 80
    info = cli("info", "--dir", str(cache_dir)).stdout
    assert "device seen    pthread\\x1b]0;owned\\x07\\x1b[31m-cpu (1 entries)" in info, info
    # JSON stays JSON: escaped by the encoder, the names intact once parsed.
    rows = _json(cli("list", "--dir", str(cache_dir), "--json"))["entries"]
    assert rows[0]["devices"] == [evil] and rows[0]["kernels"] == ["k\x1b[2J"]
    # Names of files on disk: a stray "entry" and a writer's temp file (verify lists the
    # orphans), one of them not even UTF-8.
    fanout = store.path_for(key).parent
    (fanout / "\x1b[2J.acl").write_bytes(b"")
    os.close(os.open(os.path.join(os.fsencode(fanout), b"\xff\xfe.acl"), os.O_CREAT | os.O_WRONLY, 0o600))
    temp = fanout / ".tmp-\x1b[31m.partial"
    temp.write_bytes(b"half")
    os.utime(temp, (time.time() - 7200, time.time() - 7200))  # its writer is long gone
    listed = cli("list", "--dir", str(cache_dir))
    assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.stderr
    assert "\x1b" not in listed.stdout and "\\x1b[2J" in listed.stdout and "\\udcff" in listed.stdout
    v = cli("verify", "--dir", str(cache_dir))  # paths under the directory: the names in view
    assert "Traceback" not in v.stderr, v.stderr
    assert "\x1b" not in v.stdout and ".tmp-\\x1b[31m.partial" in v.stdout, v.stdout


_PR_CAPBSET_DROP = 24
_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH = 1, 2


def _without_root_powers() -> None:
    """preexec_fn: root without the capabilities that override file modes (dropped from the
    bounding set, so the exec'd CLI lacks them): mode 0500 binds it as it binds any user."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _unprivileged() -> Callable[[], None] | None:
    """How to run the CLI so that file modes bind it. Not as uid 65534: the interpreter
    may live where that uid cannot read it (a pyenv under /root), and the store refuses
    a directory not owned by the user; so root, stripped of its file-mode override."""
    if os.geteuid() != 0:
        return None
    status = Path("/proc/self/status").read_text()
    inheritable = int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("CapInh:")), 16)
    if inheritable & ((1 << _CAP_DAC_OVERRIDE) | (1 << _CAP_DAC_READ_SEARCH)):
        pytest.skip("root with inheritable CAP_DAC_OVERRIDE: it would survive the exec")
    try:
        probe = subprocess.run([sys.executable, "-c", "pass"], preexec_fn=_without_root_powers, check=False)
    except subprocess.SubprocessError as e:
        pytest.skip(f"cannot drop root's file-mode override here (needs CAP_SETPCAP): {e}")
    assert probe.returncode == 0
    return _without_root_powers


@pytest.mark.parametrize("command", [["prune", "--max-size", "1"], ["clear", "--yes"], ["verify", "--fix"]])
def test_a_read_only_directory_is_an_error_not_a_no_op(populated: tuple[Path, int], command: list[str]) -> None:
    cache_dir = populated[0]
    store = Store(cache_dir)
    if command[0] == "verify":
        victim = next(iter(store.entries())).path
        victim.write_bytes(b"damaged")
    run_as = _unprivileged()
    dirs = [store.root, *store.fanout_dirs()]
    for d in dirs:
        d.chmod(0o500)
    try:
        r = cli(*command, "--dir", str(cache_dir), preexec_fn=run_as)
        also_json = cli(*command, "--json", "--dir", str(cache_dir), preexec_fn=run_as)
    finally:
        for d in dirs:
            d.chmod(0o700)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert f"cannot {command[0] if command[0] != 'verify' else 'fix'} {store.root}" in r.stderr
    assert "not writable (permission denied)" in r.stderr, r.stderr
    assert "another process" not in r.stdout and "removed" not in r.stdout and "Traceback" not in r.stderr
    assert also_json.returncode == 2 and also_json.stdout == ""
    assert len(list(store.entries())) == 3  # nothing changed

# }}}


# {{{ issue 26: bake and export --bake where no OpenCL platform is found (a login node)

_BUILD = r"""
import sys
import asyncclcache as acc
from kernels import small_source, run_twice
from _pocl import pocl_context
ctx = pocl_context()
cache = acc.Cache(sys.argv[1], rank_local=False)
assert run_twice(ctx, acc.Program(ctx, small_source("twice"), cache=cache).build())
assert cache.flush(60)
"""
# ocl-icd (and Khronos's loader) read their ICD files from here: none, no platform.
_NO_PLATFORM = {"OCL_ICD_VENDORS": "/nonexistent"}


def _no_platform_error() -> str:
    """pyopencl's error with ``_NO_PLATFORM`` set (skips where the loader ignores it)."""
    r = subprocess.run([sys.executable, "-c", "import pyopencl as cl; cl.get_platforms()"],
                       capture_output=True, text=True, env=dict(os.environ, **_NO_PLATFORM),
                       timeout=60, check=False)
    if "PLATFORM_NOT_FOUND_KHR" not in r.stderr:
        pytest.skip(f"this ICD loader does not read OCL_ICD_VENDORS: {r.stderr[-200:]!r}")
    return r.stderr.strip().splitlines()[-1]


def test_bake_and_export_bake_without_an_opencl_platform(cache_dir: Path, tmp_path: Path) -> None:
    assert "LogicError" in _no_platform_error()
    run_child(_BUILD, str(cache_dir))
    [kcache] = [e.key for e in Store(cache_dir, rank_local=False).entries()]
    r = cli("bake", "--dir", str(cache_dir), env=_NO_PLATFORM)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "baked 0, skipped 1, failed 0" in r.stdout and "no OpenCL platform here: " in r.stdout, r.stdout
    assert "PLATFORM_NOT_FOUND_KHR" in r.stdout and max(map(len, r.stdout.splitlines())) <= 80, r.stdout
    data = _json(cli("bake", "--dir", str(cache_dir), "--json", env=_NO_PLATFORM))
    [(why, n)] = data["skipped"].items()
    assert n == 1 and why.startswith("no OpenCL platform here: ") and "PLATFORM_NOT_FOUND_KHR" in why, why
    # The archive is written, with the entry that stays unbaked; the bake says why.
    archive = tmp_path / "a.tar"
    r = cli("export", "--dir", str(cache_dir), "--bake", str(archive), env=_NO_PLATFORM)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "exported 1 entries" in r.stdout and "no OpenCL platform here: " in r.stdout, r.stdout
    import tarfile

    with tarfile.open(archive) as tar:
        assert [Path(n).name for n in tar.getnames() if n.endswith(".acl")] == [f"{kcache}.acl"]
    data = _json(cli("export", "--dir", str(cache_dir), "--bake", "--json", str(archive), env=_NO_PLATFORM))
    assert data["entries"] == 1 and data["bake"]["baked"] == 0 and sum(data["bake"]["skipped"].values()) == 1

# }}}


# {{{ counters: one table (issue 27)

# Not events: a level, and this process's costs (docs/cli.md says why).
NOT_LIFETIME = {"pending", "main_thread_seconds", "background_cpu_seconds"}


def test_every_counter_of_events_is_a_lifetime_total(cache_dir: Path) -> None:
    from dataclasses import fields

    from asyncclcache.stats import Counters, Stats

    names = [f.name for f in fields(Stats)]
    counters = Counters()
    for name in names:
        counters.add(name, 2)
    counters.save_lifetime(Store(cache_dir).root)
    life = _json(cli("stats", "--dir", str(cache_dir), "--json"))
    assert life == {"runs": 1, **{n: 2 for n in names if n not in NOT_LIFETIME}}
    human = cli("stats", "--dir", str(cache_dir)).stdout.splitlines()
    first = [line.split()[0] for line in human].index("runs")  # after the heading (a long path: wrapped)
    assert [line.split()[0] for line in human[first:]] == ["runs", *(n for n in names if n in life)]


def test_evictions_reach_the_exit_line() -> None:
    from asyncclcache.stats import Stats

    assert Stats(evictions=3).line().endswith(" pending (3 evictions)")
    assert "evictions" not in Stats(hits=1).line()


def test_the_exit_line_shows_each_counter_as_the_table_says() -> None:
    from asyncclcache.stats import COUNTERS, Stats

    zero = Stats().line()
    for c in COUNTERS[1:]:  # runs: the directory's only
        one = Stats(**{c.name: 7_000_000 if c.unit == "bytes" else 7}).line()  # the line says MB
        words = f"7 {c.name.replace('_', ' ')}"
        if c.line == "head":
            assert one != zero, c
        elif c.line == "nonzero":
            assert one == f"{zero} ({words})" and words not in zero, c
        else:
            assert (c.line, one) == ("never", zero), c


def test_docs_list_exactly_the_counters() -> None:
    from asyncclcache.stats import COUNTERS

    text = (Path(__file__).parents[1] / "docs" / "cli.md").read_text()
    table = text.split("| counter | lifetime | exit line | counts |", 1)[1].split("\n\n", 1)[0]
    rows: dict[str, tuple[bool, str]] = {}
    for row in table.strip().splitlines()[1:]:
        names, lifetime, line, _ = (cell.strip() for cell in row.strip("|").split(" | ", 3))
        for name in names.split(", "):
            rows[name.strip("`")] = (lifetime == "yes", line)
    said = {"always": "head", "not zero": "nonzero", "never": "never"}
    assert {n: (life, said[line]) for n, (life, line) in rows.items()} == {
        c.name: (c.lifetime, c.line) for c in COUNTERS}

# }}}
