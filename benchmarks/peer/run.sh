#!/bin/bash
# boxtree's test_tree.py on pocl's CPU device: PEER=/tmp/peer run.sh nocache|acc|acc-idle [-k EXPR]
# (set-up: README.md). Prints pytest's line, the asyncclcache summary line and wall/CPU seconds.
set -uo pipefail
MODE=${1:-}; shift || true
case "$MODE" in nocache|acc|acc-idle) ;; *) echo "usage: $0 nocache|acc|acc-idle [-k EXPR]" >&2; exit 2;; esac
PEER=${PEER:-/tmp/peer}
R=$PEER/run-$MODE-$(date +%Y%m%d-%H%M%S)
mkdir -p "$R/pocl" "$R/acc" "$R/xdg"
for v in $(compgen -e); do
  case "$v" in ASYNCCLCACHE_*|PYOPENCL_*|POCL_*|ARRAYCONTEXT_*) unset "$v";; esac
done
export PYOPENCL_TEST=portable POCL_CACHE_DIR=$R/pocl XDG_CACHE_HOME=$R/xdg
case "$MODE" in
  nocache) export PYOPENCL_NO_CACHE=1 ;;
  *) export ASYNCCLCACHE_INSTALL=1 ASYNCCLCACHE_DIR=$R/acc ASYNCCLCACHE_STATS=1
     [ "$MODE" = acc-idle ] && export ASYNCCLCACHE_BAKE=idle ;;
esac
cd "$PEER"
/usr/bin/time -o "$R/time.txt" -f "%e s wall %U user %S sys" \
  "$PEER/venv/bin/python" -m pytest -p no:cacheprovider -q test_tree.py "$@" > "$R/log.txt" 2>&1
rc=$?
grep -E 'passed|failed|no tests ran' "$R/log.txt" | tail -1
grep '^asyncclcache' "$R/log.txt"
echo "$MODE: $(cat "$R/time.txt")"
exit $rc
