"""Turns run.py's raw numbers (``report.json``) into ``report.md`` and PNG plots.

``python benchmarks/report.py DIR`` re-renders DIR/report.md and the plots from
DIR/report.json (for a run made on a machine without matplotlib).
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

#: Column order everywhere. ``acc-process`` and ``acc-sync`` are in older results only (their
#: strategies are gone, issue 27): kept here so that those still render.
VARIANTS = ["nocache", "default", "pyopencl", "pyopencl-spec0", "acc", "acc-baked", "acc-idle",
            "acc-process", "acc-sync", "acc-thread", "acc-shared", "acc-ranklocal"]
#: Column heads; ``acc`` is renamed after the strategy auto picked on the machine (render()).
HEAD = {
    "nocache": "no cache",
    "default": "driver cache",
    "pyopencl": "pyopencl cache",
    "pyopencl-spec0": "pyopencl cache, WG spec. off",
    "acc": "acc (auto)",
    "acc-baked": "acc baked",
    "acc-idle": "acc idle baking",
    "acc-process": "acc process",
    "acc-sync": "acc sync",
    "acc-thread": "acc thread",
    "acc-shared": "acc shared",
    "acc-ranklocal": "acc rank-local",
}
#: What each column is (rendered under the tables).
LEGEND = {
    "nocache": "pyopencl with `PYOPENCL_NO_CACHE=1`",
    "default": "pyopencl as installed, which leaves caching to the driver's kernel cache on "
    "pocl and NVIDIA (pocl's `POCL_CACHE_DIR`, CUDA's `CUDA_CACHE_PATH`); its warm runs "
    "reuse that cache, i.e. the **same node** (†) — on a new node it is cold",
    "pyopencl": "pyopencl's own binary cache, forced on (`has_src_build_cache` patched)",
    "pyopencl-spec0": "pyopencl's binary cache with `POCL_WORK_GROUP_SPECIALIZATION=0`: every "
    "launch uses the generic variant, so its BINARIES query compiles nothing more (docs/design.md "
    "F17), at the price of unspecialized kernels (see the steps 2..N row)",
    "acc": "asyncclcache, strategy `auto` (on pocl with its kernel cache on: `kcache`, the "
    "program's kernel-cache folder is the entry; nothing is compiled for the cache)",
    "acc-baked": "asyncclcache `auto`, its directory baked (`asyncclcache bake`) between the cold "
    "and the warm run: a warm hit loads pocl's binary; its cold cells are another run of `acc`'s "
    "configuration (the bake comes after), not ranked",
    "acc-idle": "asyncclcache `auto` with `ASYNCCLCACHE_BAKE=idle`: a helper at the lowest priority "
    "bakes the entries written, where a core is idle, and is never waited for",
    "acc-process": "asyncclcache, strategy `process` (helper process: generic compile + "
    "BINARIES query; gone since issue 27)",
    "acc-sync": "asyncclcache, strategy `sync` (binary query inline in `build()`; gone since issue 27)",
    "acc-thread": "asyncclcache, strategy `thread` (query on a background thread)",
    "acc-shared": "asyncclcache `auto`, one directory for all ranks, every rank reading it "
    "(`ASYNCCLCACHE_NODE_COPIES=0`; `acc` reads it once per node; before issue 28 `acc` was rank-local)",
    "acc-ranklocal": "asyncclcache `auto`, a directory per rank (`ASYNCCLCACHE_RANK_LOCAL=1`)",
}
SAME_NODE = "†"
#: Columns whose cold run is another column's configuration (``acc-baked``: ``acc``'s, the bake
#: comes after it): shown, never the best of a cold row.
COLD_REPEATS = ("acc-baked",)
PLOTS = ("first_result", "cold_warm", "ranks")
#: One colour per variant in every plot.
COLOR = {"nocache": "C7", "default": "C5", "pyopencl": "C3", "pyopencl-spec0": "C6", "acc": "C0",
         "acc-process": "C4", "acc-sync": "C9", "acc-thread": "C1", "acc-shared": "C2", "acc-baked": "C8",
         "acc-idle": "tab:olive"}


# {{{ numbers


def median(xs: Iterable[float | None]) -> float | None:
    v = [x for x in xs if x is not None]
    return statistics.median(v) if v else None


def vals(runs: list[dict[str, Any]], get: Callable[[dict[str, Any]], Any]) -> list[float]:
    out = []
    for r in runs:
        if r.get("error"):
            continue
        with contextlib.suppress(KeyError, TypeError):
            x = get(r)
            if x is not None:
                out.append(x)
    return out


def num(x: float | None, digits: int = 2) -> str:
    if x is None:
        return "—"
    if abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:.{digits}f}"


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def met(value: float | None, target: float) -> str:
    if value is None:
        return ""
    return f"≤ {target:g}: " + ("yes" if value <= target else "**no**")


class Cell:
    """A table cell: the number it is ranked by (or None) and its text."""

    def __init__(self, value: float | None, text: str | None = None, digits: int = 2) -> None:
        self.value = value
        self.text = text if text is not None else num(value, digits)


def cell(runs: list[dict[str, Any]], get: Callable[[dict[str, Any]], Any],
         digits: int = 2, suffix: str = "") -> Cell:
    if not runs:
        return Cell(None, "—")
    errors = sum(1 for r in runs if r.get("error"))
    m = median(vals(runs, get))
    if m is None:
        return Cell(None, "failed" if errors else "—")
    text = num(m, digits) + suffix
    if errors:
        text += f" ({errors}/{len(runs)} failed)"
    return Cell(m, text)


# }}}


# {{{ tables


class Table:
    """Rows of cells per variant; the lowest number of a row is marked bold."""

    def __init__(self, variants: list[str], note_head: str = "acc vs no cache") -> None:
        self.variants = variants
        self.note_head = note_head
        self.rows: list[tuple[str, dict[str, Cell], str, bool, set[str]]] = []

    def add(self, label: str, cells: dict[str, Cell], note: str = "", *, best: bool = True,
            exclude: Iterable[str] = ()) -> None:
        self.rows.append((label, cells, note, best, set(exclude)))

    def md(self) -> str:
        head = ["measurement"] + [HEAD[v] for v in self.variants] + [self.note_head]
        lines = ["| " + " | ".join(head) + " |", "|---|" + "--:|" * (len(head) - 2) + "---|"]
        for label, cells, note, best, exclude in self.rows:
            ranked = [c.value for v, c in cells.items()
                      if c.value is not None and v not in exclude and v in self.variants]
            low = min(ranked) if best and len(ranked) > 1 else None
            texts = []
            for v in self.variants:
                c = cells.get(v)
                if c is None:
                    texts.append("")
                elif (low is not None and c.value is not None and v not in exclude
                      and num(c.value, 3) == num(low, 3)):  # ties as printed: all best
                    texts.append(f"**{c.text}**")
                else:
                    texts.append(c.text)
            lines.append("| " + " | ".join([label, *texts, note]) + " |")
        return "\n".join(lines)


def first_result_table(R: dict[str, Any], variants: list[str], summary: dict[str, Any]) -> Table:
    t = Table(variants)

    def fr(r: dict[str, Any]) -> float:
        return r["first_result_s"]

    for wl, label in (("seed", "seed kernel"), ("multi", "20 programs")):
        res = R.get(f"first_result_{wl}")
        if not res:
            continue
        n = (R.get("workloads") or {}).get(wl, "")
        cold = {v: cell(res[v]["cold"], fr) for v in res}
        warm = {v: cell(res[v]["warm"], fr, 3) for v in res if v != "nocache"}
        if "default" in warm:
            warm["default"].text += SAME_NODE
        warm["nocache"] = Cell(None, "(= cold)")
        base = cold.get("nocache", Cell(None)).value
        acc_cold = cold.get("acc", Cell(None)).value
        acc_warm = warm.get("acc", Cell(None)).value
        cr, wr = ratio(acc_cold, base), ratio(acc_warm, base)
        summary[f"{wl}_cold_ratio"], summary[f"{wl}_warm_ratio"] = cr, wr
        reps = max(len(res[v]["cold"]) for v in res)
        t.add(f"{label} {n}: **cold** first result [s] (median of {reps})", cold,
              f"{num(cr, 3)} ({met(cr, 1.05)})", exclude=COLD_REPEATS)
        t.add(f"{label}: **warm**, new node [s]", warm,
              f"{num(wr, 3)} of cold ({met(wr, 0.05)})")
        if "acc-baked" in warm:
            br = ratio(warm["acc-baked"].value, base)
            summary[f"{wl}_warm_baked_ratio"] = br
            t.add(f"{label}: **warm**, new node, baked [s]", {"acc-baked": warm["acc-baked"]},
                  f"{num(br, 3)} of cold ({met(br, 0.01)})", best=False)
            bakes = [b for b in res["acc-baked"].get("bake_s", []) if b is not None]
            t.add(f"{label}: the bake between (`asyncclcache bake`) [s]",
                  {"acc-baked": Cell(median(bakes), num(median(bakes), 2))}, best=False)
        cpu = {v: cell(res[v]["cold"], lambda r: r["group_cpu_s"], 1) for v in res}
        cpur = ratio(cpu.get("acc", Cell(None)).value, cpu.get("nocache", Cell(None)).value)
        summary[f"{wl}_cold_cpu_ratio"] = cpur
        t.add(f"{label}: cold, CPU of all processes [s]", cpu, f"{num(cpur, 3)} ({met(cpur, 1.05)})",
              exclude=COLD_REPEATS)
        t.add(f"{label}: cold, the cache's own CPU (its threads and its share of callers') [s]",
              {v: cell(res[v]["cold"], lambda r: r["stats_final"]["main_thread_seconds"]
                       + r["stats_final"]["background_cpu_seconds"], 3)
               for v in res if v.startswith("acc")}, best=False)
        t.add(f"{label}: cold, kernel time of steps 2..N [s]",
              {v: cell(res[v]["cold"], lambda r: r["steps_s"], 3) for v in res}, exclude=COLD_REPEATS)
        t.add(f"{label}: background work left at first result (flush + close) [s]",
              {v: cell(res[v]["cold"], lambda r: r["flush_s"] + r["close_s"])
               for v in res if v.startswith("acc")}, best=False)
    return t


STALL_COLUMN = {  # stall case -> (column, window)
    "idle": "nocache",
    "pyopencl-thread-build": "pyopencl",
    "acc-after-build": "acc",
    "acc-thread-after-build": "acc-thread",
}


def stall_table(R: dict[str, Any], variants: list[str], summary: dict[str, Any]) -> Table:
    st = R.get("stall") or {}
    t = Table(variants, "acc")

    def runs(case: str, probe: str) -> list[dict[str, Any]]:
        return st.get(case, {}).get(probe, [])

    def key(k: str) -> Callable[[dict[str, Any]], Any]:
        return lambda r: r["window"][k]

    def row(probe: str, k: str, digits: int = 1) -> dict[str, Cell]:
        out = {col: cell(runs(case, probe), key(k), digits)
               for case, col in STALL_COLUMN.items() if runs(case, probe)}
        if "nocache" in out:
            out["nocache"].text += " (idle)"
        return out

    a_tick = cell(runs("acc-after-launch", "tick"), key("max_ms"), 1).value
    a_launch = cell(runs("acc-after-launch", "launch"), key("max_ms"), 1).value
    b_tick = cell(runs("acc-after-build", "tick"), key("max_ms"), 1).value
    b_launch = cell(runs("acc-after-build", "launch"), key("max_ms"), 1).value
    summary.update(stall_tick_ms=a_tick, stall_launch_ms=a_launch,
                   stall_tick_whole_ms=b_tick, stall_launch_whole_ms=b_launch)
    if a_tick is not None or a_launch is not None:
        t.add("longest main-loop gap, first launch until flush() [ms]",
              {"acc": Cell(a_tick, num(a_tick, 1))}, f"{num(a_tick, 1)} ({met(a_tick, 5)})")
        t.add("longest launch of a compiled kernel, first launch until flush() [ms]",
              {"acc": Cell(a_launch, num(a_launch, 1))},
              f"{num(a_launch, 1)} ({met(a_launch, 5)})")
    if not any(st.get(c) for c in STALL_COLUMN):
        return t
    t.add("longest main-loop gap, whole binary work [ms]", row("tick", "max_ms"),
          f"{num(b_tick, 1)} ({met(b_tick, 5)})", exclude=["nocache"])
    t.add("longest launch of a compiled kernel, whole binary work [ms]",
          row("launch", "max_ms"), f"{num(b_launch, 1)} ({met(b_launch, 5)})",
          exclude=["nocache"])
    over = {}
    for case, col in STALL_COLUMN.items():
        rs = runs(case, "launch")
        n, tot = median(vals(rs, key("over_5ms"))), median(vals(rs, key("launches")))
        if n is not None:
            over[col] = Cell(n, f"{n:.0f} of {tot:.0f}")
    t.add("launches over 5 ms, whole binary work", over, best=False)  # counts of unequal totals
    t.add("median launch [ms]", row("launch", "median_ms", 3), best=False)
    t.add("window: whole binary work (tick probe) [s]", row("tick", "window_s", 1), best=False)
    return t


def throughput_tables(R: dict[str, Any], variants: list[str], summary: dict[str, Any]) -> Table:
    t = Table(variants)
    for k in ("throughput_1", "throughput_2"):
        tp = R.get(k)
        if not tp or not any(tp.values()):
            continue
        first = next(r for rs in tp.values() for r in rs)
        procs, progs = first["ranks"], first["programs"]
        what = (f"{progs} programs, 1 process" if procs == 1
                else f"{progs} programs, {procs} processes at once")
        wall = {v: cell(tp[v], lambda r: r["wall_s"], 1) for v in tp}
        cpu = {v: cell(tp[v], lambda r: r["cpu_s"], 1) for v in tp}
        wr = ratio(wall.get("acc", Cell(None)).value, wall.get("nocache", Cell(None)).value)
        cr = ratio(cpu.get("acc", Cell(None)).value, cpu.get("nocache", Cell(None)).value)
        summary[f"{k}_wall_ratio"], summary[f"{k}_cpu_ratio"] = wr, cr
        reps = max(len(x) for x in tp.values())
        t.add(f"{what}: **wall** incl. exit [s] (median of {reps})", wall,
              f"{num(wr, 3)} ({met(wr, 1.05)})")
        t.add(f"{what}: CPU, all processes [s]", cpu, f"{num(cr, 3)} ({met(cr, 1.05)})")
        own = {v: cell(tp[v], lambda r: r["own_cpu_s"], 2) for v in tp if v.startswith("acc")}
        orr = ratio(own.get("acc", Cell(None)).value, cpu.get("nocache", Cell(None)).value)
        summary[f"{k}_own_cpu_ratio"] = orr
        t.add(f"{what}: the cache's own CPU (its threads and its share of callers') [s]", own,
              f"{num(orr, 4)} of no cache's CPU", best=False)
        t.add(f"{what}: entries written by exit",
              {v: Cell(None, cell(tp[v], lambda r: r["entries"], 0).text + f" / {progs}")
               for v in tp if v not in ("nocache", "default")}, best=False)
        if "acc-idle" in tp:
            iw = ratio(wall["acc-idle"].value, wall.get("nocache", Cell(None)).value)
            ic = ratio(cpu["acc-idle"].value, cpu.get("nocache", Cell(None)).value)
            summary[f"{k}_idle_wall_ratio"], summary[f"{k}_idle_cpu_ratio"] = iw, ic
            if procs > 1:  # as many processes as cores: no core is idle, baking must cost nothing
                note = f"{num(iw, 3)} / {num(ic, 3)} (≤ 1.02 / 1.05: {met(iw, 1.02)} / {met(ic, 1.05)})"
            else:  # an idle core: the baker's CPU is expected; the wall is compared with acc
                note = (f"{num(iw, 3)} / {num(ic, 3)}; wall vs acc "
                        f"{num(ratio(wall['acc-idle'].value, wall.get('acc', Cell(None)).value), 3)}")
            t.add(f"{what}: idle baking on, wall / CPU vs no cache", {"acc-idle": wall["acc-idle"]}, note,
                  best=False)
            t.add(f"{what}: entries baked by exit",
                  {"acc-idle": Cell(None, cell(tp["acc-idle"], lambda r: r.get("baked"), 0).text
                                    + f" / {progs}")}, best=False)
            t.add(f"{what}: exit (end of work to process exit) [s]",
                  {v: cell(tp[v], lambda r: r["exit_s"], 2) for v in tp}, best=False)
    return t


def ranks_table(R: dict[str, Any], summary: dict[str, Any]) -> Table | None:
    rk = R.get("ranks")
    if not rk or not rk.get("rows"):
        return None
    variants = [v for v in VARIANTS if any(v in row for row in rk["rows"].values())]
    t = Table(variants, "acc / shared vs no cache")
    for R_ in sorted(rk["rows"], key=int):
        row = rk["rows"][R_]

        def c(v: str, phase: str, k: str, digits: int = 2, row: dict = row) -> Cell:
            return cell((row.get(v) or {}).get(phase, []), lambda r: r[k], digits)

        cold = {v: c(v, "cold", "median") for v in variants}
        base = cold.get("nocache", Cell(None)).value
        ra = ratio(cold.get("acc", Cell(None)).value, base)
        rs = ratio(cold.get("acc-shared", Cell(None)).value, base)
        summary.setdefault("ranks_cold_ratio", {})[R_] = {"acc": ra, "acc-shared": rs}
        cpu = {v: c(v, "cold", "cpu_s", 1) for v in variants}
        summary.setdefault("ranks_cpu_ratio", {})[R_] = {
            v: ratio(cpu[v].value, cpu.get("nocache", Cell(None)).value) for v in cpu}
        t.add(f"R={R_}: **cold** per-rank first result, median [s]", cold,
              f"{num(ra)} / {num(rs)} ({met(max(ra or 0, rs or 0) or None, 1.1)})")
        t.add(f"R={R_}: cold, slowest rank [s]", {v: c(v, "cold", "max") for v in variants})
        cr = summary["ranks_cpu_ratio"][R_].get("acc")
        t.add(f"R={R_}: cold, CPU of all ranks and helpers [s]", cpu, f"{num(cr)} ({met(cr, 1.05)})")
        warm = {v: c(v, "warm", "median", 3) for v in variants if v != "nocache"}
        if "default" in warm:
            warm["default"].text += SAME_NODE
        t.add(f"R={R_}: **warm** per-rank, median [s]", warm)
        t.add(f"R={R_}: cold, the cache's own CPU over all ranks (helpers not included) [s]",
              {v: c(v, "cold", "own_cpu_s", 2) for v in variants if v.startswith("acc")}, best=False)
        if any("warmups" in one for v in variants for one in (row.get(v) or {}).get("cold", [])):
            # Older results: strategy process's generic compiles.
            wu = {v: c(v, "cold", "warmups", 0) for v in variants if v.startswith("acc")}
            t.add(f"R={R_}: warm-ups (generic compiles) over all ranks, cold", wu, best=False)
    return t


def every_rep_md(R: dict[str, Any]) -> str:
    """Every repetition's value of the main rows, so the spread is visible."""
    lines = []

    def fmt(xs: list[Any]) -> str:
        return ", ".join("fail" if x is None else f"{x:.3g}" for x in xs) or "—"

    def get(r: dict[str, Any], key: str) -> float | None:
        return None if r.get("error") else r.get(key)

    for wl in ("seed", "multi"):
        for v, d in (R.get(f"first_result_{wl}") or {}).items():
            cold = fmt([get(r, "first_result_s") for r in d["cold"]])
            warm = fmt([get(r, "first_result_s") for r in d["warm"]])
            lines.append(f"- {wl}, {HEAD[v]}: cold [{cold}] s; warm [{warm}] s")
    for case, probes in (R.get("stall") or {}).items():
        for probe, runs in probes.items():
            xs = [None if r.get("error") else (r.get("window") or {}).get("max_ms") for r in runs]
            lines.append(f"- stall {case} {probe}: max [{fmt(xs)}] ms")
    for k in ("throughput_1", "throughput_2"):
        for v, runs in (R.get(k) or {}).items():
            lines.append(f"- {k} {HEAD[v]}: wall [{fmt([r.get('wall_s') for r in runs])}] s, "
                         f"cpu [{fmt([r.get('cpu_s') for r in runs])}] s, entries "
                         f"[{', '.join(str(r.get('entries')) for r in runs)}]")
    for R_, row in sorted(((R.get("ranks") or {}).get("rows") or {}).items(),
                          key=lambda x: int(x[0])):
        for v, d in row.items():
            lines.append(f"- ranks R={R_} {HEAD[v]}: cold per-rank "
                         + " | ".join(fmt(r.get("per_rank") or []) for r in d["cold"])
                         + " s; warm median " + fmt([get(r, "median") for r in d["warm"]]) + " s")
    return "\n".join(lines)


# }}}


# {{{ report.md


def machine_md(m: dict[str, Any]) -> str:
    def load(x: Any) -> str:
        return "/".join(f"{v:.2f}" for v in x) if x else "?"

    rows = [
        ("CPU", f"{m.get('cpu')}: {m.get('cores')} cores (affinity {m.get('affinity')}), "
                f"{m.get('memory_gib')} GiB"),
        ("OS", f"{m.get('os')}, Linux {m.get('kernel')}"),
        ("OpenCL", f"{m.get('platform_name')}: {m.get('platform_version')}"),
        ("device", f"{m.get('device_name')} ({m.get('device_type')}, driver "
                   f"{m.get('driver_version')}, {m.get('compute_units')} compute units)"),
        ("Python", f"{m.get('python')} ({m.get('python_executable')})"),
        ("pyopencl / numpy", f"{m.get('pyopencl')} / {m.get('numpy')}"),
        ("asyncclcache", f"{m.get('asyncclcache')} (git {m.get('git', '?')})"),
        ("environment", ", ".join(f"{k}={v}" for k, v in (m.get("env") or {}).items()) or "—"),
        ("load average", f"start {load(m.get('loadavg_start'))}, end {load(m.get('loadavg_end'))}"),
    ]
    return "\n".join(f"- **{k}**: {v}" for k, v in rows)


def auto_md(R: dict[str, Any]) -> str:
    m = R.get("machine") or {}
    auto = m.get("auto_strategy")
    if not auto:
        return ""
    line = f"**Why `auto` picks `{auto}` on this driver:** {m.get('auto_reason')}."
    st = R.get("stall") or {}

    def worst(case: str) -> float | None:
        return median(vals(st.get(case, {}).get("launch", []), lambda r: r["window"]["max_ms"]))

    measured = [(name, worst(case)) for name, case in (
        ("`auto`", "acc-after-build"), ("`thread`", "acc-thread-after-build"),
        ("pyopencl's cache built in a thread", "pyopencl-thread-build"))]
    measured = [(n, x) for n, x in measured if x is not None]
    if measured:
        line += (" Measured here, longest launch of a compiled kernel while the binary work "
                 "runs: " + ", ".join(f"{n} {num(x, 1)} ms" for n, x in measured) + ".")
    used = {s for wl in ("seed", "multi")
            for r in ((R.get(f"first_result_{wl}") or {}).get("acc") or {}).get("cold", [])
            for s in r.get("strategies_used") or []}
    if used:
        line += f" The `acc (auto)` runs used: {', '.join(sorted(used))}."
    return line


def render(R: dict[str, Any], plots: list[str]) -> str:
    summary: dict[str, Any] = {}
    auto = (R.get("machine") or {}).get("auto_strategy")
    HEAD["acc"] = f"acc {auto} (auto)" if auto else "acc (auto)"
    used = [v for v in VARIANTS if v in set(R.get("variants_used") or [])]
    a = R.get("args") or {}
    md = [
        "# asyncclcache benchmarks" + (" (--quick)" if a.get("quick") else ""),
        "",
        f"`{R.get('command', 'asyncclcache bench')}`, started {R.get('started')}, "
        f"{(R.get('duration_s') or 0) / 60:.1f} min. Every measurement is a fresh process "
        "with a fresh driver kernel cache (a new node) unless marked; each cell is the median "
        "over repetitions, the lowest of a row in **bold**. Raw numbers: `report.json`; what "
        "each row measures: benchmarks/README.md.",
        "",
        "## Machine",
        "",
        machine_md(R.get("machine") or {}),
        "",
        auto_md(R),
        "",
    ]
    sections = [
        ("Time to the first result", first_result_table(R, used, summary),
         "Build, launch and check every kernel. Cold: empty caches. Warm: a new node "
         "(empty driver cache) that shares only the cache directory."),
        ("Main thread while the binary work runs", stall_table(R, used, summary),
         "Seed kernel. The longest gap in a Python loop (tick) and the longest launch of an "
         "already compiled small kernel (launch) while the background binary work runs; "
         "pyopencl cache: its `build()` in a thread. No cache: the same probes, idle."),
        ("Throughput", throughput_tables(R, used, summary),
         "Short-lived programs, each built, launched once and checked, process start to "
         "exit (asyncclcache's exit flush included). CPU includes helper processes: the "
         "generic compile is real work."),
    ]
    rt = ranks_table(R, summary)
    if rt:
        rk = R["ranks"]
        sections.append((
            "Ranks on one node", rt,
            f"R processes started together with `PMI_RANK` set (as `mpiexec` does), one per "
            f"core, each with its own empty driver cache; the seed kernel "
            f"(N={rk.get('n')}), {rk.get('reps')} repetition(s). "
            f"`POCL_MAX_PTHREAD_COUNT={rk.get('threads_per_rank')}` per rank."))
    for title, table, intro in sections:
        if not table.rows:
            continue
        md += [f"## {title}", "", intro, "", table.md(), ""]
    if R.get("nodes"):
        import nodes

        md += ["## Ranks on several nodes, one shared directory", "", nodes.__doc__.split("\n\n", 1)[1].strip(),
               "", nodes.table_md(R["nodes"]), ""]
    if R.get("sharedpocl"):
        import sharedpocl

        md += ["## Ranks sharing one pocl cache", "", sharedpocl.__doc__.split("\n\n", 1)[1].strip(), "",
               sharedpocl.table_md(R["sharedpocl"]), ""]
    if R.get("suite"):
        import suite

        md += ["## A test suite in CI (synthetic proxy)", "", suite.__doc__.split("\n\n", 1)[1].strip(), "",
               suite.table_md(R["suite"]), ""]
    if R.get("firsthit"):
        import firsthit

        md += ["## A first hit in a new process, against pocl's own folder",
               "", firsthit.__doc__.split("\n\n", 1)[1].strip(), "", firsthit.table_md(R["firsthit"]), ""]
    if R.get("cisuite"):
        import cisuite

        md += ["## CI on a real suite: pyopencl's own tests", "", cisuite.__doc__.split("\n\n", 1)[1].strip(),
               "", cisuite.table_md(R["cisuite"]), ""]
    md += ["Columns: " + "; ".join(f"**{HEAD[v]}**: {LEGEND[v]}"
                                   for v in VARIANTS if v in used or (v == "acc-shared" and rt))
           + ".", ""]
    if plots:
        md += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    md += ["## Every repetition", "", every_rep_md(R), ""]
    R["summary"] = summary
    return "\n".join(md)


# }}}


# {{{ plots


def plot(out: Path, R: dict[str, Any]) -> list[str]:
    """PNG plots, when matplotlib is installed (the ``plot`` extra); returns their paths."""
    for name in PLOTS:  # an earlier run's plot must not pass for this one's
        (out / f"{name}.png").unlink(missing_ok=True)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return []
    written: list[str] = []
    dev = (R.get("machine") or {}).get("device_name") or ""

    def save(fig: Any, name: str) -> None:
        fig.suptitle(dev, fontsize=9)
        fig.tight_layout()
        written.append(str(out / f"{name}.png"))
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    wls = [wl for wl in ("seed", "multi") if R.get(f"first_result_{wl}")]
    fr = {wl: R[f"first_result_{wl}"] for wl in wls}

    def med(runs: list[dict[str, Any]]) -> float | None:
        return median(vals(runs, lambda r: r["first_result_s"]))

    if wls:
        # 1. Cold time to the first result, by strategy.
        fig, axes = plt.subplots(1, len(wls), figsize=(5.5 * len(wls), 4), squeeze=False)
        for ax, wl in zip(axes[0], wls, strict=True):
            vs = [v for v in VARIANTS if v in fr[wl]]
            ys = [med(fr[wl][v]["cold"]) or 0 for v in vs]
            bars = ax.bar([HEAD[v] for v in vs], ys, color=[COLOR[v] for v in vs])
            ax.bar_label(bars, fmt="%.2f")
            ax.set_title(f"{wl}: cold, time to first result")
            ax.set_ylabel("seconds (lower is better)")
            ax.tick_params(axis="x", rotation=30)
        save(fig, "first_result")

        # 2. Cold vs warm, log scale (warm is 10-100x below cold).
        fig, axes = plt.subplots(1, len(wls), figsize=(5.5 * len(wls), 4), squeeze=False)
        for ax, wl in zip(axes[0], wls, strict=True):
            vs = [v for v in VARIANTS if v in fr[wl]]
            xs = range(len(vs))
            cold = [med(fr[wl][v]["cold"]) or 0 for v in vs]
            warm = [(med(fr[wl][v]["warm"]) or 0) if v != "nocache" else 0 for v in vs]
            b1 = ax.bar([x - 0.2 for x in xs], cold, 0.4, label="cold", color="C7")
            b2 = ax.bar([x + 0.2 for x in xs], warm, 0.4, label="warm (new node; driver "
                        "cache: same node)", color="C2")
            ax.bar_label(b1, fmt="%.2g", fontsize=7)
            ax.bar_label(b2, fmt="%.2g", fontsize=7)
            ax.set_yscale("log")
            ax.set_xticks(list(xs), [HEAD[v] for v in vs], rotation=30)
            ax.set_title(f"{wl}: cold vs warm")
            ax.set_ylabel("seconds, log scale")
            ax.legend(fontsize=7)
        save(fig, "cold_warm")

    rows = ((R.get("ranks") or {}).get("rows")) or {}
    if rows:
        # 3. Per-rank time to the first result vs rank count.
        Rs = sorted(rows, key=int)
        vs = [v for v in VARIANTS if any(v in rows[r] for r in Rs)]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        for v in vs:
            for ax, phase in ((a1, "cold"), (a2, "warm")):
                pts = [(int(r), median(vals((rows[r].get(v) or {}).get(phase, []),
                                            lambda x: x["median"]))) for r in Rs]
                pts = [(x, y) for x, y in pts if y is not None]
                if not pts:
                    continue
                if phase == "cold" or v != "nocache":
                    ax.plot(*zip(*pts, strict=True), marker="o", label=HEAD[v], color=COLOR[v])
                if phase == "cold" and v == "nocache":  # the scale for the warm panel
                    a2.plot(*zip(*pts, strict=True), ls="--", label="no cache (cold)",
                            color=COLOR[v])
        a1.set_title("cold: per-rank time to first result (median)")
        a2.set_title("warm (new node; driver cache: same node)")
        a2.set_yscale("log")
        a2.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        a2.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        for ax in (a1, a2):
            ax.set_xlabel("ranks (one per core)")
            ax.set_ylabel("seconds")
            ax.set_xticks([int(r) for r in Rs])
            ax.legend(fontsize=7)
        a1.set_ylim(bottom=0)
        save(fig, "ranks")
    return written


# }}}


def write(out: Path, R: dict[str, Any], *, plots: bool = True) -> str:
    """Write report.md, report.json and (unless ``plots=False``) the plots into *out*;
    return the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    pngs: list[str] = []
    try:
        pngs = plot(out, R) if plots else []
    except Exception as e:  # noqa: BLE001 - a plot must never cost the numbers
        print(f"plots skipped: {type(e).__name__}: {e}", file=sys.stderr)
    text = render(R, pngs)
    (out / "report.md").write_text(text)
    tmp = out / "report.json.tmp"
    tmp.write_text(json.dumps(R, indent=1, default=str))
    tmp.replace(out / "report.json")
    return text


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(sys.argv[1])
    R = json.loads((out / "report.json").read_text())
    write(out, R)
    print(f"written: {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
