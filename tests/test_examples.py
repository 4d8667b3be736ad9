"""Every example runs (short mode) and says what it should."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import need, session_tmp

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

pytestmark = pytest.mark.slow  # whole programs, cold then warm, in fresh processes (mpiexec too)


def _run(args: list[str], cache_dir: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, ASYNCCLCACHE_DIR=str(cache_dir),
               POCL_CACHE_DIR=session_tmp("example-"))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          timeout=timeout, check=False)


def _row(out: str, name: str) -> list[str]:
    line = next(ln for ln in out.splitlines() if ln.strip().startswith(name))
    return line.split()[len(name.split()):]


def test_simulation_demo_pyopencl_cold_then_warm(cache_dir):
    proc = _run([str(EXAMPLES / "simulation.py"), "--short"], cache_dir)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert len(re.findall(r"step +\d+/3:", out)) == 9  # a progress line per step, three runs
    assert _row(out, "hits") == ["-", "0", "4"]
    assert _row(out, "misses") == ["-", "4", "0"]
    writes = _row(out, "writes")
    assert int(writes[1]) == 4 and writes[2] == "0"
    assert int(_row(out, "bytes_written")[1]) > 0
    assert _row(out, "same result") == ["yes"]
    # Which run was fastest is the benchmarks' to say (timings race under load); each is a time.
    assert all(float(t) > 0 for t in _row(out, "first step (s)"))
    # The exit summary of each cached run, none for pyopencl alone.
    summaries = re.findall(r"^  asyncclcache: (\d+) hits, (\d+) misses, (\d+) writes", out, re.MULTILINE)
    assert summaries == [("0", "4", "4"), ("4", "0", "0")]


def test_library_wrapper_second_run_hits_everything(cache_dir):
    first = _run([str(EXAMPLES / "library_wrapper.py")], cache_dir)
    second = _run([str(EXAMPLES / "library_wrapper.py")], cache_dir)
    assert first.returncode == 0, first.stderr
    assert second.returncode == 0, second.stderr
    result = [re.search(r"result (\S+)", p.stdout).group(1) for p in (first, second)]
    assert result[0] == result[1]
    assert re.search(r"[1-9]\d* entries written", first.stdout)
    assert re.search(r" 0 misses; 0 entries written", second.stdout)


def test_mpi_example_explains_or_runs(cache_dir):
    script = str(EXAMPLES / "mpi_ranks.py")
    if importlib.util.find_spec("mpi4py") is None:
        proc = _run([script], cache_dir)
        assert proc.returncode == 2
        assert "needs mpi4py" in proc.stderr and "mpiexec" in proc.stderr
        return
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep
                           + os.environ.get("PATH", ""))
    if mpiexec is None:
        need("mpiexec", "mpi4py is installed but no mpiexec was found")
    env = dict(os.environ, ASYNCCLCACHE_DIR=str(cache_dir))
    runs = {}
    for n in (2, 4):  # more ranks the second time: every rank hits
        runs[n] = subprocess.run([mpiexec, "-n", str(n), sys.executable, script], capture_output=True,
                                 text=True, env=env, timeout=600, check=False)
        assert runs[n].returncode == 0, runs[n].stderr
    assert "2 ranks, one shared cache" in runs[2].stdout
    # Cold: a rank that starts late may hit what the other already wrote, so the split of
    # hits and misses is timing. Not timing: each program's first build misses, and every
    # miss is written or skipped (a refresh at flush may write an entry again).
    hits, misses, writes, skipped = map(int, re.search(
        r"hits (\d+), misses (\d+), writes (\d+), skipped (\d+)", runs[2].stdout).groups())
    assert hits + misses == 8 and misses >= 4 and writes >= 4, runs[2].stdout
    assert writes + skipped >= misses, runs[2].stdout
    assert "4 ranks, one shared cache" in runs[4].stdout and "hits 16, misses 0" in runs[4].stdout
    assert runs[4].stdout.count(str(cache_dir / "v1") + "\n") == 4
    assert "read from the shared directory per node" in runs[4].stdout
