"""pocl (Portable Computing Language): everything the package knows of it.

**Its kernel cache** (:func:`kernel_cache_dir`), one rule copied from pocl's own code
(``pocl_cache_init_topdir`` in ``lib/CL/pocl_cache.c`` and ``pocl_get_bool_option`` in
``pocl_runtime_config.c``; the same from pocl 3.1 through 7.2):

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
rest of the process do as pocl does.

**Its layout** (:data:`LAYOUT`, docs/design.md F15, F21): ``<XX>/<hash>/`` per program,
holding ``program.bc``, ``last_accessed`` (touched by every build) and
``<kernel>/<variant>/`` for every variant launched, the generic one (``0-0-0...``) from
binary queries.

**Its include rule**: pocl writes a temporary copy of every program source into its cache
directory before it compiles, so a quoted ``#include`` of the main source is looked up
there first (:func:`source_dir`).

**Its settings** (:data:`SETTINGS`): every ``POCL_*`` but :data:`NOT_CODE`, read at every
build; on its other devices also ``CUDA_HOME``; on its CUDA device NVIDIA's ``CUDA_*`` and
libdevice too (:mod:`.pocl_cuda`, whose record holds that device's caches).

**What auto picks**: its kernel cache (``kcache``) on its CPU devices where the cache is
on (its CUDA device: :mod:`.pocl_cuda`). Where it is off, nothing (``off``: built
plainly, counted ``cache_off``): on its CPU
devices the binary query compiles (F1, F3), so no binary is taken in the job's process,
and :data:`WHY_OFF` says to turn the cache on, with what a helper process's binary gave
instead (measured, issue 27).

Pure functions of the environment: thread- and process-safe.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..platform import Layout, Platform, Settings

if TYPE_CHECKING:
    import pyopencl as cl

__all__ = [
    "GENERIC_PREFIX",
    "LAYOUT",
    "NAME",
    "NOT_CODE",
    "PLATFORM",
    "PROGRAM_FILE",
    "SETTINGS",
    "TOUCHED_FILE",
    "WHY_OFF",
    "cache_environ",
    "cache_topdir",
    "is_cpu_device",
    "kernel_cache_dir",
    "kernel_cache_enabled",
    "source_dir",
]

NAME = "Portable Computing Language"


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    from .. import system  # what pocl's getenv reads: os.putenv included

    return system.process_environ() if env is None else env


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
    e = _env(env)  # one read of the environment (every build asks)
    return cache_topdir(e) if kernel_cache_enabled(e) else None


def source_dir(env: Mapping[str, str] | None = None) -> Path | None:
    """The directory of the file that pocl's compiler sees as the main source: pocl
    writes its temporary copy of the source into its cache directory, so clang looks
    there first for a quoted ``#include`` of the main source."""
    return cache_topdir(env)


def cache_environ(folder: Path) -> dict[str, str]:
    """The variables that give a process started with them ``folder`` as its kernel cache, on."""
    return {"POCL_CACHE_DIR": str(folder), "POCL_KERNEL_CACHE": "1"}


def is_cpu_device(device: cl.Device) -> bool:
    """True for pocl's CPU devices, whose binary query compiles (docs/design.md F1)."""
    import pyopencl as cl

    return device.platform.name == NAME and bool(device.type & cl.device_type.CPU)


# {{{ settings

#: pocl's settings that cannot change generated code (where files go, logging, threads,
#: memory). Every other ``POCL_*`` variable is part of the key: when in doubt, miss. So
#: are ``POCL_CPU_JIT`` (pocl main's JIT, which writes ``<kernel>.so.o``: another layout,
#: another code path), ``POCL_EXTRA_BUILD_FLAGS``, ``POCL_WORK_GROUP_METHOD``...
NOT_CODE = frozenset({
    "POCL_CACHE_DIR", "POCL_KERNEL_CACHE", "POCL_DEBUG", "POCL_DEBUG_LLVM_PASSES",
    "POCL_LEAVE_KERNEL_COMPILER_TEMP_FILES", "POCL_MAX_PTHREAD_COUNT", "POCL_PTHREAD_MIN_THREADS",
    "POCL_AFFINITY", "POCL_MEMORY_LIMIT", "POCL_TRACING", "POCL_TRACING_OPT", "POCL_TRACING_FILTER",
    "POCL_DUMP_TASK_GRAPHS", "POCL_STARTUP_DELAY", "POCL_BUILDING", "POCL_IMPLICIT_FINISH",
})


def _device_settings(device: cl.Device, env: Mapping[str, str]) -> dict[str, str]:
    # pocl's CUDA device takes libdevice from there (F24), and pocl's own hash misses it.
    if "CUDA_HOME" in env and not is_cpu_device(device):
        return {"CUDA_HOME": env["CUDA_HOME"]}
    return {}


SETTINGS = Settings(("POCL_",), NOT_CODE, at_start=False, per_device=_device_settings,
                    extra_options=("POCL_EXTRA_BUILD_FLAGS",))

# }}}

# {{{ its kernel cache

#: In each program's folder: its bitcode (a folder without it holds no program), the file
#: that every build of the program touches, hit or miss, and the generic variant's prefix.
PROGRAM_FILE = "program.bc"
TOUCHED_FILE = "last_accessed"
GENERIC_PREFIX = "0-0-0"

#: ``XX/<hash>/<name>`` and ``XX/<hash>/<kernel>/<variant>/<name>``-like paths: pocl's hash
#: is SHA-1 in letters (A-P), cut as <2>/<38> (allow some leeway, nothing odd); a kernel
#: name, a variant (``64-1-1-goffs0-smallgrid``) or a file; never ``.``/``..``. Measured:
#: pocl 3.1, 5.0, 6.0 and 7.1 name a variant's compiled file ``<kernel>.so`` (7.1 writes
#: the work-group function's ``parallel.bc`` into it first); pocl main on its JIT
#: (``POCL_CPU_JIT``, in the key) ``<kernel>.so.o`` (F21).
LAYOUT = Layout(
    strategy="kcache",
    what="pocl's kernel cache",
    pattern=re.compile(r"[A-Za-z0-9]{2}/[A-Za-z0-9]{8,128}(?:/[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}){1,4}"),
    depth=2,
    settle=3.0,
    program_file=PROGRAM_FILE,
    touched_file=TOUCHED_FILE,
    generic_prefix=GENERIC_PREFIX,
    unfinished=(".bc",),
)


def _locate(devices: Sequence[cl.Device]) -> tuple[Path | None, str]:
    if not all(is_cpu_device(d) for d in devices):
        return None, "pocl's kernel cache is stored only for its CPU devices"
    root = kernel_cache_dir()
    if root is None:
        flag = _env(None).get("POCL_KERNEL_CACHE")
        return None, (f"pocl's kernel cache is off (POCL_KERNEL_CACHE={flag!r}: pocl reads only "
                      "a value starting with 1 as on)")
    return root, ""


def _include_rule(options: bytes, cwd: str | None) -> tuple[str | None, str | None]:
    # pocl compiles its copy of the source in its cache directory.
    folder = source_dir()
    return (None if folder is None else str(folder)), None

# }}}


#: Why nothing is cached on pocl's CPU devices with its kernel cache off, and what to do.
#: Measured (pocl 3.1, 2 cores, the seed program at N=600, POCL_KERNEL_CACHE=0): the former
#: strategy ``process``, a helper process's binary query, cost 1.29x the cold wall time (3.98
#: against 3.09 s) and 2.0x its CPU time, and its binary, which holds the generic variant
#: only, gave a new node 0.80 of the cold time; the kernel cache on compiles nothing extra,
#: and gives a new node 0.016 of it (benchmarks/RESULTS.md).
WHY_OFF = ("; pocl's CPU device compiles a second, generic variant when asked for its binary, "
           "under a process-wide lock that stalls every launch (docs/design.md F1, F3), so "
           "nothing is cached here: set POCL_KERNEL_CACHE=1 (under MPI with pocl older than 6.0, "
           "give each rank its own POCL_CACHE_DIR too, pocl#1480). With the cache on, its folder "
           "is the entry and a new node starts in 0.016 of the cold time; a helper's binary "
           "without it cost 1.3x the cold time, 2x its CPU, and still left a new node 0.80 of it")


PLATFORM = Platform(
    names=(NAME,),
    settings=SETTINGS,
    layout=LAYOUT,
    locate=_locate,
    why_cache=("pocl's CPU device keeps each program's compiled variants in its kernel cache ({root}), "
               "and that folder, restored on a new node, compiles nothing (docs/design.md F15, F16)"),
    include_rule=_include_rule,
    query_compiles=is_cpu_device,
    why_off=WHY_OFF,
)
