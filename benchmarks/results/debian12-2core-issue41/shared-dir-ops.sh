#!/bin/bash
# usage: run.sh SRC_DIR OUT  -- 16 ranks on 2 simulated nodes, 24 programs, 1000 filler entries; cold then warm
set -e
SRC=$1; OUT=$2; rm -rf $OUT; mkdir -p $OUT
PY=/work/main/.venv/bin/python
export PYTHONPATH=$SRC:/work/main/tests PYOPENCL_CTX=portable ASYNCCLCACHE_BAKE=off ACC_TEST_NODES=2 PMI_SIZE=16
export ASYNCCLCACHE_DIR=$OUT/shared ASYNCCLCACHE_NODE_DIR=$OUT/nodelocal
$PY - <<PY
import sys; sys.path.insert(0, "/work/main/tests")
from _store_helpers import make_entry, key_of
from asyncclcache.store import Store
from asyncclcache import maintenance
from asyncclcache.stats import add_lifetime
s = Store("$OUT/shared", rank_local=False, node_copies=False)
for i in range(1000): s.publish(make_entry(key_of(f"filler {i}"), b"x" * 500))
add_lifetime(s.root, {"runs": 1}); maintenance.upkeep(s)
PY
for job in cold warm; do
  [ $job = warm ] && export ASYNCCLCACHE_NODE_DIR=$OUT/nodelocal-new  # new nodes: nothing copied yet
  start=$($PY -c "import time; print(time.time() + 4)")
  for r in $(seq 0 15); do
    PMI_RANK=$r ACC_TEST_START_AT=$start strace -f -y -qq -e trace=%file,%desc -o $OUT/trace-$job-$r $PY /work/main/tests/_rankjob.py $OUT $job 24 > /dev/null 2>&1 &
  done
  wait
  for r in $(seq 0 15); do grep "$OUT/shared" $OUT/trace-$job-$r | grep -v "resumed>" | grep -vc " execve(" ; done > $OUT/ops-$job.txt
  echo "$job: ops a rank: $(sort -n $OUT/ops-$job.txt | tr '\n' ' ') median $(sort -n $OUT/ops-$job.txt | sed -n 8p)"
  $PY -c "import json,glob; rows=[json.load(open(f)) for f in glob.glob('$OUT/$job-rank*.json')]; print('  hits', sum(r['stats']['hits'] for r in rows), 'misses', sum(r['stats']['misses'] for r in rows), 'writes', sum(r['stats']['writes'] for r in rows), 'ok', all(r['ok'] for r in rows))"
done
