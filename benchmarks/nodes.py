"""The ``nodes`` section of ``asyncclcache bench``: jobs of R ranks on N simulated nodes
sharing one cache directory, as on a cluster's shared file system.

For each rank count R (N = R/8 nodes, at least 2; ``--ranks-per-node`` sets another
size) and each mode, a cold job (empty
directory), then a warm job on new nodes (new driver caches, new node-local storage):

* ``acc-ranklocal``: a directory per rank (the default before node-local copies);
* ``acc-shared``: one directory, every rank reads what it hits from it;
* ``acc``: the default: one directory, read through each node's copies.

Counted: opens of entry files under the shared directory in the warm job (``strace -f -y``
where strace is here; else the hits read from it, by the counters), entries and bytes
written there by the cold job, every rank's hits; timed: the first result of the warm job
(a run without strace). Then the rank-count change: a 4-rank job after a 2-rank job.
"""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import report

MODES = ["acc-ranklocal", "acc-shared", "acc"]
#: What each mode is, for the report.
LEGEND = {
    "acc-ranklocal": "a directory per rank (`ASYNCCLCACHE_RANK_LOCAL=1`; the default before)",
    "acc-shared": "one directory, no node-local copies (`ASYNCCLCACHE_NODE_COPIES=0`)",
    "acc": "one directory, read once per node through node-local copies (the default)",
}
PROGRAMS = 4


def nodes_for(ranks: int, per_node: int | None = None) -> int:
    """Simulated nodes for ``ranks``: ``per_node`` ranks a node; by default 8 a node, at
    least 2 (1 for a single rank)."""
    if per_node:
        return -(-ranks // per_node)
    return 1 if ranks == 1 else max(2, ranks // 8)


def _entry_files(acc_dir: str) -> list[Path]:
    return [p for p in Path(acc_dir).rglob("*.acl") if p.is_file() and not p.is_symlink()]


def _opens(trace_files: list[Path], acc_dir: str) -> int:
    # strace -y names the folder a relative open starts from: "openat(5</dir/v1/ab>, "x.acl"".
    pat = re.compile(r"open(at)?\(.*" + re.escape(acc_dir) + r".*\.acl\"")
    n = 0
    for f in trace_files:
        for line in f.read_text(errors="replace").splitlines():
            if pat.search(line) and "ENOENT" not in line:
                n += 1
    return n


def measure_nodes(runner: Any, ranks: list[int], modes: list[str], log: Callable[[str], None],
                  save: Callable[[dict[str, Any]], None], *, reps: int = 1,
                  per_node: int | None = None) -> dict[str, Any]:
    """``reps``: timed warm jobs per row (the median of their medians)."""
    strace = shutil.which("strace")
    res: dict[str, Any] = {"programs": PROGRAMS, "counted_by": "strace" if strace else "counters",
                           "reps": reps, "rows": {}}

    def job(mode: str, R: int, acc_dir: str, node_dir: str, *, trace: str | None = None) -> list[dict[str, Any]]:
        N = nodes_for(R, per_node)
        start_at = time.time() + 1.5 + 0.25 * R
        specs = []
        for r in range(R):
            # The mode's own settings (rank-local, copies off) are the runner's, as elsewhere.
            extra = {"PMI_RANK": str(r), "PMI_SIZE": str(R), "POCL_MAX_PTHREAD_COUNT": "1",
                     "ASYNCCLCACHE_TEST_NODE": f"sim{r * N // R}", "ASYNCCLCACHE_NODE_DIR": node_dir}
            spec: dict[str, Any] = {
                "task": "first_result", "variant": mode, "workload": "throughput",
                "workload_args": {"programs": PROGRAMS}, "start_at": start_at, "acc_dir": acc_dir,
                "steps": 1, "_env": runner.env(mode, None, **extra)}
            if trace is not None:
                spec["_wrap"] = [strace, "-f", "-y", "-qq", "-e", "trace=open,openat", "-o", f"{trace}.{r}"]
            specs.append(spec)
        return runner.run(specs, timeout=1800)

    def stat(rs: list[dict[str, Any]], k: str) -> int:
        return int(sum((r.get("stats_final") or {}).get(k, 0) for r in rs))

    for R in ranks:
        N = nodes_for(R, per_node)
        row = res["rows"].setdefault(str(R), {"nodes": N})
        for mode in modes:
            acc_dir = runner.fresh(f"{mode}-shared")
            cold = job(mode, R, acc_dir, runner.fresh("node-local"))
            files = _entry_files(acc_dir)
            one: dict[str, Any] = {
                "cold_entries": len(files), "cold_bytes": sum(p.stat().st_size for p in files),
                "cold_writes": stat(cold, "writes"),
                "cold_median_s": _median([r.get("first_result_s") for r in cold]),
                "error": next((r["error"] for r in cold if r.get("error")), None)}
            trace = None
            if strace:
                trace = str(Path(runner.fresh("strace")) / "t")
            warm = job(mode, R, acc_dir, runner.fresh("node-local"), trace=trace)
            one["warm_hits"] = stat(warm, "hits")
            one["warm_misses"] = stat(warm, "misses")
            one["warm_shared_reads"] = stat(warm, "shared_reads")
            one["warm_node_reads"] = stat(warm, "node_reads")
            if trace is not None:
                one["warm_opens"] = _opens(sorted(Path(trace).parent.glob("t.*")), acc_dir)
            else:  # every hit read its entry from the directory, except those of node copies
                one["warm_opens"] = one["warm_hits"] - one["warm_node_reads"]
            timed_jobs = [warm] if trace is None else []
            while len(timed_jobs) < reps:
                timed_jobs.append(job(mode, R, acc_dir, runner.fresh("node-local")))
            medians = [_median([r.get("first_result_s") for r in t]) for t in timed_jobs]
            one["warm_median_s"] = _median(medians)
            one["warm_medians_s"] = medians
            one["warm_max_s"] = max((r.get("first_result_s") or 0 for t in timed_jobs for r in t), default=None)
            one["error"] = one["error"] or next(
                (r["error"] for r in warm + [x for t in timed_jobs for x in t] if r.get("error")), None)
            row[mode] = one
            log(f"nodes R={R} N={N} {mode:14s} cold: {one['cold_entries']} entries "
                f"{one['cold_bytes'] / 1e6:.2f} MB | warm: {one['warm_opens']} opens of entries "
                f"(N x E = {N * PROGRAMS}), {one['warm_hits']}/{R * PROGRAMS} hits, first result "
                f"median {_fmt(one['warm_median_s'])} max {_fmt(one['warm_max_s'])}")
            save(res)
    # The rank-count change: 2 ranks, then 4 (ranks 2 and 3 are new).
    change: dict[str, Any] = {}
    for mode in modes:
        acc_dir = runner.fresh(f"{mode}-change")
        job(mode, 2, acc_dir, runner.fresh("node-local"))
        warm = job(mode, 4, acc_dir, runner.fresh("node-local"))
        change[mode] = {"hits": stat(warm, "hits"), "misses": stat(warm, "misses"),
                        "builds": 4 * PROGRAMS}
        log(f"nodes rank-count change 2 -> 4 {mode:14s} {change[mode]['hits']}/{4 * PROGRAMS} hits")
    res["rank_change"] = change
    save(res)
    return res


def _median(xs: list[float | None]) -> float | None:
    # None where a rank gave no result: a job's median is of all its ranks or none.
    return None if None in xs else report.median(xs)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


def table_md(res: dict[str, Any]) -> str:
    """The section's tables, in Markdown."""
    modes = [m for m in MODES if any(m in row for row in res.get("rows", {}).values())]
    if not modes:
        return ""
    E = res.get("programs", PROGRAMS)
    head = ("| R ranks / N nodes | mode | warm: opens of entries in the shared dir (bound N x E) "
            "| warm hits | cold: entries written | cold: MB written | warm first result median / max |")
    md = [head, "|" + "---|" * 7]
    for R, row in sorted(res.get("rows", {}).items(), key=lambda kv: int(kv[0])):
        N = row.get("nodes")
        for m in modes:
            c = row.get(m)
            if c is None:
                continue
            over = c["warm_opens"] / (N * E) if N else 0
            md.append(f"| {R} / {N} | {m} | {c['warm_opens']} ({over:.1f}x the bound {N * E}) | "
                      f"{c['warm_hits']}/{int(R) * E} | {c['cold_entries']} | {c['cold_bytes'] / 1e6:.2f} | "
                      f"{_fmt(c.get('warm_median_s'))} / {_fmt(c.get('warm_max_s'))} |")
    ch = res.get("rank_change") or {}
    if ch:
        md += ["", "A job of 4 ranks after one of 2 ranks: "
               + "; ".join(f"{m} {v['hits']}/{v['builds']} hits" for m, v in ch.items()) + "."]
    md += ["", f"E = {E} programs a rank (the same on every rank); opens counted by "
           f"{res.get('counted_by')}. Modes: " + "; ".join(f"**{m}**: {LEGEND[m]}" for m in modes) + "."]
    return "\n".join(md)
