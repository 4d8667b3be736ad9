#!/usr/bin/env bash
# Source this on the lent GPU machine for pocl's CUDA device (issue 29): unpacks pocl 6.0 built
# with it (.devcarry/pocl-cuda-6.0.tar.xz, made by shared/tools/pocl-cuda.sh), installs the
# carried wheels (.whl: pyopencl and what it needs), and points the ICD loader at that pocl only.
mkdir -p /tmp/pc && tar -xJf .devcarry/pocl-cuda-6.0.tar.xz -C /tmp/pc || return 1
# shellcheck disable=SC1091
source /tmp/pc/pocl-cuda-6.0/env.sh || return 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export PYOPENCL_CTX=port PYTHONUNBUFFERED=1
echo "pocl: $(cat "$OCL_ICD_VENDORS"/*.icd); POCL_DEVICES=$POCL_DEVICES POCL_CUDA_TOOLKIT_PATH=$POCL_CUDA_TOOLKIT_PATH"
