"""The ``suite`` section of ``asyncclcache bench``: a test suite as CI runs it, a new machine
every run with one cache folder restored (docs/design.md F28, docs/ci.md).

The workload (``workloads.suite``): P programs of 1-3 small kernels that include a header
(``-I``); test t, in a new context, builds programs t-C+1..t, so each program is built in C
consecutive tests (new contexts), and launches and checks every kernel. Each repetition runs,
one after the other, each a fresh process on a new node (empty driver caches):

* ``nocache``: pyopencl as installed (pocl's kernel cache empty at the start);
* ``cold``: asyncclcache on an empty directory;
* ``pocl folder``: no asyncclcache, pocl's kernel cache as the ``nocache`` run left it
  (what caching ``POCL_CACHE_DIR`` between CI runs gives);
* ``new machine``: asyncclcache's directory as the ``cold`` run left it;
* ``baked``: that directory after ``asyncclcache bake`` (docs/ci.md's recipe);
* ``new machine, idle baking {on|off}``: the other setting of ``ASYNCCLCACHE_BAKE``.

asyncclcache's runs have the default ``ASYNCCLCACHE_BAKE`` (``auto``: idle baking, but in a
job's ranks and on a single core), but the last.

Timed: the whole process, start to exit (asyncclcache's exit included); the CPU of the
caller's thread in ``build()`` outside the driver's build call, per build (pyopencl's own
work in ``nocache``; asyncclcache's on top of it in the others).
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
from pathlib import Path
from typing import Any

#: Modes in the order each repetition runs them (later ones restore earlier ones' folders).
MODES = ["nocache", "cold", "pocl folder", "new machine", "baked", "other idle"]
PROGRAMS = 40
CONTEXTS = 4


def _default_bake() -> str:
    """What the default ``ASYNCCLCACHE_BAKE`` comes to here: ``idle`` or ``off``."""
    from asyncclcache.config import Config

    return "idle" if Config.from_env({}).bakes_idle(None) else "off"


def _bake(runner: Any, acc_dir: str) -> None:
    subprocess.run([runner.python, "-m", "asyncclcache", "bake", "--dir", acc_dir], env=runner.env(None),
                   capture_output=True, text=True, timeout=1800, check=True)


def measure_suite(runner: Any, reps: int, log: Any, save: Any, programs: int = PROGRAMS,
                  contexts: int = CONTEXTS) -> dict[str, Any]:
    """Every mode, ``reps`` times; ``save(result)`` after each repetition."""
    from workloads import SUITE_HEADER

    include = Path(runner.fresh("suite-include"))
    (include / "suite.h").write_text(SUITE_HEADER)
    default = _default_bake()
    other = "off" if default == "idle" else "idle"
    out: dict[str, Any] = {"programs": programs, "contexts": contexts, "default_bake": default,
                           "other_bake": other, "runs": {m: [] for m in MODES}}

    def run(mode: str, variant: str, node: dict[str, str], acc_dir: str | None = None,
            **extra: str) -> dict[str, Any]:
        spec = {"task": "suite", "variant": variant, "acc_dir": acc_dir, "include_dir": str(include),
                "contexts": contexts, "workload_args": {"programs": programs},
                "_env": runner.env(variant, node, **extra)}
        r = runner.run([spec])[0]
        out["runs"][mode].append(r)
        log(f"  {mode}: {r['wall_s']:.2f} s, own CPU {r.get('own_cpu_ms', 0):.3f} ms a build, "
            f"{r.get('build_descr')}")
        return r

    for rep in range(reps):
        log(f"repetition {rep + 1} of {reps}")
        plain = runner.node()
        run("nocache", "nocache", plain)
        cold_dir = runner.fresh("suite-acc")
        run("cold", "acc", runner.node(), cold_dir, ASYNCCLCACHE_BAKE=default)
        restored = runner.node()
        shutil.copytree(plain["POCL_CACHE_DIR"], restored["POCL_CACHE_DIR"], symlinks=True)
        run("pocl folder", "nocache", restored)
        copies = {}
        for mode in ("new machine", "baked", "other idle"):
            copies[mode] = runner.fresh("suite-copy")
            shutil.copytree(cold_dir, copies[mode], symlinks=True, dirs_exist_ok=True)
        out.setdefault("baked_by_cold", []).append(count_entries(cold_dir)[1])
        run("new machine", "acc", runner.node(), copies["new machine"], ASYNCCLCACHE_BAKE=default)
        _bake(runner, copies["baked"])
        run("baked", "acc", runner.node(), copies["baked"], ASYNCCLCACHE_BAKE=default)
        run("other idle", "acc", runner.node(), copies["other idle"], ASYNCCLCACHE_BAKE=other)
        save(out)
    return out


def count_entries(acc_dir: str) -> tuple[int, int]:
    """Entries of ``acc_dir``: (kcache entries, baked binaries)."""
    from asyncclcache.store import Store

    store = Store(acc_dir, rank_local=False, create=False)
    metas = [m for e in store.entries() if (m := store.read_meta(e.path))]
    return sum(1 for m in metas if not m.baked_from), sum(1 for m in metas if m.baked_from)


def _med(runs: list[dict[str, Any]], field: str) -> float | None:
    xs = [r[field] for r in runs if r.get(field) is not None and not r.get("error")]
    return statistics.median(xs) if xs else None


def _ratios(res: dict[str, Any], mode: str, against: str) -> list[float]:
    a, b = res["runs"].get(mode) or [], res["runs"].get(against) or []
    return [x["wall_s"] / y["wall_s"] for x, y in zip(a, b, strict=False)
            if not x.get("error") and not y.get("error")]


#: (row, against, target): the issue's targets, as ratios of whole runs of one repetition.
TARGETS = [("cold", "nocache", 1.02), ("new machine", "pocl folder", 0.95), ("baked", "pocl folder", 0.75)]


def summary(res: dict[str, Any]) -> dict[str, Any]:
    """Median ratios (each repetition's runs against each other) and own CPU per build."""
    out: dict[str, Any] = {}
    for mode, against, target in TARGETS:
        rs = _ratios(res, mode, against)
        out[f"{mode} / {against}"] = (statistics.median(rs) if rs else None, min(rs, default=None),
                                      max(rs, default=None), target)
    rs = _ratios(res, "other idle", "new machine")
    out[f"new machine, idle baking {res['other_bake']} / {res['default_bake']}"] = (
        statistics.median(rs) if rs else None, min(rs, default=None), max(rs, default=None), None)
    base = _med(res["runs"]["nocache"], "own_cpu_ms")
    out["own CPU a build (ms): pyopencl's"] = base
    for mode in ("cold", "new machine", "baked"):
        own = _med(res["runs"][mode], "own_cpu_ms")
        out[f"own CPU a build (ms): asyncclcache's, {mode}"] = (
            None if own is None or base is None else own - base)
    return out


def table_md(res: dict[str, Any]) -> str:
    label = {"other idle": f"new machine, idle baking {res['other_bake']}",
             "new machine": f"new machine (idle baking {res['default_bake']})"}
    lines = ["| run | seconds (median) | own CPU a build, ms | builds: how |", "|---|--:|--:|---|"]
    for mode in MODES:
        runs = res["runs"].get(mode) or []
        if not runs:
            continue
        how: dict[str, int] = {}
        for r in runs[-1:]:
            for k, v in (r.get("build_descr") or {}).items():
                how[k] = how.get(k, 0) + v
        wall = _med(runs, "wall_s")
        own = _med(runs, "own_cpu_ms")
        lines.append(f"| {label.get(mode, mode)} | {wall:.2f} | {own:.3f} | "
                     + ", ".join(f"{v} {k}" for k, v in sorted(how.items())) + " |"
                     if wall is not None and own is not None else f"| {mode} | failed | | |")
    lines += ["", "| ratio (each repetition's runs) | median | min | max | target |", "|---|--:|--:|--:|--:|"]
    for name, value in summary(res).items():
        if isinstance(value, tuple):
            med, lo, hi, target = value
            cells = [f"{x:.3f}" if x is not None else "-" for x in (med, lo, hi)]
            tcell = f"<= {target}" if target is not None else ""
            lines.append(f"| {name} | {' | '.join(cells)} | {tcell} |")
    lines += ["", "| own CPU of the caller's thread a build, outside the driver's build | ms |", "|---|--:|"]
    for name, value in summary(res).items():
        if not isinstance(value, tuple):
            lines.append(f"| {name.split(': ', 1)[1]} | {'-' if value is None else f'{value:.3f}'} |")
    lines += ["", f"Entries the cold runs left baked (idle baking {res['default_bake']}): "
              f"{res.get('baked_by_cold')} of {res['programs']}."]
    return "\n".join(lines)
