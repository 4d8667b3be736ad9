"""The ``nodes`` section of ``asyncclcache bench``: jobs of R ranks on N simulated nodes
sharing one cache directory, as on a cluster's shared file system.

For each rank count R (N = R/8 nodes, at least 2; ``--ranks-per-node`` sets another
size) and each mode, a cold job (empty
directory), then a warm job on new nodes (new driver caches, new node-local storage):

* ``acc-ranklocal``: a directory per rank (the default before node-local copies);
* ``acc-shared``: one directory, every rank reads what it hits from it;
* ``acc``: the default: one directory, read through each node's copies.

Counted, where strace is here (``strace -f -y -e trace=%file,%desc``): every operation
whose path or descriptor lies under the shared directory, a rank at a time, in the cold job
and in the warm one (each a metadata or data request on a parallel file system), and the
opens of entry files among them (else the hits read from it, by the counters). The
directory holds ``--fill`` other entries first, kept in order within the hour, as a cache in
use for months is. Also: entries and bytes written by the cold job, every rank's hits, the
lifetime ``runs`` the directory counted, the longest exit of a rank; timed: the first result
of the warm job (a run without strace). From the per-rank and per-node terms measured, the
operations of a job of 1,000 and 10,000 ranks are projected. Then the rank-count change: a
4-rank job after a 2-rank job.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MODES = ["acc-ranklocal", "acc-shared", "acc"]
#: ``--quick``: what the node copies save against reading the shared directory from every rank.
QUICK_MODES = ["acc-shared", "acc"]
#: What each mode is, for the report.
LEGEND = {
    "acc-ranklocal": "a directory per rank (`ASYNCCLCACHE_RANK_LOCAL=1`; the default before)",
    "acc-shared": "one directory, no node-local copies (`ASYNCCLCACHE_NODE_COPIES=0`)",
    "acc": "one directory, read once per node through node-local copies (the default)",
}
PROGRAMS = 6
#: Ranks a simulated node in the projection (as in the measured rows, by default).
PROJECT_PER_NODE = 8
PROJECT_RANKS = (1_000, 10_000)


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


def _ops(trace_files: list[Path], acc_dir: str) -> tuple[list[int], dict[str, int]]:
    """Operations on the shared directory, a rank (a trace file) at a time, and by system
    call: every line whose path, or descriptor (``-y``), lies under ``acc_dir``. Not the
    ``execve`` that names it in an argument, nor the second half of an interrupted call."""
    per_rank, by_call = [], {}
    for f in trace_files:
        n = 0
        for line in f.read_text(errors="replace").splitlines():
            if acc_dir not in line or "resumed>" in line or " execve(" in line:
                continue
            n += 1
            m = re.match(r"\s*\d*\s*(\w+)\(", line)
            call = m.group(1) if m else "?"
            by_call[call] = by_call.get(call, 0) + 1
        per_rank.append(n)
    return per_rank, by_call


def _fill(acc_dir: str, n: int) -> None:
    """``n`` entries of another device in the shared directory, kept in order since (as a
    cache in use: its last upkeep within the hour)."""
    from asyncclcache import maintenance
    from asyncclcache.entry import Entry
    from asyncclcache.stats import add_lifetime
    from asyncclcache.store import Store

    store = Store(acc_dir, rank_local=False, node_copies=False)
    for _ in range(n):
        store.publish(Entry(os.urandom(32).hex(), (os.urandom(2000),), {"devices": [{"device_name": "other"}]}))
    add_lifetime(store.root, {"hits": n})  # its processes counted
    maintenance.upkeep(store)


def _runs(acc_dir: str) -> int:
    """The lifetime ``runs`` the directory counted (every rank's directory, rank-local)."""
    from asyncclcache.shared import ranks, version_dir
    from asyncclcache.stats import read_lifetime

    base = Path(acc_dir)
    roots = [version_dir(base)] + [version_dir(base) / f"rank-{r}" for r in ranks(base)]
    return int(sum(read_lifetime(r)["runs"] for r in roots))


def project(ops: list[int], ranks: int, nodes: int, to_ranks: int, per_node: int = PROJECT_PER_NODE) -> float:
    """Operations of a whole job of ``to_ranks`` ranks (``per_node`` a node) on the shared
    directory, from a job's per-rank ``ops``: the median rank's are the per-rank term; the
    rest (the ranks that read for their node, the writes of the programs) is a per-node term,
    which is conservative for the writes (once a job, whatever the node count)."""
    rank = statistics.median(ops)
    node = (sum(ops) - ranks * rank) / nodes
    to_nodes = -(-to_ranks // per_node)
    return to_ranks * rank + to_nodes * node


def measure_nodes(runner: Any, ranks: list[int], modes: list[str], log: Callable[[str], None],
                  save: Callable[[dict[str, Any]], None], *, reps: int = 1,
                  per_node: int | None = None, fill: int = 0) -> dict[str, Any]:
    """``reps``: timed warm jobs per row (the median of their medians); ``fill``: other
    entries in the shared directory first."""
    strace = shutil.which("strace")
    res: dict[str, Any] = {"programs": PROGRAMS, "counted_by": "strace" if strace else "counters",
                           "reps": reps, "fill": fill, "rows": {}}

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
                "count_entries": False,  # the parent counts them: no listing of the child's own
                "steps": 1, "_env": runner.env(mode, None, **extra)}
            if trace is not None:
                spec["_wrap"] = [strace, "-f", "-y", "-qq", "-e", "trace=%file,%desc", "-o", f"{trace}.{r}"]
            specs.append(spec)
        return runner.run(specs, timeout=1800)

    def stat(rs: list[dict[str, Any]], k: str) -> int:
        return int(sum((r.get("stats_final") or {}).get(k, 0) for r in rs))

    for R in ranks:
        N = nodes_for(R, per_node)
        row = res["rows"].setdefault(str(R), {"nodes": N})
        for mode in modes:
            acc_dir = runner.fresh(f"{mode}-shared")
            if fill:
                _fill(acc_dir, fill)
            before = {p for p in _entry_files(acc_dir)}
            traces = {phase: str(Path(runner.fresh(f"strace-{phase}")) / "t") if strace else None
                      for phase in ("cold", "warm")}
            cold = job(mode, R, acc_dir, runner.fresh("node-local"), trace=traces["cold"])
            files = [p for p in _entry_files(acc_dir) if p not in before]
            one: dict[str, Any] = {
                "cold_entries": len(files), "cold_bytes": sum(p.stat().st_size for p in files),
                "cold_writes": stat(cold, "writes"),
                "cold_median_s": _median([r.get("first_result_s") for r in cold]),
                "cold_under_strace": bool(strace),
                "error": next((r["error"] for r in cold if r.get("error")), None)}
            warm = job(mode, R, acc_dir, runner.fresh("node-local"), trace=traces["warm"])
            one["warm_hits"] = stat(warm, "hits")
            one["warm_misses"] = stat(warm, "misses")
            one["warm_shared_reads"] = stat(warm, "shared_reads")
            one["warm_node_reads"] = stat(warm, "node_reads")
            for phase, trace in traces.items():
                if trace is None:
                    continue
                files_t = sorted(Path(trace).parent.glob("t.*"), key=lambda p: int(p.suffix[1:]))
                one[f"{phase}_ops"], one[f"{phase}_ops_by_call"] = _ops(files_t, acc_dir)
                one[f"{phase}_ops_projected"] = {
                    str(n): round(project(one[f"{phase}_ops"], R, N, n, per_node or PROJECT_PER_NODE))
                    for n in PROJECT_RANKS}
            if traces["warm"] is not None:
                one["warm_opens"] = _opens(sorted(Path(traces["warm"]).parent.glob("t.*")), acc_dir)
            else:  # every hit read its entry from the directory, except those of node copies
                one["warm_opens"] = one["warm_hits"] - one["warm_node_reads"]
            timed_jobs = [warm] if trace is None else []
            while len(timed_jobs) < reps:
                timed_jobs.append(job(mode, R, acc_dir, runner.fresh("node-local")))
            medians = [_median([r.get("first_result_s") for r in t]) for t in timed_jobs]
            one["warm_median_s"] = _median(medians)
            one["warm_medians_s"] = medians
            one["warm_max_s"] = max((r.get("first_result_s") or 0 for t in timed_jobs for r in t), default=None)
            one["exit_max_s"] = max((r.get("close_s") or 0 for t in timed_jobs for r in t), default=None)
            one["lifetime_runs"] = _runs(acc_dir)
            one["jobs_run"] = 1 + len(timed_jobs) + (0 if traces["warm"] is None else 1)
            one["error"] = one["error"] or next(
                (r["error"] for r in warm + [x for t in timed_jobs for x in t] if r.get("error")), None)
            row[mode] = one
            ops = "".join(f" | {ph} ops a rank: mean {statistics.mean(one[ph + '_ops']):.1f} "
                          f"median {statistics.median(one[ph + '_ops']):.0f}"
                          for ph in ("cold", "warm") if one.get(ph + "_ops"))
            log(f"nodes R={R} N={N} {mode:14s} cold: {one['cold_entries']} entries "
                f"{one['cold_bytes'] / 1e6:.2f} MB | warm: {one['warm_opens']} opens of entries "
                f"(N x E = {N * PROGRAMS}), {one['warm_hits']}/{R * PROGRAMS} hits, first result "
                f"median {_fmt(one['warm_median_s'])} max {_fmt(one['warm_max_s'])}{ops} | "
                f"runs {one['lifetime_runs']}, longest exit {_fmt(one['exit_max_s'])}")
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
    return None if None in xs or not xs else statistics.median(xs)  # type: ignore[type-var]


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
    ops_rows = [(R, row, m) for R, row in sorted(res.get("rows", {}).items(), key=lambda kv: int(kv[0]))
                for m in modes if row.get(m, {}).get("warm_ops")]
    if ops_rows:
        fill = res.get("fill", 0)
        md += ["", f"Every operation on the shared directory (strace `%file,%desc`), a rank, with {fill} "
               "other entries in it: mean / median rank, and projected for a whole job of 1,000 and "
               f"10,000 ranks ({PROJECT_PER_NODE} a node; the median rank's operations a rank, the rest "
               "a node). The lifetime `runs` counted, against the processes run; the longest exit of a rank.",
               "", "| R / N | mode | cold a rank: mean / median | cold job, projected 1k / 10k ranks | warm a "
               "rank: mean / median | warm job, projected 1k / 10k ranks | runs counted / run | longest exit |",
               "|" + "---|" * 8]
        for R, row, m in ops_rows:
            c = row[m]

            def mm(xs: list[int]) -> str:
                return f"{statistics.mean(xs):.1f} / {statistics.median(xs):.0f}"

            def pj(d: dict[str, float] | None) -> str:
                return " / ".join(f"{v:,.0f}" for v in (d or {}).values()) or "-"

            md.append(f"| {R} / {row.get('nodes')} | {m} | {mm(c['cold_ops'])} "
                      f"| {pj(c.get('cold_ops_projected'))} | {mm(c['warm_ops'])} "
                      f"| {pj(c.get('warm_ops_projected'))} | {c.get('lifetime_runs')} / "
                      f"{int(R) * c.get('jobs_run', 0)} | {_fmt(c.get('exit_max_s'))} |")
    ch = res.get("rank_change") or {}
    if ch:
        md += ["", "A job of 4 ranks after one of 2 ranks: "
               + "; ".join(f"{m} {v['hits']}/{v['builds']} hits" for m, v in ch.items()) + "."]
    md += ["", f"E = {E} programs a rank (the same on every rank); opens counted by "
           f"{res.get('counted_by')}. Modes: " + "; ".join(f"**{m}**: {LEGEND[m]}" for m in modes) + "."]
    return "\n".join(md)
