"""Settings from the environment, parsed once, in one place.

=============================== ===================================================
``ASYNCCLCACHE_DIR``            cache directory (default: the user cache directory)
``ASYNCCLCACHE_DISABLE``        ``1``: no caching at all, plain pyopencl builds
``ASYNCCLCACHE_RANK_LOCAL``     ``1``: a directory per rank; ``0`` (the default): one for all
``ASYNCCLCACHE_NODE_COPIES``    ``0``: no node-local copies; default: on under a launcher
``ASYNCCLCACHE_NODE_COMPILE``   ``0``: each rank compiles alone; default: once a node under a launcher
``ASYNCCLCACHE_NODE_DIR``       node-local storage for them (default ``$TMPDIR``, else ``/tmp``)
``ASYNCCLCACHE_NODE_MAX_SIZE``  bound of a node's copies (default 2G; ``0``: none)
``ASYNCCLCACHE_STRATEGY``       ``auto`` | ``kcache`` | ``thread`` (``process``, ``sync``: gone, ``auto``)
``ASYNCCLCACHE_WORKERS``        background writer threads (default 1)
``ASYNCCLCACHE_FAILURE_FATAL``  ``1``: background failures raise in ``flush()``
``ASYNCCLCACHE_EXIT_TIMEOUT``   seconds to wait for pending work at exit (default 5)
``ASYNCCLCACHE_MAX_SIZE``       size bound of the directory, e.g. ``500M``
``ASYNCCLCACHE_INSTALL``        ``1``: ``install()`` at interpreter start-up (:mod:`._startup`)
``ASYNCCLCACHE_STATS``          ``1``: one summary line at exit (:mod:`.summary`)
``ASYNCCLCACHE_BAKE``           ``idle``: bake entries on idle cores during the run (:mod:`.bake`);
                                ``exit``: what this process wrote or hit and is not baked yet,
                                when its cache closes (at exit); ``auto`` (the default): ``idle``,
                                but not in one of a job's ranks nor on a single core, and
                                ``exit`` too where ``CI`` is set (a CI job); ``off``
``ASYNCCLCACHE_EXIT_BAKE_TIMEOUT`` seconds a bake at exit may take (default 600); the rest
                                stays unbaked, every entry whole
=============================== ===================================================
"""

from __future__ import annotations

import math
import os
import re
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

from ._flags import parse_bool
from .errors import RemovedStrategyWarning
from .ranks import TEST_NODE_ENV

__all__ = [
    "BAKE_MODES", "DEFAULT_NODE_MAX_BYTES", "RETIRED_STRATEGIES", "STRATEGIES", "Config", "absolute_path",
    "get_config", "parse_bool", "parse_size", "strategy_in_use",
]

STRATEGIES = ("auto", "kcache", "thread")
#: Strategies that are gone, with what to tell whoever still asks for one: ``auto`` serves instead.
RETIRED_STRATEGIES = {
    "process": ("its helper process compiled every program again; pocl's kernel cache (kcache) "
                "stores what it stored, compiling nothing, and `asyncclcache bake` makes binaries "
                "after the job. Where pocl's kernel cache is off, nothing is cached: "
                "`asyncclcache info` says what to do"),
    "sync": "it queried binaries in the caller's thread, for comparison only (the benchmarks' pyopencl column)",
}
_warned: set[str] = set()
_warned_lock = threading.Lock()


def strategy_in_use(name: str) -> str:
    """``name``, or ``auto`` for a strategy that is gone (:data:`RETIRED_STRATEGIES`), with one
    :class:`~asyncclcache.errors.RemovedStrategyWarning` per name and process. Thread-safe."""
    why = RETIRED_STRATEGIES.get(name)
    if why is None:
        return name
    with _warned_lock:
        first = name not in _warned
        _warned.add(name)
    if first:
        warnings.warn(f"asyncclcache: strategy {name!r} is gone: {why}; using auto instead",
                      RemovedStrategyWarning, stacklevel=3)
    return "auto"
BAKE_MODES = ("off", "idle", "exit", "auto")
#: ``ASYNCCLCACHE_BAKE`` where it is not set (docs/design.md, "Baking").
DEFAULT_BAKE = "auto"
#: Seconds a bake at exit may take (``ASYNCCLCACHE_EXIT_BAKE_TIMEOUT``): pyopencl's own
#: test_array.py and test_clmath.py (451 entries) baked at exit in 27-45 s on 2 cores.
DEFAULT_EXIT_BAKE_TIMEOUT = 600.0
#: ``auto`` bakes on idle cores from this many cores (CPUs this process may run on) up: one
#: core is never idle beside the process. On 2 cores a test suite's cold run baked 39 of its
#: 40 entries and ran in 0.90 of its time without a cache (bench ``suite``, issue 35).
AUTO_BAKE_CORES = 2
#: Default bound of a user's node-local copies on a node, every shared directory's
#: (``ASYNCCLCACHE_NODE_MAX_SIZE``; :mod:`.nodecopies`).
DEFAULT_NODE_MAX_BYTES = 2 << 30

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)
_SUFFIX = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: str | int | None) -> int | None:
    """Parse ``500M``, ``2G``, ``1024`` (bytes). ``None`` and ``0`` mean no limit (as in
    ccache), for ``ASYNCCLCACHE_MAX_SIZE``, ``Cache(max_size=)`` and ``prune --max-size`` alike."""
    if value is None:
        return None
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size: must be >= 0, got {value}")
        return value or None
    m = _SIZE_RE.match(value)
    if not m:
        raise ValueError(f"size: expected a number with an optional K/M/G/T suffix, got {value!r}")
    n = int(float(m.group(1)) * _SUFFIX[m.group(2).lower()])
    return n or None


def absolute_path(value: str | os.PathLike[str], name: str) -> str:
    """``value`` with ``~`` expanded and made absolute from the working directory now, once:
    a later ``chdir`` of the program (or a helper started in ``/``) must not move the cache.
    Raises ``ValueError`` naming the setting ``name`` where that cannot be done (``~user``
    of no user, no home directory, the working directory gone, a NUL byte)."""
    raw = os.fspath(value)
    if "\0" in raw:
        raise ValueError(f"{name}: {raw!r} holds a NUL byte")
    path = os.path.expanduser(raw)
    if (raw == "~" or raw.startswith("~" + os.sep)) and os.environ.get("HOME") == "":
        path = raw  # "" is no home: expanduser would make "~/x" "/x"
    if path.startswith("~"):  # os.path leaves what it cannot expand (pathlib raises RuntimeError)
        who = path[1:].split(os.sep, 1)[0]
        why = f"there is no user {who!r}" if who else "the home directory is not known (HOME)"
        raise ValueError(f"{name}: cannot expand {raw!r}: {why}")
    try:
        return os.path.abspath(path)
    except OSError as e:  # relative, and the working directory is gone
        raise ValueError(f"{name}: {raw!r} is relative and the working directory is gone "
                         f"({e.strerror or e})") from None


@dataclass(frozen=True)
class Config:
    """The environment's settings. Immutable; read once per process by :func:`get_config`."""

    directory: str | None = None
    disable: bool = False
    rank_local: bool | None = None
    node_copies: bool | None = None
    #: Each program compiled once a node (:mod:`.nodecompile`); ``None``: where a rank is detected.
    node_compile: bool | None = None
    node_dir: str | None = None
    node_max_size: int | None = DEFAULT_NODE_MAX_BYTES
    #: Test-only: a simulated node's name (:data:`.ranks.TEST_NODE_ENV`).
    test_node: str | None = None
    strategy: str = "auto"
    workers: int = 1
    failure_fatal: bool = False
    exit_timeout: float = 5.0
    max_size: int | None = None
    install: bool = False
    stats: bool = False
    bake: str = DEFAULT_BAKE
    #: A CI job runs this process (``CI`` set, as GitHub Actions, GitLab CI and others set it).
    ci: bool = False
    exit_bake_timeout: float = DEFAULT_EXIT_BAKE_TIMEOUT

    @classmethod
    def from_env(cls, env: dict[str, str] | os._Environ[str] | None = None) -> Config:
        """Parse the environment. Bad values raise ``ValueError`` naming the variable. Paths
        are expanded and made absolute here, once (:func:`absolute_path`)."""
        e = os.environ if env is None else env
        strategy = e.get("ASYNCCLCACHE_STRATEGY", "auto").strip().lower() or "auto"
        if strategy not in STRATEGIES and strategy not in RETIRED_STRATEGIES:  # retired: warned at use
            raise ValueError(f"ASYNCCLCACHE_STRATEGY: expected one of {STRATEGIES}, got {strategy!r}")
        workers = int(_number(e, "ASYNCCLCACHE_WORKERS", "1", int, "an integer"))
        if not 1 <= workers <= 256:
            raise ValueError(f"ASYNCCLCACHE_WORKERS: must be between 1 and 256, got {workers}")
        exit_timeout = _seconds(e, "ASYNCCLCACHE_EXIT_TIMEOUT", 5.0)
        bake = e.get("ASYNCCLCACHE_BAKE", DEFAULT_BAKE).strip().lower() or DEFAULT_BAKE
        if bake not in BAKE_MODES:
            raise ValueError(f"ASYNCCLCACHE_BAKE: expected one of {BAKE_MODES}, got {bake!r}")
        exit_bake_timeout = _seconds(e, "ASYNCCLCACHE_EXIT_BAKE_TIMEOUT", DEFAULT_EXIT_BAKE_TIMEOUT)
        try:
            max_size = parse_size(e.get("ASYNCCLCACHE_MAX_SIZE") or None)  # empty: unset
        except ValueError as err:
            raise ValueError(f"ASYNCCLCACHE_MAX_SIZE: {err}") from None
        try:
            raw = e.get("ASYNCCLCACHE_NODE_MAX_SIZE") or None  # empty: unset
            node_max_size = DEFAULT_NODE_MAX_BYTES if raw is None else parse_size(raw)
        except ValueError as err:
            raise ValueError(f"ASYNCCLCACHE_NODE_MAX_SIZE: {err}") from None
        return cls(
            directory=_path(e, "ASYNCCLCACHE_DIR"),
            node_copies=parse_bool(e.get("ASYNCCLCACHE_NODE_COPIES"), name="ASYNCCLCACHE_NODE_COPIES"),
            node_compile=parse_bool(e.get("ASYNCCLCACHE_NODE_COMPILE"), name="ASYNCCLCACHE_NODE_COMPILE"),
            node_dir=_path(e, "ASYNCCLCACHE_NODE_DIR"),
            node_max_size=node_max_size,
            test_node=(e.get(TEST_NODE_ENV) or "").strip() or None,
            disable=bool(parse_bool(e.get("ASYNCCLCACHE_DISABLE"), name="ASYNCCLCACHE_DISABLE")),
            rank_local=parse_bool(e.get("ASYNCCLCACHE_RANK_LOCAL"), name="ASYNCCLCACHE_RANK_LOCAL"),
            strategy=strategy,
            workers=workers,
            failure_fatal=bool(
                parse_bool(e.get("ASYNCCLCACHE_FAILURE_FATAL"), name="ASYNCCLCACHE_FAILURE_FATAL")
            ),
            exit_timeout=exit_timeout,
            max_size=max_size,
            install=bool(parse_bool(e.get("ASYNCCLCACHE_INSTALL"), name="ASYNCCLCACHE_INSTALL")),
            stats=bool(parse_bool(e.get("ASYNCCLCACHE_STATS"), name="ASYNCCLCACHE_STATS")),
            bake=bake,
            # Any value but an empty or false one: CI systems set "true", some "1" or "yes".
            ci=(e.get("CI") or "").strip().lower() not in ("", "0", "false", "no", "off"),
            exit_bake_timeout=exit_bake_timeout,
        )

    def bakes_idle(self, rank: int | None) -> bool:
        """Whether a cache bakes on idle cores here: ``idle``; ``auto`` but in one of a job's
        ranks (``rank``: they keep every core busy, one a core) and on fewer than
        :data:`AUTO_BAKE_CORES` cores."""
        if self.bake != "auto":
            return self.bake == "idle"
        from .system import usable_cores  # off the import path of a warm start

        return rank is None and usable_cores() >= AUTO_BAKE_CORES

    def bakes_at_exit(self, rank: int | None) -> bool:
        """Whether a cache bakes, when it closes, what it wrote or hit unbaked: ``exit``;
        ``auto`` in a CI job (``CI``), where the directory is saved after the run. Never in
        one of a job's ranks (``rank``), nor with a timeout of 0."""
        if rank is not None or self.exit_bake_timeout <= 0:
            return False
        return self.bake == "exit" or (self.bake == "auto" and self.ci)


def _path(env: Mapping[str, str], name: str) -> str | None:
    raw = env.get(name) or None  # empty: unset
    return None if raw is None else absolute_path(raw, name)


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    seconds = _number(env, name, str(default), float, "seconds")
    # nan compares false with everything: a wait bounded by it would never end.
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"{name}: expected a finite number of seconds >= 0, got {env.get(name)!r}")
    return seconds


def _number(env: Mapping[str, str], name: str, default: str, kind: type[float], what: str) -> float:
    raw = env.get(name, default) or default  # empty: unset
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{name}: expected {what}, got {raw!r}") from None


@lru_cache(maxsize=1)
def get_config() -> Config:
    """The process's settings, parsed on first use and then fixed (like ``PYOPENCL_NO_CACHE``)."""
    return Config.from_env()
