"""Who this process is in a job: its rank (MPI, Slurm) and its node.

Ranks of a job share one cache directory (one entry per program, whatever the rank
count, docs/mpi.md); the node says which node-local copies (:mod:`.nodecopies`) a rank
may read, and whose reads the exit summary adds up.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["NODE_ENV_VARS", "RANK_ENV_VARS", "TEST_NODE_ENV", "detect_node", "detect_rank", "initialized_mpi"]

#: Launcher variables, most specific first.
RANK_ENV_VARS = (
    "OMPI_COMM_WORLD_RANK",
    "PMI_RANK",
    "PMIX_RANK",
    "MV2_COMM_WORLD_RANK",
    "SLURM_PROCID",
)

#: The launcher's name for this node (Slurm's ``slurmd`` sets it for every task).
NODE_ENV_VARS = ("SLURMD_NODENAME",)

#: Test-only: the name of a simulated node. Tests and the benchmark run several "nodes"
#: on one machine with it; each simulated node has node-local storage of its own.
TEST_NODE_ENV = "ASYNCCLCACHE_TEST_NODE"

_Env = Mapping[str, str]


def initialized_mpi() -> Any:
    """``mpi4py.MPI`` where the program imported and initialized it (and has not finalized
    it), else ``None``; never imports it (that would initialize MPI). Thread-safe."""
    mod = sys.modules.get("mpi4py.MPI")
    if mod is None:
        return None
    try:
        if mod.Is_initialized() and not mod.Is_finalized():
            return mod
    except Exception:  # noqa: BLE001 - a broken MPI must not break caching
        return None
    return None


def _mpi4py_rank() -> int | None:
    mod = initialized_mpi()
    try:
        return None if mod is None else int(mod.COMM_WORLD.Get_rank())
    except Exception:  # noqa: BLE001
        return None


def detect_rank(env: _Env | None = None) -> int | None:
    """This process's MPI world rank, or ``None`` when not under MPI.

    mpi4py's world rank wins when mpi4py is imported and initialized; otherwise the
    launcher's environment is read (Open MPI, MPICH/Hydra, PMIx, MVAPICH, Slurm's
    ``srun``). Thread-safe, no side effects.
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


def detect_node(env: _Env | None = None) -> str:
    """This process's node: the test setting (:data:`TEST_NODE_ENV`), else Slurm's node
    name, else MPI's processor name (mpi4py imported and initialized), else the host name.
    Thread-safe, no side effects."""
    e = os.environ if env is None else env
    for var in (TEST_NODE_ENV, *NODE_ENV_VARS):
        value = (e.get(var) or "").strip()
        if value:
            return value
    mod = initialized_mpi()
    if mod is not None:
        try:
            name = str(mod.Get_processor_name()).strip()
        except Exception:  # noqa: BLE001
            name = ""
        if name:
            return name
    return socket.gethostname() or "localhost"
