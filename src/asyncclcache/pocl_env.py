"""What pocl makes of its environment: whether its kernel cache is on, and where it is.

One rule for the whole package, copied from pocl's own code (``pocl_cache_init_topdir``
in ``lib/CL/pocl_cache.c`` and ``pocl_get_bool_option`` in ``pocl_runtime_config.c``;
the same from pocl 3.1 through 7.2):

* ``POCL_KERNEL_CACHE`` set: on exactly when its value starts with ``1``
  (``strncmp(val, "1", 1)``), so ``true``, ``yes``, ``on`` and ``""`` are *off*.
  Unset: on (``KERNEL_CACHE_DEFAULT``, on in pocl's builds and Debian's).
* ``POCL_CACHE_DIR`` set: that directory, even with the cache off; set but empty, pocl
  cannot start its cache (``None`` here).
* Else ``$XDG_CACHE_HOME/pocl/kcache`` where that is set and not empty, else
  ``$HOME/.cache/pocl/kcache`` where ``HOME`` is set (even empty), else
  ``/tmp/pocl/kcache`` (``pocl/uncached`` instead of ``pocl/kcache`` with the cache off).
  Never the password database's home directory, which ``os.path.expanduser`` falls
  back to.

pocl reads these once, when its platform starts; callers that keep the answer for the
rest of the process do as pocl does. pocl also writes a temporary copy of every program
source into this directory before it compiles, so a quoted ``#include`` of the main
source is looked up here first (:func:`source_dir`). Pure functions of the environment:
thread- and process-safe.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["cache_topdir", "kernel_cache_dir", "kernel_cache_enabled", "source_dir"]


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def kernel_cache_enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether pocl keeps its kernel cache (``POCL_KERNEL_CACHE`` as pocl reads it)."""
    value = _env(env).get("POCL_KERNEL_CACHE")
    return True if value is None else value.startswith("1")


def cache_topdir(env: Mapping[str, str] | None = None) -> Path | None:
    """pocl's cache directory, with its kernel cache on or off (absolute); ``None`` where
    pocl cannot start one (``POCL_CACHE_DIR`` set but empty)."""
    e = _env(env)
    given = e.get("POCL_CACHE_DIR")
    if given is not None:
        return Path(os.path.abspath(given)) if given else None
    sub = "pocl/kcache" if kernel_cache_enabled(e) else "pocl/uncached"
    xdg = e.get("XDG_CACHE_HOME")
    if xdg:
        top = f"{xdg}/{sub}"
    elif e.get("HOME") is not None:
        top = f"{e['HOME']}/.cache/{sub}"  # pocl's snprintf: HOME="" gives /.cache/...
    else:
        top = f"/tmp/{sub}"  # noqa: S108 - pocl's own fallback, not a temp file of ours
    return Path(os.path.abspath(top))


def kernel_cache_dir(env: Mapping[str, str] | None = None) -> Path | None:
    """pocl's kernel cache directory; ``None`` when pocl's kernel cache is off."""
    return cache_topdir(env) if kernel_cache_enabled(env) else None


def source_dir(env: Mapping[str, str] | None = None) -> Path | None:
    """The directory of the file that pocl's compiler sees as the main source: pocl
    writes its temporary copy of the source into its cache directory, so clang looks
    there first for a quoted ``#include`` of the main source."""
    return cache_topdir(env)
