"""Where Mesa keeps its shader cache for rusticl, as Mesa finds it (docs/design.md F20).

Copied from Mesa's ``disk_cache_enabled``, ``disk_cache_create`` and
``disk_cache_generate_cache_dir`` (``src/util/disk_cache*.c``, Mesa 22.3) and
``debug_get_bool_option`` (``src/util/u_debug.c``), and checked against Mesa 26.1 by
running it (``benchmarks/probe/mesarules.sh``):

* Off when the effective user is not the real one, or when ``MESA_SHADER_CACHE_DISABLE``
  (where unset, ``MESA_GLSL_CACHE_DISABLE``) is true. Mesa's booleans: ``1 y yes t true``
  true, ``0 n no f false`` false (letters in any case), anything else the default (off:
  false).
* The layout: ``MESA_DISK_CACHE_SINGLE_FILE`` true: one Fossilize file per driver;
  ``MESA_DISK_CACHE_DATABASE`` true: Mesa-DB (``mesa_shader_cache_db/part*``). Neither
  is a layout of one file per item, which is what this package can snapshot, so those
  store the binary. Mesa 26 also reads ``MESA_DISK_CACHE_MULTI_FILE``: false there left
  no cache on disk at all, so only unset or true counts as the multi-file layout.
  The default depends on the release (:data:`MULTI_FILE_DEFAULT`): one file per item in
  Mesa 22.3 (Debian 12) and 26.1 (forky), **Mesa-DB in 25.0** (Debian 13), where only
  ``MESA_DISK_CACHE_MULTI_FILE=1`` chose files (``MESA_DISK_CACHE_DATABASE=0`` did not).
  A release not measured is unknown unless ``MESA_DISK_CACHE_MULTI_FILE`` is set.
* The directory: ``$MESA_SHADER_CACHE_DIR/mesa_shader_cache`` (where unset,
  ``MESA_GLSL_CACHE_DIR``), else ``$XDG_CACHE_HOME/mesa_shader_cache``, else
  ``<home>/.cache/mesa_shader_cache``. Mesa 22.3 takes that home from the password
  database and Mesa 26.1 from ``HOME``: where the two differ, the place is unknown.
  Inside: ``<xx>/<rest of the hex key>`` (38 hex digits in 22.3, 62 in 26.1), written
  as ``<name>.tmp`` and renamed, and an ``index`` file Mesa makes again when missing.

Unknown means: store the binary instead, with the reason (:func:`locate`). Pure
functions of the environment (and the password database): thread- and process-safe.
"""

from __future__ import annotations

import os
import pwd
import re
from collections.abc import Mapping
from pathlib import Path

__all__ = ["MULTI_FILE_DEFAULT", "RUSTICL_PLATFORM_NAME", "locate", "mesa_bool", "mesa_release"]

RUSTICL_PLATFORM_NAME = "rusticl"
CACHE_DIR_NAME = "mesa_shader_cache"

#: Whether Mesa keeps one file per item unless told otherwise, per release (major, minor), as
#: measured with rusticl on Debian 12 (22.3.6), Debian 13 (25.0.7: Mesa-DB, also with
#: ``MESA_DISK_CACHE_DATABASE=0``; one file per item with ``MESA_DISK_CACHE_MULTI_FILE=1``)
#: and forky (26.1).
MULTI_FILE_DEFAULT: dict[tuple[int, int], bool] = {(22, 3): True, (25, 0): False, (26, 1): True}


def mesa_bool(value: str | None, default: bool) -> bool:
    """``debug_get_bool_option``: Mesa's reading of a boolean variable."""
    if value is None:
        return default
    if value == "0" or value.lower() in ("n", "no", "f", "false"):
        return False
    if value == "1" or value.lower() in ("y", "yes", "t", "true"):
        return True
    return default


def _home() -> str | None:
    try:
        return pwd.getpwuid(os.getuid()).pw_dir
    except KeyError:
        return None


def mesa_release(driver_version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a rusticl device's driver version (``"25.0.7"``), or ``None``."""
    m = re.match(r"\s*(\d+)\.(\d+)", driver_version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def locate(
    env: Mapping[str, str] | None = None, release: tuple[int, int] | None = None,
) -> tuple[Path | None, str]:
    """``(the multi-file shader cache directory, "")``, or ``(None, why not)``, for Mesa
    ``release`` (:func:`mesa_release`; ``None``: not known, so only an explicit
    ``MESA_DISK_CACHE_MULTI_FILE`` tells the layout)."""
    e = os.environ if env is None else env
    if os.geteuid() != os.getuid():
        return None, "Mesa keeps no shader cache when the effective user is not the real one"
    name = "MESA_SHADER_CACHE_DISABLE" if "MESA_SHADER_CACHE_DISABLE" in e else "MESA_GLSL_CACHE_DISABLE"
    if mesa_bool(e.get(name), False):
        return None, f"Mesa's shader cache is off ({name}={e.get(name)!r})"
    if mesa_bool(e.get("MESA_DISK_CACHE_SINGLE_FILE"), False):
        return None, ("Mesa's shader cache is one Fossilize file (MESA_DISK_CACHE_SINGLE_FILE): "
                      "not a layout stored file by file")
    if mesa_bool(e.get("MESA_DISK_CACHE_DATABASE"), False):
        return None, ("Mesa's shader cache is a Mesa-DB database (MESA_DISK_CACHE_DATABASE): "
                      "not a layout stored file by file")
    multi = e.get("MESA_DISK_CACHE_MULTI_FILE")
    if multi is not None and mesa_bool(multi, False) == mesa_bool(multi, True):
        multi_on: bool | None = mesa_bool(multi, False)
    else:  # unset, or a value Mesa reads as the default
        multi_on = MULTI_FILE_DEFAULT.get(release) if release is not None else None
    label = "an unknown release" if release is None else f"{release[0]}.{release[1]}"
    if multi_on is None:
        return None, (f"which layout Mesa ({label}) gives its shader cache by default was not measured "
                      "(MESA_DISK_CACHE_MULTI_FILE=1 chooses one file per item)")
    if not multi_on:
        if multi is None:
            return None, (f"Mesa {label} keeps its shader cache in a Mesa-DB database by default: not a "
                          "layout stored file by file (MESA_DISK_CACHE_MULTI_FILE=1 chooses one file per item)")
        return None, f"MESA_DISK_CACHE_MULTI_FILE={multi!r}: Mesa then keeps no cache of one file per item"
    for var in ("MESA_SHADER_CACHE_DIR", "MESA_GLSL_CACHE_DIR", "XDG_CACHE_HOME"):
        given = e.get(var)
        if given is None:
            continue
        if not os.path.isabs(given):
            return None, f"{var}={given!r} is not an absolute path"
        return Path(given) / CACHE_DIR_NAME, ""
    home, db_home = e.get("HOME"), _home()
    if home is None or db_home is None or os.path.realpath(home) != os.path.realpath(db_home):
        return None, (f"HOME ({home!r}) is not the home directory of the password database ({db_home!r}): "
                      "Mesa 22.3 reads one, Mesa 26 the other")
    return Path(db_home) / ".cache" / CACHE_DIR_NAME, ""
