"""Mesa's OpenCL, rusticl (and Clover, which shares Mesa's settings): everything the
package knows of it.

**Its shader cache** for rusticl (:func:`locate`, docs/design.md F20), copied from Mesa's
``disk_cache_enabled``, ``disk_cache_create`` and ``disk_cache_generate_cache_dir``
(``src/util/disk_cache*.c``, Mesa 22.3) and ``debug_get_bool_option``
(``src/util/u_debug.c``), and checked against Mesa 26.1 by running it
(``benchmarks/probe/mesarules.sh``):

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
  Inside: ``<xx>/<rest of the hex key>`` (:data:`LAYOUT`), written as ``<name>.tmp`` and
  renamed, and an ``index`` file Mesa makes again when missing.

Unknown means: store the binary instead, with the reason. **Its include rule**: the
working directory, where the build has a ``-I`` option (pyopencl always adds one); without,
Mesa's shader cache keys the front end on the source and options, not the header: a
doubt. **Its settings** (:data:`SETTINGS`): llvmpipe's, gallium's, Mesa's, rusticl's and
those of the GPU drivers rusticl runs on. **What auto picks**: its shader cache
(``kcache-mesa``) where it is on, one file per item and known, else ``thread``.

Pure functions of the environment (and the password database): thread- and process-safe.
"""

from __future__ import annotations

import os
import pwd
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..platform import Layout, Platform, Settings

if TYPE_CHECKING:
    import pyopencl as cl

__all__ = [
    "CLOVER",
    "LAYOUT",
    "MULTI_FILE_DEFAULT",
    "NAME",
    "PLATFORM",
    "SETTINGS",
    "locate",
    "mesa_bool",
    "mesa_release",
]

NAME = "rusticl"
CLOVER_NAME = "Clover"
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
    from .. import system  # what Mesa's getenv reads: os.putenv included

    e = system.process_environ() if env is None else env
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


SETTINGS = Settings(
    # llvmpipe (LP_*), its JIT (GALLIVM_*), gallium's (GALLIUM_NOSSE, GALLIUM_OVERRIDE_CPU_CAPS:
    # the CPU features code is made for), Mesa's (MESA_SPIRV_FORCE_UNSTRUCTURED...), rusticl's
    # (RUSTICL_FEATURES, RUSTICL_DEBUG, RUSTICL_CL_VERSION), and the GPU drivers rusticl runs on
    # (AMD_DEBUG, INTEL_DEBUG's SIMD widths, ZINK_DEBUG, NV50_PROG_*, ...).
    prefixes=("LP_", "GALLIVM_", "GALLIUM_", "MESA_", "RUSTICL_", "AMD_", "RADEON_", "R600_", "ACO_",
              "INTEL_", "IRIS_", "ZINK_", "NOUVEAU_", "NV50_", "NAK_"),
    not_code=frozenset({
        # Where Mesa's shader cache goes and which backend it uses (locate): a new node
        # with another folder must hit; whether the cache is stored is the entry's kind.
        "MESA_SHADER_CACHE_DIR", "MESA_GLSL_CACHE_DIR", "MESA_SHADER_CACHE_MAX_SIZE",
        "MESA_GLSL_CACHE_MAX_SIZE", "MESA_SHADER_CACHE_DISABLE", "MESA_GLSL_CACHE_DISABLE",
        "MESA_DISK_CACHE_SINGLE_FILE", "MESA_DISK_CACHE_DATABASE", "MESA_DISK_CACHE_MULTI_FILE",
        "MESA_DISK_CACHE_DATABASE_NUM_PARTS", "MESA_DISK_CACHE_DATABASE_EVICTION_SCORE_2X_PERIOD",
        "MESA_DISK_CACHE_READ_ONLY_FOZ_DBS", "MESA_DISK_CACHE_READ_ONLY_FOZ_DBS_DYNAMIC_LIST",
        "MESA_DISK_CACHE_COMBINE_RW_WITH_RO_FOZ", "MESA_SHADER_CACHE_SHOW_STATS",
        # Logging and dumps: MESA_DEBUG's flags are the GL state tracker's (silent, flush,
        # incomplete_tex, context...), never read on rusticl's path.
        "MESA_DEBUG", "MESA_LOG", "MESA_LOG_FILE", "MESA_LOG_PREFIX", "MESA_SPIRV_LOG_LEVEL",
        "MESA_SPIRV_FAIL_DUMP_PATH", "MESA_SPIRV_DUMP_PATH", "GALLIUM_PRINT_OPTIONS",
        "GALLIUM_DUMP_CPU", "GALLIUM_LOG_FILE", "GALLIUM_HUD", "GALLIUM_HUD_DUMP_DIR",
        "GALLIUM_HUD_PERIOD", "GALLIUM_HUD_SCALE", "GALLIUM_HUD_SHARE", "GALLIUM_HUD_TOGGLE_SIGNAL",
        "GALLIUM_HUD_VISIBLE",
        # Threads: llvmpipe's rasterizer and compute threads, gallium's threaded context.
        "LP_NUM_THREADS", "GALLIUM_THREAD",
        # Which devices rusticl shows: their identity is in the key.
        "RUSTICL_ENABLE",
    }),
)

#: ``<xx>/<38 hex>`` (Mesa 22.3) or ``<xx>/<62 hex>`` (Mesa 26.1), ``*.tmp`` while written.
LAYOUT = Layout("kcache-mesa", "Mesa's shader cache", re.compile(r"[0-9a-f]{2}/[0-9a-f]{30,126}"),
                depth=1, settle=3.0, grace=0.3)


def _locate(devices: Sequence[cl.Device]) -> tuple[Path | None, str]:
    releases = {mesa_release(d.driver_version) for d in devices}
    return locate(release=releases.pop() if len(releases) == 1 else None)


def _include_rule(options: bytes, cwd: str | None) -> tuple[str | None, str | None]:
    if re.search(rb"(?:^|\s)-I", options):
        return cwd, None  # pyopencl always adds one: then Mesa 22.3 and 26.1 see headers
    return cwd, ("with no -I option, Mesa's shader cache keys rusticl's front end on the source and "
                 "options, not the header (docs/design.md F20)")


PLATFORM = Platform(
    names=(NAME,),
    settings=SETTINGS,
    layout=LAYOUT,
    locate=_locate,
    why_cache=("Mesa's shader cache ({root}) holds rusticl's front end and code generation in "
               "content-addressed files that a new node uses as they are, where the binary (SPIR-V) "
               "still compiles (docs/design.md F20)"),
    include_rule=_include_rule,
)

#: Clover, Mesa's older OpenCL: Mesa's settings; its cache and include rule were not measured.
CLOVER = Platform(names=(CLOVER_NAME,), settings=SETTINGS)
