"""A pytest plugin: every pyopencl build of a test session goes through asyncclcache, for
projects that want the cache in their test configuration only (docs/ci.md).

Installed with the package (entry point ``pytest11``: ``asyncclcache``), and off until a
session asks for it, in any of these ways::

    pytest -p asyncclcache                        # or --asyncclcache, or in the configuration:

    [tool.pytest.ini_options]
    asyncclcache = true
    asyncclcache_dir = ".acc-cache"               # optional: relative to the rootdir

So installing the package changes no other test suite (``-p no:asyncclcache`` unloads it).
Where the package is on ``sys.path`` but not installed, ``-p asyncclcache.pytest_plugin``
loads this module by its name. At the start of the session it calls
:func:`asyncclcache.install` (a bad ``ASYNCCLCACHE_*`` setting: one
:class:`~asyncclcache.errors.SettingWarning`, and the session runs uncached); at its end it
closes the caches, waiting for pending writes no longer than the exit timeout
(``ASYNCCLCACHE_EXIT_TIMEOUT``), and prints the summary line. Each process of a session
(pytest-xdist's workers) installs its own; they share the directory safely. Under xdist
each worker closes its caches at its session's end and hands its counters to the
controller, whose line sums every worker's (and says so; a worker that died before
reporting is named as missing from the sum).
``ASYNCCLCACHE_DISABLE`` and ``PYOPENCL_NO_CACHE`` turn it off as they turn ``install()`` off.
"""

from __future__ import annotations

import os
from typing import Any

import pytest  # a plugin: loaded by pytest alone

__all__ = [
    "pytest_addoption", "pytest_configure", "pytest_sessionfinish", "pytest_terminal_summary",
    "pytest_testnodedown", "pytest_unconfigure",
]

#: The ini options: on, and the cache directory (relative to the rootdir).
ON_OPTION = "asyncclcache"
DIR_OPTION = "asyncclcache_dir"
#: The names that load this module with ``-p``: the entry point's, and the module's own.
PLUGIN_NAMES = ("asyncclcache", __name__)


def pytest_addoption(parser: Any) -> None:
    parser.addini(ON_OPTION, "asyncclcache: cache the session's pyopencl builds", type="bool", default=False)
    parser.addini(DIR_OPTION, "asyncclcache: the cache directory, relative to the rootdir "
                  "(default: ASYNCCLCACHE_DIR, else the user's cache directory)", default="")
    parser.getgroup("asyncclcache").addoption(
        "--asyncclcache", action="store_true", default=False,
        help="cache the session's pyopencl builds with asyncclcache (docs/ci.md)")


def _asked(config: Any) -> bool:
    loaded = getattr(config.known_args_namespace, "plugins", None) or []
    return (bool(config.getoption("asyncclcache")) or bool(config.getini(ON_OPTION))
            or any(name in PLUGIN_NAMES for name in loaded))


def pytest_configure(config: Any) -> None:
    """Install the cache for the session where it is asked for (the directory of the ini
    option, where ``ASYNCCLCACHE_DIR`` does not name one)."""
    if not _asked(config):
        return
    given = config.getini(DIR_OPTION)
    if given and not os.environ.get("ASYNCCLCACHE_DIR"):
        # Read once by the settings (absolute: a test that changes folder keeps the cache).
        os.environ["ASYNCCLCACHE_DIR"] = os.path.join(str(config.rootpath), given)
    from .program import install

    config.stash[_INSTALLED] = install()


def _close() -> tuple[Any, list[str]]:
    from .cache import close_all
    from .stats import Stats

    total, dirs = Stats(), []
    for directory, stats in close_all():
        total = total + stats
        if directory not in dirs:
            dirs.append(directory)
    return total, dirs


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    """In a pytest-xdist worker: close its caches and hand their counters to the controller
    (the worker prints nothing of its own)."""
    config = session.config
    out = getattr(config, "workeroutput", None)
    if out is None or not config.stash.get(_INSTALLED, False):
        return
    total, dirs = _close()
    out[WORKER_OUTPUT] = {"stats": total.as_dict(), "dirs": dirs}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """pytest-xdist's controller: a worker ended; keep what its caches counted."""
    config = node.config
    if not config.stash.get(_INSTALLED, False):
        return
    reports = config.stash.setdefault(_WORKERS, [])
    reports.append(getattr(node, "workeroutput", {}).get(WORKER_OUTPUT))


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: Any) -> None:
    """Close the caches (bounded) and say what they did, as the exit summary does; under
    pytest-xdist, what every worker's did too."""
    if not config.stash.get(_INSTALLED, False):
        return
    from .stats import Stats
    from .summary import summary_line

    total, dirs = _close()
    reports = config.stash.get(_WORKERS, None)
    if reports is None:
        terminalreporter.write_line(summary_line(total, dirs))
        return
    for report in reports:
        if report is None:
            continue
        total = total + Stats.from_values(
            {k: float(v) for k, v in report["stats"].items() if k in Stats.__dataclass_fields__})
        dirs += [d for d in report["dirs"] if d not in dirs]
    reported = sum(r is not None for r in reports)
    whose = f"{reported} workers" if reported == len(reports) else f"{reported} of {len(reports)} workers reported"
    terminalreporter.write_line(f"{summary_line(total, dirs)}  ({whose})")


def pytest_unconfigure(config: Any) -> None:
    if config.stash.get(_INSTALLED, False):
        from .program import uninstall

        uninstall()


#: The key of a worker's counters in pytest-xdist's ``workeroutput``.
WORKER_OUTPUT = "asyncclcache"
_INSTALLED = pytest.StashKey[bool]()
#: The controller's: each worker's report (``None``: it ended without one).
_WORKERS = pytest.StashKey[list[Any]]()
