"""Ctrl-C while the process waits at exit for pending background work (issue 18, case 11).

The child builds one program whose entry write hangs (a stand-in for a stalled network
file system), so the exit flush waits up to ``ASYNCCLCACHE_EXIT_TIMEOUT`` (30 s here).
A SIGINT then must end the process at once, as Python ends on Ctrl-C: killed by SIGINT,
one clear line, no "Exception ignored" and no traceback, nothing half-written.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from asyncclcache import maintenance
from asyncclcache.store import Store
from conftest import ROOT, session_tmp

HUNG_WRITE_CHILD = r"""
import atexit, sys, time
import asyncclcache as acc
import asyncclcache.store as store_module
from _pocl import pocl_context
from kernels import small_source

real_write = store_module.atomic_write

def hung_write(directory, target, data, write_hook=None):
    # The temp file exists, the write never completes: a stalled file system.
    real_write(directory, target, data, lambda tmp: time.sleep(600))

store_module.atomic_write = hung_write
cache = acc.Cache(sys.argv[1], strategy="thread")
acc.Program(pocl_context(), small_source(salt="exit-ctrl-c"), cache=cache).build()
assert cache.stats().pending == 1
# Registered last, so run first at exit: the cache's exit flush starts right after it.
atexit.register(lambda: print("EXITING", flush=True))
"""


def _run_and_interrupt(cache_dir: Path, how: str, **env: str) -> tuple[int, str, float]:
    e = dict(os.environ, ASYNCCLCACHE_EXIT_TIMEOUT="30", POCL_CACHE_DIR=session_tmp("pocl-"))
    e["PYTHONPATH"] = str(ROOT / "tests") + os.pathsep + e.get("PYTHONPATH", "")
    e.update(env)
    code = textwrap.dedent(HUNG_WRITE_CHILD)
    script = cache_dir.parent / "hung_write_child.py"
    script.write_text(code)
    if how == "run":  # the script on stdin of `asyncclcache run --stats -`: the hooks' other order
        argv = [sys.executable, "-m", "asyncclcache", "run", "--stats", "-", str(cache_dir)]
    else:
        argv = [sys.executable, "-c", code, str(cache_dir)]
    with open(script) as stdin:
        proc = subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=e)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.strip() == "EXITING", proc.communicate(timeout=60)[1]
        time.sleep(1.0)  # well inside the exit flush now (it waits up to 30 s)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err, took


@pytest.mark.parametrize(("how", "stats"), [("python", "0"), ("python", "1"), ("run", "1")])
def test_ctrl_c_during_the_exit_flush_ends_the_process_as_python_does(cache_dir: Path, how: str,
                                                                      stats: str) -> None:
    # With ASYNCCLCACHE_STATS=1 the summary's exit hook closes the caches too (before the
    # cache's own hook, or after it under `run`): the interrupt must not send the second
    # close into another 30 s wait.
    code, err, took = _run_and_interrupt(cache_dir, how, ASYNCCLCACHE_STATS=stats)
    assert code in (-signal.SIGINT, 128 + signal.SIGINT), (code, err)
    assert took < 10, f"exit took {took:.1f} s after the SIGINT\n{err}"
    assert "Exception ignored" not in err and "Traceback" not in err, err
    assert err.count("asyncclcache: interrupted at exit: 1 pending entry dropped") == 1, err
    assert " hits, " not in err, err  # no summary line after an interrupt
    # Dropped, never half-written: no entry at all (a writer's temp file is swept later).
    store = Store(cache_dir, rank_local=False, create=False)
    assert list(store.entries()) == []
    assert maintenance.verify(store) == []


CLOSE_TWICE_CHILD = r"""
import json, os, signal, sys, threading, time
import asyncclcache as acc
import asyncclcache.store as store_module
from asyncclcache.cache import close_all
from _pocl import pocl_context
from kernels import small_source

real_write = store_module.atomic_write
store_module.atomic_write = lambda d, t, data, hook=None: real_write(d, t, data, lambda tmp: time.sleep(600))
cache = acc.Cache(sys.argv[1], strategy="thread", exit_timeout=30)
acc.Program(pocl_context(), small_source(salt="close-twice"), cache=cache).build()
threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
t0 = time.monotonic()
try:
    cache.close()
    interrupted = False
except KeyboardInterrupt:
    interrupted = True
first = time.monotonic() - t0
t0 = time.monotonic()
again = cache.close()
closed = close_all()
second = time.monotonic() - t0
print(json.dumps({"interrupted": interrupted, "first": first, "second": second,
                  "active": cache.active, "pending": closed[-1][1].pending}), flush=True)
os._exit(0)  # the write thread still sleeps: do not wait for anything at exit
"""


def test_an_interrupted_close_never_flushes_again(cache_dir: Path) -> None:
    from conftest import child_json, run_child

    out = child_json(run_child(CLOSE_TWICE_CHILD, str(cache_dir), timeout=120))
    assert out["interrupted"], out  # KeyboardInterrupt reaches the caller of close()
    assert out["first"] < 10 and out["second"] < 1, out  # neither waited out the 30 s
    assert not out["active"] and out["pending"] == 1, out


EVICTING = r"""
import json, sys
import asyncclcache as acc
from _pocl import pocl_context
from kernels import small_source
ctx = pocl_context()
cache = acc.Cache(sys.argv[1], strategy="thread", max_size=1)  # each entry evicts itself
for i in range(2):
    acc.Program(ctx, small_source(salt=f"evict-{i}"), cache=cache).build()
    assert cache.flush(120)
print(json.dumps(cache.stats().as_dict()))
"""


def test_the_exit_line_counts_evictions(cache_dir: Path) -> None:
    from asyncclcache.stats import read_lifetime
    from conftest import child_json, run_child

    proc = run_child(EVICTING, str(cache_dir), env={"ASYNCCLCACHE_STATS": "1"})
    stats = child_json(proc)
    assert (stats["writes"], stats["evictions"]) == (2, 2), stats
    [line] = [ln for ln in proc.stderr.splitlines() if ln.startswith("asyncclcache: ")]
    assert line.split("  [")[0].endswith(" pending (2 evictions)"), line
    assert read_lifetime(Store(cache_dir).root)["evictions"] == 2
