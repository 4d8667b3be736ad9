#!/bin/bash
# Mesa's shader cache as rusticl uses it (issue 19): which files a build, clCreateKernel and the
# first launch add; whether a changed header is seen (beside the source, and through -I); which
# switches turn it off or change its layout; HOME and XDG_CACHE_HOME. Run from an empty folder:
#   RUSTICL_ENABLE=llvmpipe P=python3 bash benchmarks/probe/mesarules.sh   (also inside forky.sh)
set -u; here=$(cd "$(dirname "$0")" && pwd); P=${P:-python3}; C="$P $here/mesarules.py"
export RUSTICL_ENABLE=${RUSTICL_ENABLE:-llvmpipe} MESA_SHADER_CACHE_DIR=$PWD/c1; mkdir -p inc; rm -rf c1 d h
$C 1.0 | tail -1; $C 1.0 | tail -1
echo "#define VAL 1" > h.h; $C inc | tail -1; echo "#define VAL 2" > h.h; $C inc | tail -1
echo "#define VAL 3" > inc/h.h; rm h.h; $C inc -I $PWD/inc | tail -1; echo "#define VAL 4" > inc/h.h; $C inc -I $PWD/inc | tail -1
for v in 1 true 0 ""; do rm -rf d; MESA_SHADER_CACHE_DIR=$PWD/d MESA_SHADER_CACHE_DISABLE=$v $C 5.0 >/dev/null 2>&1
  echo "DISABLE=$v files $(find d -type f 2>/dev/null | wc -l) $(ls d 2>/dev/null)"; done
for e in X=1 MESA_DISK_CACHE_DATABASE=1 MESA_DISK_CACHE_SINGLE_FILE=1 MESA_DISK_CACHE_MULTI_FILE=0 MESA_DISK_CACHE_MULTI_FILE=1; do
  rm -rf d; env MESA_SHADER_CACHE_DIR=$PWD/d $e $C 5.0 >/dev/null 2>&1; echo "$e: $(cd d 2>/dev/null && find . -maxdepth 2 | head -5 | tr "\n" " ")"; done
mkdir -p h/x; (unset MESA_SHADER_CACHE_DIR; HOME=$PWD/h $C 6.0 >/dev/null 2>&1; echo "HOME only: $(cd h; find . -maxdepth 3 | head -4 | tr "\n" " ")"
  XDG_CACHE_HOME=$PWD/h/x $C 6.0 >/dev/null 2>&1; echo "XDG: $(cd h/x; find . -maxdepth 1 | tr "\n" " ")")
