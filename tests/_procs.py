"""Support for the tests of helper processes: which processes are alive, modules planted in
a working folder, and a helper target that reports what its start-up got.

Children import this module like :mod:`kernels` (``tests/`` is on their ``PYTHONPATH``).
No side effects on import.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path

#: Modules a helper would import from a working folder if ``python -c``'s "" stayed first
#: on its path: the standard library's (its own start-up, ``multiprocessing``'s) and ours.
PLANTED = ("signal", "hashlib", "json", "socket", "pickle", "threading", "asyncclcache", "pyopencl")

#: The first line of a child's code run in a planted folder: the child itself (a test's
#: ``python -c``, whose PYTHONPATH may end in ":", which names the working folder too) must
#: not import from there; only its helpers are under test.
SAFE_PATH = "import os, sys; sys.path[:] = [p for p in sys.path if p and p != os.getcwd()]\n"


def plant(folder: Path, marks: Path) -> None:
    """Modules in ``folder`` that each leave a file named after themselves in ``marks``."""
    folder.mkdir(parents=True, exist_ok=True)
    marks.mkdir(parents=True, exist_ok=True)
    for name in PLANTED:
        (folder / f"{name}.py").write_text(f"open({str(marks / name)!r}, 'w').close()\n")


def alive(pid: int) -> bool:
    """``pid`` is a process, and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def state(pid: int) -> str | None:
    """The process state letter (``T``: stopped), or ``None`` if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return None


def with_args(*texts: str) -> list[int]:
    """The live processes whose command line holds every one of ``texts``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except OSError:
            continue
        if all(t in cmdline for t in texts) and alive(int(entry)):
            out.append(int(entry))
    return out


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` now."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def gone(pids: Iterable[int], within: float = 10.0) -> bool:
    """Every one of ``pids`` has ended (or is a zombie) within ``within`` seconds."""
    deadline = time.monotonic() + within
    pids = list(pids)
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def report() -> int:
    """A helper target: writes what its start-up got to the file ``argv[1]``, then waits
    for EOF on stdin."""
    from asyncclcache import system

    started = system.started
    info = {
        "pid": os.getpid(), "sid": os.getsid(0), "cwd": os.getcwd(), "path": sys.path,
        "priority": started.priority if started else None,
        "parent_death": started.parent_death if started else None,
        "env": sorted(k for k in os.environ if k.startswith("ASYNCCLCACHE_")),
        "pythonpath": os.environ.get("PYTHONPATH"),
    }
    tmp = Path(sys.argv[1] + ".tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(sys.argv[1])
    sys.stdin.read()
    return 0
