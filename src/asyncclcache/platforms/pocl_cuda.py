"""pocl's CUDA device (``POCL_DEVICES=cuda``, ``PYOPENCL_CTX=port:tesla``): everything the
package knows of it beyond pocl's own record (:mod:`.pocl`).

**What a build does there** (pocl 5.0-7.1, ``lib/CL/devices/cuda/pocl-cuda.c``; measured
on pocl 6.0, docs/design.md F27): the build writes the program's folder in pocl's kernel
cache, ``program.bc`` (the LLVM IR with pocl's kernel library linked in),
``program.bc.Ofs.ptx`` (one PTX for all kernels, made by LLVM's NVPTX back end from
``program.bc`` and ``libdevice``), ``last_accessed``, and loads that PTX with
``cuModuleLoad``, where NVIDIA's driver compiles it to machine code, keeping the result in
its compute cache (:mod:`.nvidia`, F19). All of it at the build: launches compile nothing,
no variant per kernel or work-group size (``compile_kernel`` is empty).

**Its binary query** compiles nothing (a copy), but the binary holds ``program.bc`` and no
PTX: a new node built from it runs pocl's passes, NVPTX and the driver's compile again.
**What auto picks**: both caches, as one entry (:data:`LAYOUT`, driver
``kcache-pocl-cuda``): pocl's folder and the compute-cache files its build added, restored
together; a new node compiles nothing. Where only one of the two is on, that one (the
reason says what a new node still compiles); where neither is, ``thread`` (its binary).

**Its settings**, in the key beside every ``POCL_*`` but pocl's :data:`~.pocl.NOT_CODE`
(``POCL_CUDA_GPU_ARCH``: 6.0 and later target ``min(cc, 75)`` by default, so an H200
gets ``sm_75``; ``POCL_CUDA_TOOLKIT_PATH``; ``POCL_WORK_GROUP_METHOD``): NVIDIA's
code-changing ``CUDA_*`` (:data:`.nvidia.SETTINGS`: the compute cache's place, size and
switch are not code, as on NVIDIA's own OpenCL), ``CUDA_HOME``, and the content of the
``libdevice`` that pocl links (:func:`libdevice`), which pocl's folder name misses.

Pure functions of the environment (the digest of a file is kept while its stamp holds):
thread- and process-safe.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..platform import Layout, Part, Platform, Settings
from . import nvidia, pocl

if TYPE_CHECKING:
    import pyopencl as cl

__all__ = ["LAYOUT", "PARTS", "PLATFORM", "SETTINGS", "device_settings", "is_cuda_device", "libdevice"]

#: PCI vendor id that pocl's CUDA device reports (``dev->vendor_id = 0x10de``).
NVIDIA_VENDOR_ID = 0x10DE


def is_cuda_device(device: cl.Device) -> bool:
    """True for pocl's CUDA device: a GPU of pocl's platform with NVIDIA's vendor id."""
    import pyopencl as cl

    return (device.platform.name == pocl.NAME and bool(device.type & cl.device_type.GPU)
            and device.vendor_id == NVIDIA_VENDOR_ID)


# {{{ settings

#: Where pocl 5.0-7.1 look for ``libdevice.10.bc`` (``findLibDevice`` in ``pocl-ptx-gen.cc``):
#: each base folder, then each of these below it. The first base is ``POCL_CUDA_TOOLKIT_PATH``,
#: or the toolkit folder pocl was configured with (not known here: skipped).
_BASES = ("/usr/local/lib/cuda", "/usr/local/lib", "/usr/lib")
_NVVM = ("/nvvm", "/nvidia-cuda-toolkit", "")

_digest_lock = threading.Lock()
_digests: dict[str, tuple[tuple[int, int, int], str]] = {}


def libdevice(env: Mapping[str, str]) -> Path | None:
    """The ``libdevice`` that pocl links into every program on its CUDA device, as pocl
    looks for it, or ``None`` where none is found."""
    bases = [env.get("POCL_CUDA_TOOLKIT_PATH"), env.get("CUDA_HOME", "/usr/local/cuda"), *_BASES]
    for base in bases:
        if base is None:
            continue
        for sub in _NVVM:
            path = Path(f"{base}{sub}/libdevice/libdevice.10.bc")
            if path.is_file():
                return path
    return None


def _file_digest(path: Path) -> str:
    # Kept while the file's stamp holds: read once per process and libdevice.
    try:
        st = os.stat(path)
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        with _digest_lock:
            kept = _digests.get(str(path))
        if kept is not None and kept[0] == stamp:
            return kept[1]
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:32]
    except OSError as e:
        return f"unreadable: {e.strerror}"
    with _digest_lock:
        _digests[str(path)] = (stamp, digest)
    return digest


def device_settings(device: cl.Device, env: Mapping[str, str]) -> dict[str, str]:
    """What of ``env`` changes the code of pocl's CUDA device beyond ``POCL_*``: NVIDIA's
    code-changing ``CUDA_*`` (``CUDA_HOME`` among them) and the libdevice's content."""
    if not is_cuda_device(device):
        return {}
    out = nvidia.SETTINGS.select(env)
    found = libdevice(env)
    out["pocl_cuda_libdevice"] = "none found" if found is None else _file_digest(found)
    return out


#: pocl's settings (every ``POCL_*`` but what is no code, at every build), and these.
SETTINGS: Settings = dataclasses.replace(pocl.SETTINGS, per_device=device_settings, per_device_files=True)

# }}}

# {{{ its caches, stored together

#: pocl's folder of a program on its CUDA device: its build writes every file.
POCL_FOLDERS = dataclasses.replace(pocl.LAYOUT, what="pocl's kernel cache", launches_add=False)

POCL_PREFIX = "pocl"
NV_PREFIX = "nv"


def _locate_pocl(devices: Sequence[cl.Device]) -> tuple[Path | None, str]:
    root = pocl.kernel_cache_dir()
    if root is None:
        return None, (f"pocl's kernel cache is off (POCL_KERNEL_CACHE="
                      f"{os.environ.get('POCL_KERNEL_CACHE')!r}; pocl reads only a value starting with 1 as on)")
    return root, ""


def _locate_nv(devices: Sequence[cl.Device]) -> tuple[Path | None, str]:
    return nvidia.locate()


#: The two caches, each under its folder in an entry: ``pocl/XX/<hash>/<file>``, ``nv/x/y/<hex>``.
PARTS = (Part(POCL_PREFIX, POCL_FOLDERS, _locate_pocl), Part(NV_PREFIX, nvidia.LAYOUT, _locate_nv))

LAYOUT = Layout(
    strategy="kcache-pocl-cuda",
    what="pocl's kernel cache and NVIDIA's compute cache",
    pattern=re.compile("|".join(f"{p.prefix}/(?:{p.layout.pattern.pattern})" for p in PARTS)),
    depth=0,
    settle=max(p.layout.settle for p in PARTS),
)

#: What a new node still compiles where one part is off.
_STILL = {
    POCL_PREFIX: "a new node runs pocl's compiler again (front end, passes, NVPTX), and the driver "
                 "finds its machine code",
    NV_PREFIX: "a new node skips pocl's compiler, and the driver compiles the PTX again",
}


def locate(devices: Sequence[cl.Device]) -> tuple[Path | None, str]:
    """``(a folder of the caches that are on, which are on and what a new node still
    compiles)``, or ``(None, why neither is on)``."""
    found = [(p, *p.locate(devices)) for p in PARTS]
    on = [(p, root) for p, root, _ in found if root is not None]
    if not on:
        return None, "; ".join(why for _, _, why in found)
    if len(on) == len(found):
        return on[0][1], f"{POCL_FOLDERS.what} ({on[0][1]}) and {nvidia.LAYOUT.what} ({on[1][1]})"
    (part, root), = on
    off = next((p, why) for p, r, why in found if r is None)
    return root, f"only {part.layout.what} ({root}), since {off[1]}: {_STILL[off[0].prefix]}"


# }}}


PLATFORM = Platform(
    names=(pocl.NAME,),
    settings=SETTINGS,
    layout=LAYOUT,
    locate=locate,
    why_cache=("pocl's CUDA device keeps each program's bitcode and PTX in pocl's kernel cache, and "
               "NVIDIA's driver the machine code it compiles from that PTX in its compute cache; the "
               "entry holds what the build added to {note} (docs/design.md F27)"),
    include_rule=pocl.PLATFORM.include_rule,
    devices=is_cuda_device,
    parts=PARTS,
)
