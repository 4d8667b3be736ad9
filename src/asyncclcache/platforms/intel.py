"""Intel's oneAPI OpenCL CPU runtime (PyPI ``intel-opencl-rt``): everything the package
knows of it (docs/design.md F23).

**Its settings** (:data:`SETTINGS`): every ``CL_CONFIG_*`` but threads and logging, and
the ``cl.cfg`` in effect (:func:`intel_cl_cfg`), all read once, when the runtime starts
(measured: one changed after that changes no code). **Its own cache**: none this package
knows the layout of; its include rule was not measured (a doubt); its binary query is a
copy, so ``auto`` picks ``thread``.

Functions of the environment and the files named: thread- and process-safe.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat

from .. import system
from ..platform import Platform, Settings

__all__ = ["INTEL_CL_CFG", "NAMES", "PLATFORM", "SETTINGS", "intel_cl_cfg", "intel_library_dirs"]

#: Its platform names, new and old.
NAMES = ("Intel(R) OpenCL", "Intel(R) CPU Runtime for OpenCL(TM) Applications")
#: The name of the key's field that holds the digest of the ``cl.cfg`` in effect.
INTEL_CL_CFG = "intel_cl_cfg"

_INTEL_LIB_RE = re.compile(r"/libintelocl\.so(?:\.[0-9.]+)?$")


def _regular_file_digest(path: str) -> tuple[str | None, str | None]:
    """``(sha256, None)`` of the regular file at ``path``; ``(None, None)`` where nothing is
    there; ``(None, why)`` where something is there that cannot be read as a file. Never
    blocks on a FIFO (``O_NONBLOCK``) and never follows a link to a device."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"{path} cannot be opened: {e.strerror or e}"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None, f"{path} is not a regular file"
        digest = hashlib.sha256()
        while chunk := os.read(fd, 1 << 16):
            digest.update(chunk)
        return digest.hexdigest(), None
    except OSError as e:
        return None, f"{path} cannot be read: {e.strerror or e}"
    finally:
        os.close(fd)


def intel_library_dirs(maps: str = "/proc/self/maps") -> set[str] | None:
    """The folders of the ``libintelocl.so`` mapped into this process (the runtime finds
    its own ``cl.cfg`` the same way), or ``None`` where the system does not say
    (:func:`.system.mapped_files`)."""
    paths = system.mapped_files(maps)
    if paths is None:
        return None
    return {os.path.dirname(p) for p in paths if _INTEL_LIB_RE.search(p)}


def intel_cl_cfg(maps: str = "/proc/self/maps") -> tuple[dict[str, str], str | None]:
    """``({INTEL_CL_CFG: digest}, None)`` of the ``cl.cfg`` that Intel's CPU runtime reads,
    or why it cannot be known. Intel opens ``cl.cfg`` in the working folder first, then
    beside its library (strace, 2026.2.0); neither there: its built-in defaults
    (``"none"``). Something there that is not a readable regular file: unknown."""
    digest, why = _regular_file_digest("cl.cfg")
    if why is not None or digest is not None:
        return {INTEL_CL_CFG: digest if digest is not None else f"unknown: {why}"}, why
    dirs = intel_library_dirs(maps)
    if not dirs:
        why = ("its library does not show in /proc/self/maps" if dirs is not None
               else "/proc/self/maps cannot be read")
        why = f"which cl.cfg Intel's CPU runtime reads is unknown: {why}"
        return {INTEL_CL_CFG: f"unknown: {why}"}, why
    if len(dirs) > 1:
        why = f"Intel's CPU runtime is loaded from several folders {sorted(dirs)}"
        return {INTEL_CL_CFG: f"unknown: {why}"}, why
    digest, why = _regular_file_digest(os.path.join(dirs.pop(), "cl.cfg"))
    if why is not None:
        return {INTEL_CL_CFG: f"unknown: {why}"}, why
    return {INTEL_CL_CFG: "none" if digest is None else digest}, None


SETTINGS = Settings(
    # Measured: CL_CONFIG_CPU_TARGET_ARCH, _USE_VECTORIZER, _CPU_VECTORIZER_MODE, _USE_VTUNE,
    # _USE_FAST_RELAXED_MATH and _CPU_FORCE_MAX_WORK_GROUP_SIZE change the binary; cl.cfg
    # documents more (loop unrolling, streaming stores, memory optimizations...).
    prefixes=("CL_CONFIG_",),
    # Threads and logging: the same binary bytes measured with each (2026.2.0); the dumps
    # only write copies of what was built into the working folder.
    not_code=frozenset({
        "CL_CONFIG_CPU_TBB_NUM_WORKERS", "CL_CONFIG_LOG_FILE", "CL_CONFIG_USER_LOGGER",
        "CL_CONFIG_DUMP_BIN", "CL_CONFIG_DUMP_ASM", "CL_CONFIG_DUMP_DISASSEMBLY",
        "CL_CONFIG_DUMP_IR_AFTER_OPTIMIZER", "CL_CONFIG_DUMP_IR_BEFORE_OPTIMIZER",
        "CL_CONFIG_DUMP_FILE_NAME_PREFIX",
    }),
    files=intel_cl_cfg,
)

PLATFORM = Platform(names=NAMES, settings=SETTINGS)
