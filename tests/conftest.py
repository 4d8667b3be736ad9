"""Fixtures: a temp cache directory, a real pocl context, and fresh processes.

pocl reads ``POCL_CACHE_DIR`` once per process, so this process gets its own
(set before pyopencl starts), and tests that need a *new node* run their
scenario in a child process with a fresh one (:func:`run_child`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# What the session makes outside pytest's tmp_path (pocl caches of new nodes, the default cache
# directory, node copies) goes in one folder, removed at the end (pytest_sessionfinish).
_TMP = tempfile.gettempdir()
_TMP_BEFORE = set(os.listdir(_TMP))
SESSION_TMP = Path(tempfile.mkdtemp(prefix="acc-test-"))


def session_tmp(prefix: str) -> str:
    """A new folder in the session's own, removed with it at the end."""
    return tempfile.mkdtemp(prefix=prefix, dir=SESSION_TMP)


_SESSION_POCL = session_tmp("pocl-")
os.environ["POCL_CACHE_DIR"] = _SESSION_POCL
# Children must not inherit a user's settings that change what is tested.
for _var in list(os.environ):
    if _var.startswith("ASYNCCLCACHE_") or _var == "PYOPENCL_NO_CACHE":
        del os.environ[_var]
os.environ["ASYNCCLCACHE_DIR"] = session_tmp("default-")
# Idle baking (on by default) only where a test asks for it: a helper process
# of every cache would change what the others count and time.
os.environ["ASYNCCLCACHE_BAKE"] = "off"
# Node-local copies of the tests' ranks: not in the machine's /tmp/asyncclcache-<uid>.
os.environ["ASYNCCLCACHE_NODE_DIR"] = session_tmp("node-")
# Every test is about pocl, picked by name, also in the examples and benchmarks the tests run:
# with Mesa's ICD installed the first platform may be rusticl or Clover (no devices).
os.environ["PYOPENCL_CTX"] = "portable"

import pytest  # noqa: E402

from _need import CI, need  # noqa: E402 - tests import need from here
from _pocl import PoclMissingError, pocl_context  # noqa: E402
from kernels import run_twice, seed_source, small_source  # noqa: E402, F401

ROOT = Path(__file__).resolve().parent.parent
#: Names that the tests, the examples and the library give what they make in the temp folder.
_OURS = ("acc-", "nowhere-", "asyncclcache-")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Remove the session's folder; say what else the session left in the temp folder (under
    CI=true a failure: another run on the machine may leave such names too, so not locally)."""
    shutil.rmtree(SESSION_TMP, ignore_errors=True)
    left = sorted(n for n in set(os.listdir(_TMP)) - _TMP_BEFORE if n.startswith(_OURS))
    if not left:
        return
    text = f"left in {_TMP}: {', '.join(left[:20])}" + (f" and {len(left) - 20} more" if len(left) > 20 else "")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"{'error' if CI else 'warning'}: the tests {text}", red=CI, yellow=not CI)
    if CI and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    """An empty directory for a cache."""
    d = tmp_path / "acc"
    return d


@pytest.fixture(scope="session")
def cl_ctx() -> Any:
    """A real pocl context (the first pocl CPU device)."""
    try:
        return pocl_context()
    except PoclMissingError as e:
        need("pocl", str(e))
    return None


@pytest.fixture
def open_cache() -> Iterator[Callable[..., Any]]:
    """``open_cache(...)`` is ``acc.Cache(...)``, closed at teardown even when the test fails.

    A test may still close a cache itself (close is idempotent): where closing is part of
    what it checks, or before it opens the same directory again.
    """
    import asyncclcache as acc

    opened: list[Any] = []

    def make(*args: Any, **kwargs: Any) -> Any:
        cache = acc.Cache(*args, **kwargs)
        opened.append(cache)
        return cache

    yield make
    for cache in reversed(opened):
        cache.close()


@pytest.fixture
def queue(cl_ctx: Any) -> Any:
    import pyopencl as cl

    return cl.CommandQueue(cl_ctx)


def run_in_threads(n: int, work: Any) -> list[BaseException]:
    """Run ``work(i)`` for i in range(n) on n threads released together; what they raised."""
    import threading

    barrier = threading.Barrier(n)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait()
            work(i)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def run_child(
    code: str,
    *args: str,
    pocl_cache: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh Python with its own POCL_CACHE_DIR (a new node)."""
    e = dict(os.environ)
    e["POCL_CACHE_DIR"] = str(pocl_cache) if pocl_cache else session_tmp("pocl-")
    e["PYTHONPATH"] = str(ROOT / "tests") + os.pathsep + e.get("PYTHONPATH", "")
    if env:
        e.update(env)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        env=e,
        timeout=timeout,
        check=False,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"child failed with {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        )
    return proc


def child_json(proc: subprocess.CompletedProcess[str]) -> Any:
    """The last stdout line of a child, parsed as JSON."""
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert lines, f"child printed nothing; stderr:\n{proc.stderr}"
    return json.loads(lines[-1])
