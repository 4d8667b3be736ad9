"""Strategy process: the helper builds what the key describes (issue 18).

The helper compiles the main process's source again; its entry is stored under the
main process's key. So the helper must compile in the caller's working directory and
with the caller's pocl settings as they were when the key was computed, and a Ctrl-C
meant for the program must not kill it. Every scenario runs on real pocl, in child
processes (a "new node" being one with an empty POCL_CACHE_DIR).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from asyncclcache.store import Store
from conftest import ROOT, child_json, run_child

SOURCE = '#include "params.h"\n__kernel void f(__global float *c) { c[get_global_id(0)] = VAL; }\n'
ENV_SOURCE = "__kernel void f(__global float *c) { c[get_global_id(0)] = VAL; }\n"

# A child: build ``source`` (argv[2]) with ``options`` (argv[3], JSON) in each folder of
# argv[4:] in turn (chdir there first), through a process-strategy cache in argv[1].
# Prints the value each program computed, its key and the stats.
BUILDS = r"""
import json, os, sys
import numpy as np, pyopencl as cl, asyncclcache as acc
from _pocl import pocl_context
ctx = pocl_context(); q = cl.CommandQueue(ctx)
cache = acc.Cache(sys.argv[1], strategy="process")
out = []
for folder in sys.argv[4:]:
    os.chdir(folder)
    prg = acc.Program(ctx, sys.argv[2], cache=cache).build(options=json.loads(sys.argv[3]))
    c = np.zeros(4, np.float32); cd = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, c.nbytes)
    prg.f(q, c.shape, None, cd); cl.enqueue_copy(q, c, cd); q.finish()
    out.append({"value": float(c[0]), "key": prg.cache_key})
flushed = cache.flush(120)
s = cache.stats()
print(json.dumps({"builds": out, "flushed": flushed, "hits": s.hits, "writes": s.writes,
                  "errors": s.errors}))
"""


def _folders(tmp_path: Path, sub: str) -> tuple[Path, Path]:
    # Two folders, each with its own params.h in ``sub``: the same source means 1 in A, 2 in B.
    a, b = tmp_path / "A", tmp_path / "B"
    for folder, val in ((a, 1), (b, 2)):
        (folder / sub).mkdir(parents=True, exist_ok=True)
        (folder / sub / "params.h").write_text(f"#define VAL {val}\n")
    return a, b


def _check_chdir(cache_dir: Path, tmp_path: Path, options: list[str], sub: str = ".") -> None:
    a, b = _folders(tmp_path, sub)
    opts = json.dumps(options)
    env = {"POCL_KERNEL_CACHE": "0"}
    # Built in A (where the helper starts), then in B: B's header is what B's key names.
    cold = child_json(run_child(BUILDS, str(cache_dir), SOURCE, opts, str(a), str(b), env=env))
    assert cold["flushed"] and cold["writes"] == 2 and cold["errors"] == 0
    assert [x["value"] for x in cold["builds"]] == [1.0, 2.0]
    assert cold["builds"][0]["key"] != cold["builds"][1]["key"]
    # A new node in B hits B's entry: it must compute B's value.
    warm = child_json(run_child(BUILDS, str(cache_dir), SOURCE, opts, str(b), env=env))
    assert warm["hits"] == 1
    assert warm["builds"][0] == cold["builds"][1]


def test_quote_include_is_compiled_in_the_callers_folder(cache_dir, tmp_path):
    _check_chdir(cache_dir, tmp_path, [])


@pytest.mark.parametrize(("options", "sub"), [(["-I", "."], "."), (["-I", "inc"], "inc")])
def test_relative_include_dirs_resolve_in_the_callers_folder(cache_dir, tmp_path, options, sub):
    _check_chdir(cache_dir, tmp_path, options, sub)


def test_missing_working_directory_fails_the_request_and_stores_nothing(cache_dir, tmp_path):
    code = r"""
import json, os, sys
import pyopencl as cl, asyncclcache as acc
from _pocl import pocl_context
ctx = pocl_context()
cache = acc.Cache(sys.argv[1], strategy="process")
src = "__kernel void f(__global float *c) { c[get_global_id(0)] = %d; }\n"
acc.Program(ctx, src % 1, cache=cache).build()  # the helper starts in a folder that exists
cache.flush(120)
gone = os.path.join(sys.argv[2], "gone"); os.mkdir(gone); os.chdir(gone); os.rmdir(gone)
acc.Program(ctx, src % 2, cache=cache).build()
flushed = cache.flush(120); s = cache.stats()
print(json.dumps({"flushed": flushed, "writes": s.writes, "errors": s.errors}))
"""
    proc = run_child(code, str(cache_dir), str(tmp_path), env={"POCL_KERNEL_CACHE": "0"})
    out = child_json(proc)
    assert out["flushed"] and out["writes"] == 1 and out["errors"] == 1, (out, proc.stderr)
    assert "working directory" in proc.stderr


# A child: a first build (which starts the helper), then POCL_EXTRA_BUILD_FLAGS=argv[3] in
# os.environ, then a build of argv[2]; prints its value and the stats. argv[3] "-": no change.
ENV_CHILD = r"""
import json, os, sys
import numpy as np, pyopencl as cl, asyncclcache as acc
from _pocl import pocl_context
ctx = pocl_context(); q = cl.CommandQueue(ctx)
cache = acc.Cache(sys.argv[1], strategy="process")
def run(src):
    prg = acc.Program(ctx, src, cache=cache).build()
    c = np.zeros(4, np.float32); cd = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, c.nbytes)
    prg.f(q, c.shape, None, cd); cl.enqueue_copy(q, c, cd); q.finish()
    return float(c[0])
out = {}
if sys.argv[3] != "-":
    run("__kernel void f(__global float *c) { c[get_global_id(0)] = 1; }\n")
    cache.flush(120)
    os.environ["POCL_EXTRA_BUILD_FLAGS"] = sys.argv[3]
out["value"] = run(sys.argv[2])
out["flushed"] = cache.flush(120)
s = cache.stats()
out.update(hits=s.hits, writes=s.writes, errors=s.errors, starts=cache.drivers["process"].starts)
print(json.dumps(out))
"""

ENV_VAL_SOURCE = "#ifndef VAL\n#define VAL 7\n#endif\n" + ENV_SOURCE


@pytest.mark.parametrize("before", [None, "-DVAL=3"])
def test_helper_compiles_with_the_pocl_settings_of_the_key(cache_dir, before):
    # pocl keeps the first value it reads of a setting, in the helper as in the main
    # process: a helper started before the change must be replaced by a fresh one.
    env = {"POCL_KERNEL_CACHE": "0"}
    if before is not None:
        env["POCL_EXTRA_BUILD_FLAGS"] = before
    cold = child_json(run_child(ENV_CHILD, str(cache_dir), ENV_VAL_SOURCE, "-DVAL=5", env=env))
    assert cold["flushed"] and cold["writes"] == 2 and cold["errors"] == 0
    # A new node started with the setting hits the entry its key names: built with -DVAL=5.
    warm = child_json(run_child(ENV_CHILD, str(cache_dir), ENV_VAL_SOURCE, "-",
                                env={"POCL_KERNEL_CACHE": "0", "POCL_EXTRA_BUILD_FLAGS": "-DVAL=5"}))
    assert warm["hits"] == 1 and warm["starts"] == 0
    assert warm["value"] == 5.0
    assert cold["starts"] == 2  # the setting changed once: one fresh helper, only then


# A child: starts a build of a slow kernel (seed_source(argv[2])) through the helper, prints
# the helper's pid and the key, then sleeps.
SLOW_CHILD = r"""
import sys, time
import pyopencl as cl, asyncclcache as acc
from _pocl import pocl_context
from kernels import seed_source
ctx = pocl_context()
cache = acc.Cache(sys.argv[1], strategy="process", exit_timeout=60)
prg = acc.Program(ctx, seed_source(int(sys.argv[2])), cache=cache).build()
driver = cache.drivers["process"]
deadline = time.monotonic() + 60
while driver.helper_pid is None and time.monotonic() < deadline:
    time.sleep(0.05)
print("HELPER", driver.helper_pid, prg.cache_key, flush=True)
time.sleep(60)
"""


def _slow_child(cache_dir: Path) -> tuple[subprocess.Popen[str], int, str]:
    """The child in a process group of its own (as a shell runs a program), its helper's pid
    and the key, once the helper is compiling (seed_source(300): about 2 s of it)."""
    env = dict(os.environ, POCL_KERNEL_CACHE="0", POCL_CACHE_DIR=tempfile.mkdtemp(prefix="acc-pocl-"))
    env["PYTHONPATH"] = str(ROOT / "tests") + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(SLOW_CHILD), str(cache_dir), "300"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
    )
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if not line.startswith("HELPER "):
        proc.kill()
        raise AssertionError(proc.communicate()[1])
    time.sleep(0.5)  # the helper has the request now
    return proc, int(line.split()[1]), line.split()[2]


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_ctrl_c_reaches_the_program_not_the_helper(cache_dir):
    proc, helper, key = _slow_child(cache_dir)
    try:
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode in (1, -signal.SIGINT) and "KeyboardInterrupt" in err
    # Only the program's own traceback; the helper neither printed one nor died of it.
    assert err.count("Traceback") == 1, err
    assert "helper process died" not in err and "pocl_helper" not in err, err
    # The exit waited for it (exit_timeout): the entry is written, not lost.
    assert Store(cache_dir).load(key) is not None, err
    assert _gone(helper)


def test_helper_in_its_own_session_still_dies_with_its_parent(cache_dir):
    proc, helper, _ = _slow_child(cache_dir)
    assert os.getsid(helper) != os.getsid(proc.pid)
    proc.kill()  # no exit hook runs: only the helper's parent watch can end it
    proc.communicate(timeout=60)
    assert _gone(helper), f"helper {helper} outlived its parent"


def test_helper_prints_no_summary_of_its_own(cache_dir):
    code = r"""
import pyopencl as cl
from _pocl import pocl_context
ctx = pocl_context()
prg = cl.Program(ctx, "__kernel void f(__global float *c) { c[get_global_id(0)] = 4; }\n").build()
import asyncclcache as acc
cache = acc.default_cache()
assert cache.flush(120)
print("driver", sorted(cache.drivers))
# The helper's own way out (its request pipe closed, as when it is replaced), not a kill.
cache.drivers["process"]._stop_proc(30)
"""
    proc = run_child(code, env={
        "ASYNCCLCACHE_INSTALL": "1", "ASYNCCLCACHE_STATS": "1", "ASYNCCLCACHE_DIR": str(cache_dir),
        "ASYNCCLCACHE_STRATEGY": "process", "POCL_KERNEL_CACHE": "0",
    })
    assert "driver ['process']" in proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("asyncclcache: ")]
    assert len(lines) == 1, proc.stderr
    assert "1 misses, 1 writes" in lines[0], lines[0]


# A child: in argv[2] (holding params.h), for each value of argv[3:] in turn, params.h says
# that value, then the program is built and launched. With argv[1] "step", all of it inside
# one ``with cache.step():`` (the helper rebuilds each from source at its exit). Prints the
# values computed, the keys and the stats.
HEADER_CHILD = r"""
import contextlib, json, os, sys
import numpy as np, pyopencl as cl, asyncclcache as acc
from _pocl import pocl_context
ctx = pocl_context(); q = cl.CommandQueue(ctx)
mode, cache_dir, folder, values = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
os.chdir(folder)
cache = acc.Cache(cache_dir, strategy="process")
src = '#include "params.h"\n__kernel void f(__global float *c) { c[get_global_id(0)] = VAL; }\n'
out = []
with cache.step() if mode == "step" else contextlib.nullcontext():
    for v in values:
        with open("params.h", "w") as f:
            f.write(f"#define VAL {v}\n")
        prg = acc.Program(ctx, src, cache=cache).build()
        c = np.zeros(4, np.float32); cd = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, c.nbytes)
        prg.f(q, c.shape, None, cd); cl.enqueue_copy(q, c, cd); q.finish()
        out.append({"value": float(c[0]), "key": prg.cache_key})
flushed = cache.flush(120)
s = cache.stats()
print(json.dumps({"builds": out, "flushed": flushed, **s.as_dict()}))
"""


def test_a_header_changed_before_the_helpers_rebuild_is_not_stored_under_the_old_key(cache_dir, tmp_path):
    # Issue 26, case 1: the helper compiles the source again at the step's exit, reading
    # params.h as it is then (3); each key holds params.h as it was at its build.
    folder = tmp_path / "job"
    folder.mkdir()
    env = {"POCL_KERNEL_CACHE": "0"}
    cold = child_json(run_child(HEADER_CHILD, "step", str(cache_dir), str(folder), "1", "2", "3", env=env))
    assert cold["flushed"] and cold["errors"] == 0, cold
    assert [b["value"] for b in cold["builds"]] == [1.0, 2.0, 3.0]
    assert len({b["key"] for b in cold["builds"]}) == 3
    # The entries of 1 and 2 cannot be made any more: dropped, counted, not stored.
    assert cold["writes"] <= 1 and cold["unidentified"] >= 2, cold
    # A new node builds each again with its own header: the values of its headers, never 3, 3, 3.
    warm = child_json(run_child(HEADER_CHILD, "plain", str(cache_dir), str(folder), "1", "2", "3", env=env))
    assert [b["value"] for b in warm["builds"]] == [1.0, 2.0, 3.0], warm
    assert [b["key"] for b in warm["builds"]] == [b["key"] for b in cold["builds"]]
    assert warm["hits"] == cold["writes"], (cold, warm)


SHADOW_CHILD = r"""
import json, os, sys
import numpy as np, pyopencl as cl, asyncclcache as acc
from _pocl import pocl_context
ctx = pocl_context(); q = cl.CommandQueue(ctx)
mode, cache_dir, folder = sys.argv[1:4]
os.chdir(folder)
cache = acc.Cache(cache_dir, strategy="process")
src = '#include <params.h>\n__kernel void f(__global float *c) { c[get_global_id(0)] = VAL; }\n'
with cache.step():
    prg = acc.Program(ctx, src, cache=cache).build(options=["-Ia", "-Ib"])
    c = np.zeros(4, np.float32); cd = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, c.nbytes)
    prg.f(q, c.shape, None, cd); cl.enqueue_copy(q, c, cd); q.finish()
    if mode == "shadow":  # before the helper's rebuild at the step's end: found first on -Ia
        with open("a/params.h", "w") as f:
            f.write("#define VAL 9\n")
flushed = cache.flush(120)
print(json.dumps({"value": float(c[0]), "key": prg.cache_key, "flushed": flushed, **cache.stats().as_dict()}))
"""


def test_a_header_found_elsewhere_at_the_helpers_rebuild_is_not_stored_under_the_old_key(cache_dir, tmp_path):
    # The helper's rebuild looks the includes up again: a params.h that appeared earlier on
    # the include path (-Ia before -Ib) is what it would compile, under the key of b's.
    folder = tmp_path / "job"
    (folder / "a").mkdir(parents=True)
    (folder / "b").mkdir()
    (folder / "b" / "params.h").write_text("#define VAL 2\n")
    env = {"POCL_KERNEL_CACHE": "0"}
    cold = child_json(run_child(SHADOW_CHILD, "shadow", str(cache_dir), str(folder), env=env))
    assert cold["value"] == 2.0 and cold["flushed"], cold
    assert (cold["writes"], cold["unidentified"]) == (0, 1), cold
    (folder / "a" / "params.h").unlink()
    warm = child_json(run_child(SHADOW_CHILD, "plain", str(cache_dir), str(folder), env=env))
    assert warm["key"] == cold["key"] and warm["value"] == 2.0 and warm["hits"] == 0, warm


def test_the_helper_never_imports_from_the_working_folder(cache_dir, tmp_path):
    # Issue 26, case 3: ``python -c`` put the job's working folder (a shared 1777 one, say)
    # first on the helper's sys.path: its signal.py, hashlib.py, ... ran in the helper.
    from _procs import SAFE_PATH, plant

    folder, marks = tmp_path / "shared", tmp_path / "marks"
    plant(folder, marks)
    (folder / "params.h").write_text("#define VAL 5\n")
    out = child_json(run_child(SAFE_PATH + BUILDS, str(cache_dir), SOURCE, "[]", str(folder),
                               env={"POCL_KERNEL_CACHE": "0"}))
    assert sorted(p.name for p in marks.iterdir()) == []
    assert out["flushed"] and (out["writes"], out["errors"]) == (1, 0), out
    assert out["builds"][0]["value"] == 5.0
