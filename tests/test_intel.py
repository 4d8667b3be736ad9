"""Intel's oneAPI OpenCL CPU runtime (PyPI ``intel-opencl-rt``, which ``scripts/setup.sh test``
installs into the venv) as a real driver: the cache on it, and its code-changing settings in
the key (issue 26; docs/design.md F23).

Its wheel's ICD file names a placeholder path, so the children here reach the runtime through
an ICD folder of our own (``OCL_ICD_VENDORS``: nothing is written to /etc). The runtime reads
``CL_CONFIG_*`` and ``cl.cfg`` once, when it starts: every scenario runs in fresh processes,
each in a working folder of its own (Intel reads ``cl.cfg`` there first). Where the runtime is
not installed (no wheel for this machine), every test skips with the reason.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from asyncclcache.platforms.intel import NAMES as INTEL_CPU_PLATFORM_NAMES
from conftest import need

TESTS = Path(__file__).resolve().parent

# The program, with a loop the vectorizer takes on: its code differs per target (measured).
SOURCE = """__kernel void k(__global float *a, __global const float *b, int n) {
  int i = get_global_id(0); float x = a[i];
  for (int j = 0; j < n; ++j) x = x * b[j] + 0.5f;
  a[i] = x; }"""

NODE = r'''
import hashlib, json, os, sys
import numpy as np, pyopencl as cl
import asyncclcache as acc
args = json.loads(sys.argv[1])
plat = [p for p in cl.get_platforms() if p.name in args["names"]][0]
ctx = cl.Context(plat.get_devices()); q = cl.CommandQueue(ctx)
cache = acc.Cache(args["dir"], strategy=args["strategy"])
values, binaries = [], []
for i, source in enumerate(args["sources"]):
    if i == 1:
        os.environ.update(args.get("env_after_first", {}))
    prg = acc.Program(ctx, source, cache=cache).build()
    a = np.full(64, 2.0, np.float32); b = np.full(8, 0.5, np.float32)
    mf = cl.mem_flags
    A = cl.Buffer(ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=a)
    B = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=b)
    prg.k(q, (64,), None, A, B, np.int32(8)); cl.enqueue_copy(q, a, A); q.finish()
    values.append(float(a[0]))
    binaries.append(hashlib.sha256(prg.get_info(cl.program_info.BINARIES)[0]).hexdigest())
cache.flush()
st = cache.stats()
print(json.dumps({"value": values[0], "values": values, "binary": binaries[0], "binaries": binaries,
                  "strategy": cache.driver_for(ctx.devices).name, "hits": st.hits, "misses": st.misses,
                  "writes": st.writes, "uncacheable": st.uncacheable, "rejected": st.rejected}))
'''


def _intel_library() -> Path | None:
    """``libintelocl.so`` as the wheel installs it: into the environment's ``lib``."""
    lib = Path(sys.prefix) / "lib" / "libintelocl.so"
    if lib.is_file():
        return lib
    try:
        from importlib import metadata

        files = metadata.files("intel-opencl-rt") or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == "libintelocl.so":
            return Path(str(f.locate())).resolve()
    return None


def _env(vendors: Path, **extra: str) -> dict[str, str]:
    # Neither the user's settings of the runtime nor of the cache: each test says its own.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CL_CONFIG_", "ASYNCCLCACHE_", "OCL_ICD_")) and k != "PYOPENCL_CTX"}
    env["OCL_ICD_VENDORS"] = str(vendors)
    env["PYTHONPATH"] = str(TESTS) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


@pytest.fixture(scope="session")
def vendors(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ICD folder naming Intel's CPU runtime only; skips where it is not installed."""
    lib = _intel_library()
    if lib is None and (sys.platform != "linux" or platform.machine() != "x86_64"):
        # As pocl's CUDA device for CI: no machine of this kind can have it (wheels: x86-64 only).
        pytest.skip(f"Intel's OpenCL CPU runtime has no wheel for {sys.platform} {platform.machine()}")
    if lib is None:
        need("Intel's OpenCL CPU runtime", "Intel's OpenCL CPU runtime is not installed (scripts/setup.sh "
             "test installs intel-opencl-rt from PyPI where it has a wheel for this machine)")
    folder = tmp_path_factory.mktemp("intel-icd")
    (folder / "intel-cpu.icd").write_text(f"{lib}\n")
    probe = ("import json, pyopencl as cl\n"
             "print(json.dumps([[p.name, [d.name for d in p.get_devices()]] for p in cl.get_platforms()]))")
    proc = subprocess.run([sys.executable, "-c", probe], env=_env(folder), capture_output=True, text=True,
                          timeout=300, check=False, cwd=folder)
    try:
        found = json.loads(proc.stdout.splitlines()[-1])
    except (IndexError, ValueError):
        found = []
    if not any(name in INTEL_CPU_PLATFORM_NAMES and devs for name, devs in found):
        need("Intel's OpenCL CPU runtime", f"Intel's OpenCL CPU runtime at {lib} shows no device: {found} "
             f"{proc.stderr[-300:]}")
    return folder


def _node(vendors: Path, cache: Path, cwd: Path, strategy: str = "auto", sources: tuple[str, ...] = (SOURCE,),
          env_after_first: dict[str, str] | None = None, **extra: str) -> dict[str, Any]:
    cwd.mkdir(parents=True, exist_ok=True)
    args = {"dir": str(cache), "names": list(INTEL_CPU_PLATFORM_NAMES), "sources": list(sources),
            "strategy": strategy, "env_after_first": env_after_first or {}}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(NODE), json.dumps(args)],
                          env=_env(vendors, **extra), capture_output=True, text=True, timeout=300,
                          check=False, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


# 2.0 through eight steps of x * 0.5 + 0.5: 1.00390625.
VALUE = 1.00390625


def test_cold_run_writes_and_a_new_process_hits_with_the_same_results(vendors: Path, tmp_path: Path) -> None:
    cold = _node(vendors, tmp_path / "acc", tmp_path / "wd")
    # The binary query compiles nothing here (F23): auto's pick is the background thread.
    assert cold["strategy"] == "thread", cold
    assert (cold["misses"], cold["hits"], cold["writes"]) == (1, 0, 1), cold
    assert cold["value"] == VALUE
    warm = _node(vendors, tmp_path / "acc", tmp_path / "wd")
    assert (warm["hits"], warm["misses"], warm["writes"]) == (1, 0, 0), warm
    assert warm["value"] == VALUE and warm["binary"] == cold["binary"]


def test_a_target_setting_never_serves_its_code_to_a_default_run(vendors: Path, tmp_path: Path) -> None:
    # Issue 26: after a run with CL_CONFIG_CPU_TARGET_ARCH=corei7, every default run hit the
    # SSE4.2 code. The same with the vectorizer off.
    fresh = _node(vendors, tmp_path / "fresh", tmp_path / "wd")  # the default build's bytes
    for var, value in (("CL_CONFIG_CPU_TARGET_ARCH", "corei7"), ("CL_CONFIG_USE_VECTORIZER", "False")):
        cache = tmp_path / var
        odd = _node(vendors, cache, tmp_path / "wd", **{var: value})
        assert odd["misses"] == 1 and odd["writes"] == 1, odd
        assert odd["binary"] != fresh["binary"], f"{var}={value} made the same code: no evidence"
        plain = _node(vendors, cache, tmp_path / "wd")
        assert plain["misses"] == 1 and plain["hits"] == 0, (var, plain)
        assert plain["binary"] == fresh["binary"] and plain["value"] == VALUE
        again = _node(vendors, cache, tmp_path / "wd", **{var: value})
        assert again["hits"] == 1 and again["binary"] == odd["binary"], again
    # Threads only: the same code, the same entry.
    workers = _node(vendors, tmp_path / "fresh", tmp_path / "wd", CL_CONFIG_CPU_TBB_NUM_WORKERS="1")
    assert workers["hits"] == 1 and workers["binary"] == fresh["binary"], workers


def test_a_cl_cfg_in_the_working_folder_is_in_the_key(vendors: Path, tmp_path: Path) -> None:
    cache = tmp_path / "acc"
    plain = _node(vendors, cache, tmp_path / "plain")
    assert plain["writes"] == 1
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    (cfg / "cl.cfg").write_text("CL_CONFIG_CPU_TARGET_ARCH = corei7\n")
    first = _node(vendors, cache, cfg)
    assert first["misses"] == 1 and first["hits"] == 0 and first["writes"] == 1, first
    assert first["binary"] != plain["binary"], "Intel did not read cl.cfg in the working folder"
    assert _node(vendors, cache, cfg)["hits"] == 1
    # Its content counts, not its name: a changed file is another key.
    (cfg / "cl.cfg").write_text("CL_CONFIG_CPU_TARGET_ARCH = corei7\nCL_CONFIG_USE_VECTORIZER = False\n")
    changed = _node(vendors, cache, cfg)
    assert changed["misses"] == 1 and changed["hits"] == 0, changed
    # Beside the library it is the same file in every folder: the plain run still hits.
    assert _node(vendors, cache, tmp_path / "plain")["hits"] == 1


def test_a_cl_cfg_that_cannot_be_read_is_never_cached(vendors: Path, tmp_path: Path) -> None:
    odd = tmp_path / "odd"
    (odd / "cl.cfg").mkdir(parents=True)  # what Intel makes of it is unknown: miss, store nothing
    got = _node(vendors, tmp_path / "acc", odd)
    assert got["uncacheable"] == 1 and got["writes"] == 0 and got["value"] == VALUE, got


def test_a_requested_process_strategy_is_served_by_auto(vendors: Path, tmp_path: Path) -> None:
    # Strategy process is gone: auto serves instead, which here is the thread (the query
    # compiles nothing on Intel's runtime).
    got = _node(vendors, tmp_path / "acc", tmp_path / "wd", strategy="process")
    assert got["strategy"] == "thread" and got["writes"] == 1, got
    assert _node(vendors, tmp_path / "acc", tmp_path / "wd", strategy="process")["hits"] == 1


def test_settings_changed_after_the_runtime_started_are_not_taken_for_its_code(
    vendors: Path, tmp_path: Path,
) -> None:
    # The runtime reads CL_CONFIG_* once, when it starts (measured): a program built after
    # os.environ changed is still default code, and its key must say so, not what the
    # environment says now.
    other = SOURCE.replace("0.5f;", "0.25f;")
    cache = tmp_path / "acc"
    first = _node(vendors, cache, tmp_path / "wd", sources=(SOURCE, other),
                  env_after_first={"CL_CONFIG_CPU_TARGET_ARCH": "corei7"})
    assert first["writes"] == 2, first
    # The same two builds without the change give the same bytes (a program's binary depends on
    # what the process built before it, so the same sequence is compared).
    plain = _node(vendors, tmp_path / "fresh", tmp_path / "wd", sources=(SOURCE, other))
    assert first["binaries"] == plain["binaries"], "the runtime took a setting changed after it started"
    # A run that starts with the setting gets its own code, never the default run's entry.
    odd = _node(vendors, cache, tmp_path / "wd", sources=(other,), CL_CONFIG_CPU_TARGET_ARCH="corei7")
    assert odd["misses"] == 1 and odd["hits"] == 0 and odd["rejected"] == 0, odd
    assert _node(vendors, cache, tmp_path / "wd", sources=(other,))["hits"] == 1


# {{{ which cl.cfg is in effect: our reading of Intel's rule (no runtime needed)


def _maps(tmp_path: Path, *libs: Path) -> Path:
    maps = tmp_path / f"maps{len(libs)}"
    rows = [f"7f00{i:04x}000-7f00{i:04x}fff r-xp 00000000 08:01 {100 + i}  {lib}" for i, lib in enumerate(libs)]
    maps.write_text("\n".join(["55d0-55e0 r--p 00000000 08:01 7  /usr/bin/python3.11", *rows, ""]))
    return maps


def test_the_cl_cfg_in_effect_is_the_working_folders_then_the_librarys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    import hashlib

    from asyncclcache.platforms.intel import INTEL_CL_CFG, intel_cl_cfg

    lib = tmp_path / "venv" / "lib"
    lib.mkdir(parents=True)
    wd = tmp_path / "wd"
    wd.mkdir()
    monkeypatch.chdir(wd)
    maps = _maps(tmp_path, lib / "libintelocl.so.2026.22.10.0", tmp_path / "other" / "libintelocl_emu.so")
    assert intel_cl_cfg(str(maps)) == ({INTEL_CL_CFG: "none"}, None)  # built-in defaults
    (lib / "cl.cfg").write_bytes(b"CL_CONFIG_USE_VECTORIZER = True\n")
    beside = hashlib.sha256(b"CL_CONFIG_USE_VECTORIZER = True\n").hexdigest()
    assert intel_cl_cfg(str(maps)) == ({INTEL_CL_CFG: beside}, None)
    (wd / "cl.cfg").write_bytes(b"CL_CONFIG_CPU_TARGET_ARCH = corei7\n")
    here = hashlib.sha256(b"CL_CONFIG_CPU_TARGET_ARCH = corei7\n").hexdigest()
    assert intel_cl_cfg(str(maps)) == ({INTEL_CL_CFG: here}, None)
    # What cannot be known is never cached: the reason is in the key and returned.
    (wd / "cl.cfg").unlink()
    (wd / "cl.cfg").mkdir()
    digests, why = intel_cl_cfg(str(maps))
    assert why is not None and "not a regular file" in why and digests[INTEL_CL_CFG].startswith("unknown")
    (wd / "cl.cfg").rmdir()
    os.mkfifo(wd / "cl.cfg")  # opened without blocking
    assert "not a regular file" in (intel_cl_cfg(str(maps))[1] or "")
    (wd / "cl.cfg").unlink()
    for odd, reason in ((_maps(tmp_path), "does not show"), (tmp_path / "no-maps", "cannot be read"),
                        (_maps(tmp_path, lib / "libintelocl.so", tmp_path / "b" / "libintelocl.so"), "several")):
        digests, why = intel_cl_cfg(str(odd))
        assert why is not None and reason in why, (odd, why)
        assert digests[INTEL_CL_CFG] == f"unknown: {why}"


# }}}
