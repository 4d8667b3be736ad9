"""The ``asyncclcache`` command (also ``python -m asyncclcache``).

Exit codes: 0 success, 1 a check failed (``verify`` found bad entries), 2 usage
error or unusable directory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._version import __version__

__all__ = ["main"]

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2


def _human(n: float) -> str:
    for unit in ("B", "K", "M", "G", "T"):
        if abs(n) < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n}"


def _open_store(args: argparse.Namespace) -> Any:
    import warnings

    from .store import Store

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = Store(args.dir)
    if not store.enabled:
        msg = store.problem or "unusable"
        print(f"asyncclcache: cannot use cache directory {store.root}: {msg}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    for w in caught:
        print(f"asyncclcache: {w.message}", file=sys.stderr)
    return store


def _opencl_versions() -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        import pyopencl as cl

        out["pyopencl"] = cl.VERSION_TEXT
        out["platforms"] = [
            {"name": p.name, "version": p.version, "devices": [d.name for d in p.get_devices()]}
            for p in cl.get_platforms()
        ]
    except Exception as e:  # noqa: BLE001 - info must work without a driver
        out["opencl_error"] = f"{type(e).__name__}: {e}"
    return out


def cmd_info(args: argparse.Namespace) -> int:
    from .config import get_config
    from .keys import FORMAT_VERSION

    store = _open_store(args)
    entries = list(store.entries())
    cfg = get_config()
    devices: dict[str, int] = {}
    info: dict[str, Any] = {
        "directory": str(store.root),
        "rank_local": store.rank_local,
        "rank": store.rank,
        "format_version": FORMAT_VERSION,
        "entries": len(entries),
        "bytes": sum(e.size for e in entries),
        "max_size": cfg.max_size,
        "strategy": cfg.strategy,
        "asyncclcache": __version__,
        "devices_seen": devices,
    }
    info.update(_opencl_versions())
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
        return EXIT_OK
    print(f"asyncclcache {__version__}")
    print(f"  directory      {info['directory']}" + ("  (rank-local)" if store.rank_local else ""))
    print(f"  format         v{FORMAT_VERSION}")
    print(f"  entries        {info['entries']}  ({_human(info['bytes'])})")
    print(f"  max size       {_human(cfg.max_size) if cfg.max_size else 'unlimited'}")
    print(f"  strategy       {cfg.strategy}")
    if "pyopencl" in info:
        print(f"  pyopencl       {info['pyopencl']}")
    for p in info.get("platforms", []):
        print(f"  platform       {p['name']} ({p['version']})"[:80])
        for d in p["devices"]:
            print(f"    device       {d}"[:80])
    if "opencl_error" in info:
        print(f"  OpenCL         unavailable: {info['opencl_error']}"[:80])
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and docs)."""
    parser = argparse.ArgumentParser(
        prog="asyncclcache",
        description="Inspect and maintain the asyncclcache binary cache.",
        epilog="Exit codes: 0 ok, 1 check failed, 2 usage error or unusable directory.",
    )
    parser.add_argument("--version", action="version", version=f"asyncclcache {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--dir",
        type=Path,
        default=os.environ.get("ASYNCCLCACHE_DIR") or None,
        help="cache directory (default: $ASYNCCLCACHE_DIR or the user cache directory)",
    )
    common.add_argument("--json", action="store_true", help="machine-readable output")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("info", parents=[common], help="directory, entries, versions, limits")
    p.set_defaults(func=cmd_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``asyncclcache`` command; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    return int(args.func(args))
