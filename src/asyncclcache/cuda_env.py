"""Where NVIDIA's OpenCL keeps its compute cache, as the driver finds it (docs/design.md F19).

NVIDIA documents ``CUDA_CACHE_PATH``, ``CUDA_CACHE_DISABLE`` and the default
``~/.nv/ComputeCache``; what its OpenCL does with each value was measured on driver 580
(``benchmarks/probe/nvrules.py``), and only what was measured is trusted:

* ``CUDA_CACHE_DISABLE=1``: off. ``0``, ``2``, ``true``, ``yes`` and ``""`` all left it on
  (so the driver reads "1", not a boolean); any other value: unknown.
* ``CUDA_CACHE_PATH``: that directory when it is absolute. Relative (the files did not
  appear under the working directory) or empty: unknown.
* Unset: ``$HOME/.nv/ComputeCache`` (``XDG_CACHE_HOME`` is not read). ``HOME`` unset or
  empty: unknown (nothing appeared in the password database's home either).

Unknown means: not a cache this package can snapshot, so the binary is stored instead,
with the reason (:func:`locate`). The driver reads these once, when it starts; callers
that keep the answer do the same. Pure functions of the environment: thread- and
process-safe.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["NVIDIA_PLATFORM_NAME", "locate"]

NVIDIA_PLATFORM_NAME = "NVIDIA CUDA"

_ON = ("", "0", "2", "true", "yes")


def locate(env: Mapping[str, str] | None = None) -> tuple[Path | None, str]:
    """``(the compute cache directory, "")``, or ``(None, why it is off or unknown)``."""
    e = os.environ if env is None else env
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
