"""NVIDIA's OpenCL (``NVIDIA CUDA``): everything the package knows of it.

**Its compute cache** (:func:`locate`, docs/design.md F19). NVIDIA documents
``CUDA_CACHE_PATH``, ``CUDA_CACHE_DISABLE`` and the default ``~/.nv/ComputeCache``; what
its OpenCL does with each value was measured on driver 580 (``benchmarks/probe/nvrules.py``),
and only what was measured is trusted:

* ``CUDA_CACHE_DISABLE=1``: off. ``0``, ``2``, ``true``, ``yes`` and ``""`` all left it on
  (so the driver reads "1", not a boolean); any other value: unknown.
* ``CUDA_CACHE_PATH``: that directory when it is absolute. Relative (the files did not
  appear under the working directory) or empty: unknown.
* Unset: ``$HOME/.nv/ComputeCache`` (``XDG_CACHE_HOME`` is not read). ``HOME`` unset or
  empty: unknown (nothing appeared in the password database's home either).

Unknown means: not a cache this package can snapshot, so the binary is stored instead,
with the reason. The driver reads these once, when it starts; callers that keep the
answer do the same.

**Its layout** (:data:`LAYOUT`): ``<x>/<y>/<hex>`` per item, and a shared ``index`` (left
out; the driver makes it again). **Its include rule**: the working directory, whose
headers its compute cache sees by content (F19). **Its settings**: every ``CUDA_*`` but
where the cache goes, which devices, launches. **What auto picks**: its compute cache
(``kcache-nvidia``) where it is on and known, else ``thread`` (its binary query is a copy).

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

__all__ = ["LAYOUT", "NAME", "PLATFORM", "SETTINGS", "locate"]

NAME = "NVIDIA CUDA"

_ON = ("", "0", "2", "true", "yes")


def locate(env: Mapping[str, str] | None = None) -> tuple[Path | None, str]:
    """``(the compute cache directory, "")``, or ``(None, why it is off or unknown)``."""
    from .. import system  # what the driver's getenv reads: os.putenv included

    e = system.process_environ() if env is None else env
    off = e.get("CUDA_CACHE_DISABLE")
    if off == "1":
        return None, "NVIDIA's compute cache is off (CUDA_CACHE_DISABLE=1)"
    if off is not None and off not in _ON:
        return None, f"CUDA_CACHE_DISABLE={off!r}: how the driver reads this value was not measured"
    given = e.get("CUDA_CACHE_PATH")
    if given is not None:
        if not os.path.isabs(given):
            return None, (f"CUDA_CACHE_PATH={given!r} is not an absolute path: "
                          "where the driver puts it is unknown")
        return Path(given), ""
    home = e.get("HOME")
    if not home or not os.path.isabs(home):
        return None, ("HOME is unset or not absolute, and CUDA_CACHE_PATH is unset: "
                      "the compute cache's place is unknown")
    return Path(home) / ".nv" / "ComputeCache", ""


SETTINGS = Settings(
    # The JIT of PTX: CUDA_FORCE_PTX_JIT, CUDA_DISABLE_PTX_JIT, CUDA_FORCE_JIT, ...
    prefixes=("CUDA_",),
    not_code=frozenset({
        # Where the compute cache goes, its size, whether it is on (locate; the entry's
        # kind tells whether it is stored): a new node with another folder must hit.
        "CUDA_CACHE_PATH", "CUDA_CACHE_MAXSIZE", "CUDA_CACHE_DISABLE",
        # Which devices, in which order: their identity is in the key, and these differ per rank.
        "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER",
        # Launches and queues, not compiles; MPS's folders differ per job.
        "CUDA_LAUNCH_BLOCKING", "CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_MPS_PIPE_DIRECTORY",
        "CUDA_MPS_LOG_DIRECTORY",
    }),
)

#: ``<x>/<y>/<14 hex>`` on driver 580, and a shared ``index`` (left out; made again).
LAYOUT = Layout("kcache-nvidia", "NVIDIA's compute cache", re.compile(r"[0-9a-f]/[0-9a-f]/[0-9a-f]{8,64}"),
                depth=2, settle=0.5)


def _locate(devices: Sequence[cl.Device]) -> tuple[Path | None, str]:
    return locate()


def _include_rule(options: bytes, cwd: str | None) -> tuple[str | None, str | None]:
    # Its compute cache sees a header's content (docs/design.md F19; benchmarks/probe/nvrules.py).
    return cwd, None


PLATFORM = Platform(
    names=(NAME,),
    settings=SETTINGS,
    layout=LAYOUT,
    locate=_locate,
    why_cache=("NVIDIA's compute cache ({root}) holds each build's machine code in content-addressed "
               "files that a new node uses as they are, where the binary (PTX) still runs the JIT "
               "(docs/design.md F19)"),
    include_rule=_include_rule,
)
