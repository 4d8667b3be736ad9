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
from collections.abc import Mapping
from pathlib import Path

__all__ = ["RUSTICL_PLATFORM_NAME", "locate", "mesa_bool"]

RUSTICL_PLATFORM_NAME = "rusticl"
CACHE_DIR_NAME = "mesa_shader_cache"


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


def locate(env: Mapping[str, str] | None = None) -> tuple[Path | None, str]:
    """``(the multi-file shader cache directory, "")``, or ``(None, why not)``."""
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
    if multi is not None and not mesa_bool(multi, False):
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
