"""MPI rank detection from the launcher's environment and from an initialized mpi4py."""

from __future__ import annotations

import sys
import types

import pytest

from asyncclcache.ranks import RANK_ENV_VARS, detect_rank


@pytest.fixture(autouse=True)
def _no_mpi4py(monkeypatch: pytest.MonkeyPatch) -> None:
    # These tests decide what mpi4py (if any) looks like.
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)


def test_no_launcher() -> None:
    assert detect_rank({}) is None
    assert detect_rank({"PATH": "/bin", "RANK": "3"}) is None


@pytest.mark.parametrize("var", RANK_ENV_VARS)
def test_each_launcher_variable(var: str) -> None:
    assert detect_rank({var: "3"}) == 3
    assert detect_rank({var: "0"}) == 0
    assert detect_rank({var: " 12\n"}) == 12


def test_known_launchers_are_covered() -> None:
    for var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"):
        assert var in RANK_ENV_VARS


def test_most_specific_variable_wins() -> None:
    env = {var: str(i + 10) for i, var in enumerate(RANK_ENV_VARS)}
    assert detect_rank(env) == 10
    assert detect_rank({"SLURM_PROCID": "9", "PMI_RANK": "4"}) == 4
    assert detect_rank({"SLURM_PROCID": "9", "OMPI_COMM_WORLD_RANK": "2"}) == 2


@pytest.mark.parametrize("value", ["", " ", "abc", "-1", "1.0", "0x3", "\u00b2", "3 4"])
def test_garbage_is_ignored(value: str) -> None:
    assert detect_rank({"PMI_RANK": value}) is None
    # ... and the next variable is still read.
    assert detect_rank({"PMI_RANK": value, "SLURM_PROCID": "5"}) == 5


def test_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in RANK_ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    assert detect_rank() is None
    monkeypatch.setenv("PMIX_RANK", "6")
    assert detect_rank() == 6


def _fake_mpi(rank: int, initialized: bool = True, finalized: bool = False) -> types.ModuleType:
    """An ``mpi4py.MPI`` stand-in (mpi4py itself is optional and needs an MPI library)."""
    mod = types.ModuleType("mpi4py.MPI")

    class Comm:
        def Get_rank(self) -> int:
            return rank

    mod.COMM_WORLD = Comm()  # type: ignore[attr-defined]
    mod.Is_initialized = lambda: initialized  # type: ignore[attr-defined]
    mod.Is_finalized = lambda: finalized  # type: ignore[attr-defined]
    return mod


def test_initialized_mpi4py_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", _fake_mpi(7))
    assert detect_rank({"PMI_RANK": "3"}) == 7


@pytest.mark.parametrize(("initialized", "finalized"), [(False, False), (True, True)])
def test_inactive_mpi4py_falls_back_to_env(
    monkeypatch: pytest.MonkeyPatch, initialized: bool, finalized: bool
) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", _fake_mpi(7, initialized, finalized))
    assert detect_rank({"PMI_RANK": "3"}) == 3


def test_broken_mpi4py_falls_back_to_env(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = _fake_mpi(7)

    def boom() -> bool:
        raise RuntimeError("MPI is broken")

    mod.Is_initialized = boom  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", mod)
    assert detect_rank({"PMI_RANK": "3"}) == 3


def test_mpi4py_is_not_imported_by_detection() -> None:
    detect_rank({})
    assert "mpi4py.MPI" not in sys.modules
