"""``asyncclcache bench``, run as a user runs it, on small kernels (real pocl, real processes).

Speed is the benchmark's business, not the tests': these check that the command measures
what it says (every variant ran and produced a checked result, the warm runs hit, the
rank-local and shared modes write as many times as they should) and that the report
says so.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from asyncclcache.ranks import RANK_ENV_VARS

ROOT = Path(__file__).resolve().parent.parent


def bench(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in RANK_ENV_VARS}
    env["PYOPENCL_CTX"] = "portable"  # pocl, whatever else is installed
    return subprocess.run(
        [sys.executable, "-m", "asyncclcache", "bench", *args],
        capture_output=True, text=True, env=env, timeout=timeout, check=False, cwd=ROOT,
    )


def report_module() -> ModuleType:
    """benchmarks/report.py, loaded afresh (render() renames a column head in it)."""
    return _load("bench_report", "report.py")


def _load(name: str, file: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / file)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def bold_columns(md: str, row: str) -> set[str]:
    """The heads of the columns whose cell is bold in the first table row containing ``row``."""
    lines = md.splitlines()
    i = next(i for i, line in enumerate(lines) if row in line)
    head = next(lines[j] for j in range(i, -1, -1) if lines[j].startswith("| measurement |"))
    names = [c.strip() for c in head.split("|")[2:-2]]  # less the label and the note
    cells = [c.strip() for c in lines[i].split("|")[2:-2]]
    return {n for n, c in zip(names, cells, strict=True) if c.startswith("**")}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = tmp_path_factory.mktemp("bench")
    # The variants named: --quick's, and the nodes section's rank-local mode, which --quick leaves out.
    r = bench("--quick", "--only", "seed,ranks,nodes,firsthit", "--ranks", "2", "--node-ranks", "4", "--n", "20",
              "--variants", "nocache,acc,acc-baked,acc-shared,acc-ranklocal", "--out", str(out))
    return out, r


@pytest.mark.slow
def test_quick_run_measures_every_variant(quick_run: tuple[Path, Any]) -> None:
    out, r = quick_run
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[" in r.stdout and "1/4 seed]" in r.stdout and "2/4 ranks]" in r.stdout  # progress
    R = json.loads((out / "report.json").read_text())
    assert R["machine"]["auto_strategy"] == "kcache"  # pocl's CPU device, kernel cache on
    seed = R["first_result_seed"]
    assert set(seed) == {"nocache", "acc", "acc-baked"}  # --quick's columns
    for v, runs in seed.items():
        assert len(runs["cold"]) == 1
        for run in runs["cold"] + runs["warm"]:
            assert not run.get("error"), (v, run.get("log_tail"))
            assert run["first_result_s"] > 0 and run["programs"] == 1  # checked by the child
            assert run["steps_s"] > 0 and run["steps"] == 5
        assert len(runs["warm"]) == (0 if v == "nocache" else 1)
    acc_cold, acc_warm = seed["acc"]["cold"][0], seed["acc"]["warm"][0]
    assert acc_cold["strategies_used"] == ["kcache"]
    assert acc_cold["entries"] == 1 and acc_cold["stats_final"]["writes"] == 1
    assert acc_warm["stats_timed"]["hits"] == 1 and acc_warm["stats_timed"]["misses"] == 0
    # acc baked: baked between the runs; its warm hit loads the baked binary.
    assert seed["acc-baked"]["bake_s"][0] > 0
    baked_warm = seed["acc-baked"]["warm"][0]["stats_timed"]
    assert (baked_warm["hits"], baked_warm["baked_hits"], baked_warm["misses"]) == (1, 1, 0)


@pytest.mark.slow
def test_firsthit_times_a_kcache_hit_and_a_baked_hit_beside_pocls_folder(quick_run: tuple[Path, Any]) -> None:
    out, _ = quick_run
    res = json.loads((out / "report.json").read_text())["firsthit"]
    assert not res.get("error"), res
    assert res["wide"]["kernels"] > 1
    for mode, hits in (("pocl folder", None), ("acc", [1, 0]), ("acc baked", [1, 1])):
        for runs in (res["runs"][mode], res["wide"]["runs"][mode]):
            assert len(runs) == 3, mode  # --quick's sittings
            for one in runs:
                assert one["ok"] and one["hits"] == hits, (mode, one)  # every launch's result checked
                assert 0 < one["pocl_ms"] < one["build_ms"], (mode, one)
    assert "## A first hit in a new process" in (out / "report.md").read_text()


@pytest.mark.slow
def test_rank_sweep_writes_once_per_key_whatever_the_mode(quick_run: tuple[Path, Any]) -> None:
    out, r = quick_run
    assert r.returncode == 0, r.stdout[-3000:]
    rows = json.loads((out / "report.json").read_text())["ranks"]["rows"]
    assert set(rows) == {"2"}
    row = rows["2"]
    assert set(row) == {"nocache", "acc", "acc-shared"}
    for v, phases in row.items():
        for run in phases["cold"] + phases["warm"]:
            assert not run["error"], (v, run)
            assert len(run["per_rank"]) == 2 and all(t > 0 for t in run["per_rank"])
    # One directory for the ranks (with node-local copies or without): one claim wins.
    for v in ("acc", "acc-shared"):
        shared = row[v]["cold"][0]
        assert shared["writes"] == 1
        assert shared["skipped"] + shared["hits"] == 1  # the other rank skipped (or came late)
    for v in ("acc", "acc-shared"):
        warm = row[v]["warm"][0]
        assert warm["hits"] == 2 and warm["misses"] == 0


@pytest.mark.slow
def test_nodes_section_counts_entries_opens_and_the_rank_count_change(quick_run: tuple[Path, Any]) -> None:
    out, r = quick_run
    assert r.returncode == 0, r.stdout[-3000:]
    res = json.loads((out / "report.json").read_text())["nodes"]
    E = res["programs"]
    row = res["rows"]["4"]
    assert row["nodes"] == 2
    for mode in ("acc-ranklocal", "acc-shared", "acc"):
        c = row[mode]
        assert not c["error"], (mode, c)
        assert c["warm_hits"] == 4 * E and c["warm_misses"] == 0
        assert c["warm_median_s"] > 0
    # A directory per rank: a copy per rank; one directory: one entry per program.
    assert row["acc-ranklocal"]["cold_entries"] == 4 * E
    assert row["acc-shared"]["cold_entries"] == row["acc"]["cold_entries"] == E
    # Every rank of the shared modes opens what it hits there; node copies: each node at
    # least once (a rank that came while another copied read it too), never more than that.
    assert row["acc-shared"]["warm_opens"] == 4 * E
    assert 2 * E <= row["acc"]["warm_opens"] <= 4 * E
    assert row["acc"]["warm_opens"] == row["acc"]["warm_shared_reads"]
    assert row["acc"]["warm_node_reads"] == 4 * E - row["acc"]["warm_opens"]
    # 4 ranks after 2: rank-local ranks 2 and 3 start cold; the shared directory hits.
    ch = res["rank_change"]
    assert (ch["acc"]["hits"], ch["acc-shared"]["hits"], ch["acc-ranklocal"]["hits"]) == (4 * E, 4 * E, 2 * E)
    md = (out / "report.md").read_text()
    assert "## Ranks on several nodes, one shared directory" in md and "| 4 / 2 | acc |" in md


@pytest.mark.slow
def test_report_marks_best_explains_auto_and_plots(quick_run: tuple[Path, Any]) -> None:
    out, r = quick_run
    assert r.returncode == 0
    md = (out / "report.md").read_text()
    assert "## Machine" in md and "Portable Computing Language" in md
    assert "**Why `auto` picks `kcache` on this driver:**" in md
    assert "acc kcache (auto)" in md and "acc process" not in md and "steps 2..N" in md
    assert "warm-ups" not in md
    # The lowest cold time is bold, however the timings fell: every column's but acc baked's,
    # whose cold run is acc's configuration again (the bake comes after it).
    R = json.loads((out / "report.json").read_text())
    cold = {v: statistics.median(r["first_result_s"] for r in d["cold"] if not r.get("error"))
            for v, d in R["first_result_seed"].items() if v != "acc-baked"}
    low = min(cold.values())
    heads = dict(report_module().HEAD, acc="acc kcache (auto)")
    best = {heads[v] for v, x in cold.items() if f"{x:.3f}" == f"{low:.3f}"}  # ties as printed
    assert bold_columns(md, "**cold** first result") == best, md
    assert "## Ranks on one node" in md and "R=2: **cold**" in md
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    pngs = sorted(p.name for p in out.glob("*.png"))
    if has_mpl:
        assert pngs == ["cold_warm.png", "first_result.png", "ranks.png"]
        assert all((out / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
        assert "![ranks](ranks.png)" in md
    else:
        assert pngs == [] and "## Plots" not in md


def test_a_cold_row_never_ranks_the_baked_column() -> None:
    # Issue 26: on a fresh machine acc baked's cold run (0.56 s) was the lowest. It is acc's
    # configuration run again, so it is shown, never bold; the best of the others is. (acc
    # process: a column of older results, which still render.)
    report = report_module()

    def run(first: float) -> dict[str, Any]:
        return {"first_result_s": first, "group_cpu_s": 10 * first, "steps_s": first / 10,
                "flush_s": 0.0, "close_s": 0.0,
                "stats_final": {"main_thread_seconds": 0.0, "background_cpu_seconds": 0.0}}

    cold = {"nocache": 1.2, "default": 1.1, "pyopencl": 1.3, "pyopencl-spec0": 1.25, "acc": 0.61,
            "acc-baked": 0.56, "acc-process": 0.9}
    R = {"variants_used": list(cold), "workloads": {"seed": "N=20"},
         "first_result_seed": {v: {"cold": [run(x)], "warm": [] if v == "nocache" else [run(x / 20)],
                                   "bake_s": [0.5] if v == "acc-baked" else []} for v, x in cold.items()}}
    md = report.render(R, [])
    for row in ("**cold** first result", "cold, CPU of all processes", "cold, kernel time of steps 2..N"):
        assert bold_columns(md, row) == {"acc (auto)"}, row
    # Warm, its baked hit is a configuration of its own: it competes.
    assert bold_columns(md, "**warm**, new node [s]") == {"acc baked"}
    assert "not ranked" in md


@pytest.mark.slow
def test_report_re_renders_from_json(quick_run: tuple[Path, Any], tmp_path: Path) -> None:
    out, r = quick_run
    assert r.returncode == 0
    before = (out / "report.md").read_text()
    (out / "report.md").unlink()
    rr = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py"), str(out)],
                        capture_output=True, text=True, check=False, timeout=120)
    assert rr.returncode == 0, rr.stderr
    assert (out / "report.md").read_text() == before
    # A report without the rank sweep loses the sweep's plot, not keeps a stale one.
    other = tmp_path
    R = json.loads((out / "report.json").read_text())
    del R["ranks"]
    (other / "report.json").write_text(json.dumps(R))
    (other / "ranks.png").write_bytes(b"an earlier run's plot")
    rr = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py"), str(other)],
                        capture_output=True, text=True, check=False, timeout=120)
    assert rr.returncode == 0, rr.stderr
    assert not (other / "ranks.png").exists()
    assert "## Ranks on one node" not in (other / "report.md").read_text()


@pytest.mark.parametrize("args", [["--only", "seed,nonsense"], ["--reps", "many"],
                                  ["--ranks", "1,lots"], ["--ranks", "0"], ["--n", "0"]])
def test_bad_arguments_exit_2(args: list[str], tmp_path: Path) -> None:
    r = bench(*args, "--out", str(tmp_path), timeout=60)
    assert r.returncode == 2
    assert "usage: asyncclcache bench" in r.stderr
    assert not (tmp_path / "report.json").exists()


def test_help_lists_the_options() -> None:
    r = bench("--help", timeout=60)
    assert r.returncode == 0
    for opt in ("--quick", "--out", "--only", "--ranks"):
        assert opt in r.stdout


def test_sharedpocl_jobs_build_in_one_pocl_cache_and_report_their_failures(tmp_path: Path) -> None:
    # Issue 41's section, on 2 ranks and 2 small programs (its defaults are 16 and 24).
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import run as bench_run
        import sharedpocl
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    logs = tmp_path / "logs"
    logs.mkdir()
    runner = bench_run.Runner(tmp_path / "work", logs, sys.executable)
    jobs = {v: sharedpocl._job(runner, v, 2, 2, 4, shared=not v.startswith(("nocache-own", "acc-own")),
                               barrier=v.endswith("-barrier"))
            for v in ("nocache-own", "acc-own", "acc-own-barrier", "nocache-shared", "acc-shared", "acc")}
    assert all(j["failures"] == [] and j["slowest_s"] and j["cpu_s"] > 0 for j in jobs.values()), jobs
    pocl_dirs = sorted(p.name for p in (tmp_path / "work").glob("*-node/*") if p.name.startswith("pocl"))
    assert "pocl-rank0" in pocl_dirs and "pocl.asyncclcache-builds" in pocl_dirs  # own caches; the lock's folder
    res = {"failures": {"ranks": 2, "programs": 2, "runs": [jobs["acc"]]},
           "heavy": {"ranks": 2, "programs": 2, "statements": 4, "reps": [jobs]}}
    md = sharedpocl.table_md(res)
    assert "| acc: asyncclcache installed, one pocl cache for every rank | 1 | 0 | 0 |" in md, md
    assert "| acc-shared: asyncclcache installed, one pocl cache for every rank | nocache-own |" in md, md
    assert "acc-own-barrier" not in md  # its base, nocache-own-barrier, was not run
    # The barrier: each rank waited for the other's build of each program.
    assert sorted(p.name for p in (tmp_path / "work").glob("*barrier*/*")) == ["0-0", "0-1", "1-0", "1-1"]


def run_module() -> ModuleType:
    """benchmarks/run.py, loaded afresh."""
    return _load("bench_run", "run.py")


@pytest.mark.slow
def test_a_run_says_how_long_it_will_take_and_records_each_section(quick_run: tuple[Path, Any]) -> None:
    out, r = quick_run
    assert r.returncode == 0, r.stdout[-3000:]
    first = r.stdout.splitlines()[0]
    assert first.startswith("bench: seed, ranks, nodes, firsthit: about ") and " min (" in first, first
    took = json.loads((out / "report.json").read_text())["section_s"]
    assert set(took) == {"seed", "ranks", "nodes", "firsthit"} and all(s > 0 for s in took.values()), took


def test_the_announced_length_is_this_machines_last_run_where_there_is_one(tmp_path: Path) -> None:
    run = run_module()
    quick = sum(run.SECTION_S[s][0] for s in ("seed", "suite"))
    assert run.estimate(["seed", "suite"], True, 1, tmp_path) == (quick, "2-core figures")
    full = run.estimate(["seed"], False, 6, tmp_path)[0]
    assert full == 2 * run.SECTION_S["seed"][1]  # grows with the repetitions
    (tmp_path / "report.json").write_text(json.dumps(
        {"args": {"quick": True, "reps": 1}, "section_s": {"seed": 7.0, "suite": 11.0}}))
    assert run.estimate(["seed", "suite"], True, 1, tmp_path) == (18.0, "this machine's last run")
    mixed = run.estimate(["seed", "stall"], True, 1, tmp_path)
    assert mixed == (7.0 + run.SECTION_S["stall"][0], "this machine's last run and 2-core figures")
    # A full run is not announced from a quick one's seconds.
    assert run.estimate(["seed"], False, 3, tmp_path) == (run.SECTION_S["seed"][1], "2-core figures")
