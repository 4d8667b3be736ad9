#!/bin/bash
# busy.sh SRC LABEL N : the cisuite "busy cold" run, with pytest's capture off (-s), N times
SRC=$1; LABEL=$2; N=$3
T=/tmp/rep/test
PY=/work/main/.venv/bin/python
for i in $(seq $N); do
  W=/tmp/rep/w-$LABEL-$i; rm -rf $W; mkdir -p $W/node/xdg $W/acc
  ( cd $T && env -u PYTHONDONTWRITEBYTECODE PYOPENCL_TEST=portable PYTHONPATH=$SRC:$T \
      POCL_CACHE_DIR=$W/node/pocl XDG_CACHE_HOME=$W/node/xdg CUDA_CACHE_PATH=$W/node/cuda MESA_SHADER_CACHE_DIR=$W/node/mesa \
      ASYNCCLCACHE_NODE_DIR=$W/node/nl ASYNCCLCACHE_INSTALL=1 ASYNCCLCACHE_DIR=$W/acc ASYNCCLCACHE_STATS=1 CI=true ASYNCCLCACHE_BAKE=exit \
      timeout 900 $PY -X faulthandler -m pytest -q -s --no-header -p no:cacheprovider -p acc_buildtimer test_array.py test_clmath.py > /tmp/rep/$LABEL-$i.log 2>&1 )
  echo "$LABEL $i rc=$? $(grep -c PASSED /tmp/rep/$LABEL-$i.log) $(tail -1 /tmp/rep/$LABEL-$i.log | cut -c1-150)"
done
