"""MPI rank detection, for rank-local cache directories.

Each rank writing its own directory means no two ranks race on an entry and pocl
never shares a kernel cache across ranks (pocl before 6.0 crashes on that).
"""

from __future__ import annotations

import os
import sys

__all__ = ["RANK_ENV_VARS", "detect_rank"]

#: Launcher variables, most specific first.
RANK_ENV_VARS = (
    "OMPI_COMM_WORLD_RANK",
    "PMI_RANK",
    "PMIX_RANK",
    "MV2_COMM_WORLD_RANK",
    "SLURM_PROCID",
)


def _mpi4py_rank() -> int | None:
    # Only look if the user already imported mpi4py: importing it ourselves would init MPI.
    mod = sys.modules.get("mpi4py.MPI")
    if mod is None:
        return None
    try:
        if mod.Is_initialized() and not mod.Is_finalized():
            return int(mod.COMM_WORLD.Get_rank())
    except Exception:  # noqa: BLE001 - a broken MPI must not break caching
        return None
    return None


def detect_rank(env: dict[str, str] | os._Environ[str] | None = None) -> int | None:
    """This process's MPI world rank, or ``None`` when not under MPI.

    mpi4py's world rank wins when mpi4py is imported and initialized; otherwise the
    launcher's environment is read. Thread-safe, no side effects.
    """
    rank = _mpi4py_rank()
    if rank is not None:
        return rank
    e = os.environ if env is None else env
    for var in RANK_ENV_VARS:
        value = e.get(var)
        # ASCII digits only: str.isdigit() accepts e.g. "²", which int() rejects.
        if value is not None and value.strip().isascii() and value.strip().isdigit():
            return int(value)
    return None
