"""Start-up cost of the ``ASYNCCLCACHE_INSTALL`` hook (``asyncclcache-startup.pth``).

Python's ``site`` runs the hook's line in every interpreter that has the package
installed, whether it uses OpenCL or not. This measures it directly: two throwaway
venvs of this interpreter, identical except that one holds the hook's ``.pth`` (both
see the package through the same path file). Every variant runs ``--n`` times,
interleaved round-robin so that drift in the machine's load hits them alike:

* ``python -c pass``: no hook / hook, variable unset / hook, ``ASYNCCLCACHE_INSTALL=1``
  (the hook waits for pyopencl, so this is importing asyncclcache's package only);
* ``python -c "import pyopencl"``: no hook / hook with ``=1`` (the activation itself:
  ``install()`` right after pyopencl's import).

Usage: ``python benchmarks/startup.py [--n 200] [--json FILE]``. Prints medians,
quartiles and each median's ratio to its baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PTH = ROOT / "src" / "asyncclcache-startup.pth"


def make_venv(where: Path, *, hook: bool) -> str:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    py = where / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # The package and its dependencies, through one path file in both venvs.
    paths = [str(ROOT / "src"), sysconfig.get_paths()["purelib"]]
    Path(site, "acc-bench-paths.pth").write_text("\n".join(paths) + "\n")
    if hook:
        Path(site, PTH.name).write_text(PTH.read_text())
    return str(py)


def time_once(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200, help="runs of each variant (default 200)")
    ap.add_argument("--json", type=Path, help="write the raw times here")
    args = ap.parse_args(argv)
    if not PTH.exists():
        print(f"startup.py: {PTH} is missing: run from a checkout", file=sys.stderr)
        return 2

    # As users run: bytecode cached (PYTHONDONTWRITEBYTECODE would recompile every run).
    base_env = {k: v for k, v in os.environ.items()
                if not k.startswith("ASYNCCLCACHE_") and k != "PYTHONDONTWRITEBYTECODE"}
    base_env["POCL_CACHE_DIR"] = tempfile.mkdtemp(prefix="acc-startup-pocl-")
    base_env["ASYNCCLCACHE_DIR"] = tempfile.mkdtemp(prefix="acc-startup-cache-")
    with tempfile.TemporaryDirectory(prefix="acc-startup-") as tmp:
        plain = make_venv(Path(tmp, "plain"), hook=False)
        hooked = make_venv(Path(tmp, "hooked"), hook=True)
        on = dict(base_env, ASYNCCLCACHE_INSTALL="1")
        variants = {
            "pass, no hook": ([plain, "-c", "pass"], base_env),
            "pass, hook, unset": ([hooked, "-c", "pass"], base_env),
            "pass, hook, =1": ([hooked, "-c", "pass"], on),
            "import pyopencl, no hook": ([plain, "-c", "import pyopencl"], base_env),
            "import pyopencl, hook, =1": (
                [hooked, "-c",
                 "import pyopencl; assert pyopencl.Program.build.__module__ == 'asyncclcache.program'"],
                on),
        }
        for cmd, env in variants.values():  # warm the OS's file cache and bytecode
            for _ in range(3):
                time_once(cmd, env)
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.n):
            for name, (cmd, env) in variants.items():
                times[name].append(time_once(cmd, env))

    baseline = {"pass": "pass, no hook", "import pyopencl": "import pyopencl, no hook"}
    print(f"# Start-up of the activation hook: {args.n} runs each, interleaved")
    print(f"{platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}\n")
    print("| command | median (ms) | quartiles (ms) | median / baseline |")
    print("|---|---:|---:|---:|")
    report = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        q1, _, q3 = statistics.quantiles(ts, n=4)
        base = statistics.median(times[baseline[name.split(",")[0]]])
        report[name] = {"median_s": med, "q1_s": q1, "q3_s": q3, "ratio": med / base, "times_s": ts}
        print(f"| `{name}` | {med * 1e3:.1f} | {q1 * 1e3:.1f} - {q3 * 1e3:.1f} | {med / base:.3f} |")
    if args.json:
        args.json.write_text(json.dumps({"n": args.n, "python": platform.python_version(),
                                         "cpus": os.cpu_count(), "variants": report}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
