#!/bin/bash
# A real test suite as CI runs it: a new machine every run (empty pocl kernel cache), one cache folder
# restored. pyopencl's own tests, from the sdist of the pyopencl that PY has (the wheel has no tests).
#   PY=<python with pyopencl, pytest, mako and this project> ../shared/tools/ci-suite.sh [test files]
#   default files: test_array.py test_clmath.py; REPS=3 sittings; OUT=<folder for logs> (default: a temp one)
# Each sitting runs, one after the other, each a fresh process:
#   none   : no asyncclcache, empty POCL_CACHE_DIR                       (a CI run today)
#   cold   : ASYNCCLCACHE_INSTALL=1, empty cache directory and pocl cache (the first CI run)
#   pocl   : no asyncclcache, none's POCL_CACHE_DIR restored            (the alternative: cache pocl's folder)
#   new    : asyncclcache, cold's directory restored, empty pocl cache  (every later CI run)
#   baked  : new, after `python -m asyncclcache bake` of that directory (docs/ci.md's last step)
# and prints per sitting the seconds of each run and the seconds spent inside Program.build (a timer
# plugin), then the medians and the ratios cold/none, new/pocl, baked/pocl. Python-side caches (pytools)
# are warmed once first, so all runs differ only in OpenCL caching. Needs pocl (PYOPENCL_TEST=portable).
set -u
PY=${PY:?set PY to a python with pyopencl, pytest, mako and asyncclcache}
REPS=${REPS:-3}; FILES=${*:-test_array.py test_clmath.py}
W=$(mktemp -d); OUT=${OUT:-$W/logs}; mkdir -p "$OUT"
trap 'rm -rf "$W"' EXIT
ver=$("$PY" -c "import pyopencl; print(pyopencl.VERSION_TEXT)") || exit 1
"$PY" -m pip download -q --no-deps --no-binary pyopencl "pyopencl==$ver" -d "$W/sdist" >/dev/null 2>&1 \
  || { echo "could not download pyopencl $ver's sdist"; exit 1; }
tar -xzf "$W"/sdist/pyopencl-*.tar.gz -C "$W" && S=$(echo "$W"/pyopencl-*/test) || exit 1
cat > "$W/buildtimer.py" <<'PYT'
import sys, time, pytest
_t = [0.0, 0]
@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    import pyopencl as cl
    orig = cl.Program.build
    def timed(self, *a, **k):
        t = time.perf_counter()
        try:
            return orig(self, *a, **k)
        finally:
            _t[0] += time.perf_counter() - t; _t[1] += 1
    cl.Program.build = timed
def pytest_unconfigure(config):
    sys.stderr.write(f"\nBUILDTIME {_t[1]} {_t[0]:.2f}\n")
PYT
for v in $(compgen -e); do case "$v" in ASYNCCLCACHE_*|POCL_*|PYOPENCL_NO_CACHE) unset "$v";; esac; done
export PYOPENCL_TEST=${PYOPENCL_TEST:-portable} PYTHONPATH="$W${PYTHONPATH:+:$PYTHONPATH}"
run() {  # run LABEL POCL_DIR [ACC_DIR]  -> "seconds build_seconds passed"
  local t0 t1 log="$OUT/$1.log"
  t0=$(date +%s.%N)
  ( cd "$S" && env ${4:+PYTHONPATH=$4:$W} POCL_CACHE_DIR="$2" ${3:+ASYNCCLCACHE_INSTALL=1 ASYNCCLCACHE_DIR=$3 ASYNCCLCACHE_STATS=1} \
      timeout 3600 "$PY" -m pytest -q --no-header -p no:cacheprovider -p buildtimer $FILES ) >"$log" 2>&1
  t1=$(date +%s.%N)
  echo "$(echo "$t1 - $t0" | bc) $(grep -Eo '^BUILDTIME [0-9]+ [0-9.]+' "$log" | awk '{print $3}') $(grep -Eo '[0-9]+ passed' "$log" | tail -1 | grep -Eo '[0-9]+')"
}
( cd "$S" && POCL_CACHE_DIR="$W/warm-py" timeout 3600 "$PY" -m pytest -q -p no:cacheprovider $FILES >/dev/null 2>&1 )
echo "cold old/new: pyopencl $ver, $FILES, $REPS sittings"
for r in $(seq 1 "$REPS"); do
  d=$W/s$r; mkdir -p "$d"
  if [ $((r % 2)) = 1 ]; then
    read tn bn pn < <(run none-$r "$d/pocl-none")
    read to bo po < <(run old-$r "$d/pocl-old" "$d/acc-old" /tmp/bclone/src)
    read tc bc pc < <(run new-$r "$d/pocl-new" "$d/acc-new" /tmp/bcis/src)
  else
    read tc bc pc < <(run new-$r "$d/pocl-new" "$d/acc-new" /tmp/bcis/src)
    read to bo po < <(run old-$r "$d/pocl-old" "$d/acc-old" /tmp/bclone/src)
    read tn bn pn < <(run none-$r "$d/pocl-none")
  fi
  echo "sitting $r: none $tn ($bn) old $to ($bo) new $tc ($bc); passed $pn/$po/$pc; old/none $(echo "$to / $tn" | bc -l | cut -c1-5) new/none $(echo "$tc / $tn" | bc -l | cut -c1-5)"
  grep -h "asyncclcache:" "$OUT/old-$r.log" "$OUT/new-$r.log" | tail -2
  rm -rf "$d"
done
