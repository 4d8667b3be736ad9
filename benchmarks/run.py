#!/usr/bin/env python
"""asyncclcache benchmarks: ``asyncclcache bench [--quick] [--out DIR]``
(or ``python benchmarks/run.py ...``).

Every measurement runs in a fresh child process (benchmarks/child.py) with a fresh
driver kernel cache (``POCL_CACHE_DIR``, ``CUDA_CACHE_PATH``: a new node), a fresh
``XDG_CACHE_HOME`` and its own cache directory. The variants of one row run side by
side in the same invocation, interleaved across repetitions. Sections: seed, multi
(time to the first result, cold and warm), stall (the main thread while the binary
work runs), throughput (many short-lived programs), ranks (R processes at once), nodes
(R ranks on N simulated nodes sharing one directory: opens, entries, bytes; nodes.py).
Writes ``report.md``, ``report.json`` and, with matplotlib (the ``plot`` extra), PNG
plots to ``--out`` (default benchmarks/out/); the numbers are rewritten after every
section, the plots drawn at the end (or at Ctrl-C).
See benchmarks/README.md.
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
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
NODE_RANKS = [4, 16, 64]
REPO = HERE.parent
CHILD = HERE / "child.py"

sys.path.insert(0, str(HERE))
import report  # noqa: E402

#: Single-process variants (report.VARIANTS has them all).
VARIANTS = ["nocache", "default", "pyopencl", "pyopencl-spec0", "acc", "acc-baked", "acc-thread"]
QUICK_VARIANTS = ["nocache", "acc", "acc-baked"]
RANK_VARIANTS = ["nocache", "default", "pyopencl", "acc", "acc-shared"]
SECTIONS = ["seed", "multi", "stall", "throughput", "ranks", "nodes", "sharedpocl", "suite", "cisuite", "firsthit"]

#: Seconds each section took on 2 cores (pocl 3.1): (quick, full at 3 repetitions). What the
#: bench announces before it starts, where this --out has no earlier run of its own
#: (report.json's "section_s", which it prefers).
SECTION_S = {"seed": (25, 240), "multi": (0, 300), "stall": (24, 120), "throughput": (26, 300),
             "ranks": (19, 270), "nodes": (38, 900), "sharedpocl": (32, 300), "suite": (15, 200),
             "cisuite": (61, 2640), "firsthit": (8, 25)}
#: Sections whose full length grows with --reps (the others cap their repetitions).
_BY_REPS = {"seed", "multi", "sharedpocl", "suite", "cisuite"}


def estimate(sections: list[str], quick: bool, reps: int, out: Path) -> tuple[float, str]:
    """Seconds the run will take, and where the figure comes from."""
    last: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        prev = json.loads((out / "report.json").read_text())
        if prev.get("args", {}).get("quick") == quick and isinstance(prev.get("section_s"), dict):
            last = {k: (v, prev["args"].get("reps", 3)) for k, v in prev["section_s"].items()}
    total, mine = 0.0, 0
    for sec in sections:
        if sec in last:
            seconds, their_reps = last[sec]
            mine += 1
        else:
            seconds, their_reps = SECTION_S[sec][0 if quick else 1], 1 if quick else 3
        total += seconds * (reps / max(1, their_reps) if sec in _BY_REPS and not quick else 1)
    where = ("this machine's last run" if mine == len(sections) else
             "2-core figures" if not mine else "this machine's last run and 2-core figures")
    return total, where


class Progress:
    """Progress lines: elapsed time, section k/n, and the measurement."""

    def __init__(self, sections: list[str]) -> None:
        self.t0 = time.perf_counter()
        self.sections = sections
        self.current = ""
        self.seconds: dict[str, float] = {}  # each section's, so far
        self._since = self.t0

    def section(self, name: str) -> None:
        """``name`` starts (or, the current one again: its seconds are brought up to date)."""
        now = time.perf_counter()
        if name != self.current:
            self._since = now
            self.current = name
        if name:
            self.seconds[name] = round(now - self._since, 1)

    def __call__(self, msg: str) -> None:
        el = int(time.perf_counter() - self.t0)
        k = self.sections.index(self.current) + 1 if self.current in self.sections else 0
        where = f"{k}/{len(self.sections)} {self.current}" if k else ""
        print(f"[{el // 60:02d}:{el % 60:02d} {where}] {msg}", flush=True)


log = Progress([])


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


def _s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f} s"


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f} ms"


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

    def node(self) -> dict[str, str]:
        """A new node: empty driver kernel caches and an empty pyopencl invoker cache."""
        d = self.fresh("node")
        return {"POCL_CACHE_DIR": f"{d}/pocl", "CUDA_CACHE_PATH": f"{d}/cuda",
                "MESA_SHADER_CACHE_DIR": f"{d}/mesa", "XDG_CACHE_HOME": f"{d}/xdg",
                # the node's own storage (copies, compile records), not the machine's /tmp one
                "ASYNCCLCACHE_NODE_DIR": f"{d}/nodelocal"}

    def env(self, variant: str | None, node: dict[str, str] | None = None,
            **extra: str) -> dict[str, str]:
        """The child's environment: the caller's, minus anything that configures a
        cache, plus *node* (default: a new one) and *extra*."""
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("ASYNCCLCACHE_", "PYOPENCL_"))
            and k not in ("POCL_CACHE_DIR", "XDG_CACHE_HOME", "CUDA_CACHE_PATH",
                          "CUDA_CACHE_DISABLE", "MESA_SHADER_CACHE_DIR", "MESA_GLSL_CACHE_DIR",
                          "MESA_SHADER_CACHE_DISABLE", "MESA_GLSL_CACHE_DISABLE")
        }
        if "PYOPENCL_CTX" in os.environ:
            env["PYOPENCL_CTX"] = os.environ["PYOPENCL_CTX"]
        env.update(node or self.node())
        env.update(extra)
        if variant == "nocache":
            env["PYOPENCL_NO_CACHE"] = "1"
        if variant == "pyopencl-spec0":
            env["POCL_WORK_GROUP_SPECIALIZATION"] = "0"
        if variant and variant.startswith("acc") and "ASYNCCLCACHE_BAKE" not in extra:
            # As measured before idle baking was on by default (issue 35), but in acc-idle.
            env["ASYNCCLCACHE_BAKE"] = "idle" if variant == "acc-idle" else "off"
        if variant == "acc-shared":
            env["ASYNCCLCACHE_NODE_COPIES"] = "0"  # every rank reads the shared directory
        if variant == "acc-ranklocal":
            env["ASYNCCLCACHE_RANK_LOCAL"] = "1"
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
            wrap = spec.pop("_wrap", [])  # e.g. strace, to count file operations
            spec_path = self.work / f"{tag}.spec.json"
            spec_path.write_text(json.dumps(spec))
            logf = open(self.logs / f"{tag}.log", "wb")  # noqa: SIM115 - closed below
            t0 = time.perf_counter()
            proc = subprocess.Popen(
                [*wrap, self.python, str(CHILD), str(spec_path)],
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
            # Daemon threads: an interrupted run must not wait for them at exit.
            k = threading.Timer(timeout, self._kill_group, args=(proc.pid,))
            k.daemon = True
            k.start()
            killers.append(k)
            th = threading.Thread(target=wait, args=(proc,), daemon=True)
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
    if r.get("error"):
        raise SystemExit(f"cannot create an OpenCL context:\n{r.get('log_tail')}")
    for k in (
        "platform_name", "platform_version", "device_name", "device_type", "driver_version",
        "compute_units", "pyopencl", "numpy", "python", "asyncclcache", "asyncclcache_path",
        "auto_strategy", "auto_reason", "pyopencl_default_binary_cache",
    ):
        info[k] = r.get(k)
    info["env"] = {k: v for k, v in sorted(os.environ.items())
                   if k in ("PYOPENCL_CTX", "POCL_DEVICES", "POCL_MAX_PTHREAD_COUNT",
                            "CUDA_CACHE_DISABLE", "OCL_ICD_VENDORS", "RUSTICL_ENABLE")}
    info["python_executable"] = runner.python
    info["loadavg_start"] = os.getloadavg()
    return info


# }}}


# {{{ measurements


def measure_first_result(
    runner: Runner, workload: str, variants: list[str], reps: int, extra_reps: int,
    workload_args: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Cold (fresh pocl cache, empty cache dir) then warm (fresh pocl cache, the cold
    run's cache dir) time to the first correct result, per variant and repetition."""
    res: dict[str, Any] = {v: {"cold": [], "warm": [], "bake_s": []} for v in variants}
    for rep in range(reps):
        # Rotate the order so drifting background load does not favour one variant.
        order = variants[rep % len(variants):] + variants[: rep % len(variants)]
        for v in order:
            if rep >= extra_reps and v == "acc-thread":
                continue
            spec: dict[str, Any] = {"task": "first_result", "variant": v, "workload": workload,
                                    "workload_args": workload_args or {}}
            if v.startswith("acc"):
                spec["acc_dir"] = runner.fresh(f"{v}-cache")
            if v.startswith("pyopencl"):
                spec["pyopencl_dir"] = runner.fresh("pyopencl-cache")
            node = runner.node()
            cold = runner.run([dict(spec, _env=runner.env(v, node))])[0]
            res[v]["cold"].append(cold)
            msg = f"{workload} rep {rep + 1}/{reps} {v:10s} cold {_s(cold.get('first_result_s'))}"
            if v.startswith("acc") and "flush_s" in cold:
                msg += (f" (then flush {cold['flush_s']:.2f} s, close {cold['close_s']:.2f} s,"
                        f" {cold.get('entries')} entries)")
            if v == "acc-baked" and "error" not in cold:
                baked = bake(runner, spec["acc_dir"])
                res[v]["bake_s"].append(baked)
                msg += f"; bake {_s(baked)}"
            if v != "nocache" and "error" not in cold:
                # The driver's own cache can only help on the same node; all else: a new one.
                warm_node = node if v == "default" else None
                warm = runner.run([dict(spec, _env=runner.env(v, warm_node))])[0]
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


def measure_stall(runner: Runner, cases: dict[str, tuple[str, ...]], reps: int,
                  workload_args: dict[str, Any]) -> dict[str, Any]:
    """*cases*: stall case name -> the probes to run for it."""
    res: dict[str, Any] = {}
    for rep in range(reps):
        for name, v, window in STALL_CASES:
            for probe in cases.get(name, ()):
                spec: dict[str, Any] = {"task": "stall", "variant": v, "window": window,
                                        "probe": probe, "idle_s": IDLE_S,
                                        "workload_args": workload_args}
                if v.startswith("acc"):
                    spec["acc_dir"] = runner.fresh(f"{v}-cache")
                if v.startswith("pyopencl"):
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
                if v.startswith("pyopencl"):
                    spec["pyopencl_dir"] = runner.fresh("pyopencl-cache")
                specs.append(dict(spec, _env=runner.env(v)))
            t0 = time.perf_counter()
            rs = runner.run(specs, timeout=1200)
            wall = time.perf_counter() - t0
            entries = baked = None
            if v.startswith("acc"):
                entries = sum((r.get("final") or {}).get("entries") or 0 for r in rs)
            if v == "acc-idle":
                baked = sum(baked_entries(s["acc_dir"]) for s in specs)
                entries = (entries or 0) - baked  # the kcache entries; the baked ones beside them
            elif v.startswith("pyopencl"):
                entries = programs
            one = {
                "wall_s": max(r["wall_s"] for r in rs),
                # in the slowest process: its own work, and end of work -> process exit
                "work_s": max((r.get("work_s") or 0.0) for r in rs),
                "exit_s": max(r["wall_s"] - (r.get("end_of_work_s") or r["wall_s"]) for r in rs),
                "background_errors": sum(
                    ((r.get("final") or {}).get("stats") or {}).get("errors", 0) for r in rs),
                # The cache's own CPU: its work in callers' threads plus its own threads.
                "own_cpu_s": sum(_own_cpu((r.get("final") or {}).get("stats")) for r in rs)
                if v.startswith("acc") else None,
                "group_wall_s": wall,
                "cpu_s": rs[0]["group_cpu_s"],
                "entries": entries,
                "baked": baked,
                "programs": programs,
                "ranks": ranks,
                "children": rs,
                "error": next((r["error"] for r in rs if "error" in r), None),
            }
            res[v].append(one)
            work = max((r.get("work_s") or 0) for r in rs)
            log(f"throughput {ranks}x{per} rep {rep + 1}/{reps} {v:10s} wall {_s(one['wall_s'])} "
                f"(work {_s(work)}), cpu {_s(one['cpu_s'])}, entries {entries}"
                + (f", baked {baked}" if baked is not None else ""))
    return res


def bake(runner: Runner, acc_dir: str) -> float | None:
    """``asyncclcache bake`` of ``acc_dir``, as a user runs it after a job: its seconds."""
    t0 = time.perf_counter()
    proc = subprocess.run([runner.python, "-m", "asyncclcache", "bake", "--dir", acc_dir], env=runner.env(None),
                          capture_output=True, text=True, timeout=1800, check=False)
    if proc.returncode != 0:
        log(f"bake of {acc_dir} failed: {proc.stderr.strip()[-300:]}")
        return None
    return time.perf_counter() - t0


def baked_entries(acc_dir: str) -> int:
    """How many baked binaries ``acc_dir`` holds (every rank's)."""
    from asyncclcache.store import Store, ranks

    stores = [Store(acc_dir, rank_local=False, create=False)]
    stores += [Store(acc_dir, rank_local=True, rank=r, create=False) for r in ranks(Path(acc_dir))]
    return sum(1 for s in stores for e in s.entries() if (m := s.read_meta(e.path)) and m.baked_from)


def _own_cpu(stats: dict[str, Any] | None) -> float:
    stats = stats or {}
    return stats.get("main_thread_seconds", 0.0) + stats.get("background_cpu_seconds", 0.0)


def default_ranks(cores: int) -> list[int]:
    """1, then powers of two from 4, then every core: 2 cores -> 1, 2; 16 -> 1, 4, 8, 16."""
    out = [1] + [r for r in (4, 8, 16, 32, 64, 128) if r < cores] + [cores]
    return sorted(set(out))


def measure_ranks(runner: Runner, ranks: list[int], variants: list[str], n: int, reps: int,
                  threads: int, save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """R processes at once, one per core, each its own new node; per-rank time to the
    seed kernel's first result, cold then warm (a new node again, except for the
    driver's own cache, which can only help on the same node)."""
    res: dict[str, Any] = {"n": n, "reps": reps, "threads_per_rank": threads, "rows": {}}
    for rep in range(reps):
        for R in ranks:
            row = res["rows"].setdefault(str(R), {})
            order = variants[rep % len(variants):] + variants[: rep % len(variants)]
            for v in order:
                acc_dir = runner.fresh(f"{v}-cache") if v.startswith("acc") else None
                nodes = [runner.node() for _ in range(R)]
                cl_dirs = [runner.fresh("pyopencl-cache") for _ in range(R)]
                msg = f"R={R} rep {rep + 1}/{reps} {v:10s}"
                for phase in ("cold", "warm"):
                    if phase == "warm" and v == "nocache":
                        continue
                    start_at = time.time() + 1.5 + 0.25 * R
                    node_dir = runner.fresh("nodelocal")  # the job's ranks: one node
                    specs = []
                    for r in range(R):
                        spec: dict[str, Any] = {
                            "task": "first_result", "variant": v, "workload": "seed",
                            "workload_args": {"n": n}, "start_at": start_at,
                            "acc_dir": acc_dir, "pyopencl_dir": cl_dirs[r]}
                        node = nodes[r] if phase == "cold" or v == "default" else None
                        specs.append(dict(spec, _env=runner.env(
                            v, node, PMI_RANK=str(r), PMI_SIZE=str(R), ASYNCCLCACHE_NODE_DIR=node_dir,
                            POCL_MAX_PTHREAD_COUNT=str(threads))))
                    rs = runner.run(specs, timeout=900)
                    firsts = [r.get("first_result_s") for r in rs]
                    ok = [x for x in firsts if x is not None]
                    one: dict[str, Any] = {
                        "per_rank": firsts,
                        "median": report.median(ok) if len(ok) == R else None,
                        "max": max(ok) if len(ok) == R else None,
                        "cpu_s": rs[0]["group_cpu_s"],
                        "wall_s": max(r["wall_s"] for r in rs),
                        "error": next((r["error"] for r in rs if r.get("error")), None),
                    }
                    if v.startswith("acc"):
                        for k in ("writes", "hits", "misses", "skipped"):
                            one[k] = sum((r.get("stats_final") or {}).get(k, 0) for r in rs)
                        one["own_cpu_s"] = sum(_own_cpu(r.get("stats_final")) for r in rs)
                    row.setdefault(v, {"cold": [], "warm": []})[phase].append(one)
                    msg += (f" | {phase} median {_s(one['median'])} max {_s(one['max'])}"
                            f" cpu {_s(one['cpu_s'])}")
                log(msg)
            save(res)
    return res


# }}}


def _compile_bytecode(python: str) -> None:
    """Bytecode for the package, as ``pip install`` compiles it: an editable install with
    ``PYTHONDONTWRITEBYTECODE`` set would otherwise compile every module in every timed child
    (about 25 ms of a warm start)."""
    code = ("import compileall, os, asyncclcache; "
            "compileall.compile_dir(os.path.dirname(asyncclcache.__file__), quiet=1)")
    subprocess.run([python, "-c", code], check=False, capture_output=True, timeout=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="asyncclcache bench", description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="1 repetition, fewer variants and rows (under 5 min on 2 cores)")
    ap.add_argument("--out", default=str(HERE / "out"), help="output directory")
    ap.add_argument("--reps", type=int, default=None,
                    help="repetitions (default 3, quick 1; stall, throughput, ranks: at most 2)")
    ap.add_argument("--only", default=",".join(SECTIONS),
                    help="comma-separated sections: " + ", ".join(SECTIONS)
                    + " ('first' = seed,multi)")
    ap.add_argument("--ranks", default=None,
                    help="rank counts, e.g. 1,4,8,16 (default: 1, powers of two from 4, "
                         "and the number of cores)")
    ap.add_argument("--node-ranks", default=NODE_RANKS, type=lambda t: [int(x) for x in t.split(",")],
                    help="nodes section: rank counts (default 4,16,64, quick 4; 8 ranks a simulated node)")
    ap.add_argument("--fill", type=int, default=None,
                    help="nodes section: other entries in the shared directory first (default 1000, quick 200)")
    ap.add_argument("--ranks-per-node", type=int, default=None,
                    help="nodes section: ranks a simulated node (default 8, at least 2 nodes)")
    ap.add_argument("--suite-programs", type=int, default=40,
                    help="suite section: programs, each built in 4 consecutive tests (default 40)")
    ap.add_argument("--n", type=int, default=1000,
                    help="statements in the seed kernel (1000: about 5 s of pocl compile)")
    ap.add_argument("--variants", default=None,
                    help="comma-separated columns to run, of all of a section's, --quick or not "
                         "(default: each section's, fewer with --quick), e.g. nocache,default,acc,acc-baked")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directories")
    ap.add_argument("--python", default=sys.executable, help="interpreter for the children")
    args = ap.parse_args(argv)

    reps = args.reps or (1 if args.quick else 3)
    only = [x for s in args.only.split(",") for x in (["seed", "multi"] if s == "first" else [s])]
    unknown = set(only) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown section(s): {', '.join(sorted(unknown))}")
    if reps < 1 or args.n < 1:
        ap.error("--reps and --n must be at least 1")
    ranks = None
    if args.ranks:
        try:
            ranks = sorted({int(x) for x in args.ranks.split(",")})
        except ValueError:
            ap.error(f"--ranks wants numbers like 1,4,8,16, got {args.ranks!r}")
        if ranks[0] < 1:
            ap.error("--ranks: at least 1 rank")
    if args.quick:
        only = [s for s in only if s != "multi"]
        if args.node_ranks == NODE_RANKS:
            args.node_ranks = [4]  # 16 and 64 ranks on a small machine: most of a quick run
    keep_variants = None
    if args.variants:
        keep_variants = args.variants.split(",")
        bad = set(keep_variants) - set(report.VARIANTS)
        if bad:
            ap.error(f"unknown variant(s): {', '.join(sorted(bad))}")
    sections = [s for s in SECTIONS if s in only]
    global log
    log = Progress(sections)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir()
    work = Path(tempfile.mkdtemp(prefix="acc-bench-"))
    _compile_bytecode(args.python)
    runner = Runner(work, logs, args.python)
    full = not args.quick
    R: dict[str, Any] = {
        "command": "asyncclcache bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "args": {"quick": args.quick, "reps": reps, "only": sections, "n": args.n},
        "workloads": {"seed": f"(N={args.n})", "multi": "(59 kernels)"},
        "variants_used": [],
    }
    t_start = time.perf_counter()
    seconds, where = estimate(sections, args.quick, reps, out)
    print(f"bench: {', '.join(sections)}: about {max(1, round(seconds / 60))} min ({where}; "
          "a machine with more cores takes less, a loaded one more)", flush=True)
    R["section_s"] = log.seconds  # what the next run's announcement takes (estimate())

    def save(section: str | None = None, value: Any = None) -> None:
        if section:
            R[section] = value
        log.section(log.current)  # its seconds so far
        R["duration_s"] = time.perf_counter() - t_start
        report.write(out, R, plots=False)  # the numbers so far; plots once, at the end

    def use(vs: list[str]) -> list[str]:
        if keep_variants is not None:
            vs = [v for v in vs if v in keep_variants]
        R["variants_used"] = sorted(set(R["variants_used"]) | set(vs))
        return vs

    def columns(every: list[str], quick_ones: list[str]) -> list[str]:
        # A section's columns: --quick's fewer, unless --variants names some (of all of them).
        vs = quick_ones if not full and keep_variants is None else every
        return vs if keep_variants is None else [v for v in vs if v in keep_variants]

    try:
        R["machine"] = m = describe(runner)
        print(f"machine: {m.get('cpu')}, {m.get('cores')} cores; {m.get('platform_version')}; "
              f"{m.get('device_name')}; pyopencl {m.get('pyopencl')}; auto = "
              f"{m.get('auto_strategy')}", flush=True)
        if os.getloadavg()[0] > 0.5 * (os.cpu_count() or 1):
            print(f"warning: load average {os.getloadavg()[0]:.1f} at start: other work will "
                  "show up in the numbers", flush=True)
        seed_args = {"n": args.n}
        if "seed" in sections:
            log.section("seed")
            v = use(columns(VARIANTS, QUICK_VARIANTS))
            save("first_result_seed",
                 measure_first_result(runner, "seed", v, reps, reps, seed_args))
        if "multi" in sections:
            log.section("multi")
            v = use(VARIANTS)
            save("first_result_multi", measure_first_result(runner, "multi", v, reps, 1))
        if "stall" in sections:
            log.section("stall")
            both = ("tick", "launch")
            cases = {c[0]: both for c in STALL_CASES} if full else {
                "acc-after-build": both, "acc-thread-after-build": ("launch",)}
            use([c[1] for c in STALL_CASES if c[0] in cases])
            save("stall", measure_stall(runner, cases, min(reps, 2), seed_args))
        if "throughput" in sections:
            log.section("throughput")
            v = use(columns(["nocache", "pyopencl", "acc", "acc-idle"], ["nocache", "acc", "acc-idle"]))
            progs = 200 if full else 24
            tp_reps = min(reps, 2)
            save("throughput_1",
                 measure_throughput(runner, v, progs, 1, tp_reps, {"pyopencl": 1}))
            # As many processes as cores: no core is idle, so idle baking must cost nothing.
            at_once = ["nocache", "acc", "acc-idle"]
            save("throughput_2", measure_throughput(runner, use(at_once), progs, 2, tp_reps))
        if "ranks" in sections:
            log.section("ranks")
            if ranks is None:
                cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
                    os.cpu_count() or 1)
                ranks = default_ranks(cores) if full else [cores]
            # --quick: one directory with node copies (acc-shared is the nodes section's question)
            v = columns(RANK_VARIANTS, ["nocache", "acc"])
            use([x for x in v if x != "acc-shared"])
            R["ranks"] = measure_ranks(runner, ranks, v, args.n, min(reps, 2), 1,
                                       lambda res: save("ranks", res))
        if "nodes" in sections:
            log.section("nodes")
            import nodes

            modes = use(columns(nodes.MODES, nodes.QUICK_MODES))
            R["nodes"] = nodes.measure_nodes(runner, args.node_ranks, modes, log,
                                             lambda res: save("nodes", res), reps=min(reps, 3),
                                             per_node=args.ranks_per_node,
                                             fill=args.fill if args.fill is not None else 1000 if full else 200)
        if "sharedpocl" in sections:
            log.section("sharedpocl")
            import sharedpocl

            use(["nocache", "acc"])
            R["sharedpocl"] = sharedpocl.measure_sharedpocl(runner, reps, log, lambda res: save("sharedpocl", res),
                                                            quick=args.quick)
        if "suite" in sections:
            log.section("suite")
            import suite

            use(["nocache", "acc"])
            R["suite"] = suite.measure_suite(runner, reps, log, lambda res: save("suite", res),
                                             programs=args.suite_programs if not args.quick else 20)
        if "cisuite" in sections:
            log.section("cisuite")
            import cisuite

            use(["nocache", "acc"])
            R["cisuite"] = cisuite.measure_cisuite(runner, reps, log, lambda res: save("cisuite", res),
                                                   quick=args.quick)
            save("cisuite", R["cisuite"])
        if "firsthit" in sections:
            log.section("firsthit")
            import firsthit

            use(["acc"])
            R["firsthit"] = firsthit.measure_firsthit(runner, 3 if args.quick else 5 * reps, log,
                                                      lambda res: save("firsthit", res))
    except KeyboardInterrupt:
        print("interrupted: writing what was measured", flush=True)
    finally:
        log.section(log.current)
        if "machine" in R:
            R["machine"]["loadavg_end"] = os.getloadavg()
            R["duration_s"] = time.perf_counter() - t_start
            text = report.write(out, R)
            print()
            print(text)
            print(f"written: {out / 'report.md'}, {out / 'report.json'} "
                  f"(plots: {', '.join(p.name for p in sorted(out.glob('*.png'))) or 'none'}); "
                  f"logs in {logs}")
        if args.keep:
            print(f"scratch directories kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
