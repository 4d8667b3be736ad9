#!/bin/bash
# Usage: WAVE=<folder> run.sh R MODE POCL [NSTEPS] [warm]
#   R      number of MPI ranks (mpiexec -n R, MPICH)
#   MODE   nocache | acc      (acc: asyncclcache via ASYNCCLCACHE_INSTALL=1)
#   POCL   own | shared       (pocl kernel cache: one dir per rank | one for all)
#   NSTEPS time steps (default 2)
#   warm   run the job twice in the same fresh dirs, report only the 2nd run:
#          acc:     before run 2, pocl caches, XDG_CACHE_HOME (pyopencl/loopy/
#                   pytools caches), TMPDIR and asyncclcache's node-local copies
#                   are emptied; only ASYNCCLCACHE_DIR is kept ("new node, warm
#                   shared cache")
#          nocache: plain second run, every cache kept
# Runs grudge's examples/wave/wave-op-mpi.py --lazy (patched copy:
# wave-op-mpi-timed.py, README.md) with every cache empty at the start (fresh temp dirs).
# Prints one JSON line on stdout. Log of each run: $WAVE/logs/.
# Env knobs: WAVE_KEEP=1 keeps the temp dir; WAVE_ACC_STEP=0 disables the
# `with asyncclcache.step():` around step 0 in acc mode (default 1).
set -euo pipefail

HERE=${WAVE:-/work/grudge}  # the venv, the timed example (README.md), logs/
WRAP=$(cd "$(dirname "$0")" && pwd)/rank_wrap.sh
R=${1:?usage: run.sh R MODE POCL [NSTEPS] [warm]}
MODE=${2:?MODE nocache|acc}
POCL=${3:?POCL own|shared}
NSTEPS=${4:-2}
WARM=${5:-}
case "$MODE" in nocache|acc) ;; *) echo "bad MODE $MODE" >&2; exit 2;; esac
case "$POCL" in own|shared) ;; *) echo "bad POCL $POCL" >&2; exit 2;; esac
case "$WARM" in ""|warm) ;; *) echo "bad 5th arg $WARM (want: warm)" >&2; exit 2;; esac

PY=$HERE/venv/bin/python
ACCCLI=$HERE/venv/bin/asyncclcache
mkdir -p "$HERE/logs"
STAMP=$(date +%Y%m%d-%H%M%S)-$$
LOG=$HERE/logs/$STAMP-R$R-$MODE-$POCL-n$NSTEPS${WARM:+-warm}.log
BASE=$(mktemp -d /tmp/wave-run.XXXXXX)
trap '[ "${WAVE_KEEP:-0}" = 1 ] || rm -rf "$BASE"' EXIT

# clean environment: nothing inherited from the caller's cache settings
for v in $(env | sed -n 's/^\(ASYNCCLCACHE_[A-Z_]*\)=.*/\1/p; s/^\(POCL_[A-Z_]*\)=.*/\1/p'); do
  unset "$v"
done
unset PYOPENCL_NO_CACHE LOOPY_NO_CACHE PYTOOLS_NO_CACHE || true

export PYOPENCL_CTX=portable
export XDG_CACHE_HOME=$BASE/xdg          # pyopencl, loopy, pytools persistent dicts
export TMPDIR=$BASE/tmp
export WAVE_BASE=$BASE WAVE_POCL=$POCL   # read by rank_wrap.sh (POCL_CACHE_DIR)
if [ "$MODE" = acc ]; then
  export ASYNCCLCACHE_INSTALL=1
  export ASYNCCLCACHE_DIR=$BASE/acc
  export ASYNCCLCACHE_NODE_DIR=$BASE/accnode
  export ASYNCCLCACHE_STATS=1
  export WAVE_ACC_STEP=${WAVE_ACC_STEP:-1}
else
  export ASYNCCLCACHE_INSTALL=0
  export WAVE_ACC_STEP=0
fi

reset_node_dirs() {   # pocl caches, XDG caches, tmp, node-local copies: emptied
  rm -rf "$BASE/xdg" "$BASE/tmp" "$BASE/pocl" "$BASE/accnode"
  mkdir -p "$BASE/xdg" "$BASE/tmp" "$BASE/pocl"
  if [ "$MODE" = acc ]; then mkdir -m 700 -p "$BASE/accnode"; fi
}
reset_node_dirs
if [ "$MODE" = acc ]; then mkdir -m 700 -p "$BASE/acc"; fi

run_once() {  # $1 = label; writes $BASE/time.$1 and appends to $LOG
  local label=$1
  {
    echo "===== run $label: R=$R MODE=$MODE POCL=$POCL NSTEPS=$NSTEPS $(date -Is)"
    echo "===== dirs before: $(cd "$BASE" && find . -type f | wc -l) files under $BASE"
  } >>"$LOG"
  cd "$HERE"
  /usr/bin/time -f '%e %U %S' -o "$BASE/time.$label" \
    mpiexec -n "$R" "$WRAP" "$PY" "$HERE/wave-op-mpi-timed.py" \
      --lazy --nsteps "$NSTEPS" >>"$LOG" 2>&1 || {
        echo "run.sh: mpiexec failed, see $LOG" >&2; tail -30 "$LOG" >&2; exit 1; }
}

if [ "$WARM" = warm ]; then
  run_once 1
  if [ "$MODE" = acc ]; then reset_node_dirs; fi
  echo "===== (warm) second run follows; acc dir kept, node dirs $([ "$MODE" = acc ] && echo emptied || echo kept)" >>"$LOG"
  OFFSET=$(wc -l <"$LOG")
  run_once 2
  LABEL=2
else
  OFFSET=0
  run_once 1
  LABEL=1
fi

ACC_INFO="null"
if [ "$MODE" = acc ]; then
  ACC_INFO=$("$ACCCLI" info --dir "$ASYNCCLCACHE_DIR" --json 2>/dev/null || echo null)
  echo "===== asyncclcache info: $ACC_INFO" >>"$LOG"
fi

"$PY" - "$LOG" "$OFFSET" "$BASE/time.$LABEL" "$R" "$MODE" "$POCL" "$NSTEPS" "$WARM" "$ACC_INFO" "$BASE" <<'EOF'
import json, sys
log, offset, tfile, R, mode, pocl, nsteps, warm, acc_info, base = sys.argv[1:]
lines = open(log, errors="replace").read().splitlines()[int(offset):]
timing = None
acc_lines = []
for ln in lines:
    if "WAVE_TIMING " in ln:  # ranks' output may share the line
        timing = json.JSONDecoder().raw_decode(ln.split("WAVE_TIMING ", 1)[1])[0]
    if ln.startswith("asyncclcache") and ("hits" in ln or "misses" in ln):
        acc_lines.append(ln.strip())
wall, user, sys_ = (float(x) for x in open(tfile).read().split()[-3:])
out = {"R": int(R), "mode": mode, "pocl": pocl, "nsteps": int(nsteps),
       "warm": warm == "warm",
       "first_step_s": round(timing["first_step_s"], 3) if timing else None,
       "wall_s": round(wall, 2), "cpu_s": round(user + sys_, 2)}
if timing:
    out["later_steps_s"] = [round(x, 3) for x in timing["later_steps_max_s"]]
    out["setup_s"] = round(timing["setup_max_s"], 2)
    out["to_first_step_s"] = round(timing["to_first_step_max_s"], 3)
    out["first_step_per_rank_s"] = [round(x, 3) for x in timing["first_step_per_rank"]]
if mode == "acc":
    try:
        info = json.loads(acc_info)
    except Exception:
        info = None
    out["acc_entries"] = info.get("entries") if isinstance(info, dict) else None
    out["acc_stats"] = acc_lines[-1] if acc_lines else None
out["log"] = log
print(json.dumps(out))
EOF
