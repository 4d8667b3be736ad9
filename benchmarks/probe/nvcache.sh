#!/bin/bash
# Usage on the device machine, from the project root: WHL=<folder of carried wheels> bash benchmarks/probe/nvcache.sh
# (pyopencl, pytools, platformdirs, siphash24 wheels for its Python; see the device README). Cases:
# cold from source, same node, a copied cache dir (a new node), PTX with an empty / a copied cache,
# the cache without its index file, two caches merged file by file, two processes on one cache.
set -u; cd "$(dirname "$0")"
T=$(mktemp -d); mkdir -p $T/vendors; cp /etc/OpenCL/vendors/*.icd $T/vendors/ 2>/dev/null
f=$(find / -xdev -name 'libnvidia-opencl.so*' 2>/dev/null | head -1); echo "$f" > $T/vendors/nvidia.icd
export OCL_ICD_VENDORS=$T/vendors
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $T/site "$WHL"/*.whl && export PYTHONPATH=$T/site || exit
P="python3 nvcache.py"; W=$T/w; mkdir -p $W
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
lsc() { echo "--- $1: $(find $1 -type f | wc -l) files"; find $1 -type f -printf '%P %s\n' | sort | head -${2:-12}; }
# 1 cold from source into A, 2 warm same node, 3 whole copy to B (new node), 4 PTX load with empty and with copied cache
CUDA_CACHE_PATH=$W/A/cc $P src x; lsc $W/A/cc 30
CUDA_CACHE_PATH=$W/A/cc $P src x
cp -a $W/A $W/B; CUDA_CACHE_PATH=$W/B/cc $P src x
mkdir -p $W/E; cp -a $W/A/ptx $W/E/; CUDA_CACHE_PATH=$W/E/cc $P ptx x
cp -a $W/A $W/F; CUDA_CACHE_PATH=$W/F/cc $P ptx x
# 5 without the index file(s): which file is the index?
cp -a $W/A $W/G; ls -la $W/G/cc; find $W/G/cc -maxdepth 1 -type f -name 'index*' -delete; CUDA_CACHE_PATH=$W/G/cc $P src x
# 6 merge: programs 0-9 in C1, 10-19 in C2, union of files (C1's index wins) into M; then all 20
CUDA_CACHE_PATH=$W/C1/cc $P src x 0 9; CUDA_CACHE_PATH=$W/C2/cc $P src x 10 19
mkdir -p $W/M; cp -a $W/C2/cc $W/M/; cp -a $W/C1/cc/. $W/M/cc/; cp -a $W/A/ptx $W/M/
CUDA_CACHE_PATH=$W/M/cc $P src x 0 9; CUDA_CACHE_PATH=$W/M/cc $P src x 10 19
# 7 entries of one program only: diff of file lists between C1 runs
lsc $W/C1/cc 40; lsc $W/C2/cc 40
# 8 two processes at once on one cache dir
CUDA_CACHE_PATH=$W/S/cc $P src x 0 9 & CUDA_CACHE_PATH=$W/S/cc $P src x 0 9 & wait
CUDA_CACHE_PATH=$W/S/cc $P src x 0 9
