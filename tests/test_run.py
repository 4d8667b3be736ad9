"""No code change: ``asyncclcache run`` (script, module, command, under mpiexec),
``ASYNCCLCACHE_INSTALL=1`` with a plain ``python script.py``, and the exit summary.

Every program here is a real process on real pocl; a second run on a new node (a fresh
``POCL_CACHE_DIR``) must hit what the first one wrote.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from asyncclcache.store import Store
from conftest import ROOT, need, session_tmp

# A user's driver that knows nothing of asyncclcache: builds through pyopencl (two
# programs: its own and two of pyopencl.array's), checks its results, exits with argv[1].
DRIVER = r"""
import sys
import numpy as np
import pyopencl as cl
import pyopencl.array as cla
from _pocl import pocl_context

print("name", __name__, "argv", sys.argv[1:], "path0", sys.path[0])
ctx = pocl_context()
q = cl.CommandQueue(ctx)
prg = cl.Program(ctx, "__kernel void twice(__global float *a) { a[get_global_id(0)] *= 2.0f; }").build()
a = cla.arange(q, 16, dtype=np.float32)
prg.twice(q, a.shape, None, a.data)
assert np.allclose((a + 1).get(), 2 * np.arange(16) + 1)
print("installed", cl.Program.build.__module__ == "asyncclcache.program")
if len(sys.argv) > 1 and sys.argv[1] == "raise":
    raise KeyError("from the driver")
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
"""

SUMMARY = re.compile(r"^asyncclcache(?: \[rank \d+\])?: (\d+) hits, (\d+) misses, (\d+) writes .* s saved, "
                     r"(\d+) pending", re.MULTILINE)


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "tests") + os.pathsep + env.get("PYTHONPATH", "")
    env["POCL_CACHE_DIR"] = session_tmp("pocl-")  # a new node
    env.pop("ASYNCCLCACHE_DIR", None)
    env.update(extra)
    return env


def _run(argv: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, env=_env(**env), timeout=300,
                          check=False)


def _summary(stderr: str) -> tuple[int, int, int, int]:
    lines = SUMMARY.findall(stderr)
    assert len(lines) == 1, stderr
    hits, misses, writes, pending = (int(x) for x in lines[0])
    return hits, misses, writes, pending


def _entries(d: Path) -> int:
    return len(list(Store(d, rank_local=False, create=False).entries()))


@pytest.fixture
def driver(tmp_path: Path) -> Path:
    p = tmp_path / "work" / "driver.py"
    p.parent.mkdir()
    p.write_text(DRIVER)
    return p


def test_run_script_with_arguments_exit_code_and_a_warm_second_run(driver, cache_dir, tmp_path):
    acc_run = [sys.executable, "-m", "asyncclcache", "run", "--dir", str(cache_dir), "--stats"]
    cold = _run([*acc_run, str(driver), "3", "--flag"], cwd=tmp_path)
    assert cold.returncode == 3, cold.stderr
    # What `python driver.py 3 --flag` would have seen.
    assert f"name __main__ argv ['3', '--flag'] path0 {driver.parent}" in cold.stdout
    assert "installed True" in cold.stdout
    hits, misses, writes, pending = _summary(cold.stderr)
    assert (hits, misses, writes, pending) == (0, 3, 3, 0)
    assert _entries(cache_dir) == 3

    warm = _run([*acc_run, str(driver)], cwd=tmp_path)  # a new node
    assert warm.returncode == 0, warm.stderr
    assert _summary(warm.stderr)[:3] == (3, 0, 0)


def test_run_script_exception_is_the_scripts_own(driver, cache_dir, tmp_path):
    proc = _run([sys.executable, "-m", "asyncclcache", "run", "--dir", str(cache_dir), str(driver), "raise"],
                cwd=tmp_path)
    assert proc.returncode == 1
    # The traceback starts at the driver, as `python driver.py` prints it: no runpy, no runner.
    tb = proc.stderr[proc.stderr.index("Traceback"):]
    assert tb.splitlines()[1].strip().startswith(f'File "{driver}"'), tb
    assert "runpy" not in tb and "runner.py" not in tb
    assert tb.rstrip().endswith("KeyError: 'from the driver'")
    assert "asyncclcache:" not in proc.stderr  # no summary without --stats


def test_run_module_with_arguments(tmp_path, cache_dir):
    pkg = tmp_path / "simpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "step.py").write_text(DRIVER)
    proc = _run([sys.executable, "-m", "asyncclcache", "run", "--dir", str(cache_dir), "--stats",
                 "-m", "simpkg.step", "5", "x"], cwd=tmp_path)
    assert proc.returncode == 5, proc.stderr
    assert f"name __main__ argv ['5', 'x'] path0 {tmp_path}" in proc.stdout
    assert _summary(proc.stderr)[:3] == (0, 3, 3)


def test_run_strategy_option_and_the_console_script(driver, cache_dir, tmp_path):
    exe = Path(sys.executable).with_name("asyncclcache")
    if not exe.exists():
        need("the console script", "no console script next to this interpreter")
    # A strategy that is gone reaches the program (one warning there) and auto serves it.
    proc = _run([str(exe), "run", "--dir", str(cache_dir), "--strategy", "process", "--stats", str(driver)],
                cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("RemovedStrategyWarning: asyncclcache: strategy 'process' is gone") == 1, proc.stderr
    entries = list(Store(cache_dir, rank_local=False, create=False).entries())
    kinds = {Store(cache_dir, rank_local=False).read(e.key).entry.kind for e in entries}
    assert kinds == {"kcache"} and len(entries) == 3


def test_run_command_gets_the_activation_and_returns_its_status(tmp_path, cache_dir):
    proc = _run([sys.executable, "-m", "asyncclcache", "run", "--dir", str(cache_dir), "--stats", "--",
                 "sh", "-c", 'echo "$ASYNCCLCACHE_INSTALL $ASYNCCLCACHE_DIR $ASYNCCLCACHE_STATS"; exit 7'],
                cwd=tmp_path)
    assert proc.returncode == 7
    assert proc.stdout.split() == ["1", str(cache_dir), "1"]


def test_run_command_starting_python_caches(driver, cache_dir, tmp_path):
    # A job script that starts Python itself: the start-up hook activates there.
    proc = _run([sys.executable, "-m", "asyncclcache", "run", "--dir", str(cache_dir), "--stats", "--",
                 sys.executable, str(driver)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "installed True" in proc.stdout
    assert _summary(proc.stderr)[:3] == (0, 3, 3)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "which program"),
        (["--bogus", "x.py"], "unknown option '--bogus'"),
        (["--strategy", "fast", "x.py"], "--strategy must be one of"),
        (["--dir"], "--dir needs a value"),
        (["--"], "-- needs a command"),
        (["missing.py"], "can't open file 'missing.py'"),
    ],
)
def test_run_usage_errors_exit_2(tmp_path, argv, message):
    proc = _run([sys.executable, "-m", "asyncclcache", "run", *argv], cwd=tmp_path)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def _run_input(argv: list[str], cwd: Path, stdin: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, env=_env(), timeout=300,
                          check=False, input=stdin)


def test_run_dash_reads_the_script_from_stdin_as_python_does(cache_dir, tmp_path):
    # Issue 18, case 14: `python - ARGS` runs stdin with argv[0] '-' and sys.path[0] ''.
    acc_run = [sys.executable, "-m", "asyncclcache", "run", "--dir", str(cache_dir), "--stats", "-"]
    proc = _run_input([*acc_run, "4"], tmp_path, DRIVER)
    assert proc.returncode == 4, proc.stderr
    assert "name __main__ argv ['4'] path0 \n" in proc.stdout and "installed True" in proc.stdout
    assert _summary(proc.stderr)[:3] == (0, 3, 3)
    probe = "import sys\nprint(sys.argv, repr(sys.path[0]), __name__, __file__, __spec__)\n"
    ours = _run_input([*acc_run, "a", "b"], tmp_path, probe)
    python = _run_input([sys.executable, "-", "a", "b"], tmp_path, probe)
    assert ours.stdout == python.stdout == "['-', 'a', 'b'] '' __main__ <stdin> None\n", ours.stderr


@pytest.mark.parametrize(
    "script",
    ["x = 1\n1 / 0\n", "def f(:\n", "import no_such_module_acc\n", "raise SystemExit('bye')\n"],
    ids=["exception", "syntax-error", "import-error", "system-exit"],
)
def test_run_dash_errors_are_what_python_dash_prints(tmp_path, script):
    ours = _run_input([sys.executable, "-m", "asyncclcache", "run", "-"], tmp_path, script)
    python = _run_input([sys.executable, "-"], tmp_path, script)
    assert (ours.returncode, ours.stderr) == (python.returncode, python.stderr)


@pytest.mark.parametrize("module", ["no_such_module_acc", "no_such_pkg_acc.sub", "asyncclcache.no_such"])
def test_run_missing_module_is_one_line_as_python_dash_m(tmp_path, module):
    ours = _run([sys.executable, "-m", "asyncclcache", "run", "-m", module], cwd=tmp_path)
    python = _run([sys.executable, "-m", module], cwd=tmp_path)
    assert ours.returncode == python.returncode == 1
    assert ours.stderr == python.stderr, ours.stderr
    assert ours.stderr.count("\n") == 1 and "Traceback" not in ours.stderr
    assert ours.stderr.startswith(f"{sys.executable}: ")


def test_run_module_import_error_inside_the_module_keeps_its_traceback(tmp_path):
    # Only runpy's own "cannot find it" is one line: the module's own ImportError is its.
    (tmp_path / "brokenmod_acc.py").write_text("import no_such_module_acc\n")
    ours = _run([sys.executable, "-m", "asyncclcache", "run", "-m", "brokenmod_acc"], cwd=tmp_path)
    python = _run([sys.executable, "-m", "brokenmod_acc"], cwd=tmp_path)
    assert ours.returncode == python.returncode == 1
    assert "Traceback" in ours.stderr and f'File "{tmp_path / "brokenmod_acc.py"}", line 1' in ours.stderr
    assert ours.stderr.splitlines()[-1] == python.stderr.splitlines()[-1]
    assert "runpy" not in ours.stderr and "runner.py" not in ours.stderr


def test_run_missing_command_exits_127(tmp_path):
    proc = _run([sys.executable, "-m", "asyncclcache", "run", "--", "no-such-command-acc"], cwd=tmp_path)
    assert proc.returncode == 127 and "command not found" in proc.stderr


# {{{ ASYNCCLCACHE_INSTALL=1

def test_install_by_environment_plain_python_script(driver, cache_dir, tmp_path):
    env = {"ASYNCCLCACHE_INSTALL": "1", "ASYNCCLCACHE_DIR": str(cache_dir), "ASYNCCLCACHE_STATS": "1"}
    cold = _run([sys.executable, str(driver)], cwd=tmp_path, **env)
    assert cold.returncode == 0, cold.stderr
    assert "installed True" in cold.stdout
    assert _summary(cold.stderr)[:3] == (0, 3, 3)
    assert _entries(cache_dir) == 3
    warm = _run([sys.executable, str(driver)], cwd=tmp_path, **env)
    assert _summary(warm.stderr)[:3] == (3, 0, 0)

    plain = _run([sys.executable, str(driver)], cwd=tmp_path, ASYNCCLCACHE_DIR=str(cache_dir))
    assert plain.returncode == 0 and "installed False" in plain.stdout and "asyncclcache" not in plain.stderr


@pytest.mark.parametrize("first", ["asyncclcache.cache", "asyncclcache.program", "asyncclcache.drivers"])
def test_install_by_environment_after_a_module_of_ours_imports_pyopencl(first, cache_dir, tmp_path):
    # pyopencl is first imported by a module of ours, still half imported itself: the hook
    # cannot import ours then, and installs at the first build instead.
    script = tmp_path / "work" / "driver.py"
    script.parent.mkdir()
    script.write_text(f"import {first}\n" + DRIVER)
    env = {"ASYNCCLCACHE_INSTALL": "1", "ASYNCCLCACHE_DIR": str(cache_dir), "ASYNCCLCACHE_STATS": "1"}
    cold = _run([sys.executable, str(script)], cwd=tmp_path, **env)
    assert cold.returncode == 0 and "installed True" in cold.stdout, cold.stderr
    assert "install() failed" not in cold.stderr
    assert _summary(cold.stderr)[:3] == (0, 3, 3)


PROBE = "import sys; print(sorted(m for m in ('asyncclcache', 'asyncclcache.cache', 'pyopencl') if m in sys.modules))"


@pytest.mark.parametrize(
    ("value", "loaded"),
    [
        (None, []),
        ("0", []),
        ("", []),
        # Set: the hook waits for pyopencl; nothing heavy is imported before.
        ("1", ["asyncclcache"]),
    ],
)
def test_install_hook_imports_nothing_until_pyopencl(tmp_path, value, loaded):
    env = {} if value is None else {"ASYNCCLCACHE_INSTALL": value}
    proc = _run([sys.executable, "-c", PROBE], cwd=tmp_path, **env)
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout.strip() == repr(loaded)


def test_install_hook_bad_value_says_so_and_python_runs(tmp_path):
    proc = _run([sys.executable, "-c", "print('ran')"], cwd=tmp_path, ASYNCCLCACHE_INSTALL="maybe")
    assert proc.returncode == 0 and proc.stdout.strip() == "ran"
    assert "ASYNCCLCACHE_INSTALL: not activated" in proc.stderr


def test_install_hook_steps_aside_for_disable(driver, cache_dir, tmp_path):
    proc = _run([sys.executable, str(driver)], cwd=tmp_path, ASYNCCLCACHE_INSTALL="1",
                ASYNCCLCACHE_DIR=str(cache_dir), ASYNCCLCACHE_DISABLE="1")
    assert proc.returncode == 0 and "installed False" in proc.stdout
    assert not cache_dir.exists()


def test_stats_without_any_cache_prints_nothing(tmp_path):
    proc = _run([sys.executable, "-m", "asyncclcache", "run", "--stats", "--", sys.executable, "-c", "pass"],
                cwd=tmp_path)
    assert proc.returncode == 0 and proc.stderr == ""

# }}}


# {{{ MPI

MPI_DRIVER = r"""
import sys
from mpi4py import MPI
import numpy as np
import pyopencl as cl
from _pocl import pocl_context

rank = MPI.COMM_WORLD.Get_rank()
ctx = pocl_context()
q = cl.CommandQueue(ctx)
prg = cl.Program(ctx, "__kernel void k(__global float *a) { a[get_global_id(0)] += %d.0f; }" % rank).build()
a = np.zeros(8, np.float32)
buf = cl.Buffer(ctx, cl.mem_flags.COPY_HOST_PTR, hostbuf=a)
prg.k(q, a.shape, None, buf)
cl.enqueue_copy(q, a, buf)
assert (a == rank).all()
# One write per line: the ranks share mpiexec's stdout, and print() writes word by word.
sys.stdout.write(f"rank {rank} argv {sys.argv[1:]} installed {cl.Program.build.__module__ == 'asyncclcache.program'}\n")
sys.stdout.flush()
"""


def test_run_under_mpiexec_one_job_line_from_rank_0(tmp_path, cache_dir):
    from test_mpi import _mpiexec

    exe = _mpiexec()
    if exe is None:
        need("MPI", "MPI cannot start here (no mpiexec, or mpi4py missing: pip install '.[mpi]')")
    script = tmp_path / "mpi_driver.py"
    script.write_text(MPI_DRIVER)
    argv = [exe, "-n", "2", sys.executable, "-m", "asyncclcache", "run", "--dir", str(cache_dir), "--stats",
            str(script), "a1"]
    # Each rank its own node: a fresh POCL_CACHE_DIR per run, shared by its 2 ranks
    # (distinct programs per rank, so pocl#1480 cannot bite).
    cold = _run(argv, cwd=tmp_path)
    assert cold.returncode == 0, cold.stderr
    assert sorted(ln for ln in cold.stdout.splitlines() if ln.startswith("rank")) == [
        "rank 0 argv ['a1'] installed True", "rank 1 argv ['a1'] installed True"]
    lines = [ln for ln in cold.stderr.splitlines() if ln.startswith("asyncclcache")]
    assert len(lines) == 1, cold.stderr
    assert lines[0].startswith("asyncclcache (2 ranks): 0 hits, 2 misses, 2 writes"), lines
    # The ranks share the directory: no rank directories, an entry per program.
    assert not [p for p in (cache_dir / "v1").iterdir() if p.name.startswith("rank-")]
    assert len(list((cache_dir / "v1").rglob("*.acl"))) == 2

    warm = _run(argv, cwd=tmp_path)
    lines = [ln for ln in warm.stderr.splitlines() if ln.startswith("asyncclcache")]
    assert len(lines) == 1 and lines[0].startswith("asyncclcache (2 ranks): 2 hits, 0 misses, 0 writes"), warm.stderr

# }}}

