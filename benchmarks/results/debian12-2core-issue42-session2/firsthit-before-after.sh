#!/bin/bash
# A first hit of one program in a new process on a new node: pocl's folder restored (plain
# pyopencl) against a kcache hit of the code before (OLD, a source tree) and after (NEW), side
# by side in each sitting. usage: OLD=<old src> NEW=<new src> PY=<python> firsthit-before-after.sh KERNELS SITTINGS
set -eu
K=${1:-6}; N=${2:-10}; W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
cat > "$W/child.py" <<'PYC'
import json, sys, time
import numpy as np, pyopencl as cl
mode, K = sys.argv[1], int(sys.argv[2])
if mode != "plain":
    import asyncclcache; asyncclcache.install()
from pyopencl import _cl
ctx = cl.create_some_context(interactive=False)
SRC = "\n".join("__kernel void k%d(__global float *a) { int g = get_global_id(0); a[g] = %d.0f * a[g] + 1.0f; }"
                % (i, i + 2) for i in range(K)) + " // before-after"
inside = [0.0]
_build = _cl._Program._build
def timed(self, *a, **k):
    t = time.perf_counter()
    try: return _build(self, *a, **k)
    finally: inside[0] += time.perf_counter() - t
_cl._Program._build = timed
t0 = time.perf_counter(); prg = cl.Program(ctx, SRC).build(); t1 = time.perf_counter()
q = cl.CommandQueue(ctx); a = np.ones(256, np.float32)
buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=a)
for knl in prg.all_kernels(): knl(q, a.shape, (32,), buf)
q.finish()
print(json.dumps({"build_ms": (t1 - t0) * 1e3, "pocl_ms": inside[0] * 1e3}))
PYC
export PYOPENCL_CTX=portable ASYNCCLCACHE_BAKE=off
POCL_CACHE_DIR=$W/plain "$PY" "$W/child.py" plain "$K" >/dev/null
POCL_CACHE_DIR=$W/cold ASYNCCLCACHE_DIR=$W/acc PYTHONPATH=$NEW "$PY" "$W/child.py" acc "$K" >/dev/null
for i in $(seq "$N"); do for l in plain old new; do
  n=$(mktemp -d "$W/nodeXXXX")
  [ $l = plain ] && cp -r "$W/plain" "$n/pocl"
  src=; [ $l = old ] && src=$OLD; [ $l = new ] && src=$NEW
  echo "$l $(POCL_CACHE_DIR=$n/pocl XDG_CACHE_HOME=$n/xdg ASYNCCLCACHE_NODE_DIR=$n/nl ASYNCCLCACHE_DIR=$W/acc \
    PYTHONPATH=$src "$PY" "$W/child.py" $([ $l = plain ] && echo plain || echo acc) "$K")"
  rm -rf "$n"
done; done | "$PY" -c "
import sys, json, statistics as st, collections
d = collections.defaultdict(list)
for l in sys.stdin:
    m, j = l.split(' ', 1); d[m].append(json.loads(j))
print('$K kernels, $N sittings, medians (ms); against pocl folder: per sitting')
for m, v in d.items():
    diff = st.median(a['build_ms'] - b['build_ms'] for a, b in zip(v, d['plain']))
    print(f'{m:6s} build {st.median(x[\"build_ms\"] for x in v):.2f} pocl inside {st.median(x[\"pocl_ms\"] for x in v):.2f} against pocl folder {diff:+.2f}')
"
