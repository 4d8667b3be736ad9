"""pocl's CUDA device (issue 29): pocl's folder of the program and the compute-cache files
its build added, one entry (driver ``kcache-pocl-cuda``, docs/design.md F27).

The rules (where each cache is, which is on, which names an entry holds, where libdevice
is) run everywhere. The scenarios need pocl's CUDA device and run wherever it is
(``POCL_DEVICES=cuda`` with a pocl built with it, an NVIDIA GPU: benchmarks/device/), skipped
elsewhere with the reason. Each node is a fresh process with its own ``POCL_CACHE_DIR`` and
``CUDA_CACHE_PATH`` (both drivers read them once per process) and the same cache directory.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from asyncclcache.entry import Entry
from asyncclcache.platforms import pocl_cuda
from asyncclcache.store import Store

LAYOUT = pocl_cuda.LAYOUT

# {{{ rules


@pytest.mark.parametrize(("rel", "ok"), [
    ("pocl/AB/" + "C" * 38 + "/program.bc", True),
    ("pocl/AB/" + "C" * 38 + "/program.bc.Ofs.ptx", True),
    ("nv/a/b/0123456789abcdef", True),
    ("AB/" + "C" * 38 + "/program.bc", False),  # no part's folder
    ("nv/AB/" + "C" * 38 + "/program.bc", False),  # pocl's name under NVIDIA's folder
    ("pocl/a/b/0123456789abcdef", False),
    ("nv/a/b/../../x", False),
    ("mesa/ab/0123456789abcdef", False),
])
def test_an_entry_holds_each_cache_under_its_folder(rel: str, ok: bool) -> None:
    assert LAYOUT.valid(rel) is ok


@pytest.mark.parametrize(("env", "on", "says"), [
    ({"POCL_CACHE_DIR": "/p", "CUDA_CACHE_PATH": "/c"}, "/p", "pocl's kernel cache (/p) and NVIDIA's compute cache (/c)"),
    ({"POCL_CACHE_DIR": "/p", "CUDA_CACHE_PATH": "/c", "CUDA_CACHE_DISABLE": "1"}, "/p",
     "only pocl's kernel cache (/p), since NVIDIA's compute cache is off"),
    ({"POCL_CACHE_DIR": "/p", "CUDA_CACHE_PATH": "/c", "POCL_KERNEL_CACHE": "0"}, "/c",
     "only NVIDIA's compute cache (/c), since pocl's kernel cache is off"),
    ({"POCL_CACHE_DIR": "/p", "CUDA_CACHE_PATH": "rel"}, "/p", "only pocl's kernel cache (/p), since CUDA_CACHE_PATH"),
    ({"POCL_CACHE_DIR": "/p", "CUDA_CACHE_DISABLE": "1", "POCL_KERNEL_CACHE": "0"}, None, "off"),
])
def test_which_caches_are_stored(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], on: str | None,
                                 says: str) -> None:
    for var in ("POCL_CACHE_DIR", "POCL_KERNEL_CACHE", "CUDA_CACHE_PATH", "CUDA_CACHE_DISABLE"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    root, why = pocl_cuda.locate([])
    assert root == (None if on is None else Path(on))
    assert says in why


def test_libdevice_is_found_where_pocl_looks(tmp_path: Path) -> None:
    for base in ("tk", "home"):
        (tmp_path / base / "nvvm" / "libdevice").mkdir(parents=True)
        (tmp_path / base / "nvvm" / "libdevice" / "libdevice.10.bc").write_bytes(base.encode())
    both = {"POCL_CUDA_TOOLKIT_PATH": str(tmp_path / "tk"), "CUDA_HOME": str(tmp_path / "home")}
    assert pocl_cuda.libdevice(both) == tmp_path / "tk/nvvm/libdevice/libdevice.10.bc"
    assert pocl_cuda.libdevice({"CUDA_HOME": str(tmp_path / "home")}) == tmp_path / "home/nvvm/libdevice/libdevice.10.bc"
    assert pocl_cuda.libdevice({"POCL_CUDA_TOOLKIT_PATH": str(tmp_path / "none"), "CUDA_HOME": str(tmp_path / "none")}) in (
        None, *[Path(f"{b}{s}/libdevice/libdevice.10.bc") for b in ("/usr/local/lib/cuda", "/usr/local/lib", "/usr/lib")
                for s in ("/nvvm", "/nvidia-cuda-toolkit", "")])


def test_the_key_holds_nvidia_settings_and_libdevice_on_the_cuda_device(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import pyopencl as cl

    from asyncclcache import keys

    # What pyopencl's Device reports for pocl's CUDA device and for its CPU device (the
    # attributes the rule reads; no OpenCL call is made).
    plat = SimpleNamespace(name=pocl_cuda.pocl.NAME)
    gpu = SimpleNamespace(platform=plat, type=cl.device_type.GPU, vendor_id=0x10DE)
    cpu = SimpleNamespace(platform=plat, type=cl.device_type.CPU, vendor_id=0x1002)
    lib = tmp_path / "tk" / "nvvm" / "libdevice" / "libdevice.10.bc"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"one")
    for k, v in {"POCL_CUDA_TOOLKIT_PATH": str(tmp_path / "tk"), "POCL_CUDA_GPU_ARCH": "sm_90",
                 "CUDA_FORCE_PTX_JIT": "1", "CUDA_CACHE_PATH": str(tmp_path / "nv")}.items():
        monkeypatch.setenv(k, v)
    first, _ = keys.settings_of([gpu])  # type: ignore[list-item]
    assert first["POCL_CUDA_GPU_ARCH"] == "sm_90" and first["POCL_CUDA_TOOLKIT_PATH"] == str(tmp_path / "tk")
    assert first["CUDA_FORCE_PTX_JIT"] == "1" and "CUDA_CACHE_PATH" not in first
    lib.write_bytes(b"two!")  # another libdevice at the same place: another key
    assert keys.settings_of([gpu])[0]["pocl_cuda_libdevice"] != first["pocl_cuda_libdevice"]  # type: ignore[list-item]
    on_cpu, _ = keys.settings_of([cpu])  # type: ignore[list-item]
    assert "CUDA_FORCE_PTX_JIT" not in on_cpu and "pocl_cuda_libdevice" not in on_cpu


# }}}

# {{{ on pocl's CUDA device

NODE = r'''
import json, os, sys, time, warnings
import numpy as np, pyopencl as cl
args = json.loads(sys.argv[1])
from asyncclcache.platforms import pocl_cuda
devs = []
for p in cl.get_platforms():
    try:
        devs += [d for d in p.get_devices() if pocl_cuda.is_cuda_device(d)]
    except cl.Error:
        pass
if args.get("probe"):
    print(json.dumps({"n": len(devs), "platforms": [p.name for p in cl.get_platforms()]})); sys.exit()
import asyncclcache as acc
from asyncclcache.drivers import auto_reason
from asyncclcache.store import Store
ctx = cl.Context(devs[:1]); q = cl.CommandQueue(ctx)
cache = acc.Cache(args["dir"])
t = time.perf_counter()
prg = acc.Program(ctx, args["src"], cache=cache).build()
a = np.zeros(64, np.float32)
buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=a)
prg.k(q, (64,), None, buf); cl.enqueue_copy(q, a, buf); q.finish()
first = time.perf_counter() - t
flushed = cache.flush(120)
d = cache.driver_for(ctx.devices); st = cache.stats()
def walk(root):
    return sorted(os.path.relpath(os.path.join(p, f), root) for p, _, fs in os.walk(root) for f in fs)
store = Store(args["dir"])
entries = {e.key: (store.read_meta(e.path) or {}).get("files") for e in store.entries()}
print(json.dumps({"strategy": d.name, "reason": auto_reason(ctx.devices), "hits": st.hits, "misses": st.misses,
                  "writes": st.writes, "rejected": st.rejected, "incomplete": st.incomplete_hits,
                  "unidentified": st.unidentified, "unused": getattr(d, "unused", None), "val": float(a[0]),
                  "first": round(first, 3), "flushed": flushed, "key": prg.cache_key, "entries": entries,
                  "pocl": walk(os.environ["POCL_CACHE_DIR"]), "nv": walk(os.environ["CUDA_CACHE_PATH"])}))
cache.close()
'''


def _run(args: dict[str, Any], env: dict[str, str] | None = None, cwd: Path | None = None,
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(NODE), json.dumps(args)],
                          env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          cwd=cwd, timeout=300, check=False)


@functools.lru_cache(maxsize=1)
def _cuda_here() -> str | None:
    """Why pocl's CUDA device is not here, or ``None`` (asked in a child: pocl aborts a
    process that asks for its CUDA device where there is no GPU)."""
    proc = _run({"probe": True})
    if proc.returncode:
        return f"listing OpenCL devices failed ({proc.stderr.strip()[-200:]})"
    got = json.loads(proc.stdout.splitlines()[-1])
    return None if got["n"] else f"no pocl CUDA device here (platforms: {got['platforms']})"


@pytest.fixture
def cuda() -> None:
    why = _cuda_here()
    if why is not None:
        pytest.skip(why)


def node(tmp_path: Path, name: str, src: str, env: dict[str, str] | None = None, cwd: Path | None = None,
         store: str = "acc") -> dict[str, Any]:
    """A new node: fresh pocl kernel cache and compute cache, the cache directory ``store``."""
    base = {"POCL_CACHE_DIR": str(tmp_path / name / "pocl"), "CUDA_CACHE_PATH": str(tmp_path / name / "nv"),
            "POCL_KERNEL_CACHE": "1", "PYTHONWARNINGS": "always"}
    proc = _run({"dir": str(tmp_path / store), "src": src}, {**base, **(env or {})}, cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    out["stderr"] = proc.stderr
    return out


def kernel(c: float) -> str:
    body = "".join(f"x = x * {1.0001 + j * 1e-6:.7f}f + {j}.0f;" for j in range(20))
    return ("__kernel void k(__global float *a) { int g = get_global_id(0); float x = a[g]; "
            + body + f" a[g] = x + {c}f; }}")


def _program_files(files: list[str]) -> set[str]:
    # Files of program folders (pocl's temporary source copies sit at the top: no program's).
    return {f for f in files if pocl_cuda.POCL_FOLDERS.valid(f) and not f.endswith("/last_accessed")}


def _nv_files(files: list[str]) -> set[str]:
    return {f for f in files if pocl_cuda.nvidia.LAYOUT.valid(f)}


def test_a_new_node_compiles_nothing(cuda: None, tmp_path: Path) -> None:
    cold = node(tmp_path, "n1", kernel(1.0))
    assert cold["strategy"] == "kcache-pocl-cuda", cold["reason"]
    assert "pocl's kernel cache" in cold["reason"] and "NVIDIA's compute cache" in cold["reason"]
    assert (cold["misses"], cold["writes"], cold["unidentified"]) == (1, 1, 0) and cold["flushed"]
    files = cold["entries"][cold["key"]]
    pocl_part = {f[len("pocl/"):] for f in files if f.startswith("pocl/")}
    nv_part = {f[len("nv/"):] for f in files if f.startswith("nv/")}
    assert {f.rsplit("/", 1)[1] for f in pocl_part} >= {"program.bc", "program.bc.Ofs.ptx"}
    assert nv_part and len(pocl_part) + len(nv_part) == len(files)
    # The entry is what the build added to both caches.
    assert pocl_part == _program_files(cold["pocl"]) and nv_part <= _nv_files(cold["nv"])

    warm = node(tmp_path, "n2", kernel(1.0))
    assert (warm["hits"], warm["misses"], warm["incomplete"], warm["unused"], warm["writes"]) == (1, 0, 0, 0, 0)
    assert warm["val"] == cold["val"]
    # Nothing compiled: pocl wrote no file but what was restored, NVIDIA's driver none either.
    assert _program_files(warm["pocl"]) == pocl_part
    assert _nv_files(warm["nv"]) == nv_part
    assert "asyncclcache" not in warm["stderr"]


def test_a_header_changed_between_new_nodes_gives_the_new_value(cuda: None, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    src = '#include "h.h"\n__kernel void k(__global float *a) { a[get_global_id(0)] = VAL; }'
    got = []
    for i, v in enumerate((1, 2, 1, 7)):
        (work / "h.h").write_text(f"#define VAL {v}\n")
        r = node(tmp_path, f"h{i}", src, cwd=work)
        got.append((r["val"], r["hits"]))
    assert got == [(1.0, 0), (2.0, 0), (1.0, 1), (7.0, 0)]


def test_with_one_cache_off_the_other_is_stored_and_a_new_node_completes_it(cuda: None, tmp_path: Path) -> None:
    first = node(tmp_path, "n1", kernel(2.0), env={"CUDA_CACHE_DISABLE": "1"})
    assert first["strategy"] == "kcache-pocl-cuda" and "only pocl's kernel cache" in first["reason"]
    files = first["entries"][first["key"]]
    assert files and all(f.startswith("pocl/") for f in files)
    # Both on: the hit restores pocl's folder, the driver compiles the PTX, and those files
    # join the entry at flush.
    second = node(tmp_path, "n2", kernel(2.0))
    assert (second["hits"], second["incomplete"], second["writes"]) == (1, 1, 1)
    files = second["entries"][second["key"]]
    nv_part = {f[len("nv/"):] for f in files if f.startswith("nv/")}
    assert nv_part
    third = node(tmp_path, "n3", kernel(2.0))
    assert (third["hits"], third["incomplete"], third["writes"]) == (1, 0, 0)
    assert _nv_files(third["nv"]) == nv_part
    assert third["val"] == first["val"] == second["val"]


def test_a_folder_pocl_does_not_use_is_a_miss_with_one_warning_and_the_entry_kept(cuda: None, tmp_path: Path) -> None:
    first = node(tmp_path, "n1", kernel(3.0))
    store = Store(tmp_path / "acc")
    good = store.load(first["key"])
    assert good is not None
    # pocl's files under a folder name pocl never computes (another pocl build, say).
    moved = ["pocl/ZZ/" + "Q" * 38 + "/" + f.split("/", 3)[3] if f.startswith("pocl/") else f
             for f in good.meta["files"]]
    store.publish(Entry(good.key, good.binaries, dict(good.meta, files=moved)))
    second = node(tmp_path, "n2", kernel(3.0))
    assert second["stderr"].count("pocl did not use the stored kernel-cache files") == 1
    assert (second["hits"], second["misses"], second["rejected"], second["writes"]) == (0, 1, 1, 1)
    assert second["val"] == first["val"]
    replaced = store.load(first["key"])
    assert replaced is not None and sorted(replaced.meta["files"]) == sorted(good.meta["files"])

# }}}
