#!/usr/bin/env bash
# Source this on the lent GPU machine (no registry there): installs the carried wheels
# (.whl: pyopencl and what it needs) and points the ICD loader at NVIDIA's OpenCL and pocl.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}
mkdir -p /tmp/icd
nv=$(ls /usr/local/nvidia/lib64/libnvidia-opencl.so* /usr/lib/x86_64-linux-gnu/libnvidia-opencl.so* 2>/dev/null | head -1)
[ -n "$nv" ] && echo "$nv" > /tmp/icd/nvidia.icd
for f in /etc/OpenCL/vendors/*pocl*.icd; do [ -f "$f" ] && cp "$f" /tmp/icd/; done
export OCL_ICD_VENDORS=/tmp/icd
echo "ICDs: $(cat /tmp/icd/*.icd | tr '\n' ' ')"
