"""A pytest plugin: every pyopencl build of a test session goes through asyncclcache, for
projects that want the cache in their test configuration only (docs/ci.md).

On where it is loaded, and only there::

    pytest -p asyncclcache.pytest_plugin          # or, in the project's configuration:

    [tool.pytest.ini_options]
    addopts = "-p asyncclcache.pytest_plugin"
    asyncclcache_dir = ".acc-cache"               # optional: relative to the rootdir

No entry point registers it, so installing the package changes no other test suite. At
the start of the session it calls :func:`asyncclcache.install` (a bad ``ASYNCCLCACHE_*``
setting: one :class:`~asyncclcache.errors.SettingWarning`, and the session runs uncached);
at its end it closes the caches, waiting for pending writes no longer than the exit
timeout (``ASYNCCLCACHE_EXIT_TIMEOUT``), and prints the summary line. Each process of a
session (pytest-xdist's workers) installs its own; they share the directory safely.
``ASYNCCLCACHE_DISABLE`` and ``PYOPENCL_NO_CACHE`` turn it off as they turn ``install()`` off.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["pytest_addoption", "pytest_configure", "pytest_terminal_summary", "pytest_unconfigure"]

#: The ini option naming the cache directory (relative to the rootdir).
DIR_OPTION = "asyncclcache_dir"


def pytest_addoption(parser: Any) -> None:
    parser.addini(DIR_OPTION, "asyncclcache: the cache directory, relative to the rootdir "
                  "(default: ASYNCCLCACHE_DIR, else the user's cache directory)", default="")


def pytest_configure(config: Any) -> None:
    """Install the cache for the session (the directory of the ini option, where
    ``ASYNCCLCACHE_DIR`` does not name one)."""
    given = config.getini(DIR_OPTION)
    if given and not os.environ.get("ASYNCCLCACHE_DIR"):
        # Read once by the settings (absolute: a test that changes folder keeps the cache).
        os.environ["ASYNCCLCACHE_DIR"] = os.path.join(str(config.rootpath), given)
    from .program import install

    config.stash[_INSTALLED] = install()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: Any) -> None:
    """Close the caches (bounded) and say what they did, as the exit summary does."""
    if not config.stash.get(_INSTALLED, False):
        return
    from .cache import close_all
    from .stats import Stats
    from .summary import summary_line

    total, dirs = Stats(), []
    for directory, stats in close_all():
        total = total + stats
        if directory not in dirs:
            dirs.append(directory)
    terminalreporter.write_line(summary_line(total, dirs))


def pytest_unconfigure(config: Any) -> None:
    if config.stash.get(_INSTALLED, False):
        from .program import uninstall

        uninstall()


def _stash_key() -> Any:
    import pytest

    return pytest.StashKey[bool]()


_INSTALLED = _stash_key()
