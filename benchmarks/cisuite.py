"""The ``cisuite`` section of ``asyncclcache bench``: CI on a real test suite, pyopencl's own
(``test_array.py`` and ``test_clmath.py`` from the sdist of the pyopencl installed; the wheel has
no tests), as a CI job runs it: a new machine every run, one folder restored (docs/ci.md). This
is the evidence for CI; the ``suite`` section is a synthetic proxy.

Python's own caches (pytools', loopy's) are warmed once first, so that the runs differ only in
OpenCL caching. Each sitting runs, one after the other, each a fresh pytest process on a new
node (empty pocl kernel cache):

* ``none``: no asyncclcache (a CI run today);
* ``cold``: ``ASYNCCLCACHE_INSTALL=1`` on an empty directory (the first CI run);
* ``pocl folder``: no asyncclcache, ``none``'s ``POCL_CACHE_DIR`` restored (the alternative);
* ``new machine``: asyncclcache on ``cold``'s directory as saved at the end of the run
  (every later CI run);
* ``unbaked``: the same without the binaries the cold run's idle baker made, and no baking
  (what is left where nothing was baked: baking off, or a bake at exit cut by its timeout);
* ``baked``: that directory after ``asyncclcache bake`` (docs/ci.md's last step);
* ``busy cold``: ``cold`` with no idle core (``ASYNCCLCACHE_BAKE=exit``: what ``auto`` comes to
  in a CI job whose cores are all busy, ``pytest -n auto``): nothing baked during the run,
  what it wrote baked as it exits;
* ``busy next``: a new machine on the directory ``busy cold`` saved.

Every run with asyncclcache has ``CI=true``, as a CI job has (``auto`` bakes at exit there).

Timed: the whole pytest process; and the seconds spent inside ``Program.build`` (a plugin
times pyopencl's ``Program.build``). Ratios are each sitting's runs against each other,
medians over sittings. Needs pytest and mako (the ``bench`` extra) and the sdist (``pip
download``); without them the section says so and measures nothing.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

MODES = ["none", "cold", "pocl folder", "new machine", "unbaked", "baked", "busy cold", "busy next"]
FILES = ["test_array.py", "test_clmath.py"]
QUICK_FILES = ["test_clmath.py"]
#: (row, against, target): issue 42's targets, ratios of whole runs of one sitting.
TARGETS: list[tuple[str, str, float | None]] = [
    ("cold", "none", 1.02), ("new machine", "pocl folder", 0.90), ("unbaked", "pocl folder", None),
    ("baked", "pocl folder", 0.75), ("busy cold", "none", None), ("busy next", "pocl folder", 0.90)]

TIMER = r'''
import sys, time, pytest
_t = [0.0, 0]
@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    import pyopencl as cl
    orig = cl.Program.build
    def timed(self, *a, **k):
        t = time.perf_counter()
        try:
            return orig(self, *a, **k)
        finally:
            _t[0] += time.perf_counter() - t
            _t[1] += 1
    cl.Program.build = timed
def pytest_unconfigure(config):
    sys.stderr.write(f"\nBUILDTIME {_t[1]} {_t[0]:.3f}\n")
'''


def tests_folder(runner: Any) -> tuple[Path | None, str]:
    """pyopencl's test folder from its sdist (downloaded once into the bench's scratch);
    ``(None, why)`` where it cannot be had."""
    try:
        ver = subprocess.run([runner.python, "-c", "import pyopencl; print(pyopencl.VERSION_TEXT)"],
                             capture_output=True, text=True, timeout=120, check=True).stdout.strip()
        for mod in ("pytest", "mako"):
            subprocess.run([runner.python, "-c", f"import {mod}"], capture_output=True, timeout=120, check=True)
    except (subprocess.SubprocessError, OSError):
        return None, "pyopencl, pytest or mako missing (pip install 'asyncclcache[bench]')"
    where = Path(runner.fresh("cisuite-sdist"))
    proc = subprocess.run([runner.python, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", "pyopencl",
                           f"pyopencl=={ver}", "-d", str(where)], capture_output=True, text=True, timeout=600,
                          check=False)
    tars = sorted(where.glob("pyopencl-*.tar.gz"))
    if proc.returncode != 0 or not tars:
        return None, f"pyopencl {ver}'s sdist could not be downloaded: {proc.stderr.strip()[-200:]}"
    with tarfile.open(tars[0]) as tf:
        members = [m for m in tf.getmembers() if "/test/" in m.name and m.isfile()]
        if hasattr(tarfile, "data_filter"):  # Python 3.11.4 and newer
            tf.extractall(where, members=members, filter="data")
        else:
            tf.extractall(where, members=[m for m in members if not m.name.startswith(("/", ".."))])
    found = sorted(where.glob("pyopencl-*/test"))
    if not found:
        return None, f"no test folder in {tars[0].name}"
    (found[0] / "acc_buildtimer.py").write_text(TIMER)
    return found[0], ver


def _run(runner: Any, tests: Path, files: list[str], node: dict[str, str], acc_dir: str | None,
         logs: Path, label: str, **more: str) -> dict[str, Any]:
    extra = {"PYOPENCL_TEST": "portable", "PYTHONPATH": str(tests), **more}
    if acc_dir is not None:
        extra.update(ASYNCCLCACHE_INSTALL="1", ASYNCCLCACHE_DIR=acc_dir, ASYNCCLCACHE_STATS="1", CI="true")
    env = runner.env(None, node, **extra)  # PYTHONPATH: the repository's src, then the tests
    log = logs / f"cisuite-{label}.log"
    t0 = time.perf_counter()
    with open(log, "wb") as f:
        rc = subprocess.run([runner.python, "-m", "pytest", "-q", "--no-header", "-p", "no:cacheprovider",
                             "-p", "acc_buildtimer", *files], cwd=tests, env=env, stdout=f,
                            stderr=subprocess.STDOUT, timeout=3600, check=False).returncode
    wall = time.perf_counter() - t0
    text = log.read_text(errors="replace")
    bt = re.findall(r"^BUILDTIME (\d+) ([0-9.]+)", text, re.M)
    passed = re.findall(r"(\d+) passed", text)
    acc = [ln.strip() for ln in text.splitlines() if ln.startswith("asyncclcache")]
    return {"wall_s": wall, "rc": rc, "builds": int(bt[-1][0]) if bt else None,
            "build_s": float(bt[-1][1]) if bt else None, "passed": int(passed[-1]) if passed else None,
            "summary": acc[-1] if acc else None, "log": str(log)}


def _unbake(acc_dir: str) -> None:
    """Remove the baked binaries of ``acc_dir`` (the idle baker's)."""
    from asyncclcache.store import Store

    store = Store(acc_dir, rank_local=False, create=False)
    for e in list(store.entries()):
        meta = store.read_meta(e.path)
        if meta is not None and meta.baked_from:
            store.remove(e.key)


def _bake(runner: Any, acc_dir: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([runner.python, "-m", "asyncclcache", "bake", "--dir", acc_dir], env=runner.env(None),
                   capture_output=True, text=True, timeout=3600, check=False)
    return time.perf_counter() - t0


def measure_cisuite(runner: Any, reps: int, log: Any, save: Any, *, quick: bool = False) -> dict[str, Any]:
    """``reps`` sittings (quick: one, of ``test_clmath.py`` alone, pocl's folder from the warming
    run, without the no-cache and baked runs); ``save(result)`` after each."""
    from suite import count_entries

    tests, ver = tests_folder(runner)
    files = QUICK_FILES if quick else FILES
    out: dict[str, Any] = {"files": files, "pyopencl": ver, "runs": {m: [] for m in MODES}}
    if tests is None:
        out["error"] = ver
        log(f"cisuite: not measured: {ver}")
        return out
    logs = Path(runner.fresh("cisuite-logs"))
    log(f"cisuite: pyopencl {ver}'s {' '.join(files)}: warming Python's caches once")
    warm = runner.node()
    _run(runner, tests, files, warm, None, logs, "warm-python")
    for rep in range(1 if quick else reps):
        r: dict[str, dict[str, Any]] = {}
        if quick:  # pocl's folder as the warming run left it; no "none" beside the cold run
            none = warm
        else:
            none = runner.node()
            r["none"] = _run(runner, tests, files, none, None, logs, f"none-{rep}")
        acc_dir = runner.fresh("cisuite-acc")
        r["cold"] = _run(runner, tests, files, runner.node(), acc_dir, logs, f"cold-{rep}")
        restored = runner.node()
        shutil.copytree(none["POCL_CACHE_DIR"], restored["POCL_CACHE_DIR"], symlinks=True)
        r["pocl folder"] = _run(runner, tests, files, restored, None, logs, f"pocl-{rep}")
        copy = runner.fresh("cisuite-new")
        shutil.copytree(acc_dir, copy, symlinks=True, dirs_exist_ok=True)
        r["cold"]["entries"] = count_entries(acc_dir)  # (kcache, baked) as the cold run saved it
        r["new machine"] = _run(runner, tests, files, runner.node(), copy, logs, f"new-{rep}")
        r["new machine"]["entries"] = count_entries(copy)
        if not quick:
            bare = runner.fresh("cisuite-unbaked")
            shutil.copytree(acc_dir, bare, symlinks=True, dirs_exist_ok=True)
            _unbake(bare)
            r["unbaked"] = _run(runner, tests, files, runner.node(), bare, logs, f"unbaked-{rep}",
                                ASYNCCLCACHE_BAKE="off")
            r["unbaked"]["entries"] = count_entries(bare)
        if not quick:  # the quick run: the question CI asks, a new machine against pocl's folder
            r["cold"]["bake_s"] = _bake(runner, acc_dir)  # what asyncclcache bake took after it
            r["baked"] = _run(runner, tests, files, runner.node(), acc_dir, logs, f"baked-{rep}")
            busy = runner.fresh("cisuite-busy")
            r["busy cold"] = _run(runner, tests, files, runner.node(), busy, logs, f"busy-cold-{rep}",
                                  ASYNCCLCACHE_BAKE="exit")
            r["busy cold"]["entries"] = count_entries(busy)
            r["busy next"] = _run(runner, tests, files, runner.node(), busy, logs, f"busy-next-{rep}")
        for m, one in r.items():
            out["runs"][m].append(one)
        log(f"cisuite sitting {rep + 1}: " + ", ".join(
            f"{m} {r[m]['wall_s']:.1f} s (build {r[m]['build_s'] or 0:.1f})" for m in r))
        save(out)
    return out


def _ratios(res: dict[str, Any], mode: str, against: str, field: str = "wall_s") -> list[float]:
    a, b = res["runs"].get(mode) or [], res["runs"].get(against) or []
    return [x[field] / y[field] for x, y in zip(a, b, strict=False) if x.get(field) and y.get(field)]


def table_md(res: dict[str, Any]) -> str:
    if res.get("error"):
        return f"Not measured: {res['error']}."
    n = max(len(runs) for runs in res["runs"].values())
    lines = [f"pyopencl {res['pyopencl']}'s {' + '.join(res['files'])}, {n} sitting(s), medians:", "",
             "| run | seconds | inside `Program.build` | builds | passed |", "|---|--:|--:|--:|--:|"]
    for m in MODES:
        runs = res["runs"][m]
        if not runs:
            continue

        def med(k: str, runs: list[dict[str, Any]] = runs) -> str:
            xs = [r[k] for r in runs if r.get(k) is not None]
            return f"{statistics.median(xs):.1f}" if xs else "-"
        lines.append(f"| {m} | {med('wall_s')} | {med('build_s')} | {med('builds')} | {med('passed')} |")
    lines += ["", "| ratio (each sitting's runs) | whole run: median | min | max | target | inside `build` |",
              "|---|--:|--:|--:|--:|--:|"]
    for mode, against, target in TARGETS:
        rs = _ratios(res, mode, against)
        bs = _ratios(res, mode, against, "build_s")
        if rs:
            goal = "-" if target is None else f"<= {target}"
            lines.append(f"| {mode} / {against} | {statistics.median(rs):.3f} | {min(rs):.3f} | {max(rs):.3f} "
                         f"| {goal} | {statistics.median(bs):.3f} |" if bs else "| - |")
    cold = res["runs"]["cold"]
    if cold and cold[-1].get("entries"):
        plain, baked = cold[-1]["entries"]
        bake = cold[-1].get("bake_s")
        lines += ["", f"The cold run (last sitting) left {plain} entries, {baked} of them baked (idle baking)"
                  + (f"; `asyncclcache bake` then took {bake:.1f} s." if bake is not None else ".")]
    busy = res["runs"].get("busy cold") or []
    if busy and busy[-1].get("entries"):
        plain, baked = busy[-1]["entries"]
        lines += ["", f"The busy cold run (last sitting) left {plain} entries, {baked} of them baked "
                  "(at its exit)."]
    for m in ("new machine", "baked", "busy cold", "busy next"):
        r = (res["runs"].get(m) or [{}])[-1]
        if r.get("summary"):
            lines += ["", f"{m}, last sitting: `{r['summary']}`"]
    return "\n".join(lines)


if __name__ == "__main__":  # without the bench: python benchmarks/cisuite.py OUT [REPS]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import json
    import tempfile

    from run import Runner

    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    runner = Runner(Path(tempfile.mkdtemp(prefix="acc-bench-")), out_dir, sys.executable)
    result = measure_cisuite(runner, int(sys.argv[2]) if len(sys.argv) > 2 else 3, print,
                             lambda r: (out_dir / "cisuite.json").write_text(json.dumps(r, indent=1)),
                             quick=os.environ.get("QUICK") == "1")
    print(table_md(result))
