"""The package's errors: every public one under AsyncCLCacheError, in errors.py, with a
docstring saying when it is raised and the built-in it refines; one UsageError."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from asyncclcache import errors

#: Control-flow exceptions that never reach a user, and who catches them.
PRIVATE = {
    "asyncclcache.drivers.base.Dropped": "a driver's answer at shutdown: the pipeline counts it skipped",
    "asyncclcache.drivers.base.Lost": "a driver's answer 'nothing to store': the pipeline counts it unidentified",
    "asyncclcache.keys.UncertainIncludes": "the include scan's: its callers make it a build not cached",
}

#: Every exception class defined in the package's modules (each imported in a fresh
#: process: ``__main__`` would run the command), with its bases and own docstring.
WALK = r"""
import importlib, inspect, json, pkgutil, sys
import asyncclcache
out, failed = {}, {}
for m in pkgutil.walk_packages(asyncclcache.__path__, "asyncclcache."):
    if m.name.endswith("__main__"):
        continue
    try:
        module = importlib.import_module(m.name)
    except Exception as e:
        failed[m.name] = f"{type(e).__name__}: {e}"
        continue
    for name, cls in vars(module).items():
        if inspect.isclass(cls) and issubclass(cls, BaseException) and cls.__module__.startswith("asyncclcache"):
            out[f"{cls.__module__}.{cls.__qualname__}"] = {
                "mro": [f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__],
                "doc": cls.__dict__.get("__doc__") or "", "seen_in": m.name}
print(json.dumps({"classes": out, "failed": failed}))
"""


@pytest.fixture(scope="module")
def defined() -> dict[str, dict]:
    proc = subprocess.run([sys.executable, "-c", WALK], capture_output=True, text=True, timeout=120, check=True)
    walk = json.loads(proc.stdout.splitlines()[-1])
    assert walk["failed"] == {}
    assert len(walk["classes"]) > 15, walk  # the walk sees them
    return walk["classes"]


def test_every_public_error_is_an_asyncclcache_error_in_errors_py(defined: dict[str, dict]) -> None:
    wrong = {}
    for name, info in defined.items():
        short = name.rsplit(".", 1)[1]
        if name in PRIVATE or short.startswith("_"):
            continue
        base = ("asyncclcache.errors.AsyncCLCacheWarning" if "builtins.Warning" in info["mro"]
                else "asyncclcache.errors.AsyncCLCacheError")
        doc = info["doc"].strip()
        if (not name.startswith("asyncclcache.errors.") or base not in info["mro"] or not doc
                or short not in errors.__all__):
            wrong[name] = (info["mro"], doc)
    assert wrong == {}


def test_the_private_ones_are_what_the_list_says(defined: dict[str, dict]) -> None:
    for name in PRIVATE:
        assert name in defined, name
        assert "asyncclcache.errors.AsyncCLCacheError" not in defined[name]["mro"], name
        assert not hasattr(errors, name.rsplit(".", 1)[1]), name


def test_each_error_still_is_the_built_in_it_refines_and_where_it_was() -> None:
    from asyncclcache import archive, binaries, cli, entry, fileio, runner

    for old_home, cls, builtin in (
        (fileio, errors.InsecurePathError, PermissionError), (entry, errors.EntryFormatError, ValueError),
        (binaries, errors.BinaryQueryError, RuntimeError),
        (archive, errors.ArchiveError, Exception), (errors, errors.BackgroundError, RuntimeError),
    ):
        assert getattr(old_home, cls.__name__) is cls
        assert issubclass(cls, errors.AsyncCLCacheError) and issubclass(cls, builtin), cls
    assert cli.UsageError is runner.UsageError is errors.UsageError  # one
    assert errors.BinaryQueryError("CL_PROGRAM_BINARIES", -30).code == -30


def test_both_commands_report_a_usage_error_alike() -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "asyncclcache", *args], capture_output=True, text=True,
                              timeout=120, check=False)

    for proc, says in ((run("run", "--strategy"), "run: --strategy needs a value"),
                       (run("prune", "--dir", "/nonexistent-acc"), "prune needs --max-size")):
        assert proc.returncode == 2 and f"\nasyncclcache: {says}" in f"\n{proc.stderr}", proc.stderr
        assert "Traceback" not in proc.stderr
