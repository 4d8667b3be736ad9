"""The pytest plugin (``-p asyncclcache``, ``--asyncclcache`` or ``asyncclcache = true``, its
entry point installed with the package): a project's own test session, run
for real in a folder of its own, caches its pyopencl builds on real pocl, as CI runs it (a
new machine: an empty pocl cache each time, the cache folder kept)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SUITE = '''
import numpy as np
import pyopencl as cl

def test_twice():
    plat = [p for p in cl.get_platforms() if "Portable" in p.name][0]
    ctx = cl.Context(plat.get_devices())
    q = cl.CommandQueue(ctx)
    src = "__kernel void twice(__global float *a) { a[get_global_id(0)] *= 2; } // plugin test"
    prg = cl.Program(ctx, src).build()
    a = np.arange(16, dtype=np.float32)
    buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=a)
    prg.twice(q, a.shape, None, buf)
    cl.enqueue_copy(q, a, buf)
    assert (a == 2 * np.arange(16)).all()
'''


def _session(project: Path, tmp: Path, run: str, *options: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ASYNCCLCACHE_", "PYTEST_ADDOPTS"))}
    env["POCL_CACHE_DIR"] = str(tmp / f"pocl-{run}")  # a new machine each run
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *options],
                          cwd=project, env=env, capture_output=True, text=True, timeout=300, check=False)


def _project(tmp: Path, ini: str) -> Path:
    project = tmp / "project"
    project.mkdir(exist_ok=True)
    (project / "test_kernels.py").write_text(SUITE)
    (project / "pytest.ini").write_text(ini)
    return project


@pytest.mark.parametrize(("ini", "options"), [
    ("asyncclcache = true\n", ()),
    ("", ("-p", "asyncclcache")),
    ("", ("--asyncclcache",)),
    ("addopts = -p asyncclcache\n", ()),
], ids=["ini", "-p", "flag", "addopts"])
def test_a_session_that_asks_for_the_plugin_caches_its_builds(tmp_path: Path, ini: str, options: tuple[str, ...]) -> None:
    project = _project(tmp_path, f"[pytest]\n{ini}asyncclcache_dir = .acc-cache\n")
    cold = _session(project, tmp_path, "cold", *options)
    assert cold.returncode == 0, cold.stdout + cold.stderr
    assert "asyncclcache: 0 hits, 1 misses, 1 writes" in cold.stdout, cold.stdout
    assert str(project / ".acc-cache") in cold.stdout
    warm = _session(project, tmp_path, "warm", *options)
    assert warm.returncode == 0, warm.stdout + warm.stderr
    assert "asyncclcache: 1 hits, 0 misses, 0 writes" in warm.stdout, warm.stdout


def test_installed_but_not_asked_for_nothing_is_cached(tmp_path: Path) -> None:
    project = _project(tmp_path, "[pytest]\nasyncclcache_dir = .acc-cache\n")
    r = _session(project, tmp_path, "plain")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "asyncclcache:" not in r.stdout and not (project / ".acc-cache").exists()
    # The entry point did load it (the ini option is known: no warning about it).
    assert "PytestConfigWarning" not in r.stdout + r.stderr, r.stdout + r.stderr
    unloaded = _session(project, tmp_path, "unloaded", "-p", "no:asyncclcache", "--asyncclcache")
    assert unloaded.returncode != 0 and "--asyncclcache" in unloaded.stderr  # no such option then


def test_a_bad_setting_warns_and_the_session_runs_uncached(tmp_path: Path) -> None:
    project = _project(tmp_path, "[pytest]\nasyncclcache = true\n")
    env_dir = "~nosuchuser-acc35/x"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=project,
                       env=dict(os.environ, ASYNCCLCACHE_DIR=env_dir, POCL_CACHE_DIR=str(tmp_path / "pocl")),
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SettingWarning" in r.stdout + r.stderr and "ASYNCCLCACHE_DIR" in r.stdout + r.stderr
    assert "1 passed" in r.stdout


def test_under_xdist_the_summary_sums_every_workers_builds(tmp_path: Path) -> None:
    # Issue 40: `pytest -n 2 -p asyncclcache` said 0 hits, 0 misses, 0 writes (the controller's).
    pytest.importorskip("xdist", reason="pytest-xdist (the test extra) is not installed")
    project = _project(tmp_path, "[pytest]\nasyncclcache_dir = .acc-cache\n")
    (project / "test_more.py").write_text(SUITE.replace("twice", "thrice").replace("*= 2", "*= 3")
                                          .replace("2 * np", "3 * np"))
    cold = _session(project, tmp_path, "cold", "-n", "2", "-p", "asyncclcache")
    assert cold.returncode == 0 and "2 passed" in cold.stdout, cold.stdout + cold.stderr
    assert "asyncclcache: 0 hits, 2 misses, 2 writes" in cold.stdout and "(2 workers)" in cold.stdout, cold.stdout
    warm = _session(project, tmp_path, "warm", "-n", "2", "-p", "asyncclcache")
    assert "asyncclcache: 2 hits, 0 misses, 0 writes" in warm.stdout, warm.stdout
