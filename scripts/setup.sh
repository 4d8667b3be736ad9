#!/usr/bin/env bash
# Make a fresh Debian machine ready: pocl from apt (if missing), a venv, the package.
# Usage: scripts/setup.sh [EXTRAS]   (EXTRAS e.g. "test" or "test,mpi")
# Says what it installs; waits for another apt that holds the lock (APT_LOCK_WAIT seconds,
# default 600); fails naming what could not be installed. With the extra "test" it also
# installs what the tests use (Mesa's rusticl, Slurm, munge, strace, e2fsprogs, Intel's
# runtime) where it may: as root, or with sudo that asks no password. Under CI=true each of
# them must install (the tests fail where one is missing: tests/conftest.py need()).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/apt.sh
extras="${1:-}"
venv="${VENV:-.venv}"
ci=""
case "${CI:-}" in 1 | [Tt]rue | TRUE | [Yy]es | on) ci=1 ;; esac
tests=""
[[ ",$extras," == *",test,"* ]] && tests=1

apt_install "OpenCL on the CPU, for pyopencl" pocl-opencl-icd ocl-icd-libopencl1

if [ -n "$tests" ]; then
    # What the tests run on besides pocl; system-wide, so only where we may install without
    # asking (a user's sudo password prompt in the middle of `make test` would be a surprise).
    test_pkgs=(mesa-opencl-icd e2fsprogs strace slurmctld slurmd slurm-client munge)
    mapfile -t absent < <(apt_missing "${test_pkgs[@]}")
    if [ "${#absent[@]}" -gt 0 ] && [ "$(id -u)" -ne 0 ]; then
        if sudo -n true 2>/dev/null; then
            export APT_SUDO="sudo -n"
        elif [ -n "$ci" ]; then
            echo "setup: error: CI=true and the tests need Debian's ${absent[*]}: run as root or with sudo" >&2
            exit 1
        else
            echo "setup: not installing Debian's ${absent[*]} (not root, and sudo asks a password):" \
                "the tests that need them skip, saying so" >&2
            absent=()
        fi
    fi
    if [ "${#absent[@]}" -gt 0 ]; then
        # Mesa's rusticl (RUSTICL_ENABLE=llvmpipe): a second real driver. Mesa's ICD is system-wide.
        apt_install "Mesa's OpenCL ICD, rusticl, a second driver for the tests" mesa-opencl-icd
        # An ext4 with 1-second stamps (mkfs.ext4 -I 128), strace to count file operations.
        apt_install "the tests' 1-second file system and their count of file operations" e2fsprogs strace
        # A private Slurm (tests/_slurm.py: munged, slurmctld, slurmd as root).
        apt_install "the tests' private Slurm" --no-install-recommends slurmctld slurmd slurm-client munge
    fi
fi

if [ ! -x "$venv/bin/python" ]; then
    echo "setup: making the virtual environment $venv (python3 -m venv)" >&2
    python3 -m venv "$venv" || {
        echo "setup: error: python3 -m venv failed (Debian: apt-get install python3-venv)" >&2
        exit 1
    }
fi
spec="."
[ -n "$extras" ] && spec=".[$extras]"
echo "setup: installing the package into $venv: pip install -e '$spec'" >&2
log="$(mktemp)"
if ! { "$venv/bin/python" -m pip install -q --disable-pip-version-check -U pip &&
    "$venv/bin/python" -m pip install -q --disable-pip-version-check -e "$spec"; } >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    echo "setup: error: pip could not install '$spec' into $venv" >&2
    exit 1
fi
rm -f "$log"

# Intel's oneAPI OpenCL CPU runtime from PyPI, a third real driver for the tests (tests/test_intel.py,
# docs/design.md F23). Its wheel's ICD file names a placeholder path: the tests write their own and
# point OCL_ICD_VENDORS at it (nothing in /etc). Wheels exist for x86-64 only: elsewhere its tests skip.
if [ -n "$tests" ] && [ ! -e "$venv/lib/libintelocl.so" ]; then
    if [ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]; then
        echo "setup: Intel's OpenCL CPU runtime has no wheel for $(uname -s) $(uname -m): tests/test_intel.py skips" >&2
    else
        echo "setup: installing Intel's OpenCL CPU runtime into $venv (intel-opencl-rt from PyPI, for the tests)" >&2
        log="$(mktemp)"
        if ! "$venv/bin/python" -m pip install -q --disable-pip-version-check --only-binary=:all: \
            intel-opencl-rt intel-cmplr-lib-rt >"$log" 2>&1; then
            tail -n 20 "$log" >&2
            rm -f "$log"
            if [ -n "$ci" ]; then
                echo "setup: error: CI=true and intel-opencl-rt could not be installed" >&2
                exit 1
            fi
            echo "setup: intel-opencl-rt could not be installed here: tests/test_intel.py skips" >&2
        fi
        rm -f "$log"
    fi
fi
"$venv/bin/python" -c "import asyncclcache, pyopencl"
echo "setup: ready: $venv/bin/python, $venv/bin/asyncclcache (. $venv/bin/activate puts them on the PATH)" >&2
