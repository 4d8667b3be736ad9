#!/usr/bin/env bash
# Make a fresh Debian machine ready: pocl from apt (if missing), a venv, the package.
# Usage: scripts/setup.sh [EXTRAS]   (EXTRAS e.g. "test" or "test,mpi")
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
venv="${VENV:-.venv}"

if ! dpkg -s pocl-opencl-icd >/dev/null 2>&1; then
    sudo_cmd=""
    [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
    echo "setup: installing Debian's pocl-opencl-icd" >&2
    $sudo_cmd apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq pocl-opencl-icd ocl-icd-libopencl1 >/dev/null
fi

# The tests also run on Mesa's rusticl (a second real driver, RUSTICL_ENABLE=llvmpipe) where
# Debian has it: mesa-opencl-icd, where we may install it.
if [[ ",$extras," == *",test,"* ]] && ! dpkg -s mesa-opencl-icd >/dev/null 2>&1 && [ "$(id -u)" -eq 0 ]; then
    echo "setup: installing Debian's mesa-opencl-icd (rusticl, for the tests)" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mesa-opencl-icd >/dev/null || true
fi

# The tests mount an ext4 with 1-second stamps (mkfs.ext4 -I 128): e2fsprogs, where we may install it.
if [[ ",$extras," == *",test,"* ]] && ! command -v mkfs.ext4 >/dev/null 2>&1 && [ "$(id -u)" -eq 0 ]; then
    echo "setup: installing Debian's e2fsprogs (for the tests' 1-second file system)" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq e2fsprogs >/dev/null || true
fi

# The tests run real jobs under a private Slurm (tests/_slurm.py: munged, slurmctld, slurmd as
# root), and count file operations with strace: Debian's packages, where we may install them.
if [[ ",$extras," == *",test,"* ]] && [ "$(id -u)" -eq 0 ] && ! { command -v slurmd && command -v strace; } >/dev/null 2>&1; then
    echo "setup: installing Debian's slurmctld, slurmd, slurm-client, munge (for the tests' private Slurm)" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client munge strace >/dev/null || true
fi

if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check -U pip >/dev/null 2>&1 || true
spec="."
[ -n "$extras" ] && spec=".[$extras]"
log="$(mktemp)"
if ! "$venv/bin/python" -m pip install -q --disable-pip-version-check -e "$spec" >"$log" 2>&1; then
    cat "$log" >&2; rm -f "$log"; exit 1
fi
rm -f "$log"

# Intel's oneAPI OpenCL CPU runtime from PyPI, a third real driver for the tests (tests/test_intel.py,
# docs/design.md F23). Its wheel's ICD file names a placeholder path: the tests write their own and
# point OCL_ICD_VENDORS at it (nothing in /etc). No wheel for this machine: its tests skip, saying so.
if [[ ",$extras," == *",test,"* ]] && [ ! -e "$venv/lib/libintelocl.so" ]; then
    echo "setup: installing Intel's OpenCL CPU runtime from PyPI (intel-opencl-rt, for the tests)" >&2
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --only-binary=:all: \
        intel-opencl-rt intel-cmplr-lib-rt >/dev/null 2>&1 \
        || echo "setup: intel-opencl-rt could not be installed here: tests/test_intel.py will skip" >&2
fi
"$venv/bin/python" -c "import asyncclcache, pyopencl"
