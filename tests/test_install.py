"""install(): pyopencl's own calls, with and without asyncclcache, give the same results
and raise the same exceptions. Each run is a fresh process with a fresh pocl cache."""

from __future__ import annotations

import pyopencl as cl
import pytest

import asyncclcache as acc
from asyncclcache.store import Store
from conftest import child_json, run_child

# A representative set of pyopencl calls; prints a JSON record of results and errors.
WORKLOAD = r"""
import json, os, sys, tempfile, pathlib
import numpy as np
import pyopencl as cl, pyopencl.array as cla, pyopencl.clmath as clmath
from pyopencl.elementwise import ElementwiseKernel
from pyopencl.reduction import ReductionKernel
from pyopencl.scan import InclusiveScanKernel, ExclusiveScanKernel
import asyncclcache as acc
from _pocl import pocl_context

mode = sys.argv[1]
cache = acc.Cache(sys.argv[2]) if mode == "installed" else None
if cache is not None:
    assert acc.install(cache) and acc.is_installed()
ctx = pocl_context()
q = cl.CommandQueue(ctx)
rng = np.random.default_rng(7)
x = cla.to_device(q, rng.random(5000).astype(np.float32))
y = cla.to_device(q, rng.random(5000).astype(np.float32))
out = {}
out["array"] = ((2 * x + y) * x - y / 3).get().tolist()[:50]
out["sum"] = float(cla.sum(x).get())
out["dot"] = float(cla.dot(x, y).get())
out["max"] = float(cla.max(y).get())
out["sqrt"] = clmath.sqrt(x).get().tolist()[:20]
out["where"] = cla.if_positive(x - 0.5, x, y).get().tolist()[:20]
lin = ElementwiseKernel(ctx, "float *z, float *x, float *y", "z[i] = 3 * x[i] - y[i]", "lin3")
z = cla.empty_like(x); lin(z, x, y); out["elementwise"] = z.get().tolist()[:20]
red = ReductionKernel(ctx, np.float32, neutral="0", reduce_expr="a+b", map_expr="x[i]*x[i]",
                      arguments="float *x")
out["reduction"] = float(red(x).get())
ints = cla.to_device(q, np.arange(2000, dtype=np.int32) % 7)
out["inclusive_scan"] = InclusiveScanKernel(ctx, np.int32, "a+b", neutral="0")(ints.copy()).get().tolist()[-5:]
out["exclusive_scan"] = ExclusiveScanKernel(ctx, np.int32, "a+b", "0")(ints.copy()).get().tolist()[-5:]
inc = pathlib.Path(sys.argv[3]); inc.mkdir(exist_ok=True)
(inc / "scale.h").write_text("#define SCALE 4.0f\n")
prg = cl.Program(ctx, '#include "scale.h"\n__kernel void s(__global float *a) { a[get_global_id(0)] *= SCALE; }').build(options=["-I", str(inc)])
a = x.copy(); prg.s(q, a.shape, None, a.data); out["include"] = a.get().tolist()[:10]
errors = {}
try:
    cl.Program(ctx, "__kernel void bad(__global float *a) { a[0] = nope; }").build()
except Exception as e:
    errors["bad_source"] = [type(e).__module__ + "." + type(e).__qualname__, int(e.code), "nope" in str(e)]
try:
    cl.Program(ctx, "__kernel void f(__global float *a) { a[0] = 1; }").build(options=["-cl-bogus-flag"])
except Exception as e:
    errors["bad_option"] = [type(e).__module__ + "." + type(e).__qualname__, int(e.code)]
out["errors"] = errors
if cache is not None:
    cache.flush(120)
    out["stats"] = cache.stats().as_dict()
print(json.dumps(out))
"""


def _compare(a: dict, b: dict) -> None:
    for key in a:
        if key == "stats":
            continue
        assert a[key] == b[key], key


@pytest.mark.slow
def test_pyopencl_calls_identical_with_install(cache_dir, tmp_path):
    inc = str(tmp_path / "include")
    plain = child_json(run_child(WORKLOAD, "plain", str(cache_dir), inc))
    cold = child_json(run_child(WORKLOAD, "installed", str(cache_dir), inc))
    warm = child_json(run_child(WORKLOAD, "installed", str(cache_dir), inc))  # a new node
    _compare(plain, cold)
    _compare(plain, warm)
    assert set(plain["errors"]) == {"bad_source", "bad_option"}
    assert plain["errors"]["bad_source"][2] is True  # the build log names the culprit
    assert cold["stats"]["misses"] >= 8 and cold["stats"]["writes"] >= 8
    assert cold["stats"]["errors"] == 0
    assert warm["stats"]["misses"] == 0, "every successful program should hit on the next run"
    # The same builds in both runs; a write is a new entry or a refresh of one.
    assert warm["stats"]["hits"] == cold["stats"]["hits"] + cold["stats"]["misses"]
    entries = len(list(Store(cache_dir).entries()))
    assert cold["stats"]["writes"] - cold["stats"]["refreshes"] == entries


def test_install_is_idempotent_and_uninstall_restores_pyopencl(cache_dir, open_cache):
    original = cl.Program.build
    cache = open_cache(cache_dir)
    try:
        assert acc.install(cache)
        assert acc.install(cache)
        assert acc.is_installed() and cl.Program.build is not original
        with acc.installed(cache) as inner:
            assert inner is cache and acc.is_installed()
        assert acc.is_installed()  # the block restores the previous state
    finally:
        acc.uninstall()
        acc.uninstall()
    assert cl.Program.build is original and not acc.is_installed()
    with acc.installed(cache):
        pass
    assert cl.Program.build is original
    cache.close()


def test_installed_build_goes_through_cache(cl_ctx, cache_dir, open_cache):
    from kernels import run_twice, small_source

    cache = open_cache(cache_dir)
    with acc.installed(cache):
        prg = cl.Program(cl_ctx, small_source()).build()
    assert type(prg) is cl.Program
    assert run_twice(cl_ctx, prg)
    assert cache.stats().misses == 1
    assert cache.flush(120) and cache.stats().writes == 1
    cache.close()


@pytest.mark.parametrize("var", ["PYOPENCL_NO_CACHE", "ASYNCCLCACHE_DISABLE"])
def test_install_steps_aside_when_caching_is_off(var, cache_dir):
    code = r"""
import json, logging, sys
import pyopencl as cl, asyncclcache as acc
records = []
class H(logging.Handler):
    def emit(self, r): records.append(r.getMessage())
logging.getLogger("asyncclcache").addHandler(H()); logging.getLogger("asyncclcache").setLevel(logging.INFO)
original = cl.Program.build
r1 = acc.install(acc.Cache(sys.argv[1])); r2 = acc.install()
print(json.dumps({"returned": [r1, r2], "patched": cl.Program.build is not original,
                  "said": [m for m in records if "not installing" in m]}))
"""
    out = child_json(run_child(code, str(cache_dir), env={var: "1"}))
    assert out["returned"] == [False, False]
    assert out["patched"] is False
    assert len(out["said"]) == 1 and var in out["said"][0]
