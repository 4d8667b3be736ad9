#!/usr/bin/env python
"""asyncclcache benchmark suite: ``python benchmarks/run.py [--quick] [--out DIR]``.

Every measurement runs in a fresh child process (benchmarks/child.py) with a fresh
``POCL_CACHE_DIR``, a fresh ``XDG_CACHE_HOME`` and its own cache directory. The
variants of one row run side by side in the same invocation, interleaved across
repetitions. Writes ``results.md`` (the table) and ``results.json`` (raw numbers)
to ``--out`` (default benchmarks/out/) and prints the table. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CHILD = HERE / "child.py"

VARIANTS = ["nocache", "pyopencl", "acc", "acc-sync", "acc-thread"]
HEAD = {
    "nocache": "no cache",
    "pyopencl": "pyopencl cache",
    "acc": "acc (auto=process)",
    "acc-sync": "acc sync",
    "acc-thread": "acc thread",
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _cpu(ru: resource.struct_rusage) -> float:
    return ru.ru_utime + ru.ru_stime


def _become_subreaper() -> bool:
    """Orphans of our children (asyncclcache's helper) get reparented to us, so we can
    wait for them and count their CPU time. Linux only; harmless elsewhere."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def _median(xs: Iterable[float | None]) -> float | None:
    v = [x for x in xs if x is not None]
    return statistics.median(v) if v else None


class Runner:
    """Starts children with fresh directories, times them, collects their JSON."""

    def __init__(self, work: Path, logs: Path, python: str) -> None:
        self.work = work
        self.logs = logs
        self.python = python
        self.n = 0
        self.subreaper = _become_subreaper()

    def fresh(self, name: str) -> str:
        self.n += 1
        d = self.work / f"{self.n:04d}-{name}"
        d.mkdir(parents=True)
        return str(d)

    def env(self, variant: str | None) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("ASYNCCLCACHE_", "PYOPENCL_"))
            and k not in ("POCL_CACHE_DIR", "XDG_CACHE_HOME")
        }
        if "PYOPENCL_CTX" in os.environ:
            env["PYOPENCL_CTX"] = os.environ["PYOPENCL_CTX"]
        env["POCL_CACHE_DIR"] = self.fresh("pocl")  # a fresh node: pocl's cache is empty
        env["XDG_CACHE_HOME"] = self.fresh("xdg")  # pyopencl's invoker cache, too
        if variant == "nocache":
            env["PYOPENCL_NO_CACHE"] = "1"
        src = str(REPO / "src")
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        return env

    def run(self, specs: list[dict[str, Any]], timeout: float = 900) -> list[dict[str, Any]]:
        """Start every spec at once (usually one), wait for all and for their orphans.

        Each result has the child's JSON plus ``wall_s`` (start to exit, interpreter
        exit included), ``rc`` and ``cpu_s``. The group's ``group_cpu_s`` (children and
        every descendant, asyncclcache's helper included) is on the first result.
        """
        ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = []
        for given in specs:
            self.n += 1
            tag = f"{self.n:04d}-{given['task']}-{given.get('variant')}"
            spec = dict(given, out=str(self.work / f"{tag}.json"))
            env = spec.pop("_env")
            spec_path = self.work / f"{tag}.spec.json"
            spec_path.write_text(json.dumps(spec))
            logf = open(self.logs / f"{tag}.log", "wb")  # noqa: SIM115 - closed below
            t0 = time.perf_counter()
            proc = subprocess.Popen(
                [self.python, str(CHILD), str(spec_path)],
                env=env,
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, helper included
                cwd=str(HERE),
            )
            started.append((spec, proc, t0, logf, tag))
        done: dict[int, tuple[int, resource.struct_rusage, float]] = {}

        def wait(proc: subprocess.Popen[bytes]) -> None:
            _pid, status, ru = os.wait4(proc.pid, 0)
            done[proc.pid] = (status, ru, time.perf_counter())
            proc.returncode = os.waitstatus_to_exitcode(status)

        killers = []
        threads = []
        for _spec, proc, _t0, _f, _tag in started:
            k = threading.Timer(timeout, self._kill_group, args=(proc.pid,))
            k.start()
            killers.append(k)
            th = threading.Thread(target=wait, args=(proc,))
            th.start()
            threads.append(th)
        for th in threads:
            th.join()
        for k in killers:
            k.cancel()
        self._reap_orphans([p.pid for _s, p, _t, _f, _tag in started])
        ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        results = []
        for spec, proc, t0, logf, tag in started:
            logf.close()
            status, ru, t_end = done[proc.pid]
            rc = os.waitstatus_to_exitcode(status)
            r: dict[str, Any] = {}
            try:
                r = json.loads(Path(spec["out"]).read_text())
            except (OSError, ValueError):
                r = {"error": "no result"}
            final = Path(spec["out"] + ".final")
            if final.exists():
                r["final"] = json.loads(final.read_text())
            if rc != 0:
                tail = (self.logs / f"{tag}.log").read_text(errors="replace")[-1500:]
                r["error"] = f"exit status {rc}" + (" (killed: timeout)" if rc == -9 else "")
                r["log_tail"] = tail
                log(f"  !! {tag}: {r['error']}; log tail:\n{tail[-600:]}")
            r.update(rc=rc, wall_s=t_end - t0, cpu_s=_cpu(ru), tag=tag)
            results.append(r)
        results[0]["group_cpu_s"] = _cpu(ru1) - _cpu(ru0)
        return results

    @staticmethod
    def _kill_group(pgid: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)

    def _reap_orphans(self, groups: list[int], limit: float = 20.0) -> None:
        """Wait for descendants that outlived their parent (e.g. a helper process)."""
        if not self.subreaper:
            return
        deadline = time.monotonic() + limit
        while True:
            try:
                pid, _status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid:
                continue
            if time.monotonic() > deadline:
                log("  !! orphans still running after the child exited; killing their groups")
                for g in groups:
                    self._kill_group(g)
                deadline = time.monotonic() + 5
            time.sleep(0.02)


# {{{ machine


def describe(runner: Runner) -> dict[str, Any]:
    info: dict[str, Any] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        info["cpu"] = platform.processor()
    info["cores"] = os.cpu_count()
    with contextlib.suppress(AttributeError):
        info["affinity"] = len(os.sched_getaffinity(0))
    try:
        mem = Path("/proc/meminfo").read_text().split("\n")[0].split()[1]
        info["memory_gib"] = round(int(mem) / 2**20, 1)
    except (OSError, IndexError, ValueError):
        pass
    try:
        text = Path("/etc/os-release").read_text()
        osr = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
        info["os"] = osr.get("PRETTY_NAME", "").strip('"')
    except OSError:
        pass
    info["kernel"] = platform.release()
    if shutil.which("clinfo"):
        try:
            out = subprocess.run(
                ["clinfo"], capture_output=True, text=True, timeout=60, check=False
            ).stdout
            for line in out.splitlines():
                s = line.strip()
                if s.startswith("Platform Version"):
                    info["clinfo_platform_version"] = s.split(None, 2)[2].strip()
                    break
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        sha = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=False,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--", "src"],
            capture_output=True, text=True, check=False,
        ).stdout.strip()
        info["git"] = sha + (" (+ local changes in src/)" if dirty else "")
    except OSError:
        pass
    r = runner.run([{"task": "describe", "_env": runner.env(None)}], timeout=120)[0]
    for k in (
        "platform_name", "platform_version", "device_name", "driver_version", "compute_units",
        "pyopencl", "numpy", "python", "asyncclcache", "asyncclcache_path",
    ):
        info[k] = r.get(k)
    info["python_executable"] = runner.python
    info["loadavg_start"] = os.getloadavg()
    return info


def machine_md(m: dict[str, Any]) -> str:
    rows = [
        ("CPU", f"{m.get('cpu')} — {m.get('cores')} cores (affinity {m.get('affinity')}), "
                f"{m.get('memory_gib')} GiB"),
        ("OS", f"{m.get('os')}, Linux {m.get('kernel')}"),
        ("OpenCL", f"{m.get('platform_name')}: {m.get('platform_version')}"),
        ("device", f"{m.get('device_name')} (driver {m.get('driver_version')}, "
                   f"{m.get('compute_units')} CUs)"),
        ("clinfo", m.get("clinfo_platform_version", "n/a")),
        ("Python", f"{m.get('python')} ({m.get('python_executable')})"),
        ("pyopencl / numpy", f"{m.get('pyopencl')} / {m.get('numpy')}"),
        ("asyncclcache", f"{m.get('asyncclcache')} at {m.get('asyncclcache_path')} "
                         f"(git {m.get('git', '?')})"),
        ("load average", f"start {fmt_load(m.get('loadavg_start'))}, "
                         f"end {fmt_load(m.get('loadavg_end'))}"),
    ]
    return "\n".join(f"- **{k}**: {v}" for k, v in rows)


def fmt_load(x: Any) -> str:
    return "/".join(f"{v:.2f}" for v in x) if x else "?"


# }}}


# {{{ measurements


def measure_first_result(
    runner: Runner, workload: str, variants: list[str], reps: int, extra_reps: int
) -> dict[str, Any]:
    """Cold (fresh pocl cache, empty cache dir) then warm (fresh pocl cache, the cold
    run's cache dir) time to the first correct result, per variant and repetition."""
    res: dict[str, Any] = {v: {"cold": [], "warm": []} for v in variants}
    for rep in range(reps):
        # Rotate the order so drifting background load does not favour one variant.
        order = variants[rep % len(variants):] + variants[: rep % len(variants)]
        for v in order:
            if rep >= extra_reps and v in ("acc-sync", "acc-thread"):
                continue
            spec: dict[str, Any] = {"task": "first_result", "variant": v, "workload": workload}
            if v.startswith("acc"):
                spec["acc_dir"] = runner.fresh(f"{v}-cache")
            if v == "pyopencl":
                spec["pyopencl_dir"] = runner.fresh("pyopencl-cache")
            cold = runner.run([dict(spec, _env=runner.env(v))])[0]
            res[v]["cold"].append(cold)
            msg = f"{workload} rep {rep + 1}/{reps} {v:10s} cold {_s(cold.get('first_result_s'))}"
            if v.startswith("acc") and "flush_s" in cold:
                msg += (f" (then flush {cold['flush_s']:.2f} s, close {cold['close_s']:.2f} s,"
                        f" {cold.get('entries')} entries)")
            if v != "nocache" and "error" not in cold:
                warm = runner.run([dict(spec, _env=runner.env(v))])[0]
                res[v]["warm"].append(warm)
                msg += f"; warm {_s(warm.get('first_result_s'))}"
                if warm.get("stats_timed"):
                    msg += f" ({warm['stats_timed']['hits']} hits)"
                elif warm.get("build_descr"):
                    msg += f" ({warm['build_descr']})"
            log(msg)
    return res


#: Length of the idle reference window: about as long as acc's whole-work launch window,
#: since the longest of N launches grows with N on a noisy machine.
IDLE_S = 10.0

STALL_CASES = [
    # (name, variant, window)
    ("idle", "nocache", "idle"),
    ("acc-after-launch", "acc", "after_launch"),
    ("acc-after-build", "acc", "after_build"),
    ("pyopencl-thread-build", "pyopencl", "thread_build"),
    ("acc-thread-after-build", "acc-thread", "after_build"),
]


def measure_stall(runner: Runner, cases: list[str], reps: int) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for rep in range(reps):
        for name, v, window in STALL_CASES:
            if name not in cases:
                continue
            for probe in ("tick", "launch"):
                spec: dict[str, Any] = {"task": "stall", "variant": v, "window": window,
                                        "probe": probe, "idle_s": IDLE_S}
                if v.startswith("acc"):
                    spec["acc_dir"] = runner.fresh(f"{v}-cache")
                if v == "pyopencl":
                    spec["pyopencl_dir"] = runner.fresh("pyopencl-cache")
                r = runner.run([dict(spec, _env=runner.env(v))], timeout=300)[0]
                res.setdefault(name, {}).setdefault(probe, []).append(r)
                w = r.get("window") or {}
                log(f"stall rep {rep + 1}/{reps} {name:24s} {probe:6s} "
                    f"window {_s(w.get('window_s'))}: max {_ms(w.get('max_ms'))}"
                    + (f", median launch {_ms(w.get('median_ms'))}" if probe == "launch" else "")
                    + f" (baseline max {_ms((r.get('baseline') or {}).get('max_ms'))})")
    return res


def measure_throughput(
    runner: Runner, variants: list[str], programs: int, ranks: int, reps: int,
    max_reps: dict[str, int] | None = None,
) -> dict[str, Any]:
    """``programs`` short-lived programs split over ``ranks`` concurrent processes."""
    res: dict[str, Any] = {v: [] for v in variants}
    per = programs // ranks
    for rep in range(reps):
        order = variants[rep % len(variants):] + variants[: rep % len(variants)]
        for v in order:
            if rep >= (max_reps or {}).get(v, reps):
                continue
            specs = []
            for r in range(ranks):
                spec: dict[str, Any] = {
                    "task": "throughput", "variant": v,
                    "workload_args": {"programs": per, "start": r * per},
                }
                if v.startswith("acc"):
                    spec["acc_dir"] = runner.fresh(f"{v}-cache")
                if v == "pyopencl":
                    spec["pyopencl_dir"] = runner.fresh("pyopencl-cache")
                specs.append(dict(spec, _env=runner.env(v)))
            t0 = time.perf_counter()
            rs = runner.run(specs, timeout=1200)
            wall = time.perf_counter() - t0
            entries = None
            if v.startswith("acc"):
                entries = sum((r.get("final") or {}).get("entries") or 0 for r in rs)
            elif v == "pyopencl":
                entries = programs
            one = {
                "wall_s": max(r["wall_s"] for r in rs),
                # in the slowest process: its own work, and end of work -> process exit
                "work_s": max((r.get("work_s") or 0.0) for r in rs),
                "exit_s": max(r["wall_s"] - (r.get("end_of_work_s") or r["wall_s"]) for r in rs),
                "background_errors": sum(
                    ((r.get("final") or {}).get("stats") or {}).get("errors", 0) for r in rs),
                "group_wall_s": wall,
                "cpu_s": rs[0]["group_cpu_s"],
                "entries": entries,
                "programs": programs,
                "ranks": ranks,
                "children": rs,
                "error": next((r["error"] for r in rs if "error" in r), None),
            }
            res[v].append(one)
            work = max((r.get("work_s") or 0) for r in rs)
            log(f"throughput {ranks}x{per} rep {rep + 1}/{reps} {v:10s} wall {_s(one['wall_s'])} "
                f"(work {_s(work)}), cpu {_s(one['cpu_s'])}, entries {entries}")
    return res


# }}}


# {{{ report


def _s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f} s"


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f} ms"


def _num(x: float | None, digits: int = 2) -> str:
    if x is None:
        return "—"
    if abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:.{digits}f}"


def _vals(runs: list[dict[str, Any]], get: Callable[[dict[str, Any]], float | None]) -> list:
    out = []
    for r in runs:
        if r.get("error"):
            continue
        with contextlib.suppress(KeyError, TypeError):
            out.append(get(r))
    return out


def _cell(runs: list[dict[str, Any]], get: Callable[[dict[str, Any]], Any], digits: int = 2) -> str:
    if not runs:
        return "—"
    errors = [r["error"] for r in runs if r.get("error")]
    m = _median(_vals(runs, get))
    if m is None:
        return "crash" if errors else "—"
    s = _num(m, digits)
    if errors:
        s += f" ({len(errors)}/{len(runs)} failed)"
    return s


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _met(value: float | None, target: float) -> str:
    if value is None:
        return "?"
    return "yes" if value <= target else "**no**"


class Table:
    def __init__(self, variants: list[str]) -> None:
        self.variants = variants
        self.rows: list[list[str]] = []
        self.targets: list[dict[str, Any]] = []

    def add(self, label: str, cells: dict[str, str], ratio: str = "", target: str = "",
            met: str = "") -> None:
        self.rows.append([label] + [cells.get(v, "—") for v in self.variants]
                         + [ratio, target, met])

    def md(self) -> str:
        head = ["measurement"] + [HEAD[v] for v in self.variants] + ["acc ratio", "target", "met"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in self.rows]
        return "\n".join(lines)


def build_table(R: dict[str, Any], variants: list[str]) -> tuple[Table, dict[str, Any]]:
    t = Table(variants)
    summary: dict[str, Any] = {}

    def fr(r: dict[str, Any]) -> float:
        return r["first_result_s"]

    for wl, label in (("seed", "seed (N=1000)"), ("multi", "multi-program")):
        res = R.get(f"first_result_{wl}")
        if not res:
            continue
        cold = {v: _median(_vals(res[v]["cold"], fr)) for v in res}
        warm = {v: _median(_vals(res[v]["warm"], fr)) for v in res}
        base = cold.get("nocache")
        cold_ratio = cold["acc"] / base if base and cold.get("acc") else None
        warm_ratio = warm["acc"] / base if base and warm.get("acc") else None
        summary[f"{wl}_cold_ratio"] = cold_ratio
        summary[f"{wl}_warm_ratio"] = warm_ratio
        n = max(len(res[v]["cold"]) for v in res)
        t.add(f"1 {label}: cold first result [s] (median of {n})",
              {v: _cell(res[v]["cold"], fr) for v in res},
              f"acc/no-cache {_num(cold_ratio, 3)}", "≤ 1.05", _met(cold_ratio, 1.05))
        t.add(f"1 {label}: warm first result, new node [s]",
              {v: _cell(res[v]["warm"], fr, 3) for v in res if v != "nocache"}
              | {"nocache": "(= cold)"})
        t.add(f"1 {label}: warm / no-cache cold",
              {v: _num(warm[v] / base, 3) for v in res if v != "nocache" and warm.get(v) and base},
              f"{_num(warm_ratio, 3)}", "≤ 0.05", _met(warm_ratio, 0.05))
        t.add(f"1 {label}: untimed background work after it (flush + close) [s]",
              {v: _cell(res[v]["cold"], lambda r: r["flush_s"] + r["close_s"])
               for v in res if v.startswith("acc")})

    st = R.get("stall")
    if st:
        def w(name: str, probe: str, key: str = "max_ms", digits: int = 1) -> str:
            runs = st.get(name, {}).get(probe, [])
            return _cell(runs, lambda r: r["window"][key], digits)

        def wv(name: str, probe: str, key: str = "max_ms") -> float | None:
            runs = st.get(name, {}).get(probe, [])
            return _median(_vals(runs, lambda r: r["window"][key]))

        def base(name: str, probe: str) -> str:
            runs = st.get(name, {}).get(probe, [])
            return _cell(runs, lambda r: r["baseline"]["max_ms"], 1) if runs else "n/a"

        def idle(probe: str) -> str:
            cell = w("idle", probe)
            return cell if cell == "—" else cell + f" (idle {IDLE_S:.0f} s)"

        a_tick = wv("acc-after-launch", "tick")
        a_launch = wv("acc-after-launch", "launch")
        b_tick = wv("acc-after-build", "tick")
        b_launch = wv("acc-after-build", "launch")
        summary.update(stall_tick_ms=a_tick, stall_launch_ms=a_launch,
                       stall_tick_whole_ms=b_tick, stall_launch_whole_ms=b_launch)
        t.add("2a longest main-loop gap, after first launch until flush() [ms]",
              {"nocache": idle("tick"), "acc": w("acc-after-launch", "tick")},
              _num(a_tick, 1), "≤ 5", _met(a_tick, 5))
        t.add("2a longest main-loop gap, whole binary work [ms]",
              {"pyopencl": w("pyopencl-thread-build", "tick") + " (build in a thread)",
               "acc": w("acc-after-build", "tick"),
               "acc-thread": w("acc-thread-after-build", "tick")},
              _num(b_tick, 1), "≤ 5", _met(b_tick, 5))
        t.add("2b longest launch of a compiled small kernel, after first launch until flush() [ms]",
              {"nocache": idle("launch"),
               "acc": w("acc-after-launch", "launch")},
              _num(a_launch, 1), "≤ 5", _met(a_launch, 5))
        t.add("2b longest launch of a compiled small kernel, whole binary work [ms]",
              {"pyopencl": w("pyopencl-thread-build", "launch") + " (build in a thread)",
               "acc": w("acc-after-build", "launch"),
               "acc-thread": w("acc-thread-after-build", "launch")},
              _num(b_launch, 1), "≤ 5", _met(b_launch, 5))
        def over(name: str) -> str:
            runs = st.get(name, {}).get("launch", [])
            n = _median(_vals(runs, lambda r: r["window"]["over_5ms"]))
            tot = _median(_vals(runs, lambda r: r["window"]["launches"]))
            return "—" if n is None else f"{n:.0f} of {tot:.0f}"

        t.add("2b launches over 5 ms, whole binary work (idle: same probe, no background work)",
              {"nocache": over("idle"), "pyopencl": over("pyopencl-thread-build"),
               "acc": over("acc-after-build"), "acc-thread": over("acc-thread-after-build")})
        t.add("2b median launch, whole binary work [ms]",
              {"nocache": w("idle", "launch", "median_ms", 3),
               "pyopencl": w("pyopencl-thread-build", "launch", "median_ms", 3),
               "acc": w("acc-after-build", "launch", "median_ms", 3),
               "acc-thread": w("acc-thread-after-build", "launch", "median_ms", 3)})
        t.add("2 same probes before any background work: max gap / max launch [ms]",
              {"nocache": base("idle", "tick") + " / " + base("idle", "launch"),
               "pyopencl": base("pyopencl-thread-build", "tick") + " / "
               + base("pyopencl-thread-build", "launch"),
               "acc": base("acc-after-build", "tick") + " / " + base("acc-after-build", "launch"),
               "acc-thread": base("acc-thread-after-build", "tick") + " / "
               + base("acc-thread-after-build", "launch")})
        t.add("2 window length: after first launch / whole work, tick probe [s]",
              {"acc": w("acc-after-launch", "tick", "window_s") + " / "
               + w("acc-after-build", "tick", "window_s"),
               "pyopencl": "— / " + w("pyopencl-thread-build", "tick", "window_s"),
               "acc-thread": "— / " + w("acc-thread-after-build", "tick", "window_s")})

    for key in ("throughput_1", "throughput_2"):
        tp = R.get(key)
        if not tp:
            continue
        any_runs = next(iter(tp.values()))
        if not any_runs:
            continue
        ranks, progs = any_runs[0]["ranks"], any_runs[0]["programs"]
        what = (f"{progs} programs, 1 process" if ranks == 1
                else f"{progs} programs, {ranks} concurrent processes (no idle core)")
        walls = {v: _median(_vals(tp[v], lambda r: r["wall_s"])) for v in tp}
        cpus = {v: _median(_vals(tp[v], lambda r: r["cpu_s"])) for v in tp}
        ratio = _ratio(walls.get("acc"), walls.get("nocache"))
        cratio = _ratio(cpus.get("acc"), cpus.get("nocache"))
        summary[f"{key}_wall_ratio"] = ratio
        summary[f"{key}_cpu_ratio"] = cratio
        n = max(len(x) for x in tp.values())
        t.add(f"3 {what}: wall incl. exit [s] (median of {n})",
              {v: _cell(tp[v], lambda r: r["wall_s"], 1) for v in tp},
              f"acc/no-cache {_num(ratio, 3)}", "≤ 1.05", _met(ratio, 1.05))
        t.add(f"3 {what}: CPU user+sys, all processes [s]",
              {v: _cell(tp[v], lambda r: r["cpu_s"], 1) for v in tp},
              f"acc/no-cache {_num(cratio, 3)}")
        t.add(f"3 {what}: of which: program work / end of work to exit [s]",
              {v: _cell(tp[v], lambda r: r["work_s"], 1) + " / "
               + _cell(tp[v], lambda r: r["exit_s"], 1) for v in tp})
        t.add(f"3 {what}: entries written by exit",
              {v: _cell(tp[v], lambda r: r["entries"], 0) + f" / {progs}"
               for v in tp if v != "nocache"})
    return t, summary


def details_md(R: dict[str, Any]) -> str:
    """Every repetition's value of the main rows, so the spread is visible."""
    lines = []

    def fmt(xs: list[Any]) -> str:
        return ", ".join("fail" if x is None else f"{x:.3g}" for x in xs) or "—"

    def get(r: dict[str, Any], key: str) -> float | None:
        return None if r.get("error") else r.get(key)

    for wl in ("seed", "multi"):
        res = R.get(f"first_result_{wl}")
        if not res:
            continue
        for v, d in res.items():
            cold = fmt([get(r, "first_result_s") for r in d["cold"]])
            warm = fmt([get(r, "first_result_s") for r in d["warm"]])
            lines.append(f"- {wl} {HEAD[v]}: cold [{cold}] s; warm [{warm}] s")
    st = R.get("stall") or {}
    for name, probes in st.items():
        for probe, runs in probes.items():
            xs = [None if r.get("error") else (r.get("window") or {}).get("max_ms") for r in runs]
            lines.append(f"- stall {name} {probe}: max [{fmt(xs)}] ms")
    for key in ("throughput_1", "throughput_2"):
        for v, runs in (R.get(key) or {}).items():
            entries = ", ".join(str(r["entries"]) for r in runs)
            errors = ", ".join(str(r.get("background_errors")) for r in runs)
            lines.append(f"- {key} {HEAD[v]}: wall [{fmt([r['wall_s'] for r in runs])}] s, "
                         f"cpu [{fmt([r['cpu_s'] for r in runs])}] s, entries [{entries}], "
                         f"stats.errors at exit [{errors}]")
    return "\n".join(lines)


def write_report(out: Path, R: dict[str, Any], args: argparse.Namespace) -> str:
    variants = [v for v in VARIANTS if v in args.variants_used]
    table, summary = build_table(R, variants)
    R["summary"] = summary
    md = [
        "# asyncclcache benchmarks" + (" (--quick)" if args.quick else ""),
        "",
        f"Run {R['started']}, {R.get('duration_s', 0) / 60:.1f} min. "
        "Each number is the median over repetitions; every measurement is a fresh process "
        "with a fresh POCL_CACHE_DIR. Raw numbers: results.json. Rows: benchmarks/README.md.",
        "",
        "## Machine",
        "",
        machine_md(R["machine"]),
        "",
        "## Results",
        "",
        table.md(),
        "",
        "## Every repetition",
        "",
        details_md(R),
        "",
    ]
    text = "\n".join(md)
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps(R, indent=1, default=str))
    return text


# }}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 repetition, fewer variants (3-5 min)")
    ap.add_argument("--out", default=str(HERE / "out"), help="output directory")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 3, quick 1)")
    ap.add_argument("--only", default="first,stall,throughput",
                    help="comma-separated subset of: seed, multi, stall, throughput "
                         "('first' = seed,multi)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directories")
    ap.add_argument("--python", default=sys.executable, help="interpreter for the children")
    args = ap.parse_args()

    reps = args.reps or (1 if args.quick else 3)
    only = set(args.only.replace("first", "seed,multi").split(","))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    if logs.exists():
        shutil.rmtree(logs)
    logs.mkdir()
    work = Path(tempfile.mkdtemp(prefix="acc-bench-"))
    runner = Runner(work, logs, args.python)
    args.variants_used = set()
    R: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "args": {"quick": args.quick, "reps": reps, "only": sorted(only)},
    }
    t_start = time.perf_counter()
    try:
        R["machine"] = describe(runner)
        log(f"machine: {R['machine'].get('cpu')}, {R['machine'].get('cores')} cores, "
            f"{R['machine'].get('platform_version')}, pyopencl {R['machine'].get('pyopencl')}")
        full = not args.quick
        if "seed" in only:
            v = VARIANTS if full else ["nocache", "pyopencl", "acc"]
            args.variants_used |= set(v)
            R["first_result_seed"] = measure_first_result(runner, "seed", v, reps, reps)
            write_report(out, R, args)
        if "multi" in only:
            v = VARIANTS if full else ["nocache", "pyopencl", "acc"]
            args.variants_used |= set(v)
            R["first_result_multi"] = measure_first_result(runner, "multi", v, reps, 1)
            write_report(out, R, args)
        if "stall" in only:
            cases = [c[0] for c in STALL_CASES]
            if not full:
                cases = ["acc-after-launch", "acc-after-build", "pyopencl-thread-build"]
            args.variants_used |= {c[1] for c in STALL_CASES if c[0] in cases}
            R["stall"] = measure_stall(runner, cases, min(reps, 2))
            write_report(out, R, args)
        if "throughput" in only:
            v = ["nocache", "pyopencl", "acc"] if full else ["nocache", "acc"]
            args.variants_used |= set(v)
            tp_reps = min(reps, 2)
            R["throughput_1"] = measure_throughput(runner, v, 200, 1, tp_reps, {"pyopencl": 1})
            write_report(out, R, args)
            if full:
                R["throughput_2"] = measure_throughput(runner, ["nocache", "acc"], 200, 2, tp_reps)
    finally:
        R["duration_s"] = time.perf_counter() - t_start
        if "machine" in R:
            R["machine"]["loadavg_end"] = os.getloadavg()
            text = write_report(out, R, args)
            print()
            print(text)
            print(f"written: {out / 'results.md'}, {out / 'results.json'}, logs in {logs}")
        if args.keep:
            print(f"scratch directories kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
