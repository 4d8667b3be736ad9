"""asyncclcache.system: each operating-system facility behind a probe, with its fallback, and
the helpers run once with every probe answering "not here" (what macOS gives: no /proc, no
SCHED_IDLE, no prctl), where nothing may hang or leak.

Probes and priorities change a process for good, so each scenario runs in a child process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from _procs import PLANTED, SAFE_PATH, alive, gone, plant, with_args
from conftest import ROOT, child_json, run_child

NOT_HERE = {"ASYNCCLCACHE_TEST_NO_OS_FACILITIES": "1"}
LINUX = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="the probes' Linux answers need /proc")

PROBES = r"""
import json, os
from asyncclcache import system
from asyncclcache.binaries import _opencl
print(json.dumps({
    "sample": system.cpu_sample(os.getpid()), "signal": system.death_signal_available(),
    "maps": system.loaded_library("libc"), "priority": system.lower_priority("idle"), "nice": os.nice(0),
    "opencl": _opencl()._name,
}))
"""


@pytest.mark.parametrize("here", [pytest.param(True, marks=LINUX), False], ids=["linux", "not-here"])
def test_each_probe_answers_or_falls_back(here: bool) -> None:
    out = child_json(run_child(PROBES, env=None if here else NOT_HERE))
    if here:
        assert len(out["sample"]) == 3 and out["sample"][0] > out["sample"][1] > 0, out
        assert out["signal"] is True
        assert out["maps"] and os.path.isabs(out["maps"])
        assert out["priority"] == "SCHED_IDLE"
        assert os.path.isabs(out["opencl"])  # the loader pyopencl mapped
    else:
        assert (out["sample"], out["signal"], out["maps"]) == (None, False, None), out
        assert out["priority"] == "nice 19" and out["nice"] == 19
        assert out["opencl"]  # the loader ctypes finds, and it answers (below, in the helper)


# A child in the planted folder argv[1]: starts _procs.report as a helper (with a relative
# PYTHONPATH, and an ASYNCCLCACHE_ setting of its own), waits for it to say it is set,
# prints what it reported, then ends it.
START = SAFE_PATH + r"""
import json, os, subprocess, sys, time
from asyncclcache import system
folder, tests = sys.argv[1], sys.argv[2]
os.chdir(folder)
out = os.path.join(folder, "..", "report.json")
env = dict(os.environ, PYTHONPATH=os.path.relpath(tests), ASYNCCLCACHE_INSTALL="1")
r, w = os.pipe()
proc = system.start_helper("_procs:report", [out], env=env, stdin=subprocess.PIPE, ready=w)
ready = os.read(r, 1).decode()
deadline = time.monotonic() + 60
while not os.path.exists(out) and time.monotonic() < deadline:
    time.sleep(0.02)
with open(out) as f:
    info = json.load(f)
proc.stdin.close()
print(json.dumps({"ready": ready, "info": info, "rc": proc.wait(30)}))
"""


@pytest.mark.parametrize("here", [pytest.param(True, marks=LINUX), False], ids=["linux", "not-here"])
def test_a_helper_starts_apart_from_the_working_folder(tmp_path: Path, here: bool) -> None:
    folder, marks = tmp_path / "shared", tmp_path / "marks"
    plant(folder, marks)
    out = child_json(run_child(START, str(folder), str(ROOT / "tests"), env=None if here else NOT_HERE))
    info = out["info"]
    assert out["ready"] == "R" and out["rc"] == 0, out
    assert sorted(p.name for p in marks.iterdir()) == []
    assert info["cwd"] == "/" and "" not in info["path"] and all(os.path.isabs(p) for p in info["path"])
    assert info["pythonpath"] == str(ROOT / "tests")  # what the relative entry named
    assert info["sid"] == info["pid"]  # a session of its own
    assert info["env"] == ([] if here else ["ASYNCCLCACHE_TEST_NO_OS_FACILITIES"])
    assert (info["priority"], info["parent_death"]) == (("SCHED_IDLE", "signal") if here else ("nice 19", "watch"))


# A child: starts a helper that stops itself once set (as the idle baker does), prints its
# pid and its state, then kills itself.
STOPPED = r"""
import os, signal, subprocess, sys, time
from asyncclcache import system
from _procs import state
r, w = os.pipe()
proc = system.start_helper("_procs:report", [sys.argv[1]], stdin=subprocess.PIPE, stopped=True, ready=w)
got = os.read(r, 1)
deadline = time.monotonic() + 30
while state(proc.pid) not in ("T", "Z", None) and time.monotonic() < deadline:
    time.sleep(0.01)
print(proc.pid, state(proc.pid), got, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("here", [pytest.param(True, marks=LINUX), False], ids=["linux", "not-here"])
def test_a_helper_started_stopped_never_outlives_its_parent(tmp_path: Path, here: bool) -> None:
    proc = run_child(STOPPED, str(tmp_path / "report.json"), env=None if here else NOT_HERE, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pid, st, got = proc.stdout.split()
    try:
        # Here: set to die with its parent first, then stopped. Not here: it cannot be
        # both, so it is never stopped: it exits.
        assert got == "b'R'" and st in (("T",) if here else ("Z", "None")), proc.stdout
        assert gone([int(pid)], 5.0), f"helper {pid} outlived its parent"
    finally:
        if alive(int(pid)):
            os.kill(int(pid), signal.SIGKILL)
    assert not (tmp_path / "report.json").exists()  # it never ran its target


# A child: starts a helper that waits for a signal (no pipe whose end could tell it that
# its parent is gone), prints its pid once it is set, then kills itself.
RUNNING = r"""
import os, signal, subprocess
from asyncclcache import system
r, w = os.pipe()
proc = system.start_helper("signal:pause", ready=w, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(proc.pid, os.read(r, 1), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("here", [pytest.param(True, marks=LINUX), False], ids=["linux", "not-here"])
def test_a_running_helper_never_outlives_its_parent(here: bool) -> None:
    # Here the system kills it; not here only its parent watch can: nothing else would end it.
    proc = run_child(RUNNING, env=None if here else NOT_HERE, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pid, got = proc.stdout.split()
    try:
        assert got == "b'R'", proc.stdout
        assert gone([int(pid)], 5.0), f"helper {pid} outlived its parent"
    finally:
        if alive(int(pid)):
            os.kill(int(pid), signal.SIGKILL)


def test_the_sweep_removes_only_our_folders_whose_owner_is_gone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncclcache import system

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    host = system._host()
    dead = subprocess.Popen(["true"])
    dead.wait()
    keep, swept = [], []
    for name, into in ((f"acc-bake-{dead.pid}-{host}-aaaa", swept), (f"acc-bake-{os.getpid()}-{host}-bbbb", keep),
                       (f"acc-bake-{dead.pid}-otherhost-cccc", keep), (f"acc-bake-x-{host}-dddd", keep)):
        (tmp_path / name / "w0").mkdir(parents=True)
        (tmp_path / name / "w0" / "k.so").write_bytes(b"x")
        into.append(name)
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "theirs").write_bytes(b"x")
    (tmp_path / f"acc-bake-{dead.pid}-{host}-eeee").symlink_to(tmp_path / "target")
    (tmp_path / f"acc-bake-{dead.pid}-{host}-ffff").write_bytes(b"a file")
    keep += [f"acc-bake-{dead.pid}-{host}-eeee", f"acc-bake-{dead.pid}-{host}-ffff", "target"]
    if os.getuid() == 0:  # another user's folder: left, whatever its pid
        other = tmp_path / f"acc-bake-{dead.pid}-{host}-gggg"
        other.mkdir()
        os.chown(other, 4242, 4242)
        keep.append(other.name)
    new = system.private_folder("acc-bake")
    assert new.name.startswith(f"acc-bake-{os.getpid()}-{host}-") and new.is_dir()
    left = {p.name for p in tmp_path.iterdir()} - {new.name}
    assert left == set(keep), (left, swept)
    assert (tmp_path / "target" / "theirs").exists()


# Every probe "not here": the idle baker does not start; its keys are counted; the job
# ends at once, with no process and no folder left.
IDLE_NOT_HERE = r"""
import json, sys, time
import pyopencl as cl, asyncclcache as acc
from kernels import small_source
from _pocl import pocl_context
ctx = pocl_context()
cache = acc.Cache(sys.argv[1], rank_local=False)
for i in range(2):
    acc.Program(ctx, small_source(f"twice{i}", salt="not-here"), cache=cache).build()
flushed = cache.flush(60)
time.sleep(0.5)  # its thread has decided
started = cache._baker._proc is not None
t = time.perf_counter(); cache.close(); close_s = time.perf_counter() - t
print(json.dumps({"flushed": flushed, "started": started, "close_s": close_s, **cache.stats().as_dict()}))
"""


def test_the_idle_baker_with_no_os_facilities(cache_dir: Path, tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    t0 = time.monotonic()
    out = child_json(run_child(IDLE_NOT_HERE, str(cache_dir), timeout=120,
                               env={**NOT_HERE, "ASYNCCLCACHE_BAKE": "idle", "TMPDIR": str(tmp)}))
    assert out["flushed"] and out["writes"] == 2 and not out["started"], out
    assert out["bakes_not_queued"] == 2 and out["close_s"] < 1.0, out
    assert time.monotonic() - t0 < 60
    assert gone(with_args(str(cache_dir)), 5.0), "a process of the job is left"
    assert list(tmp.iterdir()) == []


def test_planted_names_cover_the_helpers_first_imports() -> None:
    # The names planted by the tests of issue 26 case 3: what the helpers' start-up imports
    # (standard library, ``multiprocessing``'s start, and ours), none of them imported
    # by Python before ``-c`` code runs.
    preloaded = subprocess.run([sys.executable, "-c", "import sys; print(' '.join(sys.modules))"],
                               capture_output=True, text=True, check=True).stdout.split()
    assert not set(PLANTED) & set(preloaded)


BUILD_ONE = r"""
import json, sys
import pyopencl as cl, asyncclcache as acc
from kernels import small_source, run_twice
from _pocl import pocl_context
ctx = pocl_context()
cache = acc.Cache(sys.argv[1], rank_local=False)
ok = run_twice(ctx, acc.Program(ctx, small_source("twice0", salt="not-here"), cache=cache).build(), "twice0")
print(json.dumps({"ok": ok, "flushed": cache.flush(60), **cache.stats().as_dict()}))
"""


def test_bake_with_no_os_facilities(cache_dir: Path, tmp_path: Path) -> None:
    cold = child_json(run_child(BUILD_ONE, str(cache_dir)))
    assert cold["ok"] and cold["flushed"] and cold["writes"] == 1, cold
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, **NOT_HERE, TMPDIR=str(tmp))
    proc = subprocess.Popen([sys.executable, "-m", "asyncclcache", "bake", "--dir", str(cache_dir), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    result = json.loads(out)
    assert result["baked"] == 1 and not result["failed"], result
    assert list(tmp.iterdir()) == []
    assert gone(with_args("asyncclcache.bake:_worker_main", f"\x00{proc.pid}\x00"), 5.0)  # its workers
